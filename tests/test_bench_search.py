"""`branchdiff bench search`: the winners read off one anytime run at each budget of the grid
(hand-made rounds), and a small run's files, keys and ratio."""

from __future__ import annotations

import math

import pytest
import torch

from branchdiff.bench.gmm import target_reward
from branchdiff.bench.search import bench_search, best_curves, mixture_task, nfe_ratio, parse_variant, table_columns
from branchdiff.search.run import SearchResult
from branchdiff.search.sample import SearchSettings, search_of


def test_each_budget_takes_the_best_leaf_of_the_rounds_it_pays_for():
    """Prompt 0: rounds costing 10, 20, 29 rows with rewards 0.2, 0.9, 0.5; prompt 1: 10, 30 rows
    with 0.4, 0.8 (a tie on strict breaks nothing). At 10 rows: winners 0.2 and 0.4 (strict 0, 1);
    at 20: 0.9 and 0.4; at 40: 0.9 and 0.8."""
    result = SearchResult(
        leaves=[[5, 6, 7], [8, 9]], rewards=[[0.2, 0.9, 0.5], [0.4, 0.8]],
        extras=[[{"strict": 0.0}, {"strict": 1.0}, {"strict": 0.0}], [{"strict": 1.0}, {"strict": 0.0}]],
        trace=[[{"nfe": 10, "decodes": 1, "reward_calls": 1, "images": 1}, {"nfe": 20, "decodes": 2, "reward_calls": 2, "images": 2}, {"nfe": 29, "decodes": 3, "reward_calls": 3, "images": 3}], [{"nfe": 10, "decodes": 1, "reward_calls": 1, "images": 1}, {"nfe": 30, "decodes": 2, "reward_calls": 2, "images": 2}]])
    rewards, strict = best_curves(result, [10, 20, 40])
    assert rewards == pytest.approx([0.3, 0.65, 0.85]) and strict == [0.5, 1.0, 0.5]


def test_the_nfe_ratio_compares_first_times_at_the_references_final():
    """Reference 0.5 → 0.7 → 0.9 at 10, 20, 40 rows: it first reaches 0.9 at 40; a variant 0.6 → 0.9
    at 10, 20 reaches it at 20: ratio 2. A variant at 0.5, 0.8 reaches 0.9 never (None); level curves: 1."""
    grid = [10, 20, 40]
    assert nfe_ratio([0.5, 0.7, 0.9], [0.6, 0.9, 0.95], grid) == 2.0
    assert nfe_ratio([0.5, 0.7, 0.9], [0.5, 0.8, 0.85], grid) is None
    assert nfe_ratio([0.5, 0.7, 0.7], [0.5, 0.7, 0.7], grid) == 1.0
    assert nfe_ratio([0.5, 0.7, 0.9], [0.5, 0.6, 1.1], grid) == pytest.approx(40 / (20 + 20 * 0.3 / 0.5))
    # a search with no image before 20 rows (early-stopped rollouts) that is above the target at 20: reached at 20, not NaN
    assert nfe_ratio([0.5, 0.7, 0.9], [math.nan, 0.95, 0.97], grid) == 2.0


def test_a_budget_where_a_prompt_has_no_image_yet_has_no_mean():
    """Prompt 0 has an image at 10 rows, prompt 1 only at 30: the mean at 10 and 20 rows would be prompt 0's alone, so NaN."""
    result = SearchResult(leaves=[[5], [8]], rewards=[[0.2], [0.4]], extras=[[{}], [{}]],
                          trace=[[{"nfe": 10, "decodes": 1, "reward_calls": 1, "images": 1}], [{"nfe": 25, "decodes": 0, "reward_calls": 0, "images": 0}, {"nfe": 30, "decodes": 1, "reward_calls": 1, "images": 1}]])
    rewards, checks = best_curves(result, [10, 20, 30], verifier=None)
    assert math.isnan(rewards[0]) and math.isnan(rewards[1]) and rewards[2] == pytest.approx(0.3) and all(map(math.isnan, checks))


