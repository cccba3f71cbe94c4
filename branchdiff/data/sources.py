"""Source images of instruction-editing prompts (docs/editing.md).

A prompt set's row may name the image(s) its prompt edits: a JSONL row's "image" field (a path or a
list of paths), a CSV row's "image" column (paths separated by "|"). Relative paths are resolved
against the prompt file's folder. `resolve_sources` checks, when the set is read, that every image
exists and decodes, and refuses the first that does not with its file and row; the absolute paths
are kept in the prompt's metadata under `SOURCES`, where editing families, rewards that take
`sources=` and evaluation grids find them. A "mask" field or column (one image, white where the
edit may change the source) is checked the same way and kept, absolute, under `MASK`
(`edit-consistency` compares source and result outside it).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch

from branchdiff.errors import quote

SOURCES = "sources"  # metadata key: the absolute paths of a prompt's source images
MASK = "mask"  # metadata key: the absolute path of a prompt's edit mask (white where the edit may change the source)
SEPARATOR = "|"  # between paths in a CSV cell


def resolve_sources(value: object, folder: Path, where: str) -> list[str]:
    """Absolute paths of a row's source images: `value` is a path, a list of paths, or (CSV) paths
    joined by "|"; each must name a readable image. Raises ValueError naming `where` (file:row)."""
    if isinstance(value, str):
        paths = [part.strip() for part in value.split(SEPARATOR)]
    elif isinstance(value, list) and value and all(isinstance(part, str) for part in value):
        paths = [part.strip() for part in value]
    else:
        raise ValueError(f"{where}: \"image\" must be a path or a list of paths to source images, got {quote(repr(value))}")
    resolved = []
    for path in paths:
        if not path:
            raise ValueError(f"{where}: \"image\" holds an empty path; give the source image's path (relative to {folder})")
        full = (folder / path).resolve()
        if full.is_dir():
            raise ValueError(f"{where}: source image {quote(path)} is a folder ({full}), not an image file; name the image in it")
        if not full.is_file():
            raise ValueError(f"{where}: source image {quote(path)} not found (looked for {full}); fix the path, relative to the prompt file's folder")
        try:
            _verify(full)
        except (OSError, SyntaxError) as error:  # PIL reports a damaged file as either
            raise ValueError(f"{where}: source image {quote(path)} could not be read as an image ({type(error).__name__}: {error})") from None
        resolved.append(str(full))
    return resolved


def check_mask(mask: str, sources: list[str], where: str) -> None:
    """An edit mask has its source's size (the first source's, where a row names several): a mask of another size would
    be stretched over the source and mark other pixels than the ones meant."""
    mask_size, source_size = image_size(mask), image_size(sources[0])
    if mask_size != source_size:
        raise ValueError(f"{where}: the mask {quote(Path(mask).name)} is {mask_size[0]}×{mask_size[1]} (width × height) and its source "
                         f"{quote(Path(sources[0]).name)} {source_size[0]}×{source_size[1]}; give a mask of the source's size")


def _verify(path: Path) -> None:
    """Check that a file is an image PIL reads, from its header and structure, without decoding its pixels."""
    from PIL import Image

    with Image.open(path) as image:
        image.verify()


def image_size(path: str) -> tuple[int, int]:
    """(width, height) of an image file, from its header."""
    from PIL import Image

    with Image.open(path) as image:
        return image.size


def check_aspect(size: tuple[int, int], height: int, width: int, what: str) -> None:
    """Refuse a source of (width, height) `size` whose aspect ratio differs from the edits' (`height` × `width`)
    by more than 1 %: it would be stretched (or, for some families, edited at another shape than it is scored at)."""
    if abs(size[0] / size[1] - width / height) > 0.01 * width / height:
        raise ValueError(f"{what} is {size[0]}×{size[1]} (width × height) and the edits {width}×{height}: crop or pad the source to the "
                         f"aspect ratio {width}:{height}, or set model.resolution to the sources' shape (docs/editing.md)")


@lru_cache(maxsize=16)
def _decode(path: str):
    """The image at `path` as an RGB PIL image (a few cached: a prompt's sources are read at every iteration that draws it)."""
    from PIL import Image

    with Image.open(path) as image:
        return image.convert("RGB")


def source_images(metadata: list[dict]) -> list[list] | None:
    """Each prompt's source images as RGB PIL images, or None when no prompt has any."""
    if not any(SOURCES in row for row in metadata):
        return None
    return [[_decode(path) for path in row.get(SOURCES, [])] for row in metadata]


def source_tensors(metadata: list[dict]) -> list[list[torch.Tensor]] | None:
    """Each prompt's source images as float tensors (3, h, w) in [0, 1], or None when no prompt has any."""
    images = source_images(metadata)
    if images is None:
        return None
    import numpy as np

    return [[torch.from_numpy(np.asarray(image, dtype=np.float32) / 255).permute(2, 0, 1) for image in row] for row in images]


def mask_tensor(path: str) -> torch.Tensor:
    """An edit mask (1, h, w) in [0, 1] from its image's luminance: 1 where the edit may change the source."""
    import numpy as np

    return torch.from_numpy(np.asarray(_decode(path).convert("L"), dtype=np.float32) / 255)[None]
