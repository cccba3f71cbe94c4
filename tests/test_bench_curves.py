"""The curves benchmark's interpolation and ratios (hand-computed), its variants' shapes, and one
tiny end-to-end run (its numbers are for `branchdiff bench curves`, not for tests)."""

import json
import re
import statistics

import numpy as np
import pytest

from branchdiff.bench.curves import (
    COMMON,
    VARIANTS,
    bench_curves,
    format_ratios,
    format_significance,
    group_size,
    time_to_reference_final,
    time_to_reference_final_on,
)
from branchdiff.bench.stats import first_time_reaching, t_interval, time_ratio_interval, welch_p
from branchdiff.objectives.registry import dataset_kind
from branchdiff.settings.load import load_config
from branchdiff.settings.trees import tree_spec

GRID = [0.0, 1.0, 2.0, 3.0]  # minutes


def test_first_time_reaching_interpolates_between_grid_points():
    # 0.35 lies between 0.2 (t = 1) and 0.5 (t = 2): 1 + (0.35 - 0.2) / (0.5 - 0.2) · 1 = 1.5
    assert first_time_reaching(GRID, [0.1, 0.2, 0.5, 0.4], 0.35) == pytest.approx(1.5)
    # reached exactly at a grid point: that point, not an earlier interpolation
    assert first_time_reaching(GRID, [0.1, 0.2, 0.5, 0.4], 0.5) == pytest.approx(2.0)
    # the first crossing counts, not a later one: 0 + (0.3 - 0.1) / (0.6 - 0.1) · 1 = 0.4
    assert first_time_reaching(GRID, [0.1, 0.6, 0.2, 0.7], 0.3) == pytest.approx(0.4)


def test_first_time_reaching_at_first_point_and_never():
    assert first_time_reaching(GRID, [0.6, 0.2, 0.5, 0.4], 0.5) == 0.0
    assert first_time_reaching(GRID, [0.1, 0.2, 0.3, 0.4], 0.45) is None


def test_time_to_reference_final():
    means = {
        "chain": [0.1, 0.3, 0.6, 0.5],  # final 0.5, first reached at 1 + (0.5 - 0.3) / 0.3 = 5/3
        "branch": [0.1, 0.5, 0.7, 0.8],  # reached at t = 1
        "mix": [0.1, 0.2, 0.3, 0.4],  # never
        "base_high": [0.55, 0.1, 0.1, 0.1],  # at the first point
    }
    ratios, notes = time_to_reference_final(GRID, means)
    assert ratios["chain"] == pytest.approx(5 / 9)  # (5/3) / 3: the chain's own curve peaked before the end
    assert ratios["branch"] == pytest.approx(1 / 3)
    assert ratios["mix"] is None and notes == {"mix": "never reached (final 0.400 < chain final 0.500)"}
    assert ratios["base_high"] == 0.0
    # a monotone chain reaches its final at the end: 1.0
    assert time_to_reference_final(GRID, {"chain": [0.1, 0.2, 0.3, 0.4]})[0] == {"chain": 1.0}


def test_time_to_reference_final_on_another_clock():
    """Each variant against its own times on that clock, over the reference's final time there."""
    times = {"chain": [0.0, 1.0, 2.0, 4.0], "explore": [0.0, 0.5, 1.0, 1.5], "slow": [0.0, 2.0, 4.0, 8.0]}
    means = {"chain": [0.1, 0.3, 0.4, 0.5], "explore": [0.1, 0.2, 0.6, 0.7], "slow": [0.1, 0.2, 0.3, 0.4]}
    ratios = time_to_reference_final_on(times, means)
    assert ratios["chain"] == pytest.approx(1.0)  # its own final, at its own end
    assert ratios["explore"] == pytest.approx((0.5 + (0.5 - 0.2) / (0.6 - 0.2) * 0.5) / 4.0)  # 0.875 min of the chain's 4
    assert ratios["slow"] is None


