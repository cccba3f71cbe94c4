"""Reward servers: a real server on a free 127.0.0.1 port scores exactly as the reward does in
process (bit for bit, for every image format), chunks come back in order, and every failure (server
down, 5xx after bounded retries, 4xx without retry, timeout, the reward raising, a wrong shape or
NaN) is one line naming the URL."""

from __future__ import annotations

import http.server
import importlib.metadata
import json
import math
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

from branchdiff.data.tiny_task import all_prompts, render_batch
from branchdiff.rewards.base import check_scores
from branchdiff.rewards.registry import build_reward
from branchdiff.rewards.remote import (
    IMAGE_FORMATS,
    WIRE_VERSION,
    RemoteReward,
    RemoteRewardError,
    WireFormatError,
    decode_batch,
    encode_batch,
    quantize,
    to_uint8,
)
from branchdiff.rewards.server import BackgroundServer, Limits, create_app, serve
from json_handler import JSONHandler  # tests/ is on sys.path

FAST = {"retries": 1, "backoff": 0.01, "timeout": 5.0}  # failures in these tests take milliseconds


class Checksum:
    """A model-free reward sensitive to every pixel bit, the prompt and the metadata; it records the
    batch sizes it was called with."""

    name = "checksum"
    scale = "weighted pixel sum + len(prompt)/7 + metadata bonus"
    higher_is_better = False

    def __init__(self) -> None:
        self.weights = torch.rand(3, 8, 8, generator=torch.Generator().manual_seed(0))  # (3, H, W)
        self.batch_sizes: list[int] = []

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        self.batch_sizes.append(len(prompts))
        return torch.stack([(image * self.weights).sum() + len(text) / 7 + meta.get("bonus", 0.0) for image, text, meta in zip(images, prompts, metadata)])


class Failing:
    """A reward that fails in the way `mode` says."""

    name = "failing"

    def __init__(self, mode: str) -> None:
        self.mode = mode

    def __call__(self, images, prompts, metadata):
        if self.mode == "raise":
            raise ValueError("weights not found at /models/x.safetensors\nsecond line of the message")
        if self.mode == "shape":
            return torch.zeros(len(prompts), 2)
        return torch.tensor([0.5] + [math.nan] * (len(prompts) - 1))  # "nan"


def batch(size: int = 7, seed: int = 0) -> tuple[torch.Tensor, list[str], list[dict]]:
    """Images (size, 3, 8, 8) in [0, 1] (not on the uint8 grid), prompts and metadata."""
    generator = torch.Generator().manual_seed(seed)
    images = torch.rand(size, 3, 8, 8, generator=generator)
    prompts = [f"prompt number {i} " + "x" * i for i in range(size)]
    metadata = [{"bonus": 0.25 * i, "style": "anime"} for i in range(size)]
    return images, prompts, metadata


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def assert_one_line(error: pytest.ExceptionInfo, *parts: str) -> str:
    message = str(error.value)
    assert "\n" not in message and message.strip() == message, message
    for part in parts:
        assert part in message, (part, message)
    return message


@pytest.fixture(scope="module", autouse=True)
def no_leaked_servers():
    """Torn down after every other fixture of the module: no server thread may be left."""
    yield
    left = [thread.name for thread in threading.enumerate() if thread.name.startswith("reward-server-") or "serve_forever" in thread.name]
    assert not left, left


@pytest.fixture(scope="module")
def checksum_server():
    reward = Checksum()
    with BackgroundServer(reward) as server:
        yield reward, server


@pytest.fixture(scope="module")
def geneval_server():
    reward = build_reward("tiny-geneval")
    with BackgroundServer(reward) as server:
        yield reward, server


class Stub(JSONHandler):
    """Answers /health like a reward server and /score with the server's canned `answer`."""

    def do_GET(self) -> None:
        health = {"status": "ok", "name": "stub", "scale": "none", "wire": WIRE_VERSION} if self.path == "/health" else {"hello": "world"}
        self.send_json(200, json.dumps(health).encode())

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.server.requests += 1
        status, body, delay = self.server.answer
        time.sleep(delay)
        try:
            self.send_json(status, body)
        except OSError:  # the client gave up (timeout test)
            pass
        self.server.answered.set()



