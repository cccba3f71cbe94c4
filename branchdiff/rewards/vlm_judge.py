"""`vlm-judge`: a vision-language model asked a yes/no question about each image, served behind an
OpenAI-compatible chat-completions API (vLLM, SGLang, a hosted one): the VLM-as-judge rewards of
UnifiedReward-style judges.

Each image goes as a PNG data URL in one user message with the question (`question`, its `{prompt}`
replaced by the image's prompt); the request asks for one token with its top log-probabilities
(`max_tokens: 1, logprobs: true, top_logprobs: k, temperature: 0`). The score is the probability of
yes among the yes and no tokens the answer's top k holds:

    vlm-judge = Σ_{t ∈ yes} exp(logprob_t) / (Σ_{t ∈ yes} exp(logprob_t) + Σ_{t ∈ no} exp(logprob_t))   in [0, 1]

tokens compared with their surrounding spaces removed (` Yes` is `Yes`). An answer whose top k holds
neither is an error naming the tokens it holds (raise k, or add the judge's spelling to `yes` / `no`).

Requests run `concurrency` at a time; each waits at most `timeout` seconds for the server and is tried
again `retries` times after a connection error, a timeout or a 429/502/503/504 (attempt k first waits
`backoff · 2^(k−1)` s). The API key is read from the environment variable `api_key_env` when set there,
and sent as `Authorization: Bearer`; it is never read from the config.

`mode: pairwise` makes it a group reward (branchdiff/rewards/group.py), a tournament: for each ordered
pair (i, j) of a group's images the judge sees i then j in one message and is asked which is better
(`question`, default PAIRWISE_QUESTION); p_ij is the probability of a `first` token over the `first` and
`second` tokens, and each image scores its win rate against the others, both orders averaged to cancel
the judge's position bias:

    vlm-judge pairwise_i = Σ_{j≠i} (p_ij + 1 − p_ji) / 2 / (G − 1)   in [0, 1]

G (G − 1) requests a group of G, run `concurrency` at a time.
"""

from __future__ import annotations

import base64
import json
import math
import os
from concurrent.futures import ThreadPoolExecutor

import torch

from branchdiff.errors import one_line
from branchdiff.rewards.base import to_uint8
from branchdiff.rewards.group import score_by_group, tournament
from branchdiff.rewards.remote import RemoteRewardError, encode_png, request_json

DEFAULT_QUESTION = 'Does this image show "{prompt}"? Answer yes or no.'
PAIRWISE_QUESTION = 'Both images were made for "{prompt}". Which shows it better, the first or the second? Answer first or second.'
YES = ("yes", "Yes", "YES")
NO = ("no", "No", "NO")
FIRST = ("first", "First", "FIRST")
SECOND = ("second", "Second", "SECOND")
MODES = ("pointwise", "pairwise")


def yes_probability(top_logprobs: list[dict], yes: tuple[str, ...], no: tuple[str, ...]) -> float | None:
    """P(yes) of the module doc from one answer token's top log-probabilities ([{"token", "logprob"}, ...]);
    None when they hold neither a yes nor a no token."""
    mass = {"yes": 0.0, "no": 0.0}
    for entry in top_logprobs:
        token = str(entry.get("token", "")).strip()
        side = "yes" if token in yes else "no" if token in no else None
        if side:
            mass[side] += math.exp(float(entry["logprob"]))
    total = mass["yes"] + mass["no"]
    return mass["yes"] / total if total > 0 else None


