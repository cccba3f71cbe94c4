"""YAML into typed dataclasses: the machinery under `branchdiff.settings.config`, free of its schema.

- `read_yaml` and `parse_override` read YAML with two YAML 1.2 rules (see `_Loader`) and keep
  every key's line, so an error can name `file:line`.
- `build` makes a dataclass from a mapping and checks every field: unknown keys (with close
  matches), types, `choice(...)` sets, `positive` / `non_negative` / `in_range` ranges and finite
  numbers (NaN and ±inf are refused for every float), raising `ConfigError` with one line naming
  the location, the key, the value and what is allowed.
- A key given twice in one mapping is refused (YAML would silently keep the last one).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from dataclasses import field
from pathlib import Path
from typing import Any

import yaml

from branchdiff.errors import ConfigError, UserError, read_utf8


class _Loader(yaml.SafeLoader):
    """SafeLoader that reads two scalars the YAML 1.2 way: exponent floats without a dot (`1e-4`;
    YAML 1.1 keeps the string '1e-4'), and booleans only from true/false (true, True, TRUE, false,
    False, FALSE), so documented words such as `mixed_precision: no` or `mode: off` stay strings
    (YAML 1.1 reads yes/no/on/off as booleans). Bool-typed keys accept yes/no/on/off explicitly
    (`BOOL_WORDS`)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789")
)
_Loader.yaml_implicit_resolvers = {  # the line above gave _Loader its own copy of the table
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in _Loader.yaml_implicit_resolvers.items()
}
# exactly YAML 1.2's core forms: safe_dump quotes every string YAML 1.1 reads as a bool, but not
# e.g. 'tRuE', which must read back as the string it was
_Loader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))


def _construct_unique_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict:
    """A mapping whose keys are all distinct: a repeated key raises `DuplicateKey` at its line
    (merge keys `<<` excepted: what they bring in may be overridden)."""
    seen: dict[str, int] = {}
    for key_node, _ in node.value:
        if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
            continue
        if key_node.value in seen:
            raise DuplicateKey(key_node.value, seen[key_node.value], key_node.start_mark.line + 1)
        seen[key_node.value] = key_node.start_mark.line + 1
    loader.flatten_mapping(node)
    return loader.construct_mapping(node)


class DuplicateKey(yaml.YAMLError):
    """A key given twice in one YAML mapping."""

    def __init__(self, key: object, first_line: int, line: int) -> None:
        super().__init__(f"duplicate key {key!r}")
        self.key, self.first_line, self.line = key, first_line, line


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_unique_mapping)

BOOL_WORDS = {"yes": True, "no": False, "on": True, "off": False}  # YAML 1.1 words a bool-typed key also accepts, any case


def choice(default: Any, *allowed: Any) -> Any:
    return field(default=default, metadata={"choices": allowed})


def positive(default: Any) -> Any:
    return field(default=default, metadata={"min": 1e-12})


def non_negative(default: Any) -> Any:
    return field(default=default, metadata={"min": 0})


def in_range(default: Any, low: float, high: float) -> Any:
    """A number in [low, high]."""
    return field(default=default, metadata={"min": low, "max": high})