@pytest.fixture(scope="module")
def stub_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Stub)
    server.requests, server.answer, server.answered = 0, (200, b"{}", 0.0), threading.Event()
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield server, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join(5)
    assert not thread.is_alive()


def answer(stub, status: int, body: bytes, delay: float = 0.0) -> None:
    server, _ = stub
    server.requests, server.answer = 0, (status, body, delay)
    server.answered.clear()


# --- health and scores -----------------------------------------------------------------------


def test_health_names_reward_scale_and_version(checksum_server):
    reward, server = checksum_server
    with urllib.request.urlopen(server.url + "/health", timeout=5) as response:
        assert response.status == 200
        health = json.loads(response.read())
    assert health["status"] == "ok" and health["name"] == "checksum" and health["scale"] == Checksum.scale
    assert health["higher_is_better"] is False and health["video"] is False and health["wire"] == WIRE_VERSION
    assert health["branchdiff_version"] == importlib.metadata.version("branchdiff-rl")
    remote = RemoteReward(server.url, **FAST)
    assert (remote.name, remote.scale, remote.higher_is_better) == ("checksum", Checksum.scale, False)


@pytest.mark.parametrize("image_format", IMAGE_FORMATS)
def test_remote_scores_equal_in_process_bit_for_bit(checksum_server, image_format):
    reward, server = checksum_server
    images, prompts, metadata = batch()
    remote = RemoteReward(server.url, image_format=image_format, **FAST)(images, prompts, metadata)
    exact = check_scores(reward(images, prompts, metadata), len(prompts), "checksum")
    quantised = check_scores(reward(quantize(images), prompts, metadata), len(prompts), "checksum")
    assert not torch.equal(exact, quantised)  # the comparison below can tell the two apart
    expected = exact if image_format == "float32" else quantised
    assert remote.dtype == torch.float32 and remote.shape == (7,)
    assert torch.equal(remote, expected), (image_format, remote - expected)


@pytest.mark.parametrize("image_format", IMAGE_FORMATS)
def test_tiny_geneval_remote_equals_in_process(geneval_server, image_format):
    reward, server = geneval_server
    prompts = all_prompts()[::9]  # 16 prompts
    images = torch.from_numpy(render_batch(prompts, seed=1))  # (16, 3, 32, 32)
    images = (images + 0.3 * torch.rand(images.shape, generator=torch.Generator().manual_seed(2))).clamp(0, 1)
    texts = [p.text for p in prompts[1:] + prompts[:1]]  # shifted: most images miss their prompt
    remote = RemoteReward(server.url, image_format=image_format, chunk_size=5, **FAST)(images, texts, [{} for _ in texts])
    expected = reward(images if image_format == "float32" else quantize(images), texts)
    assert len(set(expected.tolist())) > 2  # scores that vary, not a constant
    assert torch.equal(remote, expected.float())


def test_large_batch_is_split_into_chunks_and_reassembled_in_order(checksum_server):
    reward, server = checksum_server
    images, prompts, metadata = batch(size=8, seed=3)
    reward.batch_sizes.clear()
    remote = RemoteReward(server.url, chunk_size=3, **FAST)(images, prompts, metadata)
    assert reward.batch_sizes == [3, 3, 2]
    assert torch.equal(remote, reward(quantize(images), prompts, metadata))
    assert torch.equal(RemoteReward(server.url, chunk_size=3, **FAST)(images[:0], [], []), torch.zeros(0))


# --- failures: one line naming the URL -------------------------------------------------------


