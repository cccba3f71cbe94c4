"""`branchdiff eval`: generate on a prompt set with fixed seeds, score with rewards, write images,
scores.csv, grid.png and a summary; shards prompts over the processes of `accelerate launch`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from branchdiff.cli.common import check_device, check_model, load_model, reward_specs_from_text, sampling_settings


def cmd_eval(args: argparse.Namespace) -> None:
    """Shards prompts over the processes of `accelerate launch` (each takes every P-th prompt) and
    gathers once; the main process prints and writes."""
    from accelerate import PartialState

    from branchdiff.data.prompts import load_prompt_set
    from branchdiff.evaluation.evaluate import OdeSampling, ProcessShare, evaluate, format_summary, gather_results, write_outputs
    from branchdiff.evaluation.preflight import Guidance, check_output_file, check_output_folder, check_prompt_set, check_video_rewards, preflight_rewards
    from branchdiff.models.registry import FAMILIES
    from branchdiff.rewards.combine import parse_reward_specs
    from branchdiff.rewards.group import refuse_in_evaluation
    from branchdiff.rewards.multi import build_component, check_remote_kwargs
    from branchdiff.rewards.registry import check_reward_kwargs, resolve_reward
    from branchdiff.runtime.distributed import disconnect

    check_device(args.device)
    settings, run = sampling_settings(args)
    size = check_model(settings, args.weights)  # before the rewards load
    out = args.out or Path("eval-" + (run.name if run else Path(args.weights or "base").stem))
    check_output_folder(out, "--out")
    if args.json:
        check_output_file(args.json, "--json")
    prompt_set = load_prompt_set(settings.prompts, settings.fit)
    specs = reward_specs_from_text(settings.rewards) if isinstance(settings.rewards, str) else parse_reward_specs(settings.rewards)
    factories = {spec.name: resolve_reward(spec.name) for spec in specs if spec.remote is None}
    for spec in specs:
        if spec.remote is None:
            check_reward_kwargs(spec.name, factories[spec.name], spec.kwargs)
        else:
            check_remote_kwargs(spec)
    if FAMILIES[settings.family].video:  # before any reward loads
        check_video_rewards("--rewards", specs, factories)
    check_prompt_set(prompt_set, settings.family, size, specs, factories, Guidance("--guidance", settings.guidance, settings.model))
    preflight_rewards(specs, factories)
    state = PartialState(cpu=args.device == "cpu")
    rewards = {spec.label: build_component(spec, args.device) for spec in specs}
    refuse_in_evaluation(rewards, "eval --rewards")
    sampling = OdeSampling(settings.images_per_prompt, settings.steps, settings.shift, settings.guidance, settings.seed, settings.solver)
    result = evaluate(load_model(settings, args.weights, state.device), prompt_set, rewards, sampling,
                      ProcessShare(state.process_index, state.num_processes), frames={spec.label: spec.frames for spec in specs},
                      out_dir=out, progress=state.is_local_main_process)
    result = gather_results(result, state)
    disconnect(state)  # every process's images are on disk before the grid reads them
    if not state.is_main_process:
        return
    out.mkdir(parents=True, exist_ok=True)
    scales = {label: getattr(reward, "scale", "unspecified") for label, reward in rewards.items()}
    extra = {"family": settings.family, "model": settings.model or "built-in tiny", "weights": args.weights, "steps": settings.steps,
             "seed": settings.seed, "shift": settings.shift, "guidance": settings.guidance, "solver": settings.solver}
    summary = write_outputs(result, out, scales, extra)
    print(f"{prompt_set.name}: {len(prompt_set.prompts)} prompts × {settings.images_per_prompt} images, "
          f"{'weights ' + args.weights if args.weights else 'base model'}; images, scores.csv, grid.png in {out}/")
    print(format_summary(summary["summary"]))
    if args.json:
        from branchdiff.runtime import storage

        storage.write_text(args.json, json.dumps(summary, indent=1))
