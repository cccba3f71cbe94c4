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

Every file is written whole or not at all (branchdiff/runtime/storage.py); a full disk stops the run with
one line naming the file, the space and the newest complete checkpoint (`storage.DiskFull`). With
several processes a heartbeat watches the others (branchdiff/runtime/watchdog.py): a process that stops
responding for `collective_timeout` seconds ends the job with one line naming it.
"""

from __future__ import annotations

import signal
import sys
from typing import cast

import torch
from tqdm.auto import tqdm

from branchdiff.errors import CheckpointError, RunStopped, is_out_of_memory, out_of_memory
from branchdiff.models.finetune import export
from branchdiff.report.figures import save_grid
from branchdiff.report.model_card import write_model_card
from branchdiff.runtime import metrics_log, storage
from branchdiff.runtime.watchdog import Heartbeat
from branchdiff.settings.validate import tracker_names
from branchdiff.training import trackers
from branchdiff.training.hacking import stop_line
from branchdiff.training.trainer import Trainer

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


def progress_fields(metrics: dict[str, float]) -> dict[str, str]:
    """The progress bar's fields: reward, tiny-task accuracy when scored, and a warning when many
    groups carry no signal (all their samples scored alike) or were dropped."""
    if "reward_mean" not in metrics:  # a dataset objective's iteration: no reward, its loss instead
        fields = {"loss": f"{metrics['loss']:.4f}"} if "loss" in metrics else {}
        held_out = next((key for key in metrics if key.startswith("eval_") and key.endswith(".strict")), None)
        if held_out:
            fields["held-out strict"] = f"{metrics[held_out]:.2f}"
        return fields
    fields = {"reward": f"{metrics['reward_mean']:.3f}"}
    if "accuracy_strict" in metrics:
        fields["strict"] = f"{metrics['accuracy_strict']:.2f}"
    held_out = next((key for key in metrics if key.startswith("eval_") and key.endswith(".strict")), None)  # a verifier's held-out accuracy
    if held_out:
        fields["held-out strict"] = f"{metrics[held_out]:.2f}"
    if metrics["reward_zero_spread_fraction"] > WEAK_SIGNAL:
        fields["no-spread groups"] = f"{metrics['reward_zero_spread_fraction']:.0%}"
    if metrics["groups_dropped"]:
        fields["dropped groups"] = str(metrics["groups_dropped"])
    if metrics["steps_skipped"]:
        fields["skipped steps"] = str(metrics["steps_skipped"])
    return fields


def stop_reason(trainer: Trainer, metrics: dict[str, float]) -> str | None:
    """Why the run cannot go on after this iteration's `metrics`, or None."""
    config, iteration = trainer.config, cast(int, metrics["iteration"])  # an int among the floats
    skipped_in_a_row = trainer.run_state["skipped_in_a_row"]
    if metrics.get("groups_dropped") == config.prompts.per_iteration * trainer.accelerator.num_processes:  # (none for a dataset objective)
        nonfinite = [k.removesuffix("_nonfinite") for k, v in metrics.items() if k.endswith("_nonfinite") and v]
        failed = [k.removesuffix("_failed") for k, v in metrics.items() if k.endswith("_failed") and v]
        culprits = ", ".join([*(f"{n} (non-finite scores)" for n in nonfinite), *(f"{n} (failed)" for n in failed)]) or "the reward"
        return (f"every group of iteration {iteration} had a non-finite reward ({culprits}), so nothing can be trained; "
                "check the reward on a few images (branchdiff rewards check NAME) and continue with --resume latest")
    if skipped_in_a_row >= config.train.max_skipped_steps:
        return (f"{skipped_in_a_row} optimizer steps in a row had a non-finite loss or gradient (up to iteration {iteration}); "
                "the weights before them are saved; lower train.learning_rate or check the reward's scale, then start a new run")
    if config.watch.stop and metrics.get("watch_diverging"):
        assert trainer.gold_score is not None  # the watch flags only after an evaluation, which follows the gold score
        return stop_line(trainer.watch_state, config.watch.window, trainer.gold_score, iteration)
    return None


def train(trainer: Trainer) -> None:
    """Iterations start_iteration .. iterations-1, then the export (RUN/lora, or the denoiser folder
    of full fine-tuning: `finetune.export`; the weights' moving average when `train.ema_decay` is on). A full disk
    or a silent process ends it with one line (`CheckpointError`, `watchdog.CollectiveTimeout`)."""
    heartbeat = trainer.heartbeat
    try:
        _train(trainer, heartbeat)
    except storage.DiskFull as error:
        raise CheckpointError(error.line(trainer.newest_checkpoint())) from None
    except (MemoryError, RuntimeError) as error:  # out of memory, a collective that timed out or lost its peer
        if is_out_of_memory(error):
            newest = trainer.newest_checkpoint()
            then = f"continue from {newest} with --resume latest" if newest else "start again"
            raise out_of_memory(error, "during training", "lower sampling.max_batch or turn on train.gradient_checkpointing or model.offload, "
                                f"and {then} (or start a new run with a smaller train.minibatch or prompts.per_iteration)") from None
        explained = heartbeat.explain(error) if heartbeat else None
        if explained is None:
            raise
        raise explained from None
    finally:
        if heartbeat:
            heartbeat.stop()