def test_server_down_is_one_line_naming_url_after_bounded_retries():
    url = f"http://127.0.0.1:{free_port()}"
    start = time.monotonic()
    with pytest.raises(RemoteRewardError) as error:
        RemoteReward(url, retries=2, backoff=0.01, timeout=1.0)
    assert time.monotonic() - start < 3
    assert_one_line(error, url + "/health", "not reachable", "3 attempts", "serve-reward")


def test_5xx_is_retried_a_bounded_number_of_times_and_4xx_is_not(stub_server):
    server, url = stub_server
    remote = RemoteReward(url, retries=2, backoff=0.01, timeout=5.0)
    images, prompts, metadata = batch(size=2)
    answer(stub_server, 503, b'{"error": "GPU busy"}')
    with pytest.raises(RemoteRewardError) as error:
        remote(images, prompts, metadata)
    assert server.requests == 3
    assert_one_line(error, url + "/score", "HTTP 503", "GPU busy", "3 attempts")
    answer(stub_server, 422, b"not json at all")
    with pytest.raises(RemoteRewardError) as error:
        remote(images, prompts, metadata)
    assert server.requests == 1
    assert_one_line(error, url + "/score", "HTTP 422", "not json at all")


def test_timeout_is_one_line(stub_server):
    server, url = stub_server
    remote = RemoteReward(url, retries=0, timeout=5)  # the /health request the constructor makes is not the one timed out
    remote.timeout = 0.2
    answer(stub_server, 200, b'{"scores": [1.0, 2.0]}', delay=0.6)
    with pytest.raises(RemoteRewardError) as error:
        remote(*batch(size=2))
    assert_one_line(error, url + "/score", "did not answer within 0.2 s", "1 attempt")
    assert server.answered.wait(5)


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        (b'{"scores": [1.0]}', "sent 1 scores for 2 images"),
        (b'{"scores": [[1.0], [2.0]]}', "non-numeric scores for images [0, 1]"),
        (b'{"scores": ["1.0", 2.0]}', "non-numeric scores for images [0]"),
        (b'{"score": 1.0}', "expected {\"scores\""),
        (b"<html>", "not JSON"),
    ],
)
def test_wrong_shape_or_nan_reply_is_one_line(stub_server, reply, expected):
    _, url = stub_server
    answer(stub_server, 200, reply)
    with pytest.raises(RemoteRewardError) as error:
        RemoteReward(url, **FAST)(*batch(size=2))
    assert_one_line(error, url, expected)


@pytest.mark.parametrize(("mode", "expected"), [("raise", "ValueError: weights not found at /models/x.safetensors second line"), ("shape", "returned shape (3, 2) for 3 images")])
def test_failing_reward_is_reported_by_the_client_in_one_line(mode, expected):
    with BackgroundServer(Failing(mode)) as server:
        with pytest.raises(RemoteRewardError) as error:
            RemoteReward(server.url, **FAST)(*batch(size=3))
    message = assert_one_line(error, server.url + "/score", expected)
    assert "HTTP 500" in message and "(1 attempt" not in message  # a failing reward is not retried


@pytest.mark.parametrize("reply", [b'{"scores": [1.0, NaN]}', b'{"scores": [null, 1.0]}'])
def test_non_finite_scores_come_back_as_nan_for_the_caller_to_count(stub_server, reply):
    """A server's NaN (sent as null) is the caller's to count, as for a local reward (MultiReward
    leaves the component out of that group), not a reason to stop the run."""
    _, url = stub_server
    answer(stub_server, 200, reply)
    scores = RemoteReward(url, **FAST)(*batch(size=2))
    assert scores.shape == (2,) and int(torch.isnan(scores).sum()) == 1


def test_malformed_request_is_400_with_a_message(checksum_server):
    _, server = checksum_server
    request = urllib.request.Request(server.url + "/score", data=b'{"format": "jpeg"}\n', method="POST")
    with pytest.raises(urllib.error.HTTPError) as error:
        urllib.request.urlopen(request, timeout=5)
    assert error.value.code == 400
    assert "header 'format' is 'jpeg'" in json.loads(error.value.read())["error"]


