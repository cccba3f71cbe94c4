"""The model-adapter contract: the only family-specific code in branchdiff (docs/models.md).

An adapter owns the denoiser (`denoiser`, the module LoRA is attached to) and answers everything
the rollout, the trainer, explore and evaluation need to know about its family:

- `schedule(T, shift)`: the family's discretisation (`FlowSchedule` for velocity models, with the
  family's own σ schedule; `DDIMSchedule` for ε-models): what the denoiser is conditioned on at
  each step and the SDE/ODE transition with its log-prob;
- `latent_shape`: per-sample latent shape at the adapter's image size `height` × `width` (packed for FLUX);
- `encode_prompts`: conditioning rows, one per prompt, every tensor batched on dim 0; families
  with classifier-free guidance add the unconditional rows under `negative_<key>`; an editing
  family's (`edits`) include its encoded source images;
- `forward`: the raw network output for a batch of latents (one row each); `predict` applies
  guidance around it: CFG (`uses_cfg`: one forward of [unconditional; conditional] rows,
  u + g·(c − u), so it costs `rows_per_sample(g)` = 2 rows per latent, counted in NFE and
  `max_batch`), or an embedded guidance value the family's `forward` consumes (FLUX);
- `decode`: latents → images (B, 3, H, W) in [0, 1], in chunks;
- LoRA: `lora_target_sets` (the family's named sets of modules LoRA wraps: `attention`,
  `attention+ff`, `all-linear`; `lora_targets` resolves a config's choice), `lora_prefix` (the
  state-dict prefix of the export, "transformer" or "unet") and `pipeline_class` (the diffusers
  pipeline whose `load_lora_weights` reads it);
- full fine-tuning: `denoiser_name` (the pipeline component, and the folder of the export that
  `<DenoiserClass>.from_pretrained` loads) and `replace_denoiser` (a fine-tuned denoiser in place of
  the loaded one);
- `quant_skip_modules`: modules a quantised explorer keeps in high precision.
Nothing outside `branchdiff.models` knows which family it runs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import torch

from branchdiff.data.prompts import NEGATIVE_PROMPT
from branchdiff.data.sources import FIT, check_aspect, fit_source, source_images
from branchdiff.errors import quote
from branchdiff.models import lora
from branchdiff.schedulers.schedule import Schedule

PromptEmbeds = dict[str, torch.Tensor]  # every tensor has the prompt batch as its first dimension
NEGATIVE = "negative_"  # key prefix of the unconditional rows of a CFG family's embeddings


def select_embeds(embeds: PromptEmbeds, index: torch.Tensor) -> PromptEmbeds:
    """Rows `index` (N,) of every tensor of a batch of prompt embeddings."""
    return {key: value.index_select(0, index.to(value.device)) for key, value in embeds.items()}


def cat_embeds(parts: list[PromptEmbeds]) -> PromptEmbeds:
    """Row-wise concatenation of batches of prompt embeddings with the same keys."""
    return {key: torch.cat([part[key] for part in parts]) for key in parts[0]}


class ModelAdapter(ABC):
    family: str  # registry name (`branchdiff.models.FAMILIES`)
    denoiser: torch.nn.Module  # the network that LoRA adapts
    device: torch.device
    height: int  # image height in pixels
    width: int  # image width in pixels
    lora_target_sets: dict[str, list[str] | str]  # families.LORA_TARGET_SETS names → module-name suffixes (or peft's "all-linear")
    denoiser_name: str = "transformer"  # the pipeline component that is the denoiser ("unet" for UNet families)
    lora_prefix: str = "transformer"  # state-dict prefix of the exported LoRA ("unet" for UNet families)
    pipeline_class_name: str  # the diffusers pipeline class whose `load_lora_weights` reads the export
    quant_skip_modules: tuple[str, ...] = ()  # module-name patterns a quantised explorer keeps in high precision
    uses_cfg: bool = False  # guidance as classifier-free guidance rows (else embedded, or none)
    edits: bool = False  # an instruction-editing family: each prompt comes with its source image(s) (docs/editing.md)
    max_sources: int = 0  # an editing family's most source images per prompt (0: any number)
    source_use: str = "edits images"  # what an editing family does with its sources, as messages say it
    made: str = "edits"  # what an editing family makes of its sources, as messages say it
    source_docs: str = "docs/editing.md"  # the page that documents its sources
    negative_prompt: str = ""  # a CFG family's unconditional prompt where a prompt set's row names none (its pipeline's default)
    default_guidance: float = 1.0  # the family's guidance when the config leaves it unset (1: none)
    decode_batch: int = 8  # images per VAE decode call
    eval_batch: int = 32  # network rows per evaluation forward: fixed per family, so a sample is the same whatever else shares its batch
    max_sequence_length: int = 77  # the most prompt tokens the family's text encoders read (CLIP's 77; the pipelines' T5 / Gemma lengths)
    instruction: bool = True  # prepend the family's prompt instruction where it has one (SANA's complex_human_instruction)
    lockstep: Callable[[int], int] | None = None  # a sharded denoiser (FSDP): agrees a number of forwards with the other processes (sharding.Lockstep)
    card_license: str = "other"  # the released weights' license as the Hub names it; a model card of a fine-tune carries it

    @property
    @abstractmethod
    def latent_shape(self) -> tuple[int, ...]:
        """Per-sample latent shape at `height` × `width`, e.g. (16, 64, 64), or (1024, 64) packed."""

    @abstractmethod
    def schedule(self, num_steps: int, shift: float | None = None) -> Schedule:
        """The family's T-step schedule; `shift` (s > 0) replaces the family's own σ schedule by the
        anchors' σ = s·t / (1 + (s-1)·t) (flow families), None keeps the family's."""

    @abstractmethod
    def encode_prompts(self, prompts: list[str], sources: list[list] | None = None, negatives: list[str | None] | None = None) -> PromptEmbeds:
        """Conditioning for each prompt, without gradients (encoders stay frozen); an editing family's
        (`edits`) includes its source images, `sources` holding each prompt's as RGB PIL images. `negatives`:
        each prompt's own negative prompt (None or blank: the family's `negative_prompt`), for a CFG family's
        unconditional rows (`row_negatives`)."""

    def row_negatives(self, negatives: list[str | None] | None, count: int) -> list[str] | None:
        """Each of `count` prompts' negative prompt, the family's where a row has none; None when no row has one."""
        given = negatives is not None and any(text is not None and text.strip() for text in negatives)
        if not given:
            return None
        assert negatives is not None and len(negatives) == count
        if not self.uses_cfg:
            raise ValueError(self.no_negatives())
        return [text if text is not None and text.strip() else self.negative_prompt for text in negatives]

    @classmethod
    def no_negatives(cls) -> str:
        """The message refusing negative prompts on a family without classifier-free guidance."""
        return (f"model.family={cls.family} has no classifier-free guidance, so it has no negative prompt: drop the \"negative_prompt\" "
                "field or column, or use a family that guides with CFG (docs/prompts.md)")

    @classmethod
    def target_sets_for(cls, config: Any) -> dict[str, list[str] | str]:
        """The LoRA target sets of a denoiser of `config` (its diffusers config, or a dict of it: `branchdiff plan` asks before
        anything loads); most families' do not depend on it."""
        return cls.lora_target_sets

    @classmethod
    def check_path(cls, path: str | Path | None, option: str = "model.path") -> None:
        """Refuse, before anything loads, a `path` (given as `option`) the family cannot load from; a family with
        built-in weights takes any (None: its own)."""
        return None

    def check_sources(self, prompts: list[str], sources: list[list] | None) -> None:
        """`check_source_sizes` on each prompt's source images (RGB PIL images, fitted by `encode_for`) at this adapter's size."""
        sizes = None if sources is None else [[image.size for image in images] for images in sources]
        self.check_source_sizes(sizes, len(prompts), (self.height, self.width))

    def fit_source(self, image: Any, fit: str) -> Any:
        """A source image (RGB PIL) of another aspect ratio than this adapter's size, fitted by `fit` (branchdiff/data/sources.py:
        resize stretches it to the size); a family whose encoding resizes it as its pipeline does takes it as it is."""
        return fit_source(image, self.height, self.width, fit)

    @classmethod
    def check_source_sizes(cls, sizes: list[list[tuple[int, int]]] | None, prompts: int, size: tuple[int, int],
                           where: Callable[[int], str] = lambda number: f"prompt {number}", names: list[list[str]] | None = None,
                           fits: list[str] | None = None) -> None:
        """The one rule for source images (docs/editing.md, docs/video.md), checked before anything loads (from the files'
        headers) and again on the images a family encodes. `sizes`: each prompt's sources as (width, height), None when no
        prompt names any; `size`: the made images' (height, width); `where(number)` names prompt `number` (1-based). An
        editing or image-to-video family needs every prompt's sources, as many with every prompt as with the first and at
        most `max_sources`, each of the made images' aspect ratio where its row's `fits` (default resize) is refuse (the
        others are fitted to it); a text-to-image family takes none. `names`: the sources' paths, for the messages."""
        if not cls.edits:
            if sizes is not None:
                first = next(number for number, row in enumerate(sizes, start=1) if row)
                raise ValueError(f"{where(first)} comes with a source image (\"image\", --image) and model.family={cls.family} makes images "
                                 "from text alone: use an editing family (flux-kontext, qwen-image-edit) or image-to-video (wan-i2v), or drop the image "
                                 "(docs/editing.md, docs/video.md)")
            return
        if sizes is None or len(sizes) != prompts or not all(sizes):
            missing = 1 if sizes is None or len(sizes) != prompts else next(n for n, row in enumerate(sizes, start=1) if not row)
            raise ValueError(f"{where(missing)} has no source image and model.family={cls.family} {cls.source_use}: give every prompt its "
                             f"source (sample --image, or an \"image\" field or column of a JSONL or CSV prompt set; {cls.source_docs})")
        for number, row in enumerate(sizes, start=1):
            if cls.max_sources and len(row) > cls.max_sources:
                raise ValueError(f"{where(number)} has {len(row)} source images and model.family={cls.family} takes at most "
                                 f"{cls.max_sources} per prompt; give it {'one' if cls.max_sources == 1 else cls.max_sources} ({cls.source_docs})")
            if len(row) != len(sizes[0]):
                raise ValueError(f"{where(number)} has {len(row)} source images and prompt 1 has {len(sizes[0])}: model.family={cls.family} "
                                 f"takes the same number with every prompt; split the set by number of sources ({cls.source_docs})")
            if (fits or [])[number - 1:number] != ["refuse"]:
                continue
            for index, source in enumerate(row):
                what = f"source image {quote(names[number - 1][index], 80)}" if names else "a source image"
                check_aspect(source, *size, f"{where(number)}: {what}", cls.made, cls.source_docs)

    @abstractmethod
    def forward(self, latents: torch.Tensor, times: torch.Tensor, embeds: PromptEmbeds, guidance: float) -> torch.Tensor:
        """The network's output (velocity or ε) for latents (B, *latent_shape) conditioned on times
        (B,) (`Schedule.model_times` values) and conditional embeddings with B rows."""

    @abstractmethod
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Images (B, 3, H, W) in [0, 1]."""

    @classmethod
    def license_of(cls, path: str) -> str:
        """The license of the release at `path` (a hub id or folder) as the Hub names it: the family's, unless its
        releases differ."""
        return cls.card_license

    @classmethod
    def cfg_rows(cls, guidance: float, path: str | None = None) -> int:
        """Network rows one prediction costs at `guidance`, by the family's rule: 2 under CFG (unconditional
        and conditional), else 1 (also what `branchdiff plan` counts, without a loaded model). `path`: the
        release (a hub id or folder), for a family whose releases differ."""
        return 2 if cls.uses_cfg and guidance > 1 else 1

    def rows_per_sample(self, guidance: float) -> int:
        """Network rows one prediction costs for this model (a distilled checkpoint may drop CFG)."""
        return self.cfg_rows(guidance)

    def predict(self, latents: torch.Tensor, times: torch.Tensor, embeds: PromptEmbeds, guidance: float | None = None) -> torch.Tensor:
        """The guided model output for latents (B, ...) at times (B,), embeds with B rows: under CFG
        u + g·(c − u) from one forward of the 2B rows [unconditional; conditional] (the diffusers
        pipelines' order and formula)."""
        guidance = self.default_guidance if guidance is None else guidance
        conditional = {key: value for key, value in embeds.items() if not key.startswith(NEGATIVE)}
        if self.rows_per_sample(guidance) == 1:
            return self.forward(latents, times, conditional, guidance)
        unconditional = {key[len(NEGATIVE) :]: value for key, value in embeds.items() if key.startswith(NEGATIVE)}
        if not unconditional:
            raise ValueError(f"guidance {guidance} needs unconditional embeddings; encode_prompts of {self.family} returned none")
        both = cat_embeds([unconditional, conditional])
        output = self.forward(torch.cat([latents, latents]), torch.cat([times, times]), both, guidance)
        uncond, cond = output.chunk(2)
        return self.guide(uncond, cond, times, guidance)

    def guide(self, uncond: torch.Tensor, cond: torch.Tensor, times: torch.Tensor, guidance: float) -> torch.Tensor:
        """The CFG prediction from the unconditional and conditional outputs (B, ...): u + g·(c − u)
        with g = `guidance_scale` (Qwen-Image rescales it to the conditional output's norm)."""
        return uncond + self.guidance_scale(times, guidance) * (cond - uncond)

    def pipeline_call_arguments(self, guidance: float) -> dict:
        """The arguments that make the family's pipeline `__call__` guide as `predict` does at `guidance`
        (tests and `branchdiff.testing` compare the two)."""
        return {"guidance_scale": guidance}

    def unused_modules(self) -> list[str]:
        """Names of the denoiser's modules whose output never reaches its prediction (Qwen-Image's last
        block's text-stream output): no gradient reaches them, so LoRA leaves them out and full fine-tuning
        freezes them (DDP would otherwise wait for their gradients). None for most families."""
        return self.unused_modules_of(self.denoiser)

    @classmethod
    def unused_modules_of(cls, denoiser: torch.nn.Module) -> list[str]:
        """`unused_modules` of a denoiser of this family: the hook a family overrides (`branchdiff plan` asks it of a
        model built on meta, the trainer through `unused_modules`)."""
        return []

    def trains_at(self, times: torch.Tensor) -> torch.Tensor:
        """(B,) True where the trained denoiser makes the prediction at model times `times` (B,): every
        row, except on a family with a frozen second network taking some timesteps (Wan 2.2 A14B training one
        expert), whose edges there cannot learn and are left out of the update."""
        return torch.ones_like(times, dtype=torch.bool)

    def guidance_scale(self, times: torch.Tensor, guidance: float) -> float | torch.Tensor:
        """The CFG scale of rows at `times` (B,): `guidance` (a family whose experts guide differently
        returns one scale per row)."""
        return guidance

    def solver_notice(self) -> str | None:
        """A line for a run whose model ships a sampler other than the one branchdiff steps with (None: the same)."""
        return None

    def release_denoise(self, latents: torch.Tensor, embeds: PromptEmbeds, num_steps: int, guidance: float | None = None) -> torch.Tensor:
        """Clean latents from initial noise (B, ...) with the sampler the model ships (embeds: one row per latent)."""
        raise ValueError(f"the {self.family} model ships no sampler of its own (--solver release needs a diffusers pipeline folder); "
                         "leave --solver at its default")

    def lora_targets(self, targets: str | list[str]) -> list[str] | str:
        """The modules LoRA wraps: a named set of this family (`families.LORA_TARGET_SETS`) or, given a list,
        those module-name patterns themselves (peft matches a pattern against the end of a name)."""
        if isinstance(targets, list):
            return list(targets)
        return self.lora_target_sets[targets]

    def replace_denoiser(self, denoiser: torch.nn.Module) -> None:
        """Use `denoiser` (a fine-tuned copy of the family's denoiser class) from now on."""
        self.denoiser = denoiser.to(self.device)

    def load_denoiser(self, folder: str | Path) -> None:
        """Load a fully fine-tuned denoiser exported by a run (`<DenoiserClass>.from_pretrained`), in
        this adapter's dtype, in place of the loaded one."""
        self.replace_denoiser(cast(Any, type(self.denoiser)).from_pretrained(str(folder), torch_dtype=self.denoiser.dtype))  # diffusers' ModelMixin

    def save_lora(self, directory: Path, state: dict[str, torch.Tensor] | None = None) -> Path:
        """Export the denoiser's LoRA (`state`: its tensors gathered from a sharded denoiser) for
        `<pipeline>.load_lora_weights`."""
        return lora.save_lora(self.denoiser, directory, self.pipeline_class_name, self.lora_prefix, state)

    def load_lora(self, path: str | Path) -> None:
        """Load an exported LoRA into the denoiser, the way the family's pipeline loads it."""
        lora.load_lora(self.denoiser, path, self.pipeline_class_name, self.lora_prefix)

    def load_lora_state(self, directory: Path) -> None:
        """Restore the values of an attached LoRA from an export (checkpoint resume)."""
        lora.load_lora_state(self.denoiser, directory, self.lora_prefix)

    @contextmanager
    def sized(self, size: tuple[int, int] | None = None, frames: int | None = None) -> Iterator[None]:
        """Within the block the adapter makes (height, width) `size` and, a video family, `frames` frames (None: as
        it is): an evaluation at its own size (`eval.resolution`, `eval.frames`), whatever size the weights trained at.
        Refuses what the model cannot make (`check_size`, `check_frame_count`) before changing anything."""
        before = (self.height, self.width, getattr(self, "frames", None))
        size = size or (self.height, self.width)
        if size != (self.height, self.width):
            self.check_size(size)
        if frames is not None and frames != before[2]:
            self.check_frame_count(frames)
        self.height, self.width = size
        if frames is not None:
            self.frames = frames
        try:
            yield
        finally:
            self.height, self.width = before[:2]
            if before[2] is not None:
                self.frames = before[2]

    def check_size(self, size: tuple[int, int]) -> None:
        """Refuse a (height, width) this model cannot make; a family with one size makes no other."""
        raise ValueError(f"resolution {size[0]}x{size[1]}: model.family={self.family} makes only {self.height}×{self.width} images")

    def check_frame_count(self, frames: int) -> None:
        """Refuse a frame count this model cannot make; an image family or a fixed-length video family makes no other."""
        raise ValueError(f"{frames} frames: model.family={self.family} makes {getattr(self, 'frames', 'no')} frame(s) a sample only")

    @contextmanager
    def modules_on_device(self, *modules: torch.nn.Module | None) -> Iterator[None]:
        """With `offload`, move helper modules (text encoders, VAE) to the accelerator for the block
        and back to the CPU after it; without, they stay on the accelerator."""
        present = [m for m in modules if m is not None]
        if not getattr(self, "offload", False):
            yield
            return
        for module in present:
            module.to(self.device)
        try:
            yield
        finally:
            for module in present:
                module.to("cpu")


def encode_for(adapter: ModelAdapter, prompts: list[str], metadata: list[dict]) -> PromptEmbeds:
    """`adapter.encode_prompts` with the prompts' source images where their metadata names any (an editing prompt set),
    and their negative prompts where any row names one."""
    sources = source_images(metadata)
    if sources is not None:  # each row's sources.fit: refused (fit refuse) or fitted to the adapter's size
        fits = [row.get(FIT, "resize") for row in metadata]
        adapter.check_source_sizes([[image.size for image in row] for row in sources], len(prompts), (adapter.height, adapter.width), fits=fits)
        sources = [[adapter.fit_source(image, fit) for image in row] for row, fit in zip(sources, fits)]
    negatives = [row.get(NEGATIVE_PROMPT) for row in metadata] if any(row.get(NEGATIVE_PROMPT) for row in metadata) else None
    if negatives is None:  # the families' own encode_prompts, plugins' included, need not know negatives
        return adapter.encode_prompts(prompts) if sources is None else adapter.encode_prompts(prompts, sources)
    return adapter.encode_prompts(prompts, sources, negatives)
