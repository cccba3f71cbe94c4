"""What a run trains: a LoRA adapter on the denoiser (`model.finetune: lora`, the default) or every
parameter of the denoiser (`model.finetune: full`). A `Finetune` answers everything that differs:

|                        | `LoraFinetune`                                  | `FullFinetune`                                      |
|------------------------|-------------------------------------------------|-----------------------------------------------------|
| trained parameters     | the adapter's, float32 over any base dtype      | all of the denoiser's (float32 weights)             |
| the base model         | the same network with the adapter disabled      | a frozen copy taken before training (one more       |
| (KL reference, base    | (no memory)                                     | denoiser in memory, only when train.kl_beta > 0 or  |
| evaluation)            |                                                 | final_eval)                                         |
| checkpoint             | `pytorch_lora_weights.safetensors`              | `denoiser.safetensors` (every weight)               |
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

import torch
from safetensors.torch import load_file, save_file

from branchdiff import storage
from branchdiff.models.base import ModelAdapter
from branchdiff.models.lora import LORA_FILE, add_lora, canonical_header

FULL_WEIGHTS = "denoiser.safetensors"  # a full fine-tuning checkpoint's weights


class LoraFinetune:
    """A LoRA adapter on the denoiser: the base weights stay frozen."""

    def __init__(self, adapter: ModelAdapter, targets: str | list[str], rank: int, alpha: float, seed: int) -> None:
        self.adapter = adapter
        self.params = add_lora(adapter.denoiser, adapter.lora_targets(targets), rank, alpha, seed)
        self.export_name = "lora"

    @contextmanager
    def base(self) -> Iterator[ModelAdapter]:
        """The base model: the same adapter with its LoRA disabled for the block."""
        self.adapter.denoiser.disable_adapters()
        try:
            yield self.adapter
        finally:
            self.adapter.denoiser.enable_adapters()

    def save_state(self, denoiser: torch.nn.Module, folder: Path) -> None:
        self.adapter.save_lora(folder, denoiser)

    def load_state(self, denoiser: torch.nn.Module, folder: Path) -> None:
        self.adapter.load_lora_state(folder, denoiser)

    def export(self, folder: Path) -> None:
        """The LoRA as `pipe.load_lora_weights()` reads it."""
        self.adapter.save_lora(folder)


class FullFinetune:
    """Every parameter of the denoiser is trained; the base model is a frozen copy (when needed)."""

    def __init__(self, adapter: ModelAdapter, keep_base: bool) -> None:
        self.adapter = adapter
        adapter.denoiser.requires_grad_(True)
        self.params = list(adapter.denoiser.parameters())
        self.export_name = adapter.denoiser_name
        self._base = None
        if keep_base:  # taken before any update (and before a checkpoint is loaded)
            self._base = copy.copy(adapter)
            self._base.denoiser = copy.deepcopy(adapter.denoiser).requires_grad_(False).eval()

    @contextmanager
    def base(self) -> Iterator[ModelAdapter]:
        """The base model: the frozen copy."""
        if self._base is None:
            raise RuntimeError("model.finetune=full keeps the base model only when train.kl_beta > 0 or final_eval is true")
        yield self._base

    def save_state(self, denoiser: torch.nn.Module, folder: Path) -> None:
        save_file({k: v.detach().contiguous() for k, v in denoiser.state_dict().items()}, folder / FULL_WEIGHTS)

    def load_state(self, denoiser: torch.nn.Module, folder: Path) -> None:
        load_full_state(denoiser, folder)

    def export(self, folder: Path) -> None:
        """A diffusers folder of the denoiser (config.json and safetensors weights)."""
        self.adapter.denoiser.save_pretrained(folder, safe_serialization=True)
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
    denoiser.load_state_dict(state)


def make_finetune(adapter: ModelAdapter, finetune: str, targets: str | list[str], rank: int, alpha: float, seed: int,
                  keep_base: bool) -> LoraFinetune | FullFinetune:
    """The config's `model.finetune` for this adapter (module doc)."""
    if finetune == "full":
        return FullFinetune(adapter, keep_base)
    return LoraFinetune(adapter, targets, rank, alpha, seed)


def export(finetune: LoraFinetune | FullFinetune, run_dir: Path) -> Path:
    """Write the run's result into RUN/<export_name>, whole or not at all."""
    return storage.replace_folder(run_dir / finetune.export_name, finetune.export)


def load_weights(adapter: ModelAdapter, path: str | Path) -> None:
    """Load what a run trained into `adapter`, from any of the places it is: the run folder (its
    export), a LoRA (`lora/` or its .safetensors, as `pipe.load_lora_weights` reads it), a fully
    fine-tuned denoiser's folder (`transformer/`, `unet/`), or a checkpoint folder (`iter-N`)."""
    path = Path(path)
    if path.is_dir() and (path / "config.yaml").is_file():  # a run folder: its export
        exported = [path / "lora", path / adapter.denoiser_name]
        path = next((p for p in exported if p.is_dir()), path)
    if path.is_dir() and (path / FULL_WEIGHTS).is_file():  # a full fine-tuning checkpoint
        load_full_state(adapter.denoiser, path)
    elif path.is_dir() and (path / "config.json").is_file():  # an exported denoiser
        adapter.load_denoiser(path)
    elif path.suffix == ".safetensors" or (path / LORA_FILE).is_file():
        adapter.load_lora(path)
    else:
        raise FileNotFoundError(f"no LoRA or fine-tuned denoiser at {path}; pass a run folder, its lora/ or {adapter.denoiser_name}/ "
                                f"folder, a {LORA_FILE}, or a checkpoint folder (iter-N)")
