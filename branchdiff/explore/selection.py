"""Contrastive subset selection: which k of a prompt's N scored candidates to keep (Sol-RL, arXiv 2604.06916).

Every mode returns the chosen indices sorted ascending (a set in canonical order), as a LongTensor
on the rewards' device. Ties are broken toward the lower index; randomness comes only from the
given generator (a CPU `torch.Generator`; None uses torch's global RNG). With k == N every mode
returns all indices and draws nothing.

Modes, for rewards r (N,):
- `best_worst`: the ceil(k/2) highest and the floor(k/2) lowest rewards (disjoint; for odd k the
  extra one goes to the best side).
- `random`: k indices uniformly without replacement.
- `mean_deviation`: the k largest |r_i - mean(r)|.
- `extremes_random`: argmax r, then argmin r among the others, then k - 2 uniformly from the rest
  (k = 1 keeps only the best).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

MODES = ("best_worst", "random", "mean_deviation", "extremes_random")


def _order(values: Tensor, descending: bool) -> Tensor:
    """Indices sorting `values` (N,), equal values in increasing index order (stable sort)."""
    return torch.sort(values, descending=descending, stable=True).indices


def _draw(candidates: Tensor, count: int, generator: torch.Generator | None) -> Tensor:
    """`count` of `candidates` (M,) uniformly without replacement (draws nothing for count 0)."""
    if count == 0:
        return candidates[:0]
    permutation = torch.randperm(len(candidates), generator=generator)[:count]
    return candidates[permutation.to(candidates.device)]


def select(rewards: Tensor, k: int, mode: str = "best_worst", generator: torch.Generator | None = None) -> Tensor:
    """Indices (k,) of the kept candidates, ascending; see the module docstring for the modes.

    Args:
        rewards: (N,) finite scores of one prompt's candidates.
        k: how many to keep, 1 <= k <= N.
        mode: one of `MODES`.
        generator: CPU generator for the random modes.
    """
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}; allowed: {', '.join(MODES)}")
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D (N,), got shape {tuple(rewards.shape)}")
    n = rewards.shape[0]
    if not 1 <= k <= n:
        raise ValueError(f"k={k} must satisfy 1 <= k <= N={n}")
    if not torch.isfinite(rewards).all():
        raise ValueError("rewards must be finite")
    indices = torch.arange(n, device=rewards.device)  # (N,)
    if k == n:
        return indices
    if mode == "best_worst":
        by_reward = _order(rewards, descending=True)  # (N,)
        n_best = k - k // 2
        rest = by_reward[n_best:].sort().values  # back to index order, so ties favour lower indices
        worst = rest[_order(rewards[rest], descending=False)[: k // 2]]
        chosen = torch.cat([by_reward[:n_best], worst])
    elif mode == "random":
        chosen = _draw(indices, k, generator)
    elif mode == "mean_deviation":
        deviation = (rewards - rewards.mean()).abs()  # (N,)
        chosen = _order(deviation, descending=True)[:k]
    else:  # extremes_random
        best = _order(rewards, descending=True)[:1]
        others = indices[indices != best]  # (N-1,)
        worst = others[_order(rewards[others], descending=False)[:1]]
        rest = others[others != worst]  # (N-2,)
        chosen = torch.cat([best, worst, _draw(rest, k - 2, generator)]) if k >= 2 else best
    return chosen.sort().values


def select_per_group(
    rewards: Tensor, k: int, mode: str = "best_worst", generators: Sequence[torch.Generator | None] | None = None
) -> Tensor:
    """`select` applied to each row of rewards (P, N) with its own generator (`generators[p]`; the
    trainer derives each from its prompt's noise address, so a prompt's choice does not depend on
    which process holds it or on the other prompts); returns indices (P, k), each row ascending."""
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be 2-D (P, N), got shape {tuple(rewards.shape)}")
    if generators is None:
        generators = [None] * len(rewards)
    if len(generators) != len(rewards):
        raise ValueError(f"{len(generators)} generators for {len(rewards)} groups")
    rows = [select(row, k, mode, generator) for row, generator in zip(rewards, generators)]
    return torch.stack(rows) if rows else torch.empty(0, k, dtype=torch.long, device=rewards.device)
