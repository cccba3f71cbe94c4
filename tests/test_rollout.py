"""Rollouts: exact regeneration from addressable noise, split-edge densities, NFE, per-node mode."""

import pytest
import torch

from branchdiff import noise
from branchdiff.rollout import NoiseAddress, SamplerSettings, grow, logprob_std_scale, regenerate
from branchdiff.tree import Split, TreeSpec, build_tree
from branchdiff.schedulers.flow import gaussian_log_prob, sigma_schedule, step

PROMPTS = ["two red circles on the left", "one blue square at the top", "three green triangles at the bottom"]
SPEC = TreeSpec(num_steps=5, splits=(Split(0, 2), Split(2, 3, 1.5)), split_noise_scale=2.0)
ADDRESS = NoiseAddress(run_seed=7, iteration=3, prompt_keys=(10, 11, 12))


def _grow(adapter, spec=SPEC, settings=SamplerSettings(sde="dance", noise_level=0.3, max_batch=8), **kw):
    tree = build_tree(spec, len(PROMPTS))
    embeds = adapter.encode_prompts(PROMPTS)
    return grow(adapter, tree, embeds, sigma_schedule(spec.num_steps, 3.0), settings, ADDRESS, **kw), embeds


def _index(tree):
    return {(p, path): i for i, (p, path) in enumerate(zip(tree.prompt.tolist(), tree.paths))}


def test_regenerating_random_leaves_is_bit_exact(tiny_adapter):
    settings = SamplerSettings(sde="dance", noise_level=0.3, max_batch=8)
    rollout, embeds = _grow(tiny_adapter, settings=settings)
    tree = rollout.tree
    leaves = tree.leaf_index[torch.randperm(len(tree.leaf_index), generator=torch.Generator().manual_seed(0))[:5]]
    sub = regenerate(tiny_adapter, tree, leaves, embeds, rollout.sigmas, settings, ADDRESS)
    where = _index(sub.tree)
    for leaf in leaves.tolist():
        node = where[(tree.prompt[leaf].item(), tree.paths[leaf])]
        assert torch.equal(sub.latents[node], rollout.latents[leaf])
        assert sub.log_prob[node] == rollout.log_prob[leaf]
    assert sub.tree.num_nodes < tree.num_nodes  # only the union of root paths was grown


def test_regenerating_one_node_alone_is_bit_exact(tiny_adapter):
    settings = SamplerSettings(sde="flow", noise_level=0.7, max_batch=8)
    rollout, embeds = _grow(tiny_adapter, settings=settings)
    node = rollout.tree.level_start[3] + 4  # an inner node at depth 3
    sub = regenerate(tiny_adapter, rollout.tree, torch.tensor([node]), embeds, rollout.sigmas, settings, ADDRESS)
    assert sub.tree.num_nodes == 4  # root, depth 1, depth 2, the node
    assert torch.equal(sub.latents[-1], rollout.latents[node])


def test_root_noise_is_the_addressed_draw(tiny_adapter):
    rollout, _ = _grow(tiny_adapter)
    expected = noise.draw("init", 7, 3, [11], [(0,)], tiny_adapter.latent_shape)
    root_of_prompt_1 = rollout.tree.level_start[0] + 1
    assert torch.equal(rollout.latents[root_of_prompt_1], expected[0])


def test_split_edge_log_probs_follow_the_convention(tiny_adapter):
    for convention in ("sampled", "anchor"):
        settings = SamplerSettings(sde="dance", noise_level=0.3, max_batch=8, split_logprob=convention)
        rollout, embeds = _grow(tiny_adapter, settings=settings)
        tree = rollout.tree
        child = tree.level_start[1]  # a child of the step-0 split (noise scale 2.0)
        parent = tree.parent[child].item()
        x = rollout.latents[parent : parent + 1]
        v = tiny_adapter.predict_velocity(x, rollout.sigmas[:1], {k: t[:1] for k, t in embeds.items()})
        base = step("dance", x, v, rollout.sigmas[0], rollout.sigmas[1], torch.zeros_like(x), 0.3)
        scale = 2.0 if convention == "sampled" else 1.0
        expected = gaussian_log_prob(rollout.latents[child : child + 1], base.mean, base.std * scale)
        assert rollout.log_prob[child].item() == pytest.approx(expected.item(), abs=1e-4)
        assert rollout.std[child].item() == pytest.approx(base.std.item() * scale, rel=1e-6)
    # under "sampled", a split edge's noise is standard normal under its own density: logp ≈ -½ - log std - ½ log 2π
    sampled = logprob_std_scale(tree, SamplerSettings())
    assert sampled[tree.level(1)].unique().tolist() == [2.0] and sampled[tree.level(3)].unique().tolist() == [1.5]
    assert sampled[tree.level(2)].unique().tolist() == [1.0]


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
