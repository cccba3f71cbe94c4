"""`vlm-judge`: a vision-language model asked a yes/no question about each image, served behind an
OpenAI-compatible chat-completions API (vLLM, SGLang, a hosted one): the VLM-as-judge rewards of
UnifiedReward-style judges.

Each image goes as a PNG data URL in one user message with the question (`question`, its `{prompt}`
replaced by the image's prompt); the request asks for one token with its top log-probabilities
(`max_tokens: 1, logprobs: true, top_logprobs: k, temperature: 0`). The score is the probability of
yes among the yes and no tokens the answer's top k holds, computed from the log-probabilities:

    vlm-judge = Y / (Y + N),   Y = Σ_{t ∈ yes} exp(logprob_t),   N = Σ_{t ∈ no} exp(logprob_t)   in [0, 1]

tokens compared with their surrounding spaces removed (` Yes` is `Yes`). A side the top k does not hold
has at most the smallest listed probability, and counts at that bound (so a top k of " Yes" −0.1 and
"The" −3 scores 1 / (1 + e^(−2.9)) = 0.95, where the exact value lies in [0.95, 1]); `top_logprobs` is
therefore at least 2. A log-probability at or below the servers' floor (−9999, vLLM's stand-in for −∞)
is no probability at all. An answer whose top k holds neither side, or both only at the floor, is an
error naming the tokens it holds (raise k, or add the judge's spelling to `yes` / `no`).

Before a run samples anything (`train`, `eval`, `rewards check`), `preflight` asks the judge about a grey
image once, so a judge that is down, stalls, names an unknown `model` or returns no log-probabilities
stops the command before a model loads. Requests run `concurrency` at a time (daemon threads: a second
Ctrl-C aborts at once, whatever the judge is doing); each waits at most `timeout` seconds for the server
and is tried again `retries` times after a connection error, a timeout or a 429/502/503/504 (attempt k
first waits `backoff · 2^(k−1)` s): at the defaults a judge that accepts and never answers is reported
after 3 · 15 + 1 + 2 = 48 s. The API key is read from the environment variable `api_key_env`, which must
be set when it is given (unset, OPENAI_API_KEY is read where it is set, and a server without keys gets
none), and sent as `Authorization: Bearer`; it is never read from the config.

`mode: pairwise` makes it a group reward (branchdiff/rewards/group.py), a tournament: for each ordered
pair (i, j) of a group's images the judge sees i then j in one message and is asked which is better
(`question`, default PAIRWISE_QUESTION); p_ij is the probability of a `first` token over the `first` and
`second` tokens, and each image scores its win rate against the others, both orders averaged to cancel
the judge's position bias:

    vlm-judge pairwise_i = Σ_{j≠i} (p_ij + 1 − p_ji) / 2 / (G − 1)   in [0, 1]

G (G − 1) requests a group of G, run `concurrency` at a time.

`url` may be a list: replicas of one judge (a vLLM server a GPU). Each request goes to the replica with the
fewest requests in flight, at most `concurrency` at once to each; a replica that does not answer (unreachable,
a stall past `timeout` and `retries`, a dropped connection) is left out with a one-line notice and its request
is asked of another; the call stops, in one line naming each replica's failure, only when every replica is
down. An answer that says the request failed (a 4xx, a 500) stops the call as one server's would. Before a
run, `preflight` asks every replica.
"""

from __future__ import annotations

import base64
import json
import math
import os
import sys
import threading

import torch
from tqdm.auto import tqdm

from branchdiff.errors import one_line
from branchdiff.rewards.base import to_uint8
from branchdiff.rewards.group import score_by_group, tournament
from branchdiff.rewards.remote import RemoteRewardError, encode_png, one_server_twice, request_json
from branchdiff.runtime.threads import DaemonPool

DEFAULT_QUESTION = 'Does this image show "{prompt}"? Answer yes or no.'
PAIRWISE_QUESTION = 'Both images were made for "{prompt}". Which shows it better, the first or the second? Answer first or second.'
YES = ("yes", "Yes", "YES")
NO = ("no", "No", "NO")
FIRST = ("first", "First", "FIRST")
SECOND = ("second", "Second", "SECOND")
MODES = ("pointwise", "pairwise")
FLOOR = -9999.0  # the log-probability servers report for a token of no probability (vLLM's stand-in for −∞)
DEFAULT_KEY = "OPENAI_API_KEY"  # read where it is set, when api_key_env is not given
PROBE_PROMPT = "a plain grey square"


