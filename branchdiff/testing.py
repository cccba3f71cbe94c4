"""Checks a family must pass, for the authors of families in other packages (docs/models.md,
"Families from other packages"): the ones branchdiff's own families pass in its test suite.

`check_family(family, folder)` loads a small (random is fine) pipeline saved in `folder` through the
family's adapter and checks, at each size given:

1. sampling: branchdiff's ODE chains (noise level 0, the family's schedule and default guidance)
   from the same initial latents equal the pipeline's own `__call__` within `tolerance`;
2. LoRA: an adapter on the family's `attention` targets with random (non-zero) B matrices, exported
   as a run exports it, loads with `pipe.load_lora_weights()`, and the pipeline then makes the
   adapter's images within `tolerance` (which differ from the base's).

It raises AssertionError naming the check, size and difference; returns the differences measured.
Use it from a test of your package: `check_family("my-model", tmp_path / "tiny")`.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from branchdiff.core.rollout import NoiseAddress, SamplerSettings, grow
from branchdiff.core.tree import TreeSpec, build_tree
from branchdiff.models import adapter_class, load_adapter
from branchdiff.models.base import ModelAdapter
from branchdiff.models.finetune import LoraFinetune
from branchdiff.models.lora import pipeline_class
from branchdiff.models.registry import FAMILIES

PROMPTS = ("a red circle on the left", "two blue squares at the top")
MOVED = 1e-3  # a random LoRA must change the images at least this much, or the round trip proves nothing


def check_family(family: str, folder: str | Path, sizes: tuple[tuple[int, int], ...] = ((32, 32), (32, 16)), steps: int = 4,
                 tolerance: float = 1e-4, call_kwargs: dict | None = None) -> dict[str, float]:
    """Both checks (module doc) at every (height, width) of `sizes`; `call_kwargs` go to the pipeline's
    `__call__` (e.g. SANA's `use_resolution_binning=False`). Returns {"<check> <h>x<w>": max difference}."""
    if adapter_class(family).edits:
        raise ValueError(f"check_family compares families that make images from text with their pipelines; {family} edits source images, "
                         "whose pipelines take them in their own ways: compare its edits with its pipeline's in a test of your own "
                         "(branchdiff's tests/test_editing.py shows how)")
    measured = {}
    for height, width in sizes:
        adapter = load_adapter(family, str(folder), resolution=[height, width])
        initial, ours = _ode_samples(adapter, steps)
        pipe = _pipeline(adapter, folder)
        theirs = _pipeline_samples(pipe, adapter, initial, steps, call_kwargs or {})
        measured[f"sampling {height}x{width}"] = _compare("sampling", ours, theirs, height, width, tolerance)
        LoraFinetune(adapter, "attention", rank=4, alpha=16.0, seed=0)
        with torch.no_grad():
            for name, parameter in adapter.denoiser.named_parameters():
                if "lora_B" in name:
                    parameter.copy_(0.05 * torch.randn(parameter.shape, generator=torch.Generator().manual_seed(len(name))))
        _, trained = _ode_samples(adapter, steps)
        if (trained - ours).abs().max().item() <= MOVED:
            raise AssertionError(f"{family} LoRA {height}x{width}: a random LoRA on the 'attention' targets left the output unchanged; "
                                 "do the family's lora_target_sets name modules of its denoiser?")
        with tempfile.TemporaryDirectory() as export:
            adapter.save_lora(Path(export))
            pipe.load_lora_weights(export)
            loaded = _pipeline_samples(pipe, adapter, initial, steps, call_kwargs or {})
        measured[f"lora {height}x{width}"] = _compare("LoRA", trained, loaded, height, width, tolerance)
    return measured


def _ode_samples(adapter: ModelAdapter, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(initial latents, decoded samples) of one ODE chain per prompt."""
    tree = build_tree(TreeSpec(steps, roots=1, sde_steps=frozenset()), len(PROMPTS))
    with torch.no_grad():
        rollout = grow(adapter, tree, adapter.encode_prompts(list(PROMPTS)), adapter.schedule(steps), SamplerSettings(),
                       NoiseAddress(3, 0, (0, 1)))
    roots = torch.arange(tree.level_start[0], tree.level_start[1])
    return rollout.latents[roots], adapter.decode(rollout.leaf_latents)


def _pipeline(adapter: ModelAdapter, folder: str | Path):
    pipe = pipeline_class(adapter.pipeline_class_name).from_pretrained(str(folder), dtype=adapter.dtype)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _pipeline_samples(pipe, adapter: ModelAdapter, initial: torch.Tensor, steps: int, call_kwargs: dict) -> torch.Tensor:
    video = FAMILIES[adapter.family].video
    arguments = {"num_frames": adapter.frames} if video else {}
    output = pipe(prompt=list(PROMPTS), num_inference_steps=steps, height=adapter.height, width=adapter.width,
                  latents=initial.clone(), output_type="pt", **adapter.pipeline_call_arguments(adapter.default_guidance), **arguments,
                  **call_kwargs)
    return output.frames if video else output.images


def _compare(check: str, ours: torch.Tensor, theirs: torch.Tensor, height: int, width: int, tolerance: float) -> float:
    if ours.shape != theirs.shape:
        raise AssertionError(f"{check} {height}x{width}: branchdiff made {tuple(ours.shape)}, the pipeline {tuple(theirs.shape)}")
    difference = (ours - theirs).abs().max().item()
    if difference > tolerance:
        raise AssertionError(f"{check} {height}x{width}: branchdiff and the pipeline differ by {difference:.3g} (> {tolerance:g})")
    return difference
