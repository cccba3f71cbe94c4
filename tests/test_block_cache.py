"""The rollouts' node-indexed first-block cache (branchdiff/models/block_cache.py, `sampling.block_cache`)."""

from __future__ import annotations

import math

import pytest
import torch

from branchdiff.core.engine import NoiseAddress, SamplerSettings, transition
from branchdiff.core.rollout import grow
from branchdiff.core.tree import Split, TreeSpec, build_tree
from branchdiff.models.block_cache import BlockCache, check_cacheable

PROMPTS = ["two red circles moving left", "a blue square moving up"]
SPEC = TreeSpec(6, (Split(0, 2), Split(2, 2)), 1)  # 2 prompts × 4 leaves, SDE at every step


@pytest.fixture(scope="module")
def video_adapter():
    from branchdiff.models.tiny_video import TinyVideoAdapter

    return TinyVideoAdapter.random(seed=0)


def _rollout(adapter, threshold: float, max_batch: int = 64, per_node: bool = False):
    tree = build_tree(SPEC, len(PROMPTS))
    settings = SamplerSettings(max_batch=max_batch, block_cache=threshold)
    address = NoiseAddress(3, 0, (0, 1))
    embeds = adapter.encode_prompts(PROMPTS)
    return grow(adapter, tree, embeds, adapter.schedule(SPEC.num_steps), settings, address, per_node), embeds, settings, address


def test_each_node_follows_diffusers_first_block_cache_along_its_root_path(video_adapter):
    """One node per forward: every node's latent is the transition from its parent's latent and the output that
    diffusers' own FirstBlockCache hooks give when the node's root path is replayed as one chain (a fresh cache a
    path, fed the path's latents in order) — the node-indexed cache carries each parent's state to its children."""
    from diffusers.hooks import FirstBlockCacheConfig, apply_first_block_cache
    from diffusers.hooks.hooks import CacheContext, HookRegistry, _set_cache_context

    threshold = 0.3
    rollout, embeds, settings, address = _rollout(video_adapter, threshold, per_node=True)
    assert 0 < rollout.forwards_cached < rollout.forwards == rollout.tree.num_nodes - len(rollout.tree.leaf_index)
    tree, schedule = rollout.tree, rollout.schedule
    denoiser = video_adapter.denoiser
    apply_first_block_cache(denoiser, FirstBlockCacheConfig(threshold))
    checked = 0
    try:
        for leaf in tree.leaf_index.tolist():
            path = [leaf]
            while tree.parent[path[0]] >= 0:
                path.insert(0, int(tree.parent[path[0]]))
            HookRegistry.check_if_exists_or_initialize(denoiser).reset_stateful_hooks(recurse=True)
            _set_cache_context(denoiser, CacheContext("path"))
            for node, child in zip(path[:-1], path[1:]):
                depth = int(tree.depth[node])
                prompt = tree.prompt[node : node + 1]
                with torch.no_grad():
                    output = video_adapter.predict(rollout.latents[node : node + 1], schedule.model_times[depth : depth + 1],
                                                   {k: v[prompt] for k, v in embeds.items()})
                made = transition(tree.spec, schedule, settings, address, depth, rollout.latents[node : node + 1], output,
                                  [address.prompt_keys[int(tree.prompt[child])]], [tree.paths[child]])
                torch.testing.assert_close(made.latents, rollout.latents[child : child + 1], rtol=0, atol=1e-5)
                checked += 1
            _set_cache_context(denoiser, None)
    finally:
        HookRegistry.check_if_exists_or_initialize(denoiser).remove_hook("fbc_leader_block_hook", recurse=True)
        HookRegistry.check_if_exists_or_initialize(denoiser).remove_hook("fbc_block_hook", recurse=True)
    assert checked == len(tree.leaf_index) * SPEC.num_steps


def test_below_any_change_the_cache_computes_every_forward_as_without_it(tiny_adapter):
    """A threshold no change falls under skips nothing: the rollout is the uncached one bit for bit, on a tree whose
    levels are cut into several forwards (max_batch 4 rows), and the blocks are the model's own again after it."""
    blocks = list(tiny_adapter.denoiser.transformer_blocks)
    plain, _, _, _ = _rollout(tiny_adapter, 0.0, max_batch=4)
    cached, _, _, _ = _rollout(tiny_adapter, 1e-12, max_batch=4)
    assert cached.forwards_cached == 0 and cached.forwards > SPEC.num_steps
    assert torch.equal(plain.latents, cached.latents)
    assert list(tiny_adapter.denoiser.transformer_blocks) == blocks


def test_above_every_change_each_level_reuses_the_roots_residual(tiny_adapter):
    """A threshold every change falls under skips every forward after the roots' (one forward a depth), and a
    skipped output differs from the network's: the cache changes the samples."""
    plain, _, _, _ = _rollout(tiny_adapter, 0.0)
    cached, _, _, _ = _rollout(tiny_adapter, 1e9)
    assert (cached.forwards, cached.forwards_cached) == (SPEC.num_steps, SPEC.num_steps - 1)
    assert not torch.allclose(plain.leaf_latents, cached.leaf_latents, atol=1e-3)


