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

import torch

MODES = ("none", "blocks", "full")
RECOMPILE_LIMIT = 64  # versions Dynamo keeps of one compiled function before it runs it eagerly


def _blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks: its declared `_repeated_blocks` classes, else every item of each
    ModuleList attribute of two or more modules of one class (SD3's and SANA's transformer_blocks)."""
    declared = getattr(model, "_repeated_blocks", None)
    if declared:
        return [m for m in model.modules() if type(m).__name__ in declared]
    found = []
    for child in model.children():
        if isinstance(child, torch.nn.ModuleList) and len(child) >= 2 and len({type(m) for m in child}) == 1:
            found.extend(child)
    return found


def check_compiler(mode: str) -> None:
    """Refuse, in one line before a model loads, a compiled denoiser where torch.compile's inductor has nothing
    to compile with: Triton on a CUDA machine, else a C++ compiler (torch's own search: `CXX`-style names from
    `torch._inductor.config.cpp.cxx`, g++ or clang++ on the PATH)."""
    if mode == "none":
        return
    fix = "or set model.compile=none (eager: the same results, about 1.15× as long an iteration on the built-in model)"
    if torch.cuda.is_available():
        from torch.utils._triton import has_triton

        if not has_triton():
            raise ValueError(f"model.compile={mode}: torch.compile on a GPU needs Triton, which is not installed here; "
                             f"pip install triton (the version your torch names), {fix}")
        return
    from torch._inductor import config
    from torch._inductor.cpp_builder import cpp_compiler_search

    search = tuple(config.cpp.cxx) if isinstance(config.cpp.cxx, (list, tuple)) else (config.cpp.cxx,)
    try:
        cpp_compiler_search(search)
    except Exception:  # torch's InvalidCxxCompiler, or a search that failed in another way: either way nothing to compile with
        names = ", ".join(str(name) for name in search if name)
        raise ValueError(f"model.compile={mode}: torch.compile on the CPU needs a C++ compiler and none was found (looked for {names}); "
                         f"install one (g++ or clang++), {fix}") from None


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
