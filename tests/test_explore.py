"""Explore → select → regenerate: exactness with the policy as explorer, quantisation otherwise."""

import torch

from branchdiff.config import load_config
from branchdiff.trainer import Trainer


def _trainer(model_dir, tmp_path, *extra):
    return Trainer(load_config(None, [
        f"model.path={model_dir}", f"output_dir={tmp_path}", "iterations=2", "reward=rewards_for_tests:Redness",
        "prompts.per_iteration=2", "sampling.num_steps=3", "sampling.max_batch=8", "train.minibatch=8",
        "logging.tensorboard=false", "final_eval=false", *extra,
    ]))


def test_seeds_mode_regenerates_kept_seeds_bit_for_bit(tiny_model_dir, tmp_path):
    trainer = _trainer(tiny_model_dir, tmp_path, "explore.mode=seeds", "explore.backend=none", "explore.pool=6",
                       "explore.keep=3", "explore.preview_sampler=sde")
    rollout, _, scores, info = trainer.rollout_and_score(0)
    stats = info["explore"]
    assert stats["latent_max_abs_diff"] == 0.0  # same model, same sampler, same addressed noise
    assert stats["spearman"] > 0.999 and stats["topk_overlap"] == 1.0
    assert rollout.tree.num_prompts == 2 and len(rollout.tree.leaf_index) == 2 * 3
    assert stats["pool_nfe"] == 2 * 6 * 3 and stats["regen_nfe"] == 2 * 3 * 3
    # the kept seeds are root ids of the pool: their paths start with the chosen ids
    roots = [path[0] for path in rollout.tree.paths[rollout.tree.level(0)]]
    assert len(set(roots)) > 1 and max(roots) < 6


def test_tree_mode_regenerates_the_kept_leaves_bit_for_bit(tiny_model_dir, tmp_path):
    trainer = _trainer(tiny_model_dir, tmp_path, "explore.mode=tree", "explore.backend=none", "tree.roots=1",
                       "tree.splits=[[0,2],[1,2]]", "explore.keep=2")
    rollout, _, scores, info = trainer.rollout_and_score(0)
    assert info["explore"]["latent_max_abs_diff"] == 0.0
    assert len(rollout.tree.leaf_index) == 2 * 2  # K leaves per prompt
    # the sub-tree holds exactly the union of the kept leaves' root paths
    assert rollout.tree.num_nodes < 2 * (1 + 2 + 4 + 4)
    metrics = trainer.run_iteration(1).metrics
    assert metrics["explore_latent_max_abs_diff"] == 0.0 and metrics["edges_trained"] > 0


def test_nvfp4_explorer_differs_only_by_quantisation_and_follows_the_policy(tiny_model_dir, tmp_path):
    trainer = _trainer(tiny_model_dir, tmp_path, "explore.mode=tree", "explore.backend=nvfp4-emulated", "tree.roots=1",
                       "tree.splits=[[0,2],[1,2]]", "explore.keep=2", "train.learning_rate=0.05")
    _, _, _, info = trainer.rollout_and_score(0)
    assert 0.0 < info["explore"]["latent_mean_abs_diff"] < 0.5
    x = torch.randn(2, 3, 32, 32)
    sigma = torch.full((2,), 0.7)
    embeds = trainer.adapter.encode_prompts(["one red circle on the left"] * 2)
    trainer.run_iteration(0)  # an update, then the explorer is refreshed with the merged LoRA
    with torch.no_grad():
        policy = trainer.adapter.predict_velocity(x, sigma, embeds)
        fresh = trainer.explorer.predict_velocity(x, sigma, embeds)
        trainer.explorer.denoiser = __import__("branchdiff.quant", fromlist=["make_quantized_copy"]).make_quantized_copy(
            trainer.adapter.denoiser.__class__.from_pretrained(tiny_model_dir / "transformer"), trainer.quant_config)
        stale = trainer.explorer.predict_velocity(x, sigma, embeds)
    assert (fresh - policy).abs().mean() < (stale - policy).abs().mean()


def test_resume_refreshes_the_quantised_explorer(tiny_model_dir, tmp_path):
    extra = ("explore.mode=tree", "explore.backend=nvfp4-emulated", "tree.roots=1", "tree.splits=[[0,2],[1,2]]",
             "explore.keep=2", "train.learning_rate=0.05")
    trainer = _trainer(tiny_model_dir, tmp_path, *extra)
    trainer.run_iteration(0)  # updates the LoRA, then refreshes the explorer
    trainer.save_checkpoint(0)
    resumed = _trainer(tiny_model_dir, tmp_path, *extra)
    resumed.resume("latest")
    x, sigma = torch.randn(2, 3, 32, 32), torch.full((2,), 0.7)
    embeds = trainer.adapter.encode_prompts(["one red circle on the left"] * 2)
    with torch.no_grad():
        assert torch.equal(resumed.explorer.predict_velocity(x, sigma, embeds), trainer.explorer.predict_velocity(x, sigma, embeds))
