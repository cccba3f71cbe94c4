"""`model.attention_backend` (branchdiff/models/attention.py): a backend that is not installed, not a
backend, or not honoured by the family's attention is one line at exit 2 with nothing left behind; a
dispatcher family under PyTorch's math kernel predicts as under `native` and keeps the rollout ÷
training log-prob check; `native` on CUDA switches cuDNN's attention off."""

from __future__ import annotations

import re

import pytest
import torch

from branchdiff.cli import main
from branchdiff.models.attention import apply_backend, installed

RUN = ["iterations=1", "final_eval=false", "logging.report_to=none", "logging.sample_every=0"]


@pytest.mark.parametrize("backend,line", [
    ("flash", r"model.attention_backend=flash: its package is not installed here \(installed: .*native.*\); install it"),
    ("fastest", r"model.attention_backend=fastest: not an attention backend; choose one of .*native"),
    ("_native_math", r"model.attention_backend=_native_math: the tiny family's attention calls PyTorch's SDPA directly"),
])
def test_a_backend_that_cannot_run_is_one_line_and_nothing_is_left(backend, line, tmp_path, capsys):
    if backend == "flash" and "flash" in installed():
        pytest.skip("flash-attn is installed here")
    run = tmp_path / "run"
    assert main(["train", "tiny-chain", f"output_dir={run}", f"model.attention_backend={backend}", *RUN]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.search(line, err), err
    assert not run.exists()


def test_a_dispatcher_family_under_the_math_kernel_predicts_as_native_and_trains(tmp_path):
    from branchdiff.models import load_adapter
    from branchdiff.settings.load import load_config
    from branchdiff.training.recipe import Trainer
    from test_model_families import _train_overrides
    from tiny_pipelines import save_pipeline

    folder = save_pipeline("flux", tmp_path / "flux")
    native = load_adapter("flux", str(folder), "cpu", 32)
    math = load_adapter("flux", str(folder), "cpu", 32)
    apply_backend(math.denoiser, "_native_math", "flux")
    embeds = native.encode_prompts(["a red circle", "two blue squares"])
    latents = torch.randn(2, *native.latent_shape, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = (a.predict(latents, torch.full((2,), 0.6), embeds, a.default_guidance) for a in (math, native))
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    assert _AttentionBackendRegistry.get_active_backend()[0].value == "native"  # the process's default is left alone (a Wan run after this one kept its own kernel)
    metrics = Trainer(load_config(None, _train_overrides("flux", folder, tmp_path / "run", "model.attention_backend=_native_math"))).run_iteration(0).metrics
    assert metrics["optimizer_steps"] == 1 and metrics["logprob_check"] <= 1e-5


def test_native_switches_cudnn_attention_off_on_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the hardware boundary: a CUDA device present
    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        apply_backend(torch.nn.Linear(2, 2), "native", "tiny")
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)
