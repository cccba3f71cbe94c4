"""`branchdiff eval`: generate on a prompt set with fixed seeds, score with rewards, write images,
scores.csv, grid.png and a summary; shards prompts over the processes of `accelerate launch`."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from branchdiff.cli.common import check_device, check_model, load_model, reward_specs_from_text, sampling_settings
from branchdiff.errors import UserError
from branchdiff.runtime import storage

if TYPE_CHECKING:
    from branchdiff.evaluation.benchmarks import Benchmark, Protocol
    from branchdiff.evaluation.evaluate import EvalResult
    from branchdiff.rewards.combine import RewardSpec
    from branchdiff.settings.evaluation import EvalSettings


def cmd_eval(args: argparse.Namespace) -> None:
    """Shards prompts over the processes of `accelerate launch` (each takes every P-th prompt) and
    gathers once; the main process prints and writes."""
    from accelerate import PartialState

    from branchdiff.cli.parser import installed_version
    from branchdiff.data.prompts import load_prompt_set
    from branchdiff.evaluation.evaluate import OdeSampling, ProcessShare, evaluate, format_summary, gather_results, write_outputs
    from branchdiff.evaluation.preflight import Guidance, check_output_file, check_output_folder, check_prompt_set, check_video_rewards, preflight_rewards
    from branchdiff.evaluation.records import ScoreRecords, content_identity, prompts_digest, resumable
    from branchdiff.models import adapter_class
    from branchdiff.models.finetune import locate_weights
    from branchdiff.models.registry import FAMILIES
    from branchdiff.rewards.combine import parse_reward_specs
    from branchdiff.rewards.group import refuse_in_evaluation
    from branchdiff.rewards.multi import build_component, check_remote_kwargs
    from branchdiff.rewards.registry import check_reward_kwargs, resolve_reward
    from branchdiff.runtime.distributed import disconnect

    check_device(args.device)
    chosen, protocol = _benchmark(args)
    settings, run = sampling_settings(args)
    size = check_model(settings, args.weights)  # before the rewards load
    out = args.out or Path("eval-" + (run.name if run else Path(args.weights or "base").stem))
    check_output_folder(out, "--out")
    if args.json:
        check_output_file(args.json, "--json")
    prompt_set = load_prompt_set(settings.prompts, settings.fit)
    if chosen is not None:
        specs = _benchmark_scorers(args.benchmark, chosen.rewards, settings.rewards)
    else:
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
    labels = list(chosen.rewards) if chosen is not None else [spec.label for spec in specs]  # a benchmark's scorers by its names
    rewards = {label: build_component(spec, args.device) for label, spec in zip(labels, specs)}
    refuse_in_evaluation(rewards, "eval --rewards")
    sampling = OdeSampling(settings.images_per_prompt, settings.steps, settings.shift, settings.guidance, settings.seed, settings.solver)
    weights = locate_weights(args.weights, adapter_class(settings.family).denoiser_name)[1] if args.weights else None
    records = resumable(out, {"settings": asdict(settings), "weights": args.weights, "weights_content": content_identity(weights),
                              "model_content": content_identity(settings.model) if settings.model else None,
                              "prompts": prompts_digest(prompt_set.prompts, prompt_set.metadata), "benchmark": args.benchmark,
                              "labels": labels, "rewards": [repr(spec) for spec in specs], "version": installed_version()}, state)
    result = evaluate(load_model(settings, args.weights, state.device), prompt_set, rewards, sampling,
                      ProcessShare(state.process_index, state.num_processes), frames=dict(zip(labels, (spec.frames for spec in specs))),
                      out_dir=out, progress=state.is_local_main_process, records=ScoreRecords(records, state.process_index))
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
    if chosen is not None:
        summary["benchmark"] = _benchmark_table(args, chosen, protocol, result, settings)
        storage.write_text(out / "benchmark.json", json.dumps(summary["benchmark"], indent=1))
        if run is not None:  # the run's report sets the table beside the papers' (RUN/benchmarks/NAME.json)
            from branchdiff.report.run_report import write_report

            storage.write_text(run / "benchmarks" / f"{args.benchmark}.json", json.dumps(summary["benchmark"], indent=1))
            if (run / "metrics.jsonl").is_file():
                write_report(run)
    if args.json:
        storage.write_text(args.json, json.dumps(summary, indent=1))


def _benchmark(args: argparse.Namespace) -> tuple[Benchmark | None, Protocol | None]:
    """With --benchmark: the benchmark, its protocol for the family (None: no paper's), and the settings it fixes set on
    `args` where the command line left them unset (the run's and the defaults come after them)."""
    if args.benchmark is None:
        if args.compare is not None:
            raise UserError("--compare names a paper whose rows stand beside a benchmark's: give --benchmark too (e.g. --benchmark geneval "
                            f"--compare {args.compare})")
        return None, None
    from branchdiff.evaluation.benchmarks import benchmark, protocol_settings
    from branchdiff.evaluation.paper_tables import paper_rows
    from branchdiff.settings.evaluation import resolve

    chosen = benchmark(args.benchmark)
    if args.prompts is not None:
        raise UserError(f"--prompts with --benchmark {args.benchmark}: the benchmark's prompts are {chosen.prompts}; leave --prompts out "
                        "(or leave --benchmark out to score another prompt set)")
    if args.compare is not None:
        paper_rows(args.benchmark, args.compare)  # a paper without rows here: one line before anything loads
    family = resolve({"family": args.family}, args.weights, evaluation=True)[0].family
    fixed, protocol = protocol_settings(args.benchmark, family)
    for name, value in fixed.items():
        if name == "rewards":
            continue  # --rewards, when given, replaces the benchmark's scorers one for one (`_benchmark_scorers`)
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    if args.rewards is None:
        args.rewards = fixed["rewards"]
    return chosen, protocol


def _benchmark_scorers(name: str, expected: tuple[str, ...], given: object) -> list[RewardSpec]:
    """The rewards scoring a benchmark, one per score of its own (`--rewards` in its order: kwargs, a reward server, a stand-in),
    each read on its own: they take the benchmark's names, so two may name the same reward."""
    from branchdiff.cli.common import yaml_value
    from branchdiff.rewards.combine import parse_reward_specs

    if isinstance(given, str) and given.lstrip().startswith(("[", "{")):
        given = yaml_value(given)
    entries = given.split(",") if isinstance(given, str) else given if isinstance(given, list) else [given]
    specs = [(reward_specs_from_text(entry) if isinstance(entry, str) else parse_reward_specs(entry))[0] for entry in entries if entry]
    if len(specs) != len(expected):
        raise UserError(f"--rewards with --benchmark {name}: give {len(expected)} reward(s), one per score in its order "
                        f"({', '.join(expected)}), e.g. to pass a weight's path: '[{{name: {expected[0]}, kwargs: {{...}}}}]'; got {len(specs)}")
    return specs


def _benchmark_table(args: argparse.Namespace, chosen: Benchmark, protocol: Protocol | None, result: EvalResult, settings: EvalSettings) -> dict:
    """The benchmark's table printed in its papers' layout (with --compare, the paper's rows beside ours); returned for the JSON."""
    from branchdiff.evaluation.paper_tables import benchmark_row, format_table, paper_rows

    metadata = result.prompt_set.metadata
    indices = result.prompt_index.tolist()
    scores = {name: values.tolist() for name, values in result.scores.items()}
    ours = benchmark_row(chosen, scores, [metadata[i].get("tag", "") for i in indices], [metadata[i].get("style", "") for i in indices])
    label = f"{settings.family}" + (f" + {Path(args.weights).name}" if args.weights else " (base)")
    compare = paper_rows(args.benchmark, args.compare) if args.compare else None
    print(f"\n{args.benchmark}: " + (f"the protocol of {protocol.paper}" if protocol else
                                      f"no paper's protocol for the {settings.family} family: its own settings") +
          f" ({settings.steps} steps, guidance {settings.guidance}, {settings.images_per_prompt} images a prompt)")
    print(format_table(chosen, ours, label, compare))
    differ = [] if protocol is None else [f"{key} {getattr(settings, key)} (protocol: {getattr(protocol, key).value})"
                                          for key in ("steps", "guidance", "images_per_prompt", "solver")
                                          if getattr(protocol, key).value is not None and getattr(settings, key) != getattr(protocol, key).value]
    if differ:
        print("differs from the protocol: " + ", ".join(differ))
    return {"benchmark": args.benchmark, "about": chosen.about, "columns": [list(column) for column in chosen.columns], "label": label,
            "table": ours, "protocol": None if protocol is None else asdict(protocol),
            "differs_from_protocol": differ, "compare": None if compare is None else {"paper": args.compare, **asdict(compare)}}
