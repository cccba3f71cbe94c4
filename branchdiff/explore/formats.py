"""Low-precision number formats as pure functions on tensors (NVFP4, MXFP4, FP8; docs/explore.md): quantise a tensor to
its parts, dequantise the parts, and the round trip ("fake quantisation") that emulation uses.

- NVFP4: E2M1 elements q (magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6), w ≈ q · s_block · s_tensor with an
  FP8 E4M3 s_block per 16 elements of the last dim and an FP32 s_tensor.
- MXFP4: E2M1 elements, w ≈ q · 2^e_block with a power-of-two (E8M0) scale per 32 elements.
- FP8 E4M3 (magnitudes up to 448, 3 mantissa bits): w ≈ q · s with one FP32 scale s = amax / 448 per
  row (output channel or token) or per tensor.
Each function is tested against an independent reference (float64 grids, torch's float8 cast,
torchao) in tests/test_quant.py; `branchdiff.explore.quant` builds model copies from them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # non-negative FP4 E2M1 magnitudes
E2M1_MAX = 6.0
E4M3_MAX = 448.0  # largest finite float8_e4m3fn
E4M3_MIN_EXPONENT = -6  # exponent of the smallest normal E4M3 value (2^-6); subnormals are m · 2^-9
E4M3_MANTISSA_BITS = 3
NVFP4_BLOCK = 16
MXFP4_BLOCK = 32
MXFP4_ELEMENT_EMAX = 2  # exponent of E2M1's largest power of two (4 = 2^2)


def round_to_e2m1(x: Tensor) -> Tensor:
    """Round to the nearest signed E2M1 value, ties to even mantissa, saturating at ±6.

    The grid spacing is 0.5 on [0, 2), 1 on [2, 4) and 2 on [4, 6], so with a = min(|x|, 6):
    q = rne(2a)/2, rne(a) or 2·rne(a/2) on those ranges (rne = round half to even, whose "even"
    is exactly the even-mantissa neighbour here). Returns float32 of x's shape; NaN stays NaN.
    """
    a = x.float().abs().clamp(max=E2M1_MAX)
    q = torch.where(a < 2, torch.round(a * 2) / 2, torch.where(a < 4, torch.round(a), torch.round(a / 2) * 2))
    return torch.where(x < 0, -q, q)


def _check_blocks(w: Tensor, block: int) -> None:
    if w.dim() == 0 or w.shape[-1] % block != 0:
        raise ValueError(f"last dim of shape {tuple(w.shape)} must be divisible by the block size {block}")


def _scale_blocks(values: Tensor, scales: Tensor, dtype: torch.dtype) -> Tensor:
    """values (..., K) times scales (..., K/B), each scale shared by B consecutive values."""
    blocks = values.reshape(*scales.shape, -1) * scales.unsqueeze(-1)  # (..., K/B, B)
    return blocks.reshape(values.shape).to(dtype)


def _pad_last(w: Tensor, block: int) -> Tensor:
    """Zero-pad the last dim to a multiple of `block` (zeros change neither amax nor values)."""
    pad = -w.shape[-1] % block
    return torch.nn.functional.pad(w, (0, pad)) if pad else w


class NVFP4Parts(NamedTuple):
    values: Tensor  # (..., K) float32 on the signed E2M1 grid
    block_scales: Tensor  # (..., K // 16) float8_e4m3fn
    tensor_scale: Tensor  # () float32


def nvfp4_quantize(w: Tensor) -> NVFP4Parts:
    """NVFP4 quantisation of w (..., K), K divisible by 16 (else ValueError), computed in float32:

        s_tensor = amax(|w|) / (448 · 6)                       (1 if w is all zeros)
        s_block  = e4m3( (amax_block(|w|) / 6) / s_tensor )    (cast rounds to nearest even)
        q        = e2m1( w / (s_block · s_tensor) )            (0 where s_block is 0)
    """
    _check_blocks(w, NVFP4_BLOCK)
    blocks = w.float().reshape(*w.shape[:-1], -1, NVFP4_BLOCK)  # (..., K/16, 16)
    amax = blocks.abs().amax()
    tensor_scale = torch.where(amax > 0, amax / (E4M3_MAX * E2M1_MAX), torch.ones_like(amax))  # ()
    block_amax = blocks.abs().amax(dim=-1)  # (..., K/16)
    block_scales = ((block_amax / E2M1_MAX) / tensor_scale).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    scale = block_scales.float() * tensor_scale  # (..., K/16)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale)).unsqueeze(-1)  # (..., K/16, 1)
    values = torch.where(scale.unsqueeze(-1) > 0, round_to_e2m1(blocks / safe), torch.zeros_like(blocks))
    return NVFP4Parts(values.reshape(w.shape), block_scales, tensor_scale)


def nvfp4_dequantize(parts: NVFP4Parts, dtype: torch.dtype = torch.float32) -> Tensor:
    """w_hat = q · s_block · s_tensor, shape (..., K), in `dtype`."""
    return _scale_blocks(parts.values, parts.block_scales.float() * parts.tensor_scale, dtype)


def fake_quantize_nvfp4(w: Tensor) -> Tensor:
    """NVFP4 quantise-dequantise of w (..., K) in w's dtype; a short final block is zero-padded."""
    padded = _pad_last(w, NVFP4_BLOCK)
    return nvfp4_dequantize(nvfp4_quantize(padded), w.dtype)[..., : w.shape[-1]]


