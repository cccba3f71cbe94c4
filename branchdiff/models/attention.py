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
"""

from __future__ import annotations

import torch

DEFAULT = "native"


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
    if name == DEFAULT:
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
