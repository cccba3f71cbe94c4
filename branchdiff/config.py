"""Typed run configuration: dataclasses with defaults, packaged YAML presets, `key=value` overrides.

`load_config(source, overrides)` starts from the defaults below, merges a preset name
(`branchdiff/configs/NAME.yaml`) or a YAML file, then the dotted overrides (`tree.roots=4`, values
parsed as YAML, whose booleans are only true/false as in YAML 1.2: `mixed_precision=no` is the word
'no'), and validates: an unknown key, a wrong type or a value outside the allowed set raises
`ConfigError` with one line naming the file and line (when known), the key, the value and what is
allowed, with close matches suggested. Combinations that would run but train nothing (no trainable
step, a group of one, cps without noise) are refused the same way.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from branchdiff.ema import validate_decay
from branchdiff.models.families import FAMILIES, LORA_TARGET_SETS, STEP_KINDS
from branchdiff.typed_yaml import ConfigError, build, choice, in_range, merge, non_negative, parse_override, positive, read_yaml
from branchdiff.lr_schedule import SCHEDULES, validate_warmup
from branchdiff.prune import mix_sde_steps
from branchdiff.rewards.combine import parse_reward_specs
from branchdiff.tree import Split, TreeSpec

PRESET_DIR = Path(__file__).parent / "configs"


@dataclass
class ModelConfig:
    family: str = choice("tiny", *FAMILIES)  # model family (branchdiff/models/, docs/models.md)
    path: str | None = None  # local directory or hub id of the diffusers pipeline; None = the built-in tiny model
    resolution: int | None = in_range(None, 8, 8192)  # image side in pixels; None = the family's default (tiny 32, sd15 512, others 1024)
    dtype: str = choice("float32", "float32", "bfloat16", "float16")  # base weights' dtype (LoRA parameters stay float32)
    offload: bool = False  # keep text encoders and VAE on the CPU except while they run
    finetune: str = choice("lora", "lora", "full")  # lora: a LoRA adapter (train.lora_rank, lora_alpha); full: every weight of the denoiser
    lora_targets: str | list[str] = "attention"  # LoRA's modules: attention | attention+ff | all-linear, or module-name patterns


@dataclass
class PromptConfig:
    train: str = "tiny:train"  # prompt source: tiny:train | tiny:held_out | tiny:all | a .txt file, one prompt a line
    per_iteration: int = positive(8)  # prompts per iteration (per process)
    eval: str = "tiny:held_out"  # prompts of the final base-vs-trained evaluation
    eval_seeds: int = positive(8)  # images per evaluation prompt (fixed seeds)
    eval_guidance: float | None = positive(None)  # guidance of evaluation sampling; None = the family's default


@dataclass
class SamplingConfig:
    num_steps: int = positive(10)  # T denoising steps
    shift: float | None = positive(None)  # σ = s·t / (1 + (s-1)·t) (the anchors'); None = the family's own schedule (tiny: s = 1)
    sde: str = choice("flow", "dance", "flow", "cps", "ddim")  # SDE (schedulers/flow.py, schedulers/ddim.py): dance | flow | cps for flow families, ddim for sd15
    noise_level: float = positive(0.7)  # η for dance and ddim, a for flow and cps (> 0: an SDE needs noise; cps: a in [0.01, 1])
    guidance: float | None = positive(None)  # CFG scale (sd3, sana, sd15) or guidance embedding (flux) of rollouts and training; None = family default
    max_batch: int = positive(64)  # network rows per model forward in rollouts (a CFG prediction takes 2)
    exact: bool = False  # pad rollout forwards to max_batch rows: bit-exact regeneration, slower narrow levels


@dataclass
class TreeConfig:
    roots: int = positive(8)  # roots per prompt: G chains, or trees per prompt
    splits: list[list[float | dict]] = field(default_factory=list)  # [[step, k] or [step, k, {noise_level: x}], ...]
    split_noise_level: float | None = positive(None)  # SDE level (η / a; cps: a in [0.01, 1]) at split steps; None = sampling.noise_level
    anchor_noise_multiplier: float = positive(1.0)  # BranchGRPO release: noise-only ×m at splits, log-prob unscaled (1 = off)
    mix_window: int = non_negative(0)  # 0: every step SDE; n: SDE only on split steps and an n-step window
    mix_start: int = non_negative(0)  # first step of the Mix window
    mix_slide_every: int = non_negative(0)  # move the window one step later every n iterations (0: fixed)


@dataclass
class AdvantageConfig:
    fusion: str = choice("mean", "mean", "logprob_softmax", "max")  # leaf → node reward fusion
    alpha: float = 1.0  # temperature of logprob_softmax fusion
    scope: str = choice("tree", "tree", "batch")  # per-depth normalisation: within a tree, or std over the batch
    clip: float = positive(5.0)  # advantages clipped to ±clip


@dataclass
class PruneConfig:
    depths: list[int] = field(default_factory=list)  # child depths whose edges are not trained
    slide_every: int = non_negative(0)  # shift `depths` one shallower every n iterations (0: static)
    stop_depth: int = non_negative(0)  # the sliding window stops at this depth
    width: str = choice("none", "none", "per_branch", "global")  # width pruning after the last split
    width_ratio: float = positive(0.5)  # fraction of branches kept by width pruning
    active_fraction: float = positive(1.0)  # prune only during this first fraction of iterations


@dataclass
class OptimConfig:
    learning_rate: float = positive(1e-3)  # AdamW learning rate of the LoRA weights (calibrated on the tiny task)
    lr_schedule: str = choice("constant", *SCHEDULES)  # the rate over the run (branchdiff/lr_schedule.py): constant, or linear / cosine decay to 0 at `iterations`
    warmup_iterations: int = non_negative(0)  # linear warm-up from 0 over the first n iterations (0: none)
    lora_rank: int = positive(8)  # LoRA rank on the attention projections
    lora_alpha: float = positive(8.0)  # LoRA scaling numerator
    loss: str = choice("grpo", "grpo")  # the training objective (branchdiff/objectives/, docs/objectives.md): grpo = clipped GRPO
    clip_range: float = positive(1e-3)  # ε of the clipped ratio
    kl_beta: float = non_negative(0.0)  # weight of the KL to the adapter-free base (0: off)
    step_fraction: float = positive(1.0)  # random fraction of SDE steps trained per iteration (DanceGRPO 0.6)
    train_steps_fraction: float = positive(1.0)  # only the first ⌊f·T⌋ steps are trainable (Flow-GRPO 0.99)
    minibatch: int = positive(32)  # parent nodes per training forward/backward
    optimizer_every: int = non_negative(0)  # optimizer step every n trained edges (0: once per iteration)
    max_grad_norm: float = positive(1.0)  # gradient clipping
    max_skipped_steps: int = positive(5)  # stop (after a checkpoint) when this many optimizer steps in a row had a non-finite gradient
    gradient_checkpointing: bool = False  # recompute the denoiser's activations in backward (less memory, ~30% slower)
    optimizer: str = choice("adamw", "adamw", "adamw8bit")  # adamw8bit: bitsandbytes' 8-bit moments (needs the quant extra)
    weight_decay: float = non_negative(1e-4)  # AdamW weight decay
    ema_decay: float = in_range(0.0, 0.0, 1.0)  # moving average of the trained weights per optimizer step, for evaluation and export (branchdiff/ema.py; 0: off, < 1)
    mixed_precision: str = choice("no", "no", "bf16")  # autocast dtype of rollout and training forwards


@dataclass
class ExploreConfig:
    mode: str = choice("off", "off", "seeds", "tree")  # FP4-explore / BF16-train (explore.py); off: plain rollouts
    backend: str = choice("nvfp4-emulated", "none", "nvfp4-emulated", "mxfp4-emulated", "fp8-emulated", "fp8-emulated-tensor", "bnb-fp4", "bnb-nf4", "te-nvfp4", "te-fp8", "torchao-fp8")  # explorer copy (quant.py); none: the policy itself
    pool: int = positive(32)  # seeds mode: candidate seeds per prompt
    keep: int = positive(8)  # kept per prompt: seeds (seeds mode) or leaves (tree mode)
    selection: str = choice("best_worst", "best_worst", "random", "mean_deviation", "extremes_random")  # contrastive subset
    preview_steps: int = non_negative(0)  # seeds mode: steps of the preview (0: sampling.num_steps)
    preview_sampler: str = choice("ode", "ode", "sde")  # seeds mode: ODE preview (Sol-RL) or the training SDE
    min_features: int = non_negative(0)  # linear layers with fewer in·out weights stay unquantised
    fidelity_every: int = non_negative(10)  # every n iterations grow the whole pool with the policy too: explore_spearman_pool (0: never)


@dataclass
class WatchConfig:
    gold: str = ""  # held-out score watched against the training reward (e.g. tiny-geneval.strict); "" = the first eval reward's score
    window: int = positive(2)  # evaluations between the two compared (branchdiff/hacking.py)
    tolerance: float = non_negative(0.02)  # the gold score must fall by more than this to flag divergence
    stop: bool = False  # stop the run, after a checkpoint, when divergence is flagged


@dataclass
class LogConfig:
    sample_every: int = non_negative(10)  # save a grid of leaf samples every n iterations (0: never)
    checkpoint_every: int = non_negative(10)  # accelerator.save_state every n iterations (and at the end)
    checkpoints_total_limit: int = positive(2)  # newest checkpoints kept (older ones deleted after each save)
    tensorboard: bool = True  # log metrics to TensorBoard through accelerate's tracker


@dataclass
class TrainConfig:
    output_dir: str = "runs/tiny"  # run directory: config, metrics, checkpoints, samples, LoRA
    iterations: int = positive(60)  # training iterations (rollout + update)
    seed: int = in_range(0, 0, 2**32 - 1)  # run seed: prompts, noise and initialisation derive from it
    final_eval: bool = True  # evaluate base vs trained on the eval prompts at the end
    eval_every: int = non_negative(0)  # held-out evaluation (prompts.eval, eval_rewards) every n iterations into the metrics (0: never)
    reward: str | dict | list[str | dict] = "tiny-geneval"  # a name, dotted path, {name|remote, weight, required, kwargs}, or a list (docs/rewards.md)
    eval_rewards: list[str | dict] = field(default_factory=lambda: ["tiny-geneval"])  # rewards of the final base-vs-trained evaluation
    collective_timeout: float = in_range(600.0, 5.0, 7 * 86400.0)  # seconds a process waits for the others at a collective before the job ends, naming the silent rank
    reward_combine: str = choice("sum_then_normalize", "sum_then_normalize", "normalize_then_sum")  # how several rewards combine (rewards/combine.py)
    model: ModelConfig = field(default_factory=ModelConfig)
    prompts: PromptConfig = field(default_factory=PromptConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    tree: TreeConfig = field(default_factory=TreeConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    prune: PruneConfig = field(default_factory=PruneConfig)
    train: OptimConfig = field(default_factory=OptimConfig)
    explore: ExploreConfig = field(default_factory=ExploreConfig)
    watch: WatchConfig = field(default_factory=WatchConfig)  # the reward-hacking watch (needs eval_every)
    logging: LogConfig = field(default_factory=LogConfig)


def tree_spec(config: TrainConfig, iteration: int) -> TreeSpec:
    """The tree an iteration grows: the configured splits, and the Mix window where enabled."""
    tree = config.tree
    sde_steps = None
    if tree.mix_window:
        sde_steps = mix_sde_steps(config.sampling.num_steps, tree.mix_window, iteration, tree.mix_start, tree.mix_slide_every)
    splits = tuple(Split(int(s[0]), int(s[1]), s[2].get("noise_level") if len(s) > 2 else None) for s in tree.splits)
    return TreeSpec(config.sampling.num_steps, splits, tree.roots, tree.split_noise_level, tree.anchor_noise_multiplier, sde_steps)


REPLACED_KEYS = {
    "logging.keep_checkpoints": "renamed logging.checkpoints_total_limit (the newest checkpoints kept)",
    "tree.split_noise_scale": "use tree.split_noise_level (an SDE noise level that enters drift and noise, e.g. 1.2 for η = 0.3 × 4) "
                              "or tree.anchor_noise_multiplier (the BranchGRPO release's noise-only kick); see docs/trees.md",
    "tree.split_logprob": "split edges' log-probs are the density sampled; tree.anchor_noise_multiplier reproduces the release's convention",
}


def presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def load_config(source: str | None = None, overrides: list[str] = ()) -> TrainConfig:
    """Defaults ← preset or YAML file `source` ← dotted `overrides`, validated."""
    data: dict = {}
    where: dict[str, str] = {}
    if source:
        path = Path(source)
        if not path.suffix and (PRESET_DIR / f"{source}.yaml").is_file():
            path = PRESET_DIR / f"{source}.yaml"
        if not path.is_file():
            close = difflib.get_close_matches(source, presets(), n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ConfigError(f"no preset or file {source!r}; presets: {', '.join(presets())}{hint}")
        data, lines = read_yaml(path)
        where = {key: f"{path}:{line}: " for key, line in lines.items()}
    for text in overrides:
        keys, value = parse_override(text)
        nested: Any = value
        for key in reversed(keys):
            nested = {key: nested}
        data = merge(data, nested)
        where[".".join(keys)] = f"override {text!r}: "
    config = build(TrainConfig, data, "", where, REPLACED_KEYS)
    validate(config)
    return config


def validate(config: TrainConfig) -> None:
    """Cross-field checks that single fields cannot express."""
    if not config.output_dir.strip():
        raise ConfigError("'output_dir' is empty; pass output_dir= a folder for the run, e.g. output_dir=runs/my-run")
    _validate_finetune(config)
    validate_warmup(config.train.warmup_iterations, config.iterations)
    validate_decay(config.train.ema_decay)
    if config.watch.stop and not config.eval_every:
        raise ConfigError("'watch.stop' = true needs held-out evaluations to watch: set eval_every (e.g. eval_every=20) and the gold "
                          "score in watch.gold (an eval_rewards score)")
    family = FAMILIES[config.model.family]
    if family.fixed_resolution and config.model.resolution not in (None, family.resolution):
        raise ConfigError(f"'model.resolution' = {config.model.resolution}: model.family={config.model.family} makes only "
                          f"{family.resolution}×{family.resolution} images; leave model.resolution unset")
    try:
        parse_reward_specs(config.reward, "reward")
        parse_reward_specs(config.eval_rewards, "eval_rewards")
    except ValueError as error:
        raise ConfigError(str(error)) from None
    steps = config.sampling.num_steps
    for entry in config.tree.splits:
        _validate_split_entry(entry)
    try:
        tree_spec(config, 0)
    except ValueError as error:
        raise ConfigError(f"'tree.splits' = {config.tree.splits}: {error}") from None
    if config.tree.mix_window and config.tree.mix_start + config.tree.mix_window > steps:
        raise ConfigError(f"'tree.mix_start' + 'tree.mix_window' = {config.tree.mix_start + config.tree.mix_window} exceeds sampling.num_steps = {steps}")
    bad = [d for d in config.prune.depths if not 1 <= d <= steps]
    if bad:
        raise ConfigError(f"'prune.depths' {bad} outside 1..{steps} (child depths of the {steps}-step tree)")
    for name in ("width_ratio", "active_fraction"):
        if getattr(config.prune, name) > 1:
            raise ConfigError(f"'prune.{name}' = {getattr(config.prune, name)} must be in (0, 1]")
    for name in ("step_fraction", "train_steps_fraction"):
        if getattr(config.train, name) > 1:
            raise ConfigError(f"'train.{name}' = {getattr(config.train, name)} must be in (0, 1]")
    steps_family = FAMILIES[config.model.family].steps
    if config.sampling.sde not in STEP_KINDS[steps_family]:
        raise ConfigError(f"'sampling.sde' = {config.sampling.sde!r} is not an SDE of model.family={config.model.family} "
                          f"({steps_family} steps); allowed: {', '.join(STEP_KINDS[steps_family])}")
    if steps_family == "ddim" and config.sampling.shift is not None:
        raise ConfigError(f"'sampling.shift' = {config.sampling.shift} applies to flow families; model.family={config.model.family} "
                          "samples on its scheduler's DDIM timesteps: leave sampling.shift unset")
    if config.sampling.sde == "cps":
        _validate_cps(config)
    _validate_explore(config)
    _validate_trainable_steps(config)
    _validate_group_size(config)
    _validate_compared_depths(config)


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


SPLIT_FORM = "[step, k] or [step, k, {noise_level: x}] with whole step and k"


def _validate_split_entry(entry: list) -> None:
    numbers, options = entry[:2], entry[2:]
    if len(entry) not in (2, 3) or any(isinstance(n, dict) or not float(n).is_integer() for n in numbers):
        raise ConfigError(f"'tree.splits' entry {entry!r} must be {SPLIT_FORM}")
    if options and not isinstance(options[0], dict):
        raise ConfigError(f"'tree.splits' entry {entry!r}: the third element must be a mapping {{noise_level: x}} "
                          "(the SDE's η / a at this split); the release's noise-only kick is tree.anchor_noise_multiplier")
    if options and set(options[0]) != {"noise_level"}:
        raise ConfigError(f"'tree.splits' entry {entry!r}: allowed split options: noise_level")
    level = options[0]["noise_level"] if options else 1.0
    if isinstance(level, bool) or not isinstance(level, (int, float)) or not math.isfinite(level) or level <= 0:
        raise ConfigError(f"'tree.splits' entry {entry!r}: noise_level must be a finite number > 0")


def _validate_explore(config: TrainConfig) -> None:
    explore = config.explore
    if explore.mode == "seeds" and explore.keep > explore.pool:
        raise ConfigError(f"'explore.keep' = {explore.keep} exceeds 'explore.pool' = {explore.pool}")
    if explore.mode == "tree":
        leaves = tree_spec(config, 0).leaves
        if explore.keep > leaves:
            raise ConfigError(f"'explore.keep' = {explore.keep} exceeds the {leaves} leaves per prompt of the tree")


CPS_LEVELS = (0.01, 1.0)  # cps's a: std = σ'·sin(aπ/2) is ≥ 1.6 % of σ' at 0.01; above 1 it shrinks again, ≤ 0 from a = 2
CPS_RANGE = (f"with sampling.sde=cps the level a must be in [{CPS_LEVELS[0]}, {CPS_LEVELS[1]:g}] (std = σ'·sin(aπ/2): a > 1 repeats "
             f"a smaller level's std, a ≥ 2 gives std ≤ 0 and NaN log-probs, a < {CPS_LEVELS[0]} a std of about 0)")


def _validate_cps(config: TrainConfig) -> None:
    """cps's noise levels stay in its range; no split at the last step, where cps's std is 0."""
    low, high = CPS_LEVELS
    fix = "use e.g. 0.8 (cps's usual level), or sampling.sde=flow or dance to explore more than a = 1 does"
    for name, level in (("sampling.noise_level", config.sampling.noise_level), ("tree.split_noise_level", config.tree.split_noise_level)):
        if level is not None and not low <= level <= high:
            raise ConfigError(f"'{name}' = {level!r} is outside cps's range: {CPS_RANGE}; {fix}")
    last = config.sampling.num_steps - 1
    for entry in config.tree.splits:
        level = entry[2]["noise_level"] if len(entry) > 2 else None
        if level is not None and not low <= level <= high:
            raise ConfigError(f"'tree.splits' entry {entry!r}: noise_level {level!r} is outside cps's range: {CPS_RANGE}; {fix}")
        if int(entry[0]) == last:
            raise ConfigError(f"'tree.splits' entry {entry!r} splits at the last step, {last} (sampling.num_steps = {last + 1}), where cps's "
                              f"std σ'·sin(aπ/2) is 0 (σ' = 0): its {int(entry[1])} children would be identical; split at an earlier "
                              "step or use sampling.sde=flow or dance")


def _steps_text(steps: list[int]) -> str:
    """[0, 1, 2, 5] → '0..2, 5'."""
    runs: list[list[int]] = []
    for s in steps:
        if runs and s == runs[-1][1] + 1:
            runs[-1][1] = s
        else:
            runs.append([s, s])
    return ", ".join(f"{a}..{b}" if b > a else str(a) for a, b in runs) or "none"


def trainable_steps(config: TrainConfig, iteration: int) -> list[int]:
    """Steps whose edges can get gradients at `iteration` before subsampling and pruning: SDE steps
    s < ⌊f·T⌋ (f = train.train_steps_fraction; `ClippedGRPO.trainable_mask` starts from these), without cps's last step
    (std 0, no density)."""
    steps = config.sampling.num_steps
    limit = math.floor(config.train.train_steps_fraction * steps + 1e-9)
    return [s for s in _usable_sde_steps(config, iteration) if s < limit]


def _usable_sde_steps(config: TrainConfig, iteration: int) -> list[int]:
    spec = tree_spec(config, iteration)
    last = spec.num_steps - 1
    return [s for s in range(spec.num_steps) if spec.is_sde(s) and not (config.sampling.sde == "cps" and s == last)]


def _window_iterations(config: TrainConfig) -> list[int]:
    """The first iteration of every Mix window position reached in range(iterations): the window is
    the only part of `tree_spec` that changes between iterations."""
    tree = config.tree
    if not tree.mix_window or not tree.mix_slide_every:
        return [0]
    last_offset = max(0, config.sampling.num_steps - tree.mix_window - tree.mix_start)
    return [p * tree.mix_slide_every for p in range(last_offset + 1) if p * tree.mix_slide_every < config.iterations]


def _validate_trainable_steps(config: TrainConfig) -> None:
    """Every iteration must have a trainable SDE step (`trainable_steps`)."""
    steps, fraction = config.sampling.num_steps, config.train.train_steps_fraction
    iterations = _window_iterations(config)
    window = " (Mix window and split steps)" if config.tree.mix_window else ""
    usable = {i: _usable_sde_steps(config, i) for i in iterations}
    for i in iterations:
        if usable[i]:
            continue
        # only cps's last step is SDE: its std σ'·sin(aπ/2) is 0 there (σ' = 0)
        zero = "where cps's std σ'·sin(aπ/2) is 0 (σ' = 0), so nothing would be trained"
        if not config.tree.mix_window:
            raise ConfigError(f"'sampling.sde' = 'cps' with sampling.num_steps = 1: the only step is the last, {zero}; "
                              "use sampling.num_steps ≥ 2 or sampling.sde=flow or dance")
        at = f"at iteration {i} " if len(iterations) > 1 else ""
        raise ConfigError(f"'sampling.sde' = 'cps' with 'tree.mix_window' = {config.tree.mix_window}: {at}the only SDE step (Mix window "
                          f"and split steps) is the last ({steps - 1}), {zero}; widen tree.mix_window, split before the last step, "
                          "or use sampling.sde=flow or dance")
    starved = [i for i in iterations if not trainable_steps(config, i)]
    if starved:
        first = starved[0]
        at = f"at iteration {first} " if len(iterations) > 1 else ""
        needed = max(usable[i][0] for i in iterations) + 1  # every iteration's first usable step must be below ⌊f·T⌋
        at_least = math.ceil(needed / steps * 100 - 1e-9) / 100
        limit = math.floor(fraction * steps + 1e-9)
        shorter = f" or iterations ≤ {first}" if first > 0 else ""
        raise ConfigError(f"'train.train_steps_fraction' = {fraction!r} trains only steps s < ⌊{fraction!r}·{steps}⌋ = {limit}, but {at}the "
                          f"SDE steps{window} are {_steps_text(usable[first])}: nothing would be trained; "
                          f"use train.train_steps_fraction ≥ {at_least:g}{shorter}")


def _validate_compared_depths(config: TrainConfig) -> None:
    """A trainable step must lead to a depth holding ≥ 2 nodes of a prompt's tree (nodes compared by
    the depth-wise advantage; a lone node's advantage is 0), and static depth pruning must leave one.
    Explore tree mode is left out: its regenerated sub-tree's widths depend on the selection."""
    if config.explore.mode == "tree":
        return
    prune = config.prune
    pruned = set(prune.depths) if not prune.slide_every else set()
    for iteration in _window_iterations(config):
        spec = tree_spec(config, iteration)
        roots = config.explore.keep if config.explore.mode == "seeds" else spec.roots
        sizes = dataclasses.replace(spec, roots=roots).level_sizes()  # nodes per prompt at each depth of the trained tree
        trainable = trainable_steps(config, iteration)
        compared = [s for s in trainable if sizes[s + 1] >= 2]
        at = f"at iteration {iteration} " if iteration else ""
        if not compared:
            raise ConfigError(f"{at}the trainable steps {_steps_text(trainable)} (train.train_steps_fraction = "
                              f"{config.train.train_steps_fraction!r}) all lead to depths with one node per prompt (the first split "
                              f"is at step {min(spec.split_steps, default='none')}): every advantage there is 0, so nothing would be trained; "
                              "split earlier or raise train.train_steps_fraction")
        if pruned and {s + 1 for s in compared} <= pruned:
            raise ConfigError(f"'prune.depths' = {sorted(prune.depths)} prunes every trained depth ({_steps_text([s + 1 for s in compared])}): "
                              "nothing would be trained while pruning is active; keep at least one of them")


