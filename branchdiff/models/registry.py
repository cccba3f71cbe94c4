"""The family registry: one line per family (docs/models.md). Light on purpose (no torch, no
diffusers), so a config is validated without importing any model code.

A family entry names its adapter class ("module:Class", imported only when used), its step family
(`flow` for velocity models, whose SDEs are dance | flow | cps; `ddim` for ε-models), its
default image size, whether its prompts carry an instruction prefix, and whether it makes videos
(then `model.frames` is its frames per video; `frames` the default).

An installed package adds a family through an entry point in the group `branchdiff.families` (its
`pyproject.toml`: `[project.entry-points."branchdiff.families"] my-model = "my_pkg.family:FAMILY"`,
`FAMILY` a `Family` naming its adapter class); it is read when this module is imported. A name that is a
built-in's, or that two packages register, is refused naming both (branchdiff/runtime/registry.py, the rule
every component's registry follows). `branchdiff families` lists them all (docs/models.md, "Families
from other packages"; `branchdiff.testing.check_family` runs the pipeline checks on one).
"""

from __future__ import annotations

from dataclasses import dataclass

from branchdiff.runtime.registry import Registry


@dataclass(frozen=True)
class Family:
    adapter: str  # "module:Class" of the ModelAdapter
    steps: str  # "flow" | "ddim": which schedulers the family samples with
    resolution: int | tuple[int, int]  # default image size in pixels: a side (a square) or (height, width)
    fixed_resolution: bool = False  # True: the family makes images of `resolution` only
    instruction: bool = False  # True: its pipeline prepends an instruction to every prompt (model.prompt_instruction turns it off)
    frames: int = 0  # a video family's default frames per video (0: the family makes images)
    side_multiple: int = 8  # the released models' image sides are multiples of this (the loaded folder's configs decide)
    uncacheable: str = ""  # why a rollout's first-block cache (sampling.block_cache) cannot follow its blocks ("": it can; refused before loading)

    @property
    def video(self) -> bool:
        return self.frames > 0


BUILT_IN: dict[str, Family] = {
    "tiny": Family("branchdiff.models.tiny:TinyAdapter", "flow", 32, fixed_resolution=True),
    "tiny-video": Family("branchdiff.models.tiny_video:TinyVideoAdapter", "flow", 32, fixed_resolution=True, frames=5),  # the built-in video task's model
    "sd3": Family("branchdiff.models.sd3:SD3Adapter", "flow", 1024, side_multiple=16),
    "flux": Family("branchdiff.models.flux:FluxAdapter", "flow", 1024, side_multiple=16),
    "flux-kontext": Family("branchdiff.models.flux_kontext:FluxKontextAdapter", "flow", 1024, side_multiple=16),  # FLUX.1 Kontext: edits a source image
    "sana": Family("branchdiff.models.sana:SanaAdapter", "flow", 1024, instruction=True, side_multiple=32,
                   uncacheable="its blocks (SanaTransformerBlock) are not in diffusers' block registry"),
    "sd15": Family("branchdiff.models.sd15:SD15Adapter", "ddim", 512, uncacheable="its denoiser is a UNet, without a list of transformer blocks"),
    "z-image": Family("branchdiff.models.z_image:ZImageAdapter", "flow", 1024, side_multiple=16,  # Z-Image(-Turbo), Qwen3 prompts
                      uncacheable="its blocks take one sequence of text and image tokens, padded per forward to its longest prompt"),
    "qwen-image": Family("branchdiff.models.qwen_image:QwenImageAdapter", "flow", 1024, side_multiple=16),  # Qwen-Image, Qwen2.5-VL prompts
    "qwen-image-edit": Family("branchdiff.models.qwen_image_edit:QwenImageEditAdapter", "flow", 1024, side_multiple=16),  # edits source images
    "flux2": Family("branchdiff.models.flux2:Flux2Adapter", "flow", 1024, side_multiple=16),  # FLUX.2 [dev], Mistral 3 prompts
    "flux2-klein": Family("branchdiff.models.flux2:Flux2KleinAdapter", "flow", 1024, side_multiple=16),  # FLUX.2 [klein] 4B / 9B, Qwen3 prompts
    "wan": Family("branchdiff.models.wan:WanAdapter", "flow", (480, 832), frames=81, side_multiple=16),  # Wan 2.1 / 2.2 text-to-video at 480p
    "wan-i2v": Family("branchdiff.models.wan_i2v:WanImageToVideoAdapter", "flow", (480, 832), frames=81, side_multiple=16),  # Wan image-to-video
}
FAMILY_REGISTRY = Registry("family", "branchdiff.families", BUILT_IN)


def installed_families() -> tuple[dict[str, Family], dict[str, str]]:
    """The families installed packages register (`FAMILY_REGISTRY`'s entry points), and for each entry point that
    could not be used, why: it takes a built-in's or another package's name (both sources named), fails
    to import, or is not a `Family`."""
    found, refused = {}, dict(FAMILY_REGISTRY.refused)
    for name, point in FAMILY_REGISTRY.installed.items():
        try:
            spec = point.load()
        except Exception as error:  # a broken plugin must not stop branchdiff: `branchdiff families` shows why
            refused[name] = f"{point.value}: could not be imported ({type(error).__name__}: {error})"
            continue
        if isinstance(spec, Family):
            found[name] = spec
        else:
            refused[name] = f"{point.value}: is a {type(spec).__name__}, not a branchdiff.models.registry.Family"
    return found, refused


PLUGINS, REFUSED_PLUGINS = installed_families()
FAMILIES: dict[str, Family] = {**BUILT_IN, **PLUGINS}
LORA_TARGET_SETS = ("attention", "attention+ff", "all-linear")  # the named LoRA target sets every family's adapter defines
STEP_KINDS = {"flow": ("dance", "flow", "cps"), "ddim": ("ddim",)}  # the SDEs each step family trains with


def image_size(resolution: int | list[int] | tuple[int, ...] | None, default: int | tuple[int, int]) -> tuple[int, int]:
    """(height, width) in pixels from `model.resolution`: H (a square), [H, W], or None (the family's
    `default`: a square's side or (height, width)). Raises ValueError naming the value and what is allowed."""
    if resolution is None:
        return (default, default) if isinstance(default, int) else (default[0], default[1])
    sides = [resolution] if isinstance(resolution, int) and not isinstance(resolution, bool) else resolution
    if (not isinstance(sides, (list, tuple)) or len(sides) not in (1, 2)
            or not all(isinstance(side, int) and not isinstance(side, bool) and 8 <= side <= 8192 for side in sides)):
        raise ValueError(f"'model.resolution' = {resolution!r} is not an image size; give the side H (a square) or [H, W], "
                         "each a whole number of pixels in [8, 8192], e.g. 1024 or [768, 1344]")
    return (sides[0], sides[-1])