def test_not_a_reward_server_is_one_line(stub_server):
    _, url = stub_server
    with pytest.raises(RemoteRewardError) as error:
        RemoteReward(url + "/other", **FAST)  # answers 200 with JSON that is not a reward's health
    assert_one_line(error, url + "/other/health", "does not describe a branchdiff reward server")
    with BackgroundServer(Checksum()) as server, pytest.raises(RemoteRewardError) as error:
        RemoteReward(server.url + "/v2", **FAST)
    assert_one_line(error, server.url + "/v2/health", "HTTP 404")


def test_client_arguments_are_checked():
    with pytest.raises(ValueError, match="must start with http"):
        RemoteReward("127.0.0.1:8765")
    with pytest.raises(ValueError, match="image_format 'jpeg'"):
        RemoteReward("http://127.0.0.1:1", image_format="jpeg")
    with pytest.raises(ValueError, match="chunk_size=0"):
        RemoteReward("http://127.0.0.1:1", chunk_size=0)


# --- wire format -----------------------------------------------------------------------------


def test_wire_roundtrip_and_quantisation():
    images, prompts, metadata = batch(size=4)
    images[0, 0, 0, 0] = -0.25  # float32 carries any value; uint8 and PNG clamp
    for image_format in IMAGE_FORMATS:
        decoded, got_prompts, got_metadata = decode_batch(encode_batch(images, prompts, metadata, image_format))
        assert (got_prompts, got_metadata) == (prompts, metadata)
        assert torch.equal(decoded, images if image_format == "float32" else quantize(images)), image_format
    assert torch.equal(to_uint8(torch.tensor([0.0, 0.5 / 255, 1.5 / 255, 0.999, 1.5, -1.0])), torch.tensor([0, 0, 2, 255, 255, 0], dtype=torch.uint8))


@pytest.mark.parametrize("image_format", IMAGE_FORMATS)
def test_a_served_reward_of_videos_scores_them_whole(image_format):
    """Videos (B, F, 3, H, W) travel whole, frame by frame in PNG; /health says the reward scores videos,
    and the remote scores equal flicker's in-process scores of what was sent; a reward of images served
    refuses videos in the client, with one line."""
    flicker = build_reward("flicker")
    videos = torch.rand(3, 4, 3, 8, 10, generator=torch.Generator().manual_seed(1))  # (B, F, 3, H, W)
    prompts, metadata = ["a", "bb", "ccc"], [{}, {"k": 1}, {}]
    decoded, got_prompts, got_metadata = decode_batch(encode_batch(videos, prompts, metadata, image_format))
    assert torch.equal(decoded, videos if image_format == "float32" else quantize(videos)) and got_prompts == prompts and got_metadata == metadata
    with BackgroundServer(flicker) as server:
        remote = RemoteReward(server.url, image_format=image_format, chunk_size=2, **FAST)
        assert remote.video and remote.health["video"] is True and remote.higher_is_better is False
        scores = remote(videos, prompts, metadata)
        assert torch.equal(scores, flicker(decoded, prompts, metadata).float()) and scores.abs().min() > 0
        with pytest.raises(ValueError) as error:
            remote(videos[:, 0], prompts, metadata)
        assert_one_line(error, "(3, 3, 8, 10)", "expected (3, F, 3, H, W): the served reward 'flicker' scores videos")
    with BackgroundServer(Checksum()) as server, pytest.raises(ValueError) as error:
        RemoteReward(server.url, **FAST)(videos, prompts, metadata)
    assert_one_line(error, "(3, 4, 3, 8, 10)", "expected (3, 3, H, W)")


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (b'{"format": "uint8", "shape": [1, 3, 2, 2], "prompts": ["a"], "metadata": [{}]}\n' + bytes(11), "must be 12 bytes; got 11"),
        (b'{"format": "uint8", "shape": [1, 4, 2, 2], "prompts": ["a"], "metadata": [{}]}\n', "expected [B, 3, H, W] (images) or [B, F, 3, H, W]"),
        (b'{"format": "png", "shape": [1, 2, 3, 1, 1], "prompts": ["a"], "metadata": [{}], "png_sizes": [3]}\nabc', "'png_sizes' must be a list of 2"),
        (b'{"format": "uint8", "shape": [2, 3, 1, 1], "prompts": ["a"], "metadata": [{}, {}]}\n' + bytes(6), "'prompts' must be a list of 2 strings"),
        (b'{"format": "png", "shape": [1, 3, 1, 1], "prompts": ["a"], "metadata": [{}], "png_sizes": [3]}\nabc', "image 0 is not a readable PNG"),
        (b"[1, 2]\n", "must be a JSON object"),
    ],
)
def test_malformed_bodies_are_named(body, expected):
    with pytest.raises(WireFormatError, match=re.escape(expected)):
        decode_batch(body)


