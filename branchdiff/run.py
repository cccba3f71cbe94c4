"""A training run: the iterations of `Trainer` and everything around them.

Iteration i: a held-out evaluation first when `eval_every` divides i (the policy the iteration's
rollouts come from: on iteration 0 the base model) with a grid of fixed prompts and seeds, then the
iteration, its metrics line (metrics.jsonl and TensorBoard, main process), a grid of training
samples, a checkpoint every `logging.checkpoint_every` iterations and at the end, and the report
(report.html) after every checkpoint.

Every stop leaves a checkpoint of the last complete iteration, from which `--resume latest`
continues as if the run had never stopped:
- Ctrl-C (SIGINT): the iteration under way finishes, a checkpoint is written, `Interrupted`
  (exit 130); a second Ctrl-C aborts at once, keeping the checkpoints already published;
- an iteration whose every group was dropped (non-finite rewards), or `train.max_skipped_steps`
  optimizer steps in a row skipped (non-finite gradients): `RunStopped` (exit 2).
The processes decide together (one max-reduction per iteration), so none waits on another.
A crash or SIGKILL at any moment loses only the iterations after the last checkpoint: on resume,
metrics.jsonl is cut back to it and TensorBoard is told to drop later steps (`purge_step`).
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import torch
from tqdm.auto import tqdm

from branchdiff.config import TrainConfig
from branchdiff.errors import RunStopped
from branchdiff.report import save_grid
from branchdiff.trainer import Trainer

WEAK_SIGNAL = 0.25  # the progress bar warns when more than this fraction of groups has no reward spread


class Interrupted(KeyboardInterrupt):
    """Ctrl-C stopped the run after a checkpoint (exit 130)."""


class InterruptRequest:
    """While active, a first SIGINT only sets `requested` (the loop stops at the end of the
    iteration); a second one raises KeyboardInterrupt at once."""

    def __init__(self) -> None:
        self.requested = False

    def _handle(self, signum: int, frame: object) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print("\nbranchdiff: stopping after this iteration with a checkpoint (Ctrl-C again to abort now)", file=sys.stderr)

    def __enter__(self) -> InterruptRequest:
        self.previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        signal.signal(signal.SIGINT, self.previous)


def check_writable(run_dir: Path) -> None:
    """Refuse, before any work, an output_dir that cannot be created or written to."""
    from branchdiff.config import ConfigError

    probe = run_dir / ".write-test"
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        raise ConfigError(f"output_dir {run_dir} is not writable ({error.strerror or error}); pass output_dir= a folder you can write to") from None


def progress_fields(metrics: dict[str, float]) -> dict[str, str]:
    """The progress bar's fields: reward, tiny-task accuracy when scored, and a warning when many
    groups carry no signal (all their samples scored alike) or were dropped."""
    fields = {"reward": f"{metrics['reward_mean']:.3f}"}
    if "accuracy_strict" in metrics:
        fields["strict"] = f"{metrics['accuracy_strict']:.2f}"
    if "eval_tiny-geneval.strict" in metrics:
        fields["held-out strict"] = f"{metrics['eval_tiny-geneval.strict']:.2f}"
    if metrics["reward_zero_spread_fraction"] > WEAK_SIGNAL:
        fields["no-spread groups"] = f"{metrics['reward_zero_spread_fraction']:.0%}"
    if metrics["groups_dropped"]:
        fields["dropped groups"] = str(metrics["groups_dropped"])
    if metrics["steps_skipped"]:
        fields["skipped steps"] = str(metrics["steps_skipped"])
    return fields


def stop_reason(config: TrainConfig, metrics: dict[str, float], skipped_in_a_row: int, num_processes: int) -> str | None:
    """Why the run cannot go on after this iteration's `metrics`, or None."""
    iteration = metrics["iteration"]
    if metrics["groups_dropped"] == config.prompts.per_iteration * num_processes:
        nonfinite = [k.removesuffix("_nonfinite") for k, v in metrics.items() if k.endswith("_nonfinite") and v]
        failed = [k.removesuffix("_failed") for k, v in metrics.items() if k.endswith("_failed") and v]
        culprits = ", ".join([*(f"{n} (non-finite scores)" for n in nonfinite), *(f"{n} (failed)" for n in failed)]) or "the reward"
        return (f"every group of iteration {iteration} had a non-finite reward ({culprits}), so nothing can be trained; "
                "check the reward on a few images (branchdiff rewards check NAME) and continue with --resume latest")
    if skipped_in_a_row >= config.train.max_skipped_steps:
        return (f"{skipped_in_a_row} optimizer steps in a row had a non-finite loss or gradient (up to iteration {iteration}); "
                "the weights before them are saved; lower train.learning_rate or check the reward's scale, then start a new run")
    return None


