"""`bench hacking`: Gao et al.'s functional forms fit exactly where the data follow them, best-of-n's picks and KL by
hand, the watch's stopped run keeping its best checkpoint, the mitigations' rewards, merging runs of other seeds, and one
tiny end-to-end run."""

import json
import math

import numpy as np
import pytest

from branchdiff.bench.hacking import (
    MITIGATIONS,
    _kept_checkpoint,
    bench_hacking,
    best_of_n,
    fit_form,
    merge_hacking,
    mitigation_config,
    mitigation_spec,
    reward_overrides,
    summarize_hacking,
    watch_sweep,
)
from branchdiff.errors import UserError
from branchdiff.rewards.combine import parse_reward_specs


@pytest.mark.parametrize("form, alpha, beta", [("rl", 0.3, 0.05), ("bon", 0.2, 0.04)])
def test_each_form_is_recovered_from_points_on_it(form, alpha, beta):
    d = np.array([0.0, 0.5, 1.0, 2.0, 3.0, 5.0])
    gain = alpha * d - beta * (d * np.log(np.where(d > 0, d, 1.0)) if form == "rl" else d**2)
    assert fit_form(d, gain, form) == pytest.approx((alpha, beta), rel=1e-9)


def test_best_of_n_picks_the_proxys_best_of_each_group_and_its_kl():
    # one prompt, four samples: proxy 0.1 0.9 0.5 0.2, gold 1 0 1 0
    proxy, gold = np.array([0.1, 0.9, 0.5, 0.2]), np.array([1.0, 0.0, 1.0, 0.0])
    rows = best_of_n(proxy, gold, 4)
    assert rows[1] == {"proxy": pytest.approx(0.425), "gold": 0.5, "kl": 0.0}
    assert rows[2]["gold"] == pytest.approx(0.5) and rows[2]["proxy"] == pytest.approx((0.9 + 0.5) / 2)  # picks 0.9 (gold 0), 0.5 (gold 1)
    assert rows[4] == {"proxy": pytest.approx(0.9), "gold": 0.0, "kl": pytest.approx(math.log(4) - 3 / 4)}


def test_a_run_the_watch_stopped_keeps_its_best_checkpoint_to_the_end():
    record = {"eval_iterations": [0, 10, 20], "gold": [0.2, 0.5, 0.4], "gold_partial": [0.6, 0.7, 0.65], "proxy": [0.5, 0.6, 0.8],
              "kl": [0.0, 3.0, 9.0]}
    kept = _kept_checkpoint(record, [0, 10, 20, 30, 40])
    assert kept["gold"] == [0.2, 0.5, 0.4, 0.5, 0.5] and kept["kl"] == [0.0, 3.0, 9.0, 3.0, 3.0] and kept["kept"] == 10
    assert kept["eval_iterations"] == [0, 10, 20, 30, 40]


def test_each_mitigation_trains_on_its_reward():
    assert reward_overrides("none", "tiny-partial", [], "tiny-geneval") == ["reward=tiny-partial"]
    assert reward_overrides("gold-reward", "tiny-partial", [], "tiny-geneval") == ["reward=tiny-geneval"]
    one = json.loads(reward_overrides("ensemble-min", "x", ["a", "b"], "tiny-geneval")[0].removeprefix("reward="))
    assert one == {"name": "learned-proxy", "kwargs": {"path": ["a", "b"], "reduce": "min"}}
    separate, combine = reward_overrides("normalize-then-sum", "x", ["a", "b"], "tiny-geneval")
    assert json.loads(separate.removeprefix("reward=")) == [{"name": "learned-proxy", "label": f"proxy-{k}", "kwargs": {"path": p}}
                                                            for k, p in enumerate(("a", "b"))]
    assert combine == "reward_combine=normalize_then_sum"
    with pytest.raises(ValueError, match="mitigation ensemble-mean needs two or more proxies: give them as --ensemble"):
        reward_overrides("ensemble-mean", "x", ["a"], "tiny-geneval")
    assert mitigation_spec("kl:train.kl_beta=0.1") == ("kl", ["train.kl_beta=0.1"])
    with pytest.raises(ValueError, match="unknown mitigation 'klx'"):
        mitigation_spec("klx")


@pytest.mark.parametrize("task", ["tiny", "tiny-video"])
@pytest.mark.parametrize("name", list(MITIGATIONS))
def test_every_mitigation_loads_on_both_tasks_with_the_budgets_schedule(tmp_path, name, task):
    config = mitigation_config(name, "tiny-partial", ["a", "b", "c"], task, 120, 3, str(tmp_path))
    assert config.iterations == 120 and config.train.decay_start == 72 and config.train.lr_schedule == "cosine" and config.seed == 3
    rewards = parse_reward_specs(config.reward)
    if name in ("normalize-then-sum", "sum-then-normalize"):
        assert [spec.label for spec in rewards] == ["proxy-0", "proxy-1", "proxy-2"]
        assert config.reward_combine == name.replace("-then-", "_then_").replace("-", "_")


def _run(seed: int, gold: list[float], alarm=None) -> dict:
    return {"seed": seed, "eval_iterations": [0, 10, 20], "gold": gold, "gold_partial": gold, "proxy": [0.5, 0.6, 0.7], "kl": [0.0, 1.0, 4.0],
            "train_reward": [0.5, 0.6, 0.7], "alarm": alarm, "stopped": None}


