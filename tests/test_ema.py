"""The moving average of the trained weights (`train.ema_decay`): its arithmetic against the closed
form, its checkpoint file, and a run that evaluates and exports the average while training the live
weights. (A resume continuing the same average: tests/test_crash_resume.py; two processes:
tests/test_multiprocess.py.)"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from branchdiff.errors import ConfigError
from branchdiff.models.ema import WeightAverage
from branchdiff.settings.load import load_config


def _reference_average(history: list[list[torch.Tensor]], decay: float) -> list[torch.Tensor]:
    """θ̄ after steps n = 1..len(history), in float64: θ̄ = θ_1, then θ̄ ← d_n·θ̄ + (1 − d_n)·θ_n, d_n = min(decay, n/(n+9))."""
    average = [t.double() for t in history[0]]
    for n, values in enumerate(history[1:], start=2):
        d = min(decay, n / (n + 9))
        average = [d * a + (1 - d) * v.double() for a, v in zip(average, values)]
    return average


def test_the_average_follows_the_ramped_decay_and_survives_a_save():
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(3, 4, generator=generator)), torch.nn.Parameter(torch.randn(5, generator=generator))]
    average = WeightAverage(params, decay=0.3)  # the ramp n/(n+9) passes 0.3 at n = 4
    history = []
    for _ in range(6):
        with torch.no_grad():
            for p in params:
                p.add_(torch.randn(p.shape, generator=generator))
        history.append([p.detach().clone() for p in params])
        average.update()
    assert average.steps == 6
    expected = _reference_average(history, 0.3)
    with average.swapped_in():
        assert all(torch.allclose(p.double(), e, rtol=0, atol=1e-6) for p, e in zip(params, expected))
    assert all(torch.equal(p, h) for p, h in zip(params, history[-1]))  # the live weights are back


def test_a_saved_average_loads_into_a_new_one_and_continues_alike(tmp_path):
    params = [torch.nn.Parameter(torch.arange(6.0).reshape(2, 3))]
    first = WeightAverage(params, decay=0.9)
    for _ in range(3):
        with torch.no_grad():
            params[0].mul_(1.5)
        first.update()
    first.save(tmp_path)
    second = WeightAverage([torch.nn.Parameter(params[0].detach().clone())], decay=0.9)
    second.load(tmp_path)
    assert second.steps == 3
    for average in (first, second):
        with torch.no_grad():
            average.params[0].add_(1.0)
        average.update()
    assert torch.equal(first.average.shadow_params[0], second.average.shadow_params[0])
    wrong = WeightAverage([torch.nn.Parameter(torch.zeros(3, 2))], decay=0.9)
    with pytest.raises(ValueError, match="do not match the 1 trained parameters"):
        wrong.load(tmp_path)


def test_a_decay_of_one_is_refused_with_the_fix():
    with pytest.raises(ConfigError, match=r"'train.ema_decay' = 1 is not in \[0, 1\); use e.g. train.ema_decay=0.99"):
        load_config("tiny-mix", ["train.ema_decay=1"])


@pytest.mark.parametrize("finetune", ["lora", "full"])
def test_a_run_trains_the_live_weights_and_evaluates_and_exports_the_average(tiny_model_dir, tmp_path, finetune):
    """The average of the weights after each optimizer step (recorded), against the closed form;
    the evaluation grid is sampled with it, the export holds it, and training goes on with the live weights."""
    from branchdiff.evaluation.evaluate import OdeSampling, sample_ode
    from branchdiff.models.finetune import export
    from branchdiff.training.recipe import Trainer

    config = load_config("tiny-chain", [f"model.path={tiny_model_dir}", f"output_dir={tmp_path}", "iterations=3", "prompts.per_iteration=1",
                                        "tree.roots=2", "sampling.num_steps=2", "final_eval=false", "logging.report_to=none",
                                        "reward=rewards_for_tests:Redness", f"model.finetune={finetune}", "train.learning_rate=1e-2",
                                        "train.optimizer_every=2", "train.minibatch=1", "train.ema_decay=0.5"])
    trainer = Trainer(config)
    params = trainer.finetune.params
    history = []
    step = trainer.optimizer.step

    def recording_step(*args, **kwargs):
        result = step(*args, **kwargs)
        history.append([p.detach().clone() for p in params])
        return result

    trainer.optimizer.step = recording_step
    for iteration in range(3):
        trainer.run_iteration(iteration)
    assert len(history) == 6 and trainer.weight_average.steps == 6  # 4 edges per iteration, a step every 2
    expected = _reference_average(history, 0.5)
    grid, prompts = trainer.fixed_samples(prompts=1, images_per_prompt=1)
    live_images = sample_ode(trainer.adapter, prompts, OdeSampling(1, 2))[0]
    with trainer.evaluated_weights():
        assert all(torch.allclose(p.double(), e, rtol=0, atol=1e-6) for p, e in zip(params, expected))
        averaged_images = sample_ode(trainer.adapter, prompts, OdeSampling(1, 2))[0]
        export(trainer.finetune, tmp_path)
        averaged = {k: v.detach().clone() for k, v in trainer.adapter.denoiser.state_dict().items()}
    assert all(torch.equal(p, h) for p, h in zip(params, history[-1]))  # the live weights are back
    assert torch.equal(grid, averaged_images) and not torch.equal(grid, live_images)
    exported = {k: v for f in (tmp_path / trainer.finetune.export_name).glob("*.safetensors") for k, v in load_file(f).items()}
    if finetune == "full":
        assert exported.keys() == averaged.keys() and all(torch.equal(exported[k], averaged[k]) for k in exported)
    else:
        lora = {k.replace(".default", ""): v for k, v in averaged.items() if "lora_" in k}
        assert len(lora) == len(exported) and all(torch.equal(exported["transformer." + k], v) for k, v in lora.items())
