"""What several commands share: the sampling settings of `sample`, `eval` and `rewards check`
(the options given, else the run's, else the defaults), loading the model with a run's weights, a
device check, sample file names, and reading reward names and keyword arguments from the command line."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from branchdiff.models.base import ModelAdapter
    from branchdiff.settings.evaluation import EvalSettings


def sampling_settings(args: argparse.Namespace) -> tuple[EvalSettings, Path | None]:
    """The sampling settings of `sample` / `eval` (branchdiff/settings/evaluation.py): the options given,
    else the LoRA's run's, else the defaults; a line says where they came from and what differs."""
    from branchdiff.settings.evaluation import EvalSettings, differences, resolve

    given = {name: getattr(args, name, None) for name in EvalSettings.__dataclass_fields__}
    settings, run, config = resolve(given, getattr(args, "weights", None), evaluation=args.command == "eval")
    if run is not None:
        differ = differences(settings, config) if args.command == "eval" else []
        note = ("; these differ from the run's final evaluation: " + ", ".join(differ)) if differ else (
            ", as in the run's final evaluation" if args.command == "eval" else "")
        print(f"{args.command}: the settings not given on the command line are the run's, from {run / 'config.yaml'}{note}", file=sys.stderr)
    return settings, run


def check_model(settings: EvalSettings, weights: str | None) -> tuple[int, int]:
    """What `load_model` checks before anything loads (its docstring); returns the (height, width) the model will make."""
    from branchdiff.models import adapter_class, check_frames, check_size
    from branchdiff.models.finetune import locate_weights
    from branchdiff.models.registry import FAMILIES

    adapter_class(settings.family).check_path(settings.model, "--model")
    if not settings.prompt_instruction and not FAMILIES[settings.family].instruction:
        raise ValueError(f"--no-prompt-instruction applies to families whose prompts carry an instruction (sana), not {settings.family}")
    if settings.guidance_2 is not None and not FAMILIES[settings.family].video:
        raise ValueError(f"--guidance-2 {settings.guidance_2:g} is the guidance of Wan 2.2's low-noise expert; the {settings.family} family "
                         "has one denoiser: leave --guidance-2 unset (--guidance is its scale)")
    if settings.guidance_2 is not None and settings.guidance is not None and settings.guidance <= 1:  # Wan guides above 1, as its pipeline
        raise ValueError(f"--guidance-2 {settings.guidance_2:g} is the CFG scale of Wan 2.2's low-noise expert, and --guidance "
                         f"{settings.guidance:g} runs no classifier-free guidance (above 1 guides), so it would be ignored: give --guidance "
                         "above 1, or leave --guidance-2 unset")
    if settings.frames is not None and not FAMILIES[settings.family].video:
        raise ValueError(f"--frames {settings.frames}: the {settings.family} family makes images, not videos; leave --frames unset")
    size = check_size(settings.family, settings.model, settings.resolution)
    check_frames(settings.family, settings.model, settings.frames)
    if weights:
        locate_weights(weights, adapter_class(settings.family).denoiser_name)
    return size


def load_model(settings: EvalSettings, weights: str | None, device: str | object = "cpu") -> ModelAdapter:
    """The model the settings name, with a run's trained weights loaded when given (`finetune.load_weights`).
    What can be checked without loading is checked first: a model path where the family needs one, the
    instruction switch, the image size against the folder's config files, and that `weights` names
    something a run trained. A model
    folder that ships another sampler than the one `--solver training` steps with gets a notice."""
    import torch

    from branchdiff.models import load_adapter
    from branchdiff.models.finetune import load_weights

    check_model(settings, weights)
    adapter = load_adapter(settings.family, settings.model, device, settings.resolution, getattr(torch, settings.dtype),
                           instruction=settings.prompt_instruction, frames=settings.frames, expert=settings.expert,
                           guidance_2=settings.guidance_2)
    if weights:
        load_weights(adapter, weights)
    notice = adapter.solver_notice() if settings.solver == "training" else None
    if notice:
        print(f"note: {notice}", file=sys.stderr)
    return adapter


def check_device(device: str) -> None:
    """Refuse a CUDA device on a machine without one, before anything loads."""
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: no CUDA device is visible here (torch.cuda.is_available() is False); use --device cpu")


def file_name(index: int, prompt: str) -> str:
    """A sample's file name from its index and prompt: letters, digits, '-' and '_' only, ≤ 60 of them."""
    slug = re.sub(r"[^A-Za-z0-9_-]+", "_", prompt).strip("_")[:60] or "prompt"
    return f"{index:03d}-{slug}.png"


def yaml_value(text: str):
    from branchdiff.settings.typed_yaml import parse_override

    return parse_override(f"value={text}")[1]


def reward_kwargs(text: str | None) -> dict:
    """`--kwargs '{checkpoint: /models/HPS_v2.1_compressed.pt}'`: keyword arguments of a reward."""
    value = yaml_value(text) if text else {}
    if not isinstance(value, dict):
        raise ValueError(f"--kwargs {text!r} must be a YAML mapping, e.g. '{{checkpoint: /models/HPS_v2.1_compressed.pt}}'")
    return value


def reward_specs_from_text(text: str) -> list:
    """`--rewards a,b,http://host:port` or the config's form, `'[{name: hpsv2.1, kwargs: {checkpoint: ...}}]'`."""
    from branchdiff.rewards.combine import RewardSpec, parse_reward_specs

    if text.lstrip().startswith(("[", "{")):
        return parse_reward_specs(yaml_value(text))
    names = [name for name in text.split(",") if name]
    specs = parse_reward_specs(names)
    return [RewardSpec(remote=spec.name) if spec.name.startswith(("http://", "https://")) else spec for spec in specs]
