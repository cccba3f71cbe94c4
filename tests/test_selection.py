"""Contrastive subset selection on hand-made reward vectors (ties included)."""

from __future__ import annotations

import pytest
import torch

from branchdiff.explore.selection import MODES, select, select_per_group

torch.set_num_threads(1)

TIED = torch.tensor([1.0, 3.0, 3.0, 0.0, 0.0, 2.0])  # best: 1, 2 (tie), 5; worst: 3, 4 (tie), 0


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize(
    "k, expected",
    [(1, [1]), (2, [1, 3]), (3, [1, 2, 3]), (4, [1, 2, 3, 4]), (5, [1, 2, 3, 4, 5]), (6, [0, 1, 2, 3, 4, 5])],
)
def test_best_worst_exact_indices_with_ties(k, expected):
    chosen = select(TIED, k, "best_worst")
    assert chosen.tolist() == expected and chosen.dtype == torch.long


def test_best_worst_sides_are_disjoint_when_all_rewards_tie():
    flat = torch.full((4,), 5.0)
    assert select(flat, 2, "best_worst").tolist() == [0, 1]
    assert select(flat, 3, "best_worst").tolist() == [0, 1, 2]


def test_mean_deviation_exact_indices_with_ties():
    # mean 1.5, |r - mean| = [0.5, 1.5, 1.5, 1.5, 1.5, 0.5]
    assert select(TIED, 2, "mean_deviation").tolist() == [1, 2]
    assert select(TIED, 4, "mean_deviation").tolist() == [1, 2, 3, 4]
    assert select(TIED, 5, "mean_deviation").tolist() == [0, 1, 2, 3, 4]
    # mean 5, |r - mean| = [5, 5, 1, 1, 0]
    assert select(torch.tensor([0.0, 10.0, 4.0, 6.0, 5.0]), 3, "mean_deviation").tolist() == [0, 1, 2]


def test_extremes_random_keeps_both_extremes_and_draws_the_rest():
    assert select(TIED, 1, "extremes_random", seeded(0)).tolist() == [1]
    assert select(TIED, 2, "extremes_random", seeded(0)).tolist() == [1, 3]
    seen = set()
    for seed in range(20):
        chosen = select(TIED, 4, "extremes_random", seeded(seed)).tolist()
        assert {1, 3} <= set(chosen) and len(set(chosen)) == 4 and chosen == sorted(chosen)
        assert chosen == select(TIED, 4, "extremes_random", seeded(seed)).tolist()
        seen.add(tuple(chosen))
    assert len(seen) > 1
    assert select(torch.tensor([2.0, 2.0]), 2, "extremes_random").tolist() == [0, 1]


def test_random_is_deterministic_per_seed_and_uniform():
    rewards = torch.arange(10.0)
    first = select(rewards, 3, "random", seeded(42))
    assert torch.equal(first, select(rewards, 3, "random", seeded(42)))
    assert first.tolist() == sorted(set(first.tolist()))
    generator, counts = seeded(1), torch.zeros(6)
    for _ in range(2000):
        counts[select(TIED, 3, "random", generator)] += 1
    assert ((counts - 1000).abs() < 5 * (2000 * 0.5 * 0.5) ** 0.5).all()  # each index kept w.p. 1/2


@pytest.mark.parametrize("mode", MODES)
def test_k_equal_n_returns_everything_and_k_one_is_valid(mode):
    assert select(TIED, 6, mode, seeded(0)).tolist() == list(range(6))
    assert len(select(TIED, 1, mode, seeded(0))) == 1
    assert select(torch.tensor([0.3]), 1, mode).tolist() == [0]


def test_invalid_arguments():
    with pytest.raises(ValueError, match=r"k=7 .*N=6"):
        select(TIED, 7, "best_worst")
    with pytest.raises(ValueError, match=r"k=0 .*N=6"):
        select(TIED, 0, "random")
    with pytest.raises(ValueError, match="best_worst, random, mean_deviation, extremes_random"):
        select(TIED, 2, "top")
    with pytest.raises(ValueError, match="1-D"):
        select(TIED[None], 2, "best_worst")
    with pytest.raises(ValueError, match="finite"):
        select(torch.tensor([0.0, float("nan")]), 1, "best_worst")
    with pytest.raises(ValueError, match="2-D"):
        select_per_group(TIED, 2, "best_worst")


@pytest.mark.parametrize("mode", MODES)
def test_per_group_matches_row_by_row(mode):
    torch.manual_seed(0)
    rewards = torch.randn(3, 8)
    batched = select_per_group(rewards, 4, mode, [seeded(7 + p) for p in range(3)])
    rows = torch.stack([select(row, 4, mode, seeded(7 + p)) for p, row in enumerate(rewards)])
    assert batched.shape == (3, 4) and batched.dtype == torch.long and torch.equal(batched, rows)
    assert select_per_group(TIED[None], 3, "best_worst").tolist() == [[1, 2, 3]]

