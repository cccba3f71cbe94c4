"""`branchdiff train` as `accelerate launch` runs it, recording per process and iteration what the
two-process tests compare: `python two_process_run.py RECORD_DIR train ...` (the CLI's arguments).

Each process writes RECORD_DIR/rank{r}-iter{i}.pt (tensors only, read back with weights_only=True):
its prompt keys and prompt indices, its trees' arrays, node rewards and advantages, the trained mask,
and its LoRA parameters right after the iteration's update.
"""

import sys
from pathlib import Path

import torch

from branchdiff.cli import main
from branchdiff.training.recipe import IterationResult, Trainer

record_dir = Path(sys.argv[1])
run_iteration = Trainer.run_iteration


def recording_run_iteration(self: Trainer, iteration: int, per_node: bool = False) -> IterationResult:
    result = run_iteration(self, iteration, per_node)
    indices, keys = self.iteration_draw(iteration)
    tree = result.rollout.tree
    record = {
        "keys": torch.tensor(keys), "prompt_ids": torch.tensor(indices),
        "parent": tree.parent, "depth": tree.depth, "prompt": tree.prompt,
        "node_rewards": result.node_rewards, "advantages": result.node_advantages, "trained": result.trained,
        **{f"lora/{name}": p.detach().clone() for name, p in self.adapter.denoiser.named_parameters() if "lora_" in name},
    }
    torch.save(record, record_dir / f"rank{self.accelerator.process_index}-iter{iteration}.pt")
    return result


Trainer.run_iteration = recording_run_iteration
sys.exit(main(sys.argv[2:]))
