"""Serve any reward over HTTP, so a reward with heavy or conflicting dependencies (or its own GPU)
lives in its own environment or machine: `branchdiff serve-reward NAME` runs
`serve(build_reward(NAME, device), host, port)`, and training or evaluation use it as
`reward: {remote: http://host:port}` (`branchdiff/rewards/remote.py`, docs/reward-server.md).

Endpoints:
- `GET /health`: 200 and `{"status": "ok", "name", "scale", "higher_is_better", "video", "group", "device",
  "branchdiff_version", "wire", "formats"}` (`video`: the reward scores videos (B, F, 3, H, W) whole;
  `group`: it scores a prompt's group at once, so each request holds one group and is scored alone,
  branchdiff/rewards/group.py);
- `POST /score`: a batch in the wire format of `branchdiff/rewards/remote.py`, answered `{"scores": [B]}`
  (float32 values, a non-finite score as null), or `{"error": "one line"}` with status 400 for a
  malformed request and 500 when the reward raises or returns the wrong shape.

The reward runs in one worker thread (the event loop keeps answering /health; models are rarely
thread-safe), under `torch.inference_mode`, on images moved to its `device` (videos stay whole).
Requests that arrive while it is busy are batched: the worker takes the waiting requests in arrival
order, as many as fit in `max_batch` images and share one image shape, scores them in one call and
answers each request its own scores. Built on Starlette and uvicorn, the optional extra `serve`,
imported only here.

Limits: a body over `max_bytes` is refused before it is read (413), a request of more than
`max_images` images (videos) after its header is read (413). A `token` makes every endpoint ask for
`Authorization: Bearer <token>` (401 otherwise); `serve` refuses to listen beyond the loopback
without one.
"""

from __future__ import annotations

import asyncio
import hmac
import importlib
import ipaddress
import logging
import math
import os
import queue
import socket
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version

import torch

from branchdiff.errors import one_line
from branchdiff.rewards.base import check_scores
from branchdiff.rewards.group import is_group_reward
from branchdiff.rewards.remote import IMAGE_FORMATS, WIRE_VERSION, WireFormatError, decode_batch

DEFAULT_PORT = 8765  # `branchdiff serve-reward` and docs/reward-server.md use it too
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Limits:
    """What one server accepts and how it batches."""

    max_images: int = 256  # images (videos) in one request
    max_bytes: int = 256 * 2**20  # bytes of one request body
    max_batch: int = 64  # images (videos) the reward scores in one call, requests batched together up to it (1: one request at a time)

    def __post_init__(self) -> None:
        if min(self.max_images, self.max_bytes, self.max_batch) < 1:
            raise ValueError(f"reward server limits must be ≥ 1 (max_images={self.max_images}, max_bytes={self.max_bytes}, max_batch={self.max_batch})")


