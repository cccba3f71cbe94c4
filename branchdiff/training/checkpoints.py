"""How a training run saves and restores everything it needs: the `Checkpointer` a `Trainer` holds.

A checkpoint holds what is trained (the LoRA, or every weight of the denoiser; never a frozen base),
its moving average, the objective's own state, the optimizer's and the RNG states (accelerate), the
iteration and the run's counters, and a manifest of it all (branchdiff/runtime/checkpoint.py). Everything
else (prompts, noise, step subsampling, pruning and Mix windows, the explorer's quantised copy) is a
function of the iteration or of the weights. A sharded denoiser's tensors are gathered on every
process and written by the main one; a resume loads them on every process (branchdiff/runtime/sharding.py).
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from branchdiff.errors import CheckpointError
from branchdiff.runtime import checkpoint, metrics_log, sharding, storage
from branchdiff.settings.load import to_dict
from branchdiff.training.hacking import WatchState

if TYPE_CHECKING:
    from accelerate import Accelerator

    from branchdiff.models.base import ModelAdapter
    from branchdiff.models.ema import WeightAverage
    from branchdiff.models.finetune import FullFinetune, LoraFinetune
    from branchdiff.objectives.base import Objective
    from branchdiff.runtime.distributed import AcceleratorCollective
    from branchdiff.runtime.sharding import ShardingSettings
    from branchdiff.settings.config import TrainConfig
    from branchdiff.training.exploration import Exploration


@dataclass
class RunCounters:
    """What a checkpoint carries besides tensors and the iteration: the run's counters and the reward-hacking
    watch's memory, restored on a resume."""
    start_iteration: int = 0  # the first iteration this process runs (after a resume: the checkpoint's + 1)
    # optimizer steps skipped in a row (non-finite gradients), across iterations; optimizer steps taken in the run
    run_state: dict[str, Any] = field(default_factory=lambda: {"skipped_in_a_row": 0, "optimizer_steps": 0})
    watch_state: WatchState = field(default_factory=WatchState)  # the reward-hacking watch's memory (branchdiff/training/hacking.py)


@dataclass
class TrainedParts:
    """What a checkpoint saves of a run's model: set once the model, its optimizer and the objective are built."""
    adapter: ModelAdapter
    finetune: LoraFinetune | FullFinetune
    optimizer: torch.optim.Optimizer
    weight_average: WeightAverage | None
    objective: Objective
    exploration: Exploration | None  # its 4-bit copy follows the restored weights