def test_a_small_bench_writes_its_table_plot_and_ratio(tmp_path, capsys):
    (tmp_path / "search.md").write_text("a hand-written page")  # docs/search.md, where --out defaults to docs: not overwritten
    result = bench_search(2, 2, tmp_path / "search.json", tmp_path, ["best-of-n", "dts-star", "tree"], prompts=2, prices=["call-as-row"])
    assert (tmp_path / "search.md").read_text() == "a hand-written page"
    # it says where it wrote (it did not)
    assert capsys.readouterr().out.splitlines()[-1] == f"wrote {tmp_path / 'search-bench.md'}, {tmp_path / 'search-bench.png'}, {tmp_path / 'search.json'}"
    assert "NaN" not in (tmp_path / "search.json").read_text()
    tree = result["searches"].pop("tree")  # a tree of 8 images does not fit in two images' rows: no winner yet
    assert all(math.isnan(v) for v in tree["best_reward"]["mean"]) and "| tree | best tiny-geneval | — | — |" in (tmp_path / "search-bench.md").read_text()
    assert (tmp_path / "search-bench.png").stat().st_size > 0 and "nfe_best_of_n_over_dts_star" in (tmp_path / "search-bench.md").read_text()
    assert result["grid_nfe"] == [10, 20] and set(result["searches"]) == {"best-of-n", "dts-star"}
    for entry in result["searches"].values():
        assert len(entry["best_reward"]["seeds"]) == 2 and all(0 <= v <= 1 for v in entry["strict"]["mean"])
        assert entry["best_reward"]["mean"][0] <= entry["best_reward"]["mean"][1]  # anytime: more rows never lose the best
    # with two images' rows and a cap of four children DTS* draws two new noises, as best-of-N does
    assert result["searches"]["dts-star"]["best_reward"] == result["searches"]["best-of-n"]["best_reward"]
    assert result["ratios"]["nfe_best_of_n_over_dts_star"] == pytest.approx(1.0)
    assert all(0 < entry["fill"] <= 1 for entry in result["searches"].values()) and "rows per forward" in (tmp_path / "search-bench.md").read_text()
    with pytest.raises(ValueError, match="unknown search 'beam'"):
        bench_search(2, 1, None, tmp_path, ["beam"], prices=["call-as-row"])


def test_a_variant_is_a_search_with_settings_and_bad_ones_are_named():
    assert parse_variant("dts-star:root_children=8:widening=1.5") == ("dts-star", {"root_children": 8, "widening": 1.5})
    assert parse_variant("best-of-n") == ("best-of-n", {})
    with pytest.raises(ValueError, match="'depth=3' in 'dts:depth=3' is not key=value with a key of max_children"):
        parse_variant("dts:depth=3")
    # a DTS option on a search that grows no tree by values would be ignored: refused, naming it (it ran as plain best-of-N)
    with pytest.raises(ValueError, match=r"'best-of-n:widening=0.5:temperature=10': best-of-n does not use widening, temperature: these set "
                                         r"how dts, dts-star, dts-is grow their trees; leave them out"):
        parse_variant("best-of-n:widening=0.5:temperature=10")  # (10 is DTS's default temperature: still not best-of-N's)
    with pytest.raises(ValueError, match=r"'dts-is:rollout_depth=2': dts-is draws with the probabilities"):  # the search's own refusal
        parse_variant("dts-is:rollout_depth=2")
    assert parse_variant("tree:parallel=2") == ("tree", {"parallel": 2})  # parallel selections are the search loop's, every search's


def test_the_target_reward_is_the_gaussian_proximity_to_each_prompts_point():
    """Targets (0, 0) and (3, 4) in 2-D, w = 1: a point at (3, 4) for prompt 0 is 25 away squared, r = exp(−25/4);
    for prompt 1 it is the target itself, r = 1; (0, 1) for prompt 0: exp(−1/4)."""
    reward = target_reward(torch.tensor([[0.0, 0.0], [3.0, 4.0]]), 1.0)
    values = reward(torch.tensor([[3.0, 4.0], [3.0, 4.0], [0.0, 1.0]]), [0, 1, 0])
    assert values.tolist() == pytest.approx([math.exp(-25 / 4), 1.0, math.exp(-1 / 4)])
    with pytest.raises(ValueError, match="width w > 0"):
        target_reward(torch.zeros(1, 2), 0.0)


