"""The built-in video model (`tiny-video`): loading and refusals, a training run whose grids play in
TensorBoard and the report, and a LoRA export that `WanPipeline.load_lora_weights` loads."""

import json

import imageio.v3 as iio
import numpy as np
import pytest
import torch

from branchdiff.models import load_adapter
from branchdiff.models.tiny_video import TinyVideoAdapter

UPSCALE, PAD = 4, 2  # save_grid's enlargement and make_grid's padding


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-video")
    TinyVideoAdapter.random(seed=0).save_pretrained(path)
    return path


def test_the_model_makes_five_frame_clips_and_refuses_other_sizes(model_dir):
    adapter = load_adapter("tiny-video", str(model_dir))
    assert adapter.latent_shape == (3, 5, 32, 32) and type(adapter.denoiser).__name__ == "WanTransformer3DModel"
    videos = torch.rand(2, 5, 3, 32, 32)
    assert torch.allclose(adapter.decode(adapter.encode_images(videos)), videos, atol=1e-6)
    latents = adapter.encode_images(videos)
    sigmas = torch.tensor([0.3, 0.9])
    velocity = adapter.forward(latents, sigmas, adapter.encode_prompts(["one red circle moving left", "two blue squares moving up"]))
    x0 = adapter.predict_x0(latents, sigmas, adapter.encode_prompts(["one red circle moving left", "two blue squares moving up"]))
    assert torch.allclose(velocity, (latents - x0) / sigmas.view(2, 1, 1, 1, 1), atol=1e-5)  # v = (x − x̂0) / σ per clip
    with pytest.raises(ValueError, match="makes 5-frame clips; model.frames=9 is not possible"):
        load_adapter("tiny-video", str(model_dir), frames=9)
    with pytest.raises(ValueError, match="makes 32×32 images"):
        load_adapter("tiny-video", str(model_dir), resolution=64)


def _strip_tiles(strip: np.ndarray, rows: int, cols: int, frames: int) -> np.ndarray:
    """Videos (rows·cols, F, H, W, 3) cut out of a saved grid of frame strips."""
    side = 32 * UPSCALE
    videos = []
    for row in range(rows):
        for col in range(cols):
            top, left = PAD + row * (side + PAD), PAD + col * (frames * side + PAD)
            videos.append([strip[top : top + side, left + f * side : left + (f + 1) * side] for f in range(frames)])
    return np.asarray(videos)


