#!/usr/bin/env python
"""Real-size checks on the CPU (docs/models.md, "Real-size checks"): a family's denoiser, text encoder and VAE
built from the release's published configs (branchdiff/plan/published.py) with random weights — on the meta
device, then materialised in bf16 — saved as a diffusers pipeline folder, counted against the published
parameter figures, then one LoRA tree iteration at a reduced resolution in a fresh process whose peak resident
memory per phase is set against `branchdiff plan`'s estimate of the same settings.

    python scripts/real_size_check.py sana --folder /tmp/sana-1.6b     # ~9 GB on disk, some minutes on 2 cores
    python scripts/real_size_check.py wan-1.3b --folder /tmp/wan-1.3b  # ~15 GB on disk (UMT5-XXL is 5.7 B)
    python scripts/real_size_check.py --counts                          # every release plan knows, counted on meta (seconds)

The tokenizer is the test suite's small one (tests/tiny_pipelines.py): ids stay inside the real vocabulary.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

PUBLISHED = {"sana": ("SANA 1600M", 1_604_000_000),  # the release's stated size (Sana_1600M: 1.6 B; 1604 M in its model card)
             "sd3.5-medium": ("SD3.5 Medium", 2_500_000_000),  # "2.5 billion parameters" (its model card): the MMDiT-X with its positional table
             "wan-1.3b": ("Wan 2.1 T2V 1.3B", 1_300_000_000),  # the release's name; its checkpoint holds 1.42 B (width 1536, 30 blocks)
             "flux2-klein-4b": ("FLUX.2 [klein] base 4B", 4_000_000_000)}  # "4B" (its model card): 3.9 B in the transformer
SETTINGS = {"sana": ["model.family=sana", "model.resolution=256", "model.dtype=bfloat16", "train.mixed_precision=bf16", "sampling.guidance=1.0",
                     "model.prompt_instruction=false"],
            "sd3.5-medium": ["model.family=sd3", "model.resolution=128", "model.dtype=bfloat16", "train.mixed_precision=bf16", "sampling.guidance=1.0"],
            "wan-1.3b": ["model.family=wan", "model.resolution=[128,128]", "model.frames=9", "model.dtype=bfloat16", "train.mixed_precision=bf16",
                         "sampling.guidance=1.0", "reward={name: rewards_for_tests:Redness, frames: 4, reduce: mean}"],
            # two training rows (not four): 15 GiB of weights leave this 23 GiB machine too little room for the page cache otherwise,
            # and the kernel then drops the mapped weights' pages from the resident set mid-phase (train measured 0.67 of the plan)
            "flux2-klein-4b": ["model.family=flux2-klein", "model.resolution=256", "model.dtype=bfloat16", "train.mixed_precision=bf16",
                               "sampling.guidance=1.0", "train.minibatch=2"]}
RUN = ["reward=rewards_for_tests:Redness", "prompts.per_iteration=1", "sampling.num_steps=2", "tree.roots=2", "tree.splits=[]", "iterations=1",
       "final_eval=false", "logging.report_to=none", "logging.sample_every=0", "train.lora_rank=8", "train.minibatch=4", "sampling.max_batch=4",
       "sampling.sde=flow", "sampling.noise_level=0.7"]


def materialise(module: torch.nn.Module) -> torch.nn.Module:
    """A meta-built module's storage on the CPU in bf16: weights ~ N(0, 0.02), 1-D weights 1, biases 0."""
    module.to(torch.bfloat16).to_empty(device="cpu")  # bf16 on meta first: the real size is allocated once, in bf16
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.02)
            else:
                p.fill_(1.0 if name.endswith("weight") else 0.0)
        for buffer in module.buffers():  # positional tables and the like: finite values
            buffer.zero_()
    return module


