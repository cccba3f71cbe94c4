"""Low-precision exploration copies of a policy (Sol-RL: explore in FP4, train in BF16, arXiv 2604.06916; docs/explore.md).

A quantised copy is a deep copy of the policy with its LoRA merged into the base weights and its
eligible `nn.Linear` layers replaced by a 4-bit or 8-bit version; it is only used to roll out and
rank a large candidate pool, never to compute a training signal. After every optimizer step
`refresh_quantized_copy` re-derives its weights from the current policy, so exploration follows it.

Formats (NVFP4, MXFP4, FP8 E4M3) are pure functions in `branchdiff.explore.formats`. FP8 is what Hopper
(sm89/sm90, e.g. H100) multiplies natively, FP4 needs Blackwell (sm100+). Which modules stay in
high precision is the model adapter's `quant_skip_modules`.

Backends (`QuantConfig.backend`):
- `nvfp4-emulated`, `mxfp4-emulated`: weight-only emulation; each eligible weight is replaced by
  its quantise-dequantise and the matmul runs in the original dtype (correct, not faster).
- `bnb-fp4`, `bnb-nf4`: bitsandbytes `Linear4bit` (64-element blocks, absmax scales; CPU or CUDA).
- `fp8-emulated` (per-row scales), `fp8-emulated-tensor` (per-tensor scales): FP8 weights and
  activations emulated by `FP8EmulatedLinear` (quantise-dequantise the input rows and the weight,
  matmul in the original dtype): the CPU counterparts of `torchao-fp8` and `te-fp8` respectively.
- `te-nvfp4`: NVIDIA Transformer Engine `Linear` under an `NVFP4BlockScaling` recipe: real FP4
  matmuls, CUDA Blackwell (sm100+) only. `te-fp8`: the same under `Float8CurrentScaling` (E4M3,
  per-tensor scales from the current amax), sm89+. Written against TE's `te.autocast` API.
- `torchao-fp8`: torchao `Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())`: E4M3
  weights with per-channel scales, activations quantised per row in every forward, FP8 matmuls
  (`torch._scaled_mm`); CUDA sm89+ only.
The real-hardware backends (te-*, torchao-fp8) are untested here (no GPU); on a machine without
what they need, building the copy raises one line naming what is missing.
"""

from __future__ import annotations

import copy
import fnmatch
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch
from torch import Tensor, nn

from branchdiff.explore.formats import fake_quantize_fp8, fake_quantize_mxfp4, fake_quantize_nvfp4
from branchdiff.runtime.sharding import full_tensor

FP8_EMULATED = {"fp8-emulated": "row", "fp8-emulated-tensor": "tensor"}  # backend -> scale granularity
EMULATED_BACKENDS = ("nvfp4-emulated", "mxfp4-emulated", *FP8_EMULATED)
BNB_BACKENDS = ("bnb-fp4", "bnb-nf4")
TE_BACKENDS = ("te-nvfp4", "te-fp8")
GPU_BACKENDS = (*TE_BACKENDS, "torchao-fp8")  # real low-precision matmuls; CUDA only
BACKENDS = EMULATED_BACKENDS + BNB_BACKENDS + GPU_BACKENDS


