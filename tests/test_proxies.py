"""The hackable proxies of the built-in tasks: the hand-made partial proxy (some of the verifier's terms), the learned
proxies and their ensembles (reductions against their formulas), and `bench proxies`, which fits them and measures their
accuracy (its pair accuracy hand-computed)."""

import json

import numpy as np
import pytest
import torch

from branchdiff.data import tiny_task, tiny_video_task
from branchdiff.rewards.combine import parse_reward_specs
from branchdiff.rewards.learned_proxy import LearnedProxy, ProxyNet, prompt_features, reduce_ensemble, save_proxy
from branchdiff.rewards.multi import build_component
from branchdiff.rewards.partial_proxy import PartialProxy
from branchdiff.rewards.tiny_geneval import TinyGenEval
from branchdiff.rewards.tiny_video import TinyVideoVerifier


def _images(texts: list[str]) -> torch.Tensor:
    return torch.from_numpy(tiny_task.render_batch([tiny_task.parse_prompt(t) for t in texts], seed=3))


def test_every_term_is_the_verifiers_partial_and_some_terms_can_be_won_without_the_rest():
    """All four terms give the verifier's partial exactly, on ground truth and on noise. Two red squares on the right, asked
    for two red circles on the left: count and colour are right (proxy 1), shape and position wrong (partial 0.5, strict 0)."""
    prompts = ["two red circles on the left", "one blue square at the top", "three green triangles at the bottom"]
    images = torch.cat([_images(prompts), torch.rand(3, 3, 32, 32, generator=torch.Generator().manual_seed(0))])
    verifier = TinyGenEval()
    everything = PartialProxy("tiny-geneval", ["count", "color", "shape", "position"])
    assert torch.equal(everything(images, prompts * 2), verifier.score(images, prompts * 2)["partial"])
    wrong = _images(["two red squares on the right"])
    asked = ["two red circles on the left"]
    assert float(PartialProxy("tiny-geneval", ["count", "color"])(wrong, asked)) == 1.0
    scores = verifier.score(wrong, asked)
    assert float(scores["partial"]) == 0.5 and float(scores["strict"]) == 0.0


def test_on_clips_a_still_object_wins_the_proxy_without_the_motion():
    prompts = ["one red circle moving left", "two blue squares moving down"]
    clips = torch.from_numpy(tiny_video_task.render_batch([tiny_video_task.parse_prompt(t) for t in prompts], seed=1))
    verifier, proxy = TinyVideoVerifier(), PartialProxy("tiny-video", ["count", "color", "shape"])
    assert torch.equal(PartialProxy("tiny-video", ["count", "color", "shape", "direction"])(clips, prompts), verifier.score(clips, prompts)["partial"])
    still = clips[:, :1].expand_as(clips).contiguous()  # every frame the first: nothing moves
    assert torch.equal(proxy(still, prompts), proxy(clips, prompts))
    assert (verifier.score(still, prompts)["direction"] == 0).all() and (verifier.score(still, prompts)["strict"] == 0).all()
    assert PartialProxy.scores_videos(task="tiny-video") and not PartialProxy.scores_videos()


@pytest.mark.parametrize("kwargs, words", [
    ({"terms": ["count", "size"]}, "terms ['count', 'size'] must be one or more distinct terms of tiny-geneval's verifier (count, color, shape, position)"),
    ({"terms": []}, "must be one or more distinct terms"),
    ({"terms": ["count", "count"]}, "must be one or more distinct terms"),
    ({"task": "geneval"}, "task 'geneval' is not a built-in verifier; give one of tiny-geneval, tiny-video"),
])
def test_a_partial_proxy_refuses_terms_its_verifier_has_not(kwargs, words):
    with pytest.raises(ValueError, match="^tiny-partial: " + ".*" + words.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(").replace(")", r"\)")):
        PartialProxy(**kwargs)


def _proxy_folder(tmp_path, name: str, task: str = "tiny-geneval", seed: int = 0):
    torch.manual_seed(seed)
    channels = 3 if task == "tiny-geneval" else 15
    network = ProxyNet(channels, 14 if task == "tiny-geneval" else 13, width=8)
    save_proxy(tmp_path / name, network, {"task": task, "channels": channels, "prompt_dim": 14 if task == "tiny-geneval" else 13, "width": 8})
    return network.eval(), str(tmp_path / name)


