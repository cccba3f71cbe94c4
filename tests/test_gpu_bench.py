"""scripts/gpu_bench.py on the CPU at tiny sizes: every code path the GPU run takes (the plan's FLOP count and
memory estimate, the family's input shapes, the timed forward and LoRA backward, the JSON), so a lent GPU's
minutes are not lost to a typo. The released sizes run only where CUDA is (docs/gpu.md)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_bench.py"


def _bench():
    spec = importlib.util.spec_from_file_location("gpu_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_family_measures_at_tiny_size_and_writes_its_figures(tmp_path):
    bench = _bench()
    out = tmp_path / "bench.json"
    assert bench.main(["--tiny", "--out", str(out), "--batches", "1,2", "--train-rows", "1", "--tree", "none"]) == 0
    record = json.loads(out.read_text())
    assert record["matmul_peak_tflops"] > 0 and set(record["families"]) == set(bench.RELEASES)
    for key, figures in record["families"].items():
        assert isinstance(figures, dict), (key, figures)
        assert set(figures["forward"]) == {"1", "2"} and set(figures["train"]) == {"1"}
        assert figures["lora_params"] > 0 and figures["forward_gflop_per_row"] > 0
        one, two = figures["forward"]["1"], figures["forward"]["2"]
        # achieved TFLOP/s is rows × the plan's FLOPs per row ÷ seconds
        assert one["tflops"] == pytest.approx(figures["forward_gflop_per_row"] / 1e3 / one["seconds"])
        assert two["planned_gib"] > one["planned_gib"] > 0  # the plan's estimate grows with the rows


def test_the_compiled_forward_is_timed_against_the_eager_one(tmp_path):
    out = tmp_path / "bench.json"
    assert _bench().main(["--tiny", "--out", str(out), "--families", "sd3", "--batches", "2", "--train-rows", "1", "--compile", "blocks",
                          "--compile-backend", "eager", "--tree", "none"]) == 0
    compiled = json.loads(out.read_text())["families"]["sd3"]["forward_compiled"]
    assert compiled["mode"] == "blocks" and compiled["rows"] == 2 and compiled["speedup_over_eager"] > 0 and compiled["first_call_seconds"] > 0


def test_whole_iterations_of_the_chain_and_the_best_tree_measure_their_phases_ratios_and_memory(tmp_path, monkeypatch):
    """--tree: a tiny SD3 pipeline saved and loaded as model.path, a fresh Trainer per variant, one measured iteration
    each: the phases sum to the iteration, the chain ÷ best ratio and its efficiency are `bench tree`'s (speed-up over
    the NFE model's), every phase's peak beside the plan's, and the ratio of probabilities 1 before the update."""
    from accelerate.state import AcceleratorState

    monkeypatch.syspath_prepend(str(SCRIPT.parent))  # the reward `gpu_bench:Warmth`, as a run from scripts/ imports it
    out = tmp_path / "bench.json"
    AcceleratorState._reset_state()  # the bench's Trainers train in bf16, this process's others in fp32: each starts from no state
    try:
        assert _bench().main(["--tiny", "--out", str(out), "--families", "", "--tree", "best,chain"]) == 0
    finally:
        AcceleratorState._reset_state()
    tree = json.loads(out.read_text())["tree_iteration"]
    assert tree["resolution"] == 64 and set(tree["variants"]) == {"chain", "best"}
    chain, best = tree["variants"]["chain"], tree["variants"]["best"]
    for row in (chain, best):
        assert sum(row["profile"].values()) == pytest.approx(row["seconds"]) and row["seconds"] > 0
        assert row["logprob_check"] < 1e-3 and row["runtime"]["compile"] == "none" and row["runtime"]["attention_backend"] == "native"  # auto, on the CPU
        assert set(row["memory"]) == {"rollout", "reward", "train"} and all(m["planned_gib"] > 0 for m in row["memory"].values())
    assert chain["nfe_rollout"] == 16 * 20 and best["nfe_rollout"] < chain["nfe_rollout"]  # 16 chains of 20 steps (--tiny: no CFG) against the tree's
    assert tree["ratios"]["chain_over_best"] == pytest.approx(chain["seconds"] / best["seconds"])
    assert best["efficiency"] == pytest.approx(best["speedup"] / best["nfe_speedup"]) and tree["trained_row_cost_c"] > 0
    against = tree["rollout_vs_pipeline"]  # branchdiff's ODE rollout of 8 images and the pipeline's __call__ making 8 (CFG: 16 rows a step)
    assert against["forward_rows"]["ours"] == against["forward_rows"]["pipeline"] == [16] * 10
    assert against["ours_over_pipeline"] > 0  # the time ratio is the bench's figure, not a test's
    cached = against["block_cache"]  # the same rollout with the first-block cache at 0.3: skips some forwards, moves the latents a little
    assert cached["threshold"] == 0.3 and 0 <= cached["forwards_skipped"] < 1 and cached["uncached_over_cached"] > 0
    assert (cached["latents_moved"] == 0) == (cached["forwards_skipped"] == 0)


def test_a_spent_budget_skips_with_its_reason(tmp_path):
    out = tmp_path / "bench.json"
    assert _bench().main(["--tiny", "--out", str(out), "--budget", "0", "--families", "sd3", "--tree", "chain"]) == 0
    record = json.loads(out.read_text())
    assert record["families"] == {"sd3": "skipped: the run's time budget is spent"}
    assert record["tree_iteration"]["variants"] == {"chain": "skipped: the run's time budget is spent"}


def test_the_released_sizes_are_refused_without_cuda(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is present here")
    with pytest.raises(SystemExit) as stopped:
        _bench().main(["--families", "sd3"])
    assert stopped.value.code == 2 and "--tiny runs every code path on the CPU" in capsys.readouterr().err


@pytest.mark.parametrize("batches", ["one", "1,0", ""])
def test_row_counts_that_are_not_whole_numbers_are_one_line(batches, capsys):
    """`--batches one` was a ValueError traceback after the tree iterations had run."""
    with pytest.raises(SystemExit) as stopped:
        _bench().main(["--tiny", "--batches", batches])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and f"argument --batches: {batches!r} is not a list of row counts; give whole numbers ≥ 1" in err
    assert "Traceback" not in err


def test_the_cudnn_backward_check_compares_the_gradients_of_the_same_batch():
    """The check the GPU run makes of cuDNN's attention backward, on the CPU (where the switch changes nothing: equal)."""
    import torch

    bench = _bench()
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 4))
    trainable = list(model.parameters())
    figures = bench.cudnn_backward(model, lambda batch: model(batch["x"]), {"x": torch.randn(3, 4)}, trainable, torch.device("cpu"), 1)
    assert figures["finite"] and figures["native_finite"] and figures["max_difference_of_largest"] == 0.0 and figures["speedup_over_native"] > 0
    assert all(p.grad is None for p in trainable)  # each pass clears what it made
