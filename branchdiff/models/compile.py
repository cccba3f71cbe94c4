"""A compiled denoiser (`model.compile`): `none`, `blocks` (regional compilation: each repeated transformer
block compiled once and reused, diffusers' `compile_repeated_blocks` where the model declares its
repeated blocks, else every block of the model's block lists) or `full` (the whole denoiser's forward).

Compilation is in place (`Module.compile`), so parameter names, LoRA exports and checkpoints are those of
the eager model; rollouts and training run the same compiled code, so the log-prob check before the first
update still holds. Shapes vary with the tree's levels (a few rows at the root, many at the leaves): the
first recompilation marks the batch dimension dynamic (torch.compile's default), so a run compiles a
handful of times, then reuses them.

`auto` (the default) compiles the blocks on CUDA for the families whose compiled forward the GPU bench
measured faster at a released size (`MEASURED_GAINS`, docs/gpu.md), and leaves every other family, and every
run on the CPU or sharded with FSDP, eager (a preset may still name `blocks`: the built-in task's do). SANA is left out: compiled and
then trained on an H200 it stopped with `(*bias): last dimension must be contiguous`, and naming `blocks` or
`full` for it on CUDA is refused in one line until that is understood. The first compiled forward's time (the
compilation's cost) is printed once.
"""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig
import time
from collections.abc import Callable
from pathlib import Path

import torch

MODES = ("none", "blocks", "full", "auto")
MEASURED_GAINS = {  # family: the compiled blocks' forward against eager's, where the GPU bench measured it (docs/gpu.md, H200, 2026-11-27)
    "sd3": "1.63× at SD3.5 Medium's 1024², 8 rows",
    "flux2-klein": "1.40× at FLUX.2 [klein] 4B's 1024², 8 rows",
}
REFUSED_ON_CUDA = {  # family: why a compiled denoiser is refused there
    "sana": "SANA compiled and then trained stopped on an H200 with '(*bias): last dimension must be contiguous' (docs/gpu.md)",
}


def on_cuda() -> bool:
    """Whether a run here trains on CUDA (a GPU, and not `ACCELERATE_USE_CPU`, as `accelerate launch --cpu` sets)."""
    from accelerate.utils import parse_flag_from_env

    return torch.cuda.is_available() and not parse_flag_from_env("ACCELERATE_USE_CPU")


def resolve_compile(mode: str, family: str, cuda: bool, sharded: bool = False) -> tuple[str, str]:
    """The compile mode a run uses (`auto` chosen here: module doc; a sharded denoiser stays eager) and why, in a few words."""
    if mode != "auto":
        return mode, "as set"
    if sharded:
        return "none", "auto: eager when sharded (FSDP)"
    if not cuda:
        return "none", "auto: eager on the CPU"
    if family in MEASURED_GAINS and family not in REFUSED_ON_CUDA:
        return "blocks", f"auto: compiled blocks measured {MEASURED_GAINS[family]}"
    return "none", f"auto: eager (no measured gain for {family})"


def check_compile_family(mode: str, family: str, cuda: bool) -> None:
    """Refuse, in one line before a model loads, a compiled denoiser of a family that failed compiled on CUDA."""
    if cuda and mode in ("blocks", "full") and family in REFUSED_ON_CUDA:
        raise ValueError(f"model.compile={mode} with model.family={family} on CUDA: {REFUSED_ON_CUDA[family]}; set model.compile=none "
                         "(or auto, which leaves it eager)")
RECOMPILE_LIMIT = 64  # versions Dynamo keeps of one compiled function before it runs it eagerly


