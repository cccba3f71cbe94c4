"""The tiny pipelines of tests/tiny_pipelines.py save, reload offline with `from_pretrained` and
generate images, losslessly and with the documented `latents=` shapes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import tiny_pipelines as tp  # tests/ is on sys.path (pytest's rootdir conftest), as for rewards_for_tests

PROMPTS = ["a red circle", "two blue squares"]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These models are so small that intra-op threads only add overhead; with the cores busy
    (2 threads while other processes run) a 3-step call goes from ~0.1 s to ~4 s (OpenMP spin-waits)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def saved(one_thread, tmp_path_factory) -> dict[str, tuple[object, Path]]:
    """family → (built pipeline, folder it was `save_pretrained` into)."""
    root = tmp_path_factory.mktemp("tiny-pipelines")
    out = {}
    for family in tp.FAMILIES:
        pipe = tp.build_pipeline(family, seed=0)
        pipe.save_pretrained(root / family, safe_serialization=True)
        out[family] = (pipe, root / family)
    return out


class _Reloaded(dict):
    """family → pipeline reloaded from its folder on first access."""

    def __init__(self, saved: dict[str, tuple[object, Path]]) -> None:
        super().__init__()
        self.saved = saved

    def __missing__(self, family: str):
        self[family] = pipe = tp.load_pipeline(family, self.saved[family][1])
        return pipe


@pytest.fixture(scope="module")
def loaded(saved) -> dict[str, object]:
    """family → pipeline reloaded with `<PipelineClass>.from_pretrained(folder)` (once per family)."""
    return _Reloaded(saved)


def generate(pipe, family: str, **kwargs) -> torch.Tensor:
    r = tp.RESOLUTION[family]
    return pipe(
        prompt=PROMPTS, num_inference_steps=3, height=r, width=r, output_type="pt",
        generator=torch.Generator().manual_seed(0), **{tp.GUIDANCE_ARGUMENT.get(family, "guidance_scale"): tp.GUIDANCE_SCALE[family]},
        **tp.CALL_KWARGS[family], **kwargs,
    ).images


def check_images(images: torch.Tensor, family: str) -> None:
    r = tp.RESOLUTION[family]
    assert images.shape == (2, 3, r, r)
    assert torch.isfinite(images).all()
    assert images.min() >= 0 and images.max() <= 1


@pytest.mark.parametrize("family", tp.FAMILIES)
def test_reloaded_pipeline_generates(family, saved, loaded):
    pipe = loaded[family]
    assert type(pipe) is tp.PIPELINE_CLASS[family]
    assert (saved[family][1] / "model_index.json").is_file()
    drawn = []

    def record_latents(pipe, step, timestep, tensors):
        drawn.append(tensors["latents"].shape)
        return tensors

    check_images(generate(pipe, family, callback_on_step_end=record_latents), family)
    packed = {"flux2": (2, 64, 16), "flux2-klein": (2, 64, 16)}  # FLUX.2 takes (B, C, h, w) and packs them into tokens inside its loop
    assert drawn == [packed.get(family, tp.latent_shape(family, batch_size=2))] * 3  # the pipeline's own latents


@pytest.mark.parametrize("family", tp.FAMILIES)
def test_save_reload_is_lossless(family, saved, loaded):
    built, reloaded = saved[family][0], loaded[family]
    before, after = tp.denoiser(built).state_dict(), tp.denoiser(reloaded).state_dict()
    assert before.keys() == after.keys()
    assert all(after[k].dtype == torch.float32 and torch.equal(before[k], after[k]) for k in before)
    # every other model component too (text encoders, VAE)
    for name, component in built.components.items():
        if isinstance(component, torch.nn.Module):
            a, b = component.state_dict(), getattr(reloaded, name).state_dict()
            assert a.keys() == b.keys(), name
            assert all(torch.equal(a[k], b[k]) for k in a), name


@pytest.mark.parametrize("family", tp.FAMILIES)
def test_explicit_latents(family, loaded):
    shape = tp.latent_shape(family, batch_size=2)
    expected = {"sd3": (2, 16, 16, 16), "flux": (2, 64, 64), "sana": (2, 32, 8, 8), "sd15": (2, 4, 16, 16), "z-image": (2, 16, 16, 16),
                "qwen-image": (2, 64, 16), "flux2": (2, 16, 8, 8), "flux2-klein": (2, 16, 8, 8)}
    assert shape == expected[family]  # as documented in tiny_pipelines' docstring
    latents = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    images = generate(loaded[family], family, latents=latents)
    check_images(images, family)


def test_save_and_load_helpers(saved, tmp_path):
    folder = tp.save_pipeline("sana", tmp_path / "sana", seed=0)
    assert folder == tmp_path / "sana" and (folder / "transformer" / "diffusion_pytorch_model.safetensors").is_file()
    reloaded = tp.load_pipeline("sana", folder)
    ref = tp.denoiser(saved["sana"][0]).state_dict()
    assert all(torch.equal(ref[k], v) for k, v in tp.denoiser(reloaded).state_dict().items())


def test_builds_are_deterministic(saved):
    again = tp.build_pipeline("flux", seed=0)
    other = tp.build_pipeline("flux", seed=1)
    ref = tp.denoiser(saved["flux"][0]).state_dict()
    assert all(torch.equal(ref[k], v) for k, v in tp.denoiser(again).state_dict().items())
    assert not all(torch.equal(ref[k], v) for k, v in tp.denoiser(other).state_dict().items())


def test_text_tokenizers_cover_prompts_and_sana_instruction(loaded):
    """The in-code T5 / Gemma vocabularies reload intact and encode SANA's default instruction and the
    test prompts without <unk>; all ids fit the text encoders' vocabularies."""
    chi = "\n".join(tp.sana_default_instruction())
    for family, names in {"sd3": ["tokenizer_3"], "flux": ["tokenizer_2"], "sana": ["tokenizer"]}.items():
        pipe = loaded[family]
        for name in names:
            tok = getattr(pipe, name)
            encoder = getattr(pipe, name.replace("tokenizer", "text_encoder"))
            ids = tok([chi + p for p in PROMPTS], padding="longest").input_ids
            assert all(tok.unk_token_id not in row for row in ids)
            assert max(max(row) for row in ids) < encoder.config.vocab_size
    gemma = loaded["sana"].tokenizer
    assert gemma("a red circle").input_ids[0] == gemma.bos_token_id
    assert loaded["sd3"].tokenizer_3("a red circle").input_ids[-1] == loaded["sd3"].tokenizer_3.eos_token_id
    for family in ("sd3", "flux", "sd15"):  # CLIP prompts are padded to model_max_length
        assert loaded[family].tokenizer.model_max_length == 77
