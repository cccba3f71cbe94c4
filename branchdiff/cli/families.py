"""`branchdiff families`: every model family branchdiff can train, built in or installed (docs/models.md)."""

from __future__ import annotations

import argparse


def family_rows() -> list[dict[str, str]]:
    """One row per family: its name, the diffusers pipeline it reproduces, step kind, guidance, default
    and allowed sizes, frames (videos) and where it came from; then entry points that could not be used."""
    from branchdiff.models import adapter_class
    from branchdiff.models.pipeline_adapter import PipelineAdapter
    from branchdiff.models.registry import BUILT_IN, FAMILIES, REFUSED_PLUGINS, image_size

    rows, unusable = [], dict(REFUSED_PLUGINS)
    for name, spec in FAMILIES.items():
        try:
            adapter = adapter_class(name)
        except Exception as error:  # an installed family whose adapter does not import: listed as not used
            unusable[name] = f"{spec.adapter}: could not be imported ({type(error).__name__}: {error})"
            continue
        height, width = image_size(None, spec.resolution)
        guidance = adapter.default_guidance
        rows.append({
            "family": name,
            "pipeline": adapter.pipeline_class_name if issubclass(adapter, PipelineAdapter) else "branchdiff's own model",
            "steps": spec.steps,
            "guidance": f"CFG {guidance:g}" if adapter.uses_cfg else (f"embedded {guidance:g}" if guidance != 1.0 else "none"),
            "size": f"{height}x{width}",
            "sizes": "fixed" if spec.fixed_resolution else f"sides × {spec.side_multiple}",
            "frames": str(spec.frames) if spec.video else "-",
            "source": "built-in" if name in BUILT_IN else f"entry point {spec.adapter}",
        })
    for name, why in unusable.items():
        rows.append({"family": name, "pipeline": "-", "steps": "-", "guidance": "-", "size": "-", "sizes": "-", "frames": "-",
                     "source": f"not used: entry point {why}"})
    return rows


def cmd_families(args: argparse.Namespace) -> None:
    rows = family_rows()
    columns = list(rows[0])
    widths = {c: max(len(c), *(len(row[c]) for row in rows)) for c in columns}
    for row in [dict(zip(columns, columns)), *rows]:
        print("  ".join(row[c].ljust(widths[c]) for c in columns).rstrip())
    print("\nsize: the default (height x width); sizes: what a model.resolution side must be a multiple of for the released "
          "models (a folder's own configs decide); guidance: the default scale (docs/models.md)")