def test_variants_share_prompts_and_group_size():
    """Every variant trains 8 prompts × 8 samples an iteration (MC-GRPO: 9 chains, its pivot left out); the dataset
    objectives draw 8 rows an iteration and have no groups."""
    shapes = set()
    for preset, overrides in VARIANTS.values():
        config = load_config(preset, [*COMMON, *overrides])
        shapes.add((config.prompts.per_iteration, None if dataset_kind(config.train.loss) else group_size(config)))
    assert shapes == {(8, 8), (8, None)}
    assert group_size(load_config("tiny-mc-grpo", COMMON)) == 8 and tree_spec(load_config("tiny-mc-grpo", COMMON), 0).leaves == 9


def test_t_interval_is_mean_plus_minus_t_times_standard_error():
    # three seeds 0.4, 0.5, 0.6: mean 0.5, s = 0.1, t_{0.975, 2} = 4.302653: half width 4.302653 · 0.1 / √3 = 0.248414
    low, high = t_interval([0.4, 0.5, 0.6])
    assert low == pytest.approx(0.5 - 0.248414, abs=1e-6) and high == pytest.approx(0.5 + 0.248414, abs=1e-6)
    assert t_interval([0.3]) == (0.3, 0.3)


def test_welch_p_against_its_formula():
    # a = (1, 2, 3), b = (4, 6, 8): t = (2 - 6) / √(1/3 + 4/3) = -3.0984, Welch's ν = (5/3)² / ((1/3)²/2 + (4/3)²/2) = 2.9412
    from scipy import stats

    t, nu = (2 - 6) / (5 / 3) ** 0.5, (5 / 3) ** 2 / ((1 / 3) ** 2 / 2 + (4 / 3) ** 2 / 2)
    assert welch_p([1, 2, 3], [4, 6, 8]) == pytest.approx(2 * stats.t.sf(abs(t), nu), rel=1e-9)
    assert welch_p([0.5, 0.5], [0.5, 0.5]) == 1.0 and welch_p([0.5], [0.1, 0.2]) == 1.0


def test_time_ratio_interval_brackets_the_ratio_and_says_never():
    chain = [[0.1, 0.3, 0.5], [0.1, 0.4, 0.6], [0.1, 0.35, 0.55]]  # final mean 0.55
    fast = [[0.1, 0.7, 0.8], [0.1, 0.65, 0.8], [0.1, 0.75, 0.85]]  # reaches 0.55 well before t = 1
    flat = [[0.1, 0.1, 0.1]] * 3
    low, high = time_ratio_interval(chain, fast, [0.0, 1.0, 2.0])
    assert 0 < low <= high < 0.5  # every resample reaches it within the first minute
    assert time_ratio_interval(chain, flat, [0.0, 1.0, 2.0]) == (float("inf"), float("inf"))


def test_significance_says_which_variant_differs():
    three = [[0.0, 0.0]] * 3  # three seeds' curves (only their count is read here)
    result = {"seeds": 3, "variants": {"chain": {"mean": [0.1, 0.5], "ci": [[0.1, 0.1], [0.4, 0.6]], "strict": three},
                                       "mix": {"mean": [0.1, 0.8], "strict": three}, "tree": {"mean": [0.1, 0.52], "strict": three}},
              "ratios": {"final_vs_chain_p": {"mix": 0.001, "tree": 0.6},
                         "time_to_chain_final_ci": {"mix": [0.2, 0.4], "tree": [0.5, 1.3]}}}
    text = format_significance(result)
    assert "- mix: final 0.800 vs the chain's 0.500: significantly higher (Welch p = 0.001); reaches the chain's final significantly sooner" in text
    assert "- tree: final 0.520 vs the chain's 0.500: not significantly different (Welch p = 0.600); time to the chain's final not significantly different" in text
    assert "noise levels" not in text  # the chain moved: its interval [0.4, 0.6] lies above the base 0.1
    result["variants"]["chain"]["ci"][-1] = [0.05, 0.95]
    assert ("- the chain's own final is not significantly above the base (0.100 within its interval [0.050, 0.950]): times to reach it "
            "compare noise levels, not learning.") in format_significance(result)


