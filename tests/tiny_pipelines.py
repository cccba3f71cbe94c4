"""Tiny, randomly initialised diffusers pipelines of five families, for offline tests.

`build_pipeline(family)` builds one from configs (no hub access: CLIP tokenizers come from
open_clip's shipped BPE vocabulary via `branchdiff.models.tiny.build_tokenizer`, T5 and Gemma
tokenizers are `PreTrainedTokenizerFast` objects over a small in-code WordPiece vocabulary);
`save_pipeline` writes it with `save_pretrained` and `load_pipeline` reloads it with the family's
pipeline class `from_pretrained(folder)`. Every model has hidden sizes 16–64 and 1–2 layers, so a
3-step call with CFG at `RESOLUTION[family]` takes ≈ 0.05–0.15 s on one CPU thread.

Latents that each pipeline's `latents=` argument expects at `RESOLUTION` (B = number of images;
read from the pipelines' `prepare_latents`, see `latent_shape`):

- sd3  (StableDiffusion3Pipeline, 32 px): (B, 16, 16, 16) — unpacked (B, C, H/f, W/f); VAE factor
  f = 2, 16 latent channels as SD3; the transformer patchifies 2×2 itself (8×8 = 64 image tokens).
  Height/width must be divisible by f·patch_size = 4.
- flux (FluxPipeline, 32 px): (B, 64, 64) — *packed* (B, (H/f/2)·(W/f/2), 4·C): f = 2, C = 16
  latent channels packed 2×2 → 64 features, an 8×8 grid of 64 tokens. Passed latents are used as
  they are (no packing); the pipeline unpacks them to (B, 16, 16, 16) before the VAE.
- sana (SanaPipeline, 32 px): (B, 32, 8, 8) — unpacked (B, C, H/f, W/f); DC-AE factor
  f = 2**(len(encoder_block_out_channels) - 1) = 4, 32 latent channels as SANA's DC-AE f32c32,
  patch_size 1. Height/width must be divisible by 32 (`check_inputs`). Call with
  `use_resolution_binning=False` (in `CALL_KWARGS`): by default SanaPipeline snaps height/width to
  its aspect-ratio bins (the smallest table is 512×512-ish), generates there — latents would then be
  (B, 32, 128, 128) — and resizes back to the requested size.
- sd15 (StableDiffusionPipeline, 32 px): (B, 4, 16, 16) — unpacked (B, C, H/f, W/f); VAE factor
  f = 2, 4 latent channels as SD 1.5. Height/width must be divisible by 8 (`check_inputs`, whatever
  the VAE). The pipeline multiplies passed latents by `scheduler.init_noise_sigma` (1.0 for DDIM).
- z-image (ZImagePipeline, 32 px): (B, 16, 16, 16) — unpacked (B, C, H/f, W/f); f = 2, 16 latent
  channels (FLUX.1's VAE, as Z-Image); the transformer patchifies 2×2 itself and takes lists.
- qwen-image (QwenImagePipeline, 32 px): (B, 64, 16) — packed as FLUX.1's, from 4 latent channels of
  a one-level causal video VAE (f = 2^len(temperal_downsample) = 2); a Qwen2.5-VL text encoder with a
  one-block vision tower the pipeline never calls. Guidance is `true_cfg_scale` with a negative prompt.
- flux2 and flux2-klein (Flux2Pipeline, Flux2KleinPipeline, 32 px): (B, 16, 8, 8) — the VAE's 4 latent channels patchified 2×2 (f = 2),
  as the pipeline's `latents=` takes them (it packs them into 64 tokens itself). Its Qwen3 encoder has 27
  layers of width 16: the pipeline concatenates the hidden states of layers 9, 18 and 27 (joint width 48).
  FLUX.2 [dev]'s Mistral 3 encoder (a 30-layer Mistral of width 16 and a one-layer Pixtral vision tower the
  pipeline never calls) is read at layers 10, 20 and 30; its tokenizer is a PixtralProcessor whose chat
  template renders the system message and the prompt; its transformer embeds the guidance scale.

Pitfalls handled here:
- open_clip-derived CLIP tokenizers have `model_max_length` ≈ 1e30; SD3/FLUX/SD15 pad CLIP prompts to
  `tokenizer.model_max_length`, so it is set to 77 (saved in tokenizer_config.json) and the CLIP
  encoders get `max_position_embeddings=77`.
- SD3 zero-pads the concatenated CLIP hidden states (2 × 32) to the T5 width, so T5's d_model (= the
  transformer's `joint_attention_dim`) must be ≥ 64 (smaller silently crops); `caption_projection_dim`
  must equal heads × head_dim; `pooled_projection_dim` = sum of both CLIP projection dims.
- SD3 and FLUX decode with `latents / scaling_factor + shift_factor`: their AutoencoderKL configs must
  set `shift_factor` (None fails).
- FLUX: `in_channels` = 4 × VAE latent channels, `sum(axes_dims_rope) == attention_head_dim`,
  `joint_attention_dim` = T5 d_model, `pooled_projection_dim` = CLIP hidden size (pooled output of
  CLIPTextModel). T5 prompts are padded to `max_sequence_length` (512 by default, 256 for SD3); T5's
  relative position buckets make any length fine.
- SANA prepends its `complex_human_instruction` (≈ 1,060 characters) to each prompt, pads to (its
  token count + max_sequence_length − 2) tokens and keeps the first + last 299 of the encoded states.
  Gemma2's rotary positions are computed on the fly, so no length is a hard error; with
  `max_position_embeddings` and `sliding_window` at 2048, every layer attends over all ~500 tokens. The WordPiece vocabulary falls back to characters for words it
  lacks, so the instruction and any ASCII prompt encode without `<unk>` (199 Gemma tokens for the
  instruction: Gemma runs on 497 tokens per prompt; the negative prompt is encoded without the
  instruction, 300 tokens). With resolution binning on, the transformer's `sample_size` must be one
  of 16/32/64/128 (it selects the bin table; anything else raises "Invalid sample size"); it is 16.
- `from_pretrained` records T5/Gemma tokenizers as transformers `TokenizersBackend` (what
  `PreTrainedTokenizerFast` is in transformers 5) and reloads them with their special tokens,
  post-processor and `model_max_length`.
- Run these models with one intra-op thread (`torch.set_num_threads(1)`): with 2 threads on a busy
  2-core machine, OpenMP spin-waits turned a 0.1 s SD3 call into 4 s.
"""

