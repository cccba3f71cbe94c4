"""4-bit exploration copies of a policy (Sol-RL: explore in FP4, train in BF16; method.md §4).

A quantised copy is a deep copy of the policy with its LoRA merged into the base weights and its
eligible `nn.Linear` layers replaced by a 4-bit version; it is only used to roll out and rank a
large candidate pool, never to compute a training signal. After every optimizer step
`refresh_quantized_copy` re-derives its weights from the current policy, so exploration follows it.

Formats: E2M1 elements q (magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6) with NVFP4, w ≈ q · s_block · s_tensor
(FP8 E4M3 s_block per 16 elements of the last dim, FP32 s_tensor), or MXFP4, w ≈ q · 2^e_block
(power-of-two E8M0 scale per 32 elements).

Backends (`QuantConfig.backend`):
- `nvfp4-emulated`, `mxfp4-emulated`: weight-only emulation; each eligible weight is replaced by
  its quantise-dequantise and the matmul runs in the original dtype (correct, not faster).
- `bnb-fp4`, `bnb-nf4`: bitsandbytes `Linear4bit` (64-element blocks, absmax scales; CPU or CUDA).
- `te-nvfp4`: NVIDIA Transformer Engine `Linear` under an `NVFP4BlockScaling` recipe: real FP4
  matmuls, CUDA Blackwell (sm100+) only. Written against TE's `te.autocast` API; untested here (no GPU).
"""

from __future__ import annotations

import copy
import fnmatch
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import NamedTuple

import torch
from torch import Tensor, nn

E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # non-negative FP4 E2M1 magnitudes
E2M1_MAX = 6.0
E4M3_MAX = 448.0  # largest finite float8_e4m3fn
NVFP4_BLOCK = 16
MXFP4_BLOCK = 32
MXFP4_ELEMENT_EMAX = 2  # exponent of E2M1's largest power of two (4 = 2^2)

EMULATED_BACKENDS = ("nvfp4-emulated", "mxfp4-emulated")
BNB_BACKENDS = ("bnb-fp4", "bnb-nf4")
BACKENDS = EMULATED_BACKENDS + BNB_BACKENDS + ("te-nvfp4",)

DEFAULT_SKIPS: dict[str, tuple[str, ...]] = {  # embedders, output norm and final projection per family
    "tiny": ("pos_embed", "time_text_embed", "context_embedder", "norm_out", "proj_out"),
    "sd3": ("pos_embed", "time_text_embed", "context_embedder", "norm_out", "proj_out"),
    "flux": ("x_embedder", "time_text_embed", "context_embedder", "norm_out", "proj_out"),
    "sana": ("patch_embed", "time_embed", "caption_projection", "norm_out", "proj_out"),
}


# --- formats: pure functions on tensors ---------------------------------------------------------

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


# --- quantised copies of a model -----------------------------------------------------------------

@dataclass
class QuantConfig:
    backend: str = "nvfp4-emulated"  # one of BACKENDS
    skip_modules: tuple[str, ...] = DEFAULT_SKIPS["sd3"]  # module-name patterns never quantised (see is_skipped)
    min_features: int = 0  # skip Linear layers with in_features * out_features below this

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"QuantConfig.backend={self.backend!r}; allowed: {', '.join(BACKENDS)}")
        if self.min_features < 0:
            raise ValueError(f"QuantConfig.min_features={self.min_features}; must be >= 0")
        self.skip_modules = tuple(self.skip_modules)

    @classmethod
    def for_family(cls, family: str, backend: str = "nvfp4-emulated", min_features: int = 0) -> "QuantConfig":
        """Config with the family's default skips (`DEFAULT_SKIPS` keys: tiny, sd3, flux, sana)."""
        if family not in DEFAULT_SKIPS:
            raise ValueError(f"family={family!r}; known: {', '.join(DEFAULT_SKIPS)}")
        return cls(backend=backend, skip_modules=DEFAULT_SKIPS[family], min_features=min_features)


def is_skipped(name: str, patterns: tuple[str, ...]) -> bool:
    """True if module `name` or one of its ancestors matches a pattern (fnmatch glob).

    Patterns are anchored dotted paths, not substrings: "proj_out" skips the top-level `proj_out`
    but not FLUX's `single_transformer_blocks.3.proj_out`; "*.norm1" would skip every block's norm1.
    """
    parts = name.split(".")
    prefixes = [".".join(parts[: i + 1]) for i in range(len(parts))]
    return any(fnmatch.fnmatchcase(prefix, pattern) for pattern in patterns for prefix in prefixes)


