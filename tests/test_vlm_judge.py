"""`vlm-judge` (branchdiff/rewards/vlm_judge.py) against a local stand-in of the OpenAI chat-completions API
subset it uses: the stand-in decodes each image and answers P(yes) = a function of its pixels, so every score
is checked against an independent computation; the request's shape (model, question, one token, log-probs, the
key from the environment), bounded concurrency, order, retries after a busy answer, and each failure mode (a
refusal, a stall, an answer without log-probabilities, one without a yes or a no, a server that is not there)
as one line naming the URL. Nothing reaches a real network."""

from __future__ import annotations

import base64
import io
import json
import math
import threading
import time
from http.server import ThreadingHTTPServer

import numpy as np
import pytest
import torch
from PIL import Image

from branchdiff.rewards.base import to_uint8
from branchdiff.rewards.registry import build_reward
from branchdiff.rewards.remote import RemoteRewardError
from branchdiff.rewards.vlm_judge import yes_probability
from json_handler import JSONHandler  # tests/ is on sys.path


def judged(pixels: np.ndarray) -> float:
    """The stand-in judge's P(yes) for an (H, W, 3) uint8 image: 0.5 + its redness, kept in [0.01, 0.99]."""
    rgb = pixels.astype(np.float64) / 255
    return min(0.99, max(0.01, 0.5 + float((rgb[..., 0] - rgb[..., 1:].mean(axis=-1)).mean())))


class StandIn(JSONHandler):
    mode = "ok"  # ok | refuse | stall | garbage | neither | busy-once
    requests: list[dict] = []
    in_flight = peak = 0
    lock = threading.Lock()

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        cls = type(self)
        with cls.lock:
            cls.requests.append({"path": self.path, "body": body, "authorization": self.headers.get("Authorization")})
            cls.in_flight += 1
            cls.peak = max(cls.peak, cls.in_flight)
            first = len(cls.requests) == 1
        try:
            if cls.mode == "stall":
                time.sleep(3)
                return
            if cls.mode == "refuse":
                return self.send_json(401, b'{"error": {"message": "invalid api key"}}')
            if cls.mode == "busy-once" and first:
                return self.send_json(503, b'{"error": "loading"}')
            if cls.mode == "garbage":
                return self.send_json(200, b'{"choices": [{"message": {"content": "yes"}}]}')
            time.sleep(0.05)  # long enough for requests to overlap
            url = body["messages"][0]["content"][0]["image_url"]["url"]
            pixels = np.asarray(Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB"))
            p = judged(pixels)
            top = ([{"token": "maybe", "logprob": -3.0}, {"token": "perhaps", "logprob": -4.0}] if cls.mode == "neither" else
                   [{"token": " Yes", "logprob": math.log(p)}, {"token": "No", "logprob": math.log(1 - p)}, {"token": "maybe", "logprob": -6.0}])
            reply = {"choices": [{"message": {"content": "Yes"}, "logprobs": {"content": [{"token": " Yes", "top_logprobs": top}]}}]}
            self.send_json(200, json.dumps(reply).encode())
        finally:
            with cls.lock:
                cls.in_flight -= 1


@pytest.fixture
def judge_url():
    StandIn.mode, StandIn.requests, StandIn.in_flight, StandIn.peak = "ok", [], 0, 0
    server = ThreadingHTTPServer(("127.0.0.1", 0), StandIn)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def _images(count: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    images = torch.rand(count, 3, 24, 32, generator=generator)
    images[:, 0] *= torch.linspace(0, 1, count).view(count, 1, 1)  # from green-blue to red: different P(yes)
    return images


def _judge(url: str, **kwargs: object):
    return build_reward("vlm-judge", kwargs={"url": url, "model": "judge-7b", **kwargs})


def test_p_yes_is_the_yes_mass_over_yes_and_no():
    top = [{"token": " Yes", "logprob": math.log(0.5)}, {"token": "yes", "logprob": math.log(0.1)}, {"token": "No", "logprob": math.log(0.2)},
           {"token": "Maybe", "logprob": math.log(0.2)}]
    assert yes_probability(top, ("yes", "Yes"), ("no", "No")) == pytest.approx(0.6 / 0.8)
    assert yes_probability([{"token": "Maybe", "logprob": 0.0}], ("yes",), ("no",)) is None


def test_scores_equal_the_judges_probabilities_in_order_with_bounded_concurrency(judge_url, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-not-a-real-key")
    images = _images(12)
    prompts = [f"prompt {i}" for i in range(12)]
    scores = _judge(judge_url, concurrency=3)(images, prompts, [{} for _ in prompts])
    expected = [judged(image.permute(1, 2, 0).numpy()) for image in to_uint8(images)]  # the PNG carries the 8-bit pixels exactly
    assert scores.dtype == torch.float32 and scores.tolist() == pytest.approx(expected, abs=1e-6)
    assert len(set(round(e, 3) for e in expected)) > 6  # the images differ, so order matters
    assert 1 < StandIn.peak <= 3
    first = StandIn.requests[0]
    assert first["path"] == "/v1/chat/completions" and first["authorization"] == "Bearer sk-test-not-a-real-key"
    body = first["body"]
    assert body["model"] == "judge-7b" and body["max_tokens"] == 1 and body["logprobs"] is True and body["top_logprobs"] == 20
    questions = sorted(r["body"]["messages"][0]["content"][1]["text"] for r in StandIn.requests)
    assert questions == sorted(f'Does this image show "prompt {i}"? Answer yes or no.' for i in range(12))


def test_a_busy_answer_is_tried_again(judge_url):
    StandIn.mode = "busy-once"
    scores = _judge(judge_url, backoff=0.01, concurrency=1)(_images(2), ["a", "b"], [{}, {}])
    assert len(StandIn.requests) == 3 and torch.isfinite(scores).all()


@pytest.mark.parametrize(("mode", "kwargs", "line"), [
    ("refuse", {}, r"judge http://127\.0\.0\.1:\d+/v1/chat/completions answered HTTP 401: .*invalid api key"),
    ("stall", {"timeout": 0.5, "retries": 1, "backoff": 0.01}, r"judge .*/v1/chat/completions did not answer within 0\.5 s \(2 attempts\)"),
    ("garbage", {}, r"judge .* answered without the log-probabilities of its first token .*does the server take logprobs"),
    ("neither", {}, r"judge .* answered with neither a yes \['yes', 'Yes', 'YES'\] nor a no .* among its top 2: .*maybe.*raise top_logprobs"),
])
def test_each_failure_is_one_line_naming_the_url(judge_url, mode, kwargs, line):
    StandIn.mode = mode
    with pytest.raises(RemoteRewardError, match=line) as raised:
        _judge(judge_url, **kwargs)(_images(1), ["a"], [{}])
    assert "\n" not in str(raised.value)


def test_a_server_that_is_not_there_and_bad_settings_are_one_line(closed_port):
    with pytest.raises(RemoteRewardError, match=r"judge .*/v1/chat/completions is not reachable .*\(1 attempt\)"):
        _judge(closed_port + "/v1", retries=0)(_images(1), ["a"], [{}])
    with pytest.raises(ValueError, match=r"question='Is it good\?' must hold \{prompt\}"):
        _judge(closed_port, question="Is it good?")
    with pytest.raises(ValueError, match=r"must start with http:// or https://"):
        _judge("localhost:8000")
