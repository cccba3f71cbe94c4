"""The model card (RUN/README.md, branchdiff/report/model_card.py) written at export, its usage for every
family, and `branchdiff push` against a stand-in for huggingface_hub's HfApi (the hub boundary only)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import yaml

from branchdiff.cli import main
from branchdiff.report.model_card import card_text


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("push") / "run"
    assert main(["train", "tiny-chain", f"output_dir={run}", "model.finetune=lora", "iterations=1", "logging.sample_every=1",
                 "prompts.eval_seeds=1", "logging.report_to=none"]) == 0
    return run


class Hub:
    """Records what branchdiff asks of huggingface_hub.HfApi, and the staged files' bytes."""

    calls: list[tuple[str, dict]] = []
    files: dict[str, bytes] = {}

    def __init__(self, *args, **kwargs) -> None:
        pass

    def create_repo(self, repo_id, **kwargs):
        Hub.calls.append(("create_repo", {"repo_id": repo_id, **kwargs}))

    def upload_folder(self, folder_path, repo_id, **kwargs):
        Hub.calls.append(("upload_folder", {"repo_id": repo_id, **kwargs}))
        Hub.files = {str(p.relative_to(folder_path)): p.read_bytes() for p in Path(folder_path).rglob("*") if p.is_file()}
        return type("Commit", (), {"oid": "abc123"})()


def test_the_card_is_written_at_export_with_the_evaluation(lora_run):
    card = (lora_run / "README.md").read_text()
    meta = yaml.safe_load(card.split("---")[1])
    assert meta["library_name"] == "diffusers" and {"lora", "template:sd-lora", "branchdiff"} <= set(meta["tags"])
    assert "| tiny-geneval.strict |" in card and "## How to use it" in card and meta["widget"][0]["output"]["url"].startswith("samples/")


def test_push_uploads_the_lora_at_the_root_with_the_card(lora_run, monkeypatch, capsys):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "HfApi", Hub)
    Hub.calls, Hub.files = [], {}
    assert main(["push", str(lora_run), "--repo-id", "me/tiny-lora", "--private"]) == 0
    assert [name for name, _ in Hub.calls] == ["create_repo", "upload_folder"]
    assert Hub.calls[0][1] == {"repo_id": "me/tiny-lora", "private": True, "exist_ok": True}
    weights = lora_run / "lora" / "pytorch_lora_weights.safetensors"
    assert Hub.files["pytorch_lora_weights.safetensors"] == weights.read_bytes()  # at the root: load_lora_weights("me/tiny-lora")
    assert {"README.md", "config.yaml", "eval.json"} <= set(Hub.files) and any(re.match(r"samples/.+\.png", f) for f in Hub.files)
    assert "--weights me/tiny-lora" in Hub.files["README.md"].decode()
    assert "pushed 5 files to https://huggingface.co/me/tiny-lora (abc123)" in capsys.readouterr().out


@pytest.mark.parametrize("argv,line", [
    (lambda run, tmp: ["push", str(tmp), "--repo-id", "me/x"], r"not a run folder \(no config.yaml\)"),
    (lambda run, tmp: ["push", str(run), "--repo-id", "x"], r"--repo-id x: a hub repository is OWNER/NAME"),
])
def test_bad_push_input_is_one_line(lora_run, tmp_path, argv, line, capsys):
    assert main(argv(lora_run, tmp_path)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.search(line, err)


def test_a_run_without_an_export_is_one_line(lora_run, tmp_path, capsys, monkeypatch):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "HfApi", Hub)
    (tmp_path / "config.yaml").write_text((lora_run / "config.yaml").read_text())
    (tmp_path / "metrics.jsonl").write_text((lora_run / "metrics.jsonl").read_text())
    assert main(["push", str(tmp_path), "--repo-id", "me/x"]) == 2
    assert "no exported weights (lora/ or transformer/, unet/)" in capsys.readouterr().err


