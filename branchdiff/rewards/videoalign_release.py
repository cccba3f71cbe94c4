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
GROWN = ("model.embed_tokens.weight", "lm_head.weight")  # the release grows their rows by the reward tokens


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


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors or `torch.save` file (`weights_only`), or one line naming the file when it is
    damaged (truncated, another format) or holds anything but a mapping of names to tensors."""
    try:
        state = load_file(str(path)) if path.suffix == ".safetensors" else torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # safetensors' and torch's readers raise their own types for a damaged file
        raise ReleaseError(f"{path} could not be read ({type(error).__name__}: {' '.join(str(error).split())[:160]}); the file is damaged "
                           "or incomplete: download the release again") from None
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()):
        raise ReleaseError(f"{path} holds {type(state).__name__}, not a state dict of named tensors; is it the release's file?")
    return state


def release_state(checkpoint: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, Path]]:
    """(trained weights without LoRA, LoRA factors, the file each key came from) of a checkpoint, keys without the PEFT
    prefix and adapter name."""
    full, adapter, rest = checkpoint / "model.pth", checkpoint / "adapter_model.safetensors", checkpoint / "non_lora_state_dict.pth"
    if full.is_file():
        files = [full]
    elif adapter.is_file() and rest.is_file():
        files = [adapter, rest]
    else:
        raise ReleaseError(f"{checkpoint}: neither model.pth nor adapter_model.safetensors with non_lora_state_dict.pth")
    weights, lora, origin = {}, {}, {}
    for file in files:
        for key, value in read_tensors(file).items():
            key = key.removeprefix(PREFIX).replace(".default.", ".").replace(".base_layer.", ".")
            if "lora_embedding_" in key:
                raise ReleaseError(f"{file}: LoRA on an embedding ({key}) is not a VideoReward layout this converter reads")
            (lora if ".lora_A." in key or ".lora_B." in key else weights)[key] = value
            origin[key] = file
    return weights, lora, origin


def merge_lora(weights: dict[str, torch.Tensor], lora: dict[str, torch.Tensor], alpha: float, rank: int, rank_stabilised: bool,
               origin: dict[str, Path] | None = None) -> None:
    """W ← W + s·B·A in place for every LoRA pair (s = α / r, or α / √r), computed in float32, stored in W's dtype.
    Refuses, naming the key and its file (`origin`), a pair that is not W's shape through rank r."""
    if rank < 1:
        raise ReleaseError(f"peft_lora_config.lora_r = {rank}: a LoRA has rank ≥ 1; is model_config.json the release's own?")
    scale = alpha / (math.sqrt(rank) if rank_stabilised else rank)
    for key in [k for k in lora if ".lora_A." in k]:
        module = key.split(".lora_A.")[0]
        target, b_key = f"{module}.weight", f"{module}.lora_B.weight"
        file = (origin or {}).get(key, "the release")
        if target not in weights or b_key not in lora:
            raise ReleaseError(f"{file}: the LoRA of {module!r} has no base weight {target!r} or no B factor {b_key!r} in the release and its base")
        a, b, weight = lora[key], lora[b_key], weights[target]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank or (b.shape[0], a.shape[1]) != tuple(weight.shape):
            raise ReleaseError(f"{file}: the LoRA of {module!r} has A {tuple(a.shape)} and B {tuple(b.shape)}, where rank {rank} "
                               f"(peft_lora_config.lora_r) and the weight {tuple(weight.shape)} need A ({rank}, {weight.shape[-1]}) and "
                               f"B ({weight.shape[0]}, {rank}); is it the release's file, with its model_config.json?")
        weights[target] = (weight.float() + scale * b.float() @ a.float()).to(weight.dtype)


def check_shapes(weights: dict[str, torch.Tensor], base: dict[str, torch.Tensor], origin: dict[str, Path], base_folder: Path) -> None:
    """Every trained weight has its base weight's shape (the embeddings: its width, their rows grow with the reward tokens)."""
    for key, value in weights.items():
        expected = base[key].shape
        same = value.shape[1:] == expected[1:] and value.dim() == len(expected) if key in GROWN else value.shape == expected
        if not same:
            raise ReleaseError(f"{origin.get(key, 'the release')}: {key!r} is {tuple(value.shape)} and the base {base_folder} holds "
                               f"{tuple(expected)}; is --base the model the release was trained from?")


