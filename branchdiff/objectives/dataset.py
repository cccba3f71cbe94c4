"""What the dataset objectives share (SFT, offline Diffusion-DPO): they train on an image set's rows
(branchdiff/data/demonstrations.py) instead of rollouts. At each iteration the trainer draws this
process's rows as it draws prompts (seed, iteration, global slot), encodes their prompts and asks
for the plan of those rows (`DatasetObjective.plan_rows`); there is no rollout, reward or signal.

Noise levels: each row is trained at `timesteps` noise levels drawn at its address (run seed,
iteration, the row's global slot, tag of the objective): t from a logit-normal (sigmoid of
N(mean, std), SD3's training distribution) or a uniform distribution on (0, 1), then σ the family's
own schedule at t (its 1000-step schedule, `ModelAdapter.schedule(1000, sampling.shift)`: shifted as
the family samples, and conditioned as the family's denoiser expects), and fresh noise ε; images a
row holds together (a preference pair) share their (σ, ε).
"""

from __future__ import annotations

from typing import ClassVar, cast

import torch

from branchdiff.core.noise import address_seed
from branchdiff.core.rollout import NoiseAddress, Rollout
from branchdiff.data.demonstrations import ImageSet, load_image_set
from branchdiff.models.base import ModelAdapter
from branchdiff.models.finetune import FullFinetune, LoraFinetune
from branchdiff.models.registry import FAMILIES, image_size
from branchdiff.objectives.base import Objective, Signal, UpdatePlan
from branchdiff.objectives.forward_process import ForwardTerms
from branchdiff.schedulers.schedule import FlowSchedule
from branchdiff.settings.config import TrainConfig

FINE_STEPS = 1000  # the schedule noise levels are read from


class DatasetObjective(Objective):
    """An objective that trains on an image set (`dataset` in its registry line names the kind)."""
    dataset: ClassVar[str]  # "demonstrations" or "preferences"
    config: TrainConfig
    finetune: LoraFinetune | FullFinetune
    rows: ImageSet  # the set, read (and checked) from the objective's `data` key when the objective is built
    fine_schedule: FlowSchedule  # the family's schedule the noise levels are read from (`fine_schedule`)

    def __post_init__(self) -> None:
        """Called by a dataclass subclass's generated __init__."""
        config = self.config
        own = getattr(config, config.train.loss.replace("-", "_"))
        self.rows = load_image_set(own.data, self.dataset, image_size(config.model.resolution, FAMILIES[config.model.family].resolution),
                                   model_frames(config))
        self.fine_schedule = fine_schedule(self.finetune.adapter, config.sampling.shift)

    def signal(self, rollout: Rollout, rewards: torch.Tensor, iteration: int) -> Signal:
        raise TypeError(f"{type(self).__name__} trains on a dataset, not on rollouts: the trainer calls plan_rows")

    def plan_rows(self, rows: list[int], embeds: dict, address: NoiseAddress) -> UpdatePlan:
        """This process's plan for the image set's rows `rows` (their prompts' embeddings in `embeds`, row order)."""
        raise NotImplementedError


def model_frames(config: TrainConfig) -> int:
    """The frames of each of the model's videos (`model.frames`, else its family's default); 0 for an image family."""
    family = FAMILIES[config.model.family]
    return (config.model.frames or family.frames) if family.video else 0


def fine_schedule(adapter: ModelAdapter, shift: float | None) -> FlowSchedule:
    """The family's `FINE_STEPS`-step schedule on its device, the noise levels are read from (flow families only: the settings
    refuse a DDIM family for the dataset objectives)."""
    return cast(FlowSchedule, adapter.schedule(FINE_STEPS, shift).to(adapter.device))


def encode_rows(adapter: ModelAdapter, image_set: ImageSet, rows: list[int]) -> torch.Tensor:
    """(R, F, ...) latents of the rows' F images (or clips) each (`ModelAdapter.encode_images`)."""
    pixels = torch.stack([torch.stack(image_set.pixels(row)) for row in rows])  # (R, F, 3, H, W), a video set's (R, F, T, 3, H, W)
    flat = adapter.encode_images(pixels.flatten(0, 1).to(adapter.device))  # type: ignore[attr-defined]  # the families that encode (preflight checks)
    return flat.reshape(len(rows), len(image_set.fields), *flat.shape[1:])


def draw_levels(address: NoiseAddress, shape: torch.Size, timesteps: int, sampling: str, mean: float, std: float, tag: str,
                schedule: FlowSchedule) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of `address.prompt_keys`: `timesteps` step indices of `schedule` (R, k) and noise (R, k, *shape) (module doc)."""
    steps, noises = [], []
    generator = torch.Generator()
    num_steps = schedule.num_steps
    for key in address.prompt_keys:
        generator.manual_seed(address_seed(tag, address.run_seed, address.iteration, key, ()))
        if sampling == "logit-normal":
            t = torch.sigmoid(mean + std * torch.randn(timesteps, generator=generator, dtype=torch.float64))
        else:
            t = torch.rand(timesteps, generator=generator, dtype=torch.float64)
        steps.append(((1 - t) * num_steps).long().clamp(0, num_steps - 1))  # t = 1 − i/T on the schedule's grid
        noises.append(torch.randn((timesteps, *shape), generator=generator))
    return torch.stack(steps), torch.stack(noises)


def dataset_terms(latents: torch.Tensor, steps: torch.Tensor, noise: torch.Tensor, schedule: FlowSchedule) -> list[ForwardTerms]:
    """One `ForwardTerms` per image field: rows' latents (R, F, ...) noised at their (R, k) steps with their
    (R, k, ...) noise, the same for every field of a row; a term's `nodes` and `prompt` are its row."""
    rows, k = steps.shape
    row_of = torch.arange(rows).repeat_interleave(k)  # (R·k,)
    flat_steps = steps.flatten()
    sigma = schedule.sigmas[flat_steps.to(schedule.sigmas.device)].to(latents.device)
    eps = noise.flatten(0, 1).to(latents.device, latents.dtype)  # (R·k, ...)
    scale = sigma.reshape((-1,) + (1,) * (eps.dim() - 1)).to(latents.dtype)
    times = schedule.model_times[flat_steps.to(schedule.model_times.device)]
    terms = []
    for f in range(latents.shape[1]):
        x0 = latents[row_of, f]  # (R·k, ...)
        terms.append(ForwardTerms(row_of, flat_steps, x0, eps, (1 - scale) * x0 + scale * eps, sigma, times, row_of))
    return terms
