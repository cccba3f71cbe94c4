"""Every model family against diffusers: a tiny random pipeline of the family's classes is saved,
loaded through the adapter's real loading code, and branchdiff's ODE sampling (noise level 0, the
family's own schedule and guidance) from the same initial latents must give the pipeline's own
`__call__` images. Then a tree rollout, one training step with the log-prob check, and a LoRA
export with lora_alpha ≠ rank that `pipe.load_lora_weights()` loads to the trained adapter's output."""

from __future__ import annotations

import json

import pytest
import torch

from branchdiff.core.rollout import NoiseAddress, SamplerSettings, grow
from branchdiff.core.tree import TreeSpec, build_tree
from branchdiff.models import load_adapter
from tiny_pipelines import CALL_KWARGS, FAMILIES, GUIDANCE_ARGUMENT, RESOLUTION, load_pipeline, save_pipeline

PROMPTS = ["a red circle on the left", "two blue squares at the top"]
# FLUX.2 [dev] shares its adapter's code with [klein] but for the text encoder and the guidance: the checks below that
# exercise branchdiff's own machinery (objectives, flags, quantisation, search) run on [dev] in the release suite only
SHARED_CODE_SLOW = [pytest.param(family, marks=pytest.mark.slow) if family == "flux2" else family for family in FAMILIES]
STEPS = 4
TOLERANCE = 1e-4  # max abs difference of images in [0, 1], fp32


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {family: save_pipeline(family, root / family) for family in FAMILIES}


