"""Checks across a run's keys, which single fields cannot express: each a `ConfigError` with one
line naming the key, the value and the fix. Combinations that would run but train nothing (no
trainable step, a group of one, cps without noise) are refused here too, before anything loads.
"""

from __future__ import annotations

import difflib
from dataclasses import fields

from branchdiff.core.advantage import is_median
from branchdiff.errors import ConfigError
from branchdiff.models.registry import FAMILIES, LORA_TARGET_SETS, STEP_KINDS, image_size
from branchdiff.objectives.registry import OBJECTIVES, dataset_kind, decoupled, flow_only, section_of
from branchdiff.rewards.combine import parse_reward_specs
from branchdiff.settings.config import TrainConfig
from branchdiff.settings.trees import tree_spec, validate_cps, validate_ode, validate_trainable, validate_tree

TRACKERS = ("tensorboard", "wandb", "swanlab")  # logging.report_to (branchdiff/training/trackers.py)


def tracker_names(report_to: str | list[str]) -> list[str]:
    """`logging.report_to` as a list of trackers ("none": none), or a one-line ConfigError."""
    names = [report_to] if isinstance(report_to, str) else list(report_to)
    if names == ["none"] or not names:
        return []
    if any(n not in TRACKERS for n in names) or len(set(names)) != len(names):
        raise ConfigError(f"logging.report_to={report_to}: choose tensorboard, wandb, swanlab or none, or a list of them without repeats, "
                          "e.g. logging.report_to=[tensorboard,wandb]")
    return names


def validate(config: TrainConfig) -> None:
    """Cross-field checks that single fields cannot express."""
    if not config.output_dir.strip():
        raise ConfigError("'output_dir' is empty; pass output_dir= a folder for the run, e.g. output_dir=runs/my-run")
    tracker_names(config.logging.report_to)
    _validate_finetune(config)
    validate_warmup(config.train.warmup_iterations, config.iterations)
    validate_decay_start(config.train.decay_start, config.train.warmup_iterations, config.train.lr_schedule)
    validate_decay(config.train.ema_decay)
    if config.watch.stop and not config.eval_every:
        raise ConfigError("'watch.stop' = true needs held-out evaluations to watch: set eval_every (e.g. eval_every=20) and the gold "
                          "score in watch.gold (an eval_rewards score)")
    family = FAMILIES[config.model.family]
    try:
        size = image_size(config.model.resolution, family.resolution)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if config.model.expert != "high" and not family.video:
        raise ConfigError(f"'model.expert' = {config.model.expert!r} chooses one of Wan 2.2's two experts; model.family="
                          f"{config.model.family} has one denoiser: leave model.expert unset")
    if config.model.expert == "both" and config.model.finetune == "full":
        raise ConfigError("'model.expert' = 'both' trains LoRA on Wan 2.2's two experts; full fine-tuning trains one expert per run: "
                          "set model.finetune=lora, or model.expert=high or low")
    if config.model.guidance_2 is not None and not family.video:
        raise ConfigError(f"'model.guidance_2' = {config.model.guidance_2} is the guidance of Wan 2.2's low-noise expert; model.family="
                          f"{config.model.family} has one denoiser: leave model.guidance_2 unset")
    scales = {"sampling.guidance": config.sampling.guidance, "prompts.eval_guidance": config.prompts.eval_guidance}
    if config.model.guidance_2 is not None and all(g is not None and g <= 1 for g in scales.values()):  # Wan guides above 1, as its pipeline
        raise ConfigError(f"'model.guidance_2' = {config.model.guidance_2} is the CFG scale of Wan 2.2's low-noise expert, and "
                          f"{' and '.join(f'{key}={g:g}' for key, g in scales.items())} run no classifier-free guidance (above 1 guides), so it "
                          "would be ignored: raise one of them, or leave model.guidance_2 unset")
    for key, frames in (("model.frames", config.model.frames), ("eval.frames", config.eval.frames)):
        if frames is not None and not family.video:
            raise ConfigError(f"'{key}' = {frames}: model.family={config.model.family} makes images, not videos; leave {key} unset")
    try:
        evaluated = image_size(config.eval.resolution, size)
    except ValueError as error:
        raise ConfigError(str(error).replace("'model.resolution'", "'eval.resolution'")) from None
    if family.fixed_resolution and evaluated != size:
        raise ConfigError(f"'eval.resolution' = {config.eval.resolution}: model.family={config.model.family} makes only "
                          f"{family.resolution}×{family.resolution} images; leave eval.resolution unset")
    if not config.model.prompt_instruction and not family.instruction:
        raise ConfigError(f"'model.prompt_instruction' = false applies to families whose prompts carry an instruction (sana); "
                          f"model.family={config.model.family} has none: leave it unset")
    if family.fixed_resolution and size != image_size(None, family.resolution):
        raise ConfigError(f"'model.resolution' = {config.model.resolution}: model.family={config.model.family} makes only "
                          f"{family.resolution}×{family.resolution} images; leave model.resolution unset")
    try:
        parse_reward_specs(config.reward, "reward")
        parse_reward_specs(config.eval_rewards, "eval_rewards")
    except ValueError as error:
        raise ConfigError(str(error)) from None
    validate_tree(config)
    steps_family = FAMILIES[config.model.family].steps
    if config.sampling.sde == "ode":
        validate_ode(config, steps_family)
    elif config.sampling.sde not in STEP_KINDS[steps_family]:
        raise ConfigError(f"'sampling.sde' = {config.sampling.sde!r} is not an SDE of model.family={config.model.family} "
                          f"({steps_family} steps); allowed: {', '.join(STEP_KINDS[steps_family])}")
    if steps_family == "ddim" and config.sampling.shift is not None:
        raise ConfigError(f"'sampling.shift' = {config.sampling.shift} applies to flow families; model.family={config.model.family} "
                          "samples on its scheduler's DDIM timesteps: leave sampling.shift unset")
    if config.sampling.sde == "cps":
        validate_cps(config)
    _validate_loss(config, steps_family)
    _validate_explore(config)
    _validate_block_cache(config)
    _validate_unread_sections(config)
    if not decoupled(config.train.loss):  # the GRPO objectives train SDE edges; the decoupled ones train final samples
        validate_trainable(config)


