"""A reward scored by a reward server over HTTP (`branchdiff serve-reward`), and the wire format.

`RemoteReward(url)` follows the reward protocol of `branchdiff/rewards/base.py`: its `name`, `scale`,
`higher_is_better` and `video` are those the server reports on `GET /health`; a call sends the images
(or, to a reward of videos, the videos), prompts and metadata to `POST /score` in chunks of at most
`chunk_size` of them and returns the scores (B,) as float32 on the CPU. It uses only the standard library for HTTP (urllib), so a training
environment needs no server package. docs/reward-server.md documents the wire format:

    request body  = one line of JSON (the header, no newline inside) + b"\\n" + the image payload
    header        = {"format": "uint8" | "float32" | "png", "shape": [B, 3, H, W] or, videos, [B, F, 3, H, W],
                     "prompts": [B strings], "metadata": [B objects], "png_sizes": [N ints] (png)}
    payload       = uint8:   the shape's values as bytes, C order, pixel = round(255·clamp(x, 0, 1))
                    float32: the shape's values as little-endian float32, C order (exact)
                    png:     N = B (images) or B·F (videos, frame by frame) 8-bit RGB PNG files back
                             to back, their lengths in "png_sizes"
    response      = {"scores": [B numbers]} (float32 values; a non-finite score is null), or
                    {"error": "one line"} with status 400 (bad request) or 500 (the reward failed)

uint8 and PNG carry `quantize(images) = from_uint8(to_uint8(images))`: the server decodes them
with `from_uint8`, so remote scores equal in-process scores of `quantize(images)` bit for bit.
"""

from __future__ import annotations

import http.client
import io
import json
import math
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import torch

from branchdiff.errors import one_line
from branchdiff.rewards.base import to_uint8

WIRE_VERSION = 1  # bumped when the format changes; /health reports it and the client checks it
IMAGE_FORMATS = ("uint8", "float32", "png")
CONTENT_TYPE = "application/x-branchdiff-batch"
_ITEM_BYTES = {"uint8": 1, "float32": 4}


class RemoteRewardError(RuntimeError):
    """The reward server is unreachable or answered an error; the message is one line naming its URL. `transport`: the
    server did not answer (unreachable, a stall, a dropped connection, busy past the retries), as opposed to an answer
    saying the request or the reward failed: a replica that did not answer is left out (branchdiff/rewards/replicas.py)."""

    def __init__(self, message: str, transport: bool = False) -> None:
        super().__init__(message)
        self.transport = transport


class WireFormatError(ValueError):
    """A request body that does not follow the wire format (the server answers 400)."""


# ---------------------------------------------------------------------------------------------
# Quantisation: shared by the client (encoding) and the server (decoding), hence bit-exact.


def from_uint8(pixels: torch.Tensor) -> torch.Tensor:
    """float32 in [0, 1]: `pixels / 255`, the exact float32 division."""
    return pixels.to(torch.float32) / 255


def quantize(images: torch.Tensor) -> torch.Tensor:
    """The float32 images (B, 3, H, W) or videos (B, F, 3, H, W) a server scores when they are sent as uint8 or PNG."""
    return from_uint8(to_uint8(images))


# ---------------------------------------------------------------------------------------------
# Request body: encode (client) and decode (server).


def encode_batch(images: torch.Tensor, prompts: list[str], metadata: list[dict], image_format: str = "uint8") -> bytes:
    """The body of a `POST /score` request for images (B, 3, H, W) or videos (B, F, 3, H, W) in [0, 1]."""
    if image_format not in IMAGE_FORMATS:
        raise ValueError(f"image_format {image_format!r} is not one of {', '.join(IMAGE_FORMATS)}")
    header = {"format": image_format, "shape": list(images.shape), "prompts": list(prompts), "metadata": list(metadata)}
    if image_format == "float32":
        payload = images.detach().to("cpu", torch.float32).contiguous().numpy().astype("<f4", copy=False).tobytes()
    elif image_format == "uint8":
        payload = to_uint8(images).numpy().tobytes()
    else:
        pngs = [encode_png(image) for image in to_uint8(images).reshape(-1, *images.shape[-3:])]  # (N, 3, H, W): images or frames
        header["png_sizes"] = [len(png) for png in pngs]
        payload = b"".join(pngs)
    try:
        line = json.dumps(header, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError) as error:
        raise ValueError(f"prompts and metadata must be JSON (strings, numbers, lists, dicts) to reach a reward server: {error}") from None
    return line.encode("utf-8") + b"\n" + payload


