"""FSDP2 (branchdiff/runtime/sharding.py) against DDP, on two CPU processes (gloo) launched once with the
packaged `fsdp` accelerate config (tests/sharded_runs.py runs several trainings in that launch): a
tiny SD3 pipeline trained for two iterations with LoRA and with full fine-tuning, under DDP and under
FSDP2 (LoRA once more with the shards in CPU memory); the same runs stopped after the first iteration
and resumed; the FSDP LoRA run evaluates every
iteration (each process's share padded to the same forwards) and the full one ends with the final
evaluation of the sharded frozen copy; Wan's video blocks sharded. The other families (Wan 2.2's two experts,
Z-Image, Qwen-Image, FLUX.2, the editing families) and the quantised explorer train in a second launch that only a
release runs (`slow`).
The pure parts (settings from the environment, lockstep padding) are tested in-process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from branchdiff.cli.tools import ACCELERATE_DIR
from branchdiff.errors import UserError
from branchdiff.runtime.sharding import ShardingSettings
from test_multiprocess import TESTS, _free_port
from tiny_pipelines import load_pipeline, save_pipeline

STEPS = 3
TOLERANCE = 1e-5  # FSDP against DDP: the same arithmetic but for the order of the gradient reductions and the norm's sum


def _arguments(model: Path, run: Path, finetune: str, *extra: str) -> list[str]:
    rate = "train.learning_rate=1e-2" if finetune == "lora" else "train.learning_rate=1e-3"
    return ["train", "tiny-chain", "model.family=sd3", f"model.path={model}", "model.resolution=32", f"model.finetune={finetune}",
            f"output_dir={run}", "seed=5", "reward=rewards_for_tests:Redness", "prompts.per_iteration=2", f"sampling.num_steps={STEPS}",
            "sampling.max_batch=8", "tree.roots=1", "tree.splits=[[0,2],[1,2]]", "train.minibatch=2", rate, "train.ema_decay=0.5",
            "logging.checkpoint_every=1", "logging.sample_every=0", "logging.report_to=none", "prompts.eval_seeds=1",
            "final_eval=false", "iterations=2", *extra]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """SD3 with LoRA and full fine-tuning (DDP, FSDP2, FSDP2 stopped and resumed), offloaded shards, and a video family:
    one launch."""
    base = tmp_path_factory.mktemp("sharding")
    model = save_pipeline("sd3", base / "sd3")
    plan = []
    for finetune in ("lora", "full"):
        common = ["train.kl_beta=0.1"] if finetune == "full" else []  # the KL's reference: the sharded frozen copy
        evaluations = ["eval_every=1"] if finetune == "lora" else ["final_eval=true"]
        plan += [["ddp", _arguments(model, base / f"ddp-{finetune}", finetune, *common, *evaluations)],
                 ["fsdp", _arguments(model, base / f"fsdp-{finetune}", finetune, *common, *evaluations)],
                 ["fsdp", _arguments(model, base / f"resumed-{finetune}", finetune, *common, "iterations=1")],
                 ["fsdp", _arguments(model, base / f"resumed-{finetune}", finetune, *common, "--resume", "latest")]]
    plan.append(["fsdp-offload", _arguments(model, base / "offload-lora", "lora")])  # the shards in CPU memory
    # a video family: Wan's transformer blocks sharded, video latents through the sharded forwards
    from tiny_pipelines import build_wan

    build_wan().save_pretrained(base / "wan", safe_serialization=True)
    plan += [[mode, [*_arguments(model, base / f"{mode}-wan", "lora"), *_wan(base / "wan")]] for mode in ("ddp", "fsdp")]
    _launch(base, plan)
    return {"base": base, "model": model}


def _wan(folder: Path) -> list[str]:
    return [f"model.path={folder}", "model.family=wan", "model.resolution=[16,32]", "model.frames=5",
            "reward={name: rewards_for_tests:Redness, frames: 2}"]


@pytest.fixture(scope="module")
def family_runs(tmp_path_factory):
    """The other families, and a whole quantised explorer on every process, under DDP and FSDP2: one launch (a release's
    check: `slow`)."""
    base = tmp_path_factory.mktemp("sharding-families")
    model = save_pipeline("sd3", base / "sd3")  # the arguments' defaults; every run names its own model
    from tiny_pipelines import build_wan

    # Wan 2.2's two experts trained together, two parents per minibatch: a minibatch holds both experts' rows or one's only
    build_wan(two_experts=True).save_pretrained(base / "wan-two", safe_serialization=True)
    both = [*_wan(base / "wan-two"), "model.expert=both"]
    plan = [[mode, [*_arguments(model, base / f"{mode}-wan-both", "lora"), *both]] for mode in ("ddp", "fsdp")]
    # a whole 4-bit copy per process, and DiffusionNFT (its sampling policy sharded, its forwards padded): Sol-RL on a tree
    explore = ["explore.mode=tree", "explore.keep=2", "explore.backend=nvfp4-emulated", "train.loss=nft"]
    plan += [[mode, _arguments(model, base / f"{mode}-explore", "lora", *explore)] for mode in ("ddp", "fsdp")]
    # Z-Image: list-taking transformer, prompts of different token counts, its refiner and main blocks sharded
    # the newer families, one iteration each: Qwen-Image (masked prompts, true CFG with its norm rescale, dual-stream blocks
    # sharded), FLUX.2 [dev] and [klein] (4-D position ids, double and single blocks sharded)
    once = ["iterations=1"]
    for family in ("z-image", "qwen-image", "flux2", "flux2-klein"):
        folder = save_pipeline(family, base / family)
        plan += [[mode, [*_arguments(model, base / f"{mode}-{family}", "lora"), f"model.path={folder}", f"model.family={family}", *once]]
                 for mode in ("ddp", "fsdp")]
    # instruction editing: FLUX.1 Kontext from a JSONL of prompts with source images, the sources' tokens beside the image's
    from test_editing import PROMPTS as EDITS
    from test_editing import _source
    from tiny_pipelines import build_flux_kontext, build_qwen_image_edit

    build_flux_kontext().save_pretrained(base / "flux-kontext", safe_serialization=True)
    build_qwen_image_edit().save_pretrained(base / "qwen-image-edit", safe_serialization=True)  # its sources' areas made small (env below)
    for index in range(2):
        _source(base / "edits" / f"source-{index}.png", (32, 32), index)
    (base / "edits" / "edits.jsonl").write_text("".join(json.dumps({"prompt": prompt, "image": f"source-{index}.png"}) + "\n"
                                                         for index, prompt in enumerate(EDITS)))
    for family in ("flux-kontext", "qwen-image-edit"):
        editing = [f"model.path={base / family}", f"model.family={family}", f"prompts.train={base / 'edits' / 'edits.jsonl'}",
                   f"prompts.eval={base / 'edits' / 'edits.jsonl'}"]
        plan += [[mode, [*_arguments(model, base / f"{mode}-{family}", "lora"), *editing, *once]] for mode in ("ddp", "fsdp")]
    _launch(base, plan)
    return {"base": base, "model": model}


def _launch(base: Path, plan: list) -> None:
    """Every [mode, arguments] of `plan` trained in one two-process launch (tests/sharded_runs.py)."""
    (base / "runs.json").write_text(json.dumps(plan))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", "ACCELERATE_USE_CPU": "true", "BRANCHDIFF_TEST_SMALL_EDIT_AREAS": "1"}
    command = [str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file", str(ACCELERATE_DIR / "fsdp.yaml"),
               "--num_processes", "2", "--main_process_ip", "127.0.0.1", "--main_process_port", str(_free_port()),
               "--mixed_precision", "no", str(TESTS / "sharded_runs.py"), str(base / "runs.json")]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def _export(run: Path, finetune: str) -> dict[str, torch.Tensor]:
    folder = run / ("lora" if finetune == "lora" else "transformer")
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.mark.parametrize("finetune", ["lora", "full"])
def test_fsdp_trains_like_ddp_and_resumes_exactly(runs, finetune):
    base = runs["base"]
    ddp, fsdp, resumed = (_export(base / f"{name}-{finetune}", finetune) for name in ("ddp", "fsdp", "resumed"))
    assert ddp.keys() == fsdp.keys() == resumed.keys() and len(ddp) > 0
    if finetune == "lora":
        moved = max(v.abs().max().item() for k, v in ddp.items() if "lora_B" in k)  # B starts at 0
    else:
        initial = load_file(runs["model"] / "transformer" / "diffusion_pytorch_model.safetensors")
        moved = max((ddp[k] - initial[k]).abs().max().item() for k in ddp)
    assert moved > 100 * TOLERANCE
    assert max((ddp[k] - fsdp[k]).abs().max().item() for k in ddp) <= TOLERANCE
    assert all(torch.equal(fsdp[k], resumed[k]) for k in fsdp)  # stopped after iteration 0 and resumed: bit for bit
    if finetune == "full":  # the folder of a sharded run is the one an unsharded run writes
        assert (base / "fsdp-full" / "transformer" / "config.json").read_text() == (base / "ddp-full" / "transformer" / "config.json").read_text()
    if finetune == "lora":
        offloaded = _export(base / "offload-lora", finetune)
        assert max((ddp[k] - offloaded[k]).abs().max().item() for k in ddp) <= TOLERANCE
    checkpoint = base / f"fsdp-{finetune}" / "checkpoints" / "iter-000001"
    assert (checkpoint / "optimizer-full.pt").is_file() and (checkpoint / "ema.safetensors").is_file()


def test_a_sharded_video_run_trains_like_ddp(runs):
    """Wan (tiny, 5 frames) under FSDP2: its blocks sharded, the LoRA after two iterations equal to DDP's
    within 1e-4, and at least 100× below what training moved. (Measured 2.1e-5: a few of Wan's LoRA
    weights see gradients near Adam's ε, where the reduction order of reduce-scatter and all-reduce
    changes the step's size; SD3's all stay within 1e-5.)"""
    ddp, fsdp = (_export(runs["base"] / f"{mode}-wan", "lora") for mode in ("ddp", "fsdp"))
    assert ddp.keys() == fsdp.keys() and len(ddp) > 0
    moved = max(v.abs().max().item() for k, v in ddp.items() if "lora_B" in k)  # B starts at 0
    difference = max((ddp[k] - fsdp[k]).abs().max().item() for k in ddp)
    assert difference <= 1e-4 and moved > 100 * difference, (difference, moved)


@pytest.mark.slow
def test_wan_22s_two_experts_train_together_sharded_like_ddp(family_runs):
    """model.expert=both on two processes, two parents per minibatch: under DDP (one forward routes a minibatch's
    rows to both experts; an expert without rows has no gradient there) and under FSDP2 (an expert without rows
    runs one row, times 0, so both processes gather and reduce alike) the two experts' LoRAs agree within 1e-4
    and moved 100× more."""
    base = family_runs["base"]
    for part in ("", "transformer_2/"):
        ddp, fsdp = (load_file(base / f"{mode}-wan-both" / "lora" / part / "pytorch_lora_weights.safetensors") for mode in ("ddp", "fsdp"))
        assert ddp.keys() == fsdp.keys() and len(ddp) > 0
        moved = max(v.abs().max().item() for k, v in ddp.items() if "lora_B" in k)
        difference = max((ddp[k] - fsdp[k]).abs().max().item() for k in ddp)
        assert difference <= 1e-4 and moved > 100 * difference, (part, difference, moved)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["z-image", "qwen-image", "flux2", "flux2-klein", "flux-kontext", "qwen-image-edit"])
def test_the_newer_image_families_train_on_two_processes_sharded_like_ddp(family_runs, family):
    """Z-Image, Qwen-Image, FLUX.2 [dev] and [klein], and FLUX.1 Kontext and Qwen-Image-Edit editing from a JSONL of
    sources, one iteration each, under DDP and FSDP2 on two processes: the LoRAs agree within 1e-4 and moved 100×
    more (Z-Image measured 1.2e-5 after two iterations: as for Wan above, a few weights see gradients near Adam's ε)."""
    ddp, fsdp = (_export(family_runs["base"] / f"{mode}-{family}", "lora") for mode in ("ddp", "fsdp"))
    assert ddp.keys() == fsdp.keys() and len(ddp) > 0
    moved = max(v.abs().max().item() for k, v in ddp.items() if "lora_B" in k)
    difference = max((ddp[k] - fsdp[k]).abs().max().item() for k in ddp)
    assert difference <= 1e-4 and moved > 100 * difference, (difference, moved)


@pytest.mark.slow
def test_a_sharded_run_explores_with_a_whole_quantised_copy_like_ddp(family_runs):
    """Explore on the tree with an emulated-NVFP4 explorer (refreshed from the gathered weights after each
    update, one tensor at a time): the same pools and kept leaves as DDP (the second iteration's come from
    the refreshed copy), the same DiffusionNFT update (its sampling policy a sharded soft copy)."""
    base = family_runs["base"]
    rows = {mode: [json.loads(line) for line in (base / f"{mode}-explore" / "metrics.jsonl").read_text().splitlines()] for mode in ("ddp", "fsdp")}
    for ddp_row, fsdp_row in zip(rows["ddp"], rows["fsdp"]):
        assert fsdp_row["explore_pool_nfe"] == ddp_row["explore_pool_nfe"] > 0
        assert abs(fsdp_row["reward_mean"] - ddp_row["reward_mean"]) < 1e-5
    ddp, fsdp = (_export(base / f"{mode}-explore", "lora") for mode in ("ddp", "fsdp"))
    assert max((ddp[k] - fsdp[k]).abs().max().item() for k in ddp) <= TOLERANCE


def test_sharded_runs_evaluate_like_unsharded_ones(runs):
    """Held-out evaluations (each process's share of 36 prompts, padded to the same forwards) and the
    final evaluation (the base model is the sharded frozen copy) give DDP's numbers."""
    def evaluations(run: str) -> list[float]:
        rows = [json.loads(line) for line in (runs["base"] / run / "metrics.jsonl").read_text().splitlines()]
        return [row["eval_tiny-geneval"] for row in rows]

    fsdp, ddp = evaluations("fsdp-lora"), evaluations("ddp-lora")
    assert fsdp[0] == ddp[0] and abs(fsdp[1] - ddp[1]) < 1e-4  # the base model, then after one update
    final = {run: json.loads((runs["base"] / run / "eval.json").read_text()) for run in ("fsdp-full", "ddp-full")}
    assert final["fsdp-full"]["base"] == final["ddp-full"]["base"] and final["fsdp-full"]["base"]["all"]["tiny-geneval"]["images"] == 36
    assert abs(final["fsdp-full"]["trained"]["all"]["tiny-geneval"]["mean"] - final["ddp-full"]["trained"]["all"]["tiny-geneval"]["mean"]) < 1e-4


def test_the_exported_lora_of_a_sharded_run_loads_in_the_pipeline_to_the_trained_output(runs):
    """pipe.load_lora_weights(RUN/lora) gives the images branchdiff samples with the run's weights."""
    from branchdiff.models import load_adapter
    from branchdiff.models.finetune import load_weights
    from test_model_families import _ode_images, _pipeline_images

    torch.set_num_threads(1)
    adapter = load_adapter("sd3", str(runs["model"]), resolution=32)
    load_weights(adapter, runs["base"] / "fsdp-lora")
    initial, ours = _ode_images(adapter, STEPS)
    pipe = load_pipeline("sd3", runs["model"])
    base = _pipeline_images(pipe, "sd3", initial, STEPS, adapter.default_guidance)
    pipe.load_lora_weights(str(runs["base"] / "fsdp-lora" / "lora"))
    loaded = _pipeline_images(pipe, "sd3", initial, STEPS, adapter.default_guidance)
    assert (ours - base).abs().max().item() > 1e-3
    assert (loaded - ours).abs().max().item() <= 1e-4


def test_settings_come_from_accelerates_fsdp_variables():
    assert ShardingSettings.from_environment({}) == ShardingSettings()
    on = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_OFFLOAD_PARAMS": "true", "FSDP_RESHARD_AFTER_FORWARD": "false"}
    assert ShardingSettings.from_environment(on) == ShardingSettings(True, True, False)
    with pytest.raises(UserError, match="fsdp_version: 2"):
        ShardingSettings.from_environment({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1"})
    for name in ("fsdp", "fsdp-offload"):  # the packaged configs launch FSDP2
        text = (ACCELERATE_DIR / f"{name}.yaml").read_text()
        assert "distributed_type: FSDP" in text and "fsdp_version: 2" in text
        assert ("fsdp_offload_params: true" in text) == (name == "fsdp-offload")


def test_a_sharded_run_on_gpus_gets_a_process_group_with_a_cpu_backend_too():
    """Offloaded shards and gathered checkpoints are CPU tensors: on GPUs a sharded run's group is NCCL
    and gloo; an unsharded one, or one on CPUs, keeps accelerate's choice."""
    from branchdiff.runtime.sharding import process_group_backend

    assert process_group_backend(ShardingSettings(True, offload=True), cuda=True) == "cuda:nccl,cpu:gloo"
    assert process_group_backend(ShardingSettings(True), cuda=True) == "cuda:nccl,cpu:gloo"
    assert process_group_backend(ShardingSettings(), cuda=True) is None
    assert process_group_backend(ShardingSettings(True, offload=True), cuda=False) is None


def test_a_sharded_adapter_pads_its_forwards_to_the_other_processes_count(tiny_adapter):
    """forward_chunked with a lockstep that answers 5 makes 5 forwards for a batch that needs 2, and
    returns the same outputs as without it."""
    from branchdiff.core.engine import SamplerSettings, forward_chunked

    calls = []
    original = type(tiny_adapter).predict

    class Counting(type(tiny_adapter)):
        def predict(self, *args, **kwargs):
            calls.append(len(args[0]))
            return original(self, *args, **kwargs)

    adapter = Counting.__new__(Counting)
    adapter.__dict__.update(tiny_adapter.__dict__)
    latents, times = torch.randn(6, 3, 32, 32), torch.full((6,), 0.5)
    embeds = adapter.encode_prompts(["a red circle"] * 6)
    settings = SamplerSettings(max_batch=4)
    plain, _ = forward_chunked(adapter, latents, times, embeds, settings)
    assert calls == [4, 2]
    calls.clear()
    adapter.lockstep = lambda count: 5
    padded, _ = forward_chunked(adapter, latents, times, embeds, settings)
    assert len(calls) == 5 and calls.count(1) == 3 and torch.equal(plain, padded)


def test_fsdp_in_a_single_process_or_with_8bit_adam_is_refused_before_the_model_loads(tiny_model_dir, tmp_path, monkeypatch):
    from branchdiff.errors import ConfigError
    from branchdiff.settings.load import load_config
    from branchdiff.training.recipe import Trainer

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    config = load_config("tiny-chain", [f"model.path={tiny_model_dir}", f"output_dir={tmp_path / 'run'}"])
    with pytest.raises(UserError, match="in a single process: sharding needs several"):
        Trainer(config)
    with pytest.raises(ConfigError, match="adamw8bit' is not supported on a sharded"):
        Trainer(load_config("tiny-chain", [f"model.path={tiny_model_dir}", f"output_dir={tmp_path / 'run'}", "train.optimizer=adamw8bit"]))