def _ode_images(adapter, num_steps: int, guidance: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """branchdiff's ODE chains for PROMPTS, one per prompt: (initial latents, images)."""
    tree = build_tree(TreeSpec(num_steps, roots=1, sde_steps=frozenset()), len(PROMPTS))
    settings = SamplerSettings(guidance=guidance)
    rollout = grow(adapter, tree, adapter.encode_prompts(PROMPTS), adapter.schedule(num_steps), settings, NoiseAddress(3, 0, (0, 1)))
    roots = torch.arange(tree.level_start[0], tree.level_start[1])
    return rollout.latents[roots], adapter.decode(rollout.leaf_latents)


def _pipeline_images(pipe, family: str, latents: torch.Tensor, num_steps: int, guidance: float,
                     size: tuple[int, int] | None = None, prompts: list[str] = PROMPTS) -> torch.Tensor:
    height, width = size or (RESOLUTION[family], RESOLUTION[family])
    # a copy: ZImagePipeline writes its chat-templated prompts into the list it is given
    return pipe(prompt=list(prompts), num_inference_steps=num_steps, height=height, width=width, latents=latents.clone(), output_type="pt",
                **{GUIDANCE_ARGUMENT.get(family, "guidance_scale"): guidance}, **CALL_KWARGS[family]).images


@pytest.mark.parametrize("family", FAMILIES)
def test_ode_sampling_reproduces_the_diffusers_pipeline(saved, family):
    adapter = load_adapter(family, str(saved[family]), resolution=RESOLUTION[family])
    initial, ours = _ode_images(adapter, STEPS)
    pipe = load_pipeline(family, saved[family])
    theirs = _pipeline_images(pipe, family, initial, STEPS, adapter.default_guidance)
    assert ours.shape == theirs.shape == (len(PROMPTS), 3, RESOLUTION[family], RESOLUTION[family])
    assert ours.std() > 1e-3  # not a constant image
    assert (ours - theirs).abs().max().item() <= TOLERANCE


@pytest.mark.parametrize("family", ["sd3", "sd15"])
def test_guidance_is_a_setting_and_changes_the_images(saved, family):
    """Evaluation guidance is its own setting: guidance 1 (no CFG, one row) reproduces the pipeline
    at guidance 1 and differs from the default."""
    adapter = load_adapter(family, str(saved[family]), resolution=RESOLUTION[family])
    initial, unguided = _ode_images(adapter, STEPS, guidance=1.0)
    theirs = _pipeline_images(load_pipeline(family, saved[family]), family, initial, STEPS, 1.0)
    assert (unguided - theirs).abs().max().item() <= TOLERANCE
    assert (unguided - _ode_images(adapter, STEPS)[1]).abs().max().item() > 1e-3
    assert adapter.rows_per_sample(1.0) == 1 and adapter.rows_per_sample(adapter.default_guidance) == 2


@pytest.mark.parametrize("layout", ["sd3.5-large", "sd3.5-medium"])
def test_sd35_large_and_medium_layouts_pass_the_family_checks(tmp_path, layout):
    """SD3.5 Large (QK RMS-norm) and Medium (QK norm, dual attention) through `sd3`: the transformer's options
    come from the checkpoint's config; sampling equals the pipeline's and a LoRA round-trips (branchdiff.testing)
    at a square and a non-square size."""
    from branchdiff.testing import check_family
    from tiny_pipelines import build_sd3

    build_sd3(layout).save_pretrained(tmp_path / layout, safe_serialization=True)
    measured = check_family("sd3", tmp_path / layout, sizes=((32, 32), (32, 16)))
    assert len(measured) == 4 and max(measured.values()) <= TOLERANCE


def test_z_image_guides_as_its_pipeline_does(saved):
    """Z-Image's pipeline guides at any scale g > 0 with pos + g·(pos − neg) and not at 0 (Z-Image-Turbo's
    setting): both equal `pipe(guidance_scale=g)`, 0 with one network row per sample, 1 with two."""
    adapter = load_adapter("z-image", str(saved["z-image"]), resolution=RESOLUTION["z-image"])
    for guidance, rows in ((0.0, 1), (1.0, 2)):
        initial, ours = _ode_images(adapter, STEPS, guidance=guidance)
        theirs = _pipeline_images(load_pipeline("z-image", saved["z-image"]), "z-image", initial, STEPS, guidance)
        assert adapter.rows_per_sample(guidance) == rows and (ours - theirs).abs().max().item() <= TOLERANCE


def test_a_step_distilled_flux2_klein_samples_unguided_as_its_pipeline(saved, tmp_path):
    """FLUX.2 [klein]'s distilled models (`is_distilled` in the pipeline's config) ignore the guidance
    scale: one network row per sample, and the images equal `pipe(guidance_scale=4)`; the base guides."""
    pipe = load_pipeline("flux2-klein", saved["flux2-klein"])
    pipe.register_to_config(is_distilled=True)
    pipe.save_pretrained(tmp_path, safe_serialization=True)
    adapter = load_adapter("flux2-klein", str(tmp_path), resolution=RESOLUTION["flux2-klein"])
    initial, ours = _ode_images(adapter, STEPS, guidance=4.0)
    theirs = _pipeline_images(load_pipeline("flux2-klein", tmp_path), "flux2-klein", initial, STEPS, 4.0)
    assert adapter.rows_per_sample(4.0) == 1 and (ours - theirs).abs().max().item() <= TOLERANCE
    base = load_adapter("flux2-klein", str(saved["flux2-klein"]), resolution=RESOLUTION["flux2-klein"])
    assert base.rows_per_sample(4.0) == 2 and (_ode_images(base, STEPS, guidance=4.0)[1] - ours).abs().max().item() > 1e-3


def _train_overrides(family: str, folder, run_dir, *extra: str) -> list[str]:
    sde = ["sampling.sde=ddim", "sampling.noise_level=1.0"] if family == "sd15" else ["sampling.sde=flow", "sampling.noise_level=0.7"]
    return [f"model.family={family}", f"model.path={folder}", f"model.resolution={RESOLUTION.get(family, 32)}", f"output_dir={run_dir}",
            "reward=rewards_for_tests:Redness", "prompts.per_iteration=2", f"sampling.num_steps={STEPS}", "tree.roots=2",
            "tree.splits=[[0,2]]", "iterations=1", "final_eval=false", "logging.report_to=none", "logging.sample_every=0",
            "train.lora_rank=4", "train.lora_alpha=16", "train.learning_rate=0.05", *sde, *extra]


@pytest.mark.parametrize("family", FAMILIES)
def test_tree_training_step_and_lora_export_load_into_the_pipeline(saved, family, tmp_path):
    """A tree rollout (2 roots split in 2 at step 0: 14 forwards per prompt, twice that under CFG),
    one update whose recomputed log-probs match the rollout's (≤ 1e-5), and the LoRA a run exports
    (alpha 16, rank 4) loaded by diffusers: the pipeline's output equals the trained adapter's; the
    run's model card beside it says how to load it into the family's pipeline."""
    from branchdiff.settings.load import load_config
    from branchdiff.training.recipe import Trainer, train

    trainer = Trainer(load_config(None, _train_overrides(family, saved[family], tmp_path / "run")))
    train(trainer)  # the run: its iteration, checkpoint, report, the LoRA export RUN/lora and its model card RUN/README.md
    metrics = json.loads((trainer.run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    guidance_rows = trainer.adapter.rows_per_sample(trainer.adapter.default_guidance)
    assert metrics["nfe_rollout"] == 2 * (2 + 4 * (STEPS - 1)) * guidance_rows
    assert metrics["optimizer_steps"] == 1 and metrics["edges_trained"] > 0
    assert metrics["logprob_check"] <= 1e-5
    pipe = load_pipeline(family, saved[family])
    card = (trainer.run_dir / "README.md").read_text()
    assert f"{type(pipe).__name__}.from_pretrained" in card and "load_lora_weights" in card
    initial, trained = _ode_images(trainer.adapter, STEPS)
    base = _pipeline_images(pipe, family, initial, STEPS, trainer.adapter.default_guidance)
    pipe.load_lora_weights(str(trainer.run_dir / "lora"))
    loaded = _pipeline_images(pipe, family, initial, STEPS, trainer.adapter.default_guidance)
    assert (trained - base).abs().max().item() > 1e-3  # the update moved the model
    assert (loaded - trained).abs().max().item() <= TOLERANCE


@pytest.mark.parametrize("family", SHARED_CODE_SLOW)
def test_the_other_objectives_train_a_step_of_every_flow_family_and_refuse_ddim(saved, family, tmp_path):
    """GRPO-Guard (its ratio 1 before the update: the rollout's means recovered from the noise),
    LayerTuning-RL and DiffusionNFT take one optimizer step on each flow family's tiny pipeline; an
    ε-prediction (DDIM) family is refused with the fix."""
    from branchdiff.errors import ConfigError
    from branchdiff.settings.load import load_config
    from branchdiff.training.recipe import Trainer

    for loss in ("grpo-guard", "grpo-layertuning", "nft"):
        if family == "sd15":  # refused when the settings are read, before the pipeline loads
            with pytest.raises(ConfigError, match="use train.loss=grpo"):
                load_config(None, _train_overrides(family, saved[family], tmp_path / loss, f"train.loss={loss}"))
            continue
        config = load_config(None, _train_overrides(family, saved[family], tmp_path / loss, f"train.loss={loss}"))
        trainer = Trainer(config)
        before = [p.detach().clone() for p in trainer.finetune.params]
        metrics = trainer.run_iteration(0).metrics
        assert metrics["optimizer_steps"] == 1 and torch.isfinite(torch.tensor(metrics["loss"]))
        assert any(not torch.equal(b, p) for b, p in zip(before, trainer.finetune.params))
        if loss == "grpo-guard":
            assert metrics["logprob_check"] <= 1e-5 and abs(metrics["log_ratio_guard"]) <= 1e-6


NEW_OBJECTIVES_FAMILIES = [family if family == "sd3" else pytest.param(family, marks=pytest.mark.slow) for family in FAMILIES if family != "sd15"]


@pytest.mark.parametrize("family", NEW_OBJECTIVES_FAMILIES)
def test_awm_dgpo_dppo_and_dpo_train_a_step_of_every_flow_family(saved, family, tmp_path):
    """AWM, DGPO, Flow-DPPO (its ratio 1 before the update) and online DPO take an optimizer step on each flow
    family's tiny pipeline (SD3 in the suite, the others in the release suite: the objectives' code is the same
    for every family, the adapters' calls are those GRPO and NFT make)."""
    from branchdiff.settings.load import load_config
    from branchdiff.training.recipe import Trainer

    for loss in ("awm", "dgpo", "dppo", "dpo"):
        trainer = Trainer(load_config(None, _train_overrides(family, saved[family], tmp_path / loss, f"train.loss={loss}", "tree.roots=3")))
        before = [p.detach().clone() for p in trainer.finetune.params]
        metrics = trainer.run_iteration(0).metrics
        assert metrics["optimizer_steps"] == 1 and torch.isfinite(torch.tensor(metrics["loss"])), (loss, metrics)
        assert any(not torch.equal(b, p) for b, p in zip(before, trainer.finetune.params)), loss
        if loss == "dppo":
            assert metrics["logprob_check"] <= 1e-5


def test_sd3_encodes_images_as_its_vae_decodes_latents_and_trains_sft_on_a_file_set(saved, tmp_path):
    """`encode_images` is the inverse of the latents' mapping into the VAE: vae_input(encode(x)) is the VAE's
    posterior mean of x in [−1, 1]; SFT on a JSONL of PNGs takes an optimizer step on the tiny SD3 pipeline."""
    from PIL import Image

    from branchdiff.settings.load import load_config
    from branchdiff.training.recipe import Trainer

    adapter = load_adapter("sd3", saved["sd3"], "cpu", (32, 32))
    images = torch.rand(3, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    latents = adapter.encode_images(images)
    assert latents.shape == (3, *adapter.latent_shape)
    with torch.no_grad():
        expected = adapter.pipe.vae.encode(images * 2 - 1).latent_dist.mode()
    assert torch.allclose(adapter.vae_input(latents), expected, atol=1e-5)
    for i in range(len(PROMPTS)):
        Image.fromarray((images[i].permute(1, 2, 0).numpy() * 255).astype("uint8")).save(tmp_path / f"{i}.png")
    (tmp_path / "demos.jsonl").write_text("".join(json.dumps({"prompt": p, "image": f"{i}.png"}) + "\n" for i, p in enumerate(PROMPTS)))
    config = load_config(None, _train_overrides("sd3", saved["sd3"], tmp_path / "run", "train.loss=sft", f"sft.data={tmp_path / 'demos.jsonl'}"))
    trainer = Trainer(config)
    before = [p.detach().clone() for p in trainer.finetune.params]
    metrics = trainer.run_iteration(0).metrics
    assert metrics["optimizer_steps"] == 1 and metrics["rows"] == 2 and any(not torch.equal(b, p) for b, p in zip(before, trainer.finetune.params))


@pytest.mark.parametrize("family", SHARED_CODE_SLOW)
def test_sample_and_eval_take_the_same_flags_for_every_family(saved, family, tmp_path, capsys):
    from branchdiff.cli import main

    common = ["--family", family, "--model", str(saved[family]), "--resolution", str(RESOLUTION[family]), "--steps", "2",
              "--images-per-prompt", "2"]
    assert main(["sample", *common, "--prompt", "a red circle", "--out", str(tmp_path / "samples")]) == 0
    assert len(list((tmp_path / "samples").glob("*.png"))) == 2
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle\ntwo blue squares\n")
    assert main(["eval", *common, "--guidance", "2.0", "--prompts", str(prompts), "--rewards", "rewards_for_tests:Redness",
                 "--out", str(tmp_path / "eval")]) == 0
    assert len(list((tmp_path / "eval" / "images").rglob("*.jpg"))) == 4
    assert "rewards_for_tests:Redness" in capsys.readouterr().out


def test_offload_keeps_encoders_and_vae_off_the_device_between_uses(saved):
    """With offload the helpers live on the CPU and visit the device only while they run; the
    outputs are those of the adapter without offload (the device here is the CPU, so placement is
    checked through the `.to` calls the adapter makes)."""
    moves: list[str] = []
    adapter = load_adapter("sd3", str(saved["sd3"]), resolution=RESOLUTION["sd3"], offload=True)
    plain = load_adapter("sd3", str(saved["sd3"]), resolution=RESOLUTION["sd3"])
    def recording(original, name: str):
        def to(*args, **kwargs):
            moves.append(f"{name}->{args[0]}")
            return original(*args, **kwargs)
        return to

    for module in adapter.helpers():
        module.to = recording(module.to, type(module).__name__)
    embeds, reference = adapter.encode_prompts(PROMPTS), plain.encode_prompts(PROMPTS)
    assert all(torch.equal(embeds[k], reference[k]) for k in reference)
    encoders = [type(m).__name__ for m in adapter.text_encoders]
    assert moves == [f"{n}->{adapter.device}" for n in encoders] + [f"{n}->cpu" for n in encoders]
    moves.clear()
    latents = torch.randn(2, *adapter.latent_shape)
    assert torch.equal(adapter.decode(latents), plain.decode(latents))
    assert moves == [f"AutoencoderKL->{adapter.device}", "AutoencoderKL->cpu"]


def test_memory_controls_gradient_checkpointing_and_8bit_adam(saved, tmp_path):
    """Gradient checkpointing gives the same update as without (same loss, same LoRA after the
    step); 8-bit AdamW (bitsandbytes) trains; LoRA parameters are fp32 over bf16 base weights."""
    from branchdiff.settings.load import load_config
    from branchdiff.training.recipe import Trainer

    def lora_after_one_iteration(*extra: str) -> tuple[dict, dict]:
        trainer = Trainer(load_config(None, _train_overrides("flux", saved["flux"], tmp_path / "-".join(extra), *extra)))
        metrics = trainer.run_iteration(0).metrics
        return metrics, {n: p.detach().clone() for n, p in trainer.adapter.denoiser.named_parameters() if "lora_" in n}

    plain_metrics, plain = lora_after_one_iteration()
    checkpointed_metrics, checkpointed = lora_after_one_iteration("train.gradient_checkpointing=true")
    assert checkpointed_metrics["loss"] == pytest.approx(plain_metrics["loss"], rel=1e-5, abs=1e-7)
    assert all(torch.allclose(plain[k], checkpointed[k], atol=1e-6) for k in plain)
    adam8_metrics, adam8 = lora_after_one_iteration("train.optimizer=adamw8bit")
    assert adam8_metrics["optimizer_steps"] == 1 and any(not torch.equal(adam8[k], plain[k]) for k in plain)
    trainer = Trainer(load_config(None, _train_overrides("flux", saved["flux"], tmp_path / "bf16", "model.dtype=bfloat16")))
    lora = [p for n, p in trainer.adapter.denoiser.named_parameters() if "lora_" in n]
    base = [p for n, p in trainer.adapter.denoiser.named_parameters() if "lora_" not in n]
    assert {p.dtype for p in lora} == {torch.float32} and {p.dtype for p in base} == {torch.bfloat16}
    assert trainer.run_iteration(0).metrics["optimizer_steps"] == 1


@pytest.mark.parametrize("family", SHARED_CODE_SLOW)
def test_a_quantised_explorer_keeps_the_adapters_skip_modules_in_full_precision(saved, family):
    """Every pattern of the adapter's quant_skip_modules names modules of its denoiser, and those
    stay out of the quantised copy while the attention projections are quantised."""
    from branchdiff.explore.quant import QuantConfig, is_skipped, quantized_layer_names

    adapter = load_adapter(family, str(saved[family]), resolution=RESOLUTION[family])
    names = [name for name, _ in adapter.denoiser.named_modules()]
    for pattern in adapter.quant_skip_modules:
        assert any(is_skipped(name, (pattern,)) for name in names), pattern
    quantized = quantized_layer_names(adapter.denoiser, QuantConfig("nvfp4-emulated", adapter.quant_skip_modules))
    assert quantized and not any(is_skipped(name, adapter.quant_skip_modules) for name in quantized)
    assert any(name.endswith("to_q") for name in quantized)


@pytest.mark.parametrize("family", SHARED_CODE_SLOW)
def test_sample_search_runs_for_every_family_and_its_winner_regrows(saved, family, tmp_path):
    """`sample --search dts-star` with a reward on each family's tiny pipeline (CFG counted: two rows
    a prediction where the family guides), then `--from-trace`: the same best image, byte for byte."""
    import json

    from branchdiff.cli import main

    common = ["--family", family, "--model", str(saved[family]), "--resolution", str(RESOLUTION[family]), "--steps", "3"]
    budget = 4 * 3 * 2  # four images' rows under CFG
    assert main(["sample", *common, "--prompt", "a red circle", "--search", "dts-star", "--budget", str(budget), "--max-children", "2",
                 "--reward", "rewards_for_tests:Redness", "--out", str(tmp_path / "search")]) == 0
    recorded = json.loads((tmp_path / "search" / "search.json").read_text())
    entry = recorded["prompts"][0]
    assert 0 < entry["nfe"] <= budget and len(entry["rounds"]) >= 2
    image = entry["best"][0]["image"]
    assert main(["sample", *common, "--from-trace", str(tmp_path / "search" / "search.json"), "--out", str(tmp_path / "again")]) == 0
    assert (tmp_path / "again" / image).read_bytes() == (tmp_path / "search" / image).read_bytes()


NON_SQUARE = {"sd3": (32, 16), "flux": (32, 16), "sana": (32, 64), "sd15": (16, 32), "z-image": (16, 32), "qwen-image": (16, 48), "flux2": (16, 32), "flux2-klein": (48, 16)}  # (height, width): multiples of each family's step


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_samples_trains_and_evaluates_at_a_non_square_size(saved, family, tmp_path):
    """model.resolution [H, W]: the ODE output equals the pipeline's own at height × width (FLUX's
    packing and image ids, SANA without resolution binning), a tree iteration trains with the log-prob
    check, and `eval --resolution HxW` writes H × W images."""
    from torchvision.io import read_image

    from branchdiff.cli import main
    from branchdiff.settings.load import load_config
    from branchdiff.training.recipe import Trainer

    height, width = NON_SQUARE[family]
    adapter = load_adapter(family, str(saved[family]), resolution=[height, width])
    initial, ours = _ode_images(adapter, STEPS)
    theirs = _pipeline_images(load_pipeline(family, saved[family]), family, initial, STEPS, adapter.default_guidance, (height, width))
    assert ours.shape == theirs.shape == (len(PROMPTS), 3, height, width)
    assert ours.std() > 1e-3 and (ours - theirs).abs().max().item() <= TOLERANCE
    overrides = [o for o in _train_overrides(family, saved[family], tmp_path / "run") if not o.startswith("model.resolution")]
    trainer = Trainer(load_config(None, [*overrides, f"model.resolution=[{height},{width}]"]))
    metrics = trainer.run_iteration(0).metrics
    assert metrics["optimizer_steps"] == 1 and metrics["logprob_check"] <= 1e-5
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    assert main(["eval", "--family", family, "--model", str(saved[family]), "--resolution", f"{height}x{width}", "--steps", "2",
                 "--images-per-prompt", "1", "--prompts", str(prompts), "--rewards", "rewards_for_tests:Redness",
                 "--out", str(tmp_path / "eval")]) == 0
    image = read_image(str(next((tmp_path / "eval" / "images").rglob("*.jpg"))))
    assert tuple(image.shape) == (3, height, width)
