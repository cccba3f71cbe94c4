"""Branching SDE trees: the spec, the flat per-node arrays, and NFE accounting.

A node is a latent at denoising step `depth` (0 = initial noise, T = final sample). Each prompt
owns `roots` root nodes; a node at depth d < T has `k` children if d is a split step with
branching factor k, else one child. The edge parent → child is the transition at step
`depth(parent)`; its noise is what makes siblings differ. A chain group of G samples is the spec
with `roots = G` and no splits; a BranchGRPO tree is `roots = 1` with splits.

Worked example (T = 3, splits (0, 2) and (1, 3), one root):

    depth 0            r
                    /     \\
    depth 1        a       b            split at step 0, k = 2
                 / | \\   / | \\
    depth 2     c  d  e  f  g  h        split at step 1, k = 3
                |  |  |  |  |  |
    depth 3     c' d' e' f' g' h'       one child each: 6 leaves

    nodes 15, edges 14, rollout NFE 9 (one forward per non-leaf node: 1 + 2 + 6).

Nodes are stored level by level (all of depth 0 for every prompt, then depth 1, ...); within a
level by prompt, then by parent, then by child index. Every attribute is one tensor indexed by
node, across all prompts of a batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from branchdiff.core.noise import NodePath


@dataclass(frozen=True)
class Split:
    step: int  # the transition x_step → x_step+1 at which every node branches
    branches: int  # k ≥ 2 children
    noise_level: float | None = None  # the SDE's noise level at this split (η / a); None = the spec's default


@dataclass(frozen=True)
class TreeSpec:
    """Topology and per-step noise of a tree.

    Noise at a split step is a *level* of the SDE (η for dance, a for flow and cps; Dynamic-TreeRPO's
    per-layer noise intensity): it enters the step's drift correction and its noise together, and
    the edge's log-prob is the density sampled. `anchor_noise_multiplier` m ≠ 1 reproduces the
    BranchGRPO release instead: only the noise of split steps is multiplied by m, and the edge's
    log-prob keeps the unscaled std (its convention; docs/trees.md shows how far it drifts).
    """

    num_steps: int  # T denoising steps
    splits: tuple[Split, ...] = ()
    roots: int = 1  # independent roots per prompt (G for a chain group)
    split_noise_level: float | None = None  # default noise level at split steps; None = the sampler's
    anchor_noise_multiplier: float = 1.0  # the release's noise-only kick at split steps (1 = off)
    sde_steps: frozenset[int] | None = None  # steps sampled with the SDE; None = all. Split steps always are.

    def __post_init__(self) -> None:
        if self.num_steps < 1:
            raise ValueError(f"num_steps must be ≥ 1, got {self.num_steps}")
        if self.roots < 1:
            raise ValueError(f"roots must be ≥ 1, got {self.roots}")
        seen = set()
        for split in self.splits:
            if not 0 <= split.step < self.num_steps:
                raise ValueError(f"split step {split.step} is outside 0..{self.num_steps - 1} (num_steps = {self.num_steps})")
            if split.branches < 2:
                raise ValueError(f"split at step {split.step} has {split.branches} branches; a split needs k ≥ 2")
            if split.step in seen:
                raise ValueError(f"split step {split.step} is given twice")
            if split.noise_level is not None and split.noise_level <= 0:
                raise ValueError(f"split at step {split.step} has noise_level {split.noise_level}; it must be > 0")
            seen.add(split.step)
        if self.split_noise_level is not None and self.split_noise_level <= 0:
            raise ValueError(f"split_noise_level must be > 0, got {self.split_noise_level}")
        if self.anchor_noise_multiplier <= 0:
            raise ValueError(f"anchor_noise_multiplier must be > 0, got {self.anchor_noise_multiplier}")

    @property
    def split_steps(self) -> frozenset[int]:
        return frozenset(s.step for s in self.splits)

    def branching(self, step: int) -> int:
        return next((s.branches for s in self.splits if s.step == step), 1)

    def noise_level(self, step: int, default: float) -> float:
        """The SDE noise level of `step`: the split's own, else the spec's split default, else `default`."""
        split = next((s for s in self.splits if s.step == step), None)
        if split is None:
            return default
        if split.noise_level is not None:
            return split.noise_level
        return default if self.split_noise_level is None else self.split_noise_level

    def noise_multiplier(self, step: int) -> float:
        """The release's noise-only multiplier: `anchor_noise_multiplier` on split steps, 1 elsewhere."""
        return self.anchor_noise_multiplier if step in self.split_steps else 1.0

    def is_sde(self, step: int) -> bool:
        return self.sde_steps is None or step in self.sde_steps or step in self.split_steps

    def level_sizes(self) -> list[int]:
        """Nodes per prompt at each depth 0..T."""
        sizes = [self.roots]
        for step in range(self.num_steps):
            sizes.append(sizes[-1] * self.branching(step))
        return sizes

    @property
    def leaves(self) -> int:
        return self.level_sizes()[-1]

    @property
    def nodes(self) -> int:
        return sum(self.level_sizes())

    @property
    def rollout_nfe(self) -> int:
        """Model forwards per prompt to grow the tree: one per non-leaf node (siblings share it)."""
        return sum(self.level_sizes()[:-1])

    def sde_edges(self) -> int:
        """Edges per prompt whose transition is stochastic (the only ones that can be trained)."""
        sizes = self.level_sizes()
        return sum(sizes[step + 1] for step in range(self.num_steps) if self.is_sde(step))


