"""Every option of every command, fuzzed (hypothesis): the values a new user types by mistake — out of range,
NaN, negative, huge, the wrong type, empty, unicode, paths that are files, folders, missing, unwritable or
inside a file — and, for `train`, `config`, `plan` and `bench`, every key of the run's settings as an override.

Whatever is drawn, a command either accepts it or refuses it with one line: exit status 0 or 2, never a
traceback, at most a few lines on stderr, and on a refusal nothing created or changed in the folders it was
pointed at. A command that accepts its input is stopped where its work would begin (a model or reward server
loading, a trainer built, a benchmark, server or upload started: `ReachedWork`), so an example costs
milliseconds and what is checked is everything done before the work.

The suite runs a fixed set of examples per command (seconds, the same ones every run); BRANCHDIFF_FUZZ_EXAMPLES=N
draws N random ones per command instead.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from dataclasses import fields, is_dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from branchdiff.cli import main
from branchdiff.cli.parser import build_parser

EXAMPLES = int(os.environ.get("BRANCHDIFF_FUZZ_EXAMPLES", "0"))
FUZZ = settings(max_examples=EXAMPLES or 40, derandomize=not EXAMPLES, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
ALSO_ALLOWED = {"plan": (1,)}  # a plan that does not fit the GPU (docs/plan.md)
MAX_ERROR_LINES = 3  # a refusal: its one line, and at most a notice or two before it


class ReachedWork(BaseException):
    """Raised where a command's work would begin: everything before it accepted the input (not an Exception, so
    no `except Exception` on the way turns it into an error)."""


def _reached(*args, **kwargs):
    raise ReachedWork


def _restore_imported_copies(originals: dict[str, object]) -> None:
    """Put the real functions back into every module that imported a patched one by name while it was patched
    (`from ... import build_component` in a module a command imported first under the patch); monkeypatch only
    undoes the attributes it set."""
    for module in [module for name, module in sys.modules.items() if name.startswith("branchdiff")]:
        for name, value in list(vars(module).items()):
            if value is _reached:
                setattr(module, name, originals[name])


@pytest.fixture
def no_work(monkeypatch):
    """Every place a command starts its work raises `ReachedWork`."""
    import branchdiff.bench.curves
    import branchdiff.bench.hacking
    import branchdiff.bench.iteration
    import branchdiff.bench.overlap
    import branchdiff.bench.proxies
    import branchdiff.bench.reward_server
    import branchdiff.bench.sampler
    import branchdiff.bench.search
    import branchdiff.models
    import branchdiff.rewards.multi
    import branchdiff.rewards.registry
    import branchdiff.rewards.server
    import branchdiff.training.recipe

    monkeypatch.setattr(branchdiff.training.recipe.Trainer, "__init__", _reached)
    originals: dict[str, object] = {}
    for module, name in ((branchdiff.models, "load_adapter"), (branchdiff.rewards.registry, "build_reward"),
                         (branchdiff.rewards.multi, "build_component"), (branchdiff.rewards.server, "serve"),
                         (branchdiff.bench.iteration, "bench_tree"), (branchdiff.bench.iteration, "bench_explore"),
                         (branchdiff.bench.curves, "bench_curves"), (branchdiff.bench.search, "bench_search"),
                         (branchdiff.bench.sampler, "bench_sampler"), (branchdiff.bench.reward_server, "bench_reward_server"),
                         (branchdiff.bench.overlap, "bench_overlap"), (branchdiff.bench.proxies, "build_proxies"),
                         (branchdiff.bench.hacking, "bench_hacking")):
        originals[name] = getattr(module, name)
        monkeypatch.setattr(module, name, _reached)
    monkeypatch.setattr("huggingface_hub.HfApi.create_repo", _reached)
    monkeypatch.setattr("huggingface_hub.HfApi.upload_folder", _reached)
    yield
    _restore_imported_copies(originals)


class Workspace:
    """Fresh per example: a folder holding a file, a folder, a run folder, a prompt file, and paths of every kind."""

    def __init__(self, run: Path) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="fuzz-"))
        (self.root / "a-file").write_text("not a folder\n")
        (self.root / "a-folder").mkdir()
        (self.root / "prompts.txt").write_text("one red circle on the left\ntwo blue squares at the top\n")
        shutil.copytree(run, self.root / "run", copy_function=os.link)  # links: the run's files are replaced whole (renamed), never written in place
        self.paths = {"file": self.root / "a-file", "folder": self.root / "a-folder", "missing": self.root / "missing" / "deeper",
                      "inside-a-file": self.root / "a-file" / "out", "unwritable": Path("/sys/branchdiff-fuzz"), "run": self.root / "run",
                      "prompts": self.root / "prompts.txt", "new": self.root / "new-run"}

    def snapshot(self) -> dict[str, bytes | None]:
        return {str(p.relative_to(self.root)): p.read_bytes() if p.is_file() else None for p in sorted(self.root.rglob("*"))}

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


NUMBERS = ["-1", "0", "1", "2", "0.5", "5", "1e308", "-1e308", "nan", "inf", "-inf", "10000000000000000000000", "1.5e-320"]
TEXTS = ["", " ", "x", "ü文字🙂", "x" * 300, "-", "--", "a=b", "[1, 2", "{a: 1}", "[sd3]", "null", "http://127.0.0.1:9/", "\x00", "tiny:nope", "tiny:held_out"]
PATH_KINDS = ["file", "folder", "missing", "inside-a-file", "unwritable", "run", "prompts"]


def value(draw: st.DrawFn, space: Workspace, kind: str = "any") -> str:
    """One mistaken (or fine) value; mostly of the `kind` expected ("number", "path", "text"), sometimes of another."""
    if kind == "any" or draw(st.integers(0, 4)) == 0:
        kind = draw(st.sampled_from(["number", "text", "path"]))
    if kind == "path":
        return str(space.paths[draw(st.sampled_from(PATH_KINDS))])
    return draw(st.sampled_from(NUMBERS if kind == "number" else TEXTS))


NUMERIC_TYPES = ("int", "float", "whole", "finite", "positive", "non_negative", "image_size", "fraction", "port")


def expected(action: argparse.Action) -> str:
    """What an option takes: a number, a path, or text."""
    name = getattr(action.type, "__name__", "")
    if name in NUMERIC_TYPES:
        return "number"
    if action.type is Path or any(word in action.dest for word in ("path", "out", "json", "file", "dir", "model", "weights", "image", "trace")):
        return "path"
    return "text"


def _commands() -> dict[str, argparse.ArgumentParser]:
    """Each command's parser by name (`rewards check` and `rewards list` as two)."""
    parser = build_parser()
    found = {}
    for action in parser._subparsers._group_actions:  # argparse's only handle on its subcommands
        for name, sub in action.choices.items():
            nested = [a for a in sub._actions if isinstance(a, argparse._SubParsersAction)]
            if nested:
                found.update({f"{name} {inner}": parser for inner, parser in nested[0].choices.items()})
            else:
                found[name] = sub
    return found


