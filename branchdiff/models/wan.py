"""Wan text-to-video (Wan 2.1 T2V 1.3B / 14B; Wan 2.2 A14B with its low-noise expert, and TI2V-5B) through
diffusers' `WanPipeline`: UMT5 prompts padded to `max_sequence_length`, CFG with an empty negative
prompt, rectified flow on the scheduler's σ schedule (the release's flow shift), the transformer
conditioned on the scheduler's timesteps t = σ·1000.

Latents are videos: (C, F', H/s, W/s) with F' = (F − 1)/r + 1 latent frames for F = r·k + 1 frames
(r = `vae.config.scale_factor_temporal`, 4 as released; s = `scale_factor_spatial`, 8). Image sides
are multiples of 16 (the pipeline's check) and of s × the transformer's spatial patch. `decode`
returns videos (B, F, 3, H, W) in [0, 1], as `pipe(..., output_type="pt")` does: latents·std + mean
per channel (the VAE's `latents_std`, `latents_mean`), then the VAE and the pipeline's video processor.

Wan 2.2 A14B ships a second transformer (`transformer_2`, the low-noise expert): rows whose timestep
is below `boundary_ratio · num_train_timesteps` go to it, the others to `transformer`, as the pipeline
switches them; `transformer` applies the run's guidance and `transformer_2` `model.guidance_2` (the
pipeline's `guidance_scale_2`), or the run's when it is unset (the pipeline's default). `denoiser`
(what LoRA and full fine-tuning train, and what the export holds) is the expert `model.expert` names:
`high`, `transformer` (the default, and Wan 2.1's only one), or `low`, `transformer_2`, whose LoRA
loads with `pipe.load_lora_weights(path, load_into_transformer_2=True)` and whose full fine-tuning
exports `transformer_2/`; the other expert stays frozen, and the edges it predicts are not trained
(`trains_at`). With `both`, LoRA trains the two experts together (`WanExperts`): the export RUN/lora
holds transformer's LoRA, and RUN/lora/transformer_2/ transformer_2's, which loads with
`load_into_transformer_2=True` (full fine-tuning trains one expert per run).

Under FSDP every process must call a sharded expert as often as the others (`lockstep`): an expert
with no rows in a batch then runs one row, whose output enters the result times 0, so its gathers
and its gradient's reduction happen on every process alike. With `both`, the rows are routed inside
one call of the trained module (`WanExperts`), so DDP sees one forward per prediction.

Wan 2.2 TI2V-5B (`expand_timesteps` in its pipeline's config) is given one timestep per token by its
pipeline; in text-to-video they all equal the row's, which the transformer's one-timestep path computes
alike (tests/test_wan.py: sampling equals the pipeline's); its VAE patchifies 2×2 and compresses 16×.

`model.frames` (`--frames`) is F. tests/test_wan.py checks that ODE sampling equals `pipe(...)` for one
and two experts, at two frame counts and a non-square size, that `--solver release` equals it with
UniPC, and that a trained LoRA's export loads into the pipeline to the same video (docs/models.md).
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import torch

from branchdiff.models import lora
from branchdiff.models.pipeline_adapter import PipelineAdapter

WAN_ATTENTION = ["attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0"]
WAN_FEED_FORWARD = ["ffn.net.0.proj", "ffn.net.2"]
PIPELINE_SIDE_MULTIPLE = 16  # WanPipeline.check_inputs: height and width divisible by 16
EXPERTS = ("high", "low", "both")  # model.expert: Wan 2.2 A14B's expert(s) trained: `transformer` (high noise), `transformer_2` (low noise), or both
LOW_NOISE_LORA = "transformer_2"  # with model.expert=both: the folder of transformer_2's LoRA inside RUN/lora


class WanExperts(torch.nn.Module):
    """Wan 2.2's two experts as one trained module (`model.expert: both`): one call routes the rows
    (`route`), so a DDP wrapper sees one forward per prediction; LoRA, gradient checkpointing and the
    adapter switch reach both experts. `denoisers` names them for FSDP's wrap (branchdiff/runtime/sharding.py:
    each expert's blocks are units)."""

    denoisers = ("transformer", "transformer_2")
    transformer: Any  # diffusers' WanTransformer3DModel (its peft and checkpointing mixins)
    transformer_2: Any

    def __init__(self, transformer: torch.nn.Module, transformer_2: torch.nn.Module) -> None:
        super().__init__()
        self.transformer, self.transformer_2 = transformer, transformer_2

    def forward(self, high: torch.Tensor, inputs: dict[str, torch.Tensor], channels: int, dtype: torch.dtype, lockstep: bool) -> torch.Tensor:
        return route(high, inputs, channels, dtype, {name: getattr(self, name) for name in self.denoisers}, self.denoisers if lockstep else ())

    def add_adapter(self, config) -> None:
        for expert in (self.transformer, self.transformer_2):
            expert.add_adapter(copy.deepcopy(config))

    def disable_adapters(self) -> None:
        self.transformer.disable_adapters()
        self.transformer_2.disable_adapters()

    def enable_adapters(self) -> None:
        self.transformer.enable_adapters()
        self.transformer_2.enable_adapters()

    def enable_gradient_checkpointing(self) -> None:
        self.transformer.enable_gradient_checkpointing()
        self.transformer_2.enable_gradient_checkpointing()


