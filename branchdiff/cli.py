"""`branchdiff train | sample | eval | bench | rewards`: parse, call, print.

Bad input ends with one line `branchdiff: error: ...` on stderr and exit status 2 (argparse's own
errors too, without its usage block; `--debug` shows the traceback instead); Ctrl-C exits with 130
(`train`: after a checkpoint). Nothing already written (checkpoints, metrics) is touched before the
configuration has been validated. Every case is listed in docs/errors.md.
"""

from __future__ import annotations

import argparse
import json
import os
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
                                epilog="presets: see branchdiff/configs/; keys: see branchdiff/config.py")
    train.add_argument("config", nargs="?", default=None, help=f"preset name or YAML file (default: {DEFAULT_PRESET})")
    train.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. tree.roots=4")
    train.add_argument("--resume", default=None, help="'latest' or a checkpoint directory of this run")

    for name, help_text in (("sample", "write PNGs for a prompt"), ("eval", "generate on a prompt set and score with rewards")):
        sub = commands.add_parser(name, help=help_text)
        sub.add_argument("--lora", default=None, help="LoRA directory or .safetensors of a run (default: the base model)")
        _model_arguments(sub)
        sub.add_argument("--steps", type=int, default=10, help="ODE sampling steps")
        sub.add_argument("--shift", type=float, default=None, help="σ schedule shift s (default: the family's own schedule)")
        sub.add_argument("--guidance", type=float, default=None, help="CFG scale, or FLUX's guidance embedding (default: the family's)")
        sub.add_argument("--images-per-prompt", "--seeds", dest="images_per_prompt", type=int, default=4, help="images per prompt (fixed seeds)")
        if name == "sample":
            sub.add_argument("--prompt", required=True, action="append", help="prompt (repeatable)")
            sub.add_argument("--out", type=Path, required=True, help="output directory")
        else:
            sub.add_argument("--prompts", default="tiny:held_out", help="tiny:held_out, hpdv2[:style], or a .txt / .jsonl / .csv file")
            sub.add_argument("--rewards", default="tiny-geneval",
                             help="comma-separated names, dotted paths or server URLs, or the config's form '[{name: hpsv2.1, kwargs: {checkpoint: PATH}}]'")
            sub.add_argument("--seed", type=int, default=1234, help="noise seed (the same for base and LoRA)")
            sub.add_argument("--device", default="cpu", help="device of the rewards")
            sub.add_argument("--out", type=Path, default=None, help="output directory (default: eval-<lora name or base>)")
            sub.add_argument("--json", type=Path, default=None, help="also write the summary to this JSON file")

    rewards = commands.add_parser("rewards", help="list rewards, or check that one carries signal")
    which = rewards.add_subparsers(dest="rewards_command", required=True)
    which.add_parser("list", help="built-in and installed rewards, what each needs and where its weights come from")
    check = which.add_parser("check", help="sample groups from the model and print the reward's scale and spread")
    check.add_argument("name", help="registered name, entry point or dotted path 'package.module:Name'")
    check.add_argument("--prompts", default="tiny:held_out", help="prompt source (tiny:held_out, a .txt file, ...)")
    check.add_argument("--num-prompts", type=int, default=8, help="prompts sampled from the source")
    check.add_argument("--group-size", type=int, default=8, help="samples per prompt (a GRPO group)")
    _model_arguments(check)
    check.add_argument("--steps", type=int, default=10, help="SDE sampling steps")
    check.add_argument("--device", default="cpu", help="device of the reward")
    check.add_argument("--kwargs", default=None, help="keyword arguments of the reward, a YAML mapping: '{checkpoint: PATH}'")

    serve = commands.add_parser("serve-reward", help="serve a reward over HTTP (docs/reward-server.md)")
    serve.add_argument("name", help="registered name, entry point or dotted path 'package.module:Name'")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: this machine only)")
    serve.add_argument("--port", type=int, default=8765, help="port to listen on")
    serve.add_argument("--device", default="cpu", help="device of the reward's model")
    serve.add_argument("--kwargs", default=None, help="keyword arguments of the reward, a YAML mapping: '{checkpoint: PATH}'")

    accel = commands.add_parser("accelerate-config", help="print the path of a packaged accelerate config (for --config_file)")
    accel.add_argument("name", nargs="?", default=None, help="single-gpu | multi-gpu | multi-node (none: list them)")

    bench = commands.add_parser("bench", help="side-by-side benchmarks")
    bench.add_argument("which", choices=["tree", "explore", "curves"], help="what to benchmark")
    bench.add_argument("--json", type=Path, default=None, help="write the table and ratios to this JSON file")
    bench.add_argument("--repeats", type=int, default=3, help="timed repeats of each variant (median reported)")
    bench.add_argument("--minutes", type=float, default=2.0, help="curves: training wall time of each variant and seed")
    bench.add_argument("--seeds", type=int, default=3, help="curves: seeds of each variant")
    bench.add_argument("--out", type=Path, default=Path("docs"), help="curves: folder of the plot and the table")

    report = commands.add_parser("report", help="(re)build RUN_DIR/report.html from a run's metrics, evaluations and samples")
    report.add_argument("run_dir", type=Path, help="a run directory (output_dir of branchdiff train)")
    return parser


