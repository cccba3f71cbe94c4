"""AWM, DGPO, Flow-DPPO, online Diffusion-DPO and MC-GRPO's median baseline on the tiny model: each
preset trains through `branchdiff train` and a run stopped and resumed ends bit for bit like an
unstopped one; each plan's terms and losses against an independent computation; each refusal of an
incompatible setting up front. (Formulas: tests/test_objective_formulas.py; two processes:
tests/test_multiprocess.py.)"""

from __future__ import annotations

import pytest
import torch

from branchdiff.core.loss import awm_weighted_error, flow_matching_error
from branchdiff.errors import ConfigError
from branchdiff.objectives.dgpo import whole_group_batches
from branchdiff.objectives.dpo import preference_pairs
from branchdiff.settings.load import load_config

SMALL = ["prompts.per_iteration=2", "final_eval=false", "eval_every=0", "logging.report_to=none", "logging.sample_every=0",
         "logging.checkpoint_every=1"]
OWN_METRICS = {"tiny-awm": "average_kl", "tiny-dgpo": "group_weight", "tiny-dppo": "step_kl", "tiny-dpo": "preference_accuracy",
               "tiny-mc-grpo": "clip_fraction", "tiny-sft": "matching", "tiny-dpo-offline": "preference_accuracy"}
FAST_RESUMES = ("tiny-awm", "tiny-sft")  # AWM keeps state of its own; SFT's iterations take the dataset path of the trainer


@pytest.mark.parametrize("preset", [pytest.param(p, marks=() if p in FAST_RESUMES else pytest.mark.slow) for p in OWN_METRICS])
def test_each_preset_trains_and_a_resumed_run_ends_like_an_unstopped_one(preset, tmp_path):
    """Two iterations straight, or one then `--resume latest`: the same export and metrics (AWM's policy
    average is saved with every checkpoint and read back; SFT draws its rows and noise levels by address;
    the others keep no state beyond the weights and run in the release suite, `slow`; their two-process
    runs, tests/test_multiprocess.py, train through `branchdiff train` in every run)."""
    from resumed_runs import assert_resumed_run_equals_straight  # tests/ is on sys.path

    def args(run, iterations):
        return ["train", preset, f"output_dir={run}", f"iterations={iterations}", *SMALL]

    def saved(run):
        if preset == "tiny-awm":
            assert (run / "checkpoints" / "iter-000000" / "policy_average.safetensors").is_file()

    lines = assert_resumed_run_equals_straight(args, tmp_path, 1, 2, saved)
    assert all(OWN_METRICS[preset] in line for line in lines) and sum(line["optimizer_steps"] for line in lines) > 0


def _trainer(tmp_path, preset: str, *extra: str):
    from branchdiff.training.recipe import Trainer

    return Trainer(load_config(preset, [f"output_dir={tmp_path}", "prompts.per_iteration=2", "final_eval=false", "logging.report_to=none",
                                        "logging.sample_every=0", *extra]))


def test_awm_terms_match_an_independent_forward_and_the_average_follows_its_recursion(tmp_path):
    trainer = _trainer(tmp_path, "tiny-awm", "awm.average_decay=0.6", "awm.average_decay_rate=0", "train.learning_rate=1e-3")
    objective, params = trainer.objective, trainer.finetune.params
    rollout, _, rewards, info = trainer.rollout_and_score(0)
    signal = objective.signal(rollout, rewards.total, 0)
    plan = objective.plan(rollout, info["embeds"], signal, info["address"])
    terms = plan.terms_drawn
    assert len(terms.nodes) == 2 * int(signal.trained.sum()) and set(terms.nodes.tolist()) <= set(rollout.tree.leaf_index.tolist())
    sigma = trainer.schedule.sigmas[terms.steps]
    x_t = (1 - sigma.view(-1, 1, 1, 1)) * rollout.latents[terms.nodes] + sigma.view(-1, 1, 1, 1) * terms.noise
    assert torch.allclose(terms.x_t, x_t)
    with torch.no_grad():
        v = trainer.adapter.predict(x_t, trainer.schedule.model_times[terms.steps], {k: v[terms.prompt] for k, v in info["embeds"].items()},
                                    None)
    expected = awm_weighted_error(flow_matching_error(v, rollout.latents[terms.nodes], terms.noise), sigma, "ghuber", 0.25)
    assert torch.allclose(plan.old_weighted, expected, rtol=1e-4, atol=1e-6)
    first = plan.loss(0)  # before any update ρ = 1: the policy term is −A, the KL to the average (= the weights) 0
    assert torch.allclose(first, -plan.advantages[plan.minibatches[0]], atol=1e-5)
    average = [p.detach().clone() for p in params]
    for iteration in range(2):
        trainer.run_iteration(iteration)
        average = [0.6 * a + 0.4 * p.detach() for a, p in zip(average, params)]
        with objective.policy_average.swapped_in():
            assert all(torch.allclose(p, a, atol=1e-6) for p, a in zip(params, average))