def test_a_model_without_registered_blocks_is_refused_in_one_line():
    denoiser = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="cannot be cached; set sampling.block_cache=0"):
        BlockCache(denoiser, 0.1)


def test_a_model_with_a_second_expert_is_refused_in_one_line(tiny_adapter):
    """Wan 2.2 A14B routes a forward's rows between two transformers: a node's cached blocks would not be those it runs next."""
    from types import SimpleNamespace

    check_cacheable(tiny_adapter)  # one transformer with registered blocks: accepted
    two_experts = SimpleNamespace(pipe=SimpleNamespace(transformer_2=torch.nn.Linear(1, 1)), denoiser=tiny_adapter.denoiser)
    with pytest.raises(ValueError, match=r"^sampling.block_cache: this model has a second expert \(transformer_2\).*; set sampling.block_cache=0$"):
        check_cacheable(two_experts)


def test_a_cached_run_reports_its_skipped_forwards(tiny_model_dir, tmp_path):
    """DiffusionNFT with the cache: the iteration's metrics count the forwards made and those skipped (every one after the
    roots' at a threshold every change falls under) and the update trains; an uncached run reports neither count."""
    from branchdiff.settings.load import load_config
    from branchdiff.training.recipe import Trainer

    def run(cache: float) -> Trainer:
        overrides = [f"model.path={tiny_model_dir}", f"output_dir={tmp_path / str(cache)}", "train.loss=nft", "sampling.num_steps=4",
                     "prompts.per_iteration=2", "tree.roots=1", "tree.splits=[[0,2],[1,2]]", "tree.mix_window=0", "model.finetune=lora",
                     f"sampling.block_cache={cache}", "logging.report_to=none", "final_eval=false"]
        return Trainer(load_config("tiny-mix", overrides))

    cached, plain = run(0.999), run(0.0)  # every change of the tiny model's forwards falls under 0.999
    metrics = cached.run_iteration(0).metrics
    assert (metrics["rollout_forwards"], metrics["rollout_forwards_cached"]) == (4, 3)
    assert "rollout_forwards" not in plain.run_iteration(0).metrics
    assert metrics["optimizer_steps"] > 0 and metrics["grad_norm"] > 0 and math.isfinite(metrics["loss"])


def test_bench_cache_measures_the_uncached_rollout_beside_each_threshold(tiny_model_dir):
    """`bench cache` at tiny size: the uncached row is 0 skipped and 0 apart from itself; a threshold every change falls
    under (0.999 on the tiny model) skips every forward after the roots' (9 of the 10 steps' forwards), and its leaves move."""
    from branchdiff.bench.block_cache import bench_cache

    result = bench_cache(None, [0.999], draws=2, repeats=1, task="tiny",
                         extra_overrides=[f"model.path={tiny_model_dir}", "model.compile=none", "prompts.per_iteration=2"])
    plain, cached = result["rows"]["0"], result["rows"]["0.999"]
    assert (plain["forwards_skipped"], plain["leaf_mean_abs_diff"], plain["reward_minus_uncached"]) == (0.0, 0.0, 0.0)
    assert cached["forwards_skipped"] == pytest.approx(0.9) and cached["leaf_mean_abs_diff"] > 0
    assert len(cached["per_draw_reward"]) == 2 and cached["speedup"] > 0


def test_a_sharded_run_is_refused_in_one_line(tmp_path, monkeypatch):
    """Under FSDP every process must call the sharded blocks together; a forward that skips them on one would hang the others."""
    from branchdiff.errors import UserError
    from branchdiff.settings.load import load_config
    from branchdiff.training.recipe import Trainer

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    with pytest.raises(UserError, match=r"^sampling.block_cache with FSDP: .*; set sampling.block_cache=0 when sharding$"):
        Trainer(load_config("tiny-mix", ["train.loss=nft", "sampling.block_cache=0.2", f"output_dir={tmp_path}", "logging.report_to=none"]))


CACHED_FAMILIES = ("sd3", "flux", "flux2", "flux2-klein", "qwen-image")
REFUSED_FAMILIES = {"sana": "blocks of class SanaTransformerBlock, which diffusers' block registry does not describe",
                    "sd15": "fewer than two transformer blocks", "z-image": "blocks (ZImageTransformerBlock) take no 'hidden_states'"}


@pytest.fixture(scope="module")
def family_adapters(tmp_path_factory):
    from branchdiff.models import load_adapter
    from tiny_pipelines import RESOLUTION, save_pipeline  # tests/ is on sys.path

    root = tmp_path_factory.mktemp("cache-families")
    return {family: load_adapter(family, str(save_pipeline(family, root / family)), resolution=RESOLUTION[family])
            for family in (*CACHED_FAMILIES, *REFUSED_FAMILIES)}


