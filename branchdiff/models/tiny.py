"""The built-in tiny text-to-image model: a 4-layer SD3 transformer in 32×32 RGB pixel space, a
2-layer CLIP text encoder and a CLIP BPE tokenizer, all stock diffusers/transformers classes, so
the tiny task runs the same code paths (peft LoRA on SD3 attention, CLIP encoding) as real models.

The transformer predicts x0 (pixels scaled to [-1, 1]); the velocity is derived from it,
`v = (x - x̂0) / σ`, which makes the pretraining of such a small model far easier than predicting
v directly (with 8×8 patches, predicting v gave noise).
"""

from __future__ import annotations

import gzip
import os
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from diffusers import SD3Transformer2DModel
from transformers import CLIPTextConfig, CLIPTextModelWithProjection, CLIPTokenizer

from branchdiff.models.base import ModelAdapter, PromptEmbeds
from branchdiff.models.loading import quiet_loading
from branchdiff.models.sd3 import SD3_ATTENTION, SD3_FEED_FORWARD
from branchdiff.schedulers.schedule import FlowSchedule

if TYPE_CHECKING:
    from typing_extensions import Self

MAX_PROMPT_TOKENS = 16
TOKENIZER_MERGES = 1000  # first BPE merges of open_clip's vocabulary: a small, valid CLIP vocab
TRANSFORMER_CONFIG = dict(
    sample_size=32, patch_size=8, in_channels=3, out_channels=3, num_layers=4, attention_head_dim=32,
    num_attention_heads=4, joint_attention_dim=64, caption_projection_dim=128, pooled_projection_dim=64,
    pos_embed_max_size=4,
)


def default_assets_dir(name: str = "tiny", variable: str = "BRANCHDIFF_TINY_MODEL") -> Path:
    """$`variable`, else the built-in model `name` shipped as package data of `branchdiff.assets`
    (the source tree's `assets/<name>` in an editable install)."""
    override = os.environ.get(variable)
    return Path(override) if override else Path(str(resources.files("branchdiff.assets") / name))


def build_tokenizer() -> CLIPTokenizer:
    """A CLIP tokenizer from open_clip's shipped BPE vocabulary (offline), truncated to its first
    `TOKENIZER_MERGES` merges; token ids match open_clip's for words those merges cover."""
    import open_clip
    from open_clip.tokenizer import bytes_to_unicode

    bpe_path = Path(open_clip.__file__).parent / "bpe_simple_vocab_16e6.txt.gz"
    merges = gzip.open(bpe_path).read().decode("utf-8").split("\n")[1 : 1 + TOKENIZER_MERGES]
    byte_tokens = list(bytes_to_unicode().values())
    tokens = byte_tokens + [t + "</w>" for t in byte_tokens] + ["".join(m.split()) for m in merges]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    # (its BPE model takes the merges as pairs)
    return CLIPTokenizer(vocab={t: i for i, t in enumerate(tokens)}, merges=[tuple(m.split()) for m in merges])


def build_text_encoder(tokenizer: CLIPTokenizer) -> CLIPTextModelWithProjection:
    config = CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=MAX_PROMPT_TOKENS, projection_dim=64,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    return CLIPTextModelWithProjection(config)


