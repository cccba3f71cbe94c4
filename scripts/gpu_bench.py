#!/usr/bin/env python
"""Denoisers at their released sizes on one GPU (docs/gpu.md, "Real size"): each family's denoiser built from
its published config (branchdiff/plan/published.py) with random weights (speed and memory do not depend on
them), in bf16, fed the family's real input shapes at a stated real resolution, and measured:

- the device's bf16 matmul peak (an 8192³ product), measured in the same run;
- a no-grad forward (a rollout's) at several batch sizes: seconds, rows/s, achieved TFLOP/s from the plan's
  FLOP count (branchdiff/plan/measure.py) and that as a fraction of the measured peak; CUDA's peak memory
  above the weights against the plan's estimate of the same forward;
- a LoRA training forward + backward (rank 64 on the family's attention targets, as the presets train)
  at one or two rows: seconds, TFLOP/s (backward ≈ 2 forwards), CUDA's peak against the plan's;
- the forward at the largest batch with PyTorch's cuDNN attention kernel switched on (a run switches it off
  under `model.attention_backend: native`, branchdiff/models/attention.py), and the LoRA gradients with it
  against PyTorch's own kernels (finite, how far apart, the step's speed-up);
- with `--compile blocks|full`, last, the LoRA-wrapped forward at the largest batch eager and compiled as
  `model.compile` compiles it (the first call, compilation included, and the speed-up);
- first, whole training iterations (`--tree`, SD3.5 Medium): the chain, the tree, Mix and the best configuration of
  `branchdiff bench tree` (BranchGRPO's 20-step tree, 16 leaves a prompt) with the SD3.5 presets' settings (512²,
  CFG 4.5, LoRA rank 32, bf16, gradient checkpointing, helpers offloaded), each through `Trainer.run_iteration`
  on a pipeline saved from the published configs (random weights; the text encoders one layer deep at their real
  widths and token counts) and loaded by the real loading code: per-phase seconds, chain ÷ each, efficiency
  against the NFE-implied speed-up, CUDA's peak of each phase against `branchdiff plan`'s estimate of the same
  settings, and the rollout's log-prob check at bf16 (max |log p_train − log p_rollout| before the update); then
  branchdiff's ODE rollout of 8 images against the pipeline's own `__call__` making 8 (`rollout_against_pipeline`:
  the same forwards of the same rows, and the time ratio, target ≤ 1.02), and the same rollout with the first-block
  cache (`sampling.block_cache` 0.3): its speed-up, forwards skipped and how far its latents moved.
An optional measurement (cuDNN, compiled) that a kernel or compiler refuses records its error and the rest go on.

    python scripts/gpu_bench.py --out gpu-bench.json                 # the four released sizes, stops itself after --budget s
    python scripts/gpu_bench.py --tiny --out /tmp/bench.json         # every code path on tiny configs, on the CPU too
    python scripts/gpu_bench.py --tree none                          # the denoisers only

Each family is skipped with its reason when the time left or the memory runs short; the JSON is rewritten
after every measurement, so a run stopped from outside keeps what it measured.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

# family key of branchdiff.plan.families.families(), and the (frames, height, width) it is measured at
RELEASES: dict[str, tuple[int, int, int]] = {"sd3": (1, 1024, 1024), "flux2-klein-4b": (1, 1024, 1024), "sana": (1, 1024, 1024),
                                             "wan": (33, 480, 832)}
# --tiny: the same families' classes at a few blocks of small width (every code path, seconds on a CPU)
TINY: dict[str, dict] = {
    "sd3": dict(num_layers=2, attention_head_dim=8, num_attention_heads=2, joint_attention_dim=32, caption_projection_dim=16,
                pooled_projection_dim=16, pos_embed_max_size=32, dual_attention_layers=(0,)),
    "flux2-klein-4b": dict(num_layers=1, num_single_layers=1, num_attention_heads=2, attention_head_dim=16, joint_attention_dim=32,
                           axes_dims_rope=(4, 4, 4, 4)),
    "sana": dict(num_layers=1, num_attention_heads=2, attention_head_dim=8, num_cross_attention_heads=2, cross_attention_head_dim=8,
                 cross_attention_dim=16, caption_channels=32),
    "wan": dict(num_attention_heads=2, attention_head_dim=8, ffn_dim=32, num_layers=1, text_dim=32, freq_dim=16),
}
TINY_SIZES: dict[str, tuple[int, int, int]] = {"sd3": (1, 64, 64), "flux2-klein-4b": (1, 64, 64), "sana": (1, 128, 128), "wan": (5, 32, 48)}
LORA_RANK = 64
# the whole iterations (--tree): `bench tree`'s variants on SD3.5 Medium with its presets' settings (sd35-pickscore.yaml)
TREE_FAMILY = "sd3"
TREE_VARIANTS = ("chain", "tree", "mix", "best")  # the chain first: every ratio needs it
TREE_RESOLUTION, TREE_TINY_RESOLUTION = 512, 64
TREE_SETTINGS = ["model.family=sd3", "model.dtype=bfloat16", "model.offload=true", "model.finetune=lora", "train.lora_rank=32",
                 "train.lora_alpha=64", "train.mixed_precision=bf16", "train.gradient_checkpointing=true", "sampling.guidance=4.5",
                 "sampling.max_batch=16", "train.minibatch=8", "prompts.per_iteration=1", "reward=gpu_bench:Warmth", "logging.report_to=none",
                 "final_eval=false"]
TREE_TINY_SETTINGS = ["sampling.guidance=1.0", "train.gradient_checkpointing=false", "train.minibatch=64"]  # --tiny: the same code, less arithmetic
PHASES = ("rollout", "reward", "train")  # the phases an iteration's metrics measure (memory_<phase>_gb)


class Warmth:
    """A weight-free reward with spread on any image: mean of R − B (the tree iteration's; a real reward model's
    cost is the `score` phase of `bench tree`, measured where its weights are)."""

    name = "warmth"
    scale = "mean of R - B, in [-1, 1]"

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: dict | None = None) -> torch.Tensor:
        return (images[:, 0] - images[:, 2]).flatten(1).mean(dim=1)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(call: Callable[[], Any], device: torch.device, repeats: int, warmup: int = 2) -> float:
    """Mean seconds of `call` over `repeats` runs after `warmup` untimed ones."""
    for _ in range(warmup):
        call()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    synchronize(device)
    return (time.perf_counter() - start) / repeats


def matmul_peak(device: torch.device, n: int) -> float:
    """TFLOP/s of an n×n×n bf16 matrix product on random data (2n³ operations)."""
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    seconds = timed(lambda: a @ b, device, repeats=10, warmup=3)
    return 2 * n**3 / seconds / 1e12


def real_inputs(fake: Any, device: torch.device, key: str = "") -> Any:
    """A tensor (or list, dict) of the same shapes and dtypes as the plan's fake inputs, with values a pipeline
    gives: timesteps in [0, 1000), guidance 3.5, masks of ones, position ids 0, latents and states N(0, 1)."""
    if isinstance(fake, dict):
        return {k: real_inputs(v, device, k) for k, v in fake.items()}
    if isinstance(fake, list):
        return [real_inputs(v, device, key) for v in fake]
    if not torch.is_tensor(fake):
        return fake
    if key in ("timestep", "t"):
        return torch.rand(fake.shape, device=device).mul(1000).to(fake.dtype)
    if key == "guidance":
        return torch.full(fake.shape, 3.5, device=device, dtype=fake.dtype)
    if fake.dtype == torch.bool or "mask" in key:
        return torch.ones(fake.shape, device=device, dtype=fake.dtype)
    if not fake.dtype.is_floating_point or key.endswith("_ids"):
        return torch.zeros(fake.shape, device=device, dtype=fake.dtype)
    return torch.randn(fake.shape, device=device, dtype=fake.dtype)


class Bench:
    """One run's measurements, written to `out` after each one."""

    def __init__(self, out: Path, budget: float, device: torch.device) -> None:
        self.out, self.deadline, self.device = out, time.monotonic() + budget, device
        capability = torch.cuda.get_device_capability(0) if device.type == "cuda" else None
        self.record: dict[str, Any] = {
            "date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
            "capability": f"{capability[0]}.{capability[1]}" if capability else None, "torch": torch.__version__, "cuda": torch.version.cuda,
            "families": {}}

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def save(self) -> None:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(json.dumps(self.record, indent=1))

    def peak_memory(self, call: Callable[[], Any]) -> float:
        """CUDA's peak of allocated memory above the start during `call`, in bytes (0 off CUDA)."""
        if self.device.type != "cuda":
            call()
            return 0.0
        synchronize(self.device)
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        call()
        synchronize(self.device)
        return float(torch.cuda.max_memory_allocated() - start)


