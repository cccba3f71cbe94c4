"""What a run trains: a LoRA adapter on the denoiser (`model.finetune: lora`, the default) or every
parameter of the denoiser (`model.finetune: full`). A `Finetune` answers everything that differs:

|                        | `LoraFinetune`                                  | `FullFinetune`                                      |
|------------------------|-------------------------------------------------|-----------------------------------------------------|
| trained parameters     | the adapter's, float32 over any base dtype      | all of the denoiser's (float32 weights)             |
| the base model         | the same network with the adapter disabled      | a frozen copy taken before training (one more       |
| (KL reference, base    | (no memory)                                     | denoiser in memory, only when train.kl_beta > 0 or  |
| evaluation)            |                                                 | final_eval)                                         |
| checkpoint             | `pytorch_lora_weights.safetensors`              | `denoiser.safetensors` (every weight)               |
| under FSDP             | the adapter's layers sharded with their blocks  | the denoiser and the frozen copy sharded            |
| export                 | RUN/lora, for `pipe.load_lora_weights()`        | RUN/<transformer or unet>, a diffusers folder for   |
|                        |                                                 | `<DenoiserClass>.from_pretrained` (then the family's|
|                        |                                                 | pipeline: `from_pretrained(base, transformer=...)`) |

LoRA wraps the modules of `model.lora_targets`: a named set of the family (`attention`,
`attention+ff`, `all-linear`; docs/models.md) or a list of module-name patterns.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import torch
from safetensors.torch import load_file, save_file

from branchdiff.models.base import ModelAdapter
from branchdiff.models.lora import LORA_FILE, add_lora, canonical_header
from branchdiff.runtime import sharding, storage
from branchdiff.runtime.sharding import Lockstep, ShardingSettings

FULL_WEIGHTS = "denoiser.safetensors"  # a full fine-tuning checkpoint's weights


class LoraFinetune:
    """A LoRA adapter on the denoiser: the base weights stay frozen."""

    def __init__(self, adapter: ModelAdapter, targets: str | list[str], rank: int, alpha: float, seed: int) -> None:
        self.adapter = adapter
        self.params = add_lora(adapter.denoiser, adapter.lora_targets(targets), rank, alpha, seed, adapter.unused_modules())
        self.export_name = "lora"

    def shard(self, settings: ShardingSettings, lockstep: Lockstep) -> None:
        """FSDP2 over the denoiser, LoRA inside its blocks (branchdiff/runtime/sharding.py); `params` become the
        shards and the adapter's forwards agree in number with the other processes' (`lockstep`)."""
        sharding.shard(self.adapter.denoiser, settings)
        self.adapter.lockstep = lockstep
        self.params = [p for p in self.adapter.denoiser.parameters() if p.requires_grad]

    @contextmanager
    def base(self) -> Iterator[ModelAdapter]:
        """The base model: the same adapter with its LoRA disabled for the block."""
        denoiser = cast(Any, self.adapter.denoiser)  # diffusers' PeftAdapterMixin
        denoiser.disable_adapters()
        try:
            yield self.adapter
        finally:
            denoiser.enable_adapters()

    def trained_state(self) -> dict[str, torch.Tensor]:
        """The LoRA tensors by their name in the denoiser, whole (every process calls it: sharded ones are gathered)."""
        return sharding.full_state(self.adapter.denoiser, lambda name: "lora_" in name)

    def write_state(self, state: dict[str, torch.Tensor], folder: Path) -> None:
        """A checkpoint's LoRA: the export's file, which `pipe.load_lora_weights()` also reads."""
        self.write_export(state, folder)

    def load_state(self, folder: Path) -> None:
        self.adapter.load_lora_state(folder)

    def write_export(self, state: dict[str, torch.Tensor], folder: Path) -> None:
        """The LoRA as `pipe.load_lora_weights()` reads it."""
        self.adapter.save_lora(folder, state)


class FullFinetune:
    """Every parameter of the denoiser is trained (but those of `unused_modules`, which no gradient reaches); the
    base model is a frozen copy (when needed)."""

    def __init__(self, adapter: ModelAdapter, keep_base: bool) -> None:
        self.adapter = adapter
        adapter.denoiser.requires_grad_(True)
        for name in adapter.unused_modules():  # no gradient ever reaches them
            adapter.denoiser.get_submodule(name).requires_grad_(False)
        self.params = [p for p in adapter.denoiser.parameters() if p.requires_grad]
        self.export_name = adapter.denoiser_name
        self._base = None
        if keep_base:  # taken before any update (and before a checkpoint is loaded)
            self._base = copy.copy(adapter)
            self._base.denoiser = copy.deepcopy(adapter.denoiser).requires_grad_(False).eval()

    def shard(self, settings: ShardingSettings, lockstep: Lockstep) -> None:
        """FSDP2 over the denoiser and over the frozen copy (branchdiff/runtime/sharding.py); `params` become the
        shards and both adapters' forwards agree in number with the other processes' (`lockstep`)."""
        sharding.shard(self.adapter.denoiser, settings)
        self.adapter.lockstep = lockstep
        if self._base is not None:
            sharding.shard(self._base.denoiser, settings)
            self._base.lockstep = lockstep
        self.params = [p for p in self.adapter.denoiser.parameters() if p.requires_grad]

    @contextmanager
    def base(self) -> Iterator[ModelAdapter]:
        """The base model: the frozen copy."""
        if self._base is None:
            raise RuntimeError("model.finetune=full keeps the base model only when train.kl_beta > 0, final_eval is true or the objective compares with it")
        yield self._base

    def trained_state(self) -> dict[str, torch.Tensor]:
        """Every weight of the denoiser (its state dict), whole (every process calls it: sharded ones are gathered)."""
        return sharding.full_state(self.adapter.denoiser)

    def write_state(self, state: dict[str, torch.Tensor], folder: Path) -> None:
        save_file({k: v.contiguous() for k, v in state.items()}, folder / FULL_WEIGHTS)

    def load_state(self, folder: Path) -> None:
        load_full_state(self.adapter.denoiser, folder)

    def write_export(self, state: dict[str, torch.Tensor], folder: Path) -> None:
        """A diffusers folder of the denoiser (config.json and safetensors weights). A sharded denoiser is
        written through an unsharded instance of its class holding `state` (made on the meta device: no
        second copy of the weights), so the folder is the one an unsharded run writes."""
        denoiser: Any = self.adapter.denoiser  # a diffusers model: its config, from_config and save_pretrained
        if sharding.is_sharded(denoiser):
            with torch.device("meta"):
                denoiser = cast(Any, sharding.plain_class(denoiser)).from_config(denoiser.config)
            denoiser.load_state_dict(state, assign=True)
        denoiser.save_pretrained(folder, safe_serialization=True)
        for weights in folder.glob("*.safetensors"):
            canonical_header(weights)


def load_full_state(denoiser: torch.nn.Module, folder: Path) -> None:
    """Every weight of `denoiser` from a full fine-tuning checkpoint; refused unless it holds exactly them."""
    state = load_file(folder / FULL_WEIGHTS)
    expected = denoiser.state_dict().keys()
    if state.keys() != expected:
        missing = sorted(expected - state.keys())
        raise ValueError(f"{folder / FULL_WEIGHTS} does not match the denoiser: {len(missing)} of its {len(expected)} tensors missing"
                         f"{f' (e.g. {missing[0]})' if missing else ''}, {len(state.keys() - expected)} unexpected")
    sharding.load_full_state(denoiser, state)


def make_finetune(adapter: ModelAdapter, finetune: str, targets: str | list[str], rank: int, alpha: float, seed: int,
                  keep_base: bool) -> LoraFinetune | FullFinetune:
    """The config's `model.finetune` for this adapter (module doc)."""
    if finetune == "full":
        return FullFinetune(adapter, keep_base)
    return LoraFinetune(adapter, targets, rank, alpha, seed)


