"""`branchdiff train | sample | eval | bench | rewards`: parse, call, print.

Bad input ends with one line `branchdiff: error: ...` on stderr and exit status 2 (argparse's own
errors too, without its usage block; `--debug` shows the traceback instead); Ctrl-C exits with 130
(`train`: after a checkpoint). Nothing already written (checkpoints, metrics) is touched before the
configuration has been validated. Every case is listed in docs/errors.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from pathlib import Path
from typing import NoReturn

EXAMPLES = """examples:
  branchdiff train                                  # the built-in tiny task, best preset
  branchdiff train tiny-chain iterations=20 output_dir=runs/chain
  branchdiff train my.yaml train.learning_rate=1e-4
  branchdiff train my.yaml iterations=500 --resume latest   # continue, longer
  branchdiff sample --prompt "two red circles on the left" --lora runs/tiny/lora --out samples/
  branchdiff eval --lora runs/tiny/lora --prompts tiny:held_out --rewards tiny-geneval --json eval.json
  branchdiff report runs/tiny-mix                   # rebuild the run's report.html
  branchdiff rewards list                           # what rewards exist, what each needs
  branchdiff rewards check my_pkg.rewards:Sharpness --prompts tiny:held_out
  branchdiff serve-reward hpsv2.1 --port 8765 --device cuda:1   # then reward={remote: http://127.0.0.1:8765}
  accelerate launch --config_file $(branchdiff accelerate-config multi-gpu) -m branchdiff.cli train flux-hps-branch
