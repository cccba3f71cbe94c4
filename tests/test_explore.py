"""Explore → select → regenerate: exactness with the policy as explorer, quantisation otherwise."""

import pytest
import torch

from branchdiff.explore.pool import selection_generators
from branchdiff.explore.selection import select_per_group
from branchdiff.settings.load import load_config
from branchdiff.training.recipe import Trainer


def _trainer(model_dir, tmp_path, *extra, resume: str | None = None):
    return Trainer(load_config(None, [
        f"model.path={model_dir}", f"output_dir={tmp_path}", "iterations=2", "reward=rewards_for_tests:Redness",
        "prompts.per_iteration=2", "sampling.num_steps=3", "sampling.max_batch=8", "train.minibatch=8",
        "logging.report_to=none", "final_eval=false", *extra,
    ]), resume)


def test_seeds_mode_regenerates_kept_seeds_bit_for_bit(tiny_model_dir, tmp_path):
    trainer = _trainer(tiny_model_dir, tmp_path, "explore.mode=seeds", "explore.backend=none", "explore.pool=6",
                       "explore.keep=3", "explore.preview_sampler=sde", "sampling.exact=true")
    rollout, _, scores, info = trainer.rollout_and_score(0)
    stats = info["explore_stats"]
    assert stats["quant_latent_max_abs_diff"] == 0.0  # same model, same sampler, same addressed noise
    kept_pool, kept_regenerated = info["explore_kept"]
    assert torch.equal(kept_pool, kept_regenerated)
    assert rollout.tree.num_prompts == 2 and len(rollout.tree.leaf_index) == 2 * 3
    assert stats["pool_nfe"] == 2 * 6 * 3 and stats["regen_nfe"] == 2 * 3 * 3
    # the kept seeds are root ids of the pool: their paths start with the chosen ids
    roots = [path[0] for path in rollout.tree.paths[rollout.tree.level(0)]]
    assert len(set(roots)) > 1 and max(roots) < 6


def test_tree_mode_regenerates_the_kept_leaves_bit_for_bit(tiny_model_dir, tmp_path):
    trainer = _trainer(tiny_model_dir, tmp_path, "explore.mode=tree", "explore.backend=none", "tree.roots=1",
                       "tree.splits=[[0,2],[1,2]]", "explore.keep=2", "sampling.exact=true")
    rollout, _, scores, info = trainer.rollout_and_score(0)
    assert info["explore_stats"]["quant_latent_max_abs_diff"] == 0.0
    assert len(rollout.tree.leaf_index) == 2 * 2  # K leaves per prompt
    # the sub-tree holds exactly the union of the kept leaves' root paths
    assert rollout.tree.num_nodes < 2 * (1 + 2 + 4 + 4)
    metrics = trainer.run_iteration(1).metrics
    assert metrics["explore_quant_latent_max_abs_diff"] == 0.0 and metrics["edges_trained"] > 0


def test_nvfp4_explorer_differs_only_by_quantisation_and_follows_the_policy(tiny_model_dir, tmp_path):
    trainer = _trainer(tiny_model_dir, tmp_path, "explore.mode=tree", "explore.backend=nvfp4-emulated", "tree.roots=1",
                       "tree.splits=[[0,2],[1,2]]", "explore.keep=2", "train.learning_rate=0.05")
    _, _, _, info = trainer.rollout_and_score(0)
    assert 0.0 < info["explore_stats"]["quant_latent_mean_abs_diff"] < 0.5
    x = torch.randn(2, 3, 32, 32)
    sigma = torch.full((2,), 0.7)
    embeds = trainer.adapter.encode_prompts(["one red circle on the left"] * 2)
    trainer.run_iteration(0)  # an update, then the explorer is refreshed with the merged LoRA
    with torch.no_grad():
        policy = trainer.adapter.predict(x, sigma, embeds)
        fresh = trainer.exploration.explorer.predict(x, sigma, embeds)
        trainer.exploration.explorer.denoiser = __import__("branchdiff.explore.quant", fromlist=["make_quantized_copy"]).make_quantized_copy(
            trainer.adapter.denoiser.__class__.from_pretrained(tiny_model_dir / "transformer"), trainer.exploration.quant_config)
        stale = trainer.exploration.explorer.predict(x, sigma, embeds)
    assert (fresh - policy).abs().mean() < (stale - policy).abs().mean()