def test_dgpo_groups_share_their_steps_and_noise_and_minibatches_hold_whole_groups(tmp_path):
    trainer = _trainer(tmp_path, "tiny-dgpo", "train.minibatch=20")
    rollout, _, rewards, info = trainer.rollout_and_score(0)
    objective = trainer.objective
    plan = objective.plan(rollout, info["embeds"], objective.signal(rollout, rewards.total, 0), info["address"])
    terms = plan.terms_drawn
    for prompt in range(2):
        rows = torch.nonzero(terms.prompt == prompt).squeeze(1)
        steps, noise = terms.steps[rows].reshape(-1, 2), terms.noise[rows].reshape(-1, 2, *terms.noise.shape[1:])
        assert (steps == steps[0]).all() and torch.equal(noise, noise[:1].expand_as(noise))
    assert [sorted(set(terms.prompt[b].tolist())) for b in plan.minibatches] == [[0, 1]]  # 16 terms a group: both in one of ≥ 20
    assert [len(b) for b in whole_group_batches(torch.tensor([0, 0, 1, 1, 1, 2]), 2)] == [2, 3, 1]
    with torch.no_grad():  # before any update the policy is the reference: σ(0) = ½ for every term
        plan.loss(0)
    assert plan.stats["group_weight"] == pytest.approx(0.5 * plan.terms[0]) and abs(plan.stats["error_gap"]) < 1e-6


def test_dppo_with_an_unreachable_threshold_is_grpo_without_a_clip(tmp_path):
    """Far below the threshold nothing is held: DPPO's edge losses are clipped GRPO's with an infinite clip range."""
    grpo = _trainer(tmp_path / "grpo", "tiny-mix", "train.clip_range=1e9")
    dppo = _trainer(tmp_path / "dppo", "tiny-dppo", "dppo.kl_mask_threshold=1e9")
    losses = []
    for trainer in (grpo, dppo):
        rollout, _, rewards, info = trainer.rollout_and_score(0)
        signal = trainer.objective.signal(rollout, rewards.total, 0)
        plan = trainer.objective.plan(rollout, info["embeds"], signal, info["address"])
        losses.append(torch.cat([plan.loss(i) for i in range(len(plan.terms))]).detach())
    assert torch.allclose(losses[0], losses[1], atol=1e-6) and losses[0].abs().sum() > 0


