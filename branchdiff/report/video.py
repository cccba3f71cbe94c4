"""Videos a user can look at: a video's frames side by side in one image (`frame_strip`, what grids,
the report and a sample's PNG show) and the video itself as an MP4 (`write_mp4`, through imageio and
the ffmpeg binary imageio-ffmpeg ships). `save_sample` writes a sample as its family makes it: an
image as a PNG, a video as a strip PNG with the MP4 beside it."""

from __future__ import annotations

from pathlib import Path

import torch

FPS = 8  # frames per second of the MP4s written (Wan's releases play at 16; the tiny models' clips are short)
STRIP_FRAMES = 8  # frames a strip shows at most, evenly spaced from the first to the last


def frame_strip(videos: torch.Tensor, frames: int = STRIP_FRAMES) -> torch.Tensor:
    """Videos (B, F, 3, H, W) → images (B, 3, H, K·W) of K = min(F, frames) evenly spaced frames side by side."""
    count = videos.shape[1]
    picked = torch.linspace(0, count - 1, min(count, frames)).round().long()  # (K,)
    chosen = videos[:, picked]  # (B, K, 3, H, W)
    return chosen.permute(0, 2, 3, 1, 4).flatten(3)  # (B, 3, H, K·W)


def write_mp4(video: torch.Tensor, path: Path, fps: int = FPS) -> None:
    """A video (F, 3, H, W) in [0, 1] as an H.264 MP4, written whole or not at all."""
    try:
        import imageio.v3 as iio
    except ImportError:
        raise ImportError("writing MP4s needs imageio and imageio-ffmpeg: pip install imageio imageio-ffmpeg") from None
    from branchdiff.rewards.base import to_uint8
    from branchdiff.runtime import storage

    frames = to_uint8(video).permute(0, 2, 3, 1).numpy()  # (F, H, W, 3) uint8
    storage.replace_file(path, lambda tmp: iio.imwrite(tmp, frames, extension=".mp4", fps=fps, codec="libx264", macro_block_size=1,
                                                                output_params=["-f", "mp4"]))  # the temporary name has no .mp4


def save_sample(sample: torch.Tensor, path: Path) -> list[Path]:
    """An image (3, H, W) as the PNG `path`; a video (F, 3, H, W) as its strip there and the MP4 beside
    it (`path` with .mp4). Returns the files written."""
    from torchvision.utils import save_image

    if sample.dim() == 3:
        save_image(sample, path)
        return [path]
    save_image(frame_strip(sample[None])[0], path)
    write_mp4(sample, path.with_suffix(".mp4"))
    return [path, path.with_suffix(".mp4")]
