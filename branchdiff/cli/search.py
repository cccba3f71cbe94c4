"""What `branchdiff sample --search` and `--from-trace` write: each prompt's best images (PNG,
named as `sample` names them) and OUT/search.json (branchdiff/search/sample.py). The reward spec and
the trace are read before the model loads; OUT is made only when the first image is ready."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

from branchdiff.cli.common import file_name
from branchdiff.models.base import ModelAdapter
from branchdiff.report.video import save_sample
from branchdiff.rewards.combine import RewardSpec
from branchdiff.runtime import storage
from branchdiff.search.sample import SearchSettings, regenerate, search_prompts, trace
from branchdiff.settings.evaluation import EvalSettings


def one_reward(text: str) -> RewardSpec:
    """`--reward`: the one reward a search maximises."""
    from branchdiff.cli.common import reward_specs_from_text

    specs = reward_specs_from_text(text)
    if len(specs) != 1:
        raise ValueError(f"--reward {text}: a search maximises one reward; name one (a name, dotted path or server URL)")
    return specs[0]


def check_search(args: argparse.Namespace, settings: EvalSettings, seed: int, size: tuple[int, int]) -> tuple[SearchSettings, RewardSpec]:
    """Everything of `sample --search` that needs no model, checked before it loads: the search's settings (its budget
    against one image's cost, the SDE against the family's steps), and the reward (it resolves, takes its keyword
    arguments and can score the prompts)."""
    from branchdiff.data.prompts import PromptSet
    from branchdiff.evaluation.preflight import check_prompt_set, preflight_rewards
    from branchdiff.models import adapter_class
    from branchdiff.models.registry import FAMILIES, STEP_KINDS
    from branchdiff.rewards.multi import check_remote_kwargs
    from branchdiff.rewards.registry import check_reward_kwargs, resolve_reward

    steps = FAMILIES[settings.family].steps
    if args.sde is not None and args.sde not in STEP_KINDS[steps]:
        raise ValueError(f"--sde {args.sde} is not an SDE of the {settings.family} family ({steps} steps); choose one of "
                         f"{', '.join(STEP_KINDS[steps])}, or leave --sde unset")
    spec = one_reward(args.reward)
    decode_cost, reward_cost = budget_prices(args, settings, spec)
    search = SearchSettings(args.search, args.budget, settings.steps, settings.shift, settings.guidance, args.sde, args.noise_level,
                            args.max_batch, seed, args.temperature, args.max_children, args.keep,
                            args.root_children, args.widening, args.exploration, args.x0_value, args.parallel, args.rollout_depth,
                            decode_cost, reward_cost)
    family = adapter_class(settings.family)
    search.validate(family.cfg_rows(family.default_guidance if settings.guidance is None else settings.guidance, settings.model))
    factories = {}
    if spec.remote is None:
        factories[spec.name] = resolve_reward(spec.name)
        check_reward_kwargs(spec.name, factories[spec.name], spec.kwargs)
    else:
        check_remote_kwargs(spec)
    check_prompt_set(PromptSet("--prompt", list(args.prompt), [{} for _ in args.prompt]), settings.family, size, [spec], factories)
    preflight_rewards([spec], factories)
    return search, spec


def budget_prices(args: argparse.Namespace, settings: EvalSettings, spec: RewardSpec) -> tuple[float, float]:
    """(a decode's, a reward call's) price in network rows of `--budget-unit cost`: `--decode-cost` / `--reward-cost`
    where given, else `branchdiff plan`'s FLOP counts for the family at the sampled size and the reward
    (branchdiff/plan/search_prices.py); (0, 0) for a budget in rows."""
    if args.budget_unit == "rows":
        given = [flag for flag, value in (("--decode-cost", args.decode_cost), ("--reward-cost", args.reward_cost)) if value is not None]
        if given:
            raise ValueError(f"{given[0]} prices a budget in cost: add --budget-unit cost, or leave {given[0]} out")
        return 0.0, 0.0
    if args.decode_cost is not None and args.reward_cost is not None:
        return args.decode_cost, args.reward_cost
    from branchdiff.plan.search_prices import price_search
    from branchdiff.settings.load import load_config

    sized = [f"model.family={settings.family}", f"model.dtype={settings.dtype}", *([f"model.path={settings.model}"] if settings.model else []),
             *([f"model.resolution={json.dumps(settings.resolution)}"] if settings.resolution is not None else []),
             *([f"model.frames={settings.frames}"] if settings.frames else [])]
    priced = price_search(load_config(None, sized), spec.name or spec.label, spec.kwargs, args.reward_cost)
    decode = priced.prices.decode if args.decode_cost is None else args.decode_cost
    source = "given" if args.reward_cost is not None else "counted"
    print(f"budget in cost: a decode is {decode:.3g} network rows, a reward call {priced.prices.reward:.3g} ({source}; FLOPs: a row "
          f"{priced.row_flops:.3g}, a decode {priced.decode_flops:.3g}, a call {priced.reward_flops:.3g})", flush=True)
    return decode, priced.prices.reward


def search_and_write(adapter: ModelAdapter, args: argparse.Namespace, settings: EvalSettings,
                     planned: tuple[SearchSettings, RewardSpec]) -> Iterator[Path]:
    """Search every `--prompt` for the reward `spec`; write the best images, then the trace; yield the paths."""
    from branchdiff.rewards.multi import build_component, score_component

    search, spec = planned
    label, reward = spec.label, build_component(spec, "cpu")
    prompts = list(args.prompt)

    def score(images: torch.Tensor, prompt_index: list[int]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        value, more, _ = score_component(reward, label, images, [prompts[i] for i in prompt_index], [{} for _ in prompt_index])
        return value, {f"{label}.{key}": scores for key, scores in more.items()}

    forest, result = search_prompts(adapter, prompts, search, score, first_round=True)
    empty = [prompt for p, prompt in enumerate(prompts) if not result.leaves[p]]
    if empty:  # only early stops leave a prompt without an image: every other first round finishes one
        raise ValueError(f"--rollout-depth {search.rollout_depth}: the search finished no image of {', '.join(map(repr, empty))} within "
                         f"--budget {search.budget} (its rollouts stopped early and were not extended in time); give a larger --budget, "
                         "--max-children 1 --widening 0.5 (which extends stopped rollouts first), or --rollout-depth 0")
    recorded = trace(forest, result, prompts, search, {"family": settings.family, "model": settings.model or "built-in tiny",
                                                       "weights": args.weights, "reward": args.reward})
    args.out.mkdir(parents=True, exist_ok=True)
    index = 0
    for entry in recorded["prompts"]:
        for best, leaf in zip(entry["best"], result.best(entry["prompt_key"], search.keep)):
            image = adapter.decode(forest.latent[leaf][None])  # (1, 3, H, W), a video (1, F, 3, H, W): decoded alone, as `--from-trace` decodes it
            best["image"] = file_name(index, entry["prompt"])
            index += 1
            yield from save_sample(image[0], args.out / best["image"])
        if len(entry["best"]) < search.keep:
            print(f"note: --keep {search.keep}: the search made {len(entry['best'])} images of {entry['prompt']!r}; all are written",
                  file=sys.stderr)
        rounds = entry["rounds"]
        calls = f"{entry['reward_calls']} reward calls"
        spent = (f"{entry['nfe']} network rows, {entry['decodes']} decodes and {calls}, a cost of {entry['cost']:g} of {search.budget:g}"
                 if search.prices.evaluation else f"{entry['nfe']} of {search.budget:g} network rows and {calls}")
        unscored = f"; {rounds[-1]['nonfinite']} scored NaN or ±inf, counted as the worst" if rounds[-1]["nonfinite"] else ""
        print(f"{entry['prompt']!r}: best {label} {entry['best'][0]['reward']:.4f} (mean {rounds[-1]['mean']:.4f} over "
              f"{rounds[-1]['images']} images{unscored}) with {spent} ({args.search})", file=sys.stderr)
    storage.write_text(args.out / "search.json", json.dumps(recorded, indent=1))
    yield args.out / "search.json"


def regrow_trace(adapter: ModelAdapter, recorded: dict, weights: str | None, out: Path) -> Iterator[Path]:
    """Regrow a trace's best images from their noise paths (with the model and weights given) and write them to `out`."""
    if recorded.get("weights") != weights:
        print(f"note: the trace was searched with weights {recorded.get('weights')}; regrowing with {weights}: the images "
              "are the same only with the same model and weights", file=sys.stderr)
    for _, latent, best in regenerate(adapter, recorded):
        out.mkdir(parents=True, exist_ok=True)
        yield from save_sample(adapter.decode(latent[None])[0], out / best["image"])