"""
DEFAULT_PRESET = "tiny-mix"
RUN_DEFAULTS = """defaults: with --lora of a run (RUN/lora, or a checkpoint RUN/checkpoints/iter-N), every option left unset takes
the run's own value from RUN/config.yaml (model, resolution, dtype, steps, shift, eval prompts, images per prompt,
guidance, eval rewards), so `branchdiff eval --lora RUN/lora` reproduces the trained column of the run's final
evaluation (a line names any setting that differs); otherwise the built-in tiny model, 10 steps, tiny:held_out,
8 images per prompt, tiny-geneval."""


class UsageError(Exception):
    """A command-line problem argparse found, described in one line."""


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line naming the subcommand and its --help (no usage block);
    subcommand parsers are of this class too (add_subparsers uses the parent's class)."""

    def error(self, message: str) -> NoReturn:
        command = self.prog.partition(" ")[2]
        raise UsageError(f"{command + ': ' if command else ''}{message}; see {self.prog} --help")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="branchdiff", description="GRPO fine-tuning of text-to-image models on branching SDE trees.",
                     epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)

    train = commands.add_parser("train", help="fine-tune with GRPO", formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=_presets_help())
    train.add_argument("config", nargs="?", default=None, help=f"preset name or YAML file (default: {DEFAULT_PRESET})")
    train.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. tree.roots=4")
    train.add_argument("--resume", default=None, help="'latest' or a checkpoint directory of this run")

    show = commands.add_parser("config", help="print the effective config of a preset or YAML file with overrides (a start for your own YAML)")
    show.add_argument("config", nargs="?", default=None, help=f"preset name or YAML file (default: {DEFAULT_PRESET})")
    show.add_argument("overrides", nargs="*", help="dotted key=value overrides")

    for name, help_text in (("sample", "write PNGs for a prompt"), ("eval", "generate on a prompt set and score with rewards")):
        sub = commands.add_parser(name, help=help_text, epilog=RUN_DEFAULTS if name == "eval" else None,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
        sub.add_argument("--lora", default=None, help="LoRA directory or .safetensors of a run (default: the base model)")
        _model_arguments(sub)
        sub.add_argument("--steps", type=_at_least(1), default=None, help="ODE sampling steps (default: the run's, else 10)")
        sub.add_argument("--shift", type=_finite, default=None, help="σ schedule shift s (default: the family's own schedule)")
        sub.add_argument("--guidance", type=_finite, default=None, help="CFG scale, or FLUX's guidance embedding (default: the family's)")
        sub.add_argument("--images-per-prompt", "--seeds", dest="images_per_prompt", type=_at_least(1), default=None,
                         help="images per prompt (fixed seeds; default: the run's prompts.eval_seeds, else 8)")
        if name == "sample":
            sub.add_argument("--prompt", required=True, action="append", help="prompt (repeatable)")
            sub.add_argument("--out", type=Path, required=True, help="output directory")
        else:
            sub.add_argument("--prompts", default=None, help="tiny:held_out, hpdv2[:style], or a .txt / .jsonl / .csv file (default: the run's prompts.eval)")
            sub.add_argument("--rewards", default=None,
                             help="comma-separated names, dotted paths or server URLs, or the config's form '[{name: hpsv2.1, kwargs: {checkpoint: PATH}}]' "
                                  "(default: the run's eval_rewards, else tiny-geneval)")
            sub.add_argument("--seed", type=_at_least(0), default=None, help="noise seed, the same for base and LoRA (default: 1234, as a run's evaluations)")
            sub.add_argument("--device", default="cpu", help="device of the rewards (cpu, cuda, cuda:1)")
            sub.add_argument("--out", type=Path, default=None, help="output directory (default: eval-<run or lora name, or base>)")
            sub.add_argument("--json", type=Path, default=None, help="also write the summary to this JSON file")

    rewards = commands.add_parser("rewards", help="list rewards, or check that one carries signal")
    which = rewards.add_subparsers(dest="rewards_command", required=True)
    which.add_parser("list", help="built-in and installed rewards, what each needs and where its weights come from")
    check = which.add_parser("check", help="sample groups from the model and print the reward's scale and spread")
    check.add_argument("name", help="registered name, entry point or dotted path 'package.module:Name'")
    check.add_argument("--prompts", default="tiny:held_out", help="prompt source (tiny:held_out, a .txt file, ...)")
    check.add_argument("--num-prompts", type=_at_least(1), default=8, help="prompts sampled from the source")
    check.add_argument("--group-size", type=_at_least(2), default=8, help="samples per prompt (a GRPO group)")
    _model_arguments(check)
    check.add_argument("--steps", type=_at_least(1), default=10, help="SDE sampling steps")
    check.add_argument("--device", default="cpu", help="device of the reward")
    check.add_argument("--kwargs", default=None, help="keyword arguments of the reward, a YAML mapping: '{checkpoint: PATH}'")

    serve = commands.add_parser("serve-reward", help="serve a reward over HTTP (docs/reward-server.md)")
    serve.add_argument("name", help="registered name, entry point or dotted path 'package.module:Name'")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: this machine only)")
    serve.add_argument("--port", type=_at_least(1), default=8765, help="port to listen on")
    serve.add_argument("--device", default="cpu", help="device of the reward's model")
    serve.add_argument("--kwargs", default=None, help="keyword arguments of the reward, a YAML mapping: '{checkpoint: PATH}'")

    accel = commands.add_parser("accelerate-config", help="print the path of a packaged accelerate config (for --config_file)")
    accel.add_argument("name", nargs="?", default=None, help="single-gpu | multi-gpu | multi-node (none: list them)")

    bench = commands.add_parser("bench", help="side-by-side benchmarks")
    bench.add_argument("which", choices=["tree", "explore", "curves"], help="what to benchmark")
    bench.add_argument("--json", type=Path, default=None, help="write the table and ratios to this JSON file")
    bench.add_argument("--repeats", type=_at_least(1), default=3, help="timed repeats of each variant (median reported)")
    bench.add_argument("--minutes", type=_positive, default=2.0, help="curves: training wall time of each variant and seed")
    bench.add_argument("--seeds", type=_at_least(1), default=3, help="curves: seeds of each variant")
    bench.add_argument("--out", type=Path, default=Path("docs"), help="curves: folder of the plot and the table")
    bench.add_argument("--variants", default=None, help="curves: comma-separated variants (default: all: chain, branch, branch_pruned, mix, "
                                                         "explore_seeds, explore_tree)")
    bench.add_argument("--points", type=_at_least(2), default=7, help="curves: evaluations over the budget")
    bench.add_argument("--eval-images", type=_at_least(1), default=4, help="curves: held-out images per prompt at each evaluation")
    bench.add_argument("overrides", nargs="*", help="dotted key=value overrides of every variant, e.g. prompts.per_iteration=2")

    report = commands.add_parser("report", help="(re)build RUN_DIR/report.html from a run's metrics, evaluations and samples")
    report.add_argument("run_dir", type=Path, help="a run directory (output_dir of branchdiff train)")
    for sub in (parser, *commands.choices.values()):
        sub.add_argument("--debug", action="store_true", help="on an error, show the traceback instead of one line")
    return parser


def _presets_help() -> str:
    """`train --help`'s epilog: the packaged presets, each with the first line of its comment."""
    lines = ["presets (branchdiff/configs/; print one with `branchdiff config NAME`):"]
    for path in sorted((Path(__file__).parent / "configs").glob("*.yaml")):
        first = path.read_text().splitlines()[0].lstrip("# ").strip()
        lines.append(f"  {path.stem:<26}{first[:90]}")
    lines += ["", "every key, its type, default and meaning: branchdiff/config.py; bad input ends with one line and exit 2",
              "(docs/errors.md), --debug shows the traceback; runs end by printing where their folder, LoRA and report are"]
    return "\n".join(lines)