from __future__ import annotations

import inspect
import string
from pathlib import Path
from typing import Any

import torch
from diffusers import (
    AutoencoderDC,
    AutoencoderKL,
    AutoencoderKLFlux2,
    AutoencoderKLQwenImage,
    DDIMScheduler,
    DiffusionPipeline,
    FlowMatchEulerDiscreteScheduler,
    Flux2KleinPipeline,
    Flux2Pipeline,
    Flux2Transformer2DModel,
    FluxPipeline,
    FluxTransformer2DModel,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
    SanaPipeline,
    SanaTransformer2DModel,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
    StableDiffusionPipeline,
    UNet2DConditionModel,
    ZImagePipeline,
    ZImageTransformer2DModel,
)
from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import WordPiece
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    CLIPTokenizer,
    Gemma2Config,
    Gemma2Model,
    Mistral3Config,
    Mistral3ForConditionalGeneration,
    PixtralImageProcessor,
    PixtralProcessor,
    PreTrainedTokenizerFast,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3Model,
    T5Config,
    T5EncoderModel,
)

from branchdiff.models.tiny import build_tokenizer as build_clip_tokenizer

FAMILIES = ("sd3", "flux", "sana", "sd15", "z-image", "qwen-image", "flux2", "flux2-klein")
RESOLUTION: dict[str, int] = {"sd3": 32, "flux": 32, "sana": 32, "sd15": 32, "z-image": 32, "qwen-image": 32, "flux2": 32, "flux2-klein": 32}
PIPELINE_CLASS: dict[str, type[DiffusionPipeline]] = {
    "sd3": StableDiffusion3Pipeline,
    "flux": FluxPipeline,
    "sana": SanaPipeline,
    "sd15": StableDiffusionPipeline,
    "z-image": ZImagePipeline,
    "qwen-image": QwenImagePipeline,
    "flux2": Flux2Pipeline,
    "flux2-klein": Flux2KleinPipeline,
}
# Extra `__call__` keyword arguments a family needs at RESOLUTION (see the module docstring).
CALL_KWARGS: dict[str, dict[str, Any]] = {"sd3": {}, "flux": {}, "sana": {"use_resolution_binning": False}, "sd15": {}, "z-image": {},
                                          "qwen-image": {"negative_prompt": " "}, "flux2": {}, "flux2-klein": {}}  # Qwen-Image guides only with a negative prompt (its card's " ")
# The `__call__` argument that takes the guidance scale, where it is not `guidance_scale` (Qwen-Image's is for guidance-distilled models).
GUIDANCE_ARGUMENT: dict[str, str] = {"qwen-image": "true_cfg_scale"}
# Guidance scale per family for tests: > 1 runs classifier-free guidance (sd3, sana, sd15);
# FLUX.1-dev is guidance-distilled, its guidance scale is an embedding input (3.5 as released).
GUIDANCE_SCALE: dict[str, float] = {"sd3": 4.5, "flux": 3.5, "sana": 4.5, "sd15": 4.5, "z-image": 5.0, "qwen-image": 4.0, "flux2": 4.0, "flux2-klein": 4.0}

CLIP_MAX_LENGTH = 77
VAE_SCALE_FACTOR: dict[str, int] = {"sd3": 2, "flux": 2, "sana": 4, "sd15": 2, "z-image": 2, "qwen-image": 2, "flux2": 2, "flux2-klein": 2}
LATENT_CHANNELS: dict[str, int] = {"sd3": 16, "flux": 16, "sana": 32, "sd15": 4, "z-image": 16, "qwen-image": 4, "flux2": 4, "flux2-klein": 4}