def route(high: torch.Tensor, inputs: dict[str, torch.Tensor], channels: int, dtype: torch.dtype, experts: dict[str, torch.nn.Module | None],
          padded: tuple[str, ...]) -> torch.Tensor:
    """The prediction (B, channels, F', h, w) of rows `high` (B,) by `transformer`, the others by `transformer_2`; `inputs`:
    the transformer's keyword arguments, B rows each (`model_inputs`). An expert of `padded` (sharded: module doc) without
    rows runs the first row, whose output enters times 0."""
    if bool(high.all()) and "transformer_2" not in padded:  # one expert takes every row (Wan 2.1 always): no gather, no scatter
        return call_expert(experts["transformer"], inputs, dtype)
    hidden = inputs["hidden_states"]
    out, idle = hidden.new_empty((len(hidden), channels, *hidden.shape[2:]), dtype=dtype), None
    for name, rows in (("transformer", high), ("transformer_2", ~high)):
        if bool(rows.any()):
            out[rows] = call_expert(experts[name], {key: value[rows] for key, value in inputs.items()}, dtype)
        elif name in padded:
            first = {key: value[:1] for key, value in inputs.items()}
            unused = call_expert(experts[name], first, dtype).sum() * 0  # the other processes' gathers
            idle = unused if idle is None else idle + unused
    return out if idle is None else out + idle