def test_another_reference_names_its_ratios_and_its_sentences():
    """The objectives are compared with clipped GRPO (`--reference mix`): the ratios and the sentences name it."""
    from branchdiff.bench.curves import summarize_runs

    grid = [0.0, 1.0, 2.0]
    def run(curves):
        return [{"strict": c, "iterations": 10, "eval_minutes": {"wall": grid, "modelled": grid}, "eval_iterations": [0, 5, 10],
                 "seconds": {"wall": 120.0, "modelled": 120.0}} for c in curves]
    runs = {"mix": run([[0.2, 0.4, 0.5], [0.2, 0.45, 0.55], [0.2, 0.4, 0.6]]),
            "nft_tree": run([[0.2, 0.6, 0.7], [0.2, 0.65, 0.75], [0.2, 0.6, 0.8]])}
    result = summarize_runs(2.0, 3, grid, runs, 4, (8, 8), "wall", reference="mix")
    assert result["reference"] == "mix" and set(result["ratios"]) == {"time_to_mix_final", "time_to_mix_final_ci", "time_to_mix_final_other_clock",
                                                                     "final_vs_mix_p"}
    assert result["ratios"]["time_to_mix_final"]["nft_tree"] == pytest.approx((0.55 - 0.2) / ((0.6 + 0.65 + 0.6) / 3 - 0.2) / 2.0)  # linear between t = 0 and 1, over the 2-minute budget
    text = format_significance(result)
    assert "- nft_tree: final 0.750 vs mix's 0.550: significantly higher" in text and "chain" not in text
    assert format_ratios(result).startswith("time to reach mix's final mean (0.550) / budget")


@pytest.mark.slow
def test_bench_curves_smoke(tmp_path):
    json_path = tmp_path / "c.json"
    result = bench_curves(0.02, 2, json_path, tmp_path, points=2, variants=["chain", "branch", "sft"], images_per_prompt=1,
                          extra_overrides=["prompts.per_iteration=1"], clock="modelled")
    assert json.loads(json_path.read_text()) == json.loads(json.dumps(result))
    assert set(result) == {"budget", "unit", "seeds", "clock", "grid", "reference", "variants", "ratios", "equal", "notes", "seed_ids"}
    assert result["grid"] == [0.0, 0.02] and result["unit"] == "minutes"
    for v in result["variants"].values():
        assert len(v["strict"]) == 2 and len(v["strict"][0]) == 2 and len(v["mean"]) == len(v["ci"]) == 2
        assert v["iterations"][0] >= 1 and set(v["eval_minutes"]) == {"wall", "modelled"}
        assert [run[-1] for run in v["eval_iterations"]] == v["iterations"] and all(run[0] == 0 for run in v["eval_iterations"])
        assert all(m[-1] >= 0.02 for m in v["eval_minutes"]["modelled"])  # the budget is on the modelled clock
    chain, branch = result["variants"]["chain"], result["variants"]["branch"]
    assert chain["strict"][0][0] == branch["strict"][0][0]  # time 0 is the shared base model
    assert set(result["ratios"]["time_to_chain_final"]) == {"chain", "branch", "sft"}  # a dataset objective runs beside them
    assert set(result["ratios"]["final_vs_chain_p"]) == {"branch", "sft"}
    assert (tmp_path / "curves.png").stat().st_size > 0
    text = (tmp_path / "curves.md").read_text()
    assert "| chain |" in text and "Significance (2 seeds)" in text and "the same on the wall clock" in text
    assert set(result["ratios"]["time_to_chain_final_other_clock"]) == {"chain", "branch", "sft"}


