"""Full fine-tuning and LoRA target sets (`model.finetune`, `model.lora_targets`): which modules each
named set wraps in every family; each mode trains the built-in model and a tiny SD3 pipeline,
resumes bit for bit, and exports what the family's diffusers classes load to the trained output;
full fine-tuning's KL reference and base evaluation use the frozen base. Two processes: in
test_multiprocess.py."""

from __future__ import annotations

import re
import shutil

import pytest
import torch

from branchdiff.cli import main
from branchdiff.errors import ConfigError
from branchdiff.models import load_adapter
from branchdiff.models.finetune import load_weights
from branchdiff.models.lora import add_lora
from branchdiff.settings.load import load_config
from test_model_families import STEPS, TOLERANCE, _ode_images, _pipeline_images
from tiny_pipelines import FAMILIES, RESOLUTION, load_pipeline, save_pipeline

MODES = ["full", "attention", "attention+ff", "all-linear"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("finetune-families")
    return {family: save_pipeline(family, root / family) for family in FAMILIES}


def _wrapped(denoiser: torch.nn.Module) -> set[str]:
    """Module names (block indices as N) that carry a LoRA."""
    return {re.sub(r"\.\d+\.", ".N.", re.sub(r"\.\d+\.", ".N.", name)) for name, module in denoiser.named_modules() if hasattr(module, "lora_A")}


@pytest.mark.parametrize("family", FAMILIES)
def test_each_named_target_set_wraps_more_than_the_one_before(saved, family):
    """attention ⊂ attention+ff ⊂ all-linear, and the feed-forward set adds the MLPs."""
    sets = {}
    for name in ("attention", "attention+ff", "all-linear"):
        adapter = load_adapter(family, str(saved[family]), resolution=RESOLUTION[family])
        add_lora(adapter.denoiser, adapter.lora_targets(name), rank=2, alpha=2.0, seed=0)
        sets[name] = _wrapped(adapter.denoiser)
    assert sets["attention"] < sets["attention+ff"] <= sets["all-linear"] or family == "sana"  # sana's FF is convolutions
    assert all(re.search(r"(attn\d?|attention)\.(to_|add_)", name) for name in sets["attention"])
    added = sets["attention+ff"] - sets["attention"]
    assert added and all(re.search(r"\.(ff|ff_context|feed_forward|img_mlp|txt_mlp)\.|proj_mlp|single_transformer_blocks\.N\.attn\.to_out$", name) for name in added)
    if family != "sana":
        assert sets["attention+ff"] < sets["all-linear"]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_trained_parameter_gets_a_gradient(saved, family):
    """DDP waits for a gradient of every parameter that requires one: with LoRA on every Linear layer and
    with full fine-tuning, one guided prediction's backward reaches all of them (Qwen-Image's last block's
    text output reaches nothing: its adapter leaves those modules untrained)."""
    from branchdiff.models.finetune import FullFinetune, LoraFinetune

    for mode in ("all-linear", "full"):
        adapter = load_adapter(family, str(saved[family]), resolution=RESOLUTION[family])
        finetune = FullFinetune(adapter, keep_base=False) if mode == "full" else LoraFinetune(adapter, mode, rank=2, alpha=2.0, seed=0)
        embeds = adapter.encode_prompts(["a red circle", "two blue squares on the left"])
        latents = torch.randn(2, *adapter.latent_shape, generator=torch.Generator().manual_seed(0))
        schedule = adapter.schedule(STEPS)
        adapter.predict(latents, schedule.model_times[1].expand(2), embeds, 2.0 if family != "flux" else None).square().mean().backward()
        missing = [name for name, parameter in adapter.denoiser.named_parameters() if parameter.requires_grad and parameter.grad is None]
        assert not missing and len(finetune.params) > 0, (mode, missing[:4])


def test_a_list_of_patterns_is_used_as_it_is(tiny_model_dir):
    adapter = load_adapter("tiny", str(tiny_model_dir))
    add_lora(adapter.denoiser, adapter.lora_targets(["to_q", "ff.net.2"]), rank=2, alpha=2.0, seed=0)
    assert _wrapped(adapter.denoiser) == {"transformer_blocks.N.attn.to_q", "transformer_blocks.N.ff.net.2"}


@pytest.mark.parametrize("overrides, message", [
    (["model.lora_targets=attentoin"], "'model.lora_targets' = 'attentoin' is not a named set; allowed: attention, attention+ff, all-linear"),
    (["model.lora_targets=[]"], "'model.lora_targets' = []: give at least one module-name pattern"),
    (["model.finetune=full", "model.dtype=bfloat16"], "'model.finetune' = 'full' trains the denoiser's own weights, which need model.dtype=float32"),
])
def test_finetune_settings_are_checked(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config("tiny-chain", overrides)


def _args(family: str, folder, run, mode: str, iterations: int, *extra: str) -> list[str]:
    model = [f"model.family={family}", f"model.resolution={RESOLUTION[family]}"] if family != "tiny" else []
    what = ["model.finetune=full", "train.learning_rate=1e-3"] if mode == "full" else ["model.finetune=lora", f"model.lora_targets={mode}", "train.learning_rate=0.05"]
    return ["train", "tiny-chain", *model, f"model.path={folder}", f"output_dir={run}", "reward=rewards_for_tests:Redness",
            "prompts.per_iteration=2", f"sampling.num_steps={STEPS}", "tree.roots=3", f"iterations={iterations}", "final_eval=false",
            "logging.report_to=none", "logging.sample_every=0", "logging.checkpoint_every=1", "logging.checkpoints_total_limit=5",
            *what, *extra]


def _exported(run, mode: str, family: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    folder = run / ("lora" if mode != "full" else ("unet" if family == "sd15" else "transformer"))
    return {k: v for file in sorted(folder.glob("*.safetensors")) for k, v in load_file(file).items()}


# the suite: every mode on the built-in model, SD3 with LoRA and full, two newer families' full fine-tuning; a release all of them
RELEASE_ONLY = {("tiny", "attention+ff"), ("sd3", "attention+ff"), ("sd3", "all-linear"), ("flux2", "full"), ("flux2-klein", "full")}


@pytest.mark.parametrize(("family", "mode"), [
    pytest.param(family, mode, marks=[pytest.mark.slow] if (family, mode) in RELEASE_ONLY else [])
    for family, mode in [*((family, mode) for family in ("tiny", "sd3") for mode in MODES), ("z-image", "full"), ("qwen-image", "full"),
                         ("flux2", "full"), ("flux2-klein", "full")]])
def test_each_mode_trains_resumes_bit_for_bit_and_exports_what_diffusers_loads(saved, tiny_model_dir, family, mode, tmp_path):
    folder = tiny_model_dir if family == "tiny" else saved[family]
    run = tmp_path / "run"
    assert main(_args(family, folder, run, mode, 2)) == 0
    resumed = tmp_path / "resumed"
    shutil.copytree(run, resumed)
    shutil.rmtree(resumed / "checkpoints" / "iter-000001")
    assert main(_args(family, folder, resumed, mode, 2, "--resume", "latest")) == 0  # iteration 1 again, from iteration 0's checkpoint
    first, again = _exported(run, mode, family), _exported(resumed, mode, family)
    assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)

    trained = load_adapter(family, str(folder), resolution=RESOLUTION[family] if family != "tiny" else None)
    base_images = _ode_images(trained, STEPS)[1]
    load_weights(trained, run)  # what `sample` / `eval --weights RUN` load
    initial, ours = _ode_images(trained, STEPS)
    assert (ours - base_images).abs().max().item() > 1e-3  # training moved the model
    if family == "tiny":  # no diffusers pipeline: its transformer class or its LoRA loader, through the tiny adapter's own loading
        return
    pipe = load_pipeline(family, folder)
    if mode == "full":
        pipe = type(pipe).from_pretrained(str(folder), transformer=type(pipe.transformer).from_pretrained(str(run / "transformer")))
    else:
        pipe.load_lora_weights(str(run / "lora"))
    theirs = _pipeline_images(pipe, family, initial, STEPS, trained.default_guidance)
    assert (theirs - ours).abs().max().item() <= TOLERANCE


def test_full_finetuning_measures_kl_and_evaluates_the_base_against_the_frozen_copy(tiny_model_dir, tmp_path):
    """The KL reference and the final evaluation's base are the weights before training, not the
    trained ones: KL is 0 before the first update and > 0 after it; the base scores equal a fresh
    model's."""
    from branchdiff.evaluation.evaluate import summarize
    from branchdiff.training.recipe import Trainer

    config = load_config(None, _args("tiny", tiny_model_dir, tmp_path / "run", "full", 2, "train.kl_beta=0.1", "final_eval=true")[2:])
    trainer = Trainer(config)
    first = trainer.run_iteration(0).metrics
    second = trainer.run_iteration(1).metrics
    assert first["kl"] == 0.0 and second["kl"] > 0
    with trainer.finetune.base() as base:
        base_scores = summarize(trainer.evaluation.evaluate(base))["all"]
    fresh = load_adapter("tiny", str(tiny_model_dir))
    assert summarize(trainer.evaluation.evaluate(fresh))["all"] == base_scores
    assert summarize(trainer.evaluation.evaluate(trainer.adapter))["all"] != base_scores
