"""Reward replicas (`reward: {remote: [URL1, URL2, ...]}`, branchdiff/rewards/replicas.py): scores equal to one
server's bit for bit, spread over the replicas with at most `in_flight` requests at each, a replica that is down or
dies mid-call left out with one notice while the others score its share, one line only when every replica is down,
a reward's own failure not retried elsewhere, replicas of different rewards refused, and training (overlapped too)
equal to one server's."""

from __future__ import annotations

import http.server
import json
import threading
import time

import pytest
import torch

from branchdiff.rewards.combine import parse_reward_specs
from branchdiff.rewards.multi import remote_client
from branchdiff.rewards.remote import RemoteReward, RemoteRewardError, decode_batch
from branchdiff.rewards.replicas import ReplicaReward
from branchdiff.rewards.server import BackgroundServer
from branchdiff.settings.load import load_config
from branchdiff.training.recipe import Trainer
from json_handler import JSONHandler  # tests/ is on sys.path
from rewards_for_tests import Redness

FAST = {"retries": 1, "backoff": 0.01, "timeout": 5.0}


class Checksum:
    """A model-free reward sensitive to every pixel, the prompt and the metadata; it counts the images it scored."""

    name = "checksum"
    scale = "weighted pixel sum"

    def __init__(self) -> None:
        self.weights = torch.rand(3, 8, 8, generator=torch.Generator().manual_seed(0))
        self.scored = 0

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        self.scored += len(prompts)
        return torch.stack([(image * self.weights).sum() + len(text) / 7 + meta.get("bonus", 0.0) for image, text, meta in zip(images, prompts, metadata)])


class Broken:
    """A reward that raises: the same on every replica, so not retried on another."""

    name = "checksum"
    scale = "weighted pixel sum"

    def __call__(self, images, prompts, metadata):
        raise ValueError("weights not found at /models/x.safetensors")


def batch(size: int = 11) -> tuple[torch.Tensor, list[str], list[dict]]:
    generator = torch.Generator().manual_seed(0)
    return torch.rand(size, 3, 8, 8, generator=generator), [f"prompt {i} " + "x" * i for i in range(size)], [{"bonus": 0.25 * i} for i in range(size)]


class Mimic(JSONHandler):
    """A replica whose /health is a real server's (`server.health`) and whose /score is slow (`server.delay`), counts the
    requests in flight (`server.most`), and answers each image's index, or drops the connection (`server.drop`)."""

    def do_GET(self) -> None:
        self.send_json(200, json.dumps(self.server.health).encode())

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        with self.server.lock:
            self.server.now += 1
            self.server.most = max(self.server.most, self.server.now)
        time.sleep(self.server.delay)
        with self.server.lock:
            self.server.now -= 1
        if self.server.drop:
            self.close_connection = True
            self.connection.shutdown(2)  # the replica died with the request in flight
            return
        _, prompts, metadata = decode_batch(body)
        self.send_json(200, json.dumps({"scores": [m["index"] for m in metadata]}).encode())


@pytest.fixture()
def mimic():
    with BackgroundServer(Checksum()) as real:
        health = RemoteReward(real.url, **FAST).health
    servers = []

    def start(delay: float = 0.0, drop: bool = False) -> tuple[http.server.ThreadingHTTPServer, str]:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Mimic)
        server.health, server.delay, server.drop, server.lock, server.now, server.most = health, delay, drop, threading.Lock(), 0, 0
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        servers.append(server)
        return server, f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def test_replicas_score_like_one_server_bit_for_bit_and_share_the_work():
    images, prompts, metadata = batch()
    first, second = Checksum(), Checksum()
    with BackgroundServer(first) as a, BackgroundServer(second) as b:
        one = RemoteReward(a.url, chunk_size=2, **FAST)(images, prompts, metadata)
        first.scored = 0
        replicas = ReplicaReward([a.url, b.url], chunk_size=2, **FAST)
        assert torch.equal(replicas(images, prompts, metadata), one)
        assert first.scored + second.scored == 11 and first.scored > 0 and second.scored > 0
        assert torch.equal(replicas(images[:1], prompts[:1], metadata[:1]), one[:1]) and replicas(images[:0], [], []).shape == (0,)
        assert (replicas.name, replicas.scale, replicas.video) == ("checksum", Checksum.scale, False)


def test_requests_in_flight_to_each_replica_are_bounded(mimic):
    (slow_a, url_a), (slow_b, url_b) = mimic(delay=0.1), mimic(delay=0.1)
    images, prompts, _ = batch(12)
    scores = ReplicaReward([url_a, url_b], in_flight=2, chunk_size=1, **FAST)(images, prompts, [{"index": i} for i in range(12)])
    assert scores.tolist() == list(range(12))  # back in order
    assert slow_a.most == 2 and slow_b.most == 2


