"""Wan text-to-video against diffusers (branchdiff/models/wan.py; issue 28's second piece): tiny random
Wan pipelines of the same diffusers / transformers classes (one expert, as Wan 2.1; two, as Wan 2.2
A14B) are saved and loaded through the adapter's loading code, and branchdiff's ODE sampling from the
same initial latents equals `pipe(...)`'s video at two frame counts and a non-square size; the
released UniPC solver (`--solver release`) equals it too; rows of one batch on both sides of the
experts' boundary equal their separate calls; a LoRA export loads with `pipe.load_lora_weights()` to
the adapter's video; sizes and frame counts the model cannot make are refused with one line."""

from __future__ import annotations

import base64
import json

import pytest
import torch
from safetensors.torch import load_file

from branchdiff.core.rollout import NoiseAddress, SamplerSettings, grow
from branchdiff.core.tree import Split, TreeSpec, build_tree
from branchdiff.models.wan import WanAdapter, call_expert
from tiny_pipelines import build_wan

PROMPTS = ["a red circle moving left", "two blue squares moving up"]
STEPS = 4
SIZE = (16, 32)  # non-square: height, width
TOLERANCE = 1e-4  # max abs difference of frames in [0, 1], fp32


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("wan")
    folders = {}
    for name, options in {"one": {}, "two": {"two_experts": True}, "release": {"release": True}, "ti2v": {"ti2v": True}}.items():
        build_wan(**options).save_pretrained(root / name, safe_serialization=True)
        folders[name] = root / name
    return folders


