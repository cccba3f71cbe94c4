"""The training loop: one iteration is rollout → rewards → fusion/advantages → pruning → update.

Everything random in an iteration (the prompts drawn, every node's noise, step subsampling, the
minibatch order) is a pure function of (run seed, iteration), so a checkpoint needs only the LoRA
weights, the optimizer and the iteration to continue exactly as if the run had never stopped.
"""

from __future__ import annotations

import copy
import json
import math
import shutil
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration, set_seed
from tqdm.auto import tqdm

from branchdiff import prune
from branchdiff.advantage import depthwise_advantages, fuse_rewards
from branchdiff.config import TrainConfig, save_config, tree_spec
from branchdiff.data import draw_prompts, load_prompts
from branchdiff.evaluate import evaluate_tiny
from branchdiff.explore import ExploreResult, explore_seeds, explore_tree, latent_difference, ranking_agreement
from branchdiff.loss import clipped_surrogate, kl_to_reference
from branchdiff.models import load_adapter
from branchdiff.models.base import ModelAdapter, select_embeds
from branchdiff.models.lora import add_lora, load_lora_state, save_lora
from branchdiff.quant import QuantConfig, make_quantized_copy, refresh_quantized_copy
from branchdiff.report import save_grid
from branchdiff.rollout import NoiseAddress, Rollout, SamplerSettings, grow, logprob_std_scale
from branchdiff.tree import build_tree
from branchdiff.rewards.registry import build_reward, reward_key, score_batch
from branchdiff.schedulers.flow import gaussian_log_prob, sigma_schedule, step

CHECKPOINT_PREFIX = "iter-"


@dataclass
class IterationResult:
    metrics: dict[str, float]
    rollout: Rollout
    leaf_images: torch.Tensor  # (L, 3, H, W)


def sampler_settings(config: TrainConfig) -> SamplerSettings:
    s = config.sampling
    return SamplerSettings(s.sde, s.noise_level, s.max_batch, s.exact, config.tree.split_logprob)