def measure_family(bench: Bench, key: str, size: tuple[int, int, int], tiny: bool, batches: list[int], train_rows: list[int],
                   peak_tflops: float, compile_mode: str = "none", compile_backend: str = "inductor") -> dict:
    """Every figure of one family; raises MemoryError-like CUDA errors to the caller."""
    import diffusers
    from torch._subclasses.fake_tensor import FakeTensorMode

    from branchdiff.models.attention import apply_backend
    from branchdiff.models.lora import add_lora
    from branchdiff.plan.families import families, geometry
    from branchdiff.plan.measure import lora_targets, measure

    family = families()[key]
    if tiny:
        family.config = {**family.config, **TINY[key]}
        family.reduced = {k: v for k, v in family.reduced.items() if k not in TINY[key]}
    vae = None
    if family.vae is not None:
        with torch.device("meta"):
            vae = getattr(diffusers, family.vae[0]).from_config(family.vae[1])
    shape = geometry(vae)
    planned = measure(family, torch.bfloat16, LORA_RANK, LORA_RANK, size, torch.bfloat16)
    flops = planned.forward_flops()
    result: dict[str, Any] = {"label": family.label, "size": list(size), "params": planned.denoiser_params, "forward_gflop_per_row": flops / 1e9,
                              "forward": {}, "train": {}}
    device = bench.device
    start = time.perf_counter()
    with device:
        denoiser = getattr(diffusers, family.denoiser).from_config(family.config).to(torch.bfloat16).eval()
    apply_backend(denoiser, "native", family.name)  # as a run does: PyTorch's SDPA, cuDNN's kernel off on CUDA
    result["build_seconds"] = time.perf_counter() - start

    def inputs(rows: int) -> dict:
        with FakeTensorMode(allow_non_fake_inputs=True):
            fake = family.inputs(denoiser.config, shape, rows, size, torch.bfloat16, family.text_tokens)
        return real_inputs(fake, device)

    def forward(batch: dict) -> Any:
        with torch.autocast(device.type, torch.bfloat16):
            return denoiser(**batch)

    repeats = 2 if tiny else 5
    for rows in batches:
        if bench.left() < 20:
            result["forward"][str(rows)] = "skipped: the run's time budget is spent"
            break
        call = partial(forward, inputs(rows))
        with torch.no_grad():
            seconds = timed(call, device, repeats)
            memory = bench.peak_memory(call)
        tflops = rows * flops / seconds / 1e12
        result["forward"][str(rows)] = {"seconds": seconds, "rows_per_second": rows / seconds, "tflops": tflops,
                                        "fraction_of_peak": tflops / peak_tflops, "peak_gib": memory / 2**30,
                                        "planned_gib": planned.rollout(rows) / 2**30}
        bench.save()
    largest = max((int(r) for r, v in result["forward"].items() if isinstance(v, dict)), default=0)
    if device.type == "cuda" and largest and bench.left() > 20:  # cuDNN's attention kernel, as PyTorch picks it when allowed
        result["forward_cudnn_attention"] = optional(lambda: cudnn_forward(forward, inputs(largest), device, repeats,
                                                                           result["forward"][str(largest)]["seconds"]))
    add_lora(denoiser, lora_targets(family, "attention"), LORA_RANK, LORA_RANK, seed=0, unused=family.adapter.unused_modules_of(denoiser))
    trainable = [p for p in denoiser.parameters() if p.requires_grad]
    result["lora_params"] = sum(p.numel() for p in trainable)
    if device.type == "cuda" and bench.left() > 30:  # cuDNN's attention backward against PyTorch's (NaN gradients on an H100, 2026-11-26)
        result["cudnn_attention_backward"] = optional(lambda: cudnn_backward(denoiser, forward, inputs(min(train_rows)), trainable, device,
                                                                             repeats))
        bench.save()
    for rows in train_rows:
        if bench.left() < 30:
            result["train"][str(rows)] = "skipped: the run's time budget is spent"
            break
        denoiser.train()
        call = partial(lora_gradients, denoiser, forward, inputs(rows), trainable)
        seconds = timed(call, device, repeats)
        memory = bench.peak_memory(call)
        tflops = 3 * rows * flops / seconds / 1e12
        result["train"][str(rows)] = {"seconds": seconds, "rows_per_second": rows / seconds, "tflops": tflops,
                                      "fraction_of_peak": tflops / peak_tflops, "peak_gib": memory / 2**30,
                                      "planned_gib": planned.train(rows, ckpt=False) / 2**30}
        bench.save()
    if compile_mode != "none" and largest and bench.left() > 60:  # last: compilation is in place, as a run's (LoRA attached)
        result["forward_compiled"] = optional(lambda: compiled_forward(denoiser, forward, inputs(largest), compile_mode, compile_backend, device,
                                                                       repeats))
    return result