def test_a_replica_down_from_the_start_or_dying_mid_call_is_left_out_once(mimic, capsys):
    images, prompts, metadata = batch()
    reward = Checksum()
    with BackgroundServer(reward) as live:
        expected = RemoteReward(live.url, chunk_size=2, **FAST)(images, prompts, metadata)
        dead = BackgroundServer(Checksum()).start()
        dead_url = dead.url
        dead.stop()
        replicas = ReplicaReward([dead_url, live.url], chunk_size=2, **FAST)
        notice = capsys.readouterr().err
        assert f"branchdiff: reward replica {dead_url} left out, the others score its share: reward server {dead_url}" in notice
        assert notice.count("\n") == 1 and torch.equal(replicas(images, prompts, metadata), expected)

        _, dying = mimic(delay=0.05, drop=True)  # answers /health, then drops every /score with the request in flight
        replicas = ReplicaReward([dying, live.url], chunk_size=2, **FAST)
        assert torch.equal(replicas(images, prompts, metadata), expected)  # its chunks went to the live replica
        notice = capsys.readouterr().err
        assert notice.count(f"reward replica {dying} left out") == 1 and notice.count("\n") == 1
        assert torch.equal(replicas(images, prompts, metadata), expected) and capsys.readouterr().err == ""  # not asked again


def test_every_replica_down_is_one_line_naming_each(mimic):
    (_, a), (_, b) = mimic(delay=0.01, drop=True), mimic(delay=0.01, drop=True)
    replicas = ReplicaReward([a, b], chunk_size=2, **FAST)
    with pytest.raises(RemoteRewardError) as error:
        replicas(*batch())
    message = str(error.value)
    assert "\n" not in message and message.startswith("every reward replica is down (2 of 2): ") and a in message and b in message
    with pytest.raises(RemoteRewardError, match=r"^every reward replica is down \(2 of 2\)"):
        replicas(*batch())  # the next call too, at once


def test_a_failing_reward_is_its_own_line_not_retried_elsewhere(capsys):
    with BackgroundServer(Broken()) as a, BackgroundServer(Broken()) as b:
        replicas = ReplicaReward([a.url, b.url], chunk_size=2, **FAST)
        with pytest.raises(RemoteRewardError, match=r"weights not found at /models/x.safetensors"):
            replicas(*batch())
        assert "left out" not in capsys.readouterr().err and replicas.down == {}


def test_replicas_of_different_rewards_and_bad_lists_are_refused():
    with BackgroundServer(Checksum()) as a, BackgroundServer(Redness()) as b:
        with pytest.raises(ValueError, match=r"serve different rewards \(name: 'checksum' and 'redness'.*give replicas of one reward"):
            ReplicaReward([a.url, b.url], **FAST)
    with pytest.raises(ValueError, match=r"in_flight=0 must be an integer ≥ 1"):
        ReplicaReward(["http://127.0.0.1:1"], in_flight=0)
    specs = parse_reward_specs({"remote": ["http://a:1", "http://b:1"], "kwargs": {"in_flight": 3}})
    assert specs[0].remote == ("http://a:1", "http://b:1") and specs[0].label == "http://a:1 (+1 replicas)"
    for bad in ([], ["http://a:1", "http://a:1"], ["http://a:1", 3]):
        with pytest.raises(ValueError, match=r"'remote' must be a server's URL or a list of distinct URLs of its replicas"):
            parse_reward_specs({"remote": bad})
    with pytest.raises(ValueError, match=r"chunk_sise"):
        remote_client(parse_reward_specs({"remote": ["http://a:1", "http://b:1"], "kwargs": {"chunk_sise": 2}})[0])


def _trainer(model_dir, out, reward: str) -> Trainer:
    return Trainer(load_config(None, [
        f"model.path={model_dir}", f"output_dir={out}", "iterations=1", "seed=3", f"reward={reward}", "sampling.exact=true",
        "prompts.per_iteration=3", "tree.roots=1", "tree.splits=[[0, 2], [1, 2]]", "sampling.num_steps=3", "sampling.max_batch=4",
        "train.minibatch=4", "model.finetune=lora", "train.learning_rate=1e-2", "final_eval=false", "logging.report_to=none", "reward_overlap=true"]))


class CountedRedness(Redness):
    """Redness that counts the images it scored."""

    def __init__(self) -> None:
        super().__init__()
        self.scored = 0

    def __call__(self, images, prompts, metadata):
        self.scored += len(prompts)
        return super().__call__(images, prompts, metadata)


