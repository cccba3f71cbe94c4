"""Serve any reward over HTTP, so a reward with heavy or conflicting dependencies (or its own GPU)
lives in its own environment or machine: `branchdiff serve-reward NAME` runs
`serve(build_reward(NAME, device), host, port)`, and training or evaluation use it as
`reward: {remote: http://host:port}` (`branchdiff/rewards/remote.py`, docs/reward-server.md).

Endpoints:
- `GET /health`: 200 and `{"status": "ok", "name", "scale", "higher_is_better", "video", "device",
  "branchdiff_version", "wire", "formats"}` (`video`: the reward scores videos (B, F, 3, H, W) whole);
- `POST /score`: a batch in the wire format of `branchdiff/rewards/remote.py`, answered `{"scores": [B]}`
  (float32 values, a non-finite score as null), or `{"error": "one line"}` with status 400 for a
  malformed request and 500 when the reward raises or returns the wrong shape.

The reward runs in a worker thread (the event loop keeps answering /health), one batch at a time
(a lock: models are rarely thread-safe), under `torch.inference_mode`, on images moved to its
`device` (videos stay whole). Built on Starlette and uvicorn, the optional extra `serve`, imported only here. The
server has no authentication: it listens on 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import importlib
import logging
import math
import socket
import sys
import threading
import time
from importlib.metadata import PackageNotFoundError, version

import torch

from branchdiff.errors import one_line
from branchdiff.rewards.base import check_scores
from branchdiff.rewards.remote import IMAGE_FORMATS, WIRE_VERSION, WireFormatError, decode_batch

DEFAULT_PORT = 8765  # `branchdiff serve-reward` and docs/reward-server.md use it too
logger = logging.getLogger(__name__)


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
        "device": str(getattr(reward, "device", "cpu")),
        "branchdiff_version": branchdiff_version,
        "wire": WIRE_VERSION,
        "formats": list(IMAGE_FORMATS),
    }


def create_app(reward: object):
    """A Starlette application serving `reward` on `/health` and `/score` (run it with any ASGI
    server; `serve` and `BackgroundServer` use uvicorn)."""
    _require("starlette")
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    info = health_info(reward)
    name = info["name"]
    device = getattr(reward, "device", None) or "cpu"
    lock = threading.Lock()

    def score_body(body: bytes) -> list[float | None]:
        images, prompts, metadata = decode_batch(body)  # (B, 3, H, W) or (B, F, 3, H, W) float32
        with lock, torch.inference_mode():  # grad mode is per thread: set it in the worker
            scores = reward(images.to(device), prompts, metadata)
            scores = check_scores(scores, len(prompts), name)  # (B,) float32 on the CPU
        return [value if math.isfinite(value) else None for value in scores.tolist()]

    async def health(request):
        return JSONResponse(info)

    async def score(request):
        body = await request.body()
        try:
            scores = await run_in_threadpool(score_body, body)
        except WireFormatError as error:
            return JSONResponse({"error": f"bad request: {one_line(error)}"}, status_code=400)
        except Exception as error:  # the reward is user code: report any failure to the client
            logger.exception("reward %r failed on a batch", name)
            return JSONResponse({"error": f"reward {name!r} failed: {type(error).__name__}: {one_line(error)}"}, status_code=500)
        return JSONResponse({"scores": scores})

    return Starlette(routes=[Route("/health", health, methods=["GET"]), Route("/score", score, methods=["POST"])])


def _listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: a free port), or a one-line ValueError."""
    try:
        return socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    except OSError as error:
        raise ValueError(f"reward server cannot listen on {host}:{port}: {error.strerror or error}") from None


def _uvicorn_server(reward: object, log_level: str):
    uvicorn = _require("uvicorn")
    app = create_app(reward)
    return uvicorn.Server(uvicorn.Config(app, log_level=log_level, access_log=log_level in ("debug", "trace"), lifespan="off"))


def serve(reward: object, host: str = "127.0.0.1", port: int = DEFAULT_PORT, log_level: str = "info") -> None:
    """Serve `reward` on http://host:port until Ctrl+C (blocking).

    Args:
        reward: any object following the reward protocol (`branchdiff/rewards/base.py`).
        host: the address to listen on; 127.0.0.1 (default) accepts only this machine, 0.0.0.0
            every network the machine is on (the server has no authentication).
        port: the TCP port; default `DEFAULT_PORT` (8765).
        log_level: uvicorn's log level; "debug" also logs every request.
    """
    server = _uvicorn_server(reward, log_level)
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

    def __init__(self, reward: object, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning") -> None:
        self._server = _uvicorn_server(reward, log_level)
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
