"""What each `branchdiff` command does, once branchdiff/cli.py has parsed its arguments: validate,
call the library, print. Each `cmd_<name>(args)` raises the library's one-line errors; `cli.main`
prints them."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from branchdiff.cli import DEFAULT_PRESET

if TYPE_CHECKING:
    from branchdiff.eval_settings import EvalSettings
    from branchdiff.models.base import ModelAdapter


def _split_train_args(args: argparse.Namespace) -> tuple[str | None, list[str]]:
    """argparse puts a first `key=value` into `config`; move it back to the overrides."""
    if args.config and "=" in args.config:
        return None, [args.config, *args.overrides]
    return args.config, list(args.overrides)


def cmd_train(args: argparse.Namespace) -> None:
    """Validate everything, claim the run directory (the first process), load, train, evaluate,
    and say where the results are. A failure before the first file is written leaves no folder behind."""
    from branchdiff.config import load_config
    from branchdiff.preflight import check_inputs
    from branchdiff.run_dir import claim

    source, overrides = _split_train_args(args)
    config = load_config(source or DEFAULT_PRESET, overrides)
    check_inputs(config)  # rewards and prompt sources, before anything is created
    run_dir = Path(config.output_dir)
    first_process = int(os.environ.get("RANK", "0")) == 0
    claimed = claim(run_dir, resume=bool(args.resume)) if first_process else None
    from branchdiff import checkpoint
    from branchdiff.distributed import disconnect
    from branchdiff.evaluate import format_comparison
    from branchdiff.run import train
    from branchdiff.trainer import Trainer
    from branchdiff.watchdog import explain_failure

    try:
        trainer = Trainer(config, resume=args.resume)
    except BaseException as error:
        if claimed:
            claimed.abandon()
        explained = explain_failure(error, checkpoint.newest(run_dir / "checkpoints"))  # a rank lost before the watch began
        if explained is None:
            raise
        raise explained from None
    train(trainer)
    comparison = trainer.final_evaluation() if config.final_eval else None  # every process samples its share
    disconnect(trainer.accelerator)
    if not trainer.accelerator.is_main_process:
        return
    if comparison is not None:
        print(f"held-out evaluation ({config.prompts.eval}, {config.prompts.eval_seeds} seeds each, ODE {config.sampling.num_steps} steps):")
        print(format_comparison(comparison))
    from branchdiff.run_report import write_report
    from branchdiff.sharding import plain_class

    how = ("pipe.load_lora_weights loads it" if trainer.finetune.export_name == "lora" else
           f"{plain_class(trainer.adapter.denoiser).__name__}.from_pretrained loads it")
    print(f"run folder: {run_dir}/\n  weights: {run_dir / trainer.finetune.export_name}/  ({how}; "
          f"branchdiff sample/eval --weights {run_dir})\n"
          f"  report: {write_report(run_dir)}\n  checkpoints: {trainer.checkpoint_dir}/ (continue with --resume latest)")


def _settings(args: argparse.Namespace) -> tuple[EvalSettings, Path | None]:
    """The sampling settings of `sample` / `eval` (branchdiff/eval_settings.py): the options given,
    else the LoRA's run's, else the defaults; a line says where they came from and what differs."""
    from branchdiff.eval_settings import EvalSettings, differences, resolve

    given = {name: getattr(args, name, None) for name in EvalSettings.__dataclass_fields__}
    settings, run, config = resolve(given, getattr(args, "weights", None))
    if run is not None:
        differ = differences(settings, config) if args.command == "eval" else []
        note = ("; differs from the run's final evaluation in " + ", ".join(differ)) if differ else (
            ", as the run's final evaluation" if args.command == "eval" else "")
        print(f"settings of the run {run} (its config.yaml) unless given{note}", file=sys.stderr)
    return settings, run


def cmd_config(args: argparse.Namespace) -> None:
    """Print the effective config of a preset or YAML file with overrides, as YAML."""
    import yaml

    from branchdiff.config import load_config, to_dict

    source, overrides = _split_train_args(args)
    print(yaml.safe_dump(to_dict(load_config(source or DEFAULT_PRESET, overrides)), sort_keys=False), end="")


def _load(settings: EvalSettings, weights: str | None, device: str | object = "cpu") -> ModelAdapter:
    """The model the settings name, with a run's trained weights loaded when given (`finetune.load_weights`)."""
    import torch

    from branchdiff.models import load_adapter
    from branchdiff.models.families import FAMILIES

    if not settings.prompt_instruction and not FAMILIES[settings.family].instruction:
        raise ValueError(f"--no-prompt-instruction applies to families whose prompts carry an instruction (sana), not {settings.family}")
    adapter = load_adapter(settings.family, settings.model, device, settings.resolution, getattr(torch, settings.dtype),
                           instruction=settings.prompt_instruction)
    if weights:
        from branchdiff.finetune import load_weights

        load_weights(adapter, weights)
    return adapter


