"""The objectives by name (`train.loss`, docs/objectives.md): one line each, the class ("module:Class",
imported only when a run builds it) and, for an objective a DDIM (ε-prediction) family cannot train, why;
installed packages add theirs as entry points of `branchdiff.objectives` (a class with an optional
`flow_only` reason). The settings read the names here without importing torch (branchdiff/runtime/registry.py:
the rule every component's registry follows).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from branchdiff.runtime.registry import Registry, import_target


@dataclass(frozen=True)
class Registered:
    target: str  # "module:Class" of the objective (branchdiff/objectives/)
    flow_only: str = ""  # why an ε-prediction (DDIM) family cannot train it; "": every family can
    decoupled: bool = False  # trains the final samples on the forward process (any sampler; no SDE edge needed)
    reference: bool = False  # compares with the frozen base model (full fine-tuning keeps a copy of it)
    dataset: str = ""  # trains on a dataset instead of rollouts: the kind of image set ("demonstrations", "preferences")
    keys: str = ""  # "module:Class" of its keys' dataclass (branchdiff/objectives/keys.py); "": it has none
    section: str = ""  # the section its keys are read from (`nft.beta`); "": its name, "-" read as "_"


KEYS = "branchdiff.objectives.keys"
OBJECTIVES = Registry("objective", "branchdiff.objectives", {
    "grpo": Registered("branchdiff.objectives.grpo:ClippedGRPO"),
    "grpo-guard": Registered("branchdiff.objectives.grpo_guard:GRPOGuard", "weighs each step by its σ step size", keys=f"{KEYS}:GuardConfig",
                             section="guard"),
    "grpo-layertuning": Registered("branchdiff.objectives.layertuning:LayerTuningGRPO", "regresses flow-matching velocities toward the best sample",
                                   keys=f"{KEYS}:LayerTuningConfig", section="layertuning"),
    "nft": Registered("branchdiff.objectives.nft:DiffusionNFT", "trains on the flow-matching forward process", decoupled=True, keys=f"{KEYS}:NFTConfig"),
    "awm": Registered("branchdiff.objectives.awm:AdvantageWeightedMatching", "trains on the flow-matching forward process", decoupled=True,
                      keys=f"{KEYS}:AWMConfig"),
    "dgpo": Registered("branchdiff.objectives.dgpo:DGPO", "trains on the flow-matching forward process", decoupled=True, reference=True,
                       keys=f"{KEYS}:DGPOConfig"),
    "dppo": Registered("branchdiff.objectives.dppo:DPPO", "bounds each step by its Gaussian divergence on σ steps", keys=f"{KEYS}:DPPOConfig"),
    "dpo": Registered("branchdiff.objectives.dpo:OnlineDPO", "trains on the flow-matching forward process", decoupled=True, reference=True,
                      keys=f"{KEYS}:DPOConfig"),
    "dpo-offline": Registered("branchdiff.objectives.dpo_offline:OfflineDPO", "trains on the flow-matching forward process", decoupled=True,
                              reference=True, dataset="preferences", keys=f"{KEYS}:DPOOfflineConfig"),
    "sft": Registered("branchdiff.objectives.sft:SupervisedFineTuning", "trains on the flow-matching forward process", decoupled=True,
                      dataset="demonstrations", keys=f"{KEYS}:SFTConfig"),
})


def key_sections() -> dict[str, type]:
    """Each objective's keys, by the section they are read from: the built-ins' (their registry line; imported here, a light
    module) and then those of installed objectives (their class's `keys` dataclass and optional `section`), in that order."""
    sections: dict[str, type] = {}
    for name, registered in OBJECTIVES.builtins.items():
        if registered.keys:
            sections[registered.section or name.replace("-", "_")] = import_target(registered.keys)  # type: ignore[assignment]
    for name in OBJECTIVES.installed:
        keys = getattr(objective_class(name), "keys", None)
        if keys is not None:
            section = str(getattr(objective_class(name), "section", name.replace("-", "_")))
            if section in sections:
                raise ValueError(f"objective {OBJECTIVES.describe(name)} reads its keys from '{section}', another objective's section; "
                                 "give its class another `section`")
            sections[section] = keys
    return sections


def section_of(name: str) -> str | None:
    """The section objective `name` reads its keys from (`nft`, `guard`, ...), or None when it has no keys: a built-in's
    registry line, an installed class's `keys` and optional `section` (as `key_sections` reads them)."""
    if name in OBJECTIVES.builtins:
        registered = OBJECTIVES.builtins[name]
        return (registered.section or name.replace("-", "_")) if registered.keys else None
    cls = objective_class(name)
    return str(getattr(cls, "section", name.replace("-", "_"))) if getattr(cls, "keys", None) is not None else None


def objective_class(name: str) -> Any:
    """The class `train.loss` = `name` names (an `Objective`, branchdiff/objectives/base.py)."""
    return OBJECTIVES.load(name)


def flow_only(name: str) -> str:
    """Why a DDIM family cannot train objective `name` ("" when it can): a built-in's line, an installed class's `flow_only`."""
    if name in OBJECTIVES.builtins:
        return OBJECTIVES.builtins[name].flow_only
    return str(getattr(objective_class(name), "flow_only", ""))


def decoupled(name: str) -> bool:
    """Whether objective `name` trains final samples on the forward process (any sampler serves): a built-in's line, an
    installed class's `decoupled`."""
    if name in OBJECTIVES.builtins:
        return OBJECTIVES.builtins[name].decoupled
    return bool(getattr(objective_class(name), "decoupled", False))


def needs_reference(name: str) -> bool:
    """Whether objective `name` compares with the frozen base model: a built-in's line, an installed class's `reference`."""
    if name in OBJECTIVES.builtins:
        return OBJECTIVES.builtins[name].reference
    return bool(getattr(objective_class(name), "reference", False))


def dataset_kind(name: str) -> str:
    """The kind of image set objective `name` trains on instead of rollouts ("" for an online objective)."""
    if name in OBJECTIVES.builtins:
        return OBJECTIVES.builtins[name].dataset
    return str(getattr(objective_class(name), "dataset", ""))


def make_objective(name: str, **context: object) -> Any:
    """The objective `name` built from what the trainer holds (config, collective, finetune, train_policy, schedule, settings)."""
    return objective_class(name)(**context)


def all_update_metrics() -> frozenset[str]:
    """Every update statistic a run may log: any objective's own and the update loop's."""
    from branchdiff.objectives.base import UPDATE_LOOP_METRICS

    return frozenset(UPDATE_LOOP_METRICS).union(*(objective_class(name).metric_kinds for name in OBJECTIVES))
