"""Searches measured as samplers (issue: DTS as an exact sampler): the Gaussian-mixture flow of
branchdiff/bench/gmm.py against independent computations (its velocity from the autograd score of
the noisy density, its samples through the engine against p on a grid, the grid target against the
closed-form tilt of a linear reward), DTS's draw as importance resampling of its tree's leaves, DTS's
samples approaching p* as rows grow, SMC, the DTS levers, and `bench search --sampler`."""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import pytest
import torch

from branchdiff.bench.gmm import (
    GaussianMixture,
    GaussianMixtureAdapter,
    grid_target,
    grid_tv,
    make_reward,
    mmd2,
    ring_mixture,
    target_samples,
)
from branchdiff.bench.sampler import bandwidths, bench_sampler, draw_samples
from branchdiff.schedulers.marginals import exact_velocity_gain
from branchdiff.search.best_of_n import BestOfN
from branchdiff.search.dts import DTS, draw_leaf, selection_weights
from branchdiff.search.dts_is import DTSIS, draw_leaf_is, mass_weights
from branchdiff.search.run import run_search
from branchdiff.search.sample import SearchSettings, new_forest
from branchdiff.search.smc import run_smc

LAMBDA = 4.0
STEPS = 20


def _score(reward):
    return lambda points, _: (reward(points), {})


def test_the_velocity_is_the_noisy_density_s_exact_field():
    """v = E[ε − x0 | x_σ] = −σ·s − (x + σ²·s)/(1 − σ), with s = ∇ log p_σ(x) (Tweedie for ε, and x = (1−σ)·x0 + σ·ε),
    the score taken by autograd of the noisy mixture's log density; a single standard normal gives c(σ)·x."""
    mixture = ring_mixture()
    x = (3 * torch.randn(64, 2, dtype=torch.float64)).requires_grad_(True)
    sigma = torch.rand(64, dtype=torch.float64) * 0.9 + 0.05
    log_density = mixture._component_log_joint(x, sigma).logsumexp(1)  # log p_σ(x)
    score, = torch.autograd.grad(log_density.sum(), x)
    s = sigma[:, None]
    expected = -s * score - (x.detach() + s**2 * score) / (1 - s)
    assert torch.allclose(mixture.velocity(x.detach(), sigma), expected, atol=1e-9)
    normal = GaussianMixture(torch.ones(1, dtype=torch.float64), torch.zeros(1, 3, dtype=torch.float64), torch.ones(1, dtype=torch.float64))
    points = torch.randn(5, 3, dtype=torch.float64)
    gains = torch.tensor([exact_velocity_gain(float(v)) for v in sigma[:5]], dtype=torch.float64)
    assert torch.allclose(normal.velocity(points, sigma[:5]), gains[:, None] * points, atol=1e-12)


def test_the_engine_s_samples_of_the_mixture_match_p_on_the_grid():
    """3000 draws through the search engine (20 flow SDE steps, a = 0.7) against p's cell masses on a 12×12 grid:
    total variation below 0.08 (3000 exact draws give ≈ 0.04, the sampling noise; the discretisation adds the rest);
    exact draws of the same components with the weights reversed are far off (the grid tells mixtures apart)."""
    mixture = ring_mixture()
    adapter = GaussianMixtureAdapter(mixture)
    runs = 3000
    forest = new_forest(adapter, [""] * runs, SearchSettings("best-of-n", STEPS, STEPS, max_batch=runs))
    result = run_search(forest, BestOfN(), STEPS, _score(lambda p: torch.zeros(len(p))))
    samples = forest.leaf_latents([leaves[0] for leaves in result.leaves])
    assert samples.shape == (runs, 2)
    engine = grid_tv(samples, mixture)
    exact = grid_tv(mixture.sample(runs, torch.Generator().manual_seed(1)), mixture)
    reversed_weights = GaussianMixture(mixture.weights.flip(0), mixture.means, mixture.scales)
    wrong = grid_tv(reversed_weights.sample(runs, torch.Generator().manual_seed(1)), mixture)
    assert engine < 0.08 and exact < 0.06 and wrong > 0.2, (engine, exact, wrong)


