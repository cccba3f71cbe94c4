"""Rollouts: exact regeneration from addressable noise, split-edge noise levels and densities, NFE,
per-node mode."""

import math
from dataclasses import replace

import pytest
import torch

from branchdiff.core import noise
from branchdiff.core.rollout import NoiseAddress, SamplerSettings, grow, regenerate
from branchdiff.core.tree import Split, TreeSpec, build_tree

PROMPTS = ["two red circles on the left", "one blue square at the top", "three green triangles at the bottom"]
SPEC = TreeSpec(num_steps=5, splits=(Split(0, 2), Split(2, 3, noise_level=0.9)), split_noise_level=0.6)
ADDRESS = NoiseAddress(run_seed=7, iteration=3, prompt_keys=(10, 11, 12))


SETTINGS = SamplerSettings(sde="dance", noise_level=0.3, max_batch=8)


def _grow(adapter, spec=SPEC, settings=SETTINGS, **kw):
    tree = build_tree(spec, len(PROMPTS))
    embeds = adapter.encode_prompts(PROMPTS)
    return grow(adapter, tree, embeds, adapter.schedule(spec.num_steps, 3.0), settings, ADDRESS, **kw), embeds


def _index(tree):
    return {(p, path): i for i, (p, path) in enumerate(zip(tree.prompt.tolist(), tree.paths))}


def test_regenerating_random_leaves_is_bit_exact(tiny_adapter):
    settings = SamplerSettings(sde="dance", noise_level=0.3, max_batch=8, exact=True)
    rollout, embeds = _grow(tiny_adapter, settings=settings)
    tree = rollout.tree
    leaves = tree.leaf_index[torch.randperm(len(tree.leaf_index), generator=torch.Generator().manual_seed(0))[:5]]
    sub = regenerate(tiny_adapter, tree, leaves, embeds, rollout.schedule, settings, ADDRESS)
    where = _index(sub.tree)
    for leaf in leaves.tolist():
        node = where[(tree.prompt[leaf].item(), tree.paths[leaf])]
        assert torch.equal(sub.latents[node], rollout.latents[leaf])
        assert sub.log_prob[node] == rollout.log_prob[leaf]
    assert sub.tree.num_nodes < tree.num_nodes  # only the union of root paths was grown


def test_regenerating_one_node_alone_is_bit_exact(tiny_adapter):
    settings = SamplerSettings(sde="flow", noise_level=0.7, max_batch=8, exact=True)
    rollout, embeds = _grow(tiny_adapter, settings=settings)
    node = rollout.tree.level_start[3] + 4  # an inner node at depth 3
    sub = regenerate(tiny_adapter, rollout.tree, torch.tensor([node]), embeds, rollout.schedule, settings, ADDRESS)
    assert sub.tree.num_nodes == 4  # root, depth 1, depth 2, the node
    assert torch.equal(sub.latents[-1], rollout.latents[node])


def test_root_noise_is_the_addressed_draw(tiny_adapter):
    rollout, _ = _grow(tiny_adapter)
    expected = noise.draw("init", 7, 3, [11], [(0,)], tiny_adapter.latent_shape)
    root_of_prompt_1 = rollout.tree.level_start[0] + 1
    assert torch.equal(rollout.latents[root_of_prompt_1], expected[0])


def _dance_float64(x, v, sigma, sigma_next, eta):
    """DanceGRPO's step in float64, written out from the paper's formula (independent of schedulers.flow)."""
    x, v, sigma, sigma_next = x.double(), v.double(), float(sigma), float(sigma_next)
    delta = sigma_next - sigma
    x0_hat = x - sigma * v
    score = -(x - (1 - sigma) * x0_hat) / sigma**2
    return x + delta * v - 0.5 * eta**2 * score * delta, eta * math.sqrt(sigma - sigma_next)


