"""Source images of instruction-editing and image-to-video prompts (docs/editing.md, docs/video.md), and the
reading of every image file a set names (sources, SFT demonstrations, preference pairs).

A prompt set's row may name the image(s) its prompt edits, or the first frame of its video: a JSONL row's
"image" field (a path or a list of paths), a CSV row's "image" column (paths separated by "|"). Relative
paths are resolved against the prompt file's folder. `resolve_sources` reads every image whole when the
set is read (before any model loads) and refuses the first that does not read, with its file and row: a
missing file, a symbolic link that loops, a file PIL cannot decode (a truncated JPEG, a PNG with broken
compressed data), or one larger than PIL's decompression-bomb guard. The absolute paths are kept in the
prompt's metadata under `SOURCES`, where families, rewards that take `sources=` and evaluation grids find
them. A "mask" field or column (one image, white where the edit may change the source) is checked the same
way and kept, absolute, under `MASK` (`edit-consistency` compares source and result outside it).

Images are read as the pipelines' `load_image` reads them: the EXIF orientation applied (a phone photo
stored sideways stands upright), then RGB; 16-bit grayscale levels (PNG, TIFF) are scaled to 8 bits
(PIL's own conversion clips them, and they read almost white).

A source of another aspect ratio than the model's (height, width) is fitted by the command's `fit`
(`sources.fit`, `--fit`), kept in each row's metadata under `FIT`:
- `resize` (the default): stretched to the model's size as `WanImageToVideoPipeline` and FLUX.1 Kontext's
  image processor resize it (Lanczos), which equals the pipeline's own preprocessing bit for bit;
- `crop`: the largest centred box of the model's aspect ratio;
- `pad`: black borders around it, to the model's aspect ratio;
- `refuse`: a source more than 1 % off the model's aspect ratio is refused when the set is read.
A source within 1 % of the aspect ratio is left as it is: the family resizes it as its pipeline does.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch

from branchdiff.errors import quote

SOURCES = "sources"  # metadata key: the absolute paths of a prompt's source images
MASK = "mask"  # metadata key: the absolute path of a prompt's edit mask (white where the edit may change the source)
FIT = "source_fit"  # metadata key: how a row's sources of another aspect ratio are fitted to the model's size (module doc)
SEPARATOR = "|"  # between paths in a CSV cell
FITS = ("resize", "crop", "pad", "refuse")
ASPECT_TOLERANCE = 0.01  # a source within 1 % of the model's aspect ratio is taken as it is
SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I")  # PIL's modes of 16-bit grayscale levels
ORIENTATION = 0x0112  # the EXIF tag of the orientation


def resolve_image(value: str, folder: Path, where: str, what: str = "source image") -> str:
    """The absolute path of one image a row names (relative to `folder`), read whole now; one line naming `where`
    (file:row) and the image otherwise (module doc)."""
    if not value:
        raise ValueError(f"{where}: an empty path; give the {what}'s path (relative to {folder})")
    try:
        full = (folder / value).resolve()
    except (RuntimeError, OSError) as error:  # a symbolic link that loops (RuntimeError "Symlink loop" before Python 3.13)
        raise ValueError(f"{where}: {what} {quote(value)} is a symbolic link that cannot be followed ({error}); point it at the image") from None
    if full.is_dir():
        raise ValueError(f"{where}: {what} {quote(value)} is a folder ({full}), not an image file; name the image in it")
    if not full.is_file():
        raise ValueError(f"{where}: {what} {quote(value)} not found (looked for {full}); fix the path, relative to the prompt file's folder")
    try:
        _decode(str(full))
    except Exception as error:  # PIL reports a damaged file as OSError, SyntaxError, ValueError or its DecompressionBombError
        raise ValueError(f"{where}: {what} {quote(value)} could not be read as an image ({unreadable(error)})") from None
    return str(full)


def unreadable(error: Exception) -> str:
    """Why PIL could not read a file, in a few words with the fix where there is one."""
    from PIL import Image

    message = " ".join(str(error).split())
    if isinstance(error, Image.DecompressionBombError):
        return (f"{type(error).__name__}: {message.rstrip('.')}; PIL refuses images this large as a guard against decompression bombs: resize it, or raise "
                "PIL.Image.MAX_IMAGE_PIXELS if you trust the file")
    if "truncated" in message.lower():
        return f"{type(error).__name__}: {message}; the file is cut short: copy or export it again"
    return f"{type(error).__name__}: {message}"


def resolve_sources(value: object, folder: Path, where: str) -> list[str]:
    """Absolute paths of a row's source images: `value` is a path, a list of paths, or (CSV) paths
    joined by "|"; each must name an image that reads (`resolve_image`). Raises ValueError naming `where` (file:row)."""
    if isinstance(value, str):
        paths = [part.strip() for part in value.split(SEPARATOR)]
    elif isinstance(value, list) and value and all(isinstance(part, str) for part in value):
        paths = [part.strip() for part in value]
    else:
        raise ValueError(f"{where}: \"image\" must be a path or a list of paths to source images, got {quote(repr(value))}")
    return [resolve_image(path, folder, where) for path in paths]


def check_mask(mask: str, sources: list[str], where: str) -> None:
    """An edit mask has its source's size (the first source's, where a row names several): a mask of another size would
    be stretched over the source and mark other pixels than the ones meant."""
    mask_size, source_size = image_size(mask), image_size(sources[0])
    if mask_size != source_size:
        raise ValueError(f"{where}: the mask {quote(Path(mask).name)} is {mask_size[0]}×{mask_size[1]} (width × height) and its source "
                         f"{quote(Path(sources[0]).name)} {source_size[0]}×{source_size[1]}; give a mask of the source's size")


def image_size(path: str) -> tuple[int, int]:
    """(width, height) of an image file as it is shown: from its header, its EXIF orientation applied."""
    from PIL import Image

    with Image.open(path) as image:
        turned = image.getexif().get(ORIENTATION, 1) in (5, 6, 7, 8)  # a quarter turn: width and height swap
        return (image.height, image.width) if turned else image.size


def aspect_differs(size: tuple[int, int], height: int, width: int) -> bool:
    """Whether a (width, height) `size` is more than `ASPECT_TOLERANCE` off the aspect ratio of `height` × `width`."""
    return abs(size[0] / size[1] - width / height) > ASPECT_TOLERANCE * width / height


def check_aspect(size: tuple[int, int], height: int, width: int, what: str, made: str = "edits", docs: str = "docs/editing.md") -> None:
    """Refuse (`fit: refuse`) a source of (width, height) `size` more than 1 % off the aspect ratio of the `made` images
    (`height` × `width`)."""
    if aspect_differs(size, height, width):
        raise ValueError(f"{what} is {size[0]}×{size[1]} (width × height) and the {made} {width}×{height}, another aspect ratio, and "
                         f"sources.fit is refuse: fit it (sources.fit / --fit resize, crop or pad), crop or pad it to {width}:{height}, or "
                         f"set model.resolution to its shape ({docs})")


def fit_source(image, height: int, width: int, fit: str):
    """An RGB PIL image of another aspect ratio than `height` × `width` fitted by `fit` (module doc); one within 1 % of
    it, or any under `refuse`, as it is."""
    from PIL import Image

    if fit == "refuse" or not aspect_differs(image.size, height, width):
        return image
    if fit == "resize":
        return image.resize((width, height), Image.Resampling.LANCZOS)
    scale = min(image.width / width, image.height / height) if fit == "crop" else max(image.width / width, image.height / height)
    box_width, box_height = round(width * scale), round(height * scale)  # the model's aspect ratio, inside (crop) or around (pad) the image
    if fit == "crop":
        left, top = (image.width - box_width) // 2, (image.height - box_height) // 2
        return image.crop((left, top, left + box_width, top + box_height))
    padded = Image.new("RGB", (box_width, box_height))
    padded.paste(image, ((box_width - image.width) // 2, (box_height - image.height) // 2))
    return padded


def read_rgb(path: str):
    """The image at `path` as an RGB PIL image, read as the pipelines' `load_image` reads it (module doc): EXIF orientation
    applied, 16-bit grayscale levels scaled to 8 bits."""
    import numpy as np
    from PIL import Image, ImageOps

    with Image.open(path) as opened:
        image = ImageOps.exif_transpose(opened)
        if image.mode in SIXTEEN_BIT_MODES:
            levels = np.asarray(image, dtype=np.float64) / 65535  # 16-bit levels (PIL's "I" holds them as 32-bit integers)
            image = Image.fromarray(np.round(np.clip(levels, 0, 1) * 255).astype(np.uint8), "L")
        return image.convert("RGB")


@lru_cache(maxsize=16)
def _decode(path: str):
    """`read_rgb`, a few cached: a prompt's sources are read at every iteration that draws it."""
    return read_rgb(path)


