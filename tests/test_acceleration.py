"""`model.compile: auto` and `model.attention_backend: auto` (branchdiff/models/compile.py, attention.py) on the CPU: the
choice per device and family (CUDA stood in for where only the choice is tested), the gradient check that gates a
kernel (a sound kernel passes, a NaN one and a wrong one fall back to native), the kernel a run records
(RUN/runtime.json), the one line on the first compiled forward, and the real presets' defaults."""

from __future__ import annotations

import json

import pytest
import torch

from branchdiff.models.attention import CUDNN, DEFAULT, DEFAULT_WITH_CUDNN, choose_backend, dispatched, gradient_check, resolve_backend
from branchdiff.models.compile import check_compile_family, report_first_call, resolve_compile
from branchdiff.settings.load import load_config, presets

CUDA = torch.device("cuda")  # a device object only: the tests below never run a kernel on it


def test_compile_auto_compiles_on_cuda_where_a_gain_was_measured_and_nowhere_on_the_cpu():
    assert resolve_compile("auto", "sd3", cuda=False) == ("none", "auto: eager on the CPU")
    mode, why = resolve_compile("auto", "sd3", cuda=True)
    assert mode == "blocks" and "1.63×" in why
    assert resolve_compile("auto", "flux2-klein", cuda=True)[0] == "blocks"
    assert resolve_compile("auto", "sana", cuda=True) == ("none", "auto: eager (no measured gain for sana)")  # 1.90× measured, but it failed trained
    assert resolve_compile("auto", "sd3", cuda=True, sharded=True) == ("none", "auto: eager when sharded (FSDP)")
    assert resolve_compile("auto", "wan", cuda=True)[0] == "none" and resolve_compile("blocks", "tiny", cuda=False) == ("blocks", "as set")
    with pytest.raises(ValueError, match=r"model.compile=blocks with model.family=sana on CUDA: SANA compiled and then trained stopped on an "
                                         r"H200 with '\(\*bias\): last dimension must be contiguous'.*; set model.compile=none"):
        check_compile_family("blocks", "sana", cuda=True)
    check_compile_family("blocks", "sana", cuda=False)
    check_compile_family("auto", "sana", cuda=True)


def test_the_gradient_check_passes_a_sound_kernel_and_fails_a_nan_or_wrong_one():
    sdpa = torch.nn.functional.scaled_dot_product_attention
    passed, why = gradient_check(sdpa, heads=2, head_dim=16, device=torch.device("cpu"), tokens=32)
    assert passed and why.startswith("gradients finite, within")
    nan = lambda q, k, v: sdpa(q, k, v) * torch.where(q[..., :1] > 3, float("nan"), 1.0)
    assert gradient_check(nan, 2, 16, torch.device("cpu"), tokens=32) == (False, "its backward gave non-finite gradients")
    passed, why = gradient_check(lambda q, k, v: 1.2 * sdpa(q, k, v), 2, 16, torch.device("cpu"), tokens=32)
    assert not passed and "off the math kernel's" in why


@pytest.fixture(scope="module")
def denoisers():
    from tiny_pipelines import build_pipeline  # tests/ is on sys.path

    return {"sd3": build_pipeline("sd3").transformer, "flux": build_pipeline("flux").transformer}


def test_attention_auto_chooses_per_device_and_family_and_falls_back_to_native(denoisers, monkeypatch):
    """On the CPU: native. On CUDA: cuDNN where its check passes (the SDPA families through PyTorch's own dispatch with
    cuDNN allowed; the dispatcher families through the dispatcher), a flash kernel first where one is installed, and
    native, saying why, where every check fails."""
    import branchdiff.models.attention as attention

    sd3, flux = denoisers["sd3"], denoisers["flux"]
    assert not dispatched(sd3) and dispatched(flux)
    assert choose_backend(sd3, torch.device("cpu")) == (DEFAULT, "native: PyTorch's SDPA (on the CPU)")
    asked = []

    def passes(name_of):
        def check(attend, heads, head_dim, device):
            asked.append((attend, heads, head_dim))
            return name_of(attend), "stand-in"
        return check

    assert choose_backend(sd3, CUDA, passes(lambda attend: True))[0] == CUDNN and asked[-1][1:] == (2, 16)  # the tiny SD3's width (tests/tiny_pipelines.py)
    name, why = choose_backend(flux, CUDA, passes(lambda attend: False))
    assert name == DEFAULT and why.startswith("native: PyTorch's SDPA, cuDNN's kernel off (_native_cudnn: stand-in")
    monkeypatch.setattr(attention, "installed", lambda: ["flash", "sage"])
    assert choose_backend(flux, CUDA, passes(lambda attend: True))[0] == "flash"
    assert choose_backend(sd3, CUDA, passes(lambda attend: True))[0] == CUDNN  # SDPA-direct: no dispatcher kernel is tried
    enabled = []
    monkeypatch.setattr(torch.backends.cuda, "enable_cudnn_sdp", lambda on: enabled.append(on))
    assert resolve_backend("auto", sd3, CUDA, "sd3", passes(lambda attend: True))[0] == DEFAULT_WITH_CUDNN and enabled == [True]


def test_a_run_records_its_kernel_and_the_real_presets_default_to_auto(tmp_path):
    from branchdiff.cli import main

    run = tmp_path / "run"
    assert main(["train", "tiny-chain", f"output_dir={run}", "iterations=1", "prompts.per_iteration=2", "tree.roots=2", "final_eval=false",
                 "logging.report_to=none", "logging.sample_every=0"]) == 0
    recorded = json.loads((run / "runtime.json").read_text())
    assert recorded == {"device": "cpu", "attention_backend": "native", "attention_kernel": "native: PyTorch's SDPA (on the CPU)", "compile": "none",
                        "compile_choice": "auto: eager on the CPU"}
    real = [name for name in presets() if not name.startswith(("tiny", "branchgrpo"))]
    assert len(real) > 20 and all(load_config(name).model.compile == "auto" and load_config(name).model.attention_backend == "auto" for name in real)


def test_the_first_compiled_forward_says_once_that_it_compiles_and_what_it_cost():
    """A line as the first forward starts (on the CPU it compiles for a minute or more with nothing else printed) and one when it ends."""
    said = []
    model = torch.nn.Linear(4, 4)
    report_first_call(model, said.append, "model.compile=blocks: 4 modules")
    model(torch.zeros(1, 4))
    model(torch.zeros(1, 4))
    assert len(said) == 2 and said[0] == "model.compile=blocks: 4 modules: compiling them in the first forward (once)..."
    assert said[1].startswith("model.compile=blocks: 4 modules: the first forward, which compiles them, took ")


def test_compiling_for_the_cpu_prints_no_cuda_runtime_notice():
    """torch.compile for the CPU imports torch's C++ extension builder, which, in a CUDA build of torch on a machine without
    a GPU, warned "No CUDA runtime is found" in the middle of every compiled run's first iteration: the command line holds it
    back with the other notices that are not the user's to fix."""
    import subprocess
    import sys

    quieted = "from branchdiff.cli.main import _quiet_third_party_logs; _quiet_third_party_logs(); import torch.utils.cpp_extension"
    said = subprocess.run([sys.executable, "-c", quieted], capture_output=True, text=True, timeout=120)
    assert said.returncode == 0 and "No CUDA runtime" not in said.stderr, said.stderr