def _validate_group_size(config: TrainConfig) -> None:
    """A prompt's trained tree needs two leaves: with one, every advantage is 0 and nothing is trained."""
    explore, tree = config.explore, config.tree
    zero = "its advantage is always 0, so nothing would be trained"
    if explore.mode == "off" and tree.roots == 1 and not tree.splits:
        raise ConfigError(f"'tree.roots' = 1 with no 'tree.splits' grows one sample per prompt: {zero}; "
                          "use tree.roots ≥ 2 or add a split (e.g. tree.splits=[[0, 2]])")
    if explore.mode == "tree" and explore.keep == 1:
        raise ConfigError(f"'explore.keep' = 1 with explore.mode=tree keeps one leaf per prompt: {zero}; use explore.keep ≥ 2")
    if explore.mode == "seeds" and explore.keep == 1 and not tree.splits:
        raise ConfigError(f"'explore.keep' = 1 with explore.mode=seeds and no 'tree.splits' keeps one chain per prompt: {zero}; "
                          "use explore.keep ≥ 2 or add a split (e.g. tree.splits=[[0, 2]])")


def to_dict(config: TrainConfig) -> dict:
    return dataclasses.asdict(config)


def save_config(config: TrainConfig, path: Path) -> None:
    """The effective config as YAML, written whole or not at all; the same config gives the same bytes."""
    from branchdiff import storage

    storage.write_text(path, yaml.safe_dump(to_dict(config), sort_keys=False))
