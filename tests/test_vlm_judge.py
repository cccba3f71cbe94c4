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
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from http.server import ThreadingHTTPServer

import numpy as np
import pytest
import torch
from PIL import Image

from branchdiff.rewards.base import to_uint8
from branchdiff.rewards.registry import build_reward
from branchdiff.rewards.remote import RemoteRewardError
from branchdiff.rewards.vlm_judge import NO, YES, JudgeAnswerError, VLMJudge, yes_probability
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
    mode = "ok"  # ok | refuse | stall | garbage | neither | floor | overflow | busy-once | unknown-model | stall-after-first
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
        if mode == "stall-after-first" and not first:
            time.sleep(120)  # longer than any test waits: the client must not wait for it
            return None
        if mode == "refuse":
            return 401, b'{"error": {"message": "invalid api key"}}'
        if mode == "unknown-model":
            return 404, b'{"error": {"message": "The model `judge-7b` does not exist."}}'
        if mode == "busy-once" and first:
            return 503, b'{"error": "loading"}'
        if mode == "garbage":
            return 200, b'{"choices": [{"message": {"content": "yes"}}]}'
        time.sleep(0.05)  # long enough for requests to overlap
        shown = [_decoded(part["image_url"]["url"]) for part in body["messages"][0]["content"] if part["type"] == "image_url"]
        p = judged(shown[0]) if len(shown) == 1 else preferred_first(*shown)
        words = (" Yes", "No") if len(shown) == 1 else (" First", "Second")
        top = {"neither": [{"token": "maybe", "logprob": -3.0}, {"token": "perhaps", "logprob": -4.0}],
               "floor": [{"token": words[0], "logprob": -9999.0}, {"token": words[1], "logprob": -9999.0}, {"token": "The", "logprob": -0.01}],
               "overflow": [{"token": words[0], "logprob": 1000.0}, {"token": words[1], "logprob": -2.0}]}.get(mode) or [
            {"token": words[0], "logprob": math.log(p)}, {"token": words[1], "logprob": math.log(1 - p)}, {"token": "maybe", "logprob": -6.0}]
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
    with pytest.raises(JudgeAnswerError, match="^neither$"):
        yes_probability([{"token": "Maybe", "logprob": 0.0}], ("yes",), ("no",))


def test_a_side_missing_from_the_top_k_counts_at_the_smallest_listed_probability():
    """Only yes listed (it scored 1.0, and with top_logprobs 1 every score was 0 or 1): no counts at the bound."""
    top = [{"token": " Yes", "logprob": math.log(0.6)}, {"token": "The", "logprob": math.log(0.1)}]
    assert yes_probability(top, YES, NO) == pytest.approx(0.6 / 0.7)
    top = [{"token": "No", "logprob": math.log(0.7)}, {"token": "I", "logprob": math.log(0.2)}, {"token": "It", "logprob": math.log(0.05)}]
    assert yes_probability(top, YES, NO) == pytest.approx(0.05 / 0.75)
    with pytest.raises(ValueError, match=r"top_logprobs=1 must be an integer ≥ 2 \(with one, the answer's own token is all it lists"):
        _judge("http://127.0.0.1:9/v1", top_logprobs=1)