class JudgeAnswerError(ValueError):
    """An answer's log-probabilities that give no P(yes): the message says why and what it holds."""


def _log_mass(logprobs: list[float]) -> float:
    """log Σ exp(logprob) of the entries above the floor; −∞ for none."""
    alive = [value for value in logprobs if value > FLOOR]
    if not alive:
        return -math.inf
    top = max(alive)
    return top + math.log(sum(math.exp(value - top) for value in alive))


def yes_probability(top_logprobs: list[dict], yes: tuple[str, ...], no: tuple[str, ...]) -> float:
    """P(yes) of the module doc from one answer token's top log-probabilities ([{"token", "logprob"}, ...]); a side
    missing from them at the bound of the smallest listed one. Raises JudgeAnswerError for an answer holding neither
    side, both at the floor, or a log-probability that is not a number ≤ 0."""
    sides: dict[str, list[float]] = {"yes": [], "no": []}
    listed = []
    for entry in top_logprobs:
        token, logprob = str(entry.get("token", "")).strip(), entry["logprob"]
        if isinstance(logprob, bool) or not isinstance(logprob, (int, float)) or math.isnan(logprob) or logprob > 1e-3:
            raise JudgeAnswerError(f"a log-probability of {logprob!r} for the token {entry.get('token')!r}, where a log-probability is a number ≤ 0")
        listed.append(float(logprob))
        side = "yes" if token in yes else "no" if token in no else None
        if side:
            sides[side].append(float(logprob))
    if not sides["yes"] and not sides["no"]:
        raise JudgeAnswerError("neither")
    bound = min(listed)  # a token left out of the top k is at most as likely as the least likely one listed
    mass = {side: _log_mass(values) if values else _log_mass([bound]) for side, values in sides.items()}
    if mass["yes"] == mass["no"] == -math.inf:
        raise JudgeAnswerError("floor")
    if mass["yes"] == -math.inf or mass["no"] == -math.inf:
        return float(mass["no"] == -math.inf)
    return 1.0 / (1.0 + math.exp(min(700.0, mass["no"] - mass["yes"])))