def _gif_tiles(gif: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """Videos (rows·cols, F, H, W, 3) cut out of a GIF of a grid (F, H', W', 3)."""
    side = 32 * UPSCALE
    return np.asarray([gif[:, PAD + r * (side + PAD) : PAD + r * (side + PAD) + side, PAD + c * (side + PAD) : PAD + c * (side + PAD) + side]
                       for r in range(rows) for c in range(cols)])


def test_a_run_logs_its_videos_to_the_trackers_and_the_report(model_dir, tmp_path, monkeypatch):
    """`branchdiff train tiny-video` for one iteration: the training and held-out grids are PNG strips, MP4s,
    and GIFs in TensorBoard's image summaries whose frames are the strips' frames (up to the GIF's palette),
    the same GIFs in W&B (offline) and SwanLab (local) as their videos; the report plays the videos; the
    held-out evaluation scores the verifier's attributes."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from branchdiff.cli import main

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("SWANLAB_MODE", "local")
    run = tmp_path / "run"
    assert main(["train", "tiny-video", f"model.path={model_dir}", f"output_dir={run}", "iterations=1", "eval_every=1",
                 "prompts.per_iteration=2", "prompts.eval_seeds=1", "logging.sample_every=1", "model.compile=none", "sampling.num_steps=4",
                 "tree.splits=[[0,2],[1,2]]", "tree.mix_window=2", "logging.report_to=[tensorboard,wandb,swanlab]"]) == 0
    wandb_gifs = {path.name.split("_0_")[0]: path.read_bytes() for path in (run / "logs" / "wandb").glob("offline-run-*/files/media/videos/samples/*.gif")}
    swanlab_gifs = {path.read_bytes() for path in (run / "logs" / "swanlab").glob("run-*/media/*/*.gif")}
    events = EventAccumulator(str(run / "logs" / "branchdiff"), size_guidance={"images": 0})
    events.Reload()
    assert sorted(events.Tags()["images"]) == ["samples/held_out", "samples/train"]
    for tag, grid, (rows, cols) in (("samples/train", "iter-000000", (2, 4)), ("samples/held_out", "eval-iter-000000", (4, 4))):
        summary = events.Images(tag)[0]
        assert wandb_gifs[tag.split("/")[1]] == summary.encoded_image_string and summary.encoded_image_string in swanlab_gifs
        gif = iio.imread(summary.encoded_image_string, index=None, extension=".gif")[..., :3]  # (F, H', W', 3)
        strip = iio.imread(run / "samples" / f"{grid}.png")[..., :3]
        assert gif.shape[0] == 5 and summary.step == 0 and (run / "samples" / f"{grid}.mp4").is_file()
        played, shown = _gif_tiles(gif, rows, cols).astype(float) / 255, _strip_tiles(strip, rows, cols, 5).astype(float) / 255
        matched, other = np.abs(played - shown).mean(), np.abs(played - shown[::-1]).mean()  # the same videos; others (tiles reversed)
        assert matched < 0.3 * other, (tag, matched, other)  # a random model's noisy frames lose ~0.05 to the GIF's 256 colours
    assert '<video class="grid"' in (run / "report.html").read_text()
    trained = json.loads((run / "eval.json").read_text())["trained"]["all"]
    assert {"tiny-video", "tiny-video.strict", "tiny-video.direction"} <= set(trained)


def test_a_lora_export_loads_into_a_wan_pipeline(model_dir, tmp_path):
    """A LoRA trained on the tiny-video model loads with `WanPipeline.load_lora_weights` into the same Wan
    transformer, which then predicts what the trained adapter predicts."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

    from branchdiff.settings.load import load_config
    from branchdiff.training.recipe import Trainer

    config = load_config("tiny-video", [f"model.path={model_dir}", "model.finetune=lora", "model.compile=none", "train.learning_rate=0.05", "iterations=1",
                                        "prompts.per_iteration=1", "sampling.num_steps=3", "tree.splits=[[0,2]]", "tree.mix_window=2",
                                        "final_eval=false", f"output_dir={tmp_path / 'run'}",
                                        "reward=flicker"])  # a continuous reward: two leaves never tie (the verifier's can: then nothing trains)
    trainer = Trainer(config)
    assert trainer.run_iteration(0).metrics["optimizer_steps"] >= 1
    trainer.adapter.save_lora(tmp_path / "lora")
    base = TinyVideoAdapter.from_pretrained(model_dir)
    pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=None, transformer=base.denoiser, scheduler=FlowMatchEulerDiscreteScheduler())
    latents, sigmas = torch.randn(2, 3, 5, 32, 32), torch.tensor([0.4, 0.8])
    embeds = base.encode_prompts(["one red circle moving left", "two green triangles moving down"])
    before = base.predict_x0(latents, sigmas, embeds)
    pipe.load_lora_weights(str(tmp_path / "lora"))
    with torch.no_grad():
        loaded, trained = base.predict_x0(latents, sigmas, embeds), trainer.adapter.predict_x0(latents, sigmas, embeds)
    assert (loaded - trained).abs().max().item() <= 1e-5 < (loaded - before).abs().max().item()


def test_bad_video_input_is_one_line_before_anything_is_written(model_dir, tmp_path, capsys):
    """Another frame count, an image reward without frames, an image prompt: one line, exit 2, no run folder."""
    from branchdiff.cli import main

    run = tmp_path / "run"
    cases = [
        (["model.frames=9"], "the tiny-video model makes 5-frame clips; model.frames=9 is not possible"),
        (["reward=tiny-geneval"], "'reward' entry 'tiny-geneval' scores images and the model makes videos: give it frames: N"),
        (["prompts.train=tiny:train"], "is not in the tiny-video grammar"),
    ]
    for overrides, message in cases:
        assert main(["train", "tiny-video", f"model.path={model_dir}", f"output_dir={run}", *overrides]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith("branchdiff: error: ") and message in err[-1] and sum("error" in line for line in err) == 1, err
        assert not run.exists()
