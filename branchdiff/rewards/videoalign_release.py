"""VideoReward's published checkpoint (VideoAlign, Liu et al. 2025, arXiv 2501.13918) turned into the
`videoalign` reward's folder: `branchdiff rewards convert videoalign SRC DST` (docs/rewards.md).

The release is its training code's output: `model_config.json` (its data, model, LoRA and inference
settings: the frame rate, the pixel budget, the prompt template's type, the dimensions' mean and std,
the base model) and a `checkpoint-N` folder holding either the whole PEFT-wrapped model's state
(`model.pth`) or its LoRA (`adapter_model.safetensors`) and its other trained weights
(`non_lora_state_dict.pth`: the reward head, the embeddings of the three reward tokens). The base is
Qwen2-VL (`model_config.model_name_or_path`, or `--base`), to which the release adds three special
tokens, `<|VQ_reward|>`, `<|MQ_reward|>`, `<|TA_reward|>`, and whose linear layers outside the vision
tower and the heads carry the LoRA. The reward reads the last hidden state h_d at token d and the
head w (output_dim rows, bias-free):

    raw_d = w_k · h_d   (k = 0 for one output, k = d for three)      score_d = (raw_d − mean_d) / std_d

Conversion: the LoRA is merged, W ← W + s·B·A with s = α / r (α / √r for rank-stabilised LoRA); the
model (its vocabulary grown by the three tokens) is saved with its processor; the head goes to
`reward_head.safetensors`; `videoalign.json` gets the template, the tokens, the standardisation and the
release's video preprocessing (frames at `fps` over the clip, a frame count a multiple of 2 between 4
and 768; each frame resized, bicubic, to a multiple of 28 per side within [min_pixels, max_pixels];
branchdiff/rewards/videoalign.py). The template is the release's text for the checkpoint's
`prompt_template_type`, read from VideoAlign's `prompt_template.py` (`--template`, never run) or a text
file holding it; its `{text_prompt}` becomes `{prompt}`. Checkpoints are read with safetensors and
`torch.load(weights_only=True)`.
"""

from __future__ import annotations

import ast
import json
import math
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from branchdiff.rewards.videoalign import CONFIG_FILE, DIMENSIONS, HEAD_FILE

RELEASE_TOKENS = {"VQ": "<|VQ_reward|>", "MQ": "<|MQ_reward|>", "TA": "<|TA_reward|>"}
TEMPLATE_NAMES = {"detailed_special": "DETAILED_PROMPT_WITH_SPECIAL_TOKEN"}  # prompt_template_type → its name in prompt_template.py
# qwen-vl-utils' video constants, which the release's `vision_process.py` uses
VIDEO_MIN_PIXELS, SIZE_FACTOR, FRAME_FACTOR, MIN_FRAMES, MAX_FRAMES = 128 * 28 * 28, 28, 2, 4, 768
PREFIX = "base_model.model."


class ReleaseError(ValueError):
    """The release folder is not VideoReward's layout; one line naming what is wrong."""


def latest_checkpoint(source: Path, step: int | None) -> Path:
    """`checkpoint-<step>`, or the one with the highest step (as the release's loader picks it)."""
    found = {int(p.name.split("-")[-1]): p for p in source.glob("checkpoint-*") if p.name.split("-")[-1].isdigit() and p.is_dir()}
    if not found:
        raise ReleaseError(f"{source}: no checkpoint-N folder; expected VideoReward's release (model_config.json and checkpoint-N/)")
    if step is not None and step not in found:
        raise ReleaseError(f"{source}: no checkpoint-{step}; it holds {', '.join(f'checkpoint-{s}' for s in sorted(found))}")
    return found[step if step is not None else max(found)]


