"""The training loop: one iteration is rollout → rewards → the objective's signal (for GRPO: fusion,
advantages, pruning) → update.

The checkpoint methods are in branchdiff/training/checkpoints.py.

Everything random in an iteration (the prompts drawn, every node's noise, step subsampling, the
minibatch order) is a pure function of (run seed, iteration), so a checkpoint needs only the LoRA
weights, the optimizer and the iteration to continue exactly as if the run had never stopped.

With several processes (`accelerate launch`), each process grows the trees of its own prompts.
Under DDP, rollouts, the KL reference and evaluation run the plain denoiser (no collective inside);
only the training forward goes through the DDP wrapper, and every process takes the same optimizer
steps. Under FSDP every forward gathers weights, so the processes' forwards agree in number
(branchdiff/runtime/sharding.py, docs/sharding.md).
Batch-wide statistics, the loss normaliser and the metrics combine all processes
(`branchdiff.runtime.distributed`), so a run on P processes computes what one process would on all prompts.
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

from branchdiff.core.rollout import NoiseAddress, Rollout, SamplerSettings, grow
from branchdiff.core.tree import build_tree
from branchdiff.data.prompts import PromptSet, draw_prompts, load_prompt_set
from branchdiff.errors import ConfigError, UserError
from branchdiff.evaluation.evaluate import EvalResult, beside_sources, evaluate, gather_results, sample_ode, score_names, summarize
from branchdiff.explore.pool import (
    ExploreResult,
    RolloutContext,
    Selection,
    explore_search,
    explore_seeds,
    explore_tree,
    latent_difference,
    pool_under_policy,
    selection_generators,
)
from branchdiff.explore.quant import QuantConfig, make_quantized_copy, refresh_quantized_copy
from branchdiff.models import load_adapter
from branchdiff.models.attention import apply_backend
from branchdiff.models.base import ModelAdapter, encode_for
from branchdiff.models.compile import compile_denoiser
from branchdiff.models.ema import WeightAverage
from branchdiff.models.finetune import make_finetune
from branchdiff.objectives.base import UpdatePlan
from branchdiff.objectives.dataset import DatasetObjective
from branchdiff.objectives.registry import make_objective, needs_reference
from branchdiff.rewards.combine import parse_reward_specs
from branchdiff.rewards.multi import MultiReward, RewardBatch, build_component
from branchdiff.runtime import storage
from branchdiff.runtime.distributed import AcceleratorCollective
from branchdiff.runtime.memory import PhaseMemory
from branchdiff.runtime.sharding import Lockstep, ShardingSettings, accelerate_without_fsdp, process_group_backend
from branchdiff.runtime.watchdog import Heartbeat, backend_timeout
from branchdiff.search.registry import make_search
from branchdiff.settings.config import TrainConfig
from branchdiff.settings.trees import tree_spec
from branchdiff.settings.validate import tracker_names
from branchdiff.training.checkpoints import Checkpointer, TrainedParts
from branchdiff.training.hacking import WatchState
from branchdiff.training.lr_schedule import LearningRateSchedule
from branchdiff.training.metrics import dataset_iteration_metrics, iteration_metrics
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
    return SamplerSettings(s.sde, s.noise_level, s.max_batch, s.exact, s.guidance)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def make_optimizer(config: TrainConfig, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """AdamW over the trained parameters, or bitsandbytes' 8-bit AdamW (`train.optimizer=adamw8bit`:
    its two moments in 8 bits, a quarter of AdamW's optimizer memory). AdamW is PyTorch's fused kernel
    (one pass, in place: 4× faster a step than the per-tensor-list default on the built-in model's
    2.3 M weights on the CPU, and no temporary copies of the weights) wherever the parameters are plain
    tensors on one CPU or CUDA device; sharded (FSDP) parameters take the default, which handles them."""
    train = config.train
    if train.optimizer == "adamw8bit":
        try:
            import bitsandbytes
        except ImportError:
            raise ImportError("train.optimizer=adamw8bit needs bitsandbytes: pip install 'branchdiff-rl[quant]'") from None
        return bitsandbytes.optim.AdamW8bit(params, lr=train.learning_rate, weight_decay=train.weight_decay)
    # fused=None, not False, where it cannot fuse: False would also skip torch's choice of its foreach step
    optimizer = torch.optim.AdamW(params, lr=train.learning_rate, weight_decay=train.weight_decay, fused=fused_adamw(params) or None)
    kernel = {key: optimizer.defaults[key] for key in ("fused", "foreach")}

    def keep_kernel(loaded: torch.optim.Optimizer) -> None:
        """A checkpoint's param_groups carry the step kernel they were saved with (a run from before AdamW was
        fused says none): the run keeps its own."""
        for group in loaded.param_groups:
            group.update(kernel)

    optimizer.register_load_state_dict_post_hook(keep_kernel)
    return optimizer


def fused_adamw(params: list[torch.nn.Parameter]) -> bool:
    """Whether PyTorch's fused AdamW takes `params`: plain floating tensors, all on one CPU or CUDA device."""
    from torch.distributed.tensor import DTensor

    devices = {p.device for p in params}
    return (len(devices) == 1 and next(iter(devices)).type in ("cpu", "cuda")
            and all(p.is_floating_point() and not isinstance(p, DTensor) for p in params))


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
        if self.sharding.enabled and config.model.compile != "none":
            raise UserError(f"model.compile={config.model.compile} with FSDP: a sharded denoiser is not compiled yet; leave model.compile=none "
                            "when sharding")
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
        self.eval_rewards = self._build_eval_rewards()  # by label: resolved and loaded before the first iteration
        self.gold_score = self._gold_score()  # before the model loads: a wrong name costs nothing
        model = config.model
        self.adapter = load_adapter(model.family, model.path, self.accelerator.device, model.resolution, DTYPES[model.dtype], model.offload,
                                    model.prompt_instruction, model.frames, model.expert, model.guidance_2)
        apply_backend(self.adapter.denoiser, model.attention_backend, model.family)
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
        self.explorer = self._make_explorer()  # a whole copy on every process, made before the denoiser is sharded
        if self.sharding.enabled:
            self.finetune.shard(self.sharding, Lockstep(self.collective))
        compile_denoiser(self.adapter.denoiser, model.compile)  # after LoRA, the explorer's copy and sharding: rollouts and training run it
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
        self.checkpoints.attach(TrainedParts(self.adapter, self.finetune, self.optimizer, self.weight_average, self.objective, self.refresh_explorer))
        self.prompt_set = load_prompt_set(config.prompts.train)
        if isinstance(self.objective, DatasetObjective):  # its rows are drawn as prompts are
            self.prompt_set = PromptSet(self.objective.rows.name, self.objective.rows.prompts, [{} for _ in self.objective.rows.prompts])
        self.prompts = self.prompt_set.prompts
        if resumed is not None:
            self.checkpoints.load(resumed)

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

    def _make_explorer(self) -> ModelAdapter | None:
        """The policy itself (backend none) or a 4-bit copy of it, for explore modes."""
        explore = self.config.explore
        if explore.mode == "off":
            return None
        if explore.backend == "none":
            return self.adapter
        self.quant_config = QuantConfig(explore.backend, self.adapter.quant_skip_modules, explore.min_features)
        explorer = copy.copy(self.adapter)
        explorer.denoiser = make_quantized_copy(self.adapter.denoiser, self.quant_config, self.accelerator.device)
        return explorer

    def refresh_explorer(self) -> None:
        """Re-derive the quantised copy from the policy (its weights, LoRA merged), so exploration follows it."""
        if self.explorer is not None and self.explorer is not self.adapter:
            refresh_quantized_copy(self.explorer.denoiser, self.adapter.denoiser, self.quant_config)

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
        start = time.perf_counter()
        with self.memory.phase("rollout", info["memory"]), self.accelerator.autocast(), self.objective.sampling_weights():
            if self.explorer is None:
                rollout = grow(self.adapter, build_tree(spec, len(prompts)), embeds, self.schedule, self.settings, address, per_node)
            else:
                explored = self._explore(context, prompts, metadata)
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
        if self.explorer is not None:
            kept_regenerated = rewards.total.reshape(len(prompts), self.config.explore.keep, -1).mean(-1)
            info["explore_kept"] = (explored.pool_rewards.gather(1, explored.kept), kept_regenerated)  # (P, K) each
            info["explore_stats"] = {**latent_difference(explored), **explored.stats}
            every = self.config.explore.fidelity_every
            if every and iteration % every == 0 and self.config.explore.mode != "search":  # a search's pool has no fixed shape to regrow
                info["explore_pool"] = (explored.pool_rewards, self._pool_rewards_under_policy(context, prompts, metadata))
        return rollout, images, rewards, info

    def _score_images(self, prompts: list[str], metadata: list[dict]):
        def score(images: torch.Tensor, prompt_index: torch.Tensor) -> torch.Tensor:
            rows = prompt_index.tolist()
            return self.reward(images, [prompts[p] for p in rows], [metadata[p] for p in rows], prompt_index).total

        return score

    def _score_latents(self, prompts: list[str], metadata: list[dict]):
        score_images = self._score_images(prompts, metadata)
        return lambda latents, prompt_index: score_images(self.adapter.decode(latents), prompt_index)

    def _explore(self, context: RolloutContext, prompts: list[str], metadata: list[dict]) -> ExploreResult:
        assert self.explorer is not None  # called only with an explorer (rollout_and_score)
        explore, address = self.config.explore, context.address
        selection = Selection(explore.keep, explore.selection, selection_generators(self.config.seed, address.iteration, address.prompt_keys))
        if explore.mode == "search":
            return explore_search(context, self.explorer, make_search(explore.search), explore.search_budget, selection,
                                  self._score_images(prompts, metadata))
        score = self._score_latents(prompts, metadata)
        if explore.mode == "tree":
            return explore_tree(context, self.explorer, selection, score)
        preview_steps = explore.preview_steps or self.config.sampling.num_steps
        preview_schedule = self.adapter.schedule(preview_steps, self.config.sampling.shift).to(self.accelerator.device)
        return explore_seeds(context, self.explorer, preview_schedule, explore.preview_sampler == "sde", explore.pool, selection, score)

    def _pool_rewards_under_policy(self, context: RolloutContext, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        """(P, N) the policy's reward of every pool candidate (the explorer's ranking is judged on these)."""
        explore = self.config.explore
        with self.accelerator.autocast():
            latents, per_candidate = pool_under_policy(context, explore.mode, explore.pool)
        prompt_index = torch.arange(len(prompts)).repeat_interleave(len(latents) // len(prompts))
        return self._score_latents(prompts, metadata)(latents, prompt_index).reshape(len(prompts), -1, per_candidate).mean(-1)

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

    # ---------------------------------------------------------------- evaluation
    def evaluated_weights(self) -> AbstractContextManager:
        """The weights that are evaluated and exported in the model for the block: the moving
        average when `train.ema_decay` is on (branchdiff/models/ema.py), else the live ones."""
        return self.weight_average.swapped_in() if self.weight_average is not None else nullcontext()

    def _gold_score(self) -> str | None:
        """The held-out score the reward-hacking watch follows: `watch.gold`, else the first eval
        reward's own score; None when the run never evaluates during training."""
        if not self.config.eval_every:
            return None
        names = score_names(self.eval_rewards)
        gold = self.config.watch.gold or names[0]
        if gold not in names:
            raise ConfigError(f"'watch.gold' = {gold!r} is not a score of eval_rewards; allowed: {', '.join(names)}")
        return gold

    def _build_eval_rewards(self) -> dict[str, object]:
        """The evaluation rewards (`eval_rewards`) by label, built before the first iteration when the
        run evaluates; a component the training reward already built (the same spec) is shared, not
        loaded twice."""
        def component(spec) -> object:
            for trained, reward in zip(self.reward.specs, self.reward.rewards):
                if (trained.name, trained.remote, trained.kwargs) == (spec.name, spec.remote, spec.kwargs):
                    return reward
            return build_component(spec, str(self.accelerator.device))

        if not (self.config.final_eval or self.config.eval_every):
            return {}  # the run never evaluates
        return {spec.label: component(spec) for spec in parse_reward_specs(self.config.eval_rewards)}

    def _evaluate(self, model: ModelAdapter, process_index: int = 0, num_processes: int = 1) -> EvalResult:
        """`model` on the eval prompts with the eval rewards (this process's share)."""
        config = self.config
        return evaluate(model, load_prompt_set(config.prompts.eval), self.eval_rewards, config.prompts.eval_seeds,
                        config.sampling.num_steps, config.sampling.shift, process_index=process_index, num_processes=num_processes,
                        guidance=config.prompts.eval_guidance, lockstep=self.sharding.enabled,
                        frames={spec.label: spec.frames for spec in parse_reward_specs(config.eval_rewards)})

    def _evaluate_shared(self, model: ModelAdapter) -> EvalResult:
        """`model` on the eval prompts, each process sampling its share, gathered on every process."""
        accelerator = self.accelerator
        return gather_results(self._evaluate(model, accelerator.process_index, accelerator.num_processes), accelerator)

    def heldout_metrics(self) -> dict[str, float]:
        """The policy's mean score on the eval prompts, `eval_<score>` for each eval reward and its
        extras (fixed noise, ODE), each process sampling its share of the prompts; `eval_seconds`."""
        start = time.perf_counter()
        memory: dict[str, float] = {}
        with self.memory.phase("eval", memory), self.evaluated_weights():
            summary = summarize(self._evaluate_shared(self.adapter))["all"]
        memory = {key: self.collective.max(torch.tensor([value], dtype=torch.float64)).item() for key, value in memory.items()}
        return {**{f"eval_{name}": row["mean"] for name, row in summary.items()}, "eval_seconds": time.perf_counter() - start, **memory}

    def fixed_samples(self, prompts: int = 4, images_per_prompt: int = 4) -> tuple[torch.Tensor, list[str]]:
        """The policy's ODE samples (prompts · images_per_prompt, 3, H, W) of the first eval prompts
        with fixed seeds, and those prompts: the same noise at every call, so grids compare across
        iterations; an editing set's rows start with their source image. On a sharded denoiser every process calls it."""
        config = self.config
        prompt_set = load_prompt_set(config.prompts.eval)
        chosen, metadata = prompt_set.prompts[:prompts], prompt_set.metadata[:prompts]
        with self.evaluated_weights():
            images = sample_ode(self.adapter, chosen, images_per_prompt, config.sampling.num_steps, config.sampling.shift,
                                guidance=config.prompts.eval_guidance, metadata=metadata)[0]
        return beside_sources(images, metadata, images_per_prompt), chosen

    def final_evaluation(self) -> dict[str, dict[str, float]]:
        """Base (adapter disabled) vs trained on the eval prompts with the eval rewards and the same
        fixed noise: mean scores by model; the full summaries go to eval.json in the run directory
        (written by the main process). Every process calls it and samples its share of the prompts."""
        config = self.config
        with self.finetune.base() as base:
            summaries = {"base": summarize(self._evaluate_shared(base))}
        with self.evaluated_weights():
            summaries["trained"] = summarize(self._evaluate_shared(self.adapter))
        scales = {label: getattr(reward, "scale", "unspecified") for label, reward in self.eval_rewards.items()}
        report = {"prompts": config.prompts.eval, "images_per_prompt": config.prompts.eval_seeds, "scales": scales,
                  "after_iteration": config.iterations - 1, **summaries}
        if self.accelerator.is_main_process:
            storage.write_text(self.run_dir / "eval.json", json.dumps(report, indent=1))
        return {model: {name: row["mean"] for name, row in summary["all"].items()} for model, summary in summaries.items()}
