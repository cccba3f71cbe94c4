"""The searches by name (`sample --search`, `bench search`, `explore.mode=search`): one line each, "module:factory"
taking the search's keyword arguments; installed packages add theirs as entry points of `branchdiff.searches`
(branchdiff/runtime/registry.py: the rule every component's registry follows)."""

from __future__ import annotations

from branchdiff.runtime.registry import Registry

SEARCHES = Registry("search", "branchdiff.searches", {
    "best-of-n": "branchdiff.search.best_of_n:BestOfN",
    "tree": "branchdiff.search.fixed_tree:FixedTree",
    "dts": "branchdiff.search.dts:DTS",
    "dts-star": "branchdiff.search.dts:dts_star",
    "dts-is": "branchdiff.search.dts_is:DTSIS",
})


def make_search(name: str, **settings: object) -> object:
    """The search `name` with its keyword arguments (DTS and DTS*: temperature, max_children, root_children, widening, exploration, x0_value)."""
    factory = SEARCHES.load(name)
    return factory(**settings)  # type: ignore[operator]
