"""`videoalign`: a vision-language reward of videos in the style of VideoAlign's VideoReward (Liu et al.
2025, "Improving Video Generation with Human Feedback", arXiv 2501.13918), the motion-quality reward
BranchGRPO trains Wan with (`video = True`).

A Qwen2-VL model (transformers' `Qwen2VLForConditionalGeneration`) reads the video and a text that
names the prompt and holds three special tokens, one per dimension: visual quality (VQ), motion
quality (MQ) and text alignment (TA). With h_d the last layer's hidden state at dimension d's token
and w the reward head (a linear map hidden → 1 without bias),

    raw_d = w_k · h_d (k = 0, or d for three rows)   score_d = (raw_d − mean_d) / std_d   overall = VQ + MQ + TA

(the head and the standardisation are VideoReward's; mean and std are the checkpoint's). The reward is
`dimension`: `overall` (the default) or one of VQ, MQ, TA; `score` returns all four.

h_d is computed as VideoReward's released reward model computes it, which is not Qwen2-VL's stock forward:
its model calls the language model without position ids, which in the transformers it was released with
(4.45) numbers the tokens 0, 1, 2, ... in all three sections of Qwen2-VL's rotary embedding (1-D positions),
where the stock forward gives a video's tokens their (frame, row, column) places (3-D M-RoPE). The release's
scores are defined by that path, so the reward passes those 1-D positions (the stock path moves a score by
up to about 6e-3 on a tiny model of the release's layout).

The model is a LOCAL FOLDER (nothing is downloaded) holding
- the model (`save_pretrained` of the Qwen2-VL model: config.json, *.safetensors) and its processor
  (`Qwen2VLProcessor.save_pretrained`: tokenizer with the three special tokens, chat template, image
  and video processors);
- `reward_head.safetensors`: {"weight": (1, hidden)}, one head for every token, or (3, hidden), row d for
  dimension d;
- `videoalign.json`: {"template": the text after the video, with `{prompt}` and the three tokens,
  "tokens": {"VQ": ..., "MQ": ..., "TA": ...}, "mean": {"VQ": ..., ...}, "std": {"VQ": ..., ...}}, and
  for a converted release "video", its preprocessing (below).
VideoReward's own release (a LoRA checkpoint of its training code) becomes this folder with
`branchdiff rewards convert videoalign` (branchdiff/rewards/videoalign_release.py).

Videos (B, F, 3, H, W) in [0, 1] go to the processor as 8-bit frames; `num_frames` (None: all) picks
that many evenly spaced frames first. A folder converted from VideoReward's release
(`branchdiff rewards convert videoalign`, branchdiff/rewards/videoalign_release.py) also carries the
release's video preprocessing (`videoalign.json`'s "video"), which the reward then follows as its
inference code does: K frames at `fps` over the clip's duration F / `video_fps` (the rate the model's
videos play at, Wan's 16 by default),

    K = round₂(clamp(F / video_fps · fps, ⌈min_frames⌉₂, ⌊min(max_frames, F)⌋₂)), at most F   (round₂: to a multiple of 2)

at indices round(linspace(0, F − 1, K)), each resized (bicubic, antialiased) to the sides nearest its own
that are multiples of 28 with an area in [min_pixels, max_pixels] (qwen-vl-utils' rule), and the
prompt right-padded in a batch.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from branchdiff.rewards.model_reward import load_tensor_file, to_uint8

DIMENSIONS = ("VQ", "MQ", "TA")
CONFIG_FILE = "videoalign.json"
HEAD_FILE = "reward_head.safetensors"


def round_to(value: float, factor: int) -> int:
    """The multiple of `factor` nearest `value` (Python's rounding, half to even, as the release rounds)."""
    return round(value / factor) * factor


def release_frame_count(total: int, video_fps: float, video: dict) -> int:
    """K of the module doc: the frames read of a clip of `total` frames playing at `video_fps`."""
    factor = video["frame_factor"]
    if video.get("num_frames"):
        count = round_to(video["num_frames"], factor)
    else:
        low = math.ceil(video["min_frames"] / factor) * factor
        high = math.floor(min(video["max_frames"], total) / factor) * factor
        count = round_to(min(max(total / video_fps * video["fps"], low), high), factor)
    count = min(count, total)
    if count < factor:
        raise ValueError(f"reward 'videoalign' reads at least {factor} frames of a video; got videos of {total}")
    return count


def release_size(height: int, width: int, video: dict) -> tuple[int, int]:
    """The resized frame's (height, width) of the module doc: each side the nearest multiple of the factor, scaled
    down (floor) into max_pixels or up (ceil) into min_pixels, keeping the aspect ratio (qwen-vl-utils' rule)."""
    factor, low, high = video["size_factor"], video["min_pixels"], video["max_pixels"]
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"reward 'videoalign': frames of {height}×{width} are more than 200 times longer than wide")
    new_height, new_width = max(factor, round_to(height, factor)), max(factor, round_to(width, factor))
    if new_height * new_width > high:
        beta = math.sqrt(height * width / high)
        new_height, new_width = math.floor(height / beta / factor) * factor, math.floor(width / beta / factor) * factor
    elif new_height * new_width < low:
        beta = math.sqrt(low / (height * width))
        new_height, new_width = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return new_height, new_width


