"""`videoalign`: a vision-language reward of videos in the style of VideoAlign's VideoReward (Liu et al.
2025, "Improving Video Generation with Human Feedback", arXiv 2501.13918), the motion-quality reward
BranchGRPO trains Wan with (`video = True`).

A Qwen2-VL model (transformers' `Qwen2VLForConditionalGeneration`) reads the video and a text that
names the prompt and holds three special tokens, one per dimension: visual quality (VQ), motion
quality (MQ) and text alignment (TA). With h_d the last layer's hidden state at dimension d's token
and w the reward head (a linear map hidden → 1 without bias),

    raw_d = w · h_d          score_d = (raw_d − mean_d) / std_d          overall = VQ + MQ + TA

(the head and the standardisation are VideoReward's; mean and std are the checkpoint's). The reward is
`dimension`: `overall` (the default) or one of VQ, MQ, TA; `score` returns all four.

The model is a LOCAL FOLDER (nothing is downloaded) holding
- the model (`save_pretrained` of the Qwen2-VL model: config.json, *.safetensors) and its processor
  (`Qwen2VLProcessor.save_pretrained`: tokenizer with the three special tokens, chat template, image
  and video processors);
- `reward_head.safetensors`: {"weight": (1, hidden)};
- `videoalign.json`: {"template": the text after the video, with `{prompt}` and the three tokens,
  "tokens": {"VQ": ..., "MQ": ..., "TA": ...}, "mean": {"VQ": ..., ...}, "std": {"VQ": ..., ...}}.
VideoReward's own release is a LoRA checkpoint of its training code; merged into the base model and
saved in this layout with its question text as the template, it is this reward (not verified here:
the test suite builds a tiny random folder of the same classes, tests/tiny_pipelines.py).

Videos (B, F, 3, H, W) in [0, 1] go to the processor as 8-bit frames; `num_frames` (None: all) picks
that many evenly spaced frames first (VideoReward samples its videos at 2 frames a second).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from branchdiff.rewards.model_reward import load_tensor_file, to_uint8

DIMENSIONS = ("VQ", "MQ", "TA")
CONFIG_FILE = "videoalign.json"
HEAD_FILE = "reward_head.safetensors"


class VideoAlignReward:
    """Scores of videos by a Qwen2-VL reward model with VQ, MQ and TA tokens (module doc).

    Args:
        path: the local folder (module doc).
        dimension: the reward returned: overall, VQ, MQ or TA.
        num_frames: evenly spaced frames of each video the model reads (None: every frame).
        device, batch_size: where the model runs, videos per forward pass.
        dtype: the model's weights (float32, bfloat16 or float16).
    """

    name = "videoalign"
    video = True
    higher_is_better = True

    def __init__(self, path: str | Path | None = None, dimension: str = "overall", num_frames: int | None = None,
                 device: str | torch.device = "cpu", batch_size: int = 4, dtype: str = "float32") -> None:
        from transformers import AutoProcessor, Qwen2VLForConditionalGeneration

        if dimension not in ("overall", *DIMENSIONS):
            raise ValueError(f"reward 'videoalign': dimension={dimension!r}; allowed: overall, {', '.join(DIMENSIONS)}")
        if num_frames is not None and (isinstance(num_frames, bool) or not isinstance(num_frames, int) or num_frames < 1):
            raise ValueError(f"reward 'videoalign': num_frames must be a whole number ≥ 1 or unset, got {num_frames!r}")
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
        self.dimension, self.num_frames, self.batch_size = dimension, num_frames, batch_size
        self.reward_key, self.score_keys = dimension, ("overall", *DIMENSIONS)
        self.scale = ("VQ + MQ + TA, each standardised by the checkpoint's mean and std" if dimension == "overall"
                      else f"{dimension}, standardised by the checkpoint's mean and std")
        self.device = torch.device(device)
        self.processor = AutoProcessor.from_pretrained(folder)
        self.model = Qwen2VLForConditionalGeneration.from_pretrained(folder, dtype=getattr(torch, dtype)).to(self.device).eval()
        self.head = load_tensor_file(folder / HEAD_FILE, reward=self.name)["weight"].to(self.device, torch.float32)  # (1, hidden)
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
        """Videos (B, F, 3, H, W) → the frames read, (B, K, 3, H, W) uint8."""
        if self.num_frames is not None and self.num_frames < videos.shape[1]:
            videos = videos[:, torch.linspace(0, videos.shape[1] - 1, self.num_frames).round().long()]
        return to_uint8(videos.flatten(0, 1)).view(*videos.shape[:2], *videos.shape[2:])

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
            hidden = self.model(**batch, output_hidden_states=True).hidden_states[-1].float()  # (b, L, hidden)
            per_dimension = []
            for dimension in DIMENSIONS:
                positions = (batch["input_ids"] == self.token_ids[dimension]).int().argmax(dim=1)  # (b,) the token's first place
                per_dimension.append(hidden[torch.arange(len(positions)), positions] @ self.head[0])  # (b,)
            raw.append(torch.stack(per_dimension, dim=1))  # (b, 3)
        raw_scores = torch.cat(raw).cpu()  # (B, 3)
        scores = {d: (raw_scores[:, i] - self.mean[d]) / self.std[d] for i, d in enumerate(DIMENSIONS)}
        scores["overall"] = scores["VQ"] + scores["MQ"] + scores["TA"]
        return scores

    def __call__(self, videos: torch.Tensor, prompts: list[str], metadata: list[dict] | None = None) -> torch.Tensor:
        return self.score(videos, prompts)[self.dimension]
