"""The GPU suite: `python -m pytest -m gpu -o addopts=""` (one process: the CPU suite's two workers are
its addopts) on any machine with CUDA (every test skips, naming why,
where there is none; CI has none). It measures what CPU tests cannot and writes the figures to
gpu-summary.json ($BRANCHDIFF_GPU_SUMMARY overrides the path), which docs/gpu.md records by date and
device:
- a bf16 training iteration of the built-in model and of each family's tiny pipeline (bf16 base
  weights under bf16 autocast), with the log-prob check (the ratio before the first update);
- exploration through low-precision kernels where the hardware has them: FP8 through torchao
  (compute capability ≥ 8.9) and NVFP4 through Transformer Engine (≥ 10.0);
- FSDP2 against DDP on the GPUs present (two or more);
- each tiny pipeline's peak memory of a rollout forward against scripts/memory_table.py's estimate
  of the same forward at the same size;
- rollout throughput, network rows per second, per family.
"""

from __future__ import annotations

import datetime
import inspect
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                   reason="no CUDA device here: the GPU suite runs where one is present (docs/gpu.md)")]

TESTS = Path(__file__).parent
sys.path.insert(0, str(TESTS))
from tiny_pipelines import FAMILIES  # noqa: E402  (every image family's tiny pipeline)

STEPS = 4


@pytest.fixture(scope="session")
def summary():
    """Every test's figures by name; written as JSON when the session ends."""
    capability = torch.cuda.get_device_capability(0)
    record = {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(0), "devices": torch.cuda.device_count(),
              "capability": f"{capability[0]}.{capability[1]}", "torch": torch.__version__, "cuda": torch.version.cuda, "tests": {}}
    yield record["tests"]
    path = Path(os.environ.get("BRANCHDIFF_GPU_SUMMARY", "gpu-summary.json"))
    path.write_text(json.dumps(record, indent=1))
    print(f"\nGPU summary: {path.resolve()}")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    from tiny_pipelines import build_wan, save_pipeline

    root = tmp_path_factory.mktemp("gpu-families")
    folders = {family: save_pipeline(family, root / family) for family in FAMILIES}
    build_wan(two_experts=True).save_pretrained(root / "wan")  # Wan 2.2 A14B's layout: both experts
    return {**folders, "wan": root / "wan"}


def _iteration(config) -> dict[str, float]:
    from branchdiff.training.recipe import Trainer

    trainer = Trainer(config)
    assert trainer.accelerator.device.type == "cuda"
    start = time.perf_counter()
    metrics = trainer.run_iteration(0).metrics
    torch.cuda.synchronize()
    metrics["iteration_seconds"] = time.perf_counter() - start
    return metrics


