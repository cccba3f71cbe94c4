#!/usr/bin/env python
"""The memory table of docs/memory-table.md: `branchdiff plan` (branchdiff/plan/) on every preset that
targets a released model and on its -explore variant, as markdown tables.

    python scripts/memory_table.py            # the table (CPU only, no network; ~20 s)
    python scripts/memory_table.py --detail   # plus the phases, per-row figures and component counts

Every figure is an ESTIMATE; docs/plan.md gives the formulas and what is not counted.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from branchdiff.plan.estimate import GIB, RESERVE, Estimator, Plan, Target, with_change  # noqa: E402
from branchdiff.plan.families import KLEIN  # noqa: E402
from branchdiff.plan.measure import Measured, reward_params  # noqa: E402
from branchdiff.settings.load import load_config, presets  # noqa: E402

WAN_14B = "model.path=Wan-AI/Wan2.1-T2V-14B-Diffusers"
WAN_I2V_14B = ("model.path=Wan-AI/Wan2.1-I2V-14B-480P-Diffusers", "model.resolution=[480,832]")
WAN_I2V_A14B = ("model.path=Wan-AI/Wan2.2-I2V-A14B-Diffusers", "model.resolution=[480,832]")
# (preset, its overrides): each row's preset and its -explore variant where there is one; Wan 14B is wan-mq-branch on the
# 14B model; flux2-klein-pickscore plans its own 9B and, with the override, the 4B; wan-i2v-mq-branch plans TI2V-5B and, at
# 480×832, the 14B image-to-video models
PRESETS = [("sd35-pickscore", ()), ("flux-hps-branch", ()), ("flux-hps-mix", ()), ("sana-pickscore", ()), ("sd15-hps", ()),
           ("wan-mq-branch", ()), ("wan-mq-branch", (WAN_14B,)), ("qwen-image-pickscore", ()), ("flux2-pickscore", ()),
           ("flux2-klein-pickscore", (f"model.path={KLEIN.format('4B')}",)), ("flux2-klein-pickscore", ()), ("z-image-pickscore", ()),
           ("flux-kontext-pickscore", ()), ("qwen-image-edit-pickscore", ()), ("wan-i2v-mq-branch", ()), ("wan-i2v-mq-branch", WAN_I2V_14B),
           ("wan-i2v-mq-branch", WAN_I2V_A14B)]


def g(x: float) -> str:
    return f"{x / GIB:.1f}"


def millions(n: int) -> str:
    return f"{n / 1e9:.3f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"


def _table(head: list[str], lines: list[list[str]]) -> str:
    return "\n".join("| " + " | ".join(cells) + " |" for cells in [head, ["---"] * len(head), *lines])


def table(rows: list[tuple[str, Plan, Plan | None, Measured]]) -> str:
    head = ["preset", "GPU (per process)", "denoiser params (weights)", "text enc. + VAE resident", "reward model (fp32)", "LoRA params",
            "LoRA + grad + AdamW + DDP bucket", "training activations", "rollout chunk peak", "est. peak (when)", "headroom",
            "+ explore FP8 copy", "-explore est. peak (when)", "-explore headroom"]
    lines = []
    for name, plan, explore, m in rows:
        s = plan.settings
        params = millions(m.denoiser_params) + (f" + {millions(m.denoiser_buffers)} buffer" if m.denoiser_buffers else "")
        helpers = (f"0 (offloaded: {g(plan.phases['encode'])} enc. while in use)" if s["offload"]
                   else f"{g(plan.static['text encoders + VAE'])} (not offloaded)")
        lines.append([
            name, f"{plan.gpu} ({g(plan.capacity)})", f"{params} ({g(plan.static['denoiser'])} {s['dtype']})", helpers, g(plan.static["reward models"]),
            millions(m.lora_params),
            g(plan.static["trained state"] + m.lora_params * 4), f"{g(plan.phases['train'] - m.lora_params * 4)} ({s['minibatch'] * s['cfg_rows']} rows, "
            f"ckpt {'on' if s['gradient_checkpointing'] else 'off'})", f"{g(plan.phases['rollout'])} ({s['max_batch'] // s['cfg_rows'] * s['cfg_rows']} rows)",
            f"**{g(plan.peak)}** ({plan.peak_phase})", g(plan.capacity - plan.peak),
            *((g(explore.static.get("explore copy", 0)), f"**{g(explore.peak)}** ({explore.peak_phase})", g(explore.capacity - explore.peak))
              if explore else ("no -explore preset", "", "")),
        ])
    return _table(head, lines)


def phase_table(rows: list[tuple[str, Plan, Plan | None, Measured]]) -> str:
    head = ["preset", "static (resident all run)", "encode", "rollout", "reward (decode + images)", "train", "optimizer", "eval",
            "-explore: static", "-explore: explore", "-explore: start-up copy (absolute)"]
    lines = []
    for name, plan, explore, _ in rows:
        p = plan.phases
        lines.append([name, g(sum(plan.static.values())), *(f"+{g(p[k])}" for k in ("encode", "rollout", "reward", "train", "optimizer", "eval")),
                      *((g(sum(explore.static.values())), f"+{g(explore.phases.get('explore', 0))}", g(explore.phases.get("start-up", 0)))
                        if explore else ("", "", ""))])
    return _table(head, lines)


def per_row_table(rows: list[tuple[str, Plan, Plan | None, Measured]]) -> str:
    head = ("| family @ px | blocks | training, ckpt off: held + backward = per row | training, ckpt on: held + recompute "
            "+ backward = per row | rollout (no grad) per row | VAE decode per image | forward GFLOPs per row |")
    out = [head, "|" + "|".join(["---"] * (head.count("|") - 1)) + "|"]
    seen = set()
    mib = lambda x: f"{x / 2**20:,.0f}"
    slope = lambda f: f(2) - f(1)  # bytes per network row
    for _, plan, _, m in rows:
        size = tuple(plan.settings["size"])
        if (plan.label, size) in seen:
            continue
        seen.add((plan.label, size))
        blocks = (", ".join(f"{n}× {k}" for k, n in m.counts.items()) if plan.family != "sd15"
                  else f"{sum(m.counts.values())} checkpointed units (resnets, transformer blocks)")
        off = [slope(lambda r, m=m: m.held(r, False)), slope(m.backward)]
        on = [slope(lambda r, m=m: m.held(r, True)), slope(m.recompute), slope(m.backward)]
        at = f"{size[1]}×{size[2]}" + (f", {size[0]} frames" if size[0] > 1 else "")
        out.append(f"| {plan.label} @ {at} | {blocks} | {' + '.join(map(mib, off))} = **{mib(sum(off))} MiB** "
                   f"| {' + '.join(map(mib, on))} = **{mib(sum(on))} MiB** | {mib(slope(m.rollout))} MiB | {mib(m.decode_image)} MiB "
                   f"| {m.forward_flops() / 1e9:,.0f} |")
    return "\n".join(out)


def components_table(rows: list[tuple[str, Plan, Plan | None, Measured]]) -> str:
    head = "| family | denoiser (exact) | LoRA params | FP8 copy: quantised weights / bytes | text encoders | VAE |"
    out = [head, "|" + "|".join(["---"] * (head.count("|") - 1)) + "|"]
    seen = set()
    for _, plan, _, m in rows:
        if plan.label in seen:
            continue
        seen.add(plan.label)
        enc = ", ".join(f"{k} {n:,}" for k, n in m.encoders.items())
        out.append(f"| {plan.label} | {m.denoiser_params:,} | {m.lora_params:,} | {m.copy_quantised:,} / {g(m.copy_bytes)} GiB | {enc} | {m.vae_params:,} |")
    out.append(f"| reward (HPS v2.1 / PickScore, ViT-H-14) | {reward_params():,} | | | | |")
    out.append(f"| reward (VideoAlign, Qwen2-VL-2B) | {reward_params('qwen2-vl-2b'):,} | | | | |")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--detail", action="store_true", help="also print the phases, per-row figures and component counts")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override applied to every preset, e.g. --set train.gradient_checkpointing=false (repeatable)")
    args = parser.parse_args()
    estimator = Estimator()
    rows = []
    for preset, extra in PRESETS:
        overrides = [*extra, *args.set]
        name = f"{preset} ({', '.join(extra)})" if extra else preset
        plan = with_change(preset, overrides, Target(), estimator)
        explore = with_change(f"{preset}-explore", overrides, Target(), estimator) if f"{preset}-explore" in presets() else None
        config = load_config(preset, overrides)
        rows.append((name, plan, explore, estimator.measured(estimator.family(config), config)))
    print(table(rows))
    notes = [(name, p.change) for name, p, _, _ in rows] + [(f"{name} -explore", e.change) for name, _, e, _ in rows if e]
    print()
    if any(note for _, note in notes):
        print(f"Over the GPU or less than {RESERVE // GIB} GiB under it, and the smallest change that brings the estimate {RESERVE // GIB} GiB under it:\n")
        for name, note in notes:
            if note:
                print(f"- {name}: {note}")
    else:
        print(f"Every preset and its -explore variant leaves at least {RESERVE // GIB} GiB of its GPU free (estimate).")
    if args.detail:
        print("\nPhases (GiB; a phase adds to the static part, the peak is static + the largest phase):\n")
        print(phase_table(rows))
        print("\nPer network row (the preset's autocast, LoRA attached; MiB):\n")
        print(per_row_table(rows))
        print("\nComponents (parameters counted on the meta device):\n")
        print(components_table(rows))


if __name__ == "__main__":
    main()