def _validate_unread_sections(config: TrainConfig) -> None:
    """An objective's keys (`dpo.beta`, `awm.power`, a plugin's own section) set on a run of another objective do nothing:
    refused, naming the objective that reads them. A section at its defaults is accepted (`branchdiff config` writes
    every section), so only a value that differs from its default is a key that was set."""
    active = section_of(config.train.loss)
    owners = {section: name for name in OBJECTIVES if (section := section_of(name)) is not None}
    for section, keys in config.objectives.items():
        if section == active:
            continue
        defaults = type(keys)()
        for field in fields(keys):
            value = getattr(keys, field.name)
            if value != getattr(defaults, field.name):
                owner = owners.get(section, section)
                raise ConfigError(f"'{section}.{field.name}' = {value!r} is a key of train.loss={owner}, and this run trains "
                                  f"train.loss={config.train.loss}, which never reads it; remove it (or set train.loss={owner})")


def _validate_block_cache(config: TrainConfig) -> None:
    """A first-block cache (`sampling.block_cache`) changes what rollouts sample: only where no rollout log-prob is trained."""
    cache = config.sampling.block_cache
    if not cache:
        return
    if cache >= 1:
        raise ConfigError(f"'sampling.block_cache' = {cache:g}: the threshold is a relative change of the first block's residual, which "
                          "is almost never 1 or more, so every forward after a node's first would be skipped; use a value below 1 "
                          "(0.3 was measured on the video task: docs/gpu.md)")
    uncacheable = FAMILIES[config.model.family].uncacheable
    if uncacheable:
        raise ConfigError(f"'sampling.block_cache' = {cache:g} with model.family={config.model.family}: {uncacheable}, so the cache cannot "
                          "follow them; set sampling.block_cache=0")
    if dataset_kind(config.train.loss):
        raise ConfigError(f"'sampling.block_cache' = {cache:g} with train.loss={config.train.loss}, which trains on a dataset and grows no "
                          "rollouts: there is nothing to cache; set sampling.block_cache=0")
    if config.explore.mode == "search":
        raise ConfigError(f"'sampling.block_cache' = {cache:g} with explore.mode=search, which grows its trees a node at a time: the cache "
                          "follows a rollout's levels only; set sampling.block_cache=0 or explore.mode=seeds or tree")
    if not decoupled(config.train.loss):
        on_samples = ", ".join(name for name in OBJECTIVES if decoupled(name) and not dataset_kind(name))
        raise ConfigError(f"'sampling.block_cache' = {cache:g} with train.loss={config.train.loss}: a cached step is not the policy's, so the "
                          f"log-probs it trains would not be the rollout's (the ratio would not be 1 before the first update); use an "
                          f"objective that trains final samples ({on_samples}) or sampling.block_cache=0")
    if config.sampling.exact:
        raise ConfigError(f"'sampling.block_cache' = {cache:g} with sampling.exact: a cached forward's skips depend on the rows it "
                          "holds, so a node regrown alone would not be bit for bit the same; set one of them off")
    if config.model.compile == "full":
        raise ConfigError(f"'sampling.block_cache' = {cache:g} with model.compile=full: the cache wraps the denoiser's blocks, which "
                          "a whole-model compilation traces through; use model.compile=blocks (compiled blocks stay compiled) or none")


