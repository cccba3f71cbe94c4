"""The run's settings: the typed dataclasses of every key (`config`), reading presets, YAML files and
overrides (`load`), checks across keys (`validate`), the tree an iteration grows and its checks
(`trees`), the settings of `sample` and `eval` (`evaluation`), and the YAML-to-dataclass machinery
(`typed_yaml`).

May import: search and models (their registries' names), rewards (reward specs), core (tree specs), runtime, data, errors.
"""
