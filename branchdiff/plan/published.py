"""The released models' published configs, as their hub `config.json` files give them (the diffusers /
transformers defaults fill the keys a config leaves out). `branchdiff plan` builds every network at
its real size on the meta device from these, so parameter counts are exact and nothing downloads;
a run whose `model.path` is a local folder is planned from that folder's own configs instead
(branchdiff/plan/families.py). Each entry names its source.
"""

from __future__ import annotations

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
# Image-to-video (wan/configs/wan_i2v_14B.py, wan_i2v_A14B.py and wan_ti2v_5B.py of Wan 2.1 and 2.2; the -Diffusers
# folders' transformer/config.json): Wan 2.1 I2V 14B is T2V 14B's transformer reading 16 + 4 + 16 input channels (noise,
# mask, the first frame's latents) and the CLIP ViT-H/14 image's states (width 1280) through added key/value
# projections; each expert of Wan 2.2 I2V-A14B is the same without the image's states; TI2V-5B is width 3072 = 24 × 128,
# FFN 14336, 30 blocks on 48 latent channels (its VAE compresses 16× in space).
WAN_I2V_14B_TRANSFORMER = dict(WAN_T2V_14B_TRANSFORMER, in_channels=36, image_dim=1280, added_kv_proj_dim=5120)
WAN_I2V_A14B_TRANSFORMER = dict(WAN_T2V_14B_TRANSFORMER, in_channels=36)
WAN_TI2V_5B_TRANSFORMER = dict(_WAN_T2V, num_attention_heads=24, ffn_dim=14336, num_layers=30, in_channels=48, out_channels=48)
# Wan 2.2's VAE (Wan2.2_VAE.pth; vae_stride (4, 16, 16)): 2×2 patches of 12 channels in, 48 latent channels, a wider decoder.
VAE_WAN22 = dict(base_dim=160, decoder_base_dim=256, z_dim=48, dim_mult=[1, 2, 4, 4], num_res_blocks=2, temperal_downsample=[False, True, True],
                 is_residual=True, in_channels=12, out_channels=12, patch_size=2, scale_factor_spatial=16, scale_factor_temporal=4)
# Wan 2.1 I2V's image encoder (open-clip xlm-roberta-large-vit-huge-14's visual tower; image_encoder/config.json): width 1280,
# 32 layers, 16 heads, MLP 5120, 224² images in 14² patches: 257 states a picture.
CLIP_VIT_H_14 = dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=16, image_size=224, patch_size=14,
                     projection_dim=1024, hidden_act="gelu")
CLIP_VIT_H_14_STATES = 257  # (224 / 14)² patches and the class token

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
# ServeurpersoCom/flux2.c's README: 5 double, 20 single blocks, Qwen3-4B of width 2560 and 36 layers).
FLUX2_KLEIN_4B_TRANSFORMER = dict(num_layers=5, num_single_layers=20, num_attention_heads=24, attention_head_dim=128, joint_attention_dim=7680,
                                  guidance_embeds=False)
QWEN3_4B = dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                vocab_size=151936, tie_word_embeddings=True)
# black-forest-labs/FLUX.2-klein-base-9B: 8 double + 24 single blocks of width 4096 = 32 × 128, MLP ratio 3, text of
# 3 × 4096 (Qwen/Qwen3-8B's hidden states), no guidance embedding; as the public re-implementations read it from the
# release's transformer/config.json (e.g. the C implementation github.com/marcelcotta/iris.c, its notes: hidden 4096, 32 heads, 8 double and 24 single
# blocks, text dimension 12288; Qwen3-8B of width 4096, 36 layers, 32 query and 8 key-value heads).
FLUX2_KLEIN_9B_TRANSFORMER = dict(num_layers=8, num_single_layers=24, num_attention_heads=32, attention_head_dim=128, joint_attention_dim=12288,
                                  guidance_embeds=False)
QWEN3_8B = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                vocab_size=151936, tie_word_embeddings=False)
# Tongyi-MAI/Z-Image-Turbo (and Z-Image) transformer/config.json, which ZImageTransformer2DModel's defaults equal (a single-stream
# DiT of width 3840 = 30 × 128: 2 noise-refiner and 2 context-refiner blocks, then 30 joint blocks; 2×2 patches of 16
# latent channels; text of Qwen3-4B's 2560-wide states); its VAE FLUX.1's (VAE_KL16's layout); its text encoder
# Qwen/Qwen3-4B (Qwen3Model, QWEN3_4B above).
Z_IMAGE_TRANSFORMER = dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=3840, n_layers=30, n_refiner_layers=2, n_heads=30,
                           n_kv_heads=30, norm_eps=1e-5, qk_norm=True, cap_feat_dim=2560, rope_theta=256.0, t_scale=1000.0,
                           axes_dims=[32, 48, 48], axes_lens=[1024, 512, 512])
# Editing releases reuse their text-to-image layouts: black-forest-labs/FLUX.1-Kontext-dev's transformer is FLUX.1-dev's
# (FLUX_DEV_TRANSFORMER), Qwen/Qwen-Image-Edit-2509's Qwen-Image's (QWEN_IMAGE_TRANSFORMER, Qwen2.5-VL-7B, its VAE).
