"""`branchdiff plan` (branchdiff/plan/): every preset with a memory model planned and written as JSON,
the smallest change that fits, sharding's division, the CUDA launch's refusal (the device's memory
mocked at torch.cuda, the hardware boundary), the report's estimate column, and the estimate of a
wide tiny SD3 against the peak memory a real iteration measures on this CPU."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from branchdiff.cli import main
from branchdiff.plan import GIB, Estimator, Target, estimate, with_change
from branchdiff.plan.families import Geometry
from branchdiff.settings.load import load_config, presets

TESTS = Path(__file__).parent


@pytest.fixture(scope="module")
def estimator():
    return Estimator()


@pytest.mark.slow  # a release check: tracing every family takes ~45 s; the tests below plan SD3.5, Qwen-Image and the edit families
def test_every_preset_is_planned_and_written_as_json(estimator):
    """Every preset: phases, a peak that is static + its largest phase, FLOPs, and JSON that round-trips."""
    from branchdiff.cli.plan import format_plan

    planned = 0
    for preset in presets():
        plan = with_change(preset, [], Target(), estimator)
        assert plan.flops["total"] > 0 and plan.seconds > 0 and (plan.fits or plan.change)
        assert plan.static["denoiser"] >= plan.parameters["denoiser"] and set(plan.phases) >= {"rollout", "reward", "train", "optimizer", "eval"}
        data = json.loads(json.dumps(plan.to_json(), default=str))
        assert data["peak_gib"] == pytest.approx(plan.peak / GIB, abs=1e-4) and set(data["phase_peaks_gib"]) == set(plan.phases)
        assert plan.label in format_plan(preset, plan)
        planned += 1
    assert planned == len(presets()) >= 40


def test_the_command_prints_the_plan_and_writes_json(tmp_path, capsys):
    path = tmp_path / "plan.json"
    assert main(["plan", "sd35-pickscore", "train.minibatch=4", "--gpu", "a100-80gb", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    data = json.loads(path.read_text())
    assert "SD3.5 Medium" in out and "A100 80 GB" in out and data["settings"]["minibatch"] == 4 and data["fits"] is True
    assert data["parameters"]["denoiser"] == 2_243_171_520  # SD3.5 Medium's transformer, counted on meta


def test_the_newer_releases_count_their_published_sizes(estimator):
    """Z-Image (6 B), FLUX.2 [klein] base 9B (9 B) and FLUX.1 Kontext (FLUX.1-dev's 12 B) from their published
    configs, counted on meta; Qwen-Image-Edit is Qwen-Image's 20 B."""
    sizes = {"z-image-pickscore": (6.0e9, 6.3e9), "flux2-klein-pickscore": (8.9e9, 9.3e9), "flux-kontext-pickscore": (11.8e9, 12.0e9),
             "qwen-image-edit-pickscore": (20.3e9, 20.5e9)}
    for preset, (low, high) in sizes.items():
        assert low < estimate(load_config(preset), Target(), estimator).parameters["denoiser"] < high, preset


def test_the_image_to_video_releases_and_wan_2_2s_second_expert(estimator):
    """wan-i2v plans the release its model.path names: TI2V-5B (5.0 B), Wan 2.1 I2V 14B (T2V 14B with the image's added key and
    value projections and 20 more input channels) and Wan 2.2 I2V-A14B, whose frozen second expert (as large as the trained
    one) is resident; with model.expert=both the second expert carries a LoRA as large as the first."""
    plans = {name: estimate(load_config("wan-i2v-mq-branch", overrides), Target(), estimator) for name, overrides in (
        ("ti2v", []), ("i2v", ["model.path=Wan-AI/Wan2.1-I2V-14B-480P-Diffusers", "model.resolution=[480,832]"]),
        ("a14b", ["model.path=Wan-AI/Wan2.2-I2V-A14B-Diffusers", "model.resolution=[480,832]"]),
        ("both", ["model.path=Wan-AI/Wan2.2-I2V-A14B-Diffusers", "model.resolution=[480,832]", "model.expert=both"]))}
    assert [plans[name].label for name in plans] == ["Wan 2.2 TI2V-5B from an image", "Wan 2.1 I2V 14B", "Wan 2.2 I2V-A14B", "Wan 2.2 I2V-A14B"]
    assert abs(plans["ti2v"].parameters["denoiser"] - 5.0e9) < 0.05e9
    width, blocks = 5120, 40
    added = blocks * (2 * (width * width + width) + width)  # add_k_proj, add_v_proj and the added keys' RMS norm, per block
    assert plans["i2v"].parameters["denoiser"] - plans["a14b"].parameters["denoiser"] > added  # and the image's projection
    assert plans["a14b"].static["second expert"] == plans["a14b"].static["denoiser"] and plans["ti2v"].static["second expert"] == 0
    assert plans["both"].static["trained state"] == 2 * plans["a14b"].static["trained state"]
    t2v = estimate(load_config("wan-mq-branch", ["model.path=Wan-AI/Wan2.2-T2V-A14B-Diffusers"]), Target(), estimator)
    assert t2v.static["second expert"] == t2v.static["denoiser"] > 0


def test_qwen_images_trained_parameters_are_those_the_trainer_trains(estimator):
    """Regression: the plan counted LoRA on every attention projection, but the trainer leaves out the last block's
    text-stream output (no gradient reaches it: `unused_modules`), and full fine-tuning freezes it with that block's
    text MLP. The plan's `lora` and `trained` equal what peft attaches and what requires grad on the release built
    on meta (188,350,464 LoRA parameters at the preset's rank 64, not 188,743,680)."""
    import diffusers

    from branchdiff.models.lora import add_lora
    from branchdiff.models.qwen_image import QwenImageAdapter
    from branchdiff.plan import published as P

    def release() -> torch.nn.Module:
        with torch.device("meta"):
            return diffusers.QwenImageTransformer2DModel.from_config(P.QWEN_IMAGE_TRANSFORMER)

    config = load_config("qwen-image-pickscore")
    model = release()
    lora = sum(p.numel() for p in add_lora(model, QwenImageAdapter.lora_target_sets["attention"], config.train.lora_rank, 1.0, seed=0,
                                           unused=QwenImageAdapter.unused_modules_of(model)))
    assert estimate(config, Target(), estimator).parameters["lora"] == lora
    model = release().requires_grad_(True)
    for name in QwenImageAdapter.unused_modules_of(model):
        model.get_submodule(name).requires_grad_(False)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert estimate(load_config("qwen-image-pickscore", ["model.finetune=full", "model.dtype=float32"]), Target(), estimator).parameters["trained"] == trained


def test_a_weight_average_is_one_more_fp32_copy_of_what_is_trained(estimator):
    """Regression: `train.ema_decay` keeps an fp32 average of every trained parameter on their device (diffusers'
    EMAModel shadow copies), which the plan left out: 4 bytes per LoRA parameter, per trained weight under full
    fine-tuning, and under FSDP a shard of it per process."""
    def trained_state(*overrides: str) -> float:
        return estimate(load_config("sd35-pickscore", list(overrides)), Target(), estimator).static["trained state"]

    lora = estimate(load_config("sd35-pickscore"), Target(), estimator).parameters["lora"]
    assert trained_state("train.ema_decay=0.99") - trained_state("train.ema_decay=0") == 4 * lora
    processes, full = 4, ["model.finetune=full", "model.dtype=float32"]
    fsdp = Target(processes=processes, sharding="fsdp")
    without = estimate(load_config("sd35-pickscore", [*full, "train.ema_decay=0"]), fsdp, estimator)
    with_average = estimate(load_config("sd35-pickscore", [*full, "train.ema_decay=0.99"]), fsdp, estimator)
    # FSDP puts each process's shard of the weights and the trained state in "denoiser"
    assert with_average.static["denoiser"] - without.static["denoiser"] == pytest.approx(4 * without.parameters["trained"] / processes)


def test_the_objectives_own_tensors_are_counted(estimator):
    """AWM keeps an fp32 moving average of what it trains; a decoupled objective keeps each training term's x0, ε, x_t
    and one prediction (4 latents of SD3.5's 16 × H/8 × W/8 fp32 values), `timesteps` terms per sample (a leaf, a
    demonstration, each image of a preference pair) and trains that many forwards; SFT and offline DPO grow no tree
    and neither roll out nor decode. Clipped GRPO has none of these."""
    def planned(preset: str, *overrides: str):
        config = load_config(preset, list(overrides))
        return config, estimate(config, Target(), estimator)

    latent = 16 * (512 // 8) ** 2 * 4  # bytes of one SD3.5 latent at 512² in fp32
    _, grpo = planned("sd35-pickscore", "model.resolution=512")
    assert grpo.static["objective state"] == grpo.static["training terms"] == 0 and grpo.static["tree latents"] > 0
    config, awm = planned("sd35-pickscore-awm")
    leaves = config.tree.roots * config.prompts.per_iteration  # a tree of chains: one leaf per root
    assert awm.static["objective state"] == 4 * awm.parameters["lora"]
    assert awm.static["training terms"] == leaves * config.awm.timesteps * 4 * latent
    assert awm.rows["train"] == leaves * config.awm.timesteps * awm.settings["cfg_rows"]
    for preset, images in (("sd35-pickscore-sft", 1), ("sd35-pickscore-dpo-offline", 2)):
        config, plan = planned(preset, "model.resolution=512")
        timesteps = getattr(config, config.train.loss.replace("-", "_")).timesteps
        assert plan.static["training terms"] == config.prompts.per_iteration * images * timesteps * 4 * latent
        assert plan.static["tree latents"] == plan.phases["rollout"] == plan.phases["reward"] == plan.rows["rollout"] == 0


def test_a_rollouts_block_cache_is_counted_in_its_phase(estimator):
    """`sampling.block_cache` keeps, per network row, the first block's residual and the later blocks' residual of each stream:
    at most twice SD3.5 Medium's first joint block output, (333 text + (512/16)² image tokens) × 1536 channels in bf16, for the
    widest depth twice (kept per forward and joined) and one forward's gathered rows; the rest of the plan does not move."""
    config = load_config("sd35-pickscore-awm")
    plain = estimate(config, Target(), estimator)
    cached = estimate(load_config("sd35-pickscore-awm", ["sampling.block_cache=0.3"]), Target(), estimator)
    stream = (333 + (512 // 16) ** 2) * 1536 * 2
    widest = config.tree.roots * config.prompts.per_iteration  # chains: every depth holds every root's node
    rows = 2 if config.sampling.guidance > 1 else 1  # CFG: two rows a node (the AWM preset samples without it)
    nodes = 2 * widest + config.sampling.max_batch // rows
    assert cached.phases["rollout"] - plain.phases["rollout"] == 2 * stream * rows * nodes
    assert {k: v for k, v in cached.phases.items() if k != "rollout"} == {k: v for k, v in plain.phases.items() if k != "rollout"}


def test_an_edit_step_holds_the_source_tokens_beside_the_image(estimator):
    """FLUX.1 Kontext at 384² runs FLUX.1's transformer over 2 × 576 image tokens: the FLOPs and the per-row
    rollout memory of FLUX.1 at 384 × 768 (the same sequence). Qwen-Image-Edit's forward takes one source at the
    pipeline's 1024² VAE area (64 × 64 tokens) after the image's 24 × 24."""
    def measured(preset: str, *overrides: str):
        config = load_config(preset, list(overrides))
        return estimator.measured(estimator.family(config), config)

    kontext, flux = measured("flux-kontext-pickscore"), measured("flux-kontext-pickscore", "model.family=flux", "model.resolution=[384,768]")
    assert kontext.forward_flops() == pytest.approx(flux.forward_flops(), rel=1e-3) and kontext.rollout(4) == pytest.approx(flux.rollout(4), rel=0.02)
    from torch._subclasses.fake_tensor import FakeTensorMode

    edit = estimator.family(load_config("qwen-image-edit-pickscore"))
    with FakeTensorMode(allow_non_fake_inputs=True):
        inputs = edit.inputs(edit.config, Geometry(8, 1, 16), 2, (1, 384, 384), torch.bfloat16, edit.text_tokens)
    assert inputs["hidden_states"].shape == (2, 576 + 4096, 64) and inputs["img_shapes"] == [[(1, 24, 24), (1, 64, 64)]] * 2


def test_blocks_scale_to_the_real_model_whatever_kinds_the_traced_copy_holds(tmp_path):
    """The traced copy of an SD3 transformer holds one block of every kind SD3.5 Medium has (a dual-attention block
    among them); scaled to a model without dual attention it must equal a trace of that whole model. Regression:
    the extra kind's activations stayed in (the wide tiny SD3 was planned at 1.7× its saved tensors)."""
    from dataclasses import replace

    from branchdiff.plan.measure import measure
    from tiny_pipelines import build_wide_sd3

    build_wide_sd3(resolution=64).save_pretrained(tmp_path / "sd3")
    config = load_config(None, ["model.family=sd3", f"model.path={tmp_path / 'sd3'}", "model.resolution=64"])
    family = Estimator().family(config)
    assert family.reduced and not family.config.get("dual_attention_layers")
    args = (torch.float32, 4, 4.0, (1, 64, 64), None)
    scaled, whole = measure(family, *args), measure(replace(family, reduced={}), *args)
    assert scaled.counts == whole.counts == {"joint block": 1, "last joint block (context pre-only)": 1}
    for rows in (1, 8):
        assert scaled.held(rows, False) == pytest.approx(whole.held(rows, False), rel=0.02)
        assert scaled.held(rows, True) == pytest.approx(whole.held(rows, True), rel=0.02)
        assert scaled.backward(rows) == pytest.approx(whole.backward(rows), rel=0.02)
    assert scaled.forward_flops() == pytest.approx(whole.forward_flops(), rel=0.02)


def test_guidance_zero_is_one_row_for_z_image(estimator):
    """Z-Image-Turbo's guidance 0 is unguided (one row a prediction); CFG for any guidance above 0. Regression: the
    plan read guidance 0 as unset and counted the default's two rows."""
    assert estimate(load_config("z-image-pickscore"), Target(), estimator).settings["cfg_rows"] == 1
    assert estimate(load_config("z-image-pickscore", ["sampling.guidance=0.5"]), Target(), estimator).settings["cfg_rows"] == 2


def test_a_step_distilled_klein_is_one_row_a_prediction(estimator, tmp_path):
    """FLUX.2 [klein]'s step-distilled releases sample unguided whatever the guidance (the adapter reads `is_distilled`
    from the loaded pipeline); the plan knows them by their folder's model_index.json or their hub id. Regression: it
    counted CFG's two rows for them at the preset's guidance 4."""
    from branchdiff.models.flux2 import Flux2KleinAdapter

    def rows(path: str) -> int:
        return estimate(load_config("flux2-klein-pickscore", [f"model.path={path}"]), Target(), estimator).settings["cfg_rows"]

    assert rows("black-forest-labs/FLUX.2-klein-base-9B") == 2 and rows("black-forest-labs/FLUX.2-klein-9B") == 1
    for distilled in (True, False):
        folder = tmp_path / f"klein-{distilled}"
        folder.mkdir()
        (folder / "model_index.json").write_text(json.dumps({"_class_name": "Flux2KleinPipeline", "is_distilled": distilled}))
        assert Flux2KleinAdapter.cfg_rows(4.0, str(folder)) == (1 if distilled else 2)
    assert Flux2KleinAdapter.cfg_rows(4.0) == 2 and Flux2KleinAdapter.cfg_rows(4.0, "someone/my-finetune") == 2  # unknown: guided
    assert Flux2KleinAdapter.cfg_rows(4.0, "someone/klein-9b-grpo") == 2  # a fine-tune of a base release, named freely


def test_a_run_that_does_not_fit_gets_the_smallest_change_that_does(estimator):
    """Wan 2.1 14B's branch preset peaks in training on an 80 GB GPU; the plan names the largest minibatch
    that fits, and planning with that override fits."""
    plan = with_change("wan-mq-branch", ["model.path=Wan-AI/Wan2.1-T2V-14B-Diffusers"], Target(), estimator)
    assert not plan.fits and plan.peak_phase == "train" and plan.change == "train.minibatch=1"
    again = estimate(load_config("wan-mq-branch", ["model.path=Wan-AI/Wan2.1-T2V-14B-Diffusers", "train.minibatch=1"]), Target(), estimator)
    assert again.fits and again.peak == plan.change_peak


def test_fsdp_divides_the_weights_and_trained_state_among_the_processes(estimator):
    config = load_config("flux-hps-branch")
    ddp = estimate(config, Target(), estimator)
    fsdp = estimate(config, Target(4, "fsdp"), estimator)
    shard = (ddp.static["denoiser"] + ddp.static["trained state"] - ddp.parameters["trained"] * 4) / 4  # no DDP bucket under FSDP
    assert fsdp.static["denoiser"] == pytest.approx(shard) and fsdp.static["gathered blocks"] > 0 and fsdp.peak < ddp.peak
    assert fsdp.flops == ddp.flops  # the same work per process


@pytest.mark.parametrize("argv,line", [
    (["plan", "tiny-chain", "--gpu", "h1000"], r"--gpu h1000: not a GPU plan knows; choose one of h100-80gb"),
    (["plan", "tiny-chain", "--sharding", "fsdp"], r"--sharding fsdp with --gpus 1: sharding needs two or more processes"),
    (["plan", "flux2-klein-pickscore", "model.path=someone/klein"],
     r"model.path=someone/klein: plan knows FLUX.2 \[klein\] 4B and 9B by name; plan with model.path=black-forest-labs/FLUX.2-klein-base-4B"),
    # refused as they are parsed: a ZeroDivisionError traceback (utilisation 0), a plan of NaN GiB, a negative modelled time
    (["plan", "tiny-mix", "--utilisation", "0"], r"^branchdiff: error: plan: argument --utilisation: must be in \(0, 1\], got 0; see branchdiff plan --help$"),
    (["plan", "tiny-mix", "--utilisation", "5"], r"plan: argument --utilisation: must be in \(0, 1\], got 5"),
    (["plan", "tiny-mix", "--utilisation", "nan"], r"plan: argument --utilisation: must be a finite number, got nan"),
    (["plan", "tiny-mix", "--gpu-memory", "nan"], r"plan: argument --gpu-memory: must be a finite number, got nan"),
    (["plan", "tiny-mix", "--gpu-memory", "0"], r"plan: argument --gpu-memory: must be > 0, got 0"),
    (["plan", "tiny-mix", "--gpu-tflops", "-1"], r"plan: argument --gpu-tflops: must be > 0, got -1"),
    (["plan", "tiny-mix", "--gpu-tflops", "inf"], r"plan: argument --gpu-tflops: must be a finite number, got inf"),
    (["plan", "tiny-mix", "--gpus", "0"], r"plan: argument --gpus: must be ≥ 1, got 0"),
])
def test_bad_plan_input_is_one_line(argv, line, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.search(line, err)


@pytest.mark.parametrize("where", ["missing/deeper/plan.json", "a-file/plan.json", "."])
def test_plan_json_where_no_file_can_go_is_refused_and_creates_nothing(where, tmp_path, monkeypatch, capsys):
    """`--json` under a missing folder made the folders; a file where a folder should be, or a folder, is refused too."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file").write_text("not a folder")
    before = sorted(tmp_path.rglob("*"))
    assert main(["plan", "tiny-chain", "--json", where]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and re.fullmatch(rf"branchdiff: error: plan: argument --json: {re.escape(where)}(: the folder missing/deeper does not "
                                               r"exist; create it first \(mkdir -p missing/deeper\)|: a-file is a file, not a folder| is a folder).*\n",
                                               captured.err), captured.err
    assert sorted(tmp_path.rglob("*")) == before


def test_a_plan_that_does_not_fit_exits_1_and_is_still_printed_and_written(tmp_path, capsys):
    """Exit status 1 like a check that fails (bad input stays 2): the plan, its verdict and its JSON as when it fits; it exited 0."""
    path = tmp_path / "plan.json"
    assert main(["plan", "tiny-chain", "--gpu-memory", "1", "--json", str(path)]) == 1
    captured = capsys.readouterr()
    assert "\ndoes NOT fit: peak 0.1 GiB (train) of 1.0 GiB" in captured.out and captured.err == ""
    assert json.loads(path.read_text())["fits"] is False
    assert main(["plan", "tiny-chain", "--gpu-memory", "1", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["fits"] is False


def _cuda_with(monkeypatch, total_memory: int) -> None:
    """torch.cuda as a device of `total_memory` bytes would report it (the hardware boundary only)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: types.SimpleNamespace(name="Test GPU", total_memory=total_memory))


def test_a_cuda_launch_that_will_not_fit_is_refused_before_anything_is_written(tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    need = with_change("tiny-chain", [f"output_dir={run}"], Target(), Estimator())
    _cuda_with(monkeypatch, int(need.peak * 0.5))
    assert main(["train", "tiny-chain", f"output_dir={run}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and not run.exists()
    assert f"plan: the {need.peak_phase} phase needs an estimated {need.peak / GIB:.1f} GiB per process and Test GPU has" in err
    assert "or add --force to launch anyway" in err
    from branchdiff.training.fit import check_fits, device_target

    target = device_target()
    assert target.gpu.memory == int(need.peak * 0.5) and target.processes == 1
    forced = check_fits("tiny-chain", [f"output_dir={run}"], True, target)
    assert forced is not None and forced.peak == need.peak


def test_the_report_sets_the_estimate_beside_the_measured_peaks(tmp_path):
    from branchdiff.report.run_report import write_report
    from test_run_report import write_metrics

    run = tmp_path / "run"
    run.mkdir()
    write_metrics(run)
    plan = with_change("tiny-chain", [], Target(), Estimator())
    (run / "plan.json").write_text(json.dumps(plan.to_json(), default=str))
    html = write_report(run).read_text()
    assert "estimated peak (branchdiff plan on H100 80 GB SXM, GiB)" in html
    assert f"{max(plan.phase_peak('train'), plan.phase_peak('optimizer')) / GIB:.3f}" in html


@pytest.mark.slow  # release only: keeps the suite under 15 minutes on 2 cores
def test_the_plan_of_a_wide_tiny_sd3_against_a_measured_iteration_on_this_cpu(tmp_path):
    """A tiny SD3 pipeline with a wider transformer (1024 tokens, width 256): one tree iteration in a fresh
    process, each phase's peak resident set above the process's start against the plan's estimate:
    within [0.8, 1.25] (measured rollout 1.17, train 0.99). The reward phase is only checked to be measured: planned at
    80 MiB, it measures 1.31 of that (2026-11-27), because the resident set after the rollout still holds ~25-40 MiB
    the C allocator and the CPU kernels kept (53 MiB above the process's start after an iteration, 15 after loading),
    a third of so small a phase; the real-size checks' GiB-sized reward phases measure 0.84-1.00."""
    from tiny_pipelines import build_wide_sd3

    folder = tmp_path / "wide-sd3"
    build_wide_sd3().save_pretrained(folder)
    overrides = ["model.family=sd3", f"model.path={folder}", "model.resolution=128", f"output_dir={tmp_path / 'run'}",
                 "reward=rewards_for_tests:Redness", "prompts.per_iteration=2", "sampling.num_steps=3", "tree.roots=2", "tree.splits=[[0,2]]",
                 "iterations=1", "final_eval=false", "logging.report_to=none", "logging.sample_every=0", "train.lora_rank=4",
                 "train.minibatch=8", "sampling.max_batch=8", "sampling.sde=flow", "sampling.noise_level=0.7"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]), "HF_HUB_OFFLINE": "1",
           "MALLOC_MMAP_THRESHOLD_": "65536"}  # large blocks mapped and returned when freed: the resident set follows live tensors
    done = subprocess.run([sys.executable, str(TESTS / "plan_measured.py"), *overrides], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    phases = json.loads(done.stdout.strip().splitlines()[-1])
    ratio = {phase: p["measured_gib"] / p["estimated_gib"] for phase, p in phases.items()}
    assert phases["train"]["estimated_gib"] > 0.5  # large enough to measure
    assert 0.8 <= ratio["rollout"] <= 1.25 and 0.8 <= ratio["train"] <= 1.25, (ratio, phases)
    assert np.isfinite(ratio["reward"])


@pytest.mark.slow
@pytest.mark.parametrize("family,parameters", [("sana", 1_604_462_752), ("sd3.5-medium", 2_243_171_520 + 226_492_416),
                                               ("wan-1.3b", 1_418_996_800 + 262_144), ("flux2-klein-4b", 3_875_544_576)])
def test_a_release_at_its_real_size_on_this_cpu(tmp_path, family, parameters):
    """scripts/real_size_check.py: the release built from its published configs (random bf16 weights), its denoiser's
    parameters as published (SANA 1600M: 1.6 B; SD3.5 Medium: 2.5 B with its positional table; Wan 2.1 1.3B: 1.42 B;
    FLUX.2 [klein] base 4B: 3.9 B), one LoRA tree iteration
    at a reduced size in a fresh process whose peak resident memory per phase is within [0.8, 1.25] of the plan's
    (SANA ~9 GB written and ~2 minutes on 2 cores; SD3.5 Medium ~16 GB and ~4 minutes; Wan ~15 GB, ~3 minutes; FLUX.2
    [klein] ~16 GB, ~3 minutes)."""
    out = tmp_path / "result.json"
    done = subprocess.run([sys.executable, str(TESTS.parent / "scripts" / "real_size_check.py"), family, "--folder", str(tmp_path / family),
                           "--json", str(out)], capture_output=True, text=True, timeout=3000)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["parameters"]["denoiser"] + result["parameters"].get("denoiser_buffers", 0) == parameters
    assert all(0.8 <= ratio <= 1.25 for ratio in result["ratio"].values()), result