def _check_device(device: str) -> None:
    """Refuse a CUDA device on a machine without one, before anything loads."""
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: no CUDA device is visible here (torch.cuda.is_available() is False); use --device cpu")


def file_name(index: int, prompt: str) -> str:
    """A sample's file name from its index and prompt: letters, digits, '-' and '_' only, ≤ 60 of them."""
    slug = re.sub(r"[^A-Za-z0-9_-]+", "_", prompt).strip("_")[:60] or "prompt"
    return f"{index:03d}-{slug}.png"


def cmd_sample(args: argparse.Namespace) -> None:
    """ODE samples of each prompt, one PNG each, named by `file_name`; with `--search`, each prompt's
    best images of a search and OUT/search.json; with `--from-trace`, a trace's best images regrown."""
    from torchvision.utils import save_image

    from branchdiff.eval_settings import EVAL_RUN_SEED

    if args.from_trace is None and not args.prompt:
        raise ValueError("sample needs --prompt (or --from-trace OUT/search.json to regrow a search's best images)")
    if (args.search or args.from_trace is not None) and args.solver == "release":
        raise ValueError("--solver release samples the model's own ODE; a search grows SDE trees with branchdiff's steps: "
                         "leave --solver unset with --search or --from-trace")
    if args.search and args.budget is None:
        raise ValueError(f"--search {args.search} needs --budget: the network rows to spend per prompt (a {args.steps or 10}-step image costs "
                         f"{args.steps or 10}, twice that under CFG)")
    settings, _ = _settings(args)
    seed = EVAL_RUN_SEED if args.seed is None else args.seed
    args.out.mkdir(parents=True, exist_ok=True)
    if args.from_trace is not None or args.search:
        from branchdiff.search.command import regrow_trace, search_and_write

        adapter = _load(settings, args.weights)
        written = (regrow_trace(adapter, args.from_trace, args.weights, args.out) if args.from_trace is not None else
                   search_and_write(adapter, args, settings, seed))
        for path in written:
            print(path)
        return
    from branchdiff.evaluate import sample_ode

    images, prompts = sample_ode(_load(settings, args.weights), args.prompt, settings.images_per_prompt, settings.steps, settings.shift,
                                 seed=seed, guidance=settings.guidance, solver=settings.solver)
    for index, (image, prompt) in enumerate(zip(images, prompts)):
        path = args.out / file_name(index, prompt)
        save_image(image, path)
        print(path)


def cmd_eval(args: argparse.Namespace) -> None:
    """Shards prompts over the processes of `accelerate launch` (each takes every P-th prompt) and
    gathers once; the main process prints and writes."""
    from accelerate import PartialState

    from branchdiff.data import load_prompt_set
    from branchdiff.distributed import disconnect
    from branchdiff.evaluate import evaluate, format_summary, gather_results, write_outputs
    from branchdiff.rewards.combine import parse_reward_specs
    from branchdiff.rewards.multi import build_component

    _check_device(args.device)
    settings, run = _settings(args)
    state = PartialState(cpu=args.device == "cpu")
    prompt_set = load_prompt_set(settings.prompts)
    specs = reward_specs_from_text(settings.rewards) if isinstance(settings.rewards, str) else parse_reward_specs(settings.rewards)
    rewards = {spec.label: build_component(spec, args.device) for spec in specs}
    out = args.out or Path("eval-" + (run.name if run else Path(args.weights or "base").stem))
    result = evaluate(_load(settings, args.weights, state.device), prompt_set, rewards, settings.images_per_prompt, settings.steps,
                      settings.shift, settings.seed, state.process_index, state.num_processes, progress=state.is_local_main_process,
                      out_dir=out, guidance=settings.guidance, solver=settings.solver)
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
        from branchdiff import storage

        storage.write_text(args.json, json.dumps(summary, indent=1))


ACCELERATE_DIR = Path(__file__).parent / "configs" / "accelerate"