class VLMJudge:
    name = "vlm-judge"
    device = torch.device("cpu")  # the model runs on the server

    def __init__(self, url: str, model: str, mode: str = "pointwise", question: str | None = None, yes: list[str] | tuple[str, ...] = YES,
                 no: list[str] | tuple[str, ...] = NO, first: list[str] | tuple[str, ...] = FIRST, second: list[str] | tuple[str, ...] = SECOND,
                 top_logprobs: int = 20, concurrency: int = 8, timeout: float = 60.0, retries: int = 2, backoff: float = 1.0,
                 api_key_env: str = "OPENAI_API_KEY") -> None:
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"reward 'vlm-judge': url={url!r} must start with http:// or https:// (the API's base, e.g. http://127.0.0.1:8000/v1)")
        if mode not in MODES:
            raise ValueError(f"reward 'vlm-judge': mode={mode!r} must be one of {', '.join(MODES)}")
        pairwise = mode == "pairwise"
        question = question if question is not None else PAIRWISE_QUESTION if pairwise else DEFAULT_QUESTION
        if not isinstance(question, str) or "{prompt}" not in question:
            raise ValueError(f"reward 'vlm-judge': question={question!r} must hold {{prompt}}, where each image's prompt goes")
        labels = ("first", "second") if pairwise else ("yes", "no")
        positive, negative = (first, second) if pairwise else (yes, no)
        if not positive or not negative or set(positive) & set(negative):
            raise ValueError(f"reward 'vlm-judge': {labels[0]}={list(positive)} and {labels[1]}={list(negative)} must be non-empty and share no token")
        for key, value, low in (("top_logprobs", top_logprobs, 1), ("concurrency", concurrency, 1), ("retries", retries, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"reward 'vlm-judge': {key}={value!r} must be an integer ≥ {low}")
        for key, number in (("timeout", timeout), ("backoff", backoff)):
            if not isinstance(number, (int, float)) or number < 0 or (key == "timeout" and number == 0):
                raise ValueError(f"reward 'vlm-judge': {key}={number!r} must be a number of seconds {'> 0' if key == 'timeout' else '≥ 0'}")
        self.url, self.model, self.mode, self.question = url.rstrip("/") + "/chat/completions", model, mode, question
        self.labels, self.positive, self.negative, self.top_logprobs = labels, tuple(positive), tuple(negative), top_logprobs
        self.concurrency, self.timeout, self.retries, self.backoff = concurrency, float(timeout), retries, float(backoff)
        key = os.environ.get(api_key_env)
        self.headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
        self.scale = ("win rate in [0, 1] against the group's other images, both orders averaged" if pairwise else
                      "P(yes) in [0, 1]: the judge's probability of yes over yes + no among its top answer tokens")
        if pairwise:
            self.score_group = self.judge_group

    def request(self, pixels: list[torch.Tensor], prompt: str) -> bytes:
        """The chat-completions body asking about images (3, H, W) uint8, in the order shown (one, or two for a pair)."""
        content = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(encode_png(image)).decode()}}
                   for image in pixels]
        content.append({"type": "text", "text": self.question.replace("{prompt}", prompt)})
        return json.dumps({"model": self.model, "messages": [{"role": "user", "content": content}], "max_tokens": 1, "temperature": 0,
                           "logprobs": True, "top_logprobs": self.top_logprobs}).encode()

    def probability(self, pixels: list[torch.Tensor], prompt: str) -> float:
        """The judge's P(yes) of one image, or P(first) of a pair."""
        reply = request_json(self.url, self.request(pixels, prompt), self.headers, self.timeout, self.retries, self.backoff, "judge")
        try:
            top = reply["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
            probability = yes_probability(top, self.positive, self.negative)
        except (KeyError, IndexError, TypeError, ValueError):
            raise RemoteRewardError(f"judge {self.url} answered without the log-probabilities of its first token "
                                    f"(choices[0].logprobs.content[0].top_logprobs): {one_line(reply, 200)}; does the server take "
                                    "logprobs and top_logprobs?") from None
        if probability is None:
            held = [str(entry.get("token", "")) for entry in top]
            yes, no = self.labels
            raise RemoteRewardError(f"judge {self.url} answered with neither a {yes} {list(self.positive)} nor a {no} {list(self.negative)} token "
                                    f"among its top {len(held)}: {one_line(held, 200)}; raise top_logprobs or add its spelling to {yes} / {no}")
        return probability

    def judge_group(self, images: torch.Tensor, prompts: list[str], metadata: list[dict] | None = None) -> torch.Tensor:
        """Win rates (G,) of one group's images (G, 3, H, W): every ordered pair judged (module doc)."""
        pixels = to_uint8(images)  # (G, 3, H, W)
        count = len(pixels)
        pairs = [(i, j) for i in range(count) for j in range(count) if i != j]
        with ThreadPoolExecutor(max_workers=self.concurrency) as pool:
            judged = list(pool.map(lambda pair: self.probability([pixels[pair[0]], pixels[pair[1]]], prompts[0]), pairs))
        preferred_first = torch.full((count, count), 0.5, dtype=torch.float64)  # (G, G); the diagonal is not read
        for (i, j), probability in zip(pairs, judged):
            preferred_first[i, j] = probability
        return tournament(preferred_first).float()

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict] | None = None) -> torch.Tensor:
        """Scores (B,): each image's P(yes), or in pairwise mode each one's win rate among the images sharing its prompt."""
        if self.mode == "pairwise":
            return score_by_group(self, self.name, images, prompts, metadata or [{} for _ in prompts], None)
        pixels = to_uint8(images)  # (B, 3, H, W)
        with ThreadPoolExecutor(max_workers=self.concurrency) as pool:
            scores = list(pool.map(lambda image, prompt: self.probability([image], prompt), pixels, prompts))  # in order; the first failure is raised
        return torch.tensor(scores, dtype=torch.float32)