def test_the_grid_target_equals_the_closed_form_tilt_of_a_linear_reward():
    """p(x)·exp(λ·u·x) for isotropic components is again a mixture: means μ_k + λ·s_k²·u, weights ∝
    π_k·exp(λ·u·μ_k + λ²·s_k²·|u|²/2); the grid target's cell masses equal that mixture's on the same grid."""
    mixture, u = ring_mixture(), torch.tensor([0.6, -0.8], dtype=torch.float64)
    centres, mass, _ = grid_target(mixture, lambda x: x.double() @ u, 1.5)
    s2 = mixture.scales**2
    tilted = GaussianMixture(torch.softmax(mixture.weights.log() + 1.5 * mixture.means @ u + 1.5**2 * s2 / 2, 0),
                             mixture.means + 1.5 * s2[:, None] * u, mixture.scales)
    assert torch.allclose(mass, torch.softmax(tilted.log_prob(centres), 0), atol=1e-12)


def test_mmd_is_near_zero_for_one_distribution_and_large_between_two():
    mixture = ring_mixture()
    reward, widths = make_reward("mode", mixture), bandwidths(mixture)
    target = target_samples(mixture, reward, LAMBDA, 600, seed=1)
    same = mmd2(target_samples(mixture, reward, LAMBDA, 600, seed=2), target, widths)
    base = mmd2(mixture.sample(600, torch.Generator().manual_seed(3)), target, widths)
    assert abs(same) < 0.02 and base > 0.5, (same, base)


def test_a_dts_draw_resamples_the_tree_s_leaves_by_reward_and_mass():
    """The descent's probability of each leaf (the product of softmax(λ·V) along its path, computed here node by node)
    equals exp(λ·r(leaf)) / Π K(n) over its ancestors, normalised over the tree's leaves; and draws follow it."""
    mixture = ring_mixture()
    forest = new_forest(GaussianMixtureAdapter(mixture), [""], SearchSettings("dts", 200, 8, temperature=LAMBDA))
    result = run_search(forest, DTS(temperature=LAMBDA), 200, _score(make_reward("mode", mixture)))
    leaves = result.leaves[0]
    descent, closed = [], []
    for leaf in leaves:
        probability, mass, node = 1.0, 1.0, leaf
        while node != 0:  # up to the virtual root
            parent = forest.parent[node]
            siblings = forest.children[parent]
            weights = selection_weights(torch.tensor([forest.value[c] for c in siblings], dtype=torch.float64), LAMBDA)
            probability *= float(weights[siblings.index(node)])
            mass /= len(siblings)
            node = parent
        descent.append(probability)
        closed.append(mass * math.exp(LAMBDA * forest.value[leaf]))
    assert len(leaves) > 20 and max(len(c) for c in forest.children[1:]) > 1  # a tree that branched below its roots
    assert torch.allclose(torch.tensor(descent), torch.tensor(closed) / sum(closed), atol=1e-12)
    assert sum(descent) == pytest.approx(1.0, abs=1e-12)
    generator = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.tensor([leaves.index(draw_leaf(forest, 0, LAMBDA, generator)) for _ in range(10_000)]), minlength=len(leaves))
    assert 0.5 * (counts / 10_000 - torch.tensor(descent)).abs().sum() < 0.05


def test_dts_samples_approach_the_tilted_target_as_rows_grow():
    """256 independent DTS trees on the 2-D mixture, reward: the rarest mode (λ = 4, p* puts ≈ 83% on it against p's 8%):
    the squared MMD of their draws to p* at 320 rows per sample is below 0.45 (the base model's is ≈ 1.17) and below
    its value at a quarter of the rows."""
    mixture = ring_mixture()
    adapter, reward = GaussianMixtureAdapter(mixture), make_reward("mode", mixture)
    reference = target_samples(mixture, reward, LAMBDA, 2000, seed=10_000)
    distance = {rows: mmd2(draw_samples("dts", adapter, reward, LAMBDA, rows, 256, seed=0)[0], reference, bandwidths(mixture)) for rows in (80, 320)}
    assert distance[320] < 0.45 and distance[320] < distance[80], distance


