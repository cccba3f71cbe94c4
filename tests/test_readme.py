"""README's first hour, run as a new user would: every command of its "Use" block, in order, in a
fresh folder, on the built-in model, verbatim but for sizes (fewer iterations, prompts, images,
minutes); each must succeed, and the files the next command needs must be where the README says."""

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
SMALL_RUN = ["prompts.eval_seeds=1", "prompts.per_iteration=2"]  # sizes added to every training command


def use_commands() -> list[str]:
    """The lines of the README's first code block under "## Use"."""
    text = README.read_text()
    block = re.search(r"^## Use\n.*?```\n(.*?)```", text, flags=re.S | re.M)
    assert block, "README has no code block under ## Use"
    return [line for line in block[1].splitlines() if line.strip()]


def smaller(words: list[str]) -> list[str]:
    """The same command with smaller sizes: iterations N → max(2, N // 10), two prompts per
    iteration, one evaluation image per prompt; benchmarks: one repeat, seed, prompt and image, two
    evaluations, 0.6 s of training per variant."""
    if words[:2] == ["bench", "curves"]:
        swapped = {"--minutes": "0.01", "--seeds": "1"}
        out = [swapped.get(words[i - 1], w) if i else w for i, w in enumerate(words)]
        return [*out, "--points", "2", "--eval-images", "1", "prompts.per_iteration=1"]
    if words[:2] == ["bench", "tree"]:
        return [*words, "--repeats", "1", "prompts.per_iteration=1"]
    if "train" not in words:
        return words
    out = [f"iterations={max(2, int(w.split('=')[1]) // 10)}" if w.startswith("iterations=") else w for w in words]
    if not any(w.startswith("iterations=") for w in out):
        out.append("iterations=2")
    return [*out, *SMALL_RUN]


def test_the_readme_commands_run_in_order(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    commands = use_commands()
    assert len(commands) >= 10 and commands[0].split("#")[0].split() == ["branchdiff", "train"]
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
            assert re.search(r"^run folder: runs/[\w-]+/$", out, flags=re.M) and "  LoRA:   runs/" in out and "  report: runs/" in out, out
    for made in ("runs/tiny-mix/lora/pytorch_lora_weights.safetensors", "runs/tiny-mix/report.html", "samples", "eval.json",
                 "runs/tiny-chain/checkpoints", "runs/mine/lora", "bench.json", "curves/curves.md", "runs/two/lora"):
        assert (tmp_path / made).exists(), made


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
