"""README, as a new user meets it: every command of its first hour (its benchmarks and the longer ones: a
release check, `slow`), in order, in a fresh folder, on the built-in model, verbatim but for sizes (fewer iterations, prompts,
images, minutes), each succeeding, with the files the next command needs where the README says;
every GPU command and every command of the results table checked as far as a machine without a GPU
can (the preset and overrides validated by `branchdiff config`, the accelerate config found, the
options parsed); the README a manual (at most 200 lines, a result a line); `eval` of a run
reproducing the run's own final evaluation; `sample` file names that any prompt cannot break."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from branchdiff.cli import main

README = Path(__file__).parent.parent / "README.md"
# sizes added to every training command; and eager: the default run compiles, which from a cold Inductor cache adds
# ~47 s to this test (60 s against 13 for its first command) and the suite's 15 minutes cannot hold it. Inductor's
# rollouts against eager are the slow test in tests/test_compile.py; the refusal without a compiler is tested there.
SMALL_RUN = ["prompts.eval_seeds=1", "prompts.per_iteration=2", "model.compile=none"]


def section(title: str) -> str:
    """The README's text under `## title`, up to the next `## ` heading."""
    found = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", README.read_text(), flags=re.S | re.M)
    assert found, f"README has no section ## {title}"
    return found[1]


def code_lines(text: str) -> list[str]:
    """The non-empty lines of every ``` block in `text`, in order."""
    return [line for block in re.findall(r"^```\n(.*?)^```", text, flags=re.S | re.M) for line in block.splitlines() if line.strip()]


def use_commands() -> tuple[list[str], list[str]]:
    """The first hour's commands, and the longer benchmarks' (the section's two blocks)."""
    blocks = re.findall(r"^```\n(.*?)^```", section("The first hour"), flags=re.S | re.M)
    assert len(blocks) == 2, "the first hour: its commands, then the longer benchmarks"
    first_hour, benchmarks = ([line for line in block.splitlines() if line.strip()] for block in blocks)
    return first_hour, benchmarks


def smaller(words: list[str]) -> list[str]:
    """The same command with smaller sizes: iterations N → N // 10 within [2, 4] (2 when not given), two prompts per
    iteration, one evaluation image per prompt; benchmarks: one repeat, seed, prompt and image, two
    evaluations, 0.6 s of training per variant, the tree benchmark's chain and tree only; searches: 30 rows,
    benchmarked with two images' worth and one seed."""
    if words[:2] == ["bench", "curves"]:
        swapped = {"--minutes": "0.01", "--seeds": "1"}
        out = [swapped.get(words[i - 1], w) if i else w for i, w in enumerate(words)]
        return [*out, "--points", "2", "--eval-images", "1", "prompts.per_iteration=1"]
    if words[:2] == ["bench", "tree"]:
        return [*words, "--repeats", "1", "--variants", "chain,tree", "prompts.per_iteration=1"]
    if words[:2] == ["bench", "search"] or "--search" in words:
        swapped = {"--images": "2", "--seeds": "1", "--budget": "30"}
        return [swapped.get(words[i - 1], w) if i else w for i, w in enumerate(words)]
    if "train" not in words:
        return words
    out = [f"iterations={min(4, max(2, int(w.split('=')[1]) // 10))}" if w.startswith("iterations=") else w for w in words]
    if not any(w.startswith("iterations=") for w in out):
        out.append("iterations=2")
    return [*out, *SMALL_RUN]


def test_the_readme_commands_run_in_order(tmp_path, monkeypatch, capsys):
    """The first hour's commands but its benchmark (`bench tree`: with the longer ones, below)."""
    commands = use_commands()[0]
    assert len(commands) >= 12 and commands[0].split("#")[0].split() == ["branchdiff", "train"]
    _run_in_order([line for line in commands if not line.startswith("branchdiff bench ")], tmp_path, monkeypatch, capsys)
    for made in ("runs/tiny-mix-full/transformer/diffusion_pytorch_model.safetensors", "runs/tiny-mix-full/report.html", "samples", "eval.json",
                 "runs/tiny-chain/checkpoints", "runs/mine/transformer", "runs/two/transformer", "found/search.json", "again"):
        assert (tmp_path / made).exists(), made
    ignored = subprocess.run(["git", "-C", str(README.parent), "check-ignore", "--no-index", *made_paths()], capture_output=True, text=True)
    assert ignored.stdout.split() == made_paths(), ignored  # what the first hour writes is ignored by git


@pytest.mark.slow  # a release check: the benchmarks (5 to 40 minutes each at the README's sizes)
def test_the_readmes_benchmarks_run(tmp_path, monkeypatch, capsys):
    first_hour, longer = use_commands()
    commands = [line for line in first_hour if line.startswith("branchdiff bench ")] + longer
    assert len(commands) >= 4 and all(line.startswith("branchdiff bench ") for line in commands)
    _run_in_order(commands, tmp_path, monkeypatch, capsys)
    for made in ("bench.json", "curves/curves.md", "search/search.md", "curves-video/curves.md"):
        assert (tmp_path / made).exists(), made