def test_a_bench_of_dataset_objectives_alone_writes_its_result(tmp_path, capsys):
    """Dataset objectives have no group shape: a bench of them alone (or first among the variants) ended in a
    KeyError after all its runs, losing them. A later first seed runs that seed (a benchmark continued in another process)."""
    result = bench_curves(0.01, 1, tmp_path / "c.json", tmp_path, points=2, variants=["sft"], images_per_prompt=1,
                          extra_overrides=["prompts.per_iteration=1"], reference="sft", first_seed=3)
    assert "seed 3 sft: " in capsys.readouterr().out
    assert result["notes"]["shape"] == "dataset objectives only: each trains prompts.per_iteration rows an iteration"
    assert len(result["variants"]["sft"]["strict"][0]) == 2 and json.loads((tmp_path / "c.json").read_text())["reference"] == "sft"


def test_variant_specs_and_merging_runs_over_other_seeds(tmp_path):
    """A variant with its own overrides (commas inside brackets kept); two runs' seeds merged into one result equal to the
    result of all the seeds at once (means, intervals, Welch's test)."""
    from branchdiff.bench.curves import split_variants, summarize_runs, variant_spec
    from branchdiff.bench.curves_merge import merge_results

    assert split_variants("mix,awm:train.learning_rate=1e-4,mix:tree.splits=[[0,2],[1,2]]") == [
        "mix", "awm:train.learning_rate=1e-4", "mix:tree.splits=[[0,2],[1,2]]"]
    assert variant_spec("awm:train.learning_rate=1e-4:awm.average_kl=0.1") == ("awm", ["train.learning_rate=1e-4", "awm.average_kl=0.1"])
    with pytest.raises(ValueError, match=r"unknown variant 'aw' in 'aw:x=1'"):
        variant_spec("aw:x=1")

    def run(strict, iterations):
        return {"strict": strict, "iterations": iterations, "eval_minutes": {"wall": GRID, "modelled": GRID},
                "eval_iterations": [round(iterations * t / GRID[-1]) for t in GRID],
                "seconds": {"wall": 3.0 * iterations, "modelled": 1.0 * iterations}}

    seeds = {"mix": [[0.2, 0.3, 0.5, 0.6], [0.2, 0.4, 0.5, 0.5], [0.2, 0.3, 0.6, 0.7]],
             "awm": [[0.2, 0.35, 0.55, 0.65], [0.2, 0.3, 0.4, 0.5], [0.2, 0.5, 0.6, 0.8]]}
    everything = summarize_runs(3.0, 3, GRID, {n: [run(s, 60) for s in v] for n, v in seeds.items()}, 4, (8, 8), "wall", "mix")
    for index, (first, count) in enumerate(((0, 2), (2, 1))):
        part = summarize_runs(3.0, count, GRID, {n: [run(s, 60) for s in v[first:first + count]] for n, v in seeds.items()}, 4, (8, 8), "wall", "mix")
        (tmp_path / f"{index}.json").write_text(json.dumps(part))
    merged = merge_results([tmp_path / "0.json", tmp_path / "1.json"], tmp_path / "out", tmp_path / "merged.json")
    for name in seeds:
        assert merged["variants"][name]["seconds_per_iteration"] == pytest.approx(everything["variants"][name]["seconds_per_iteration"])
        for key in ("strict", "mean", "ci", "iterations"):
            np.testing.assert_allclose(np.asarray(merged["variants"][name][key], dtype=float),
                                       np.asarray(everything["variants"][name][key], dtype=float), err_msg=f"{name} {key}")
    assert merged["ratios"]["final_vs_mix_p"] == pytest.approx(everything["ratios"]["final_vs_mix_p"])
    assert (tmp_path / "out" / "curves.md").is_file() and json.loads((tmp_path / "merged.json").read_text())["seeds"] == 3


