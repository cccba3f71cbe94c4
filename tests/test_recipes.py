"""The presets pinned to published recipes (docs/recipes.yaml, docs/recipes.md): every value the table pins is the
preset's, with a source for each; what cannot be expressed is listed; the card states the paper's numbers and the plan
at the published GPU count, and the plan figures in docs/recipes.md are what `branchdiff plan` computes now."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from branchdiff.settings.load import load_config

DOCS = Path(__file__).parents[1] / "docs"
RECIPES = yaml.safe_load((DOCS / "recipes.yaml").read_text())


def _value(config: object, dotted: str) -> object:
    for key in dotted.split("."):
        config = getattr(config, key)
    return config


@pytest.mark.parametrize("preset", list(RECIPES))
def test_every_pinned_value_is_the_presets_and_says_where_it_comes_from(preset):
    recipe, config = RECIPES[preset], load_config(preset)
    assert recipe["source"] and recipe["reported"] and recipe["recipe"] and isinstance(recipe["gpus"], int)
    assert recipe["not_expressed"] and all(isinstance(line, str) and line for line in recipe["not_expressed"])
    mismatched = [(key, value, _value(config, key)) for key, value, source in recipe["pinned"]
                  if _value(config, key) != value or not str(source).strip()]
    assert mismatched == [], mismatched
    keys = [key for key, _, _ in recipe["pinned"]]
    assert len(keys) == len(set(keys)) >= 10
    header = (Path(__file__).parents[1] / "branchdiff" / "configs" / f"{preset}.yaml").read_text().splitlines()[0]
    assert "docs/recipes.md" in header  # `branchdiff train --help` lists it as pinned


def test_the_cards_state_the_papers_numbers_and_the_plan_at_the_published_gpu_count():
    """docs/recipes.md's card of each preset: its reported numbers and `branchdiff plan PRESET --gpus N`'s peak and modelled
    seconds per iteration, as the plan computes them today (a preset changed without its card fails here)."""
    from branchdiff.plan.estimate import GIB, Estimator, Target, with_change
    from branchdiff.settings.load import preset_or_default

    cards = (DOCS / "recipes.md").read_text()
    estimator = Estimator()
    for preset, recipe in RECIPES.items():
        card = cards[cards.index(f"### `{preset}`"):]
        card = card[: card.find("\n### ", 1) if "\n### " in card[1:] else len(card)]
        assert recipe["reported"] in card, preset
        sharding = recipe.get("sharding", "none")
        plan = with_change(preset_or_default(preset, []), [], Target(recipe["gpus"], sharding, None, None, 0.4, 1), estimator)
        flag = "" if sharding == "none" else f" --sharding {sharding}"
        expected = f"`branchdiff plan {preset} --gpus {recipe['gpus']}{flag}`: peak {plan.peak / GIB:.1f} GiB ({plan.peak_phase}) a process"
        assert expected in card and f"modelled {plan.seconds:.0f} s an iteration" in card, (preset, expected, re.findall(r"`branchdiff plan.*", card))
