"""What `branchdiff plan` needs to know of each family: the denoiser's diffusers class and config, the
blocks whose figures scale to the real depth, the forward's inputs for a number of network rows
(as the adapters in branchdiff/models/ pass them), the text encoders and the VAE.

A family is planned from its release's published config (branchdiff/plan/published.py), or, where
`model.path` is a local pipeline folder, from that folder's own configs: its denoiser, its VAE and
every text encoder that `model_index.json` lists (a fine-tuned copy or a tiny test pipeline).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from branchdiff.plan import published as P

Size = tuple[int, int, int]  # (frames, height, width) in pixels of what a row makes: frames 1 for an image


@dataclass(frozen=True)
class Geometry:
    """How the VAE maps pixels to latents: spatial and temporal factors, latent channels (1, 1 and 3 in pixel space)."""

    factor: int
    temporal: int
    channels: int


@dataclass
class Family:
    name: str
    label: str
    adapter: type  # branchdiff adapter: LoRA targets, CFG, quantisation skips, text tokens
    denoiser: str  # diffusers class
    config: dict
    block_lists: tuple[str, ...]  # ModuleLists of the blocks whose per-block figures scale to the real depth
    reduced: dict  # config overrides of the traced copy (one block of every kind)
    block_kind: Callable[[str, torch.nn.Module], str]
    inputs: Callable[[Any, Geometry, int, Size, torch.dtype, int], dict]  # (denoiser config, geometry, rows, size, dtype, text tokens) -> kwargs
    text_tokens: int  # per row, as the adapter pads prompts
    text_encoders: list[tuple[str, Callable[[], torch.nn.Module]]]
    vae: tuple[str, dict] | None  # diffusers class and config; None: the model works in pixel space
    latent: Callable[[Any, Geometry, Size], tuple[int, ...]]  # per node latent the rollout stores (fp32)
    gpu: str  # the GPU its presets target (branchdiff/plan/clock.py GPUS)
    ckpt_units: tuple[str, ...] = ()  # module classes diffusers checkpoints (UNet: resnets and transformer blocks)
    source: str = "published"  # "published", or the local folder the configs were read from
    experts: int = 1  # denoisers of this size the model holds (Wan 2.2 A14B: 2, each taking its own timesteps)

    def vae_latent(self, geometry: Geometry, size: Size) -> tuple[int, ...]:
        """The latent one decoded image (video) comes from."""
        video_vae = self.vae is not None and self.vae[0] in ("AutoencoderKLWan", "AutoencoderKLQwenImage")  # they decode (C, F, H, W)
        frames = ((size[0] - 1) // geometry.temporal + 1,) if video_vae else ()
        return (geometry.channels, *frames, size[1] // geometry.factor, size[2] // geometry.factor)


def _empty(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(*shape, device="cuda", dtype=dtype)


def _packed(cfg: Any, g: Geometry, size: Size) -> int:
    """Tokens of a latent packed 2×2 (FLUX, Qwen-Image, FLUX.2)."""
    return (size[1] // g.factor // 2) * (size[2] // g.factor // 2)


def _flux_inputs(cfg: Any, g: Geometry, rows: int, size: Size, dtype: torch.dtype, text: int) -> dict:
    tokens = _packed(cfg, g, size)
    e = lambda *shape, dt=dtype: _empty(*shape, dtype=dt)
    return dict(hidden_states=e(rows, tokens, cfg["in_channels"]), encoder_hidden_states=e(rows, text, cfg["joint_attention_dim"]),
                pooled_projections=e(rows, cfg["pooled_projection_dim"]), timestep=e(rows),
                guidance=e(rows, dt=torch.float32) if cfg["guidance_embeds"] else None, img_ids=e(tokens, 3), txt_ids=e(text, 3), return_dict=False)


def _sd3_inputs(cfg: Any, g: Geometry, rows: int, size: Size, dtype: torch.dtype, text: int) -> dict:
    e = lambda *shape, dt=dtype: _empty(*shape, dtype=dt)
    return dict(hidden_states=e(rows, cfg["in_channels"], size[1] // g.factor, size[2] // g.factor),
                encoder_hidden_states=e(rows, text, cfg["joint_attention_dim"]), pooled_projections=e(rows, cfg["pooled_projection_dim"]),
                timestep=e(rows, dt=torch.float32), return_dict=False)


def _sana_inputs(cfg: Any, g: Geometry, rows: int, size: Size, dtype: torch.dtype, text: int) -> dict:
    e = lambda *shape, dt=dtype: _empty(*shape, dtype=dt)
    return dict(hidden_states=e(rows, cfg["in_channels"], size[1] // g.factor, size[2] // g.factor),
                encoder_hidden_states=e(rows, text, cfg["caption_channels"]), encoder_attention_mask=e(rows, text, dt=torch.int64),
                timestep=e(rows, dt=torch.float32), return_dict=False)


def _sd15_inputs(cfg: Any, g: Geometry, rows: int, size: Size, dtype: torch.dtype, text: int) -> dict:
    e = lambda *shape, dt=dtype: _empty(*shape, dtype=dt)
    return dict(sample=e(rows, cfg["in_channels"], size[1] // g.factor, size[2] // g.factor), timestep=e(rows, dt=torch.float32),
                encoder_hidden_states=e(rows, text, cfg["cross_attention_dim"]), return_dict=False)


def _wan_inputs(cfg: Any, g: Geometry, rows: int, size: Size, dtype: torch.dtype, text: int) -> dict:
    e = lambda *shape, dt=dtype: _empty(*shape, dtype=dt)
    return dict(hidden_states=e(rows, cfg["in_channels"], *_wan_latent(cfg, g, size)[1:]), timestep=e(rows, dt=torch.float32),
                encoder_hidden_states=e(rows, text, cfg["text_dim"]), return_dict=False)


def _wan_i2v_inputs(cfg: Any, g: Geometry, rows: int, size: Size, dtype: torch.dtype, text: int) -> dict:
    """Image-to-video: the condition's channels in `in_channels`; Wan 2.1's image states; TI2V's timestep per token
    (its input and output channels are equal: the first frame is a clean latent, not concatenated channels)."""
    inputs = _wan_inputs(cfg, g, rows, size, dtype, text)
    if cfg.get("image_dim"):
        inputs["encoder_hidden_states_image"] = _empty(rows, P.CLIP_VIT_H_14_STATES, cfg["image_dim"], dtype=dtype)
    if cfg["in_channels"] == cfg["out_channels"]:
        frames, height, width = _wan_latent(cfg, g, size)[1:]
        inputs["timestep"] = _empty(rows, frames * (height // cfg["patch_size"][1]) * (width // cfg["patch_size"][2]), dtype=torch.float32)
    return inputs


def _qwen_image_inputs(cfg: Any, g: Geometry, rows: int, size: Size, dtype: torch.dtype, text: int) -> dict:
    grid = (size[1] // g.factor // 2, size[2] // g.factor // 2)
    e = lambda *shape, dt=dtype: _empty(*shape, dtype=dt)
    return dict(hidden_states=e(rows, grid[0] * grid[1], cfg["in_channels"]), encoder_hidden_states=e(rows, text, cfg["joint_attention_dim"]),
                encoder_hidden_states_mask=e(rows, text, dt=torch.bool), timestep=e(rows), img_shapes=[[(1, *grid)]] * rows, return_dict=False)


def _flux2_inputs(cfg: Any, g: Geometry, rows: int, size: Size, dtype: torch.dtype, text: int) -> dict:
    tokens = _packed(cfg, g, size)
    e = lambda *shape, dt=dtype: _empty(*shape, dtype=dt)
    return dict(hidden_states=e(rows, tokens, cfg["in_channels"]), encoder_hidden_states=e(rows, text, cfg["joint_attention_dim"]),
                timestep=e(rows), img_ids=e(rows, tokens, 4, dt=torch.int64), txt_ids=e(rows, text, 4, dt=torch.int64),
                guidance=e(rows, dt=torch.float32) if cfg["guidance_embeds"] else None, return_dict=False)


def _z_image_inputs(cfg: Any, g: Geometry, rows: int, size: Size, dtype: torch.dtype, text: int) -> dict:
    """Z-Image's transformer takes lists: per row a (C, 1, h, w) latent and its prompt's (L, D) token states."""
    e = lambda *shape, dt=dtype: _empty(*shape, dtype=dt)
    return dict(x=[e(cfg["in_channels"], 1, size[1] // g.factor, size[2] // g.factor) for _ in range(rows)], t=e(rows, dt=torch.float32),
                cap_feats=[e(text, cfg["cap_feat_dim"]) for _ in range(rows)], return_dict=False)


def _kontext_inputs(cfg: Any, g: Geometry, rows: int, size: Size, dtype: torch.dtype, text: int) -> dict:
    """FLUX.1 Kontext: the source image's tokens (encoded at the run's size) beside the noisy image's."""
    inputs = _flux_inputs(cfg, g, rows, size, dtype, text)
    tokens = 2 * _packed(cfg, g, size)
    return {**inputs, "hidden_states": _empty(rows, tokens, cfg["in_channels"], dtype=dtype), "img_ids": _empty(tokens, 3, dtype=dtype)}


