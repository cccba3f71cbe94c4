"""FP4 explore / BF16 train (Sol-RL): the explore pool and its exact regeneration (`pool`),
low-precision copies of the policy (`quant`), number formats as pure functions (`formats`) and the
contrastive subset's selection (`selection`).

May import: settings, search (explore.mode=search), rewards, core, models, schedulers, runtime, data, errors.
"""
