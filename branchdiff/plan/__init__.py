"""`branchdiff plan`: the memory, rows, FLOPs and modelled time a run needs, phase by phase, worked
out before any weight loads (every network is built on the meta device from its published config or
its local folder's, and traced on fake tensors). docs/plan.md gives the formulas and what is not counted.
"""

from branchdiff.plan.estimate import GIB, RESERVE, Estimator, Plan, Target, estimate, with_change

__all__ = ["GIB", "RESERVE", "Estimator", "Plan", "Target", "estimate", "with_change"]