class MXFP4Parts(NamedTuple):
    values: Tensor  # (..., K) float32 on the signed E2M1 grid
    scales: Tensor  # (..., K // 32) float32, powers of two (E8M0)


def mxfp4_quantize(w: Tensor) -> MXFP4Parts:
    """MXFP4 (OCP MX) quantisation of w (..., K), K divisible by 32 (else ValueError):

        e_block = clamp(floor(log2(amax_block(|w|))) - 2, -127, 127)     (2 = E2M1's emax)
        q       = e2m1( w / 2^e_block )                                 (saturates at ±6)
    floor(log2 a) is read exactly from frexp (a = m · 2^k, m ∈ [0.5, 1) gives k - 1); an all-zero
    block gets some finite scale and zero values.
    """
    _check_blocks(w, MXFP4_BLOCK)
    blocks = w.float().reshape(*w.shape[:-1], -1, MXFP4_BLOCK)  # (..., K/32, 32)
    _, exponent = torch.frexp(blocks.abs().amax(dim=-1))  # (..., K/32)
    shared = (exponent - 1 - MXFP4_ELEMENT_EMAX).clamp(-127, 127)
    scales = torch.ldexp(torch.ones_like(shared, dtype=torch.float32), shared)  # (..., K/32)
    values = round_to_e2m1(blocks / scales.unsqueeze(-1))
    return MXFP4Parts(values.reshape(w.shape), scales)


def mxfp4_dequantize(parts: MXFP4Parts, dtype: torch.dtype = torch.float32) -> Tensor:
    """w_hat = q · 2^e_block, shape (..., K), in `dtype`."""
    return _scale_blocks(parts.values, parts.scales, dtype)


def fake_quantize_mxfp4(w: Tensor) -> Tensor:
    """MXFP4 quantise-dequantise of w (..., K) in w's dtype; a short final block is zero-padded."""
    padded = _pad_last(w, MXFP4_BLOCK)
    return mxfp4_dequantize(mxfp4_quantize(padded), w.dtype)[..., : w.shape[-1]]


def _pow2(k: Tensor) -> Tensor:
    """2^k as float32, exact, built from its bit pattern (int32 k in [-126, 127])."""
    return ((k + 127) << 23).view(torch.float32)


def round_to_e4m3(x: Tensor) -> Tensor:
    """Round to the nearest float8 E4M3 (`e4m3fn`, no infinities) value, ties to even mantissa,
    saturating at ±448. Returns float32 of x's shape; NaN stays NaN.

    With a = min(|x|, 448) and e = max(floor(log2 a), -6) (-6: the smallest normal exponent; below
    it the subnormals keep its spacing), the grid spacing is 2^(e-3) (3 mantissa bits), so
    q = rne(a · 2^(3-e)) · 2^(e-3). Scaling by powers of two is exact, and rne's even integer is
    the even-mantissa neighbour (a value just below 2^(e+1) rounds up to it, which is representable).
    floor(log2 a) is read from a's float32 exponent bits (-127 for 0 and float32 subnormals).
    """
    a = x.float().abs().clamp(max=E4M3_MAX)
    exponent = (a.view(torch.int32) >> 23) - 127  # floor(log2 a)
    step = exponent.clamp(min=E4M3_MIN_EXPONENT) - E4M3_MANTISSA_BITS  # log2 of the grid spacing
    q = torch.round(a * _pow2(-step)) * _pow2(step)
    return torch.copysign(q, x.float())


class FP8Parts(NamedTuple):
    values: Tensor  # (..., K) float32 on the signed E4M3 grid
    scales: Tensor  # (..., 1) per row or () per tensor, float32


def fp8_quantize(x: Tensor, granularity: str = "row") -> FP8Parts:
    """FP8 E4M3 quantisation of x (..., K) with one float32 scale per row or per tensor, in float32:

        s = amax(|x|) / 448          (amax over the last dim per row, or over the tensor; 1 if it is 0)
        q = e4m3(x / s)              (round to nearest even, saturating at ±448)
    A row is one output channel of a weight (out, in), or one token of an activation (..., in).
    These are torchao's float8 scale and cast (`_choose_scale_float8`, `_quantize_affine_float8`).
    """
    if granularity not in ("row", "tensor"):
        raise ValueError(f"granularity={granularity!r}; allowed: row, tensor")
    if x.dim() == 0:
        raise ValueError("fp8_quantize needs a tensor with at least one dim, got a scalar")
    x32 = x.float()
    amax = x32.abs().amax(dim=-1, keepdim=True) if granularity == "row" else x32.abs().amax()  # (..., 1) or ()
    scales = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    return FP8Parts(round_to_e4m3(x32 / scales), scales)


def fp8_dequantize(parts: FP8Parts, dtype: torch.dtype = torch.float32) -> Tensor:
    """x_hat = q · s, shape (..., K), in `dtype`."""
    return (parts.values * parts.scales).to(dtype)


def fake_quantize_fp8(x: Tensor, granularity: str = "row") -> Tensor:
    """FP8 E4M3 quantise-dequantise of x (..., K) in x's dtype (`fp8_quantize`, then q · s)."""
    return fp8_dequantize(fp8_quantize(x, granularity), x.dtype)