def test_the_plot_keeps_a_long_legend_inside_the_image(tmp_path):
    """The legend stands beside the axes; a variant's spec can be long (`dpo_offline_then_default:iterations=270:...`): the
    saved image widens to hold it instead of cutting it (and the title and axis label) at the figure's 7 × 120 pixels."""
    from PIL import Image

    from branchdiff.bench.curves import plot_curves

    grid = [0.0, 1.0, 2.0]
    long_name = "dpo_offline_then_default:iterations=270:train.decay_start=162"
    result = {"grid": grid, "seeds": 2, "clock": "wall", "reference": "mix",
              "variants": {name: {"mean": [0.2, 0.3, 0.4], "ci": [[0.2, 0.2], [0.25, 0.35], [0.3, 0.5]], "strict": [[0.2, 0.3, 0.4]] * 2,
                                  "eval_iterations": [[0, 10, 20]] * 2}
                           for name in ("mix", long_name)}}
    plot_curves(result, tmp_path / "curves.png")
    width, _ = Image.open(tmp_path / "curves.png").size
    assert width > 12 * 120 + 200


def _part(tmp_path, name: str, first: int, count: int, seed_ids: bool = True):
    """A `bench curves` JSON result of seeds first..first+count-1 of mix and awm (as a run of --first-seed writes it)."""
    from branchdiff.bench.curves import summarize_runs

    curves = [[0.2, 0.3 + 0.01 * k, 0.5, 0.6 + 0.02 * k] for k in range(first, first + count)]
    runs = {n: [{"strict": c, "iterations": 60 + k, "eval_minutes": {"wall": GRID, "modelled": GRID}, "eval_iterations": [0, 20, 40, 60 + k],
                 "seconds": {"wall": 180.0, "modelled": 60.0}}
                for k, c in enumerate(curves)] for n in ("mix", "awm")}
    result = summarize_runs(3.0, count, GRID, runs, 4, (8, 8), "wall", "mix")
    if seed_ids:
        result["seed_ids"] = list(range(first, first + count))
    path = tmp_path / name
    path.write_text(json.dumps(result))
    return path


def _broken(good: dict) -> dict[str, str]:
    """File contents `--merge` refuses, each with the words of its one line."""
    no_scores = json.loads(json.dumps(good))
    del no_scores["variants"]["awm"]["strict"]
    nan_list = json.dumps(good).replace('"iterations": [60, 61]', '"iterations": NaN', 1)
    short = json.loads(json.dumps(good))
    short["variants"]["mix"]["strict"][0] = short["variants"]["mix"]["strict"][0][:2]
    no_variants = {k: v for k, v in good.items() if k != "variants"}
    return {"[]": "it holds a list, not an object", '{"hello": 1}': "no 'budget', 'grid', 'clock', 'reference', 'variants'",
            json.dumps(no_variants): "no 'variants'", json.dumps(no_scores): "variant 'awm' has no per-seed scores",
            nan_list: "variant 'mix': 'iterations' must hold one number per seed (2)", json.dumps(short): "variant 'mix' has no per-seed scores",
            "": "is empty", '{"minutes": 3': "is not JSON"}


def test_merge_checks_every_file_before_anything_merges(tmp_path):
    """`[]` was a TypeError, `{"hello": 1}` a KeyError, a variant without its scores an IndexError, NaN where a list belongs a
    TypeError: each is one line naming the file and what is wrong, and nothing is written."""
    from branchdiff.bench.curves_merge import merge_results
    from branchdiff.errors import UserError

    good = _part(tmp_path, "good.json", 0, 2)
    for index, (text, words) in enumerate(_broken(json.loads(good.read_text())).items()):
        bad = tmp_path / f"bad-{index}.json"
        bad.write_text(text)
        with pytest.raises(UserError, match="^bench curves --merge: " + str(bad).replace(".", r"\.") + " .*" + re.escape(words)):
            merge_results([good, bad], tmp_path / "out", tmp_path / "merged.json")
    with pytest.raises(UserError, match=r"missing.json does not exist; give the JSON files that bench curves --json wrote$"):
        merge_results([good, tmp_path / "missing.json"], tmp_path / "out", None)
    assert not (tmp_path / "out").exists() and not (tmp_path / "merged.json").exists()