def test_png_of_wrong_size_is_refused():
    png_body = encode_batch(torch.zeros(1, 3, 4, 4), ["a"], [{}], "png")
    header, _, payload = png_body.partition(b"\n")
    header = json.loads(header) | {"shape": [1, 3, 4, 5]}
    with pytest.raises(WireFormatError, match="RGB PNG of 4x4; expected 8-bit RGB of 5x4"):
        decode_batch(json.dumps(header).encode() + b"\n" + payload)


# --- serve() as `branchdiff serve-reward` calls it -------------------------------------------


def test_serve_in_a_subprocess_as_the_cli_calls_it():
    port = free_port()
    code = f"from branchdiff.rewards.registry import build_reward; from branchdiff.rewards.server import serve; serve(build_reward('tiny-geneval', 'cpu'), '127.0.0.1', {port})"
    process = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            assert process.poll() is None, process.stderr.read()
            try:
                urllib.request.urlopen(url + "/health", timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "server did not start"
                time.sleep(0.1)
        prompts = all_prompts()[:6]
        images = torch.from_numpy(render_batch(prompts, seed=4))
        texts = [p.text for p in prompts[::-1]]
        remote = RemoteReward(url, image_format="png", **FAST)
        assert remote.name == "tiny-geneval"
        assert torch.equal(remote(images, texts), build_reward("tiny-geneval")(quantize(images), texts))
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=10) == 0
        assert f"serving reward 'tiny-geneval' on {url}" in process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        process.stderr.close()


def test_port_in_use_is_one_line():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(ValueError) as error:
            serve(Checksum(), "127.0.0.1", port)
    assert_one_line(error, f"cannot listen on 127.0.0.1:{port}")


@pytest.mark.parametrize("module", ["starlette", "uvicorn"])
def test_missing_server_package_names_the_extra(monkeypatch, module):
    monkeypatch.setitem(sys.modules, module, None)  # import of `module` now fails
    with pytest.raises(ValueError) as error:
        serve(Checksum(), "127.0.0.1", free_port())
    assert_one_line(error, repr(module), 'pip install "branchdiff-rl[serve]"')
    if module == "starlette":
        with pytest.raises(ValueError, match="serve"):
            create_app(Checksum())




# ---------------------------------------------------------------------------------------------
# Fit for a cluster: a shared token beyond the loopback, bounded requests, batching, a load test.

TOKEN = "s3cret-token-of-the-test-0123456789"


def _token_file(tmp_path, token: str = TOKEN):
    path = tmp_path / "token"
    path.write_text(token + "\n")
    return str(path)