def save_tree_pipeline(folder: Path, tiny: bool) -> None:
    """An SD3 pipeline saved to `folder` as `model.path` reads it: the denoiser and VAE from the published configs
    (random weights, bf16), the three text encoders at their real widths one layer deep (their weights are not
    what is measured; a prompt is encoded once an iteration), the built-in CLIP tokenizer for all three (77 and 256
    tokens, as the pipeline pads), SD3.5's scheduler; `tiny`: small widths, the same classes."""
    import diffusers
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    from branchdiff.models.loading import quiet_loading
    from branchdiff.models.tiny import build_tokenizer
    from branchdiff.plan import published
    from branchdiff.plan.families import families

    family = families()[TREE_FAMILY]
    denoiser_config = {**family.config, **(TINY[TREE_FAMILY] if tiny else {})}
    vae_config = {**published.VAE_KL16, "scaling_factor": 1.5305, "shift_factor": 0.0609}  # SD3.5's vae/config.json
    if tiny:
        vae_config.update(down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2, block_out_channels=[16, 32],
                          layers_per_block=1, norm_num_groups=8)
    tokenizers = [build_tokenizer() for _ in range(3)]
    for tokenizer in tokenizers[:2]:
        tokenizer.model_max_length = 77
    special = dict(vocab_size=len(tokenizers[0]), bos_token_id=tokenizers[0].bos_token_id, eos_token_id=tokenizers[0].eos_token_id,
                   pad_token_id=tokenizers[0].pad_token_id)
    width = (lambda real, small: small if tiny else real)
    clip_l = CLIPTextConfig(**{**published.CLIP_L, **special, "num_hidden_layers": 1, "hidden_size": width(768, 16),
                               "intermediate_size": width(3072, 32), "num_attention_heads": width(12, 2), "projection_dim": width(768, 8)})
    clip_g = CLIPTextConfig(**{**published.CLIP_G, **special, "num_hidden_layers": 1, "hidden_size": width(1280, 16),
                               "intermediate_size": width(5120, 32), "num_attention_heads": width(20, 2), "projection_dim": width(1280, 8)})
    t5 = T5Config(**{**published.T5_XXL, "num_layers": 1, "vocab_size": len(tokenizers[2]), "d_model": width(4096, denoiser_config["joint_attention_dim"]),
                     "d_ff": width(10240, 64), "num_heads": width(64, 2), "d_kv": width(64, 16), "pad_token_id": tokenizers[2].pad_token_id,
                     "eos_token_id": tokenizers[2].eos_token_id, "decoder_start_token_id": 0, "is_encoder_decoder": False})
    device = torch.device("cuda" if torch.cuda.is_available() and not tiny else "cpu")
    with device, quiet_loading():  # (diffusers' notices about casting a model built from its config)
        pipe = diffusers.StableDiffusion3Pipeline(
            transformer=diffusers.SD3Transformer2DModel.from_config(denoiser_config), vae=diffusers.AutoencoderKL.from_config(vae_config),
            scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0),
            text_encoder=CLIPTextModelWithProjection(clip_l), tokenizer=tokenizers[0],
            text_encoder_2=CLIPTextModelWithProjection(clip_g), tokenizer_2=tokenizers[1],
            text_encoder_3=T5EncoderModel(t5), tokenizer_3=tokenizers[2])
        pipe.to(torch.bfloat16).save_pretrained(folder, safe_serialization=True)