def decode_batch(body: bytes) -> tuple[torch.Tensor, list[str], list[dict]]:
    """(images float32 (B, 3, H, W) or videos (B, F, 3, H, W) in [0, 1], prompts, metadata) of a request
    body; a malformed body raises `WireFormatError` with one line saying what is wrong."""
    newline = body.find(b"\n")
    if newline < 0:
        raise WireFormatError("the body must be one line of JSON (the header), a newline, then the image bytes")
    try:
        header = json.loads(body[:newline])
    except ValueError as error:
        raise WireFormatError(f"the header line is not JSON: {error}") from None
    if not isinstance(header, dict):
        raise WireFormatError("the header line must be a JSON object")
    payload = memoryview(body)[newline + 1 :]
    image_format, shape = header.get("format"), header.get("shape")
    prompts, metadata = header.get("prompts"), header.get("metadata")
    if image_format not in IMAGE_FORMATS:
        raise WireFormatError(f"header 'format' is {image_format!r}; allowed: {', '.join(IMAGE_FORMATS)}")
    if not (isinstance(shape, list) and len(shape) in (4, 5) and all(type(n) is int and n >= 0 for n in shape) and shape[-3] == 3):
        raise WireFormatError(f"header 'shape' is {shape!r}; expected [B, 3, H, W] (images) or [B, F, 3, H, W] (videos) of non-negative integers")
    batch = shape[0]
    if not (isinstance(prompts, list) and len(prompts) == batch and all(isinstance(p, str) for p in prompts)):
        raise WireFormatError(f"header 'prompts' must be a list of {batch} strings (one per image)")
    if not (isinstance(metadata, list) and len(metadata) == batch and all(isinstance(m, dict) for m in metadata)):
        raise WireFormatError(f"header 'metadata' must be a list of {batch} objects (one per image, {{}} for none)")
    if image_format == "png":
        pixels = _decode_pngs(payload, header.get("png_sizes"), shape)
    else:
        expected = math.prod(shape) * _ITEM_BYTES[image_format]
        if len(payload) != expected:
            raise WireFormatError(f"{image_format} payload of shape {shape} must be {expected} bytes; got {len(payload)}")
        if image_format == "float32":
            array = np.frombuffer(payload, dtype="<f4").reshape(shape).astype(np.float32)  # a native-order copy
            return torch.from_numpy(array), prompts, metadata
        pixels = torch.from_numpy(np.frombuffer(payload, dtype=np.uint8).reshape(shape).copy())
    return from_uint8(pixels), prompts, metadata


