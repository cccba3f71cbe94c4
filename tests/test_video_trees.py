"""Trees over videos: nothing in the rollout engine, the trees, fusion, depth-wise advantages or
regeneration assumes an image. A toy video model with latents (C, F, H, W) grows a tree with a Mix
window through the engine, and every node's latent and log-prob equal an independent float64
computation along its path (its parent's latent, the model's velocity, the SDE's mean and std, the
noise at its address); fused rewards and depth-wise advantages equal a per-node loop; a leaf
regrown alone is bit for bit the one grown in the tree; a DTS* search over the same latents keeps its
budget and its winner regrows from its noise path. (Issue 28's first piece: no code had to change.)"""

from __future__ import annotations

import math

import pytest
import torch

from branchdiff.core import noise
from branchdiff.core.advantage import depthwise_advantages, fuse_rewards
from branchdiff.core.rollout import NoiseAddress, SamplerSettings, grow, regenerate
from branchdiff.core.tree import Split, TreeSpec, build_tree
from branchdiff.models.base import ModelAdapter
from branchdiff.schedulers.schedule import FlowSchedule

SHAPE = (3, 5, 4, 6)  # (C, F', H', W'): channels, latent frames, height, width (non-square)
SPEC = TreeSpec(num_steps=4, splits=(Split(0, 2), Split(2, 2, noise_level=0.9)), roots=2, sde_steps=frozenset({1}))  # a Mix window
SETTINGS = SamplerSettings(sde="dance", noise_level=0.5, max_batch=5)  # batches cut across the levels
ADDRESS = NoiseAddress(run_seed=3, iteration=2, prompt_keys=(7, 8))
PROMPTS = ["a red circle moving left", "two blue squares moving up"]


