"""One convention for the four registries — families, rewards, objectives, searches (branchdiff/runtime/registry.py):
built-ins by name in each folder's registry.py, installed packages' entry points beside them, an installed name that
is a built-in's or another package's refused naming both sources, and every built-in name with its row in the
kind's docs page. Packages are installed for a test by a dist-info folder on sys.path, as pip leaves one."""

from __future__ import annotations

from pathlib import Path

import pytest

from branchdiff.models.registry import FAMILY_REGISTRY
from branchdiff.objectives.registry import OBJECTIVES
from branchdiff.rewards.registry import REWARDS, available, resolve_reward
from branchdiff.runtime.registry import Registry
from branchdiff.search.registry import SEARCHES, make_search

DOCS = Path(__file__).resolve().parents[1] / "docs"
KINDS: dict[str, tuple[Registry, str, str]] = {  # kind → (registry, a built-in name, its docs page)
    "family": (FAMILY_REGISTRY, "sd3", "models.md"), "reward": (REWARDS, "tiny-geneval", "rewards.md"),
    "objective": (OBJECTIVES, "grpo", "objectives.md"), "search": (SEARCHES, "dts", "search.md"),
}


@pytest.fixture
def site(tmp_path, monkeypatch) -> Path:
    """A folder on sys.path where `install` puts packages."""
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def install(site: Path, package: str, group: str, lines: list[str], module: str = "") -> None:
    """A distribution `package` whose entry points of `group` are `lines` ("name = module:attribute"), with `module`'s source."""
    dist = site / f"{package.replace('-', '_')}-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package}\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[{group}]\n" + "\n".join(lines) + "\n")
    if module:
        (site / f"{package.replace('-', '_')}.py").write_text(module)


@pytest.mark.parametrize("kind", list(KINDS))
def test_an_installed_name_of_a_built_in_is_refused_naming_both(site, kind):
    registry, builtin, _ = KINDS[kind]
    install(site, "clash-pkg", registry.group, [f"{builtin} = clash_pkg:THING"])
    assert builtin not in registry.installed and registry.names().count(builtin) == 1
    why = registry.refused[builtin]
    assert why.startswith(f"clash_pkg:THING (package clash-pkg): the name of the built-in {kind} {builtin!r}") and why.endswith("rename the entry point")


@pytest.mark.parametrize("kind", list(KINDS))
def test_one_name_from_two_packages_is_left_to_neither(site, kind):
    registry = KINDS[kind][0]
    install(site, "one-pkg", registry.group, ["shared-name = one_pkg:A"])
    install(site, "two-pkg", registry.group, ["shared-name = two_pkg:B"])
    assert "shared-name" not in registry and "shared-name" not in registry.names()
    why = registry.refused["shared-name"]
    assert "one_pkg:A (package one-pkg)" in why and "two_pkg:B (package two-pkg)" in why and "two installed packages register this name" in why


def test_an_installed_search_is_built_by_name(site):
    install(site, "more-searches", SEARCHES.group, ["greedy = more_searches:Greedy"],
            "class Greedy:\n    def __init__(self, depth=1):\n        self.depth = depth\n")
    assert "greedy" in SEARCHES and SEARCHES.names()[-1] == "greedy"
    assert make_search("greedy", depth=3).depth == 3
    assert SEARCHES.describe("greedy") == "'greedy' (entry point more_searches:Greedy of package more-searches)"


def test_a_reward_plugin_named_like_a_built_in_is_listed_as_not_used_and_the_built_in_kept(site):
    """It was silently shadowed by the built-in and then listed twice, as the built-in and as an entry point."""
    install(site, "shadow-rewards", REWARDS.group, ["tiny-geneval = shadow_rewards:Fake"], "class Fake:\n    pass\n")
    rows = [row for row in available() if row["name"] == "tiny-geneval"]
    assert [(row["source"], row["status"]) for row in rows] == [("built-in", "ready"), ("entry point", "not used")]
    assert "shadow_rewards:Fake (package shadow-rewards): the name of the built-in reward 'tiny-geneval'" in rows[1]["note"]
    assert resolve_reward("tiny-geneval").__name__ == "TinyGenEval"


def test_a_reward_two_packages_register_is_refused_with_both_named(site):
    install(site, "one-pkg", REWARDS.group, ["sharp = one_pkg:Sharp"])
    install(site, "two-pkg", REWARDS.group, ["sharp = two_pkg:Sharp"])
    with pytest.raises(ValueError, match=r"reward 'sharp' cannot be used: .*two installed packages register this name"):
        resolve_reward("sharp")


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_built_in_name_has_its_row_in_the_docs(kind):
    """A table row of the kind's page whose first cell names it in backticks."""
    registry, _, page = KINDS[kind]
    first_cells = [line.split("|")[1] for line in (DOCS / page).read_text().splitlines() if line.startswith("| ")]
    missing = [name for name in registry.builtins if not any(f"`{name}`" in cell for cell in first_cells)]
    assert not missing, f"docs/{page} has no row for {missing}"