def tree_iterations(bench: Bench, tiny: bool, variants: list[str]) -> dict:
    """`variants` of `bench tree` (chain, tree, mix, best), each a fresh `Trainer` on the saved pipeline: one warm-up
    iteration (not with `tiny`), one measured; then the chain's trained-row cost c (`measure_trained_row_cost`, 4 rows) and the
    ratios and efficiencies of `bench tree`, and each phase's CUDA peak against the plan's estimate."""
    from branchdiff.bench.iteration import BASE, VARIANTS, chain_ratios, measure_trained_row_cost, variant_row
    from branchdiff.plan.estimate import Estimator, Target, estimate
    from branchdiff.settings.load import load_config
    from branchdiff.training.recipe import Trainer

    folder = Path(tempfile.mkdtemp(prefix="branchdiff-gpu-tree-"))
    resolution = TREE_TINY_RESOLUTION if tiny else TREE_RESOLUTION
    settings = [*BASE, *TREE_SETTINGS, *(TREE_TINY_SETTINGS if tiny else [])]
    result: dict[str, Any] = {"family": TREE_FAMILY, "resolution": resolution, "settings": settings, "variants": {}}
    try:
        start = time.perf_counter()
        save_tree_pipeline(folder / "pipeline", tiny)
        result["build_seconds"] = time.perf_counter() - start
        rows: dict[str, dict] = {}
        c = None
        estimator = Estimator()  # the family's figures measured once for every variant
        for name in variants:
            if bench.left() < 60:
                result["variants"][name] = "skipped: the run's time budget is spent"
                continue
            config = load_config(None, [*settings, *VARIANTS[name], f"model.path={folder / 'pipeline'}", f"model.resolution={resolution}",
                                        f"output_dir={folder / name}"])
            planned = estimate(config, Target(), estimator)
            trainer = None
            leftover = torch.cuda.memory_allocated() / 2**30 if bench.device.type == "cuda" else 0.0  # what no variant should find
            try:
                trainer = Trainer(config)
                if not tiny:
                    trainer.run_iteration(0)  # warm-up: kernels chosen, the allocator's pools grown
                synchronize(bench.device)
                start = time.perf_counter()
                metrics = trainer.run_iteration(1).metrics
                synchronize(bench.device)
                rows[name] = variant_row([{**metrics, "seconds": time.perf_counter() - start}])
                peaks = {phase: (metrics[f"memory_{phase}_gb"], planned.phase_peak(phase) / 2**30) for phase in PHASES}
                rows[name].update(logprob_check=metrics["logprob_check"], allocated_at_start_gib=leftover, runtime=trainer.runtime, memory={
                    phase: {"peak_gib": peak, "planned_gib": plan, "peak_over_plan": peak / plan} for phase, (peak, plan) in peaks.items()})
                if name == "chain":
                    c = measure_trained_row_cost(trainer, rows=4, repeats=3)
                result["variants"][name] = rows[name]
            except torch.cuda.OutOfMemoryError as error:  # this variant only: the smaller trees may still fit
                result["variants"][name] = f"skipped: out of memory ({str(error).splitlines()[0]}); plan's peak {planned.peak / 2**30:.1f} GiB"
            del trainer
            gc.collect()  # torch.compile's caches or an out-of-memory error's traceback may still refer to the weights
            if bench.device.type == "cuda":
                torch.cuda.empty_cache()
            bench.save()
        if c is not None and len(rows) > 1:  # (the chain measured)
            result["trained_row_cost_c"] = c
            result["ratios"] = chain_ratios(rows, c)  # also puts speedup, nfe_speedup, efficiency and efficiency_lost in each row
        result["rollout_vs_pipeline"] = optional(lambda: rollout_against_pipeline(folder / "pipeline", bench.device, resolution, tiny))
        bench.save()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return result


