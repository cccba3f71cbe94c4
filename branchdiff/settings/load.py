"""Reading a run's settings: packaged YAML presets, YAML files and `key=value` overrides.

`load_config(source, overrides)` starts from the defaults (branchdiff/settings/config.py), merges a
preset name (`branchdiff/configs/NAME.yaml`) or a YAML file, then the dotted overrides
(`tree.roots=4`, values parsed as YAML, whose booleans are only true/false as in YAML 1.2:
`mixed_precision=no` is the word 'no'), and validates (branchdiff/settings/validate.py): an unknown
key, a wrong type or a value outside the allowed set raises `ConfigError` with one line naming the
file and line (when known), the key, the value and what is allowed, with close matches suggested.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from branchdiff.errors import ConfigError
from branchdiff.models.registry import FAMILIES
from branchdiff.runtime import storage
from branchdiff.settings.config import DEFAULT_PRESET, TrainConfig
from branchdiff.settings.typed_yaml import build, close_keys, merge, parse_override, read_yaml
from branchdiff.settings.validate import validate

PRESET_DIR = Path(__file__).parents[1] / "configs"


REPLACED_KEYS = {
    "logging.tensorboard": "renamed logging.report_to: tensorboard (the default), wandb, swanlab or none, or a list of them",
    "logging.keep_checkpoints": "renamed logging.checkpoints_total_limit (the newest checkpoints kept)",
    "tree.split_noise_scale": "use tree.split_noise_level (an SDE noise level that enters drift and noise, e.g. 1.2 for η = 0.3 × 4) "
                              "or tree.anchor_noise_multiplier (the BranchGRPO release's noise-only kick); see docs/trees.md",
    "tree.split_logprob": "split edges' log-probs are the density sampled; tree.anchor_noise_multiplier reproduces the release's convention",
}


def presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def family_presets(family: str) -> list[str]:
    """The packaged presets whose `model.family` is `family`."""
    return [name for name in presets() if (yaml.safe_load((PRESET_DIR / f"{name}.yaml").read_text()) or {}).get("model", {}).get(
        "family", "tiny") == family]


def preset_or_default(source: str | None, overrides: Sequence[str]) -> str:
    """`source`, or the default preset when none is given. The default is the built-in tiny model's
    recipe (full fine-tuning at its learning rate, its reward): a real family named by an override
    alone is refused, naming the family's own presets."""
    if source:
        return source
    family = next((value for keys, value in map(parse_override, overrides) if keys == ["model", "family"]), "tiny")
    if not isinstance(family, str) or family == "tiny" or family not in FAMILIES:  # an unknown family (or a list) is refused by the settings' own check
        return DEFAULT_PRESET
    own = family_presets(family)
    listed = ", ".join(own[:6]) + (f", … ({len(own)} in all: branchdiff train --help)" if len(own) > 6 else "")
    start = (f"start from one of its presets ({listed}), e.g. branchdiff train {own[0]} model.path=...; or from a YAML file "
             f"of your own (branchdiff config {own[0]} > my.yaml)" if own else
             "write a YAML file of your own (branchdiff config tiny-chain > my.yaml, then set model.family, model.path and the rest)")
    raise ConfigError(f"model.family={family} without a preset would train with the default preset {DEFAULT_PRESET}, the built-in tiny "
                      f"model's recipe (full fine-tuning, its learning rate and reward); {start}")


def load_config(source: str | None = None, overrides: Sequence[str] = ()) -> TrainConfig:
    """Defaults ← preset or YAML file `source` ← dotted `overrides`, validated."""
    data: dict = {}
    where: dict[str, str] = {}
    if source:
        path = Path(source)
        if not path.suffix and (PRESET_DIR / f"{source}.yaml").is_file():
            path = PRESET_DIR / f"{source}.yaml"
        if not path.is_file():
            close = difflib.get_close_matches(source, presets(), n=3)
            names = (f"did you mean {', '.join(close)}? (branchdiff train --help lists every preset)" if close
                     else f"presets: {', '.join(presets())}")
            raise ConfigError(f"no preset or file {source!r}; {names}")
        data, lines = read_yaml(path)
        where = {key: f"{path}:{line}: " for key, line in lines.items()}
    for text in overrides:
        keys, value = parse_override(text)
        nested: Any = value
        for key in reversed(keys):
            nested = {key: nested}
        data = merge(data, nested)
        where[".".join(keys)] = f"override {text!r}: "
    config = build_config(data, where)
    validate(config)
    return config


def build_config(data: dict, where: dict[str, str]) -> TrainConfig:
    """The run's settings from a mapping: the objectives' sections (`nft`, `awm`, ...) each built with its keys' dataclass,
    the rest with `TrainConfig`'s (each checked key by key, typed_yaml.build)."""
    config = TrainConfig()
    sections = {name: data[name] for name in config.objectives if name in data}
    own = [f.name for f in dataclasses.fields(TrainConfig) if not f.metadata.get("sections")]
    for key in data:
        if key in own or key in sections or key in REPLACED_KEYS:
            continue
        close = close_keys(TrainConfig, str(key), "", {name: type(keys) for name, keys in config.objectives.items()})
        hint = f"did you mean {', '.join(close)}?" if close else f"allowed: {', '.join(own)}, and the objectives' {', '.join(config.objectives)}"
        raise ConfigError(f"{where.get(str(key), '')}unknown key '{key}'; {hint}")
    config = build(TrainConfig, {key: value for key, value in data.items() if key not in sections}, "", where, REPLACED_KEYS)
    for name, value in sections.items():
        keys = type(config.objectives[name])
        if not isinstance(value, dict):
            raise ConfigError(f"{where.get(name, '')}'{name}' must be a mapping of its keys ({', '.join(f.name for f in dataclasses.fields(keys))}), "
                              f"got {value!r}")
        config.objectives[name] = build(keys, value, f"{name}.", where, REPLACED_KEYS)
    return config


def to_dict(config: TrainConfig) -> dict:
    """The settings as a mapping, each objective's section at the top level beside the others (where a YAML file has it)."""
    flat = dataclasses.asdict(config)
    sections = flat.pop("objectives")
    ordered: dict[str, Any] = {}
    for key, value in flat.items():
        ordered[key] = value
        if key == "train":
            ordered.update(sections)
    return ordered


def save_config(config: TrainConfig, path: Path) -> None:
    """The effective config as YAML, written whole or not at all; the same config gives the same bytes."""
    storage.write_text(path, yaml.safe_dump(to_dict(config), sort_keys=False))