def test_dpo_pairs_rank_within_groups_or_siblings_and_share_their_noise(tmp_path):
    trainer = _trainer(tmp_path, "tiny-dpo")
    rollout, _, _, info = trainer.rollout_and_score(0)
    tree = rollout.tree  # two prompts × 8 leaves (splits at steps 0, 1, 2), prompt 0's first; each pair of leaves shares its depth-2 node
    leaves = tree.leaf_index
    node_rewards = torch.zeros(tree.num_nodes)
    node_rewards[leaves] = torch.tensor([0.1, 0.9, 0.5, 0.5, 0.3, 0.7, 0.2, 0.8, 1, 1, 1, 1, 0, 0, 1, 1], dtype=torch.float32)
    kept = torch.zeros(tree.num_nodes, dtype=torch.bool)
    kept[leaves] = True
    chosen, rejected = preference_pairs(tree, node_rewards, kept, siblings=False)
    first = leaves[:8].tolist()
    # prompt 0 ranked: 0.9, 0.8, 0.7, 0.5, 0.5, 0.3, 0.2, 0.1 → (0.9, 0.1), (0.8, 0.2), (0.7, 0.3); the two 0.5s tie
    assert list(zip(chosen.tolist(), rejected.tolist()))[:3] == [(first[1], first[0]), (first[7], first[6]), (first[5], first[4])]
    assert len(chosen) == 3 + 2  # prompt 1: six 1s and two 0s: two pairs
    sibling_chosen, sibling_rejected = preference_pairs(tree, node_rewards, kept, siblings=True)
    assert list(zip(sibling_chosen.tolist(), sibling_rejected.tolist())) == [(first[1], first[0]), (first[5], first[4]), (first[7], first[6])]
    # prompt 0's siblings: (0.1, 0.9), (0.5, 0.5) tied, (0.3, 0.7), (0.2, 0.8); prompt 1's: (1, 1), (1, 1), (0, 0), (1, 1) all tied
    node_rewards[leaves] = torch.tensor([0.1, 0.9, 0.5, 0.4, 0.3, 0.7, 0.2, 0.8, 1, 0, 1, 0, 0, 1, 0, 1], dtype=torch.float32)
    from branchdiff.objectives.base import Signal

    signal = Signal(node_rewards, torch.zeros(tree.num_nodes), kept, 0)
    plan = trainer.objective.plan(rollout, info["embeds"], signal, info["address"])
    terms = plan.terms_drawn
    assert torch.equal(terms.steps[plan.chosen_rows], terms.steps[plan.rejected_rows])
    assert torch.equal(terms.noise[plan.chosen_rows], terms.noise[plan.rejected_rows]) and plan.stats["pairs"] == 8
    with torch.no_grad():  # the policy is the reference before any update: every pair's loss is log 2
        assert torch.allclose(plan.loss(0), torch.full((plan.terms[0],), 0.6931472), atol=1e-5)


