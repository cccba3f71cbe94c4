"""Training at one size and evaluating at another (issue 49): `eval.resolution` and `eval.frames` set the final and
periodic evaluations' samples, their grids, eval.json, the report and `eval --weights RUN`; the plan measures the
evaluation phase at that size; what the model cannot make is refused before anything loads."""

from __future__ import annotations

import json

import pytest

from branchdiff.cli import main
from branchdiff.evaluation.evaluate import OdeSampling, sample_ode
from branchdiff.models import load_adapter
from branchdiff.models.finetune import load_weights
from rewards_for_tests import Redness
from test_cli_errors import error_line
from test_model_families import _train_overrides
from tiny_pipelines import save_pipeline

PROMPTS = ["a red circle on the left", "two blue squares at the top"]


@pytest.fixture(scope="module")
def sd3(tmp_path_factory):
    return save_pipeline("sd3", tmp_path_factory.mktemp("sd3") / "sd3")


def test_a_lora_trained_at_one_size_evaluates_at_another(sd3, tmp_path, capsys):
    """Trained at 32 × 32, evaluated at 16 × 32 (periodic and final): eval.json's trained scores are the Redness of a fresh
    adapter loaded at 16 × 32 with the run's LoRA, sampled from the same noise; the held-out grid and `eval --weights RUN`
    are at that size, and the card and report say so."""
    from PIL import Image

    prompts = tmp_path / "eval.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    run = tmp_path / "run"
    overrides = _train_overrides("sd3", sd3, run, "final_eval=true", "eval_every=1", "eval.resolution=[16,32]", f"prompts.eval={prompts}",
                                 "prompts.eval_seeds=2", "eval_rewards=[rewards_for_tests:Redness]", "logging.sample_every=1", "model.finetune=lora")
    assert main(["train", "tiny-chain", *overrides]) == 0
    evaluation = json.loads((run / "eval.json").read_text())
    assert evaluation["resolution"] == [16, 32]
    adapter = load_adapter("sd3", str(sd3), resolution=[16, 32])
    load_weights(adapter, run)
    images, _ = sample_ode(adapter, PROMPTS, OdeSampling(2, 4))  # the run's eval: 2 seeds, its 4 steps, the family's guidance
    assert images.shape == (4, 3, 16, 32)
    assert abs(Redness()(images, PROMPTS * 2, [{}] * 4).mean().item() - evaluation["trained"]["all"]["rewards_for_tests:Redness"]["mean"]) <= 1e-5
    assert Image.open(run / "samples" / "eval-iter-000000.png").size != Image.open(run / "samples" / "iter-000000.png").size
    metrics = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert "eval_rewards_for_tests:Redness" in metrics
    assert ", at 16 × 32, the same noise" in (run / "README.md").read_text()
    assert "the evaluations sample at 16 × 32" in (run / "report.html").read_text()
    capsys.readouterr()
    assert main(["eval", "--weights", str(run), "--out", str(tmp_path / "eval")]) == 0  # the run's eval size, unasked
    written = sorted((tmp_path / "eval" / "images").rglob("*.*"))
    assert len(written) == 4 and all(Image.open(path).size == (32, 16) for path in written)
    assert "differ from the run's final evaluation" not in capsys.readouterr().err  # the run's own settings, its size included


def test_a_video_run_evaluates_longer_clips_than_it_trains(tmp_path):
    """Wan trained on 5-frame clips evaluates 9-frame ones (eval.frames): eval.json says so and `eval --weights RUN` writes them."""
    import imageio.v3 as iio

    from tiny_pipelines import build_wan

    build_wan().save_pretrained(tmp_path / "wan", safe_serialization=True)
    prompts = tmp_path / "eval.txt"
    prompts.write_text(PROMPTS[0] + "\n")
    run = tmp_path / "run"
    assert main(["train", "tiny-chain", "model.family=wan", f"model.path={tmp_path / 'wan'}", "model.resolution=[16,32]", "model.frames=5",
                 "eval.frames=9", "model.finetune=lora", "reward={name: rewards_for_tests:Redness, frames: 2}", f"prompts.eval={prompts}",
                 "eval_rewards=[{name: rewards_for_tests:Redness, frames: 2}]", "prompts.per_iteration=1", "prompts.eval_seeds=1", "iterations=1",
                 "sampling.num_steps=2", "tree.roots=2", "logging.sample_every=0", "logging.report_to=none", f"output_dir={run}"]) == 0
    assert json.loads((run / "eval.json").read_text())["frames"] == 9
    assert main(["eval", "--weights", str(run), "--out", str(tmp_path / "eval")]) == 0
    (clip,) = (tmp_path / "eval" / "images").rglob("*.mp4")
    assert iio.imread(clip).shape == (9, 16, 32, 3)


