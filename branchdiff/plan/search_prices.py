"""A search's decode and reward call priced in network rows of its family at its size (branchdiff/search/cost.py),
from floating-point operations counted as `branchdiff plan` counts them (multiply-add = 2):

    c_decode = FLOPs(one VAE decode) / FLOPs(one network row),    c_reward = FLOPs(one reward call) / FLOPs(one network row)

- one network row: the denoiser's no-grad forward of one latent at the size (`Measured.forward_flops`, fake tensors);
- one decode: the family's VAE decoding one latent at that size (`Measured.decode_flops`; 0 in pixel space);
- one reward call, per reward network (`REWARD_NETWORKS`): PickScore and HPS v2 / v2.1 are CLIP ViT-H/14: its image
  tower at 224² and its text tower at 77 tokens, both counted per sample (the prompt is encoded with each image);
  VideoAlign is Qwen2-VL-2B: its vision tower on the frames it reads (`videoalign_tokens`) and its language model on
  those tokens and the prompt's (`PROMPT_TOKENS`). The language model and CLIP are counted on fake tensors; Qwen2-VL's
  vision tower splits its attention by frame lengths read from the data, which fake tensors cannot follow, so it is
  counted by `qwen2_vl_vision_flops`'s formula (a test checks the formula against a counted forward of a small one).
  The rewards computed by rules (the built-in tasks' verifiers, flicker) cost no network FLOPs: 0. A reward not
  known here has no price: give it (`--reward-cost`).
Matrix products and convolutions are counted; element-wise work (norms, activations, softmax) and the host's work are
not, so the prices are a model, not a clock (docs/search.md gives measured figures where a GPU was lent).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch

from branchdiff.plan import published as P
from branchdiff.plan.measure import REWARD_NETWORKS, reward_network
from branchdiff.search.cost import Prices

RULE_REWARDS = ("tiny-geneval", "tiny-video", "tiny-partial", "flicker")  # computed by rules: no network FLOPs
PROMPT_TOKENS = 128  # VideoAlign's question around the prompt, with the prompt (its chat template and a sentence's prompt)
QWEN_VIDEO_PIXELS = (56 * 56, 28 * 28 * 1280)  # Qwen2-VL's video processor: area bounds of a resized frame (its defaults)


@dataclass(frozen=True)
class PricedRun:
    """What a price is computed from, and the price: FLOPs of a row, a decode and a reward call."""
    row_flops: float
    decode_flops: float
    reward_flops: float

    @property
    def prices(self) -> Prices:
        return Prices(decode=self.decode_flops / self.row_flops, reward=self.reward_flops / self.row_flops)


def counted_flops(build: Callable[[], torch.nn.Module], run: Callable[[torch.nn.Module], object]) -> float:
    """FLOPs of `run(model)` for a model from `build()`, built on the meta device and run on fake tensors (no memory)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"):
        model = build()
    counter = FlopCounterMode(display=False)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")
        with torch.no_grad(), counter:
            run(model)
    return float(counter.get_total_flops())


@cache
def clip_vit_h14_flops() -> float:
    """One sample through CLIP ViT-H/14: the image tower at 224² plus the text tower at 77 tokens."""
    def run(model: Any) -> None:
        model.get_image_features(pixel_values=torch.empty(1, 3, 224, 224))
        model.get_text_features(input_ids=torch.zeros(1, 77, dtype=torch.long))

    return counted_flops(lambda: reward_network("vit-h-14"), run)


