"""A model folder whose scheduler is not the one branchdiff steps with: SANA's releases ship
DPM-Solver++ (flow sigmas), SD 1.5's PNDM. `--solver release` samples with it and must give the
pipeline's own images; a training run on such a folder says so in one line. SANA's instruction
prefix can be turned off (`model.prompt_instruction`, `--no-prompt-instruction`)."""

from __future__ import annotations

import pytest
import torch
from diffusers import DPMSolverMultistepScheduler, PNDMScheduler

from branchdiff.core.engine import initial_noise
from branchdiff.core.rollout import NoiseAddress
from branchdiff.core.tree import TreeSpec, build_tree
from branchdiff.evaluation.evaluate import OdeSampling, sample_ode
from branchdiff.models import load_adapter
from branchdiff.settings.evaluation import EVAL_RUN_SEED
from test_model_families import PROMPTS, TOLERANCE, _pipeline_images, _train_overrides
from tiny_pipelines import RESOLUTION, build_pipeline, load_pipeline

STEPS = 4
RELEASE_SCHEDULERS = {  # the schedulers of the released folders (their scheduler_config.json)
    "sana": lambda: DPMSolverMultistepScheduler(num_train_timesteps=1000, algorithm_type="dpmsolver++", solver_order=2,
                                                prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0,
                                                final_sigmas_type="zero", lower_order_final=True),
    "sd15": lambda: PNDMScheduler(num_train_timesteps=1000, beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012,
                                  set_alpha_to_one=False, skip_prk_steps=True, steps_offset=1),
}


FAMILIES = ("sd3", "flux", "sana", "sd15", "z-image", "qwen-image", "flux2", "flux2-klein")  # all but sana and sd15 ship the flow-matching Euler scheduler branchdiff steps with


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    folders = {}
    for family in FAMILIES:
        pipe = build_pipeline(family)
        if family in RELEASE_SCHEDULERS:
            pipe.scheduler = RELEASE_SCHEDULERS[family]()
        folders[family] = tmp_path_factory.mktemp(family)
        pipe.save_pretrained(folders[family], safe_serialization=True)
    return folders


def _initial_latents(adapter, prompts: int) -> torch.Tensor:
    """The evaluation's addressable initial noise of one image per prompt (iteration -1 of the eval seed)."""
    tree = build_tree(TreeSpec(STEPS, roots=1, sde_steps=frozenset()), prompts)
    roots = torch.arange(tree.level_start[0], tree.level_start[1])
    address = NoiseAddress(EVAL_RUN_SEED, -1, tuple(range(prompts)))
    return initial_noise(address, tree.prompt[roots].tolist(), [tree.paths[r] for r in roots.tolist()], adapter.latent_shape, "cpu")


@pytest.mark.parametrize("family", FAMILIES)
def test_the_release_solver_reproduces_the_pipelines_own_images(released, family):
    """SANA's DPM-Solver++ and SD 1.5's PNDM give other images than branchdiff's steps; where the
    folder ships the flow-matching Euler scheduler (all other families), both solvers are the pipeline's."""
    torch.set_num_threads(1)
    adapter = load_adapter(family, str(released[family]), resolution=RESOLUTION[family])
    ours, _ = sample_ode(adapter, PROMPTS, OdeSampling(1, STEPS, solver="release"))
    theirs = _pipeline_images(load_pipeline(family, released[family]), family, _initial_latents(adapter, len(PROMPTS)), STEPS,
                              adapter.default_guidance)
    assert ours.shape == theirs.shape and ours.std() > 1e-3
    assert (ours - theirs).abs().max().item() <= TOLERANCE
    stepped, _ = sample_ode(adapter, PROMPTS, OdeSampling(1, STEPS))  # branchdiff's own ODE steps
    if family in RELEASE_SCHEDULERS:
        assert (stepped - ours).abs().max().item() > 1e-3 and adapter.solver_notice() is not None
    else:
        assert (stepped - ours).abs().max().item() <= TOLERANCE and adapter.solver_notice() is None


