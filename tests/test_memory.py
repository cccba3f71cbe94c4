"""Peak memory per phase (branchdiff/runtime/memory.py): on the CPU, the resident set's peak within each
phase; a training iteration logs every phase's."""

from __future__ import annotations

import torch

from branchdiff.runtime.memory import GIB, PhaseMemory


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
    from branchdiff.settings.load import load_config
    from branchdiff.training.recipe import Trainer

    trainer = Trainer(load_config("tiny-chain", [f"model.path={tiny_model_dir}", f"output_dir={tmp_path}", "prompts.per_iteration=1",
                                                 "tree.roots=2", "sampling.num_steps=2", "final_eval=false", "logging.report_to=none"]))
    metrics = trainer.run_iteration(0).metrics
    for phase in ("rollout", "reward", "train"):
        assert 0.05 < metrics[f"memory_{phase}_gb"] < 24  # a Python process with torch and the model resident, below the machine's memory
    assert 0.05 < trainer.heldout_metrics()["memory_eval_gb"] < 24


def test_the_memory_tables_forward_trace_counts_a_layers_output_per_row():
    """branchdiff plan's `forward_peak` (branchdiff/plan/trace.py) (what the GPU suite sets against a real forward): a
    Linear 64 → 128 in bf16 under autocast keeps its bf16 output, 256 bytes a row, and its bf16 weight
    cast (fixed, whatever the rows)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from branchdiff.plan.trace import forward_peak

    with torch.device("meta"):
        layer = torch.nn.Linear(64, 128, bias=False)
    with FakeTensorMode(allow_non_fake_inputs=True):
        layer.to_empty(device="cuda")
        peak = forward_peak(layer, {"input": torch.empty(1, 64, device="cuda")}, grad=False, autocast=torch.bfloat16)
    weight_cast = 64 * 128 * 2  # bf16
    input_cast = 64 * 2  # the fp32 input cast to bf16, per row
    assert peak.at(1) == weight_cast + input_cast + 128 * 2
    assert peak.at(100) - peak.at(1) == 99 * (input_cast + 128 * 2)


def test_a_dropped_trainer_frees_its_model_without_waiting_for_the_cycle_collector(tiny_model_dir, tmp_path):
    """`del trainer` frees the denoiser's weights (and the explorer's 4-bit copy's) at once: nothing the Trainer
    keeps refers back to it. Reference cycles (the accelerator's checkpoint hooks as the Checkpointer's bound
    methods, the Checkpointer's parts holding the Trainer's own method) kept a whole model allocated until
    `gc.collect()`, so a second run in the same process (a benchmark's next variant, a notebook) peaked with both."""
    import gc
    import weakref

    from branchdiff.settings.load import load_config
    from branchdiff.training.recipe import Trainer

    trainer = Trainer(load_config("tiny-explore-tree", [f"model.path={tiny_model_dir}", f"output_dir={tmp_path}", "prompts.per_iteration=1",
                                                        "sampling.num_steps=4", "tree.splits=[[0,2],[1,2]]", "explore.keep=2",
                                                        "train.minibatch=4", "train.optimizer_every=4", "final_eval=false",
                                                        "logging.report_to=none"]))
    trainer.run_iteration(0)
    trainer.save_checkpoint(0)
    assert trainer.exploration is not None
    weights = [weakref.ref(p) for p in trainer.adapter.denoiser.parameters()]
    explorer = weakref.ref(trainer.exploration)
    gc.disable()
    try:
        del trainer
        assert explorer() is None and sum(w() is not None for w in weights) == 0
    finally:
        gc.enable()