@pytest.mark.parametrize("family", ["tiny", "tiny-video", *FAMILIES, "wan"])
def test_a_bf16_training_iteration_of_each_family(saved, family, tmp_path, summary):
    """One iteration trains (an optimizer step, finite loss), and the log-prob check stays at bf16's
    rounding: the rollout and the update recompute the same bf16 forwards."""
    from branchdiff.settings.load import load_config
    from test_model_families import _train_overrides

    if family == "tiny":  # full fine-tuning of the fp32 weights under bf16 autocast
        config = load_config("tiny-mix-full", [f"output_dir={tmp_path}", "iterations=1", "final_eval=false", "eval_every=0",
                                               "logging.report_to=none", "logging.sample_every=0", "train.mixed_precision=bf16",
                                               "prompts.per_iteration=2", "model.compile=none"])  # eager, as the other families
    elif family == "tiny-video":  # the built-in video model, full fine-tuning; clipped GRPO, whose log-probs the check compares
        config = load_config("tiny-video", [f"output_dir={tmp_path}", "iterations=1", "final_eval=false", "eval_every=0",
                                            "logging.report_to=none", "logging.sample_every=0", "train.mixed_precision=bf16",
                                            "prompts.per_iteration=2", "model.compile=none", "train.loss=grpo",
                                            "train.kl_beta=0", "train.optimizer_every=0"])  # eager, as the other families; the iteration it ran before the preset took DiffusionNFT
    elif family == "wan":  # both experts train (LoRA), an image reward on every 2nd frame
        config = load_config(None, _train_overrides(family, saved[family], tmp_path, "model.dtype=bfloat16", "train.mixed_precision=bf16",
                                                    "train.learning_rate=1e-2", "model.resolution=[16,32]", "model.frames=5",
                                                    "reward={name: rewards_for_tests:Redness, frames: 2}"))
    else:
        config = load_config(None, _train_overrides(family, saved[family], tmp_path, "model.dtype=bfloat16", "train.mixed_precision=bf16",
                                                    "train.learning_rate=1e-2"))
    metrics = _iteration(config)
    summary[f"bf16_iteration/{family}"] = {k: metrics.get(k) for k in ("logprob_check", "loss", "iteration_seconds", "nfe_rollout",
                                                                          "memory_rollout_gb", "memory_train_gb", "optimizer_steps", "steps_skipped",
                                                                          "grad_norm", "edges_trained")}
    assert metrics["optimizer_steps"] == 1 and torch.isfinite(torch.tensor(metrics["loss"])), summary[f"bf16_iteration/{family}"]
    assert metrics["logprob_check"] <= 5e-2


def _capability() -> tuple[int, int]:
    return torch.cuda.get_device_capability(0)


@pytest.mark.parametrize("backend,needs", [("torchao-fp8", (8, 9)), ("te-nvfp4", (10, 0))])
def test_low_precision_exploration_on_the_hardware_that_has_it(backend, needs, tmp_path, summary):
    """An explore iteration with the explorer in FP8 (torchao) or NVFP4 (Transformer Engine): the pool is
    grown by the low-precision copy and its ranking of the kept subset is recorded against the policy's."""
    from branchdiff.settings.load import load_config

    if _capability() < needs:
        pytest.skip(f"{backend} needs compute capability ≥ {needs[0]}.{needs[1]}; this device has {_capability()}")
    if backend == "te-nvfp4":
        pytest.importorskip("transformer_engine", reason="Transformer Engine is not installed")
    config = load_config("tiny-explore-seeds", [f"output_dir={tmp_path}", "iterations=1", "final_eval=false", "eval_every=0",
                                                "logging.report_to=none", "logging.sample_every=0", f"explore.backend={backend}",
                                                "explore.fidelity_every=1", "train.mixed_precision=bf16"])
    metrics = _iteration(config)
    explore = {k: v for k, v in metrics.items() if k.startswith("explore_")}
    summary[f"explore/{backend}"] = {**explore, "iteration_seconds": metrics["iteration_seconds"]}
    assert metrics["optimizer_steps"] >= 1 and torch.isfinite(torch.tensor(metrics["loss"])) and "explore_spearman_pool" in explore


def test_fsdp_trains_like_ddp_on_the_gpus(tmp_path, summary):
    """tests/sharded_runs.py on the GPUs present: a tiny SD3 pipeline, two iterations with LoRA under DDP
    and under FSDP2 (the packaged fsdp config), the same LoRA within GPU reduction noise."""
    from safetensors.torch import load_file

    from branchdiff.cli.tools import ACCELERATE_DIR
    from test_multiprocess import _free_port
    from test_sharding import _arguments
    from tiny_pipelines import save_pipeline

    count = torch.cuda.device_count()
    if count < 2:
        pytest.skip(f"FSDP needs two or more GPUs; this machine has {count}")
    model = save_pipeline("sd3", tmp_path / "sd3")
    modes = ("ddp", "fsdp", "fsdp-offload")  # offloaded shards: their collectives run on the group's CPU backend (gloo)
    plan = [[mode, _arguments(model, tmp_path / mode, "lora", "train.mixed_precision=no")] for mode in modes]
    (tmp_path / "runs.json").write_text(json.dumps(plan))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]), "HF_HUB_OFFLINE": "1"}
    command = [str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file", str(ACCELERATE_DIR / "fsdp.yaml"),
               "--num_processes", str(min(count, 8)), "--main_process_port", str(_free_port()), "--mixed_precision", "no",
               str(TESTS / "sharded_runs.py"), str(tmp_path / "runs.json")]
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    ddp, fsdp, offload = (load_file(tmp_path / mode / "lora" / "pytorch_lora_weights.safetensors") for mode in modes)
    difference = max((ddp[k] - fsdp[k]).abs().max().item() for k in ddp)
    offload_difference = max((ddp[k] - offload[k]).abs().max().item() for k in ddp)
    summary["fsdp_vs_ddp"] = {"processes": min(count, 8), "max_abs_difference": difference, "offload_max_abs_difference": offload_difference,
                              "seconds": time.perf_counter() - start}
    assert ddp.keys() == fsdp.keys() == offload.keys() and difference <= 1e-4 and offload_difference <= 1e-4


