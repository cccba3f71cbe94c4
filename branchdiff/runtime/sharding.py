"""FSDP2: the denoiser sharded across processes (`torch.distributed.fsdp.fully_shard`), for models
whose weights, gradients and optimizer state do not fit one device (docs/sharding.md).

Turned on by the launcher: `accelerate launch --config_file $(branchdiff accelerate-config fsdp)`
(or `--use_fsdp --fsdp_version 2`, or `ACCELERATE_USE_FSDP=true` under torchrun) sets accelerate's
FSDP variables, which `ShardingSettings.from_environment` reads. branchdiff shards the denoiser
itself, the same way on GPUs and on CPUs (gloo), so every part of a run knows the sharded module:
- the wrap: every block of the denoiser's top-level `ModuleList`s (transformer blocks, UNet down and
  up blocks; each expert's, for Wan 2.2's two trained together) is one FSDP unit, the rest of the network the root unit; LoRA's layers live inside
  their blocks. `fsdp_offload_params` keeps the shards (and the optimizer's step) on the CPU;
  `fsdp_reshard_after_forward` is honoured for the blocks; accelerate's wrap policy and FSDP1 settings
  are not read. The module may wait in host memory: `fully_shard` moves each unit to the device.
- every forward of a sharded module gathers its weights from the other processes, so the
  processes must make the same forwards in the same order (lockstep): the engine agrees on the
  number of forwards of every batch (`Lockstep`), the update loop pads optimizer steps with zero
  losses, evaluation pads each process's share of the prompts.
- checkpoints and exports hold full tensors, gathered to the main process (`full_state`,
  `full_tensor`), the same files as without sharding (plus the optimizer's gathered state,
  `OPTIMIZER_FILE`); a resume loads them on every process and shards them again (`load_full_state`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from branchdiff.errors import UserError

OPTIMIZER_FILE = "optimizer-full.pt"  # a sharded run's optimizer state, gathered (tensors only: read with weights_only=True)
TRUE = ("true", "1", "yes")


@dataclass(frozen=True)
class ShardingSettings:
    enabled: bool = False  # FSDP2 over the denoiser
    offload: bool = False  # shards (and the optimizer step) on the CPU
    reshard_after_forward: bool = True  # free gathered weights after each unit's forward (False: keep them until backward)

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] = os.environ) -> ShardingSettings:
        """accelerate's FSDP variables (what `accelerate launch` sets from an FSDP config or `--use_fsdp`)."""
        if environ.get("ACCELERATE_USE_FSDP", "false").lower() not in TRUE:
            return cls()
        version = environ.get("FSDP_VERSION", "1")
        if version != "2":
            raise UserError(f"FSDP version {version} is set (accelerate's fsdp_version / FSDP_VERSION); branchdiff shards with FSDP2: "
                            "set fsdp_version: 2 in the accelerate config, or use $(branchdiff accelerate-config fsdp)")
        reshard = environ.get("FSDP_RESHARD_AFTER_FORWARD", "true").lower()
        return cls(True, environ.get("FSDP_OFFLOAD_PARAMS", "false").lower() in TRUE, reshard not in ("false", "0", "no_reshard"))


def process_group_backend(settings: ShardingSettings, cuda: bool) -> str | None:
    """The process group's backend for a run on GPUs: sharded, "cuda:nccl,cpu:gloo", since an offloaded
    shard, its gradient and the gathered state of a checkpoint are CPU tensors whose collectives NCCL
    cannot run (accelerate chooses the same for its own offloaded FSDP); else None (accelerate's choice:
    NCCL on GPUs, gloo on CPUs)."""
    return "cuda:nccl,cpu:gloo" if settings.enabled and cuda else None


@contextmanager
def accelerate_without_fsdp() -> Iterator[None]:
    """accelerate's own FSDP integration held off while an `Accelerator` is made: branchdiff shards the
    denoiser itself (module doc), so accelerate runs its plain multi-process mode (processes, devices,
    mixed precision, gathers) on every device."""
    before = os.environ.get("ACCELERATE_USE_FSDP")
    os.environ["ACCELERATE_USE_FSDP"] = "false"
    try:
        yield
    finally:
        if before is None:
            del os.environ["ACCELERATE_USE_FSDP"]
        else:
            os.environ["ACCELERATE_USE_FSDP"] = before


