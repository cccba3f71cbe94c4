"""Instruction editing (docs/editing.md): prompt sets whose rows name source images, the flux-kontext and
qwen-image-edit families against their pipelines' own edits, a run that trains from such a set and
exports a LoRA the pipeline loads to the same edits, rewards that take `sources=`, `sample --image`, and
grids that put each source before its edits. Bad rows are refused when the set is read, naming file and row."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from branchdiff.cli import main
from branchdiff.core.rollout import NoiseAddress, SamplerSettings, grow
from branchdiff.core.tree import TreeSpec, build_tree
from branchdiff.data.prompts import load_prompt_set
from branchdiff.data.sources import FIT, MASK, SOURCES, source_images
from branchdiff.evaluation.evaluate import beside_sources
from branchdiff.models import load_adapter
from branchdiff.models.base import encode_for
from branchdiff.models.finetune import load_weights
from branchdiff.rewards.edit_consistency import EditConsistency
from branchdiff.rewards.multi import score_component
from test_cli_errors import error_line
from test_model_families import _train_overrides
from tiny_pipelines import SMALL_EDIT_AREAS, build_flux_kontext, build_qwen_image_edit, save_pipeline

PROMPTS = ["make the circle blue", "add a red square on the left"]
STEPS = 4
TOLERANCE = 1e-4


def _source(path, size: tuple[int, int], seed: int) -> None:
    """A small RGB image (height, width): a coloured background with a brighter block."""
    rng = np.random.default_rng(seed)
    pixels = np.broadcast_to(rng.integers(0, 256, 3, dtype=np.uint8), (*size, 3)).copy()
    pixels[size[0] // 4 : size[0] // 2, size[1] // 4 : size[1] // 2] = rng.integers(128, 256, 3, dtype=np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path)


EDITING = ("flux-kontext", "qwen-image-edit")


@pytest.fixture(scope="module", autouse=True)
def small_edit_areas():
    """The tiny Qwen-Image-Edit's source areas, in the pipeline's module, which the adapter reads too."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as release

    before = {name: getattr(release, name) for name in SMALL_EDIT_AREAS}
    for name, value in SMALL_EDIT_AREAS.items():
        setattr(release, name, value)
    yield
    for name, value in before.items():
        setattr(release, name, value)


