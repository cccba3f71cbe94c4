"""First-block caching of rollouts (`sampling.block_cache`): a step may skip all but the denoiser's first block.

At each step a node's forward runs the first transformer block and compares its residual r = block(h) − h
with the one cached at the last step its root path computed in full,

    δ = mean|r − r_cached| / mean|r_cached|    (over the forward's rows, tokens and channels);

when δ < threshold the remaining blocks are skipped: their residual cached at that step (the last block's
output − the first block's output, per stream) is added to the first block's output instead. This is First
Block Cache (ParaAttention's; an input-side variant of TeaCache, Liu et al. 2024, arXiv:2411.19108), as
diffusers' `FirstBlockCacheConfig` applies it to a pipeline's fixed batch. A tree's batch is not fixed: a
depth's rows are the nodes of that depth, and at a split each child's step follows its parent's. So the
cache here is node-indexed: every node keeps the cached tensors of its own forward, and a child's forward
starts from its parent's, gathered row by row (`BlockCache.next_level`); the skip decision is one per
forward (a chunk of a depth's rows), as diffusers' is one per call.

A skipped step's output is not the network's, so rollouts whose log-probabilities are trained (the GRPO
family) must not use it; objectives that train their final samples on the forward process (DiffusionNFT,
AWM, DGPO, online DPO) may (the settings check). Evaluation never caches. Which blocks, and where a block's
output holds each stream, are read from diffusers' own block registry (the metadata its caches use); a
model with no registered block list (SANA, SD 1.5's UNet) or whose blocks take another input than the
registry names (Z-Image's one sequence, padded per forward) is refused in one line. FLUX.2 joins its text
and image tokens before its single-stream blocks: the residual kept is the image tokens' (the last ones). Blocks compiled in place
(`model.compile: blocks`) stay compiled: the cache wraps them from outside, so its decisions run eagerly.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


def _block_metadata(block: torch.nn.Module) -> Any:
    """diffusers' metadata of a transformer block class (which output index holds which stream), or None."""
    from diffusers.hooks._helpers import TransformerBlockRegistry

    try:
        return TransformerBlockRegistry.get(type(block))
    except ValueError:  # not registered
        return None


def block_lists(denoiser: torch.nn.Module) -> list[tuple[torch.nn.ModuleList, int]]:
    """The denoiser's transformer block lists in call order (diffusers' block list names: FLUX's double-stream
    blocks, then its single-stream ones), each with its length. Raises ValueError naming the fix when the
    denoiser has none whose blocks diffusers' block registry describes."""
    from diffusers.hooks._common import _ALL_TRANSFORMER_BLOCK_IDENTIFIERS

    lists = [(child, len(child)) for name, child in denoiser.named_children()
             if name in _ALL_TRANSFORMER_BLOCK_IDENTIFIERS and isinstance(child, torch.nn.ModuleList) and len(child)]
    blocks = [block for blocks, _ in lists for block in blocks]
    unknown = sorted({type(b).__name__ for b in blocks if _block_metadata(b) is None})
    fix = "so its blocks cannot be cached; set sampling.block_cache=0"
    if len(blocks) < 2 or unknown:
        what = f"blocks of class {', '.join(unknown)}" if unknown else "fewer than two transformer blocks"
        raise ValueError(f"sampling.block_cache: the denoiser {type(denoiser).__name__} has {what}, which diffusers' block registry "
                         f"does not describe, {fix}")
    for block in blocks:  # Z-Image's blocks take one unified sequence `x`, padded per forward to its longest prompt
        name = _block_metadata(block).hidden_states_argument_name
        if name not in inspect.signature(type(block).forward).parameters:
            raise ValueError(f"sampling.block_cache: the denoiser {type(denoiser).__name__}'s blocks ({type(block).__name__}) take no "
                             f"'{name}', the input diffusers' block registry names for them, {fix}")
    return lists


SECOND_EXPERT = ("sampling.block_cache: this model has a second expert (transformer_2), which takes part of a forward's rows, "
                 "so a node's cached blocks would not be the ones its next step runs; set sampling.block_cache=0")


def check_cacheable_folder(path: str | None) -> None:
    """Before the model loads: refuse a local diffusers folder whose model_index.json names a second expert (Wan 2.2 A14B's
    `transformer_2`; Wan 2.1's index lists it as [null, null]). A hub id is checked once loaded (`check_cacheable`)."""
    index = Path(path) / "model_index.json" if path else None
    if index is None or not index.is_file():
        return
    try:
        entry = json.loads(index.read_text()).get("transformer_2")
    except (OSError, ValueError, AttributeError):  # an unreadable index is the loader's to name
        return
    if isinstance(entry, list) and entry and entry[0] is not None:
        raise ValueError(SECOND_EXPERT)


