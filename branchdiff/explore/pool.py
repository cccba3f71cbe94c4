"""FP4 explore, BF16 train (Sol-RL, arXiv 2604.06916; docs/explore.md), for chains and for trees.

Explore with a cheap copy of the policy (`branchdiff.explore.quant`), keep a contrastive subset, and
regenerate exactly that subset with the training-precision policy from the same addressable
noise; training labels always come from the regenerated samples, re-scored, never from the pool.

- `seeds` mode (Sol-RL): each prompt gets `pool` candidate roots (seeds 0..pool-1). They are
  previewed with the explorer — by default with the ODE sampler at `preview_steps` steps, as
  Sol-RL does, or with the training sampler — scored, and `keep` of them are selected. The kept
  roots are regenerated with the policy as chains or, with splits, as tree roots.
- `tree` mode: the training tree is grown whole with the explorer, its leaves scored, `keep`
  leaves per prompt selected, and exactly the union of their root paths regenerated with the
  policy (`rollout.regenerate`); depth-wise advantages are then computed on that sub-tree.
- `search` mode (DiffusionNFT, which trains final samples): an inference-time search
  (branchdiff/search/, e.g. DTS*) spends `search_budget` network rows per prompt; the images it
  finishes are the pool, `keep` of them are selected and trained on (`explore_search`).

With the policy itself as explorer (backend `none`), the training sampler and `exact` forwards,
regeneration reproduces the explored latents bit for bit; with a 4-bit explorer they differ by the
quantisation, which `latent_difference` reports (and, in seeds mode with a preview sampler or step
count other than the training one, by that difference too: its metric names say which).

How well the explorer ranks is measured on the whole pool, not on the kept subset (whose extremes
inflate a rank correlation): `pool_under_policy` grows every candidate with the policy, at the
training settings, for `ranking_agreement` against the explorer's pool rewards.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch
from scipy import stats

from branchdiff.core import noise
from branchdiff.core.engine import rows_per_latent
from branchdiff.core.rollout import NoiseAddress, Rollout, SamplerSettings, grow, regenerate
from branchdiff.core.tree import Tree, TreeSpec, build_tree
from branchdiff.explore.selection import select, select_per_group
from branchdiff.models.base import ModelAdapter, PromptEmbeds, select_embeds
from branchdiff.schedulers.schedule import Schedule


@dataclass(frozen=True)
class RolloutContext:
    """What an iteration's rollouts share: the policy that samples what is trained, its prompts'
    embeddings, the training tree's spec, the schedule, the sampler and the noise address."""
    policy: ModelAdapter
    embeds: PromptEmbeds
    spec: TreeSpec
    schedule: Schedule
    settings: SamplerSettings
    address: NoiseAddress


@dataclass(frozen=True)
class Selection:
    """How a pool's candidates are kept: `keep` per prompt by `rule` (branchdiff/explore/selection.py), with one
    generator per prompt (`selection_generators`) for the rules that draw."""
    keep: int
    rule: str
    generators: list[torch.Generator]


@dataclass
class ExploreResult:
    rollout: Rollout  # regenerated with the policy: what is trained on
    pool_rewards: torch.Tensor  # (P, N) explorer rewards of every candidate
    kept: torch.Tensor  # (P, K) indices of the kept candidates (root ids or leaf ranks)
    kept_pool_latents: torch.Tensor  # (P·K, ...) the kept candidates' final latents in the pool
    kept_regenerated_latents: torch.Tensor  # (P·K, ...) the same candidates regenerated (same order)
    stats: dict[str, float]
    same_sampler: bool  # pool and regeneration used the same sampler and steps (latent gap = quantisation)


def selection_generators(run_seed: int, iteration: int, prompt_keys: tuple[int, ...]) -> list[torch.Generator]:
    """One generator per prompt for the random selection modes, seeded from the prompt's address:
    a prompt's choice is the same whichever process holds it, and differs between prompts."""
    return [torch.Generator().manual_seed(noise.address_seed("select", run_seed, iteration, key, ())) for key in prompt_keys]


