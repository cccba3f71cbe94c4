"""FP4 explore / BF16 train (Sol-RL): the explore pool and its exact regeneration (`pool`),
low-precision copies of the policy (`quant`), number formats as pure functions (`formats`) and the
contrastive subset's selection (`selection`).

May import: search (explore.mode=search), settings, rewards, core, models, schedulers, runs, data, errors.
"""
