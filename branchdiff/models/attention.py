"""The attention kernel a run's denoiser uses (`model.attention_backend`), through diffusers' attention
dispatcher (`ModelMixin.set_attention_backend`): `native` (PyTorch's scaled_dot_product_attention,
the default), `flash` / `flash_varlen` (flash-attn 2), `_flash_3` (flash-attn 3), `sage` (SageAttention),
`xformers`, `flex`, and PyTorch's kernels by name (`_native_flash`, `_native_efficient`, `_native_math`,
`_native_cudnn`). The hub-fetched kernels are not offered: nothing downloads code at run time.

Under `native` on CUDA, PyTorch's cuDNN attention kernel is switched off: on an H100 (torch 2.11,
cuDNN of CUDA 13) its backward returned NaN gradients for the tiny FLUX.1 and FLUX.2 pipelines under
bf16 where the flash and memory-efficient kernels do not (docs/gpu.md); `_native_cudnn` asks for it.
A backend is refused before anything loads where its package is missing, and once the model has
loaded where the family's attention does not go through the dispatcher (SD3, SANA and SD 1.5 call
PyTorch's SDPA directly: `native` only).

`auto` (the default) chooses per device and family, once the model has loaded (`choose_backend`): on the
CPU, `native`; on CUDA, the first of flash-attn 3, flash-attn 2 and SageAttention that is installed (where
the family's attention goes through the dispatcher) and then cuDNN's kernel (for every family: through the
dispatcher, or PyTorch's SDPA with cuDNN allowed) whose gradient check passes at the model's own attention
width (`gradient_check`: one forward and backward of random queries, keys and values at the model's heads and
head dimension in bf16, finite and within 3 % of PyTorch's math kernel's), else `native`. The choice, and
why, is the run's `attention_kernel` (written to RUN/runtime.json and printed once).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch

DEFAULT = "native"
AUTO = "auto"
DISPATCHED_CANDIDATES = ("_flash_3", "flash", "sage")  # tried in this order on CUDA where installed (dispatcher families only)
CUDNN = "_native_cudnn"
GRADIENT_TOLERANCE = 0.03  # a kernel's gradients within this fraction of the largest math-kernel gradient (bf16 rounding: ≤ 0.5 % measured)


def offered() -> list[str]:
    """Every backend a run may name: diffusers' dispatcher's, less those fetched from the hub."""
    from diffusers.models.attention_dispatch import AttentionBackendName

    return [b.value for b in AttentionBackendName if "hub" not in b.value and b.value not in ("_native_npu", "_native_xla")]


def installed() -> list[str]:
    """The offered backends whose packages (and versions) diffusers finds here."""
    from diffusers.models.attention_dispatch import AttentionBackendName, _check_attention_backend_requirements

    usable = []
    for name in offered():
        try:
            _check_attention_backend_requirements(AttentionBackendName(name))
        except (RuntimeError, ImportError, ValueError):
            continue
        usable.append(name)
    return usable


def check_backend(name: str) -> None:
    """Refuse, in one line, a backend that is not offered or whose package is not installed."""
    if name in (DEFAULT, AUTO):
        return
    if name not in offered():
        raise ValueError(f"model.attention_backend={name}: not an attention backend; choose one of {', '.join(offered())}")
    usable = installed()
    if name not in usable:
        raise ValueError(f"model.attention_backend={name}: its package is not installed here (installed: {', '.join(usable)}); "
                         f"install it (flash: flash-attn, sage: sageattention, xformers: xformers) or choose an installed one")


def apply_backend(denoiser: torch.nn.Module, name: str, family: str) -> None:
    """Set `denoiser`'s attention backend on each of its processors; on CUDA under `native`, PyTorch's
    cuDNN attention off (see above). diffusers' `set_attention_backend` also makes the backend the
    process's default for every other model; that default is put back, so a second model in the
    process (an evaluation, another run in the same Python) keeps its own."""
    from diffusers import ModelMixin
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    if name == DEFAULT and torch.cuda.is_available():
        torch.backends.cuda.enable_cudnn_sdp(False)
    processors = [module.processor for module in denoiser.modules() if hasattr(module, "processor")]
    if not any(hasattr(processor, "_attention_backend") for processor in processors):
        if name == DEFAULT:
            return  # PyTorch's SDPA called directly: native is what runs
        raise ValueError(f"model.attention_backend={name}: the {family} family's attention calls PyTorch's SDPA directly, not diffusers' "
                         f"dispatcher; leave it at native for this family")
    from branchdiff.models.loading import quiet_loading

    default = _AttentionBackendRegistry.get_active_backend()[0]
    try:
        with quiet_loading():  # diffusers warns that its backends are experimental, on every call
            for model in [m for m in denoiser.modules() if isinstance(m, ModelMixin)]:  # Wan 2.2 A14B: both experts
                model.set_attention_backend(name)  # pinned on the processors, native included
    finally:
        _AttentionBackendRegistry.set_active_backend(default)


def dispatched(denoiser: torch.nn.Module) -> bool:
    """Whether the denoiser's attention goes through diffusers' dispatcher (its processors carry a backend)."""
    return any(hasattr(getattr(module, "processor", None), "_attention_backend") for module in denoiser.modules())


def attention_width(denoiser: torch.nn.Module) -> tuple[int, int]:
    """(heads, head dimension) of the denoiser's attention, from its diffusers config (the first model's)."""
    from diffusers import ModelMixin

    model = next((m for m in denoiser.modules() if isinstance(m, ModelMixin)), denoiser)
    config = getattr(model, "config", {})
    if "block_out_channels" in config:  # a UNet (SD 1.5): its attention_head_dim is the number of heads, the first blocks' width split by it
        heads = config.get("attention_head_dim") or 8
        heads = heads[0] if isinstance(heads, (list, tuple)) else heads
        return int(heads), int(config["block_out_channels"][0]) // int(heads)
    return int(config.get("num_attention_heads") or config.get("num_heads") or 8), int(config.get("attention_head_dim") or config.get("head_dim") or 64)


def gradient_check(attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor], heads: int, head_dim: int, device: torch.device,
                   tokens: int = 256) -> tuple[bool, str]:
    """Whether attention `attend(q, k, v)` (B, heads, L, D) gives finite gradients within `GRADIENT_TOLERANCE` of PyTorch's
    math kernel's, in bf16 at this width (the NaN gradients of 2026-11-26 came from such a backward); (passed, why)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    generator = torch.Generator(device="cpu").manual_seed(0)
    inputs = [torch.randn(2, heads, tokens, head_dim, generator=generator).to(device, torch.bfloat16) for _ in range(3)]
    upstream = torch.randn(2, heads, tokens, head_dim, generator=generator).to(device, torch.bfloat16)

    def gradients(function) -> list[torch.Tensor]:
        leaves = [x.clone().requires_grad_(True) for x in inputs]
        (function(*leaves) * upstream).sum().backward()
        return [cast(torch.Tensor, x.grad).float() for x in leaves]

    try:
        candidate = gradients(attend)
    except (RuntimeError, ValueError, NotImplementedError) as error:
        return False, f"its backward failed ({type(error).__name__}: {str(error).splitlines()[0][:120]})"
    with sdpa_kernel(SDPBackend.MATH):
        reference = gradients(torch.nn.functional.scaled_dot_product_attention)
    if not all(torch.isfinite(g).all() for g in candidate):
        return False, "its backward gave non-finite gradients"
    scale = max(float(g.abs().max()) for g in reference) or 1.0
    difference = max(float((a - b).abs().max()) for a, b in zip(candidate, reference)) / scale
    if difference > GRADIENT_TOLERANCE:
        return False, f"its gradients are {difference:.1%} of the largest off the math kernel's"
    return True, f"gradients finite, within {difference:.2%} of the math kernel's"