@pytest.mark.parametrize("family", CACHED_FAMILIES)
def test_a_child_at_its_parents_input_skips_to_the_full_output_on_every_family(family, family_adapters):
    """Each family's block layout (SD3's last block without a text stream, FLUX's and FLUX.2's single-stream blocks —
    FLUX.2 joins [text; image] before them —, Qwen-Image's two streams), under its default guidance (CFG's two halves
    for SD3 and Qwen-Image): a parent computed in full, then two children at the parent's own input in one forward
    skip every block after the first, and the skipped output is the full one — the kept residual is the one that
    belongs there, for each row and half."""
    adapter = family_adapters[family]
    torch.manual_seed(0)
    x = torch.randn(1, *adapter.latent_shape)
    embeds = adapter.encode_prompts(["a red cube on a table"])
    times = adapter.schedule(4).model_times[1:2]
    with torch.no_grad():
        full = adapter.predict(x, times, embeds)
        cache = BlockCache(adapter.denoiser, 1e9)
        halves = adapter.rows_per_sample(adapter.default_guidance)
        with cache:
            with cache.forward(torch.tensor([0]), halves):
                parent = adapter.predict(x, times, embeds)
            cache.next_level(torch.tensor([0, 0]))
            with cache.forward(torch.tensor([0, 1]), halves):
                children = adapter.predict(x.expand(2, *x.shape[1:]), times.expand(2), {k: v.expand(2, *v.shape[1:]) for k, v in embeds.items()})
    assert (cache.forwards, cache.skipped) == (2, 1)
    scale = full.abs().max()
    assert (parent - full).abs().max() <= 1e-5 * scale
    assert (children - full).abs().max() <= 1e-4 * scale


@pytest.mark.parametrize("family", list(REFUSED_FAMILIES))
def test_a_family_whose_blocks_the_cache_cannot_follow_is_refused_in_one_line(family, family_adapters):
    with pytest.raises(ValueError, match=rf"^sampling.block_cache: the denoiser \w+(?:'s)? (?:has )?.*"
                                         rf"{REFUSED_FAMILIES[family].replace('(', '.').replace(')', '.')}.*; set sampling.block_cache=0$"):
        check_cacheable(family_adapters[family])


def test_rows_keep_their_own_cache_however_a_level_is_cut_into_forwards(family_adapters):
    """SD3 under CFG (each forward: [unconditional; conditional] halves of several nodes), every forward after the roots'
    skipped: a rollout whose levels go through forwards of 2 nodes equals the one grown a node a forward (1e-4 of the
    latents' scale: only the batch size differs), so every row and half is stored and gathered as its own node's."""
    adapter = family_adapters["sd3"]
    assert adapter.rows_per_sample(adapter.default_guidance) == 2
    batched, _, _, _ = _rollout(adapter, 1e9, max_batch=4)
    alone, _, _, _ = _rollout(adapter, 1e9, per_node=True)
    assert batched.forwards_cached == batched.forwards - 1  # all but the two roots' forward
    assert (batched.latents - alone.latents).abs().max() <= 1e-4 * alone.latents.abs().max()


def test_wan_22s_second_expert_is_refused_before_the_model_loads(tmp_path):
    """A local folder whose model_index.json names transformer_2 (Wan 2.2 A14B) is refused by the preflight, before the model
    loads (it was refused only once loaded); Wan 2.1's index, which lists transformer_2 as [null, null], is not."""
    import json

    from branchdiff.errors import UserError
    from branchdiff.models.block_cache import check_cacheable_folder
    from branchdiff.settings.load import load_config
    from branchdiff.training.preflight import check_inputs

    a14b, wan21 = tmp_path / "a14b", tmp_path / "wan21"
    for folder, expert in ((a14b, ["diffusers", "WanTransformer3DModel"]), (wan21, [None, None])):
        folder.mkdir()
        (folder / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline", "transformer": ["diffusers", "WanTransformer3DModel"],
                                                             "transformer_2": expert}))
    config = load_config("tiny-mix", ["model.family=wan", f"model.path={a14b}", "train.loss=nft", "sampling.block_cache=0.3", "model.compile=none"])
    with pytest.raises(UserError, match=r"^sampling.block_cache: this model has a second expert \(transformer_2\).*; set sampling.block_cache=0$"):
        check_inputs(config)
    check_cacheable_folder(str(wan21))
    check_cacheable_folder("Wan-AI/Wan2.1-T2V-1.3B-Diffusers")  # a hub id: checked once it has loaded


def test_a_family_the_cache_cannot_follow_is_named_in_the_registry_as_the_loaded_check_finds_it():
    """The registry's reasons (refused before the model loads) name exactly the families `check_cacheable` refuses once loaded."""
    from branchdiff.models.registry import FAMILIES

    assert {name for name, family in FAMILIES.items() if family.uncacheable} == set(REFUSED_FAMILIES)
    assert not any(FAMILIES[name].uncacheable for name in CACHED_FAMILIES)
