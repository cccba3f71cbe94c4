"""`branchdiff plan PRESET [overrides]`: the memory a run needs per process, phase by phase, whether it
fits the GPU and the smallest change that makes it fit; rows, FLOPs and a modelled time per
iteration. Nothing loads: every network is built on the meta device (docs/plan.md)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from branchdiff.errors import UserError


def target_from_args(args: argparse.Namespace):
    """The processes, sharding and GPU of the command line (a named GPU, its memory overridden by --gpu-memory)."""
    from dataclasses import replace

    from branchdiff.plan.clock import GPUS
    from branchdiff.plan.estimate import SHARDING, Target

    if args.gpu is not None and args.gpu not in GPUS:
        raise UserError(f"--gpu {args.gpu}: not a GPU plan knows; choose one of {', '.join(GPUS)}, or give --gpu-memory GB")
    if args.sharding not in SHARDING:
        raise UserError(f"--sharding {args.sharding}: choose one of {', '.join(SHARDING)}")
    if args.sharding != "none" and args.gpus < 2:
        raise UserError(f"--sharding {args.sharding} with --gpus {args.gpus}: sharding needs two or more processes; give --gpus N (N ≥ 2)")
    gpu = GPUS[args.gpu] if args.gpu else None
    if args.gpu_memory is not None:
        gpu = replace(gpu or GPUS["h100-80gb"], name=f"{(gpu.name if gpu else 'GPU')} with {args.gpu_memory:g} GB", memory=args.gpu_memory * 2**30)
    if args.nodes > args.gpus or args.gpus % args.nodes:
        raise UserError(f"--nodes {args.nodes} with --gpus {args.gpus}: the processes are spread evenly over the machines; give --gpus a multiple "
                        "of --nodes (e.g. --gpus 16 --nodes 2)")
    return Target(args.gpus, args.sharding, gpu, args.gpu_tflops, args.utilisation, args.nodes)


def format_plan(name: str, plan) -> str:
    from branchdiff.plan.estimate import GIB, RESERVE

    g = lambda x: f"{x / GIB:.1f}"
    s = plan.settings
    lines = [f"{name}: {plan.label} ({'published config' if plan.source == 'published' else plan.source}), "
             f"{s['processes']} process{'es' if s['processes'] > 1 else ''} on {plan.gpu} ({g(plan.capacity)} GiB each)",
             f"settings: {s['dtype']}, autocast {s['mixed_precision']}, {s['finetune']} fine-tuning, checkpointing "
             f"{'on' if s['gradient_checkpointing'] else 'off'}, offload {'on' if s['offload'] else 'off'}, {s['optimizer']}, "
             f"max_batch {s['max_batch']}, minibatch {s['minibatch']}, {'x'.join(map(str, s['size'][1:]))}"
             + (f", {s['size'][0]} frames" if s["size"][0] > 1 else "") + f", sharding {s['sharding']}, explore {s['explore']}",
             "", f"resident all run: {g(sum(plan.static.values()))} GiB"]
    lines += [f"  {k:<22}{g(v):>8}" for k, v in plan.static.items() if v]
    lines += ["", f"  {'phase':<22}{'adds':>8}{'peak':>8}  GiB per process"]
    for phase, added in plan.phases.items():
        marker = "  <- peak" if phase == plan.peak_phase else ""
        lines.append(f"  {phase:<22}{('' if phase == 'start-up' else '+') + g(added):>8}{g(plan.phase_peak(phase)):>8}{marker}")
    free = plan.capacity - plan.peak
    if plan.fits:
        verdict = f"fits: peak {g(plan.peak)} GiB ({plan.peak_phase}) of {g(plan.capacity)} GiB, {g(free)} GiB free"
    else:
        verdict = (f"does NOT fit: peak {g(plan.peak)} GiB ({plan.peak_phase}) of {g(plan.capacity)} GiB (a plan keeps {RESERVE // GIB} GiB "
                   f"for the CUDA context and allocator); smallest change: {plan.change}"
                   + (f" (→ {g(plan.change_peak)} GiB)" if plan.change_peak else ""))
    lines += ["", verdict, f"per iteration and process: {plan.rows['rollout']:,} rollout rows, {plan.rows['train']:,} trained rows (before "
              f"pruning); {plan.flops['total']:.3g} FLOPs; modelled {plan.seconds:.3g} s on {plan.gpu} (denoiser only, "
              f"{plan.settings['utilisation']:g} of its {'bf16' if plan.settings['bf16'] else 'TF32'} peak)"]
    if plan.network:
        net = plan.network
        lines.append(f"network, {net['nodes']} machines: each sends {net['bytes_per_machine'] / 2**30:.3g} GiB an iteration (and receives as much) "
                     f"in {net['all_reduces']} gradient all-reduce{'s' if net['all_reduces'] > 1 else ''} of {net['gradient_bytes'] / 2**20:.4g} MiB "
                     f"(2·(M − 1)/M of them each; at 25 GB/s: {net['bytes_per_machine'] / 25e9:.3g} s)")
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)


DOES_NOT_FIT = 1  # the exit status of a plan whose peak does not fit, printed whole (bad input: 2)


def cmd_plan(args: argparse.Namespace) -> int:
    """Print (or write as JSON) the plan; the exit status says whether it fits: 0, else `DOES_NOT_FIT`."""
    from branchdiff.plan.estimate import Estimator, with_change
    from branchdiff.runtime import storage
    from branchdiff.settings.load import preset_or_default

    target = target_from_args(args)
    source = preset_or_default(args.config, args.overrides)
    try:
        plan = with_change(source, list(args.overrides), target, Estimator())
    except KeyError as error:
        raise UserError(f"plan: {error}") from None
    if args.json:
        text = json.dumps(plan.to_json(), indent=1, default=str)
        if args.json == "-":
            print(text)
        else:
            storage.write_text(Path(args.json), text + "\n")
    if args.json != "-":
        print(format_plan(args.config or source, plan))
    return 0 if plan.fits else DOES_NOT_FIT
