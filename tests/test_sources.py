"""Image files a set names (branchdiff/data/sources.py): read as the pipelines' `load_image` reads them (EXIF orientation,
16-bit levels scaled), fitted to the model's size by `sources.fit` (each mode against an independent computation, resize
against diffusers' own image processor), and every image of a set read whole when the set is read: a damaged file, one
past PIL's decompression-bomb guard or a symbolic link that loops is one line naming the file and the row, before any
model loads and with nothing written, in an SFT set, an offline-DPO set, an image-to-video prompt set and `sample --image`."""

from __future__ import annotations

import json
import zlib

import numpy as np
import pytest
from PIL import Image

from branchdiff.cli import main
from branchdiff.data.sources import fit_source, image_size, read_rgb
from test_cli_errors import error_line

PREFIX = "branchdiff: error: "


def _pattern(width: int, height: int) -> Image.Image:
    """An RGB image whose every pixel differs from its neighbours (so a crop, a pad or a turn shows)."""
    rows, columns = np.mgrid[0:height, 0:width]
    return Image.fromarray(np.stack([rows * 7 % 256, columns * 11 % 256, (rows * columns) % 256], axis=-1).astype(np.uint8))


def test_each_fit_against_an_independent_computation():
    from diffusers.image_processor import VaeImageProcessor

    wide = _pattern(40, 20)  # width × height: 2:1 for square 32×32 images
    pixels = np.asarray(wide)
    resized = np.asarray(fit_source(wide, 32, 32, "resize"))
    assert np.array_equal(resized, np.asarray(VaeImageProcessor().resize(wide, 32, 32)))  # the pipelines' own stretch (Lanczos)
    assert np.array_equal(np.asarray(fit_source(wide, 32, 32, "crop")), pixels[:, 10:30])  # the centred 20×20 box
    padded = np.zeros((40, 40, 3), dtype=np.uint8)
    padded[10:30] = pixels
    assert np.array_equal(np.asarray(fit_source(wide, 32, 32, "pad")), padded)
    assert fit_source(wide, 32, 32, "refuse") is wide
    near = _pattern(201, 200)  # 0.5 % off a square: taken as it is, the family resizes it as its pipeline does
    assert all(fit_source(near, 32, 32, fit) is near for fit in ("resize", "crop", "pad"))


def test_exif_orientation_and_16_bit_levels_are_read_as_load_image_reads_them(tmp_path):
    """A photo stored sideways with orientation 6 (turn 90° clockwise to view) reads upright, and its size is the upright
    one (it was read sideways); a 16-bit grayscale PNG reads at its levels (PIL's convert clips them: almost white)."""
    from diffusers.utils import load_image

    upright = _pattern(30, 12)
    stored = upright.transpose(Image.Transpose.ROTATE_90)  # 12 wide, 30 high, as a phone stores it
    exif = Image.Exif()
    exif[0x0112] = 6
    stored.save(tmp_path / "phone.png", exif=exif)
    assert np.array_equal(np.asarray(read_rgb(str(tmp_path / "phone.png"))), np.asarray(upright))
    assert np.array_equal(np.asarray(read_rgb(str(tmp_path / "phone.png"))), np.asarray(load_image(str(tmp_path / "phone.png"))))
    assert image_size(str(tmp_path / "phone.png")) == (30, 12)
    levels = np.linspace(0, 65535, 16 * 16).reshape(16, 16).astype(np.uint16)
    Image.fromarray(levels).save(tmp_path / "deep.png")
    assert Image.open(tmp_path / "deep.png").mode == "I;16"
    read = np.asarray(read_rgb(str(tmp_path / "deep.png")))
    assert np.array_equal(read, np.repeat(np.round(levels / 257).astype(np.uint8)[..., None], 3, axis=-1))
    assert abs(read.mean() / 255 - 0.5) < 0.01  # PIL's own conversion read 0.998