def _tuner_layer_type() -> type | None:
    """peft's BaseTunerLayer if peft is loaded (a model with LoRA layers implies it is)."""
    if "peft" not in sys.modules:
        return None
    from peft.tuners.tuners_utils import BaseTunerLayer

    return BaseTunerLayer


def _unwrap(model: nn.Module) -> nn.Module:
    """The network inside a peft `PeftModel` (module names then match the merged model's)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _linear_layers(model: nn.Module) -> dict[str, nn.Linear]:
    """nn.Linear layers named as in the LoRA-merged model: a LoRA-wrapped layer `a.to_q` yields its
    base layer under `a.to_q`; the adapters' own Linear layers (lora_A, lora_B) are not listed."""
    tuner = _tuner_layer_type()
    base, layers, wrapped = _unwrap(model), {}, set()
    for name, module in base.named_modules():
        if any(name.startswith(w + ".") for w in wrapped):
            continue
        if tuner is not None and isinstance(module, tuner):
            wrapped.add(name)
            module = module.get_base_layer()
        if isinstance(module, nn.Linear):
            layers[name] = module
    return layers


def _fits_backend(layer: nn.Linear, backend: str) -> bool:
    """Shape limits of the kernels: bitsandbytes' CPU inference kernel packs 32 output rows by
    64-element input blocks; Transformer Engine's FP4 GEMMs want both dims divisible by 16.
    The emulated backends take any shape (a short final block is zero-padded)."""
    if backend in BNB_BACKENDS:
        return layer.in_features % 64 == 0 and layer.out_features % 32 == 0
    if backend == "te-nvfp4":
        return layer.in_features % 16 == 0 and layer.out_features % 16 == 0
    return True


def quantized_layer_names(model: nn.Module, config: QuantConfig) -> list[str]:
    """Names (in the merged model) of the Linear layers `config` quantises: not skipped, with
    in_features · out_features >= min_features and a shape the backend's kernels accept."""
    return [
        name for name, layer in _linear_layers(model).items()
        if layer.in_features * layer.out_features >= config.min_features
        and _fits_backend(layer, config.backend) and not is_skipped(name, config.skip_modules)
    ]


def _merged_tensors(model: nn.Module) -> dict[str, Tensor]:
    """Every parameter and buffer of the LoRA-merged model, without merging in place:
    W_merged = W_base + Σ_adapters get_delta_weight(adapter) (= B·A·scaling), as peft's merge."""
    tuner, base = _tuner_layer_type(), _unwrap(model)
    tensors = {}
    for key, tensor in [*base.named_parameters(), *base.named_buffers()]:
        if any(part.startswith("lora_") for part in key.split(".")):
            continue
        tensors[key.replace(".base_layer.", ".")] = tensor.detach()
    lora_layers = [(n, m) for n, m in base.named_modules() if tuner is not None and isinstance(m, tuner)]
    for name, module in lora_layers:
        if module.merged or not hasattr(module, "lora_A"):
            continue  # already in the base weight, or not a LoRA layer
        for adapter in [a for a in module.active_adapters if a in module.lora_A]:
            if getattr(module, "use_dora", {}).get(adapter, False):
                raise NotImplementedError(f"DoRA adapter on {name}: only plain LoRA is supported")
            tensors[f"{name}.weight"] = tensors[f"{name}.weight"] + module.get_delta_weight(adapter)
    return tensors


def _merge_lora_into(model: nn.Module) -> nn.Module:
    """Merge LoRA into the base weights with peft's merge API and drop the adapter modules."""
    if hasattr(model, "merge_and_unload"):
        return model.merge_and_unload()
    tuner = _tuner_layer_type()
    wrapped = [n for n, m in model.named_modules() if tuner is not None and isinstance(m, tuner)]
    for name in wrapped:  # LoRA injected without a PeftModel (e.g. diffusers' add_adapter)
        module = model.get_submodule(name)
        module.merge()
        _replace(model, name, module.get_base_layer())
    return model


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def _require_transformer_engine() -> tuple[ModuleType, type]:
    """(transformer_engine.pytorch, NVFP4BlockScaling) or RuntimeError saying what is missing."""
    missing = []
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 10:
        missing.append("a CUDA Blackwell GPU (sm100+)")
    try:
        import transformer_engine.pytorch as te
        from transformer_engine.common.recipe import NVFP4BlockScaling
    except ImportError:
        missing.insert(0, "NVIDIA Transformer Engine (transformer_engine.pytorch)")
    if missing:
        raise RuntimeError(f"backend te-nvfp4 needs {' and '.join(missing)}; "
                           f"backends that work here: {', '.join(EMULATED_BACKENDS + BNB_BACKENDS)}")
    return te, NVFP4BlockScaling


