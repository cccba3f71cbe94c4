"""The trainer end to end on a random tiny model: metrics, checkpoints, exact resume, LoRA, KL."""

import json

import pytest
import torch
from safetensors.torch import load_file

from branchdiff.cli import main
from branchdiff.objectives.base import Signal
from branchdiff.settings.load import load_config
from branchdiff.training.recipe import Trainer
from branchdiff.training.update import optimizer_groups


def _overrides(model_dir, out, iterations, *extra):
    return [
        f"model.path={model_dir}", f"output_dir={out}", f"iterations={iterations}", "seed=0",
        "reward=rewards_for_tests:Redness", "prompts.per_iteration=2", "tree.roots=3", "sampling.num_steps=3",
        "sampling.max_batch=8", "train.minibatch=4", "model.finetune=lora", "train.learning_rate=1e-2", "final_eval=false",
        "logging.checkpoint_every=1", "logging.sample_every=1", *extra,
    ]


def _metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_train_writes_metrics_checkpoints_and_lora(tiny_model_dir, tmp_path, monkeypatch):
    from branchdiff.report import run_report

    run = tmp_path / "run"
    write_report, reports = run_report.write_report, []

    def counted(run_dir):  # the report's writes, each by the iterations its metrics held
        reports.append(len(_metrics(run_dir)))
        return write_report(run_dir)

    monkeypatch.setattr(run_report, "write_report", counted)
    assert main(["train", "tiny-chain", *_overrides(tiny_model_dir, run, 2)]) == 0
    assert reports == [2]  # after the final evaluation only: a run of seconds (ReportSchedule) whose last checkpoint's would be redundant
    metrics = _metrics(run)
    assert [m["iteration"] for m in metrics] == [0, 1]
    for m in metrics:
        assert torch.isfinite(torch.tensor(m["reward_mean"]))
        assert m["logprob_check"] < 1e-4  # the ratio is 1 before the first update
        assert m["nfe_rollout"] == 2 * 3 * 3 and m["edges_trained"] == 2 * 3 * 3
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["iter-000000", "iter-000001"]
    assert (run / "config.yaml").is_file() and (run / "samples" / "iter-000001.png").is_file()
    assert any((run / "logs").rglob("events.out.tfevents*"))
    lora = load_file(run / "lora" / "pytorch_lora_weights.safetensors")
    b_weights = [v for k, v in lora.items() if "lora_B" in k]
    assert all(k.startswith("transformer.") for k in lora)
    assert max(w.abs().max().item() for w in b_weights) > 0  # B starts at 0: training moved it