@dataclass
class Tree:
    """Flat arrays of the trees of a batch of prompts (N nodes in all)."""

    spec: TreeSpec
    num_prompts: int
    parent: torch.Tensor  # (N,) long, -1 for roots
    depth: torch.Tensor  # (N,) long, 0..T
    prompt: torch.Tensor  # (N,) long, prompt index within the batch
    paths: list[NodePath]  # N node paths (root index, child indices...)
    level_start: list[int]  # nodes of depth d are [level_start[d], level_start[d+1])

    @property
    def num_nodes(self) -> int:
        return len(self.paths)

    def level(self, depth: int) -> slice:
        return slice(self.level_start[depth], self.level_start[depth + 1])

    @property
    def is_sde_edge(self) -> torch.Tensor:
        """(N,) bool: the edge into the node was sampled with the SDE (False for roots)."""
        sde_step = torch.tensor([self.spec.is_sde(s) for s in range(self.spec.num_steps)] + [False])
        return (self.depth > 0) & sde_step[(self.depth - 1).clamp(min=0)]

    @property
    def leaf_index(self) -> torch.Tensor:
        """(L,) node indices of the leaves, prompt-major."""
        return torch.arange(self.level_start[-2], self.level_start[-1])


def build_tree(spec: TreeSpec, num_prompts: int, root_ids: list[list[int]] | None = None) -> Tree:
    """Topology of `num_prompts` trees of `spec`, in level order (see the module docstring).
    `root_ids[p]` names prompt p's roots (default 0..roots-1): a root's id is the first element
    of every path below it, so chosen seeds of a larger pool keep their noise addresses."""
    if root_ids is None:
        root_ids = [list(range(spec.roots))] * num_prompts
    if len(root_ids) != num_prompts or any(len(ids) != spec.roots for ids in root_ids):
        raise ValueError(f"root_ids must give {spec.roots} root ids for each of {num_prompts} prompts")
    parent: list[int] = [-1] * (num_prompts * spec.roots)
    depth: list[int] = [0] * len(parent)
    prompt: list[int] = [p for p in range(num_prompts) for _ in range(spec.roots)]
    paths: list[NodePath] = [(int(r),) for p in range(num_prompts) for r in root_ids[p]]
    level_start = [0, len(paths)]
    for step in range(spec.num_steps):
        k = spec.branching(step)
        for node in range(level_start[-2], level_start[-1]):
            for child in range(k):
                parent.append(node)
                depth.append(step + 1)
                prompt.append(prompt[node])
                paths.append(paths[node] + (child,))
        level_start.append(len(paths))
    return Tree(
        spec=spec,
        num_prompts=num_prompts,
        parent=torch.tensor(parent),
        depth=torch.tensor(depth),
        prompt=torch.tensor(prompt),
        paths=paths,
        level_start=level_start,
    )