def ranking_agreement(pool: torch.Tensor, regenerated: torch.Tensor) -> dict[str, float]:
    """Agreement between pool and regenerated rewards of the same candidates (P, K): Spearman ρ and
    Kendall τ pooled over all prompts (differences between prompts inflate these); their means over
    prompts taken one at a time (`*_within`: what selection, which ranks within a prompt, depends on;
    prompts whose rewards are constant on either side have no ranking and are left out); and the
    mean top-half overlap within each prompt."""
    p, k = pool.shape
    spearman = kendall = float("nan")  # rewards constant on either side (a saturated reward, a tiny run): no ranking to agree on
    if pool.unique().numel() > 1 and regenerated.unique().numel() > 1:
        spearman = stats.spearmanr(pool.flatten().numpy(), regenerated.flatten().numpy()).statistic
        kendall = stats.kendalltau(pool.flatten().numpy(), regenerated.flatten().numpy()).statistic
    ranked = [i for i in range(p) if pool[i].unique().numel() > 1 and regenerated[i].unique().numel() > 1]
    within = {"spearman_within": float("nan"), "kendall_within": float("nan")}
    if ranked:
        within["spearman_within"] = float(sum(stats.spearmanr(pool[i].numpy(), regenerated[i].numpy()).statistic for i in ranked) / len(ranked))
        within["kendall_within"] = float(sum(stats.kendalltau(pool[i].numpy(), regenerated[i].numpy()).statistic for i in ranked) / len(ranked))
    half = max(1, k // 2)
    top_pool = torch.sort(-pool, dim=1, stable=True).indices[:, :half]
    top_regen = torch.sort(-regenerated, dim=1, stable=True).indices[:, :half]
    overlap = sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(top_pool, top_regen)) / (p * half)
    return {"spearman": float(spearman), "kendall": float(kendall), **within, "topk_overlap": overlap}


def _leaves_by_prompt(tree: Tree) -> torch.Tensor:
    """(P, L) leaf node indices of each prompt (leaves are stored prompt-major)."""
    return tree.leaf_index.reshape(tree.num_prompts, -1)


def explore_seeds(context: RolloutContext, explorer: ModelAdapter, preview_schedule: Schedule, preview_sde: bool, pool: int,
                  selection: Selection, score) -> ExploreResult:
    """Seeds mode. `score(latents (B, ...), prompt_index (B,)) -> rewards (B,)` decodes and scores.
    The context's spec is the training spec; its `roots` is replaced by `keep` chosen seeds per prompt."""
    policy, embeds, spec, schedule, settings, address = (context.policy, context.embeds, context.spec, context.schedule, context.settings,
                                                         context.address)
    keep = selection.keep
    num_prompts = len(address.prompt_keys)
    preview_steps = preview_schedule.num_steps
    preview_spec = TreeSpec(preview_steps, roots=pool, sde_steps=None if preview_sde else frozenset())
    start = time.perf_counter()
    preview_tree = build_tree(preview_spec, num_prompts)
    explored = grow(explorer, preview_tree, embeds, preview_schedule, settings, address)
    leaves = _leaves_by_prompt(preview_tree)  # (P, pool) in root order
    scoring = time.perf_counter()
    pool_rewards = score(explored.latents[leaves.flatten()], preview_tree.prompt[leaves.flatten()]).reshape(num_prompts, pool)
    pool_seconds, score_seconds = time.perf_counter() - start, time.perf_counter() - scoring
    kept = select_per_group(pool_rewards, keep, selection.rule, selection.generators)  # (P, K) root ids, ascending
    start = time.perf_counter()
    train_spec = replace(spec, roots=keep)
    train_tree = build_tree(train_spec, num_prompts, root_ids=kept.tolist())
    rollout = grow(policy, train_tree, embeds, schedule, settings, address)
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
        stats={"pool_nfe": explored.nfe, "pool_seconds": pool_seconds, "pool_score_seconds": score_seconds, "regen_nfe": rollout.nfe,
               "regen_seconds": regen_seconds},
        same_sampler=preview_sde and preview_steps == spec.num_steps and spec.sde_steps is None and not spec.splits,
    )


