"""The settings of `branchdiff sample` and `branchdiff eval`: what the command line gives, else the
settings of the run the LoRA comes from, else the built-in defaults.

Weights of a run (the run folder `RUN`, `RUN/lora`, `RUN/lora/pytorch_lora_weights.safetensors`,
a fully fine-tuned `RUN/transformer`, or a checkpoint `RUN/checkpoints/iter-N`) bring the run's
`config.yaml`: its model (family, path, resolution,
dtype) and its final evaluation's settings (prompts.eval, prompts.eval_seeds, sampling steps and
shift, prompts.eval_guidance, eval_rewards, and eval.resolution / eval.frames where the run evaluated
at another size than it trained at). With those `branchdiff eval --weights RUN`
reproduces the `trained` column of the run's final evaluation (RUN/eval.json) exactly; a setting
given on the command line that differs is named (`differences`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml

EVAL_RUN_SEED = 1234  # the noise seed of every evaluation, in training too (evaluation noise is iteration -1 of it)

@dataclass
class EvalSettings:
    family: str = "tiny"
    model: str | None = None  # None: the built-in tiny model
    resolution: int | list[int] | None = None  # H or [H, W]
    frames: int | None = None  # a video family's frames per video (None: its default)
    expert: str = "high"  # wan: the expert a run trained (its weights load into it)
    guidance_2: float | None = None  # wan, Wan 2.2 A14B: the low-noise expert's guidance (None: `guidance`)
    dtype: str = "float32"
    steps: int = 10
    shift: float | None = None
    guidance: float | None = None
    images_per_prompt: int = 8
    prompts: str = "tiny:held_out"
    rewards: object = "tiny-geneval"  # command-line text, or the config's list form
    seed: int = EVAL_RUN_SEED
    solver: str = "training"  # training: the ODE of the steps branchdiff trains with; release: the sampler the model folder ships
    prompt_instruction: bool = True  # sana: its pipeline's instruction before every prompt
    fit: str = "resize"  # a source image of another aspect ratio than the model's: resize, crop, pad or refuse (branchdiff/data/sources.py)


# a built-in task's family evaluates on that task unless told otherwise (the dataclass defaults are the image task's)
TASK_DEFAULTS = {"tiny-video": {"prompts": "tiny-video:held_out", "rewards": "tiny-video"}}

SOLVERS = ("training", "release")  # the ODE of the steps branchdiff trains with, or the sampler the model folder ships

# settings field → the key of a run's config that holds it (keys joined by "|": the first that is set)
FROM_RUN = {"family": "model.family", "model": "model.path", "resolution": "model.resolution", "frames": "model.frames",
            "expert": "model.expert", "guidance_2": "model.guidance_2", "dtype": "model.dtype", "steps": "sampling.num_steps", "shift": "sampling.shift",
            "guidance": "prompts.eval_guidance", "images_per_prompt": "prompts.eval_seeds", "prompts": "prompts.eval",
            "rewards": "eval_rewards", "prompt_instruction": "model.prompt_instruction", "fit": "sources.fit"}


# `eval` of a run evaluates at the run's evaluation size where it had one (eval.resolution, eval.frames); `sample` and
# `rewards check` make what the run trained on
EVALUATED = {**FROM_RUN, "resolution": "eval.resolution|model.resolution", "frames": "eval.frames|model.frames"}


def eval_keys(message: str) -> str:
    """A size check's message about a run's evaluation size: it names eval.resolution and eval.frames, not the model's keys."""
    return message.replace("model.resolution=", "eval.resolution=", 1).replace("model.frames=", "eval.frames=", 1)


def run_of(weights: str | None) -> Path | None:
    """The run directory a weights path belongs to (the folder holding config.yaml), or None."""
    if not weights:
        return None
    path = Path(weights)
    for folder in (path, *path.parents[:3]):
        if (folder / "config.yaml").is_file() and ((folder / "metrics.jsonl").is_file() or (folder / "checkpoints").is_dir()):
            return folder
    return None


def _get(config: dict, dotted: str) -> Any:
    """The value at `dotted` in `config`; "a.b|c.d": the first of them that is set."""
    for path in dotted.split("|"):
        value: Any = config
        for key in path.split("."):
            value = value.get(key) if isinstance(value, dict) else None
        if value is not None:
            return value
    return None


def resolve(given: dict[str, Any], weights: str | None, evaluation: bool = False) -> tuple[EvalSettings, Path | None, dict]:
    """(settings, the run, its config) from the options `given` (None where unset) and the weights' run; `evaluation`:
    for `eval`, the run's evaluation size (`EVALUATED`)."""
    keys = EVALUATED if evaluation else FROM_RUN
    run = run_of(weights)
    config = yaml.safe_load((run / "config.yaml").read_text()) if run else {}
    config = config if isinstance(config, dict) else {}
    values: dict[str, Any] = {}
    for spec in fields(EvalSettings):
        if given.get(spec.name) is not None:
            values[spec.name] = given[spec.name]
        elif spec.name in keys and _get(config, keys[spec.name]) is not None:
            values[spec.name] = _get(config, keys[spec.name])
    for name, value in TASK_DEFAULTS.get(values.get("family", EvalSettings.family), {}).items():
        values.setdefault(name, value)
    return EvalSettings(**values), run, config


def differences(settings: EvalSettings, config: dict) -> list[str]:
    """The settings that differ from those of the run's final evaluation, e.g. 'images per prompt 4 (run: 8)'."""
    out = []
    for name, key in EVALUATED.items():
        mine, theirs = getattr(settings, name), _get(config, key)
        if name == "rewards" and isinstance(mine, str) and isinstance(theirs, list) and mine == ",".join(map(str, theirs)):
            continue
        if theirs is not None and mine != theirs:
            out.append(f"{name.replace('_', ' ')} {mine} (run: {theirs})")
    if settings.solver != "training":  # a run evaluates with the steps it trains with
        out.append(f"solver {settings.solver} (run: training)")
    return out