@pytest.fixture
def files(tmp_path, monkeypatch):
    """Good and damaged images beside each other: a 32×32 PNG, half a JPEG, a PNG whose compressed data is broken, one past
    PIL's pixel limit (lowered here), a symbolic link to itself and a 16-bit PNG."""
    monkeypatch.chdir(tmp_path)
    Image.new("RGB", (32, 32), "red").save("good.png")
    _pattern(32, 32).save("photo.jpg", quality=90)
    whole = (tmp_path / "photo.jpg").read_bytes()
    (tmp_path / "half.jpg").write_bytes(whole[: len(whole) // 2])
    _pattern(32, 32).save("broken.png")
    data = bytearray((tmp_path / "broken.png").read_bytes())
    chunk = data.index(b"IDAT")  # length (4 bytes) before it; then the compressed pixels and their CRC
    length = int.from_bytes(data[chunk - 4 : chunk], "big")
    data[chunk + 8 : chunk + 48] = bytes(40)  # the compressed pixels overwritten, past zlib's 2-byte header
    data[chunk + 4 + length : chunk + 8 + length] = zlib.crc32(data[chunk : chunk + 4 + length]).to_bytes(4, "big")  # a valid CRC:
    (tmp_path / "broken.png").write_bytes(bytes(data))  # PIL's verify() passes, only decoding the pixels fails
    Image.new("RGB", (40, 40), "blue").save("huge.png")
    (tmp_path / "loop.png").symlink_to(tmp_path / "loop.png")
    Image.fromarray(np.full((32, 32), 30000, dtype=np.uint16)).save("deep.png")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 32 * 32 // 2)  # 40×40 is more than twice this: PIL's DecompressionBombError
    return tmp_path


DAMAGED = [("half.jpg", "could not be read as an image (OSError: "),
           ("broken.png", "could not be read as an image ("),
           ("huge.png", "could not be read as an image (DecompressionBombError: Image size (1600 pixels) exceeds limit"),
           ("loop.png", "is a symbolic link that cannot be followed")]


def _train(run, *overrides: str) -> list[str]:
    return ["train", "tiny-chain", f"output_dir={run}", "iterations=1", "final_eval=false", "logging.report_to=none", "model.compile=none", *overrides]


@pytest.mark.parametrize(("name", "words"), DAMAGED)
def test_a_damaged_image_of_an_sft_or_dpo_set_is_one_line_before_anything_loads(files, name, words, capsys):
    for loss, row in (("sft", {"prompt": "one red circle on the left", "image": name}),
                      ("dpo-offline", {"prompt": "one red circle on the left", "chosen": "good.png", "rejected": name})):
        rows = [{"prompt": "one red circle on the left", **{key: "good.png" for key in row if key not in ("prompt",)}}, row]
        rows[0] = {**rows[0], "rejected": "photo.jpg"} if loss == "dpo-offline" else rows[0]
        (files / "set.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        key = "sft.data" if loss == "sft" else "dpo_offline.data"
        assert main(_train(files / "run", f"train.loss={loss}", f"{key}={files / 'set.jsonl'}")) == 2
        line = error_line(capsys)
        assert line.startswith(f"{PREFIX}{files / 'set.jsonl'}:2: ") and words in line and f"'{name}'" in line, line
        assert name != "half.jpg" or line.endswith("; the file is cut short: copy or export it again)")
        assert not (files / "run").exists()


def test_a_pair_of_one_image_a_long_demonstration_prompt_and_a_16_bit_image(files, capsys):
    """chosen == rejected trained on nothing; a 12,000-character prompt skipped the length check; a 16-bit PNG is read
    at its levels (it trains)."""
    (files / "pairs.jsonl").write_text(json.dumps({"prompt": "one red circle on the left", "chosen": "good.png", "rejected": "good.png"}) + "\n")
    assert main(_train(files / "run", "train.loss=dpo-offline", f"dpo_offline.data={files / 'pairs.jsonl'}")) == 2
    assert error_line(capsys) == (f"{PREFIX}{files / 'pairs.jsonl'}:1: \"chosen\" and \"rejected\" are the same image, and a pair trains on "
                                  "their difference: give the rejected image of the pair, or drop the row")
    (files / "long.jsonl").write_text(json.dumps({"prompt": "a red circle " * 1000, "image": "good.png"}) + "\n")
    assert main(_train(files / "run", "train.loss=sft", f"sft.data={files / 'long.jsonl'}")) == 2
    line = error_line(capsys)
    assert line.startswith(f"{PREFIX}prompt 1 of demonstrations set '") and "long.jsonl' is 13,000 characters" in line, line
    assert not (files / "run").exists()
    from branchdiff.data.demonstrations import load_image_set

    (files / "deep.jsonl").write_text(json.dumps({"prompt": "one red circle on the left", "image": "deep.png"}) + "\n")
    pixels = load_image_set(str(files / "deep.jsonl"), "demonstrations", (32, 32)).pixels(0)[0]
    assert pixels.sub(round(30000 / 257) / 255).abs().max().item() < 1e-6  # it read 1.0 (white)


@pytest.mark.parametrize(("name", "words"), DAMAGED)
def test_a_damaged_first_frame_or_source_is_one_line_naming_its_row(files, name, words, capsys):
    from branchdiff.data.prompts import load_prompt_set

    (files / "edits.jsonl").write_text(json.dumps({"prompt": "a", "image": "good.png"}) + "\n" + json.dumps({"prompt": "b", "image": name}) + "\n")
    with pytest.raises(ValueError) as raised:
        load_prompt_set(str(files / "edits.jsonl"))
    assert str(raised.value).startswith(f"{files / 'edits.jsonl'}:2: source image '{name}' ") and words in str(raised.value)
    assert main(["sample", "--family", "flux-kontext", "--model", str(files), "--prompt", "make it red", "--image", name, "--out", "out"]) == 2
    line = error_line(capsys)
    assert line.startswith(f"{PREFIX}--image: source image '{name}' ") and words in line and not (files / "out").exists()


@pytest.mark.parametrize(("size", "multiple"), [((720, 1280), 32), ((48, 80), 32), ((480, 854), 16), ((704, 1280), 32)])
def test_the_suggested_size_keeps_the_aspect_ratio(size, multiple):
    """The size a refusal suggests (`nearest_size`) against a search of every multiple: the one nearest in area among those
    within 1 % of the aspect ratio (the hint once changed it: 48×80 → [64, 64]; 720×1280 at 32 → 704×1280, 2.3 % off)."""
    import math

    from branchdiff.models.pipeline_adapter import nearest_size

    aspect, area = size[1] / size[0], size[0] * size[1]
    kept = [(abs(math.log(r * c * multiple**2 / area)), [r * multiple, c * multiple]) for r in range(1, 100) for c in range(1, 100)
            if abs(c / r - aspect) / aspect <= 0.01]
    assert nearest_size(size, multiple) == min(kept)[1]