class TinyAdapter(ModelAdapter):
    family = "tiny"
    resolution = 32  # the only image side: height = width = 32
    height = width = resolution
    lora_target_sets = {"attention": SD3_ATTENTION, "attention+ff": SD3_ATTENTION + SD3_FEED_FORWARD, "all-linear": "all-linear"}
    quant_skip_modules: tuple[str, ...] = ("pos_embed", "time_text_embed", "context_embedder", "norm_out", "proj_out")
    pipeline_class_name = "StableDiffusion3Pipeline"  # its LoRA loads into an SD3 transformer
    denoiser_class = SD3Transformer2DModel
    denoiser_config: Mapping[str, object] = TRANSFORMER_CONFIG
    assets = ("tiny", "BRANCHDIFF_TINY_MODEL")  # the built-in model's folder under branchdiff.assets, and the variable that overrides it
    pretrain_script = "pretrain_tiny.py"

    def __init__(
        self,
        transformer: SD3Transformer2DModel,
        text_encoder: CLIPTextModelWithProjection,
        tokenizer: CLIPTokenizer,
        device: str | torch.device = "cpu",
    ) -> None:
        self.device = torch.device(device)
        self.denoiser = transformer.to(self.device)
        self.text_encoder = text_encoder.to(self.device).requires_grad_(False).eval()
        self.tokenizer = tokenizer

    @classmethod
    def random(cls, seed: int = 0, device: str | torch.device = "cpu") -> TinyAdapter:
        """Randomly initialised model of the shipped architecture (pretraining, tests)."""
        torch.manual_seed(seed)
        tokenizer = build_tokenizer()
        return cls(cls.denoiser_class(**cls.denoiser_config), build_text_encoder(tokenizer), tokenizer, device)

    @classmethod
    def from_pretrained(cls, path: str | Path | None = None, device: str | torch.device = "cpu", size: tuple[int, int] = (32, 32),
                        dtype: torch.dtype = torch.float32, offload: bool = False) -> Self:
        """Load `transformer/`, `text_encoder/` and `tokenizer/` saved by `save_pretrained` (the
        built-in model when `path` is None). The model is 32×32 pixels, small enough to stay on the
        device: `offload` is ignored."""
        if tuple(size) != (cls.height, cls.width):
            raise ValueError(f"the tiny model makes {cls.height}×{cls.width} images; model.resolution={list(size)} is not possible")
        path = Path(path) if path else default_assets_dir(*cls.assets)
        if not (path / "transformer" / "config.json").is_file():
            raise FileNotFoundError(
                f"no {cls.family} model at {path}: expected {path}/transformer/config.json; set model.path or "
                f"${cls.assets[1]} to a directory holding one (the source tree's scripts/{cls.pretrain_script} makes one)"
            )
        with quiet_loading():
            parts = (cls.denoiser_class.from_pretrained(path / "transformer", torch_dtype=dtype),
                     CLIPTextModelWithProjection.from_pretrained(path / "text_encoder"), CLIPTokenizer.from_pretrained(path / "tokenizer"))
        return cls(*parts, device)

    def save_pretrained(self, path: str | Path) -> None:
        path = Path(path)
        cast(Any, self.denoiser).save_pretrained(path / "transformer")  # diffusers' ModelMixin
        self.text_encoder.save_pretrained(path / "text_encoder")
        self.tokenizer.save_pretrained(path / "tokenizer")

    @property
    def latent_shape(self) -> tuple[int, ...]:
        return (3, self.resolution, self.resolution)  # pixel space

    def schedule(self, num_steps: int, shift: float | None = None) -> FlowSchedule:
        """σ = s·t / (1 + (s-1)·t) (s = 1: linear); the denoiser is conditioned on σ itself."""
        return FlowSchedule.shifted(num_steps, 1.0 if shift is None else shift, time_scale=1.0)

    def text_features(self, prompts: list[str]) -> PromptEmbeds:
        """Text-encoder outputs with gradients (pretraining trains the encoder jointly)."""
        tokens = self.tokenizer(
            prompts, padding="max_length", max_length=MAX_PROMPT_TOKENS, truncation=True, return_tensors="pt"
        ).to(self.device)
        out = self.text_encoder(**tokens)
        return {"encoder_hidden_states": out.last_hidden_state, "pooled_projections": out.text_embeds}

    def encode_prompts(self, prompts: list[str], sources: list[list] | None = None, negatives: list[str | None] | None = None) -> PromptEmbeds:
        self.check_sources(prompts, sources)
        self.row_negatives(negatives, len(prompts))  # the tiny model has no CFG: a row's negative prompt is refused
        with torch.no_grad():
            return self.text_features(prompts)

    def predict_x0(self, latents: torch.Tensor, sigmas: torch.Tensor, embeds: PromptEmbeds) -> torch.Tensor:
        return self.denoiser(hidden_states=latents, timestep=sigmas * 1000, **embeds).sample

    def forward(self, latents: torch.Tensor, times: torch.Tensor, embeds: PromptEmbeds, guidance: float = 1.0) -> torch.Tensor:
        """v = (x - x̂0) / σ, with times = σ."""
        sigmas = times
        x0_hat = self.predict_x0(latents, sigmas, embeds)  # (B, 3, 32, 32), or (B, 3, F, 32, 32) for clips
        return (latents - x0_hat) / sigmas.reshape(-1, *[1] * (latents.dim() - 1)).to(latents.dtype)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return ((latents.float() + 1) / 2).clamp(0, 1)

    @staticmethod
    def encode_images(images: torch.Tensor) -> torch.Tensor:
        """Images in [0, 1] → latents in [-1, 1] (the inverse of `decode`)."""
        return images * 2 - 1