COMMANDS = _commands()


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and a.dest not in ("help", "debug")]


def _keys(section: object, prefix: str = "") -> dict[str, str]:
    """Every dotted key of the run's settings, with what it takes (a number, a path, or text)."""
    from branchdiff.settings.config import TrainConfig

    section = section or TrainConfig()
    keys = {}
    for item in fields(section):
        inner = getattr(section, item.name)
        if item.metadata.get("sections"):  # the objectives' sections (nft.*, awm.*, ...), each its own dataclass
            for name, keys_of in inner.items():
                keys.update(_keys(keys_of, f"{name}."))
        elif is_dataclass(inner):
            keys.update(_keys(inner, f"{prefix}{item.name}."))
        else:
            numeric = any(word in str(item.type) for word in ("int", "float"))
            keys[f"{prefix}{item.name}"] = "number" if numeric else "path" if item.name in ("path", "output_dir", "train", "eval") else "text"
    return keys


KEYS = _keys(None)
POSITIONAL = {  # what a command's positional arguments are drawn from, beyond the mistaken values
    "train": ["tiny-chain", "tiny-mix", "sd35-pickscore", "wan-mq-branch", "tiny-chainn"], "config": ["tiny-chain", "flux-hps-branch", "nope"],
    "plan": ["tiny-chain", "tiny-mix-full", "nope"], "report": [], "push": [], "serve-reward": ["tiny-geneval", "hpsv2.1", "nope", "my.mod:Reward"],
    "rewards check": ["tiny-geneval", "pickscore", "nope"], "accelerate-config": ["multi-gpu", "fsdp", "nope"],
}