def test_a_server_beyond_the_loopback_without_a_token_is_refused(capsys, tmp_path):
    from branchdiff.cli import main

    assert main(["serve-reward", "tiny-geneval", "--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("branchdiff: error: serve-reward --host 0.0.0.0: a server listening beyond this machine needs a shared token; give "
                   "--token-file FILE (clients: kwargs: {token_file: FILE}), or listen on 127.0.0.1 behind an SSH tunnel")
    assert main(["serve-reward", "tiny-geneval", "--host", "0.0.0.0", "--token-file", _token_file(tmp_path, "short")]) == 2
    assert "holds no token of 16 characters or more" in capsys.readouterr().err


def test_the_token_is_required_and_checked(tmp_path):
    images = quantize(torch.rand(3, 3, 8, 8))  # what uint8 carries exactly
    with BackgroundServer(Checksum(), token=TOKEN) as server:
        assert RemoteReward(server.url, token_file=_token_file(tmp_path))(images, ["a"] * 3).tolist() == Checksum()(images, ["a"] * 3, [{}] * 3).tolist()
        for token_file in (None, _token_file(tmp_path, "the-wrong-token-of-the-test-000")):
            with pytest.raises(RemoteRewardError) as refused:
                RemoteReward(server.url, retries=0, token_file=token_file)
            message = str(refused.value)
            assert len(message.splitlines()) == 1 and "answered HTTP 401: unauthorized: this reward server needs its shared token" in message


def test_requests_over_the_limits_get_one_line_naming_the_limit(tmp_path):
    with BackgroundServer(Checksum(), limits=Limits(max_images=4, max_bytes=6000)) as server:
        with pytest.raises(RemoteRewardError, match=r"HTTP 413: request too large: 6 images, this server takes at most 4 \(--max-images\)"):
            RemoteReward(server.url, retries=0, chunk_size=8)(torch.rand(6, 3, 8, 8), ["a"] * 6)
        with pytest.raises(RemoteRewardError, match=r"HTTP 413: request too large: \d+ bytes, this server takes at most 6000 \(--max-bytes\)"):
            RemoteReward(server.url, retries=0)(torch.rand(2, 3, 40, 40), ["a"] * 2)
        assert RemoteReward(server.url, chunk_size=4)(torch.rand(6, 3, 8, 8), ["a"] * 6).shape == (6,)  # in chunks it fits


def test_the_load_test_loses_and_misorders_nothing_and_batches():
    """Six clients for two seconds against a server batching up to 64 images: every request answered with
    its own images' identities, in order, and fewer reward calls than requests."""
    from branchdiff.bench.reward_server import Echo, load_test

    with BackgroundServer(Echo(), limits=Limits(max_batch=64)) as server:
        row = load_test(server.url, clients=6, seconds=2.0, images_per_request=3, size=16)
        calls = server.batcher.calls
    assert row["requests"] > 20 and row["failed"] == 0 and row["mismatched"] == 0
    assert calls < row["requests"] and server.batcher.requests == row["requests"]


def test_batches_keep_one_image_shape_and_arrival_order():
    """The batcher takes the oldest request and those after it of the same shape, up to max_batch images."""
    from concurrent.futures import wait

    from branchdiff.rewards.server import Batcher, _Request

    gate = threading.Event()

    sizes: list[int] = []

    def gated(images, prompts, metadata):  # each image's mean, once the gate opens (the requests queue up meanwhile)
        gate.wait(5)
        sizes.append(len(prompts))
        return images.flatten(1).mean(1)

    batcher = Batcher(gated, "gated", "cpu", max_batch=5)
    first = batcher.submit(_Request(torch.rand(1, 3, 8, 8), ["p"], [{}]))  # the worker holds it at the gate while the rest queue
    shapes = [(2, 8), (2, 8), (1, 4), (2, 8), (3, 8)]
    requests = [_Request(torch.rand(n, 3, side, side), ["p"] * n, [{}] * n) for n, side in shapes]
    while batcher.waiting.qsize():  # wait until the worker has taken the first request
        time.sleep(0.001)
    futures = [batcher.submit(r) for r in requests]
    gate.set()
    wait([first, *futures], timeout=10)
    for request, future in zip(requests, futures):
        assert future.result() == request.images.flatten(1).mean(1).tolist()
    # the held request alone, then the two 8×8 pairs (the 4×4 request stops the batch), the 4×4 one, then 2 + 3 images
    assert sizes == [1, 4, 1, 5] and batcher.requests == 6
