"""Build a reward from a registered name, an installed entry point or a dotted import path.

- A **registered name** (`BUILT_IN`: `tiny-geneval`, ...) names a built-in; its module is imported
  only when it is built, so a reward's heavy dependencies load only for runs that use it.
- An **entry point** in the group `branchdiff.rewards` (a package's `pyproject.toml`:
  `[project.entry-points."branchdiff.rewards"] sharpness = "my_pkg.rewards:Sharpness"`) is found
  by its name once the package is installed; one that takes a built-in's name, or another package's,
  is refused naming both (branchdiff/runtime/registry.py, every component's rule) and listed as such.
- A **dotted path** `package.module:Name` names a class or factory in any importable module.

Keyword arguments (from YAML: `{name: ..., kwargs: {...}}`) go to the class or factory; `device`
is passed too when its signature takes one. The result follows the protocol of `branchdiff/rewards/base.py`.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from importlib.util import find_spec

import torch

from branchdiff.errors import quote
from branchdiff.runtime.registry import Registry


@dataclass(frozen=True)
class Registered:
    target: str  # "module:attribute" of the class or factory
    needs: tuple[str, ...] = ()  # importable modules it needs beyond branchdiff's own dependencies
    install: str = ""  # how to get them
    weights: tuple[tuple[str, str, str], ...] = ()  # (keyword argument, hub repo, a file of it) per weight it loads by default
    required: tuple[str, ...] = ()  # keyword arguments a run must give it (those without a default, and videoalign's path)


BUILT_IN: dict[str, Registered] = {
    "tiny-geneval": Registered("branchdiff.rewards.tiny_geneval:TinyGenEval"),
    "tiny-video": Registered("branchdiff.rewards.tiny_video:TinyVideoVerifier"),  # clips of the built-in video task
    "tiny-partial": Registered("branchdiff.rewards.partial_proxy:PartialProxy"),  # some of a built-in verifier's terms: a hackable proxy
    "learned-proxy": Registered("branchdiff.rewards.learned_proxy:LearnedProxy", required=("path",)),  # small networks fit to a verifier, or their ensemble
    "geneval": Registered("branchdiff.rewards.geneval:GenEvalReward",  # GenEval's verdict: a Mask2Former's detections, CLIP's colours, its rules
                          weights=(("detector", "facebook/mask2former-swin-small-coco-instance", "config.json"),)),
    "videoalign": Registered("branchdiff.rewards.videoalign:VideoAlignReward",  # videos: a Qwen2-VL reward model from a local folder (VQ, MQ, TA)
                             required=("path",)),
    "flicker": Registered("branchdiff.rewards.flicker:Flicker"),  # videos: frame-to-frame change
    "ocr": Registered("branchdiff.rewards.ocr:OCRReward", needs=("rapidocr_onnxruntime",),  # rendered text: PP-OCRv4 inside rapidocr's wheel
                      install="pip install 'branchdiff-rl[ocr]'"),
    "vlm-judge": Registered("branchdiff.rewards.vlm_judge:VLMJudge",  # a VLM's P(yes), or its tournament (mode: pairwise), over an OpenAI-compatible API
                            required=("url", "model")),
    "group-rank": Registered("branchdiff.rewards.group_rank:GroupRank", required=("reward",)),  # another reward's rank within the group
    "edit-consistency": Registered("branchdiff.rewards.edit_consistency:EditConsistency"),  # editing: the source kept outside the edit
    "clip-consistency": Registered("branchdiff.rewards.clip_consistency:CLIPConsistencyReward",  # videos: adjacent frames' CLIP similarity
                                   weights=(("model", "openai/clip-vit-large-patch14", "config.json"),)),
    "hpsv2": Registered("branchdiff.rewards.hps:hpsv2", weights=(("checkpoint", "xswu/HPSv2", "HPS_v2_compressed.pt"),)),
    "hpsv2.1": Registered("branchdiff.rewards.hps:hpsv2_1", weights=(("checkpoint", "xswu/HPSv2", "HPS_v2.1_compressed.pt"),)),
    "pickscore": Registered("branchdiff.rewards.pickscore:PickScoreReward",
                            weights=(("model", "yuvalkirstain/PickScore_v1", "config.json"),
                                     ("processor", "laion/CLIP-ViT-H-14-laion2B-s32B-b79K", "preprocessor_config.json"))),
    "clip-score": Registered("branchdiff.rewards.clip_score:CLIPScoreReward", weights=(("model", "openai/clip-vit-large-patch14", "config.json"),)),
    "aesthetic": Registered("branchdiff.rewards.aesthetic:AestheticReward",
                            weights=(("mlp", "trl-lib/ddpo-aesthetic-predictor", "aesthetic-model.pth"),
                                     ("clip_model", "openai/clip-vit-large-patch14", "config.json"))),
    "imagereward": Registered("branchdiff.rewards.imagereward:ImageRewardReward", needs=("ImageReward",),
                              install="pip install image-reward in its own environment, then serve it: branchdiff serve-reward imagereward",
                              weights=(("checkpoint", "THUDM/ImageReward", "ImageReward.pt"), ("", "bert-base-uncased", "tokenizer_config.json"))),
}


REWARDS = Registry("reward", "branchdiff.rewards", BUILT_IN)


def _import(target: str, what: str):
    module_name, _, attribute = target.partition(":")
    try:
        return getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"{what} {target!r} could not be imported ({error}); expected 'package.module:Name'") from None


def _construct(factory, name: str, device: str, kwargs: dict) -> object:
    try:
        parameters = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a builtin or C callable: no signature to inspect
        parameters = {}
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    if "device" in parameters or takes_any:
        kwargs = {"device": device, **kwargs}
    try:
        return factory(**kwargs)
    except TypeError as error:
        raise ValueError(f"reward {name!r}: {error}; check its kwargs") from None


def resolve_reward(name: str) -> Callable[..., object]:
    """The class or factory `name` names (registered name, entry point or dotted path), imported but
    not built: what a run checks before it loads anything."""
    if name in BUILT_IN:
        registered = BUILT_IN[name]
        missing = [module for module in registered.needs if find_spec(module) is None]
        if missing:
            raise ValueError(f"reward {name!r} needs {', '.join(missing)}: {registered.install}")
        return _import(registered.target, f"reward {name!r}:")
    if name in REWARDS.installed:
        try:
            return REWARDS.load(name)
        except (ImportError, AttributeError) as error:
            raise ValueError(f"reward {name!r} (entry point {REWARDS.installed[name].value!r}) could not be loaded ({error})") from None
    if name in REWARDS.refused:
        raise ValueError(f"reward {name!r} cannot be used: {REWARDS.refused[name]}")
    if ":" in name:
        return _import(name, "reward")
    known = REWARDS.names()
    close = difflib.get_close_matches(name, known, n=2)
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    raise ValueError(f"unknown reward {quote(name)}{hint}; available: {', '.join(known)}, or a dotted path 'package.module:Name'")


def check_reward_kwargs(name: str, factory: Callable[..., object], kwargs: dict) -> None:
    """Refuse keyword arguments the reward's class or factory does not take (before it is built)."""
    try:
        parameters = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a builtin or C callable: nothing to check
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return
    unknown = sorted(set(kwargs) - set(parameters))
    if unknown:
        takes = [p for p in parameters if p != "device"]
        raise ValueError(f"reward {name!r} takes no keyword argument {unknown[0]!r}; it takes: {', '.join(takes) or 'none'}")