def test_differences_from_none_are_paired_by_seed_and_merges_keep_each_seed_once(tmp_path):
    runs = {"none": [_run(0, [0.2, 0.5, 0.3]), _run(1, [0.2, 0.4, 0.35])], "kl": [_run(0, [0.2, 0.45, 0.4]), _run(1, [0.2, 0.42, 0.44], alarm=20)]}
    bon = {"1": {"proxy": 0.5, "gold": 0.2, "kl": 0.0}, "2": {"proxy": 0.6, "gold": 0.25, "kl": math.log(2) - 0.5},
           "4": {"proxy": 0.7, "gold": 0.28, "kl": math.log(4) - 0.75}}
    result = summarize_hacking(runs, [0, 10, 20], bon, {"reward": "tiny-partial"})
    kl = result["variants"]["kl"]
    assert kl["end_vs_none"]["per_seed"] == pytest.approx([0.1, 0.09]) and kl["peak_vs_none"]["per_seed"] == pytest.approx([-0.05, 0.04])
    assert kl["alarms"] == [None, 20] and kl["peak_iterations"] == [10, 20] and result["variants"]["none"]["end_kl"] == 4.0
    # split by seed into two files and merged: the same summary
    for seed in (0, 1):
        part = summarize_hacking({k: [r for r in v if r["seed"] == seed] for k, v in runs.items()}, [0, 10, 20], bon, {"reward": "tiny-partial"})
        (tmp_path / f"{seed}.json").write_text(json.dumps(part))
    merged = merge_hacking([tmp_path / "1.json", tmp_path / "0.json"], tmp_path / "out", None)
    assert merged["variants"]["kl"]["end_vs_none"]["per_seed"] == pytest.approx(kl["end_vs_none"]["per_seed"])
    assert merged["variants"]["kl"]["end_vs_none"]["p"] == pytest.approx(kl["end_vs_none"]["p"])
    with pytest.raises(UserError, match="seed 0 of none is in two files"):
        merge_hacking([tmp_path / "0.json", tmp_path / "0.json"], tmp_path / "out", None)


def test_a_tiny_run_records_gold_proxy_kl_and_the_watch(tmp_path):
    """Two iterations on the partial proxy: every evaluation's gold, proxy and KL (0 at the base model, above after
    training), and best-of-n on the same proxy."""
    result = bench_hacking('{"name": "tiny-partial", "kwargs": {"terms": ["count", "color"]}}', 2, 1, tmp_path / "h.json", tmp_path, points=2,
                           variants=["none", "watch-stop"], images_per_prompt=1, kl_chains=1, bon_max=2,
                           extra_overrides=["prompts.per_iteration=1", "model.compile=none"])
    for v in result["variants"].values():
        run = v["runs"][0]
        assert run["eval_iterations"] == [0, 2] and len(run["gold"]) == len(run["proxy"]) == len(run["train_reward"]) == 2
        assert run["kl"][0] == 0.0 and run["kl"][1] > 0 and 0 <= run["gold"][1] <= 1
    assert set(result["best_of_n"]) == {"1", "2"} and (tmp_path / "hacking.png").is_file()
    assert json.loads((tmp_path / "h.json").read_text())["grid"] == [0, 2]


def test_the_watch_replayed_gives_its_lead_the_gold_it_keeps_and_its_false_alarms():
    hacked = _run(0, [0.2, 0.5, 0.3])  # training reward rises 0.5 → 0.6 → 0.7; gold peaks at iteration 10, then falls by 0.2
    slow = _run(1, [0.4, 0.38, 0.1])  # peaks at 0: falls by 0.02 then 0.28
    honest = _run(2, [0.2, 0.3, 0.25])  # trained on the gold: falls by 0.05 at the end
    runs = {"none": [hacked], "kl:train.kl_beta=1": [slow], "watch-stop": [_run(3, [0.2, 0.1, 0.0])], "gold-reward": [honest]}
    rows = {(row["window"], row["tolerance"]): row for row in watch_sweep(runs, (1, 2), (0.0, 0.1))}
    strict = rows[1, 0.0]  # flags the first fall: hacked at 20 (peak 10), slow at 10 (peak 0); the honest run at 20
    assert (strict["flagged"], strict["proxy_runs"], strict["median_lead"]) == (2, 2, 10.0)
    assert strict["kept_gold"] == pytest.approx((0.5 + 0.4) / 2) and strict["end_gold"] == pytest.approx((0.3 + 0.1) / 2)
    assert (strict["false_alarms"], strict["gold_runs"]) == (1, 1)
    loose = rows[1, 0.1]  # slow's 0.02 at 10 is within it: slow at 20 (lead 20), hacked at 20 (lead 10); the honest 0.05 is too
    assert (loose["flagged"], loose["median_lead"], loose["false_alarms"]) == (2, 15.0, 0)
    wide = rows[2, 0.1]  # compares 20 with 0: hacked 0.3 vs 0.2 is no fall; slow 0.1 vs 0.4 is
    assert (wide["flagged"], wide["median_lead"], wide["false_alarms"]) == (1, 20.0, 0)
    assert wide["kept_gold"] == pytest.approx((0.3 + 0.4) / 2)


@pytest.mark.parametrize("result", ["hacking-n64.json", "hacking-n4096.json", "hacking-video.json"])
def test_the_docs_tables_are_what_their_merge_computes(tmp_path, result):
    """docs/hacking.md's tables hold the rows `bench hacking --merge docs/RESULT` prints."""
    from pathlib import Path

    from branchdiff.bench.hacking import format_hacking

    docs = Path(__file__).resolve().parents[1] / "docs"
    merged = merge_hacking([docs / result], tmp_path, None)
    page = (docs / "hacking.md").read_text()
    rows = [line for line in format_hacking(merged, markdown=True).splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) > 10 and all(row in page for row in rows), [row for row in rows if row not in page]