class Checkpointer:
    """A run's checkpoints: choosing one to resume (before the model loads), saving every checkpoint and
    restoring one (once the model's parts are `attach`ed)."""

    def __init__(self, config: TrainConfig, run_dir: Path, accelerator: Accelerator, collective: AcceleratorCollective,
                 sharding: ShardingSettings) -> None:
        self.config, self.run_dir, self.accelerator, self.collective, self.sharding = config, run_dir, accelerator, collective, sharding
        self.counters = RunCounters()
        self._parts: TrainedParts | None = None

    def attach(self, parts: TrainedParts) -> None:
        """The model's parts; accelerate saves and loads no model weights itself (`_save_trained` and `_load_trained` do)."""
        self._parts = parts
        # plain functions: a bound method kept by the accelerator, which this object keeps, would be a reference
        # cycle holding the model's weights after the run is dropped, until Python's cycle collector ran
        self.accelerator.register_save_state_pre_hook(_save_no_model_weights)
        self.accelerator.register_load_state_pre_hook(_load_no_model_weights)

    @property
    def parts(self) -> TrainedParts:
        assert self._parts is not None, "attach the model's parts before saving or loading a checkpoint"
        return self._parts

    def _save_trained(self, folder: Path) -> None:
        """What is trained (the LoRA, or every weight of the denoiser; never a frozen base), its moving
        average when on, the objective's own state and, on a sharded denoiser, the optimizer's state:
        gathered on every process (a sharded denoiser's shards), written by the main one."""
        main = self.accelerator.is_main_process
        failures: list[Exception] = []

        def guarded(part: Callable[[], None]) -> None:  # every process makes every gather; a failed write is raised after the last
            try:
                part()
            except Exception as error:  # safetensors, torch and the OS each raise their own types
                failures.append(error)

        trained = self.parts.finetune.trained_state()
        optimizer = sharding.optimizer_state(self.parts.adapter.denoiser, self.parts.optimizer) if self.sharding.enabled else None
        if main:
            guarded(lambda: self.parts.finetune.write_state(trained, folder))
            if optimizer is not None:
                guarded(lambda: sharding.save_optimizer(optimizer, folder))
        if (average := self.parts.weight_average) is not None:
            guarded(lambda: average.save(folder, write=main))
        guarded(lambda: self.parts.objective.save_state(folder, write=main))
        if failures:
            raise failures[0]

    def _load_trained(self, folder: Path) -> None:
        """What `_save_trained` wrote, on every process."""
        self.parts.finetune.load_state(folder)
        if self.parts.weight_average is not None:
            self.parts.weight_average.load(folder)
        self.parts.objective.load_state(folder)
        if self.sharding.enabled:
            sharding.load_optimizer(self.parts.adapter.denoiser, self.parts.optimizer, folder)

    @property
    def folder(self) -> Path:
        return self.run_dir / "checkpoints"

    def save(self, iteration: int) -> None:
        """Everything the run needs to continue as if never stopped: LoRA, optimizer and RNG states
        (accelerate), the iteration, config and `run_state` counters, and a manifest of it all; the
        rest is a function of the iteration (prompts, noise, step subsampling, pruning and Mix
        windows) or of the LoRA (the explorer's quantised copy). Written to a staging folder and
        published by renames (`checkpoint.publish`); old ones pruned. A failed write on any process
        (a full disk: `storage.DiskFull`) removes the staging folder on every process and raises:
        the published checkpoints stay as they were."""
        final = self.folder / checkpoint.name(iteration)
        staging = checkpoint.staging(final)
        main = self.accelerator.is_main_process
        if main and self.folder.exists():
            checkpoint.clean_interrupted(self.folder)
        previous = checkpoint.newest(self.folder)
        needed = storage.tree_size(previous) if previous else 0  # the last checkpoint's size, else what was written
        self.accelerator.wait_for_everyone()

        def attempt(write: Callable[[], None], only_main: bool = False) -> None:
            """`write` on every process (or the main one), then one reduction that is also the barrier:
            a failure anywhere removes the staging folder and stops every process together."""
            failure: Exception | None = None
            if main or not only_main:
                try:
                    with storage.disk_full_as_error(final, needed, partial=staging):
                        write()
                except Exception as error:  # torch, safetensors and the OS each raise their own type
                    failure = error
            if self.collective.max(torch.tensor([float(failure is not None)])).item() > 0:
                if main:
                    shutil.rmtree(staging, ignore_errors=True)
                raise failure or CheckpointError(f"another process could not write its part of checkpoint {final} (its error is in "
                                                 "its output); the published checkpoints are intact; continue with --resume latest")

        attempt(lambda: self.accelerator.save_state(str(staging)))  # every process's RNG state is in staging after it
        attempt(lambda: self._save_trained(staging))
        counters = self.counters
        counters.run_state["watch"] = counters.watch_state.to_dict()

        def state_and_manifest() -> None:
            checkpoint.write_state(staging, iteration, to_dict(self.config), self.accelerator.num_processes, counters.run_state)
            checkpoint.write_manifest(staging)

        attempt(state_and_manifest, only_main=True)
        if main:
            checkpoint.publish(staging, final)
            checkpoint.prune(self.folder, self.config.logging.checkpoints_total_limit)
        self.accelerator.wait_for_everyone()

    def newest(self) -> Path | None:
        """The newest published checkpoint folder, or None."""
        return checkpoint.newest(self.folder)

    def select(self, which: str) -> checkpoint.Selected:
        """The checkpoint to resume from (`checkpoint.select`: checked, `latest` falling back past
        damaged ones, notices printed by the main process), made with this config and process count,
        and a readable metrics.jsonl. Every process chooses alike: the main one first puts back a
        checkpoint a crash left renamed, and the others wait for it."""
        if self.accelerator.is_main_process and self.folder.exists():
            checkpoint.restore_replaced(self.folder)
        self.accelerator.wait_for_everyone()
        selected = checkpoint.select(self.folder, which)
        saved = selected.state.get("config") or _saved_run_config(self.run_dir)
        if saved is not None:
            checkpoint.check_config(saved, to_dict(self.config), selected.path)
        checkpoint.check_processes(selected.state.get("num_processes"), self.accelerator.num_processes, selected.path)
        if (self.run_dir / "metrics.jsonl").is_file():
            metrics_log.read(self.run_dir / "metrics.jsonl")
        self.accelerator.wait_for_everyone()  # every process has chosen before damaged checkpoints are set aside
        if self.accelerator.is_main_process:
            for notice in selected.notices:
                print(f"branchdiff: {notice}", file=sys.stderr)
            for damaged in selected.skipped:
                checkpoint.set_aside(damaged)
            done = selected.state["iteration"] + 1  # iterations are counted from 0; the progress bar shows how many are done
            print(f"branchdiff: resuming from {selected.path}: {done} of {self.config.iterations} iterations done", file=sys.stderr)
        return selected

    def load(self, selected: checkpoint.Selected) -> None:
        """LoRA, optimizer, iteration and counters from the selected checkpoint; metrics.jsonl cut back to it."""
        path, state = selected.path, selected.state
        self.accelerator.wait_for_everyone()
        if self.accelerator.is_main_process:
            checkpoint.clean_interrupted(self.folder)
        self.accelerator.wait_for_everyone()
        try:
            self.accelerator.load_state(str(path))
            self._load_trained(path)
        except Exception as error:  # safetensors, torch.load and peft each raise their own types for a bad file
            older = [p for p in checkpoint.checkpoints(self.folder) if p.name < path.name]
            hint = f"resume from an older one (--resume {older[-1]})" if older else "start a new run in another output_dir="
            reason = " ".join(str(error).split())[:200]
            raise CheckpointError(f"--resume: checkpoint {path} is damaged or not this run's ({type(error).__name__}: {reason}); {hint}") from None
        if self.parts.exploration is not None:
            self.parts.exploration.refresh()  # the 4-bit copy must follow the restored LoRA
        counters = self.counters
        counters.start_iteration = state["iteration"] + 1
        counters.run_state.update(state.get("run_state", {}))
        counters.watch_state = WatchState(**counters.run_state.get("watch", {}))
        if self.accelerator.is_main_process:
            metrics_log.truncate(self.run_dir / "metrics.jsonl", state["iteration"])  # a resumed run rewrites the later lines


def _save_no_model_weights(models: list, weights: list, output_dir: str) -> None:
    """accelerate writes no model weights: what is trained is saved by `Checkpointer._save_trained`."""
    weights.clear()


def _load_no_model_weights(models: list, input_dir: str) -> None:
    """accelerate loads no model weights: `Checkpointer._load_trained` does."""
    models.clear()


def _saved_run_config(run_dir: Path) -> dict | None:
    """The config a run was started with (checkpoints before the config was stored in them)."""
    import yaml

    path = run_dir / "config.yaml"
    return yaml.safe_load(path.read_text()) if path.is_file() else None