def explore_tree(context: RolloutContext, explorer: ModelAdapter, selection: Selection, score) -> ExploreResult:
    """Tree mode: grow the context's spec with the explorer, keep `selection.keep` leaves per prompt, regenerate the
    union of their root paths with the policy."""
    policy, embeds, spec, schedule, settings, address = (context.policy, context.embeds, context.spec, context.schedule, context.settings,
                                                         context.address)
    num_prompts = len(address.prompt_keys)
    start = time.perf_counter()
    tree = build_tree(spec, num_prompts)
    explored = grow(explorer, tree, embeds, schedule, settings, address)
    leaves = _leaves_by_prompt(tree)  # (P, L)
    scoring = time.perf_counter()
    pool_rewards = score(explored.latents[leaves.flatten()], tree.prompt[leaves.flatten()]).reshape(num_prompts, -1)
    pool_seconds, score_seconds = time.perf_counter() - start, time.perf_counter() - scoring
    kept = select_per_group(pool_rewards, selection.keep, selection.rule, selection.generators)  # (P, K) leaf ranks
    kept_nodes = leaves.gather(1, kept).flatten()  # (P·K,)
    start = time.perf_counter()
    rollout = regenerate(policy, tree, kept_nodes, embeds, schedule, settings, address)
    regen_seconds = time.perf_counter() - start
    # the sub-tree's leaves are exactly the kept leaves, in the same (prompt, path) order
    return ExploreResult(
        rollout=rollout,
        pool_rewards=pool_rewards,
        kept=kept,
        kept_pool_latents=explored.latents[kept_nodes],
        kept_regenerated_latents=rollout.latents[rollout.tree.leaf_index],
        stats={"pool_nfe": explored.nfe, "pool_seconds": pool_seconds, "pool_score_seconds": score_seconds, "regen_nfe": rollout.nfe,
               "regen_seconds": regen_seconds},
        same_sampler=True,
    )