class Trainer:
    def __init__(self, config: TrainConfig) -> None:
        self.config = config
        self.run_dir = Path(config.output_dir)
        self.accelerator = Accelerator(
            cpu=not torch.cuda.is_available(),
            mixed_precision=config.train.mixed_precision,
            log_with="tensorboard" if config.logging.tensorboard else None,
            project_config=ProjectConfiguration(project_dir=str(self.run_dir), logging_dir=str(self.run_dir / "logs")),
        )
        set_seed(config.seed)
        self.adapter = load_adapter(config.model.family, config.model.path, self.accelerator.device)
        self.lora_params = add_lora(
            self.adapter.denoiser, self.adapter.lora_target_modules, config.train.lora_rank, config.train.lora_alpha, config.seed
        )
        optimizer = torch.optim.AdamW(self.lora_params, lr=config.train.learning_rate, weight_decay=config.train.weight_decay)
        self.adapter.denoiser, self.optimizer = self.accelerator.prepare(self.adapter.denoiser, optimizer)
        self.accelerator.register_save_state_pre_hook(self._save_hook)
        self.accelerator.register_load_state_pre_hook(self._load_hook)
        self.reward = build_reward(config.reward, str(self.accelerator.device))
        self.reward_key = reward_key(self.reward)
        self.prompts = load_prompts(config.prompts.train)
        self.sigmas = sigma_schedule(config.sampling.num_steps, config.sampling.shift).to(self.accelerator.device)
        self.settings = sampler_settings(config)
        if self.accelerator.num_processes > 1 and config.explore.mode == "tree" and config.train.optimizer_every:
            # regenerated sub-trees differ in size between processes, so would their numbers of gradient syncs
            raise ValueError("explore.mode=tree with several processes needs train.optimizer_every=0 (one optimizer step per iteration)")
        self.explorer = self._make_explorer()
        self.start_iteration = 0

    def _make_explorer(self) -> ModelAdapter | None:
        """The policy itself (backend none) or a 4-bit copy of it, for explore modes."""
        explore = self.config.explore
        if explore.mode == "off":
            return None
        if explore.backend == "none":
            return self.adapter
        self.quant_config = QuantConfig.for_family(self.config.model.family, explore.backend, explore.min_features)
        explorer = copy.copy(self.adapter)
        explorer.denoiser = make_quantized_copy(self.accelerator.unwrap_model(self.adapter.denoiser), self.quant_config)
        return explorer

    def refresh_explorer(self) -> None:
        """Merge the current LoRA into the quantised copy, so exploration follows the policy."""
        if self.explorer is not None and self.explorer is not self.adapter:
            refresh_quantized_copy(self.explorer.denoiser, self.accelerator.unwrap_model(self.adapter.denoiser), self.quant_config)

    # ---------------------------------------------------------------- checkpoints
    def _save_hook(self, models: list, weights: list, output_dir: str) -> None:
        """Only the LoRA weights of the denoiser are saved (not the frozen base), by one process."""
        if self.accelerator.is_main_process:
            for model in models:
                save_lora(self.accelerator.unwrap_model(model), Path(output_dir))
        weights.clear()

    def _load_hook(self, models: list, input_dir: str) -> None:
        while models:
            load_lora_state(self.accelerator.unwrap_model(models.pop()), Path(input_dir))

    @property
    def checkpoint_dir(self) -> Path:
        return self.run_dir / "checkpoints"

    def checkpoints(self) -> list[Path]:
        return sorted(self.checkpoint_dir.glob(f"{CHECKPOINT_PREFIX}*"))

    def save_checkpoint(self, iteration: int) -> None:
        """Atomic: written to a temporary directory, then renamed; old ones pruned after."""
        final = self.checkpoint_dir / f"{CHECKPOINT_PREFIX}{iteration:06d}"
        staging = self.checkpoint_dir / f".staging-{iteration:06d}"
        if self.accelerator.is_main_process:
            shutil.rmtree(staging, ignore_errors=True)
        self.accelerator.wait_for_everyone()
        self.accelerator.save_state(str(staging))
        if self.accelerator.is_main_process:
            (staging / "trainer_state.json").write_text(json.dumps({"iteration": iteration}))
            shutil.rmtree(final, ignore_errors=True)
            staging.rename(final)
            for old in self.checkpoints()[: -self.config.logging.keep_checkpoints]:
                shutil.rmtree(old)
        self.accelerator.wait_for_everyone()

    def resume(self, checkpoint: str) -> None:
        """Continue from `checkpoint` ("latest" or a path): LoRA, optimizer, iteration."""
        path = Path(checkpoint)
        if checkpoint == "latest":
            found = self.checkpoints()
            if not found:
                raise FileNotFoundError(f"--resume latest: no checkpoint under {self.checkpoint_dir}")
            path = found[-1]
        if not (path / "trainer_state.json").is_file():
            raise FileNotFoundError(f"--resume {checkpoint}: {path} is not a checkpoint (no trainer_state.json)")
        self.accelerator.load_state(str(path))
        self.refresh_explorer()  # the 4-bit copy must follow the restored LoRA
        done = json.loads((path / "trainer_state.json").read_text())["iteration"]
        self.start_iteration = done + 1
        self._truncate_metrics(done)

    def _truncate_metrics(self, last_iteration: int) -> None:
        """Drop metrics lines after the checkpoint (a resumed run rewrites them)."""
        path = self.run_dir / "metrics.jsonl"
        if self.accelerator.is_main_process and path.is_file():
            lines = [l for l in path.read_text().splitlines() if _iteration_of(l) <= last_iteration]
            tmp = path.with_suffix(".tmp")
            tmp.write_text("".join(l + "\n" for l in lines))
            tmp.replace(path)

    # ---------------------------------------------------------------- one iteration
    def iteration_prompts(self, iteration: int) -> tuple[list[str], tuple[int, ...]]:
        """This process's prompts and their global keys (slots of the iteration's global draw)."""
        per_process = self.config.prompts.per_iteration
        indices = draw_prompts(self.prompts, per_process * self.accelerator.num_processes, self.config.seed, iteration)
        first = self.accelerator.process_index * per_process
        keys = tuple(range(first, first + per_process))
        return [self.prompts[indices[k]] for k in keys], keys

    def trainable_mask(self, rollout: Rollout, node_advantages: torch.Tensor, iteration: int) -> torch.Tensor:
        """(N,) edges that get gradients: SDE edges with a density, in the trainable steps, after
        step subsampling and (while active) depth and width pruning."""
        config, tree = self.config, rollout.tree
        spec = tree.spec
        limit = math.floor(config.train.train_steps_fraction * spec.num_steps + 1e-9)
        steps = [s for s in range(limit) if spec.is_sde(s)]
        generator = torch.Generator().manual_seed(config.seed * 7_919 + iteration)
        mask = tree.is_sde_edge & (rollout.std > 0)
        mask &= prune.step_mask(tree, prune.subsample_steps(steps, config.train.step_fraction, generator))
        p = config.prune
        if iteration < p.active_fraction * config.iterations:
            mask &= prune.depth_mask(tree, prune.sliding_depths(frozenset(p.depths), iteration, p.slide_every, p.stop_depth))
            mask &= prune.width_mask(tree, node_advantages, p.width, p.width_ratio)
        return mask

    def rollout_and_score(self, iteration: int, per_node: bool = False) -> tuple[Rollout, torch.Tensor, dict[str, torch.Tensor], dict]:
        """Grow this iteration's trees and score the leaves: (rollout, leaf images, scores, info)."""
        prompts, keys = self.iteration_prompts(iteration)
        spec = tree_spec(self.config, iteration)
        embeds = self.adapter.encode_prompts(prompts)
        address = NoiseAddress(self.config.seed, iteration, keys)
        info: dict = {"embeds": embeds}
        start = time.perf_counter()
        with self.accelerator.autocast():
            if self.explorer is None:
                rollout = grow(self.adapter, build_tree(spec, len(prompts)), embeds, self.sigmas, self.settings, address, per_node)
            else:
                explored = self._explore(spec, prompts, embeds, address, iteration)
                rollout = explored.rollout
        info["rollout_seconds"] = time.perf_counter() - start
        start = time.perf_counter()
        images = self.adapter.decode(rollout.leaf_latents)
        tree = rollout.tree
        scores = score_batch(self.reward, images, [prompts[p] for p in tree.prompt[tree.leaf_index].tolist()])
        info["reward_seconds"] = time.perf_counter() - start
        if self.explorer is not None:
            kept_regenerated = scores[self.reward_key].reshape(len(prompts), self.config.explore.keep, -1).mean(-1)
            kept_pool = explored.pool_rewards.gather(1, explored.kept)
            info["explore"] = {**ranking_agreement(kept_pool, kept_regenerated), **latent_difference(explored), **explored.stats}
            info["explore_rewards"] = (kept_pool, kept_regenerated)
        return rollout, images, scores, info

    def _explore(self, spec, prompts: list[str], embeds: dict, address: NoiseAddress, iteration: int) -> ExploreResult:
        explore = self.config.explore
        generator = torch.Generator().manual_seed(self.config.seed * 15_485_863 + iteration)

        def score(latents: torch.Tensor, prompt_index: torch.Tensor) -> torch.Tensor:
            images = self.adapter.decode(latents)
            return score_batch(self.reward, images, [prompts[p] for p in prompt_index.tolist()])[self.reward_key]

        if explore.mode == "tree":
            return explore_tree(self.adapter, self.explorer, embeds, spec, self.sigmas, self.settings, address,
                                explore.keep, explore.selection, score, generator)
        preview_steps = explore.preview_steps or self.config.sampling.num_steps
        preview_sigmas = sigma_schedule(preview_steps, self.config.sampling.shift)
        return explore_seeds(self.adapter, self.explorer, embeds, spec, self.sigmas, preview_sigmas, explore.preview_sampler == "sde",
                             self.settings, address, explore.pool, explore.keep, explore.selection, score, generator)

    def run_iteration(self, iteration: int, per_node: bool = False) -> IterationResult:
        """One iteration; `per_node` grows the tree with batch-1 forwards (benchmarks)."""
        config = self.config
        rollout, images, scores, info = self.rollout_and_score(iteration, per_node)
        tree = rollout.tree
        leaf_rewards = scores[self.reward_key]
        node_rewards = fuse_rewards(tree, leaf_rewards, rollout.log_prob, config.advantage.fusion, config.advantage.alpha)
        node_advantages = depthwise_advantages(tree, node_rewards, config.advantage.scope).clamp(-config.advantage.clip, config.advantage.clip)
        mask = self.trainable_mask(rollout, node_advantages, iteration)
        start = time.perf_counter()
        train_stats = self.update(rollout, info["embeds"], node_advantages, mask, iteration)
        gathered = {k: self.accelerator.gather(v.to(self.accelerator.device)).float() for k, v in scores.items()}
        metrics = {
            "iteration": iteration,
            "reward_mean": gathered[self.reward_key].mean().item(),
            "reward_std": gathered[self.reward_key].std().item() if len(leaf_rewards) > 1 else 0.0,
            **{f"accuracy_{k}": v.mean().item() for k, v in gathered.items() if k != self.reward_key},
            **train_stats,
            "nfe_rollout": rollout.nfe,
            "edges_trained": int(mask.sum()),
            "rollout_seconds": info["rollout_seconds"],
            "reward_seconds": info["reward_seconds"],
            "train_seconds": time.perf_counter() - start,
            **{f"explore_{k}": v for k, v in info.get("explore", {}).items()},
        }
        self.refresh_explorer()
        return IterationResult(metrics, rollout, images)

    def update(self, rollout: Rollout, embeds: dict, node_advantages: torch.Tensor, mask: torch.Tensor, iteration: int) -> dict[str, float]:
        """Clipped GRPO on the masked edges. Siblings share their parent's forward: minibatches are
        made of parent nodes; each optimizer step averages the loss over its edges."""
        config, tree, accelerator = self.config, rollout.tree, self.accelerator
        edges = torch.nonzero(mask).squeeze(1)  # (E,) child node of each trained edge
        stats = {"loss": 0.0, "clip_fraction": 0.0, "kl": 0.0, "logprob_check": 0.0, "nfe_trained": 0, "optimizer_steps": 0}
        if len(edges) == 0:
            return stats
        parents, edge_parent = torch.unique(tree.parent[edges], return_inverse=True)  # (U,), (E,)
        generator = torch.Generator().manual_seed(config.seed * 104_729 + iteration)
        order = torch.randperm(len(parents), generator=generator)
        minibatches = [rows.sort().values for rows in order.split(config.train.minibatch)]  # rows of `parents`
        minibatch_edges = [torch.nonzero(torch.isin(edge_parent, rows)).squeeze(1) for rows in minibatches]  # rows of `edges`
        groups = _optimizer_groups([len(e) for e in minibatch_edges], config.train.optimizer_every)
        std_scale = logprob_std_scale(tree, self.settings)  # (N,)
        denoiser = accelerator.unwrap_model(self.adapter.denoiser)
        total_loss = clipped = kl_total = 0.0
        first = True
        for group in groups:
            group_edges = sum(len(minibatch_edges[m]) for m in group)
            for index, m in enumerate(group):
                parent_rows, edge_rows = minibatches[m], minibatch_edges[m]  # (u,), (e,)
                local = torch.searchsorted(parent_rows, edge_parent[edge_rows])  # (e,) parent row of each edge
                parent_nodes, child_nodes = parents[parent_rows], edges[edge_rows]
                x = rollout.latents[parent_nodes]
                sigma = self.sigmas[tree.depth[parent_nodes]]
                sigma_next = self.sigmas[tree.depth[child_nodes]]
                node_embeds = select_embeds(embeds, tree.prompt[parent_nodes])
                sync = index == len(group) - 1
                with (nullcontext() if sync else accelerator.no_sync(self.adapter.denoiser)), accelerator.autocast():
                    velocity = self.adapter.predict_velocity(x, sigma, node_embeds)[local]
                    x_parent = x[local]
                    out = step(self.settings.sde, x_parent, velocity, sigma[local], sigma_next, torch.zeros_like(x_parent), self.settings.noise_level, self.sigmas[1])
                    std = out.std * std_scale[child_nodes].to(out.std.device)
                    log_prob = gaussian_log_prob(rollout.latents[child_nodes], out.mean, std)
                    old = rollout.log_prob[child_nodes].to(log_prob.device)
                    advantages = node_advantages[child_nodes].to(log_prob.device).float()
                    per_edge, was_clipped = clipped_surrogate(log_prob, old, advantages, config.train.clip_range)
                    if config.train.kl_beta > 0:
                        with torch.no_grad():
                            denoiser.disable_adapters()
                            ref_velocity = self.adapter.predict_velocity(x, sigma, node_embeds)[local]
                            denoiser.enable_adapters()
                            ref = step(self.settings.sde, x_parent, ref_velocity, sigma[local], sigma_next, torch.zeros_like(x_parent), self.settings.noise_level, self.sigmas[1])
                        kl = kl_to_reference(out.mean, ref.mean, std)
                        per_edge = per_edge + config.train.kl_beta * kl
                        kl_total += kl.sum().item()
                    if first:
                        stats["logprob_check"] = (log_prob.detach() - old).abs().max().item()
                        first = False
                    accelerator.backward(per_edge.sum() / group_edges)
                total_loss += per_edge.sum().item()
                clipped += was_clipped.sum().item()
                stats["nfe_trained"] += len(parent_nodes)
            if accelerator.sync_gradients:
                stats["grad_norm"] = float(accelerator.clip_grad_norm_(self.lora_params, config.train.max_grad_norm))
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            stats["optimizer_steps"] += 1
        stats.update(loss=total_loss / len(edges), clip_fraction=clipped / len(edges), kl=kl_total / len(edges))
        return stats

    # ---------------------------------------------------------------- the run
    def train(self) -> None:
        config, accelerator = self.config, self.accelerator
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if accelerator.is_main_process:
            save_config(config, self.run_dir / "config.yaml")
        accelerator.init_trackers("branchdiff")
        progress = tqdm(range(self.start_iteration, config.iterations), initial=self.start_iteration, total=config.iterations,
                        desc="train", disable=not accelerator.is_local_main_process)
        for iteration in progress:
            result = self.run_iteration(iteration)
            metrics = result.metrics
            accelerator.log({k: v for k, v in metrics.items() if k != "iteration"}, step=iteration)
            if accelerator.is_main_process:
                with (self.run_dir / "metrics.jsonl").open("a") as handle:
                    handle.write(json.dumps(metrics) + "\n")
                every = config.logging.sample_every
                if every and (iteration % every == 0 or iteration == config.iterations - 1):
                    tree = result.rollout.tree
                    leaves_per_prompt = len(tree.leaf_index) // tree.num_prompts
                    save_grid(result.leaf_images[: 4 * leaves_per_prompt], self.run_dir / "samples" / f"iter-{iteration:06d}.png", nrow=leaves_per_prompt)
            progress.set_postfix(reward=f"{metrics['reward_mean']:.3f}", strict=f"{metrics.get('accuracy_strict', float('nan')):.2f}")
            every = config.logging.checkpoint_every
            if (every and (iteration + 1) % every == 0) or iteration == config.iterations - 1:
                self.save_checkpoint(iteration)
        if accelerator.is_main_process:
            save_lora(accelerator.unwrap_model(self.adapter.denoiser), self.run_dir / "lora")
        accelerator.end_training()

    def final_evaluation(self) -> dict[str, dict[str, float]]:
        """Base (adapter disabled) vs trained on the eval prompts with the same fixed noise;
        written to eval.json in the run directory."""
        config = self.config
        prompts = load_prompts(config.prompts.eval)
        denoiser = self.accelerator.unwrap_model(self.adapter.denoiser)
        args = (prompts, config.prompts.eval_seeds, config.sampling.num_steps, config.sampling.shift)
        denoiser.disable_adapters()
        rows = {"base": evaluate_tiny(self.adapter, *args)}
        denoiser.enable_adapters()
        rows["trained"] = evaluate_tiny(self.adapter, *args)
        (self.run_dir / "eval.json").write_text(json.dumps({"prompts": config.prompts.eval, **rows}, indent=1))
        return rows


def _iteration_of(line: str) -> float:
    """The iteration of a metrics line; a line cut off by a crash counts as after any checkpoint."""
    try:
        return json.loads(line)["iteration"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return float("inf")


def _optimizer_groups(edges_per_minibatch: list[int], every: int) -> list[list[int]]:
    """Minibatch indices of each optimizer step: one step for all (every = 0), or a new step once
    at least `every` edges have been accumulated."""
    if every <= 0:
        return [list(range(len(edges_per_minibatch)))]
    groups, current, count = [], [], 0
    for index, edges in enumerate(edges_per_minibatch):
        current.append(index)
        count += edges
        if count >= every:
            groups.append(current)
            current, count = [], 0
    if current:
        groups.append(current)
    return groups