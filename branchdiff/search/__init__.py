"""Inference-time search over denoising trees (`branchdiff sample --search`, `branchdiff bench
search`, `explore.mode=search`): a search is one file with `select` (which node gets a new child) and
`branching` (how a new child is completed to images), and one line in `SEARCHES` here. The registry
is names only (a search's module is imported when it is built), so the settings and the command line
read it without loading torch. `smc` (sequential Monte Carlo over the same forest) and
`dts.draw_leaf` (a sample of DTS's target from its tree) are the samplers `bench search --sampler`
measures against the reward-tilted target.

May import: core, models, schedulers, runtime, data, errors.
"""

from __future__ import annotations

import importlib

SEARCHES = {  # name → "module:factory" taking the search's keyword arguments
    "best-of-n": "branchdiff.search.best_of_n:BestOfN",
    "tree": "branchdiff.search.fixed_tree:FixedTree",
    "dts": "branchdiff.search.dts:DTS",
    "dts-star": "branchdiff.search.dts:dts_star",
}


def make_search(name: str, **settings: object) -> object:
    """The search `name` with its keyword arguments (DTS and DTS*: temperature, max_children, root_children, widening, exploration, x0_value)."""
    module, _, attribute = SEARCHES[name].partition(":")
    return getattr(importlib.import_module(module), attribute)(**settings)
