"""What a search spends: network rows, decodes and reward calls, and their sum in row-equivalents.

A search spends three things per prompt. A network row is one latent through the denoiser (two under CFG). A
decode turns one latent into pixels: every finished image, and every predicted clean sample x̂0 that an early stop
(`rollout_depth`) or an in-flight value (`x0_value`) scores. A reward call scores one decoded sample. Counting rows
alone makes a search that scores many x̂0 look cheaper than it is: on a real family a decode and a reward model
(PickScore, HPS, VideoAlign) cost as much as several rows. The cost in row-equivalents is

    cost = rows + c_decode · decodes + c_reward · reward_calls

with c_decode and c_reward the floating-point operations of one decode and one reward call over those of one
network row, at the run's size (`Prices`; `branchdiff plan`'s FLOP counts give them for a family and a reward:
branchdiff/plan/search_prices.py). With both prices at 0 the cost is the rows.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Prices:
    """Row-equivalents of one decode and of one reward call (one sample each)."""
    decode: float = 0.0
    reward: float = 0.0

    def __post_init__(self) -> None:
        if not (self.decode >= 0 and self.reward >= 0):  # NaN fails too
            raise ValueError(f"a decode's and a reward call's cost in network rows must be ≥ 0; got {self.decode} and {self.reward}")

    @property
    def evaluation(self) -> float:
        """One sample decoded and scored."""
        return self.decode + self.reward

    def cost(self, rows: float, decodes: float, reward_calls: float) -> float:
        """rows + c_decode · decodes + c_reward · reward_calls."""
        return rows + self.decode * decodes + self.reward * reward_calls


ROWS = Prices()  # a budget in network rows alone