def _pipe(folder):
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(folder, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _pipeline_video(pipe, initial: torch.Tensor, frames: int, guidance: float) -> torch.Tensor:
    return pipe(prompt=PROMPTS, num_inference_steps=STEPS, height=SIZE[0], width=SIZE[1], num_frames=frames, guidance_scale=guidance,
                latents=initial.clone(), output_type="pt", max_sequence_length=WanAdapter.max_sequence_length).frames


def _ode_video(adapter: WanAdapter) -> tuple[torch.Tensor, torch.Tensor]:
    tree = build_tree(TreeSpec(STEPS, roots=1, sde_steps=frozenset()), len(PROMPTS))
    with torch.no_grad():
        rollout = grow(adapter, tree, adapter.encode_prompts(PROMPTS), adapter.schedule(STEPS), SamplerSettings(), NoiseAddress(3, 0, (0, 1)))
    roots = torch.arange(tree.level_start[0], tree.level_start[1])
    return rollout.latents[roots], adapter.decode(rollout.leaf_latents)


@pytest.mark.parametrize("experts", ["one", "two", "ti2v"])
@pytest.mark.parametrize("frames", [5, 9])
def test_ode_sampling_reproduces_the_wan_pipeline(saved, experts, frames):
    """Wan 2.1 (one transformer), 2.2 A14B (two experts) and 2.2 TI2V-5B (a timestep per token, a VAE patchifying 2×2)."""
    adapter = WanAdapter.from_pretrained(str(saved[experts]), size=SIZE, frames=frames)
    channels, factor = (12, 4) if experts == "ti2v" else (4, 2)
    assert adapter.latent_shape == (channels, (frames - 1) // 2 + 1, SIZE[0] // factor, SIZE[1] // factor)
    initial, ours = _ode_video(adapter)
    theirs = _pipeline_video(_pipe(saved[experts]), initial, frames, adapter.default_guidance)
    assert ours.shape == theirs.shape == (len(PROMPTS), frames, 3, *SIZE)
    assert ours.std() > 1e-3 and (ours - theirs).abs().max().item() <= TOLERANCE
    if experts == "two":  # the schedule crosses the boundary: both experts ran
        times = adapter.schedule(STEPS).model_times
        assert (times >= adapter.boundary).any() and (times < adapter.boundary).any()


def test_the_low_noise_experts_own_guidance_reproduces_guidance_scale_2(saved):
    """`model.guidance_2` is the pipeline's guidance_scale_2: the video equals `pipe(..., guidance_scale_2=...)` and
    differs from sampling without it; a one-transformer model refuses it in one line."""
    adapter = WanAdapter.from_pretrained(str(saved["two"]), size=SIZE, frames=5, guidance_2=1.5)
    initial, ours = _ode_video(adapter)
    pipe = _pipe(saved["two"])
    theirs = pipe(prompt=PROMPTS, num_inference_steps=STEPS, height=SIZE[0], width=SIZE[1], num_frames=5, guidance_scale=adapter.default_guidance,
                  guidance_scale_2=1.5, latents=initial.clone(), output_type="pt", max_sequence_length=WanAdapter.max_sequence_length).frames
    assert (ours - theirs).abs().max().item() <= TOLERANCE
    assert (ours - _pipeline_video(pipe, initial, 5, adapter.default_guidance)).abs().max().item() > 1e-3
    with pytest.raises(ValueError, match=r"model.guidance_2=1.5 \(--guidance-2\) is the guidance of Wan 2.2's low-noise expert .* has one transformer"):
        WanAdapter.from_pretrained(str(saved["one"]), size=SIZE, frames=5, guidance_2=1.5)


def test_rows_on_both_sides_of_the_boundary_equal_their_separate_calls(saved):
    adapter = WanAdapter.from_pretrained(str(saved["two"]), size=SIZE, frames=5)
    embeds = adapter.encode_prompts(PROMPTS)
    latents = torch.randn((2, *adapter.latent_shape), generator=torch.Generator().manual_seed(0))
    times = torch.tensor([900.0, 300.0])  # the first for `transformer`, the second for `transformer_2`
    with torch.no_grad():
        together = adapter.predict(latents, times, embeds)
        apart = torch.cat([adapter.predict(latents[i : i + 1], times[i : i + 1], {k: v[i : i + 1] for k, v in embeds.items()}) for i in (0, 1)])
        inputs = {"hidden_states": latents[1:], "timestep": times[1:], "encoder_hidden_states": embeds["encoder_hidden_states"][1:]}
        first_only = call_expert(adapter.denoiser, inputs, adapter.dtype)
    assert torch.allclose(together, apart, atol=1e-6)
    assert not torch.allclose(first_only, call_expert(adapter.second, inputs, adapter.dtype))


def test_the_release_solver_reproduces_the_pipeline_with_unipc(saved):
    adapter = WanAdapter.from_pretrained(str(saved["release"]), size=SIZE, frames=5)
    assert "UniPCMultistepScheduler" in adapter.solver_notice()
    initial = torch.randn((len(PROMPTS), *adapter.latent_shape), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = adapter.decode(adapter.release_denoise(initial.clone(), adapter.encode_prompts(PROMPTS), STEPS, adapter.default_guidance))
    theirs = _pipeline_video(_pipe(saved["release"]), initial, 5, adapter.default_guidance)
    assert ours.std() > 1e-3 and (ours - theirs).abs().max().item() <= TOLERANCE


def _export_a_random_lora(adapter: WanAdapter, targets: str, folder) -> None:
    """A LoRA (rank 4, alpha 16) on the adapter's trained expert, its B matrices random (not zero), exported to `folder`."""
    from branchdiff.models.finetune import LoraFinetune

    finetune = LoraFinetune(adapter, targets, rank=4, alpha=16.0, seed=0)
    with torch.no_grad():
        for name, param in adapter.denoiser.named_parameters():
            if "lora_B" in name:
                param.copy_(0.05 * torch.randn(param.shape, generator=torch.Generator().manual_seed(len(name))))
    finetune.write_export(finetune.trained_state(), folder)


def test_a_lora_export_loads_into_the_pipeline_to_the_same_video(saved, tmp_path):
    adapter = WanAdapter.from_pretrained(str(saved["one"]), size=SIZE, frames=5)
    _export_a_random_lora(adapter, "attention+ff", tmp_path / "lora")
    initial, ours = _ode_video(adapter)
    pipe = _pipe(saved["one"])
    base = _pipeline_video(pipe, initial, 5, adapter.default_guidance)
    pipe.load_lora_weights(str(tmp_path / "lora"))
    loaded = _pipeline_video(pipe, initial, 5, adapter.default_guidance)
    assert (ours - base).abs().max().item() > 1e-3  # the LoRA changes the video
    assert (loaded - ours).abs().max().item() <= TOLERANCE


def test_sizes_and_frame_counts_it_cannot_make_are_refused(saved):
    with pytest.raises(ValueError, match=r"model.frames=6: a Wan video has r·k \+ 1 frames \(r = 2, the VAE's temporal factor\), e.g. 5"):
        WanAdapter.from_pretrained(str(saved["one"]), size=SIZE, frames=6)
    with pytest.raises(ValueError, match=r"model.resolution=\[24, 32\] \(height, width\) is not possible for wan: each side must be a multiple "
                                         r"of 16 \(e.g. \[32, 32\], or \[48, 64\] to keep its aspect ratio\)"):
        WanAdapter.from_pretrained(str(saved["one"]), size=(24, 32), frames=5)
    assert WanAdapter.folder_multiple(saved["one"]) == 16


def test_sample_writes_each_video_as_a_strip_and_an_mp4(saved, tmp_path, capsys):
    import imageio.v3 as iio
    from PIL import Image

    from branchdiff.cli import main

    assert main(["sample", "--family", "wan", "--model", str(saved["one"]), "--resolution", "16x32", "--frames", "5", "--steps", "2",
                 "--images-per-prompt", "1", "--prompt", "a red circle", "--out", str(tmp_path / "out")]) == 0
    written = capsys.readouterr().out.split()
    assert written == [str(tmp_path / "out" / "000-a_red_circle.png"), str(tmp_path / "out" / "000-a_red_circle.mp4")]
    assert Image.open(written[0]).size == (5 * 32, 16)  # the 5 frames side by side
    assert iio.imread(written[1]).shape == (5, 16, 32, 3)
    assert main(["sample", "--family", "sd3", "--model", "some/sd3", "--frames", "5", "--prompt", "x", "--out", str(tmp_path / "x")]) == 2
    assert "--frames 5: the sd3 family makes images, not videos; leave --frames unset" in capsys.readouterr().err


def test_a_video_run_trains_evaluates_and_exports_a_lora_the_pipeline_loads(saved, tmp_path):
    """`branchdiff train` on the tiny Wan: a tree iteration whose log-probs recompute (≤ 1e-5), an image
    reward scoring every 2nd frame, sample grids of frame strips, the final evaluation writing MP4s,
    and a LoRA export that `pipe.load_lora_weights()` loads to the trained adapter's video."""
    from branchdiff.cli import main
    from branchdiff.settings.load import load_config
    from branchdiff.training.recipe import Trainer

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle moving left\ntwo blue squares moving up\n")
    run = tmp_path / "run"
    overrides = ["model.family=wan", f"model.path={saved['one']}", "model.resolution=[16,32]", "model.frames=5", "model.finetune=lora",
                 f"prompts.train={prompts}", f"prompts.eval={prompts}", "prompts.per_iteration=2", "prompts.eval_seeds=1",
                 "reward={name: rewards_for_tests:Redness, frames: 2}", "eval_rewards=[{name: rewards_for_tests:Redness, frames: 2}]",
                 "sampling.num_steps=3", "tree.roots=2", "tree.splits=[[0,2]]", "train.learning_rate=0.05", "train.lora_rank=4",
                 "train.lora_alpha=16", "logging.sample_every=1", "logging.report_to=none", f"output_dir={run}"]
    assert main(["train", "tiny-chain", *overrides, "iterations=1"]) == 0
    assert (run / "samples" / "iter-000000.png").is_file() and (run / "report.html").is_file()
    playing = run / "samples" / "iter-000000.mp4"  # the grid of training videos, playing; the report embeds it
    assert playing.is_file() and '<video class="grid"' in (run / "report.html").read_text()
    assert base64.b64encode(playing.read_bytes()).decode() in (run / "report.html").read_text()
    assert json.loads((run / "eval.json").read_text())["trained"]["all"]["rewards_for_tests:Redness"]["nonfinite"] == 0
    assert main(["eval", "--weights", str(run), "--out", str(tmp_path / "eval")]) == 0  # the run's settings: frames, rewards with frames
    written = sorted(p.suffix for p in (tmp_path / "eval" / "images").rglob("*.*"))
    assert written == [".jpg", ".jpg", ".mp4", ".mp4"] and (tmp_path / "eval" / "grid.png").is_file()
    trainer = Trainer(load_config("tiny-chain", [*overrides, "iterations=1", f"output_dir={tmp_path / 'again'}", "final_eval=false"]))
    metrics = trainer.run_iteration(0).metrics
    assert metrics["logprob_check"] <= 1e-5 and metrics["optimizer_steps"] == 1
    trainer.adapter.save_lora(tmp_path / "lora")
    initial, trained = _ode_video(trainer.adapter)
    pipe = _pipe(saved["one"])
    pipe.load_lora_weights(str(tmp_path / "lora"))
    guidance = trainer.adapter.default_guidance
    loaded = pipe(prompt=PROMPTS, num_inference_steps=STEPS, height=16, width=32, num_frames=5, guidance_scale=guidance,
                  latents=initial.clone(), output_type="pt", max_sequence_length=WanAdapter.max_sequence_length).frames
    assert (loaded - trained).abs().max().item() <= TOLERANCE


def test_bad_video_input_is_one_line_before_anything_is_written(saved, tmp_path, capsys):
    """An image reward without `frames` on a video family, and a frame count the VAE cannot make, stop
    `train` and `eval` with one line and exit 2 before the run folder, the model or a reward is made."""
    from branchdiff.cli import main

    model = ["model.family=wan", f"model.path={saved['one']}", "model.resolution=[16,32]", "final_eval=false", f"output_dir={tmp_path / 'run'}"]
    cases = [
        (["train", "tiny-chain", *model, "model.frames=5", "reward=rewards_for_tests:Redness"],
         "'reward' entry 'rewards_for_tests:Redness' scores images and the model makes videos: give it frames: N"),
        (["train", "tiny-chain", *model, "model.frames=6", "reward={name: rewards_for_tests:Redness, frames: 2}"],
         "model.frames=6: a Wan video has r·k + 1 frames (r = 2, the VAE's temporal factor), e.g. 5"),
        (["eval", "--family", "wan", "--model", str(saved["one"]), "--resolution", "16x32", "--frames", "5", "--rewards",
          "rewards_for_tests:Redness", "--out", str(tmp_path / "eval")], "'--rewards' entry 'rewards_for_tests:Redness' scores images"),
    ]
    for argv, message in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith("branchdiff: error: ") and message in err[-1] and sum("error" in line for line in err) == 1, err
        assert not (tmp_path / "run").exists() and not (tmp_path / "eval").exists()


def test_rewards_check_scores_videos_through_their_frames(saved, capsys):
    from branchdiff.cli import main

    common = ["rewards", "check", "rewards_for_tests:Redness", "--family", "wan", "--model", str(saved["one"]), "--resolution", "16x32",
              "--frames", "5", "--steps", "2", "--num-prompts", "2", "--group-size", "2"]
    assert main(common) == 2
    assert "give --every-frame N (score every N-th frame) and --reduce mean or min" in capsys.readouterr().err
    assert main([*common, "--every-frame", "2", "--reduce", "min"]) == 0
    out = capsys.readouterr().out
    assert "4 images (2 prompts × 2)" in out and "within_group_std" in out


def test_a_video_run_killed_mid_iteration_resumes_to_the_same_weights(saved, tmp_path):
    """SIGKILL inside iteration 2's optimizer step (after the checkpoint of iteration 1), then
    `--resume latest`: the LoRA and the metrics equal a run never stopped, bit for bit."""
    from resumed_runs import assert_killed_lora_run_equals_straight

    def args(run):
        return ["train", "tiny-chain", "model.family=wan", f"model.path={saved['one']}", "model.resolution=[16,32]", "model.frames=5",
                "model.finetune=lora", "reward={name: rewards_for_tests:Redness, frames: 2}", "prompts.per_iteration=2", "iterations=4",
                "sampling.num_steps=3", "tree.roots=2", "tree.splits=[[0,2]]", "train.learning_rate=5e-2", "final_eval=false",
                "logging.checkpoint_every=2", "logging.sample_every=0", "logging.report_to=none", "seed=4", f"output_dir={run}"]

    assert_killed_lora_run_equals_straight(args, tmp_path, 4)


def test_the_low_noise_expert_trains_and_its_lora_loads_into_transformer_2(saved, tmp_path):
    """Wan 2.2 A14B with `model.expert=low`: the trained denoiser is transformer_2, sampling is the
    pipeline's as before, and its LoRA export loads with load_into_transformer_2=True to the same video
    (into transformer it gives another)."""
    from branchdiff.errors import ConfigError
    from branchdiff.settings.load import load_config

    adapter = WanAdapter.from_pretrained(str(saved["two"]), size=SIZE, frames=5, expert="low")
    pipe = _pipe(saved["two"])
    assert adapter.denoiser is adapter.pipe.transformer_2 and adapter.second is adapter.pipe.transformer
    initial, base = _ode_video(adapter)
    assert (base - _pipeline_video(pipe, initial, 5, adapter.default_guidance)).abs().max().item() <= TOLERANCE
    _export_a_random_lora(adapter, "attention", tmp_path / "lora")
    _, ours = _ode_video(adapter)
    pipe.load_lora_weights(str(tmp_path / "lora"), load_into_transformer_2=True)
    assert (ours - base).abs().max().item() > 1e-3 and (_pipeline_video(pipe, initial, 5, adapter.default_guidance) - ours).abs().max() <= TOLERANCE
    wrong = _pipe(saved["two"])
    wrong.load_lora_weights(str(tmp_path / "lora"))
    assert (_pipeline_video(wrong, initial, 5, adapter.default_guidance) - ours).abs().max().item() > 1e-3
    with pytest.raises(ValueError, match="model.expert=low trains Wan 2.2's low-noise expert .*this model has one transformer"):
        WanAdapter.from_pretrained(str(saved["one"]), size=SIZE, frames=5, expert="low")
    with pytest.raises(ConfigError, match="'model.expert' = 'low' chooses one of Wan 2.2's two experts; model.family=tiny has one denoiser"):
        load_config("tiny-chain", ["model.expert=low"])


def test_full_fine_tuning_with_gradient_checkpointing_exports_a_transformer_the_pipeline_takes(saved, tmp_path):
    """model.finetune=full, train.gradient_checkpointing=true, two iterations: the exported transformer/
    loads with WanTransformer3DModel.from_pretrained, and the pipeline built with it makes the video the
    trained adapter makes (its moving average, which evaluations and the export use)."""
    from diffusers import WanPipeline, WanTransformer3DModel

    from branchdiff.cli import main
    from branchdiff.models import load_adapter
    from branchdiff.models.finetune import load_weights

    run = tmp_path / "run"
    assert main(["train", "tiny-chain", "model.family=wan", f"model.path={saved['one']}", "model.resolution=[16,32]", "model.frames=5",
                 "model.finetune=full", "train.gradient_checkpointing=true", "train.learning_rate=1e-3", "train.ema_decay=0.5",
                 "reward={name: rewards_for_tests:Redness, frames: 2}", "prompts.per_iteration=2", "iterations=2", "sampling.num_steps=3",
                 "tree.roots=2", "tree.splits=[[0,2]]", "final_eval=false", "logging.sample_every=0", "logging.report_to=none",
                 f"output_dir={run}"]) == 0
    transformer = WanTransformer3DModel.from_pretrained(run / "transformer")
    pipe = WanPipeline.from_pretrained(saved["one"], transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    trained = load_adapter("wan", str(saved["one"]), resolution=SIZE, frames=5)
    load_weights(trained, run)  # the run folder's export, as sample/eval --weights RUN load it
    initial, ours = _ode_video(trained)
    base = _pipeline_video(_pipe(saved["one"]), initial, 5, trained.default_guidance)
    assert (ours - base).abs().max().item() > 1e-4  # it trained
    assert (_pipeline_video(pipe, initial, 5, trained.default_guidance) - ours).abs().max().item() <= TOLERANCE


def test_evaluation_forwards_and_decodes_stay_within_the_familys_batches(saved):
    """Evaluation runs Wan `eval_batch` (4) rows per forward and decodes `decode_batch` (1) video per VAE
    call, not the image families' 32 and 8 (at 33 frames of 480×832 those would add ~21 GiB and ~27 GiB:
    docs/memory-table.md); the samples equal one-prompt-at-a-time sampling."""
    from branchdiff.evaluation.evaluate import OdeSampling, sample_ode

    adapter = WanAdapter.from_pretrained(str(saved["one"]), size=SIZE, frames=5)
    assert (adapter.eval_batch, adapter.decode_batch) == (4, 1)
    forward_rows, decoded = [], []
    adapter.denoiser.register_forward_pre_hook(lambda module, args, kwargs: forward_rows.append(kwargs["hidden_states"].shape[0]), with_kwargs=True)
    decode = adapter.pipe.vae.decode
    adapter.pipe.vae.decode = lambda z, **kwargs: (decoded.append(z.shape[0]), decode(z, **kwargs))[1]
    videos, prompts = sample_ode(adapter, PROMPTS, OdeSampling(3, STEPS))
    assert videos.shape == (6, 5, 3, *SIZE) and prompts == [p for p in PROMPTS for _ in range(3)]
    assert set(forward_rows) == {4} and set(decoded) == {1} and len(decoded) == 6
    alone = torch.cat([sample_ode(adapter, [prompt], OdeSampling(3, STEPS), prompt_keys=[index])[0] for index, prompt in enumerate(PROMPTS)])
    assert torch.equal(videos, alone)


def _two_expert_run(saved, run, expert: str, *extra: str) -> list[dict]:
    """Two iterations of LoRA training on the two-expert Wan with `model.expert=expert`, one parent per
    minibatch (so a minibatch's rows are all one expert's); the run's metrics."""
    from branchdiff.cli import main

    assert main(["train", "tiny-chain", "model.family=wan", f"model.path={saved['two']}", "model.resolution=[16,32]", "model.frames=5",
                 "model.finetune=lora", f"model.expert={expert}", "reward={name: rewards_for_tests:Redness, frames: 2}",
                 "prompts.per_iteration=2", "iterations=2", f"sampling.num_steps={STEPS}", "tree.roots=2", "tree.splits=[[0,2],[2,2]]",
                 "train.learning_rate=5e-2", "train.minibatch=1", "final_eval=false", "logging.sample_every=0", "logging.report_to=none",
                 f"output_dir={run}", *extra]) == 0
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_one_trained_expert_trains_only_the_edges_it_predicts(saved, tmp_path):
    """Regression: with one expert trained, a minibatch whose rows the frozen expert predicts had a loss
    without gradient and the run crashed ("element 0 of tensors does not require grad"). Now those edges
    are left out: the edges expert=high and expert=low train add up to those expert=both trains, each
    as many as the SDE edges stepped from its side of the boundary; DiffusionNFT trains at the steps
    the trained expert predicts."""
    adapter = WanAdapter.from_pretrained(str(saved["two"]), size=SIZE, frames=5)
    times = adapter.schedule(STEPS).model_times  # (STEPS,) the time each step starts from
    tree = build_tree(TreeSpec(STEPS, roots=2, splits=(Split(0, 2), Split(2, 2))), 2)
    edge_times = times[tree.depth[tree.parent[tree.parent >= 0]]]  # (edges,) every edge of the trees, all SDE in tiny-chain's window
    trained = {expert: [m["edges_trained"] for m in _two_expert_run(saved, tmp_path / expert, expert)] for expert in ("high", "low", "both")}
    high = int((edge_times >= adapter.boundary).sum())
    assert 0 < high < len(edge_times)
    assert trained["high"] == [high] * 2 and trained["low"] == [len(edge_times) - high] * 2 and trained["both"] == [len(edge_times)] * 2
    # DiffusionNFT draws each leaf's steps among those the trained expert predicts (it crashed the same way)
    leaves, high_steps = int((tree.depth == STEPS).sum()), int((times >= adapter.boundary).sum())
    nft = _two_expert_run(saved, tmp_path / "nft", "high", "train.loss=nft", f"nft.timesteps={STEPS}")
    assert [m["nfe_trained"] for m in nft] == [leaves * high_steps] * 2 and all(m["optimizer_steps"] == 1 for m in nft)


def test_both_experts_train_in_one_run_and_their_loras_load_into_the_pipeline(saved, tmp_path):
    """model.expert=both: one run trains a LoRA on each expert; RUN/lora loads into transformer and
    RUN/lora/transformer_2 with load_into_transformer_2=True, and the pipeline then makes the video the
    adapter makes with the run's weights; full fine-tuning of both is refused in one line."""
    from branchdiff.errors import ConfigError
    from branchdiff.models.finetune import load_weights
    from branchdiff.settings.load import load_config

    run = tmp_path / "both"
    _two_expert_run(saved, run, "both")
    exports = {name: load_file(folder / "pytorch_lora_weights.safetensors")
               for name, folder in (("transformer", run / "lora"), ("transformer_2", run / "lora" / "transformer_2"))}
    for state in exports.values():  # each expert's B moved from 0
        assert state and max(v.abs().max().item() for k, v in state.items() if "lora_B" in k) > 1e-3
    adapter = WanAdapter.from_pretrained(str(saved["two"]), size=SIZE, frames=5, expert="both")
    initial, base = _ode_video(adapter)
    load_weights(adapter, run)
    _, ours = _ode_video(adapter)
    pipe = _pipe(saved["two"])
    pipe.load_lora_weights(str(run / "lora"))
    pipe.load_lora_weights(str(run / "lora" / "transformer_2"), load_into_transformer_2=True)
    theirs = _pipeline_video(pipe, initial, 5, adapter.default_guidance)
    assert (ours - base).abs().max().item() > 1e-3 and (theirs - ours).abs().max().item() <= TOLERANCE
    high_only = WanAdapter.from_pretrained(str(saved["two"]), size=SIZE, frames=5)
    with pytest.raises(ValueError, match="holds LoRAs of both Wan 2.2 experts .*load the run folder"):  # not transformer's alone, silently
        high_only.load_lora(run / "lora")
    from branchdiff.explore.quant import is_skipped  # a quantised explorer keeps each expert's embedders and output layers

    assert all(is_skipped(f"{name}.proj_out", adapter.quant_skip_modules) for name in ("transformer", "transformer_2"))
    with pytest.raises(ConfigError, match="'model.expert' = 'both' trains LoRA on Wan 2.2's two experts; full fine-tuning trains one"):
        load_config("tiny-chain", ["model.family=wan", f"model.path={saved['two']}", "model.expert=both", "model.finetune=full"])
    with pytest.raises(ValueError, match="model.expert=both trains Wan 2.2's low-noise expert \\(transformer_2\\) too, and this model has one transformer"):
        WanAdapter.from_pretrained(str(saved["one"]), size=SIZE, frames=5, expert="both")


def test_guidance_2_on_the_command_line_sets_the_low_noise_experts_scale(saved, tmp_path, capsys):
    """`sample --guidance-2` (and `eval`, which shares the option): the low-noise expert's scale, the pipeline's
    guidance_scale_2. Equal to --guidance it changes nothing; another value changes the frames; an image family or a
    model with one transformer refuses it in one line."""
    import numpy
    from PIL import Image

    from branchdiff.cli import main

    def strip(name: str, *extra: str) -> torch.Tensor:
        assert main(["sample", "--family", "wan", "--model", str(saved["two"]), "--resolution", "16x32", "--frames", "5", "--steps", "2",
                     "--images-per-prompt", "1", "--prompt", "a red circle", "--guidance", "3", "--out", str(tmp_path / name), *extra]) == 0
        capsys.readouterr()
        return torch.from_numpy(numpy.asarray(Image.open(tmp_path / name / "000-a_red_circle.png"))).float()

    plain = strip("plain")
    assert torch.equal(strip("same", "--guidance-2", "3"), plain)
    assert (strip("other", "--guidance-2", "1.5") - plain).abs().max() >= 1
    for argv, line in [
        (["sample", "--prompt", "x", "--guidance-2", "2", "--out", str(tmp_path / "x")], "--guidance-2 2 is the guidance of Wan 2.2's low-noise "
         "expert; the tiny family has one denoiser: leave --guidance-2 unset"),
        # Wan runs CFG only above a guidance of 1, as its pipeline: a second scale without it was ignored
        (["sample", "--family", "wan", "--model", str(saved["two"]), "--resolution", "16x32", "--frames", "5", "--prompt", "x", "--guidance", "1",
          "--guidance-2", "3", "--out", str(tmp_path / "z")], "--guidance-2 3 is the CFG scale of Wan 2.2's low-noise expert, and --guidance 1 runs "
         "no classifier-free guidance (above 1 guides), so it would be ignored: give --guidance above 1, or leave --guidance-2 unset"),
        (["eval", "--family", "wan", "--model", str(saved["one"]), "--resolution", "16x32", "--frames", "5", "--guidance-2", "2", "--rewards",
          "tiny-video", "--prompts", "tiny-video:held_out", "--out", str(tmp_path / "y")], "model.guidance_2=2.0 (--guidance-2) is the guidance of Wan 2.2's low-noise expert"),
    ]:
        assert main(argv) == 2
        error = capsys.readouterr().err.strip()
        assert line in error and len(error.splitlines()) == 1, error