class VideoToy(ModelAdapter):
    """v = W ⋆ x + t·c + p: a 1×1×1 3-D convolution over (C, F, H, W), a time direction and a per-prompt offset."""

    family = "video-toy"
    pipeline_class_name = ""
    lora_target_sets: dict = {}

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.denoiser = torch.nn.Conv3d(SHAPE[0], SHAPE[0], kernel_size=1)
        self.time_direction = torch.randn(SHAPE[0])
        self.device = torch.device("cpu")

    @property
    def latent_shape(self) -> tuple[int, ...]:
        return SHAPE

    def schedule(self, num_steps: int, shift: float | None = None) -> FlowSchedule:
        return FlowSchedule.shifted(num_steps, shift or 1.0, 1.0)

    def encode_prompts(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        return {"offset": torch.stack([torch.full((SHAPE[0],), 0.1 * len(p)) for p in prompts])}

    def forward(self, latents: torch.Tensor, times: torch.Tensor, embeds: dict[str, torch.Tensor], guidance: float) -> torch.Tensor:
        shape = (-1, SHAPE[0], 1, 1, 1)
        return self.denoiser(latents) + times.view(-1, 1, 1, 1, 1) * self.time_direction.view(shape) + embeds["offset"].view(shape)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return latents.transpose(1, 2).clamp(0, 1)  # (B, F, C, H, W)


def _velocity64(model: VideoToy, x: torch.Tensor, t: float, prompt: str) -> torch.Tensor:
    """The toy's velocity in float64, written out per voxel: Σ_c' W[c, c']·x[c'] + b[c] + t·d[c] + p[c]."""
    weight = model.denoiser.weight.detach().double()[:, :, 0, 0, 0]  # (C, C)
    bias = model.denoiser.bias.detach().double()
    mixed = torch.einsum("ij,jfhw->ifhw", weight, x)
    return mixed + (bias + t * model.time_direction.double() + 0.1 * len(prompt)).view(-1, 1, 1, 1)


def _dance64(x, v, sigma, sigma_next, eta):
    """DanceGRPO's step in float64: μ = x + Δ·v − ½η²·ŝ·Δ with ŝ = −(x − (1 − σ)·x̂0)/σ², x̂0 = x − σ·v; std = η·√(σ − σ')."""
    delta = sigma_next - sigma
    x0 = x - sigma * v
    score = -(x - (1 - sigma) * x0) / sigma**2
    return x + delta * v - 0.5 * eta**2 * score * delta, eta * math.sqrt(sigma - sigma_next)


def test_a_tree_on_video_latents_equals_the_per_node_computation():
    model = VideoToy()
    tree = build_tree(SPEC, len(PROMPTS))
    schedule = model.schedule(SPEC.num_steps, 3.0)
    with torch.no_grad():
        rollout = grow(model, tree, model.encode_prompts(PROMPTS), schedule, SETTINGS, ADDRESS)
    assert rollout.latents.shape == (tree.num_nodes, *SHAPE)
    sigmas = schedule.sigmas.double().tolist()
    keys = [ADDRESS.prompt_keys[p] for p in tree.prompt.tolist()]
    for node in range(tree.num_nodes):
        path, prompt = tree.paths[node], PROMPTS[int(tree.prompt[node])]
        if tree.depth[node] == 0:
            expected = noise.draw("init", ADDRESS.run_seed, ADDRESS.iteration, [keys[node]], [path], SHAPE)[0].double()
            assert torch.equal(rollout.latents[node], expected.float())
            continue
        parent, depth = int(tree.parent[node]), int(tree.depth[node]) - 1  # the step taken into this node
        x = rollout.latents[parent].double()
        v = _velocity64(model, x, float(schedule.model_times[depth]), prompt)
        sigma, sigma_next = sigmas[depth], sigmas[depth + 1]
        if SPEC.is_sde(depth):
            eta = SPEC.noise_level(depth, SETTINGS.noise_level)
            mean, std = _dance64(x, v, sigma, sigma_next, eta)
            eps = noise.draw("step", ADDRESS.run_seed, ADDRESS.iteration, [keys[node]], [path], SHAPE)[0].double()
            expected = mean + std * eps
            log_prob = (-((expected - mean) ** 2) / (2 * std**2) - math.log(std) - 0.5 * math.log(2 * math.pi)).mean()
            assert rollout.log_prob[node].item() == pytest.approx(log_prob.item(), abs=1e-4)
        else:
            expected = x + (sigma_next - sigma) * v
            assert rollout.log_prob[node].item() == 0.0
        assert torch.allclose(rollout.latents[node].double(), expected, rtol=1e-5, atol=1e-5), node

    # fusion (the mean of the leaves below each node) and depth-wise advantages (z-scores among a prompt's nodes of one depth)
    leaf_rewards = torch.rand(len(tree.leaf_index), generator=torch.Generator().manual_seed(1))
    fused = fuse_rewards(tree, leaf_rewards, rollout.log_prob, "mean", 1.0)
    reward_of_leaf = dict(zip(tree.leaf_index.tolist(), leaf_rewards.tolist()))
    below = {n: [] for n in range(tree.num_nodes)}
    for leaf in tree.leaf_index.tolist():
        node = leaf
        while node >= 0:
            below[node].append(reward_of_leaf[leaf])
            node = int(tree.parent[node])
    assert all(fused[n].item() == pytest.approx(sum(r) / len(r), abs=1e-6) for n, r in below.items())
    advantages = depthwise_advantages(tree, fused, "tree")
    for n in range(tree.num_nodes):  # a group is a prompt's nodes at one depth, over its roots' trees
        peers = [m for m in range(tree.num_nodes) if tree.prompt[m] == tree.prompt[n] and tree.depth[m] == tree.depth[n]]
        values = torch.tensor([fused[m].item() for m in peers], dtype=torch.float64)
        if len(peers) < 2 or values.std() == 0:
            continue
        expected = (fused[n].item() - values.mean().item()) / (values.std().item() + 1e-8)
        assert advantages[n].item() == pytest.approx(expected, abs=1e-4), n


def test_a_video_leaf_regrown_alone_is_bit_for_bit_the_trees():
    model = VideoToy()
    settings = SamplerSettings(sde="dance", noise_level=0.5, max_batch=5, exact=True)
    tree = build_tree(SPEC, len(PROMPTS))
    embeds = model.encode_prompts(PROMPTS)
    with torch.no_grad():
        rollout = grow(model, tree, embeds, model.schedule(SPEC.num_steps, 3.0), settings, ADDRESS)
        leaf = tree.leaf_index[5:6]
        alone = regenerate(model, tree, leaf, embeds, rollout.schedule, settings, ADDRESS)
    regrown = alone.latents[alone.tree.leaf_index[0]]
    assert regrown.shape == SHAPE and torch.equal(regrown, rollout.latents[int(leaf)])


def test_a_search_over_video_latents_stays_in_budget_and_its_winner_regrows_exactly():
    """DTS* on the toy video model, its reward a function of the decoded frames (B, F, C, H, W)."""
    from branchdiff.search.forest import SearchForest, regenerate_path
    from branchdiff.search.registry import make_search
    from branchdiff.search.run import run_search
    from branchdiff.search.sample import SEARCH_ITERATION, encode_each

    model, steps = VideoToy(), 3
    settings = SamplerSettings(sde="flow", noise_level=0.7, max_batch=8)
    forest = SearchForest(model, TreeSpec(steps), model.schedule(steps), settings, NoiseAddress(5, SEARCH_ITERATION, (0, 1)),
                          encode_each(model, PROMPTS))

    def brightness(videos: torch.Tensor, prompt_index: list[int]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        assert videos.shape[1:] == (SHAPE[1], SHAPE[0], *SHAPE[2:])  # frames, channels, height, width
        return videos.flatten(1).mean(1), {}

    with torch.no_grad():
        result = run_search(forest, make_search("dts-star", max_children=2), 5 * steps, brightness, seed=1)
        for p in range(len(PROMPTS)):
            assert forest.nfe[p] <= 5 * steps
            best = result.best(p)[0]
            again = regenerate_path(model, forest.spec, forest.schedule, forest.settings, 5, SEARCH_ITERATION, p,
                                    encode_each(model, [PROMPTS[p]]), forest.path[best])
            assert again.shape == SHAPE and torch.equal(again, forest.latent[best])