@pytest.mark.parametrize("multiplier", [1.0, 4.0])
def test_split_edges_use_their_noise_level(tiny_adapter, multiplier):
    """Each edge's mean and std follow its step's level (split default 0.6 at step 0, the split's own
    0.9 at step 2, the sampler's 0.3 elsewhere), against a float64 computation. The stored log-prob is
    the density sampled, log N(x'; μ, std²) = mean(-ε²/2) - log std - ½ log 2π; under the release's
    noise-only multiplier m the draw is μ + m·std·ε and the log-prob keeps std: mean(-(mε)²/2) - log std - ..."""
    spec = replace(SPEC, anchor_noise_multiplier=multiplier)
    rollout, embeds = _grow(tiny_adapter, spec=spec)
    tree = rollout.tree
    for depth, level, on_split in ((0, 0.6, True), (1, 0.3, False), (2, 0.9, True), (3, 0.3, False)):
        child = tree.level_start[depth + 1] + 1  # a node of prompt 0
        parent = tree.parent[child].item()
        x = rollout.latents[parent : parent + 1]
        v = tiny_adapter.predict(x, rollout.schedule.sigmas[depth : depth + 1], {k: t[:1] for k, t in embeds.items()})
        mean, std = _dance_float64(x, v, rollout.schedule.sigmas[depth], rollout.schedule.sigmas[depth + 1], level)
        eps = noise.draw("step", ADDRESS.run_seed, ADDRESS.iteration, [ADDRESS.prompt_keys[0]], [tree.paths[child]], x.shape[1:]).double()
        kick = multiplier if on_split else 1.0
        assert torch.allclose(rollout.latents[child : child + 1].double(), mean + kick * std * eps, atol=1e-5)
        assert rollout.std[child].item() == pytest.approx(std, rel=1e-6)
        assert rollout.noise_level[child].item() == pytest.approx(level)
        density = (-(kick * eps) ** 2 / 2).mean() - math.log(std) - 0.5 * math.log(2 * math.pi)
        assert rollout.log_prob[child].item() == pytest.approx(density.item(), abs=1e-4)


def test_nfe_counts_real_and_computed_rows(tiny_adapter):
    """exact=True pads every forward to max_batch rows; nfe_computed says what that cost. The default
    (regression: it was exact=True, so narrow tree levels cost as much as the chain's full ones)
    computes only the real rows."""
    from branchdiff.settings.load import load_config

    assert SamplerSettings().exact is False and load_config(None).sampling.exact is False
    fast, _ = _grow(tiny_adapter, settings=SamplerSettings(sde="dance", noise_level=0.3, max_batch=8))
    padded, _ = _grow(tiny_adapter, settings=SamplerSettings(sde="dance", noise_level=0.3, max_batch=8, exact=True))
    levels = [3 * n for n in SPEC.level_sizes()[:-1]]  # rows per level: 3, 6, 6, 18, 18
    assert fast.nfe == padded.nfe == fast.nfe_computed == sum(levels) == 51
    assert padded.nfe_computed == sum(math.ceil(n / 8) * 8 for n in levels) == 72
    assert torch.allclose(fast.latents, padded.latents, atol=1e-4)


def test_nfe_and_chain_rollout(tiny_adapter):
    rollout, _ = _grow(tiny_adapter)
    assert rollout.nfe == 3 * SPEC.rollout_nfe
    chain = TreeSpec(num_steps=4, roots=3)
    rollout, _ = _grow(tiny_adapter, spec=chain)
    assert rollout.nfe == 3 * 3 * 4 and rollout.leaf_latents.shape == (9, 3, 32, 32)
    assert (rollout.log_prob[rollout.tree.depth > 0] != 0).all()


def test_per_node_expansion_builds_the_same_tree(tiny_adapter):
    settings = SamplerSettings(sde="dance", noise_level=0.3, max_batch=8, exact=False)
    batched, _ = _grow(tiny_adapter, settings=settings)
    per_node, _ = _grow(tiny_adapter, settings=settings, per_node=True)
    assert torch.allclose(batched.latents, per_node.latents, atol=1e-4)
    assert torch.allclose(batched.log_prob, per_node.log_prob, atol=1e-3)


def test_cps_last_step_is_deterministic(tiny_adapter):
    rollout, _ = _grow(tiny_adapter, spec=TreeSpec(3, roots=2), settings=SamplerSettings(sde="cps", noise_level=0.8, max_batch=8))
    leaves = rollout.tree.level(3)
    assert (rollout.std[leaves] == 0).all() and (rollout.log_prob[leaves] == 0).all()
    assert (rollout.std[rollout.tree.level(2)] > 0).all()


def test_noise_addresses_are_distinct_and_stable():
    a = noise.address_seed("step", 0, 1, 2, (0, 1))
    assert a == noise.address_seed("step", 0, 1, 2, (0, 1))
    others = {noise.address_seed("step", 0, 1, 2, (1, 0)), noise.address_seed("init", 0, 1, 2, (0, 1)),
              noise.address_seed("step", 0, 2, 2, (0, 1)), noise.address_seed("step", 1, 1, 2, (0, 1))}
    assert a not in others and len(others) == 4 and 0 <= a < 2**63
    draw = noise.draw("step", 0, 1, [2, 2], [(0, 1), (0, 1)], (4,))
    assert torch.equal(draw[0], draw[1])  # same address, same noise