def test_training_on_a_folder_with_another_solver_prints_the_notice(released, tmp_path, capsys):
    from branchdiff.settings.load import load_config
    from branchdiff.training.recipe import Trainer

    Trainer(load_config(None, _train_overrides("sana", released["sana"], tmp_path / "run")))
    notice = [line for line in capsys.readouterr().err.splitlines() if "DPMSolverMultistepScheduler" in line]
    assert len(notice) == 1 and "--solver release" in notice[0] and "FlowMatchEulerDiscreteScheduler" in notice[0]


def test_sample_and_eval_on_a_folder_with_another_solver_print_the_notice(released, tmp_path, capsys):
    """As training does: without --solver release, a line says the folder ships DPM-Solver++ and that
    the images come from branchdiff's steps (sample said nothing); with it, no line."""
    from branchdiff.cli import main

    common = ["--family", "sana", "--model", str(released["sana"]), "--resolution", "32", "--steps", "2", "--images-per-prompt", "1"]
    assert main(["sample", *common, "--prompt", "a red circle", "--out", str(tmp_path / "sampled")]) == 0
    notice = [line for line in capsys.readouterr().err.splitlines() if "DPMSolverMultistepScheduler" in line]
    assert len(notice) == 1 and notice[0].startswith("note: model.path ships the sampler") and "--solver release" in notice[0]
    assert main(["sample", *common, "--solver", "release", "--prompt", "a red circle", "--out", str(tmp_path / "released")]) == 0
    assert "DPMSolverMultistepScheduler" not in capsys.readouterr().err


def test_sample_takes_the_release_solver_and_refuses_it_with_a_search(released, tmp_path, capsys):
    """`sample --solver release` writes the pipeline's own image (its 8-bit pixels) for the same noise."""
    from torchvision.io import read_image

    from branchdiff.cli import main
    from branchdiff.rewards.base import to_uint8

    # 4 steps: at 2, DPM-Solver++ (second order, first order at the last step) is Euler's first-order step and the images agree
    common = ["--family", "sana", "--model", str(released["sana"]), "--resolution", "32", "--steps", str(STEPS), "--prompt", "a red circle"]
    assert main(["sample", *common, "--solver", "release", "--images-per-prompt", "1", "--out", str(tmp_path / "release")]) == 0
    written = list((tmp_path / "release").glob("*.png"))
    assert len(written) == 1
    adapter = load_adapter("sana", str(released["sana"]), resolution=32)
    pipeline = _pipeline_images(load_pipeline("sana", released["sana"]), "sana", _initial_latents(adapter, 1), STEPS, adapter.default_guidance,
                                prompts=["a red circle"])
    difference = (read_image(str(written[0])).int() - to_uint8(pipeline)[0].int()).abs()
    assert difference.max().item() <= 1 and pipeline.std() > 1e-3  # a pixel may round the other way: ≤ 1e-4 in [0, 1] is < 1/255
    assert main(["sample", *common, "--solver", "release", "--search", "dts", "--budget", "8", "--out", str(tmp_path / "x")]) == 2
    assert "leave --solver unset with --search" in capsys.readouterr().err


def test_sanas_instruction_prefix_can_be_turned_off(released):
    """Off: the embeddings are the pipeline's encode_prompt without complex_human_instruction (the bare prompt)."""
    on = load_adapter("sana", str(released["sana"]), resolution=32)
    off = load_adapter("sana", str(released["sana"]), resolution=32, instruction=False)
    with_instruction, bare = on.encode_prompts(PROMPTS[:1]), off.encode_prompts(PROMPTS[:1])
    pipe = load_pipeline("sana", released["sana"])
    expected = pipe.encode_prompt(PROMPTS[:1], do_classifier_free_guidance=True, negative_prompt="", device="cpu",
                                  max_sequence_length=off.max_sequence_length, complex_human_instruction=None)[0]
    assert torch.equal(bare["encoder_hidden_states"], expected)
    assert bare["encoder_hidden_states"].shape != with_instruction["encoder_hidden_states"].shape or \
        not torch.equal(bare["encoder_hidden_states"], with_instruction["encoder_hidden_states"])


def test_prompt_instruction_is_refused_for_families_without_one():
    from branchdiff.errors import ConfigError
    from branchdiff.settings.load import load_config

    with pytest.raises(ConfigError, match="model.family=sd3 has none"):
        load_config(None, ["model.family=sd3", "model.path=x", "model.prompt_instruction=false"])