def cmd_accelerate_config(args: argparse.Namespace) -> None:
    """The path of a packaged accelerate config, or the list of them with their first comment line."""
    configs = sorted(p.stem for p in ACCELERATE_DIR.glob("*.yaml"))
    if args.name is None:
        for name in configs:
            first = (ACCELERATE_DIR / f"{name}.yaml").read_text().splitlines()[0].lstrip("# ")
            print(f"{name:<14}{first}")
        return
    if args.name not in configs:
        raise ValueError(f"no packaged accelerate config {args.name!r}; available: {', '.join(configs)}")
    print(ACCELERATE_DIR / f"{args.name}.yaml")


def cmd_bench(args: argparse.Namespace) -> None:
    from branchdiff.bench import bench_explore, bench_tree

    variants = [name for name in args.variants.split(",") if name] if args.variants else None
    if args.which == "tree":
        bench_tree(args.json, args.repeats, args.overrides, variants)
    elif args.which == "explore":
        bench_explore(args.json, extra_overrides=args.overrides)
    elif args.which == "search":
        from branchdiff.bench_search import bench_search

        bench_search(args.images, args.seeds, args.json, args.out, variants)
    else:
        from branchdiff.bench_curves import bench_curves

        bench_curves(args.minutes, args.seeds, args.json, args.out, args.points, variants, args.eval_images, args.overrides, args.clock,
                     args.reference)


def cmd_report(args: argparse.Namespace) -> None:
    from branchdiff.run_report import write_report

    print(write_report(args.run_dir))


def _yaml_value(text: str):
    from branchdiff.typed_yaml import parse_override

    return parse_override(f"value={text}")[1]


def _kwargs(text: str | None) -> dict:
    """`--kwargs '{checkpoint: /models/HPS_v2.1_compressed.pt}'`: keyword arguments of a reward."""
    value = _yaml_value(text) if text else {}
    if not isinstance(value, dict):
        raise ValueError(f"--kwargs {text!r} must be a YAML mapping, e.g. '{{checkpoint: /models/HPS_v2.1_compressed.pt}}'")
    return value


def reward_specs_from_text(text: str) -> list:
    """`--rewards a,b,http://host:port` or the config's form, `'[{name: hpsv2.1, kwargs: {checkpoint: ...}}]'`."""
    from branchdiff.rewards.combine import RewardSpec, parse_reward_specs

    if text.lstrip().startswith(("[", "{")):
        return parse_reward_specs(_yaml_value(text))
    names = [name for name in text.split(",") if name]
    specs = parse_reward_specs(names)
    return [RewardSpec(remote=spec.name) if spec.name.startswith(("http://", "https://")) else spec for spec in specs]


def cmd_rewards(args: argparse.Namespace) -> None:
    from branchdiff.rewards.registry import available, build_reward

    if args.rewards_command == "list":
        rows = available()
        columns = ("name", "source", "needs", "status", "weights")
        widths = {c: max(len(c), *(len(row[c]) for row in rows)) for c in columns}
        print("  ".join(c.ljust(widths[c]) for c in columns))
        for row in rows:
            print("  ".join(row[c].ljust(widths[c]) for c in columns))
        return
    from branchdiff.data import load_prompt_set
    from branchdiff.models.families import FAMILIES
    from branchdiff.signal_check import check_reward

    _check_device(args.device)
    reward = build_reward(args.name, args.device, _kwargs(args.kwargs))
    prompt_set = load_prompt_set(args.prompts)
    prompts, metadata = prompt_set.prompts[: args.num_prompts], prompt_set.metadata[: args.num_prompts]
    settings, _ = _settings(args)
    sde = "ddim" if FAMILIES[settings.family].steps == "ddim" else "flow"
    stats = check_reward(_load(settings, None), reward, prompts, metadata, args.name, args.group_size, settings.steps, sde=sde)
    print(f"reward {args.name!r}, scale: {getattr(reward, 'scale', 'unspecified')}; {stats['images']} images "
          f"({len(prompts)} prompts × {args.group_size}) from {args.prompts}")
    for key in ("min", "mean", "max", "within_group_std", "between_prompt_std", "zero_spread_fraction", "seconds_per_image",
                "nonfinite", "groups_dropped"):
        print(f"  {key:<22}{stats[key]:.4g}")
    if stats["zero_spread_fraction"] > 0.5 or stats["within_group_std"] < 1e-6:
        print("  weak signal: most groups score all their samples alike; GRPO learns nothing from those groups")


def cmd_serve_reward(args: argparse.Namespace) -> None:
    from branchdiff.rewards.registry import build_reward
    from branchdiff.rewards.server import serve

    _check_device(args.device)
    serve(build_reward(args.name, args.device, _kwargs(args.kwargs)), args.host, args.port)