def is_loopback(host: str) -> bool:
    """Whether `host` accepts connections from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_host(host: str, token: str | None) -> None:
    """Refuse, in one line, to listen beyond the loopback without a shared token."""
    if not is_loopback(host) and not token:
        raise ValueError(f"serve-reward --host {host}: a server listening beyond this machine needs a shared token; give --token-file FILE "
                         "(clients: kwargs: {token_file: FILE}), or listen on 127.0.0.1 behind an SSH tunnel")


@dataclass
class _Request:
    images: torch.Tensor  # (n, 3, H, W) or (n, F, 3, H, W) float32
    prompts: list[str]
    metadata: list[dict]
    answer: Future = field(default_factory=Future)


def wire_values(scores: torch.Tensor) -> list[float | None]:
    """Scores (n,) as a /score reply lists them: a non-finite score as null."""
    return [value if math.isfinite(value) else None for value in scores.tolist()]


class Batcher:
    """One worker thread scoring queued requests, batched: the oldest request and those after it that
    share its image shape, up to `max_batch` images; each request's future gets its own scores."""

    def __init__(self, reward: object, name: str, device: object, max_batch: int) -> None:
        self.reward, self.name, self.device, self.max_batch = reward, name, device, max_batch
        self.group = is_group_reward(reward)  # each request one group, scored alone
        self.waiting: queue.Queue[_Request] = queue.Queue()
        self.held: _Request | None = None  # taken from the queue, not fitting the last batch: the next batch's first
        self.calls = self.requests = 0  # reward calls made, requests answered (stats; counted before the answer is set)
        self.thread = threading.Thread(target=self._run, name="reward-batcher", daemon=True)
        self.thread.start()

    def submit(self, request: _Request) -> Future:
        self.waiting.put(request)
        return request.answer

    def _take(self, wait: bool) -> _Request:
        """The held request, else the oldest queued one (waiting for one when `wait`; queue.Empty otherwise)."""
        if self.held is not None:
            request, self.held = self.held, None
            return request
        return self.waiting.get() if wait else self.waiting.get_nowait()

    def _next_batch(self) -> list[_Request]:
        first = self._take(wait=True)
        batch, size = [first], len(first.prompts)
        while size < self.max_batch:
            try:
                candidate = self._take(wait=False)
            except queue.Empty:
                break
            if candidate.images.shape[1:] != first.images.shape[1:] or size + len(candidate.prompts) > self.max_batch:
                self.held = candidate  # keeps arrival order: it opens the next batch
                break
            batch.append(candidate)
            size += len(candidate.prompts)
        return batch

    def _score_groups(self, batch: list[_Request]) -> None:
        """A group reward: each request is one group, scored by its own `score_group` call and answered alone."""
        for r in batch:
            try:
                with torch.inference_mode():
                    scored = self.reward.score_group(r.images.to(self.device), r.prompts, r.metadata)  # type: ignore[attr-defined]
                scores = check_scores(scored, len(r.prompts), self.name)
            except Exception as error:  # user code: this request gets its failure, the others their scores
                logger.exception("reward %r failed on a group", self.name)
                self.calls, self.requests = self.calls + 1, self.requests + 1
                r.answer.set_exception(error)
                continue
            self.calls, self.requests = self.calls + 1, self.requests + 1
            r.answer.set_result(wire_values(scores))

    def _run(self) -> None:
        while True:
            batch = self._next_batch()
            if self.group:
                self._score_groups(batch)
                continue
            try:
                images = torch.cat([r.images for r in batch]) if len(batch) > 1 else batch[0].images
                prompts = [p for r in batch for p in r.prompts]
                metadata = [m for r in batch for m in r.metadata]
                with torch.inference_mode():  # grad mode is per thread: set it in the worker
                    scores = check_scores(self.reward(images.to(self.device), prompts, metadata), len(prompts), self.name)  # (B,) on the CPU
                values = wire_values(scores)
            except Exception as error:  # the reward is user code: every request of the batch gets its failure
                logger.exception("reward %r failed on a batch", self.name)
                for r in batch:
                    r.answer.set_exception(error)
                continue
            self.calls, self.requests = self.calls + 1, self.requests + len(batch)
            start = 0
            for r in batch:
                r.answer.set_result(values[start:start + len(r.prompts)])
                start += len(r.prompts)


def _require(module: str):
    """Import `module` of the `serve` extra, or a one-line ValueError saying how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ValueError(f"serving a reward needs the package {module!r}: pip install \"branchdiff-rl[serve]\"") from None


def health_info(reward: object) -> dict:
    """What `GET /health` answers for `reward`."""
    try:
        branchdiff_version = version("branchdiff-rl")
    except PackageNotFoundError:  # running from a source tree that was never installed
        branchdiff_version = "unknown"
    return {
        "status": "ok",
        "name": str(getattr(reward, "name", type(reward).__name__)),
        "scale": str(getattr(reward, "scale", "unspecified")),
        "higher_is_better": bool(getattr(reward, "higher_is_better", True)),
        "video": bool(getattr(reward, "video", False)),  # it scores videos (B, F, 3, H, W) whole
        "group": is_group_reward(reward),  # it scores a prompt's group at once: each request is one group
        "device": str(getattr(reward, "device", "cpu")),
        "branchdiff_version": branchdiff_version,
        "wire": WIRE_VERSION,
        "formats": list(IMAGE_FORMATS),
    }


def create_app(reward: object, limits: Limits = Limits(), token: str | None = None):
    """A Starlette application serving `reward` on `/health` and `/score` (run it with any ASGI
    server; `serve` and `BackgroundServer` use uvicorn). `app.state.batcher` holds the worker."""
    _require("starlette")
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    info = health_info(reward)
    name = info["name"]
    batcher = Batcher(reward, name, getattr(reward, "device", None) or "cpu", limits.max_batch)
    expected = f"Bearer {token}".encode() if token else None

    def refused(request) -> JSONResponse | None:
        if expected is None:
            return None
        given = request.headers.get("authorization", "").encode()
        if hmac.compare_digest(given, expected):
            return None
        return JSONResponse({"error": "unauthorized: this reward server needs its shared token (a remote reward's kwargs: "
                                      "{token_file: PATH}); the token sent is missing or wrong"}, status_code=401)

    async def health(request):
        return refused(request) or JSONResponse(info)

    async def score(request):
        if (denied := refused(request)) is not None:
            return denied
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limits.max_bytes:
            return JSONResponse({"error": f"request too large: {int(length)} bytes, this server takes at most {limits.max_bytes} "
                                          "(--max-bytes); send fewer images per request (kwargs: {chunk_size: N})"}, status_code=413)
        body = await request.body()
        if len(body) > limits.max_bytes:
            return JSONResponse({"error": f"request too large: over {limits.max_bytes} bytes (--max-bytes)"}, status_code=413)
        try:
            images, prompts, metadata = decode_batch(body)  # (B, 3, H, W) or (B, F, 3, H, W) float32
        except WireFormatError as error:
            return JSONResponse({"error": f"bad request: {one_line(error)}"}, status_code=400)
        if info["group"] and len(set(prompts)) > 1:
            return JSONResponse({"error": f"reward {name!r} scores one prompt's group a request and this request holds {len(set(prompts))} "
                                          "prompts: a client that knows group rewards (branchdiff ≥ this server's version) sends each group whole"},
                                status_code=400)
        if len(prompts) > limits.max_images:
            return JSONResponse({"error": f"request too large: {len(prompts)} images, this server takes at most {limits.max_images} "
                                          "(--max-images); send fewer per request (kwargs: {chunk_size: N}; a group reward's group goes whole: "
                                          "raise --max-images)"},
                                status_code=413)
        try:
            scores = await asyncio.wrap_future(batcher.submit(_Request(images, prompts, metadata)))
        except Exception as error:
            return JSONResponse({"error": f"reward {name!r} failed: {type(error).__name__}: {one_line(error)}"}, status_code=500)
        return JSONResponse({"scores": scores})

    app = Starlette(routes=[Route("/health", health, methods=["GET"]), Route("/score", score, methods=["POST"])])
    app.state.batcher = batcher
    return app


def check_address(host: str, port: int) -> None:
    """Refuse, in one line, an address this machine cannot listen on (a port in use, a host not its
    own), before the reward loads: `serve` listens there once it has."""
    _listen(host, port).close()


def _listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: a free port), or a one-line ValueError."""
    try:
        return socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    except OSError as error:
        reason = os.strerror(error.errno) if isinstance(error.errno, int) and error.errno > 0 else error.strerror or error
        raise ValueError(f"reward server cannot listen on {host}:{port} ({reason}); give a --port nothing else listens on (or stop what "
                         "listens there) and a --host of this machine") from None