def source_images(metadata: list[dict]) -> list[list] | None:
    """Each prompt's source images as RGB PIL images, or None when no prompt has any."""
    if not any(SOURCES in row for row in metadata):
        return None
    return [[_decode(path) for path in row.get(SOURCES, [])] for row in metadata]


def fitted_sources(metadata: list[dict], height: int, width: int) -> list[list] | None:
    """`source_images`, each fitted to `height` × `width` by its row's `FIT` (default resize; module doc)."""
    images = source_images(metadata)
    if images is None:
        return None
    return [[fit_source(image, height, width, row.get(FIT, "resize")) for image in images] for row, images in zip(metadata, images)]


def source_tensors(metadata: list[dict], size: tuple[int, int]) -> list[list[torch.Tensor]] | None:
    """Each prompt's source images fitted to (height, width) `size` as its model saw them, as float tensors (3, h, w) in
    [0, 1], or None when no prompt has any."""
    images = fitted_sources(metadata, *size)
    if images is None:
        return None
    import numpy as np

    return [[torch.from_numpy(np.asarray(image, dtype=np.float32) / 255).permute(2, 0, 1) for image in row] for row in images]


def mask_tensor(path: str, size: tuple[int, int], fit: str = "resize") -> torch.Tensor:
    """An edit mask (1, h, w) in [0, 1] from its image's luminance, fitted to (height, width) `size` as its source is
    (`fit`; its own size under resize, which its reader resizes): 1 where the edit may change the source."""
    import numpy as np

    image = _decode(path) if fit == "resize" else fit_source(_decode(path), *size, fit)
    return torch.from_numpy(np.asarray(image.convert("L"), dtype=np.float32) / 255)[None]