def test_merge_refuses_a_seed_counted_twice(tmp_path):
    """The same file twice was merged as ten seeds (the default's interval narrowed from [0.584, 0.746] to [0.621, 0.709] by
    duplicated seeds): a file named twice, two files sharing a seed (by the seed numbers they record) and, in files older than
    those numbers, the same run in two files are refused; distinct seeds merge, their numbers kept."""
    from branchdiff.bench.curves_merge import merge_results
    from branchdiff.errors import UserError

    first, second, overlap = _part(tmp_path, "0-1.json", 0, 2), _part(tmp_path, "2.json", 2, 1), _part(tmp_path, "1-2.json", 1, 2)
    with pytest.raises(UserError, match=r"^bench curves --merge: .*0-1.json is named twice; its seeds would count twice \(each file once\)$"):
        merge_results([first, second, tmp_path / "." / "0-1.json"], tmp_path / "out", None)
    with pytest.raises(UserError, match=r"^bench curves --merge: seed 1 of variant mix is in both .*0-1.json and .*1-2.json; merge files of "
                                        r"different seeds \(each run's --first-seed\), each seed once$"):
        merge_results([first, overlap], tmp_path / "out", None)
    old_first, old_copy = _part(tmp_path, "old.json", 0, 2, seed_ids=False), tmp_path / "old-copy.json"
    old_copy.write_text(old_first.read_text())
    with pytest.raises(UserError, match=r"^bench curves --merge: a run of variant mix is in both .*old.json and .*old-copy.json"):
        merge_results([old_first, old_copy], tmp_path / "out", None)
    with pytest.raises(UserError, match=r"^bench curves --merge: a run of variant mix is in both .*old.json and .*0-1.json"):
        merge_results([old_first, first], tmp_path / "out", None)  # an older file and a newer one holding the same seeds
    with pytest.raises(UserError, match=r"^bench curves --merge --reference nosuch: no such variant in the files merged \(mix, awm\)"):
        merge_results([first, second], tmp_path / "out", None, "nosuch")
    assert not (tmp_path / "out").exists()
    merged = merge_results([first, second], tmp_path / "out", None)
    assert merged["seed_ids"] == [0, 1, 2] and len(merged["variants"]["mix"]["strict"]) == 3


def test_one_seed_says_n_a_where_a_statistic_needs_two_and_each_variant_its_count(tmp_path):
    """One seed printed intervals [x, x], "Welch p = 1.000" and "significantly later or never"; merged files with other
    variants were labelled with the smallest count."""
    from branchdiff.bench.curves import format_ratios, format_significance, format_table, summarize_runs

    def runs(count: int) -> list[dict]:
        return [{"strict": [0.2, 0.3, 0.5, 0.6 + 0.01 * k], "iterations": 60, "eval_minutes": {"wall": GRID, "modelled": GRID},
                 "eval_iterations": [0, 20, 40, 60],
                 "seconds": {"wall": 180.0, "modelled": 60.0}} for k in range(count)]

    one = summarize_runs(3.0, 1, GRID, {"mix": runs(1), "awm": runs(1)}, 4, (8, 8), "wall", "mix")
    assert one["ratios"]["final_vs_mix_p"] == {"awm": None} and one["ratios"]["time_to_mix_final_ci"]["awm"] is None
    table, significance = format_table(one), format_significance(one)
    assert "[n/a]" in table and "[0.600, 0.600]" not in table
    assert "- awm: final 0.600 vs mix's 0.600: n/a (a test needs two seeds of each; 1 and 1 here)." in significance
    assert "Welch" not in significance and "never" not in significance and significance.startswith("Significance (1 seed):")
    assert "awm 1.00 [n/a: one seed]" in format_ratios(one)
    mixed = summarize_runs(3.0, 2, GRID, {"mix": runs(3), "awm": runs(2)}, 4, (8, 8), "wall", "mix")
    assert format_significance(mixed).startswith("Significance (seeds: mix 3, awm 2):")
    assert [line.split()[1] for line in format_table(mixed).splitlines()[1:]] == ["3", "2"]