def test_log_probabilities_are_combined_in_log_space_and_the_floor_is_no_probability():
    """Both far below exp's range (once "neither"); both at the servers' floor −9999 (once "neither" too); one side at
    the floor; a log-probability of 1000 (once OverflowError: math range error)."""
    tiny = [{"token": "yes", "logprob": -800.0}, {"token": "no", "logprob": -801.0}]
    assert yes_probability(tiny, YES, NO) == pytest.approx(1 / (1 + math.exp(-1)))
    with pytest.raises(JudgeAnswerError, match="^floor$"):
        yes_probability([{"token": "Yes", "logprob": -9999.0}, {"token": "No", "logprob": -9999.0}, {"token": "A", "logprob": -0.1}], YES, NO)
    assert yes_probability([{"token": "Yes", "logprob": -9999.0}, {"token": "No", "logprob": -0.2}], YES, NO) == 0.0
    for value in (1000.0, float("nan"), "high"):
        with pytest.raises(JudgeAnswerError, match=r"a log-probability of .* for the token 'yes', where a log-probability is a number ≤ 0"):
            yes_probability([{"token": "yes", "logprob": value}], YES, NO)


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
    ("refuse", {}, r"judge http://127\.0\.0\.1:\d+/v1/chat/completions answered HTTP 401: .*invalid api key.*; no key was sent: set \$OPENAI_API_KEY, "
                   r"or name the variable holding it with kwargs \{api_key_env: NAME\}"),
    ("unknown-model", {}, r"answered HTTP 404: .*does not exist.*; does the server serve a model named 'judge-7b' \(its /v1/models\)\?"),
    ("stall", {"timeout": 0.5, "retries": 1, "backoff": 0.01}, r"judge .*/v1/chat/completions did not answer within 0\.5 s \(2 attempts\)"),
    ("garbage", {}, r"judge .* answered without the log-probabilities of its first token .*does the server take logprobs"),
    ("neither", {}, r"judge .* answered with neither a yes \['yes', 'Yes', 'YES'\] nor a no .* among its top 2: .*maybe.*raise top_logprobs"),
    ("floor", {}, r"judge .* answered with its yes and no tokens only at the floor log-probability \(-9999, no probability\) among its top 3"),
    ("overflow", {}, r"judge .*/v1/chat/completions answered a log-probability of 1000.0 for the token ' Yes', where a log-probability is a "
                     r"number ≤ 0: .*; check the server's logprobs$"),
])
def test_each_failure_is_one_line_naming_the_url(judge_url, mode, kwargs, line, monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
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


def test_the_key_comes_from_the_named_variable_which_must_be_set(judge_url, monkeypatch):
    monkeypatch.delenv("JUDGE_KEY", raising=False)
    with pytest.raises(ValueError, match=r"api_key_env=JUDGE_KEY names an environment variable that is not set \(or empty\): export JUDGE_KEY="):
        _judge(judge_url, api_key_env="JUDGE_KEY")
    monkeypatch.setenv("JUDGE_KEY", "k-1")
    monkeypatch.setenv("OPENAI_API_KEY", "k-2")
    StandIn.mode = "refuse"
    with pytest.raises(RemoteRewardError, match=r"answered HTTP 401: .*; the key in \$JUDGE_KEY was refused$"):
        _judge(judge_url, api_key_env="JUDGE_KEY")(_images(1), ["a"], [{}])
    assert StandIn.requests[-1]["authorization"] == "Bearer k-1"


def test_the_defaults_report_a_silent_judge_within_a_minute():
    """timeout · (retries + 1) plus the back-offs between the attempts (it was 183 s)."""
    import inspect

    defaults = {name: p.default for name, p in inspect.signature(VLMJudge).parameters.items()}
    worst = defaults["timeout"] * (defaults["retries"] + 1) + sum(defaults["backoff"] * 2 ** k for k in range(defaults["retries"]))
    assert worst <= 60


def _train(tiny_model_dir, run, reward: str, *extra: str) -> list[str]:
    return ["train", "tiny-chain", f"model.path={tiny_model_dir}", f"output_dir={run}", f"reward={reward}", "iterations=3",
            "prompts.per_iteration=1", "tree.roots=2", "sampling.num_steps=3", "final_eval=false", "logging.report_to=none",
            "model.compile=none", *extra]


@pytest.mark.parametrize(("mode", "words"), [("unknown-model", "does the server serve a model named 'judge-7b'"),
                                             ("garbage", "answered without the log-probabilities of its first token")])
def test_a_judge_that_cannot_score_stops_train_before_anything_is_written(judge_url, closed_port, tiny_model_dir, tmp_path, capsys, mode, words):
    """One question about a grey image before the model loads (it was asked only at the first rollout, after the run's
    folder was made); a judge that is not there at all, too."""
    from branchdiff.cli import main

    StandIn.mode = mode
    for url, expected in ((judge_url, words), (closed_port + "/v1", "is not reachable")):
        run = tmp_path / f"run-{mode}"
        reward = f"{{name: vlm-judge, kwargs: {{url: '{url}', model: judge-7b, retries: 0}}}}"
        assert main(_train(tiny_model_dir, run, reward)) == 2
        error = [line for line in capsys.readouterr().err.splitlines() if line.startswith("branchdiff")]
        assert len(error) == 1 and expected in error[0] and error[0].startswith("branchdiff: error: judge "), error
        assert not run.exists()
    assert len(StandIn.requests) == 1 and StandIn.requests[0]["body"]["messages"][0]["content"][1]["text"] == (
        'Does this image show "a plain grey square"? Answer yes or no.')


@pytest.mark.parametrize("command", ["eval", "rewards-check", "sample-search"])
def test_eval_rewards_check_and_search_ask_the_judge_before_the_model_loads(judge_url, tiny_model_dir, tmp_path, capsys, monkeypatch,
                                                                              command):
    """The same one question before `eval`, `rewards check` and `sample --search` load the model: a judge serving
    another model stops each with the judge's line, the model never loaded and no output folder made."""
    import branchdiff.models
    from branchdiff.cli import main

    def loaded(*args, **kwargs):
        raise AssertionError("the model loaded before the judge was asked")

    monkeypatch.setattr(branchdiff.models, "load_adapter", loaded)
    StandIn.mode = "unknown-model"
    kwargs = f"{{url: '{judge_url}', model: judge-7b, retries: 0}}"
    reward = f"{{name: vlm-judge, kwargs: {kwargs}}}"
    out = tmp_path / "out"
    argv = {"eval": ["eval", "--model", str(tiny_model_dir), "--prompts", "tiny:held_out", "--rewards", f"[{reward}]", "--out", str(out)],
            "rewards-check": ["rewards", "check", "vlm-judge", "--kwargs", kwargs, "--model", str(tiny_model_dir), "--prompts", "tiny:held_out"],
            "sample-search": ["sample", "--model", str(tiny_model_dir), "--prompt", "one red circle on the left", "--search", "best-of-n",
                              "--budget", "20", "--reward", reward, "--out", str(out)]}[command]
    assert main(argv) == 2
    error = [line for line in capsys.readouterr().err.splitlines() if line.startswith("branchdiff")]
    assert len(error) == 1 and error[0].startswith("branchdiff: error: judge ") and "does the server serve a model named 'judge-7b'" in error[0], error
    assert len(StandIn.requests) == 1 and not out.exists()


ABORT_BOUND = 2.0  # seconds from the second Ctrl-C to the process's end, whatever it still holds (a loaded machine took > 60 s)


def _second_ctrl_c_ends(process: subprocess.Popen, ready: Callable[[], bool], stderr: list[str]) -> float:
    """Wait until `ready()`, press Ctrl-C twice (to the process group, as a terminal does), and return the seconds from the
    second to the process's end (exit 130)."""
    deadline = time.monotonic() + 240
    while not ready():
        assert process.poll() is None and time.monotonic() < deadline, "".join(stderr)[-3000:] or "not ready in time"
        time.sleep(0.1)
    time.sleep(0.5)
    os.killpg(process.pid, signal.SIGINT)
    time.sleep(0.5)
    os.killpg(process.pid, signal.SIGINT)
    pressed = time.monotonic()
    status = process.wait(timeout=60)
    took = time.monotonic() - pressed
    assert status == 130, "".join(stderr)[-3000:]
    return took


def _started(argv: list[str]) -> tuple[subprocess.Popen, list[str]]:
    """`python -m branchdiff.cli ARGV` in a session of its own, and its stderr's lines as they come."""
    process = subprocess.Popen([sys.executable, "-m", "branchdiff.cli", *argv], stderr=subprocess.PIPE, text=True, start_new_session=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(process.stderr.readline, "")), daemon=True).start()
    return process, lines