MEDIAN_BASELINE = ("grpo", "grpo-guard", "grpo-layertuning", "dppo", "nft", "awm", "dgpo")  # objectives whose advantages take advantage.baseline


def _validate_loss(config: TrainConfig, steps_family: str) -> None:
    """The objective's family and its own step count: refused here, before any model loads."""
    loss = config.train.loss
    if steps_family == "ddim" and flow_only(loss):
        raise ConfigError(f"'train.loss' = {loss!r} {flow_only(loss)}; model.family={config.model.family} is an ε-prediction "
                          "(DDIM) family: use train.loss=grpo")
    steps = config.sampling.num_steps
    own = getattr(config, loss.replace("-", "_"), None)  # the objective's own section, where it has one
    if decoupled(loss) and not dataset_kind(loss) and own is not None and getattr(own, "timesteps", 0) > steps:  # a dataset objective draws
        # its noise levels on the 1000-step schedule, not the sampler's steps
        raise ConfigError(f"'{loss}.timesteps' = {own.timesteps} exceeds sampling.num_steps = {steps}; use {loss}.timesteps ≤ {steps}")
    if config.advantage.scale == "mad" and (not is_median(config.advantage.baseline) or config.advantage.scope != "tree"):
        raise ConfigError(f"'advantage.scale' = 'mad' divides each group's distances from its median by their median (MC-GRPO); it needs "
                          f"advantage.baseline=median and advantage.scope=tree (got {config.advantage.baseline} and {config.advantage.scope}): "
                          "set those, or advantage.scale=std")
    if is_median(config.advantage.baseline) and loss not in MEDIAN_BASELINE:
        raise ConfigError(f"'advantage.baseline' = '{config.advantage.baseline}' applies to {', '.join(MEDIAN_BASELINE)}; train.loss={loss} ranks its samples "
                          "its own way: use advantage.baseline=mean")
    if loss == "dpo" and config.dpo.pairs == "siblings" and not config.tree.splits:
        raise ConfigError("'dpo.pairs' = 'siblings' pairs leaves that share their last split; the rollouts have no 'tree.splits': "
                          "use dpo.pairs=group, or add splits")
    if config.reward_overlap and config.explore.mode != "off":
        raise ConfigError(f"'reward_overlap' scores parts of a plain rollout while the next grows; explore.mode={config.explore.mode} "
                          "scores its candidate pool its own way: use reward_overlap=false with explore")
    if dataset_kind(loss) and config.explore.mode != "off":
        raise ConfigError(f"train.loss={loss} trains on its {dataset_kind(loss)} ({loss.replace('-', '_')}.data), not on rollouts: "
                          "explore.mode must stay off")
    leaves = tree_spec(config, 0).leaves
    if decoupled(loss) and not dataset_kind(loss) and config.explore.mode == "off" and leaves < 2:
        raise ConfigError(f"train.loss={loss} compares the samples of a prompt, and the rollouts give each prompt {leaves}: use tree.roots ≥ 2 "
                          "or a split (tree.splits)")