# A few hundred words for the T5 / Gemma WordPiece vocabularies; anything else falls back to
# single characters (`##x` continuations), so ASCII text never maps to <unk>.
_WORDS = """
a an the and or of in on at to from with without by for as is are be it its this that these those
one two three four five six seven eight nine ten many few some all each every no not only more less
red green blue yellow orange purple pink black white gray grey brown gold silver dark light bright
circle circles square squares triangle triangles star stars line lines dot dots shape shapes
small large big tiny huge round flat tall short long wide thin thick left right top bottom middle
center above below under over near next behind front inside outside beside between around
cat dog bird fish horse tree trees flower flowers house car bus street city sky sun moon water
photo picture image painting drawing scene background foreground style detailed simple color colors
sizes textures spatial relationships vivid concrete scenes given user prompt prompts generate
enhanced provides visual descriptions suitable generation evaluate level detail details if
focus adding specifics about create already refine enhance existing slightly overcomplicating here
examples how transform sleeping fluffy curled up shape peacefully warm sunny windowsill surrounded
pots blooming busy bustling dusk featuring glowing lamps diverse crowd people colorful clothing
double decker passing towering glass skyscrapers please description avoid including any additional
commentary evaluations
"""
_CHARS = string.ascii_lowercase + string.digits


def _wordpiece_tokenizer(specials: dict[str, str], template: str, model_max_length: int) -> PreTrainedTokenizerFast:
    """A lowercase WordPiece tokenizer over `_WORDS` plus single characters. `specials` maps roles
    ("pad_token", "eos_token", …) to tokens, which get ids 0, 1, … in that order; `template` is the
    post-processor's single-sequence template (e.g. "$A </s>")."""
    words = [w for w in dict.fromkeys(_WORDS.split()) if w not in _CHARS]
    tokens = list(specials.values()) + words + list(_CHARS) + ["##" + c for c in _CHARS] + list(string.punctuation)
    vocab = {t: i for i, t in enumerate(tokens)}
    assert len(vocab) == len(tokens)
    tok = Tokenizer(WordPiece(vocab, unk_token=specials["unk_token"], max_input_chars_per_word=100))
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()  # split on whitespace and punctuation
    tok.decoder = decoders.WordPiece()
    tok.post_processor = processors.TemplateProcessing(
        single=template,
        pair=template.replace("$A", "$A $B"),
        special_tokens=[(t, vocab[t]) for t in specials.values() if t in template.split()],
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=model_max_length, **specials)


def build_t5_tokenizer() -> PreTrainedTokenizerFast:
    """T5-style: <pad>=0, </s>=1, <unk>=2, "</s>" appended."""
    specials = {"pad_token": "<pad>", "eos_token": "</s>", "unk_token": "<unk>"}
    return _wordpiece_tokenizer(specials, "$A </s>", model_max_length=512)


def build_gemma_tokenizer() -> PreTrainedTokenizerFast:
    """Gemma-style: <pad>=0, <eos>=1, <bos>=2, <unk>=3, "<bos>" prepended."""
    specials = {"pad_token": "<pad>", "eos_token": "<eos>", "bos_token": "<bos>", "unk_token": "<unk>"}
    return _wordpiece_tokenizer(specials, "<bos> $A", model_max_length=2048)


QWEN_CHAT_TEMPLATE = (  # Qwen3's chat markup, as much of it as the Z-Image pipeline renders (one user turn, the generation prompt)
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def build_qwen_tokenizer() -> PreTrainedTokenizerFast:
    """Qwen-style: <|endoftext|> pads, <|im_start|> / <|im_end|> are special tokens, nothing added
    around a text, and the chat template above (Z-Image renders each prompt through it)."""
    specials = {"pad_token": "<|endoftext|>", "eos_token": "<|im_end|>", "bos_token": "<|im_start|>", "unk_token": "<unk>"}
    tokenizer = _wordpiece_tokenizer(specials, "$A", model_max_length=32768)
    tokenizer.chat_template = QWEN_CHAT_TEMPLATE
    return tokenizer


def _clip_tokenizer() -> CLIPTokenizer:
    tokenizer = build_clip_tokenizer()
    tokenizer.model_max_length = CLIP_MAX_LENGTH
    return tokenizer


def _clip_config(tokenizer: CLIPTokenizer, hidden: int = 32, projection: int = 32) -> CLIPTextConfig:
    return CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
        num_attention_heads=2, max_position_embeddings=CLIP_MAX_LENGTH, projection_dim=projection,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )


def _t5_encoder(tokenizer: PreTrainedTokenizerFast, d_model: int) -> T5EncoderModel:
    config = T5Config(
        vocab_size=len(tokenizer), d_model=d_model, d_kv=16, d_ff=2 * d_model, num_layers=1, num_heads=2,
        relative_attention_num_buckets=8, feed_forward_proj="gated-gelu", is_encoder_decoder=False,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=0,
    )
    return T5EncoderModel(config)


def _autoencoder_kl(latent_channels: int, scaling_factor: float, shift_factor: float | None, flow: bool) -> AutoencoderKL:
    """Two levels (scale factor 2); `flow` mimics SD3/FLUX's VAE (no quant convs)."""
    return AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=latent_channels,
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(16, 32), layers_per_block=1, norm_num_groups=8,
        scaling_factor=scaling_factor, shift_factor=shift_factor,
        use_quant_conv=not flow, use_post_quant_conv=not flow,
    )


