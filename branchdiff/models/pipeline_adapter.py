"""What the diffusers-backed adapters share: loading a pipeline, placing (and offloading) its
modules, chunked decoding, the latent grid from the image size, and the flow schedule taken from
the pipeline's own scheduler. A family file adds only what differs: prompt encoding, the network
call, and how latents become VAE input.

The adapter keeps the loaded diffusers pipeline (`pipe`) and uses its own `encode_prompt`, image
post-processing and scheduler, so conventions (tokenisation, timestep scaling, VAE scaling and
shift) are diffusers', not copies of them; `tests/test_model_families.py` checks that sampling
through the adapter reproduces `pipe(...)` itself.
"""

from __future__ import annotations

import copy
import inspect
import json
import math
from pathlib import Path
from typing import Any, cast

import torch

from branchdiff.errors import UserError, one_line, quote
from branchdiff.models.base import ModelAdapter
from branchdiff.models.loading import quiet_loading
from branchdiff.schedulers.schedule import FlowSchedule, Schedule


class PipelineAdapter(ModelAdapter):
    helper_names: tuple[str, ...] = ("text_encoder", "text_encoder_2", "text_encoder_3", "vae")  # offloadable components
    example_hub_id = ""  # shown in the error when model.path is missing
    config: Any  # the denoiser's diffusers config, read by attribute (in_channels, guidance_embeds, ...)
    dtype: torch.dtype  # the denoiser's weights' dtype

    def __init__(self, pipe, device: torch.device | str = "cpu", size: tuple[int, int] = (1024, 1024), offload: bool = False) -> None:
        self.pipe = pipe
        check_multiple(size, self.resolution_multiple, self.family)
        self.device = torch.device(device)
        self.height, self.width = size
        self.offload = offload
        pipe.set_progress_bar_config(disable=True)
        self.denoiser = getattr(pipe, self.denoiser_name).to(self.device)
        self.config = self.denoiser.config  # kept: `denoiser` may later be a DDP wrapper without it
        self.dtype = cast(torch.dtype, self.denoiser.dtype)  # diffusers' ModelMixin.dtype
        for module in self.helpers():
            module.requires_grad_(False).eval().to("cpu" if offload else self.device)

    @classmethod
    def check_path(cls, path: str | Path | None, option: str = "model.path") -> None:
        """A pipeline family has no built-in weights: `path` (given as `option`) must name a folder or hub id."""
        if not path:
            raise ValueError(f"{option} is required for model.family={cls.family}: a local diffusers pipeline folder or a hub id "
                             f"such as {cls.example_hub_id}")

    @classmethod
    def from_pretrained(cls, path: str | Path | None, device: torch.device | str = "cpu", size: tuple[int, int] = (1024, 1024),
                        dtype: torch.dtype = torch.float32, offload: bool = False, **options: object) -> PipelineAdapter:
        """Load the family's diffusers pipeline from a local folder or a hub id, weights in `dtype`, for
        images of `size` (height, width); `options` go to the family's constructor (Wan: `frames`)."""
        cls.check_path(path)
        assert path is not None  # check_path refuses none
        from branchdiff.models.lora import pipeline_class
        from branchdiff.runtime.hub import transport_errors

        pipeline = pipeline_class(cls.pipeline_class_name)  # imported first: diffusers sets its log level on import
        with quiet_loading():
            try:
                pipe = pipeline.from_pretrained(str(path), dtype=dtype)
            except (OSError, ValueError) + transport_errors() as error:  # a hub that timed out reaches here as the HTTP client's error
                raise UserError(f"model.path={quote(str(path), 80)} could not be loaded as a {cls.pipeline_class_name} ({_load_failure(path, error)}); "
                                f"pass model.path= a local diffusers folder (model_index.json beside {cls.denoiser_name}/, vae/, "
                                "text_encoder*/, tokenizer*/ and scheduler/), or a hub id on a machine that reaches the hub "
                                "(gated models: hf auth login first)") from None
        return cls(pipe, device, size, offload, **options)

    def check_size(self, size: tuple[int, int]) -> None:
        check_multiple(size, self.resolution_multiple, self.family)

    def replace_denoiser(self, denoiser: torch.nn.Module) -> None:
        """The fine-tuned denoiser becomes the pipeline's component too."""
        super().replace_denoiser(denoiser)
        setattr(self.pipe, self.denoiser_name, self.denoiser)
        self.config = self.denoiser.config

    def helpers(self) -> list[torch.nn.Module]:
        """The pipeline's text encoders and VAE (frozen; offloaded with `offload`)."""
        return [m for m in (getattr(self.pipe, name, None) for name in self.helper_names) if m is not None]

    @property
    def text_encoders(self) -> list[torch.nn.Module]:
        return [m for m in self.helpers() if m is not self.pipe.vae]

    @property
    def resolution_multiple(self) -> int:
        """Image height and width must be multiples of this (`multiple_of` the loaded pipeline's VAE factor and patch)."""
        return self.multiple_of(self.pipe.vae_scale_factor, getattr(getattr(self.pipe, self.denoiser_name).config, "patch_size", None) or 1)

    @classmethod
    def multiple_of(cls, vae_scale_factor: int, patch_size: int) -> int:
        """The image sides' multiple from the VAE's scale factor and the denoiser's patch size."""
        return vae_scale_factor * patch_size

    @classmethod
    def folder_multiple(cls, path: str | Path | None) -> int | None:
        """`resolution_multiple` read from a local pipeline folder's config files, before anything loads
        (the VAE factor as the pipelines compute it, 2^(levels − 1)); None for a hub id or an unreadable folder."""
        configs = []
        for component in ("vae", cls.denoiser_name):
            try:
                configs.append(json.loads((Path(path or "") / component / "config.json").read_text()))
            except (OSError, ValueError):
                return None
        return cls.multiple_from_configs(*configs)

    @classmethod
    def multiple_from_configs(cls, vae: dict, denoiser: dict) -> int:
        """`resolution_multiple` from the VAE's and the denoiser's config.json."""
        return cls.multiple_of(2 ** (len(vae.get("block_out_channels", [])) - 1), denoiser.get("patch_size") or 1)

    @property
    def vae_scale_factor(self) -> int:
        return self.pipe.vae_scale_factor

    def latent_grid(self) -> tuple[int, int]:
        """Latent (height, width) at the image size."""
        return self.height // self.vae_scale_factor, self.width // self.vae_scale_factor

    def encode_prompts(self, prompts: list[str], sources: list[list] | None = None, negatives: list[str | None] | None = None) -> dict[str, torch.Tensor]:
        self.check_sources(prompts, sources)
        rows = self.row_negatives(negatives, len(prompts))
        given = {} if rows is None else {"negatives": rows}  # a family's encode takes negatives only when a row has one
        encoders = [*self.text_encoders, self.pipe.vae] if self.edits else self.text_encoders  # an editing family encodes its sources too
        with torch.no_grad(), self.modules_on_device(*encoders):
            embeds = self.encode_edits(prompts, cast(list[list], sources), **given) if self.edits else self.encode(prompts, **given)  # sources checked above
        return {key: value.to(self.device) for key, value in embeds.items()}

    def encode(self, prompts: list[str], negatives: list[str] | None = None) -> dict[str, torch.Tensor]:
        """Family part of `encode_prompts` (text encoders are on the device); a CFG family's unconditional rows encode
        `negatives`, one a prompt (None: the family's `negative_prompt`)."""
        raise NotImplementedError

    def encode_edits(self, prompts: list[str], sources: list[list], negatives: list[str] | None = None) -> dict[str, torch.Tensor]:
        """An editing family's part of `encode_prompts`: the prompts, their source images (encoders and VAE on the device)
        and, under CFG, their negative prompts (as `encode`)."""
        raise NotImplementedError

    def vae_input(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents as the VAE decodes them (scaling, shift, unpacking)."""
        return latents / self.pipe.vae.config.scaling_factor

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Images (B, 3, H, W) in [0, 1], `decode_batch` at a time, post-processed by the pipeline's
        image processor as `pipe(..., output_type="pt")` does."""
        vae = self.pipe.vae
        images = []
        with self.modules_on_device(vae):
            for chunk in latents.split(self.decode_batch):
                decoded = self.vae_output(vae.decode(self.vae_input(chunk.to(self.device)).to(vae.dtype), return_dict=False)[0])
                images.append(self.pipe.image_processor.postprocess(decoded, output_type="pt").float())
        return torch.cat(images)

    def vae_output(self, decoded: torch.Tensor) -> torch.Tensor:
        """The VAE's output as images (B, 3, H, W) (a video VAE's single frame taken out)."""
        return decoded

    # ---------------------------------------------------------------- flow schedules
    @property
    def time_scale(self) -> float:
        """The denoiser's timestep per unit σ under the anchors' shifted schedule (a family may read it from its config)."""
        return 1000.0

    def schedule(self, num_steps: int, shift: float | None = None) -> Schedule:
        """The pipeline's own scheduler set for `num_steps` (its shift, or its dynamic shift at this
        resolution) with the pipeline's arguments; or, with `shift`, the anchors' σ schedule."""
        if shift is not None:
            return FlowSchedule.shifted(num_steps, shift, self.time_scale)
        scheduler = copy.deepcopy(self.pipe.scheduler)
        scheduler.set_timesteps(device="cpu", **self.scheduler_arguments(num_steps))
        sigmas = scheduler.sigmas.float()  # (T+1,) ending at 0
        return FlowSchedule(sigmas, self.model_times(scheduler.timesteps.float()))

    # ---------------------------------------------------------------- the release's own sampler
    stepped_scheduler = "FlowMatchEulerDiscreteScheduler"  # the diffusers scheduler whose steps (and their SDEs) branchdiff samples and trains with

    def solver_notice(self) -> str | None:
        shipped = type(self.pipe.scheduler).__name__
        if shipped == self.stepped_scheduler:
            return None
        return (f"model.path ships the sampler {shipped}; branchdiff samples and trains with {self.stepped_scheduler} steps "
                f"and their SDEs on its schedule, so rollouts differ from the pipeline's own images; branchdiff sample/eval "
                f"--solver release sample with {shipped}")

    @torch.no_grad()
    def release_denoise(self, latents: torch.Tensor, embeds: dict[str, torch.Tensor], num_steps: int,
                        guidance: float | None = None) -> torch.Tensor:
        """The pipeline's own denoising loop with the scheduler the folder ships (DPM-Solver++ for SANA's
        releases, PNDM for SD 1.5's): its timesteps set as the pipeline sets them, initial noise times
        its `init_noise_sigma` where it has one, `scale_model_input` where the scheduler has one, the guided prediction
        (`predict`), and its `step` (η = 0 where it takes one). A multistep solver keeps state, so one
        call is one batch of chains from start to end."""
        scheduler = copy.deepcopy(self.pipe.scheduler)
        accepted = inspect.signature(scheduler.set_timesteps).parameters
        scheduler.set_timesteps(device=self.device, **{k: v for k, v in self.scheduler_arguments(num_steps).items() if k in accepted})
        step_arguments = {"eta": 0.0} if "eta" in inspect.signature(scheduler.step).parameters else {}
        latents = latents * getattr(scheduler, "init_noise_sigma", 1.0)  # flow-matching schedulers have none (their pipelines scale nothing)
        for t in scheduler.timesteps:
            model_input = scheduler.scale_model_input(latents, t) if hasattr(scheduler, "scale_model_input") else latents
            output = self.predict(model_input, self.model_times(t.expand(len(latents))), embeds, guidance)
            latents = scheduler.step(output, t, latents, **step_arguments, return_dict=False)[0]
        return latents

    def scheduler_arguments(self, num_steps: int) -> dict:
        """What the pipeline passes to `scheduler.set_timesteps`."""
        return {"num_inference_steps": num_steps}

    def model_times(self, timesteps: torch.Tensor) -> torch.Tensor:
        """The scheduler's timesteps as the pipeline hands them to the denoiser."""
        return timesteps


class PackedLatentsAdapter(PipelineAdapter):
    """A family whose pipeline packs the VAE latent's 2×2 patches into tokens of 4·C features, row by row
    (FLUX.1, Qwen-Image): latents (rows · columns, in_channels) on the latent grid's (H/2f, W/2f) patches."""

    @classmethod
    def multiple_of(cls, vae_scale_factor: int, patch_size: int) -> int:
        return vae_scale_factor * 2  # 2×2 packing

    @property
    def latent_shape(self) -> tuple[int, ...]:
        rows, columns = self.token_grid()
        return (rows * columns, self.config.in_channels)  # in_channels = 4 × the VAE's latent channels

    def token_grid(self) -> tuple[int, int]:
        """The packed latent's (rows, columns) of 2×2 patches: the image ids' grid."""
        height, width = self.latent_grid()
        return height // 2, width // 2


def check_multiple(size: tuple[int, int], multiple: int, family: str) -> None:
    """Refuse an image size whose sides are not multiples of `multiple`, naming the nearest that are, and the nearest of
    its aspect ratio where rounding each side changes it."""
    if size[0] % multiple or size[1] % multiple:
        rounded, kept = [max(1, round(side / multiple)) * multiple for side in size], nearest_size(size, multiple)
        keeping = "" if rounded == kept else f", or {kept} to keep its aspect ratio"
        raise ValueError(f"model.resolution={list(size)} (height, width) is not possible for {family}: each side must be a "
                         f"multiple of {multiple} (e.g. {rounded}{keeping})")


def nearest_size(size: tuple[int, int], multiple: int, tolerance: float = 0.01) -> list[int]:
    """The (height, width) of multiples of `multiple` nearest in area to `size` among those within `tolerance` of its
    aspect ratio (1 %: e.g. 720×1280 at 32 → 736×1312, where rounding each side gives 704×1280, 2.3 % off); where
    none is within four times its area, the one closest in aspect ratio."""
    height, width = size
    aspect, area = width / height, height * width
    candidates = []
    for rows in range(1, max(2, 2 * height // multiple + 2)):
        new_height = rows * multiple
        new_width = max(1, round(new_height * aspect / multiple)) * multiple
        off = abs(new_width / new_height - aspect) / aspect
        growth = abs(math.log(new_height * new_width / area))
        candidates.append((off > tolerance or growth > math.log(4), growth if off <= tolerance else off, [new_height, new_width]))
    return min(candidates)[2]


def _load_failure(path: str | Path, error: Exception) -> str:
    """Why a pipeline did not load, in a few words."""
    from branchdiff.runtime.hub import hub_failure, transport_errors

    if isinstance(error, transport_errors()):
        return f"not in the local hub cache, and {hub_failure(error)}"
    folder = Path(path)
    if folder.is_dir():
        return "no model_index.json in that folder" if not (folder / "model_index.json").is_file() else one_line(error, 160)
    if str(path).startswith((".", "/", "~")) or str(path).count("/") != 1:  # a hub id is "owner/name"
        return "no such folder"
    message = str(error).lower()
    if "cached" in message or "offline" in message or "connect" in message or "resolve" in message:
        return "not in the local hub cache, and the hub could not be reached"
    return one_line(error, 160)
