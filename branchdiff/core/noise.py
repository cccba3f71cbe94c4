"""Addressable noise: every random draw of a rollout is a pure function of its address.

An address is (run seed, iteration, prompt key, node path). A node path is the tuple of child
indices from the root: `(r,)` names root r of a prompt's group, `(r, c1, ..., cd)` the node reached
by taking child c1 at depth 0, ... . The initial noise of a root and the step noise that created a
node are drawn from a CPU generator seeded with a 63-bit BLAKE2b hash of (tag, address), so any node
(or any subset of leaves with their root paths) can be regenerated alone, bit for bit, in any batch
order, on any process. The draw is made on CPU in float32 and moved to the target device.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

NodePath = tuple[int, ...]


def address_seed(tag: str, run_seed: int, iteration: int, prompt_key: int, path: NodePath) -> int:
    """63-bit seed of an address; `tag` separates initial noise ("init") from step noise ("step")."""
    text = f"{tag}|{run_seed}|{iteration}|{prompt_key}|{','.join(map(str, path))}"
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


def draw(
    tag: str,
    run_seed: int,
    iteration: int,
    prompt_keys: Sequence[int],
    paths: Sequence[NodePath],
    shape: Sequence[int],
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Standard normal noise (N, *shape) for N addresses sharing a run seed and iteration."""
    out = torch.empty((len(paths), *shape), dtype=torch.float32)
    generator = torch.Generator(device="cpu")
    for row, (prompt_key, path) in enumerate(zip(prompt_keys, paths)):
        generator.manual_seed(address_seed(tag, run_seed, iteration, int(prompt_key), tuple(path)))
        torch.randn(tuple(shape), generator=generator, out=out[row])
    return out.to(device)