def test_the_mixture_task_searches_without_a_verifier_and_says_where_its_rows_went(tmp_path):
    """Four prompts, four images' rows: best-of-N spends one row at every depth per image (4 per depth); every search's
    rows by depth add up to its rows per prompt; the table has no strict rows; DTS* is best-of-N until it branches."""
    result = bench_search(4, 1, tmp_path / "search.json", tmp_path, ["best-of-n", "dts-star", "dts-star:rollout_depth=2"], prompts=4, task="mixture",
                          prices=["call-as-row", "tiny"])
    assert result["task"] == "mixture" and result["prompts"] == 4 and result["grid_nfe"] == [10, 20, 30, 40] and result["first_seed"] == 0
    points = torch.randn(4, 16)
    assert torch.equal(mixture_task(4).score(points, [0, 1, 2, 3])[0], mixture_task().score(points, [0, 1, 2, 3])[0])  # the first 4 targets
    searches = result["searches"]
    assert searches["best-of-n"]["rows_by_depth"] == [4.0] * 10
    for entry in searches.values():
        assert "strict" not in entry and sum(entry["rows_by_depth"]) == pytest.approx(entry["nfe_mean"])
    assert searches["dts-star"]["best_reward"]["mean"][:1] == searches["best-of-n"]["best_reward"]["mean"][:1]
    assert searches["dts-star:rollout_depth=2"]["rows_by_depth"][9] < searches["dts-star"]["rows_by_depth"][9]  # stopped rollouts skip the last steps
    markdown = (tmp_path / "search-bench.md").read_text()
    assert "winner strict" not in markdown and "| best-of-n | 4.0 | 4.0 |" in markdown and "mixture task" in markdown


def test_the_table_shows_one_two_four_images_and_the_last():
    assert table_columns(list(range(10, 130, 10))) == [0, 1, 3, 7, 11] and table_columns([10, 20, 30, 40]) == [0, 1, 3]


def test_rollout_depth_is_a_search_setting_and_a_variant_key():
    assert search_of(SearchSettings("dts-star", 100, rollout_depth=3)).rollout_depth == 3
    assert parse_variant("dts-star:rollout_depth=3") == ("dts-star", {"rollout_depth": 3})
    with pytest.raises(ValueError, match="--rollout-depth ≥ 0"):
        SearchSettings("dts-star", 100, rollout_depth=-1).validate()
    with pytest.raises(ValueError, match="rollout_depth=3"):  # dts-is's own refusal, at validation (before `sample` loads a model)
        SearchSettings("dts-is", 100, rollout_depth=3).validate()


def test_in_cost_each_budget_pays_for_the_rounds_decodes_and_reward_calls():
    """Prompt 0: rounds at 10 rows + 1 call (reward 0.2), 20 rows + 4 calls (0.9: three early stops scored); prompt 1: 10
    rows + 1 call (0.4), 20 rows + 2 calls (0.8). With a decode at 1 row and a call at 2 (an evaluation 3): costs 13, 32;
    13, 26. Read at 13, 26, 39: winners 0.2/0.4, 0.2/0.8, 0.9/0.8."""
    from branchdiff.bench.search import cost_grid
    from branchdiff.search.cost import Prices

    result = SearchResult(leaves=[[5, 6], [8, 9]], rewards=[[0.2, 0.9], [0.4, 0.8]], extras=[[{}, {}], [{}, {}]],
                          trace=[[{"nfe": 10, "decodes": 1, "reward_calls": 1, "images": 1}, {"nfe": 20, "decodes": 4, "reward_calls": 4, "images": 2}],
                                 [{"nfe": 10, "decodes": 1, "reward_calls": 1, "images": 1}, {"nfe": 20, "decodes": 2, "reward_calls": 2, "images": 2}]])
    prices = Prices(decode=1.0, reward=2.0)
    grid = cost_grid(prices, 3)
    assert grid == [13.0, 26.0, 39.0]
    rewards, _ = best_curves(result, grid, None, prices)
    assert rewards == pytest.approx([0.3, 0.5, 0.85])
    assert best_curves(result, [10, 20], None)[0] == pytest.approx([0.3, 0.85])  # in rows the calls are free


