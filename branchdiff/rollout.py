"""Grow trees of SDE/ODE transitions with a model adapter, level by level.

At every step all nodes of the current depth, across all prompts, go through the model in
batched forwards of at most `max_batch` rows; each node's k children share that forward and differ
only in their step noise. With `exact=True` every forward is padded to exactly `max_batch` rows:
on CPU (and in general) a row's output depends on the batch size but not on the other rows'
contents, so padding makes any node regenerable alone, bit for bit (see `regenerate`).

Split-edge log-probs: the children of a split are sampled as `mean + scale·std·ε`. With
`split_logprob="sampled"` (default) the stored log-prob is the density of that draw,
N(mean, (scale·std)²); `"anchor"` reproduces the BranchGRPO release, which evaluates it under the
unscaled std, so its "old" log-probs are not the behaviour density.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from branchdiff import noise
from branchdiff.models.base import ModelAdapter, PromptEmbeds, select_embeds
from branchdiff.tree import Tree
from branchdiff.schedulers.flow import gaussian_log_prob, step

SPLIT_LOGPROB_CONVENTIONS = ("sampled", "anchor")


@dataclass(frozen=True)
class SamplerSettings:
    sde: str = "flow"  # SDE kind: dance | flow | cps (schedulers.flow)
    noise_level: float = 0.7  # η for dance, a for flow and cps
    max_batch: int = 64  # rows per model forward
    exact: bool = True  # pad forwards to max_batch so any node regenerates bit for bit
    split_logprob: str = "sampled"  # sampled | anchor (see module docstring)


@dataclass(frozen=True)
class NoiseAddress:
    run_seed: int
    iteration: int
    prompt_keys: tuple[int, ...]  # global key of each prompt of the batch


@dataclass
class Rollout:
    tree: Tree
    sigmas: torch.Tensor  # (T+1,)
    latents: torch.Tensor  # (N, *latent_shape) every node's latent
    log_prob: torch.Tensor  # (N,) log-prob of the edge into each node (0 for roots and ODE edges)
    std: torch.Tensor  # (N,) std the edge's log-prob is evaluated with (0 for roots and ODE edges)
    nfe: int  # model forwards (rows) used, padding excluded

    @property
    def leaf_latents(self) -> torch.Tensor:
        return self.latents[self.tree.leaf_index]


def forward_chunked(
    adapter: ModelAdapter,
    latents: torch.Tensor,
    sigmas: torch.Tensor,
    embeds: PromptEmbeds,
    max_batch: int,
    exact: bool,
) -> torch.Tensor:
    """Velocity for latents (B, ...) in chunks of `max_batch` rows; with `exact`, a short chunk is
    padded (its last row repeated) to exactly `max_batch` rows and the padding dropped after."""
    outputs = []
    for start in range(0, latents.shape[0], max_batch):
        rows = torch.arange(start, min(start + max_batch, latents.shape[0]))
        if exact and len(rows) < max_batch:
            rows = torch.cat([rows, rows[-1:].expand(max_batch - len(rows))])
        velocity = adapter.predict_velocity(latents[rows], sigmas[rows], select_embeds(embeds, rows))
        outputs.append(velocity[: min(max_batch, latents.shape[0] - start)])
    return torch.cat(outputs)


def logprob_std_scale(tree: Tree, settings: SamplerSettings) -> torch.Tensor:
    """(N,) factor between the step's std and the std an edge's log-prob uses: the split's noise
    scale under the "sampled" convention, 1 under "anchor" (and 1 off splits)."""
    if settings.split_logprob == "anchor":
        return torch.ones(tree.num_nodes)
    scale_of_step = torch.tensor([tree.spec.noise_scale(s) for s in range(tree.spec.num_steps)] + [1.0])
    return torch.where(tree.depth > 0, scale_of_step[(tree.depth - 1).clamp(min=0)], torch.ones(tree.num_nodes))


def _transition(
    tree: Tree,
    depth: int,
    parent_latents: torch.Tensor,
    parent_velocity: torch.Tensor,
    sigmas: torch.Tensor,
    settings: SamplerSettings,
    address: NoiseAddress,
    children: torch.Tensor,
    parent_row: torch.Tensor,
    std_scale: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Latents, log-probs and log-prob stds (C,) of `children` (node indices, at depth+1), whose
    parents' latents and velocities are rows `parent_row` of the given tensors; `std_scale` (N,) is
    `logprob_std_scale` of the tree."""
    spec = tree.spec
    kind = settings.sde if spec.is_sde(depth) else "ode"
    if kind == "cps" and sigmas[depth + 1] == 0:
        kind = "ode"  # cps has std σ'·sin(aπ/2) = 0 at the last step: no density, so deterministic
    x, v = parent_latents[parent_row], parent_velocity[parent_row]
    if kind == "ode":
        out = step("ode", x, v, sigmas[depth], sigmas[depth + 1], None, 0.0)
        zeros = torch.zeros(len(children))
        return out.sample, zeros, zeros
    scale = spec.noise_scale(depth)
    keys = [address.prompt_keys[p] for p in tree.prompt[children].tolist()]
    paths = [tree.paths[c] for c in children.tolist()]
    eps = noise.draw("step", address.run_seed, address.iteration, keys, paths, x.shape[1:], x.device)
    out = step(kind, x, v, sigmas[depth], sigmas[depth + 1], eps * scale, settings.noise_level, sigmas[1])
    logprob_std = out.std * std_scale[children].to(out.std.device)
    return out.sample, gaussian_log_prob(out.sample, out.mean, logprob_std).cpu(), logprob_std.cpu()


