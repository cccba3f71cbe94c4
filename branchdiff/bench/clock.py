"""A modelled GPU clock for comparing training algorithms whose rollouts run in other number formats.

On this machine's CPU a 4-bit or 8-bit explorer is emulated (quantise, dequantise, then a float32
matmul), so it is slower than the policy, not faster, and wall time says nothing about what a
low-precision explorer buys on a GPU. The modelled clock charges each iteration

    t = t_row · (policy_rows + c(format) · explorer_rows) + reward_seconds + score_seconds + train_seconds

where t_row is the measured seconds per policy network row in the same iteration (its rollout time
over its rows), `c(format)` the cost of a row in the explorer's format relative to a BF16 row on the
GPU that format targets (`FORMAT_COST`), and the reward, pool-scoring and update times are measured.

`FORMAT_COST` is the ratio of dense tensor-core throughput, BF16 over the format, from NVIDIA's
datasheets: H100 SXM BF16 989 TFLOPS, FP8 1979 TFLOPS (Hopper); B200 (HGX, 1000 W) BF16 2.25 PFLOPS,
FP8 4.5 PFLOPS, FP4 9 PFLOPS (Blackwell). Peak ratios are an upper bound on the speed-up: the rest
of a forward (attention softmax, norms, memory traffic) does not shrink with the format; Sol-RL
(arXiv 2604.06916) measures NVFP4 rollouts up to 2.4× faster than BF16 end to end, against the 4×
here. bitsandbytes' 4-bit layers store weights in 4 bits but compute in BF16: cost 1.
"""

from __future__ import annotations

FORMAT_COST = {"bf16": 1.0, "fp8": 0.5, "nvfp4": 0.25, "mxfp4": 0.25}  # seconds per row relative to BF16 (module doc)
BACKEND_FORMAT = {  # the number format each explore backend (branchdiff/explore/quant.py) computes in on its target GPU
    "none": "bf16", "nvfp4-emulated": "nvfp4", "mxfp4-emulated": "mxfp4", "fp8-emulated": "fp8", "fp8-emulated-tensor": "fp8",
    "bnb-fp4": "bf16", "bnb-nf4": "bf16", "te-nvfp4": "nvfp4", "te-fp8": "fp8", "torchao-fp8": "fp8",
}


def row_cost(backend: str) -> float:
    """Cost of one explorer row relative to a BF16 policy row, for an explore backend."""
    return FORMAT_COST[BACKEND_FORMAT[backend]]


def modelled_seconds(metrics: dict[str, float], backend: str | None) -> float:
    """The modelled GPU time of one iteration from its metrics (module doc); `backend` is the
    explorer's (None: no explorer, every row is the policy's). A dataset objective's iteration (SFT,
    offline DPO) is its prompt encoding and its update, as measured."""
    if "rollout_seconds" not in metrics:  # a dataset objective's iteration: prompts encoded, then the update
        return metrics["encode_seconds"] + metrics["train_seconds"]
    measured = metrics["reward_seconds"] + metrics["train_seconds"]
    if backend is None or "explore_pool_nfe" not in metrics:
        return metrics["rollout_seconds"] + measured
    policy_rows, explorer_rows = metrics["explore_regen_nfe"], metrics["explore_pool_nfe"]
    seconds_per_row = metrics["explore_regen_seconds"] / policy_rows
    return seconds_per_row * (policy_rows + row_cost(backend) * explorer_rows) + metrics["explore_pool_score_seconds"] + measured
