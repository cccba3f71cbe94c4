"""The tree benchmark's bookkeeping (its timings are for `branchdiff bench tree`, not for tests)."""

import pytest

from branchdiff.bench.iteration import bench_tree


@pytest.mark.slow
def test_bench_tree_counts(tiny_model_dir, tmp_path):
    result = bench_tree(tmp_path / "bench.json", repeats=1, extra_overrides=[f"model.path={tiny_model_dir}", "prompts.per_iteration=1"])
    rows = result["variants"]
    # the anchor's numbers: 16 chains × 20 steps = 320; the 0,3,6,9 tree needs 203 forwards
    assert (rows["chain"]["nfe_rollout"], rows["chain"]["nfe_trained"]) == (320, 320)
    assert (rows["tree"]["nfe_rollout"], rows["tree"]["edges_trained"]) == (203, 218)
    assert rows["tree"]["nfe_trained"] == 203  # siblings share the parent forward in training too
    # depth pruning of child depths 11..20 leaves the edges into depths 1..10: 2+2+2+4+4+4+8+8+8+16 = 58
    assert rows["tree_depth_pruned"]["edges_trained"] == 58
    # Mix (SDE on steps 0..3 and the splits 6, 9): edges into depths 1,2,3,4,7,10 = 2+2+2+4+8+16 = 34
    assert rows["mix"]["edges_trained"] == 34 and rows["mix"]["nfe_trained"] == 1 + 2 + 2 + 2 + 4 + 8
    assert rows["tree_per_node"]["nfe_rollout"] == 203
    # the default computes only real rows; exact=true pads every level to max_batch = 64 rows
    assert rows["tree"]["nfe_rollout_computed"] == 203 and rows["tree"]["exact"]["nfe_rollout_computed"] == 20 * 64
    assert rows["chain"]["exact"]["nfe_rollout_computed"] == 20 * 64 and rows["chain"]["nfe_rollout_computed"] == 320
    assert set(result["ratios"]) >= {"chain_over_tree", "chain_over_tree_pruned", "chain_over_mix", "chain_over_best",
                                     "per_node_over_batched", "rollout_over_bare_forward", "efficiency", "exact"}
    assert set(result["ratios"]["exact"]) >= {"chain_over_mix", "rollout_over_bare_forward"}
    assert (tmp_path / "bench.json").is_file()
    profile = rows["tree"]["profile"]  # where the seconds went, summing to the iteration's
    assert set(profile) == {"rollout_seconds", "decode_seconds", "score_seconds", "forward_backward_seconds", "optimizer_seconds", "other_seconds"}
    assert "compiled_over_eager" in result["ratios"] and rows["tree_compiled"]["nfe_rollout"] == 203