@pytest.mark.parametrize(("preset", "overrides", "message"), [
    ("tiny-dppo", ["sampling.sde=ode", "tree.splits=[]", "tree.mix_window=0", "tree.roots=8"],
     r"'sampling.sde' = 'ode' samples without noise, so no step has a density for train.loss=dppo to train: use an objective that trains on "
     r"final samples \(nft, awm, dgpo, dpo, dpo-offline, sft\), or an SDE \(sampling.sde=flow\)"),
    ("tiny-awm", ["awm.timesteps=11"], r"'awm.timesteps' = 11 exceeds sampling.num_steps = 10; use awm.timesteps ≤ 10"),
    ("tiny-dpo", ["advantage.baseline=median"], r"'advantage.baseline' = 'median' applies to grpo, grpo-guard, grpo-layertuning, dppo, nft, "
                                               r"awm, dgpo; train.loss=dpo ranks its samples its own way: use advantage.baseline=mean"),
    ("tiny-dpo", ["dpo.pairs=siblings", "tree.splits=[]", "tree.mix_window=0", "tree.roots=8"],
     r"'dpo.pairs' = 'siblings' pairs leaves that share their last split; the rollouts have no 'tree.splits': use dpo.pairs=group, or add splits"),
    ("tiny-dgpo", ["tree.splits=[]", "tree.mix_window=0", "tree.roots=1"],
     r"train.loss=dgpo compares the samples of a prompt, and the rollouts give each prompt 1: use tree.roots ≥ 2 or a split \(tree.splits\)"),
    ("sd15-hps", ["train.loss=awm"], r"'train.loss' = 'awm' trains on the flow-matching forward process; model.family=sd15 is an ε-prediction"),
    ("sd15-hps", ["train.loss=dppo"], r"'train.loss' = 'dppo' bounds each step by its Gaussian divergence on σ steps; model.family=sd15"),
])
def test_incompatible_settings_are_refused_when_the_config_is_read(preset, overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(preset, overrides)


def test_a_dataset_objective_takes_more_noise_levels_than_sampling_steps():
    """SFT and offline DPO draw their levels on the 1000-step schedule: sft.timesteps=20 at 10 sampling steps is accepted
    (it was refused against sampling.num_steps)."""
    assert load_config("tiny-sft", ["sft.timesteps=20"]).sft.timesteps == 20
    assert load_config("tiny-dpo-offline", ["dpo_offline.timesteps=20"]).dpo_offline.timesteps == 20


def test_dataset_objectives_draw_rows_and_noise_levels_by_address_and_pairs_share_them(tmp_path):
    """SFT's terms: the rows the iteration draws, noised at levels of the family's 1000-step schedule drawn at each
    row's address (logit-normal t), its loss the flow-matching error; offline DPO's chosen and rejected images share
    (σ, ε), and before any update every pair's loss is log 2."""
    from branchdiff.core.noise import address_seed
    from branchdiff.core.rollout import NoiseAddress

    trainer = _trainer(tmp_path / "sft", "tiny-sft")
    objective = trainer.objective
    rows, keys = trainer.iteration_draw(3)
    assert [trainer.prompts[r] for r in rows] == [objective.rows.prompts[r] for r in rows]
    embeds = {k: v for k, v in trainer.adapter.encode_prompts([trainer.prompts[r] for r in rows]).items()}
    plan = objective.plan_rows(rows, embeds, NoiseAddress(trainer.config.seed, 3, keys))
    terms = plan.terms_drawn
    generator = torch.Generator().manual_seed(address_seed("sft", trainer.config.seed, 3, keys[1], ()))
    t = torch.sigmoid(torch.randn(2, generator=generator, dtype=torch.float64))
    assert terms.steps[2:4].tolist() == ((1 - t) * 1000).long().tolist()
    assert torch.equal(terms.noise[2:4], torch.randn((2, 3, 32, 32), generator=generator))
    x0 = objective.rows.pixels(rows[1])[0] * 2 - 1  # the tiny model's latent is the image in [−1, 1]
    assert torch.allclose(terms.x0[2], x0)
    sigma = objective.fine_schedule.sigmas[terms.steps[2]]
    assert torch.allclose(terms.x_t[2], (1 - sigma) * x0 + sigma * terms.noise[2], atol=1e-6)
    with torch.no_grad():
        v = trainer.adapter.predict(terms.x_t[:4], terms.times[:4], {k: v[terms.prompt[:4]] for k, v in embeds.items()}, None)
        assert torch.allclose(plan.loss(0), flow_matching_error(v, terms.x0[:4], terms.noise[:4]), atol=1e-6)
    offline = _trainer(tmp_path / "dpo", "tiny-dpo-offline")
    rows, keys = offline.iteration_draw(0)
    embeds = offline.adapter.encode_prompts([offline.prompts[r] for r in rows])
    pairs = offline.objective.plan_rows(rows, embeds, NoiseAddress(offline.config.seed, 0, keys))
    chosen, rejected = pairs.pair_terms
    assert torch.equal(chosen.steps, rejected.steps) and torch.equal(chosen.noise, rejected.noise) and not torch.equal(chosen.x0, rejected.x0)
    with torch.no_grad():
        assert torch.allclose(pairs.loss(0), torch.full((pairs.terms[0],), 0.6931472), atol=1e-5)


def test_image_sets_are_checked_when_read(tmp_path):
    from PIL import Image

    from branchdiff.data.demonstrations import load_image_set

    Image.new("RGB", (32, 32), "red").save(tmp_path / "good.png")
    Image.new("RGB", (64, 32), "red").save(tmp_path / "wide.png")
    (tmp_path / "notes.png").write_text("not an image")
    cases = {
        '{"prompt": "a", "image": "good.png"}\n{"prompt": "b", "image": "wide.png"}':
            r'sets.jsonl:2: "image" \'wide.png\' is 64×32 \(width × height\) and the model makes 32×32; resize the demonstrations to 32×32',
        '{"prompt": "a", "image": "missing.png"}': r"sets.jsonl:1: \"image\" 'missing.png' not found",
        '{"prompt": "a", "image": "notes.png"}': r"sets.jsonl:1: \"image\" 'notes.png' could not be read as an image",
        '{"prompt": "a"}': r'sets.jsonl:1: expected a JSON object with the fields "prompt", "image"',
        '{"prompt": "", "image": "good.png"}': r'sets.jsonl:1: "prompt" must be a non-empty string',
        "not json": r'sets.jsonl:1: expected a JSON object with the fields "prompt", "image", got',
    }
    for text, message in cases.items():
        (tmp_path / "sets.jsonl").write_text(text + "\n")
        with pytest.raises(ValueError, match=message):
            load_image_set(str(tmp_path / "sets.jsonl"), "demonstrations", (32, 32))
    (tmp_path / "sets.jsonl").write_text('{"prompt": "a", "image": "good.png"}\n')
    assert load_image_set(str(tmp_path / "sets.jsonl"), "demonstrations", (32, 32)).pixels(0)[0][0].min() == 1.0  # red
    with pytest.raises(ValueError, match="tiny:demonstrations is a set of demonstrations, not preferences; use tiny:preferences"):
        load_image_set("tiny:demonstrations", "preferences", (32, 32))


def test_the_video_tasks_sets_hold_its_clips_and_train_the_video_model(tmp_path):
    """tiny-video:demonstrations holds each training prompt's clip as the task renders it (at the model's frames);
    tiny-video:preferences prefers it to a clip of the next colour or the next direction, alternately; a video model
    refuses the image sets and JSONL files, an image model the clip sets, in one line; SFT trains the video model."""
    from branchdiff.data import tiny_video_task
    from branchdiff.data.demonstrations import load_image_set

    prompts = tiny_video_task.split_prompts()[0]
    demonstrations = load_image_set("tiny-video:demonstrations", "demonstrations", (32, 32), frames=3)
    assert demonstrations.prompts == [p.text for p in prompts]
    assert torch.equal(demonstrations.pixels(3)[0], torch.from_numpy(tiny_video_task.render_batch(prompts, seed=0, frames=3)[3]))
    pairs = load_image_set("tiny-video:preferences", "preferences", (32, 32), frames=5)
    chosen, rejected = pairs.pixels(0)
    assert chosen.shape == rejected.shape == (5, 3, 32, 32) and not torch.equal(chosen, rejected)
    colors, directions = list(tiny_video_task.COLORS), list(tiny_video_task.DIRECTIONS)
    first, second = prompts[:2]
    wrong = [tiny_video_task.TinyClipPrompt(first.count, colors[(colors.index(first.color) + 1) % len(colors)], first.shape, first.direction),
             tiny_video_task.TinyClipPrompt(second.count, second.color, second.shape,
                                            directions[(directions.index(second.direction) + 1) % len(directions)])]
    rendered = torch.from_numpy(tiny_video_task.render_batch(wrong, seed=1))
    assert torch.equal(pairs.pixels(0)[1], rendered[0]) and torch.equal(pairs.pixels(1)[1], rendered[1])
    for source, frames, message in (("tiny:demonstrations", 5, "tiny:demonstrations holds images and the model makes videos of 5 frames; "
                                                               "use tiny-video:demonstrations"),
                                    ("tiny-video:demonstrations", 0, "tiny-video:demonstrations holds clips and the model makes images; "
                                                                     "use tiny:demonstrations"),
                                    (str(tmp_path / "sets.jsonl"), 5, "a video model trains on tiny-video:demonstrations only")):
        with pytest.raises(ValueError, match=message):
            load_image_set(source, "demonstrations", (32, 32), frames)
    from branchdiff.training.recipe import Trainer

    trainer = Trainer(load_config("tiny-video", ["train.loss=sft", "sft.data=tiny-video:demonstrations", f"output_dir={tmp_path / 'run'}", "model.compile=none",
                                                 *SMALL]))
    before = [p.detach().clone() for p in trainer.finetune.params]
    metrics = trainer.run_iteration(0).metrics
    assert metrics["loss"] > 0 and metrics["optimizer_steps"] == 1
    assert any(not torch.equal(b, p) for b, p in zip(before, trainer.finetune.params))


def test_dataset_objectives_are_refused_where_they_cannot_run(tmp_path):
    from branchdiff.errors import UserError
    from branchdiff.training.preflight import check_inputs

    with pytest.raises(UserError, match=r"train.loss=sft trains on images, which model.family=flux cannot encode into latents yet; families "
                                         r"that can: tiny, tiny-video, sd3"):
        check_inputs(load_config("flux-hps-branch", ["train.loss=sft"]))
    with pytest.raises(UserError, match=r"preferences set '.*nowhere.jsonl' is neither tiny:demonstrations, tiny:preferences, tiny-video:demonstrations, "
                                         r"tiny-video:preferences nor an existing file: give a JSONL "
                                         r"file of rows with the fields \"prompt\", \"chosen\", \"rejected\" \(docs/objectives.md\)"):
        check_inputs(load_config("tiny-dpo-offline", [f"dpo_offline.data={tmp_path / 'nowhere.jsonl'}"]))
    with pytest.raises(ConfigError, match=r"train.loss=sft trains on its demonstrations \(sft.data\), not on rollouts: explore.mode must stay off"):
        load_config("tiny-sft", ["explore.mode=seeds"])