@pytest.mark.parametrize("kind", ["judge", "judge-overlapped", "judge-replicas", "eval"])
def test_a_second_ctrl_c_ends_the_process_at_once_while_the_judge_never_answers(judge_url, tiny_model_dir, tmp_path, kind):
    """Ctrl-C while the judge's requests hang: the first asks to stop after the iteration, the second ends the process within
    `ABORT_BOUND` seconds (it raised a KeyboardInterrupt, and the interpreter's teardown then garbage-collected the model and
    its caches: over a minute on a loaded machine) with a line of its own; nothing of the run is half-written."""
    StandIn.mode = "stall-after-first"
    servers = [_replica("stall-after-first")] if kind == "judge-replicas" else []
    urls = f"[{', '.join(repr(url) for url in [judge_url, *(url for _, _, url in servers)])}]"
    reward = f"{{name: vlm-judge, kwargs: {{url: {urls}, model: judge-7b, timeout: 60, retries: 0}}}}"
    extra = ["reward_overlap=true"] if kind == "judge-overlapped" else []
    handlers = [StandIn, *(handler for _, handler, _ in servers)]
    preflights = len(handlers)  # the judge asks every replica one question before the model loads
    argv = (["eval", "--model", str(tiny_model_dir), "--prompts", "tiny:held_out", "--rewards", f"[{reward}]", "--images-per-prompt", "1",
             "--steps", "2", "--out", str(tmp_path / "out")] if kind == "eval" else _train(tiny_model_dir, tmp_path / "run", reward, *extra))
    process, stderr = _started(argv)
    try:
        took = _second_ctrl_c_ends(process, lambda: sum(len(h.requests) for h in handlers) > preflights, stderr)
        assert took <= ABORT_BOUND, f"{took:.1f} s"
        said = "".join(stderr)
        if kind == "eval":  # the first stops the command (and the process, at once), the second any clean-up still under way
            assert said.rstrip().splitlines()[-1] in ("branchdiff: interrupted by Ctrl-C", "branchdiff: aborted by a second Ctrl-C"), said[-2000:]
        else:
            assert "Ctrl-C again to abort now" in said and said.rstrip().endswith("branchdiff: aborted by a second Ctrl-C; checkpoints "
                                                                                     "already saved are intact (continue from one with --resume latest)")
        assert "Traceback" not in said and "Exception ignored" not in said
        run = tmp_path / "run"
        assert not list(run.rglob("*.tmp*")) and not list((run / "checkpoints").glob("iter-*") if (run / "checkpoints").exists() else [])
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        for server, _, _ in servers:
            server.shutdown()
            server.server_close()