def check_cacheable(adapter: Any) -> None:
    """Raise ValueError, in one line naming the fix, for a model whose rollouts the cache cannot follow: a second
    expert (Wan 2.2 A14B routes a forward's rows between two transformers by their noise level), or a denoiser
    without registered block lists (`block_lists`)."""
    if getattr(getattr(adapter, "pipe", None), "transformer_2", None) is not None:
        raise ValueError(SECOND_EXPERT)
    block_lists(adapter.denoiser)


@dataclass
class Cached:
    """The cached tensors of a set of rows (the first dimension: the forward's rows, CFG's halves first)."""
    head_residual: torch.Tensor  # (R, ...) the first block's residual at the last step computed in full
    tail_hidden: torch.Tensor  # (R, ...) the last block's hidden-state output − the first block's, at that step
    tail_encoder: torch.Tensor | None  # (R, ...) the same for the text stream, where both blocks return it

    def rows(self, index: torch.Tensor) -> Cached:
        return Cached(self.head_residual[index], self.tail_hidden[index], None if self.tail_encoder is None else self.tail_encoder[index])


class BlockCache:
    """Node-indexed first-block caching of one rollout (module doc). Use as a context (the blocks are wrapped
    inside it); around each forward `forward(rows, halves)`, and `next_level(parent_row)` between depths."""

    def __init__(self, denoiser: torch.nn.Module, threshold: float) -> None:
        if threshold <= 0:
            raise ValueError(f"sampling.block_cache={threshold}: the cache's threshold must be > 0 (0 turns it off)")
        self.denoiser, self.threshold = denoiser, threshold
        self.lists = block_lists(denoiser)
        self.forwards = 0  # forwards made
        self.skipped = 0  # forwards whose blocks after the first were skipped
        self._parents: Cached | None = None  # the previous depth's rows' cache, (halves · n_prev, ...)
        self._parent_row: torch.Tensor | None = None  # (n,) each row of this depth: its parent's row in the previous depth
        self._level: list[tuple[torch.Tensor, Cached]] = []  # this depth's forwards so far: their rows (n,) and cache (halves · n, ...)
        self._inputs: Cached | None = None  # the current forward's cache (None: nothing cached yet, compute)
        self._head_out: tuple[torch.Tensor, torch.Tensor | None] | None = None  # the current forward's first-block output
        self._skip = False
        self._active = False  # inside `forward`: the blocks cache; outside (a sharded denoiser's padding forwards) they run plainly

    def __enter__(self) -> BlockCache:
        blocks = [(blocks, i) for blocks, n in self.lists for i in range(n)]
        for position, (blocks_list, i) in enumerate(blocks):
            role = "head" if position == 0 else "tail" if position == len(blocks) - 1 else "middle"
            blocks_list[i] = _CachedBlock(blocks_list[i], self, role)
        return self

    def __exit__(self, *exc: object) -> None:
        for blocks_list, n in self.lists:
            for i in range(n):
                wrapper = blocks_list[i]
                if isinstance(wrapper, _CachedBlock):
                    blocks_list[i] = wrapper.block

    @contextmanager
    def forward(self, rows: torch.Tensor, halves: int) -> Iterator[None]:
        """Around the forward of this depth's `rows` (n,), each `halves` times (2 under CFG: [unconditional;
        conditional]): gather their parents' cache before it, keep theirs after it."""
        self._inputs, self._active = None, True
        if self._parents is not None and self._parent_row is not None:
            parents = self._parent_row[rows.cpu()]  # (n,) rows of the previous depth
            count = self._parents.head_residual.shape[0] // halves  # previous depth's rows
            index = (torch.arange(halves)[:, None] * count + parents[None, :]).reshape(-1)  # (halves · n,) half-major
            self._inputs = self._parents.rows(index.to(self._parents.head_residual.device))
        self.forwards += 1
        try:
            yield
        finally:
            self._active = False
        if self._inputs is None:
            raise RuntimeError("sampling.block_cache: the forward did not pass through the denoiser's first block")
        self._level.append((rows.cpu(), self._inputs))
        self._head_out, self._skip = None, False

    def next_level(self, parent_row: torch.Tensor) -> None:
        """The next depth's rows are children: `parent_row` (n_next,) holds each one's parent's row in this depth."""
        forwards, self._parents, self._level = self._level, None, []  # (the previous depth's cache goes before this one is joined)
        if not len(parent_row):  # a sub-tree that ends here: nothing forwards from it
            return
        rows = torch.cat([r for r, _ in forwards])  # (Σ n,) `exact` padding repeats a row: its copies hold the same values
        count = int(rows.max()) + 1
        if len(rows.unique()) != count:
            raise RuntimeError("sampling.block_cache: a depth's rows were not all computed before the next depth")
        position = torch.empty(count, dtype=torch.long)
        position[rows] = torch.arange(len(rows))  # each row's place among the forwards' rows

        def joined(tensors: list[torch.Tensor]) -> torch.Tensor:  # (halves · n, ...) each → (halves · count, ...), half-major, in row order
            halves = [t.unflatten(0, (-1, len(r))) for t, (r, _) in zip(tensors, forwards)]  # (halves, n, ...)
            return torch.cat(halves, 1)[:, position.to(tensors[0].device)].flatten(0, 1)

        caches = [c for _, c in forwards]
        encoders = [c.tail_encoder for c in caches if c.tail_encoder is not None]
        self._parents = Cached(joined([c.head_residual for c in caches]), joined([c.tail_hidden for c in caches]),
                               joined(encoders) if len(encoders) == len(caches) else None)
        self._parent_row = parent_row.cpu()

    def head(self, hidden_in: torch.Tensor, output: Any, meta: Any) -> Any:
        """The first block's hook: decide, and return either its output or the output with the rest's cached residual."""
        hidden_out, encoder_out = _streams(output, meta)
        residual = hidden_out - hidden_in
        cached = self._inputs
        if cached is not None and cached.head_residual.shape != residual.shape:
            raise RuntimeError(f"sampling.block_cache: the first block saw {tuple(residual.shape)} where the cache holds "
                               f"{tuple(cached.head_residual.shape)}: the model's forwards do not keep one row and sequence length "
                               "per node; set sampling.block_cache=0")
        if cached is not None:
            change = (residual - cached.head_residual).abs().mean() / cached.head_residual.abs().mean()
            self._skip = bool(change < self.threshold)
        if self._skip:
            assert cached is not None
            self.skipped += 1
            encoder = encoder_out if encoder_out is None or cached.tail_encoder is None else encoder_out + cached.tail_encoder
            return _with_streams(output, meta, hidden_out + cached.tail_hidden, encoder)
        self._inputs = Cached(residual, torch.zeros_like(hidden_out), None)  # the tail block fills in its residuals
        self._head_out = (hidden_out, encoder_out)
        return output

    def tail(self, output: Any, meta: Any) -> None:
        """The last block's hook, in a forward computed in full: cache the residual of the blocks after the first."""
        assert self._inputs is not None and self._head_out is not None
        hidden_out, encoder_out = _streams(output, meta)
        head_hidden, head_encoder = self._head_out
        if encoder_out is None and hidden_out.shape[1] > head_hidden.shape[1]:
            # FLUX.2 joins the streams, [text; image], before its single-stream blocks: the image tokens are the last ones
            hidden_out = hidden_out[:, -head_hidden.shape[1] :]
        encoder = None if encoder_out is None or head_encoder is None else encoder_out - head_encoder
        self._inputs = Cached(self._inputs.head_residual, hidden_out - head_hidden, encoder)


