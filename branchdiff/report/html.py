"""The run report's page pieces: its style sheet and the HTML of an image, a note, a table; the
numbers' formatting (branchdiff/report/run_report.py builds the page from them)."""

from __future__ import annotations

from html import escape

import numpy as np

STYLE = """body{font-family:system-ui,sans-serif;max-width:1240px;margin:1em auto;padding:0 1em;color:#222}
h2{border-bottom:1px solid #ccc;margin-top:1.6em}nav a{margin-right:1em}
img.plot{max-width:100%;display:block}img.grid,video.grid{width:100%;display:block;image-rendering:pixelated}
figure{display:inline-block;width:calc(50% - 1.2em);margin:.4em;vertical-align:top}figcaption{font-size:.85em;color:#555}
table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;padding:2px 8px;text-align:right}
td:first-child,th:first-child{text-align:left}.missing{color:#888;font-style:italic}
figcaption ol{margin:.2em 0;padding-left:1.8em}pre{background:#f6f6f6;padding:.5em;overflow:auto;font-size:.85em}"""


def evenly_spaced(items: list, count: int) -> list:
    """At most `count` items evenly spaced over `items`, first and last included."""
    if len(items) <= count:
        return list(items)
    return [items[i] for i in sorted({round(x) for x in np.linspace(0, len(items) - 1, count)})]


def img(uri: str, alt: str, kind: str = "plot") -> str:
    return f'<img class="{kind}" alt="{escape(alt)}" src="{uri}">'


def note(text: str) -> str:
    return f'<p class="missing">{escape(text)}</p>'


def missing(what: str) -> str:
    return note(f"{what} not recorded in this run.")


def table(header: list[str], body: list[list[str]]) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    lines = "".join("<tr>" + "".join(f"<td>{escape(c)}</td>" for c in line) + "</tr>" for line in body)
    return f"<table><tr>{head}</tr>{lines}</table>"


def dotted_get(config: object, dotted: str) -> object:
    """config["a"]["b"] for "a.b"; None when a level is absent."""
    for key in dotted.split("."):
        config = config.get(key) if isinstance(config, dict) else None
    return config


def finite_mean(values: np.ndarray, axis: int | None = None) -> np.ndarray:
    """Mean of the finite values (NaN where there is none), without numpy's empty-slice warning."""
    finite = np.isfinite(values)
    with np.errstate(invalid="ignore"):
        return np.where(finite, values, 0.0).sum(axis) / finite.sum(axis)


def fmt(x: float | None) -> str:
    return "–" if x is None else f"{x:.4g}"
