"""`edit-consistency`: how much of the source image an edit keeps where it should not change it, for
instruction editing (docs/editing.md). It needs no weights; its call takes `sources=`.

    edit-consistency = 1 − Σ_p w_p · |x_p − s_p| / (3 · Σ_p w_p)

over the result's pixels p and channels, with s the prompt's (first) source image resized to the
result's size (bilinear, antialiased) and w = 1 − m the weight outside the edit mask m (the prompt's
"mask", resized the same way; white where the edit may change the image); without a mask every pixel
counts. In [0, 1]; 1 keeps the source exactly. Combine it with a preference reward on the result
(`reward: [{name: pickscore}, {name: edit-consistency, weight: 0.5}]`): alone it rewards doing nothing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from branchdiff.data.sources import FIT, MASK, mask_tensor


class EditConsistency:
    name = "edit-consistency"
    scale = "1 − mean |result − source| outside the edit mask, pixels in [0, 1] (1: the source kept)"
    higher_is_better = True

    def __init__(self, device: str | torch.device = "cpu") -> None:
        self.device = torch.device(device)

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict], sources: list[list[torch.Tensor]] | None = None) -> torch.Tensor:
        if sources is None or len(sources) != len(images) or not all(sources):
            raise ValueError("reward 'edit-consistency' compares each result with its source image: the prompts need an \"image\" "
                             "(an editing prompt set, docs/editing.md)")
        scores = []
        for image, row, own in zip(images.to(self.device, torch.float32), metadata, sources):
            size = image.shape[-2:]
            source = F.interpolate(own[0][None].to(self.device, torch.float32), size=size, mode="bilinear", antialias=True)[0].clamp(0, 1)
            weight = torch.ones(1, *size, device=self.device)  # (1, H, W)
            if row.get(MASK):
                mask = mask_tensor(row[MASK], tuple(size), row.get(FIT, "resize"))[None].to(self.device)  # fitted as its source
                weight = 1 - F.interpolate(mask, size=size, mode="bilinear", antialias=True)[0].clamp(0, 1)
            difference = ((image - source).abs() * weight).sum() / (3 * weight.sum().clamp_min(1e-8))
            scores.append(1 - difference)
        return torch.stack(scores).cpu()  # (B,)