@torch.no_grad()
def grow(
    adapter: ModelAdapter,
    tree: Tree,
    embeds: PromptEmbeds,
    sigmas: torch.Tensor,
    settings: SamplerSettings,
    address: NoiseAddress,
    per_node: bool = False,
) -> Rollout:
    """Sample every node of `tree` (embeds: one row per prompt of the batch). With `per_node`, every
    node is expanded by its own batch-1 forward, as the BranchGRPO release does (for benchmarks)."""
    if settings.split_logprob not in SPLIT_LOGPROB_CONVENTIONS:
        raise ValueError(f"split_logprob {settings.split_logprob!r}; allowed: {SPLIT_LOGPROB_CONVENTIONS}")
    sigmas = sigmas.to(adapter.device)
    shape = adapter.latent_shape
    latents = torch.empty((tree.num_nodes, *shape), device=adapter.device)
    log_prob = torch.zeros(tree.num_nodes)
    std = torch.zeros(tree.num_nodes)
    roots = torch.arange(tree.level_start[0], tree.level_start[1])
    keys = [address.prompt_keys[p] for p in tree.prompt[roots].tolist()]
    latents[roots] = noise.draw("init", address.run_seed, address.iteration, keys, [tree.paths[r] for r in roots.tolist()], shape, adapter.device)
    nfe = 0
    std_scale = logprob_std_scale(tree, settings)  # (N,)
    for depth in range(tree.spec.num_steps):
        level = torch.arange(tree.level_start[depth], tree.level_start[depth + 1])
        if len(level) == 0:  # a sub-tree that ends above the leaves
            break
        x = latents[level]  # (n_level, *shape)
        level_embeds = select_embeds(embeds, tree.prompt[level])
        level_sigmas = sigmas[depth].expand(len(level))
        if per_node:
            velocity = torch.cat([
                adapter.predict_velocity(x[i : i + 1], level_sigmas[i : i + 1], select_embeds(level_embeds, torch.tensor([i])))
                for i in range(len(level))
            ])
        else:
            velocity = forward_chunked(adapter, x, level_sigmas, level_embeds, settings.max_batch, settings.exact)
        nfe += len(level)
        children = torch.arange(tree.level_start[depth + 1], tree.level_start[depth + 2])
        parent_row = tree.parent[children] - tree.level_start[depth]
        latents[children], log_prob[children], std[children] = _transition(
            tree, depth, x, velocity, sigmas, settings, address, children, parent_row, std_scale
        )
    return Rollout(tree=tree, sigmas=sigmas, latents=latents, log_prob=log_prob, std=std, nfe=nfe)


@torch.no_grad()
def regenerate(
    adapter: ModelAdapter,
    tree: Tree,
    nodes: torch.Tensor,
    embeds: PromptEmbeds,
    sigmas: torch.Tensor,
    settings: SamplerSettings,
    address: NoiseAddress,
) -> Rollout:
    """Grow only `nodes` (indices into `tree`) and their ancestors, with the same addressable noise:
    the sub-tree made of the union of their root paths. Returns a Rollout over that sub-tree whose
    tree keeps the original paths and prompts (so its noise addresses are the original ones)."""
    keep = torch.zeros(tree.num_nodes, dtype=torch.bool)
    frontier = nodes.clone()
    while len(frontier):
        keep[frontier] = True
        frontier = tree.parent[frontier]
        frontier = frontier[(frontier >= 0) & ~keep[frontier.clamp(min=0)]].unique()
    return grow(adapter, subtree(tree, keep), embeds, sigmas, settings, address)


def subtree(tree: Tree, keep: torch.Tensor) -> Tree:
    """The nodes `keep` (N,) bool of `tree`, closed under taking parents, as a Tree in level order.
    Paths and prompt indices are the original ones."""
    old_index = torch.nonzero(keep).squeeze(1)  # level order is preserved by sorting
    new_of_old = torch.full((tree.num_nodes,), -1, dtype=torch.long)
    new_of_old[old_index] = torch.arange(len(old_index))
    parent = tree.parent[old_index]
    depth = tree.depth[old_index]
    counts = torch.bincount(depth, minlength=tree.spec.num_steps + 1)
    return Tree(
        spec=tree.spec,
        num_prompts=tree.num_prompts,
        parent=torch.where(parent >= 0, new_of_old[parent.clamp(min=0)], parent),
        depth=depth,
        prompt=tree.prompt[old_index],
        paths=[tree.paths[i] for i in old_index.tolist()],
        level_start=[0, *torch.cumsum(counts, 0).tolist()],
    )
