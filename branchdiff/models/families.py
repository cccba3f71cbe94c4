"""The family registry: one line per family (docs/models.md). Light on purpose (no torch, no
diffusers), so a config is validated without importing any model code.

A family entry names its adapter class ("module:Class", imported only when used), its step family
(`flow` for velocity models, whose SDEs are dance | flow | cps; `ddim` for ε-models) and its
default image side.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    adapter: str  # "module:Class" of the ModelAdapter
    steps: str  # "flow" | "ddim": which schedulers the family samples with
    resolution: int  # default image side in pixels
    fixed_resolution: bool = False  # True: the family makes images of `resolution` only


FAMILIES: dict[str, Family] = {
    "tiny": Family("branchdiff.models.tiny:TinyAdapter", "flow", 32, fixed_resolution=True),
    "sd3": Family("branchdiff.models.sd3:SD3Adapter", "flow", 1024),
    "flux": Family("branchdiff.models.flux:FluxAdapter", "flow", 1024),
    "sana": Family("branchdiff.models.sana:SanaAdapter", "flow", 1024),
    "sd15": Family("branchdiff.models.sd15:SD15Adapter", "ddim", 512),
}
LORA_TARGET_SETS = ("attention", "attention+ff", "all-linear")  # the named LoRA target sets every family's adapter defines
STEP_KINDS = {"flow": ("dance", "flow", "cps"), "ddim": ("ddim",)}  # the SDEs each step family trains with