def test_a_run_is_read_linearly_between_its_evaluations_and_compared_where_every_run_reached():
    """s(x) between evaluations, x* the smallest last spend, the paired t-test on per-seed differences (by its formula),
    Welch's test where the runs are not the same seeds."""
    from scipy import stats

    from branchdiff.bench.equal_budget import compare_at_equal_spend, paired_p, value_at

    # between (10, 0.2) and (30, 0.6): 0.2 + (25 − 10) / 20 · 0.4 = 0.5; a repeated evaluation (30, 30) holds one value
    assert value_at([0, 10, 30, 30], [0.1, 0.2, 0.6, 0.6], 25) == pytest.approx(0.5)
    assert value_at([0, 10, 30], [0.1, 0.2, 0.6], 30) == pytest.approx(0.6)
    with pytest.raises(ValueError, match="outside the run's evaluations"):
        value_at([0, 10, 30], [0.1, 0.2, 0.6], 31)
    reference = ([[0, 50, 100], [0, 40, 80], [0, 60, 120]], [[0.2, 0.4, 0.6], [0.2, 0.3, 0.5], [0.2, 0.5, 0.7]])
    variant = ([[0, 30, 60], [0, 35, 70], [0, 45, 90]], [[0.2, 0.5, 0.6], [0.2, 0.4, 0.5], [0.2, 0.6, 0.8]])
    c = compare_at_equal_spend(reference, variant, paired=True)
    assert c["at"] == 60  # the variant's first seed ends there: no run is extrapolated
    # reference at 60: 0.4 + 10/50 · 0.2 = 0.44; 0.3 + 20/40 · 0.2 = 0.4; 0.5 exactly. variant: 0.6; 0.4 + 25/35 · 0.1; 0.6 + 15/45 · 0.2
    expected_reference, expected_variant = [0.44, 0.4, 0.5], [0.6, 0.4 + 25 / 35 * 0.1, 0.6 + 15 / 45 * 0.2]
    np.testing.assert_allclose(c["reference"], expected_reference)
    np.testing.assert_allclose(c["variant"], expected_variant)
    d = np.subtract(expected_variant, expected_reference)
    t = d.mean() / (d.std(ddof=1) / np.sqrt(3))
    assert c["per_seed"] == pytest.approx(d.tolist()) and c["test"] == "paired t"
    assert c["p"] == pytest.approx(2 * stats.t.sf(abs(t), 2), rel=1e-9)
    assert c["difference"] == pytest.approx(d.mean())
    unpaired = compare_at_equal_spend(reference, variant, paired=False)
    assert unpaired["test"] == "Welch" and unpaired["per_seed"] is None
    assert unpaired["p"] == pytest.approx(welch_p(expected_variant, expected_reference))
    assert paired_p([0.1]) == 1.0 and paired_p([0.0, 0.0]) == 1.0 and paired_p([0.1, 0.1]) == 0.0


def test_an_iteration_budget_evaluates_at_whole_iterations_and_reads_the_runs_at_equal_wall_time(tmp_path):
    """`--iterations 2 --points 3`: every run evaluated after 0, 1 and 2 iterations, each evaluation's iterations and minutes
    kept, each run's own rate; the comparison with the reference on the other axis (wall minutes), paired by seed."""
    result = bench_curves(2, 2, tmp_path / "c.json", tmp_path, points=3, variants=["sft", "dpo_offline"], images_per_prompt=1,
                          extra_overrides=["prompts.per_iteration=1"], clock="iterations", reference="sft")
    assert result["unit"] == "iterations" and result["grid"] == [0, 1, 2] and result["budget"] == 2
    for v in result["variants"].values():
        assert v["eval_iterations"] == [[0, 1, 2]] * 2 and v["iterations"] == [2, 2]
        wall = v["eval_minutes"]["wall"]
        assert all(run[0] == 0 < run[1] < run[2] for run in wall)
        # each run's own rate is its wall seconds over its iterations (at its last evaluation: its whole training)
        assert v["run_seconds_per_iteration"]["wall"] == pytest.approx([run[-1] * 60 / 2 for run in wall])
    equal = result["equal"]
    assert equal["axis"] == "wall minutes" and set(equal["comparisons"]) == {"dpo_offline"}
    comparison = equal["comparisons"]["dpo_offline"]
    assert comparison["at"] == min(run[-1] for v in result["variants"].values() for run in v["eval_minutes"]["wall"])
    assert comparison["test"] == "paired t" and len(comparison["per_seed"]) == 2
    text = (tmp_path / "curves.md").read_text()
    assert "--iterations 2 --seeds 2" in text and "| 0 it. | 1 it. | 2 it. (final) |" in text
    assert "At equal wall minutes: each variant against sft at the most wall minutes every run of both reached" in text
    assert "iterations to reach sft's final mean" in text