def test_resume_continues_exactly(tiny_model_dir, tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert main(["train", "tiny-chain", *_overrides(tiny_model_dir, straight, 3)]) == 0
    assert main(["train", "tiny-chain", *_overrides(tiny_model_dir, resumed, 2)]) == 0
    assert main(["train", "tiny-chain", *_overrides(tiny_model_dir, resumed, 3), "--resume", "latest"]) == 0
    a, b = _metrics(straight), _metrics(resumed)
    assert [m["iteration"] for m in b] == [0, 1, 2]  # continued at the third iteration
    for key in ("reward_mean", "loss", "grad_norm", "logprob_check"):
        assert a[2][key] == b[2][key], key
    wa = load_file(straight / "lora" / "pytorch_lora_weights.safetensors")
    wb = load_file(resumed / "lora" / "pytorch_lora_weights.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_resume_from_an_earlier_checkpoint_rewrites_later_metrics(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    assert main(["train", "tiny-chain", *_overrides(tiny_model_dir, run, 2, "logging.checkpoints_total_limit=5")]) == 0
    assert main(["train", "tiny-chain", *_overrides(tiny_model_dir, run, 2), "--resume", str(run / "checkpoints" / "iter-000000")]) == 0
    assert [m["iteration"] for m in _metrics(run)] == [0, 1]


def test_optimizer_cadence(tiny_model_dir, tmp_path):
    config = load_config(None, _overrides(tiny_model_dir, tmp_path / "cadence", 1, "train.optimizer_every=8"))
    result = Trainer(config).run_iteration(0)
    # 18 single-child parents in minibatches of 4 → edges 4,4,4,4,2; ⌊18/8⌋ = 2 steps of 8 and 10 edges
    # (regression: a step once ≥ 8 edges had accumulated took a third step on the last 2 edges alone)
    assert result.metrics["optimizer_steps"] == 2


def test_optimizer_groups_are_the_same_on_every_process():
    """Every process takes ⌊global edges / every⌋ steps whatever its own minibatches; a process
    without edges in a step gets an empty group (it joins the gradient sync with a zero loss)."""
    assert optimizer_groups([4, 4, 4, 4, 2], 18, 8) == [[0, 1], [2, 3, 4]]
    assert optimizer_groups([4, 4, 4, 4, 2], 18, 0) == [[0, 1, 2, 3, 4]]
    assert optimizer_groups([4, 4, 4, 4, 2], 18, 5) == [[0], [1, 2], [3, 4]]
    assert optimizer_groups([6], 18, 5) == [[], [0], []]  # another process holds the other 12 edges
    assert optimizer_groups([], 18, 5) == [[], [], []]
    assert optimizer_groups([3], 3, 5) == [[0]]  # fewer edges than `every`: one step, not none


def _dance_kl_float64(v_policy, v_reference, sigma, sigma_next, eta):
    """KL between the dance transitions of two velocities at the same x, written out from DanceGRPO's step:
    μ = x + Δ·v - ½η²·ŝ·Δ with ŝ = -(x + (1-σ)·v)/σ, so μ_θ - μ_ref = (v_θ - v_ref)·Δ·(1 + η²(1-σ)/(2σ));
    std = η·√(σ - σ'); KL = mean((μ_θ - μ_ref)²) / (2·std²) per edge."""
    delta = sigma_next - sigma
    gap = (v_policy.double() - v_reference.double()) * delta * (1 + eta**2 * (1 - sigma) / (2 * sigma))
    return gap.pow(2).flatten(1).mean(1) / (2 * eta**2 * (sigma - sigma_next))


def test_kl_to_the_adapter_free_base(tiny_model_dir, tmp_path):
    trainer = Trainer(load_config(None, _overrides(tiny_model_dir, tmp_path / "kl", 2, "train.kl_beta=0.1", "sampling.sde=dance",
                                                   "sampling.noise_level=0.3")))
    assert trainer.run_iteration(0).metrics["kl"] == 0.0  # before the first update the adapter (B = 0) is the base
    rollout, _, _, info = trainer.rollout_and_score(1)  # what iteration 1 trains on (addressed noise: the same rollout)
    tree, denoiser = rollout.tree, trainer.adapter.denoiser
    children = torch.nonzero(tree.depth > 0).squeeze(1)  # every edge is trained (no pruning, all SDE)
    parents = tree.parent[children]
    x, sigma = rollout.latents[parents], rollout.schedule.sigmas[tree.depth[parents]]
    embeds = {k: v[tree.prompt[parents]] for k, v in info["embeds"].items()}
    with torch.no_grad():
        v_policy = trainer.adapter.predict(x, sigma, embeds)
        denoiser.disable_adapters()
        v_reference = trainer.adapter.predict(x, sigma, embeds)
        denoiser.enable_adapters()
    expected = torch.stack([
        _dance_kl_float64(v_policy[i : i + 1], v_reference[i : i + 1], sigma[i].item(), rollout.schedule.sigmas[tree.depth[c]].item(), 0.3)
        for i, c in enumerate(children.tolist())
    ]).mean()
    kl = trainer.run_iteration(1).metrics["kl"]
    assert kl > 0 and kl == pytest.approx(expected.item(), rel=1e-3)


@pytest.fixture
def fresh_accelerator_state():
    """accelerate keeps one process-wide state; a run with another precision needs a fresh one."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.mark.parametrize("minibatch", [4, 3])
def test_bf16_autocast_keeps_the_ratio_at_one(tiny_model_dir, tmp_path, fresh_accelerator_state, minibatch):
    """Rollout and training run under the same autocast; the training minibatches (4 or 3 parents)
    differ from the rollout's level batches (6 rows), yet the ratio before the first update must be 1
    far within the clip range ε = 1e-3 (0.0 measured), and no edge may be clipped."""
    trainer = Trainer(load_config(None, _overrides(tiny_model_dir, tmp_path / "bf16", 1, "train.mixed_precision=bf16",
                                                   f"train.minibatch={minibatch}")))
    metrics = trainer.run_iteration(0).metrics
    assert metrics["logprob_check"] <= 1e-2 * trainer.config.train.clip_range
    assert metrics["clip_fraction"] == 0.0 and metrics["edges_trained"] == 18


def test_sample_and_eval_commands(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "png"
    assert main(["sample", "--model", str(tiny_model_dir), "--prompt", "one red circle on the left", "--seeds", "2",
                 "--steps", "3", "--out", str(out)]) == 0
    assert len(list(out.glob("*.png"))) == 2
    report = tmp_path / "eval.json"
    assert main(["eval", "--model", str(tiny_model_dir), "--prompts", "tiny:held_out", "--seeds", "1", "--steps", "3",
                 "--out", str(tmp_path / "eval"), "--json", str(report)]) == 0
    scores = json.loads(report.read_text())["summary"]["all"]
    assert scores["tiny-geneval"]["images"] == 36 and 0.0 <= scores["tiny-geneval"]["mean"] <= 1.0
    assert "tiny-geneval.strict" in capsys.readouterr().out


def test_a_new_run_never_appends_to_an_existing_one(tiny_model_dir, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "tiny-chain", *_overrides(tiny_model_dir, run, 1)]) == 0
    before = (run / "metrics.jsonl").read_bytes()
    assert main(["train", "tiny-chain", *_overrides(tiny_model_dir, run, 1)]) == 2
    assert "already holds a run" in capsys.readouterr().err.strip().splitlines()[-1]
    assert (run / "metrics.jsonl").read_bytes() == before


class OtherProcessHoldsEdges:
    """A collective as seen by a process whose edges were all pruned while another process holds
    10 per optimizer step (`sum` adds the other process's share)."""

    num_processes = 1

    def sum(self, values):
        return values + 10

    def max(self, values):
        return values

    def cat(self, values):
        return values, 0


def test_a_process_without_trained_edges_joins_every_step_idle(tiny_model_dir, tmp_path):
    """Regression: with every edge of one process pruned (global width pruning on chains does it),
    that process built one empty minibatch and crashed in the forward, and its partner hung in DDP's
    gradient sync; it must take the same optimizer steps with a zero loss."""
    trainer = Trainer(load_config(None, _overrides(tiny_model_dir, tmp_path / "idle", 1)))
    trainer.update.collective = OtherProcessHoldsEdges()
    rollout, _, _, info = trainer.rollout_and_score(0)
    nothing = torch.zeros(rollout.tree.num_nodes, dtype=torch.bool)
    signal = Signal(torch.zeros(rollout.tree.num_nodes), torch.zeros(rollout.tree.num_nodes), nothing, 0)
    stats = trainer.update(trainer.objective.plan(rollout, info["embeds"], signal, info["address"]))
    assert stats["optimizer_steps"] == 1 and stats["nfe_trained"] == 0 and stats["logprob_check"] == 0.0


@pytest.mark.parametrize("sde, level", [("dance", 0.3), ("flow", 0.7), ("cps", 0.8)])
@pytest.mark.parametrize("anchor_multiplier", [1.0, 4.0])
def test_training_recomputes_each_edge_at_its_own_noise_level(tiny_model_dir, tmp_path, sde, level, anchor_multiplier):
    """Splits with their own level and a default split level: the training recomputation must use
    every edge's level (and the release's convention when its multiplier is on), so the ratio before
    the first update is 1 on every edge (one minibatch holds them all)."""
    config = load_config(None, [
        f"model.path={tiny_model_dir}", f"output_dir={tmp_path / 'levels'}", "iterations=1", "final_eval=false",
        "reward=rewards_for_tests:Redness", "prompts.per_iteration=2", "sampling.num_steps=4", f"sampling.sde={sde}",
        f"sampling.noise_level={level}", "tree.roots=1", f"tree.splits=[[0, 2, {{noise_level: {level * 0.5}}}], [2, 2]]",
        f"tree.split_noise_level={min(level * 1.25, 1.0)}", f"tree.anchor_noise_multiplier={anchor_multiplier}",
        "train.minibatch=64", "logging.report_to=none",
    ])
    metrics = Trainer(config).run_iteration(0).metrics
    assert metrics["edges_trained"] > 0 and metrics["logprob_check"] < 1e-5


def test_exported_lora_keeps_its_scale_when_alpha_differs_from_rank(tiny_model_dir, tmp_path):
    """Regression (issue 9): without the adapter's metadata diffusers assumes lora_alpha = rank, so a
    LoRA with alpha ≠ rank loaded with the wrong scale; the export carries it, and a fresh model
    loading the file through diffusers reproduces the trained model's output."""
    from branchdiff.models.lora import add_lora
    from branchdiff.models.tiny import TinyAdapter

    trained = TinyAdapter.from_pretrained(tiny_model_dir)
    params = add_lora(trained.denoiser, trained.lora_targets("attention"), rank=4, alpha=16.0, seed=0)
    with torch.no_grad():
        for p in params:
            p.add_(0.05 * torch.randn_like(p))  # B moves away from 0, as training does
    path = trained.save_lora(tmp_path / "lora")
    fresh = TinyAdapter.from_pretrained(tiny_model_dir)
    fresh.load_lora(path)
    x, sigma = torch.randn(2, 3, 32, 32), torch.full((2,), 0.6)
    embeds = trained.encode_prompts(["one red circle on the left"] * 2)
    with torch.no_grad():
        expected, got = trained.predict(x, sigma, embeds), fresh.predict(x, sigma, embeds)
        base = TinyAdapter.from_pretrained(tiny_model_dir).predict(x, sigma, embeds)
    assert (expected - base).abs().max() > 1e-3 and torch.allclose(got, expected, atol=1e-5)


def test_adamw_is_fused_where_it_can_be_and_steps_as_the_default():
    """Plain parameters on one CPU or CUDA device get PyTorch's fused AdamW (one in-place pass, no temporary copies:
    the plan counts none); its steps equal the per-tensor-list default's to float32 rounding. Parameters it cannot
    take (another device type, integers) keep the default."""
    from branchdiff.training.optimizer import fused_adamw, make_optimizer

    config = load_config("tiny-chain", ["train.learning_rate=1e-2", "train.weight_decay=0.1"])
    torch.manual_seed(0)
    ours, theirs = torch.nn.Linear(16, 8), torch.nn.Linear(16, 8)
    theirs.load_state_dict(ours.state_dict())
    fused = make_optimizer(config, list(ours.parameters()))
    default = torch.optim.AdamW(theirs.parameters(), lr=1e-2, weight_decay=0.1)
    assert fused.defaults["fused"] is True and not default.defaults["fused"]
    for _ in range(5):
        grads = [torch.randn_like(p) for p in ours.parameters()]
        for model, optimizer in ((ours, fused), (theirs, default)):
            for p, g in zip(model.parameters(), grads):
                p.grad = g.clone()
            optimizer.step()
    for p, q in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)
    unfused = torch.optim.AdamW(theirs.parameters()).state_dict()
    default.load_state_dict(fused.state_dict())
    assert default.param_groups[0]["fused"] is True  # torch's optimizer takes the kernel of the groups it loads ...
    fused.load_state_dict(unfused)
    assert fused.param_groups[0]["fused"] is True  # ... ours keeps its own: a checkpoint from before the change resumes fused
    assert not fused_adamw([torch.nn.Parameter(torch.zeros(2, device="meta"))])
    assert not fused_adamw([torch.zeros(2, dtype=torch.int64)])


def test_the_report_is_rewritten_when_its_time_is_at_most_a_tenth_of_the_run():
    """ReportSchedule: a checkpoint writes the report once the run has trained 20 s, then only when the time since
    the last write ended is at least 9 times that write's duration (a 2 s report after 18 s more)."""
    from branchdiff.training.run_control import ReportSchedule

    now = [100.0]
    schedule = ReportSchedule(clock=lambda: now[0])

    def write(seconds: float):
        return lambda: now.__setitem__(0, now[0] + seconds)

    now[0] = 119.9
    assert not schedule.due()
    now[0] = 120.0
    assert schedule.due()
    schedule.write(write(2.0))  # ends at 122 s
    now[0] = 139.9
    assert not schedule.due()
    now[0] = 140.0
    assert schedule.due()
    schedule.write(write(0.5))  # ends at 140.5 s, took 0.5 s: due again 4.5 s later
    now[0] = 144.9
    assert not schedule.due()
    now[0] = 145.0
    assert schedule.due()


def test_the_first_iterations_held_out_evaluation_is_said_as_it_starts(tiny_model_dir, tmp_path, capsys):
    """The first iteration was silent for about 80 s on the default run (the base model's held-out evaluation, then the
    compile): it says what it does, once, above the bar."""
    eval_prompts = tmp_path / "held.txt"
    eval_prompts.write_text("one red circle on the left\n")
    run = tmp_path / "run"
    assert main(["train", "tiny-chain", *_overrides(tiny_model_dir, run, 2), "eval_every=1", f"prompts.eval={eval_prompts}",
                 "prompts.eval_seeds=1", "logging.report_to=none"]) == 0
    said = capsys.readouterr().err
    assert said.count("branchdiff: evaluating the base model on the held-out prompts first (every 1 iterations)...") == 1, said[-2000:]