def _streams(output: Any, meta: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(hidden states, text stream or None) of a block's output, by diffusers' metadata of the block."""
    if not isinstance(output, tuple):
        return output, None
    encoder = None if meta.return_encoder_hidden_states_index is None else output[meta.return_encoder_hidden_states_index]
    return output[meta.return_hidden_states_index], encoder


def _with_streams(like: Any, meta: Any, hidden: torch.Tensor, encoder: torch.Tensor | None) -> Any:
    """A block output in the layout of `like` holding `hidden` and `encoder`."""
    if not isinstance(like, tuple):
        return hidden
    out = list(like)
    out[meta.return_hidden_states_index] = hidden
    if meta.return_encoder_hidden_states_index is not None:
        out[meta.return_encoder_hidden_states_index] = encoder
    return tuple(out)


class _CachedBlock(torch.nn.Module):
    """A block as the cache runs it (only inside `BlockCache`'s context): the first always, the others unless skipped."""

    def __init__(self, block: torch.nn.Module, cache: BlockCache, role: str) -> None:
        super().__init__()
        self.block, self.role, self.meta, self.cache = block, role, _block_metadata(block), cache

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        cache = self.cache
        if not cache._active:
            return self.block(*args, **kwargs)
        if self.role != "head" and cache._skip:  # passed through: the head's output already holds the rest's residual
            hidden = self.meta._get_parameter_from_args_kwargs(self.meta.hidden_states_argument_name, args, kwargs)
            if self.meta.return_encoder_hidden_states_index is None:
                return hidden
            encoder = self.meta._get_parameter_from_args_kwargs(self.meta.encoder_hidden_states_argument_name, args, kwargs)
            return _with_streams((None, None), self.meta, hidden, encoder)
        output = self.block(*args, **kwargs)
        if self.role == "head":
            hidden_in = self.meta._get_parameter_from_args_kwargs(self.meta.hidden_states_argument_name, args, kwargs)
            return cache.head(hidden_in, output, self.meta)
        if self.role == "tail":
            cache.tail(output, self.meta)
        return output