def call_expert(expert: torch.nn.Module | None, inputs: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """One expert's output for `inputs` (its keyword arguments; float tensors but the timesteps in the expert's `dtype`)."""
    assert expert is not None  # `route` calls only an expert that takes rows or is padded: the model has it
    cast = {key: value if key == "timestep" else value.to(dtype) for key, value in inputs.items()}
    return expert(**cast, return_dict=False)[0]


class WanAdapter(PipelineAdapter):
    family = "wan"
    pipeline_class_name = "WanPipeline"
    helper_names: tuple[str, ...] = ("text_encoder", "vae")
    lora_target_sets = {"attention": WAN_ATTENTION, "attention+ff": WAN_ATTENTION + WAN_FEED_FORWARD, "all-linear": "all-linear"}
    quant_skip_modules: tuple[str, ...] = ("patch_embedding", "condition_embedder", "norm_out", "proj_out")
    uses_cfg = True
    default_guidance = 5.0  # WanPipeline's default guidance_scale
    example_hub_id = "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"
    card_license = "apache-2.0"
    max_sequence_length = 512  # UMT5 tokens (WanPipeline.__call__'s default)
    decode_batch = 1  # videos per VAE call: one 33-frame 480×832 decode peaks near 4 GiB (docs/memory-table.md)
    eval_batch = 4  # rows per evaluation forward (2 videos with CFG): 32 rows of 14k tokens would add ~21 GiB (1.3B) or ~53 GiB (14B)

    def __init__(self, pipe, device: torch.device | str = "cpu", size: tuple[int, int] = (480, 832), offload: bool = False,
                 frames: int = 81, expert: str = "high", guidance_2: float | None = None) -> None:
        check_frames(frames, pipe.vae_scale_factor_temporal)
        if expert not in EXPERTS:
            raise ValueError(f"model.expert={expert!r}; allowed: {', '.join(EXPERTS)}")
        if expert != "high" and pipe.transformer_2 is None:
            raise ValueError(f"model.expert={expert} trains Wan 2.2's low-noise expert (transformer_2){' too' if expert == 'both' else ''}, "
                             "and this model has one transformer; use model.expert=high")
        if guidance_2 is not None and pipe.transformer_2 is None:
            raise ValueError(f"model.guidance_2={guidance_2} (--guidance-2) is the guidance of Wan 2.2's low-noise expert (transformer_2), "
                             "and this model has one transformer; leave it unset")
        if self.pipeline_class_name == "WanPipeline" and pipe.transformer.config.in_channels != pipe.transformer.config.out_channels:
            raise ValueError(f"model.path holds an image-to-video Wan (its transformer reads {pipe.transformer.config.in_channels} channels "
                             f"and makes {pipe.transformer.config.out_channels}); use model.family=wan-i2v")
        self.frames, self.expert, self.guidance_2 = frames, expert, guidance_2
        self.denoiser_name = "transformer_2" if expert == "low" else "transformer"  # the trained expert (both: the first), its export's folder
        super().__init__(pipe, device, size, offload)
        self.second = {"high": pipe.transformer_2, "low": pipe.transformer, "both": None}[expert]  # the frozen expert, or None (Wan 2.1; both trained)
        if self.second is not None:
            self.second.requires_grad_(False).eval().to(self.device)
        if expert == "both":
            self.denoiser = WanExperts(pipe.transformer, pipe.transformer_2.to(self.device))
            self.quant_skip_modules = tuple(f"{name}.{pattern}" for name in WanExperts.denoisers for pattern in WanAdapter.quant_skip_modules)
        ratio = pipe.config.boundary_ratio
        self.boundary = None if ratio is None else ratio * pipe.scheduler.config.num_train_timesteps  # timesteps below it: transformer_2

    @classmethod
    def multiple_of(cls, vae_scale_factor: int, patch_size: int) -> int:
        return math.lcm(PIPELINE_SIDE_MULTIPLE, vae_scale_factor * patch_size)

    @property
    def resolution_multiple(self) -> int:
        return self.multiple_of(self.pipe.vae_scale_factor_spatial, self.pipe.transformer.config.patch_size[1])

    def check_frame_count(self, frames: int) -> None:
        check_frames(frames, self.pipe.vae_scale_factor_temporal)

    @classmethod
    def folder_frames(cls, path, frames: int) -> None:
        """Refuse a frame count the folder's VAE cannot make, from its config.json, before anything loads."""
        try:
            temporal = json.loads((Path(path or "") / "vae" / "config.json").read_text()).get("scale_factor_temporal") or 4
        except (OSError, ValueError):
            return  # a hub id: checked once it has loaded
        check_frames(frames, temporal)

    @classmethod
    def multiple_from_configs(cls, vae: dict, denoiser: dict) -> int:
        return cls.multiple_of(vae.get("scale_factor_spatial") or 8, (denoiser.get("patch_size") or (1, 2, 2))[1])

    @property
    def vae_scale_factor(self) -> int:
        return self.pipe.vae_scale_factor_spatial

    @property
    def latent_frames(self) -> int:
        return (self.frames - 1) // self.pipe.vae_scale_factor_temporal + 1

    @property
    def latent_shape(self) -> tuple[int, ...]:
        return (self.config.out_channels, self.latent_frames, *self.latent_grid())  # the VAE's channels (an image-to-video model's input has more)

    def encode(self, prompts: list[str], negatives: list[str] | None = None) -> dict[str, torch.Tensor]:
        embeds, negative = self.pipe.encode_prompt(prompt=prompts, negative_prompt=negatives, do_classifier_free_guidance=True,
                                                   max_sequence_length=self.max_sequence_length, device=self.device)
        return {"encoder_hidden_states": embeds, "negative_encoder_hidden_states": negative}

    def guidance_scale(self, times: torch.Tensor, guidance: float) -> float | torch.Tensor:
        """`guidance`, or with `guidance_2` set, per row: `guidance_2` on the rows the low-noise expert takes
        (the pipeline's guidance_scale_2), shaped to broadcast over a row's latent."""
        if self.guidance_2 is None or self.boundary is None:
            return guidance
        scale = torch.where(times >= self.boundary, guidance, self.guidance_2).to(self.dtype)  # (B,)
        return scale.view(-1, *[1] * len(self.latent_shape))

    def high_noise(self, times: torch.Tensor) -> torch.Tensor:
        """(B,) True for rows `transformer` predicts: at timesteps ≥ the boundary (all, without a second expert)."""
        return torch.ones_like(times, dtype=torch.bool) if self.boundary is None else times >= self.boundary

    def trains_at(self, times: torch.Tensor) -> torch.Tensor:
        high = self.high_noise(times)
        return {"high": high, "low": ~high, "both": torch.ones_like(high)}[self.expert]

    def forward(self, latents: torch.Tensor, times: torch.Tensor, embeds: dict[str, torch.Tensor], guidance: float) -> torch.Tensor:
        """Rows at timesteps ≥ the boundary through `transformer`, the others through `transformer_2`
        (under FSDP a sharded expert without rows runs one: module doc)."""
        high, inputs, sharded = self.high_noise(times), self.model_inputs(latents, times, embeds), self.lockstep is not None
        channels = self.latent_shape[0]
        if self.expert == "both":
            return self.denoiser(high, inputs, channels, self.dtype, sharded)
        trained = "transformer" if self.expert == "high" else "transformer_2"
        experts = {trained: self.denoiser, ("transformer_2" if self.expert == "high" else "transformer"): self.second}
        return route(high, inputs, channels, self.dtype, experts, (trained,) if sharded else ())

    def model_inputs(self, latents: torch.Tensor, times: torch.Tensor, embeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The transformer's keyword arguments for latents (B, C, F', h, w) at times (B,): the text's states (the
        image-to-video family adds the source's)."""
        return {"hidden_states": latents, "timestep": times, "encoder_hidden_states": embeds["encoder_hidden_states"]}

    @staticmethod
    def _lora_parts(directory: Path) -> list[tuple[str, Path]]:
        """With model.expert=both: (expert, folder) of each expert's LoRA in an export `directory` (module doc)."""
        return [("transformer", directory), ("transformer_2", directory / LOW_NOISE_LORA)]

    def save_lora(self, directory: Path, state: dict[str, torch.Tensor] | None = None) -> Path:
        if self.expert != "both":
            return super().save_lora(directory, state)
        for name, folder in self._lora_parts(directory):
            start = name + "."
            part = None if state is None else {k[len(start) :]: v for k, v in state.items() if k.startswith(start)}
            lora.save_lora(getattr(self.denoiser, name), folder, self.pipeline_class_name, self.lora_prefix, part)
        return directory / lora.LORA_FILE

    def load_lora(self, path: str | Path) -> None:
        folder = Path(path) if Path(path).is_dir() else Path(path).parent  # a LoRA file: its folder
        if self.expert != "both":
            if (folder / LOW_NOISE_LORA / lora.LORA_FILE).is_file():
                raise ValueError(f"{path} holds LoRAs of both Wan 2.2 experts (model.expert=both); load the run folder, whose config "
                                 "says so, or use model.expert=both")
            return super().load_lora(path)
        for name, part in self._lora_parts(folder):
            lora.load_lora(getattr(self.denoiser, name), part, self.pipeline_class_name, self.lora_prefix)

    def load_lora_state(self, directory: Path) -> None:
        if self.expert != "both":
            return super().load_lora_state(directory)
        for name, folder in self._lora_parts(directory):
            lora.load_lora_state(getattr(self.denoiser, name), folder, self.lora_prefix)

    def vae_input(self, latents: torch.Tensor) -> torch.Tensor:
        config = self.pipe.vae.config
        shape = (1, config.z_dim, 1, 1, 1)
        mean = torch.tensor(config.latents_mean, device=latents.device, dtype=latents.dtype).view(shape)
        std = torch.tensor(config.latents_std, device=latents.device, dtype=latents.dtype).view(shape)
        return latents * std + mean

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Videos (B, F, 3, H, W) in [0, 1], `decode_batch` at a time, post-processed by the
        pipeline's video processor as `pipe(..., output_type="pt")` does."""
        vae = self.pipe.vae
        videos = []
        with self.modules_on_device(vae):
            for chunk in latents.split(self.decode_batch):
                decoded = vae.decode(self.vae_input(chunk.to(self.device)).to(vae.dtype), return_dict=False)[0]  # (b, 3, F, H, W)
                videos.append(self.pipe.video_processor.postprocess_video(decoded, output_type="pt").float())  # (b, F, 3, H, W)
        return torch.cat(videos)


def check_frames(frames: int, temporal: int) -> None:
    """A Wan video has r·k + 1 frames, r the VAE's temporal factor."""
    if frames < 1 or (frames - 1) % temporal:
        raise ValueError(f"model.frames={frames}: a Wan video has r·k + 1 frames (r = {temporal}, the VAE's temporal factor), "
                         f"e.g. {temporal * max(1, (frames - 1) // temporal) + 1}")