def test_a_ctrl_c_pair_while_the_first_iteration_compiles_ends_the_process(tiny_model_dir, tmp_path):
    """The pair pressed while torch.compile builds the first forward (the second was swallowed in a weakref callback,
    "Exception ignored in ExactWeakKeyDictionary", and the run went on): the process ends within `ABORT_BOUND` seconds."""
    argv = [item for item in _train(tiny_model_dir, tmp_path / "run", "tiny-geneval") if item != "model.compile=none"] + ["model.compile=blocks"]
    process, stderr = _started(argv)
    try:
        took = _second_ctrl_c_ends(process, lambda: any("compiling them in the first forward" in line for line in stderr), stderr)
        assert took <= ABORT_BOUND, f"{took:.1f} s"
        said = "".join(stderr)
        assert said.rstrip().endswith("branchdiff: aborted by a second Ctrl-C; checkpoints already saved are intact (continue from one with "
                                      "--resume latest)"), said[-2000:]
        assert "Exception ignored" not in said and "Traceback" not in said, said[-3000:]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def _replica(mode: str = "ok"):
    """A stand-in judge of its own (its own request log, mode and in-flight peak) on a free port: (server, handler, URL)."""
    handler = type("Replica", (StandIn,), {"mode": mode, "requests": [], "in_flight": 0, "peak": 0, "lock": threading.Lock()})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, handler, f"http://127.0.0.1:{server.server_address[1]}/v1"


def test_replicas_judge_like_one_server_spread_the_requests_and_bound_each(judge_url, capfd):
    images, prompts = _images(12), [f"prompt {i}" for i in range(12)]
    one = _judge(judge_url, concurrency=2)(images, prompts, [{} for _ in prompts])
    servers = [_replica(), _replica()]
    try:
        judge = _judge([url for _, _, url in servers], concurrency=2)
        both = judge(images, prompts, [{} for _ in prompts])
        assert torch.equal(one, both)
        counts = [len(handler.requests) for _, handler, _ in servers]
        assert sum(counts) == 12 and min(counts) >= 3, counts  # both judged a share
        assert all(handler.peak <= 2 for _, handler, _ in servers)  # at most `concurrency` in flight at each
    finally:
        for server, _, _ in servers:
            server.shutdown()
            server.server_close()
    assert "left out" not in capfd.readouterr().err


