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


def cmd_bench(args: argparse.Namespace) -> None:
    """Run the benchmark named with its own options (branchdiff/cli/parser.py gives each only those)."""
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

        try:
            thresholds = [float(item) for item in args.thresholds.split(",") if item]
        except ValueError:
            raise UserError(f"bench cache --thresholds {args.thresholds}: give comma-separated numbers, e.g. 0.1,0.2") from None
        bench_cache(args.json, thresholds, args.draws, args.first_draw, args.repeats, args.task, args.overrides)
    elif args.which == "search" and args.sampler:
        if args.task is not None or args.first_seed:
            option = "--task" if args.task is not None else "--first-seed"
            raise UserError(f"bench search: {option} is an option of bench search's best-reward benchmark, not of --sampler (its testbeds and "
                            "seeds 0..n−1); leave one of them out")
        from branchdiff.bench.sampler import bench_sampler, parse_testbeds

        given = {} if args.temperature is None else {"temperature": args.temperature}
        if args.testbeds is not None:
            given["testbeds"] = parse_testbeds(args.testbeds)
        bench_sampler(args.images, args.seeds, args.json, args.out, samplers=_variants(args.variants), **given)
    elif args.which == "search":
        for option, value, what in (("--temperature", args.temperature, "λ of the reward-tilted target"), ("--testbeds", args.testbeds, "the mixtures")):
            if value is not None:
                raise UserError(f"bench search: {option} is {what} of bench search --sampler; add --sampler or leave {option} out")
        from branchdiff.bench.search import bench_search

        bench_search(args.images, args.seeds, args.json, args.out, _variants(args.variants), task=args.task or "tiny", first_seed=args.first_seed)
    elif args.merge:
        from branchdiff.bench.curves import merge_results

        merge_results([Path(item) for item in args.merge.split(",") if item], args.out, args.json,
                      args.reference if args.reference != "chain" else None)
    else:
        from branchdiff.bench.curves import bench_curves

        bench_curves(args.minutes, args.seeds, args.json, args.out, args.points, _variants(args.variants), args.eval_images, args.overrides,
                     args.clock, args.reference, args.task, args.first_seed)


def _variants(text: str | None) -> list[str] | None:
    """`--variants a,b`: the names given, each with its overrides where it has any (None: every variant)."""
    from branchdiff.bench.curves import split_variants

    return split_variants(text) if text else None


def cmd_report(args: argparse.Namespace) -> None:
    from branchdiff.report.run_report import write_report

    print(write_report(args.run_dir))