SD3_LAYOUTS: dict[str, dict[str, Any]] = {  # the SD3 transformer's options by release (their config.json)
    "sd3": {},  # SD3 Medium
    "sd3.5-large": {"qk_norm": "rms_norm"},  # SD3.5 Large and Large Turbo: RMS-normed queries and keys
    "sd3.5-medium": {"qk_norm": "rms_norm", "dual_attention_layers": (0,)},  # SD3.5 Medium: MMDiT-X, a second self-attention in its first blocks
}


def build_sd3(layout: str = "sd3", seed: int = 0) -> StableDiffusion3Pipeline:
    """A tiny SD3 pipeline with the transformer options of `layout` (SD3_LAYOUTS)."""
    torch.manual_seed(seed)
    pipe = _build_sd3(RESOLUTION["sd3"], **SD3_LAYOUTS[layout])
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _build_sd3(res: int, **layout: Any) -> StableDiffusion3Pipeline:
    tokenizer, tokenizer_2, tokenizer_3 = _clip_tokenizer(), _clip_tokenizer(), build_t5_tokenizer()
    text_encoder = CLIPTextModelWithProjection(_clip_config(tokenizer))
    text_encoder_2 = CLIPTextModelWithProjection(_clip_config(tokenizer_2))
    text_encoder_3 = _t5_encoder(tokenizer_3, d_model=64)  # ≥ 32 + 32: SD3 pads CLIP states to T5 width
    latent = res // VAE_SCALE_FACTOR["sd3"]
    transformer = SD3Transformer2DModel(
        sample_size=latent, patch_size=2, in_channels=LATENT_CHANNELS["sd3"], out_channels=LATENT_CHANNELS["sd3"],
        num_layers=2, attention_head_dim=16, num_attention_heads=2, joint_attention_dim=64,
        caption_projection_dim=32, pooled_projection_dim=64, pos_embed_max_size=latent, **layout,
    )
    vae = _autoencoder_kl(LATENT_CHANNELS["sd3"], scaling_factor=1.5305, shift_factor=0.0609, flow=True)
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)  # SD3.5's config
    return StableDiffusion3Pipeline(
        transformer=transformer, scheduler=scheduler, vae=vae,
        text_encoder=text_encoder, tokenizer=tokenizer, text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2,
        text_encoder_3=text_encoder_3, tokenizer_3=tokenizer_3,
    )


def _build_flux(res: int) -> FluxPipeline:
    tokenizer, tokenizer_2 = _clip_tokenizer(), build_t5_tokenizer()
    text_encoder = CLIPTextModel(_clip_config(tokenizer))
    text_encoder_2 = _t5_encoder(tokenizer_2, d_model=32)
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=4 * LATENT_CHANNELS["flux"], num_layers=1, num_single_layers=1,
        attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
        guidance_embeds=True, axes_dims_rope=(4, 6, 6),
    )
    vae = _autoencoder_kl(LATENT_CHANNELS["flux"], scaling_factor=0.3611, shift_factor=0.1159, flow=True)
    scheduler = FlowMatchEulerDiscreteScheduler(  # FLUX.1-dev's scheduler_config.json
        num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True,
        base_shift=0.5, max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096,
    )
    return FluxPipeline(
        scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
        text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2, transformer=transformer,
    )


def _build_sana(res: int) -> SanaPipeline:
    tokenizer = build_gemma_tokenizer()
    text_encoder = Gemma2Model(Gemma2Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=2048,
        sliding_window=2048, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    ))
    vae = AutoencoderDC(  # 3 levels: spatial factor 4
        in_channels=3, latent_channels=LATENT_CHANNELS["sana"], attention_head_dim=8,
        encoder_block_types=("ResBlock", "ResBlock", "EfficientViTBlock"),
        decoder_block_types=("ResBlock", "ResBlock", "EfficientViTBlock"),
        encoder_block_out_channels=(16, 32, 32), decoder_block_out_channels=(16, 32, 32),
        encoder_layers_per_block=(1, 1, 1), decoder_layers_per_block=(1, 1, 1),
        encoder_qkv_multiscales=((), (), (5,)), decoder_qkv_multiscales=((), (), (5,)),
        downsample_block_type="Conv", upsample_block_type="interpolate",
        decoder_norm_types="rms_norm", decoder_act_fns="silu", scaling_factor=0.41407,
    )
    transformer = SanaTransformer2DModel(
        in_channels=LATENT_CHANNELS["sana"], out_channels=LATENT_CHANNELS["sana"], num_attention_heads=2,
        attention_head_dim=16, num_layers=2, num_cross_attention_heads=2, cross_attention_head_dim=16,
        cross_attention_dim=32, caption_channels=32, sample_size=16, patch_size=1,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    return SanaPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer, scheduler=scheduler)


def _build_sd15(res: int) -> StableDiffusionPipeline:
    tokenizer = _clip_tokenizer()
    text_encoder = CLIPTextModel(_clip_config(tokenizer))
    unet = UNet2DConditionModel(
        sample_size=res // VAE_SCALE_FACTOR["sd15"], in_channels=4, out_channels=4, layers_per_block=1,
        block_out_channels=(16, 32), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=32, attention_head_dim=8,
        norm_num_groups=8,
    )
    vae = _autoencoder_kl(LATENT_CHANNELS["sd15"], scaling_factor=0.18215, shift_factor=None, flow=False)
    scheduler = DDIMScheduler(  # SD 1.5's scheduler_config.json
        num_train_timesteps=1000, beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012,
        clip_sample=False, set_alpha_to_one=False, steps_offset=1, timestep_spacing="leading",
        prediction_type="epsilon",
    )
    return StableDiffusionPipeline(
        vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet, scheduler=scheduler,
        safety_checker=None, feature_extractor=None, requires_safety_checker=False,
    )