def export(finetune: LoraFinetune | FullFinetune, run_dir: Path, write: bool = True) -> Path:
    """Write the run's result into RUN/<export_name>, whole or not at all. Every process calls it
    (a sharded denoiser's weights are gathered); only those with `write` (the main one) write."""
    state = finetune.trained_state()
    if write:
        storage.replace_folder(run_dir / finetune.export_name, lambda folder: finetune.write_export(state, folder))
    return run_dir / finetune.export_name


def locate_weights(path: str | Path, denoiser_name: str) -> tuple[str, Path]:
    """What a run trained, found from any of the places it is, without loading anything: the run
    folder (its export), a LoRA (`lora/` or its .safetensors, as `pipe.load_lora_weights` reads it), a
    fully fine-tuned denoiser's folder (`transformer/`, `unet/`), or a checkpoint folder (`iter-N`).
    Returns ("full-checkpoint" | "denoiser" | "lora", the path to load); nothing there raises one line."""
    path = Path(path)
    if path.is_dir() and (path / "config.yaml").is_file():  # a run folder: its export
        exported = [path / "lora", path / denoiser_name]
        path = next((p for p in exported if p.is_dir()), path)
    if path.is_dir() and (path / FULL_WEIGHTS).is_file():
        return "full-checkpoint", path
    if path.is_dir() and (path / "config.json").is_file():
        return "denoiser", path
    if (path.suffix == ".safetensors" and path.is_file()) or (path / LORA_FILE).is_file():
        return "lora", path
    raise FileNotFoundError(f"no LoRA or fine-tuned denoiser at {path}; pass a run folder, its lora/ or {denoiser_name}/ "
                            f"folder, a {LORA_FILE}, or a checkpoint folder (iter-N)")


def load_weights(adapter: ModelAdapter, path: str | Path) -> None:
    """Load what a run trained into `adapter` (`locate_weights` finds it)."""
    kind, found = locate_weights(path, adapter.denoiser_name)
    if kind == "full-checkpoint":
        load_full_state(adapter.denoiser, found)
    elif kind == "denoiser":
        adapter.load_denoiser(found)
    else:
        adapter.load_lora(found)