def test_a_hub_that_refuses_the_connection_is_one_line_naming_it(lora_run, closed_port, hub_at, capsys):
    """It ended in two tracebacks (httpx ConnectError); now the hub's address, the tries and the fix."""
    hub_at(closed_port)
    assert main(["push", str(lora_run), "--repo-id", "me/x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err == (f"branchdiff: error: push to me/x: the hub at {closed_port} is not reachable (Connection refused) (3 attempts); check the "
                   "network connection and HF_ENDPOINT (unset: https://huggingface.co), or try again later\n")


def test_a_hub_that_never_answers_is_one_line_after_the_timeout(lora_run, silent_server, hub_at, capsys):
    """It waited forever, printing nothing; now each try waits --timeout seconds, three tries in all."""
    hub_at(silent_server)
    start = time.monotonic()
    assert main(["push", str(lora_run), "--repo-id", "me/x", "--timeout", "0.5"]) == 2
    assert time.monotonic() - start < 20  # 3 tries of 0.5 s and 1 + 2 s between them
    err = capsys.readouterr().err
    assert err == (f"branchdiff: error: push to me/x: the hub at {silent_server} did not answer within 0.5 s (3 attempts); check the "
                   "network connection and HF_ENDPOINT (unset: https://huggingface.co), or try again later; give more seconds with --timeout\n")


@pytest.mark.parametrize("family,export,expected", [
    ("sd3", "lora", 'pipe = StableDiffusion3Pipeline.from_pretrained("stabilityai/stable-diffusion-3.5-medium"'),
    ("flux", "lora", 'pipe.load_lora_weights("me/run")'),
    ("sana", "lora", "from diffusers import SanaPipeline"),
    ("sd15", "unet", 'from diffusers import UNet2DConditionModel, StableDiffusionPipeline\n\nunet = UNet2DConditionModel.from_pretrained("me/run", subfolder="unet"'),
    ("z-image", "lora", "from diffusers import ZImagePipeline"),
    ("qwen-image", "lora", "from diffusers import QwenImagePipeline"),
    ("flux2", "transformer", 'from diffusers import Flux2Transformer2DModel, Flux2Pipeline\n\ntransformer = Flux2Transformer2DModel.from_pretrained("me/run"'),
    ("flux2-klein", "lora", "from diffusers import Flux2KleinPipeline"),
    ("flux-kontext", "lora", "from diffusers import FluxKontextPipeline"),
    ("qwen-image-edit", "lora", "QwenImageEditPlusPipeline"),
    ("wan", "lora", 'video = pipe("a photo of a red circle").frames[0]'),
    ("wan-i2v", "lora", 'from diffusers.utils import load_image\n\npipe = WanImageToVideoPipeline.from_pretrained("owner/wan-i2v"'),
    ("wan-i2v", "lora", 'video = pipe(image=load_image("source.png"), prompt="the red circle rolls to the left").frames[0]'),
    ("flux-kontext", "lora", 'image = pipe(image=load_image("source.png"), prompt="make the circle blue").images[0]'),
    ("tiny-video", "transformer", "branchdiff sample --weights me/run"),
])
def test_every_familys_card_says_how_to_load_it(lora_run, tmp_path, family, export, expected):
    run = tmp_path / "run"
    run.mkdir()
    config = yaml.safe_load((lora_run / "config.yaml").read_text())
    path = {"sd3": "stabilityai/stable-diffusion-3.5-medium", "flux2-klein": "black-forest-labs/FLUX.2-klein-base-9B"}.get(family, f"owner/{family}")
    config["model"].update(family=family, path=path)
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    (run / "metrics.jsonl").write_text((lora_run / "metrics.jsonl").read_text())
    if export != "lora":  # a full fine-tuning's export: the denoiser's diffusers folder
        (run / export).mkdir()
        (run / export / "config.json").write_text(json.dumps({"_class_name": {"unet": "UNet2DConditionModel"}.get(export, "Flux2Transformer2DModel")}))
    card = card_text(run, export, "me/run")
    assert expected in card, card
    assert "\npipeline_tag: " + ("image-to-video" if family == "wan-i2v" else "text-to-video" if family in ("wan", "tiny-video") else "text-to-image") in card
    license = {"sd15": "creativeml-openrail-m", "wan": "apache-2.0", "wan-i2v": "apache-2.0", "qwen-image": "apache-2.0", "qwen-image-edit": "apache-2.0",
               "z-image": "apache-2.0", "tiny-video": None}.get(family, "other")  # the base model's license, as the Hub names it
    assert (f"\nlicense: {license}\n" in card) if license else "license:" not in card


def test_a_flux2_klein_card_carries_its_releases_license(lora_run, tmp_path):
    """FLUX.2 [klein] 4B is Apache 2.0, the 9B under a non-commercial license ("other")."""
    for size, license in (("4B", "apache-2.0"), ("9B", "other")):
        run = tmp_path / size
        run.mkdir()
        config = yaml.safe_load((lora_run / "config.yaml").read_text())
        config["model"].update(family="flux2-klein", path=f"black-forest-labs/FLUX.2-klein-base-{size}")
        (run / "config.yaml").write_text(yaml.safe_dump(config))
        (run / "metrics.jsonl").write_text((lora_run / "metrics.jsonl").read_text())
        assert f"\nlicense: {license}\n" in card_text(run, "lora", "me/run")
