"""Training objectives, one module each (docs/objectives.md): `train.loss` names one of `OBJECTIVES`."""

from __future__ import annotations

from branchdiff.objectives.base import UPDATE_LOOP_METRICS, Objective
from branchdiff.objectives.grpo import ClippedGRPO
from branchdiff.objectives.grpo_guard import GRPOGuard
from branchdiff.objectives.layertuning import LayerTuningGRPO
from branchdiff.objectives.nft import DiffusionNFT

OBJECTIVES: dict[str, type] = {
    "grpo": ClippedGRPO,
    "grpo-guard": GRPOGuard,
    "grpo-layertuning": LayerTuningGRPO,
    "nft": DiffusionNFT,
}


def make_objective(name: str, **context: object) -> Objective:
    """The objective `name` built from what the trainer holds (config, collective, finetune, train_policy, schedule, settings)."""
    return OBJECTIVES[name](**context)


def all_update_metrics() -> frozenset[str]:
    """Every update statistic a run may log: any objective's own and the update loop's."""
    return frozenset(UPDATE_LOOP_METRICS).union(*(objective.metric_kinds for objective in OBJECTIVES.values()))
