"""Inference-time search over denoising trees (`branchdiff sample --search`, `branchdiff bench
search`): a search is one file with `select` (which node gets a new child) and `branching` (how a
new child is completed to images), and one line here."""

from __future__ import annotations

from functools import partial

from branchdiff.search.best_of_n import BestOfN
from branchdiff.search.dts import DTS
from branchdiff.search.fixed_tree import FixedTree

SEARCHES = {
    "best-of-n": BestOfN,
    "tree": FixedTree,
    "dts": DTS,
    "dts-star": partial(DTS, greedy=True),
}
