"""Every call to the Hugging Face Hub with a timeout, and a bounded retry where the library has none.

huggingface_hub makes every hub request of the process through one shared HTTP client: `push`, a
model or a reward's weights named by a hub id (diffusers and transformers load through it), HPDv2's
prompts. Its default client has no timeout, and the calls that give none (creating a repository, a
commit, a model's info) wait forever on a hub that accepts the connection and never answers.
`bound_hub_calls(timeout)` installs, through `huggingface_hub.set_client_factory`, the library's own
client (its offline switch and request ids kept) whose connect, send, read and pool waits each last
at most `timeout` seconds; a call that sets a shorter limit of its own (a file's metadata:
HF_HUB_ETAG_TIMEOUT, a download: HF_HUB_DOWNLOAD_TIMEOUT, 10 s each) keeps it. The CLI installs it
for every command (`HUB_TIMEOUT`; `push --timeout`).

huggingface_hub retries a file's metadata and download itself: on a hub that never answers, a file
fails after one wait of HF_HUB_ETAG_TIMEOUT, then 6 of 60 s (its metadata retry's limit, capped at
`timeout`) with 23 s between them: 6.5 minutes by default. `call_hub` gives the calls it does not
retry (creating a repository, an upload) `attempts` tries in all while the hub cannot be reached,
times out or answers 408, 429 or 5xx, then one line naming the hub's address and the fix. Files
stored with Xet move through hf_xet's own client, with its own timeouts and retries.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

from branchdiff.errors import UserError, one_line

HUB_TIMEOUT = 60.0  # seconds each connect, send, read or pool wait of a hub call may last
HUB_ATTEMPTS = 3  # tries of a call huggingface_hub does not retry itself
HUB_BACKOFF = 1.0  # seconds before the second try; doubled before each further one
RETRIED_STATUS = (408, 429, 500, 502, 503, 504)  # the answers huggingface_hub's own retries try again after

T = TypeVar("T")


def bound_hub_calls(timeout: float | None = None) -> None:
    """Give every request huggingface_hub makes from now on at most `timeout` seconds (default
    `HUB_TIMEOUT`) for each of its connect, send, read and pool waits (module doc)."""
    from huggingface_hub import set_client_factory
    from huggingface_hub.utils._http import default_client_factory  # the library's client: offline switch, request ids

    limit = HUB_TIMEOUT if timeout is None else timeout

    def bounded(request: Any) -> None:
        """A request's waits at most `limit` each: "no limit" (huggingface_hub passes timeout=None) and
        the 60 s of its metadata retry included."""
        waits = request.extensions.get("timeout", {})
        request.extensions = {**request.extensions, "timeout": {phase: limit if wait is None else min(wait, limit) for phase, wait in waits.items()}}

    def client() -> Any:
        made = default_client_factory()
        made.timeout = limit
        made.event_hooks = {**made.event_hooks, "request": [*made.event_hooks["request"], bounded]}
        return made

    set_client_factory(client)


def transport_errors() -> tuple[type[Exception], ...]:
    """The exceptions of huggingface_hub's HTTP client for a hub out of reach: refused, timed out, dropped."""
    import httpx2

    return (httpx2.TransportError,)


def hub_failure(error: Exception) -> str:
    """What a transport error says of the hub, in a few words: "the hub at URL did not answer within
    60 s" (the limit of the wait that ran out), "... is not reachable (Connection refused)"."""
    import httpx2
    from huggingface_hub import constants

    where = f"the hub at {constants.ENDPOINT}"
    if isinstance(error, httpx2.TimeoutException):
        phase = {httpx2.ConnectTimeout: "connect", httpx2.WriteTimeout: "write", httpx2.PoolTimeout: "pool"}.get(type(error), "read")
        try:
            wait = error.request.extensions.get("timeout", {}).get(phase)
        except RuntimeError:  # raised outside a request
            wait = None
        return f"{where} did not answer within {wait:g} s" if wait else f"{where} did not answer in time"
    if isinstance(error, httpx2.ConnectError):
        return f"{where} is not reachable ({_reason(error)})"
    return f"{where} dropped the connection ({type(error).__name__}: {_reason(error)})"


def call_hub(call: Callable[[], T], what: str, fix_for_time: str = "", attempts: int = HUB_ATTEMPTS, backoff: float = HUB_BACKOFF) -> T:
    """`call()`, a huggingface_hub call, tried up to `attempts` times while the hub cannot be reached,
    times out or answers 408, 429 or 5xx (try k + 1 waits `backoff · 2^(k-1)` s first). A hub still
    out of reach then is one UserError line: `what`, the hub's address, what happened and the fix (a
    timeout's ends with `fix_for_time`); its other answers (a refusal, the last 5xx) are raised as
    huggingface_hub raised them."""
    import httpx2
    from huggingface_hub.errors import HfHubHTTPError

    for attempt in range(1, attempts + 1):
        if attempt > 1:
            time.sleep(backoff * 2 ** (attempt - 2))
        try:
            return call()
        except transport_errors() as error:
            failure, fix = hub_failure(error), fix_for_time if isinstance(error, httpx2.TimeoutException) else ""
        except HfHubHTTPError as error:
            if error.response is None or error.response.status_code not in RETRIED_STATUS or attempt == attempts:
                raise
    tries = f"{attempts} attempt{'s' if attempts > 1 else ''}"
    raise UserError(f"{what}: {failure} ({tries}); check the network connection and HF_ENDPOINT (unset: https://huggingface.co), "
                    f"or try again later{fix}")


def _reason(error: Exception) -> str:
    """The last words of a transport error ("[Errno 111] Connection refused" → "Connection refused")."""
    return one_line(str(error).rpartition("] ")[2] or type(error).__name__, 160)
