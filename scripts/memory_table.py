#!/usr/bin/env python
"""Per-preset GPU memory estimate, worked out on paper: parameters, activations at the preset's
batch, LoRA and optimizer state, beside the GPU each preset targets. Prints a markdown table.

    python scripts/memory_table.py            # the table (CPU only, no network; ~30 s, a third of it imports)
    python scripts/memory_table.py --detail   # plus the per-row activation figures behind it

Nothing is downloaded and no weights exist: every network is built at its real size on the `meta`
device from its published config (hard-coded below, each with its source), so parameter counts are
exact. Activation memory is measured, not guessed: a reduced-depth copy of each denoiser (one block
of every kind, full width) runs one forward on fake CUDA tensors (`FakeTensorMode`: shapes only) with
CUDA bf16 autocast switched on as `accelerator.autocast()` does, the preset's LoRA attached and
gradient checkpointing as in the preset; a dispatch mode counts the bytes of every tensor storage
alive. What the forward leaves alive is what autograd keeps for the backward; per-block figures are
scaled to the real number of blocks and linearly in network rows. Attention is counted as the
memory-efficient SDPA kernel (q, k, v, output and log-sum-exp kept, no N×N matrix), which is what
the GPU runs; the math fallback that CPU/fake tensors would pick is replaced for the trace.

Every figure is an ESTIMATE (see docs/memory-table.md for the formulas and what is not counted:
CUDA context, allocator fragmentation and caching, NCCL buffers, the backward's exact transients).
GiB = 2^30 bytes throughout.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import sys
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
warnings.filterwarnings("ignore")
logging.disable(logging.WARNING)  # torchao/pytree import chatter
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.utils import _pytree as pytree  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from branchdiff.models.lora import add_lora  # noqa: E402

GIB = 2**30
Size = tuple[int, int, int]  # (frames, height, width) in pixels of what a row makes: frames 1 for an image

# ------------------------------------------------------------------------------------------------
# Published configs. Sources: the hub config.json of each component (read through the public
# mirrors named below; the diffusers/transformers defaults fill the keys a config leaves out).
# ------------------------------------------------------------------------------------------------

# black-forest-labs/FLUX.1-dev transformer/config.json (19 double + 38 single blocks, width 3072).
FLUX_DEV_TRANSFORMER = dict(
    attention_head_dim=128, axes_dims_rope=[16, 56, 56], guidance_embeds=True, in_channels=64, joint_attention_dim=4096,
    num_attention_heads=24, num_layers=19, num_single_layers=38, patch_size=1, pooled_projection_dim=768,
)
# stabilityai/stable-diffusion-3.5-medium transformer/config.json (MMDiT-X: 24 blocks of width 1536,
# dual self-attention in blocks 0-12, RMS qk-norm). The hub repo is gated; the same values are
# hard-coded, identically, in public code that builds SD3.5-M without the repo (e.g. tenstorrent/
# tt-metal's and Comfy-Org fp8 loaders' _MEDIUM_TRANSFORMER_CONFIG), and SD3.5-M is published as 2.5B.
SD35_MEDIUM_TRANSFORMER = dict(
    sample_size=128, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64, num_attention_heads=24,
    joint_attention_dim=4096, caption_projection_dim=1536, pooled_projection_dim=2048, out_channels=16,
    pos_embed_max_size=384, dual_attention_layers=tuple(range(13)), qk_norm="rms_norm",
)
# Efficient-Large-Model/Sana_1600M_1024px_diffusers transformer/config.json (20 blocks of width
# 2240 = 70 heads × 32, linear self-attention, cross-attention 20 × 112, Mix-FFN ratio 2.5); the same
# values as diffusers' scripts/convert_sana_to_diffusers.py "SanaMS_1600M_P1_D20".
SANA_1600M_1024_TRANSFORMER = dict(
    sample_size=32, patch_size=1, num_layers=20, num_attention_heads=70, attention_head_dim=32,
    num_cross_attention_heads=20, cross_attention_head_dim=112, cross_attention_dim=2240, caption_channels=2304,
    in_channels=32, out_channels=32, attention_bias=False, mlp_ratio=2.5, dropout=0.0, norm_elementwise_affine=False,
    norm_eps=1e-6, interpolation_scale=None,
)
# stable-diffusion-v1-5/stable-diffusion-v1-5 unet/config.json: UNet2DConditionModel's defaults
# (blocks 320/640/1280/1280, 2 layers per block, 8 heads, cross-attention dim 768), sample 64.
SD15_UNET = dict(sample_size=64, in_channels=4, out_channels=4, cross_attention_dim=768, attention_head_dim=8)

# Wan-AI/Wan2.1-T2V-1.3B-Diffusers and -14B-Diffusers transformer/config.json (the release's configs,
# wan/configs/wan_t2v_1_3B.py and wan_t2v_14B.py: width 1536 = 12 × 128, FFN 8960, 30 blocks; width
# 5120 = 40 × 128, FFN 13824, 40 blocks; 2×2 patches, RMS qk-norm across heads, UMT5 text of width 4096).
_WAN_T2V = dict(patch_size=[1, 2, 2], attention_head_dim=128, in_channels=16, out_channels=16, text_dim=4096, freq_dim=256,
                cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
WAN_T2V_1_3B_TRANSFORMER = dict(_WAN_T2V, num_attention_heads=12, ffn_dim=8960, num_layers=30)
WAN_T2V_14B_TRANSFORMER = dict(_WAN_T2V, num_attention_heads=40, ffn_dim=13824, num_layers=40)

# VAEs. SD3.5 and FLUX.1: vae/config.json, AutoencoderKL with 16 latent channels and no quant convs;
# SD 1.5: vae/config.json, AutoencoderKL with 4 latent channels and quant convs; SANA: DC-AE f32c32
# (mit-han-lab/dc-ae-f32c32-sana-1.0-diffusers, the pipeline's vae/config.json).
_KL_BLOCKS = dict(in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
                  block_out_channels=[128, 256, 512, 512], layers_per_block=2, norm_num_groups=32)
VAE_KL16 = dict(_KL_BLOCKS, latent_channels=16, use_quant_conv=False, use_post_quant_conv=False)
VAE_KL4 = dict(_KL_BLOCKS, latent_channels=4)
VAE_DCAE_F32C32 = dict(
    in_channels=3, latent_channels=32, attention_head_dim=32,
    encoder_block_types=["ResBlock"] * 3 + ["EfficientViTBlock"] * 3, decoder_block_types=["ResBlock"] * 3 + ["EfficientViTBlock"] * 3,
    encoder_block_out_channels=[128, 256, 512, 512, 1024, 1024], decoder_block_out_channels=[128, 256, 512, 512, 1024, 1024],
    encoder_layers_per_block=[2, 2, 2, 3, 3, 3], decoder_layers_per_block=[3, 3, 3, 3, 3, 3],
    encoder_qkv_multiscales=[[], [], [], [5], [5], [5]], decoder_qkv_multiscales=[[], [], [], [5], [5], [5]],
    upsample_block_type="interpolate", downsample_block_type="Conv", decoder_norm_types="rms_norm", decoder_act_fns="silu",
)

# Text encoders (transformers configs of the pipelines' text_encoder*/config.json).
CLIP_L = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12, vocab_size=49408,
              max_position_embeddings=77, projection_dim=768, hidden_act="quick_gelu")  # openai/clip-vit-large-patch14
CLIP_G = dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=20, vocab_size=49408,
              max_position_embeddings=77, projection_dim=1280, hidden_act="gelu")  # OpenCLIP bigG (SD3 text_encoder_2)
T5_XXL = dict(d_model=4096, d_ff=10240, d_kv=64, num_heads=64, num_layers=24, vocab_size=32128,
              feed_forward_proj="gated-gelu")  # google/t5-v1_1-xxl (encoder only: SD3 text_encoder_3, FLUX text_encoder_2)
UMT5_XXL = dict(d_model=4096, d_ff=10240, d_kv=64, num_heads=64, num_layers=24, vocab_size=256384,
                feed_forward_proj="gated-gelu")  # google/umt5-xxl encoder (Wan's text_encoder, UMT5EncoderModel)
GEMMA2_2B = dict(hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4,
                 head_dim=256, vocab_size=256000)  # google/gemma-2-2b-it (SANA text_encoder, Gemma2Model)

# Reward models, resident on the GPU in float32 (branchdiff/rewards/hps.py: open_clip ViT-H-14 built in fp32 and
# loaded from HPS_v2.1_compressed.pt; branchdiff/rewards/pickscore.py: transformers CLIPModel of
# yuvalkirstain/PickScore_v1, laion/CLIP-ViT-H-14 geometry, stored in fp32).
VIT_H14_CLIP = dict(
    text_config=dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16, vocab_size=49408,
                     max_position_embeddings=77, hidden_act="gelu"),
    vision_config=dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=16, patch_size=14,
                       image_size=224, hidden_act="gelu"),
    projection_dim=1024,
)
# VideoAlign (KwaiVGI/VideoReward, branchdiff/rewards/videoalign.py): Qwen2-VL-2B-Instruct's config.json, 2.21 B parameters
# as published; resident in the dtype of its `dtype` kwarg (float32 unless the preset says otherwise).
QWEN2_VL_2B = dict(
    text_config=dict(hidden_size=1536, intermediate_size=8960, num_attention_heads=12, num_hidden_layers=28, num_key_value_heads=2,
                     vocab_size=151936, rms_norm_eps=1e-6, rope_theta=1e6),
    vision_config=dict(depth=32, embed_dim=1280, mlp_ratio=4, num_heads=16, in_chans=3, hidden_size=1536, patch_size=14,
                       spatial_merge_size=2, temporal_patch_size=2),
    tie_word_embeddings=True, vocab_size=151936,
)

# Qwen/Qwen-Image transformer/config.json (60 dual-stream blocks of width 3072 = 24 × 128, 2×2 patches,
# joint attention with Qwen2.5-VL-7B's 3584-wide states); its VAE is AutoencoderKLQwenImage's defaults
# (base 96, 16 latent channels, 3 spatial downsamplings); its text encoder Qwen/Qwen2.5-VL-7B-Instruct.
QWEN_IMAGE_TRANSFORMER = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128, num_attention_heads=24,
                              joint_attention_dim=3584, guidance_embeds=False, axes_dims_rope=(16, 56, 56))
QWEN25_VL_7B = dict(
    text_config=dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                     vocab_size=152064, rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]}),
    vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584, patch_size=14,
                       spatial_merge_size=2, temporal_patch_size=2, window_size=112, fullatt_block_indexes=[7, 15, 23, 31]),
    vocab_size=152064, hidden_size=3584,
)
# black-forest-labs/FLUX.2-dev: Flux2Transformer2DModel's defaults are its transformer/config.json (8 double + 48 single
# blocks of width 6144 = 48 × 128, MLP ratio 3, 128 latent channels, embedded guidance, text of 3 × 5120); its VAE
# AutoencoderKLFlux2's defaults (32 latent channels); its text encoder Mistral-Small-3.1-24B (Mistral3ForConditionalGeneration).
FLUX2_DEV_TRANSFORMER: dict = {}
MISTRAL_SMALL_31_24B = dict(
    text_config=dict(model_type="mistral", hidden_size=5120, intermediate_size=32768, num_hidden_layers=40, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=131072),
    vision_config=dict(model_type="pixtral", hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                       head_dim=64, patch_size=14, image_size=1540),
)
# black-forest-labs/FLUX.2-klein-base-4B: 5 double + 20 single blocks of width 3072 = 24 × 128, text of 3 × 2560
# (Qwen/Qwen3-4B's hidden states), no guidance embedding; the public re-implementations' configs (e.g.
# ServeurpersoCom/flux2.c's README: 5 double, 20 single blocks, Qwen3-4B of width 2560 and 36 layers). The 9B's
# config is not reproduced here.
FLUX2_KLEIN_4B_TRANSFORMER = dict(num_layers=5, num_single_layers=20, num_attention_heads=24, attention_head_dim=128, joint_attention_dim=7680,
                                  guidance_embeds=False)
QWEN3_4B = dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                vocab_size=151936, tie_word_embeddings=True)

# The GPU each preset targets (the presets' headers; one DDP process per GPU). Capacity as
# nvidia-smi reports it: H100 80GB SXM 81559 MiB (A100 80GB: 81920), a 24 GB card (RTX 4090,
# A10, L4): 24564 MiB.
GPUS = {"80": ("H100/A100 80 GB", 81559 / 1024), "24": ("24 GB GPU", 24564 / 1024)}


# ------------------------------------------------------------------------------------------------
# Families: what the adapters in branchdiff/models/ load, how many tokens a row carries, and the
# reduced-depth copy whose blocks are traced.
# ------------------------------------------------------------------------------------------------

@dataclass
class Family:
    name: str
    label: str
    adapter: type  # branchdiff adapter: LoRA targets, CFG, quantisation skips
    denoiser: str  # diffusers class
    config: dict
    block_lists: tuple[str, ...]  # ModuleLists of the blocks whose per-block figures scale to the real depth
    reduced: dict  # config overrides of the traced copy (one block of every kind)
    block_kind: Callable[[str, torch.nn.Module], str]
    inputs: Callable[[int, Size, torch.dtype, int], dict]  # (rows, size, dtype, text tokens) -> forward kwargs
    text_tokens: int  # per row: T5 512 (FLUX); CLIP 77 + T5 256 concatenated (SD3); Gemma 300 (SANA); CLIP 77 (SD 1.5)
    tokens: Callable[[Size], str]  # description of a row's tokens at a size
    text_encoders: list[tuple[str, Callable[[], torch.nn.Module]]]
    vae: tuple[str, dict]
    vae_latent: Callable[[Size], tuple[int, ...]]  # per image (video) latent the VAE decodes
    latent: Callable[[Size], tuple[int, ...]]  # per node latent the rollout stores (fp32)
    gpu: str
    ckpt_units: tuple[str, ...] = ()  # module classes diffusers checkpoints (UNet: resnets and transformer blocks)


def _text_models():
    from transformers import (
        CLIPTextConfig,
        CLIPTextModel,
        CLIPTextModelWithProjection,
        Gemma2Config,
        Gemma2Model,
        Mistral3Config,
        Mistral3ForConditionalGeneration,
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen3Config,
        Qwen3ForCausalLM,
        T5Config,
        T5EncoderModel,
        UMT5Config,
        UMT5EncoderModel,
    )

    return {
        "CLIP-L": lambda: CLIPTextModel(CLIPTextConfig(**CLIP_L)),
        "CLIP-L+proj": lambda: CLIPTextModelWithProjection(CLIPTextConfig(**CLIP_L)),
        "CLIP-G+proj": lambda: CLIPTextModelWithProjection(CLIPTextConfig(**CLIP_G)),
        "T5-XXL enc": lambda: T5EncoderModel(T5Config(**T5_XXL)),
        "Gemma-2-2B": lambda: Gemma2Model(Gemma2Config(**GEMMA2_2B)),
        "UMT5-XXL enc": lambda: UMT5EncoderModel(UMT5Config(**UMT5_XXL)),
        "Qwen2.5-VL-7B": lambda: Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**QWEN25_VL_7B)),
        "Mistral-Small-3.1-24B": lambda: Mistral3ForConditionalGeneration(Mistral3Config(**MISTRAL_SMALL_31_24B)),
        "Qwen3-4B": lambda: Qwen3ForCausalLM(Qwen3Config(**QWEN3_4B)),
    }


# The forward's inputs for `rows` network rows, as the adapters pass them (branchdiff/models/*.py):
# latents and text embeddings in the model dtype; `text` = the adapter's text tokens per row.

def _flux_inputs(rows: int, size: Size, dtype: torch.dtype, text: int) -> dict:
    tokens = (size[1] // 16) * (size[2] // 16)  # VAE /8, then 2×2 packing
    e = lambda *shape, dt=dtype: torch.empty(*shape, device="cuda", dtype=dt)  # noqa: E731
    return dict(hidden_states=e(rows, tokens, 64), encoder_hidden_states=e(rows, text, 4096), pooled_projections=e(rows, 768),
                timestep=e(rows), guidance=e(rows, dt=torch.float32), img_ids=e(tokens, 3), txt_ids=e(text, 3), return_dict=False)


def _sd3_inputs(rows: int, size: Size, dtype: torch.dtype, text: int) -> dict:
    e = lambda *shape, dt=dtype: torch.empty(*shape, device="cuda", dtype=dt)  # noqa: E731
    return dict(hidden_states=e(rows, 16, size[1] // 8, size[2] // 8), encoder_hidden_states=e(rows, text, 4096), pooled_projections=e(rows, 2048),
                timestep=e(rows, dt=torch.float32), return_dict=False)


def _sana_inputs(rows: int, size: Size, dtype: torch.dtype, text: int) -> dict:
    e = lambda *shape, dt=dtype: torch.empty(*shape, device="cuda", dtype=dt)  # noqa: E731
    return dict(hidden_states=e(rows, 32, size[1] // 32, size[2] // 32), encoder_hidden_states=e(rows, text, 2304),
                encoder_attention_mask=e(rows, text, dt=torch.int64), timestep=e(rows, dt=torch.float32), return_dict=False)


def _sd15_inputs(rows: int, size: Size, dtype: torch.dtype, text: int) -> dict:
    e = lambda *shape, dt=dtype: torch.empty(*shape, device="cuda", dtype=dt)  # noqa: E731
    return dict(sample=e(rows, 4, size[1] // 8, size[2] // 8), timestep=e(rows, dt=torch.float32), encoder_hidden_states=e(rows, text, 768), return_dict=False)


def _sd3_kind(name: str, block: torch.nn.Module) -> str:
    if getattr(block, "context_pre_only", False):
        return "last joint block (context pre-only)"
    return "joint block + dual attention" if getattr(block, "attn2", None) is not None else "joint block"


def _wan_inputs(rows: int, size: Size, dtype: torch.dtype, text: int) -> dict:
    e = lambda *shape, dt=dtype: torch.empty(*shape, device="cuda", dtype=dt)  # noqa: E731
    return dict(hidden_states=e(rows, 16, *_wan_latent(size)[1:]), timestep=e(rows, dt=torch.float32),
                encoder_hidden_states=e(rows, text, 4096), return_dict=False)


def _qwen_image_inputs(rows: int, size: Size, dtype: torch.dtype, text: int) -> dict:
    grid = (size[1] // 16, size[2] // 16)  # VAE /8, then 2×2 packing
    e = lambda *shape, dt=dtype: torch.empty(*shape, device="cuda", dtype=dt)  # noqa: E731
    return dict(hidden_states=e(rows, grid[0] * grid[1], 64), encoder_hidden_states=e(rows, text, 3584),
                encoder_hidden_states_mask=e(rows, text, dt=torch.bool), timestep=e(rows), img_shapes=[[(1, *grid)]] * rows, return_dict=False)


def _flux2_inputs(text_width: int, guidance: bool) -> Callable[[int, Size, torch.dtype, int], dict]:
    def inputs(rows: int, size: Size, dtype: torch.dtype, text: int) -> dict:
        tokens = (size[1] // 16) * (size[2] // 16)  # VAE /8, then the 2×2 patchify
        e = lambda *shape, dt=dtype: torch.empty(*shape, device="cuda", dtype=dt)  # noqa: E731
        return dict(hidden_states=e(rows, tokens, 128), encoder_hidden_states=e(rows, text, 3 * text_width), timestep=e(rows),
                    img_ids=e(rows, tokens, 4, dt=torch.int64), txt_ids=e(rows, text, 4, dt=torch.int64),
                    guidance=e(rows, dt=torch.float32) if guidance else None, return_dict=False)

    return inputs


def _flux2_family(name: str, label: str, config: dict, text: tuple[str, Callable[[], torch.nn.Module]], text_width: int, guidance: bool) -> Family:
    from branchdiff.models.flux2 import Flux2Adapter, Flux2KleinAdapter

    adapter = Flux2Adapter if guidance else Flux2KleinAdapter
    return Family(
        name, label, adapter, "Flux2Transformer2DModel", config, ("transformer_blocks", "single_transformer_blocks"),
        dict(num_layers=1, num_single_layers=1), lambda block_name, block: type(block).__name__, _flux2_inputs(text_width, guidance),
        adapter.max_sequence_length, lambda s: f"{(s[1] // 16) * (s[2] // 16)} image + {adapter.max_sequence_length} text", [text],
        ("AutoencoderKLFlux2", {}), lambda s: (32, s[1] // 8, s[2] // 8), lambda s: (128, s[1] // 16, s[2] // 16), "80",
    )


def _wan_latent(size: Size) -> tuple[int, int, int, int]:
    """Wan's latent of a video of F frames at H×W: (16, (F − 1)/4 + 1, H/8, W/8)."""
    return (16, (size[0] - 1) // 4 + 1, size[1] // 8, size[2] // 8)


def _wan_family(name: str, label: str, config: dict, text: dict) -> Family:
    from branchdiff.models.wan import WanAdapter

    return Family(
        name, label, WanAdapter, "WanTransformer3DModel", config, ("blocks",), dict(num_layers=1),
        lambda block_name, block: type(block).__name__, _wan_inputs, WanAdapter.max_sequence_length,
        lambda s: f"{math.prod(_wan_latent(s)[1:]) // 4} video + {WanAdapter.max_sequence_length} text (cross-attention)",
        [("UMT5-XXL enc", text["UMT5-XXL enc"])], ("AutoencoderKLWan", {}), _wan_latent, _wan_latent, "80",
    )


def families() -> dict[str, Family]:
    from branchdiff.models.flux import FluxAdapter
    from branchdiff.models.qwen_image import QwenImageAdapter
    from branchdiff.models.sana import SanaAdapter
    from branchdiff.models.sd3 import SD3Adapter
    from branchdiff.models.sd15 import SD15Adapter

    text = _text_models()
    return {
        "flux": Family(
            "flux", "FLUX.1-dev", FluxAdapter, "FluxTransformer2DModel", FLUX_DEV_TRANSFORMER,
            ("transformer_blocks", "single_transformer_blocks"), dict(num_layers=1, num_single_layers=1),
            lambda name, block: type(block).__name__, _flux_inputs, FluxAdapter.max_sequence_length,
            lambda s: f"{(s[1] // 16) * (s[2] // 16)} image + {FluxAdapter.max_sequence_length} text",
            [("CLIP-L", text["CLIP-L"]), ("T5-XXL enc", text["T5-XXL enc"])], ("AutoencoderKL", VAE_KL16),
            lambda s: (16, s[1] // 8, s[2] // 8), lambda s: ((s[1] // 16) * (s[2] // 16), 64), "80",
        ),
        "sd3": Family(
            "sd3", "SD3.5 Medium", SD3Adapter, "SD3Transformer2DModel", SD35_MEDIUM_TRANSFORMER,
            ("transformer_blocks",), dict(num_layers=3, dual_attention_layers=(0,)), _sd3_kind, _sd3_inputs, 77 + SD3Adapter.max_sequence_length,
            lambda s: f"{(s[1] // 16) * (s[2] // 16)} image + {77 + SD3Adapter.max_sequence_length} text",
            [("CLIP-L", text["CLIP-L+proj"]), ("CLIP-G", text["CLIP-G+proj"]), ("T5-XXL enc", text["T5-XXL enc"])], ("AutoencoderKL", VAE_KL16),
            lambda s: (16, s[1] // 8, s[2] // 8), lambda s: (16, s[1] // 8, s[2] // 8), "80",
        ),
        "sana": Family(
            "sana", "SANA 1600M 1024px", SanaAdapter, "SanaTransformer2DModel", SANA_1600M_1024_TRANSFORMER,
            ("transformer_blocks",), dict(num_layers=1), lambda name, block: type(block).__name__, _sana_inputs, SanaAdapter.max_sequence_length,
            lambda s: f"{(s[1] // 32) * (s[2] // 32)} image (+ {SanaAdapter.max_sequence_length} text, cross-attention)",
            [("Gemma-2-2B", text["Gemma-2-2B"])], ("AutoencoderDC", VAE_DCAE_F32C32),
            lambda s: (32, s[1] // 32, s[2] // 32), lambda s: (32, s[1] // 32, s[2] // 32), "80",
        ),
        "sd15": Family(
            "sd15", "SD 1.5", SD15Adapter, "UNet2DConditionModel", SD15_UNET,
            (), {}, lambda name, block: name, _sd15_inputs, 77,
            lambda s: f"{(s[1] // 8) * (s[2] // 8)} at the top level (+ 77 text, cross-attention)",
            [("CLIP-L", text["CLIP-L"])], ("AutoencoderKL", VAE_KL4),
            lambda s: (4, s[1] // 8, s[2] // 8), lambda s: (4, s[1] // 8, s[2] // 8), "24",
            ckpt_units=("ResnetBlock2D", "BasicTransformerBlock"),
        ),
        "wan": _wan_family("wan", "Wan 2.1 T2V 1.3B", WAN_T2V_1_3B_TRANSFORMER, text),
        "wan-14b": _wan_family("wan-14b", "Wan 2.1 T2V 14B", WAN_T2V_14B_TRANSFORMER, text),
        "qwen-image": Family(
            "qwen-image", "Qwen-Image", QwenImageAdapter, "QwenImageTransformer2DModel", QWEN_IMAGE_TRANSFORMER,
            ("transformer_blocks",), dict(num_layers=1), lambda name, block: type(block).__name__, _qwen_image_inputs,
            QwenImageAdapter.max_sequence_length, lambda s: f"{(s[1] // 16) * (s[2] // 16)} image + {QwenImageAdapter.max_sequence_length} text",
            [("Qwen2.5-VL-7B", text["Qwen2.5-VL-7B"])], ("AutoencoderKLQwenImage", {}),
            lambda s: (16, 1, s[1] // 8, s[2] // 8), lambda s: ((s[1] // 16) * (s[2] // 16), 64), "80",
        ),
        "flux2": _flux2_family("flux2", "FLUX.2 [dev]", FLUX2_DEV_TRANSFORMER, ("Mistral-Small-3.1-24B", text["Mistral-Small-3.1-24B"]), 5120, True),
        "flux2-klein-4b": _flux2_family("flux2-klein-4b", "FLUX.2 [klein] base 4B", FLUX2_KLEIN_4B_TRANSFORMER, ("Qwen3-4B", text["Qwen3-4B"]),
                                        2560, False),
    }


def family_key(config) -> str:
    """The `families()` entry of a run's model: its family, Wan's 14B where the model path names it, FLUX.2 [klein]'s
    4B (the only [klein] whose config is reproduced here)."""
    if config.model.family == "wan" and "14b" in str(config.model.path).lower():
        return "wan-14b"
    if config.model.family == "flux2-klein":
        if "4b" not in str(config.model.path).lower():
            raise ValueError(f"{config.model.path}: only FLUX.2 [klein] 4B's config is reproduced here; estimate with {KLEIN_4B}")
        return "flux2-klein-4b"
    return config.model.family


def size_of(config) -> Size:
    """(frames, height, width) of what a run's model makes: frames 1 for an image family."""
    resolution = config.model.resolution
    height, width = (resolution, resolution) if isinstance(resolution, int) else tuple(resolution)
    return (config.model.frames if config.model.family == "wan" else 1, height, width)


# ------------------------------------------------------------------------------------------------
# Counting on the meta device
# ------------------------------------------------------------------------------------------------

def numel(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def build_meta(class_name: str, config: dict, dtype: torch.dtype) -> torch.nn.Module:
    import diffusers

    with torch.device("meta"):
        model = getattr(diffusers, class_name).from_config(config)
    return model.to(dtype)


def lora_targets_by_formula(model: torch.nn.Module, targets: list[str], rank: int) -> tuple[int, int]:
    """Σ r·(in + out) and Σ in·out over the nn.Linear layers whose name ends with a target (peft's
    suffix match), on a model without an adapter."""
    lora = base = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and any(name == t or name.endswith("." + t) for t in targets):
            lora += rank * (module.in_features + module.out_features)
            base += module.in_features * module.out_features
    return lora, base


def explore_copy_bytes(model: torch.nn.Module, skips: tuple[str, ...], dtype_bytes: int) -> tuple[int, int]:
    """Bytes of the torchao-fp8 exploration copy (branchdiff.explore.quant.make_quantized_copy): LoRA merged,
    the Linear layers quantised: E4M3 weights (1 B/param) with one fp32 scale per output row, bias
    kept; everything else (convs, norms, embedders, skipped layers) in the model dtype. Also returns
    the number of quantised weights."""
    try:
        from branchdiff.explore.quant import QuantConfig, quantized_layer_names

        names = set(quantized_layer_names(model, QuantConfig("torchao-fp8", tuple(skips))))
    except (ImportError, AttributeError, TypeError):  # the same rule (Linear, dims % 16, not skipped) if quant.py moves
        import fnmatch

        def skipped(name):
            parts = name.split(".")
            return any(fnmatch.fnmatchcase(".".join(parts[: i + 1]), s) for s in skips for i in range(len(parts)))
        names = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m.in_features % 16 == 0
                 and m.out_features % 16 == 0 and not skipped(n)}
    total = quantised = 0
    for name, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            if "lora_" in name or "lora_" in pname:
                continue  # merged into the base weight
            base_name = name.replace(".base_layer", "")
            if base_name in names and pname == "weight":
                total += p.numel() + p.shape[0] * 4
                quantised += p.numel()
            else:
                total += p.numel() * dtype_bytes
    total += sum(b.numel() for b in model.buffers()) * dtype_bytes
    return total, quantised


# ------------------------------------------------------------------------------------------------
# Activation trace: fake CUDA tensors, CUDA autocast, live-storage accounting
# ------------------------------------------------------------------------------------------------

ALIASING: dict = {}  # aten op -> whether its outputs alias its inputs (schema annotation)


@dataclass(frozen=True)
class Cost:
    """Bytes = fixed + per_row · rows. Per-row: activations. Fixed: tensors made once per forward
    whatever the batch, i.e. weights cast by autocast (SD 1.5's fp16 weights cast to bf16, kept for
    the backward; the fp32 LoRA weights' bf16 copies)."""

    fixed: float = 0.0
    per_row: float = 0.0

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.fixed + other.fixed, self.per_row + other.per_row)

    def __sub__(self, other: Cost) -> Cost:
        return Cost(self.fixed - other.fixed, self.per_row - other.per_row)

    def __rmul__(self, k: float) -> Cost:
        return Cost(k * self.fixed, k * self.per_row)

    def at(self, rows: int) -> float:
        return self.fixed + self.per_row * rows


class Peak:
    """The peak of fixed + per_row · rows over a run, for any rows: the live (fixed, per_row) points
    that no other point dominates (their maximum at `rows` is the peak)."""

    def __init__(self, start: Cost = Cost()) -> None:
        self.start, self.points = start, [start]

    def add(self, point: Cost) -> None:
        if any(p.fixed >= point.fixed and p.per_row >= point.per_row for p in self.points):
            return
        self.points = [p for p in self.points if not (point.fixed >= p.fixed and point.per_row >= p.per_row)] + [point]

    def at(self, rows: int) -> float:
        """Peak above the start."""
        return max(p.at(rows) for p in self.points) - self.start.at(rows)


class LiveBytes(TorchDispatchMode):
    """Bytes of the tensor storages allocated inside the mode and still alive, split into per-forward
    weight casts (`fixed`: an `_to_copy` of a parameter) and the rest (per row); the run's peak and a
    peak local to the current block (reset by `mark`)."""

    def __init__(self, weights: set[int]) -> None:
        super().__init__()
        self.weights = weights  # storage ids of the model's parameters
        self.fixed = self.rows = 0
        self.sizes: dict[int, tuple[int, bool]] = {}
        self.peak = Peak()
        self.local = Peak()

    @property
    def live(self) -> Cost:
        return Cost(self.fixed, self.rows)

    def mark(self) -> Cost:
        self.local = Peak(self.live)
        return self.live

    def _free(self, key: int) -> None:
        size, fixed = self.sizes.pop(key)
        if fixed:
            self.fixed -= size
        else:
            self.rows -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func not in ALIASING:  # views and in-place ops return (parts of) their inputs: nothing allocated
            ALIASING[func] = any(r.alias_info is not None for r in func._schema.returns)
        if ALIASING[func]:
            return out
        fixed = func is torch.ops.aten._to_copy.default and isinstance(args[0], torch.Tensor) and id(args[0].untyped_storage()) in self.weights
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = id(storage)
                if key not in self.sizes:
                    self.sizes[key] = (storage.nbytes(), fixed)
                    if fixed:
                        self.fixed += storage.nbytes()
                    else:
                        self.rows += storage.nbytes()
                    weakref.finalize(storage, self._free, key)
        self.peak.add(self.live)
        self.local.add(self.live)
        return out


def efficient_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """F.scaled_dot_product_attention as the CUDA memory-efficient kernel runs it (keeps q, k, v, out,
    log-sum-exp; a mask becomes an additive bias, padded to a multiple of 16 keys as PyTorch does)."""
    if torch.is_autocast_enabled("cuda"):
        dtype = torch.get_autocast_dtype("cuda")
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        repeat = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(repeat, -3), value.repeat_interleave(repeat, -3)
    bias = None
    if attn_mask is not None:
        bias = attn_mask if attn_mask.dtype != torch.bool else torch.zeros_like(attn_mask, dtype=query.dtype).masked_fill(~attn_mask, -math.inf)
        bias = bias.to(query.dtype).expand(*query.shape[:-1], key.shape[-2])
        pad = -key.shape[-2] % 16
        if pad:
            bias = torch.nn.functional.pad(bias, (0, pad))[..., : key.shape[-2]]
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    return torch.ops.aten._scaled_dot_product_efficient_attention(query, key, value, bias, grad, dropout_p, is_causal, scale=scale)[0]


@contextlib.contextmanager
def efficient_attention():
    original = torch.nn.functional.scaled_dot_product_attention
    torch.nn.functional.scaled_dot_product_attention = efficient_sdpa
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = original


@contextlib.contextmanager
def cuda_autocast(dtype: torch.dtype | None):
    """CUDA autocast as `accelerator.autocast()` enables it (torch.autocast refuses without a GPU; the
    dispatch keys work on fake CUDA tensors)."""
    if dtype is None:
        yield
        return
    torch._C.set_autocast_enabled("cuda", True)
    torch._C.set_autocast_dtype("cuda", dtype)
    torch._C.autocast_increment_nesting()
    try:
        yield
    finally:
        if torch._C.autocast_decrement_nesting() == 0:
            torch._C.clear_autocast_cache()
        torch._C.set_autocast_enabled("cuda", False)


@dataclass
class Trace:
    held: Cost = Cost()  # alive after the forward: what autograd keeps for the backward (+ the output)
    peak: Peak = field(default_factory=Peak)  # during the forward
    delta: dict[str, Cost] = field(default_factory=dict)  # per block kind: what the block leaves alive
    transient: dict[str, Peak] = field(default_factory=dict)  # per block kind: its peak above its start
    count: dict[str, int] = field(default_factory=dict)  # blocks of each kind in the traced copy


def units(model: torch.nn.Module, family: Family):
    """(name, module) of the blocks whose figures are kept per kind."""
    if family.ckpt_units:
        return [(n, m) for n, m in model.named_modules() if type(m).__name__ in family.ckpt_units]
    return [(f"{lst}.{i}", m) for lst in family.block_lists for i, m in enumerate(getattr(model, lst))]


def trace(model: torch.nn.Module, family: Family, size: Size, grad: bool, autocast: torch.dtype | None) -> Trace:
    """One forward of one network row through `model` (already on fake CUDA)."""
    tracker = LiveBytes({id(p.untyped_storage()) for p in model.parameters()})
    result = Trace()
    starts: dict[str, Cost] = {}
    hooks = []
    for name, module in units(model, family):
        kind = family.block_kind(name, module)
        result.count[kind] = result.count.get(kind, 0) + 1

        def pre(mod, args, name=name):
            starts[name] = tracker.mark()

        def post(mod, args, out, name=name, kind=kind):
            result.delta[kind] = tracker.live - starts[name]  # the last block of a kind stands for all of them
            if kind not in result.transient or tracker.local.at(1) > result.transient[kind].at(1):
                result.transient[kind] = tracker.local

        hooks += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    try:
        with efficient_attention(), torch.set_grad_enabled(grad), cuda_autocast(autocast), tracker:
            out = model(**family.inputs(1, size, model.dtype, family.text_tokens))
            result.held, result.peak = tracker.live, tracker.peak
            del out
    finally:
        for h in hooks:
            h.remove()
    return result


def forward_peak(model: torch.nn.Module, inputs: dict, grad: bool, autocast: torch.dtype | None) -> Peak:
    """The peak above the start of one forward of `model` (on fake CUDA) on `inputs` (one network
    row, fake CUDA tensors), as `trace` counts it; `.at(rows)` scales it to a batch. The GPU suite
    (tests/test_gpu.py) sets this estimate against a real forward's peak."""
    tracker = LiveBytes({id(p.untyped_storage()) for p in model.parameters()})
    with efficient_attention(), torch.set_grad_enabled(grad), cuda_autocast(autocast), tracker:
        out = model(**inputs)
        peak = tracker.peak
        del out
    return peak


def trace_vae_decode(vae: torch.nn.Module, latent: tuple[int, ...]) -> float:
    """Peak bytes of decoding one image (no grad, the VAE's dtype, outside autocast as adapter.decode)."""
    tracker = LiveBytes(set())
    with efficient_attention(), torch.no_grad(), tracker:
        z = torch.empty(1, *latent, device="cuda", dtype=vae.dtype)
        vae.decode(z, return_dict=False)
    return tracker.peak.at(1)


# ------------------------------------------------------------------------------------------------
# Per-family measurements (independent of the preset's batch sizes)
# ------------------------------------------------------------------------------------------------

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class Measured:
    denoiser_params: int
    denoiser_buffers: int  # persistent buffers (SD3's positional table), held in the model dtype too
    lora_params: int
    lora_base_params: int  # weights of the LoRA-wrapped layers
    copy_bytes: int  # fp8 explore copy
    copy_quantised: int
    encoders: dict[str, int]  # params
    vae_params: int
    counts: dict[str, int]  # blocks of each kind in the real denoiser
    block_params: int  # the largest block's parameters: what FSDP2 gathers per unit
    plain: Trace  # training forward, no checkpointing
    ckpt: Trace  # training forward, gradient checkpointing
    nograd: Trace  # rollout forward
    decode_image: float  # VAE decode peak per image

    def held(self, rows: int, ckpt: bool) -> float:
        """Alive after the training forward, at the real depth: traced + Σ (real − traced blocks) × per-block."""
        t = self.ckpt if ckpt else self.plain
        return sum(((self.counts[k] - t.count.get(k, 0)) * t.delta[k] for k in self.counts), t.held).at(rows)

    def recompute(self, rows: int) -> float:
        """Checkpointing: one block's saved set, rebuilt during the backward (the largest kind)."""
        return max(((self.plain.delta[k] - self.ckpt.delta[k]).at(rows) for k in self.counts), default=0.0)

    def backward(self, rows: int) -> float:
        """The backward's working set (gradients of one block's ops), taken as one block's no-grad working set."""
        return max((p.at(rows) for p in self.nograd.transient.values()), default=0.0)

    def train(self, rows: int, ckpt: bool) -> float:
        """Peak of the training forward + backward."""
        return self.held(rows, ckpt) + (self.recompute(rows) if ckpt else 0.0) + self.backward(rows)

    def rollout(self, rows: int) -> float:
        """Peak of a no-grad forward (rollout chunk, KL reference)."""
        return self.nograd.peak.at(rows)


def measure(family: Family, dtype: torch.dtype, rank: int, alpha: float, size: Size, autocast: torch.dtype | None) -> Measured:
    import diffusers
    from torch._subclasses.fake_tensor import FakeTensorMode

    targets = list(family.adapter.lora_target_sets["attention"])
    dbytes = torch.finfo(dtype).bits // 8
    full = build_meta(family.denoiser, family.config, dtype)
    params, buffers = numel(full), sum(b.numel() for b in full.buffers())
    lora, lora_base = lora_targets_by_formula(full, targets, rank)  # verified against peft below
    counts: dict[str, int] = {}
    for name, module in units(full, family):
        kind = family.block_kind(name, module)
        counts[kind] = counts.get(kind, 0) + 1
    block_params = max((numel(module) for _, module in units(full, family)), default=0)
    copy_bytes, quantised = explore_copy_bytes(full, tuple(family.adapter.quant_skip_modules), dbytes)

    encoders = {}
    for label, build in family.text_encoders:
        with torch.device("meta"):
            encoders[label] = numel(build())
    vae_class, vae_config = family.vae
    with torch.device("meta"):
        vae = getattr(diffusers, vae_class).from_config(vae_config).to(dtype)
    vae_params = numel(vae)

    # the traced copy (the full model itself when nothing is reduced), built on meta outside the
    # fake mode and materialised as fake CUDA tensors inside it
    model = build_meta(family.denoiser, {**family.config, **family.reduced}, dtype) if family.reduced else full
    expected = lora_targets_by_formula(model, targets, rank)[0]
    attached = sum(p.numel() for p in add_lora(model, targets, rank, alpha, seed=0))
    if attached != expected:  # peft's count on the traced copy must equal the formula used for the full model
        raise RuntimeError(f"{family.name}: peft attached {attached} LoRA parameters, r·(in+out) over the targets gives {expected}")
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cuda")
        plain = trace(model, family, size, True, autocast)
        nograd = trace(model, family, size, False, autocast)
        # diffusers' checkpointing (non-reentrant); the RNG state is not saved: there is no CUDA to ask
        model.enable_gradient_checkpointing(
            lambda module, *args: torch.utils.checkpoint.checkpoint(module.__call__, *args, use_reentrant=False, preserve_rng_state=False))
        ckpt = trace(model, family, size, True, autocast)
        vae.to_empty(device="cuda")
        decode_image = trace_vae_decode(vae, family.vae_latent(size))
    return Measured(params, buffers, lora, lora_base, copy_bytes, quantised, encoders, vae_params, counts, block_params, plain, ckpt, nograd,
                    decode_image)


# ------------------------------------------------------------------------------------------------
# Presets
# ------------------------------------------------------------------------------------------------

WAN_14B = "model.path=Wan-AI/Wan2.1-T2V-14B-Diffusers"
KLEIN_4B = "model.path=black-forest-labs/FLUX.2-klein-base-4B"
# (preset, its overrides): each row's preset and -explore variant; Wan 14B is wan-mq-branch on the 14B model
PRESETS = [("sd35-pickscore", ()), ("flux-hps-branch", ()), ("flux-hps-mix", ()), ("sana-pickscore", ()), ("sd15-hps", ()),
           ("wan-mq-branch", ()), ("wan-mq-branch", (WAN_14B,)), ("qwen-image-pickscore", ()), ("flux2-pickscore", ()),
           ("flux2-klein-pickscore", (KLEIN_4B,))]
EVAL_CHUNK = 16  # prompts per evaluate() chunk (its default)
RESERVE = 2 * GIB  # a suggested setting must leave this free: CUDA context (~1 GiB) and allocator slack
REWARD_PARAMS: dict[str, int] = {}


def reward_params(model: str = "vit-h-14") -> int:
    """Parameters of a reward's network, counted on meta: "vit-h-14" (HPS v2.1 and PickScore share the
    geometry) or "qwen2-vl-2b" (VideoAlign)."""
    if model not in REWARD_PARAMS:
        from transformers import CLIPConfig, CLIPModel, Qwen2VLConfig, Qwen2VLForConditionalGeneration

        with torch.device("meta"):
            network = CLIPModel(CLIPConfig(**VIT_H14_CLIP)) if model == "vit-h-14" else Qwen2VLForConditionalGeneration(Qwen2VLConfig(**QWEN2_VL_2B))
        REWARD_PARAMS[model] = numel(network)
    return REWARD_PARAMS[model]


def reward_bytes(spec) -> int:
    """GPU bytes of one reward component's weights: HPS / PickScore fp32 ViT-H-14, VideoAlign's
    Qwen2-VL-2B in its `dtype`; the programmatic rewards (flicker, the verifiers) hold none."""
    if spec.name in ("hpsv2", "hpsv2.1", "pickscore"):
        return reward_params("vit-h-14") * 4
    if spec.name == "videoalign":
        return reward_params("qwen2-vl-2b") * torch.finfo(DTYPES[spec.kwargs.get("dtype", "float32")]).bits // 8
    return 0


@dataclass
class Row:
    preset: str
    values: dict
    label: str = ""  # the row's name in the tables: the preset, and the overrides that made it (WAN_14B)

    @property
    def name(self) -> str:
        return self.label or self.preset


def estimate(preset: str, fams: dict[str, Family], cache: dict, overrides: tuple[str, ...] = ()) -> Row:
    """The estimate for `preset` (and its -explore variant) with dotted config `overrides`."""
    from branchdiff.core.tree import build_tree
    from branchdiff.rewards.combine import parse_reward_specs
    from branchdiff.settings.load import load_config
    from branchdiff.settings.trees import tree_spec

    config = load_config(preset, list(overrides))
    explore = load_config(preset + "-explore", list(overrides))
    family = fams[family_key(config)]
    dtype = DTYPES[config.model.dtype]
    dbytes = torch.finfo(dtype).bits // 8
    autocast = torch.bfloat16 if config.train.mixed_precision == "bf16" else None
    rank, alpha, size = config.train.lora_rank, config.train.lora_alpha, size_of(config)
    pixels = math.prod(size) * 3  # values per decoded image (video)
    key = (family.name, dtype, rank, alpha, size, autocast)
    if key not in cache:
        cache[key] = measure(family, dtype, rank, alpha, size, autocast)
    m: Measured = cache[key]

    cfg_rows = 2 if family.adapter.uses_cfg and (config.sampling.guidance or family.adapter.default_guidance) > 1 else 1
    train_rows = config.train.minibatch * cfg_rows
    chunk_rows = max(1, config.sampling.max_batch // cfg_rows) * cfg_rows
    ckpt = config.train.gradient_checkpointing
    offload = config.model.offload

    denoiser = (m.denoiser_params + m.denoiser_buffers) * dbytes
    encoders = sum(m.encoders.values()) * dbytes
    vae = m.vae_params * dbytes
    helpers = encoders + vae
    resident_helpers = 0 if offload else helpers
    reward = sum(reward_bytes(spec) for spec in parse_reward_specs(config.reward))
    moments = 2 if config.train.optimizer == "adamw8bit" else 8  # AdamW: two fp32 moments (bitsandbytes 8-bit: two bytes)
    lora_state = m.lora_params * (4 + 4 + moments + 4)  # fp32 params, fp32 grads, optimizer moments, DDP gradient bucket (fp32)
    tree = build_tree(tree_spec(config, 0), config.prompts.per_iteration)
    latents = tree.num_nodes * math.prod(family.latent(size)) * 4
    images = len(tree.leaf_index) * pixels * 4  # decoded leaves, fp32 (B, 3, H, W) or (B, F, 3, H, W)

    train_act = m.train(train_rows, ckpt)
    # sd35 (train.kl_beta > 0): the adapter-free reference forward runs without grad while the
    # training forward's graph is still held (objectives/grpo.py, GRPOPlan.edge_losses)
    kl_ref = m.held(train_rows, ckpt) + m.rollout(train_rows) if config.train.kl_beta > 0 else 0
    rollout = m.rollout(chunk_rows)
    decode_batch = family.adapter.decode_batch  # images per VAE call
    decode = min(decode_batch, len(tree.leaf_index)) * m.decode_image + images
    eval_images = EVAL_CHUNK * config.prompts.eval_seeds

    static = denoiser + resident_helpers + reward + m.lora_params * (4 + moments + 4) + latents  # LoRA + moments + DDP bucket
    phases = {  # what each phase of an iteration adds on top of `static`
        "encode": encoders if offload else 0,  # text encoders moved in (model.offload)
        "rollout": rollout,
        "decode": (vae if offload else 0) + decode,
        "update": m.lora_params * 4 + max(train_act, kl_ref),  # LoRA grads + activations
        # final_evaluation: one more reward model per eval reward (all ViT-H-14 here), ODE sampling at
        # the adapter's eval_batch rows for EVAL_CHUNK prompts at a time, then their decode
        "final eval": sum(reward_bytes(spec) for spec in parse_reward_specs(config.eval_rewards)) + max(
            encoders if offload else 0, m.rollout(family.adapter.eval_batch),
            (vae if offload else 0) + min(decode_batch, eval_images) * m.decode_image + eval_images * pixels * 4),
    }
    peak_phase = max(phases, key=phases.get)
    total = static + phases[peak_phase]

    # explore variant: + the fp8 copy (resident), its refresh after every update, its build at start-up
    refresh = m.lora_base_params * 4  # quant._merged_tensors: W + B·A of every LoRA layer in fp32, all alive at once
    explore_static = static + m.copy_bytes
    explore_phases = dict(phases, refresh=refresh)
    if explore.explore.mode == "seeds":  # the pool: previewed latents and decoded images of pool × prompts candidates
        pool = explore.explore.pool * explore.prompts.per_iteration
        pool_latents = pool * (explore.explore.preview_steps + 1) * math.prod(family.latent(size)) * 4
        explore_phases["decode"] = (vae if offload else 0) + min(decode_batch, pool) * m.decode_image + pool * pixels * 4 + pool_latents
    else:  # tree: the explored tree is kept while its kept paths are regenerated
        explore_static += latents
    explore_peak_phase = max(explore_phases, key=explore_phases.get)
    explore_total = explore_static + explore_phases[explore_peak_phase]
    # start-up: make_quantized_copy deep-copies the policy (bf16 + LoRA) on the GPU before quantising it
    build = 2 * (denoiser + m.lora_params * 4) + m.lora_params * 4 + reward + resident_helpers
    if build > explore_total:
        explore_total, explore_peak_phase = build, "start-up copy"

    gpu_label, capacity = GPUS[family.gpu]
    return Row(preset, dict(
        family=family, config=config, m=m, gpu=gpu_label, capacity=capacity * GIB, dtype=config.model.dtype, denoiser=denoiser,
        encoders=encoders, vae=vae, helpers=helpers, resident_helpers=resident_helpers, offload=offload, reward=reward,
        lora_state=lora_state, latents=latents, train_rows=train_rows, chunk_rows=chunk_rows, ckpt=ckpt, train_act=train_act,
        kl_ref=kl_ref, rollout=rollout, decode=decode, static=static, phases=phases, peak_phase=peak_phase, total=total,
        copy=m.copy_bytes, refresh=refresh, explore_total=explore_total, explore_peak_phase=explore_peak_phase, build=build,
        explore_phases=explore_phases, explore_static=explore_static, overrides=overrides,
    ))


# ------------------------------------------------------------------------------------------------
# Output
# ------------------------------------------------------------------------------------------------

def g(x: float) -> str:
    return f"{x / GIB:.1f}"


def millions(n: int) -> str:
    return f"{n / 1e9:.3f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"


def fits(row: Row, fams: dict[str, Family], cache: dict, key: str = "total") -> str:
    """If the estimate (`total`, or `explore_total`) is less than RESERVE under the GPU: the single
    settings (largest values) that bring it RESERVE under, or else a combination."""
    v = row.values
    limit = v["capacity"] - RESERVE
    if v[key] <= limit:
        return ""
    config = v["config"]

    def peak(*overrides: str) -> float:
        return estimate(row.preset, fams, cache, (*v["overrides"], *overrides)).values[key]

    def largest(setting: str, current: int, *fixed: str) -> str | None:
        """The largest value below `current` that fits (the peak grows with it: bisection)."""
        low, high = 0, current  # peak(low) fits (0: nothing tried yet), peak(high) does not
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if peak(*fixed, f"{setting}={middle}") <= limit else (low, middle)
        return f"{' + '.join((*fixed, f'{setting}={low}'))} (→ {g(peak(*fixed, f'{setting}={low}'))} GiB)" if low else None

    options = [largest("train.minibatch", config.train.minibatch), largest("sampling.max_batch", config.sampling.max_batch)]
    for flag, on in (("train.gradient_checkpointing", config.train.gradient_checkpointing), ("model.offload", config.model.offload)):
        if not on and (p := peak(f"{flag}=true")) <= limit:
            options.append(f"{flag}=true (→ {g(p)} GiB)")
    options = [o for o in options if o]
    if not options and not config.train.gradient_checkpointing:
        options = [largest("train.minibatch", config.train.minibatch, "train.gradient_checkpointing=true")]
    if not options and key == "total":
        for processes in (2, 4, 8):
            if (p := sharded_total(v, processes)) <= limit:
                options.append(f"FSDP2 over {processes} GPUs (accelerate launch --config_file $(branchdiff accelerate-config fsdp) "
                               f"--num_processes {processes}; docs/sharding.md) (→ {g(p)} GiB)")
                break
    tried = "minibatch, max_batch, checkpointing, offload, FSDP2 over 2-8 GPUs" if key == "total" else "minibatch, max_batch, checkpointing, offload"
    return "; or ".join(o for o in options if o) or f"no setting tried ({tried}) is enough"


def sharded_total(v: dict, processes: int) -> float:
    """The peak under FSDP2 over `processes` GPUs: the denoiser's weights, the LoRA and its gradients and AdamW
    moments divided among them (no DDP bucket), plus two blocks gathered at a time (the one computing and the
    next, prefetched); the rest as under DDP."""
    m, dbytes = v["m"], torch.finfo(DTYPES[v["dtype"]]).bits // 8
    moments = 2 if v["config"].train.optimizer == "adamw8bit" else 8
    lora = m.lora_params * (4 + 4 + moments)
    return v["total"] - m.lora_params * 4 - (1 - 1 / processes) * (v["denoiser"] + lora) + 2 * m.block_params * dbytes


def _table(head: list[str], lines: list[list[str]]) -> str:
    return "\n".join("| " + " | ".join(cells) + " |" for cells in [head, ["---"] * len(head), *lines])


def table(rows: list[Row]) -> str:
    """The main table (GiB; estimates)."""
    head = ["preset", "GPU (per process)", "denoiser params (weights)", "text enc. + VAE resident", "reward model (fp32)", "LoRA params",
            "LoRA + grad + AdamW + DDP bucket", "training activations", "rollout chunk peak", "est. peak (when)", "headroom",
            "+ explore FP8 copy", "-explore est. peak (when)", "-explore headroom"]
    lines = []
    for row in rows:
        v = row.values
        m: Measured = v["m"]
        params = millions(m.denoiser_params) + (f" + {millions(m.denoiser_buffers)} buffer" if m.denoiser_buffers else "")
        helpers = (f"0 (offloaded: {g(v['encoders'])} enc. / {g(v['vae'])} VAE while in use)" if v["offload"]
                   else f"{g(v['resident_helpers'])} (not offloaded)")
        act = f"{g(v['train_act'])} ({v['train_rows']} rows, ckpt {'on' if v['ckpt'] else 'off'})"
        if v["kl_ref"]:
            act += f"; KL ref. {g(v['kl_ref'])}"
        lines.append([
            row.name, f"{v['gpu']} ({g(v['capacity'])})", f"{params} ({g(v['denoiser'])} {v['dtype']})", helpers, g(v["reward"]),
            f"{millions(m.lora_params)} (r {v['config'].train.lora_rank})", g(v["lora_state"]), act, f"{g(v['rollout'])} ({v['chunk_rows']} rows)",
            f"**{g(v['total'])}** ({v['peak_phase']})", g(v["capacity"] - v["total"]), g(v["copy"]),
            f"**{g(v['explore_total'])}** ({v['explore_peak_phase']})", g(v["capacity"] - v["explore_total"]),
        ])
    return _table(head, lines)


def phase_table(rows: list[Row]) -> str:
    head = ["preset", "static (resident all run)", "encode", "rollout", "decode + images", "update", "final eval",
            "-explore: static", "-explore: decode", "-explore: refresh", "-explore: start-up copy (absolute)"]
    lines = []
    for row in rows:
        v = row.values
        p, e = v["phases"], v["explore_phases"]
        lines.append([row.name, g(v["static"]), *(f"+{g(p[k])}" for k in ("encode", "rollout", "decode", "update", "final eval")),
                      g(v["explore_static"]), f"+{g(e['decode'])}", f"+{g(e['refresh'])}", g(v["build"])])
    return _table(head, lines)


def per_row_table(rows: list[Row]) -> str:
    head = ("| family @ px | tokens per row | blocks | training, ckpt off: held + backward = per row | training, ckpt on: held + recompute "
            "+ backward = per row | fixed per training forward, ckpt off / on | rollout (no grad) per row | VAE decode per image |")
    out = [head, "|" + "|".join(["---"] * (head.count("|") - 1)) + "|"]
    seen = set()
    mib = lambda x: f"{x / 2**20:,.0f}"  # noqa: E731
    slope = lambda f: f(2) - f(1)  # noqa: E731  (bytes per network row)
    for row in rows:
        v = row.values
        f, m = v["family"], v["m"]
        size = size_of(v["config"])
        if (f.name, size) in seen:
            continue
        seen.add((f.name, size))
        blocks = (", ".join(f"{n}× {k}" for k, n in m.counts.items()) if f.block_lists
                  else f"{sum(m.counts.values())} checkpointed units (resnets, transformer blocks)")
        off = [slope(lambda r, m=m: m.held(r, False)), slope(m.backward)]
        on = [slope(lambda r, m=m: m.held(r, True)), slope(m.recompute), slope(m.backward)]
        fixed = [m.train(1, ckpt) - slope(lambda r, m=m, ckpt=ckpt: m.train(r, ckpt)) for ckpt in (False, True)]
        at = f"{size[1]}×{size[2]}" + (f", {size[0]} frames" if size[0] > 1 else "")
        out.append(f"| {f.label} @ {at} | {f.tokens(size)} | {blocks} | {' + '.join(map(mib, off))} = **{mib(sum(off))} MiB** "
                   f"| {' + '.join(map(mib, on))} = **{mib(sum(on))} MiB** | {mib(fixed[0])} / {mib(fixed[1])} MiB "
                   f"| {mib(slope(m.rollout))} MiB | {mib(m.decode_image)} MiB |")
    return "\n".join(out)


def components_table(rows: list[Row]) -> str:
    head = "| family | denoiser (exact) | LoRA targets | LoRA params (rank) | FP8 copy: quantised weights / bytes | text encoders | VAE |"
    out = [head, "|" + "|".join(["---"] * (head.count("|") - 1)) + "|"]
    seen = set()
    for row in rows:
        v = row.values
        f, m = v["family"], v["m"]
        if f.name in seen:
            continue
        seen.add(f.name)
        enc = ", ".join(f"{k} {n:,}" for k, n in m.encoders.items())
        targets = ", ".join(f.adapter.lora_target_sets["attention"])
        out.append(f"| {f.label} | {m.denoiser_params:,} | {targets} | {m.lora_params:,} (r {v['config'].train.lora_rank}) "
                   f"| {m.copy_quantised:,} / {g(m.copy_bytes)} GiB | {enc} | {f.vae[0]} {m.vae_params:,} |")
    out.append(f"| reward (HPS v2.1 / PickScore, ViT-H-14) | {reward_params():,} | | | | | |")
    if any(f.name.startswith("wan") for f in (row.values["family"] for row in rows)):
        out.append(f"| reward (VideoAlign, Qwen2-VL-2B) | {reward_params('qwen2-vl-2b'):,} | | | | | |")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--detail", action="store_true", help="also print the phases, per-row figures and component counts")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override applied to every preset, e.g. --set train.gradient_checkpointing=false (repeatable)")
    args = parser.parse_args()
    fams = families()
    cache: dict = {}
    overrides = tuple(args.set)
    rows = [estimate(preset, fams, cache, (*extra, *overrides)) for preset, extra in PRESETS]
    for row, (preset, extra) in zip(rows, PRESETS):
        row.label = f"{preset} ({', '.join(extra)})" if extra else preset
    print(table(rows))
    notes = [(r.name, fits(r, fams, cache)) for r in rows] + [(f"{r.name} -explore", fits(r, fams, cache, "explore_total")) for r in rows]
    print()
    if any(note for _, note in notes):
        print(f"Over the GPU or less than {RESERVE // GIB} GiB under it, and settings that bring the estimate {RESERVE // GIB} GiB under it:\n")
        for preset, note in notes:
            if note:
                print(f"- {preset}: {note}")
    else:
        print(f"Every preset and its -explore variant leaves at least {RESERVE // GIB} GiB of its GPU free (estimate).")
    if args.detail:
        print("\nPhases (GiB; a phase adds to the static part, the peak is static + the largest phase):\n")
        print(phase_table(rows))
        print("\nPer network row (bf16 autocast, LoRA attached; MiB):\n")
        print(per_row_table(rows))
        print("\nComponents (parameters counted on the meta device):\n")
        print(components_table(rows))


if __name__ == "__main__":
    main()
