"""`learned-proxy`: a small network fit to a built-in task's verifier, or an ensemble of them, as a reward.

Gao, Schulman and Hilton ("Scaling Laws for Reward Model Overoptimization", 2023) measured reward hacking by training
proxy reward models on a gold model's labels and optimising the proxies while watching the gold. The built-in tasks
have an exact gold, their verifier, so the same experiment runs here: `branchdiff bench proxies` fits networks of this
module to the verifier's `partial` score of N samples of the base model (branchdiff/bench/proxies.py), and a run
trains on them (`reward: {name: learned-proxy, kwargs: {path: ...}}`) while its held-out strict score is the gold
(docs/hacking.md).

The network (`ProxyNet`) reads a sample (an image (3, 32, 32), or a clip's frames stacked as channels (3·F, 32, 32))
and its prompt's attributes (one-hot: count, colour, shape and position or direction), which scale and shift its
last convolution's features (FiLM); a sigmoid puts the score in [0, 1].

Ensembles (`path` a list of proxies of one task), from the M networks' scores s_1..s_M of a sample:

    mean:      (1/M)·Σ s_m
    min:       min_m s_m
    mean-std:  mean − k·std,   std = √(Σ (s_m − mean)² / (M − 1))   (0 for one network; `k`, default 1)

A proxy is a folder holding `proxy.safetensors` (the weights) and `proxy.json` (task, sizes, what it was fit on and
its accuracy), loaded without unpickling anything.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from branchdiff.data import tiny_task, tiny_video_task
from branchdiff.data.tiny_task import IMAGE_SIZE, check_grammar

WEIGHTS, CARD = "proxy.safetensors", "proxy.json"
REDUCTIONS = ("mean", "min", "mean-std")
TASKS = ("tiny-geneval", "tiny-video")  # the verifier a proxy is fit to


def _parser(task: str):
    return tiny_video_task.parse_prompt if task == "tiny-video" else tiny_task.parse_prompt


def prompt_features(task: str, prompts: list[str]) -> torch.Tensor:
    """One-hot attributes (B, D) of `task`'s prompts: count, colour, shape, then position (images, D = 14) or direction
    (clips, D = 13)."""
    if task == "tiny-video":
        fields = ((tuple(tiny_video_task.COUNTS.values()), "count"), (tuple(tiny_task.COLORS), "color"), (tiny_task.SHAPES, "shape"),
                  (tuple(tiny_video_task.DIRECTIONS), "direction"))
    else:
        fields = ((tuple(tiny_task.COUNTS.values()), "count"), (tuple(tiny_task.COLORS), "color"), (tiny_task.SHAPES, "shape"),
                  (tiny_task.POSITIONS, "position"))
    parse = _parser(task)
    rows = []
    for text in prompts:
        prompt = parse(text)
        rows.append([float(getattr(prompt, attribute) == value) for values, attribute in fields for value in values])
    return torch.tensor(rows, dtype=torch.float32)  # (B, D)


def in_channels(task: str) -> int:
    return 3 * tiny_video_task.FRAMES if task == "tiny-video" else 3


class ProxyNet(nn.Module):
    """Score in [0, 1] of samples (B, C, 32, 32) given their prompts' features (B, D) (module doc)."""

    def __init__(self, channels: int, prompt_dim: int, width: int = 32) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(channels, width, 3, padding=1), nn.SiLU(),
            nn.Conv2d(width, 2 * width, 3, stride=2, padding=1), nn.SiLU(),  # 16 × 16
            nn.Conv2d(2 * width, 2 * width, 3, stride=2, padding=1))  # 8 × 8
        self.film = nn.Linear(prompt_dim, 4 * width)  # a scale and a shift per channel
        self.head = nn.Sequential(
            nn.SiLU(), nn.Conv2d(2 * width, 2 * width, 3, stride=2, padding=1), nn.SiLU(), nn.Flatten(),  # 4 × 4
            nn.Linear(2 * width * (IMAGE_SIZE // 8) ** 2, 64), nn.SiLU(), nn.Linear(64, 1))

    def forward(self, samples: torch.Tensor, prompts: torch.Tensor) -> torch.Tensor:
        h = self.features(samples)  # (B, 2w, 8, 8)
        scale, shift = self.film(prompts).chunk(2, dim=1)  # (B, 2w) each
        h = h * (1 + scale[:, :, None, None]) + shift[:, :, None, None]
        return torch.sigmoid(self.head(h).squeeze(1))  # (B,)


def as_channels(pixels: torch.Tensor) -> torch.Tensor:
    """Images (B, 3, H, W) as they are; clips (B, F, 3, H, W) with their frames stacked as channels (B, 3·F, H, W)."""
    return pixels.flatten(1, 2) if pixels.dim() == 5 else pixels


def save_proxy(folder: Path, network: ProxyNet, card: dict) -> None:
    """The proxy's weights and card (`task`, `channels`, `prompt_dim`, `width` and what it was fit on) in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    save_file({name: tensor.detach().contiguous().cpu() for name, tensor in network.state_dict().items()}, str(folder / WEIGHTS))
    (folder / CARD).write_text(json.dumps(card, indent=1) + "\n")


def read_card(folder: str | Path) -> dict:
    """A proxy's card, or a one-line ValueError naming the folder and what it lacks."""
    folder = Path(folder)
    if not (folder / CARD).is_file() or not (folder / WEIGHTS).is_file():
        raise ValueError(f"learned-proxy: {folder} is not a proxy (no {CARD} and {WEIGHTS}); make one with branchdiff bench proxies")
    card = json.loads((folder / CARD).read_text())
    if card.get("task") not in TASKS:
        raise ValueError(f"learned-proxy: {folder / CARD} names task {card.get('task')!r}; a proxy is fit to one of {', '.join(TASKS)}")
    return card


def load_proxy(folder: str | Path, device: str | torch.device = "cpu") -> tuple[ProxyNet, dict]:
    """The network of a proxy folder (in eval mode, on `device`) and its card."""
    card = read_card(folder)
    network = ProxyNet(card["channels"], card["prompt_dim"], card["width"])
    network.load_state_dict(load_file(str(Path(folder) / WEIGHTS)))
    return network.to(device).eval(), card


def _paths(path: str | list[str]) -> list[str]:
    paths = [path] if isinstance(path, str) else list(path) if isinstance(path, (list, tuple)) else []
    if not paths or not all(isinstance(p, str) and p for p in paths):
        raise ValueError(f"learned-proxy: path={path!r} must be a proxy's folder or a list of them (an ensemble)")
    return paths


class LearnedProxy:
    """The score of one proxy, or the `reduce` of an ensemble's (module doc)."""

    name = "learned-proxy"
    higher_is_better = True

    def __init__(self, path: str | list[str], reduce: str = "mean", k: float = 1.0, device: str | torch.device = "cpu") -> None:
        if reduce not in REDUCTIONS:
            raise ValueError(f"learned-proxy: reduce={reduce!r} is not one of {', '.join(REDUCTIONS)}")
        if isinstance(k, bool) or not isinstance(k, (int, float)) or not math.isfinite(k) or k < 0:
            raise ValueError(f"learned-proxy: k={k!r} must be a number ≥ 0 (mean-std's mean − k·std)")
        self.device = torch.device(device)
        loaded = [load_proxy(folder, self.device) for folder in _paths(path)]
        tasks = {card["task"] for _, card in loaded}
        if len(tasks) > 1:
            raise ValueError(f"learned-proxy: an ensemble's proxies must share a task; these are fit to {', '.join(sorted(tasks))}")
        self.networks = [network for network, _ in loaded]
        self.task, self.reduce, self.k = tasks.pop(), reduce, float(k)
        self.video = self.task == "tiny-video"
        what = f"an ensemble of {len(loaded)} ({reduce}{f', k = {self.k:g}' if reduce == 'mean-std' else ''})" if len(loaded) > 1 else "one network"
        self.scale = f"a learned proxy of {self.task}'s partial credit, {what}, in [0, 1]"

    @staticmethod
    def check_prompts(prompts: list[str], path: str | list[str] = "", **settings: object) -> None:
        """Refuse, before a run starts, a prompt outside the grammar of the proxies' task (preflight calls it)."""
        check_grammar(prompts, _parser(read_card(_paths(path)[0])["task"]))

    @staticmethod
    def scores_videos(path: str | list[str] = "", **settings: object) -> bool:
        """Whether these proxies score clips (the video task's), read from their card before anything is built."""
        return read_card(_paths(path)[0])["task"] == "tiny-video"

    @torch.no_grad()
    def __call__(self, pixels: torch.Tensor, prompts: list[str], metadata: list[dict] | None = None) -> torch.Tensor:
        """Scores (B,) of images (B, 3, H, W) or clips (B, F, 3, H, W) in [0, 1]."""
        if pixels.shape[0] != len(prompts):
            raise ValueError(f"learned-proxy: got {pixels.shape[0]} samples for {len(prompts)} prompts")
        samples = as_channels(pixels.detach().float().clamp(0, 1).to(self.device))
        features = prompt_features(self.task, prompts).to(self.device)
        scores = torch.stack([network(samples, features) for network in self.networks])  # (M, B)
        return reduce_ensemble(scores, self.reduce, self.k).cpu()


def reduce_ensemble(scores: torch.Tensor, reduce: str, k: float = 1.0) -> torch.Tensor:
    """An ensemble's score (B,) from its networks' (M, B) (module doc)."""
    if reduce == "min":
        return scores.min(dim=0).values
    mean = scores.mean(dim=0)
    if reduce == "mean" or scores.shape[0] == 1:
        return mean
    return mean - k * scores.std(dim=0, unbiased=True)
