"""`branchdiff accelerate-config`, `branchdiff bench` and `branchdiff report`: the packaged accelerate
configs, the side-by-side benchmarks, and a run's report rebuilt."""

from __future__ import annotations

import argparse
from pathlib import Path

from branchdiff.errors import UserError

ACCELERATE_DIR = Path(__file__).parents[1] / "configs" / "accelerate"


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
    path = ACCELERATE_DIR / f"{args.name}.yaml"
    if args.name == "multi-node":
        path = _scheduled(path) or path
    print(path)


def _scheduled(packaged: Path) -> Path | None:
    """Inside a SLURM job: a copy of the multi-node config with the job's machine count, this node's rank, the first node's
    address and the process count filled in (branchdiff/runtime/cluster.py), in the temporary folder, one per job and
    node; None outside one (the packaged file, to edit or override with accelerate launch's own flags)."""
    import os
    import sys
    import tempfile

    from branchdiff.runtime import storage
    from branchdiff.runtime.cluster import fill_config, slurm_launch

    if not (os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")):
        return None
    gpus = 0
    if not (os.environ.get("SLURM_GPUS_ON_NODE") or os.environ.get("SLURM_GPUS_PER_NODE")):
        import torch

        gpus = torch.cuda.device_count()
    launch = slurm_launch(os.environ, gpus)
    assert launch is not None  # a node list was there
    filled = Path(tempfile.gettempdir()) / f"branchdiff-multi-node-{os.environ.get('SLURM_JOB_ID', 'job')}-{launch.machine_rank}.yaml"
    storage.write_text(filled, fill_config(packaged.read_text(), launch))
    print(f"branchdiff: multi-node from SLURM: {launch.num_machines} machines, {launch.num_processes} processes in all, this machine's rank "
          f"{launch.machine_rank}, rendezvous at {launch.main_process_ip}:{launch.main_process_port}", file=sys.stderr)
    return filled


BENCH_OUT = Path("runs")  # `--out` unset: runs/bench-<name>/ (a benchmark writes into docs/ only when named there)


def cmd_bench(args: argparse.Namespace) -> None:
    """Run the benchmark named with its own options (branchdiff/cli/parser.py gives each only those), once its inputs and
    the files it will write are checked: nothing runs for minutes to fail on its last line."""
    _check_bench_inputs(args)
    if args.which == "tree":
        from branchdiff.bench.iteration import bench_tree

        bench_tree(args.json, args.repeats, args.overrides, _variants(args.variants))
    elif args.which == "explore":
        from branchdiff.bench.iteration import bench_explore

        bench_explore(args.json, extra_overrides=args.overrides)
    elif args.which == "reward-server":
        from branchdiff.bench.reward_server import bench_reward_server

        bench_reward_server(args.json)
    elif args.which == "overlap":
        from branchdiff.bench.overlap import bench_overlap, bench_replicas

        if args.replicas:
            bench_replicas(args.json, args.replicas, args.iterations, args.overrides)
        else:
            bench_overlap(args.json, args.iterations, args.overrides)
    elif args.which == "cache":
        from branchdiff.bench.block_cache import bench_cache

        bench_cache(args.json, _thresholds(args.thresholds), args.draws, args.first_draw, args.repeats, args.task, args.overrides)
    elif args.which == "search" and args.sampler:
        given_options = [option for option, value in (("--task", args.task is not None), ("--first-seed", args.first_seed),
                                                      ("--target-seed", args.target_seed is not None), ("--prices", args.prices is not None)) if value]
        if given_options:
            raise UserError(f"bench search: {given_options[0]} is an option of bench search's best-reward benchmark, not of --sampler (its "
                            "testbeds and seeds 0..n−1); leave one of them out")
        from branchdiff.bench.sampler import bench_sampler, parse_testbeds

        given = {} if args.temperature is None else {"temperature": args.temperature}
        if args.testbeds is not None:
            given["testbeds"] = parse_testbeds(args.testbeds)
        bench_sampler(args.images, args.seeds, args.json, args.out, samplers=_variants(args.variants), **given)
    elif args.which == "search":
        for option, value, what in (("--temperature", args.temperature, "λ of the reward-tilted target"), ("--testbeds", args.testbeds, "the mixtures")):
            if value is not None:
                raise UserError(f"bench search: {option} is {what} of bench search --sampler; add --sampler or leave {option} out")
        from branchdiff.bench.search import bench_search, parse_prices

        bench_search(args.images, args.seeds, args.json, args.out, _variants(args.variants), task=args.task or "tiny", first_seed=args.first_seed,
                     target_seed=args.target_seed, prices=None if args.prices is None else parse_prices(args.prices))
    elif args.which == "proxies":
        from branchdiff.bench.proxies import build_proxies

        build_proxies(args.task, _sizes(args.sizes), args.seeds, args.out, args.json, args.steps)
    elif args.which == "hacking":
        _bench_hacking(args)
    elif args.merge is not None:
        given = next((option for option, value in (("--minutes", args.minutes), ("--iterations", args.iterations), ("--clock", args.clock))
                      if value is not None), None)
        if given:
            raise UserError(f"bench curves --merge: {given} sets the budget of a run, and --merge runs nothing (the files keep their "
                            f"own budget); leave {given} out")
        from branchdiff.bench.curves_merge import merge_results

        merge_results(_merged_files(args.merge), args.out, args.json, args.reference)
    else:
        from branchdiff.bench.curves import REFERENCE, SAMPLING_VARIANTS, bench_curves

        names = _variants(args.variants)
        if args.reference is not None and args.reference not in (names or SAMPLING_VARIANTS):
            raise UserError(f"bench curves --reference {args.reference}: not one of the variants run ({', '.join(names or SAMPLING_VARIANTS)}); "
                            "name one of them, or add it to --variants")
        if args.iterations is not None and args.clock is not None:
            raise UserError(f"bench curves --iterations {args.iterations} --clock {args.clock}: an iteration budget has no clock (each run "
                            "records both clocks' minutes anyway); leave --clock out, or give --minutes instead of --iterations")
        budget, clock = (args.iterations, "iterations") if args.iterations is not None else (args.minutes or 2.0, args.clock or "wall")
        bench_curves(budget, args.seeds, args.json, args.out, args.points, names, args.eval_images, args.overrides,
                     clock, args.reference or REFERENCE, args.task, args.first_seed)


def _bench_hacking(args: argparse.Namespace) -> None:
    """`bench hacking`: its runs, or with --merge the files of runs over other seeds."""
    from branchdiff.bench.hacking import bench_hacking, merge_hacking, parse_reward_option, parse_variants

    if args.merge is not None:
        if args.reward is not None:
            raise UserError("bench hacking --merge: --reward names the proxy of a run, and --merge runs nothing (the files keep theirs); "
                            "leave --reward out")
        merge_hacking(_merged_files(args.merge), args.out, args.json)
        return
    if args.reward is None:
        raise UserError("bench hacking needs --reward, the proxy to train on: e.g. --reward '{name: tiny-partial, kwargs: {terms: [count, color]}}' "
                        "or a learned proxy of branchdiff bench proxies (docs/hacking.md)")
    ensemble = [item.strip() for item in (args.ensemble or "").split(",") if item.strip()]
    bench_hacking(parse_reward_option(args.reward), args.iterations, args.seeds, args.json, args.out, args.points, parse_variants(args.variants),
                  ensemble, args.eval_images, args.kl_chains, args.best_of_n, args.overrides, args.task, args.first_seed)


def _sizes(text: str) -> list[int]:
    """`bench proxies --sizes 64,256`: whole numbers of samples, each at least 2."""
    try:
        sizes = [int(item) for item in text.split(",") if item.strip()]
    except ValueError:
        sizes = []
    if not sizes or any(n < 2 for n in sizes):
        raise UserError(f"bench proxies --sizes {text!r}: give comma-separated whole numbers of samples, each at least 2, e.g. 64,256,1024")
    return sizes


def _check_bench_inputs(args: argparse.Namespace) -> None:
    """The options every benchmark shares, checked before it starts: `--json` names a file that can be written (not a folder,
    its nearest existing folder writable: the folders up to it are made), `--out` a folder that can be (unset: runs/bench-<name>)."""
    from branchdiff.evaluation.preflight import check_output_file, check_output_folder

    if "out" in vars(args) and args.out is None:
        args.out = BENCH_OUT / f"bench-{'sampler' if getattr(args, 'sampler', False) else args.which}"
    if args.json is not None:
        check_output_file(args.json, "--json")
    if "out" in vars(args):
        check_output_folder(args.out, "--out")


def _variants(text: str | None) -> list[str] | None:
    """`--variants a,b`: the names given, each with its overrides where it has any (None: the option left out, every variant)."""
    from branchdiff.bench.curves import split_variants

    if text is None:
        return None
    names = split_variants(text)
    if not names:
        raise UserError(f"--variants {text!r} names no variant; give comma-separated names (e.g. --variants chain,mix), or leave --variants "
                        "out for the benchmark's default set")
    return names


def _merged_files(text: str) -> list[Path]:
    """`bench curves --merge a.json,b.json`: the files, at least one, none twice."""
    paths = [Path(item.strip()) for item in text.split(",") if item.strip()]
    if not paths:
        raise UserError(f"bench curves --merge {text!r} names no file; give the JSON results to merge, comma-separated (e.g. --merge "
                        "seeds-0-2.json,seeds-3-4.json)")
    return paths


def _thresholds(text: str) -> list[float]:
    """`bench cache --thresholds 0.1,0.3`: one or more numbers (their range is the benchmark's to check)."""
    try:
        thresholds = [float(item) for item in text.split(",") if item.strip()]
    except ValueError:
        raise UserError(f"bench cache --thresholds {text}: give comma-separated numbers, e.g. 0.1,0.2") from None
    if not thresholds:
        raise UserError(f"bench cache --thresholds {text!r} names no threshold; give one or more in (0, 1), e.g. --thresholds 0.1,0.3")
    return thresholds


def cmd_report(args: argparse.Namespace) -> None:
    from branchdiff.report.run_report import write_report

    print(write_report(args.run_dir))