def test_a_judge_replica_down_is_left_out_once_and_every_one_down_is_one_line(judge_url, capfd):
    images, prompts = _images(6), [f"prompt {i}" for i in range(6)]
    expected = _judge(judge_url)(images, prompts, [{} for _ in prompts])
    server, handler, live = _replica()
    down = "http://127.0.0.1:9/v1"  # nothing listens on the discard port
    try:
        judge = _judge([down, live], retries=0, backoff=0.0)
        assert torch.equal(judge(images, prompts, [{} for _ in prompts]), expected)
        assert torch.equal(judge(images, prompts, [{} for _ in prompts]), expected)
        assert len(handler.requests) == 12
    finally:
        server.shutdown()
        server.server_close()
    err = capfd.readouterr().err
    assert err.count(f"branchdiff: judge replica {down}/chat/completions left out, the others judge its share: judge {down}") == 1, err
    judge = _judge([down, "http://127.0.0.1:7/v1"], retries=0, backoff=0.0)
    with pytest.raises(RemoteRewardError, match=r"^every judge replica is down \(2 of 2\): http://127.0.0.1:9/v1/chat/completions: judge .* is not "
                                                r"reachable.*; http://127.0.0.1:7/v1/chat/completions: judge .* is not reachable") as caught:
        judge(images, prompts, [{} for _ in prompts])
    assert "\n" not in str(caught.value)


def test_a_judge_replica_that_refuses_stops_the_call_and_bad_lists_are_refused(judge_url):
    server, _, refusing = _replica("unknown-model")
    try:
        with pytest.raises(RemoteRewardError, match=r"judge http://127.0.0.1:\d+/v1/chat/completions answered HTTP 404.*does the server serve a "
                                                    r"model named 'judge-7b'"):
            _judge([judge_url, refusing], concurrency=1)(_images(4), ["a"] * 4, [{}] * 4)
        with pytest.raises(RemoteRewardError, match="answered HTTP 404"):
            VLMJudge.preflight(url=[judge_url, refusing], model="judge-7b")  # every replica is asked before a run
    finally:
        server.shutdown()
        server.server_close()
    for bad, why in (([], "a list of distinct URLs"), ([judge_url, judge_url], "a list of distinct URLs"), ([judge_url, "ftp://x"], "must start with")):
        with pytest.raises(ValueError, match=why):
            _judge(bad)


def test_a_judge_replica_down_at_preflight_is_left_out_and_a_trailing_slash_is_the_same_url(judge_url, capfd):
    VLMJudge.preflight(url=["http://127.0.0.1:9/v1", judge_url], model="judge-7b", retries=0, backoff=0.0)
    assert capfd.readouterr().err.count("branchdiff: judge replica http://127.0.0.1:9/v1/chat/completions left out") == 1
    with pytest.raises(RemoteRewardError, match=r"^every judge replica is down \(2 of 2\)"):
        VLMJudge.preflight(url=["http://127.0.0.1:9/v1", "http://127.0.0.1:7/v1"], model="judge-7b", retries=0, backoff=0.0)
    with pytest.raises(ValueError, match="a list of distinct URLs"):
        _judge([judge_url, judge_url + "/"])


def test_a_replica_left_out_is_said_on_a_line_of_its_own_above_the_progress_bar(judge_url, capsys):
    """The notice was printed onto the training bar's line ("train: 40%|...| 2/5branchdiff: judge replica ..."): it is
    written above the bar, which is drawn again below it."""
    from tqdm.auto import tqdm

    judge = _judge([judge_url, "http://127.0.0.1:9/v1"])
    with tqdm(total=5, desc="train", file=sys.stderr) as bar:
        bar.update(2)
        judge.leave_out("http://127.0.0.1:9/v1", "connection refused")
    said = capsys.readouterr().err
    notice = said.index("branchdiff: judge replica http://127.0.0.1:9/v1 left out")
    assert said[notice - 1] in "\r\n" and said[notice:].split("\n", 1)[0].endswith("connection refused"), repr(said)


def test_one_server_named_twice_by_two_host_names_is_refused():
    """`127.0.0.1` and `localhost` for one server were taken as two replicas (a judge's and a reward server's)."""
    from branchdiff.rewards.replicas import ReplicaReward

    with pytest.raises(ValueError, match=r"^reward 'vlm-judge': http://127.0.0.1:8000/v1 and http://localhost:8000/v1/ are one server \(their "
                                         r"hosts resolve to the same address\); list each replica once$"):
        _judge(["http://127.0.0.1:8000/v1", "http://localhost:8000/v1/"])
    with pytest.raises(ValueError, match=r"^remote reward replicas: http://localhost:8765 and http://127.0.0.1:8765 are one server"):
        ReplicaReward(["http://localhost:8765", "http://127.0.0.1:8765"])
    _judge(["http://127.0.0.1:8000/v1", "http://localhost:8001/v1"])  # two ports: two servers (built without a request)