def finite_numbers(value: Any) -> bool:
    """False when `value` is, or is a list holding, a float that is NaN or ±inf."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(finite_numbers(item) for item in value)
    return True


def key_lines(text: str) -> dict[str, int]:
    """1-based line of every dotted key in a YAML mapping."""
    lines: dict[str, int] = {}

    def walk(node: yaml.Node, prefix: str) -> None:
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                key = f"{prefix}{key_node.value}"
                lines[key] = key_node.start_mark.line + 1
                walk(value_node, key + ".")

    root = yaml.compose(text, Loader=_Loader)
    if root is not None:
        walk(root, "")
    return lines


def read_yaml(path: Path) -> tuple[dict, dict[str, int]]:
    try:
        text = read_utf8(path)
    except UserError as error:
        raise ConfigError(str(error)) from None
    try:
        data = yaml.load(text, Loader=_Loader) or {}
    except DuplicateKey as error:
        raise ConfigError(f"{path}:{error.line}: key {error.key!r} is given twice (first at line {error.first_line}); YAML would keep "
                          "only the last one: merge the two into one") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise ConfigError(f"{where}: not valid YAML ({getattr(error, 'problem', error)})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of keys to values, got {type(data).__name__}")
    return data, key_lines(text)


def _type_ok(value: Any, annotation: Any) -> bool:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, arg) for arg in typing.get_args(annotation))
    if annotation is type(None):
        return value is None
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is str:
        return isinstance(value, str)
    if annotation is dict:
        return isinstance(value, dict)
    if origin is list:
        (item,) = typing.get_args(annotation)
        return isinstance(value, list) and all(_type_ok(v, item) for v in value)
    raise TypeError(f"unsupported config annotation {annotation}")


def _bool_word(value: Any, annotation: Any) -> Any:
    """yes/no/on/off (any case) as the bool they mean, for a bool-typed key; any other value unchanged."""
    accepts_bool = annotation is bool or bool in typing.get_args(annotation)
    if accepts_bool and isinstance(value, str) and value.lower() in BOOL_WORDS:
        return BOOL_WORDS[value.lower()]
    return value


def _type_name(annotation: Any) -> str:
    if annotation is bool:
        return f"bool (true, false, {', '.join(BOOL_WORDS)})"
    return str(annotation).replace("typing.", "") if not isinstance(annotation, type) else annotation.__name__


def close_keys(cls: type, key: str, prefix: str, sections: dict[str, type] | None = None) -> list[str]:
    """Keys of `cls` close to an unknown `key`: its own fields, or a section's field when that is closer
    (`learning_rate` → train.learning_rate, a key given without its section); `sections`: more sections by name
    (the objectives' keys), whose names and fields are candidates too."""
    hints = typing.get_type_hints(cls)
    fields = [f.name for f in dataclasses.fields(cls) if not f.metadata.get("sections")]
    more = sections or {}
    sections_by_name = {name: hints[name] for name in fields if dataclasses.is_dataclass(hints[name])} | more
    fields += list(more)
    leaves = {f"{prefix}{name}.{field.name}": field.name for name, section in sections_by_name.items() for field in dataclasses.fields(section)}

    def score(candidate: str) -> float:
        return difflib.SequenceMatcher(None, key, candidate).ratio()

    own = [prefix + c for c in difflib.get_close_matches(key, fields, n=3)]
    nested = [dotted for dotted, leaf in sorted(leaves.items(), key=lambda item: -score(item[1])) if score(leaf) >= 0.6][:3]
    if nested and (not own or score(leaves[nested[0]]) > score(own[0][len(prefix):])):
        return [dotted for dotted in nested if score(leaves[dotted]) == score(leaves[nested[0]])]
    return own


def build(cls: type, data: dict, prefix: str, where: dict[str, str], replaced_keys: dict[str, str]) -> Any:
    """An instance of dataclass `cls` from `data`, checked field by field (type, `choice`, range);
    `where` maps dotted keys to a location prefix ("file:line: "), `replaced_keys` old keys to advice."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        loc = where.get(dotted, "")
        if key not in fields and dotted in replaced_keys:
            raise ConfigError(f"{loc}'{dotted}' was replaced: {replaced_keys[dotted]}")
        if key not in fields or fields[key].metadata.get("sections"):  # the objectives' sections are read by name, not as one key
            close = close_keys(cls, str(key), prefix)
            known = [prefix + f for f in fields if not fields[f].metadata.get("sections")]
            hint = f"; did you mean {', '.join(close)}?" if close else f"; allowed: {', '.join(known)}"
            raise ConfigError(f"{loc}unknown key '{dotted}'{hint}")
        annotation = hints[key]
        if isinstance(annotation, type) and dataclasses.is_dataclass(annotation):
            if not isinstance(value, dict):
                raise ConfigError(f"{loc}'{dotted}' must be a mapping of its keys ({', '.join(f.name for f in dataclasses.fields(annotation))}), got {value!r}")
            kwargs[key] = build(annotation, value, dotted + ".", where, replaced_keys)
            continue
        value = _bool_word(value, annotation)
        meta = fields[key].metadata
        if not _type_ok(value, annotation):
            allowed = f"; allowed: {', '.join(map(str, meta['choices']))}" if "choices" in meta else ""
            raise ConfigError(f"{loc}'{dotted}' = {value!r} has the wrong type; expected {_type_name(annotation)}{allowed}")
        if "choices" in meta and value not in meta["choices"]:
            close = difflib.get_close_matches(str(value), [str(c) for c in meta["choices"]], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{loc}'{dotted}' = {value!r} is not allowed; allowed: {', '.join(map(str, meta['choices']))}{hint}")
        if not finite_numbers(value):
            raise ConfigError(f"{loc}'{dotted}' = {value!r} is not a finite number; give a number (default: {_default(fields[key])!r})")
        if "min" in meta and value is not None and value < meta["min"]:
            bound = f"in [{meta['min']}, {meta['max']}]" if "max" in meta else "> 0" if meta["min"] > 0 else "≥ 0"
            raise ConfigError(f"{loc}'{dotted}' = {value!r} is out of range; it must be {bound}")
        if "max" in meta and value is not None and value > meta["max"]:
            raise ConfigError(f"{loc}'{dotted}' = {value!r} is out of range; it must be in [{meta['min']}, {meta['max']}]")
        kwargs[key] = value
    return cls(**kwargs)


def _default(spec: dataclasses.Field) -> Any:
    if spec.default is not dataclasses.MISSING:
        return spec.default
    factory: Any = spec.default_factory  # every field of the settings has a default or a factory
    return factory()


def merge(base: dict, update: dict) -> dict:
    out = dict(base)
    for key, value in update.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b=value` → (["a", "b"], value parsed as YAML)."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {text!r} is not of the form key=value (e.g. tree.roots=4)")
    try:
        value = yaml.load(raw, Loader=_Loader) if raw.strip() else ""
    except DuplicateKey as error:
        raise ConfigError(f"override {text!r}: key {error.key!r} is given twice; give it once") from None
    except yaml.YAMLError:
        value = raw
    return key.strip().split("."), value
