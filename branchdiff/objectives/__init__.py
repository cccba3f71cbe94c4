"""Training objectives, one module each (docs/objectives.md): `train.loss` names one registered in
branchdiff/objectives/registry.py (one line there, "module:Class") or installed as an entry point of
`branchdiff.objectives`. Nothing is imported here, so the settings read the registry's names without
loading an objective.

May import: settings, search, rewards, core, models, schedulers, runtime, data, errors (not explore, its sibling).
"""
