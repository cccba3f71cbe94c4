"""Images and plots of a run: sample grids (saved by training and evaluation, read back as data URIs
for a page), and the matplotlib primitives the run's report draws with: figures with fixed margins,
metric curves with a moving average, small multiples, PNG data URIs.

No legend covers data: an axes' legend lies between the axes and their title (`title_and_legend`),
the legend of small multiples above them all, each in as many columns as fit; `png_data_uri` grows
a figure at the top until its titles and legends fit (`fit_top`).

Nothing here knows a run's sections or metric names (branchdiff/report/run_report.py is the page). torch is
imported by `grid_of` and `save_grid` only, so that building a report does not load it.
"""

from __future__ import annotations

import base64
import io
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.legend import Legend
from matplotlib.ticker import MaxNLocator
from PIL import Image

if TYPE_CHECKING:
    import torch

CAPTIONS_KEY = "branchdiff:row_captions"  # PNG text chunk of a grid: JSON list, one caption per row
MAX_GRID_SIDE = 2048  # larger grids are downscaled before embedding (keeps the page a few MB)
LEGEND_PAD = 0.05  # inches kept free above a figure's titles and legends
TITLE_PAD = 3.0  # points between an axes' legend and the title above it

Column = tuple[np.ndarray, np.ndarray]  # (iterations, values) of the rows that log a key; NaN kept (a gap)


# ---------------------------------------------------------------- sample grids
def grid_of(images: torch.Tensor, nrow: int = 8, upscale: int = 4) -> torch.Tensor:
    """Images (B, 3, H, W) → one grid image (3, H', W'), each enlarged `upscale`× (nearest), `nrow` a row;
    videos (B, F, 3, H, W) → the grid of each frame, a video (F, 3, H', W')."""
    import torch
    from torchvision.utils import make_grid

    if images.dim() == 5:
        return torch.stack([grid_of(images[:, f], nrow, upscale) for f in range(images.shape[1])])
    big = torch.nn.functional.interpolate(images.float().cpu(), scale_factor=upscale, mode="nearest")
    return make_grid(big, nrow=nrow, padding=2, pad_value=0.5)


def save_grid(images: torch.Tensor, path: Path, nrow: int = 8, upscale: int = 4, row_captions: list[str] | None = None) -> torch.Tensor:
    """Save images (B, 3, H, W) in [0, 1] as one PNG grid, each image enlarged `upscale`× (nearest),
    written atomically (`storage.replace_file`); videos (B, F, 3, H, W) show as their frame strips
    (`video.frame_strip`), and the grid plays beside it as an MP4 (`path` with .mp4, the videos in the
    same places). `row_captions` (one per row, e.g. its prompt) go into the PNG's text chunk
    `CAPTIONS_KEY` as a JSON list, which the report shows under the grid. Returns the grid shown: the
    image (3, H', W'), or for videos the playing grid (F, 3, H', W')."""
    from PIL.PngImagePlugin import PngInfo

    from branchdiff.report.video import frame_strip, write_mp4
    from branchdiff.rewards.base import to_uint8
    from branchdiff.runtime import storage

    playing = None
    if images.dim() == 5:
        playing = grid_of(images, nrow, upscale)  # (F, 3, H', W'): the grid, playing
        write_mp4(playing, path.with_suffix(".mp4"))
        images = frame_strip(images)

    grid = grid_of(images, nrow, upscale)  # (3, H', W')
    info = PngInfo()
    if row_captions is not None:
        info.add_text(CAPTIONS_KEY, json.dumps(list(row_captions)))
    image = Image.fromarray(to_uint8(grid[None])[0].permute(1, 2, 0).numpy())
    storage.replace_file(path, lambda tmp: image.save(tmp, format="PNG", pnginfo=info))
    return grid if playing is None else playing


def grid_captions(path: Path) -> list[str] | None:
    """The row captions `save_grid` stored in a grid PNG, or None."""
    try:
        with Image.open(path) as image:
            captions = json.loads(image.text.get(CAPTIONS_KEY, "null"))
    except (OSError, SyntaxError, ValueError, AttributeError):
        return None
    return [str(c) for c in captions] if isinstance(captions, list) else None


