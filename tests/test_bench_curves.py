"""The curves benchmark's interpolation and ratios (hand-computed), its variants' shapes, and one
tiny end-to-end run (its numbers are for `branchdiff bench curves`, not for tests)."""

import json

import pytest

from branchdiff.bench_curves import COMMON, VARIANTS, bench_curves, first_time_reaching, group_size, time_to_reference_final
from branchdiff.config import load_config

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


def test_variants_share_prompts_and_group_size():
    shapes = set()
    for preset, overrides in VARIANTS.values():
        config = load_config(preset, [*COMMON, *overrides])
        shapes.add((config.prompts.per_iteration, group_size(config)))
    assert shapes == {(8, 8)}


@pytest.mark.slow
def test_bench_curves_smoke(tmp_path):
    json_path = tmp_path / "c.json"
    result = bench_curves(0.02, 1, json_path, tmp_path, points=2, variants=["chain", "branch"], images_per_prompt=1,
                          extra_overrides=["prompts.per_iteration=1"])
    assert json.loads(json_path.read_text()) == json.loads(json.dumps(result))
    assert set(result) == {"minutes", "seeds", "grid_minutes", "variants", "ratios", "notes"}
    assert result["grid_minutes"] == [0.0, 0.02]
    for v in result["variants"].values():
        assert len(v["strict"]) == 1 and len(v["strict"][0]) == 2 and len(v["mean"]) == len(v["std"]) == 2
        assert v["iterations"][0] >= 1 and v["seconds_per_iteration"] > 0
    chain, branch = result["variants"]["chain"], result["variants"]["branch"]
    assert chain["strict"][0][0] == branch["strict"][0][0]  # time 0 is the shared base model
    assert set(result["ratios"]["time_to_chain_final"]) == {"chain", "branch"}
    assert (tmp_path / "curves.png").stat().st_size > 0
    assert "| chain |" in (tmp_path / "curves.md").read_text()