def test_the_bench_counts_what_each_search_spends_and_reads_it_in_cost(tmp_path):
    """Mixture task, 4 prompts, 4 images' rows: best-of-N decodes and scores one sample per image (4 of each, 40 rows);
    DTS* with early stops scores more samples than it finishes images; under a call counted as a row its cost is rows +
    calls; the tiny task's prices are zero, so its cost equals its rows and its ratios equal the rows' ones; held-out
    targets differ from the tuning's."""
    from branchdiff.bench.search import TUNING_TARGET_SEED

    result = bench_search(4, 2, tmp_path / "search.json", tmp_path, ["best-of-n", "dts-star:max_children=1:widening=0.5:rollout_depth=2"],
                          prompts=4, task="mixture", prices=["call-as-row", "tiny"])
    searches = result["searches"]
    assert searches["best-of-n"]["spent"] == {"rows": 40, "decodes": 4, "reward_calls": 4}
    stopped = searches["dts-star:max_children=1:widening=0.5:rollout_depth=2"]
    assert stopped["spent"]["reward_calls"] == stopped["spent"]["decodes"] > 4
    assert result["prices"]["tiny"] == {"decode": 0.0, "reward": 0.0, **{k: result["prices"]["tiny"][k] for k in ("row_flops", "decode_flops", "reward_flops", "from")}}
    assert result["grid_cost"]["call-as-row"] == [11.0, 22.0, 33.0, 44.0] and result["grid_cost"]["tiny"] == [10.0, 20.0, 30.0, 40.0]
    assert stopped["priced"]["tiny"] == stopped["best_reward"] and result["ratios_cost"]["tiny"] == result["ratios"]
    markdown = (tmp_path / "search-bench.md").read_text()
    assert "| best-of-n | 40 | 4.0 | 4.0 | 44 | 40 |" in markdown and "cost: call-as-row" in markdown
    points = torch.randn(4, 16)
    assert not torch.equal(mixture_task(4).score(points, [0, 1, 2, 3])[0], mixture_task(4, TUNING_TARGET_SEED).score(points, [0, 1, 2, 3])[0])
    assert result["target_seed"] == 2027
    with pytest.raises(ValueError, match="unknown price set"):
        bench_search(1, 1, None, tmp_path, ["best-of-n"], prices=["h100"])
    with pytest.raises(ValueError, match="--target-seed draws the mixture"):
        bench_search(1, 1, None, tmp_path, ["best-of-n"], target_seed=3, prices=["tiny"])


def test_the_price_of_a_search_comes_from_the_plans_flop_counts():
    """The tiny family's denoiser row is counted (> 0); it works in pixel space (no decode) and its verifier is a rule
    (no network): both prices 0. A reward the plan does not count needs --reward-cost; given, it is that many rows."""
    from branchdiff.plan.search_prices import price_search
    from branchdiff.settings.load import load_config

    config = load_config("tiny-mix", [])
    priced = price_search(config, "tiny-geneval")
    assert priced.row_flops > 0 and priced.prices.decode == 0 and priced.prices.reward == 0
    with pytest.raises(ValueError, match="--reward-cost"):
        price_search(config, "my_rewards.Judge")
    assert price_search(config, "my_rewards.Judge", reward_cost=2.5).prices.reward == pytest.approx(2.5)


def test_qwen2_vl_vision_flops_equal_a_counted_forward():
    """The formula for Qwen2-VL's vision tower (its attention splits by lengths read from the data, which fake tensors
    cannot follow) equals the FLOPs counted on a small random tower's real forward: 3 slices of 4 × 6 patches."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

    from branchdiff.plan.search_prices import qwen2_vl_vision_flops

    vision = dict(depth=2, embed_dim=32, mlp_ratio=4, num_heads=2, in_chans=3, hidden_size=48, patch_size=14, spatial_merge_size=2,
                  temporal_patch_size=2)
    config = Qwen2VLVisionConfig(**vision)
    config._attn_implementation = "eager"
    tower = Qwen2VisionTransformerPretrainedModel._from_config(config).eval()
    slices, height, width = 3, 4, 6
    pixels = torch.randn(slices * height * width, 3 * 2 * 14 * 14)
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        tower(pixels, grid_thw=torch.tensor([[slices, height, width]]))
    assert qwen2_vl_vision_flops(vision, slices, height, width) == counter.get_total_flops()