def rollout_against_pipeline(folder: Path, device: torch.device, resolution: int, tiny: bool, images: int = 8, steps: int = 10,
                             guidance: float = 4.5, repeats: int = 3, cache_threshold: float = 0.3) -> dict:
    """branchdiff's ODE rollout of `images` chains against `StableDiffusion3Pipeline.__call__` making as many images, at
    equal steps, guidance and resolution, on the pipeline saved in `folder` (bf16): both from the same prompt embeddings,
    to latents (no VAE decode, no prompt encoding), the mean of `repeats` timed calls after a warm-up. The tree's engine must
    add nothing per forward: the two make the same denoiser forwards of the same rows (counted), and the time ratio
    ours ÷ the pipeline's is what is left (target ≤ 1.02). Then our rollout again with the first-block cache at
    `cache_threshold` (branchdiff/models/block_cache.py): uncached ÷ cached seconds, the forwards that skipped, and the
    mean |Δ| of its latents from the uncached ones against their mean |x|."""
    import diffusers

    from branchdiff.core.rollout import NoiseAddress, SamplerSettings, grow
    from branchdiff.core.tree import TreeSpec, build_tree
    from branchdiff.models import load_adapter

    adapter = load_adapter(TREE_FAMILY, str(folder), device, resolution, torch.bfloat16, False)
    pipe = diffusers.StableDiffusion3Pipeline.from_pretrained(folder, torch_dtype=torch.bfloat16).to(device)
    pipe.set_progress_bar_config(disable=True)
    pipe.transformer = adapter.denoiser  # one denoiser for both: the same weights and kernels
    embeds = adapter.encode_prompts(["a photo of a cat"])
    tree = build_tree(TreeSpec(steps, roots=images, sde_steps=frozenset()), 1)
    schedule = adapter.schedule(steps).to(device)
    settings = SamplerSettings(max_batch=2 * images, guidance=guidance)
    latents = torch.randn(images, *adapter.latent_shape, generator=torch.Generator().manual_seed(0)).to(device, torch.bfloat16)
    conditional = {k: v for k, v in embeds.items() if not k.startswith("negative_")}
    call = dict(prompt_embeds=conditional["encoder_hidden_states"].expand(images, -1, -1),  # the SD3 adapter's names for the pipeline's embeddings
                pooled_prompt_embeds=conditional["pooled_projections"].expand(images, -1),
                negative_prompt_embeds=embeds["negative_encoder_hidden_states"].expand(images, -1, -1),
                negative_pooled_prompt_embeds=embeds["negative_pooled_projections"].expand(images, -1), num_inference_steps=steps,
                guidance_scale=guidance, height=resolution, width=resolution, latents=latents, output_type="latent")
    calls: list[int] = []
    hook = adapter.denoiser.register_forward_pre_hook(lambda module, args, kwargs: calls.append(int(kwargs["hidden_states"].shape[0])),
                                                      with_kwargs=True)
    ours_run = lambda: grow(adapter, tree, embeds, schedule, settings, NoiseAddress(0, 0, (0,)))
    theirs_run = lambda: pipe(**call)
    cached_run = lambda: grow(adapter, tree, embeds, schedule, replace(settings, block_cache=cache_threshold), NoiseAddress(0, 0, (0,)))
    with torch.no_grad():
        plain = ours_run().leaf_latents.float()
        ours_rows, calls[:] = list(calls), []
        theirs_run()
        theirs_rows, calls[:] = list(calls), []
        hook.remove()
        ours = timed(ours_run, device, repeats, warmup=0 if tiny else 1)
        theirs = timed(theirs_run, device, repeats, warmup=0 if tiny else 1)
        cached_rollout = cached_run()
        cached = timed(cached_run, device, repeats, warmup=0)
    moved = float((cached_rollout.leaf_latents.float() - plain).abs().mean() / plain.abs().mean())
    block_cache = {"threshold": cache_threshold, "seconds": cached, "uncached_over_cached": ours / cached,
                   "forwards_skipped": cached_rollout.forwards_cached / cached_rollout.forwards, "latents_moved": moved}
    return {"images": images, "steps": steps, "guidance": guidance, "resolution": resolution, "forward_rows": {"ours": ours_rows, "pipeline": theirs_rows},
            "seconds": {"ours": ours, "pipeline": theirs}, "ours_over_pipeline": ours / theirs, "block_cache": block_cache}