def test_resume_refreshes_the_quantised_explorer(tiny_model_dir, tmp_path):
    extra = ("explore.mode=tree", "explore.backend=nvfp4-emulated", "tree.roots=1", "tree.splits=[[0,2],[1,2]]",
             "explore.keep=2", "train.learning_rate=0.05")
    trainer = _trainer(tiny_model_dir, tmp_path, *extra)
    trainer.run_iteration(0)  # updates the LoRA, then refreshes the explorer
    trainer.save_checkpoint(0)
    resumed = _trainer(tiny_model_dir, tmp_path, *extra, resume="latest")
    x, sigma = torch.randn(2, 3, 32, 32), torch.full((2,), 0.7)
    embeds = trainer.adapter.encode_prompts(["one red circle on the left"] * 2)
    with torch.no_grad():
        assert torch.equal(resumed.exploration.explorer.predict(x, sigma, embeds), trainer.exploration.explorer.predict(x, sigma, embeds))


def test_ranking_agreement_is_reported_over_the_whole_pool(tiny_model_dir, tmp_path):
    """Regression: the training metric ranked only the kept best/worst candidates, whose extremes
    inflate a rank correlation. `explore_spearman_pool` must equal the agreement measured by
    regenerating every candidate (keep = pool), and the kept-subset figure carries its own name."""
    common = ("explore.mode=seeds", "explore.backend=nvfp4-emulated", "explore.pool=8", "explore.preview_sampler=sde",
              "prompts.per_iteration=4", "explore.fidelity_every=1")
    everything = _trainer(tiny_model_dir, tmp_path / "all", *common, "explore.keep=8").run_iteration(0).metrics
    subset = _trainer(tiny_model_dir, tmp_path / "subset", *common, "explore.keep=2").run_iteration(0).metrics
    assert subset["explore_spearman_pool"] == pytest.approx(everything["explore_spearman_kept"], abs=1e-6)
    assert subset["explore_spearman_pool"] == pytest.approx(everything["explore_spearman_pool"], abs=1e-6)
    assert "explore_spearman" not in subset and "explore_spearman_kept" in subset
    later = _trainer(tiny_model_dir, tmp_path / "later", *common[:-1], "explore.keep=2", "explore.fidelity_every=5")
    assert "explore_spearman_pool" not in later.run_iteration(1).metrics  # only every fidelity_every iterations


def test_preview_at_other_steps_names_its_latent_gap(tiny_model_dir, tmp_path):
    """Regression: with preview_steps ≠ num_steps the latent gap measures the step count too; its
    metric must not claim to measure quantisation."""
    trainer = _trainer(tiny_model_dir, tmp_path, "explore.mode=seeds", "explore.backend=none", "explore.pool=4",
                       "explore.keep=2", "explore.preview_steps=2")
    stats = trainer.rollout_and_score(0)[3]["explore_stats"]
    assert "quant_latent_max_abs_diff" not in stats and stats["preview_vs_train_latent_max_abs_diff"] > 0


def test_selection_generators_follow_the_prompt_not_the_process():
    """Regression: the random selection generator was seeded alike on every process; each prompt's
    generator now derives from its address, so prompt key 5 draws the same on any process and
    differently from key 0."""
    rewards = torch.arange(16.0).expand(2, 16)
    on_rank_0 = select_per_group(rewards, 4, "random", selection_generators(0, 3, (0, 1)))
    on_rank_1 = select_per_group(rewards, 4, "random", selection_generators(0, 3, (4, 5)))
    one_process = select_per_group(torch.arange(16.0).expand(6, 16), 4, "random", selection_generators(0, 3, tuple(range(6))))
    assert not torch.equal(on_rank_0, on_rank_1)
    assert torch.equal(one_process[[0, 1, 4, 5]], torch.cat([on_rank_0, on_rank_1]))