def qwen2_vl_vision_flops(vision: dict, slices: int, height_patches: int, width_patches: int) -> float:
    """Qwen2-VL's vision tower on `slices` temporal slices of height_patches × width_patches patches (N patches in all):
    the patch embedding 2·N·(C·t·p²)·E, per block the linear layers 2·N·(4E² + 2·E·mlp·E) and attention within each
    slice 4·slices·n²·E (n = its patches), and the merger's MLP 2·(N/m²)·(m²E·m²E + m²E·H)."""
    embed, patch, temporal, merge = vision["embed_dim"], vision["patch_size"], vision["temporal_patch_size"], vision["spatial_merge_size"]
    per_slice = height_patches * width_patches
    patches = slices * per_slice
    hidden, merged = embed * vision["mlp_ratio"], embed * merge**2
    flops = 2 * patches * vision["in_chans"] * temporal * patch**2 * embed
    flops += vision["depth"] * (2 * patches * (4 * embed**2 + 2 * embed * hidden) + 4 * slices * per_slice**2 * embed)
    return float(flops + 2 * (patches // merge**2) * (merged * merged + merged * vision["hidden_size"]))


@cache
def qwen2_vl_text_flops(tokens: int) -> float:
    """Qwen2-VL-2B's language model on `tokens` tokens (fake tensors; the head is not run: VideoAlign reads hidden states)."""
    width = P.QWEN2_VL_2B["text_config"]["hidden_size"]
    return counted_flops(lambda: reward_network("qwen2-vl-2b"), lambda model: model.model.language_model(inputs_embeds=torch.empty(1, tokens, width)))


def videoalign_tokens(frames: int, height: int, width: int, kwargs: dict) -> tuple[int, int, int]:
    """(temporal slices, height patches, width patches) of a clip of `frames` frames at height × width read by VideoAlign
    with `kwargs`: `num_frames` of them (None: all), each resized by Qwen2-VL's video processor rule to multiples of 28
    within its area bounds; frames pair into slices of 2 (an odd count padded)."""
    from branchdiff.rewards.videoalign import release_size

    read = min(frames, kwargs.get("num_frames") or frames)
    low, high = QWEN_VIDEO_PIXELS
    resized = release_size(height, width, {"size_factor": 28, "min_pixels": low, "max_pixels": high})
    vision = P.QWEN2_VL_2B["vision_config"]
    return math.ceil(read / vision["temporal_patch_size"]), resized[0] // vision["patch_size"], resized[1] // vision["patch_size"]


def reward_flops(name: str, kwargs: dict, size: tuple[int, int, int]) -> float | None:
    """FLOPs of one call of reward `name` on one sample of `size` (frames, height, width); None: not known here."""
    if name in RULE_REWARDS:
        return 0.0
    network = REWARD_NETWORKS.get(name)
    if network == "vit-h-14":
        return clip_vit_h14_flops()
    if network == "qwen2-vl-2b":
        slices, height, width = videoalign_tokens(*size, kwargs)
        merge = P.QWEN2_VL_2B["vision_config"]["spatial_merge_size"]
        video_tokens = slices * height * width // merge**2
        return qwen2_vl_vision_flops(P.QWEN2_VL_2B["vision_config"], slices, height, width) + qwen2_vl_text_flops(video_tokens + PROMPT_TOKENS)
    return None


def price_search(config: Any, reward: str, reward_kwargs: dict | None = None, reward_cost: float | None = None) -> PricedRun:
    """The FLOPs of a row, a decode and a call of `reward` for the family and size of the run `config` (a training config:
    model.family, model.path, model.resolution, model.frames, model.dtype); `reward_cost` (in rows) replaces the reward's
    count, and is needed for a reward not known here."""
    from branchdiff.plan.estimate import Estimator
    from branchdiff.plan.families import size_of

    estimator = Estimator()
    measured = estimator.measured(estimator.family(config), config)
    row = measured.forward_flops()
    if reward_cost is not None:
        return PricedRun(row, measured.decode_flops, reward_cost * row)
    flops = reward_flops(reward, reward_kwargs or {}, size_of(config))
    if flops is None:
        raise ValueError(f"a budget in cost needs the price of reward {reward!r}, which `branchdiff plan` does not count (it counts "
                         f"{', '.join([*REWARD_NETWORKS, *RULE_REWARDS])}): give it in network rows, e.g. --reward-cost 2")
    return PricedRun(row, measured.decode_flops, flops)
