"""Sample grids in TensorBoard: an image grid as an image summary, a video grid as an animated GIF in an
image summary (what TensorBoard's own video summaries are, and what its images tab plays).

torch's `SummaryWriter.add_video` encodes the GIF through moviepy, whose 2.x releases no longer have the
module it imports; here imageio (already the MP4 writer's library) encodes it, with its Pillow plugin.
"""

from __future__ import annotations

import io

import torch

GIF_FRAME_MS = 125  # 8 frames a second, as the MP4s (report/video.py FPS)


def gif_bytes(video: torch.Tensor, frame_ms: int = GIF_FRAME_MS) -> bytes:
    """A video (F, 3, H, W) in [0, 1] as an endlessly looping GIF."""
    import imageio.v3 as iio

    from branchdiff.rewards.base import to_uint8

    frames = to_uint8(video).permute(0, 2, 3, 1).numpy()  # (F, H, W, 3) uint8
    buffer = io.BytesIO()
    iio.imwrite(buffer, frames, extension=".gif", duration=frame_ms, loop=0)
    return buffer.getvalue()


def add_grid(writer, tag: str, grid: torch.Tensor, step: int) -> None:
    """Log a grid to a `SummaryWriter`: (3, H, W) as an image, (F, 3, H, W) as a playing GIF."""
    if grid.dim() == 3:
        writer.add_image(tag, grid.clamp(0, 1), step)
        return
    from tensorboard.compat.proto.summary_pb2 import Summary

    image = Summary.Image(height=grid.shape[2], width=grid.shape[3], colorspace=3, encoded_image_string=gif_bytes(grid))
    writer._get_file_writer().add_summary(Summary(value=[Summary.Value(tag=tag, image=image)]), step)
