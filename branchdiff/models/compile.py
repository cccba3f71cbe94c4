"""A compiled denoiser (`model.compile`): `none`, `blocks` (regional compilation: each repeated transformer
block compiled once and reused, diffusers' `compile_repeated_blocks` where the model declares its
repeated blocks, else every block of the model's block lists) or `full` (the whole denoiser's forward).

Compilation is in place (`Module.compile`), so parameter names, LoRA exports and checkpoints are those of
the eager model; rollouts and training run the same compiled code, so the log-prob check before the first
update still holds. Shapes vary with the tree's levels (a few rows at the root, many at the leaves): the
first recompilation marks the batch dimension dynamic (torch.compile's default), so a run compiles a
handful of times, then reuses them.
"""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig
from pathlib import Path

import torch

MODES = ("none", "blocks", "full")
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
    if mode == "none":
        return
    fix = "or set model.compile=none (eager: the same recipe, an iteration about 1.15× as long on the built-in model)"
    from accelerate.utils import parse_flag_from_env

    if torch.cuda.is_available() and not parse_flag_from_env("ACCELERATE_USE_CPU"):
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


def compile_denoiser(denoiser: torch.nn.Module, mode: str, backend: str = "inductor") -> int:
    """Compile `denoiser` (every diffusers model inside it: both of Wan 2.2's experts) in place with
    torch.compile's `backend`; returns how many modules were compiled. Raises ValueError naming the fix
    when `blocks` finds none."""
    if mode == "none":
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