def _recorded_inputs(adapter, rows: int) -> dict:
    """The keyword arguments the adapter's guided prediction hands its denoiser for `rows` latents."""
    captured = {}
    forward = adapter.denoiser.forward

    def record(*args, **kwargs):
        captured.update(kwargs)
        captured.update({f"_positional{i}": a for i, a in enumerate(args)})
        return forward(*args, **kwargs)

    adapter.denoiser.forward = record
    try:
        embeds = adapter.encode_prompts(["a red circle"] * rows)
        latents = torch.randn(rows, *adapter.latent_shape, device=adapter.device)
        with torch.no_grad():
            adapter.predict(latents, torch.full((rows,), 0.5, device=adapter.device), embeds, 1.0)
    finally:
        adapter.denoiser.forward = forward
    return captured


@pytest.mark.parametrize("family", FAMILIES)
def test_a_rollout_forwards_peak_memory_against_the_memory_tables_estimate(saved, family, summary):
    """A no-grad bf16 forward of R network rows through the tiny pipeline's denoiser: CUDA's peak of
    allocated memory above the start, against branchdiff plan's trace (branchdiff/plan/trace.py) of the same module and inputs
    (fake CUDA tensors, one row, scaled to R). Both count activations and the output, not the weights."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from branchdiff.models import load_adapter
    from branchdiff.models.attention import apply_backend
    from branchdiff.plan.trace import forward_peak

    rows = 256
    adapter = load_adapter(family, str(saved[family]), "cuda", 32, torch.bfloat16)
    apply_backend(adapter.denoiser, "native", family)  # as a run does: PyTorch's SDPA without cuDNN's kernel
    inputs = _recorded_inputs(adapter, rows)
    rows *= adapter.rows_per_sample(1.0)  # the network rows of the recorded call (Z-Image guides at any guidance above 0)
    denoiser = adapter.denoiser
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    with torch.no_grad(), torch.autocast("cuda", torch.bfloat16):
        output = denoiser(*[inputs[k] for k in sorted(inputs) if k.startswith("_positional")],
                          **{k: v for k, v in inputs.items() if not k.startswith("_positional")})
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated() - start
    del output
    one_row = {k: v[:1] if (torch.is_tensor(v) and v.dim() or isinstance(v, list)) and len(v) == rows else v for k, v in inputs.items()}
    with torch.device("meta"):  # built on meta, then materialised as fake CUDA tensors (as memory_table.py does)
        fake = type(denoiser).from_config(denoiser.config).to(torch.bfloat16)
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake.to_empty(device="cuda")
        empty = lambda v: (torch.empty(v.shape, dtype=v.dtype, device="cuda") if torch.is_tensor(v)
                           else [empty(t) for t in v] if isinstance(v, list) and v and torch.is_tensor(v[0]) else v)
        fake_inputs = {k: empty(v) for k, v in one_row.items()}
        positional = [fake_inputs.pop(k) for k in sorted(list(fake_inputs)) if k.startswith("_positional")]
        names = [n for n in inspect.signature(type(denoiser).forward).parameters if n != "self"]
        fake_inputs.update(zip(names, positional))  # some denoisers (SD 1.5's UNet, SANA) take their first inputs by position
        estimate = forward_peak(fake, fake_inputs, grad=False, autocast=torch.bfloat16).at(rows)
    ratio = measured / estimate
    summary[f"memory/{family}"] = {"rows": rows, "measured_mb": measured / 2**20, "estimated_mb": estimate / 2**20, "ratio": ratio}
    assert 0.5 <= ratio <= 2.0


@pytest.mark.parametrize("family", FAMILIES)
def test_rollout_throughput(saved, family, summary):
    """Network rows per second of a 10-step tree rollout (4 prompts × 8 chains, k = 2 at step 0) in bf16."""
    from branchdiff.core.rollout import NoiseAddress, SamplerSettings, grow
    from branchdiff.core.tree import Split, TreeSpec, build_tree
    from branchdiff.models import load_adapter

    adapter = load_adapter(family, str(saved[family]), "cuda", 32, torch.bfloat16)
    prompts = ["a red circle on the left", "two blue squares", "three green triangles", "a yellow star at the top"]
    tree = build_tree(TreeSpec(10, splits=(Split(0, 2),), roots=4), len(prompts))
    settings = SamplerSettings(sde="ddim" if family == "sd15" else "flow", noise_level=1.0 if family == "sd15" else 0.7, max_batch=64)
    embeds, schedule = adapter.encode_prompts(prompts), adapter.schedule(10)
    grow(adapter, tree, embeds, schedule, settings, NoiseAddress(0, 0, (0, 1, 2, 3)))  # warm-up: kernels chosen, caches filled
    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.autocast("cuda", torch.bfloat16):
        rollout = grow(adapter, tree, embeds, schedule, settings, NoiseAddress(0, 1, (0, 1, 2, 3)))
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    summary[f"throughput/{family}"] = {"rows": rollout.nfe_computed, "seconds": seconds, "rows_per_second": rollout.nfe_computed / seconds}
    assert rollout.nfe_computed > 0 and seconds > 0


@pytest.mark.parametrize("model", ["wide-sd3", "tiny"])
def test_the_plans_phase_estimates_against_cudas_peaks(model, tmp_path, summary):
    """`branchdiff train` on CUDA: the launch plans the run on this device (RUN/plan.json), the trainer
    measures each phase's peak of allocated memory; the ratio of the two per phase."""
    from test_model_families import _train_overrides
    from tiny_pipelines import build_wide_sd3

    run = tmp_path / "run"
    if model == "wide-sd3":
        build_wide_sd3().save_pretrained(tmp_path / "wide")
        argv = ["train", "tiny-chain", *_train_overrides("sd3", tmp_path / "wide", run, "model.resolution=128", "train.minibatch=8",
                                                         "sampling.max_batch=8", "sampling.num_steps=3", "model.finetune=lora")]
    else:
        argv = ["train", "tiny-chain", f"output_dir={run}", "iterations=1", "final_eval=false", "logging.report_to=none", "logging.sample_every=0"]
    # a fresh process: CUDA's peak of allocated memory is the process's, and earlier tests' tensors would count in it
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "branchdiff.cli", *argv], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    plan = json.loads((run / "plan.json").read_text())
    metrics = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    peaks = dict(plan["phase_peaks_gib"], train=max(plan["phase_peaks_gib"]["train"], plan["phase_peaks_gib"]["optimizer"]))
    ratios = {phase: metrics[f"memory_{phase}_gb"] / peaks[phase] for phase in ("rollout", "reward", "train")}
    summary[f"plan/{model}"] = {"gpu": plan["gpu"], "estimated_gib": {p: peaks[p] for p in ratios},
                                "measured_gib": {p: metrics[f"memory_{p}_gb"] for p in ratios}, "ratio": ratios}
    assert all(0.5 <= r <= 2.0 for r in ratios.values()), ratios