def release_state(checkpoint: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(trained weights without LoRA, LoRA factors) of a checkpoint, keys without the PEFT prefix and adapter name."""
    full, adapter, rest = checkpoint / "model.pth", checkpoint / "adapter_model.safetensors", checkpoint / "non_lora_state_dict.pth"
    if full.is_file():
        state = torch.load(full, map_location="cpu", weights_only=True)
    elif adapter.is_file() and rest.is_file():
        state = {**load_file(str(adapter)), **torch.load(rest, map_location="cpu", weights_only=True)}
    else:
        raise ReleaseError(f"{checkpoint}: neither model.pth nor adapter_model.safetensors with non_lora_state_dict.pth")
    weights, lora = {}, {}
    for key, value in state.items():
        key = key.removeprefix(PREFIX).replace(".default.", ".").replace(".base_layer.", ".")
        if "lora_embedding_" in key:
            raise ReleaseError(f"{checkpoint}: LoRA on an embedding ({key}) is not a VideoReward layout this converter reads")
        (lora if ".lora_A." in key or ".lora_B." in key else weights)[key] = value
    return weights, lora


def merge_lora(weights: dict[str, torch.Tensor], lora: dict[str, torch.Tensor], alpha: float, rank: int, rank_stabilised: bool) -> None:
    """W ← W + s·B·A in place for every LoRA pair (s = α / r, or α / √r), computed in float32, stored in W's dtype."""
    scale = alpha / (math.sqrt(rank) if rank_stabilised else rank)
    for key in [k for k in lora if ".lora_A." in k]:
        module = key.split(".lora_A.")[0]
        target = f"{module}.weight"
        if target not in weights or f"{module}.lora_B.weight" not in lora:
            raise ReleaseError(f"LoRA of {module!r} has no base weight or no B factor in the release and its base")
        merged = weights[target].float() + scale * lora[f"{module}.lora_B.weight"].float() @ lora[key].float()
        weights[target] = merged.to(weights[target].dtype)


def release_template(path: Path, template_type: str) -> str:
    """The release's question for `template_type`, from VideoAlign's prompt_template.py (parsed, not run) or a text file."""
    text = path.read_text()
    if path.suffix == ".py":
        name = TEMPLATE_NAMES.get(template_type)
        if name is None:
            raise ReleaseError(f"prompt_template_type {template_type!r} has no reward tokens; the converter reads {', '.join(TEMPLATE_NAMES)}")
        for node in ast.parse(text).body:
            if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets)
                    and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)):
                text = node.value.value
                break
        else:
            raise ReleaseError(f"{path}: no string {name} (the template of {template_type!r})")
    if "{text_prompt}" not in text or any(text.count(token) != 1 for token in RELEASE_TOKENS.values()):
        raise ReleaseError(f"{path}: the template must hold {{text_prompt}} and each of {', '.join(RELEASE_TOKENS.values())} once")
    return text.replace("{text_prompt}", "{prompt}")


def _base_weights(base: Path) -> dict[str, torch.Tensor]:
    files = sorted(base.glob("*.safetensors"))
    if not files or not (base / "config.json").is_file():
        raise ReleaseError(f"base model {base}: no config.json and *.safetensors; give the local folder of the release's base "
                           "(model_config.model_name_or_path, e.g. Qwen2-VL-2B-Instruct) with --base")
    return {k: v for f in files for k, v in load_file(str(f)).items()}