def _qwen_edit_grid(g: Geometry, size: Size) -> tuple[int, int]:
    """The token grid of one source at the pipeline's VAE area (1024², at the edit's aspect ratio)."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import VAE_IMAGE_SIZE, calculate_dimensions

    width, height = calculate_dimensions(VAE_IMAGE_SIZE, size[2] / size[1])
    return (height // g.factor // 2, width // g.factor // 2)


def _qwen_edit_inputs(cfg: Any, g: Geometry, rows: int, size: Size, dtype: torch.dtype, text: int) -> dict:
    """Qwen-Image-Edit with one source: the source's tokens at the pipeline's VAE area beside the noisy image's."""
    inputs = _qwen_image_inputs(cfg, g, rows, size, dtype, text)
    grid, source = (size[1] // g.factor // 2, size[2] // g.factor // 2), _qwen_edit_grid(g, size)
    tokens = grid[0] * grid[1] + source[0] * source[1]
    return {**inputs, "hidden_states": _empty(rows, tokens, cfg["in_channels"], dtype=dtype), "img_shapes": [[(1, *grid), (1, *source)]] * rows}


def _wan_latent(cfg: Any, g: Geometry, size: Size) -> tuple[int, int, int, int]:
    """Wan's latent of a video of F frames at H×W: (C, (F − 1)/r + 1, H/f, W/f), C the transformer's output channels (an
    image-to-video transformer reads more)."""
    return (cfg.get("out_channels") or cfg["in_channels"], (size[0] - 1) // g.temporal + 1, size[1] // g.factor, size[2] // g.factor)


def _spatial_latent(cfg: Any, g: Geometry, size: Size) -> tuple[int, int, int]:
    return (cfg["in_channels"], size[1] // g.factor, size[2] // g.factor)


def _packed_latent(cfg: Any, g: Geometry, size: Size) -> tuple[int, int]:
    return (_packed(cfg, g, size), cfg["in_channels"])


def _flux2_latent(cfg: Any, g: Geometry, size: Size) -> tuple[int, int, int]:
    return (cfg["in_channels"], size[1] // g.factor // 2, size[2] // g.factor // 2)


def _sd3_kind(name: str, block: torch.nn.Module) -> str:
    if getattr(block, "context_pre_only", False):
        return "last joint block (context pre-only)"
    return "joint block + dual attention" if getattr(block, "attn2", None) is not None else "joint block"


def _class_kind(name: str, block: torch.nn.Module) -> str:
    return type(block).__name__


def _list_kind(name: str, block: torch.nn.Module) -> str:
    """The ModuleList a block sits in (Z-Image's refiners see the image's or the text's tokens only, its layers both)."""
    return name.rsplit(".", 1)[0]


def _text_models() -> dict[str, Callable[[], torch.nn.Module]]:
    from transformers import (
        CLIPTextConfig,
        CLIPTextModel,
        CLIPTextModelWithProjection,
        CLIPVisionConfig,
        CLIPVisionModel,
        Gemma2Config,
        Gemma2Model,
        Mistral3Config,
        Mistral3ForConditionalGeneration,
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3Model,
        T5Config,
        T5EncoderModel,
        UMT5Config,
        UMT5EncoderModel,
    )

    return {
        "CLIP-L": lambda: CLIPTextModel(CLIPTextConfig(**P.CLIP_L)),
        "CLIP-L+proj": lambda: CLIPTextModelWithProjection(CLIPTextConfig(**P.CLIP_L)),
        "CLIP-G+proj": lambda: CLIPTextModelWithProjection(CLIPTextConfig(**P.CLIP_G)),
        "T5-XXL enc": lambda: T5EncoderModel(T5Config(**P.T5_XXL)),
        "Gemma-2-2B": lambda: Gemma2Model(Gemma2Config(**P.GEMMA2_2B)),
        "UMT5-XXL enc": lambda: UMT5EncoderModel(UMT5Config(**P.UMT5_XXL)),
        "Qwen2.5-VL-7B": lambda: Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**P.QWEN25_VL_7B)),
        "Mistral-Small-3.1-24B": lambda: Mistral3ForConditionalGeneration(Mistral3Config(**P.MISTRAL_SMALL_31_24B)),
        "Qwen3-4B": lambda: Qwen3ForCausalLM(Qwen3Config(**P.QWEN3_4B)),
        "Qwen3-4B model": lambda: Qwen3Model(Qwen3Config(**P.QWEN3_4B)),
        "Qwen3-8B": lambda: Qwen3ForCausalLM(Qwen3Config(**P.QWEN3_8B)),
        "CLIP ViT-H/14 image": lambda: CLIPVisionModel(CLIPVisionConfig(**P.CLIP_VIT_H_14)),
    }


def _flux2_family(name: str, label: str, config: dict, text: tuple[str, Callable[[], torch.nn.Module]], guidance: bool) -> Family:
    from branchdiff.models.flux2 import Flux2Adapter, Flux2KleinAdapter

    adapter = Flux2Adapter if guidance else Flux2KleinAdapter
    return Family(name, label, adapter, "Flux2Transformer2DModel", config, ("transformer_blocks", "single_transformer_blocks"),
                  dict(num_layers=1, num_single_layers=1), _class_kind, _flux2_inputs, adapter.max_sequence_length, [text],
                  ("AutoencoderKLFlux2", {}), _flux2_latent, "80")


def _wan_family(name: str, label: str, config: dict, text: dict, image: bool = False, vae: dict | None = None, experts: int = 1) -> Family:
    """A Wan release; `image`: started from an image (`wan-i2v`), with Wan 2.1 I2V's CLIP image encoder where its config reads it;
    `experts`: 2 for Wan 2.2 A14B."""
    from branchdiff.models.wan import WanAdapter
    from branchdiff.models.wan_i2v import WanImageToVideoAdapter

    adapter, inputs = (WanImageToVideoAdapter, _wan_i2v_inputs) if image else (WanAdapter, _wan_inputs)
    encoders = [("UMT5-XXL enc", text["UMT5-XXL enc"]), *([("CLIP ViT-H/14 image", text["CLIP ViT-H/14 image"])] if config.get("image_dim") else [])]
    return Family(name, label, adapter, "WanTransformer3DModel", config, ("blocks",), dict(num_layers=1), _class_kind, inputs,
                  adapter.max_sequence_length, encoders, ("AutoencoderKLWan", vae or {}), _wan_latent, "80", experts=experts)


def families() -> dict[str, Family]:
    """Every released model `plan` knows, by key (a family, or a family's other size: wan-14b, flux2-klein-4b, -9b)."""
    from branchdiff.models.flux import FluxAdapter
    from branchdiff.models.flux_kontext import FluxKontextAdapter
    from branchdiff.models.qwen_image import QwenImageAdapter
    from branchdiff.models.qwen_image_edit import QwenImageEditAdapter
    from branchdiff.models.sana import SanaAdapter
    from branchdiff.models.sd3 import SD3Adapter
    from branchdiff.models.sd15 import SD15Adapter
    from branchdiff.models.tiny import MAX_PROMPT_TOKENS, TinyAdapter
    from branchdiff.models.tiny_video import TinyVideoAdapter
    from branchdiff.models.z_image import ZImageAdapter

    text = _text_models()
    return {
        "flux": Family("flux", "FLUX.1-dev", FluxAdapter, "FluxTransformer2DModel", P.FLUX_DEV_TRANSFORMER,
                       ("transformer_blocks", "single_transformer_blocks"), dict(num_layers=1, num_single_layers=1), _class_kind, _flux_inputs,
                       FluxAdapter.max_sequence_length, [("CLIP-L", text["CLIP-L"]), ("T5-XXL enc", text["T5-XXL enc"])],
                       ("AutoencoderKL", P.VAE_KL16), _packed_latent, "80"),
        "sd3": Family("sd3", "SD3.5 Medium", SD3Adapter, "SD3Transformer2DModel", P.SD35_MEDIUM_TRANSFORMER, ("transformer_blocks",),
                      dict(num_layers=3, dual_attention_layers=(0,)), _sd3_kind, _sd3_inputs, 77 + SD3Adapter.max_sequence_length,
                      [("CLIP-L", text["CLIP-L+proj"]), ("CLIP-G", text["CLIP-G+proj"]), ("T5-XXL enc", text["T5-XXL enc"])],
                      ("AutoencoderKL", P.VAE_KL16), _spatial_latent, "80"),
        "sana": Family("sana", "SANA 1600M 1024px", SanaAdapter, "SanaTransformer2DModel", P.SANA_1600M_1024_TRANSFORMER, ("transformer_blocks",),
                       dict(num_layers=1), _class_kind, _sana_inputs, SanaAdapter.max_sequence_length,
                       [("Gemma-2-2B", text["Gemma-2-2B"])], ("AutoencoderDC", P.VAE_DCAE_F32C32), _spatial_latent, "80"),
        "sd15": Family("sd15", "SD 1.5", SD15Adapter, "UNet2DConditionModel", P.SD15_UNET, (), {}, lambda name, block: name, _sd15_inputs, 77,
                       [("CLIP-L", text["CLIP-L"])], ("AutoencoderKL", P.VAE_KL4), _spatial_latent, "24",
                       ckpt_units=("ResnetBlock2D", "BasicTransformerBlock")),
        "wan": _wan_family("wan", "Wan 2.1 T2V 1.3B", P.WAN_T2V_1_3B_TRANSFORMER, text),
        "wan-14b": _wan_family("wan-14b", "Wan 2.1 T2V 14B", P.WAN_T2V_14B_TRANSFORMER, text),
        "wan-ti2v-5b": _wan_family("wan-ti2v-5b", "Wan 2.2 TI2V-5B", P.WAN_TI2V_5B_TRANSFORMER, text, vae=P.VAE_WAN22),
        "wan-i2v": _wan_family("wan-i2v", "Wan 2.1 I2V 14B", P.WAN_I2V_14B_TRANSFORMER, text, image=True),
        "wan-a14b": _wan_family("wan-a14b", "Wan 2.2 T2V-A14B", P.WAN_T2V_14B_TRANSFORMER, text, experts=2),
        "wan-i2v-a14b": _wan_family("wan-i2v-a14b", "Wan 2.2 I2V-A14B", P.WAN_I2V_A14B_TRANSFORMER, text, image=True, experts=2),
        "wan-i2v-ti2v-5b": _wan_family("wan-i2v-ti2v-5b", "Wan 2.2 TI2V-5B from an image", P.WAN_TI2V_5B_TRANSFORMER, text, image=True,
                                       vae=P.VAE_WAN22),
        "qwen-image": Family("qwen-image", "Qwen-Image", QwenImageAdapter, "QwenImageTransformer2DModel", P.QWEN_IMAGE_TRANSFORMER,
                             ("transformer_blocks",), dict(num_layers=1), _class_kind, _qwen_image_inputs, QwenImageAdapter.max_sequence_length,
                             [("Qwen2.5-VL-7B", text["Qwen2.5-VL-7B"])], ("AutoencoderKLQwenImage", {}), _packed_latent, "80"),
        "flux2": _flux2_family("flux2", "FLUX.2 [dev]", P.FLUX2_DEV_TRANSFORMER, ("Mistral-Small-3.1-24B", text["Mistral-Small-3.1-24B"]), True),
        "flux2-klein-4b": _flux2_family("flux2-klein-4b", "FLUX.2 [klein] base 4B", P.FLUX2_KLEIN_4B_TRANSFORMER, ("Qwen3-4B", text["Qwen3-4B"]),
                                        False),
        "flux2-klein-9b": _flux2_family("flux2-klein-9b", "FLUX.2 [klein] base 9B", P.FLUX2_KLEIN_9B_TRANSFORMER, ("Qwen3-8B", text["Qwen3-8B"]),
                                        False),
        "z-image": Family("z-image", "Z-Image", ZImageAdapter, "ZImageTransformer2DModel", P.Z_IMAGE_TRANSFORMER,
                          ("noise_refiner", "context_refiner", "layers"), dict(n_layers=1, n_refiner_layers=1), _list_kind, _z_image_inputs,
                          ZImageAdapter.max_sequence_length, [("Qwen3-4B", text["Qwen3-4B model"])], ("AutoencoderKL", P.VAE_KL16),
                          _spatial_latent, "80"),
        # editing: a step's tokens are the noisy image's and one source's
        "flux-kontext": Family("flux-kontext", "FLUX.1 Kontext [dev]", FluxKontextAdapter, "FluxTransformer2DModel", P.FLUX_DEV_TRANSFORMER,
                               ("transformer_blocks", "single_transformer_blocks"), dict(num_layers=1, num_single_layers=1), _class_kind,
                               _kontext_inputs, FluxKontextAdapter.max_sequence_length, [("CLIP-L", text["CLIP-L"]), ("T5-XXL enc", text["T5-XXL enc"])],
                               ("AutoencoderKL", P.VAE_KL16), _packed_latent, "80"),
        "qwen-image-edit": Family("qwen-image-edit", "Qwen-Image-Edit 2509", QwenImageEditAdapter, "QwenImageTransformer2DModel",
                                  P.QWEN_IMAGE_TRANSFORMER, ("transformer_blocks",), dict(num_layers=1), _class_kind, _qwen_edit_inputs,
                                  QwenImageEditAdapter.max_sequence_length, [("Qwen2.5-VL-7B", text["Qwen2.5-VL-7B"])],
                                  ("AutoencoderKLQwenImage", {}), _packed_latent, "80"),
        # the built-in model: an SD3 transformer in pixel space (no VAE), its CLIP text encoder read from its folder
        "tiny": Family("tiny", "built-in tiny model", TinyAdapter, "SD3Transformer2DModel", TinyAdapter.denoiser_config, ("transformer_blocks",),
                       {}, _sd3_kind, _sd3_inputs, MAX_PROMPT_TOKENS, [], None, _spatial_latent, "80"),
        # the built-in video model: a Wan transformer over 5-frame clips in pixel space
        "tiny-video": Family("tiny-video", "built-in tiny video model", TinyVideoAdapter, "WanTransformer3DModel", TinyVideoAdapter.denoiser_config,
                             ("blocks",), {}, _class_kind, _wan_inputs, MAX_PROMPT_TOKENS, [], None, _wan_latent, "80"),
    }


KLEIN = "black-forest-labs/FLUX.2-klein-base-{}"


def family_key(config: Any) -> str:
    """The `families()` entry of a run's model: its family, Wan's 14B where the model path names it, FLUX.2 [klein]'s
    4B or 9B as the path names it (a local folder is planned from its own configs)."""
    family, path = config.model.family, str(config.model.path or "")
    if family in ("wan", "wan-i2v") and "ti2v" in path.lower():
        return "wan-ti2v-5b" if family == "wan" else "wan-i2v-ti2v-5b"
    if family in ("wan", "wan-i2v") and "a14b" in path.lower():
        return "wan-a14b" if family == "wan" else "wan-i2v-a14b"
    if family == "wan" and "14b" in path.lower():
        return "wan-14b"
    if family == "flux2-klein":
        for size in ("9b", "4b"):
            if size in path.lower():
                return f"flux2-klein-{size}"
        if not Path(path).is_dir():
            raise ValueError(f"model.path={path}: plan knows FLUX.2 [klein] 4B and 9B by name; plan with model.path={KLEIN.format('4B')}, "
                             f"{KLEIN.format('9B')} or a local copy of the model")
        return "flux2-klein-4b"
    return family


def size_of(config: Any) -> Size:
    """(frames, height, width) of what a run's model makes: frames 1 for an image family; the family's defaults where unset."""
    from branchdiff.models.registry import FAMILIES, image_size

    spec = FAMILIES[config.model.family]
    height, width = image_size(config.model.resolution, spec.resolution)
    return ((config.model.frames or spec.frames) if spec.frames else 1, height, width)


def eval_size_of(config: Any) -> Size:
    """(frames, height, width) of the evaluations' samples: `eval.resolution` and `eval.frames`, else the training's."""
    from branchdiff.models.registry import image_size

    frames, height, width = size_of(config)
    height, width = image_size(config.eval.resolution, (height, width))
    return (config.eval.frames or frames, height, width)


def _read(path: Path) -> dict:
    return {k: v for k, v in json.loads(path.read_text()).items() if not k.startswith("_")}


def _local_text_encoders(folder: Path) -> list[tuple[str, Callable[[], torch.nn.Module]]]:
    """Every text encoder the pipeline folder's model_index.json lists, built from its own config."""
    import transformers

    index = json.loads((folder / "model_index.json").read_text()) if (folder / "model_index.json").exists() else {}
    found = []
    for name, entry in sorted(index.items()):
        encodes = name.startswith("text_encoder") or name == "image_encoder"  # the prompts' encoders, and an image-to-video model's image's
        if encodes and isinstance(entry, list) and entry[1] and (folder / name / "config.json").exists():
            model_class = getattr(transformers, entry[1])
            config = model_class.config_class.from_pretrained(folder / name)
            found.append((f"{name} ({entry[1]})", lambda model_class=model_class, config=config: model_class(config)))
    if not index and (folder / "text_encoder" / "config.json").exists():  # the built-in model: one CLIP encoder with projection
        from transformers import CLIPTextConfig, CLIPTextModelWithProjection

        config = CLIPTextConfig.from_pretrained(folder / "text_encoder")
        found.append(("text_encoder (CLIPTextModelWithProjection)", lambda: CLIPTextModelWithProjection(config)))
    return found


def from_folder(family: Family, folder: Path) -> Family:
    """`family` with the configs of the pipeline saved in `folder`: the denoiser, the VAE, the text encoders."""
    denoiser_folder = folder / ("unet" if family.denoiser == "UNet2DConditionModel" else "transformer")
    config = _read(denoiser_folder / "config.json") if (denoiser_folder / "config.json").exists() else family.config
    vae = family.vae
    if (folder / "vae" / "config.json").exists():
        vae = (json.loads((folder / "vae" / "config.json").read_text())["_class_name"], _read(folder / "vae" / "config.json"))
    experts = 2 if (folder / "transformer_2" / "config.json").exists() else 1  # Wan 2.2 A14B's second expert
    return replace(family, config=config, vae=vae, text_encoders=_local_text_encoders(folder) or family.text_encoders, source=str(folder),
                   label=f"{family.label} ({folder.name})", experts=experts)


def family_for(config: Any, known: dict[str, Family] | None = None) -> Family:
    """The family a run's config plans: the published one, or the local folder's configs where model.path is a folder."""
    known = known if known is not None else families()
    key = family_key(config)
    if key not in known:
        raise ValueError(f"model.family={config.model.family}: `branchdiff plan` has no memory model for this family yet "
                         f"(it knows {', '.join(sorted(known))}); docs/plan.md")
    family = known[key]
    if key in ("tiny", "tiny-video"):
        from branchdiff.models import adapter_class
        from branchdiff.models.tiny import default_assets_dir

        return from_folder(family, Path(config.model.path) if config.model.path else default_assets_dir(*adapter_class(key).assets))
    if config.model.path and Path(config.model.path).is_dir():
        return from_folder(family, Path(config.model.path))
    return family


def geometry(vae: torch.nn.Module | None) -> Geometry:
    """The VAE's spatial and temporal factors and latent channels, from its (full) config."""
    if vae is None:
        return Geometry(1, 1, 3)
    cfg = vae.config
    name = type(vae).__name__
    if name == "AutoencoderDC":
        return Geometry(2 ** (len(cfg["encoder_block_out_channels"]) - 1), 1, cfg["latent_channels"])
    if name == "AutoencoderKLWan":
        return Geometry(cfg["scale_factor_spatial"], cfg["scale_factor_temporal"], cfg["z_dim"])
    if name == "AutoencoderKLQwenImage":
        return Geometry(2 ** len(cfg["temperal_downsample"]), 1, cfg["z_dim"])
    return Geometry(2 ** (len(cfg["block_out_channels"]) - 1), 1, cfg["latent_channels"])
