"""Training objectives, one module each (docs/objectives.md): `train.loss` names one of the
`LOSSES` registered in branchdiff/settings/config.py (one line there, "module:Class"), built here.

May import: settings, search, rewards, core, models, schedulers, runtime, data, errors (not explore, its sibling).
"""

from __future__ import annotations

import importlib

from branchdiff.objectives.base import UPDATE_LOOP_METRICS, Objective
from branchdiff.settings.config import LOSSES


def objective_class(name: str) -> type[Objective]:
    """The class `train.loss` = `name` names."""
    module, _, attribute = LOSSES[name].objective.partition(":")
    return getattr(importlib.import_module(module), attribute)


def make_objective(name: str, **context: object) -> Objective:
    """The objective `name` built from what the trainer holds (config, collective, finetune, train_policy, schedule, settings)."""
    return objective_class(name)(**context)


def all_update_metrics() -> frozenset[str]:
    """Every update statistic a run may log: any objective's own and the update loop's."""
    return frozenset(UPDATE_LOOP_METRICS).union(*(objective_class(name).metric_kinds for name in LOSSES))