class FP8EmulatedLinear(nn.Linear):
    """Emulated FP8 weights-and-activations Linear, as an FP8 GEMM with dynamic scales (Hopper;
    torchao's Float8DynamicActivationFloat8WeightConfig for `row`, TE's current scaling for `tensor`):

        y = fq(x) · fq(W)ᵀ + b,      fq = fake_quantize_fp8(·, granularity)
    with per-row scales one per output channel of W and one per token of x (a row of its last dim),
    with per-tensor scales one for W and one for each forward's x. The weight is stored
    quantise-dequantised (`load`); the input is quantised in every forward. Emulated: both E4M3
    roundings and scales. Not emulated: the matmul runs in the input's dtype on the dequantised
    values (the hardware multiplies the E4M3 values and accumulates at its own precision), and the
    bias stays full precision.
    """

    def __init__(self, weight: Tensor, bias: Tensor | None, granularity: str = "row") -> None:
        out_features, in_features = weight.shape
        super().__init__(in_features, out_features, bias=bias is not None, device=weight.device, dtype=weight.dtype)
        self.granularity = granularity
        self.load(weight, bias)

    def load(self, weight: Tensor, bias: Tensor | None) -> None:
        with torch.no_grad():
            self.weight.copy_(fake_quantize_fp8(weight, self.granularity))
            if bias is not None:
                self.bias.copy_(bias)

    def forward(self, x: Tensor) -> Tensor:
        return nn.functional.linear(fake_quantize_fp8(x, self.granularity), self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8_e4m3 granularity={self.granularity}"


# --- quantised copies of a model -----------------------------------------------------------------

@dataclass
class QuantConfig:
    backend: str = "nvfp4-emulated"  # one of BACKENDS
    skip_modules: tuple[str, ...] = ()  # module-name patterns never quantised (the adapter's quant_skip_modules; see is_skipped)
    min_features: int = 0  # skip Linear layers with in_features * out_features below this

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"QuantConfig.backend={self.backend!r}; allowed: {', '.join(BACKENDS)}")
        if self.min_features < 0:
            raise ValueError(f"QuantConfig.min_features={self.min_features}; must be >= 0")
        self.skip_modules = tuple(self.skip_modules)



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
    64-element input blocks; Transformer Engine's FP4/FP8 GEMMs and torch._scaled_mm (torchao)
    want both dims divisible by 16. The emulated backends take any shape (a short final block is
    zero-padded)."""
    if backend in BNB_BACKENDS:
        return layer.in_features % 64 == 0 and layer.out_features % 32 == 0
    if backend in GPU_BACKENDS:
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


GPU_NEEDS = {  # backend -> (minimum compute capability, what to call it, its CPU emulation)
    "te-nvfp4": ((10, 0), "a CUDA Blackwell GPU (sm100+)", "nvfp4-emulated"),
    "te-fp8": ((8, 9), "a CUDA GPU with FP8 (sm89+, e.g. H100)", "fp8-emulated-tensor"),
    "torchao-fp8": ((8, 9), "a CUDA GPU with FP8 (sm89+, e.g. H100)", "fp8-emulated"),
}


def _require_gpu_backend(backend: str, library: str, import_library: Callable[[], object]) -> object:
    """import_library() if this machine has the GPU `backend` needs and the import works, else one
    RuntimeError line naming what is missing, what the machine has and what works here."""
    capability, gpu, emulation = GPU_NEEDS[backend]
    missing, result = [], None
    if torch.cuda.is_available():
        found = torch.cuda.get_device_capability()
        has = f"a CUDA GPU of compute capability sm{found[0]}{found[1]}"
    else:
        found, has = None, "no CUDA GPU"
    if found is None or found < capability:
        missing.append(gpu)
    try:
        result = import_library()
    except ImportError:
        missing.insert(0, library)
    if missing:
        raise RuntimeError(f"backend {backend} needs {' and '.join(missing)}; this machine has {has}; its emulation is "
                           f"{emulation}; backends that work here: {', '.join(EMULATED_BACKENDS + BNB_BACKENDS)}")
    return result


def _require_transformer_engine(backend: str = "te-nvfp4") -> tuple[ModuleType, type]:
    """(transformer_engine.pytorch, the backend's recipe class) or RuntimeError saying what is missing."""
    def load() -> tuple[ModuleType, type]:
        import transformer_engine.pytorch as te
        from transformer_engine.common import recipe

        return te, recipe.NVFP4BlockScaling if backend == "te-nvfp4" else recipe.Float8CurrentScaling

    return _require_gpu_backend(backend, "NVIDIA Transformer Engine (transformer_engine.pytorch)", load)


def _require_torchao_fp8() -> tuple[object, object]:
    """(torchao's quantize_, its per-row dynamic FP8 config) or RuntimeError saying what is missing."""
    def load() -> tuple[object, object]:
        from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

        return quantize_, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())

    return _require_gpu_backend("torchao-fp8", "torchao (pip install torchao)", load)