@pytest.fixture(scope="module")
def kontext(tmp_path_factory):
    root = tmp_path_factory.mktemp("editing")
    build_flux_kontext().save_pretrained(root / "flux-kontext", safe_serialization=True)
    build_qwen_image_edit().save_pretrained(root / "qwen-image-edit", safe_serialization=True)
    build_qwen_image_edit(zero_cond_t=True).save_pretrained(root / "qwen-image-edit-2511", safe_serialization=True)
    for index in range(2):
        _source(root / "data" / "images" / f"square-{index}.png", (32, 32), index)
        _source(root / "data" / "images" / f"tall-{index}.png", (32, 16), 10 + index)
    _source(root / "data" / "images" / "wide.png", (32, 96), 20)
    rows = [{"prompt": prompt, "image": f"images/square-{index}.png"} for index, prompt in enumerate(PROMPTS)]
    (root / "data" / "edits.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return root


def _load(root, family: str):
    """The saved tiny pipeline through `from_pretrained`, as the adapter loads it (its tokenizers reloaded alike)."""
    from diffusers import FluxKontextPipeline, QwenImageEditPlusPipeline

    pipeline = FluxKontextPipeline if family == "flux-kontext" else QwenImageEditPlusPipeline
    pipe = pipeline.from_pretrained(str(root / family), dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _edits(adapter, metadata: list[dict], guidance: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """branchdiff's ODE edits, one per prompt: (initial latents, images)."""
    tree = build_tree(TreeSpec(STEPS, roots=1, sde_steps=frozenset()), len(PROMPTS))
    rollout = grow(adapter, tree, encode_for(adapter, PROMPTS, metadata), adapter.schedule(STEPS), SamplerSettings(guidance=guidance),
                   NoiseAddress(3, 0, (0, 1)))
    roots = torch.arange(tree.level_start[0], tree.level_start[1])
    return rollout.latents[roots], adapter.decode(rollout.leaf_latents)


def _pipeline_edits(pipe, family: str, metadata: list[dict], initial: torch.Tensor, size: tuple[int, int], guidance: float,
                    negatives: tuple[str, ...] = (" ", " ")) -> torch.Tensor:
    """The pipeline's edits of the same sources from the same initial latents. Kontext: `max_area` the output's
    (its default rescales any size to a megapixel) and the sources at the output size, so `_auto_resize=False`
    encodes them there, as branchdiff does. Qwen-Image-Edit: one prompt per call (its pipeline's limit), true CFG
    against each prompt's of `negatives` (the family's " " by default)."""
    images = source_images(metadata)
    common = {"height": size[0], "width": size[1], "num_inference_steps": STEPS, "output_type": "pt"}
    if family == "flux-kontext":
        return pipe(prompt=list(PROMPTS), image=[row[0] for row in images], guidance_scale=guidance, latents=initial.clone(),
                    max_area=size[0] * size[1], _auto_resize=False, **common).images
    return torch.cat([pipe(prompt=prompt, image=row, negative_prompt=negatives[index], true_cfg_scale=guidance,
                           latents=initial[index : index + 1].clone(), **common).images for index, (prompt, row) in enumerate(zip(PROMPTS, images))])


@pytest.mark.parametrize(("family", "size"), [*((family, size) for family in EDITING for size in ((32, 32), (32, 16))),
                                             ("qwen-image-edit-2511", (32, 32)),
                                             pytest.param("qwen-image-edit-2511", (32, 16), marks=pytest.mark.slow)])
def test_edits_equal_the_pipelines(kontext, family, size):
    """Both solvers: branchdiff's steps and `--solver release` (the folder's own scheduler, the same here)."""
    from branchdiff.evaluation.evaluate import OdeSampling, sample_ode

    adapter = load_adapter(family.removesuffix("-2511"), str(kontext / family), resolution=list(size))
    kind = "square" if size == (32, 32) else "tall"
    metadata = [{SOURCES: [str(kontext / "data" / "images" / f"{kind}-{index}.png")]} for index in range(2)]
    initial, ours = _edits(adapter, metadata)
    theirs = _pipeline_edits(_load(kontext, family), family, metadata, initial, size, adapter.default_guidance)
    assert ours.shape == theirs.shape == (2, 3, *size) and ours.std() > 1e-3
    assert (ours - theirs).abs().max().item() <= TOLERANCE
    other = [{SOURCES: [row[SOURCES][0]]} for row in reversed(metadata)]  # the sources swapped: the edits follow them
    assert (_edits(adapter, other)[1] - ours).abs().max().item() > 5 * TOLERANCE  # 9e-4 measured on Kontext: the tiny model reads its source weakly
    release, _ = sample_ode(adapter, PROMPTS, OdeSampling(1, STEPS, solver="release"), metadata=metadata)
    stepped, _ = sample_ode(adapter, PROMPTS, OdeSampling(1, STEPS), metadata=metadata)
    assert (release - stepped).abs().max().item() <= TOLERANCE


def test_qwen_image_edit_takes_several_sources_as_its_pipeline(kontext):
    adapter = load_adapter("qwen-image-edit", str(kontext / "qwen-image-edit"), resolution=32)
    images = kontext / "data" / "images"
    metadata = [{SOURCES: [str(images / "square-0.png"), str(images / "square-1.png")]},
                {SOURCES: [str(images / "square-1.png"), str(images / "square-0.png")]}]
    initial, ours = _edits(adapter, metadata)
    theirs = _pipeline_edits(_load(kontext, "qwen-image-edit"), "qwen-image-edit", metadata, initial, (32, 32), adapter.default_guidance)
    assert (ours - theirs).abs().max().item() <= TOLERANCE
    assert (_edits(adapter, [{SOURCES: row[SOURCES][:1]} for row in metadata])[1] - ours).abs().max().item() > 5 * TOLERANCE



def test_qwen_image_edit_takes_each_rows_negative_prompt_as_its_pipeline(kontext):
    """A row's negative prompt enters the true-CFG rows with the row's sources, as `pipe(..., negative_prompt=...)`; a row
    without one keeps the family's " "."""
    adapter = load_adapter("qwen-image-edit", str(kontext / "qwen-image-edit"), resolution=32)
    metadata = [dict(row) for row in load_prompt_set(str(kontext / "data" / "edits.jsonl")).metadata]
    metadata[0]["negative_prompt"] = "blurry, washed out"
    initial, ours = _edits(adapter, metadata)
    theirs = _pipeline_edits(_load(kontext, "qwen-image-edit"), "qwen-image-edit", metadata, initial, (32, 32), adapter.default_guidance,
                             ("blurry, washed out", " "))
    assert (ours - theirs).abs().max().item() <= TOLERANCE
    assert (ours[0] - _edits(adapter, [{**metadata[0], "negative_prompt": ""}, metadata[1]])[1][0]).abs().max().item() > 1e-3

@pytest.mark.parametrize("family", EDITING)
def test_sources_of_another_shape_or_number_are_refused(kontext, family):
    """A source of another aspect ratio than the edits is refused under sources.fit refuse (it would be stretched, or make
    other token grids than its batch's), fitted otherwise; prompts of one batch carry as many sources (Kontext: one)."""
    adapter = load_adapter(family, str(kontext / family), resolution=32)
    images = kontext / "data" / "images"
    with pytest.raises(ValueError, match=r"a source image is 96×32 \(width × height\) and the edits 32×32, another aspect ratio, and "
                                         r"sources.fit is refuse: fit it \(sources.fit / --fit resize, crop or pad\).*\(docs/editing.md\)"):
        encode_for(adapter, PROMPTS, [{SOURCES: [str(images / "square-0.png")], FIT: "refuse"}, {SOURCES: [str(images / "wide.png")], FIT: "refuse"}])
    encode_for(adapter, PROMPTS, [{SOURCES: [str(images / "square-0.png")]}, {SOURCES: [str(images / "wide.png")]}])  # resized: one grid
    with pytest.raises(ValueError, match=rf"prompt 2 has 2 source images and (model.family={family} takes at most 1 per prompt|prompt 1 has 1: "
                                         rf"model.family={family} takes the same number with every prompt)"):
        encode_for(adapter, PROMPTS, [{SOURCES: [str(images / "square-0.png")]}, {SOURCES: [str(images / "square-0.png")] * 2}])


@pytest.mark.parametrize("family", EDITING)
def test_every_trained_parameter_of_an_editing_family_gets_a_gradient(kontext, family):
    from branchdiff.models.finetune import FullFinetune, LoraFinetune

    metadata = load_prompt_set(str(kontext / "data" / "edits.jsonl")).metadata
    for mode in ("all-linear", "full"):
        adapter = load_adapter(family, str(kontext / family), resolution=32)
        finetune = FullFinetune(adapter, keep_base=False) if mode == "full" else LoraFinetune(adapter, mode, rank=2, alpha=2.0, seed=0)
        latents = torch.randn(2, *adapter.latent_shape, generator=torch.Generator().manual_seed(0))
        adapter.predict(latents, adapter.schedule(STEPS).model_times[1].expand(2), encode_for(adapter, PROMPTS, metadata)).square().mean().backward()
        missing = [name for name, parameter in adapter.denoiser.named_parameters() if parameter.requires_grad and parameter.grad is None]
        assert not missing and len(finetune.params) > 0, (mode, missing[:4])


@pytest.mark.parametrize(("family", "finetune"), [*((family, "lora") for family in EDITING),
                                                   *(pytest.param(family, "full", marks=pytest.mark.slow) for family in EDITING)])
def test_a_run_trains_from_a_jsonl_of_edits_and_its_export_loads_into_the_pipeline(kontext, family, finetune, tmp_path):
    """One iteration from the JSONL (an edit-consistency term beside a preference-like reward), then the
    export (a LoRA, or the whole transformer): the pipeline with it makes branchdiff's edits; the evaluation
    grid starts each row with its source."""
    folder, edits, run = kontext / family, kontext / "data" / "edits.jsonl", tmp_path / "run"
    reward = "reward=[{name: rewards_for_tests:Redness}, {name: edit-consistency, weight: 0.5}]"
    rate = ["train.learning_rate=1e-3"] if finetune == "full" else []
    overrides = _train_overrides(family, folder, run, f"prompts.train={edits}", f"prompts.eval={edits}", reward, f"model.finetune={finetune}",
                                 "train.optimizer_every=0", *rate)
    assert main(["train", "tiny-chain", *overrides]) == 0
    metrics = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert np.isfinite(metrics["reward_edit-consistency"]) and 0 < metrics["reward_edit-consistency"] <= 1
    adapter = load_adapter(family, str(folder), resolution=32)
    metadata = load_prompt_set(str(edits)).metadata
    base = _edits(adapter, metadata)[1]
    load_weights(adapter, run)
    initial, ours = _edits(adapter, metadata)
    assert (ours - base).abs().max().item() > 1e-3  # training moved the model
    pipe = _load(kontext, family)
    if finetune == "full":
        pipe.transformer = type(pipe.transformer).from_pretrained(str(run / "transformer"))
    else:
        pipe.load_lora_weights(str(run / "lora"))
    assert (_pipeline_edits(pipe, family, metadata, initial, (32, 32), adapter.default_guidance) - ours).abs().max().item() <= TOLERANCE
    if (family, finetune) != ("flux-kontext", "lora"):
        return
    out = tmp_path / "eval"
    assert main(["eval", "--weights", str(run), "--prompts", str(edits), "--images-per-prompt", "2", "--steps", "2", "--rewards",
                 "edit-consistency", "--out", str(out)]) == 0
    from torchvision.io import read_image

    from branchdiff.report.figures import save_grid

    expected = save_grid(torch.zeros(2 * 3, 3, 32, 32), tmp_path / "expected.png", nrow=3)  # two rows: the source, then two edits
    assert read_image(str(out / "grid.png")).shape[-2:] == expected.shape[-2:]
    shown = beside_sources(torch.rand(4, 3, 32, 32), metadata, 2)  # what the grid shows: each row's source first
    source = torch.from_numpy(np.asarray(source_images(metadata)[1][0], dtype=np.float32) / 255).permute(2, 0, 1)
    assert shown.shape == (6, 3, 32, 32) and (shown[3] - source).abs().max().item() <= 1e-5


def test_sample_edits_the_image_given(kontext, tmp_path, capsys):
    source = kontext / "data" / "images" / "square-0.png"
    out = tmp_path / "out"
    assert main(["sample", "--family", "flux-kontext", "--model", str(kontext / "flux-kontext"), "--resolution", "32", "--prompt", PROMPTS[0],
                 "--image", str(source), "--steps", str(STEPS), "--images-per-prompt", "1", "--out", str(out)]) == 0
    written = sorted(out.glob("*.png"))
    assert len(written) == 1
    adapter = load_adapter("flux-kontext", str(kontext / "flux-kontext"), resolution=32)
    from branchdiff.evaluation.evaluate import OdeSampling, sample_ode

    expected, _ = sample_ode(adapter, [PROMPTS[0]], OdeSampling(1, STEPS), metadata=[{SOURCES: [str(source)]}])
    saved = torch.from_numpy(np.asarray(Image.open(written[0]), dtype=np.float32) / 255).permute(2, 0, 1)
    assert (saved - expected[0]).abs().max().item() <= 1 / 255 + 1e-6
    capsys.readouterr()
    assert main(["sample", "--family", "flux-kontext", "--model", str(kontext / "flux-kontext"), "--prompt", "a", "--prompt", "b",
                 "--image", str(source), "--image", str(source), "--image", str(source), "--out", str(tmp_path / "none")]) == 2
    assert "--image was given 3 times for 2 prompts" in error_line(capsys) and not (tmp_path / "none").exists()


@pytest.mark.parametrize("row, message", [
    ({"prompt": "x", "image": "images/missing.png"}, "edits.jsonl:2: source image 'images/missing.png' not found"),
    ({"prompt": "x", "image": "notes.png"}, "edits.jsonl:2: source image 'notes.png' could not be read as an image"),
    ({"prompt": "x", "image": 3}, "edits.jsonl:2: \"image\" must be a path or a list of paths to source images, got '3'"),
    ({"prompt": "x", "image": "images/square-0.png", "mask": "images/missing.png"}, "edits.jsonl:2: mask 'images/missing.png' not found"),
])
def test_bad_rows_are_refused_when_the_set_is_read_naming_the_row(kontext, tmp_path, capsys, row, message):
    data = tmp_path / "data"
    (data / "images").mkdir(parents=True)
    (data / "images" / "square-0.png").write_bytes((kontext / "data" / "images" / "square-0.png").read_bytes())
    (data / "notes.png").write_text("not an image")
    (data / "edits.jsonl").write_text(json.dumps({"prompt": "fine", "image": "images/square-0.png"}) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_prompt_set(str(data / "edits.jsonl"))
    overrides = _train_overrides("flux-kontext", kontext / "flux-kontext", tmp_path / "run", f"prompts.train={data / 'edits.jsonl'}")
    assert main(["train", "tiny-chain", *overrides]) == 2
    assert message in error_line(capsys) and not (tmp_path / "run").exists()


def test_a_csv_row_names_several_sources_and_a_text_family_refuses_them(kontext, tmp_path, capsys):
    csv = kontext / "data" / "edits.csv"
    csv.write_text('prompt,image,mask\n"make it blue",images/square-0.png|images/square-1.png,images/square-1.png\n')
    prompt_set = load_prompt_set(str(csv))
    images = kontext / "data" / "images"
    assert prompt_set.metadata == [{SOURCES: [str(images / "square-0.png"), str(images / "square-1.png")], MASK: str(images / "square-1.png"),
                                    FIT: "resize"}]
    sd3 = save_pipeline("sd3", tmp_path / "sd3")
    assert main(["train", "tiny-chain", *_train_overrides("sd3", sd3, tmp_path / "run", f"prompts.train={csv}")]) == 2
    assert "comes with a source image" in error_line(capsys) and not (tmp_path / "run").exists()
    text = tmp_path / "prompts.txt"
    text.write_text("make it blue\n")
    assert main(["train", "tiny-chain", *_train_overrides("flux-kontext", kontext / "flux-kontext", tmp_path / "run", f"prompts.train={text}")]) == 2
    assert "has no source image and model.family=flux-kontext edits images" in error_line(capsys)
    wide = kontext / "data" / "wide.jsonl"  # a source of another shape than the edits under sources.fit refuse: refused up front, naming the prompt
    wide.write_text(json.dumps({"prompt": "a", "image": "images/square-0.png"}) + "\n" + json.dumps({"prompt": "b", "image": "images/wide.png"}) + "\n")
    assert main(["train", "tiny-chain", *_train_overrides("flux-kontext", kontext / "flux-kontext", tmp_path / "run", f"prompts.train={wide}"),
                 "sources.fit=refuse"]) == 2
    assert "prompt 2 of " in (line := error_line(capsys)) and "wide.png' is 96×32 (width × height) and the edits 32×32" in line


def test_edit_consistency_scores_the_source_kept_outside_the_mask(tmp_path):
    """A result equal to its source except +0.2 on the left half: 1 − 0.1 without a mask, 1 with the left half
    masked as the edited region; a reward taking `sources=` gets each image's sources through the scoring boundary."""
    source = torch.rand(3, 8, 8, generator=torch.Generator().manual_seed(0)) * 0.5
    mask = np.zeros((8, 8), dtype=np.uint8)
    mask[:, :4] = 255
    Image.fromarray(mask).save(tmp_path / "mask.png")
    Image.fromarray((source.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)).save(tmp_path / "source.png")
    kept = torch.from_numpy(np.asarray(Image.open(tmp_path / "source.png"), dtype=np.float32) / 255).permute(2, 0, 1)
    result = kept.clone()
    result[:, :, :4] += 0.2
    metadata = [{SOURCES: [str(tmp_path / "source.png")]}, {SOURCES: [str(tmp_path / "source.png")], MASK: str(tmp_path / "mask.png")}]
    scores, _, failed = score_component(EditConsistency(), "edit-consistency", torch.stack([result, result]), ["a", "b"], metadata)
    assert not failed and torch.allclose(scores, torch.tensor([0.9, 1.0]), atol=1e-5)

    class Recorder:
        def __call__(self, images, prompts, metadata, sources=None):
            self.sources = sources
            return torch.zeros(len(images))

    recorder = Recorder()
    score_component(recorder, "recorder", torch.stack([result, result]), ["a", "b"], metadata)
    assert [len(row) for row in recorder.sources] == [1, 1] and torch.equal(recorder.sources[0][0], kept)
    assert beside_sources(torch.stack([result, result]), metadata[:1], 2).shape == (3, 3, 8, 8)