def _build_z_image(res: int) -> ZImagePipeline:
    tokenizer = build_qwen_tokenizer()
    text_encoder = Qwen3Model(Qwen3Config(  # the pipeline takes the second-to-last hidden states: two layers
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=1024, pad_token_id=tokenizer.pad_token_id,
    ))
    transformer = ZImageTransformer2DModel(  # rope axes (frame, row, column) sum to the head size 16
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=LATENT_CHANNELS["z-image"], dim=32, n_layers=2,
        n_refiner_layers=1, n_heads=2, n_kv_heads=2, cap_feat_dim=32, axes_dims=[8, 4, 4], axes_lens=[1024, 64, 64],
    )
    vae = _autoencoder_kl(LATENT_CHANNELS["z-image"], scaling_factor=0.3611, shift_factor=0.1159, flow=True)  # FLUX.1's VAE, as released
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)  # Z-Image-Turbo's config
    return ZImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer)


def _build_qwen_image(res: int) -> QwenImagePipeline:
    tokenizer = build_qwen_tokenizer()
    text_encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(  # the pipeline reads the last hidden states of the language model
        text_config={"vocab_size": len(tokenizer), "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                     "num_key_value_heads": 1, "max_position_embeddings": 2048, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
                     "pad_token_id": tokenizer.pad_token_id, "bos_token_id": None, "eos_token_id": tokenizer.eos_token_id},
        vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 32, "fullatt_block_indexes": [0]},
        vocab_size=len(tokenizer), hidden_size=32, bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
    )).eval()
    transformer = QwenImageTransformer2DModel(  # rope axes (frame, row, column) sum to the head size 16
        patch_size=2, in_channels=4 * LATENT_CHANNELS["qwen-image"], out_channels=LATENT_CHANNELS["qwen-image"], num_layers=2,
        attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 6, 6),
    )
    vae = AutoencoderKLQwenImage(base_dim=8, z_dim=LATENT_CHANNELS["qwen-image"], dim_mult=[1, 2], num_res_blocks=1, temperal_downsample=[False],
                                 latents_mean=[0.1, -0.2, 0.3, 0.0], latents_std=[1.5, 0.8, 1.2, 2.0])
    scheduler = FlowMatchEulerDiscreteScheduler(  # Qwen-Image's scheduler config: exponential dynamic shift stretched to σ 0.02
        num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9, base_image_seq_len=256,
        max_image_seq_len=8192, time_shift_type="exponential", shift_terminal=0.02,
    )
    return QwenImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer)


MISTRAL_CHAT_TEMPLATE = (  # as much of Mistral 3's chat markup as FLUX.2 [dev]'s pipeline renders (a system message, user turns of text)
    "{% for message in messages %}{% if message['role'] == 'system' %}[SYSTEM_PROMPT]{{ message['content'][0]['text'] }}[/SYSTEM_PROMPT]"
    "{% else %}[INST]{{ message['content'][0]['text'] }}[/INST]{% endif %}{% endfor %}"
)


def _flux2_parts(res: int, guidance_embeds: bool, text_width: int) -> dict[str, Any]:
    """FLUX.2's transformer, VAE and scheduler, shared by [dev] and [klein]."""
    transformer = Flux2Transformer2DModel(  # rope axes (time, row, column, layer) sum to the head size 16
        patch_size=1, in_channels=4 * LATENT_CHANNELS["flux2"], num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=3 * text_width, timestep_guidance_channels=32, axes_dims_rope=(4, 4, 4, 4),
        guidance_embeds=guidance_embeds,
    )
    vae = AutoencoderKLFlux2(block_out_channels=(16, 32), down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                             latent_channels=LATENT_CHANNELS["flux2"], norm_num_groups=8, layers_per_block=1, sample_size=res)
    with torch.no_grad():  # batch-norm statistics other than 0 and 1, so that decoding must apply them
        vae.bn.running_mean.copy_(0.1 * torch.randn(vae.bn.running_mean.shape))
        vae.bn.running_var.copy_(0.5 + torch.rand(vae.bn.running_var.shape))
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True)  # FLUX.2's config
    return {"transformer": transformer, "vae": vae, "scheduler": scheduler}


def _build_flux2(res: int) -> Flux2Pipeline:
    specials = {"pad_token": "<pad>", "eos_token": "</s>", "bos_token": "<s>", "unk_token": "<unk>"}
    tokenizer = _wordpiece_tokenizer(specials, "<s> $A", model_max_length=131072)
    tokenizer.add_special_tokens({"additional_special_tokens": ["[IMG]", "[IMG_BREAK]", "[IMG_END]"]})  # what Pixtral's processor looks up
    processor = PixtralProcessor(image_processor=PixtralImageProcessor(), tokenizer=tokenizer, chat_template=MISTRAL_CHAT_TEMPLATE,
                                 patch_size=16, spatial_merge_size=2)
    text_encoder = Mistral3ForConditionalGeneration(Mistral3Config(  # 30 layers: the pipeline reads layers 10, 20 and 30
        text_config={"model_type": "mistral", "vocab_size": len(tokenizer), "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 30,
                     "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8, "max_position_embeddings": 1024,
                     "pad_token_id": tokenizer.pad_token_id},
        vision_config={"model_type": "pixtral", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                       "head_dim": 8, "patch_size": 16, "image_size": 64},
        image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"), spatial_merge_size=2,
    )).eval()
    return Flux2Pipeline(text_encoder=text_encoder, tokenizer=processor, **_flux2_parts(res, guidance_embeds=True, text_width=16))


