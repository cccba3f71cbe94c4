"""Wan image-to-video against diffusers (branchdiff/models/wan_i2v.py; issue 49): tiny random pipelines of
`WanImageToVideoPipeline`'s classes in the three released layouts (Wan 2.1 I2V with its CLIP vision encoder, Wan 2.2
I2V-A14B with two experts, Wan 2.2 TI2V-5B saved as its text-to-video pipeline, as released) are saved and loaded
through the adapter's loading code. branchdiff's ODE sampling from the same initial latents equals `pipe(image=...)`'s
video at a square and a non-square size; `--solver release` equals it with UniPC; LoRA and full fine-tuning exports
load into the pipeline to the same video; a run trains from a JSONL whose rows name images and resumes exactly;
`sample --image` writes an MP4 whose first frame is the source's (TI2V keeps it clean)."""

from __future__ import annotations

import json

import pytest
import torch

from branchdiff.cli import main
from branchdiff.core.rollout import NoiseAddress, SamplerSettings, grow
from branchdiff.core.tree import TreeSpec, build_tree
from branchdiff.data.prompts import load_prompt_set
from branchdiff.data.sources import FIT, SOURCES
from branchdiff.models import load_adapter
from branchdiff.models.base import encode_for
from branchdiff.models.finetune import load_weights
from branchdiff.models.wan_i2v import WanImageToVideoAdapter
from test_cli_errors import error_line
from test_editing import _source
from tiny_pipelines import build_wan, build_wan_i2v

PROMPTS = ["the circle rolls left", "the squares drift up"]
STEPS = 4
TOLERANCE = 1e-4  # max abs difference of frames in [0, 1], fp32
LAYOUTS = ("2.1", "a14b", "ti2v")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The three layouts (TI2V saved by its WanPipeline, as the release ships it), the 2.1 and TI2V layouts with UniPC, a
    text-to-video Wan, and a prompt set whose rows name 16×32 and 16×16 sources."""
    root = tmp_path_factory.mktemp("wan-i2v")
    pipes = {kind: build_wan_i2v(kind) for kind in ("2.1", "a14b")} | {"ti2v": build_wan(ti2v=True), "release": build_wan_i2v("2.1", release=True),
                                                                      "ti2v-release": build_wan(ti2v=True, release=True), "t2v": build_wan()}
    for name, pipe in pipes.items():
        pipe.save_pretrained(root / name, safe_serialization=True)
    data = root / "data"
    for shape, size in (("wide", (16, 32)), ("square", (16, 16))):
        for seed in (0, 1):
            _source(data / "images" / f"{shape}-{seed}.png", size, seed)
        rows = [{"prompt": prompt, "image": f"images/{shape}-{seed}.png"} for seed, prompt in enumerate(PROMPTS)]
        (data / f"{shape}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return root


def _metadata(saved, size: tuple[int, int]) -> list[dict]:
    return load_prompt_set(str(saved / "data" / f"{'wide' if size[1] > size[0] else 'square'}.jsonl")).metadata


def _ode_video(adapter: WanImageToVideoAdapter, metadata: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    tree = build_tree(TreeSpec(STEPS, roots=1, sde_steps=frozenset()), len(PROMPTS))
    with torch.no_grad():
        rollout = grow(adapter, tree, encode_for(adapter, PROMPTS, metadata), adapter.schedule(STEPS), SamplerSettings(), NoiseAddress(3, 0, (0, 1)))
    roots = torch.arange(tree.level_start[0], tree.level_start[1])
    return rollout.latents[roots], adapter.decode(rollout.leaf_latents)


def _pipe(folder):
    from diffusers import WanImageToVideoPipeline

    pipe = WanImageToVideoPipeline.from_pretrained(folder, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _pipeline_video(pipe, metadata: list[dict], initial: torch.Tensor, size: tuple[int, int], guidance: float) -> torch.Tensor:
    """The pipeline's video of each prompt from its source (one call a prompt, as the pipeline takes one image)."""
    from branchdiff.data.sources import source_images

    videos = [pipe(image=images[0], prompt=prompt, num_inference_steps=STEPS, height=size[0], width=size[1], num_frames=5, guidance_scale=guidance,
                   latents=initial[i : i + 1].clone(), output_type="pt", max_sequence_length=WanImageToVideoAdapter.max_sequence_length).frames
              for i, (prompt, images) in enumerate(zip(PROMPTS, source_images(metadata)))]
    return torch.cat(videos)