@st.composite
def command_line(draw: st.DrawFn, name: str, space: Workspace) -> list[str]:
    """`name`'s command line: its positional argument(s), up to three options, and (where it takes them) overrides."""
    parser = COMMANDS[name]
    argv = name.split()
    positionals = [a for a in parser._actions if not a.option_strings and a.dest not in ("overrides", "command")]
    for _ in positionals:
        pool = POSITIONAL.get(name, [])
        argv.append(draw(st.sampled_from(pool)) if pool and draw(st.booleans()) else value(draw, space))
    for action in draw(st.lists(st.sampled_from(_options(parser)), max_size=3, unique_by=lambda a: a.dest)) if _options(parser) else []:
        flag = draw(st.sampled_from(action.option_strings))
        if action.nargs == 0:
            argv.append(flag)
        elif action.choices is not None and draw(st.booleans()):
            argv += [flag, str(draw(st.sampled_from(list(action.choices))))]
        else:
            argv += [flag, value(draw, space, expected(action))]
    if any(a.dest == "overrides" for a in parser._actions):
        if name == "train":
            argv.append(f"output_dir={space.paths[draw(st.sampled_from(['new', 'run', 'missing', 'inside-a-file', 'unwritable', 'file']))]}")
        for _ in range(draw(st.integers(0, 2))):
            key = draw(st.sampled_from(sorted(KEYS)))
            argv.append(f"{key}={value(draw, space, KEYS[key])}")
    return argv


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, tiny_model_dir) -> Path:
    run = tmp_path_factory.mktemp("fuzz-run") / "run"
    assert main(["train", "tiny-chain", f"model.path={tiny_model_dir}", f"output_dir={run}", "iterations=1", "prompts.per_iteration=2",
                 "tree.roots=2", "sampling.num_steps=2", "final_eval=false", "logging.report_to=none", "logging.sample_every=0"]) == 0
    return run


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_any_input_to_any_command_is_accepted_or_refused_in_one_line(name, no_work, finished_run, capsys):
    @FUZZ
    @given(st.data())
    def example(data: st.DataObject) -> None:
        space = Workspace(finished_run)
        here = os.getcwd()
        os.chdir(space.root)  # a relative path drawn ("1", "-") lands in the workspace
        try:
            argv = data.draw(command_line(name, space), label="argv")
            before = space.snapshot()
            try:
                code = main(argv)
            except ReachedWork:
                code = None
            except SystemExit as stopped:  # --help, --version
                code = stopped.code
            err = capsys.readouterr().err
            assert "Traceback" not in err, err
            assert code in (None, 0, 2, *ALSO_ALLOWED.get(name, ())), (code, err)
            if code == 2:
                lines = [line for line in err.replace("\r", "\n").splitlines() if line.strip()]
                assert 1 <= len(lines) <= MAX_ERROR_LINES and lines[-1].startswith("branchdiff: error: "), err
                assert space.snapshot() == before, "a refused command changed its folders"
        finally:
            os.chdir(here)
            space.remove()

    example()


SHAPES = ["[sd3, 1]", "{a: 1}", "-"]  # YAML reads a list, a mapping, and a list of one null


@pytest.mark.parametrize("shape", SHAPES)
def test_every_key_takes_a_list_or_a_mapping_or_refuses_it_in_one_line(shape, capsys):
    """Every key with a value YAML reads as a list or a mapping, through `config` with no preset (the path that chose the
    default preset: `model.family=[sd3]` was `TypeError: unhashable type: 'list'`, which the draws above reached only
    sometimes): accepted, or one line."""
    for key in sorted(KEYS):
        code = main(["config", "", f"{key}={shape}"])
        captured = capsys.readouterr()
        assert "Traceback" not in captured.err and code in (0, 2), (key, code, captured.err)
        if code == 2:
            lines = [line for line in captured.err.splitlines() if line.strip()]
            assert len(lines) == 1 and lines[0].startswith("branchdiff: error: "), (key, captured.err)