def _blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks: its declared `_repeated_blocks` classes, else every item of each
    ModuleList attribute of two or more modules of one class (SD3's and SANA's transformer_blocks)."""
    declared = getattr(model, "_repeated_blocks", None)
    if declared:
        return [m for m in model.modules() if type(m).__name__ in declared]
    found: list[torch.nn.Module] = []
    for child in model.children():
        if isinstance(child, torch.nn.ModuleList) and len(child) >= 2 and len({type(m) for m in child}) == 1:
            found.extend(child)
    return found


def check_compiler(mode: str) -> None:
    """Refuse, in one line before a model loads, a compiled denoiser where torch.compile's Inductor has nothing
    to build with. On a CUDA device it writes Triton kernels (Triton, and a C compiler for Triton's launcher:
    `CC`, gcc or clang); on the CPU (no GPU, or `ACCELERATE_USE_CPU`, as `accelerate launch --cpu` sets) C++
    that includes Python's headers (a C++ compiler found by torch's own search: `CXX`, else g++, clang++ on
    macOS, cl on Windows; and Python.h)."""
    if mode in ("none", "auto"):  # auto compiles only on CUDA, where it is checked once chosen (compile_denoiser's callers)
        return
    fix = "or set model.compile=none (eager: the same recipe, an iteration about 1.15× as long on the built-in model)"
    if on_cuda():
        from torch.utils._triton import has_triton, has_triton_package

        if not has_triton_package():
            raise ValueError(f"model.compile={mode}: torch.compile on a GPU needs Triton, which is not installed here; "
                             f"pip install triton (the version your torch names), {fix}")
        if not has_triton():
            raise ValueError(f"model.compile={mode}: Triton is installed but does not support this GPU (torch.compile's GPU kernels "
                             f"need compute capability 7.0 or newer), {fix}")
        if not any(shutil.which(name) for name in (os.environ.get("CC"), "gcc", "clang") if name):
            raise ValueError(f"model.compile={mode}: Triton builds its kernel launcher with a C compiler and none was found "
                             f"(CC, gcc, clang); install gcc, {fix}")
        return
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        get_cpp_compiler()
    except Exception:  # torch's InvalidCxxCompiler, or a search that failed in another way: either way nothing to build with
        raise ValueError(f"model.compile={mode}: torch.compile on the CPU needs a C++ compiler and none was found "
                         f"(CXX, else {'clang++' if sys.platform == 'darwin' else 'g++'}); install one, {fix}") from None
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if not headers.is_file():
        raise ValueError(f"model.compile={mode}: torch.compile on the CPU builds against Python's headers and {headers} is missing; "
                         f"install your Python's development package (e.g. python3-dev), {fix}")


def report_first_call(denoiser: torch.nn.Module, say: Callable[[str], None], what: str) -> None:
    """Say once that the denoiser's first forward compiles (`say(line)` as it starts: on the CPU it takes a
    minute or more, in which nothing else is printed) and how long it took, when it returns."""
    started: list[float] = []

    def before(module: torch.nn.Module, args: object) -> None:
        say(f"{what}: compiling them in the first forward (once)...")
        started.append(time.perf_counter())

    def after(module: torch.nn.Module, args: object, output: object) -> None:
        pre.remove()
        post.remove()
        say(f"{what}: the first forward, which compiles them, took {time.perf_counter() - started[0]:.1f} s (later ones reuse them)")

    pre, post = denoiser.register_forward_pre_hook(before), denoiser.register_forward_hook(after)


def compile_denoiser(denoiser: torch.nn.Module, mode: str, backend: str = "inductor") -> int:
    """Compile `denoiser` (every diffusers model inside it: both of Wan 2.2's experts) in place with
    torch.compile's `backend`; returns how many modules were compiled. Raises ValueError naming the fix
    when `blocks` finds none."""
    if mode in ("none", "auto"):  # auto is resolved by the caller (`resolve_compile`)
        return 0
    from diffusers import ModelMixin

    # a run's forwards differ in grad mode, inputs that require grad, batch and model (the explorer's copy, a second
    # expert, another run in the same process): past torch's default of 8 versions of a block, Dynamo falls back to
    # eager without an error, so a run allows more
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)

    models = [m for m in denoiser.modules() if isinstance(m, ModelMixin)] or [denoiser]
    compiled = 0
    for model in models:
        if mode == "full":
            model.compile(backend=backend)
            compiled += 1
            continue
        blocks = _blocks(model)
        if not blocks:
            raise ValueError(f"model.compile=blocks: {type(model).__name__} has no repeated blocks to compile; use model.compile=full")
        for block in blocks:
            block.compile(backend=backend)
        compiled += len(blocks)
    return compiled
