"""Activation memory measured on fake tensors: a forward runs on `FakeTensorMode` CUDA tensors (shapes
only, no memory, no GPU needed) under CUDA autocast as `accelerator.autocast()` enables it, and a
dispatch mode counts the bytes of every tensor storage alive. What a forward leaves alive is what
autograd keeps for the backward. Attention is counted as the memory-efficient SDPA kernel (q, k, v,
output and log-sum-exp kept, no N×N matrix), which is what a GPU runs; the math fallback that fake
tensors would otherwise pick is replaced while tracing. docs/plan.md states what is not counted.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from dataclasses import dataclass

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

ALIASING: dict = {}  # aten op -> whether its outputs alias its inputs (schema annotation)


@dataclass(frozen=True)
class Cost:
    """Bytes = fixed + per_row · rows. Per-row: activations. Fixed: tensors made once per forward
    whatever the batch, i.e. weights cast by autocast (SD 1.5's fp16 weights cast to bf16, kept for
    the backward; the fp32 LoRA weights' bf16 copies)."""

    fixed: float = 0.0
    per_row: float = 0.0

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.fixed + other.fixed, self.per_row + other.per_row)

    def __sub__(self, other: Cost) -> Cost:
        return Cost(self.fixed - other.fixed, self.per_row - other.per_row)

    def __rmul__(self, k: float) -> Cost:
        return Cost(k * self.fixed, k * self.per_row)

    def at(self, rows: int) -> float:
        return self.fixed + self.per_row * rows


class Peak:
    """The peak of fixed + per_row · rows over a run, for any rows: the live (fixed, per_row) points
    that no other point dominates (their maximum at `rows` is the peak)."""

    def __init__(self, start: Cost = Cost()) -> None:
        self.start, self.points = start, [start]

    def add(self, point: Cost) -> None:
        if any(p.fixed >= point.fixed and p.per_row >= point.per_row for p in self.points):
            return
        self.points = [p for p in self.points if not (point.fixed >= p.fixed and point.per_row >= p.per_row)] + [point]

    def at(self, rows: int) -> float:
        """Peak above the start."""
        return max(p.at(rows) for p in self.points) - self.start.at(rows)


class LiveBytes(TorchDispatchMode):
    """Bytes of the tensor storages allocated inside the mode and still alive, split into per-forward
    weight casts (`fixed`: an `_to_copy` of a parameter) and the rest (per row); the run's peak and a
    peak local to the current block (reset by `mark`)."""

    def __init__(self, weights: set[int]) -> None:
        super().__init__()
        self.weights = weights  # storage ids of the model's parameters
        self.fixed = self.rows = 0
        self.sizes: dict[int, tuple[int, bool]] = {}
        self.peak = Peak()
        self.local = Peak()

    @property
    def live(self) -> Cost:
        return Cost(self.fixed, self.rows)

    def mark(self) -> Cost:
        self.local = Peak(self.live)
        return self.live

    def _free(self, key: int) -> None:
        size, fixed = self.sizes.pop(key)
        if fixed:
            self.fixed -= size
        else:
            self.rows -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func not in ALIASING:  # views and in-place ops return (parts of) their inputs: nothing allocated
            ALIASING[func] = any(r.alias_info is not None for r in func._schema.returns)
        if ALIASING[func]:
            return out
        fixed = func is torch.ops.aten._to_copy.default and isinstance(args[0], torch.Tensor) and id(args[0].untyped_storage()) in self.weights
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = id(storage)
                if key not in self.sizes:
                    self.sizes[key] = (storage.nbytes(), fixed)
                    if fixed:
                        self.fixed += storage.nbytes()
                    else:
                        self.rows += storage.nbytes()
                    weakref.finalize(storage, self._free, key)
        self.peak.add(self.live)
        self.local.add(self.live)
        return out


def efficient_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """F.scaled_dot_product_attention as the CUDA memory-efficient kernel runs it (keeps q, k, v, out,
    log-sum-exp; a mask becomes an additive bias, padded to a multiple of 16 keys as PyTorch does)."""
    if torch.is_autocast_enabled("cuda"):
        dtype = torch.get_autocast_dtype("cuda")
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        repeat = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(repeat, -3), value.repeat_interleave(repeat, -3)
    bias = None
    if attn_mask is not None:
        bias = attn_mask if attn_mask.dtype != torch.bool else torch.zeros_like(attn_mask, dtype=query.dtype).masked_fill(~attn_mask, -math.inf)
        bias = bias.to(query.dtype).expand(*query.shape[:-1], key.shape[-2])
        pad = -key.shape[-2] % 16
        if pad:
            bias = torch.nn.functional.pad(bias, (0, pad))[..., : key.shape[-2]]
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    return torch.ops.aten._scaled_dot_product_efficient_attention(query, key, value, bias, grad, dropout_p, is_causal, scale=scale)[0]


@contextlib.contextmanager
def efficient_attention():
    original = torch.nn.functional.scaled_dot_product_attention
    torch.nn.functional.scaled_dot_product_attention = efficient_sdpa
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = original


@contextlib.contextmanager
def cuda_autocast(dtype: torch.dtype | None):
    """CUDA autocast as `accelerator.autocast()` enables it (torch.autocast refuses without a GPU; the
    dispatch keys work on fake CUDA tensors)."""
    if dtype is None:
        yield
        return
    torch._C.set_autocast_enabled("cuda", True)
    torch._C.set_autocast_dtype("cuda", dtype)
    torch._C.autocast_increment_nesting()
    try:
        yield
    finally:
        if torch._C.autocast_decrement_nesting() == 0:
            torch._C.clear_autocast_cache()
        torch._C.set_autocast_enabled("cuda", False)


def forward_peak(model: torch.nn.Module, inputs: dict, grad: bool, autocast: torch.dtype | None) -> Peak:
    """The peak above the start of one forward of `model` (on fake CUDA) on `inputs` (one network
    row, fake CUDA tensors), as `trace` counts it; `.at(rows)` scales it to a batch. The GPU suite
    (tests/test_gpu.py) sets this estimate against a real forward's peak."""
    tracker = LiveBytes({id(p.untyped_storage()) for p in model.parameters()})
    with efficient_attention(), torch.set_grad_enabled(grad), cuda_autocast(autocast), tracker:
        out = model(**inputs)
        peak = tracker.peak
        del out
    return peak


def trace_vae_decode(vae: torch.nn.Module, latent: tuple[int, ...]) -> tuple[float, float]:
    """Peak bytes and floating-point operations (multiply-add = 2) of decoding one image (no grad, the VAE's dtype,
    outside autocast as adapter.decode)."""
    from torch.utils.flop_counter import FlopCounterMode

    tracker, counter = LiveBytes(set()), FlopCounterMode(display=False)
    with efficient_attention(), torch.no_grad(), tracker, counter:
        z = torch.empty(1, *latent, device="cuda", dtype=vae.dtype)
        vae.decode(z, return_dict=False)
    return tracker.peak.at(1), float(counter.get_total_flops())
