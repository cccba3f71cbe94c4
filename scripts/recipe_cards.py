"""Write docs/recipes.md's cards from docs/recipes.yaml and `branchdiff plan` (tests/test_recipes.py checks that they agree).

    python scripts/recipe_cards.py

The text before the first card is kept as it is; each card is written anew: the recipe and its source, what the paper
reports, the plan at the published GPU count (an H100 80 GB, 0.4 of its bf16 peak; FSDP where the recipe shards),
the pinned keys and what branchdiff cannot express.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from branchdiff.plan.estimate import GIB, Estimator, Target, with_change
from branchdiff.settings.load import preset_or_default

DOCS = Path(__file__).parents[1] / "docs"


def card(preset: str, recipe: dict, estimator: Estimator) -> list[str]:
    sharding = recipe.get("sharding", "none")
    plan = with_change(preset_or_default(preset, []), [], Target(recipe["gpus"], sharding, None, None, 0.4, 1), estimator)
    flag = "" if sharding == "none" else f" --sharding {sharding}"
    fits = "" if plan.fits else " (does not fit: the plan names the change that does)"
    return [f"### `{preset}`", "", f"- Recipe: {recipe['recipe']}, `{recipe['source']}`.", f"- Reported: {recipe['reported']}",
            f"- Plan: `branchdiff plan {preset} --gpus {recipe['gpus']}{flag}`: peak {plan.peak / GIB:.1f} GiB ({plan.peak_phase}) a process, "
            f"modelled {plan.seconds:.0f} s an iteration{fits}.",
            f"- Pinned: {len(recipe['pinned'])} values ([recipes.yaml](recipes.yaml)): "
            + ", ".join(f"`{key}` {value}" for key, value, _ in recipe["pinned"]) + ".",
            "- Not expressed:", *(f"  - {line}" for line in recipe["not_expressed"]), ""]


def main() -> None:
    recipes = yaml.safe_load((DOCS / "recipes.yaml").read_text())
    text = (DOCS / "recipes.md").read_text()
    estimator = Estimator()
    lines = [text[: text.index("### ")].rstrip("\n"), ""]
    for preset, recipe in recipes.items():
        lines += card(preset, recipe, estimator)
    (DOCS / "recipes.md").write_text("\n".join(lines))
    print(f"wrote {DOCS / 'recipes.md'}: {len(recipes)} cards")


if __name__ == "__main__":
    main()