def test_dts_is_weights_sum_to_one_and_correct_most_of_dts_s_low_estimate_of_the_tilted_mass():
    """256 independent guided trees of 160 rows on the 2-D mixture's rarest mode: each tree's mass weights sum to 1 in
    expectation (their mean within 3 standard errors of 1: the cut's masses always sum to 1); DTS's own estimate of
    Z = E_p[exp(λ·r)], exp(λ·V(root)), is below Z (200 000 exact draws) by more than 5 of its standard errors; dts-is's,
    Σ w(ℓ)·exp(λ·r(ℓ)), is above DTS's by more than 4 standard errors of the difference (measured here: 6.15 ± 0.44 and
    3.42 ± 0.20 against 5.34; over 768 trees dts-is is within a standard error of the SDE's own law's value, docs/search.md);
    its draws are the trees' leaves."""
    mixture = ring_mixture()
    adapter, reward = GaussianMixtureAdapter(mixture), make_reward("mode", mixture)
    exact = float(torch.exp(LAMBDA * reward(mixture.sample(200_000, torch.Generator().manual_seed(5)))).mean())
    runs, budget = 256, 8 * STEPS
    settings = SearchSettings("dts-is", budget, STEPS, max_batch=runs, temperature=LAMBDA)
    forest, search = new_forest(adapter, [""] * runs, settings), DTSIS(temperature=LAMBDA)
    result = run_search(forest, search, budget, _score(reward), seed=3)
    masses = [mass_weights(forest, search, p, result.leaves[p]) for p in range(runs)]
    estimates = torch.stack([(m * torch.exp(LAMBDA * torch.tensor(result.rewards[p], dtype=torch.float64))).sum() for p, m in enumerate(masses)])
    totals = torch.stack([m.sum() for m in masses])
    assert abs(float(totals.mean()) - 1) < 3 * float(totals.std()) / runs**0.5 + 1e-12
    dts_forest = new_forest(adapter, [""] * runs, SearchSettings("dts", budget, STEPS, max_batch=runs, temperature=LAMBDA))
    run_search(dts_forest, DTS(temperature=LAMBDA), budget, _score(reward), seed=3)
    soft = torch.exp(LAMBDA * torch.tensor([dts_forest.value[p] for p in range(runs)], dtype=torch.float64))
    assert exact - float(soft.mean()) > 5 * float(soft.std()) / runs**0.5, (float(soft.mean()), exact)
    spread = ((float(estimates.var()) + float(soft.var())) / runs) ** 0.5
    assert float(estimates.mean()) - float(soft.mean()) > 4 * spread, (float(estimates.mean()), float(soft.mean()), exact)
    generator = torch.Generator().manual_seed(0)
    drawn = [draw_leaf_is(forest, search, p, result.leaves[p], result.rewards[p], generator) for p in range(runs)]
    assert all(leaf in result.leaves[p] for p, leaf in enumerate(drawn))


def test_dts_is_refuses_what_would_make_its_weights_wrong():
    mixture = ring_mixture()
    adapter, score = GaussianMixtureAdapter(mixture), _score(make_reward("mode", mixture))
    for settings, word in (({"greedy": True}, "greedy=True"), ({"widening": 1.0}, "widening=1.0"), ({"mix": 1.5}, "mix=1.5"),
                           ({"guided": False, "mix": 0.2}, "guided=False")):
        with pytest.raises(ValueError, match=rf"dts-is draws with the probabilities its descent had: .*{word}"):
            DTSIS(**settings)
    forest = new_forest(adapter, [""], SearchSettings("dts-is", 10 * STEPS, STEPS))
    with pytest.raises(ValueError, match=r"dts-is needs one selection in flight per prompt \(--parallel 1\)"):
        run_search(forest, DTSIS(), 10 * STEPS, score, parallel=2)