def release_template(path: Path, template_type: str) -> str:
    """The release's question for `template_type`, from VideoAlign's prompt_template.py (parsed, not run) or a text file."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ReleaseError(f"--template {path} is not UTF-8 text; give VideoAlign's prompt_template.py or a text file with the question") from None
    if path.suffix == ".py":
        name = TEMPLATE_NAMES.get(template_type)
        if name is None:
            raise ReleaseError(f"prompt_template_type {template_type!r} has no reward tokens; the converter reads {', '.join(TEMPLATE_NAMES)}")
        try:
            body = ast.parse(text).body
        except SyntaxError as error:
            raise ReleaseError(f"--template {path} is not valid Python (line {error.lineno}: {error.msg}); give VideoAlign's "
                               "prompt_template.py as released, or a text file holding the question") from None
        for node in body:
            if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets)
                    and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)):
                text = node.value.value
                break
        else:
            raise ReleaseError(f"{path}: no string {name} (the template of {template_type!r})")
    if "{text_prompt}" not in text or any(text.count(token) != 1 for token in RELEASE_TOKENS.values()):
        raise ReleaseError(f"{path}: the template must hold {{text_prompt}} and each of {', '.join(RELEASE_TOKENS.values())} once")
    return text.replace("{text_prompt}", "{prompt}")


def _base_weights(base: Path) -> tuple[dict[str, torch.Tensor], bool]:
    """The base's weights and whether it ties its output embeddings to its input ones (Qwen2-VL-2B does)."""
    from transformers import AutoConfig

    files = sorted(base.glob("*.safetensors"))
    if not files or not (base / "config.json").is_file():
        raise ReleaseError(f"base model {base}: no config.json and *.safetensors; give the local folder of the release's base "
                           "(model_config.model_name_or_path, e.g. Qwen2-VL-2B-Instruct) with --base")
    try:
        config = AutoConfig.from_pretrained(base)
    except (OSError, ValueError, KeyError) as error:
        raise ReleaseError(f"{base / 'config.json'} is not a model configuration transformers reads ({' '.join(str(error).split())[:160]})") from None
    tied = bool(getattr(config, "tie_word_embeddings", False) or getattr(getattr(config, "text_config", None), "tie_word_embeddings", False))
    return {k: v for f in files for k, v in read_tensors(f).items()}, tied


def convert_videoalign(source: Path, destination: Path, template: Path, base: Path | None = None, step: int | None = None) -> Path:
    """Write the `videoalign` folder of the release at `source` to `destination` (module doc); returns it. Nothing is
    left at `destination` when the conversion fails."""
    if destination.exists() and not destination.is_dir():
        raise ReleaseError(f"{destination} is a file; give a new folder to write the converted reward to")
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
    numbers = {"inference_config": [f"{d}_{kind}" for d in DIMENSIONS for kind in ("mean", "std")], "peft_lora_config": ["lora_alpha"],
               "data_config": ["fps", "max_frame_pixels"]}
    for section, keys in numbers.items():  # read as numbers once the model is written: checked now, before anything is
        for key in keys:
            value = (settings.get(section) or {}).get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)):
                raise ReleaseError(f"{config_file}: {section}.{key} is {value!r}; the release writes a number there")
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
    checkpoint = latest_checkpoint(source, step)
    weights, lora, origin = release_state(checkpoint)
    head = weights.pop("rm_head.weight", None)
    if head is None or "model.embed_tokens.weight" not in weights:
        raise ReleaseError(f"{checkpoint}: the checkpoint holds no rm_head.weight or model.embed_tokens.weight (the reward head and the "
                           "reward tokens' embeddings)")
    state, tied = _base_weights(base)
    if tied:  # the output embeddings are the input ones: the release's state lists them under both names
        weights.pop("lm_head.weight", None)
    unknown = sorted(set(weights) - set(state))
    if unknown:
        raise ReleaseError(f"{origin[unknown[0]]}: {len(unknown)} trained weights have no counterpart in the base {base}, e.g. {unknown[0]!r}; "
                           "is --base the model the release was trained from?")
    check_shapes(weights, state, origin, base)
    width = weights["model.embed_tokens.weight"].shape[-1]
    if head.dim() != 2 or tuple(head.shape) != (model["output_dim"], width):
        raise ReleaseError(f"{origin['rm_head.weight']}: 'rm_head.weight' is {tuple(head.shape)}; model_config's output_dim {model['output_dim']} "
                           f"and the model's width {width} need ({model['output_dim']}, {width})")
    state.update(weights)
    rank = peft.get("lora_r", 8)
    if lora:
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise ReleaseError(f"{config_file}: peft_lora_config.lora_r is {rank!r}; the release writes the LoRA's rank, a whole number ≥ 1")
        merge_lora(state, lora, float(peft.get("lora_alpha", 16)), rank, bool(peft.get("use_rslora", False)), origin)
    created = not destination.exists()
    try:
        _write(destination, state, head, base, tied, settings, data, prompt_template, checkpoint)
    except BaseException:
        if created:
            shutil.rmtree(destination, ignore_errors=True)
        raise
    return destination


def _write(destination: Path, state: dict[str, torch.Tensor], head: torch.Tensor, base: Path, tied: bool, settings: dict, data: dict,
           prompt_template: str, checkpoint: Path) -> None:
    """The folder of the module doc: the model with its grown vocabulary, the processor, the head, videoalign.json."""
    from transformers import AutoConfig, AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(base, padding_side="right")
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ReleaseError(f"base model {base}: its processor (tokenizer, chat template, video processor) could not be read "
                           f"({' '.join(str(error).split())[:160]}); give the base's whole folder with --base") from None
    processor.tokenizer.add_special_tokens({"additional_special_tokens": list(RELEASE_TOKENS.values())})  # as the release adds them
    vocabulary = state["model.embed_tokens.weight"].shape[0]
    if vocabulary != len(processor.tokenizer):
        raise ReleaseError(f"{checkpoint}: 'model.embed_tokens.weight' holds {vocabulary} tokens, the base's tokenizer with the reward tokens "
                           f"{len(processor.tokenizer)}; is --base the model the release was trained from?")
    config = AutoConfig.from_pretrained(base)
    text_config = getattr(config, "text_config", config)
    text_config.vocab_size = vocabulary
    if tied:
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
        "source": {"release": str(checkpoint.parent), "checkpoint": checkpoint.name, "base": str(base)}}, indent=1))