def test_training_with_replicas_equals_one_server_with_overlapped_scoring(tiny_model_dir, tmp_path):
    second = CountedRedness()
    with BackgroundServer(Redness()) as a, BackgroundServer(second) as b:
        one = _trainer(tiny_model_dir, tmp_path / "one", f"{{remote: '{a.url}', kwargs: {{chunk_size: 2}}}}")
        two = _trainer(tiny_model_dir, tmp_path / "two", f"{{remote: ['{a.url}', '{b.url}'], kwargs: {{chunk_size: 2}}}}")
        x, y = one.run_iteration(0), two.run_iteration(0)
    assert torch.equal(x.leaf_images, y.leaf_images) and torch.equal(x.node_rewards, y.node_rewards) and x.metrics["loss"] == y.metrics["loss"]
    assert second.scored > 0  # the second replica scored a share
    weights = lambda t: {k: v for k, v in t.adapter.denoiser.named_parameters() if "lora_" in k}  # noqa: E731
    assert all(torch.equal(weights(one)[k], weights(two)[k]) for k in weights(one))


class SlowChecksum(Checksum):
    """Checksum taking 0.2 s a call: requests that overlap in time."""

    def __call__(self, images, prompts, metadata):
        time.sleep(0.2)
        return super().__call__(images, prompts, metadata)


def test_calls_at_once_go_to_the_least_busy_replicas():
    """Overlapped scoring makes one-request calls two at a time: each pair must reach both replicas, not wait on one
    (in_flight 2 would allow both at one; regression: a shared queue taken by whichever worker came first)."""
    from branchdiff.runtime.threads import DaemonPool

    first, second = SlowChecksum(), SlowChecksum()
    images, prompts, metadata = batch(4)  # one request a call (chunk_size 16)
    with BackgroundServer(first) as a, BackgroundServer(second) as b:
        reward = ReplicaReward([a.url, b.url], in_flight=2, **FAST)
        for calls in range(1, 4):
            with DaemonPool(2, "caller") as pool:
                pool.map(lambda _: reward(images, prompts, metadata), range(2))
            assert first.scored == second.scored == 4 * calls


class SlowGroupRank:
    """A group reward taking 0.2 s a group: each image's rank of redness in its group; it counts the groups it scored."""

    name = "slow-group-rank"
    scale = "rank"

    def __init__(self) -> None:
        self.groups = 0

    def score_group(self, images, prompts, metadata):
        time.sleep(0.2)
        self.groups += 1
        return Redness()(images, prompts).argsort().argsort().float()


def test_urls_are_compared_as_the_client_reads_them_and_a_group_reward_scores_groups_on_every_replica():
    """A trailing slash is the same server (refused twice; one given with it still works), `parallel_calls` counts the
    live replicas (one found down at the start left out), and a group reward's groups go to the replicas at once."""
    from branchdiff.rewards.group import score_by_group

    first, second = SlowGroupRank(), SlowGroupRank()
    images, prompts, _ = batch(8)
    prompts = [f"group {i // 2}" for i in range(8)]  # four groups of two
    with BackgroundServer(first) as a, BackgroundServer(second) as b:
        with pytest.raises(ValueError, match="give a list of distinct server URLs"):
            ReplicaReward([a.url, a.url + "/"], **FAST)
        reward = ReplicaReward([a.url + "/", b.url, "http://127.0.0.1:9"], **FAST)
        assert reward.parallel_calls == 2 and hasattr(reward, "score_group")
        scores = score_by_group(reward, reward.name, images, prompts, [{} for _ in prompts], None)
        alone = RemoteReward(a.url, **FAST)
        expected = score_by_group(alone, alone.name, images, prompts, [{} for _ in prompts], None)
    assert torch.equal(scores, expected)
    assert first.groups - 4 == 2 and second.groups == 2  # the four groups shared out (then four more on the first alone)


def test_a_replica_left_out_is_said_on_a_line_of_its_own_above_the_progress_bar(capsys):
    """The notice was printed onto the training bar's line: it is written above the bar, which is drawn again below it."""
    import sys

    from tqdm.auto import tqdm

    with BackgroundServer(Checksum()) as live:
        dead = BackgroundServer(Checksum()).start()
        dead_url = dead.url
        dead.stop()
        with tqdm(total=5, desc="train", file=sys.stderr) as bar:
            bar.update(2)
            ReplicaReward([dead_url, live.url], chunk_size=2, **FAST)
    said = capsys.readouterr().err
    notice = said.index(f"branchdiff: reward replica {dead_url} left out")
    assert said[notice - 1] in "\r\n", repr(said)