def test_a_learned_proxy_loads_as_saved_and_an_ensemble_reduces_by_its_formula(tmp_path):
    prompts = ["two red circles on the left", "one blue square at the top", "three green triangles at the bottom"]
    images = _images(prompts)
    networks, paths = zip(*(_proxy_folder(tmp_path, f"p{k}", seed=k) for k in range(3)))
    with torch.no_grad():
        each = torch.stack([n(images, prompt_features("tiny-geneval", prompts)) for n in networks]).double()  # (3, B)
    single = build_component(parse_reward_specs([{"name": "learned-proxy", "kwargs": {"path": paths[0]}}])[0], "cpu")
    torch.testing.assert_close(single(images, prompts, [{}] * 3).double(), each[0], rtol=1e-6, atol=1e-7)
    mean = each.mean(0)
    std = ((each - mean).pow(2).sum(0) / 2).sqrt()  # unbiased over the three networks
    for reduce, k, expected in (("mean", 1.0, mean), ("min", 1.0, each.min(0).values), ("mean-std", 2.0, mean - 2.0 * std)):
        ensemble = LearnedProxy(list(paths), reduce=reduce, k=k)
        torch.testing.assert_close(ensemble(images, prompts).double(), expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(reduce_ensemble(each[:1], "mean-std"), each[0])  # one network: no spread
    features = prompt_features("tiny-geneval", ["two red circles on the left"])[0]
    # count two, red, circle, left: positions 1, 3 + 0, 7 + 0, 10 + 0 of the one-hot (count 3, colour 4, shape 3, position 4)
    assert features.nonzero().squeeze(1).tolist() == [1, 3, 7, 10] and len(features) == 14


def test_a_learned_proxy_refuses_what_it_cannot_load(tmp_path):
    _, image_proxy = _proxy_folder(tmp_path, "image")
    _, clip_proxy = _proxy_folder(tmp_path, "clip", task="tiny-video")
    with pytest.raises(ValueError, match=r"^learned-proxy: .*nowhere is not a proxy \(no proxy.json and proxy.safetensors\); make one with branchdiff bench proxies$"):
        LearnedProxy(str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="^learned-proxy: an ensemble's proxies must share a task; these are fit to tiny-geneval, tiny-video$"):
        LearnedProxy([image_proxy, clip_proxy])
    with pytest.raises(ValueError, match="^learned-proxy: reduce='median' is not one of mean, min, mean-std$"):
        LearnedProxy(image_proxy, reduce="median")
    with pytest.raises(ValueError, match=r"^learned-proxy: k=-1 must be a number ≥ 0"):
        LearnedProxy(image_proxy, reduce="mean-std", k=-1)
    assert LearnedProxy.scores_videos(path=clip_proxy) and not LearnedProxy.scores_videos(path=[image_proxy])


def test_pair_accuracy_counts_the_pairs_of_one_prompt_ordered_as_the_verifier_orders_them():
    from branchdiff.bench.proxies import pair_accuracy

    truth = np.array([0.2, 0.5, 0.5, 0.1, 0.9])
    proxy = np.array([0.3, 0.6, 0.1, 0.4, 0.4])
    groups = np.array([0, 0, 0, 1, 1])
    # group 0: (0,1) truth up, proxy up: hit; (0,2) truth up, proxy down: miss; (1,2) truth tie: not a pair.
    # group 1: (3,4) truth up, proxy tie: half. (1 + 0 + 0.5) / 3
    assert pair_accuracy(proxy, truth, groups) == pytest.approx(1.5 / 3)


def test_bench_proxies_fits_each_size_and_seed_and_reports_its_accuracy(tmp_path):
    from branchdiff.bench.proxies import build_proxies

    result = build_proxies("tiny", [4, 8], 2, tmp_path, tmp_path / "p.json", steps=3, test_per_prompt=2)
    assert [(row["n"], row["seed"]) for row in result["proxies"]] == [(4, 0), (4, 1), (4, "ensemble"), (8, 0), (8, 1), (8, "ensemble")]
    assert result["tests"]["held-out prompts"]["samples"] == 72 and result["pool_size"] >= 16
    card = json.loads((tmp_path / "tiny-geneval-n8-s1" / "proxy.json").read_text())
    assert card["samples"] == 8 and card["seed"] == 1 and set(card["accuracy"]) == set(result["tests"])
    for row in result["proxies"]:
        for numbers in row["accuracy"].values():
            assert 0 <= numbers["pair_accuracy"] <= 1 and -1 <= numbers["spearman"] <= 1 and numbers["mae"] >= 0
    proxy = LearnedProxy(str(tmp_path / "tiny-geneval-n8-s1"))
    scores = proxy(_images(["two red circles on the left"]), ["two red circles on the left"])
    assert scores.shape == (1,) and 0 <= float(scores) <= 1
    assert (tmp_path / "proxies.md").is_file() and json.loads((tmp_path / "p.json").read_text())["sizes"] == [4, 8]
