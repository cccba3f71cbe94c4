"""Value backup on a search tree: a node's value from its children's values.

Three rules (`aggregate`), for children values v_1..v_K of a node:
- `mean`: (1/K)·Σ v_c, the Monte Carlo estimate of the expected terminal reward;
- `max`: max_c v_c, the best reward found below the node;
- `soft` (the soft Bellman update of Diffusion Tree Sampling, Jain et al., arXiv 2506.20701):
  V = (1/λ)·log((1/K)·Σ exp(λ·v_c)), the soft value of the reward-tilted target p_θ(x)·exp(λ·r(x)),
  estimated with the children as samples of p_θ(x_{t+1} | x_t). It lies between `mean` (λ → 0)
  and `max` (λ → ∞), and is computed with log-sum-exp so large λ·v does not overflow.
A leaf's value is its reward. `backup_path` recomputes the values of a leaf's ancestors, bottom up,
after a new reward arrives; nodes without a valued child keep no value (NaN).
"""

from __future__ import annotations

import math

import torch

BACKUPS = ("mean", "max", "soft")


def aggregate(child_values: torch.Tensor, rule: str, temperature: float = 1.0) -> float:
    """The value of a node from its children's values (K,) under `rule` (module doc); `temperature`
    is the soft rule's λ > 0."""
    if rule == "mean":
        return float(child_values.double().mean())
    if rule == "max":
        return float(child_values.max())
    if rule == "soft":
        if temperature <= 0:
            raise ValueError(f"the soft backup needs a temperature λ > 0, got {temperature}")
        scaled = temperature * child_values.double()  # (K,)
        return float((torch.logsumexp(scaled, 0) - math.log(len(child_values))) / temperature)
    raise ValueError(f"unknown backup {rule!r}; allowed: {', '.join(BACKUPS)}")


def backup_path(parent: list[int], children: list[list[int]], value: list[float], leaf: int, rule: str,
                temperature: float = 1.0) -> list[int]:
    """Recompute `value` (in place) of every ancestor of `leaf` from its valued children, bottom up;
    returns the path leaf → root (node indices). `parent[n]` is −1 at a root."""
    path, node = [leaf], parent[leaf]
    while node >= 0:
        valued = [value[c] for c in children[node] if not math.isnan(value[c])]
        value[node] = aggregate(torch.tensor(valued, dtype=torch.float64), rule, temperature) if valued else math.nan
        path.append(node)
        node = parent[node]
    return path
