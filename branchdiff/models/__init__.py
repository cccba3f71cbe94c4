"""Model adapters by family (`families.FAMILIES`): one module per family, the only family-specific
code in branchdiff (`base.ModelAdapter` is the contract; docs/models.md); LoRA (`lora`), what a run
trains, LoRA or every weight (`finetune`), and a moving average of trained weights (`ema`).

May import: schedulers, runtime, data, errors; never training, objectives or the command line.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, cast

from branchdiff.models.registry import FAMILIES, image_size

if TYPE_CHECKING:
    import torch

    from branchdiff.models.base import ModelAdapter


def check_size(family: str, path: str | None, resolution: int | list[int] | tuple[int, int] | None) -> tuple[int, int]:
    """The (height, width) the family's model at `path` makes at `resolution`, refused before anything
    loads when it cannot: another size of a fixed-size family, or sides that are not multiples of what
    the folder's config files ask for (a hub id is checked once it has loaded)."""
    from branchdiff.models.pipeline_adapter import check_multiple

    spec = FAMILIES[family]
    size = image_size(resolution, spec.resolution)
    if spec.fixed_resolution and size != image_size(None, spec.resolution):
        raise ValueError(f"resolution {size[0]}x{size[1]}: model.family={family} makes only {spec.resolution}×{spec.resolution} images; "
                         "leave the resolution unset")
    folder_multiple = getattr(adapter_class(family), "folder_multiple", None)
    multiple = folder_multiple(path) if folder_multiple else None
    if multiple:
        check_multiple(size, multiple, family)
    return size


def check_frames(family: str, path: str | None, frames: int | None) -> None:
    """A video family's frame count, refused before anything loads when the folder's VAE cannot make it."""
    spec = FAMILIES[family]
    if spec.video:
        cast(Any, adapter_class(family)).folder_frames(path, frames or spec.frames)  # a video family's


def adapter_class(family: str) -> type[ModelAdapter]:
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; allowed: {', '.join(FAMILIES)}")
    module, name = FAMILIES[family].adapter.split(":")
    return getattr(importlib.import_module(module), name)


def load_adapter(
    family: str,
    path: str | None,
    device: torch.device | str = "cpu",
    resolution: int | list[int] | tuple[int, int] | None = None,
    dtype: torch.dtype | None = None,
    offload: bool = False,
    instruction: bool = True,
    frames: int | None = None,
    expert: str = "high",
    guidance_2: float | None = None,
) -> ModelAdapter:
    """The family's adapter loaded from `path` (a local directory or a hub id; None: the family's
    default, which only the built-in tiny model has) at `resolution` (H, [H, W] or None: the family's default size),
    base weights in `dtype` (None: float32); `instruction` False: prompts without the family's
    instruction prefix (SANA's); `frames`: a video family's frames per video (None: its default);
    `expert`: which of Wan 2.2's experts is the trained denoiser; `guidance_2`: the guidance of its low-noise
    expert (None: the guidance each call names)."""
    import torch

    spec = FAMILIES[family]
    size = image_size(resolution, spec.resolution)
    options = {"frames": frames or spec.frames, "expert": expert, "guidance_2": guidance_2} if spec.video else {}
    # each family's own from_pretrained (their options differ)
    adapter: ModelAdapter = cast(Any, adapter_class(family)).from_pretrained(path, device, size, dtype or torch.float32, offload, **options)
    adapter.instruction = instruction
    return adapter