def explore_search(context: RolloutContext, explorer: ModelAdapter, search: object, budget: int, selection: Selection,
                   score_images) -> ExploreResult:
    """Search mode (final samples only: DiffusionNFT): each prompt's denoising tree is searched by the
    explorer with `search` (branchdiff/search/: best-of-N, fixed trees, DTS, DTS*) within `budget`
    network rows, at the training sampler on the context spec's steps; every leaf it finishes is a candidate.
    `selection.keep` of them are selected per prompt, and regrown with the policy from their noise paths when the
    explorer is another model (the policy's own search leaves are its samples as they are). The rollout
    holds them as the leaves of `keep` chains per prompt; its other nodes are not sampled (zeros), so
    only an objective that trains final samples may use it. `score_images(images, prompt_index)`."""
    from branchdiff.search.forest import SearchForest, regenerate_path
    from branchdiff.search.run import run_search

    policy, embeds, spec, schedule, settings, address = (context.policy, context.embeds, context.spec, context.schedule, context.settings,
                                                         context.address)
    keep = selection.keep
    num_prompts = len(address.prompt_keys)
    # a round forwards at most one node per prompt: padding (every search forward is padded) to more would waste rows
    forest_settings = replace(settings, max_batch=num_prompts * rows_per_latent(explorer, settings))
    start = time.perf_counter()
    forest = SearchForest(explorer, TreeSpec(spec.num_steps, sde_steps=spec.sde_steps), schedule, forest_settings, address, embeds)
    found = run_search(forest, search, budget, lambda images, prompts: (score_images(images, torch.tensor(prompts)), {}),
                       noise.address_seed("search", address.run_seed, address.iteration, address.prompt_keys[0], ()))
    pool_seconds = time.perf_counter() - start
    if min(len(leaves) for leaves in found.leaves) < keep:
        raise ValueError(f"explore.search_budget={budget} finished fewer than explore.keep={keep} images for a prompt; "
                         f"raise the budget (a {spec.num_steps}-step image costs {spec.num_steps} rows) or keep fewer")
    width = max(len(leaves) for leaves in found.leaves)
    pool_rewards = torch.full((num_prompts, width), float("nan"))  # (P, N): each prompt's leaves in the order made, NaN after its last
    for prompt, rewards in enumerate(found.rewards):
        pool_rewards[prompt, : len(rewards)] = torch.tensor(rewards)
    kept = torch.stack([select(pool_rewards[p, : len(found.rewards[p])], keep, selection.rule, selection.generators[p])
                        for p in range(num_prompts)])
    kept_leaves = [found.leaves[p][i] for p in range(num_prompts) for i in kept[p].tolist()]  # (P·K,) forest nodes
    kept_pool = forest.leaf_latents(kept_leaves)
    start = time.perf_counter()
    regenerated, regen_nfe = kept_pool, 0
    if explorer is not policy:
        regenerated = torch.stack([regenerate_path(policy, forest.spec, schedule, forest_settings, address.run_seed, address.iteration,
                                                   address.prompt_keys[forest.prompt[leaf]], select_embeds(embeds, torch.tensor([forest.prompt[leaf]])),
                                                   forest.path[leaf]) for leaf in kept_leaves])
        regen_nfe = len(kept_leaves) * spec.num_steps * rows_per_latent(policy, settings)
    tree = build_tree(TreeSpec(spec.num_steps, roots=keep, sde_steps=frozenset()), num_prompts)
    latents = torch.zeros((tree.num_nodes, *regenerated.shape[1:]), device=regenerated.device)
    latents[tree.leaf_index] = regenerated  # leaves are prompt-major, as kept_leaves
    zeros = torch.zeros(tree.num_nodes)
    nfe = sum(forest.nfe) + regen_nfe
    rollout = Rollout(tree, schedule, latents, zeros, zeros.clone(), zeros.clone(), nfe, nfe)
    return ExploreResult(
        rollout=rollout, pool_rewards=pool_rewards, kept=kept, kept_pool_latents=kept_pool, kept_regenerated_latents=regenerated,
        stats={"pool_nfe": sum(forest.nfe), "pool_seconds": pool_seconds, "regen_nfe": regen_nfe, "regen_seconds": time.perf_counter() - start,
               "search_images": float(sum(len(leaves) for leaves in found.leaves)) / num_prompts},
        same_sampler=True,
    )


def latent_difference(result: ExploreResult) -> dict[str, float]:
    """How far the regenerated kept samples are from their pool versions (0 = bit-identical):
    `quant_latent_*` when pool and regeneration ran the same sampler and steps (the gap is the
    explorer's quantisation), `preview_vs_train_latent_*` otherwise (quantisation and the preview's
    other sampler or step count together)."""
    diff = (result.kept_regenerated_latents - result.kept_pool_latents).abs()
    name = "quant" if result.same_sampler else "preview_vs_train"
    return {f"{name}_latent_max_abs_diff": diff.max().item(), f"{name}_latent_mean_abs_diff": diff.mean().item()}


@torch.no_grad()
def pool_under_policy(context: RolloutContext, mode: str, pool: int) -> tuple[torch.Tensor, int]:
    """Every candidate of the explorer's pool grown with the policy at the training settings:
    seeds mode grows all `pool` seeds as training trees, tree mode the whole tree. Returns the leaf
    latents (P·N·L, ...) in candidate order and L, the leaves per candidate (a candidate's policy
    reward is the mean over its L leaves, as for the kept candidates)."""
    spec, address = context.spec, context.address
    num_prompts = len(address.prompt_keys)
    if mode == "seeds":
        tree = build_tree(replace(spec, roots=pool), num_prompts)
        per_candidate = spec.leaves // spec.roots
    else:
        tree = build_tree(spec, num_prompts)
        per_candidate = 1
    return grow(context.policy, tree, context.embeds, context.schedule, context.settings, address).leaf_latents, per_candidate
