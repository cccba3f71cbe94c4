"""LoRA on a diffusers denoiser through diffusers' peft integration, saved in the format that the
family's `pipeline.load_lora_weights()` loads (the adapter names the pipeline class and prefix)."""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import torch
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict
from safetensors.torch import load_file

from branchdiff.runtime import sharding, storage

LORA_FILE = "pytorch_lora_weights.safetensors"


def pipeline_class(name: str) -> type[Any]:
    """The diffusers pipeline class `name` (e.g. "FluxPipeline"), imported lazily."""
    import diffusers

    return getattr(diffusers, name)


def add_lora(denoiser: torch.nn.Module, target_modules: list[str] | str, rank: int, alpha: float, seed: int,
             unused: Sequence[str] = ()) -> list[torch.nn.Parameter]:
    """Attach a trainable LoRA adapter (B = 0, so the model is unchanged at first) and freeze the
    rest; modules named in `unused` (their output never reaches the prediction) get none. The LoRA
    parameters are float32 whatever the base weights' dtype. Returns them."""
    denoiser.requires_grad_(False)
    torch.manual_seed(seed)
    excluded = [name for name in unused if _targeted(name, target_modules)]
    exclusion: dict[str, Any] = {"exclude_modules": excluded} if excluded else {}
    # peft types lora_alpha an int; a float scales alike (alpha / r)
    config = LoraConfig(r=rank, lora_alpha=alpha, init_lora_weights="gaussian", target_modules=target_modules, **exclusion)  # type: ignore[arg-type]
    cast(Any, denoiser).add_adapter(config)  # diffusers' PeftAdapterMixin
    params = [p for n, p in denoiser.named_parameters() if "lora_" in n]
    for p in params:
        p.data = p.data.float()
        p.requires_grad_(True)
    return params


def _targeted(name: str, target_modules: list[str] | str) -> bool:
    """Whether peft wraps the Linear `name` for `target_modules` (a list matches a name or its end after a dot)."""
    return target_modules == "all-linear" or any(name == target or name.endswith(f".{target}") for target in target_modules)


def save_lora(denoiser: torch.nn.Module, directory: Path, pipeline_class_name: str, prefix: str,
              state: dict[str, torch.Tensor] | None = None) -> Path:
    """Write the adapter as `pytorch_lora_weights.safetensors` with diffusers' `<prefix>.` keys and
    the adapter's config as its metadata: without it diffusers assumes lora_alpha = rank, and a LoRA
    with another alpha would load at the wrong scale. The same weights give the same bytes. `state`:
    the LoRA tensors by their name in the denoiser (gathered from a sharded one), else the denoiser's own."""
    directory.mkdir(parents=True, exist_ok=True)
    # sets (target_modules) in sorted order: the file's bytes must not depend on PYTHONHASHSEED
    metadata = {key: sorted(value) if isinstance(value, (set, frozenset)) else value
                for key, value in cast(Any, denoiser).peft_config["default"].to_dict().items()}
    pipeline_class(pipeline_class_name).save_lora_weights(
        directory, **{f"{prefix}_lora_layers": get_peft_model_state_dict(denoiser, state_dict=state), f"{prefix}_lora_adapter_metadata": metadata}
    )
    canonical_header(directory / LORA_FILE)
    return directory / LORA_FILE


def canonical_header(file: Path) -> None:
    """Rewrite a safetensors file's JSON header with its `__metadata__` keys in sorted order:
    safetensors writes them in the order of a hash map whose seed changes from process to process,
    so the same tensors and metadata would give different bytes. The tensor data is kept as it is
    (its offsets count from the end of the header, whatever the header's length)."""
    data = file.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    if "__metadata__" in header:
        header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)  # the format pads the header to a multiple of 8 bytes
    storage.write_bytes(file, struct.pack("<Q", len(text)) + text + data[8 + length :])


def load_lora(denoiser: torch.nn.Module, path: str | Path, pipeline_class_name: str, prefix: str) -> None:
    """Load a LoRA saved by `save_lora` (a directory or the .safetensors file) into the denoiser the
    way `pipe.load_lora_weights()` does: the pipeline's `lora_state_dict` reads the adapter config
    from the file's metadata, which `load_lora_adapter` applies (given a path instead, the
    model-level loader would ignore it and assume lora_alpha = rank)."""
    path = Path(path)
    file = path / LORA_FILE if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"no LoRA weights at {file}; pass a run's lora/ directory or its {LORA_FILE}")
    *state, metadata = pipeline_class(pipeline_class_name).lora_state_dict(str(file), return_lora_metadata=True)
    if not any(key.startswith(prefix + ".") and "lora" in key for key in state[0]):  # the pipeline would load nothing, silently
        keys = sorted(state[0])
        holds = f"{len(keys)} tensors, e.g. {keys[0]!r}" if keys else "no tensors"
        raise ValueError(f"{file} holds no LoRA for this model's {prefix} (keys '{prefix}.*lora*' as {pipeline_class_name}.load_lora_weights "
                         f"reads them); it holds {holds}; pass a LoRA exported by branchdiff train or saved by save_lora_weights")
    cast(Any, denoiser).load_lora_adapter(state[0], prefix=prefix, metadata=metadata)  # diffusers' PeftAdapterMixin


def load_lora_state(denoiser: torch.nn.Module, directory: Path, prefix: str) -> None:
    """Restore the weights of the adapter `add_lora` attached, from a `save_lora` directory
    (checkpoint resume: the adapter exists, only its values change; a sharded denoiser keeps its shards)."""
    start = prefix + "."
    state = {k[len(start) :]: v for k, v in load_file(directory / LORA_FILE).items() if k.startswith(start)}
    names = {name.replace(".default.", "."): name for name in denoiser.state_dict() if "lora_" in name}  # export name → module name
    expected = set(names)
    if set(state) != expected:
        missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
        raise ValueError(f"{directory / LORA_FILE} does not match the model's LoRA: {len(missing)} of its {len(expected)} tensors missing"
                         f"{f' (e.g. {missing[0]})' if missing else ''}, {len(unexpected)} unexpected"
                         f"{f' (e.g. {unexpected[0]})' if unexpected else ''}")
    sharding.load_full_state(denoiser, {names[key]: value for key, value in state.items()})
