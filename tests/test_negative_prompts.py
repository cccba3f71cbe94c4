"""Per-prompt negative prompts (issue 49): a JSONL or CSV row's "negative_prompt" is its CFG rows' unconditional
prompt in rollouts, training forwards and evaluation. Every CFG family of the tiny pipelines samples from such rows
as its pipeline does with `negative_prompt=[...]` (CFG: SD3, SD 1.5, SANA, Z-Image, FLUX.2 [klein]; true CFG:
Qwen-Image); a blank row takes the family's own; a run draws them with its prompts; bad rows and families without CFG
are refused in one line before anything loads."""

from __future__ import annotations

import json

import pytest
import torch

from branchdiff.cli import main
from branchdiff.data.prompts import load_prompt_set
from branchdiff.evaluation.evaluate import OdeSampling, sample_ode
from branchdiff.models import adapter_class, load_adapter
from test_cli_errors import error_line
from test_model_families import _train_overrides
from tiny_pipelines import CALL_KWARGS, FAMILIES, GUIDANCE_ARGUMENT, RESOLUTION, load_pipeline, save_pipeline

PROMPTS = ["a red circle on the left", "two blue squares at the top"]
NEGATIVES = ["blurry, grey, low contrast", ""]  # the second row blank: the family's own negative prompt
CFG_FAMILIES = [family for family in FAMILIES if adapter_class(family).uses_cfg]
STEPS = 4
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    root = tmp_path_factory.mktemp("negatives")
    (root / "rows.jsonl").write_text("".join(json.dumps({"prompt": p, "negative_prompt": n}) + "\n" for p, n in zip(PROMPTS, NEGATIVES)))
    (root / "plain.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    (root / "rows.csv").write_text("prompt,negative_prompt\n" + "".join(f'"{p}","{n}"\n' for p, n in zip(PROMPTS, NEGATIVES)))
    return root


def test_the_cfg_families_are_those_of_both_guidance_kinds():
    assert {"sd3", "qwen-image"} <= set(CFG_FAMILIES) and "flux" not in CFG_FAMILIES


@pytest.mark.parametrize("family", CFG_FAMILIES)
def test_each_rows_negative_prompt_samples_as_the_pipelines_negative_prompt(rows, family, tmp_path):
    """branchdiff's evaluation sampling (one prompt a call, as `eval` encodes them) from the JSONL equals `pipe(...,
    negative_prompt=[row's, family's])` from the same noise, and differs from sampling without the rows' negatives."""
    folder = save_pipeline(family, tmp_path / family)
    adapter = load_adapter(family, str(folder), resolution=RESOLUTION[family])
    metadata = load_prompt_set(str(rows / "rows.jsonl")).metadata
    assert load_prompt_set(str(rows / "rows.csv")).metadata == metadata  # a CSV column reads as the JSONL field
    sampling = OdeSampling(1, STEPS, guidance=adapter.default_guidance)
    ours, _ = sample_ode(adapter, PROMPTS, sampling, metadata=metadata)
    plain, _ = sample_ode(adapter, PROMPTS, sampling, metadata=[{}, {}])
    initial = _initial_latents(adapter, sampling, metadata)
    negatives = [NEGATIVES[0], adapter.negative_prompt]
    guidance = {GUIDANCE_ARGUMENT.get(family, "guidance_scale"): adapter.default_guidance}
    pipe = load_pipeline(family, folder)

    def negative_argument(negative: str) -> dict:
        """FLUX.2 [klein]'s pipeline guides with "" unless given the negative's embeddings; the others take the text."""
        if family != "flux2-klein":
            return {"negative_prompt": [negative]}
        return {"negative_prompt_embeds": pipe.encode_prompt(prompt=[negative], device="cpu", max_sequence_length=adapter.max_sequence_length)[0]}

    theirs = torch.cat([pipe(prompt=[prompt], num_inference_steps=STEPS, height=RESOLUTION[family], width=RESOLUTION[family],
                             latents=initial[i : i + 1].clone(), output_type="pt", **{**CALL_KWARGS[family], **guidance, **negative_argument(negative)}).images
                        for i, (prompt, negative) in enumerate(zip(PROMPTS, negatives))])
    assert (ours - theirs).abs().max().item() <= TOLERANCE
    assert (ours[0] - plain[0]).abs().max().item() > 1e-3 and (ours[1] - plain[1]).abs().max().item() <= 1e-6  # the blank row: the family's


def _initial_latents(adapter, sampling: OdeSampling, metadata: list[dict]) -> torch.Tensor:
    """The initial noise `sample_ode` draws for each prompt: its tree's roots, grown from the same address."""
    from branchdiff.core.rollout import NoiseAddress, SamplerSettings, grow
    from branchdiff.core.tree import TreeSpec, build_tree
    from branchdiff.models.base import encode_for

    tree = build_tree(TreeSpec(STEPS, roots=1, sde_steps=frozenset()), len(PROMPTS))
    address = NoiseAddress(sampling.seed, -1, tuple(range(len(PROMPTS))))
    settings = SamplerSettings(max_batch=adapter.eval_batch, exact=True, guidance=sampling.guidance)
    with torch.no_grad():
        rollout = grow(adapter, tree, encode_for(adapter, PROMPTS, metadata), adapter.schedule(STEPS), settings, address)
    return rollout.latents[torch.arange(tree.level_start[0], tree.level_start[1])]


def test_a_run_draws_each_prompts_negative_with_it(rows, tmp_path):
    """A tree iteration on SD3 from the JSONL: the rollout's rewards differ from the same run without negatives, and the
    training forwards, which read the same embeddings, recompute the rollout's log-probs."""
    from branchdiff.settings.load import load_config
    from branchdiff.training.recipe import Trainer

    folder = save_pipeline("sd3", tmp_path / "sd3")
    rewards = {}
    for name in ("rows", "plain"):
        overrides = _train_overrides("sd3", folder, tmp_path / name, f"prompts.train={rows / f'{name}.jsonl'}", "train.lora_rank=2")
        metrics = Trainer(load_config("tiny-chain", overrides)).run_iteration(0).metrics
        assert metrics["logprob_check"] <= 1e-5 and metrics["optimizer_steps"] == 1
        rewards[name] = metrics["reward_mean"]
    assert rewards["rows"] != rewards["plain"]


@pytest.mark.parametrize("row, message", [
    ({"prompt": "x", "negative_prompt": 3}, 'rows.jsonl:1: "negative_prompt" must be a string (blank: the family\'s own), got \'3\''),
    ({"prompt": "x", "negative_prompt": ["a"]}, 'rows.jsonl:1: "negative_prompt" must be a string'),
])
def test_a_row_whose_negative_prompt_is_not_text_is_refused_naming_it(tmp_path, capsys, row, message):
    (tmp_path / "rows.jsonl").write_text(json.dumps(row) + "\n")
    assert main(["train", "tiny-chain", f"prompts.train={tmp_path / 'rows.jsonl'}", f"output_dir={tmp_path / 'run'}"]) == 2
    assert message in error_line(capsys) and not (tmp_path / "run").exists()


def test_a_negative_prompt_longer_than_the_encoders_read_is_refused_like_a_prompt(tmp_path, capsys):
    from branchdiff.evaluation.preflight import max_prompt_characters

    long = "blurry " * (max_prompt_characters("sd3") // 7 + 1)
    (tmp_path / "rows.jsonl").write_text(json.dumps({"prompt": "x", "negative_prompt": long}) + "\n")
    assert main(["train", "tiny-chain", "model.family=sd3", "model.path=owner/not-loaded", f"prompts.train={tmp_path / 'rows.jsonl'}",
                 f"output_dir={tmp_path / 'run'}"]) == 2
    line = error_line(capsys)
    assert line.startswith("branchdiff: error: negative prompt 1 of ") and f"rows.jsonl' is {len(long):,} characters" in line


def test_a_family_without_cfg_refuses_negative_prompts_before_loading(rows, tmp_path, capsys):
    for family, model in (("flux", ["model.path=owner/not-loaded"]), ("tiny", [])):
        assert main(["train", "tiny-chain", f"model.family={family}", *model, f"prompts.train={rows / 'rows.jsonl'}", f"output_dir={tmp_path / 'run'}"]) == 2
        line = error_line(capsys)
        assert f"prompt 1 of '{rows / 'rows.jsonl'}' has a negative prompt and model.family={family} has no classifier-free guidance" in line, line
        assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("family, path, overrides, message", [
    ("sd3", "owner/not-loaded", ["sampling.guidance=1"], "has a negative prompt, and sampling.guidance=1 samples model.family=sd3 without "
     "classifier-free guidance, so it would be ignored: raise sampling.guidance (the family's default is 4.5) or drop the \"negative_prompt\""),
    ("z-image", "owner/not-loaded", ["sampling.guidance=0"], "and sampling.guidance=0 samples model.family=z-image without classifier-free"),
    ("flux2-klein", "owner/FLUX.2-klein-4B", [], "has a negative prompt, and owner/FLUX.2-klein-4B samples without classifier-free guidance "
     "(a step-distilled release), so it would be ignored: drop the \"negative_prompt\" field or column"),
    ("sd3", "owner/not-loaded", ["prompts.eval_guidance=1", "prompts.eval={rows}/rows.jsonl", "prompts.train=tiny:train"],
     "has a negative prompt, and prompts.eval_guidance=1 samples model.family=sd3 without"),
])
def test_negative_prompts_at_a_guidance_that_runs_no_cfg_are_refused_before_loading(rows, tmp_path, capsys, family, path, overrides, message):
    """A CFG family sampled unguided (its scale at 1, z-image's at 0, a step-distilled FLUX.2 klein) never reads the
    rows' negative prompts: they were ignored in silence."""
    overrides = [override.format(rows=rows) for override in overrides]
    assert main(["train", "tiny-chain", f"model.family={family}", f"model.path={path}", f"prompts.train={rows / 'rows.jsonl'}",
                 f"output_dir={tmp_path / 'run'}", *overrides]) == 2
    assert message in error_line(capsys) and not (tmp_path / "run").exists()


def test_eval_refuses_negative_prompts_at_its_guidance_and_a_second_expert_that_guides_reads_them(rows, tmp_path, capsys):
    from branchdiff.evaluation.preflight import Guidance, check_negatives_guided

    assert main(["eval", "--family", "sd3", "--model", "owner/not-loaded", "--prompts", str(rows / "rows.jsonl"), "--guidance", "1",
                 "--rewards", "rewards_for_tests:Redness", "--out", str(tmp_path / "out")]) == 2
    assert "has a negative prompt, and --guidance=1 samples model.family=sd3 without classifier-free guidance" in error_line(capsys)
    assert not (tmp_path / "out").exists()
    # each of these guides, so the negatives are read: no refusal
    for family, guidance in (("wan", Guidance("sampling.guidance", 1.5)), ("sd3", Guidance("sampling.guidance", None)),
                             ("z-image", Guidance("sampling.guidance", 0.5)), ("flux2-klein", Guidance("sampling.guidance", None, "owner/FLUX.2-klein-base-4B"))):
        check_negatives_guided("prompt 1", family, guidance)
    with pytest.raises(ValueError, match="sampling.guidance=1 samples model.family=wan without classifier-free guidance"):
        check_negatives_guided("prompt 1", "wan", Guidance("sampling.guidance", 1.0))  # Wan 2.2's second scale is used only under CFG


def test_a_video_familys_rows_negative_prompt_samples_as_its_pipeline(rows, tmp_path):
    """Wan (text-to-video; its image-to-video family encodes text the same way): the JSONL's negatives equal
    `WanPipeline(..., negative_prompt=[...])`."""
    from diffusers import WanPipeline

    from tiny_pipelines import build_wan

    build_wan().save_pretrained(tmp_path / "wan", safe_serialization=True)
    adapter = load_adapter("wan", str(tmp_path / "wan"), resolution=[16, 32], frames=5)
    metadata = load_prompt_set(str(rows / "rows.jsonl")).metadata
    sampling = OdeSampling(1, STEPS, guidance=adapter.default_guidance)
    ours, _ = sample_ode(adapter, PROMPTS, sampling, metadata=metadata)
    initial = _initial_latents(adapter, sampling, metadata)
    pipe = WanPipeline.from_pretrained(tmp_path / "wan", dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    theirs = torch.cat([pipe(prompt=[prompt], negative_prompt=[negative], num_inference_steps=STEPS, height=16, width=32, num_frames=5,
                             guidance_scale=adapter.default_guidance, latents=initial[i : i + 1].clone(), output_type="pt",
                             max_sequence_length=adapter.max_sequence_length).frames
                        for i, (prompt, negative) in enumerate(zip(PROMPTS, [NEGATIVES[0], adapter.negative_prompt]))])
    assert (ours - theirs).abs().max().item() <= TOLERANCE
