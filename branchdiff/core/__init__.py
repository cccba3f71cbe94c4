"""The core (pure tensor math and the rollout engine): trees as flat arrays (`tree`), addressable
noise (`noise`), the engine that predicts and expands any frontier of nodes (`engine`), rollouts
(`rollout`), reward fusion and advantages (`advantage`), pruning and Mix windows (`prune`) and the
objectives' loss formulas (`loss`).

May import: models, schedulers, runtime (the `Collective` of batch-wide statistics), errors.
"""