def optional(measure: Callable[[], dict]) -> dict | str:
    """An optional measurement's figures, or the line of the error a kernel or compiler raised (the rest still measured)."""
    try:
        return measure()
    except RuntimeError as error:
        return f"failed: {type(error).__name__}: {str(error).splitlines()[0]}"


def cudnn_forward(forward: Callable[[dict], Any], batch: dict, device: torch.device, repeats: int, native_seconds: float) -> dict:
    """The no-grad forward with cuDNN's attention kernel allowed, against the native one's `native_seconds`."""
    torch.backends.cuda.enable_cudnn_sdp(True)
    try:
        with torch.no_grad():
            seconds = timed(lambda: forward(batch), device, repeats)
    finally:
        torch.backends.cuda.enable_cudnn_sdp(False)
    return {"rows": len(next(iter(batch.values()))), "seconds": seconds, "speedup_over_native": native_seconds / seconds}


def compiled_forward(denoiser: torch.nn.Module, forward: Callable[[dict], Any], batch: dict, mode: str, backend: str, device: torch.device,
                     repeats: int) -> dict:
    """The no-grad forward of the LoRA-wrapped denoiser eager, then compiled in place as `model.compile` compiles it (the
    first call, compilation included, and the speed-up)."""
    from branchdiff.models.compile import compile_denoiser

    denoiser.eval()
    with torch.no_grad():
        eager = timed(lambda: forward(batch), device, repeats)
        compile_denoiser(denoiser, mode, backend)
        start = time.perf_counter()
        forward(batch)
        synchronize(device)
        first = time.perf_counter() - start
        seconds = timed(lambda: forward(batch), device, repeats)
    return {"mode": mode, "rows": len(next(iter(batch.values()))), "first_call_seconds": first, "eager_seconds": eager, "seconds": seconds,
            "speedup_over_eager": eager / seconds}


