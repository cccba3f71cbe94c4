"""The house's checks, run with the suite (and by pre-commit, .pre-commit-config.yaml): import-linter's
contracts (the layers' order, models / rewards / schedulers never importing training, no import
circle anywhere), ruff's lint and import order on the whole tree, and mypy on the typed layers (`files` of
pyproject.toml's [tool.mypy]: training, objectives, settings, core, models, schedulers, data, runtime, errors); and
proof that the contracts bite: a copy of the package with one upward import, or one circle inside a
layer, breaks them."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _tool(name: str, *args: str, cwd: Path = REPO, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """ruff and mypy through this Python (`python -m`), lint-imports by its script beside it."""
    if name == "lint-imports":
        script = BIN / name if (BIN / name).exists() else shutil.which(name)
        if script is None:
            pytest.fail("lint-imports is not installed: pip install -e '.[test]'")
        command = [str(script)]
    else:
        command = [sys.executable, "-m", name]
    return subprocess.run([*command, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_the_import_contracts_hold():
    done = _tool("lint-imports", "--no-cache")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "Contracts: 3 kept, 0 broken." in done.stdout


def test_ruff_is_clean():
    done = _tool("ruff", "check", ".")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]


def test_mypy_is_clean_on_the_typed_layers():
    done = _tool("mypy", "--cache-dir", os.devnull)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]


@pytest.mark.parametrize("importer, line, broken", [
    ("core/tree.py", "import branchdiff.cli.main", "Layers: each imports only the layers below it BROKEN"),
    ("models/lora.py", "import branchdiff.training.recipe", "Models, rewards and schedulers never import training, objectives or the command"),
    ("core/noise.py", "import branchdiff.core.tree", "No import circles, inside a layer either BROKEN"),  # core.tree imports core.noise
])
def test_a_wrong_import_breaks_a_contract(tmp_path, importer, line, broken):
    copy = tmp_path / "copy"
    shutil.copytree(REPO / "branchdiff", copy / "branchdiff", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", copy / "pyproject.toml")
    module = copy / "branchdiff" / importer
    module.write_text(module.read_text().replace("from __future__ import annotations\n", f"from __future__ import annotations\n\n{line}\n", 1))
    done = _tool("lint-imports", "--no-cache", cwd=copy, env={**os.environ, "PYTHONPATH": str(copy)})
    shown = re.sub(r"\x1b\[[0-9;]*m", "", done.stdout)  # import-linter colours its report whether or not it is a terminal
    assert done.returncode != 0 and broken in shown, shown[-3000:]


def test_the_layer_map_is_the_contract_and_covers_the_package():
    """CONTRIBUTING.md's table of layers, top to bottom, is import-linter's layers contract, and every module
    and folder of the package is in it (`plan/` and `testing.py` were in neither map)."""
    import tomllib

    contract = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"][0]["layers"]
    layers = [sorted(part.strip().removeprefix("branchdiff.") for part in row.split("|")) for row in contract]
    house = (REPO / "CONTRIBUTING.md").read_text().split("## The house", 1)[1].split("\n## ", 1)[0]
    rows = [re.findall(r"`([a-z_]+)(?:/|\.py)`", line.split("|")[1]) for line in house.splitlines() if line.startswith("| `")]
    assert [sorted(row) for row in rows] == layers
    package = {p.stem for p in (REPO / "branchdiff").iterdir() if (p.is_dir() and (p / "__init__.py").exists()) or p.suffix == ".py"}
    assert package - {"__init__"} == {name for row in layers for name in row}