def _counts(transformer: torch.nn.Module, text_encoders: list[torch.nn.Module], vae: torch.nn.Module) -> dict[str, int]:
    """Parameters (and the denoiser's buffer values) of a release's parts, counted on meta."""
    count = lambda m: sum(p.numel() for p in m.parameters())
    return {"denoiser": count(transformer), "denoiser_buffers": sum(b.numel() for b in transformer.buffers()),
            "text_encoder": sum(map(count, text_encoders)), "vae": count(vae)}


def _save(folder: Path, pipeline: type, transformer: torch.nn.Module, text_encoders: dict[str, torch.nn.Module], vae: torch.nn.Module,
          **rest) -> dict[str, int]:
    """Count the meta-built parts, materialise them in bf16 and save the pipeline they make (`rest`: its tokenizers
    and scheduler) in `folder`; returns the counts."""
    counts = _counts(transformer, list(text_encoders.values()), vae)
    parts = {name: materialise(module) for name, module in text_encoders.items()}
    pipeline(transformer=materialise(transformer), vae=materialise(vae), **parts, **rest).save_pretrained(folder, safe_serialization=True)
    return counts


def build_sana(folder: Path) -> dict[str, int]:
    from diffusers import AutoencoderDC, FlowMatchEulerDiscreteScheduler, SanaPipeline, SanaTransformer2DModel
    from transformers import Gemma2Config, Gemma2Model

    from branchdiff.plan import published as P
    from tiny_pipelines import build_gemma_tokenizer

    with torch.device("meta"):
        transformer = SanaTransformer2DModel.from_config(P.SANA_1600M_1024_TRANSFORMER)
        text_encoder = Gemma2Model(Gemma2Config(**P.GEMMA2_2B))
        vae = AutoencoderDC.from_config(P.VAE_DCAE_F32C32)
    return _save(folder, SanaPipeline, transformer, {"text_encoder": text_encoder}, vae, tokenizer=build_gemma_tokenizer(),
                 scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0))


def build_sd35_medium(folder: Path) -> dict[str, int]:
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    from branchdiff.plan import published as P
    from tiny_pipelines import _clip_tokenizer, build_t5_tokenizer

    with torch.device("meta"):
        transformer = SD3Transformer2DModel.from_config(P.SD35_MEDIUM_TRANSFORMER)
        text_encoders = {"text_encoder": CLIPTextModelWithProjection(CLIPTextConfig(**P.CLIP_L)),
                         "text_encoder_2": CLIPTextModelWithProjection(CLIPTextConfig(**P.CLIP_G)),
                         "text_encoder_3": T5EncoderModel(T5Config(**P.T5_XXL))}
        vae = AutoencoderKL.from_config({**P.VAE_KL16, "scaling_factor": 1.5305, "shift_factor": 0.0609})  # SD3.5's vae/config.json
    return _save(folder, StableDiffusion3Pipeline, transformer, text_encoders, vae, tokenizer=_clip_tokenizer(), tokenizer_2=_clip_tokenizer(),
                 tokenizer_3=build_t5_tokenizer(), scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0))


def build_wan_1_3b(folder: Path) -> dict[str, int]:
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    from branchdiff.plan import published as P
    from tiny_pipelines import build_t5_tokenizer

    with torch.device("meta"):
        transformer = WanTransformer3DModel.from_config(P.WAN_T2V_1_3B_TRANSFORMER)
        text_encoder = UMT5EncoderModel(UMT5Config(**P.UMT5_XXL))
        vae = AutoencoderKLWan()  # its defaults are the release's VAE
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0, num_train_timesteps=1000)
    return _save(folder, WanPipeline, transformer, {"text_encoder": text_encoder}, vae, tokenizer=build_t5_tokenizer(), scheduler=scheduler)