def _build_flux2_klein(res: int) -> Flux2KleinPipeline:
    tokenizer = build_qwen_tokenizer()
    text_encoder = Qwen3ForCausalLM(Qwen3Config(  # 27 layers: the pipeline reads layers 9, 18 and 27
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=27, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, max_position_embeddings=1024, pad_token_id=tokenizer.pad_token_id,
    )).eval()
    return Flux2KleinPipeline(text_encoder=text_encoder, tokenizer=tokenizer, **_flux2_parts(res, guidance_embeds=False, text_width=16))

_BUILDERS = {"sd3": _build_sd3, "flux": _build_flux, "sana": _build_sana, "sd15": _build_sd15, "z-image": _build_z_image,
             "qwen-image": _build_qwen_image, "flux2": _build_flux2, "flux2-klein": _build_flux2_klein}


def _check(family: str) -> None:
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")


def build_pipeline(family: str, seed: int = 0) -> DiffusionPipeline:
    """A tiny randomly initialised pipeline of `family` (float32, CPU, eval mode); deterministic in `seed`."""
    _check(family)
    torch.manual_seed(seed)
    pipe = _BUILDERS[family](RESOLUTION[family])
    pipe.set_progress_bar_config(disable=True)
    return pipe


def save_pipeline(family: str, directory: Path, seed: int = 0) -> Path:
    """Build `family` and `save_pretrained` it (safetensors) into `directory`; returns `directory`."""
    directory = Path(directory)
    build_pipeline(family, seed).save_pretrained(directory, safe_serialization=True)
    return directory