def video_data_uri(path: Path) -> str | None:
    """An MP4 as a data URI; None when there is none."""
    try:
        return "data:video/mp4;base64," + base64.b64encode(path.read_bytes()).decode()
    except OSError:
        return None


def grid_data_uri(path: Path) -> str | None:
    """A grid PNG as a data URI (downscaled past MAX_GRID_SIDE); None when unreadable (being written)."""
    try:
        data = path.read_bytes()
        with Image.open(io.BytesIO(data)) as image:
            if max(image.size) > MAX_GRID_SIDE:
                image.thumbnail((MAX_GRID_SIDE, MAX_GRID_SIDE))
                buffer = io.BytesIO()
                image.save(buffer, format="PNG")
                data = buffer.getvalue()
            else:
                image.verify()
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError):
        return None
    return "data:image/png;base64," + base64.b64encode(data).decode()


# ---------------------------------------------------------------- curves
def base_level(iterations: np.ndarray, values: np.ndarray) -> float | None:
    """The base model's level of a curve: its value at iteration 0 (None when not logged or not finite).
    The LoRA starts at zero, so iteration 0's rollouts, and the evaluation logged with it, come from the base model."""
    at_zero = values[iterations == 0]
    return float(at_zero[0]) if len(at_zero) and math.isfinite(at_zero[0]) else None


