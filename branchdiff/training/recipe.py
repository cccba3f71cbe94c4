"""The training recipe, top to bottom: setup (`Trainer.__init__`), the loop over iterations with its
evaluations, logs and checkpoints (`train`), one iteration (`Trainer.run_iteration`: rollout → rewards →
the objective's signal → its update plan → optimizer steps), and the checkpoint (`Trainer.save_checkpoint`).
The parts it composes live beside it: the checkpointer (checkpoints.py), the update loop (update.py), the
exploration (exploration.py), the evaluations (evaluation.py), the metrics (metrics.py) and what the loop
decides between iterations (run_control.py); the objectives are in branchdiff/objectives/.

Everything random in an iteration (the prompts drawn, every node's noise, step subsampling, the
minibatch order) is a pure function of (run seed, iteration), so a checkpoint needs only the trained
weights, the optimizer and the iteration to continue exactly as if the run had never stopped.

Iteration i: a held-out evaluation first when `eval_every` divides i (the policy the iteration's
rollouts come from: on iteration 0 the base model) with a grid of fixed prompts and seeds, then the
iteration, its metrics line (metrics.jsonl and TensorBoard, main process), a grid of training
samples, a checkpoint every `logging.checkpoint_every` iterations and at the end, and the report
(report.html) after a checkpoint when drawing it keeps under a tenth of the run's time (`ReportSchedule`), when
the run stops early, and after the final evaluation.

Every stop leaves a checkpoint of the last complete iteration, from which `--resume latest`
continues as if the run had never stopped:
- Ctrl-C (SIGINT): the iteration under way finishes, a checkpoint is written, `Interrupted`
  (exit 130); a second Ctrl-C aborts at once, keeping the checkpoints already published;
- an iteration whose every group was dropped (non-finite rewards), or `train.max_skipped_steps`
  optimizer steps in a row skipped (non-finite gradients): `RunStopped` (exit 2).
The processes decide together (one max-reduction per iteration), so none waits on another.
A crash or SIGKILL at any moment loses only the iterations after the last checkpoint: on resume,
metrics.jsonl is cut back to it and TensorBoard is told to drop later steps (`purge_step`).
Every file is written whole or not at all (branchdiff/runtime/storage.py); a full disk stops the run with
one line naming the file, the space and the newest complete checkpoint (`storage.DiskFull`).

With several processes (`accelerate launch`), each process grows the trees of its own prompts.
Under DDP, rollouts, the KL reference and evaluation run the plain denoiser (no collective inside);
only the training forward goes through the DDP wrapper, and every process takes the same optimizer
steps. Under FSDP every forward gathers weights, so the processes' forwards agree in number
(branchdiff/runtime/sharding.py, docs/sharding.md).
Batch-wide statistics, the loss normaliser and the metrics combine all processes
(`branchdiff.runtime.distributed`), so a run on P processes computes what one process would on all prompts.
A heartbeat watches the other processes (branchdiff/runtime/watchdog.py): a process that stops
responding for `collective_timeout` seconds ends the job with one line naming it.
"""

from __future__ import annotations

import copy
import json
import sys
import time
import uuid
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs, ProjectConfiguration, broadcast_object_list, set_seed
from tqdm.auto import tqdm