def _run_in_order(commands: list[str], folder: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """Each command in `folder`, verbatim but for sizes (`smaller`), each succeeding and saying where its results are."""
    monkeypatch.chdir(folder)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for line in commands:
        words = shlex.split(line, comments=True)
        redirect = words[words.index(">") + 1] if ">" in words else None
        words = words[: words.index(">")] if redirect else words
        if words[0] == "accelerate":
            launch, program = words[: words.index("-m")], words[words.index("-m") + 2 :]
            port = ["--num_machines", "1", "--main_process_port", str(_free_port())]  # not a size: two tests may launch at once
            environment = {**os.environ, "OMP_NUM_THREADS": "1"}
            done = subprocess.run([str(Path(sys.executable).parent / "accelerate"), *launch[1:], *port, "-m", "branchdiff.cli",
                                   *smaller(program)], env=environment, capture_output=True, text=True, timeout=300)
            assert done.returncode == 0, (line, done.stderr[-3000:])
            assert "run folder: runs/two/" in done.stdout
            continue
        assert words[0] == "branchdiff", line
        capsys.readouterr()
        code = main(smaller(words[1:]))
        out, err = capsys.readouterr()
        assert code == 0, (line, err[-3000:])
        if redirect:
            Path(redirect).write_text(out)
        if words[1] == "train":  # training says where its results are
            assert re.search(r"^run folder: runs/[\w-]+/$", out, flags=re.M) and "  weights: runs/" in out and "  report: runs/" in out, out
        if words[1] == "bench":  # and a benchmark where it wrote
            assert out.splitlines()[-1].startswith("wrote "), out


def made_paths() -> list[str]:
    """The files and folders the first hour writes in the folder it runs in."""
    return ["runs/tiny-mix-full/", "samples/", "eval.json", "my.yaml", "bench.json", "found/", "again/", "curves/", "search/", "eval-tiny-mix-full/"]


def test_the_gpu_and_results_commands_are_valid(capsys):
    """The commands that need a GPU or an hour: their presets and overrides validate, their accelerate
    configs exist, their options parse; another tool's command (`hf auth login`) is a script installed
    beside this Python that takes it (its --help exits 0: `huggingface-cli login` was named, which
    huggingface_hub 1.0 removed)."""
    from branchdiff.cli.parser import build_parser

    lines = code_lines(section("Fine-tuning real models")) + re.findall(r"`(branchdiff [^`]+)`", section("Results on the built-in task (2 CPU cores)"))
    checked = 0
    for line in lines:
        words = shlex.split(line, comments=True)
        if words[0] == "accelerate":
            config = re.search(r"\$\(branchdiff accelerate-config ([\w-]+)\)", line)
            assert config and main(["accelerate-config", config[1]]) == 0, line
            words = ["branchdiff", *words[words.index("branchdiff.cli") + 1 :]]
        if words[0] == "pip":
            continue
        if words[0] != "branchdiff":
            script = Path(sys.executable).parent / words[0]
            assert script.is_file(), f"{line}: no {words[0]} is installed beside {sys.executable}"
            done = subprocess.run([str(script), *words[1:], "--help"], capture_output=True, text=True)
            assert done.returncode == 0, (line, done.stderr[-2000:])
            checked += 1
            continue
        if words[1] == "train":
            assert main(["config", *words[2:]]) == 0, line
        else:
            build_parser().parse_args(words[1:])
        checked += 1
    capsys.readouterr()
    assert checked >= 8


def test_the_readme_is_a_manual():
    """At most 200 lines, a result a line; what a new user tripped on: the set-up trained, so the first
    hour's first command found its folder taken; no times (and well over an hour); LoRA said where the
    default trains every weight; presets missing; nothing on the 6 GB CUDA build or on threads."""
    from branchdiff.settings.load import presets

    text = README.read_text()
    assert len(text.splitlines()) <= 200
    results = [line for line in section("Results on the built-in task (2 CPU cores)").splitlines() if line.startswith("| ")]
    assert len(results) >= 6 and max(len(line) for line in results) <= 300  # a result a line: figure, command, link
    assert not any("branchdiff" in line for line in code_lines(section("Set up")))  # the set-up installs and tests, nothing more
    first_hour = code_lines(section("The first hour"))[:12]
    minutes = [re.search(r"# (\d+) (s|min)\b", line) for line in first_hour if not line.startswith("branchdiff config")]
    assert all(minutes), first_hour  # every command that takes time says how long
    assert sum(int(m[1]) / (60 if m[2] == "s" else 1) for m in minutes) <= 60
    assert "RUN/transformer/" in text and all(f"`{name}`" in text for name in presets() if name.startswith(("tiny-", "branchgrpo")))
    assert "download.pytorch.org/whl/cpu" in text and "OMP_NUM_THREADS" in text


def test_the_cpu_set_up_is_a_whole_line():
    """Without a GPU the set-up is its own line to copy: the default line's venv and install with torch and
    torchvision from PyTorch's CPU index first, in one pip call, and `&&` between the steps, so that an
    unreachable index stops it. The CPU build was a bullet to splice into the default line; copied as
    written, the block installed the 6 GB CUDA build."""
    setup = code_lines(section("Set up"))
    default, cpu = setup[0], next((line for line in setup if "download.pytorch.org/whl/cpu" in line), "")
    assert shell_steps(cpu) == [*shell_steps(default)[:-1], "pip install torch torchvision --index-url https://download.pytorch.org/whl/cpu",
                                shell_steps(default)[-1]], cpu


def shell_steps(line: str) -> list[str]:
    """The commands of a shell line joined by `&&`, its comment left out."""
    return [step.strip() for step in line.split("#")[0].split("&&")]


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.parametrize("line", ["branchdiff train tiny-chain iterations=20 seed=1", "branchdiff bench curves --minutes 2 --seeds 3"])
def test_only_sizes_change(line):
    before, after = shlex.split(line)[1:], smaller(shlex.split(line)[1:])
    sizes = [w for w in before if re.match(r"(iterations=|\d)", w)]
    assert [w for w in after if w not in sizes and w in before] == [w for w in before if w not in sizes]  # other words stay as written


def test_eval_of_a_run_reproduces_its_final_evaluation(tiny_model_dir, tmp_path, capsys):
    """`branchdiff eval --lora RUN/lora` takes the run's settings and prints the trained column of
    the run's final evaluation exactly; an option given that differs is named (before, eval's own
    defaults, 4 images per prompt, gave another number for the same LoRA without saying why)."""
    import json

    run = tmp_path / "run"
    assert main(["train", "tiny-chain", f"model.path={tiny_model_dir}", f"output_dir={run}", "iterations=2", "prompts.per_iteration=2",
                 "tree.roots=3", "sampling.num_steps=3", "prompts.eval_seeds=2", "model.finetune=lora", "train.learning_rate=0.05", "logging.report_to=none"]) == 0
    trained = json.loads((run / "eval.json").read_text())["trained"]["all"]
    capsys.readouterr()
    assert main(["eval", "--lora", str(run / "lora"), "--json", str(tmp_path / "again.json"), "--out", str(tmp_path / "again")]) == 0
    err = capsys.readouterr().err
    assert f"eval: the settings not given on the command line are the run's, from {run / 'config.yaml'}, as in the run's final evaluation" in err
    again = json.loads((tmp_path / "again.json").read_text())
    assert again["images_per_prompt"] == 2 and again["steps"] == 3
    assert {k: v["mean"] for k, v in again["summary"]["all"].items()} == {k: v["mean"] for k, v in trained.items()}
    assert main(["eval", "--lora", str(run / "lora"), "--images-per-prompt", "1", "--out", str(tmp_path / "other")]) == 0
    assert "these differ from the run's final evaluation: images per prompt 1 (run: 2)" in capsys.readouterr().err


def test_sample_file_names_are_safe_whatever_the_prompt(tiny_model_dir, tmp_path, capsys):
    """A prompt's text named the file: '/' made folders (or escaped --out), a NUL or a 300-character
    prompt broke the name."""
    from branchdiff.cli.common import file_name

    prompts = ["two red circles on the left", "../../etc/passwd", "a/b: c?*|<x>", "x" * 300, "\n", "café ☕"]
    assert main(["sample", "--model", str(tiny_model_dir), *(f"--prompt={p}" for p in prompts), "--out", str(tmp_path / "out"),
                 "--steps", "1", "--images-per-prompt", "1"]) == 0
    written = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert written == sorted(file_name(i, p) for i, p in enumerate(prompts)) and len(written) == len(prompts)
    assert [p for p in tmp_path.rglob("*") if p.is_file() and p.parent != tmp_path / "out"] == []
    assert all(re.fullmatch(r"\d{3}-[A-Za-z0-9_-]{1,60}\.png", name) for name in written)
    assert file_name(0, "two red circles on the left") == "000-two_red_circles_on_the_left.png"
    assert file_name(1, "../../etc/passwd") == "001-etc_passwd.png" and file_name(4, "\n") == "004-prompt.png"


def test_train_help_lists_every_preset_and_the_debug_switch(capsys):
    from branchdiff.settings.load import PRESET_DIR, presets

    with pytest.raises(SystemExit) as done:
        main(["train", "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert all(re.search(rf"^  {re.escape(name)} +\S", out, flags=re.M) for name in presets()) and len(presets()) >= 17
    assert "--debug" in out and "docs/errors.md" in out
    for name in presets():  # each preset's summary, whole (descriptions were cut at 90 characters, mid-word)
        summary = (PRESET_DIR / f"{name}.yaml").read_text().splitlines()[0].lstrip("# ")
        assert len(summary) <= 80 and re.search(rf"^  {re.escape(name)} +{re.escape(summary)}$", out, flags=re.M), name
    # what the default trains: every weight of the tiny model, not LoRA (the epilogue said LoRA)
    assert "the tiny presets fine-tune every weight of the built-in model (exported to RUN/transformer/)" in out
