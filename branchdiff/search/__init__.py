"""Inference-time search over denoising trees (`branchdiff sample --search`, `branchdiff bench
search`, `explore.mode=search`): a search is one file with `select` (which node gets a new child) and
`branching` (how a new child is completed to images), and one line in `SEARCHES`
(branchdiff/search/registry.py). The registry is names only (a search's module is imported when it is
built), so the settings and the command line read it without loading torch; installed packages add
searches as entry points of `branchdiff.searches`. `smc` (sequential Monte Carlo over the same forest)
and `dts.draw_leaf` (a sample of DTS's target from its tree) are the samplers `bench search --sampler`
measures against the reward-tilted target.

May import: core, models, schedulers, runtime, data, errors.
"""