def load_pipeline(family: str, directory: str | Path) -> DiffusionPipeline:
    """`<PipelineClass>.from_pretrained(directory)` in float32 with the progress bar off."""
    _check(family)
    pipe = PIPELINE_CLASS[family].from_pretrained(directory, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def denoiser(pipe: DiffusionPipeline) -> torch.nn.Module:
    """The pipeline's transformer, or its UNet for SD 1.5."""
    return pipe.unet if isinstance(pipe, StableDiffusionPipeline) else pipe.transformer


def latent_shape(family: str, batch_size: int, resolution: int | None = None) -> tuple[int, ...]:
    """Shape of the `latents=` argument of `family`'s pipeline at `resolution` (default RESOLUTION);
    SANA assumes `use_resolution_binning=False`."""
    _check(family)
    side = (resolution or RESOLUTION[family]) // VAE_SCALE_FACTOR[family]
    channels = LATENT_CHANNELS[family]
    if family in ("flux", "qwen-image"):
        return (batch_size, (side // 2) ** 2, 4 * channels)
    if family in ("flux2", "flux2-klein"):
        return (batch_size, 4 * channels, side // 2, side // 2)
    return (batch_size, channels, side, side)


def sana_default_instruction() -> list[str]:
    """SanaPipeline's default `complex_human_instruction` (prepended to every prompt)."""
    return inspect.signature(SanaPipeline.__call__).parameters["complex_human_instruction"].default


def build_flux_kontext(seed: int = 0) -> DiffusionPipeline:
    """A tiny FLUX.1 Kontext pipeline (not in FAMILIES, whose shared tests make images from text alone;
    tests/test_editing.py): the tiny FLUX.1's components in `FluxKontextPipeline`."""
    from diffusers import FluxKontextPipeline

    torch.manual_seed(seed)
    pipe = FluxKontextPipeline(**_build_flux(RESOLUTION["flux"]).components)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def build_qwen_image_edit(seed: int = 0, zero_cond_t: bool = False) -> DiffusionPipeline:
    """A tiny Qwen-Image-Edit (2509/2511) pipeline (not in FAMILIES; tests/test_editing.py): the tiny Qwen-Image's
    transformer, VAE and scheduler, and a Qwen2.5-VL whose one-block vision tower reads the sources through a
    Qwen2VLProcessor (14-pixel patches merged 2×2). At these sizes the pipeline's fixed source areas
    (CONDITION_IMAGE_SIZE 384², VAE_IMAGE_SIZE 1024²) would be far too large: tests set them with
    `SMALL_EDIT_AREAS`. `zero_cond_t`: the transformer conditions the sources' tokens on time 0 (a layout
    Qwen-Image-Edit-2511's transformer config can set)."""
    from diffusers import QwenImageEditPlusPipeline
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    torch.manual_seed(seed)
    base = _build_qwen_image(RESOLUTION["qwen-image"])
    tokenizer = build_qwen_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]})
    processor = Qwen2VLProcessor(image_processor=Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=112 * 112, patch_size=14, merge_size=2,
                                                                       temporal_patch_size=2),
                                 tokenizer=tokenizer, video_processor=Qwen2VLVideoProcessor(), chat_template=QWEN_CHAT_TEMPLATE)
    token = tokenizer.convert_tokens_to_ids
    text_encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config={"vocab_size": len(tokenizer), "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                     "num_key_value_heads": 1, "max_position_embeddings": 2048, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
                     "pad_token_id": tokenizer.pad_token_id, "bos_token_id": None, "eos_token_id": tokenizer.eos_token_id},
        vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 32, "fullatt_block_indexes": [0],
                       "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2},
        vocab_size=len(tokenizer), hidden_size=32, bos_token_id=None, eos_token_id=tokenizer.eos_token_id, image_token_id=token("<|image_pad|>"),
        video_token_id=token("<|video_pad|>"), vision_start_token_id=token("<|vision_start|>"), vision_end_token_id=token("<|vision_end|>"),
    )).eval()
    transformer = base.transformer
    if zero_cond_t:
        transformer = QwenImageTransformer2DModel.from_config({**transformer.config, "zero_cond_t": True})
        transformer.load_state_dict(base.transformer.state_dict())
    pipe = QwenImageEditPlusPipeline(scheduler=base.scheduler, vae=base.vae, text_encoder=text_encoder, tokenizer=tokenizer, processor=processor,
                                     transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    return pipe


SMALL_EDIT_AREAS = {"CONDITION_IMAGE_SIZE": 56 * 56, "VAE_IMAGE_SIZE": 48 * 48}  # the tiny Qwen-Image-Edit's source areas (pixels)


def build_wan(two_experts: bool = False, release: bool = False, seed: int = 0, ti2v: bool = False) -> DiffusionPipeline:
    """A tiny Wan text-to-video pipeline (not in this module's FAMILIES, whose shared tests take images; tests/test_wan.py).
    UMT5 text encoder, a 2-level causal 3-D VAE (spatial and temporal factor 2: F = 2k + 1 frames,
    latents (4, F', H/2, W/2)), a 1-layer WanTransformer3DModel with patch (1, 2, 2). `two_experts`:
    Wan 2.2 A14B's layout, a second transformer for timesteps below boundary_ratio 0.75 · 1000.
    `release`: the released scheduler (UniPC, flow prediction, flow shift 3) instead of flow-matching Euler.
    `ti2v`: Wan 2.2 TI2V-5B's layout: `expand_timesteps` (a timestep per token) and its residual VAE that
    patchifies 2×2 before a 2-level encoder (spatial factor 4, latents (12, F', H/4, W/4))."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(seed)
    tokenizer = build_t5_tokenizer()
    text_encoder = UMT5EncoderModel(UMT5Config(
        vocab_size=len(tokenizer), d_model=32, d_kv=16, d_ff=64, num_layers=1, num_heads=2, relative_attention_num_buckets=8,
        feed_forward_proj="gated-gelu", is_encoder_decoder=False, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=0,
    ))
    channels = 12 if ti2v else 4
    vae = AutoencoderKLWan(base_dim=8, z_dim=channels, dim_mult=[1, 1] if ti2v else [1, 2], num_res_blocks=1, temperal_downsample=[True],
                           latents_mean=[0.1, -0.2, 0.3, 0.0] * (channels // 4), latents_std=[1.5, 0.8, 1.2, 2.0] * (channels // 4),
                           scale_factor_temporal=2, scale_factor_spatial=4 if ti2v else 2,
                           **({"is_residual": True, "patch_size": 2, "in_channels": 12, "out_channels": 12} if ti2v else {}))

    def transformer() -> WanTransformer3DModel:
        return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=channels, out_channels=channels,
                                     text_dim=32, freq_dim=16, ffn_dim=32, num_layers=1, rope_max_seq_len=32)

    scheduler = (UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0, num_train_timesteps=1000)
                 if release else FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0))
    experts = {"transformer_2": transformer(), "boundary_ratio": 0.75} if two_experts else {}
    pipe = WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer(), scheduler=scheduler, **experts,
                       expand_timesteps=ti2v)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def build_wan_i2v(kind: str, seed: int = 0, release: bool = False) -> DiffusionPipeline:
    """A tiny Wan image-to-video pipeline (`WanImageToVideoPipeline`; tests/test_wan_i2v.py) on `build_wan`'s text encoder
    and VAE. `kind`: "2.1", Wan 2.1 I2V's layout (a CLIP vision encoder whose penultimate states the transformer reads
    through its image projection and added key/value projections; the noise, the mask's r = 2 channels and the source's
    latents concatenated: in_channels 4 + 2 + 4); "a14b", Wan 2.2 I2V-A14B's (no image encoder, two experts,
    boundary_ratio 0.9); "ti2v", Wan 2.2 TI2V-5B's (`expand_timesteps`: the first frame's latent kept clean). `release`:
    the released UniPC scheduler, as in `build_wan`."""
    from diffusers import WanImageToVideoPipeline, WanTransformer3DModel
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    if kind not in ("2.1", "a14b", "ti2v"):
        raise ValueError(f"kind={kind!r}")
    base = build_wan(ti2v=kind == "ti2v", seed=seed, release=release)
    channels = base.vae.config.z_dim
    image = {"image_dim": 24, "added_kv_proj_dim": 16} if kind == "2.1" else {}

    def transformer() -> WanTransformer3DModel:
        inputs = channels if kind == "ti2v" else channels + base.vae_scale_factor_temporal + channels
        return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=inputs, out_channels=channels,
                                     text_dim=32, freq_dim=16, ffn_dim=32, num_layers=1, rope_max_seq_len=32, **image)

    encoder = {}
    if kind == "2.1":
        encoder = {"image_encoder": CLIPVisionModel(CLIPVisionConfig(hidden_size=24, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                                                                     image_size=16, patch_size=8, projection_dim=24)),
                   "image_processor": CLIPImageProcessor(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16})}
    experts = {"transformer_2": transformer(), "boundary_ratio": 0.9} if kind == "a14b" else {}
    pipe = WanImageToVideoPipeline(tokenizer=base.tokenizer, text_encoder=base.text_encoder, vae=base.vae, scheduler=base.scheduler,
                                   transformer=transformer(), expand_timesteps=kind == "ti2v", **encoder, **experts)
    pipe.set_progress_bar_config(disable=True)
    return pipe


VIDEOALIGN_TOKENS = {"VQ": "<|VQ_reward|>", "MQ": "<|MQ_reward|>", "TA": "<|TA_reward|>"}
QWEN2_VL_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
QWEN2_VL_CHAT = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% for part in message['content'] %}"
                 "{% if part['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>{% else %}{{ part['text'] }}{% endif %}"
                 "{% endfor %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tiny_qwen2_vl(extra_tokens: list[str], seed: int = 0, tied: bool = False):
    """(model, processor): a 1-layer Qwen2VLForConditionalGeneration and a Qwen2VLProcessor (patch 4, merge 2: 32×32
    frames are 4 tokens per pair of frames) with a byte-level Qwen2 tokenizer holding the chat and vision tokens and
    `extra_tokens`; `tied`: its output embeddings are its input ones, as Qwen2-VL-2B's (saved without lm_head)."""
    from open_clip.tokenizer import bytes_to_unicode
    from transformers import Qwen2Tokenizer, Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    torch.manual_seed(seed)
    tokenizer = Qwen2Tokenizer(vocab={t: i for i, t in enumerate(bytes_to_unicode().values())}, merges=[], unk_token=None, bos_token=None,
                               eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.add_special_tokens({"additional_special_tokens": QWEN2_VL_SPECIALS[1:] + extra_tokens})
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN2_VL_SPECIALS}
    sizes = dict(patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=16, max_pixels=32 * 32)
    processor = Qwen2VLProcessor(image_processor=Qwen2VLImageProcessor(**sizes), video_processor=Qwen2VLVideoProcessor(**sizes),
                                 tokenizer=tokenizer, chat_template=QWEN2_VL_CHAT)
    config = Qwen2VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, max_position_embeddings=512, bos_token_id=None, eos_token_id=ids["<|im_end|>"],
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}),
        vision_config=dict(depth=1, embed_dim=16, hidden_size=32, num_heads=2, patch_size=4, spatial_merge_size=2, temporal_patch_size=2,
                           mlp_ratio=2),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        tie_word_embeddings=tied)
    return Qwen2VLForConditionalGeneration(config), processor