def test_within_prompt_agreement_is_not_inflated_by_differences_between_prompts():
    """Two prompts whose candidates rank in opposite orders but sit at different reward levels: the
    pooled ρ is high (the level dominates), the within-prompt mean is -1."""
    from branchdiff.explore.pool import ranking_agreement

    pool = torch.tensor([[1.0, 2.0, 3.0], [11.0, 12.0, 13.0]])
    regenerated = torch.tensor([[3.0, 2.0, 1.0], [13.0, 12.0, 11.0]])
    agreement = ranking_agreement(pool, regenerated)
    assert agreement["spearman"] > 0.5 and agreement["spearman_within"] == pytest.approx(-1.0)
    assert agreement["kendall_within"] == pytest.approx(-1.0)


def test_constant_rewards_have_no_ranking_agreement_and_warn_nothing():
    """A pool whose rewards are all equal (a saturated reward, a tiny run): NaN agreement, and no warning from
    scipy's correlation of a constant input in every such iteration's log."""
    import math
    import warnings

    from branchdiff.explore.pool import ranking_agreement

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        agreement = ranking_agreement(torch.ones(2, 3), torch.tensor([[1.0, 2.0, 3.0], [3.0, 2.0, 1.0]]))
    assert all(math.isnan(agreement[key]) for key in ("spearman", "kendall", "spearman_within", "kendall_within"))
    assert agreement["topk_overlap"] == pytest.approx(0.5)  # ties keep their order: candidate 0 tops the pool of both prompts, the regrown only on the second


def test_search_mode_keeps_the_best_and_worst_images_of_a_search_and_trains_nft_on_them(tiny_model_dir, tmp_path):
    """explore.mode=search with the policy as explorer: each prompt's DTS* search spends at most its
    budget; the kept images are the search's own (re-scored to the same rewards), its best and worst per
    prompt, the leaves of the rollout NFT trains on; a 4-bit explorer's kept images are regrown with the
    policy from their noise paths (`search.forest.regenerate_path`): they differ from the explorer's by
    the quantisation only."""
    common = ["train.loss=nft", "sampling.sde=flow", "explore.mode=search", "explore.search_budget=12", "explore.keep=2", "tree.roots=2",
              "nft.timesteps=1"]
    trainer = _trainer(tiny_model_dir, tmp_path / "policy", *common, "explore.backend=none")
    rollout, _, rewards, info = trainer.rollout_and_score(0)
    pool, regenerated_rewards = info["explore_kept"]  # (P, K): the search's rewards of the kept images, and their re-scored rewards
    assert torch.equal(pool, regenerated_rewards)
    explored = info["explore_stats"]
    assert 0 < explored["pool_nfe"] <= 2 * 12 and rollout.nfe == explored["pool_nfe"] and explored["regen_nfe"] == 0
    assert explored["search_images"] >= 2 and explored["quant_latent_max_abs_diff"] == 0.0
    assert len(rollout.tree.leaf_index) == 2 * 2 and torch.equal(rewards.total.reshape(2, 2), regenerated_rewards)
    metrics = trainer.run_iteration(1).metrics
    assert metrics["optimizer_steps"] >= 1 and metrics["nfe_trained"] == 2 * 2 * 1

    quantised = _trainer(tiny_model_dir, tmp_path / "nvfp4", *common, "explore.backend=nvfp4-emulated")
    rollout, _, _, info = quantised.rollout_and_score(0)
    stats = info["explore_stats"]
    assert stats["regen_nfe"] == 2 * 2 * 3 and 0 < stats["quant_latent_mean_abs_diff"] < 0.1  # images in [-1, 1]: a 4-bit gap
    assert rollout.leaf_latents.abs().amin(dim=(1, 2, 3)).min() >= 0 and rollout.leaf_latents.abs().sum(dim=(1, 2, 3)).min() > 0


def test_search_mode_needs_nft_and_an_sde():
    with pytest.raises(Exception, match="trains with train.loss=nft"):
        load_config(None, ["explore.mode=search"])
    with pytest.raises(Exception, match="set sampling.sde to an SDE"):
        load_config(None, ["explore.mode=search", "train.loss=nft", "sampling.sde=ode"])