def convert_videoalign(source: Path, destination: Path, template: Path, base: Path | None = None, step: int | None = None) -> Path:
    """Write the `videoalign` folder of the release at `source` to `destination` (module doc); returns it. Nothing is
    left at `destination` when the conversion fails."""
    if destination.exists() and any(destination.iterdir()):
        raise ReleaseError(f"{destination} is not empty; give a new folder to write the converted reward to")
    if not template.is_file():
        raise ReleaseError(f"--template {template}: no such file; give VideoAlign's prompt_template.py or a text file with the question")
    config_file = source / "model_config.json"
    if not config_file.is_file():
        raise ReleaseError(f"{source}: no model_config.json; expected VideoReward's release folder")
    try:
        settings = json.loads(config_file.read_text())
    except ValueError as error:
        raise ReleaseError(f"{config_file} is not JSON ({error})") from None
    sections = ("data_config", "model_config", "peft_lora_config")
    if not isinstance(settings, dict) or not all(isinstance(settings.get(key, {}), dict) for key in (*sections, "inference_config")):
        raise ReleaseError(f"{config_file}: expected an object with the sections {', '.join(sections)} and inference_config")
    data, model, peft = (settings.get(key, {}) for key in sections)
    if model.get("reward_token") != "special" or not model.get("use_special_tokens") or model.get("output_dim") not in (1, 3):
        raise ReleaseError(f"{config_file}: model_config must read its reward at the special tokens (reward_token: special, "
                           "use_special_tokens: true, output_dim 1 or 3) as VideoReward does")
    if data.get("sample_type", "uniform") != "uniform" or data.get("eval_dim") != list(DIMENSIONS):
        raise ReleaseError(f"{config_file}: data_config must sample frames uniformly over the dimensions {list(DIMENSIONS)}")
    if base is None:
        named = model.get("model_name_or_path")
        if not isinstance(named, str) or not named:
            raise ReleaseError(f"{config_file} names no base model (model_config.model_name_or_path); give its local folder with --base")
        base = Path(named).expanduser()
    prompt_template = release_template(template, data.get("prompt_template_type", ""))
    weights, lora = release_state(latest_checkpoint(source, step))
    head = weights.pop("rm_head.weight", None)
    if head is None or "model.embed_tokens.weight" not in weights:
        raise ReleaseError(f"{source}: the checkpoint holds no rm_head.weight or model.embed_tokens.weight (the reward head and the "
                           "reward tokens' embeddings)")
    state = _base_weights(base)
    unknown = sorted(set(weights) - set(state))
    if unknown:
        raise ReleaseError(f"{source}: {len(unknown)} trained weights have no counterpart in the base {base}, e.g. {unknown[0]!r}; "
                           "is --base the model the release was trained from?")
    state.update(weights)
    if lora:
        merge_lora(state, lora, float(peft.get("lora_alpha", 16)), int(peft.get("lora_r", 8)), bool(peft.get("use_rslora", False)))
    created = not destination.exists()
    try:
        _write(destination, state, head, base, settings, data, prompt_template, source)
    except BaseException:
        if created:
            shutil.rmtree(destination, ignore_errors=True)
        raise
    return destination


def _write(destination: Path, state: dict[str, torch.Tensor], head: torch.Tensor, base: Path, settings: dict, data: dict, prompt_template: str,
           source: Path) -> None:
    """The folder of the module doc: the model with its grown vocabulary, the processor, the head, videoalign.json."""
    from transformers import AutoConfig, AutoProcessor

    processor = AutoProcessor.from_pretrained(base, padding_side="right")
    processor.tokenizer.add_special_tokens({"additional_special_tokens": list(RELEASE_TOKENS.values())})  # as the release adds them
    vocabulary = state["model.embed_tokens.weight"].shape[0]
    if vocabulary != len(processor.tokenizer):
        raise ReleaseError(f"{source}: the embeddings hold {vocabulary} tokens, the base's tokenizer with the reward tokens {len(processor.tokenizer)}")
    config = AutoConfig.from_pretrained(base)
    text_config = getattr(config, "text_config", config)
    text_config.vocab_size = vocabulary
    if getattr(config, "tie_word_embeddings", False) or getattr(text_config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    elif "lm_head.weight" in state:  # the reward never reads it; sized to the vocabulary as the release's resize does
        head_rows = state["lm_head.weight"][:vocabulary]
        missing = vocabulary - len(head_rows)
        state["lm_head.weight"] = torch.cat([head_rows, head_rows.mean(dim=0, keepdim=True).expand(missing, -1)]) if missing else head_rows
    destination.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(destination / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(destination)
    processor.save_pretrained(destination)
    save_file({"weight": head.float().contiguous()}, str(destination / HEAD_FILE))
    inference = settings.get("inference_config") or {}
    (destination / CONFIG_FILE).write_text(json.dumps({
        "template": prompt_template, "tokens": RELEASE_TOKENS,
        "mean": {d: float(inference.get(f"{d}_mean", 0.0)) for d in DIMENSIONS}, "std": {d: float(inference.get(f"{d}_std", 1.0)) for d in DIMENSIONS},
        "video": {"fps": data.get("fps", 2.0), "num_frames": data.get("num_frames"), "min_frames": MIN_FRAMES, "max_frames": MAX_FRAMES,
                  "frame_factor": FRAME_FACTOR, "size_factor": SIZE_FACTOR, "min_pixels": VIDEO_MIN_PIXELS,
                  "max_pixels": data.get("max_frame_pixels", 240 * 320)},
        "source": {"release": str(source), "base": str(base)}}, indent=1))
