"""`branchdiff bench reward-server`: a bounded load test of a reward server on the loopback. Several
clients (`RemoteReward`, one thread each) send requests for a fixed time; every image carries its
client, request and position in three pixels, and the served reward (`Echo`) answers that identity
as its score after a fixed amount of real work (a convolution over the batch, so batching has
something to amortise). Every answer is checked against its request: nothing lost, nothing
mis-ordered. Run side by side with requests batched (`max_batch`) and one at a time (`max_batch`
1): images per second and p50 / p99 latency (docs/reward-server.md).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import torch

from branchdiff.bench.tables import write_json
from branchdiff.rewards.remote import RemoteReward, RemoteRewardError
from branchdiff.rewards.server import BackgroundServer, Limits


class Echo:
    """Scores an image by the identity its first three pixels hold (client·65536 + request·256 + index,
    each a uint8 level of the red channel), after a 3×3 convolution of 16 channels over the whole batch."""

    name = "echo"
    scale = "identity"
    higher_is_better = True
    device = "cpu"

    def __init__(self) -> None:
        self.work = torch.nn.Conv2d(3, 16, 3, padding=1)

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        self.work(images).sum()  # the model's cost, batch-amortised like a real network's
        levels = (images[:, 0, 0, :3] * 255).round()  # (B, 3)
        return levels[:, 0] * 65536 + levels[:, 1] * 256 + levels[:, 2]


def _images(client: int, request: int, count: int, size: int) -> tuple[torch.Tensor, list[float]]:
    images = torch.full((count, 3, size, size), 0.5)
    identities = []
    for i in range(count):
        levels = (client % 256, request % 256, i % 256)
        images[i, 0, 0, :3] = torch.tensor(levels, dtype=torch.float32) / 255
        identities.append(float(levels[0] * 65536 + levels[1] * 256 + levels[2]))
    return images, identities


def load_test(url: str, clients: int = 8, seconds: float = 3.0, images_per_request: int = 4, size: int = 64,
              token_file: str | None = None) -> dict:
    """`clients` threads sending requests of `images_per_request` images to `url` for `seconds`; every
    answer compared with the identities its images carry."""
    latencies: list[float] = []
    counts = {"requests": 0, "images": 0, "mismatched": 0, "failed": 0}
    lock = threading.Lock()
    deadline = time.monotonic() + seconds

    def client(index: int) -> None:
        remote = RemoteReward(url, retries=0, chunk_size=images_per_request, token_file=token_file)
        request = 0
        while time.monotonic() < deadline:
            images, expected = _images(index, request, images_per_request, size)
            start = time.perf_counter()
            try:
                scores = remote(images, ["x"] * images_per_request, None).tolist()
            except RemoteRewardError:
                with lock:
                    counts["failed"] += 1
                continue
            elapsed = time.perf_counter() - start
            with lock:
                latencies.append(elapsed)
                counts["requests"] += 1
                counts["images"] += images_per_request
                counts["mismatched"] += scores != expected
            request += 1

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - start
    ordered = sorted(latencies)
    quantile = lambda q: 1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")
    return {**counts, "clients": clients, "seconds": wall, "images_per_second": counts["images"] / wall, "p50_ms": quantile(0.5),
            "p99_ms": quantile(0.99)}


def bench_reward_server(json_path: Path | None, clients: int = 8, seconds: float = 5.0, images_per_request: int = 4) -> dict:
    """The load test against a server batching up to 64 images, then one that scores one request at a time."""
    rows = {}
    for label, max_batch in (("batched (max_batch 64)", 64), ("one request at a time (max_batch 1)", 1)):
        with BackgroundServer(Echo(), limits=Limits(max_batch=max_batch)) as server:
            row = load_test(server.url, clients, seconds, images_per_request)
            row["reward_calls"] = server.batcher.calls
            rows[label] = row
    print(f"reward server load test: {clients} clients × {images_per_request} images of 64×64 per request, {seconds:g} s each, loopback")
    print(f"{'server':<38}{'requests':>10}{'images/s':>10}{'p50 ms':>9}{'p99 ms':>9}{'calls':>8}{'lost':>6}{'wrong':>7}")
    for label, row in rows.items():
        print(f"{label:<38}{row['requests']:>10}{row['images_per_second']:>10.0f}{row['p50_ms']:>9.1f}{row['p99_ms']:>9.1f}"
              f"{row['reward_calls']:>8}{row['failed']:>6}{row['mismatched']:>7}")
    batched, single = rows.values()
    print(f"batched ÷ one at a time, images per second: {batched['images_per_second'] / single['images_per_second']:.2f}")
    if json_path:
        write_json(json_path, rows)
    return rows
