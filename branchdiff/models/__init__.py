"""Model adapters by family."""

from __future__ import annotations

import torch

from branchdiff.models.base import ModelAdapter

FAMILIES = ("tiny",)


def load_adapter(family: str, path: str | None, device: torch.device | str = "cpu") -> ModelAdapter:
    if family == "tiny":
        from branchdiff.models.tiny import TinyAdapter

        return TinyAdapter.from_pretrained(path, device)
    raise ValueError(f"unknown model family {family!r}; allowed: {FAMILIES}")
