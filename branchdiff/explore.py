"""FP4 explore, BF16 train (Sol-RL, method.md §4), for chains and for trees.

Explore with a cheap copy of the policy (`branchdiff.quant`), keep a contrastive subset, and
regenerate exactly that subset with the training-precision policy from the same addressable
noise; training labels always come from the regenerated samples, re-scored, never from the pool.

- `seeds` mode (Sol-RL): each prompt gets `pool` candidate roots (seeds 0..pool-1). They are
  previewed with the explorer — by default with the ODE sampler at `preview_steps` steps, as
  Sol-RL does, or with the training sampler — scored, and `keep` of them are selected. The kept
  roots are regenerated with the policy as chains or, with splits, as tree roots.
- `tree` mode: the training tree is grown whole with the explorer, its leaves scored, `keep`
  leaves per prompt selected, and exactly the union of their root paths regenerated with the
  policy (`rollout.regenerate`); depth-wise advantages are then computed on that sub-tree.

With the policy itself as explorer (backend `none`) and the training sampler, regeneration
reproduces the explored latents bit for bit; with a 4-bit explorer they differ only by the
quantisation, which `latent_difference` reports.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from scipy import stats

from branchdiff.models.base import ModelAdapter, PromptEmbeds
from branchdiff.rollout import NoiseAddress, Rollout, SamplerSettings, grow, regenerate
from branchdiff.selection import select_per_group
from branchdiff.tree import Tree, TreeSpec, build_tree


@dataclass
class ExploreResult:
    rollout: Rollout  # regenerated with the policy: what is trained on
    pool_rewards: torch.Tensor  # (P, N) explorer rewards of every candidate
    kept: torch.Tensor  # (P, K) indices of the kept candidates (root ids or leaf ranks)
    kept_pool_latents: torch.Tensor  # (P·K, ...) the kept candidates' final latents in the pool
    kept_regenerated_latents: torch.Tensor  # (P·K, ...) the same candidates regenerated (same order)
    stats: dict[str, float]


def ranking_agreement(pool: torch.Tensor, regenerated: torch.Tensor) -> dict[str, float]:
    """Spearman ρ and Kendall τ between pool and regenerated rewards of the same candidates
    (P, K), pooled over all prompts; and the mean top-half overlap within each prompt."""
    p, k = pool.shape
    spearman = stats.spearmanr(pool.flatten().numpy(), regenerated.flatten().numpy()).statistic
    kendall = stats.kendalltau(pool.flatten().numpy(), regenerated.flatten().numpy()).statistic
    half = max(1, k // 2)
    top_pool = torch.sort(-pool, dim=1, stable=True).indices[:, :half]
    top_regen = torch.sort(-regenerated, dim=1, stable=True).indices[:, :half]
    overlap = sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(top_pool, top_regen)) / (p * half)
    return {"spearman": float(spearman), "kendall": float(kendall), "topk_overlap": overlap}


def _leaves_by_prompt(tree: Tree) -> torch.Tensor:
    """(P, L) leaf node indices of each prompt (leaves are stored prompt-major)."""
    return tree.leaf_index.reshape(tree.num_prompts, -1)


def explore_seeds(
    policy: ModelAdapter,
    explorer: ModelAdapter,
    embeds: PromptEmbeds,
    spec: TreeSpec,
    sigmas: torch.Tensor,
    preview_sigmas: torch.Tensor,
    preview_sde: bool,
    settings: SamplerSettings,
    address: NoiseAddress,
    pool: int,
    keep: int,
    selection: str,
    score,
    generator: torch.Generator,
) -> ExploreResult:
    """Seeds mode. `score(latents (B, ...), prompt_index (B,)) -> rewards (B,)` decodes and scores.
    `spec` is the training spec; its `roots` is replaced by `keep` chosen seeds per prompt."""
    num_prompts = len(address.prompt_keys)
    preview_steps = len(preview_sigmas) - 1
    preview_spec = TreeSpec(preview_steps, roots=pool, sde_steps=None if preview_sde else frozenset())
    start = time.perf_counter()
    preview_tree = build_tree(preview_spec, num_prompts)
    explored = grow(explorer, preview_tree, embeds, preview_sigmas, settings, address)
    leaves = _leaves_by_prompt(preview_tree)  # (P, pool) in root order
    pool_rewards = score(explored.latents[leaves.flatten()], preview_tree.prompt[leaves.flatten()]).reshape(num_prompts, pool)
    pool_seconds = time.perf_counter() - start
    kept = select_per_group(pool_rewards, keep, selection, generator)  # (P, K) root ids, ascending
    start = time.perf_counter()
    train_spec = TreeSpec(spec.num_steps, spec.splits, keep, spec.split_noise_scale, spec.sde_steps)
    train_tree = build_tree(train_spec, num_prompts, root_ids=kept.tolist())
    rollout = grow(policy, train_tree, embeds, sigmas, settings, address)
    regen_seconds = time.perf_counter() - start
    # the regenerated counterpart of each kept seed: its first leaf (a chain's only leaf)
    per_root = train_spec.leaves // keep  # leaves below each kept root
    first_leaf = train_tree.leaf_index[::per_root]  # (P·K,)
    kept_pool = explored.latents[leaves.gather(1, kept).flatten()]
    return ExploreResult(
        rollout=rollout,
        pool_rewards=pool_rewards,
        kept=kept,
        kept_pool_latents=kept_pool,
        kept_regenerated_latents=rollout.latents[first_leaf],
        stats={"pool_nfe": explored.nfe, "pool_seconds": pool_seconds, "regen_nfe": rollout.nfe, "regen_seconds": regen_seconds},
    )


def explore_tree(
    policy: ModelAdapter,
    explorer: ModelAdapter,
    embeds: PromptEmbeds,
    spec: TreeSpec,
    sigmas: torch.Tensor,
    settings: SamplerSettings,
    address: NoiseAddress,
    keep: int,
    selection: str,
    score,
    generator: torch.Generator,
) -> ExploreResult:
    """Tree mode: grow `spec` with the explorer, keep `keep` leaves per prompt, regenerate the
    union of their root paths with the policy."""
    num_prompts = len(address.prompt_keys)
    start = time.perf_counter()
    tree = build_tree(spec, num_prompts)
    explored = grow(explorer, tree, embeds, sigmas, settings, address)
    leaves = _leaves_by_prompt(tree)  # (P, L)
    pool_rewards = score(explored.latents[leaves.flatten()], tree.prompt[leaves.flatten()]).reshape(num_prompts, -1)
    pool_seconds = time.perf_counter() - start
    kept = select_per_group(pool_rewards, keep, selection, generator)  # (P, K) leaf ranks
    kept_nodes = leaves.gather(1, kept).flatten()  # (P·K,)
    start = time.perf_counter()
    rollout = regenerate(policy, tree, kept_nodes, embeds, sigmas, settings, address)
    regen_seconds = time.perf_counter() - start
    # the sub-tree's leaves are exactly the kept leaves, in the same (prompt, path) order
    return ExploreResult(
        rollout=rollout,
        pool_rewards=pool_rewards,
        kept=kept,
        kept_pool_latents=explored.latents[kept_nodes],
        kept_regenerated_latents=rollout.latents[rollout.tree.leaf_index],
        stats={"pool_nfe": explored.nfe, "pool_seconds": pool_seconds, "regen_nfe": rollout.nfe, "regen_seconds": regen_seconds},
    )


def latent_difference(result: ExploreResult) -> dict[str, float]:
    """How far the regenerated kept samples are from their pool versions (0 = bit-identical)."""
    diff = (result.kept_regenerated_latents - result.kept_pool_latents).abs()
    return {"latent_max_abs_diff": diff.max().item(), "latent_mean_abs_diff": diff.mean().item()}
