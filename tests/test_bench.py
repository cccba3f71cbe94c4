"""The tree benchmark's bookkeeping (its timings are for `branchdiff bench tree`, not for tests)."""

import pytest

from branchdiff.bench.iteration import bench_tree, chain_ratios


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
    assert set(result["ratios"]["forward_ms_per_row"]) == {4, 8, 16, 32, 64}
    for name in ("tree", "tree_depth_pruned", "tree_width_pruned", "mix", "best"):  # every variant's gap accounted for
        assert rows[name]["efficiency"] + sum(rows[name]["efficiency_lost"].values()) == pytest.approx(1.0), name


def _variant(rollout_rows: int, trained_rows: int, rollout: float, trained: float, fixed: float, seconds: float) -> dict:
    """A bench row whose phases' medians sum to rollout + trained + fixed and whose median iteration is `seconds`."""
    return {"nfe_rollout_computed": rollout_rows, "nfe_trained": trained_rows, "seconds": seconds,
            "profile": {"rollout_seconds": rollout, "forward_backward_seconds": trained, "decode_seconds": 0.0,
                        "score_seconds": fixed / 2, "optimizer_seconds": fixed / 4, "other_seconds": fixed / 4}}


def test_efficiency_lost_accounts_for_the_whole_gap():
    """Worked by hand: chain 100 rollout + 100 trained rows (1 s + 2 s, 0.15 s fixed, a 3.2 s median iteration), a
    variant 50 + 10 rows (0.6 + 0.25 s, 0.08 s fixed, 0.95 s), c = 3: k = (50 + 30) / (100 + 300) = 0.2,
    efficiency 0.2 · 3.2 / 0.95; the medians' mismatch 0.05 s and 0.02 s."""
    rows = {"chain": _variant(100, 100, 1.0, 2.0, 0.15, 3.2), "tree": _variant(50, 10, 0.6, 0.25, 0.08, 0.95)}
    chain_ratios(rows, c=3.0)
    tree = rows["tree"]
    assert tree["efficiency"] == pytest.approx(0.2 * 3.2 / 0.95)
    expected = {"rollout_rows": 0.6 - 1.0 * 0.5, "trained_rows": 0.25 - 2.0 * 0.1, "fixed": 0.08 - 0.2 * 0.15, "medians": 0.02 - 0.2 * 0.05,
                "cost_model": 1.0 * (0.5 - 0.2) + 2.0 * (0.1 - 0.2)}
    assert tree["efficiency_lost"] == pytest.approx({k: v / 0.95 for k, v in expected.items()})
    assert tree["efficiency"] + sum(tree["efficiency_lost"].values()) == pytest.approx(1.0)


def test_the_probe_rows_are_on_the_models_device():
    """Regression (found on an H200): the cost probe drew its noise on the CPU, so `bench tree` and the GPU bench stopped with
    "Input type (CPUBFloat16Type) and weight type (CUDABFloat16Type)". The device boundary is mocked here by a model on `meta`."""
    from types import SimpleNamespace

    import torch

    from branchdiff.bench.iteration import _probe

    meta = torch.device("meta")
    adapter = SimpleNamespace(device=meta, latent_shape=(4, 8, 8),
                              encode_prompts=lambda prompts: {"prompt_embeds": torch.zeros(len(prompts), 3, 5, device=meta)})
    trainer = SimpleNamespace(adapter=adapter, schedule=SimpleNamespace(model_times=torch.linspace(1, 0, 10, device=meta)),
                              settings=SimpleNamespace(guidance=4.5))
    noise, times, embeds, guidance = _probe(trainer, rows=6)
    assert noise.shape == (6, 4, 8, 8) and times.shape == (6,) and embeds["prompt_embeds"].shape == (6, 3, 5)
    assert {noise.device, times.device, embeds["prompt_embeds"].device} == {meta} and guidance == 4.5