def _model_arguments(sub: argparse.ArgumentParser) -> None:
    from branchdiff.models.families import FAMILIES

    sub.add_argument("--family", default=None, choices=list(FAMILIES), help="model family (default: tiny)")
    sub.add_argument("--model", default=None, help="diffusers pipeline directory or hub id (default: the built-in tiny model)")
    sub.add_argument("--resolution", type=_at_least(8), default=None, help="image side in pixels (default: the family's)")
    sub.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"], help="weights' dtype (default: float32)")


def _at_least(low: int):
    """argparse type: an integer ≥ `low`."""
    def whole(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be ≥ {low}, got {value}")
        return value

    return whole


def _finite(text: str) -> float:
    """argparse type: a finite number."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


def _positive(text: str) -> float:
    """argparse type: a finite number > 0."""
    value = _finite(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


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
    from branchdiff.evaluate import format_comparison
    from branchdiff.run import train
    from branchdiff.trainer import Trainer

    try:
        trainer = Trainer(config, resume=args.resume)
    except BaseException:
        if claimed:
            claimed.abandon()
        raise
    train(trainer)
    if not trainer.accelerator.is_main_process:
        return
    if config.final_eval:
        print(f"held-out evaluation ({config.prompts.eval}, {config.prompts.eval_seeds} seeds each, ODE {config.sampling.num_steps} steps):")
        print(format_comparison(trainer.final_evaluation()))
    from branchdiff.run_report import write_report

    print(f"run folder: {run_dir}/\n  LoRA:   {run_dir / 'lora'}/  (pipe.load_lora_weights loads it; branchdiff sample/eval --lora)\n"
          f"  report: {write_report(run_dir)}\n  checkpoints: {trainer.checkpoint_dir}/ (continue with --resume latest)")


def _settings(args: argparse.Namespace):
    """The sampling settings of `sample` / `eval` (branchdiff/eval_settings.py): the options given,
    else the LoRA's run's, else the defaults; a line says where they came from and what differs."""
    from branchdiff.eval_settings import EvalSettings, differences, resolve

    given = {name: getattr(args, name, None) for name in EvalSettings.__dataclass_fields__}
    settings, run, config = resolve(given, getattr(args, "lora", None))
    if run is not None:
        differ = differences(settings, config) if args.command == "eval" else []
        note = ("; differs from the run's final evaluation in " + ", ".join(differ)) if differ else (
            ", as the run's final evaluation" if args.command == "eval" else "")
        print(f"settings of the run {run} (its config.yaml) unless given{note}", file=sys.stderr)
    return settings, run


def cmd_config(args: argparse.Namespace) -> None:
    import yaml

    from branchdiff.config import load_config, to_dict

    source, overrides = _split_train_args(args)
    print(yaml.safe_dump(to_dict(load_config(source or DEFAULT_PRESET, overrides)), sort_keys=False), end="")


def _load(settings, lora: str | None, device: str | object = "cpu"):
    import torch

    from branchdiff.models import load_adapter

    adapter = load_adapter(settings.family, settings.model, device, settings.resolution, getattr(torch, settings.dtype))
    if lora:
        adapter.load_lora(lora)
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
    from torchvision.utils import save_image

    from branchdiff.evaluate import sample_ode

    settings, _ = _settings(args)
    images, prompts = sample_ode(_load(settings, args.lora), args.prompt, settings.images_per_prompt, settings.steps, settings.shift,
                                 guidance=settings.guidance)
    args.out.mkdir(parents=True, exist_ok=True)
    for index, (image, prompt) in enumerate(zip(images, prompts)):
        path = args.out / file_name(index, prompt)
        save_image(image, path)
        print(path)


def cmd_eval(args: argparse.Namespace) -> None:
    """Shards prompts over the processes of `accelerate launch` (each takes every P-th prompt) and
    gathers once; the main process prints and writes."""
    from accelerate import PartialState

    from branchdiff.data import load_prompt_set
    from branchdiff.evaluate import evaluate, format_summary, gather_results, write_outputs
    from branchdiff.rewards.combine import parse_reward_specs
    from branchdiff.rewards.multi import build_component

    _check_device(args.device)
    settings, run = _settings(args)
    state = PartialState(cpu=args.device == "cpu")
    prompt_set = load_prompt_set(settings.prompts)
    specs = _reward_specs(settings.rewards) if isinstance(settings.rewards, str) else parse_reward_specs(settings.rewards)
    rewards = {spec.label: build_component(spec, args.device) for spec in specs}
    out = args.out or Path("eval-" + (run.name if run else Path(args.lora or "base").stem))
    result = evaluate(_load(settings, args.lora, state.device), prompt_set, rewards, settings.images_per_prompt, settings.steps,
                      settings.shift, settings.seed, state.process_index, state.num_processes, progress=state.is_local_main_process,
                      out_dir=out, guidance=settings.guidance)
    result = gather_results(result, state)
    state.wait_for_everyone()  # every process's images are on disk before the grid reads them
    if not state.is_main_process:
        return
    out.mkdir(parents=True, exist_ok=True)
    scales = {label: getattr(reward, "scale", "unspecified") for label, reward in rewards.items()}
    extra = {"family": settings.family, "model": settings.model or "built-in tiny", "lora": args.lora, "steps": settings.steps,
             "seed": settings.seed, "shift": settings.shift, "guidance": settings.guidance}
    summary = write_outputs(result, out, scales, extra)
    print(f"{prompt_set.name}: {len(prompt_set.prompts)} prompts × {settings.images_per_prompt} images, "
          f"{'LoRA ' + args.lora if args.lora else 'base model'}; images, scores.csv, grid.png in {out}/")
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
            print(f"{name:<12}{first}")
        return
    if args.name not in configs:
        raise ValueError(f"no packaged accelerate config {args.name!r}; available: {', '.join(configs)}")
    print(ACCELERATE_DIR / f"{args.name}.yaml")


def cmd_bench(args: argparse.Namespace) -> None:
    from branchdiff.bench import bench_explore, bench_tree

    if args.which == "tree":
        bench_tree(args.json, args.repeats, args.overrides)
    elif args.which == "explore":
        bench_explore(args.json, extra_overrides=args.overrides)
    else:
        from branchdiff.bench_curves import bench_curves

        variants = [name for name in args.variants.split(",") if name] if args.variants else None
        bench_curves(args.minutes, args.seeds, args.json, args.out, args.points, variants, args.eval_images, args.overrides)


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


def _reward_specs(text: str) -> list:
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


def main(argv: list[str] | None = None) -> int:
    """Run a command. Bad input: one line `branchdiff: error: ...`, exit 2 (`--debug` anywhere on the
    command line re-raises with the traceback instead); Ctrl-C: exit 130."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv = [item for item in argv if item != "--debug"]
    parser = _parser()
    try:
        args, extra = parser.parse_known_args(argv)
        if args.command in ("train", "config", "bench") and all("=" in item and not item.startswith("-") for item in extra):
            args.overrides = [*args.overrides, *extra]  # overrides may also follow --resume
        elif extra:
            raise UsageError(f"{args.command}: unrecognized arguments: {' '.join(extra)}; see branchdiff {args.command} --help")
    except UsageError as error:
        print(f"branchdiff: error: {error}", file=sys.stderr)
        return 2
    if not debug:
        _quiet_third_party_logs()
    from branchdiff.config import ConfigError
    from branchdiff.errors import UserError, is_out_of_memory, out_of_memory
    from branchdiff.rewards.multi import RewardError
    from branchdiff.rewards.remote import RemoteRewardError

    try:
        {"train": cmd_train, "config": cmd_config, "sample": cmd_sample, "eval": cmd_eval, "bench": cmd_bench, "rewards": cmd_rewards,
         "accelerate-config": cmd_accelerate_config, "report": cmd_report,
         "serve-reward": cmd_serve_reward}[args.command](args)
    except KeyboardInterrupt as interrupt:
        if debug:
            raise
        print(f"branchdiff: {interrupt or 'interrupted'}", file=sys.stderr)
        return 130
    except (ConfigError, UserError, OSError, ValueError, ImportError, RewardError, RemoteRewardError) as error:
        if debug:
            raise
        print(f"branchdiff: error: {_one_line(error)}", file=sys.stderr)
        return 2
    except (MemoryError, RuntimeError) as error:
        if debug or not is_out_of_memory(error):
            raise
        line = out_of_memory(error, f"in branchdiff {args.command}", "use a smaller batch (fewer images per prompt or prompts), a smaller "
                             "--resolution, --dtype bfloat16, or a device with more memory")
        print(f"branchdiff: error: {_one_line(line)}", file=sys.stderr)
        return 2
    return 0


NOISY_LOGGERS = ("torch.utils._pytree", "bitsandbytes", "diffusers.quantizers")  # import-time notices about optional kernels


def _quiet_third_party_logs() -> None:
    """Hold back the notices optional dependencies print when they are imported (a missing optional
    kernel, a deprecated registration): they are not the user's to fix. `--debug` shows them."""
    import logging

    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)


def _one_line(error: BaseException) -> str:
    """The error's message on one line of at most `errors.MAX_LINE` characters; an OSError names its
    file (`[Errno 28] ...: 'path'`)."""
    from branchdiff.errors import bounded

    if isinstance(error, OSError) and not isinstance(error, FileNotFoundError) and error.strerror:
        where = f": {error.filename}" if error.filename else ""
        return bounded(f"{error.strerror}{where} ({type(error).__name__}); free space or fix the path's permissions and run again")
    return bounded(" ".join(str(error).split()))


if __name__ == "__main__":
    sys.exit(main())