from branchdiff.core.rollout import NoiseAddress, Rollout, SamplerSettings, grow
from branchdiff.core.tree import TreeSpec, build_tree
from branchdiff.data.prompts import PromptSet, draw_prompts, load_prompt_set
from branchdiff.errors import CheckpointError, ConfigError, RunStopped, UserError, is_out_of_memory, out_of_memory
from branchdiff.explore.pool import RolloutContext, latent_difference
from branchdiff.models import load_adapter
from branchdiff.models.attention import resolve_backend
from branchdiff.models.base import PromptEmbeds, encode_for
from branchdiff.models.block_cache import check_cacheable
from branchdiff.models.compile import compile_denoiser, report_first_call, resolve_compile
from branchdiff.models.ema import WeightAverage
from branchdiff.models.finetune import export, make_finetune
from branchdiff.objectives.base import UpdatePlan
from branchdiff.objectives.dataset import DatasetObjective
from branchdiff.objectives.registry import make_objective, needs_reference
from branchdiff.report.figures import save_grid
from branchdiff.report.model_card import write_model_card
from branchdiff.rewards.combine import parse_reward_specs
from branchdiff.rewards.multi import MultiReward, RewardBatch
from branchdiff.runtime import metrics_log, storage
from branchdiff.runtime.distributed import AcceleratorCollective
from branchdiff.runtime.memory import PhaseMemory
from branchdiff.runtime.sharding import Lockstep, ShardingSettings, accelerate_without_fsdp, process_group_backend
from branchdiff.runtime.watchdog import Heartbeat, backend_timeout
from branchdiff.settings.config import TrainConfig
from branchdiff.settings.trees import tree_spec
from branchdiff.settings.validate import tracker_names
from branchdiff.training import trackers
from branchdiff.training.checkpoints import Checkpointer, TrainedParts
from branchdiff.training.evaluation import RunEvaluation
from branchdiff.training.exploration import Exploration
from branchdiff.training.hacking import BEST, WatchState, is_new_best
from branchdiff.training.lr_schedule import LearningRateSchedule
from branchdiff.training.metrics import dataset_iteration_metrics, iteration_metrics
from branchdiff.training.optimizer import make_optimizer
from branchdiff.training.overlap import grow_and_score, overlap_parts
from branchdiff.training.run_control import Interrupted, InterruptRequest, ReportSchedule, progress_fields, stop_reason
from branchdiff.training.update import UpdateLoop


@dataclass
class IterationResult:
    metrics: dict[str, float]
    rollout: Rollout | None  # None: a dataset objective's iteration (no rollout; the tensors below are then empty)
    leaf_images: torch.Tensor  # (L, 3, H, W)
    node_rewards: torch.Tensor  # (N,) fused reward of each node
    node_advantages: torch.Tensor  # (N,) clipped advantage of the edge into each node
    trained: torch.Tensor  # (N,) bool: the edge into the node got gradients
    prompts: list[str]  # (P,) the prompt of each tree (of each row, for a dataset objective)


def sampler_settings(config: TrainConfig) -> SamplerSettings:
    s = config.sampling
    return SamplerSettings(s.sde, s.noise_level, s.max_batch, s.exact, s.guidance, s.block_cache)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
RUNTIME_FILE = "runtime.json"  # the run's attention kernel and compilation, as `auto` chose them