def test_smc_spends_its_rows_tilts_towards_the_target_and_survives_nan_rewards():
    mixture = ring_mixture()
    adapter, reward = GaussianMixtureAdapter(mixture), make_reward("mode", mixture)
    forest = new_forest(adapter, [""] * 64, SearchSettings("best-of-n", 80, STEPS, max_batch=256))
    leaves = run_smc(forest, 4, _score(reward), LAMBDA, seed=0)
    assert forest.nfe == [4 * STEPS] * 64 and all(forest.depth[leaf] == STEPS for leaf in leaves)
    preferred = int(torch.argmin(mixture.weights))
    share = float((mixture.responsibilities(forest.leaf_latents(leaves)).argmax(1) == preferred).double().mean())
    assert share > 0.3  # p puts 8% on the preferred mode; 4 particles with resampling move most runs there
    nan_forest = new_forest(adapter, [""] * 4, SearchSettings("best-of-n", 80, STEPS))
    assert len(run_smc(nan_forest, 4, _score(lambda p: torch.full((len(p),), math.nan)), LAMBDA)) == 4


def test_the_dts_levers_root_cap_widening_and_unguided_growth():
    mixture = ring_mixture()
    adapter, score = GaussianMixtureAdapter(mixture), _score(make_reward("mode", mixture))

    def grown(search: DTS, budget: int = 8 * 10):
        forest = new_forest(adapter, [""], SearchSettings("dts", budget, 10))
        run_search(forest, search, budget, score)
        return forest

    assert len(grown(DTS(max_children=2, root_children=6)).children[0]) == 6  # six initial noises, then branching below them
    assert len(grown(DTS(max_children=2)).children[0]) == 2
    widened = grown(DTS(max_children=2, widening=2.0), budget=30 * 10)
    assert len(widened.children[0]) >= math.ceil(2.0 * math.sqrt(widened.visits[0] - 1)) > 2  # ⌈2·√visits⌉ at the last widening
    assert widened.visits[0] == sum(widened.visits[c] for c in widened.children[0])
    forest = new_forest(adapter, [""], SearchSettings("dts", 100, 10))
    forest.add_children([0, 0])
    for node, value in zip(forest.children[0], (10.0, -10.0)):
        forest.value[node] = value
    picks = {DTS(max_children=2, guided=False).select(forest, 0, torch.Generator().manual_seed(s)) for s in range(40)}
    assert picks == set(forest.children[0])  # uniform: both children, whatever their values (guided: the first, always)
    assert {DTS(max_children=2).select(forest, 0, torch.Generator().manual_seed(s)) for s in range(40)} == {forest.children[0][0]}
    with pytest.raises(ValueError, match="root_children ≥ 1"):
        DTS(root_children=0)