def _validate_finetune(config: TrainConfig) -> None:
    """A named LoRA target set or a list of module-name patterns; full fine-tuning trains float32 weights."""
    targets = config.model.lora_targets
    if isinstance(targets, str) and targets not in LORA_TARGET_SETS:
        close = difflib.get_close_matches(targets, LORA_TARGET_SETS, n=1)
        raise ConfigError(f"'model.lora_targets' = {targets!r} is not a named set; allowed: {', '.join(LORA_TARGET_SETS)}, or a list of "
                          f"module-name patterns such as [to_q, to_v]{f' (did you mean {close[0]!r}?)' if close else ''}")
    if isinstance(targets, list) and (not targets or not all(t.strip() for t in targets)):
        raise ConfigError(f"'model.lora_targets' = {targets!r}: give at least one module-name pattern, each non-empty")
    if config.model.finetune == "full" and config.model.dtype != "float32":
        raise ConfigError(f"'model.finetune' = 'full' trains the denoiser's own weights, which need model.dtype=float32 (got "
                          f"{config.model.dtype!r}); compute in bf16 with train.mixed_precision=bf16, or fine-tune a LoRA")


def _validate_explore(config: TrainConfig) -> None:
    explore = config.explore
    if explore.mode == "search" and config.train.loss != "nft":
        raise ConfigError(f"'explore.mode' = 'search' keeps only the searched images, not their trees' log-probs: it trains with "
                          f"train.loss=nft (DiffusionNFT), not {config.train.loss!r}")
    if explore.mode == "search" and config.sampling.sde == "ode":
        raise ConfigError("'explore.mode' = 'search' searches SDE trees: set sampling.sde to an SDE (flow, dance or cps), not ode")
    if explore.mode == "search" and explore.search_budget < config.sampling.num_steps:
        raise ConfigError(f"'explore.search_budget' = {explore.search_budget} network rows cannot make one image: a {config.sampling.num_steps}-step "
                          f"image costs at least {config.sampling.num_steps} (twice under CFG); use explore.search_budget ≥ "
                          f"{explore.keep * config.sampling.num_steps} for explore.keep={explore.keep} images")
    if explore.mode == "seeds" and explore.keep > explore.pool:
        raise ConfigError(f"'explore.keep' = {explore.keep} exceeds 'explore.pool' = {explore.pool}")
    if explore.mode == "tree":
        leaves = tree_spec(config, 0).leaves
        if explore.keep > leaves:
            raise ConfigError(f"'explore.keep' = {explore.keep} exceeds the {leaves} leaves per prompt of the tree")


def validate_warmup(warmup_iterations: int, iterations: int) -> None:
    """Warm-up must end before the run does."""
    if warmup_iterations and warmup_iterations >= iterations:
        raise ConfigError(f"'train.warmup_iterations' = {warmup_iterations} is not below iterations = {iterations}; "
                          f"warm up for fewer iterations (e.g. train.warmup_iterations={iterations // 10})")


def validate_decay_start(decay_start: int, warmup_iterations: int, schedule: str) -> None:
    """A decay starts after the warm-up, and only a decaying schedule has one."""
    if decay_start and schedule == "constant":
        raise ConfigError(f"'train.decay_start' = {decay_start} needs a decaying train.lr_schedule (linear or cosine); "
                          "set train.lr_schedule=cosine, or train.decay_start=0")
    if decay_start and decay_start < warmup_iterations:
        raise ConfigError(f"'train.decay_start' = {decay_start} is inside the warm-up (train.warmup_iterations = {warmup_iterations}); "
                          f"start the decay at or after it (e.g. train.decay_start={warmup_iterations})")


def validate_decay(decay: float) -> None:
    """An average must move: the decay is in [0, 1)."""
    if not 0.0 <= decay < 1.0:
        raise ConfigError(f"'train.ema_decay' = {decay} is not in [0, 1); use e.g. train.ema_decay=0.99 "
                          "(an average over about 100 optimizer steps), or 0 for no average")
