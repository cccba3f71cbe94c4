"""Peak memory per phase (branchdiff/memory.py): on the CPU, the resident set's peak within each
phase; a training iteration logs every phase's."""

from __future__ import annotations

import torch

from branchdiff.memory import GIB, PhaseMemory


def test_each_phase_reports_its_own_peak():
    memory, peaks = PhaseMemory(torch.device("cpu")), {}
    size = 256 * 2**20  # 256 MiB, touched so that it is resident
    with memory.phase("big", peaks):
        block = torch.ones(size // 4)
        del block
    with memory.phase("small", peaks):
        torch.ones(1024)
    assert memory.per_phase  # Linux: the peak is reset before each phase
    assert peaks["memory_big_gb"] >= size / GIB
    assert peaks["memory_small_gb"] < peaks["memory_big_gb"] - 0.75 * size / GIB


def test_an_iteration_logs_the_peak_of_each_phase(tiny_model_dir, tmp_path):
    from branchdiff.config import load_config
    from branchdiff.trainer import Trainer

    trainer = Trainer(load_config("tiny-chain", [f"model.path={tiny_model_dir}", f"output_dir={tmp_path}", "prompts.per_iteration=1",
                                                 "tree.roots=2", "sampling.num_steps=2", "final_eval=false", "logging.tensorboard=false"]))
    metrics = trainer.run_iteration(0).metrics
    for phase in ("rollout", "reward", "train"):
        assert 0.05 < metrics[f"memory_{phase}_gb"] < 24  # a Python process with torch and the model resident, below the machine's memory
    assert 0.05 < trainer.heldout_metrics()["memory_eval_gb"] < 24