def encode_png(pixels: torch.Tensor) -> bytes:
    """One lossless 8-bit RGB PNG of uint8 pixels (3, H, W)."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(pixels.permute(1, 2, 0).contiguous().numpy()).save(buffer, format="PNG", compress_level=1)
    return buffer.getvalue()


def _decode_pngs(payload: memoryview, sizes: object, shape: list[int]) -> torch.Tensor:
    """uint8 `shape` ((B, 3, H, W), or (B, F, 3, H, W) frame by frame) of its N images' PNG files back to
    back in `payload`, with byte lengths `sizes`."""
    from PIL import Image

    count, (height, width) = math.prod(shape[:-3]), shape[-2:]
    if not (isinstance(sizes, list) and len(sizes) == count and all(type(n) is int and n > 0 for n in sizes)):
        raise WireFormatError(f"header 'png_sizes' must be a list of {count} positive integers (each PNG's length in bytes)")
    if sum(sizes) != len(payload):
        raise WireFormatError(f"'png_sizes' add up to {sum(sizes)} bytes but the payload has {len(payload)}")
    images, start = [], 0
    for index, size in enumerate(sizes):
        try:
            image = Image.open(io.BytesIO(payload[start : start + size]), formats=["PNG"])
            image.load()
        except Exception as error:  # PIL raises several types for a corrupt file
            raise WireFormatError(f"image {index} is not a readable PNG: {one_line(error)}") from None
        if image.mode != "RGB" or image.size != (width, height):
            raise WireFormatError(f"image {index} is a {image.mode} PNG of {image.size[0]}x{image.size[1]}; expected 8-bit RGB of {width}x{height}")
        images.append(torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1))  # (3, H, W)
        start += size
    return torch.stack(images).view(shape) if images else torch.zeros(shape, dtype=torch.uint8)


# ---------------------------------------------------------------------------------------------
# The client.


RETRIED_STATUS = (502, 503, 504)  # busy or restarting: worth another attempt


def read_token(path: str | Path) -> str:
    """The shared token in a file (its first word: surrounding whitespace and a newline are not part of it), or a one-line ValueError."""
    try:
        words = Path(path).read_text().split()
    except OSError as error:
        raise ValueError(f"token file {path}: cannot be read ({error.strerror or error})") from None
    token = words[0] if words else ""
    if len(token) < 16:
        raise ValueError(f"token file {path}: holds no token of 16 characters or more; write one, e.g. python -c 'import secrets; "
                         f"print(secrets.token_urlsafe(32))' > {path}")
    return token



class RemoteReward:
    """A reward served by `branchdiff serve-reward` at `url`, e.g. `http://127.0.0.1:8765`.

    Args:
        url: the server's base URL (http or https); `/health` and `/score` are appended.
        timeout: seconds to wait on each network operation (connect, send, each read) before the
            attempt counts as failed. Default 120: a large model on a CPU can be slow.
        retries: further attempts after a connection error, a timeout or a 502/503/504 answer (a
            gateway or server that is busy or restarting); a 4xx or a 500 (the reward itself
            failed, which would fail again) is not retried. Attempt k waits `backoff · 2^(k-1)`
            seconds first. Default 3.
        backoff: seconds before the first retry. Default 1.0.
        image_format: "uint8" (default: 1 byte a value; the server scores `quantize(images)`),
            "float32" (exact, 4 bytes a value) or "png" (lossless 8-bit, smallest for flat images).
        chunk_size: most images (videos) in one request; a larger batch is sent in order in several. A
            group reward's server (one that scores a prompt's group at once) gets each group whole.
        token_file: a file holding the server's shared token (`serve-reward --token-file`), sent as
            `Authorization: Bearer <token>` with every request.

    The server's `/health` is read once here (with the same retries), so a server that is down or
    is not a reward server fails at build time, not at the first batch. Requests go directly to
    the server (HTTP_PROXY and friends are ignored).
    """

    device = torch.device("cpu")  # where the scores are returned; the model runs on the server

    def __init__(self, url: str, timeout: float = 120.0, retries: int = 3, backoff: float = 1.0, image_format: str = "uint8", chunk_size: int = 16,
                 token_file: str | None = None) -> None:
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"remote reward URL {url!r} must start with http:// or https:// (e.g. http://127.0.0.1:8765)")
        if image_format not in IMAGE_FORMATS:
            raise ValueError(f"remote reward image_format {image_format!r} is not one of {', '.join(IMAGE_FORMATS)}")
        if not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(f"remote reward timeout={timeout!r} must be a number of seconds > 0")
        if not (isinstance(backoff, (int, float)) and backoff >= 0):
            raise ValueError(f"remote reward backoff={backoff!r} must be a number of seconds >= 0")
        if not (isinstance(retries, int) and retries >= 0):
            raise ValueError(f"remote reward retries={retries!r} must be an integer >= 0")
        if not (isinstance(chunk_size, int) and chunk_size >= 1):
            raise ValueError(f"remote reward chunk_size={chunk_size!r} must be an integer >= 1")
        self.url = url.rstrip("/")
        self.timeout, self.retries, self.backoff = float(timeout), retries, float(backoff)
        self.image_format, self.chunk_size = image_format, chunk_size
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        self._auth = {}
        if token_file is not None:
            self._auth = {"Authorization": f"Bearer {read_token(token_file)}"}
        health = self._request("/health")
        if not isinstance(health, dict) or health.get("wire") != WIRE_VERSION or "name" not in health:
            raise RemoteRewardError(f"reward server {self.url}/health answered {one_line(health, 200)}, which does not describe a branchdiff "
                                    f"reward server of wire format {WIRE_VERSION}")
        self.health = health  # everything the server reported (branchdiff_version, device, ...)
        self.name = str(health["name"])
        self.scale = str(health.get("scale", "unspecified"))
        self.higher_is_better = bool(health.get("higher_is_better", True))
        self.video = bool(health.get("video", False))  # the served reward scores videos whole (B, F, 3, H, W)
        if health.get("group", False):  # the served reward scores a prompt's group at once (branchdiff/rewards/group.py)
            self.score_group = self._score_group

    def __repr__(self) -> str:
        return f"RemoteReward({self.url!r}, name={self.name!r}, image_format={self.image_format!r})"

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict] | dict | None = None) -> torch.Tensor:
        """Scores (B,) float32 on the CPU for images (B, 3, H, W), or for a reward of videos videos (B, F, 3, H, W), in [0, 1]."""
        batch = len(prompts)
        expected = f"({batch}, F, 3, H, W): the served reward {self.name!r} scores videos" if self.video else f"({batch}, 3, H, W)"
        if images.dim() != (5 if self.video else 4) or images.shape[0] != batch or images.shape[-3] != 3:
            raise ValueError(f"remote reward {self.url}: input of shape {tuple(images.shape)} for {batch} prompts; expected {expected}")
        if not metadata:  # None or {}: no metadata for any image
            metadata = [{} for _ in range(batch)]
        if not isinstance(metadata, list) or len(metadata) != batch:
            raise ValueError(f"remote reward {self.url}: metadata must be a list of {batch} dicts, one per image")
        chunks = []
        for start in range(0, batch, self.chunk_size):
            stop = min(start + self.chunk_size, batch)
            body = encode_batch(images[start:stop], prompts[start:stop], metadata[start:stop], self.image_format)
            chunks.append(self._scores(self._request("/score", body), stop - start))
        return torch.cat(chunks) if chunks else torch.zeros(0)

    def _score_group(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        """Scores (G,) of one group, sent whole in one request whatever `chunk_size` (the server scores each request as one group)."""
        body = encode_batch(images, prompts, metadata or [{} for _ in prompts], self.image_format)
        return self._scores(self._request("/score", body), len(prompts))

    def _scores(self, reply: object, expected: int) -> torch.Tensor:
        """The float32 scores (n,) of a /score reply, or one line naming the URL and what is wrong."""
        scores = reply.get("scores") if isinstance(reply, dict) else None
        if not isinstance(scores, list) or len(scores) != expected:
            got = f"{len(scores)} scores" if isinstance(scores, list) else one_line(reply, 200)
            raise RemoteRewardError(f"reward server {self.url}/score sent {got} for {expected} images; expected {{\"scores\": [{expected} numbers]}}")
        bad = [i for i, s in enumerate(scores) if s is not None and (isinstance(s, bool) or not isinstance(s, (int, float)))]
        if bad:
            raise RemoteRewardError(f"reward server {self.url}/score sent non-numeric scores for images {bad[:10]} of {expected}")
        # a non-finite score travels as null and comes back as NaN: the caller counts it, as for a local reward
        values = [math.nan if s is None else s for s in scores]
        return torch.tensor(values, dtype=torch.float64).to(torch.float32)  # float32 → JSON → float64 is exact

    def _request(self, path: str, body: bytes | None = None) -> object:
        """The JSON reply to GET (body None) or POST `path`, with bounded retries and backoff."""
        headers = {"Accept": "application/json", **self._auth, **({} if body is None else {"Content-Type": CONTENT_TYPE})}
        return request_json(self.url + path, body, headers, self.timeout, self.retries, self.backoff, "reward server",
                            unreachable_hint="; is `branchdiff serve-reward` running there?", retried=RETRIED_STATUS, opener=self._opener)


def one_server_twice(urls: list[str]) -> tuple[str, str] | None:
    """The first two of `urls` that reach the same server (None when none do): the same scheme, port and path, and host
    names that resolve to a shared address (`localhost` and `127.0.0.1`); a name that does not resolve is compared as written."""
    import urllib.parse

    def place(url: str) -> tuple[str, int | None, str, set[str]]:
        parts = urllib.parse.urlsplit(url.rstrip("/"))
        port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
        host = parts.hostname or ""
        try:
            addresses = {info[4][0] for info in socket.getaddrinfo(host, port, proto=socket.IPPROTO_TCP)}
        except (OSError, UnicodeError):
            addresses = {host}
        return parts.scheme, port, parts.path, addresses

    places = [place(url) for url in urls]
    for j, (scheme, port, path, addresses) in enumerate(places):
        for i in range(j):
            if places[i][:3] == (scheme, port, path) and places[i][3] & addresses:
                return urls[i], urls[j]
    return None


def request_json(url: str, body: bytes | None, headers: dict[str, str], timeout: float, retries: int, backoff: float, who: str,
                 unreachable_hint: str = "", retried: tuple[int, ...] = (429, *RETRIED_STATUS),
                 opener: urllib.request.OpenerDirector | None = None, hints: dict[int, str] | None = None) -> object:
    """The JSON reply to a GET (`body` None) or POST of `body` to `url`, tried `retries` more times after a connection
    error, a timeout or a `retried` status (attempt k first waits `backoff · 2^(k−1)` s); any other HTTP error, an
    answer that is not JSON or the last failure is a one-line `RemoteRewardError` starting "`who` `url`", ending with
    `hints[status]` for an HTTP error of that status. Proxies (HTTP_PROXY and friends) are ignored unless `opener` says otherwise."""
    opener = opener or urllib.request.build_opener(urllib.request.ProxyHandler({}))
    failure = unreachable = None
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(backoff * 2 ** (attempt - 1))
        request = urllib.request.Request(url, data=body, headers=headers, method="GET" if body is None else "POST")
        unreachable = False
        try:
            with opener.open(request, timeout=timeout) as response:
                raw = response.read()
        except urllib.error.HTTPError as error:
            failure = f"answered HTTP {error.code}: {_error_message(error)}"
            if error.code not in retried:
                raise RemoteRewardError(f"{who} {url} {failure}{(hints or {}).get(error.code, '')}") from None
        except TimeoutError:
            failure = f"did not answer within {timeout:g} s"
        except urllib.error.URLError as error:
            reason = error.reason
            unreachable = not isinstance(reason, (TimeoutError, socket.timeout))
            failure = (f"is not reachable ({one_line(getattr(reason, 'strerror', None) or reason)})" if unreachable
                       else f"did not answer within {timeout:g} s")
        except (OSError, http.client.HTTPException) as error:  # reset, closed mid-reply, ...
            failure = f"dropped the connection ({type(error).__name__}: {one_line(error)})"
        else:
            try:
                return json.loads(raw)
            except ValueError:
                raise RemoteRewardError(f"{who} {url} answered something that is not JSON: {one_line(raw[:200])}") from None
    attempts = f"{retries + 1} attempt{'s' if retries else ''}"
    raise RemoteRewardError(f"{who} {url} {failure} ({attempts}){unreachable_hint if unreachable else ''}", transport=True)


def _error_message(error: urllib.error.HTTPError) -> str:
    """The server's `{"error": ...}` message of an HTTP error, else the start of its body."""
    try:
        raw = error.read()
    except (OSError, http.client.HTTPException):
        return error.reason or "no message"
    try:
        message = json.loads(raw).get("error")
    except (ValueError, AttributeError):
        message = None
    return one_line(message if message else raw[:200].decode("utf-8", "replace") or error.reason)