def test_bench_search_sampler_writes_distances_a_plot_and_a_table(tmp_path):
    result = bench_sampler(2, 2, tmp_path / "sampler.json", tmp_path, testbeds=((2, "sharp"),), runs=32, law_draws=2048)
    assert result["grid_nfe"] == [20, 40]
    entry = result["testbeds"]["2-D sharp"]
    assert set(entry) == {"dts", "dts-unguided", "dts-is", "best-of-n-is", "smc", "exact"}
    assert all(len(e["seeds"]) == 2 and len(e["mean"]) == 2 for e in entry.values())
    assert entry["dts"]["seeds"][0][0] == entry["best-of-n-is"]["seeds"][0][0]  # one image: every method is one draw of p, the same noise
    assert json.loads((tmp_path / "sampler.json").read_text())["testbeds"]["2-D sharp"]["smc"]["mean"] == entry["smc"]["mean"]
    assert (tmp_path / "sampler.png").stat().st_size > 10_000 and "| 2-D sharp | smc |" in (tmp_path / "sampler.md").read_text()
    assert "best" not in entry["smc"] and len(entry["dts-is"]["best"]["mean"]) == 2 and 0 <= entry["dts-is"]["best"]["mean"][1] <= 1
    assert "| 2-D sharp | dts-is: best reward |" in (tmp_path / "sampler.md").read_text()
    # SMC scores every particle's x̂0 at each of the 20 steps and its image: 21 calls a particle; best-of-N one an image
    calls = result["reward_calls"]["2-D sharp"]
    assert calls["smc"] == [21.0, 42.0] and calls["best-of-n-is"] == [1.0, 2.0] and "| 2-D sharp | smc: reward calls (= decodes) | 21.0 | 42.0 |" in (tmp_path / "sampler.md").read_text()
    assert "| 2-D sharp | smc: cost, a call as a row | 41.0 | 82.0 |" in (tmp_path / "sampler.md").read_text()
    with pytest.raises(ValueError, match="known samplers"):
        bench_sampler(2, 1, None, tmp_path, samplers=["nope"])


def test_bench_search_sampler_testbeds_are_chosen_by_name(tmp_path, capsys):
    from branchdiff.bench.sampler import parse_testbeds
    from branchdiff.cli import main

    assert parse_testbeds("2-D-mode, 16-D-mode") == ((2, "mode"), (16, "mode"))
    assert main(["bench", "search", "--sampler", "--testbeds", "2-D-nope", "--out", str(tmp_path / "x")]) == 2
    assert "--testbeds '2-D-nope': unknown 2-D-nope; allowed: 2-D-mode, 2-D-sharp, 2-D-smooth, 16-D-mode" in capsys.readouterr().err
    assert main(["bench", "search", "--testbeds", "2-D-mode", "--out", str(tmp_path / "y")]) == 2
    assert "bench search: --testbeds is the mixtures of bench search --sampler; add --sampler or leave --testbeds out" in capsys.readouterr().err
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_the_samplers_are_also_measured_against_the_sde_s_own_law():
    """2-D mode, 128 runs of 4 images: best-of-N's estimate of the tilted mass, the mean of exp(λ·r) over its images, is
    unbiased under the SDE's own law q, so it lies within 3 standard errors of E_q[exp(λ·r)] from 8192 other SDE
    samples; at one image every tree sampler's estimate is exp(λ·r) of the same first image; the distances to q* are
    there for every sampler and the floor, and the floor is far below the base model's."""
    from branchdiff.bench.sampler import format_law, law_samples

    result = bench_sampler(4, 1, None, Path(tempfile.mkdtemp()), samplers=["dts", "dts-is", "best-of-n-is"], testbeds=((2, "mode"),), runs=128,
                           law_draws=8192)
    law = result["law"]["2-D mode"]
    z_q, estimate = law["z_q"], law["estimates"]["best-of-n-is"][-1]
    assert abs(estimate["mean"] - z_q["mean"]) < 3 * math.hypot(estimate["se"], z_q["se"]), (estimate, z_q)
    assert law["estimates"]["dts"][0] == law["estimates"]["dts-is"][0] == law["estimates"]["best-of-n-is"][0]
    distances = law["distances"]
    assert set(distances) == {"dts", "dts-is", "best-of-n-is", "exact-q*"} and distances["exact-q*"]["mean"][0] < 0.2 * distances["dts"]["mean"][0]
    assert "SE from E_q" in format_law(result) and law["q_star_ess"] > 500
    samples = law_samples(GaussianMixtureAdapter(ring_mixture()), 300, seed=3, chunk=128)  # three forests: the same as three separate calls
    assert samples.shape == (300, 2) and torch.equal(samples[128:256], law_samples(GaussianMixtureAdapter(ring_mixture()), 128, seed=4))
