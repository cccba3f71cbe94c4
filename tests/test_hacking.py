"""The reward-hacking watch: its rule on hand-made curves, and the built-in task trained on a hackable
proxy (the fraction of the image in the prompt's colour) against the strict verifier as gold: the
watch flags the proxy run, and stops it with `watch.stop`, and never flags a run on the verifier."""

from __future__ import annotations

import json

import pytest

from branchdiff.cli import main
from branchdiff.training.hacking import WatchState, diverging

PREFIX = "branchdiff: error: "


@pytest.mark.parametrize("train, gold, window, flagged", [
    ([0.1, 0.2, 0.5], [0.30, 0.25, 0.10], 2, True),  # reward up 0.4, gold down 0.2 > 0.02
    ([0.1, 0.2, 0.5], [0.30, 0.25, 0.29], 2, False),  # gold down 0.01: within the tolerance
    ([0.5, 0.2, 0.1], [0.30, 0.25, 0.10], 2, False),  # both fell: a collapse, not a hack
    ([0.1, 0.2, 0.5], [0.10, 0.25, 0.30], 2, False),  # both rose: learning
    ([0.1, 0.5], [0.30, 0.10], 2, False),  # not enough evaluations for the window
    ([0.1, 0.5], [0.30, 0.10], 1, True),
    ([0.4, 0.1, 0.5], [0.30, 0.20, 0.25], 1, False),  # gold rose since the evaluation before
])
def test_divergence_is_reward_up_while_gold_falls_beyond_the_tolerance(train, gold, window, flagged):
    assert diverging(train, gold, window, tolerance=0.02) is flagged


def test_the_state_pairs_each_evaluation_and_round_trips():
    state = WatchState()
    assert state.add_evaluation(0.1, 0.3, 1, 0.02) == {"watch_reward": 0.1, "watch_gold": 0.3, "watch_diverging": 0.0}
    assert state.add_evaluation(0.5, 0.1, 1, 0.02)["watch_diverging"] == 1.0
    assert WatchState(**state.to_dict()) == state


def _run(run, reward: str, *extra: str) -> list[str]:
    """The built-in model, trained 9 iterations and evaluated (strict, two images per held-out prompt) at 0, 4 and 8."""
    return ["train", "tiny-mix", f"output_dir={run}", f"reward={reward}", "iterations=9", "eval_every=4", "prompts.per_iteration=4",
            "model.finetune=lora", "train.learning_rate=1e-3", "train.optimizer_every=0", "prompts.eval_seeds=2", "watch.gold=tiny-geneval.strict", "final_eval=false", "logging.sample_every=0",
            "logging.report_to=none", *extra]


def _watched(run) -> list[tuple[int, float, float, float]]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["iteration"], r["watch_reward"], r["watch_gold"], r["watch_diverging"]) for r in rows if "watch_gold" in r]


@pytest.mark.slow  # release only: keeps the suite under 15 minutes on 2 cores
def test_a_hackable_proxy_is_flagged_and_stopped_and_the_verifier_is_not(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    proxy = tmp_path / "proxy"
    assert main(_run(proxy, "rewards_for_tests:PromptColour", "train.learning_rate=1e-2", "watch.stop=true")) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    watched = _watched(proxy)
    assert [w[0] for w in watched] == [0, 4, 8] and watched[-1][3] == 1.0  # flagged at the third evaluation
    (_, reward_0, gold_0, _), (_, reward_8, gold_8, _) = watched[0], watched[-1]
    assert reward_8 > reward_0 + 0.2 and gold_8 < gold_0 - 0.1  # the colour spreads, the objects go
    kept = json.loads((proxy / "best" / "best.json").read_text())
    assert kept["gold"] == max(w[2] for w in watched) and (proxy / "best" / "lora").is_dir()
    assert line == (f"{PREFIX}the training reward rose from {reward_0:.4g} to {reward_8:.4g} while held-out tiny-geneval.strict fell from "
                    f"{gold_0:.4g} to {gold_8:.4g} over the last 2 evaluations (up to iteration 8): the policy may be exploiting its reward "
                    f"(reward hacking); the weights of its best evaluation before the alarm (iteration {kept['iteration']}, held-out "
                    f"tiny-geneval.strict {kept['gold']:.4g}) are in {proxy / 'best'}, the last iteration's in the checkpoint; look at the "
                    "samples in report.html, then "
                    "change the reward (or train with a KL term), or continue with watch.stop=false")
    assert (proxy / "checkpoints" / "iter-000008").is_dir()
    assert "Divergence flagged at 1 evaluation(s)" in (proxy / "report.html").read_text()
    verifier = tmp_path / "verifier"
    assert main(_run(verifier, "tiny-geneval", "watch.stop=true")) == 0
    assert [w[3] for w in _watched(verifier)] == [0.0, 0.0, 0.0]
    assert "No divergence flagged" in (verifier / "report.html").read_text()


def test_a_watched_run_keeps_the_weights_of_its_best_evaluation(tiny_model_dir, tmp_path):
    """With watch.stop, every evaluation whose gold beats the earlier ones exports the weights it evaluated to RUN/best/;
    a stopped run then keeps its best gold estimate, not its last iteration (before, only the last was saved)."""
    from safetensors.torch import load_file

    from watched_runs import assert_kept_best

    run = tmp_path / "run"
    # the gold here is the trained reward itself, so that it rises and the best is not the base model
    assert main(["train", "tiny-chain", f"model.path={tiny_model_dir}", f"output_dir={run}", "iterations=3", "eval_every=1", "watch.stop=true",
                 "reward=rewards_for_tests:Redness", "eval_rewards=[rewards_for_tests:Redness]",
                 "watch.window=5", "prompts.per_iteration=2", "sampling.num_steps=3", "tree.roots=2", "model.finetune=lora",
                 "train.learning_rate=5e-2", "prompts.eval_seeds=1", "final_eval=false", "logging.checkpoint_every=1", "logging.sample_every=0",
                 "logging.report_to=none"]) == 0
    assert_kept_best(run, lambda iteration: load_file(run / "checkpoints" / f"iter-{iteration:06d}" / "pytorch_lora_weights.safetensors"))
    assert json.loads((run / "best" / "best.json").read_text())["iteration"] > 0


def test_the_stop_line_names_the_kept_weights(tmp_path):
    from branchdiff.training.hacking import stop_line

    state = WatchState([0.1, 0.2, 0.5], [0.3, 0.35, 0.1])
    line = stop_line(state, 2, "tiny-geneval.strict", 8, {"iteration": 4, "gold": 0.35}, tmp_path)
    assert (f"(reward hacking); the weights of its best evaluation before the alarm (iteration 4, held-out tiny-geneval.strict 0.35) are in "
            f"{tmp_path / 'best'}, the last iteration's in the checkpoint; look at the samples") in line
