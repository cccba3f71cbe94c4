"""The GPUs `branchdiff plan` knows and its modelled clock. A modelled time is FLOPs over the GPU's
dense bf16 (or TF32) peak times an assumed utilisation; it counts the denoiser's forwards and
backwards only (VAE decode, rewards, text encoding and host work are left out), so it is a floor
for a run whose forwards are large and a rough guide otherwise. Every constant is stated here and
in docs/plan.md; `--gpu-tflops` and `--utilisation` replace them.
"""

from __future__ import annotations

from dataclasses import dataclass

MIB = 2**20


@dataclass(frozen=True)
class GPU:
    name: str
    memory: float  # bytes, as nvidia-smi reports the card's total
    bf16_tflops: float  # dense bf16 tensor-core peak (datasheet), FP32 accumulate
    tf32_tflops: float  # dense TF32 peak (datasheet): float32 forwards without autocast


GPUS = {
    "h100-80gb": GPU("H100 80 GB SXM", 81559 * MIB, 989.0, 494.0),
    "h200": GPU("H200 141 GB", 143771 * MIB, 989.0, 494.0),
    "a100-80gb": GPU("A100 80 GB", 81920 * MIB, 312.0, 156.0),
    "l40s": GPU("L40S 48 GB", 46068 * MIB, 362.0, 183.0),
    "rtx4090": GPU("RTX 4090 24 GB", 24564 * MIB, 165.0, 82.6),
}
TARGET_GPU = {"80": "h100-80gb", "24": "rtx4090"}  # what each family's presets are written for
UTILISATION = 0.4  # assumed fraction of the peak a large transformer forward/backward reaches (model FLOPs utilisation)


def modelled_seconds(flops: float, gpu: GPU, bf16: bool, utilisation: float = UTILISATION, tflops: float | None = None) -> float:
    """flops / (peak · utilisation): the peak is `tflops` when given, else the GPU's bf16 or TF32 figure."""
    peak = tflops if tflops else (gpu.bf16_tflops if bf16 else gpu.tf32_tflops)
    return flops / (peak * 1e12 * utilisation)