def lora_gradients(denoiser: torch.nn.Module, forward: Callable[[dict], Any], batch: dict, trainable: list[torch.nn.Parameter]) -> torch.Tensor:
    """The LoRA parameters' gradients of one training forward + backward (mean square of the output), flattened."""
    output = forward(batch)
    output = output[0] if isinstance(output, (tuple, list)) else output
    output = torch.stack(output) if isinstance(output, list) else output
    output.float().square().mean().backward()
    flat = torch.cat([p.grad.flatten() for p in trainable])
    for p in trainable:
        p.grad = None
    return flat


def cudnn_backward(denoiser: torch.nn.Module, forward: Callable[[dict], Any], batch: dict, trainable: list[torch.nn.Parameter],
                   device: torch.device, repeats: int) -> dict:
    """The LoRA gradients with cuDNN's attention kernel allowed against PyTorch's own kernels (the same batch): finite,
    their largest difference relative to the largest gradient, and the training step's speed-up."""
    denoiser.train()
    native = lora_gradients(denoiser, forward, batch, trainable)
    native_seconds = timed(lambda: lora_gradients(denoiser, forward, batch, trainable), device, repeats)
    torch.backends.cuda.enable_cudnn_sdp(True)
    try:
        cudnn = lora_gradients(denoiser, forward, batch, trainable)
        cudnn_seconds = timed(lambda: lora_gradients(denoiser, forward, batch, trainable), device, repeats)
    finally:
        torch.backends.cuda.enable_cudnn_sdp(False)
    scale = native.abs().max().item()
    return {"finite": bool(torch.isfinite(cudnn).all()), "native_finite": bool(torch.isfinite(native).all()),
            "max_difference_of_largest": (cudnn - native).abs().max().item() / scale if scale else None,
            "speedup_over_native": native_seconds / cudnn_seconds}


