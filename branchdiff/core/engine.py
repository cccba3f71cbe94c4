"""The rollout engine: predict and step any frontier of nodes, at any depths.

Training rollouts (`rollout.grow`: a whole level of a tree whose shape is fixed in advance),
exploration and inference-time search (`branchdiff.search`: nodes picked one at a time, at mixed
depths) are loops around the same two calls, as a diffusers pipeline is a loop around its
scheduler's `step`:

- `predict`: the guided model output of B nodes at their own depths, in batched forwards of at most
  `max_batch` network rows; returns the network rows of the real nodes and of the rows computed.
- `expand`: one transition x_d → x_{d+1} for C children, each from its parent's latent and model
  output (siblings share their parent's output), drawn with the addressable noise of the child's
  path (branchdiff/core/noise.py), so any node regenerates alone, bit for bit.

A step is the tree spec's at the parent's depth: the sampler's SDE (`SamplerSettings.sde`) where
`spec.is_sde(depth)`, else the deterministic ODE step; a split step's own noise level and the
BranchGRPO release's noise-only multiplier (`TreeSpec`) apply as in training. The stored log-prob is
the Gaussian log-density of the child under the step's mean and std (0 for an ODE step).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from branchdiff.core import noise
from branchdiff.core.noise import NodePath
from branchdiff.core.tree import TreeSpec
from branchdiff.models.base import ModelAdapter, PromptEmbeds, select_embeds
from branchdiff.models.block_cache import BlockCache
from branchdiff.schedulers.flow import gaussian_log_prob
from branchdiff.schedulers.schedule import Schedule


@dataclass(frozen=True)
class SamplerSettings:
    sde: str = "flow"  # SDE kind: dance | flow | cps (flow families), ddim (ε families)
    noise_level: float = 0.7  # η for dance and ddim, a for flow and cps
    max_batch: int = 64  # network rows per model forward (a CFG prediction costs 2)
    exact: bool = False  # pad forwards to max_batch so any node regenerates bit for bit
    guidance: float | None = None  # CFG scale or embedded guidance; None = the adapter's default
    block_cache: float = 0.0  # first-block cache threshold of `rollout.grow`'s forwards (branchdiff/models/block_cache.py); 0: off


@dataclass(frozen=True)
class NoiseAddress:
    run_seed: int
    iteration: int
    prompt_keys: tuple[int, ...]  # global key of each prompt of the batch


@dataclass
class Children:
    latents: torch.Tensor  # (C, *latent_shape)
    log_prob: torch.Tensor  # (C,) on CPU: log-density of each child under its step (0 for ODE steps)
    std: torch.Tensor  # (C,) on CPU: the std the log-prob is evaluated with (0 for ODE steps)
    noise_level: torch.Tensor  # (C,) on CPU: the SDE noise level of the step (0 for ODE steps)


def rows_per_latent(adapter: ModelAdapter, settings: SamplerSettings) -> int:
    """Network rows one latent's prediction costs at these settings (2 under CFG)."""
    return adapter.rows_per_sample(adapter.default_guidance if settings.guidance is None else settings.guidance)


