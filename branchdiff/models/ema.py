"""An exponential moving average (EMA) of the trained weights: `train.ema_decay` (0: off).

After every optimizer step n (n = 1, 2, …) each trained parameter's average moves toward it,
    θ̄ ← d_n·θ̄ + (1 − d_n)·θ,   d_n = min(decay, n / (n + 9))   (d_1 = 0: the average starts at θ),
the ramp of diffusers' `EMAModel` (which does the arithmetic), so the first steps do not tie the
average to the untrained weights. The rollouts and the update use the live weights; the held-out
evaluations, the evaluation grids, the final evaluation and the export use the average (a policy
that swings from one update to the next is judged, and shipped, smoothed). Over the LoRA or every
weight of the denoiser alike: one more float32 copy of what is trained in memory, saved in every
checkpoint (`ema.safetensors`) so that a resumed run continues the same average.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from branchdiff.runtime.sharding import full_tensor, shard_like

EMA_FILE = "ema.safetensors"  # a checkpoint's averaged weights, with the step count in its metadata


class WeightAverage:
    """The moving average of `params` (the trained parameters, in a fixed order)."""

    def __init__(self, params: list[torch.nn.Parameter], decay: float) -> None:
        from diffusers.training_utils import EMAModel  # diffusers loads with the model, not with the config

        if not 0.0 <= decay < 1.0:  # train.ema_decay is checked with the settings (branchdiff/settings/validate.py)
            raise ValueError(f"a weight average's decay must be in [0, 1), got {decay}")
        self.params = params
        from torch.distributed.tensor import DTensor

        sharded = any(isinstance(p, DTensor) for p in params)  # DTensors have no fused (foreach) copy
        self.average = EMAModel(params, decay=decay, foreach=not sharded)

    @property
    def steps(self) -> int:
        """Optimizer steps averaged so far."""
        return self.average.optimization_step

    def update(self, decay: float | None = None) -> None:
        """Fold the current weights into the average: at the ramped decay, or at exactly `decay` when
        given (EMAModel's decay and its floor both set to it; the first update still copies)."""
        if decay is not None:
            self.average.decay = self.average.min_decay = decay
        self.average.step(self.params)

    @contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The averaged weights in the model for the block; the live ones back after it."""
        self.average.store(self.params)
        self.average.copy_to(self.params)
        try:
            yield
        finally:
            self.average.restore(self.params)

    def save(self, folder: Path, name: str = EMA_FILE, write: bool = True) -> None:
        """The average as `folder/name` (tensor i = parameter i, whole), its step count as metadata.
        Every process calls it (sharded parameters' averages are gathered); only with `write` is it written."""
        tensors = {str(i): full_tensor(shadow.detach()).cpu().contiguous() for i, shadow in enumerate(self.average.shadow_params)}  # gathered into host memory
        if write:
            save_file(tensors, folder / name, metadata={"optimization_step": str(self.steps)})

    def load(self, folder: Path, name: str = EMA_FILE) -> None:
        """The average saved by `save`; refused unless it holds one tensor of the right shape per parameter."""
        path = folder / name
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing: the checkpoint was written without this average")
        with safe_open(str(path), "pt") as handle:
            tensors = {key: handle.get_tensor(key) for key in handle.keys()}
            steps = int(handle.metadata()["optimization_step"])
        shapes = [tuple(p.shape) for p in self.params]
        saved = [tuple(tensors[str(i)].shape) if str(i) in tensors else None for i in range(len(shapes))]
        if len(tensors) != len(shapes) or saved != shapes:
            raise ValueError(f"{path} holds {len(tensors)} averaged tensors that do not match the {len(shapes)} trained parameters")
        self.average.load_state_dict({"optimization_step": steps,
                                      "shadow_params": [shard_like(tensors[str(i)], p) for i, p in enumerate(self.params)]})