def _cudnn_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)


def _dispatched(name: str) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """diffusers' dispatcher's kernel `name` on (B, heads, L, D) tensors (it takes (B, L, heads, D))."""
    from diffusers.models.attention_dispatch import AttentionBackendName, dispatch_attention_fn

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = dispatch_attention_fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), backend=AttentionBackendName(name))
        return out.transpose(1, 2)

    return attend


def choose_backend(denoiser: torch.nn.Module, device: torch.device, check=gradient_check) -> tuple[str, str]:
    """`auto`'s choice for this denoiser on `device` (module doc): (backend name for `apply_backend`, the kernel and why)."""
    if device.type != "cuda":
        return DEFAULT, "native: PyTorch's SDPA (on the CPU)"
    heads, head_dim = attention_width(denoiser)
    through_dispatcher = dispatched(denoiser)
    usable = installed() if through_dispatcher else []
    refused = []
    for name in [*(n for n in DISPATCHED_CANDIDATES if n in usable), CUDNN]:
        attend = _dispatched(name) if through_dispatcher else _cudnn_sdpa
        passed, why = check(attend, heads, head_dim, device)
        if passed:
            return name, f"{name} ({why} at {heads} heads × {head_dim})"
        refused.append(f"{name}: {why}")
    return DEFAULT, "native: PyTorch's SDPA, cuDNN's kernel off (" + "; ".join(refused) + ")"


def resolve_backend(name: str, denoiser: torch.nn.Module, device: torch.device, family: str, check=gradient_check) -> tuple[str, str]:
    """The backend a run's denoiser gets (`auto` chosen here) and the kernel it records; set with `apply_backend`, on CUDA
    PyTorch's cuDNN kernel allowed exactly where it was chosen."""
    if name == AUTO:
        name, kernel = choose_backend(denoiser, device, check)
    else:
        kernel = name
    if name == CUDNN and not dispatched(denoiser):  # PyTorch's SDPA called directly: cuDNN allowed, nothing to set
        torch.backends.cuda.enable_cudnn_sdp(True)
        return DEFAULT_WITH_CUDNN, kernel
    apply_backend(denoiser, name, family)
    return name, kernel


DEFAULT_WITH_CUDNN = "native+cudnn"  # the SDPA families' cuDNN: PyTorch's own dispatch with its cuDNN kernel allowed