class VideoAlignReward:
    """Scores of videos by a Qwen2-VL reward model with VQ, MQ and TA tokens (module doc).

    Args:
        path: the local folder (module doc).
        dimension: the reward returned: overall, VQ, MQ or TA.
        num_frames: evenly spaced frames of each video the model reads (None: every frame; a converted release's
            folder reads its frames by its own rule, module doc).
        video_fps: the frame rate the videos play at (a converted release samples its frames per second of video).
        device, batch_size: where the model runs, videos per forward pass.
        dtype: the model's weights (float32, bfloat16 or float16).
    """

    name = "videoalign"
    video = True
    higher_is_better = True

    def __init__(self, path: str | Path | None = None, dimension: str = "overall", num_frames: int | None = None,
                 device: str | torch.device = "cpu", batch_size: int = 4, dtype: str = "float32", video_fps: float = 16.0) -> None:
        from transformers import AutoProcessor, Qwen2VLForConditionalGeneration

        if dimension not in ("overall", *DIMENSIONS):
            raise ValueError(f"reward 'videoalign': dimension={dimension!r}; allowed: overall, {', '.join(DIMENSIONS)}")
        if num_frames is not None and (isinstance(num_frames, bool) or not isinstance(num_frames, int) or num_frames < 1):
            raise ValueError(f"reward 'videoalign': num_frames must be a whole number ≥ 1 or unset, got {num_frames!r}")
        if isinstance(video_fps, bool) or not isinstance(video_fps, (int, float)) or not video_fps > 0:
            raise ValueError(f"reward 'videoalign': video_fps must be a number of frames a second > 0, got {video_fps!r}")
        if dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"reward 'videoalign': dtype={dtype!r}; allowed: float32, bfloat16, float16")
        folder = Path(path).expanduser() if path else None
        missing = [name for name in ("config.json", CONFIG_FILE, HEAD_FILE) if folder is None or not (folder / name).is_file()]
        if missing:
            raise FileNotFoundError(f"reward 'videoalign' needs path=FOLDER, a local Qwen2-VL reward model with {', '.join(missing)} "
                                    f"(docs/rewards.md, the videoalign layout); " + ("no path was given" if folder is None else f"got {str(folder)!r}"))
        settings = json.loads((folder / CONFIG_FILE).read_text())
        self.template, self.tokens = settings["template"], settings["tokens"]
        self.mean, self.std = settings["mean"], settings["std"]
        self.preprocessing, self.video_fps = settings.get("video"), float(video_fps)  # a converted release's preprocessing
        if self.preprocessing and num_frames is not None:
            raise ValueError(f"reward 'videoalign': {str(folder)!r} is a converted release, which reads its frames by its own rule (2 a "
                             "second of video_fps); leave num_frames out and give video_fps, the rate the videos play at")
        self.dimension, self.num_frames, self.batch_size = dimension, num_frames, batch_size
        self.reward_key, self.score_keys = dimension, ("overall", *DIMENSIONS)
        self.scale = ("VQ + MQ + TA, each standardised by the checkpoint's mean and std" if dimension == "overall"
                      else f"{dimension}, standardised by the checkpoint's mean and std")
        self.device = torch.device(device)
        self.processor = AutoProcessor.from_pretrained(folder)
        self.model = Qwen2VLForConditionalGeneration.from_pretrained(folder, dtype=getattr(torch, dtype)).to(self.device).eval()
        self.head = load_tensor_file(folder / HEAD_FILE, reward=self.name)["weight"].to(self.device, torch.float32)  # (1 or 3, hidden)
        if self.head.dim() != 2 or self.head.shape[0] not in (1, len(DIMENSIONS)):
            raise ValueError(f"reward 'videoalign': {HEAD_FILE} in {str(folder)!r} holds a head of shape {tuple(self.head.shape)}; "
                             "expected (1, hidden), one head for every token, or (3, hidden), one per dimension")
        self.token_ids = {d: self.processor.tokenizer.convert_tokens_to_ids(self.tokens[d]) for d in DIMENSIONS}
        vocabulary = self.processor.tokenizer.get_vocab()
        for d in DIMENSIONS:
            if self.tokens[d] not in vocabulary or self.template.count(self.tokens[d]) != 1:
                raise ValueError(f"reward 'videoalign': {CONFIG_FILE} in {str(folder)!r}: the {d} token {self.tokens[d]!r} must be one token of "
                                 "the tokenizer and appear once in the template")
        if "{prompt}" not in self.template:
            raise ValueError(f"reward 'videoalign': {CONFIG_FILE} in {str(folder)!r}: the template has no {{prompt}}")

    def text(self, prompt: str) -> str:
        """The chat text of one video and its prompt (the processor's chat template)."""
        messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": self.template.format(prompt=prompt)}]}]
        return self.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def frames(self, videos: torch.Tensor) -> torch.Tensor:
        """Videos (B, F, 3, H, W) → the frames read, (B, K, 3, H', W'): uint8, or for a converted release float
        levels in [0, 255] resized by its rule (module doc)."""
        total = videos.shape[1]
        count = release_frame_count(total, self.video_fps, self.preprocessing) if self.preprocessing else self.num_frames
        if count is not None and count < total:
            videos = videos[:, torch.linspace(0, total - 1, count).round().long()]
        pixels = to_uint8(videos.flatten(0, 1)).view(*videos.shape[:2], *videos.shape[2:])
        if not self.preprocessing:
            return pixels
        from torchvision.transforms.functional import InterpolationMode, resize

        size = list(release_size(*videos.shape[-2:], self.preprocessing))
        return torch.stack([resize(clip, size, interpolation=InterpolationMode.BICUBIC, antialias=True) for clip in pixels]).float()

    @torch.no_grad()
    def score(self, videos: torch.Tensor, prompts: list[str]) -> dict[str, torch.Tensor]:
        """VQ, MQ, TA (B,) each, standardised, and their sum `overall`."""
        if videos.dim() != 5 or videos.shape[2] != 3:
            raise ValueError(f"reward 'videoalign' scores videos (B, F, 3, H, W), got {tuple(videos.shape)}")
        if videos.shape[0] != len(prompts):
            raise ValueError(f"reward 'videoalign' got {videos.shape[0]} videos for {len(prompts)} prompts")
        frames = self.frames(videos)
        raw = []
        for start in range(0, len(prompts), self.batch_size):
            batch = self.processor(text=[self.text(p) for p in prompts[start : start + self.batch_size]],
                                   videos=list(frames[start : start + self.batch_size]), padding=True, return_tensors="pt",
                                   videos_kwargs={"do_rescale": True}).to(self.device)
            length = batch["input_ids"].shape[1]
            positions = torch.arange(length, device=self.device).expand(len(batch["input_ids"]), length)  # (b, L) the release's 1-D positions
            hidden = self.model.model(**batch, position_ids=positions).last_hidden_state.float()  # (b, L, hidden), after the final norm
            per_dimension = []
            for row, dimension in enumerate(DIMENSIONS):
                positions = (batch["input_ids"] == self.token_ids[dimension]).int().argmax(dim=1)  # (b,) the token's first place
                per_dimension.append(hidden[torch.arange(len(positions)), positions] @ self.head[row if len(self.head) > 1 else 0])  # (b,)
            raw.append(torch.stack(per_dimension, dim=1))  # (b, 3)
        raw_scores = torch.cat(raw).cpu()  # (B, 3)
        scores = {d: (raw_scores[:, i] - self.mean[d]) / self.std[d] for i, d in enumerate(DIMENSIONS)}
        scores["overall"] = scores["VQ"] + scores["MQ"] + scores["TA"]
        return scores

    def __call__(self, videos: torch.Tensor, prompts: list[str], metadata: list[dict] | None = None) -> torch.Tensor:
        return self.score(videos, prompts)[self.dimension]