def blocks(module: nn.Module) -> list[nn.Module]:
    """The FSDP units below the root: every element of the module's top-level `ModuleList`s; of a
    module made of several denoisers (`denoisers` names them: Wan 2.2's two experts), theirs."""
    denoisers: tuple[str, ...] = getattr(module, "denoisers", ())
    if denoisers:
        return [block for name in denoisers for block in blocks(getattr(module, name))]
    return [block for child in module.children() if isinstance(child, nn.ModuleList) for block in child]


def shard(module: nn.Module, settings: ShardingSettings) -> nn.Module:
    """`fully_shard` each of `blocks(module)`, then the root; in place (the module's parameters
    become DTensors, one shard on each process). Returns the module."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    policy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if settings.offload else OffloadPolicy()
    for block in blocks(module):
        fully_shard(block, offload_policy=policy, reshard_after_forward=settings.reshard_after_forward)
    fully_shard(module, offload_policy=policy)
    return module


def is_sharded(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def plain_class(module: nn.Module) -> type[nn.Module]:
    """The module's own class (`fully_shard` gives a sharded module a subclass named FSDP<class>)."""
    from torch.distributed.fsdp import FSDPModule

    if not is_sharded(module):
        return type(module)
    return next(cls for cls in type(module).__mro__ if issubclass(cls, nn.Module) and not issubclass(cls, FSDPModule))


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor (an all-gather: every process calls it, in the same order), else the tensor."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def shard_like(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`full` placed as `like` is: this process's shard of it when `like` is a DTensor (every process
    holds `full`), else `full` on like's device and dtype."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    full = full.to(like.device if not isinstance(like, DTensor) else like.to_local().device, like.dtype)
    if isinstance(like, DTensor):
        return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)
    return full


def full_state(module: nn.Module, keep: Callable[[str], bool] = lambda name: True) -> dict[str, torch.Tensor]:
    """The module's state-dict tensors whose name `keep` accepts, whole, detached, on the CPU when
    sharded (gathered one at a time; every process calls it and gets them)."""
    return {name: full_tensor(tensor.detach()).cpu() if is_sharded(module) else tensor.detach()
            for name, tensor in module.state_dict().items() if keep(name)}


@torch.no_grad()
def load_full_state(module: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Whole tensors into the module's parameters and persistent buffers of the same names (a subset
    is fine), each process keeping its shard of a sharded module."""
    current = module.state_dict()
    unknown = sorted(set(state) - set(current))
    if unknown:
        raise KeyError(f"{len(unknown)} tensors are not the module's (e.g. {unknown[0]})")
    for name, full in state.items():
        current[name].copy_(shard_like(full, current[name]))


def optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's state with whole tensors, on the main process (empty elsewhere); every process calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(module, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def save_optimizer(state: dict, folder: Path) -> None:
    """`optimizer_state`'s result as `folder/OPTIMIZER_FILE` (tensors, numbers and lists: read back without
    unpickling code); `folder` is a checkpoint's staging folder, published whole or not at all."""
    torch.save(state, folder / OPTIMIZER_FILE)


def load_optimizer(module: nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    """The optimizer state `save_optimizer` wrote, read on every process and sharded like the parameters."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    path = folder / OPTIMIZER_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: the checkpoint was not written by a sharded (FSDP) run")
    state = torch.load(path, map_location="cpu", weights_only=True)
    set_optimizer_state_dict(module, optimizer, optim_state_dict=state, options=StateDictOptions(full_state_dict=True))


class Lockstep:
    """Agreement on a number of forwards with the other processes (the largest count wins): a sharded
    module's forward is a collective, so a process with fewer forwards of a batch makes padding ones."""

    def __init__(self, collective) -> None:
        self.collective = collective

    def __call__(self, count: int) -> int:
        return int(self.collective.max(torch.tensor([count])).item())