def _uvicorn_server(reward: object, log_level: str, limits: Limits, token: str | None):
    uvicorn = _require("uvicorn")
    app = create_app(reward, limits, token)
    server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, access_log=log_level in ("debug", "trace"), lifespan="off"))
    server.app = app
    return server


def serve(reward: object, host: str = "127.0.0.1", port: int = DEFAULT_PORT, log_level: str = "info", limits: Limits = Limits(),
          token: str | None = None) -> None:
    """Serve `reward` on http://host:port until Ctrl+C (blocking).

    Args:
        reward: any object following the reward protocol (`branchdiff/rewards/base.py`).
        host: the address to listen on; 127.0.0.1 (default) accepts only this machine. Any other
            address (0.0.0.0: every network the machine is on) needs a `token`.
        port: the TCP port; default `DEFAULT_PORT` (8765).
        log_level: uvicorn's log level; "debug" also logs every request.
        limits: request bounds and the batch size (`Limits`).
        token: the shared token every request must carry (`Authorization: Bearer <token>`).
    """
    check_host(host, token)
    server = _uvicorn_server(reward, log_level, limits, token)
    listener = _listen(host, port)
    shown = f"[{host}]" if ":" in host else host
    print(f"serving reward {health_info(reward)['name']!r} on http://{shown}:{listener.getsockname()[1]} (Ctrl+C to stop)", file=sys.stderr, flush=True)
    try:
        server.run(sockets=[listener])
    except KeyboardInterrupt:  # uvicorn shut down gracefully, then re-raised the Ctrl+C
        print("reward server stopped", file=sys.stderr, flush=True)
    finally:
        listener.close()


class BackgroundServer:
    """A reward server on a daemon thread of this process, for tests and notebooks:

        with BackgroundServer(reward) as server:   # port 0: a free port
            remote = RemoteReward(server.url)
    """

    def __init__(self, reward: object, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning", limits: Limits = Limits(),
                 token: str | None = None) -> None:
        self._server = _uvicorn_server(reward, log_level, limits, token)
        self.batcher: Batcher = self._server.app.state.batcher
        self._listener = _listen(host, port)
        self.port: int = self._listener.getsockname()[1]
        self.url = f"http://{f'[{host}]' if ':' in host else host}:{self.port}"
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._listener]}, name=f"reward-server-{self.port}", daemon=True)

    def start(self, timeout: float = 10.0) -> BackgroundServer:
        """Start serving; returns once the server accepts requests (or raises after `timeout` s)."""
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not self._server.started:
            self.stop()
            raise RuntimeError(f"reward server at {self.url} did not start within {timeout:g} s")
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop serving and wait for the thread to end; safe to call twice."""
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._listener.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()