class VLMJudge:
    name = "vlm-judge"
    device = torch.device("cpu")  # the model runs on the server

    def __init__(self, url: str | list[str], model: str, mode: str = "pointwise", question: str | None = None, yes: list[str] | tuple[str, ...] = YES,
                 no: list[str] | tuple[str, ...] = NO, first: list[str] | tuple[str, ...] = FIRST, second: list[str] | tuple[str, ...] = SECOND,
                 top_logprobs: int = 20, concurrency: int = 8, timeout: float = 15.0, retries: int = 2, backoff: float = 1.0,
                 api_key_env: str | None = None) -> None:
        urls = list(url) if isinstance(url, (list, tuple)) else [url]
        for each in urls:
            if not isinstance(each, str) or not each.startswith(("http://", "https://")):
                raise ValueError(f"reward 'vlm-judge': url={each!r} must start with http:// or https:// (the API's base, e.g. "
                                 "http://127.0.0.1:8000/v1)")
        if not urls or len({each.rstrip("/") for each in urls}) != len(urls):
            raise ValueError(f"reward 'vlm-judge': url={url!r} must be a URL or a list of distinct URLs (replicas of one judge)")
        twice = one_server_twice(urls) if len(urls) > 1 else None
        if twice:
            raise ValueError(f"reward 'vlm-judge': {twice[0]} and {twice[1]} are one server (their hosts resolve to the same address); "
                             "list each replica once")
        if not isinstance(model, str) or not model.strip():
            raise ValueError(f"reward 'vlm-judge': model={model!r} must be the name the server serves the judge under (its /v1/models)")
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
        for key, value, low in (("top_logprobs", top_logprobs, 2), ("concurrency", concurrency, 1), ("retries", retries, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                why = " (with one, the answer's own token is all it lists: P(yes) would be 0, 1 or its bound ½)" if key == "top_logprobs" else ""
                raise ValueError(f"reward 'vlm-judge': {key}={value!r} must be an integer ≥ {low}{why}")
        for key, number in (("timeout", timeout), ("backoff", backoff)):
            if isinstance(number, bool) or not isinstance(number, (int, float)) or number < 0 or (key == "timeout" and number == 0):
                raise ValueError(f"reward 'vlm-judge': {key}={number!r} must be a number of seconds {'> 0' if key == 'timeout' else '≥ 0'}")
        self.urls = [each.rstrip("/") + "/chat/completions" for each in urls]
        self.model, self.mode, self.question = model, mode, question
        self.in_flight = dict.fromkeys(self.urls, 0)  # requests now waiting on each replica
        self.down: dict[str, str] = {}  # replica: why it was left out
        self.lock = threading.Condition()
        self.labels, self.positive, self.negative, self.top_logprobs = labels, tuple(positive), tuple(negative), top_logprobs
        self.concurrency, self.timeout, self.retries, self.backoff = concurrency, float(timeout), retries, float(backoff)
        self.key_variable, key = api_key(api_key_env)
        self.headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
        self.scale = ("win rate in [0, 1] against the group's other images, both orders averaged" if pairwise else
                      "P(yes) in [0, 1]: the judge's probability of yes over yes + no among its top answer tokens")
        if pairwise:
            self.score_group = self.judge_group

    @classmethod
    def preflight(cls, **settings: object) -> None:
        """Before a command samples anything: the judge these settings name answers one question about a grey image
        (two in pairwise mode) with the log-probabilities of its first token, or the command stops with one line."""
        cls(**settings).probe()  # type: ignore[arg-type]

    def probe(self) -> None:
        """The judge answers the grey image's question: every replica is asked; one that does not answer is left out with
        a notice (the run stops only when none answers), one that answers wrongly stops the run (module doc)."""
        grey = torch.full((3, 64, 64), 128, dtype=torch.uint8)
        body = self.request([grey] * (2 if self.mode == "pairwise" else 1), PROBE_PROMPT)
        for url in self.urls:
            try:
                self.top_of(self.send(url, body), url)
            except RemoteRewardError as error:
                if not error.transport or len(self.urls) == 1:
                    raise
                self.leave_out(url, str(error))
        if len(self.down) == len(self.urls):
            raise RemoteRewardError(self.all_down())

    def request(self, pixels: list[torch.Tensor], prompt: str) -> bytes:
        """The chat-completions body asking about images (3, H, W) uint8, in the order shown (one, or two for a pair)."""
        content = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(encode_png(image)).decode()}}
                   for image in pixels]
        content.append({"type": "text", "text": self.question.replace("{prompt}", prompt)})
        return json.dumps({"model": self.model, "messages": [{"role": "user", "content": content}], "max_tokens": 1, "temperature": 0,
                           "logprobs": True, "top_logprobs": self.top_logprobs}).encode()

    def send(self, url: str, body: bytes) -> object:
        """The JSON reply of the replica `url` to a request body; a refusal for want of a key names the variable it is read from."""
        sent = "Authorization" in self.headers
        key_hint = (f"; the key in ${self.key_variable} was refused" if sent else
                    f"; no key was sent: set ${self.key_variable}, or name the variable holding it with kwargs {{api_key_env: NAME}}")
        return request_json(url, body, self.headers, self.timeout, self.retries, self.backoff, "judge",
                            hints={401: key_hint, 403: key_hint, 404: f"; does the server serve a model named {self.model!r} (its /v1/models)?"})

    def ask(self, pixels: list[torch.Tensor], prompt: str) -> tuple[str, object]:
        """(the replica that answered, its JSON reply) about `pixels`, asked of the least busy replica (module doc)."""
        body = self.request(pixels, prompt)
        while True:
            url = self.take_replica()
            try:
                return url, self.send(url, body)
            except RemoteRewardError as error:
                if not error.transport or len(self.urls) == 1:
                    raise
                self.leave_out(url, str(error))
            finally:
                with self.lock:
                    self.in_flight[url] -= 1
                    self.lock.notify_all()

    def take_replica(self) -> str:
        """The live replica with the fewest requests in flight, once it has fewer than `concurrency` (counted as taken)."""
        with self.lock:
            while True:
                live = [url for url in self.urls if url not in self.down]
                if not live:
                    raise RemoteRewardError(self.all_down())
                url = min(live, key=lambda each: self.in_flight[each])
                if self.in_flight[url] < self.concurrency:
                    self.in_flight[url] += 1
                    return url
                self.lock.wait()

    def all_down(self) -> str:
        reasons = "; ".join(f"{url}: {one_line(why, 160)}" for url in self.urls if (why := self.down.get(url)) is not None)
        return f"every judge replica is down ({len(self.down)} of {len(self.urls)}): {reasons}"

    def leave_out(self, url: str, why: str) -> None:
        with self.lock:
            if url in self.down:
                return
            self.down[url] = why
            self.lock.notify_all()
        # on a line of its own above a training run's progress bar
        tqdm.write(f"branchdiff: judge replica {url} left out, the others judge its share: {one_line(why, 300)}", file=sys.stderr)

    def top_of(self, reply: object, url: str) -> list[dict]:
        """The first answer token's top log-probabilities of a reply, or one line saying the reply has none."""
        try:
            top = reply["choices"][0]["logprobs"]["content"][0]["top_logprobs"]  # type: ignore[index]
            if not isinstance(top, list) or not all(isinstance(entry, dict) and "logprob" in entry for entry in top):
                raise TypeError
        except (KeyError, IndexError, TypeError):
            raise RemoteRewardError(f"judge {url} answered without the log-probabilities of its first token "
                                    f"(choices[0].logprobs.content[0].top_logprobs): {one_line(reply, 200)}; does the server take "
                                    "logprobs and top_logprobs?") from None
        return top

    def probability(self, pixels: list[torch.Tensor], prompt: str) -> float:
        """The judge's P(yes) of one image, or P(first) of a pair."""
        url, reply = self.ask(pixels, prompt)
        top = self.top_of(reply, url)
        try:
            return yes_probability(top, self.positive, self.negative)
        except JudgeAnswerError as error:
            held = [f"{entry.get('token')!s}: {entry.get('logprob')}" for entry in top]
            yes, no = self.labels
            if str(error) not in ("neither", "floor"):  # a value no log-probability takes: the server's fault
                raise RemoteRewardError(f"judge {url} answered {error}: {one_line(held, 200)}; check the server's logprobs") from None
            why = (f"neither a {yes} {list(self.positive)} nor a {no} {list(self.negative)} token" if str(error) == "neither" else
                   f"its {yes} and {no} tokens only at the floor log-probability ({FLOOR:g}, no probability)")
            raise RemoteRewardError(f"judge {url} answered with {why} among its top {len(held)}: {one_line(held, 200)}; raise top_logprobs "
                                    f"or add its spelling to {yes} / {no}") from None

    def judge_group(self, images: torch.Tensor, prompts: list[str], metadata: list[dict] | None = None) -> torch.Tensor:
        """Win rates (G,) of one group's images (G, 3, H, W): every ordered pair judged (module doc)."""
        pixels = to_uint8(images)  # (G, 3, H, W)
        count = len(pixels)
        pairs = [(i, j) for i in range(count) for j in range(count) if i != j]
        with DaemonPool(self.concurrency * len(self.urls), "vlm-judge") as pool:
            judged = pool.map(lambda pair: self.probability([pixels[pair[0]], pixels[pair[1]]], prompts[0]), pairs)
        preferred_first = torch.full((count, count), 0.5, dtype=torch.float64)  # (G, G); the diagonal is not read
        for (i, j), probability in zip(pairs, judged):
            preferred_first[i, j] = probability
        return tournament(preferred_first).float()

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict] | None = None) -> torch.Tensor:
        """Scores (B,): each image's P(yes), or in pairwise mode each one's win rate among the images sharing its prompt."""
        if self.mode == "pairwise":
            return score_by_group(self, self.name, images, prompts, metadata or [{} for _ in prompts], None)
        pixels = to_uint8(images)  # (B, 3, H, W)
        with DaemonPool(self.concurrency * len(self.urls), "vlm-judge") as pool:
            scores = pool.map(lambda image, prompt: self.probability([image], prompt), pixels, prompts)  # in order; the first failure is raised
        return torch.tensor(scores, dtype=torch.float32)


def api_key(variable: str | None) -> tuple[str, str | None]:
    """(the environment variable the key is read from, the key or None): `variable` must be set where it is given; unset,
    OPENAI_API_KEY is read where it is set, and no key is sent where it is not (a local server takes none)."""
    if variable is None:
        return DEFAULT_KEY, os.environ.get(DEFAULT_KEY) or None
    if not isinstance(variable, str) or not variable.strip():
        raise ValueError(f"reward 'vlm-judge': api_key_env={variable!r} must name an environment variable holding the key")
    if not os.environ.get(variable):
        raise ValueError(f"reward 'vlm-judge': api_key_env={variable} names an environment variable that is not set (or empty): export "
                         f"{variable}=<the judge's key>, or leave api_key_env out for a server that takes no key")
    return variable, os.environ[variable]
