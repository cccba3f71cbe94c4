"""RUN/README.md: the run's model card in diffusers' LoRA card format (YAML metadata through
`huggingface_hub.ModelCardData`: base model, `library_name: diffusers`, tags, a widget of the newest
sample grid), then how it was trained (preset, family, rewards, objective, iterations), the
held-out evaluation table of eval.json, a sample grid and how to load it. Written at export and
again after the final evaluation, so it exists offline; `branchdiff push` uploads it with the weights.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from branchdiff.report.run_data import read_run, sample_grids
from branchdiff.runtime import storage

CARD = "README.md"
BUILT_IN = ("tiny", "tiny-video")  # branchdiff's own models: no diffusers pipeline loads them


def _hub_id(path: object) -> str | None:
    """`model.path` when it names a hub repository (owner/name), not a local folder."""
    text = str(path or "")
    return text if text.count("/") == 1 and not Path(text).exists() and not text.startswith((".", "/", "~")) else None


def _rewards(value: object) -> str:
    entries = value if isinstance(value, list) else [value]
    names = []
    for entry in entries:
        if isinstance(entry, dict):
            names.append(str(entry.get("name") or entry.get("remote")) + (f" × {entry['weight']:g}" if entry.get("weight", 1) != 1 else ""))
        else:
            names.append(str(entry))
    return ", ".join(names)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("branchdiff-rl")
    except PackageNotFoundError:
        return "(source tree)"


def evaluation_table(evaluation: dict | None) -> str:
    """Base vs trained means (± std) of every held-out score, as markdown; a line when there is none."""
    if not evaluation or "trained" not in evaluation:
        return "No held-out evaluation yet (the run's final evaluation writes eval.json; `branchdiff eval --weights RUN` makes one)."
    models = [m for m in ("base", "trained") if m in evaluation]
    scores = list(evaluation["trained"]["all"])
    lines = ["| score | " + " | ".join(models) + " |", "|---|" + "---|" * len(models)]
    for name in scores:
        cells = [f"{evaluation[m]['all'][name]['mean']:.4f} ± {evaluation[m]['all'][name]['std']:.4f}" for m in models]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    images = evaluation["trained"]["all"][scores[0]]["images"] if scores else 0
    size = evaluation.get("resolution")  # an evaluation at another size than the training's (eval.resolution)
    where = (f", at {size[0]} × {size[1]}" if size else "") + (f", {evaluation['frames']} frames" if evaluation.get("frames") else "")
    return (f"On `{evaluation.get('prompts')}`, {evaluation.get('images_per_prompt')} image(s) per prompt ({images} in all){where}, the same "
            f"noise for both models, after iteration {evaluation.get('after_iteration')}:\n\n" + "\n".join(lines))


def usage(config: dict, export: str, repo: str, denoiser: str | None) -> str:
    """The Python that loads the result: the pipeline with the LoRA, or the fine-tuned denoiser (of diffusers class
    `denoiser`, as its export's config.json names it) in it."""
    from branchdiff.models import FAMILIES, adapter_class

    model = config["model"]
    family = model["family"]
    if family in BUILT_IN:
        return ("```bash\n# branchdiff's built-in model: sample from the run folder with branchdiff\n"
                f"branchdiff sample --weights {repo} --prompt \"a red circle\" --out samples\n```")
    adapter = adapter_class(family)
    base = model.get("path") or "BASE_MODEL"
    pipeline = adapter.pipeline_class_name
    lines = ["```python", "import torch", f"from diffusers import {pipeline}", ""]
    if export == "lora":
        lines += [f'pipe = {pipeline}.from_pretrained("{base}", torch_dtype=torch.bfloat16).to("cuda")']
        if model.get("expert") == "low":  # Wan 2.2's low-noise expert
            lines += [f'pipe.load_lora_weights("{repo}", load_into_transformer_2=True)  # the low-noise expert\'s LoRA']
        else:
            lines += [f'pipe.load_lora_weights("{repo}")']
    else:
        lines[2] = f"from diffusers import {denoiser}, {pipeline}"
        lines += [f'{export} = {denoiser}.from_pretrained("{repo}", subfolder="{export}", torch_dtype=torch.bfloat16)',
                  f'pipe = {pipeline}.from_pretrained("{base}", {export}={export}, torch_dtype=torch.bfloat16).to("cuda")']
    video, call = FAMILIES[family].video, 'pipe("a photo of a red circle")'
    if adapter.edits:  # the prompt's source image: what the pipeline edits, or a video's first frame
        lines[3:3] = ["from diffusers.utils import load_image"]
        call = 'pipe(image=load_image("source.png"), prompt="the red circle rolls to the left")' if video else \
            'pipe(image=load_image("source.png"), prompt="make the circle blue")'
    lines += [("video = " if video else "image = ") + call + (".frames[0]" if video else ".images[0]"), "```"]
    return "\n".join(lines)


def card_text(run_dir: Path, export: str, repo: str | None = None) -> str:
    """The model card of the run in `run_dir` whose weights are in RUN/`export` (`repo`: where it is pushed)."""
    from huggingface_hub import ModelCard, ModelCardData

    run = read_run(run_dir)
    config: dict[str, Any] = run.config or {}
    model, train = config.get("model", {}), config.get("train", {})
    family = model.get("family", "unknown")
    base = _hub_id(model.get("path"))
    held_out, training = sample_grids(run_dir)
    grid = (held_out or training or [None])[-1]
    widget = [{"text": "sample grid", "output": {"url": f"samples/{grid[1].name}"}}] if grid else None
    from branchdiff.models import FAMILIES, adapter_class

    spec = FAMILIES.get(family)
    kind = "text-to-image" if spec is None or not spec.video else "image-to-video" if adapter_class(family).edits else "text-to-video"
    tags = [kind, "diffusers", "diffusers-training", "branchdiff",
            "grpo", *(["lora", "template:sd-lora"] if export == "lora" else [])]

    license = adapter_class(family).license_of(base) if base and family not in BUILT_IN else None  # the base model's
    data = ModelCardData(library_name="diffusers", base_model=base, tags=tags, widget=widget, license=license, pipeline_tag=tags[0])
    objective = train.get("loss", "grpo")
    iterations = int(run.iterations[-1]) + 1 if len(run.iterations) else 0
    trained = "every weight of the denoiser"
    if export == "lora":
        trained = f"a LoRA adapter (rank {train.get('lora_rank')}, alpha {train.get('lora_alpha')}) on the {model.get('lora_targets')} modules"
    lines = [
        f"# {run_dir.name}: {family} fine-tuned with GRPO on branching SDE trees (branchdiff)",
        "",
        f"{'A LoRA for' if export == 'lora' else 'A fine-tuned denoiser of'} `{model.get('path') or 'the built-in ' + family + ' model'}`, trained with "
        f"branchdiff {_version()}: group-relative policy optimisation over trees of denoising trajectories.",
        "",
        "## How it was trained",
        "",
        f"- family: `{family}`, resolution {model.get('resolution') or 'the family default'}"
        + (f", {model.get('frames')} frames" if model.get("frames") else ""),
        f"- what trained: {trained}",
        f"- reward: {_rewards(config.get('reward'))}",
        f"- objective: `{objective}`, learning rate {train.get('learning_rate')}, {iterations} iterations of "
        f"{config.get('prompts', {}).get('per_iteration')} prompts per process",
        f"- sampling: {config.get('sampling', {}).get('num_steps')} steps, tree roots {config.get('tree', {}).get('roots')}, "
        f"splits {config.get('tree', {}).get('splits')}",
        "- the whole config: `config.yaml` beside this card",
        "",
        "## Held-out evaluation",
        "",
        evaluation_table(run.evaluation),
        "",
    ]
    if grid:
        lines += ["## Samples", "", f"![the newest sample grid](samples/{grid[1].name})", ""]
    saved = run_dir / export / "config.json"  # a full fine-tuning's diffusers folder names its class
    denoiser = json.loads(saved.read_text()).get("_class_name") if export != "lora" and saved.is_file() else None
    lines += ["## How to use it", "", usage(config, export, repo or str(run_dir), denoiser), ""]
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines)))


def write_model_card(run_dir: Path, export: str) -> Path:
    """Write RUN/README.md (whole or not at all); returns its path."""
    path = run_dir / CARD
    storage.write_text(path, card_text(run_dir, export))
    return path