def test_merge_reads_an_older_file_estimating_each_evaluations_iterations(tmp_path):
    """A file written before `eval_iterations` (keys `minutes`, `grid_minutes`) merges: each evaluation's iterations are the
    run's iterations × its minutes there over its last (its constant rate), the estimate named in the notes."""
    from branchdiff.bench.curves_merge import merge_results

    new = json.loads(_part(tmp_path, "new.json", 0, 2).read_text())
    old = {**{k: v for k, v in new.items() if k not in ("budget", "grid", "unit", "equal")}, "minutes": 3.0, "grid_minutes": GRID}
    minutes = [0.0, 0.8, 2.1, 3.2]  # a run's evaluations, on its clock
    for v in old["variants"].values():
        del v["eval_iterations"], v["run_seconds_per_iteration"]
        v["eval_minutes"]["wall"] = [minutes, minutes]
    (tmp_path / "old.json").write_text(json.dumps(old))
    merged = merge_results([tmp_path / "old.json"], tmp_path / "out", None)
    assert merged["budget"] == 3.0 and merged["grid"] == GRID
    for v in merged["variants"].values():
        for total, estimate in zip(v["iterations"], v["eval_iterations"]):
            assert estimate == pytest.approx([total * m / 3.2 for m in minutes])
    assert "estimated at the run's own constant rate" in merged["notes"]["eval_iterations"]
    assert "At equal iterations (estimated: see the notes)" in (tmp_path / "out" / "curves.md").read_text()


def test_the_rankings_equal_iteration_table_is_what_its_command_computes(tmp_path):
    """docs/curves.md's table at equal iterations holds the numbers `bench curves --merge docs/curves-ranking-6min.json`
    prints (this file's iterations estimated), and the regression of its Guard paragraph: LayerTuning-RL below the default at
    220 iterations in every seed (paired p = 0.024)."""
    from pathlib import Path

    from branchdiff.bench.curves_merge import merge_results
    from branchdiff.bench.equal_budget import paired_p, value_at

    docs = Path(__file__).resolve().parents[1] / "docs"
    merged = merge_results([docs / "curves-ranking-6min.json"], tmp_path, None, "default:iterations=325:train.decay_start=195")
    table = (docs / "curves.md").read_text()
    for name, c in merged["equal"]["comparisons"].items():
        row = (f"| `{name.split(':')[0]}` | {c['at']:.0f} | {c['variant_mean']:.3f} | {c['reference_mean']:.3f} | {c['difference']:+.3f} | "
               + ", ".join(f"{d:+.3f}" for d in c["per_seed"]) + f" | {c['p']:.3f} |").replace("-", "−")
        assert row in table, row  # the docs write a minus sign
    variants = merged["variants"]
    default, layertuning = (next(v for k, v in variants.items() if k.startswith(prefix)) for prefix in ("default", "layertuning"))
    d = [value_at(x, s, 220) - value_at(y, r, 220) for x, s, y, r in zip(layertuning["eval_iterations"], layertuning["strict"],
                                                                          default["eval_iterations"], default["strict"])]
    assert all(-0.03 < x < 0 for x in d) and statistics.mean(d) == pytest.approx(-0.014, abs=5e-4) and paired_p(d) == pytest.approx(0.024, abs=5e-4)
