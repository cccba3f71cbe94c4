"""Pin the bytes of a few short runs through the command line, to check that a refactor keeps behaviour.

    python scripts/pin_runs.py before.json            # on the commit before the change
    python scripts/pin_runs.py after.json --compare before.json

Runs, each a few iterations of the built-in model or a tiny random SD3 pipeline: the default preset
(full fine-tuning, LayerTuning-RL, EMA), Sol-RL (explore + DiffusionNFT), explore on a tree, a LoRA
chain stopped and resumed, and in one two-process launch (gloo) a DDP LoRA run, an FSDP2 LoRA run and
an FSDP2 full fine-tuning run with a KL term. Pinned per run: the SHA-256 of every exported
safetensors file and of metrics.jsonl without times and memory. `--compare` names every run whose
bytes differ and exits 1 when one does. Bytes are those of this machine and thread count (another
machine rounds float32 differently); tests/test_pinned_runs.py pins three runs for any machine.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"
BIN = Path(sys.executable).parent
QUIET = ["final_eval=false", "logging.sample_every=0", "logging.report_to=none"]
UNPINNED = ("time", "seconds", "memory", "_per_s")  # metrics that measure the machine, not the run


def digest(run: Path) -> dict:
    """The SHA-256 of each exported safetensors file (checkpoints aside) and of the metrics that describe the run."""
    files = {str(f.relative_to(run)): hashlib.sha256(f.read_bytes()).hexdigest()
             for f in sorted(run.rglob("*.safetensors")) if "checkpoints" not in f.parts}
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    metrics = [{k: v for k, v in row.items() if not any(part in k for part in UNPINNED)} for row in rows]
    return {"files": files, "metrics": hashlib.sha256(json.dumps(metrics, sort_keys=True).encode()).hexdigest(), "iterations": len(rows)}


def run_cli(env: dict, *args: str) -> None:
    done = subprocess.run([str(BIN / "branchdiff"), *args], env=env, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"branchdiff {' '.join(args)} failed:\n{done.stderr[-2000:]}")


def sharded_plan(model: Path, work: Path) -> list:
    """Three runs of tests/sharded_runs.py: DDP LoRA, FSDP2 LoRA, FSDP2 full with a KL term."""
    def args(name: str, finetune: str, *extra: str) -> list[str]:
        return ["train", "tiny-chain", "model.family=sd3", f"model.path={model}", "model.resolution=32", f"model.finetune={finetune}",
                "iterations=2", "prompts.per_iteration=2", "tree.roots=1", "tree.splits=[[0,2],[1,2]]", "sampling.num_steps=3",
                "train.minibatch=2", "seed=5", "reward=rewards_for_tests:Redness", "train.ema_decay=0.5", "sampling.max_batch=8",
                *QUIET, f"output_dir={work / name}", *extra]
    return [["ddp", args("ddp-lora", "lora")], ["fsdp", args("fsdp-lora", "lora")], ["fsdp", args("fsdp-full", "full", "train.kl_beta=0.1")]]


def pin(work: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(TESTS), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "ACCELERATE_USE_CPU": "true"}
    run_cli(env, "train", "iterations=3", f"output_dir={work / 'default'}", *QUIET)
    run_cli(env, "train", "tiny-sol", "iterations=2", f"output_dir={work / 'sol'}", *QUIET)
    run_cli(env, "train", "tiny-explore-tree", "iterations=1", f"output_dir={work / 'explore-tree'}", *QUIET)
    chain = ["tiny-chain", "model.finetune=lora", f"output_dir={work / 'resumed'}", *QUIET]
    run_cli(env, "train", *chain, "iterations=1")
    run_cli(env, "train", *chain, "iterations=2", "--resume", "latest")
    sys.path.insert(0, str(TESTS))
    from tiny_pipelines import save_pipeline

    (work / "runs.json").write_text(json.dumps(sharded_plan(save_pipeline("sd3", work / "sd3"), work)))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    launch = [str(BIN / "accelerate"), "launch", "--config_file", str(REPO / "branchdiff/configs/accelerate/fsdp.yaml"), "--num_processes", "2",
              "--main_process_ip", "127.0.0.1", "--main_process_port", str(port), "--mixed_precision", "no",
              str(TESTS / "sharded_runs.py"), str(work / "runs.json")]
    done = subprocess.run(launch, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode:
        sys.exit(f"the two-process launch failed:\n{done.stderr[-3000:]}")
    names = ("default", "sol", "explore-tree", "resumed", "ddp-lora", "fsdp-lora", "fsdp-full")
    return {name: digest(work / name) for name in names}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="where to write the pins (JSON)")
    parser.add_argument("--compare", type=Path, default=None, help="pins written before the change")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        pins = pin(Path(work))
    args.out.write_text(json.dumps(pins, indent=1))
    if args.compare is None:
        print(f"wrote {args.out}")
        return
    before = json.loads(args.compare.read_text())
    differ = [name for name in pins if pins[name] != before.get(name)]
    for name in pins:
        print(f"{name:<14}{'differs' if name in differ else 'same bytes'}")
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