def build_flux2_klein_4b(folder: Path) -> dict[str, int]:
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline, Flux2Transformer2DModel
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from branchdiff.plan import published as P
    from tiny_pipelines import build_qwen_tokenizer

    with torch.device("meta"):
        transformer = Flux2Transformer2DModel.from_config(P.FLUX2_KLEIN_4B_TRANSFORMER)
        text_encoder = Qwen3ForCausalLM(Qwen3Config(**P.QWEN3_4B))
        vae = AutoencoderKLFlux2()  # its defaults are the release's VAE
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True)
    return _save(folder, Flux2KleinPipeline, transformer, {"text_encoder": text_encoder}, vae, tokenizer=build_qwen_tokenizer(), scheduler=scheduler)


BUILDERS = {"sana": build_sana, "sd3.5-medium": build_sd35_medium, "wan-1.3b": build_wan_1_3b, "flux2-klein-4b": build_flux2_klein_4b}


def meta_counts(rank: int = 8) -> dict[str, dict[str, int]]:
    """Every release `branchdiff plan` knows, its denoiser built on meta from the published config: parameters, buffer
    values, the LoRA parameters peft attaches at `rank` on the family's attention targets as the trainer does (the
    family's unused modules left out), and the plan's r·(in + out) over the same layers."""
    from branchdiff.models.lora import add_lora
    from branchdiff.plan.families import families
    from branchdiff.plan.measure import build_meta, lora_targets, lora_targets_by_formula

    counts = {}
    for family in families().values():
        model = build_meta(family.denoiser, family.config, torch.bfloat16)
        names, unused = lora_targets(family, "attention"), family.adapter.unused_modules_of(model)
        counts[family.label] = {"denoiser": sum(p.numel() for p in model.parameters()), "buffers": sum(b.numel() for b in model.buffers()),
                                "lora_planned": lora_targets_by_formula(model, names, rank, unused)[0]}  # before the adapter is attached
        counts[family.label]["lora_attached"] = sum(p.numel() for p in add_lora(model, names, rank, float(rank), seed=0, unused=unused))
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("family", nargs="?", choices=sorted(PUBLISHED))
    parser.add_argument("--folder", type=Path, help="where the random-weight pipeline is saved (reused when present)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--counts", action="store_true", help="count every release on meta (parameters, LoRA r 8) and stop")
    args = parser.parse_args()
    if args.counts:
        counts = meta_counts()
        for label, c in counts.items():
            print(f"{label:<28}{c['denoiser']:>16,}{c['buffers']:>13,}  LoRA r 8 {c['lora_attached']:>12,} (plan {c['lora_planned']:,})")
        if args.json:
            args.json.write_text(json.dumps(counts, indent=1))
        return
    if args.family is None or args.folder is None:
        parser.error("give a FAMILY and --folder, or --counts")
    counts = json.loads((args.folder / "counts.json").read_text()) if (args.folder / "counts.json").is_file() else None
    if counts is None:
        counts = BUILDERS[args.family](args.folder)
        (args.folder / "counts.json").write_text(json.dumps(counts))
        os.sync()  # the folder's pages written back before the measured run needs the memory
    label, published = PUBLISHED[args.family]
    overrides = [*RUN, *SETTINGS[args.family], f"model.path={args.folder}", f"output_dir={args.folder.parent / (args.folder.name + '-run')}"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]), "HF_HUB_OFFLINE": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "plan_measured.py"), *overrides], env=env, capture_output=True, text=True)
    if done.returncode:
        sys.exit(done.stderr[-3000:])
    phases = json.loads(done.stdout.strip().splitlines()[-1])
    result = {"family": label, "parameters": counts, "published": published, "phases": phases,
              "ratio": {p: v["measured_gib"] / v["estimated_gib"] for p, v in phases.items()}}
    print(f"{label}: denoiser {counts['denoiser']:,} parameters (published {published:,}); text encoder {counts['text_encoder']:,}; VAE {counts['vae']:,}")
    for phase, v in phases.items():
        print(f"  {phase:<8} measured {v['measured_gib']:.2f} GiB, planned {v['estimated_gib']:.2f} GiB, ratio {result['ratio'][phase]:.2f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