def build_reward(name: str, device: str | torch.device = "cpu", kwargs: dict | None = None) -> object:
    """The reward `name` (registered name, entry point name or dotted path), built with `kwargs`."""
    return _construct(resolve_reward(name), name, str(device), dict(kwargs or {}))


def _cached(repo: str, file: str) -> bool:
    """Whether the hub file is in the local cache (nothing is downloaded to find out)."""
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(repo, file), str)


def _import_failure(modules: tuple[str, ...]) -> str | None:
    """The first of `modules` that is installed but fails to import (a missing system library, a broken build), with why."""
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as error:  # any import-time failure: ImportError, OSError of a shared library, ...
            return f"{module} ({type(error).__name__}: {' '.join(str(error).split())[:120]})"
    return None


def available() -> list[dict[str, str]]:
    """One row per reward that can be named, built-ins and installed entry points (`branchdiff rewards
    list`): its source, its status (`ready`: it runs now; `needs kwargs X`: it runs once the run gives it
    X (videoalign's folder, a judge's URL); `not downloaded`: a default weight is not in the local hub cache,
    so it needs the hub or a local path; `missing X`: a package it needs; `broken X`: a package it needs is
    installed and fails to import) and its default weights; `note` says how to get what is missing."""
    rows = []
    for name, registered in BUILT_IN.items():
        missing = [module for module in registered.needs if find_spec(module) is None]
        broken = None if missing else _import_failure(registered.needs)
        absent = [(argument, repo, file) for argument, repo, file in registered.weights if not _cached(repo, file)]
        weights = ", ".join(dict.fromkeys(repo for _, repo, _ in registered.weights)) or "none"
        if missing:
            status, note = f"missing {', '.join(missing)}", registered.install
        elif broken:
            status, note = f"broken {broken.split(' ')[0]}", f"{broken} fails to import; reinstall it: {registered.install}"
        elif registered.required:
            status = f"needs kwargs {', '.join(registered.required)}"
            note = f"give kwargs {{{', '.join(f'{key}: ...' for key in registered.required)}}} (docs/rewards.md, {name})"
        elif absent:
            status = "not downloaded"
            note = "; ".join(f"{argument + ' = ' if argument else ''}{repo}{'' if file.endswith('.json') else ' ' + file}"
                             for argument, repo, file in absent)
        else:
            status, note = "ready", ""
        rows.append({"name": name, "source": "built-in", "status": status, "weights": weights, "note": note})
    for name, point in REWARDS.installed.items():
        rows.append({"name": name, "source": "entry point", "status": "installed", "weights": f"its package's ({point.value})", "note": ""})
    for name, why in REWARDS.refused.items():
        rows.append({"name": name, "source": "entry point", "status": "not used", "weights": "-", "note": why})
    return rows


def reward_key(reward: object) -> str:
    """The key of a reward's `score()` dict that is the reward itself (others are extra scores)."""
    return getattr(reward, "reward_key", "reward")