class TorchaoFP8Linear(nn.Module):
    """A Linear(weight (out, in), bias) quantised by torchao: E4M3 weight with per-channel scales,
    activations quantised per row in every forward, FP8 matmul (torch._scaled_mm). torchao's per-row
    scaling takes bfloat16 weights, so the layer holds them in bfloat16 whatever the model's dtype, and
    its input is cast to bfloat16 and its output back to the input's dtype."""

    def __init__(self, weight: Tensor, bias: Tensor | None) -> None:
        super().__init__()
        quantize, fp8_config = _require_torchao_fp8()
        out_features, in_features = weight.shape
        self.linear = nn.Linear(in_features, out_features, bias=bias is not None, device=weight.device, dtype=torch.bfloat16)
        with torch.no_grad():
            self.linear.weight.copy_(weight)
            if bias is not None:
                self.linear.bias.copy_(bias)
        quantize(self.linear, fp8_config)  # replaces linear.weight by a torchao Float8Tensor in place
        self.requires_grad_(False)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(x.to(torch.bfloat16)).to(x.dtype)


class TELinear(nn.Module):
    """A Transformer Engine Linear run under the backend's recipe (te-nvfp4: NVFP4BlockScaling,
    te-fp8: Float8CurrentScaling); weights are kept in their dtype, TE quantises them and the
    activations in every forward."""

    def __init__(self, weight: Tensor, bias: Tensor | None, backend: str = "te-nvfp4") -> None:
        super().__init__()
        te, recipe = _require_transformer_engine(backend)
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
        layer = quantized.get_submodule(name)
        if isinstance(layer, (FP8EmulatedLinear, TELinear)):  # a refresh: the layer re-quantises itself
            layer.load(weight, bias)
        elif backend in FP8_EMULATED:
            _replace(quantized, name, FP8EmulatedLinear(weight, bias, FP8_EMULATED[backend]))
        elif backend in TE_BACKENDS:
            _replace(quantized, name, TELinear(weight, bias, backend))
        elif backend in EMULATED_BACKENDS:
            fake = fake_quantize_nvfp4 if backend == "nvfp4-emulated" else fake_quantize_mxfp4
            layer.weight.copy_(fake(weight))
            if bias is not None:
                layer.bias.copy_(bias)
        elif backend in BNB_BACKENDS:
            _replace(quantized, name, _bnb_linear(weight, bias, backend.removeprefix("bnb-")))
        else:  # torchao-fp8: re-quantised from scratch
            _replace(quantized, name, TorchaoFP8Linear(weight, bias))


def make_quantized_copy(model: nn.Module, config: QuantConfig, device: torch.device | str | None = None) -> nn.Module:
    """A low-precision copy of `model` for exploration: deep copy, LoRA merged (peft merge API, on
    the copy only), moved to `device` (None: where `model` is; a model held in host memory until it is
    sharded gives a copy on the training device), layers from `quantized_layer_names` quantised by
    `config.backend`; eval mode, frozen. The original model is left untouched."""
    if config.backend in TE_BACKENDS:  # fail before the deep copy
        _require_transformer_engine(config.backend)
    elif config.backend == "torchao-fp8":
        _require_torchao_fp8()
    quantized = _merge_lora_into(copy.deepcopy(model))
    if device is not None:
        quantized.to(device)
    for parameter in quantized.parameters():
        parameter.grad = None
    for name in quantized_layer_names(quantized, config):
        layer = quantized.get_submodule(name)
        _set_layer(quantized, name, layer.weight, layer.bias, config.backend)
    return quantized.eval().requires_grad_(False)


def refresh_quantized_copy(quantized: nn.Module, model: nn.Module, config: QuantConfig) -> None:
    """Re-derive `quantized` in place from the current (LoRA-merged) `model`, e.g. after an optimizer
    step: quantised layers are re-quantised from the merged weights, every other parameter and
    buffer is copied. `model` is not modified (the merge is computed, not applied). A sharded `model`
    (FSDP) is gathered one tensor at a time, on every process (each holds a whole quantised copy)."""
    with torch.no_grad():
        merged = _merged_tensors(model)
        names = quantized_layer_names(model, config)
        for name in names:
            bias = merged.get(f"{name}.bias")
            _set_layer(quantized, name, full_tensor(merged[f"{name}.weight"]), None if bias is None else full_tensor(bias), config.backend)
        eligible = set(names)
        for key, tensor in [*quantized.named_parameters(), *quantized.named_buffers()]:
            parts = key.split(".")
            if not any(".".join(parts[:i]) in eligible for i in range(1, len(parts))):
                tensor.copy_(full_tensor(merged[key]))