def test_the_plan_measures_the_evaluation_at_its_own_size():
    """Trained at 512, evaluated at 1024: the evaluation phase is the one a run at 1024 plans, the training phases the 512 run's."""
    from branchdiff.plan import Estimator, Target, estimate
    from branchdiff.settings.load import load_config

    estimator = Estimator()
    mixed, small, large = (estimate(load_config("sd35-pickscore", overrides), Target(), estimator) for overrides in
                           (["model.resolution=512", "eval.resolution=1024"], ["model.resolution=512"], ["model.resolution=1024"]))
    assert mixed.phases["eval"] == large.phases["eval"] > small.phases["eval"]
    assert mixed.phases["rollout"] == small.phases["rollout"] < large.phases["rollout"] and mixed.phases["train"] == small.phases["train"]


@pytest.mark.parametrize("overrides, message", [
    (["eval.resolution=64"], "'eval.resolution' = 64: model.family=tiny makes only 32×32 images; leave eval.resolution unset"),
    (["eval.frames=9"], "'eval.frames' = 9: model.family=tiny makes images, not videos; leave eval.frames unset"),
    (["eval.resolution=[8,8,8]"], "'eval.resolution' = [8, 8, 8] is not an image size"),
])
def test_an_evaluation_size_the_model_cannot_make_is_one_line(tmp_path, capsys, overrides, message):
    assert main(["train", "tiny-chain", *overrides, f"output_dir={tmp_path / 'run'}"]) == 2
    assert message in error_line(capsys) and not (tmp_path / "run").exists()


def test_an_evaluation_size_off_the_folders_multiple_is_refused_before_loading(sd3, tmp_path, capsys):
    overrides = _train_overrides("sd3", sd3, tmp_path / "run", "final_eval=true", "eval.resolution=[16,18]")
    assert main(["train", "tiny-chain", *overrides]) == 2
    assert "eval.resolution=[16, 18] (height, width) is not possible for sd3" in error_line(capsys) and not (tmp_path / "run").exists()


def test_an_evaluation_size_is_checked_as_soon_as_the_model_loads(sd3, tmp_path):
    """Where the folder's configs could not be read beforehand (a hub id), the trainer refuses an evaluation size the loaded
    model cannot make before training, naming eval.resolution (the command line's preflight catches a local folder earlier)."""
    from branchdiff.settings.load import load_config
    from branchdiff.training.recipe import Trainer

    overrides = _train_overrides("sd3", sd3, tmp_path / "run", "final_eval=true", "eval.resolution=[16,18]")
    with pytest.raises(ValueError, match=r"eval.resolution=\[16, 18\] \(height, width\) is not possible for sd3"):
        Trainer(load_config("tiny-chain", overrides))


def test_sample_and_rewards_check_of_a_run_make_its_training_size_and_eval_its_evaluation_size(tmp_path):
    from branchdiff.settings.evaluation import resolve

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("")
    (run / "config.yaml").write_text("model: {family: wan, path: owner/wan, resolution: [16, 32], frames: 5}\neval: {resolution: [32, 64], frames: 9}\n")
    trained, _, _ = resolve({}, str(run))
    evaluated, _, _ = resolve({}, str(run), evaluation=True)
    assert (trained.resolution, trained.frames) == ([16, 32], 5) and (evaluated.resolution, evaluated.frames) == ([32, 64], 9)
