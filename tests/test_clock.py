"""The modelled GPU clock against hand-computed iterations, and its table against the explore backends."""

import dataclasses

import pytest

from branchdiff.bench.clock import BACKEND_FORMAT, FORMAT_COST, modelled_seconds, row_cost
from branchdiff.settings.config import ExploreConfig

ITERATION = {"rollout_seconds": 3.0, "reward_seconds": 0.5, "train_seconds": 2.0, "nfe_rollout_computed": 300}


def test_without_an_explorer_the_modelled_time_is_the_measured_time():
    assert modelled_seconds(ITERATION, None) == pytest.approx(3.0 + 0.5 + 2.0)


def test_explorer_rows_are_charged_at_their_formats_cost():
    # regeneration: 200 policy rows in 1.0 s → 5 ms a row; the pool: 800 NVFP4 rows at a quarter of that
    explored = {**ITERATION, "explore_regen_nfe": 200, "explore_regen_seconds": 1.0, "explore_pool_nfe": 800,
                "explore_pool_score_seconds": 0.25, "rollout_seconds": 9.0}  # the emulated pool made the measured rollout slow
    assert modelled_seconds(explored, "nvfp4-emulated") == pytest.approx(0.005 * (200 + 0.25 * 800) + 0.25 + 0.5 + 2.0)
    assert modelled_seconds(explored, "te-fp8") == pytest.approx(0.005 * (200 + 0.5 * 800) + 0.25 + 0.5 + 2.0)
    assert modelled_seconds(explored, "none") == pytest.approx(0.005 * 1000 + 0.25 + 0.5 + 2.0)


def test_every_explore_backend_has_a_format_with_a_sourced_cost():
    backends = dataclasses.fields(ExploreConfig)[[f.name for f in dataclasses.fields(ExploreConfig)].index("backend")].metadata["choices"]
    assert set(backends) == set(BACKEND_FORMAT)
    assert {row_cost(b) for b in backends} <= set(FORMAT_COST.values())
    # dense tensor-core throughput ratios from NVIDIA's datasheets (H100: BF16 989, FP8 1979 TFLOPS; B200: 2.25, 4.5, 9 PFLOPS)
    assert FORMAT_COST == {"bf16": 1.0, "fp8": pytest.approx(989 / 1979, abs=1e-3), "nvfp4": 2.25 / 9, "mxfp4": 2.25 / 9}