class Trainer:
    def __init__(self, config: TrainConfig, resume: str | None = None) -> None:
        """Everything an iteration needs. `resume` ("latest" or a checkpoint folder): continue from
        that checkpoint, which is chosen and checked before any model or reward loads (`Checkpointer.select`)."""
        self.config = config
        self.run_dir = Path(config.output_dir)
        self.sharding = ShardingSettings.from_environment()
        if self.sharding.enabled and config.explore.mode == "search":
            raise ConfigError("'explore.mode' = 'search' grows each prompt's tree a node at a time, which sharded forwards cannot follow "
                              "in lockstep; under FSDP use explore.mode=seeds or tree")
        if self.sharding.enabled and config.model.compile in ("blocks", "full"):
            raise UserError(f"model.compile={config.model.compile} with FSDP: a sharded denoiser is not compiled yet; set model.compile=none "
                            "(or auto, which leaves it eager) when sharding")
        if self.sharding.enabled and config.sampling.block_cache > 0:
            raise UserError("sampling.block_cache with FSDP: a forward that skips blocks on one process would leave the others' "
                            "sharded blocks waiting; set sampling.block_cache=0 when sharding")
        if self.sharding.enabled and config.train.optimizer == "adamw8bit":
            raise ConfigError("'train.optimizer' = 'adamw8bit' is not supported on a sharded (FSDP) denoiser; use train.optimizer=adamw "
                              "(its moments are sharded with the weights)")
        with accelerate_without_fsdp():
            self.accelerator = self._accelerator()
        if self.sharding.enabled and self.accelerator.num_processes < 2:
            raise UserError("FSDP is on (ACCELERATE_USE_FSDP) in a single process: sharding needs several; launch with accelerate launch "
                            "--config_file $(branchdiff accelerate-config fsdp) --num_processes N (N ≥ 2), or unset ACCELERATE_USE_FSDP")
        self.collective = AcceleratorCollective(self.accelerator)
        self.checkpoints = Checkpointer(config, self.run_dir, self.accelerator, self.collective, self.sharding)
        self.memory = PhaseMemory(self.accelerator.device)  # peak memory of each phase, in the metrics
        self.heartbeat = self._start_heartbeat() if self.accelerator.num_processes > 1 else None
        resumed = self.checkpoints.select(resume) if resume else None
        self.settings = sampler_settings(config)
        set_seed(config.seed)
        self.reward = MultiReward(parse_reward_specs(config.reward), config.reward_combine, self.accelerator.device)
        self.evaluation = RunEvaluation.build(config, self.accelerator, self.collective, self.memory, self.reward, self.sharding.enabled)
        model = config.model
        self.adapter = load_adapter(model.family, model.path, self.accelerator.device, model.resolution, DTYPES[model.dtype], model.offload,
                                    model.prompt_instruction, model.frames, model.expert, model.guidance_2)
        self.evaluation.check_size(self.adapter)
        if config.sampling.block_cache > 0:
            try:
                check_cacheable(self.adapter)
            except ValueError as error:
                raise UserError(str(error)) from None
        cuda = self.accelerator.device.type == "cuda"
        attention, kernel = resolve_backend(model.attention_backend, self.adapter.denoiser, self.accelerator.device, model.family)
        compile_mode, compile_why = resolve_compile(model.compile, model.family, cuda, self.sharding.enabled)
        self.runtime = {"device": str(self.accelerator.device), "attention_backend": attention, "attention_kernel": kernel,
                        "compile": compile_mode, "compile_choice": compile_why}
        notice = self.adapter.solver_notice()
        if notice and self.accelerator.is_main_process:
            print(f"branchdiff: {notice}", file=sys.stderr)
        self.schedule = self.adapter.schedule(config.sampling.num_steps, config.sampling.shift).to(self.accelerator.device)
        if self.sharding.enabled:  # LoRA and the frozen copy are made in host memory; `shard` moves one block at a time to the device
            self.adapter.denoiser.to("cpu")
        self.finetune = make_finetune(self.adapter, model.finetune, model.lora_targets, config.train.lora_rank, config.train.lora_alpha,
                                      config.seed, keep_base=config.train.kl_beta > 0 or config.final_eval or needs_reference(config.train.loss))
        if config.train.gradient_checkpointing:
            cast(Any, self.adapter.denoiser).enable_gradient_checkpointing()  # diffusers' ModelMixin
        # a whole copy on every process, made before the denoiser is sharded
        self.exploration = Exploration.build(config, self.adapter, self.reward, self.accelerator.device, self.accelerator.autocast)
        if self.sharding.enabled:
            self.finetune.shard(self.sharding, Lockstep(self.collective))
        compiled = compile_denoiser(self.adapter.denoiser, compile_mode)  # after LoRA, the explorer's copy and sharding: rollouts and training run it
        if self.accelerator.is_main_process:
            self._record_runtime(compiled, cuda)
        optimizer = make_optimizer(config, self.finetune.params)
        self.weight_average = WeightAverage(self.finetune.params, config.train.ema_decay) if config.train.ema_decay else None
        self.learning_rate = LearningRateSchedule(optimizer, config.train.lr_schedule, config.train.warmup_iterations, config.iterations,
                                                  config.train.decay_start)
        if self.sharding.enabled:  # the sharded module is its own wrapper; its optimizer state is saved gathered (_save_trained)
            wrapped, self.optimizer = self.adapter.denoiser, optimizer
        else:
            wrapped, self.optimizer = self.accelerator.prepare(self.adapter.denoiser, optimizer)
        # the training forward goes through the (DDP-)wrapped module; everything else uses the plain one
        self.train_adapter = copy.copy(self.adapter)
        self.train_adapter.denoiser = wrapped
        self.objective = make_objective(config.train.loss, config=config, collective=self.collective, finetune=self.finetune,
                                        train_policy=self.train_adapter, schedule=self.schedule, settings=self.settings)
        self.update = UpdateLoop(config.train, self.accelerator, self.collective, self.finetune.params, wrapped, self.optimizer,
                                 self.weight_average, self.sharding.enabled)
        self.checkpoints.attach(TrainedParts(self.adapter, self.finetune, self.optimizer, self.weight_average, self.objective, self.exploration))
        self.prompt_set = load_prompt_set(config.prompts.train, config.sources.fit)
        if isinstance(self.objective, DatasetObjective):  # its rows are drawn as prompts are
            self.prompt_set = PromptSet(self.objective.rows.name, self.objective.rows.prompts, [{} for _ in self.objective.rows.prompts])
        self.prompts = self.prompt_set.prompts
        if resumed is not None:
            self.checkpoints.load(resumed)

    def _record_runtime(self, compiled: int, cuda: bool) -> None:
        """The kernel and compilation the run chose, in RUN/runtime.json (what `auto` picked, and why) and, on CUDA, one line;
        the compiled forward's first call says once what it cost."""
        storage.write_text(self.run_dir / RUNTIME_FILE, json.dumps(self.runtime, indent=1))
        if cuda:
            print(f"branchdiff: attention {self.runtime['attention_kernel']}; compile {self.runtime['compile']} "
                  f"({self.runtime['compile_choice']})", file=sys.stderr)
        if compiled:  # the lines go above the progress bar (tqdm.write)
            report_first_call(self.adapter.denoiser, lambda line: tqdm.write(f"branchdiff: {line}", file=sys.stderr),
                              f"model.compile={self.runtime['compile']}: {compiled} modules")

    def _accelerator(self) -> Accelerator:
        config = self.config
        backend = process_group_backend(self.sharding, torch.cuda.is_available())
        timeout = timedelta(seconds=backend_timeout(config.collective_timeout))
        group = InitProcessGroupKwargs(timeout=timeout, **({"backend": backend} if backend else {}))
        return Accelerator(
            cpu=not torch.cuda.is_available(),
            mixed_precision=config.train.mixed_precision,
            log_with=tracker_names(config.logging.report_to) or None,
            project_config=ProjectConfiguration(project_dir=str(self.run_dir), logging_dir=str(self.run_dir / "logs")),
            # the denoiser's buffers are constants (SD3's positional table): nothing to broadcast; a collective
            # still waiting a while after the heartbeat watch (branchdiff/runtime/watchdog.py) would have named a frozen rank raises
            # model.expert=both: a minibatch whose rows are all one expert's leaves the other's LoRA without a gradient
            kwargs_handlers=[DistributedDataParallelKwargs(broadcast_buffers=False, find_unused_parameters=config.model.expert == "both"),
                             group],
        )

    def refresh_explorer(self) -> None:
        """The explorer's 4-bit copy follows the policy's weights (after every update and a resume)."""
        if self.exploration is not None:
            self.exploration.refresh()

    def _start_heartbeat(self) -> Heartbeat:
        """With several processes, this process's heartbeat and its watch over the others
        (branchdiff/runtime/watchdog.py), started before the first collective that could wait on a frozen rank."""
        job = broadcast_object_list([uuid.uuid4().hex])[0]  # names this launch in every process's heartbeat
        return Heartbeat(self.run_dir, self.accelerator.process_index, self.accelerator.num_processes,
                         self.config.collective_timeout, self.checkpoints.newest, job).start()

    # ---------------------------------------------------------------- checkpoints (branchdiff/training/checkpoints.py)
    @property
    def start_iteration(self) -> int:
        return self.checkpoints.counters.start_iteration

    @property
    def run_state(self) -> dict:
        """The run's counters (optimizer steps taken, skipped in a row), kept in every checkpoint."""
        return self.checkpoints.counters.run_state

    @property
    def watch_state(self) -> WatchState:
        return self.checkpoints.counters.watch_state

    @property
    def checkpoint_dir(self) -> Path:
        return self.checkpoints.folder

    def save_checkpoint(self, iteration: int) -> None:
        self.checkpoints.save(iteration)

    def newest_checkpoint(self) -> Path | None:
        return self.checkpoints.newest()

    # ---------------------------------------------------------------- one iteration
    def iteration_draw(self, iteration: int) -> tuple[list[int], tuple[int, ...]]:
        """This process's prompt indices and their global keys (slots of the iteration's global draw)."""
        per_process = self.config.prompts.per_iteration
        indices = draw_prompts(self.prompts, per_process * self.accelerator.num_processes, self.config.seed, iteration)
        first = self.accelerator.process_index * per_process
        keys = tuple(range(first, first + per_process))
        return [indices[k] for k in keys], keys

    def rollout_and_score(self, iteration: int, per_node: bool = False) -> tuple[Rollout, torch.Tensor, RewardBatch, dict]:
        """Grow this iteration's trees and score the leaves: (rollout, leaf images, rewards, info)."""
        indices, keys = self.iteration_draw(iteration)
        prompts, metadata = [self.prompts[i] for i in indices], [self.prompt_set.metadata[i] for i in indices]
        spec = tree_spec(self.config, iteration)
        embeds = encode_for(self.adapter, prompts, metadata)
        address = NoiseAddress(self.config.seed, iteration, keys)
        context = RolloutContext(self.adapter, embeds, spec, self.schedule, self.settings, address)
        info: dict = {"embeds": embeds, "prompts": prompts, "address": address, "memory": {}}
        if self.config.reward_overlap and not per_node:
            return self._rollout_scored_in_parts(spec, prompts, metadata, embeds, address, info)
        start = time.perf_counter()
        with self.memory.phase("rollout", info["memory"]), self.accelerator.autocast(), self.objective.sampling_weights():
            if self.exploration is None:
                rollout = grow(self.adapter, build_tree(spec, len(prompts)), embeds, self.schedule, self.settings, address, per_node)
            else:
                explored = self.exploration.explore(context, prompts, metadata)
                rollout = explored.rollout
        info["rollout_seconds"] = time.perf_counter() - start
        start = time.perf_counter()
        with self.memory.phase("reward", info["memory"]):
            images = self.adapter.decode(rollout.leaf_latents)
            info["decode_seconds"] = time.perf_counter() - start
            tree = rollout.tree
            leaf_prompts = tree.prompt[tree.leaf_index]  # (L,) the group of each leaf
            rewards = self.reward(images, [prompts[p] for p in leaf_prompts.tolist()], [metadata[p] for p in leaf_prompts.tolist()],
                                  leaf_prompts)
        info["reward_seconds"] = time.perf_counter() - start
        if self.exploration is not None:
            kept_regenerated = rewards.total.reshape(len(prompts), self.config.explore.keep, -1).mean(-1)
            info["explore_kept"] = (explored.pool_rewards.gather(1, explored.kept), kept_regenerated)  # (P, K) each
            info["explore_stats"] = {**latent_difference(explored), **explored.stats}
            every = self.config.explore.fidelity_every
            if every and iteration % every == 0 and self.config.explore.mode != "search":  # a search's pool has no fixed shape to regrow
                info["explore_pool"] = (explored.pool_rewards, self.exploration.pool_rewards_under_policy(context, prompts, metadata))
        return rollout, images, rewards, info

    def _rollout_scored_in_parts(self, spec: TreeSpec, prompts: list[str], metadata: list[dict], embeds: PromptEmbeds, address: NoiseAddress,
                                 info: dict) -> tuple[Rollout, torch.Tensor, RewardBatch, dict]:
        """`rollout_and_score` with each part's leaves scored while the next part grows (`reward_overlap`, branchdiff/training/overlap.py)."""
        tree = build_tree(spec, len(prompts))
        leaf_prompts = tree.prompt[tree.leaf_index]  # (L,) the group of each leaf

        def score(images: torch.Tensor, rows: torch.Tensor) -> RewardBatch:
            groups = leaf_prompts[rows]
            return self.reward(images, [prompts[p] for p in groups.tolist()], [metadata[p] for p in groups.tolist()], groups)

        parts = overlap_parts(len(prompts), spec.leaves, self.settings.max_batch)
        with self.memory.phase("rollout", info["memory"]), self.objective.sampling_weights():  # the decodes too; autocast around the growing only
            rollout, images, rewards, seconds = grow_and_score(self.adapter, tree, embeds, self.schedule, self.settings, address, parts, score,
                                                               self.accelerator.autocast, self.reward.parallel_calls)
        info.update(seconds)
        return rollout, images, rewards, info

    def run_iteration(self, iteration: int, per_node: bool = False) -> IterationResult:
        """One iteration; `per_node` grows the tree with batch-1 forwards (benchmarks). The objective
        (`train.loss`, branchdiff/objectives/) turns the rewards into a signal and the signal into
        an update plan, which the update loop runs (branchdiff/training/update.py). A dataset objective
        (SFT, offline DPO) trains on its rows instead (`dataset_iteration`)."""
        if isinstance(self.objective, DatasetObjective):
            return self.dataset_iteration(iteration)
        rollout, images, rewards, info = self.rollout_and_score(iteration, per_node)
        signal = self.objective.signal(rollout, rewards.total, iteration)
        info["groups_dropped"] = signal.groups_dropped
        info["block_cache"] = self.settings.block_cache > 0  # the same on every process: the counts below are reduced together
        learning_rate = self.learning_rate.set(iteration)
        train_stats = self._run_update(lambda: self.objective.plan(rollout, info["embeds"], signal, info["address"]), info)
        metrics = {"iteration": iteration, **iteration_metrics(self.collective, rollout, rewards, signal.node_advantages, signal.trained,
                                                               train_stats, self.objective.metric_kinds, info),
                   "learning_rate": learning_rate}
        self.refresh_explorer()
        return IterationResult(metrics, rollout, images, signal.node_rewards, signal.node_advantages, signal.trained, info["prompts"])

    def _run_update(self, make_plan: Callable[[], UpdatePlan], info: dict) -> dict[str, float]:
        """The objective's plan (made inside the train phase: its forwards count there) run by the update loop; the
        run's counters of optimizer steps taken and skipped in a row follow, and the objective hears of the steps."""
        start = time.perf_counter()
        with self.memory.phase("train", info["memory"]):
            train_stats = self.update(make_plan())
            self.run_state["optimizer_steps"] += train_stats["optimizer_steps"]
            self.objective.after_update(self.run_state["optimizer_steps"])
        info["train_seconds"] = time.perf_counter() - start
        streak = self.run_state["skipped_in_a_row"] + train_stats["steps_skipped"]
        self.run_state["skipped_in_a_row"] = train_stats["trailing_skips"] if train_stats["optimizer_steps"] else streak
        return train_stats

    def dataset_iteration(self, iteration: int) -> IterationResult:
        """One iteration of a dataset objective: this process's rows drawn as prompts are, their prompts
        encoded, the objective's plan of them run by the update loop."""
        objective = self.objective
        assert isinstance(objective, DatasetObjective)
        indices, keys = self.iteration_draw(iteration)
        prompts = [self.prompts[i] for i in indices]
        info: dict = {"memory": {}}
        start = time.perf_counter()
        embeds = encode_for(self.adapter, prompts, [{} for _ in prompts])
        info["encode_seconds"] = time.perf_counter() - start
        learning_rate = self.learning_rate.set(iteration)
        train_stats = self._run_update(lambda: objective.plan_rows(indices, embeds, NoiseAddress(self.config.seed, iteration, keys)), info)
        metrics = {"iteration": iteration, **dataset_iteration_metrics(self.collective, len(indices), train_stats, objective.metric_kinds, info),
                   "learning_rate": learning_rate}
        empty = torch.zeros(0)
        return IterationResult(metrics, None, empty, empty, empty, empty.bool(), prompts)


    # ---------------------------------------------------------------- evaluation (branchdiff/training/evaluation.py)
    def evaluated_weights(self) -> AbstractContextManager:
        """The weights that are evaluated and exported in the model for the block: the moving
        average when `train.ema_decay` is on (branchdiff/models/ema.py), else the live ones."""
        return self.weight_average.swapped_in() if self.weight_average is not None else nullcontext()

    def keep_best(self, iteration: int, gold: float) -> None:
        """The weights evaluated before `iteration` (the best held-out gold so far) exported to RUN/best/ as the run's final
        export is, with best.json naming the iteration and the gold (branchdiff/training/hacking.py)."""
        folder = self.run_dir / BEST
        with self.evaluated_weights():
            export(self.finetune, folder, write=self.accelerator.is_main_process)
        if self.accelerator.is_main_process:
            (folder / "best.json").write_text(json.dumps({"iteration": iteration, "gold": gold, "score": self.evaluation.gold_score}) + "\n")

    def heldout_metrics(self) -> dict[str, float]:
        return self.evaluation.heldout_metrics(self.adapter, self.evaluated_weights())

    def fixed_samples(self, prompts: int = 4, images_per_prompt: int = 4) -> tuple[torch.Tensor, list[str]]:
        return self.evaluation.fixed_samples(self.adapter, self.evaluated_weights(), prompts, images_per_prompt)

    def final_evaluation(self) -> dict[str, dict[str, float]]:
        return self.evaluation.final(self.finetune, self.adapter, self.evaluated_weights(), self.run_dir)