def _train(trainer: Trainer, heartbeat: Heartbeat | None) -> None:
    config, accelerator, run_dir = trainer.config, trainer.accelerator, trainer.run_dir
    from branchdiff.settings.load import save_config, to_dict

    if accelerator.is_main_process:
        save_config(config, run_dir / "config.yaml")
    trackers.start(accelerator, tracker_names(config.logging.report_to), run_dir, trainer.start_iteration, to_dict(config))
    progress = tqdm(range(trainer.start_iteration, config.iterations), initial=trainer.start_iteration, total=config.iterations,
                    desc="train", disable=not accelerator.is_local_main_process)
    try:
        with InterruptRequest() as interrupt:
            for iteration in progress:
                if heartbeat:
                    heartbeat.doing(f"iteration {iteration}")
                metrics = _iteration(trainer, iteration)
                progress.set_postfix(progress_fields(metrics))
                reason = stop_reason(trainer, metrics)
                stop = trainer.collective.max(torch.tensor([float(interrupt.requested or reason is not None)])).item() > 0
                every = config.logging.checkpoint_every
                if stop or (every and (iteration + 1) % every == 0) or iteration == config.iterations - 1:
                    if heartbeat:
                        heartbeat.doing(f"the checkpoint of iteration {iteration}")
                    trainer.save_checkpoint(iteration)
                    _write_report(trainer)
                if reason is not None:
                    raise RunStopped(reason)
                if stop:
                    raise Interrupted(f"interrupted after {iteration + 1} of {config.iterations} iterations, a checkpoint of them saved in "
                                      f"{trainer.checkpoint_dir}; continue with --resume latest")
    finally:
        progress.close()
        trackers.finish(accelerator)
    with trainer.evaluated_weights():  # the moving average when on; every process (a sharded denoiser is gathered), the main one writes
        export(trainer.finetune, run_dir, write=accelerator.is_main_process)
    if accelerator.is_main_process:
        write_model_card(run_dir, trainer.finetune.export_name)  # RUN/README.md, again after the final evaluation


def _iteration(trainer: Trainer, iteration: int) -> dict[str, float]:
    """Held-out evaluation when due, the iteration, its logs and grids; returns its metrics."""
    config, accelerator, run_dir = trainer.config, trainer.accelerator, trainer.run_dir
    heldout = {}
    if config.eval_every and iteration % config.eval_every == 0:
        heldout = trainer.heldout_metrics()
        if accelerator.is_main_process or trainer.sharding.enabled:
            images, prompts = trainer.fixed_samples()
        if accelerator.is_main_process:
            grid = save_grid(images, run_dir / "samples" / f"eval-iter-{iteration:06d}.png", nrow=len(images) // len(prompts),
                             row_captions=prompts)
            _log_grid(trainer, "samples/held_out", grid, iteration)
    result = trainer.run_iteration(iteration)
    if heldout and "reward_mean" in result.metrics:  # the evaluation measured the policy of this iteration's rollouts: the watch pairs the two
        heldout.update(trainer.watch_state.add_evaluation(result.metrics["reward_mean"], heldout[f"eval_{trainer.gold_score}"],
                                                          config.watch.window, config.watch.tolerance))
    metrics = {**result.metrics, **heldout}
    with storage.disk_full_as_error(run_dir / "logs"):
        accelerator.log({k: v for k, v in metrics.items() if k != "iteration"}, step=iteration)
    if accelerator.is_main_process:
        metrics_log.append(run_dir / "metrics.jsonl", metrics)
        every = config.logging.sample_every
        if every and result.rollout is not None and (iteration % every == 0 or iteration == config.iterations - 1):
            tree = result.rollout.tree
            leaves_per_prompt = len(tree.leaf_index) // tree.num_prompts
            shown = 4 * leaves_per_prompt
            grid = save_grid(result.leaf_images[:shown], run_dir / "samples" / f"iter-{iteration:06d}.png", nrow=leaves_per_prompt,
                             row_captions=result.prompts[: shown // leaves_per_prompt])
            _log_grid(trainer, "samples/train", grid, iteration)
    return metrics


def _log_grid(trainer: Trainer, tag: str, grid: torch.Tensor, iteration: int) -> None:
    """A saved sample grid into the trackers: an image, or a video's grid playing as a GIF."""
    names = tracker_names(trainer.config.logging.report_to)
    if names:
        with storage.disk_full_as_error(trainer.run_dir / "logs"):
            trackers.log_grid(trainer.accelerator, names, tag, grid, iteration)


def _write_report(trainer: Trainer) -> None:
    if trainer.accelerator.is_main_process:
        from branchdiff.report.run_report import write_report

        write_report(trainer.run_dir)