def _model_arguments(sub: argparse.ArgumentParser) -> None:
    from branchdiff.models.families import FAMILIES

    sub.add_argument("--family", default="tiny", choices=list(FAMILIES), help="model family (default: tiny)")
    sub.add_argument("--model", default=None, help="diffusers pipeline directory or hub id (default: the built-in tiny model)")
    sub.add_argument("--resolution", type=int, default=None, help="image side in pixels (default: the family's)")
    sub.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="weights' dtype")


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


def _load(args: argparse.Namespace, device: str | object = "cpu"):
    import torch

    from branchdiff.models import load_adapter

    adapter = load_adapter(args.family, args.model, device, args.resolution, getattr(torch, args.dtype))
    if getattr(args, "lora", None):
        adapter.load_lora(args.lora)
    return adapter


def cmd_sample(args: argparse.Namespace) -> None:
    from branchdiff.evaluate import sample_ode
    from torchvision.utils import save_image

    images, prompts = sample_ode(_load(args), args.prompt, args.images_per_prompt, args.steps, args.shift, guidance=args.guidance)
    args.out.mkdir(parents=True, exist_ok=True)
    for index, (image, prompt) in enumerate(zip(images, prompts)):
        path = args.out / f"{index:03d}-{prompt.replace(' ', '_')[:60]}.png"
        save_image(image, path)
        print(path)


def cmd_eval(args: argparse.Namespace) -> None:
    """Shards prompts over the processes of `accelerate launch` (each takes every P-th prompt) and
    gathers once; the main process prints and writes."""
    from accelerate import PartialState

    from branchdiff.data import load_prompt_set
    from branchdiff.evaluate import evaluate, format_summary, gather_results, write_outputs
    from branchdiff.rewards.multi import build_component

    state = PartialState(cpu=args.device == "cpu")
    prompt_set = load_prompt_set(args.prompts)
    specs = _reward_specs(args.rewards)
    rewards = {spec.label: build_component(spec, args.device) for spec in specs}
    out = args.out or Path("eval-" + Path(args.lora or "base").stem)
    result = evaluate(_load(args, state.device), prompt_set, rewards, args.images_per_prompt, args.steps, args.shift, args.seed,
                      state.process_index, state.num_processes, progress=state.is_local_main_process, out_dir=out, guidance=args.guidance)
    result = gather_results(result, state)
    state.wait_for_everyone()  # every process's images are on disk before the grid reads them
    if not state.is_main_process:
        return
    out.mkdir(parents=True, exist_ok=True)
    scales = {label: getattr(reward, "scale", "unspecified") for label, reward in rewards.items()}
    extra = {"family": args.family, "model": args.model or "built-in tiny", "lora": args.lora, "steps": args.steps, "seed": args.seed,
             "shift": args.shift, "guidance": args.guidance}
    summary = write_outputs(result, out, scales, extra)
    print(f"{prompt_set.name}: {len(prompt_set.prompts)} prompts × {args.images_per_prompt} images, "
          f"{'LoRA ' + args.lora if args.lora else 'base model'}; images, scores.csv, grid.png in {out}/")
    print(format_summary(summary["summary"]))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))


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
        bench_tree(args.json, args.repeats)
    elif args.which == "explore":
        bench_explore(args.json)
    else:
        from branchdiff.bench_curves import bench_curves

        bench_curves(args.minutes, args.seeds, args.json, args.out)


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

    reward = build_reward(args.name, args.device, _kwargs(args.kwargs))
    prompt_set = load_prompt_set(args.prompts)
    prompts, metadata = prompt_set.prompts[: args.num_prompts], prompt_set.metadata[: args.num_prompts]
    sde = "ddim" if FAMILIES[args.family].steps == "ddim" else "flow"
    stats = check_reward(_load(args), reward, prompts, metadata, args.name, args.group_size, args.steps, sde=sde)
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
        if args.command == "train" and all("=" in item and not item.startswith("-") for item in extra):
            args.overrides = [*args.overrides, *extra]  # overrides may also follow --resume
        elif extra:
            raise UsageError(f"{args.command}: unrecognized arguments: {' '.join(extra)}; see branchdiff {args.command} --help")
    except UsageError as error:
        print(f"branchdiff: error: {error}", file=sys.stderr)
        return 2
    from branchdiff.config import ConfigError
    from branchdiff.errors import UserError
    from branchdiff.rewards.multi import RewardError
    from branchdiff.rewards.remote import RemoteRewardError

    try:
        {"train": cmd_train, "sample": cmd_sample, "eval": cmd_eval, "bench": cmd_bench, "rewards": cmd_rewards,
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
    return 0


def _one_line(error: BaseException) -> str:
    """The error's message on one line; an OSError names its file (`[Errno 28] ...: 'path'`)."""
    if isinstance(error, OSError) and not isinstance(error, FileNotFoundError) and error.strerror:
        where = f": {error.filename}" if error.filename else ""
        return f"{error.strerror}{where} ({type(error).__name__}); free space or fix the path's permissions and run again"
    return " ".join(str(error).split())


if __name__ == "__main__":
    sys.exit(main())