# ---------------------------------------------------------------- the loop
def train(trainer: Trainer) -> None:
    """Iterations start_iteration .. iterations-1, then the export (RUN/lora, or the denoiser folder
    of full fine-tuning: `finetune.export`; the weights' moving average when `train.ema_decay` is on). A full disk
    or a silent process ends it with one line (`CheckpointError`, `watchdog.CollectiveTimeout`)."""
    heartbeat = trainer.heartbeat
    try:
        _train(trainer, heartbeat)
    except storage.DiskFull as error:
        raise CheckpointError(error.line(trainer.newest_checkpoint())) from None
    except (MemoryError, RuntimeError) as error:  # out of memory, a collective that timed out or lost its peer
        if is_out_of_memory(error):
            newest = trainer.newest_checkpoint()
            then = f"continue from {newest} with --resume latest" if newest else "start again"
            raise out_of_memory(error, "during training", "lower sampling.max_batch or turn on train.gradient_checkpointing or model.offload, "
                                f"and {then} (or start a new run with a smaller train.minibatch or prompts.per_iteration)") from None
        explained = heartbeat.explain(error) if heartbeat else None
        if explained is None:
            raise
        raise explained from None
    finally:
        if heartbeat:
            heartbeat.stop()


def _train(trainer: Trainer, heartbeat: Heartbeat | None) -> None:
    config, accelerator, run_dir = trainer.config, trainer.accelerator, trainer.run_dir
    from branchdiff.settings.load import save_config, to_dict

    if accelerator.is_main_process:
        save_config(config, run_dir / "config.yaml")
    trackers.start(accelerator, tracker_names(config.logging.report_to), run_dir, trainer.start_iteration, to_dict(config))
    progress = tqdm(range(trainer.start_iteration, config.iterations), initial=trainer.start_iteration, total=config.iterations,
                    desc="train", disable=not accelerator.is_local_main_process)
    report = ReportSchedule()
    try:
        with InterruptRequest() as interrupt:
            for iteration in progress:
                if heartbeat:
                    heartbeat.doing(f"iteration {iteration}")
                metrics = _iteration(trainer, iteration)
                progress.set_postfix(progress_fields(metrics))
                reason = stop_reason(config, metrics, trainer.run_state["skipped_in_a_row"], accelerator.num_processes, trainer.watch_state,
                                     trainer.evaluation.gold_score, run_dir)
                stop = trainer.collective.max(torch.tensor([float(interrupt.requested or reason is not None)])).item() > 0
                every = config.logging.checkpoint_every
                if stop or (every and (iteration + 1) % every == 0) or iteration == config.iterations - 1:
                    if heartbeat:
                        heartbeat.doing(f"the checkpoint of iteration {iteration}")
                    trainer.save_checkpoint(iteration)
                    # a run that ends here normally gets its report after the final evaluation (branchdiff/cli/train.py)
                    if stop or (iteration < config.iterations - 1 and report.due()):
                        report.write(lambda: _write_report(trainer))
                    if stop:  # every process leaves once the main one's report is written: a launcher ends the others when one exits
                        accelerator.wait_for_everyone()
                if reason is not None:
                    raise RunStopped(reason)
                if stop:
                    raise Interrupted(f"interrupted after {iteration + 1} of {config.iterations} iterations, a checkpoint of them saved in "
                                      f"{trainer.checkpoint_dir}; continue with --resume latest")
    finally:
        progress.close()
        trackers.finish(accelerator)
    with trainer.evaluated_weights():  # the moving average when on; every process (a sharded denoiser is gathered), the main one writes
        export(trainer.finetune, run_dir, write=accelerator.is_main_process)
    if accelerator.is_main_process:
        write_model_card(run_dir, trainer.finetune.export_name)  # RUN/README.md, again after the final evaluation


