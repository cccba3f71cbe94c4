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


def preferred_first(first: np.ndarray, second: np.ndarray) -> float:
    """The stand-in judge's P(first) for a pair: the redder one preferred, with a bias toward the image shown first."""
    return 1 / (1 + math.exp(-(8 * (judged(first) - judged(second)) + POSITION_BIAS)))


POSITION_BIAS = 0.8  # logits in favour of the first image, whatever it shows


def _decoded(url: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB"))


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
            answer = self.answer(body, first)
        finally:
            # the request stops counting before its answer is written: the client can send its next request as
            # soon as it reads this one, and a count taken after the write would see both at once
            with cls.lock:
                cls.in_flight -= 1
        if answer is not None:
            self.send_json(*answer)

    def answer(self, body: dict, first: bool) -> tuple[int, bytes] | None:
        """The status and JSON body the stand-in answers in its mode, or None for a stall (no answer)."""
        mode = type(self).mode
        if mode == "stall":
            time.sleep(3)
            return None
        if mode == "refuse":
            return 401, b'{"error": {"message": "invalid api key"}}'
        if mode == "busy-once" and first:
            return 503, b'{"error": "loading"}'
        if mode == "garbage":
            return 200, b'{"choices": [{"message": {"content": "yes"}}]}'
        time.sleep(0.05)  # long enough for requests to overlap
        shown = [_decoded(part["image_url"]["url"]) for part in body["messages"][0]["content"] if part["type"] == "image_url"]
        p = judged(shown[0]) if len(shown) == 1 else preferred_first(*shown)
        words = (" Yes", "No") if len(shown) == 1 else (" First", "Second")
        top = ([{"token": "maybe", "logprob": -3.0}, {"token": "perhaps", "logprob": -4.0}] if mode == "neither" else
               [{"token": words[0], "logprob": math.log(p)}, {"token": words[1], "logprob": math.log(1 - p)}, {"token": "maybe", "logprob": -6.0}])
        reply = {"choices": [{"message": {"content": "Yes"}, "logprobs": {"content": [{"token": " Yes", "top_logprobs": top}]}}]}
        return 200, json.dumps(reply).encode()


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


def _win_rates(pixels: list[np.ndarray]) -> list[float]:
    """Each image's win rate against the others, both orders averaged: an independent computation of the tournament."""
    count = len(pixels)
    return [sum((preferred_first(pixels[i], pixels[j]) + 1 - preferred_first(pixels[j], pixels[i])) / 2 for j in range(count) if j != i) / (count - 1)
            for i in range(count)]


def test_pairwise_mode_scores_each_image_by_its_win_rate_in_its_group_both_orders(judge_url):
    images = _images(7)
    prompts = ["a fox"] * 4 + ["a hen"] * 3  # two groups: the images sharing a prompt
    judge = _judge(judge_url, mode="pairwise", concurrency=4)
    scores = judge(images, prompts, [{} for _ in prompts])
    pixels = [image.permute(1, 2, 0).numpy() for image in to_uint8(images)]
    assert scores.tolist() == pytest.approx(_win_rates(pixels[:4]) + _win_rates(pixels[4:]), abs=1e-6)
    assert len(StandIn.requests) == 4 * 3 + 3 * 2  # every ordered pair of each group
    shown = [[part["type"] for part in r["body"]["messages"][0]["content"]] for r in StandIn.requests]
    assert all(parts == ["image_url", "image_url", "text"] for parts in shown)
    assert StandIn.requests[0]["body"]["messages"][0]["content"][2]["text"].startswith('Both images were made for "a ')
    one_order = [sum(preferred_first(pixels[i], pixels[j]) for j in range(4) if j != i) / 3 for i in range(4)]
    assert max(abs(a - b) for a, b in zip(one_order, scores[:4].tolist())) > 0.05  # the position bias, cancelled by the second order
    assert judge.scale.startswith("win rate") and hasattr(judge, "score_group")


def test_pairwise_answers_without_first_or_second_are_one_line(judge_url):
    StandIn.mode = "neither"
    with pytest.raises(RemoteRewardError, match=r"neither a first \['first', 'First', 'FIRST'\] nor a second .*add its spelling to first / second"):
        _judge(judge_url, mode="pairwise")(_images(2), ["a", "a"], [{}, {}])
    with pytest.raises(ValueError, match=r"mode='listwise' must be one of pointwise, pairwise"):
        _judge(judge_url, mode="listwise")


def test_a_tiny_run_trains_on_a_pairwise_tournament(judge_url, tiny_model_dir, tmp_path):
    from branchdiff.settings.load import load_config
    from branchdiff.training.recipe import Trainer

    reward = f"{{name: vlm-judge, kwargs: {{url: '{judge_url}', model: judge-7b, mode: pairwise}}}}"
    config = load_config(None, [
        f"model.path={tiny_model_dir}", f"output_dir={tmp_path / 'run'}", "iterations=1", "seed=0", f"reward={reward}",
        "prompts.per_iteration=2", "tree.roots=3", "sampling.num_steps=3", "sampling.max_batch=8", "train.minibatch=4",
        "model.finetune=lora", "train.learning_rate=1e-2", "final_eval=false", "logging.report_to=none"])
    result = Trainer(config).run_iteration(0)
    tree = result.rollout.tree
    leaf_prompts = tree.prompt[tree.leaf_index]  # (6,) three samples a prompt
    pixels = [image.permute(1, 2, 0).numpy() for image in to_uint8(result.leaf_images)]
    leaf_rewards = result.node_rewards[tree.leaf_index]
    for group in range(2):
        rows = (leaf_prompts == group).nonzero().flatten().tolist()
        assert leaf_rewards[rows].tolist() == pytest.approx(_win_rates([pixels[r] for r in rows]), abs=1e-6)
    assert len(StandIn.requests) == 2 * 3 * 2
    assert result.metrics["reward_mean"] == pytest.approx(0.5)  # a tournament's win rates average ½
    assert result.metrics["edges_trained"] > 0 and result.metrics["grad_norm"] > 0