def save_videoalign(directory: Path, seed: int = 0) -> Path:
    """A tiny random Qwen2-VL reward model in the `videoalign` reward's folder layout (`tiny_qwen2_vl` with the three
    reward tokens), a random head and a standardisation."""
    import json

    from safetensors.torch import save_file

    model, processor = tiny_qwen2_vl(list(VIDEOALIGN_TOKENS.values()), seed)
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    save_file({"weight": torch.randn(1, 32)}, str(directory / "reward_head.safetensors"))
    template = "Prompt: {prompt}. Visual quality <|VQ_reward|> motion quality <|MQ_reward|> alignment <|TA_reward|>"
    (directory / "videoalign.json").write_text(json.dumps({"template": template, "tokens": VIDEOALIGN_TOKENS,
                                                           "mean": {"VQ": 0.5, "MQ": -0.25, "TA": 1.0}, "std": {"VQ": 2.0, "MQ": 0.5, "TA": 4.0}}))
    return directory


def build_wide_sd3(resolution: int = 128, heads: int = 4, seed: int = 0) -> StableDiffusion3Pipeline:
    """The tiny SD3 pipeline with a wider transformer (2 blocks of width 64·heads over (resolution/4)² tokens):
    activations large enough that a phase's peak memory is measured above the process's noise (tests/test_plan.py,
    the GPU suite's plan check)."""
    pipe = build_sd3(seed=seed)
    latent = resolution // VAE_SCALE_FACTOR["sd3"]
    pipe.transformer = SD3Transformer2DModel(
        sample_size=latent, patch_size=2, in_channels=LATENT_CHANNELS["sd3"], out_channels=LATENT_CHANNELS["sd3"], num_layers=2,
        attention_head_dim=64, num_attention_heads=heads, joint_attention_dim=64, caption_projection_dim=64 * heads, pooled_projection_dim=64,
        pos_embed_max_size=latent,
    )
    return pipe
