"""One convention for the four kinds of component — model families, rewards, objectives, searches.

Each component folder has a `registry.py` holding its built-ins, name → "module:attribute" (families: name →
a `Family` record), so the command line and the settings list the names without importing torch; installed
packages add theirs as entry points of the kind's group (`[project.entry-points."branchdiff.rewards"]`, ...).
`Registry` merges the two for every kind alike: an installed name that is a built-in's, or that two packages
both register, is refused — the built-in keeps its name, a clash between packages leaves the name to neither —
and each refusal names both sources, for the listing commands (`branchdiff rewards list`, `branchdiff
families`) to show. Nothing is imported until a component is asked for; the entry points are read at each question.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint, entry_points
from typing import Generic, TypeVar

T = TypeVar("T")


def import_target(target: str) -> object:
    """The attribute a "package.module:attribute" string names, imported."""
    module, _, attribute = target.partition(":")
    return getattr(importlib.import_module(module), attribute)


def _package(point: EntryPoint) -> str:
    """The installed distribution an entry point comes from, for messages."""
    return f"package {point.dist.name}" if point.dist is not None else "an installed package"


@dataclass
class Registry(Generic[T]):
    """A kind's built-ins and the entry points of its group, merged by one rule (module doc)."""

    kind: str  # "reward", "family", "objective", "search": how messages name one
    group: str  # the entry-point group installed packages register in
    builtins: Mapping[str, T] = field(default_factory=dict)  # name → "module:attribute", or a record

    def _entry_points(self) -> tuple[dict[str, EntryPoint], dict[str, str]]:
        """(usable entry points by name, refused names → why), read afresh: a package installed into a running
        process (a test's) is seen."""
        found: dict[str, EntryPoint] = {}
        refused: dict[str, str] = {}
        clashing: dict[str, list[EntryPoint]] = {}
        for point in entry_points(group=self.group):
            clashing.setdefault(point.name, []).append(point)
        for name, points in clashing.items():
            sources = " and ".join(f"{p.value} ({_package(p)})" for p in points)
            if name in self.builtins:
                refused[name] = f"{sources}: the name of the built-in {self.kind} {self.describe(name)}; rename the entry point"
            elif len({p.value for p in points}) > 1:
                refused[name] = f"{sources}: two installed packages register this name; uninstall one or rename its entry point"
            else:
                found[name] = points[0]
        return found, refused

    @property
    def installed(self) -> dict[str, EntryPoint]:
        """The usable entry points of the group, by name."""
        return self._entry_points()[0]

    @property
    def refused(self) -> dict[str, str]:
        """Entry points that cannot be used, by name, each with why (naming both sources of a clash)."""
        return self._entry_points()[1]

    def names(self) -> list[str]:
        """Every name that can be asked for: the built-ins, then the usable entry points."""
        return [*self.builtins, *self.installed]

    def __contains__(self, name: object) -> bool:
        return name in self.builtins or name in self.installed

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def target(self, name: str) -> str | None:
        """A built-in's "module:attribute": the entry itself, or a record's `target`; None for a record that is
        the component (a family)."""
        entry = self.builtins[name]
        return entry if isinstance(entry, str) else getattr(entry, "target", None)

    def describe(self, name: str) -> str:
        """Where `name` comes from, in a few words: a built-in's target, or an entry point's value and package."""
        if name in self.builtins:
            target = self.target(name)
            return f"{name!r} ({target})" if target else repr(name)
        point = self.installed[name]
        return f"{name!r} (entry point {point.value} of {_package(point)})"

    def load(self, name: str) -> object:
        """The component `name` names, imported: a built-in's target (a record without one as it is), or the entry
        point's object. Raises KeyError for a name neither holds; import errors are the caller's to word."""
        if name in self.builtins:
            target = self.target(name)
            return import_target(target) if target else self.builtins[name]
        return self.installed[name].load()