def _iteration(trainer: Trainer, iteration: int) -> dict[str, float]:
    """Held-out evaluation when due, the iteration, its logs and grids; returns its metrics."""
    config, accelerator, run_dir = trainer.config, trainer.accelerator, trainer.run_dir
    heldout = {}
    if config.eval_every and iteration % config.eval_every == 0:
        if iteration == trainer.start_iteration and accelerator.is_local_main_process:  # the first one is a while without a bar's tick
            policy = "the base model" if iteration == 0 else f"the policy of iteration {iteration}"
            tqdm.write(f"branchdiff: evaluating {policy} on the held-out prompts first (every {config.eval_every} iterations)...",
                       file=sys.stderr)
        heldout = trainer.heldout_metrics()
        if config.watch.stop and is_new_best(trainer.watch_state, heldout[f"eval_{trainer.evaluation.gold_score}"]):
            trainer.keep_best(iteration, heldout[f"eval_{trainer.evaluation.gold_score}"])  # what a run the watch stops keeps
        if accelerator.is_main_process or trainer.sharding.enabled:
            images, prompts = trainer.fixed_samples()
        if accelerator.is_main_process:
            grid = save_grid(images, run_dir / "samples" / f"eval-iter-{iteration:06d}.png", nrow=len(images) // len(prompts),
                             row_captions=prompts)
            _log_grid(trainer, "samples/held_out", grid, iteration)
    result = trainer.run_iteration(iteration)
    if heldout and "reward_mean" in result.metrics:  # the evaluation measured the policy of this iteration's rollouts: the watch pairs the two
        heldout.update(trainer.watch_state.add_evaluation(result.metrics["reward_mean"], heldout[f"eval_{trainer.evaluation.gold_score}"],
                                                          config.watch.window, config.watch.tolerance))
    metrics = {**result.metrics, **heldout}
    with storage.disk_full_as_error(run_dir / "logs"):
        accelerator.log({k: v for k, v in metrics.items() if k != "iteration"}, step=iteration)
    if accelerator.is_main_process:
        metrics_log.append(run_dir / "metrics.jsonl", metrics)
        every = config.logging.sample_every
        if every and result.rollout is not None and (iteration % every == 0 or iteration == config.iterations - 1):
            tree = result.rollout.tree
            leaves_per_prompt = len(tree.leaf_index) // tree.num_prompts
            shown = 4 * leaves_per_prompt
            grid = save_grid(result.leaf_images[:shown], run_dir / "samples" / f"iter-{iteration:06d}.png", nrow=leaves_per_prompt,
                             row_captions=result.prompts[: shown // leaves_per_prompt])
            _log_grid(trainer, "samples/train", grid, iteration)
    return metrics


def _log_grid(trainer: Trainer, tag: str, grid: torch.Tensor, iteration: int) -> None:
    """A saved sample grid into the trackers: an image, or a video's grid playing as a GIF."""
    names = tracker_names(trainer.config.logging.report_to)
    if names:
        with storage.disk_full_as_error(trainer.run_dir / "logs"):
            trackers.log_grid(trainer.accelerator, names, tag, grid, iteration)


def _write_report(trainer: Trainer) -> None:
    if trainer.accelerator.is_main_process:
        from branchdiff.report.run_report import write_report

        write_report(trainer.run_dir)