def moving_average(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean of the finite values among the last `window` at each point:
    m_i = mean{v_j : i - w < j <= i, v_j finite} (NaN where there is none)."""
    finite = np.isfinite(values)
    sums = np.concatenate([[0.0], np.cumsum(np.where(finite, values, 0.0))])
    counts = np.concatenate([[0], np.cumsum(finite)])
    end = np.arange(1, len(values) + 1)
    start = np.maximum(end - window, 0)
    n = counts[end] - counts[start]
    return np.where(n > 0, (sums[end] - sums[start]) / np.maximum(n, 1), np.nan)


def smoothing_window(count: int) -> int:
    """Moving-average window of a curve of `count` points: max(1, count // 20)."""
    return max(1, count // 20)


# ---------------------------------------------------------------- drawing
def png_data_uri(figure: Figure) -> str:
    """The figure, grown at the top to hold its titles and legends (`fit_top`), as a PNG data URI."""
    fit_top(figure)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def new_figure(width: float, height: float, lines: int = 1, columns: int = 1, top: float = 0.3) -> tuple[Figure, np.ndarray]:
    """lines × columns axes with fixed margins in inches, `top` above the first line (a layout
    engine doubles the drawing time)."""
    figure = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(figure)  # the renderer that measures legends and titles is the one that draws the PNG
    margins = dict(left=0.55 / width, right=1 - 0.15 / width, bottom=0.45 / height, top=1 - top / height, wspace=0.3, hspace=0.65)
    axes = figure.subplots(lines, columns, squeeze=False, gridspec_kw=margins).ravel()
    for ax in axes:
        ax.tick_params(labelsize=7)
        ax.ticklabel_format(useOffset=False)
        ax.xaxis.set_major_locator(MaxNLocator(5, integer=True))
        ax.yaxis.set_major_locator(MaxNLocator(4))
    return figure, axes


def grow_top(figure: Figure, inches: float) -> None:
    """Add `inches` at the top of the figure; every axes keeps its size and distance from the bottom."""
    width, height = figure.get_size_inches()
    scale = height / (height + inches)
    boxes = [(ax, ax.get_position(original=True)) for ax in figure.axes]
    figure.set_size_inches(width, height + inches)
    for ax, box in boxes:
        ax.set_position((box.x0, box.y0 * scale, box.width, box.height * scale))


def fit_top(figure: Figure) -> None:
    """Grow the figure at the top until its axes' titles and legends lie LEGEND_PAD below its edge,
    and its own legends (on top, `small_multiples`) LEGEND_PAD above all of them."""
    pad = LEGEND_PAD * figure.dpi
    shown = [ax for ax in figure.axes if ax.get_visible()]
    top = max((artist.get_window_extent().y1 for ax in shown for artist in (ax, ax.title, ax.get_legend()) if artist is not None), default=0.0)
    lacking = max([top + pad - figure.bbox.height, *(top + pad - legend.get_window_extent().y0 for legend in figure.legends)])
    if lacking > 0:
        grow_top(figure, lacking / figure.dpi)


def widest_legend(make: Callable[[int], Legend], count: int, width: float) -> Legend:
    """`make(ncols)` with the most columns, at most `count`, whose legend fits `width` pixels (one
    column when none does); the wider legends tried are removed."""
    for ncols in range(count, 1, -1):
        legend = make(ncols)
        if legend.get_window_extent().width <= width:
            return legend
        legend.remove()
    return make(1)


def title_and_legend(ax: Axes, title: str, others: tuple[Axes, ...] = ()) -> None:
    """The axes' title, and their legend (with the labelled artists of `others`, e.g. a twin axes)
    between them and the title (which moves up to make room), in as many columns as fit their
    width; the title alone when nothing drawn has a label."""
    handles, labels = (sum(parts, []) for parts in zip(*(a.get_legend_handles_labels() for a in (ax, *others))))
    if not labels:
        ax.set_title(title, fontsize=9)
        return
    legend = widest_legend(lambda ncols: ax.legend(handles, labels, loc="lower left", bbox_to_anchor=(0, 1), ncols=ncols, fontsize=6,
                                                   frameon=False, borderaxespad=0.2), len(labels), ax.bbox.width)
    above = (legend.get_window_extent().y1 - ax.bbox.y1) * 72 / ax.figure.dpi  # points
    ax.set_title(title, fontsize=9, pad=above + TITLE_PAD)


def draw_curve(ax: Axes, key: str, column: Column, smooth: bool = True, markers: bool = False, base: bool = False) -> None:
    """One metric over iterations: a thin raw line and its moving average (or markers); `base`:
    the base model's level dashed, when the curve starts at iteration 0."""
    iterations, values = column
    ax.set_title(key, fontsize=9)
    window = smoothing_window(len(values))
    if smooth and window > 1:
        ax.plot(iterations, values, lw=0.6, alpha=0.45, color="C0", label="per iteration")
        ax.plot(iterations, moving_average(values, window), lw=1.5, color="C0", label=f"moving average of {window} iterations")
    else:
        ax.plot(iterations, values, lw=1.2, marker="o" if markers else None, ms=3, color="C0", label="per evaluation" if markers else "per iteration")
    if base and (level := base_level(iterations, values)) is not None:
        ax.axhline(level, ls="--", lw=1, color="0.35", label="base (iteration 0)")
    ax.grid(alpha=0.3)


def small_multiples(columns: dict[str, Column], keys: list[str], draw: Callable[[Axes, str, Column], None] = draw_curve) -> Figure:
    """One axes per key, three a row, drawn by `draw(ax, key, columns[key])`; one legend on top for all,
    in as many columns as fit the figure's width."""
    per_line = min(3, len(keys))
    lines = math.ceil(len(keys) / per_line)
    figure, axes = new_figure(3.1 * per_line + 0.3, 2.3 * lines + 0.45, lines, per_line, top=0.55)
    legend: dict[str, object] = {}
    for ax, key in zip(axes, keys):
        draw(ax, key, columns[key])
        ax.set_xlabel("iteration", fontsize=7, labelpad=1)
        legend.update(zip(*reversed(ax.get_legend_handles_labels())))
    for ax in axes[len(keys):]:
        ax.set_visible(False)
    if legend:
        widest_legend(lambda ncols: figure.legend(list(legend.values()), list(legend), loc="upper center", ncols=ncols, fontsize=7, frameon=False),
                      len(legend), figure.bbox.width)
    return figure
