"""A dense, model-agnostic reward for trainer tests: how red an image is (mean of R - (G+B)/2)."""

import torch


class Redness:
    name = "redness"
    scale = "mean of R - (G + B) / 2, in [-1, 1]"

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: dict | None = None) -> torch.Tensor:
        return (images[:, 0] - images[:, 1:].mean(dim=1)).flatten(1).mean(dim=1)


class Failing:
    """Raises on every batch, with a two-line message (the CLI must still print one line)."""

    name = "failing"
    scale = "none"

    def __call__(self, images, prompts, metadata):
        raise RuntimeError("weights not found\nsecond line")


class WrongShape:
    name = "wrong-shape"
    scale = "none"

    def __call__(self, images, prompts, metadata):
        return torch.zeros(len(prompts), 2)


class AllNaN:
    name = "all-nan"
    scale = "none"

    def __call__(self, images, prompts, metadata):
        return torch.full((len(prompts),), float("nan"))


class Darkness:
    """Redness's opposite direction: lower is better."""

    name = "darkness"
    scale = "mean pixel value (lower is better)"
    higher_is_better = False

    def __call__(self, images, prompts, metadata):
        return images.flatten(1).mean(dim=1)


class AllInf:
    name = "all-inf"
    scale = "none"

    def __call__(self, images, prompts, metadata):
        return torch.full((len(prompts),), float("inf"))


class FirstNaN(Redness):
    """Redness with NaN for the first image of every batch (one leaf of the first group)."""

    name = "first-nan"

    def __call__(self, images, prompts, metadata=None):
        scores = super().__call__(images, prompts, metadata)
        scores[0] = float("nan")
        return scores


class PromptColour:
    """A hackable proxy of the tiny task: the fraction of the image painted in the prompt's colour.
    Painting the whole image wins it, and the objects the prompt asks for disappear."""

    name = "prompt-colour"
    scale = "fraction of pixels within 0.3 of the prompt's colour, in [0, 1]"

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata=None) -> torch.Tensor:
        from branchdiff.data.tiny_task import COLORS, parse_prompt

        colours = torch.tensor([COLORS[parse_prompt(p).color] for p in prompts])  # (B, 3)
        distance = (images - colours[:, :, None, None]).norm(dim=1)  # (B, H, W)
        return (distance < 0.3).float().flatten(1).mean(dim=1)


class Shifted:
    """An image's mean brightness plus `offset`: a stand-in of any reward, distinct by its offset (a benchmark's several scores)."""

    name = "shifted"
    scale = "mean pixel value + offset"

    def __init__(self, offset: float = 0.0) -> None:
        self.offset = offset

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict] | None = None) -> torch.Tensor:
        return images.flatten(1).mean(dim=1) + self.offset