def row_counts(text: str) -> list[int]:
    """A comma-separated list of whole numbers ≥ 1 (argparse refuses anything else in one line, before anything runs)."""
    counts = [part.strip() for part in text.split(",") if part.strip()]
    if not counts or not all(part.isdigit() and int(part) >= 1 for part in counts):
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of row counts; give whole numbers ≥ 1 separated by commas, e.g. 1,2,4,8")
    return [int(part) for part in counts]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("gpu-bench.json"), help="the JSON written (default gpu-bench.json)")
    parser.add_argument("--budget", type=float, default=420.0, help="seconds after which no new measurement starts (default 420)")
    parser.add_argument("--families", default=",".join(RELEASES), help=f"comma-separated, of {', '.join(RELEASES)}")
    parser.add_argument("--batches", type=row_counts, default="1,2,4,8", help="forward batch sizes, network rows (default 1,2,4,8)")
    parser.add_argument("--train-rows", type=row_counts, default="1,2", help="training forward + backward batch sizes (default 1,2)")
    parser.add_argument("--compile", default="none", choices=["none", "blocks", "full"],
                        help="also time the forward at the largest batch compiled as model.compile does (default none)")
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile's backend (default inductor; eager: the tests' quick one)")
    parser.add_argument("--tree", default=",".join(TREE_VARIANTS),
                        help=f"whole iterations of these variants first (default {','.join(TREE_VARIANTS)}; none: skip)")
    parser.add_argument("--tiny", action="store_true", help="tiny configs of the same classes: every code path in seconds, CPU or GPU")
    args = parser.parse_args(argv)
    keys = [k for k in args.families.split(",") if k]
    unknown = [k for k in keys if k not in RELEASES]
    if unknown:
        parser.error(f"--families: {', '.join(unknown)} not measured here; choose among {', '.join(RELEASES)}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.tiny:
        parser.error("no CUDA device here: the released sizes need a GPU; --tiny runs every code path on the CPU")
    variants = [] if args.tree == "none" else [v for v in args.tree.split(",") if v]
    if any(v not in TREE_VARIANTS for v in variants):
        parser.error(f"--tree: choose among {', '.join(TREE_VARIANTS)} (or none)")
    bench = Bench(args.out, args.budget, device)
    bench.record["matmul_peak_tflops"] = peak = matmul_peak(device, 256 if args.tiny else 8192)
    bench.save()
    if variants:
        try:
            bench.record["tree_iteration"] = tree_iterations(bench, args.tiny, variants)
        except torch.cuda.OutOfMemoryError as error:
            bench.record["tree_iteration"] = f"skipped: out of memory ({str(error).splitlines()[0]})"
        except RuntimeError as error:
            traceback.print_exc()  # the log keeps where it failed; the JSON its line
            bench.record["tree_iteration"] = f"failed: {type(error).__name__}: {str(error).splitlines()[0]}"
        if device.type == "cuda":
            torch.cuda.empty_cache()
        bench.save()
        print(json.dumps({"tree_iteration": bench.record["tree_iteration"]}, indent=1), flush=True)
    batches, train_rows = args.batches, args.train_rows
    for key in keys:
        size = TINY_SIZES[key] if args.tiny else RELEASES[key]
        start = time.perf_counter()
        if bench.left() < 60:
            figures: dict | str = "skipped: the run's time budget is spent"
        else:
            try:
                figures = {**measure_family(bench, key, size, args.tiny, batches, train_rows, peak, args.compile, args.compile_backend),
                           "seconds": time.perf_counter() - start}
            except torch.cuda.OutOfMemoryError as error:
                figures = f"skipped: out of memory ({str(error).splitlines()[0]})"
            except RuntimeError as error:  # a kernel or compiler refusing this model: recorded, the other families still measured
                figures = f"failed: {type(error).__name__}: {str(error).splitlines()[0]}"
            if device.type == "cuda":
                torch.cuda.empty_cache()
        bench.record["families"][key] = figures
        bench.save()
        print(json.dumps({key: figures}, indent=1), flush=True)
    print(f"matmul peak {peak:.1f} TFLOP/s; written {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
