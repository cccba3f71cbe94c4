"""`hpsv2` and `hpsv2.1`: Human Preference Score v2 / v2.1 (Wu et al. 2023, github.com/tgxs002/HPSv2).

The model is OpenCLIP ViT-H-14 fine-tuned on HPDv2; its checkpoint (`HPS_v2_compressed.pt`,
`HPS_v2.1_compressed.pt` in the hub repo `xswu/HPSv2`) is a torch file holding a dict whose
"state_dict" entry is the full open_clip `CLIP` state dict (no "module." prefix). The reference
builds ViT-H-14 and loads that dict strictly, so no base CLIP weights are needed; here open_clip's
own `load_checkpoint` reads it (with `weights_only=True`, strict).

Score, as the reference's `hpsv2.score`:

    HPS = <f_img / |f_img|, f_txt / |f_txt|>        (cosine in [-1, 1])

The HPS benchmark prints 100·HPS; FLUX scores ≈ 0.31 here (≈ 31 there).

Preprocessing, as the reference's evaluation transform (`image_transform(..., resize_longest_max=True)`
in the hpsv2 package): the 8-bit image as floats in [0, 1]; the LONGEST side resized to 224
(bicubic, antialiased; new sides `round(side · 224 / longest)`); zero padding (black, in [0, 1]
pixel space, i.e. BEFORE normalisation) to 224×224 with `pad // 2` on the left/top and the rest on
the right/bottom; then CLIP mean/std normalisation. Nothing is cropped. (The reference skips the
pad when the longest side is already 224, which leaves a non-square input the ViT rejects; here
such images are padded too.)
"""

from __future__ import annotations

import pickle
from pathlib import Path

import torch
import torch.nn.functional as F
from torchvision.transforms.v2 import functional as TF

from branchdiff.rewards.model_reward import CLIP_MEAN, CLIP_STD, ModelReward, first_line, resolve_weight_file, to_uint8

HPS_HUB_REPO = "xswu/HPSv2"
HPS_FILES = {"v2.0": "HPS_v2_compressed.pt", "v2.1": "HPS_v2.1_compressed.pt"}  # version -> file in HPS_HUB_REPO
HPS_NAMES = {"v2.0": "hpsv2", "v2.1": "hpsv2.1"}  # version -> registry name


def hps_preprocess(images: torch.Tensor, size: int = 224) -> torch.Tensor:
    """(B, 3, H, W) in [0, 1] -> (B, 3, size, size): longest side to `size` (bicubic, antialiased),
    zero-padded to a square (pad//2 left/top), then `(x - mean) / std` with CLIP statistics.
    Padded pixels are therefore `-mean / std` after normalisation."""
    height, width = images.shape[-2:]
    scale = size / max(height, width)
    new_height, new_width = round(height * scale), round(width * scale)  # Python rounding, as the reference
    if (new_height, new_width) != (height, width):
        images = TF.resize(images, [new_height, new_width], interpolation=TF.InterpolationMode.BICUBIC, antialias=True)
    pad_h, pad_w = size - new_height, size - new_width
    images = F.pad(images, (pad_w // 2, pad_w - pad_w // 2, pad_h // 2, pad_h - pad_h // 2), value=0.0)  # (B, 3, size, size)
    mean = torch.tensor(CLIP_MEAN, device=images.device).view(1, 3, 1, 1)
    std = torch.tensor(CLIP_STD, device=images.device).view(1, 3, 1, 1)
    return (images - mean) / std


class HPSReward(ModelReward):
    """HPSv2 (`version="v2.0"`, name `hpsv2`) or HPSv2.1 (`version="v2.1"`, name `hpsv2.1`).

    Args:
        version: "v2.0" or "v2.1" (default): which checkpoint, and the reward's name.
        checkpoint: a local checkpoint file, a folder holding the version's file, or a hub repo id;
            None (default) means the hub repo `xswu/HPSv2` (online only).
        architecture: the open_clip model config the checkpoint belongs to (default "ViT-H-14";
            tests pass a tiny registered config).
        device: where the model runs (default "cpu").
        batch_size: images per forward pass (default 16).
    """

    scale = "cosine in [-1, 1] of normalised CLIP image and text features (the HPS benchmark prints 100·cosine)"
    higher_is_better = True

    def __init__(
        self,
        version: str = "v2.1",
        checkpoint: str | Path | None = None,
        architecture: str = "ViT-H-14",
        device: str | torch.device = "cpu",
        batch_size: int = 16,
    ) -> None:
        super().__init__(device, batch_size)
        if version not in HPS_FILES:
            raise ValueError(f"HPS version must be one of {', '.join(HPS_FILES)}, got {version!r}")
        import open_clip

        self.name = HPS_NAMES[version]
        filename = HPS_FILES[version]
        if open_clip.get_model_config(architecture) is None:
            raise ValueError(f"reward {self.name!r}: unknown open_clip architecture {architecture!r}; e.g. 'ViT-H-14'")
        path = resolve_weight_file(
            checkpoint if checkpoint is not None else HPS_HUB_REPO, filename, reward=self.name,
            origin=f"https://huggingface.co/{HPS_HUB_REPO} (file {filename})",
        )
        model = open_clip.create_model(architecture, device="cpu")
        try:  # open_clip's loader: torch.load(weights_only=True), the "state_dict" entry, strict load_state_dict
            open_clip.load_checkpoint(model, str(path), strict=True, weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, KeyError, ValueError) as error:
            raise ValueError(f"reward {self.name!r}: {str(path)!r} is not an open_clip {architecture} checkpoint ({first_line(error)})") from error
        self.model = model.to(self.device).eval().requires_grad_(False)
        self.tokenizer = open_clip.get_tokenizer(architecture)
        image_size = model.visual.image_size
        self.image_size = int(image_size[0] if isinstance(image_size, (tuple, list)) else image_size)

    def score_chunk(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        pixels = hps_preprocess(to_uint8(images).to(self.device).float() / 255, self.image_size)  # (b, 3, 224, 224)
        tokens = self.tokenizer(prompts).to(self.device)  # (b, context_length)
        image_features = self.model.encode_image(pixels, normalize=True)  # (b, D)
        text_features = self.model.encode_text(tokens, normalize=True)  # (b, D)
        return (image_features * text_features).sum(dim=-1)


def hpsv2(checkpoint: str | Path | None = None, architecture: str = "ViT-H-14", device: str | torch.device = "cpu", batch_size: int = 16) -> HPSReward:
    """The registered `hpsv2`: `HPSReward(version="v2.0", ...)`."""
    return HPSReward("v2.0", checkpoint, architecture, device, batch_size)


def hpsv2_1(checkpoint: str | Path | None = None, architecture: str = "ViT-H-14", device: str | torch.device = "cpu", batch_size: int = 16) -> HPSReward:
    """The registered `hpsv2.1`: `HPSReward(version="v2.1", ...)`."""
    return HPSReward("v2.1", checkpoint, architecture, device, batch_size)
