"""Wan text-to-video against diffusers (branchdiff/models/wan.py; issue 28's second piece): tiny random
Wan pipelines of the same diffusers / transformers classes (one expert, as Wan 2.1; two, as Wan 2.2
A14B) are saved and loaded through the adapter's loading code, and branchdiff's ODE sampling from the
same initial latents equals `pipe(...)`'s video at two frame counts and a non-square size; the
released UniPC solver (`--solver release`) equals it too; rows of one batch on both sides of the
experts' boundary equal their separate calls; a LoRA export loads with `pipe.load_lora_weights()` to
the adapter's video; sizes and frame counts the model cannot make are refused with one line."""

from __future__ import annotations

import pytest
import torch

from branchdiff.core.rollout import NoiseAddress, SamplerSettings, grow
from branchdiff.core.tree import TreeSpec, build_tree
from branchdiff.models.wan import WanAdapter
from tiny_pipelines import build_wan

PROMPTS = ["a red circle moving left", "two blue squares moving up"]
STEPS = 4
SIZE = (16, 32)  # non-square: height, width
TOLERANCE = 1e-4  # max abs difference of frames in [0, 1], fp32


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("wan")
    folders = {}
    for name, options in {"one": {}, "two": {"two_experts": True}, "release": {"release": True}}.items():
        build_wan(**options).save_pretrained(root / name, safe_serialization=True)
        folders[name] = root / name
    return folders


def _pipe(folder):
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(folder, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _pipeline_video(pipe, initial: torch.Tensor, frames: int, guidance: float) -> torch.Tensor:
    return pipe(prompt=PROMPTS, num_inference_steps=STEPS, height=SIZE[0], width=SIZE[1], num_frames=frames, guidance_scale=guidance,
                latents=initial.clone(), output_type="pt", max_sequence_length=WanAdapter.max_sequence_length).frames


def _ode_video(adapter: WanAdapter) -> tuple[torch.Tensor, torch.Tensor]:
    tree = build_tree(TreeSpec(STEPS, roots=1, sde_steps=frozenset()), len(PROMPTS))
    with torch.no_grad():
        rollout = grow(adapter, tree, adapter.encode_prompts(PROMPTS), adapter.schedule(STEPS), SamplerSettings(), NoiseAddress(3, 0, (0, 1)))
    roots = torch.arange(tree.level_start[0], tree.level_start[1])
    return rollout.latents[roots], adapter.decode(rollout.leaf_latents)


@pytest.mark.parametrize("experts", ["one", "two"])
@pytest.mark.parametrize("frames", [5, 9])
def test_ode_sampling_reproduces_the_wan_pipeline(saved, experts, frames):
    adapter = WanAdapter.from_pretrained(str(saved[experts]), size=SIZE, frames=frames)
    assert adapter.latent_shape == (4, (frames - 1) // 2 + 1, SIZE[0] // 2, SIZE[1] // 2)
    initial, ours = _ode_video(adapter)
    theirs = _pipeline_video(_pipe(saved[experts]), initial, frames, adapter.default_guidance)
    assert ours.shape == theirs.shape == (len(PROMPTS), frames, 3, *SIZE)
    assert ours.std() > 1e-3 and (ours - theirs).abs().max().item() <= TOLERANCE
    if experts == "two":  # the schedule crosses the boundary: both experts ran
        times = adapter.schedule(STEPS).model_times
        assert (times >= adapter.boundary).any() and (times < adapter.boundary).any()


def test_rows_on_both_sides_of_the_boundary_equal_their_separate_calls(saved):
    adapter = WanAdapter.from_pretrained(str(saved["two"]), size=SIZE, frames=5)
    embeds = adapter.encode_prompts(PROMPTS)
    latents = torch.randn((2, *adapter.latent_shape), generator=torch.Generator().manual_seed(0))
    times = torch.tensor([900.0, 300.0])  # the first for `transformer`, the second for `transformer_2`
    with torch.no_grad():
        together = adapter.predict(latents, times, embeds)
        apart = torch.cat([adapter.predict(latents[i : i + 1], times[i : i + 1], {k: v[i : i + 1] for k, v in embeds.items()}) for i in (0, 1)])
        first_only = adapter._expert(adapter.denoiser, latents[1:], times[1:], embeds["encoder_hidden_states"][1:])
    assert torch.allclose(together, apart, atol=1e-6)
    assert not torch.allclose(first_only, adapter._expert(adapter.second, latents[1:], times[1:], embeds["encoder_hidden_states"][1:]))


def test_the_release_solver_reproduces_the_pipeline_with_unipc(saved):
    adapter = WanAdapter.from_pretrained(str(saved["release"]), size=SIZE, frames=5)
    assert "UniPCMultistepScheduler" in adapter.solver_notice()
    initial = torch.randn((len(PROMPTS), *adapter.latent_shape), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = adapter.decode(adapter.release_denoise(initial.clone(), adapter.encode_prompts(PROMPTS), STEPS, adapter.default_guidance))
    theirs = _pipeline_video(_pipe(saved["release"]), initial, 5, adapter.default_guidance)
    assert ours.std() > 1e-3 and (ours - theirs).abs().max().item() <= TOLERANCE


def test_a_lora_export_loads_into_the_pipeline_to_the_same_video(saved, tmp_path):
    from branchdiff.models.finetune import LoraFinetune

    adapter = WanAdapter.from_pretrained(str(saved["one"]), size=SIZE, frames=5)
    finetune = LoraFinetune(adapter, "attention+ff", rank=4, alpha=16.0, seed=0)
    with torch.no_grad():
        for name, param in adapter.denoiser.named_parameters():
            if "lora_B" in name:
                param.copy_(0.05 * torch.randn(param.shape, generator=torch.Generator().manual_seed(len(name))))
    finetune.write_export(finetune.trained_state(), tmp_path / "lora")
    initial, ours = _ode_video(adapter)
    pipe = _pipe(saved["one"])
    base = _pipeline_video(pipe, initial, 5, adapter.default_guidance)
    pipe.load_lora_weights(str(tmp_path / "lora"))
    loaded = _pipeline_video(pipe, initial, 5, adapter.default_guidance)
    assert (ours - base).abs().max().item() > 1e-3  # the LoRA changes the video
    assert (loaded - ours).abs().max().item() <= TOLERANCE


def test_sizes_and_frame_counts_it_cannot_make_are_refused(saved):
    with pytest.raises(ValueError, match=r"model.frames=6: a Wan video has r·k \+ 1 frames \(r = 2, the VAE's temporal factor\), e.g. 5"):
        WanAdapter.from_pretrained(str(saved["one"]), size=SIZE, frames=6)
    with pytest.raises(ValueError, match=r"model.resolution=\[24, 32\] \(height, width\) is not possible for wan: each side must be a multiple "
                                         r"of 16 \(e.g. \[32, 32\]\)"):
        WanAdapter.from_pretrained(str(saved["one"]), size=(24, 32), frames=5)
    assert WanAdapter.folder_multiple(saved["one"]) == 16