@pytest.mark.parametrize("size", [(16, 32), (16, 16)])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_ode_sampling_reproduces_the_image_to_video_pipeline(saved, layout, size):
    adapter = load_adapter("wan-i2v", str(saved / layout), resolution=list(size), frames=5)
    channels, factor = (12, 4) if layout == "ti2v" else (4, 2)
    assert adapter.latent_shape == (channels, 3, size[0] // factor, size[1] // factor)
    metadata = _metadata(saved, size)
    initial, ours = _ode_video(adapter, metadata)
    theirs = _pipeline_video(_pipe(saved / layout), metadata, initial, size, adapter.default_guidance)
    assert ours.shape == theirs.shape == (len(PROMPTS), 5, 3, *size)
    assert ours.std() > 1e-3 and (ours - theirs).abs().max().item() <= TOLERANCE
    if layout == "a14b":  # the schedule crosses the boundary: both experts ran
        times = adapter.schedule(STEPS).model_times
        assert (times >= adapter.boundary).any() and (times < adapter.boundary).any()


@pytest.mark.parametrize("layout", ["2.1", "ti2v"])
def test_a_first_frame_of_another_aspect_is_stretched_as_the_pipeline_stretches_it(saved, layout):
    """16×16 sources for 16×32 videos (sources.fit: resize, the default): the video equals `pipe(image=...)`'s from the
    same source (they were refused, 2.5 % off already); Wan 2.1's CLIP vision encoder reads the source whole, as the
    pipeline's does. Under crop the video differs."""
    adapter = load_adapter("wan-i2v", str(saved / layout), resolution=[16, 32], frames=5)
    metadata = _metadata(saved, (16, 16))
    initial, ours = _ode_video(adapter, metadata)
    theirs = _pipeline_video(_pipe(saved / layout), metadata, initial, (16, 32), adapter.default_guidance)
    assert ours.std() > 1e-3 and (ours - theirs).abs().max().item() <= TOLERANCE
    cropped = _ode_video(adapter, [{**row, FIT: "crop"} for row in metadata])[1]
    assert (cropped - ours).abs().max().item() > 1e-3


def test_the_source_conditions_the_video_and_ti2v_adds_nothing_to_the_ratio_on_its_first_frame(saved):
    """Another source changes the video; TI2V's first latent frame is predicted as the source's latent whatever
    the weights (its velocity is the same before and after a change of the transformer)."""
    adapter = load_adapter("wan-i2v", str(saved / "2.1"), resolution=[16, 32], frames=5)
    metadata = _metadata(saved, (16, 32))
    swapped = [metadata[1], metadata[0]]
    assert (_ode_video(adapter, metadata)[1] - _ode_video(adapter, swapped)[1]).abs().max().item() > 1e-3
    ti2v = load_adapter("wan-i2v", str(saved / "ti2v"), resolution=[16, 32], frames=5)
    embeds = encode_for(ti2v, PROMPTS, metadata)
    latents = torch.randn(2, *ti2v.latent_shape, generator=torch.Generator().manual_seed(0))
    times = ti2v.schedule(STEPS).model_times[1].expand(2)
    with torch.no_grad():
        before = ti2v.predict(latents, times, embeds)
        for parameter in ti2v.denoiser.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
        after = ti2v.predict(latents, times, embeds)
    assert torch.equal(before[:, :, 0], after[:, :, 0]) and (before[:, :, 1:] - after[:, :, 1:]).abs().max().item() > 1e-3
    sigma = times[0].item() / 1000
    assert torch.allclose(latents[:, :, 0] - sigma * before[:, :, 0], embeds["source_condition"][:, :, 0], atol=1e-5)


@pytest.mark.parametrize("folder", ["release", "ti2v-release"])
def test_the_release_solver_reproduces_the_pipeline_with_unipc(saved, folder):
    """Wan 2.1's layout and TI2V's with the released UniPC (whole-number timesteps): `--solver release` equals `pipe(...)`, and
    under the training ODE on UniPC's schedule TI2V's first latent frame still ends on the source's."""
    adapter = load_adapter("wan-i2v", str(saved / folder), resolution=[16, 32], frames=5)
    assert "UniPCMultistepScheduler" in adapter.solver_notice()
    metadata = _metadata(saved, (16, 32))
    initial = torch.randn((len(PROMPTS), *adapter.latent_shape), generator=torch.Generator().manual_seed(1))
    embeds = encode_for(adapter, PROMPTS, metadata)
    with torch.no_grad():
        released = adapter.release_denoise(initial.clone(), embeds, STEPS, adapter.default_guidance)
    ours = adapter.decode(released)
    theirs = _pipeline_video(_pipe(saved / folder), metadata, initial, (16, 32), adapter.default_guidance)
    assert ours.std() > 1e-3 and (ours - theirs).abs().max().item() <= TOLERANCE
    if folder == "ti2v-release":
        assert adapter.schedule(STEPS).model_times.dtype == torch.float32 and torch.equal(adapter.schedule(STEPS).model_times,
                                                                                          adapter.schedule(STEPS).model_times.round())
        tree = build_tree(TreeSpec(STEPS, roots=1, sde_steps=frozenset()), len(PROMPTS))
        with torch.no_grad():
            leaves = grow(adapter, tree, embeds, adapter.schedule(STEPS), SamplerSettings(), NoiseAddress(3, 0, (0, 1))).leaf_latents
        condition = embeds["source_condition"]
        assert (released[:, :, :1] - condition).abs().max().item() <= 1e-5 and (leaves[:, :, :1] - condition).abs().max().item() <= 1e-5


def _overrides(saved, layout: str, run, *extra: str) -> list[str]:
    data = saved / "data" / "wide.jsonl"
    return ["model.family=wan-i2v", f"model.path={saved / layout}", "model.resolution=[16,32]", "model.frames=5", f"prompts.train={data}",
            f"prompts.eval={data}", "prompts.per_iteration=2", "prompts.eval_seeds=1", "reward={name: rewards_for_tests:Redness, frames: 2}",
            "eval_rewards=[{name: rewards_for_tests:Redness, frames: 2}]",
            "sampling.num_steps=3", "tree.roots=2", "tree.splits=[[0,2]]", "train.learning_rate=0.05", "train.lora_rank=4", "train.lora_alpha=16",
            "final_eval=false", "logging.sample_every=0", "logging.report_to=none", "seed=4", f"output_dir={run}", *extra]


@pytest.mark.parametrize(("layout", "finetune"), [("2.1", "lora"), ("a14b", "lora"), pytest.param("ti2v", "full", marks=pytest.mark.slow)])
def test_a_run_trains_from_a_jsonl_of_images_and_its_export_loads_into_the_pipeline(saved, layout, finetune, tmp_path):
    """One iteration from the JSONL whose rows name the first frames; the export (a LoRA of the high-noise expert,
    A14B's low-noise one, or TI2V's whole transformer) makes the pipeline's video equal the trained adapter's."""
    run = tmp_path / "run"
    expert = ["model.expert=low"] if layout == "a14b" else []
    rate = ["train.learning_rate=1e-3"] if finetune == "full" else []
    assert main(["train", "tiny-chain", *_overrides(saved, layout, run, f"model.finetune={finetune}", "iterations=1", *expert, *rate)]) == 0
    metrics = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert metrics["logprob_check"] <= 1e-5 and metrics["optimizer_steps"] == 1
    adapter = load_adapter("wan-i2v", str(saved / layout), resolution=[16, 32], frames=5, expert="low" if expert else "high")
    metadata = _metadata(saved, (16, 32))
    base = _ode_video(adapter, metadata)[1]
    load_weights(adapter, run)
    initial, ours = _ode_video(adapter, metadata)
    assert (ours - base).abs().max().item() > 1e-3  # training moved the model
    pipe = _pipe(saved / layout)
    if finetune == "full":
        pipe.transformer = type(pipe.transformer).from_pretrained(str(run / "transformer"))
    else:
        pipe.load_lora_weights(str(run / "lora"), **({"load_into_transformer_2": True} if expert else {}))
    assert (_pipeline_video(pipe, metadata, initial, (16, 32), adapter.default_guidance) - ours).abs().max().item() <= TOLERANCE


@pytest.mark.slow  # release only: wan's own resume test runs the same loop in the suite
def test_a_run_killed_mid_iteration_resumes_to_the_same_weights_and_evaluates(saved, tmp_path):
    """SIGKILL inside iteration 3's optimizer step (after iteration 2's checkpoint), then `--resume latest`: the LoRA and
    the metrics equal a run never stopped, bit for bit; `eval` of the run makes one MP4 per row's source."""
    from resumed_runs import assert_killed_lora_run_equals_straight

    def args(run):
        return ["train", "tiny-chain", *_overrides(saved, "2.1", run, "model.finetune=lora", "iterations=4", "logging.checkpoint_every=2")]

    assert_killed_lora_run_equals_straight(args, tmp_path, 4)
    assert main(["eval", "--weights", str(tmp_path / "straight"), "--images-per-prompt", "1", "--steps", "2", "--out", str(tmp_path / "eval")]) == 0
    assert len(list((tmp_path / "eval" / "images").rglob("*.mp4"))) == len(PROMPTS)


def test_sample_image_writes_an_mp4_whose_first_frame_is_the_sources(saved, tmp_path, capsys):
    """TI2V keeps the first latent frame clean and the video VAE is causal: the first frame is the source through the
    VAE (encoded, then decoded alone), exactly in the sampled video and within the MP4's coding error in the file."""
    import imageio.v3 as iio

    from branchdiff.evaluation.evaluate import OdeSampling, sample_ode

    source = saved / "data" / "images" / "wide-0.png"
    out = tmp_path / "out"
    assert main(["sample", "--family", "wan-i2v", "--model", str(saved / "ti2v"), "--resolution", "16x32", "--frames", "5", "--steps", "3",
                 "--images-per-prompt", "1", "--prompt", PROMPTS[0], "--image", str(source), "--out", str(out)]) == 0
    written = capsys.readouterr().out.split()
    assert [path.rsplit(".", 1)[1] for path in written] == ["png", "mp4"]
    frames = torch.from_numpy(iio.imread(written[1])).float() / 255  # (F, H, W, 3)
    adapter = load_adapter("wan-i2v", str(saved / "ti2v"), resolution=[16, 32], frames=5)
    metadata = [{SOURCES: [str(source)]}]
    with torch.no_grad():
        latent = encode_for(adapter, [PROMPTS[0]], metadata)["source_condition"]  # (1, C, 1, h, w)
        single = adapter.pipe.vae.decode(adapter.vae_input(latent), return_dict=False)[0]  # (1, 3, 1, H, W)
    through_vae = adapter.pipe.video_processor.postprocess_video(single, output_type="pt")[0, 0]  # (3, H, W)
    video = sample_ode(adapter, [PROMPTS[0]], OdeSampling(1, 3), metadata=metadata)[0][0]  # (F, 3, H, W)
    assert frames.shape == (5, 16, 32, 3) and (video[0] - through_vae).abs().max().item() <= 1e-5
    assert (video[1] - through_vae).abs().max().item() > 0.1  # the later frames are made, not copied
    assert (frames[0] - through_vae.permute(1, 2, 0)).abs().mean().item() < 0.05  # H.264's 4:2:0 coding of a 16×32 frame


def test_image_to_video_input_is_checked_before_anything_loads(saved, tmp_path, capsys):
    """A prompt without a source, a source of another aspect ratio and a text-to-video folder each stop with one line."""
    bare = tmp_path / "bare.txt"
    bare.write_text("a circle\n")
    model = ["model.family=wan-i2v", f"model.path={saved / '2.1'}", "model.resolution=[16,32]", "model.frames=5", "final_eval=false",
             "reward={name: rewards_for_tests:Redness, frames: 2}", f"output_dir={tmp_path / 'run'}"]
    cases = [
        (["train", "tiny-chain", *model, f"prompts.train={bare}"], "has no source image and model.family=wan-i2v starts each video from an image: "
         "give every prompt its source (sample --image, or an \"image\" field or column of a JSONL or CSV prompt set; docs/video.md)"),
        (["train", "tiny-chain", *model, f"prompts.train={saved / 'data' / 'square.jsonl'}", "sources.fit=refuse"],
         "is 16×16 (width × height) and the videos 32×16, another aspect ratio, and sources.fit is refuse: fit it (sources.fit / --fit "
         "resize, crop or pad), crop or pad it to 32:16, or set model.resolution to its shape (docs/video.md)"),
    ]
    for argv, message in cases:
        assert main(argv) == 2
        assert message in error_line(capsys) and not (tmp_path / "run").exists()
    with pytest.raises(ValueError, match=r"model.path holds a text-to-video Wan \(its transformer reads 4 channels, not the noise, a 2-channel mask "
                                         r"and the first frame's latents: 10\); use model.family=wan"):
        load_adapter("wan-i2v", str(saved / "t2v"), resolution=[16, 32], frames=5)
    with pytest.raises(ValueError, match=r"model.path holds an image-to-video Wan \(its transformer reads 10 channels and makes 4\); use model.family=wan-i2v"):
        load_adapter("wan", str(saved / "2.1"), resolution=[16, 32], frames=5)
