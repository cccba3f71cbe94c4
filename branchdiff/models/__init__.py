"""Model adapters by family (`families.FAMILIES`): one module per family, the only family-specific
code in branchdiff (`base.ModelAdapter` is the contract; docs/models.md)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from branchdiff.models.families import FAMILIES, image_size

if TYPE_CHECKING:
    import torch

    from branchdiff.models.base import ModelAdapter


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
) -> ModelAdapter:
    """The family's adapter loaded from `path` (a local directory or a hub id; None: the family's
    default, which only the built-in tiny model has) at `resolution` (H, [H, W] or None: the family's default square),
    base weights in `dtype` (None: float32); `instruction` False: prompts without the family's
    instruction prefix (SANA's)."""
    import torch

    size = image_size(resolution, FAMILIES[family].resolution)
    adapter = adapter_class(family).from_pretrained(path, device, size, dtype or torch.float32, offload)
    adapter.instruction = instruction
    return adapter