def forward_chunked(
    adapter: ModelAdapter,
    latents: torch.Tensor,
    times: torch.Tensor,
    embeds: PromptEmbeds,
    settings: SamplerSettings,
    cache: BlockCache | None = None,
) -> tuple[torch.Tensor, int]:
    """The guided model output for latents (B, ...) at times (B,) in forwards of at most
    `max_batch` network rows (max_batch // 2 latents under CFG), and the network rows computed;
    with `exact`, a short chunk is padded (its last latent repeated) to a full chunk and the
    padding dropped after. A sharded denoiser (`adapter.lockstep`) makes as many forwards as the
    other processes do for their batch: the missing ones are padding forwards of one latent, dropped.
    `cache`: the rollout's block cache, told which of the depth's rows each forward holds."""
    rows_each = rows_per_latent(adapter, settings)
    chunk = max(1, settings.max_batch // rows_each)
    outputs, computed = [], 0
    if adapter.lockstep is not None:
        forwards = -(-latents.shape[0] // chunk)
        for _ in range(adapter.lockstep(forwards) - forwards):
            if not len(latents):
                raise RuntimeError("a sharded denoiser must join the other processes' forwards, but this process has no latent to forward")
            adapter.predict(latents[:1], times[:1], select_embeds(embeds, torch.tensor([0])), settings.guidance)
    for start in range(0, latents.shape[0], chunk):
        rows = torch.arange(start, min(start + chunk, latents.shape[0]))
        if settings.exact and len(rows) < chunk:
            rows = torch.cat([rows, rows[-1:].expand(chunk - len(rows))])
        with nullcontext() if cache is None else cache.forward(rows, rows_each):
            output = adapter.predict(latents[rows], times[rows], select_embeds(embeds, rows), settings.guidance)
        outputs.append(output[: min(chunk, latents.shape[0] - start)])
        computed += len(rows) * rows_each
    return torch.cat(outputs), computed


def predict(
    adapter: ModelAdapter,
    latents: torch.Tensor,
    depths: torch.Tensor,
    embeds: PromptEmbeds,
    schedule: Schedule,
    settings: SamplerSettings,
    cache: BlockCache | None = None,
) -> tuple[torch.Tensor, int, int]:
    """Model outputs (B, ...) of nodes with latents (B, ...) at depths (B,) (embeds: one row per
    node); the network rows of the B nodes and the rows computed (padding included). `cache`: a
    rollout's block cache (`rollout.grow`), the B nodes being one depth's rows."""
    times = schedule.model_times[depths.to(schedule.model_times.device)]  # (B,)
    output, computed = forward_chunked(adapter, latents, times, embeds, settings, cache)
    return output, len(latents) * rows_per_latent(adapter, settings), computed


def step_kind(spec: TreeSpec, schedule: Schedule, settings: SamplerSettings, depth: int) -> str:
    """The transition taken from `depth`: the sampler's SDE where the spec samples one, else `ode`
    (and `ode` where the SDE has no density, as cps at its last step)."""
    return schedule.kind_at(settings.sde if spec.is_sde(depth) else "ode", depth)


def transition(
    spec: TreeSpec,
    schedule: Schedule,
    settings: SamplerSettings,
    address: NoiseAddress,
    depth: int,
    parent_latents: torch.Tensor,
    parent_output: torch.Tensor,
    prompt_keys: list[int],
    paths: list[NodePath],
) -> Children:
    """Children (C,) of parents at one `depth`, from each child's parent latent and model output
    (C, ...), drawn with the noise at (address, prompt_keys[c], paths[c])."""
    kind = step_kind(spec, schedule, settings, depth)
    at_depth = torch.full((len(paths),), depth, dtype=torch.long)
    if kind == "ode":
        out = schedule.step("ode", parent_latents, parent_output, at_depth, None, 0.0)
        zeros = torch.zeros(len(paths))
        return Children(out.sample, zeros, zeros, zeros.clone())
    level = spec.noise_level(depth, settings.noise_level)
    eps = noise.draw("step", address.run_seed, address.iteration, prompt_keys, paths, parent_latents.shape[1:], parent_latents.device)
    out = schedule.step(kind, parent_latents, parent_output, at_depth, eps * spec.noise_multiplier(depth), level)
    return Children(out.sample, gaussian_log_prob(out.sample, out.mean, out.std).cpu(), out.std.cpu(), torch.full((len(paths),), level))


def expand(
    spec: TreeSpec,
    schedule: Schedule,
    settings: SamplerSettings,
    address: NoiseAddress,
    parent_depths: torch.Tensor,
    parent_latents: torch.Tensor,
    parent_output: torch.Tensor,
    prompt_keys: list[int],
    paths: list[NodePath],
) -> Children:
    """Children (C,) of parents at mixed depths (C,): `transition` per depth, in the children's order."""
    depths = parent_depths.tolist()
    if len(set(depths)) == 1:
        return transition(spec, schedule, settings, address, depths[0], parent_latents, parent_output, prompt_keys, paths)
    latents = torch.empty_like(parent_latents)
    log_prob, std, level = torch.zeros(len(paths)), torch.zeros(len(paths)), torch.zeros(len(paths))
    for depth in sorted(set(depths)):
        rows = [i for i, d in enumerate(depths) if d == depth]
        index = torch.tensor(rows)
        part = transition(spec, schedule, settings, address, depth, parent_latents[index.to(parent_latents.device)],
                          parent_output[index.to(parent_output.device)], [prompt_keys[i] for i in rows], [paths[i] for i in rows])
        latents[index.to(latents.device)] = part.latents
        log_prob[index], std[index], level[index] = part.log_prob, part.std, part.noise_level
    return Children(latents, log_prob, std, level)


def initial_noise(address: NoiseAddress, prompt_keys: list[int], paths: list[NodePath], shape: tuple[int, ...],
                  device: torch.device | str) -> torch.Tensor:
    """Root latents (R, *shape): the initial noise at each root's address."""
    return noise.draw("init", address.run_seed, address.iteration, prompt_keys, paths, shape, device)