def train(trainer: Trainer) -> None:
    """Iterations start_iteration .. iterations-1, then the final LoRA in run_dir/lora."""
    config, accelerator, run_dir = trainer.config, trainer.accelerator, trainer.run_dir
    from branchdiff.config import save_config

    run_dir.mkdir(parents=True, exist_ok=True)
    if accelerator.is_main_process:
        save_config(config, run_dir / "config.yaml")
    # TensorBoard drops the events of steps ≥ purge_step that an earlier session wrote after its last checkpoint
    accelerator.init_trackers("branchdiff", init_kwargs={"tensorboard": {"purge_step": trainer.start_iteration}})
    progress = tqdm(range(trainer.start_iteration, config.iterations), initial=trainer.start_iteration, total=config.iterations,
                    desc="train", disable=not accelerator.is_local_main_process)
    try:
        with InterruptRequest() as interrupt:
            for iteration in progress:
                metrics = _iteration(trainer, iteration)
                progress.set_postfix(progress_fields(metrics))
                reason = stop_reason(config, metrics, trainer.run_state["skipped_in_a_row"], accelerator.num_processes)
                stop = trainer.collective.max(torch.tensor([float(interrupt.requested or reason is not None)])).item() > 0
                every = config.logging.checkpoint_every
                if stop or (every and (iteration + 1) % every == 0) or iteration == config.iterations - 1:
                    trainer.save_checkpoint(iteration)
                    _write_report(trainer)
                if reason is not None:
                    raise RunStopped(reason)
                if stop:
                    raise Interrupted(f"interrupted: checkpoint of iteration {iteration} saved in {trainer.checkpoint_dir}; "
                                      "continue with --resume latest")
    finally:
        progress.close()
        accelerator.end_training()  # flushes TensorBoard, on a stop too
    if accelerator.is_main_process:
        trainer.adapter.save_lora(run_dir / "lora")


def _iteration(trainer: Trainer, iteration: int) -> dict[str, float]:
    """Held-out evaluation when due, the iteration, its logs and grids; returns its metrics."""
    config, accelerator, run_dir = trainer.config, trainer.accelerator, trainer.run_dir
    heldout = {}
    if config.eval_every and iteration % config.eval_every == 0:
        heldout = trainer.heldout_metrics()
        if accelerator.is_main_process:
            save_grid(trainer.fixed_samples(), run_dir / "samples" / f"eval-iter-{iteration:06d}.png", nrow=4)
    result = trainer.run_iteration(iteration)
    metrics = {**result.metrics, **heldout}
    accelerator.log({k: v for k, v in metrics.items() if k != "iteration"}, step=iteration)
    if accelerator.is_main_process:
        with (run_dir / "metrics.jsonl").open("a") as handle:
            handle.write(json.dumps(metrics) + "\n")
        every = config.logging.sample_every
        if every and (iteration % every == 0 or iteration == config.iterations - 1):
            tree = result.rollout.tree
            leaves_per_prompt = len(tree.leaf_index) // tree.num_prompts
            save_grid(result.leaf_images[: 4 * leaves_per_prompt], run_dir / "samples" / f"iter-{iteration:06d}.png", nrow=leaves_per_prompt)
    return metrics


def _write_report(trainer: Trainer) -> None:
    if trainer.accelerator.is_main_process:
        from branchdiff.run_report import write_report

        write_report(trainer.run_dir)
