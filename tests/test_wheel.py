"""A wheel of the repository works anywhere: it ships the built-in model, installs rewards/ and
schedulers/ only inside `branchdiff`, and `branchdiff train` / `eval` run from a fresh venv outside
the source tree (the dependencies of this environment are made visible to it, not reinstalled)."""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import zipfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NOT_SOURCE = shutil.ignore_patterns(".git", ".venv", "venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", "runs",
                                    ".ruff_cache", ".mypy_cache", ".hypothesis", ".import_linter_cache", ".whl")


def run(args: list[str | Path], cwd: Path, env: dict[str, str] | None = None) -> str:
    """Run a command; fail with its output unless it exits 0; its stdout."""
    result = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{args} exited {result.returncode}\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    return result.stdout


def build_isolation_flags() -> list[str]:
    """Build with this environment's setuptools when it meets the build requirement (no download)."""
    try:
        major = int(version("setuptools").split(".")[0])
    except PackageNotFoundError:
        return []
    return ["--no-build-isolation"] if major >= 68 else []


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wheel built from a copy of the source tree (keeps build/ and *.egg-info out of the repo,
    and stale build/lib files out of the wheel)."""
    root = tmp_path_factory.mktemp("wheel")
    shutil.copytree(REPO, root / "src", ignore=NOT_SOURCE)
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", *build_isolation_flags(), "-w", root / "dist", root / "src"], root)
    (path,) = (root / "dist").glob("branchdiff_rl-*.whl")
    return path


def test_wheel_contents(wheel: Path) -> None:
    """rewards/ and schedulers/ only inside `branchdiff`; every file of assets/tiny and assets/tiny-video in `branchdiff.assets`;
    every module of every subpackage of branchdiff/ (a package left out of pyproject's list is missing)."""
    names = set(zipfile.ZipFile(wheel).namelist())
    assert not [n for n in names if n.startswith(("rewards/", "schedulers/"))]
    assert {"branchdiff/rewards/registry.py", "branchdiff/schedulers/flow.py"} <= names
    model_files = [p.relative_to(REPO / "assets").as_posix() for name in ("tiny", "tiny-video")
                   for p in (REPO / "assets" / name).rglob("*") if p.is_file()]
    assert {"tiny/transformer/config.json", "tiny-video/transformer/config.json"} <= set(model_files)
    assert not [f for f in model_files if f"branchdiff/assets/{f}" not in names]
    modules = [p.relative_to(REPO).as_posix() for p in (REPO / "branchdiff").rglob("*.py")]
    assert "branchdiff/search/dts.py" in modules and not [m for m in modules if m not in names]


@pytest.mark.slow  # a release check (the installed wheel end to end, 19 s); its contents are checked above on every run
def test_wheel_trains_and_evaluates_outside_the_source_tree(wheel: Path, tmp_path: Path) -> None:
    """A fresh venv holding only the wheel (plus this environment's dependencies on its path) trains and
    evaluates the built-in model from a directory that is not the source tree."""
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", venv], tmp_path)
    python = venv / "bin" / "python"
    run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", "-q", wheel], tmp_path)
    purelib = Path(run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp_path).strip())
    # Lines of a .pth only extend sys.path: the .pth files there (this environment's editable finder) stay unprocessed.
    (purelib / "host_site_packages.pth").write_text("".join(f"{p}\n" for p in site.getsitepackages()))

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "BRANCHDIFF_TINY_MODEL")}
    env["HF_HUB_OFFLINE"] = "1"
    work = tmp_path / "work"
    work.mkdir()
    where = run([python, "-c", "import importlib.util, branchdiff; "
                 "print(branchdiff.__file__, importlib.util.find_spec('rewards'), importlib.util.find_spec('schedulers'))"],
                work, env).split()
    assert Path(where[0]).is_relative_to(purelib) and where[1:] == ["None", "None"], where

    branchdiff = venv / "bin" / "branchdiff"
    run([branchdiff, "train", "tiny-chain", "iterations=2", "prompts.per_iteration=2", "tree.roots=2", "sampling.num_steps=3",
         "model.finetune=lora", "final_eval=false", "logging.report_to=none", f"output_dir={tmp_path / 'run'}"], work, env)
    assert (tmp_path / "run" / "lora" / "pytorch_lora_weights.safetensors").is_file()
    table = run([branchdiff, "eval", "--seeds", "1", "--steps", "3", "--out", str(tmp_path / "eval")], work, env).splitlines()
    assert table[0].startswith("tiny:held_out: 36 prompts × 1 images, base model") and table[1].split() == ["score", "all"], table
    assert table[2].startswith("tiny-geneval ") and (tmp_path / "eval" / "scores.csv").is_file(), table