def test_rewards_list_says_what_a_reward_still_needs(monkeypatch):
    """A reward whose package is installed but fails to import is `broken`, not `ready`; one that needs settings says which
    (it was `ready` for videoalign without its folder). Every built-in's required settings include those its class
    takes without a default."""
    import importlib
    import inspect

    from branchdiff.rewards.registry import BUILT_IN

    real_import = importlib.import_module

    def failing(name, *args):
        if name == "rapidocr_onnxruntime":
            raise ImportError("libGL.so.1: cannot open shared object file")
        return real_import(name, *args)

    monkeypatch.setattr(importlib, "import_module", failing)
    rows = {row["name"]: row for row in available() if row["source"] == "built-in"}
    assert rows["ocr"]["status"] == "broken rapidocr_onnxruntime" and "libGL.so.1" in rows["ocr"]["note"]
    assert rows["videoalign"]["status"] == "needs kwargs path" and rows["vlm-judge"]["status"] == "needs kwargs url, model"
    assert rows["group-rank"]["status"] == "needs kwargs reward" and rows["tiny-geneval"]["status"] == "ready"
    monkeypatch.undo()
    for name, registered in BUILT_IN.items():
        parameters = inspect.signature(resolve_reward(name)).parameters.values() if name != "imagereward" else []
        without_default = {p.name for p in parameters if p.default is inspect.Parameter.empty and p.kind is p.POSITIONAL_OR_KEYWORD}
        assert without_default <= set(registered.required), (name, without_default)


def test_the_readme_names_every_objective():
    """README's Concepts: each built-in `train.loss`, in backticks, in its Objectives entry (it named four of eleven)."""
    from branchdiff.objectives.registry import OBJECTIVES

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    entry = readme[readme.index("- **Objectives**"):readme.index("- **Rewards**")]
    assert all(f"`{name}`" in entry for name in OBJECTIVES.builtins) and "advantage.baseline: median" in entry


PLUGIN_OBJECTIVE = '''
from dataclasses import dataclass

from branchdiff.objectives.grpo import ClippedGRPO
from branchdiff.settings.typed_yaml import choice, positive


@dataclass
class ScaledKeys:
    factor: float = positive(1.0)  # multiplies every advantage
    mode: str = choice("on", "on", "off")


class ScaledGRPO(ClippedGRPO):
    keys = ScaledKeys

    def signal(self, rollout, rewards, iteration):
        signal = super().signal(rollout, rewards, iteration)
        signal.node_advantages.mul_(self.config.scaled.factor)
        return signal
'''


PLUGIN_SCRIPT = """
import contextlib, io, json, sys
from branchdiff.cli import main
from branchdiff.settings.load import load_config

config = load_config("tiny-chain", ["train.loss=scaled", "scaled.factor=0.5"])
out = {"factor": config.scaled.factor, "mode": config.scaled.mode, "nft_beta": config.nft.beta, "runs": []}
printed = io.StringIO()
with contextlib.redirect_stdout(printed):
    main(["config", "tiny-chain", "train.loss=scaled", "scaled.factor=2"])
out["config"] = printed.getvalue()
common = ["train", "tiny-chain", "train.loss=scaled", "output_dir=" + sys.argv[1], "iterations=1", "prompts.per_iteration=2",
          "final_eval=false", "logging.report_to=none", "logging.sample_every=0"]
for extra in sys.argv[2:]:
    error = io.StringIO()
    with contextlib.redirect_stderr(error), contextlib.redirect_stdout(io.StringIO()):
        code = main([*common, *extra.split()])
    lines = [line for line in error.getvalue().splitlines() if line.startswith("branchdiff")]
    out["runs"].append([code, lines])
print(json.dumps(out))
"""


def test_an_installed_objective_brings_its_own_keys_read_and_checked_like_the_built_ins(site, tmp_path):
    """Its class's `keys` dataclass is read from the section of its name: set from the command line, printed by
    `branchdiff config`, checked key by key (one line for a bad value, before anything is written), and it trains.
    In a fresh process, as a user's (the settings read the installed objectives when they are imported)."""
    import json
    import os
    import subprocess
    import sys

    from branchdiff.objectives.registry import OBJECTIVES

    install(site, "scaled-objective", OBJECTIVES.group, ["scaled = scaled_objective:ScaledGRPO"], PLUGIN_OBJECTIVE)
    bad = {"scaled.factor=abc": "'scaled.factor' = 'abc' has the wrong type; expected float",
           "scaled.factor=-1": "'scaled.factor' = -1 is out of range; it must be > 0",
           "scaled.mode=maybe": "'scaled.mode' = 'maybe' is not allowed; allowed: on, off",
           "scaled.facter=2": "unknown key 'scaled.facter'; did you mean scaled.factor?",
           # its keys on a run of another objective did nothing, in silence
           "train.loss=grpo scaled.factor=2": "'scaled.factor' = 2 is a key of train.loss=scaled, and this run trains train.loss=grpo, which never "
                                              "reads it; remove it (or set train.loss=scaled)"}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", PLUGIN_SCRIPT, str(tmp_path / "run"), *bad, "scaled.factor=0.5"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.splitlines()[-1])
    assert (out["factor"], out["mode"], out["nft_beta"]) == (0.5, "on", 1.0)
    assert "scaled:\n  factor: 2\n  mode: 'on'\nexplore:" in out["config"]  # beside the built-ins' sections
    for (code, lines), words in zip(out["runs"], bad.values()):
        assert code == 2 and len(lines) == 1 and words in lines[0], lines
    assert out["runs"][-1] == [0, []] and (tmp_path / "run" / "metrics.jsonl").is_file()