class TELinear(nn.Module):
    """A Transformer Engine Linear run under the NVFP4 recipe (weights kept in their dtype; TE
    quantises them and the activations in every forward)."""

    def __init__(self, weight: Tensor, bias: Tensor | None) -> None:
        super().__init__()
        te, recipe = _require_transformer_engine()
        self.te, self.recipe = te, recipe()
        out_features, in_features = weight.shape
        self.linear = te.Linear(in_features, out_features, bias=bias is not None,
                                params_dtype=weight.dtype, device=weight.device)
        self.load(weight, bias)

    def load(self, weight: Tensor, bias: Tensor | None) -> None:
        with torch.no_grad():
            self.linear.weight.copy_(weight)
            if bias is not None:
                self.linear.bias.copy_(bias)

    def forward(self, x: Tensor) -> Tensor:
        with self.te.autocast(enabled=True, recipe=self.recipe):  # older TE: fp8_autocast(fp8_recipe=)
            return self.linear(x)


def _bnb_linear(weight: Tensor, bias: Tensor | None, quant_type: str) -> nn.Module:
    import bitsandbytes as bnb

    out_features, in_features = weight.shape
    layer = bnb.nn.Linear4bit(in_features, out_features, bias=bias is not None,
                              compute_dtype=weight.dtype, quant_type=quant_type, device=weight.device)
    layer.weight = bnb.nn.Params4bit(weight.detach().clone(), requires_grad=False, quant_type=quant_type)
    if bias is not None:
        layer.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
    return layer.to(weight.device)  # Params4bit quantises on .to(device)


def _set_layer(quantized: nn.Module, name: str, weight: Tensor, bias: Tensor | None, backend: str) -> None:
    """Make layer `name` of `quantized` the `backend` version of Linear(weight (out, in), bias)."""
    with torch.no_grad():
        if backend in EMULATED_BACKENDS:
            layer = quantized.get_submodule(name)
            fake = fake_quantize_nvfp4 if backend == "nvfp4-emulated" else fake_quantize_mxfp4
            layer.weight.copy_(fake(weight))
            if bias is not None:
                layer.bias.copy_(bias)
        elif backend in BNB_BACKENDS:
            _replace(quantized, name, _bnb_linear(weight, bias, backend.removeprefix("bnb-")))
        else:
            layer = quantized.get_submodule(name)
            if isinstance(layer, TELinear):
                layer.load(weight, bias)
            else:
                _replace(quantized, name, TELinear(weight, bias))


def make_quantized_copy(model: nn.Module, config: QuantConfig) -> nn.Module:
    """A 4-bit copy of `model` for exploration: deep copy, LoRA merged (peft merge API, on the copy
    only), layers from `quantized_layer_names` quantised by `config.backend`; eval mode, frozen.
    The original model is left untouched."""
    if config.backend == "te-nvfp4":
        _require_transformer_engine()  # fail before the deep copy
    quantized = _merge_lora_into(copy.deepcopy(model))
    for parameter in quantized.parameters():
        parameter.grad = None
    for name in quantized_layer_names(quantized, config):
        layer = quantized.get_submodule(name)
        _set_layer(quantized, name, layer.weight, layer.bias, config.backend)
    return quantized.eval().requires_grad_(False)


def refresh_quantized_copy(quantized: nn.Module, model: nn.Module, config: QuantConfig) -> None:
    """Re-derive `quantized` in place from the current (LoRA-merged) `model`, e.g. after an optimizer
    step: quantised layers are re-quantised from the merged weights, every other parameter and
    buffer is copied. `model` is not modified (the merge is computed, not applied)."""
    with torch.no_grad():
        merged = _merged_tensors(model)
        names = quantized_layer_names(model, config)
        for name in names:
            _set_layer(quantized, name, merged[f"{name}.weight"], merged.get(f"{name}.bias"), config.backend)
        eligible = set(names)
        for key, tensor in [*quantized.named_parameters(), *quantized.named_buffers()]:
            parts = key.split(".")
            if not any(".".join(parts[:i]) in eligible for i in range(1, len(parts))):
                tensor.copy_(merged[key])
