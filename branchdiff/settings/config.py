"""The run's settings as typed dataclasses: every key of a run, its type, default and meaning.

`TrainConfig` is the whole run; each section (`model`, `prompts`, `sources`, `sampling`, `tree`, `advantage`,
`prune`, `train`, `explore`, `watch`, `logging`) is a dataclass whose fields carry their allowed values (`choice`, `positive`, `non_negative`, `in_range`:
branchdiff/settings/typed_yaml.py), so a wrong value is refused when the YAML is read. Each objective's own
section (`nft`, `awm`, `dpo`, ...) is its keys' dataclass, which the objective registers (branchdiff/objectives/keys.py,
branchdiff/objectives/registry.py): they are kept in `objectives` and read as `config.nft`, and written where they were. Reading presets,
files and overrides: branchdiff/settings/load.py; checks across keys: branchdiff/settings/validate.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from branchdiff.models.registry import FAMILIES
from branchdiff.objectives.registry import OBJECTIVES, key_sections
from branchdiff.search.registry import SEARCHES
from branchdiff.settings.typed_yaml import choice, in_range, non_negative, positive

LR_SCHEDULES = ("constant", "linear", "cosine")  # train.lr_schedule (branchdiff/training/lr_schedule.py)
MAX_STEPS = 1000  # sampling steps at most: the schedulers' 1000 training timesteps (a huge count exhausted memory building the schedule)
DEFAULT_PRESET = "tiny-mix-full"  # what `branchdiff train` and `branchdiff config` start from when given no preset or file


@dataclass
class ModelConfig:
    family: str = choice("tiny", *FAMILIES)  # model family (branchdiff/models/, docs/models.md)
    path: str | None = None  # local directory or hub id of the diffusers pipeline; None = the built-in tiny model
    resolution: int | list[int] | None = None  # image size in pixels: H (a square) or [H, W]; None = the family's default (tiny 32, sd15 512, wan [480, 832], others 1024)
    frames: int | None = positive(None)  # video families (wan): frames per video, r·k + 1 (r = the VAE's temporal factor, 4 for Wan); None = the family's default (Wan 81); image families: leave unset
    expert: str = choice("high", "high", "low", "both")  # wan, Wan 2.2 A14B: the expert(s) trained and exported, transformer (high noise), transformer_2 (low noise) or both (LoRA)
    guidance_2: float | None = positive(None)  # wan, Wan 2.2 A14B: the low-noise expert's CFG scale (the pipeline's guidance_scale_2); None = the run's guidance
    dtype: str = choice("float32", "float32", "bfloat16", "float16")  # base weights' dtype (LoRA parameters stay float32)
    offload: bool = False  # keep text encoders and VAE on the CPU except while they run
    finetune: str = choice("lora", "lora", "full")  # lora: a LoRA adapter (train.lora_rank, lora_alpha); full: every weight of the denoiser
    prompt_instruction: bool = True  # sana: prepend the pipeline's complex_human_instruction to every prompt (as SanaPipeline does); false: the bare prompt
    lora_targets: str | list[str] = "attention"  # LoRA's modules: attention | attention+ff | all-linear, or module-name patterns
    compile: str = choice("auto", "auto", "none", "blocks", "full")  # torch.compile the denoiser: blocks (each repeated block, regional) or full; rollouts and training; auto: blocks on CUDA where the GPU bench measured a gain, else eager (branchdiff/models/compile.py)
    attention_backend: str = "auto"  # the denoiser's attention kernel: auto (per device and family, a gradient check first), native (PyTorch SDPA), flash, _flash_3, sage, xformers, flex, _native_cudnn, ... through diffusers' dispatcher (branchdiff/models/attention.py)


@dataclass
class EvalConfig:
    resolution: int | list[int] | None = None  # the evaluations' image size (final, periodic, their grids, `eval` of the run): H or [H, W]; None = model.resolution
    frames: int | None = positive(None)  # video families: the evaluations' frames per video; None = model.frames


@dataclass
class PromptConfig:
    train: str = "tiny:train"  # prompt source: tiny:train | tiny:held_out | tiny:all | a .txt file, one prompt a line
    per_iteration: int = positive(8)  # prompts per iteration (per process)
    eval: str = "tiny:held_out"  # prompts of the final base-vs-trained evaluation
    eval_seeds: int = positive(8)  # images per evaluation prompt (fixed seeds)
    eval_guidance: float | None = non_negative(None)  # guidance of evaluation sampling; None = the family's default


@dataclass
class SourcesConfig:
    fit: str = choice("resize", "resize", "crop", "pad", "refuse")  # a source image (editing, image-to-video) of another aspect ratio than model.resolution: resize (stretched, as the pipelines resize), crop, pad or refuse (branchdiff/data/sources.py)


@dataclass
class SamplingConfig:
    num_steps: int = in_range(10, 1, MAX_STEPS)  # T denoising steps
    shift: float | None = positive(None)  # σ = s·t / (1 + (s-1)·t) (the anchors'); None = the family's own schedule (tiny: s = 1)
    sde: str = choice("flow", "dance", "flow", "cps", "ddim", "ode")  # SDE (branchdiff/schedulers/flow.py, branchdiff/schedulers/ddim.py): dance | flow | cps for flow families, ddim for sd15; ode: deterministic chains (train.loss=nft only)
    noise_level: float = positive(0.7)  # η for dance and ddim, a for flow and cps (> 0: an SDE needs noise; cps: a in [0.01, 1])
    guidance: float | None = non_negative(None)  # CFG scale (sd3, sana, sd15, wan, qwen-image: > 1 guides; z-image: > 0, as its pipeline) or guidance embedding (flux) of rollouts and training; None = family default
    max_batch: int = positive(64)  # network rows per model forward in rollouts (a CFG prediction takes 2)
    exact: bool = False  # pad rollout forwards to max_batch rows: bit-exact regeneration, slower narrow levels
    block_cache: float = non_negative(0.0)  # rollouts skip all but the denoiser's first block where its residual changed less than this (relative) since its last full step; 0: off. Objectives that train final samples only (nft, awm, dgpo, dpo); docs/gpu.md


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
    baseline: str = choice("mean", "mean", "median", "median-lower")  # each group's centre: its mean, or its median (MC-GRPO: with an odd group one sample sits at the median and is left out of the loss; an even group's median is the mean of its two middle values, or with median-lower the lower one, as MC-GRPO's public code takes it; docs/objectives.md)
    scale: str = choice("auto", "auto", "std", "mad")  # what a group's residuals are divided by: std, or mad (MC-GRPO's public code: the median absolute deviation + 1e-3, the non-zero advantages rescaled to the group's count); auto: mad with the median baseline, std with the mean


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
    lr_schedule: str = choice("constant", *LR_SCHEDULES)  # the rate over the run (branchdiff/training/lr_schedule.py): constant, or linear / cosine decay to 0 at `iterations`
    warmup_iterations: int = non_negative(0)  # linear warm-up from 0 over the first n iterations (0: none)
    decay_start: int = non_negative(0)  # linear / cosine: hold the rate until this iteration, then decay to 0 at `iterations` (0: decay over the whole run)
    lora_rank: int = positive(8)  # LoRA rank on the attention projections
    lora_alpha: float = positive(8.0)  # LoRA scaling numerator
    loss: str = choice("grpo", *OBJECTIVES)  # the training objective (branchdiff/objectives/, docs/objectives.md): its keys are the section of its name (nft.*, awm.*, ...)
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
    ema_decay: float = in_range(0.0, 0.0, 1.0)  # moving average of the trained weights per optimizer step, for evaluation and export (branchdiff/models/ema.py; 0: off, < 1)
    mixed_precision: str = choice("no", "no", "bf16")  # autocast dtype of rollout and training forwards


@dataclass
class ExploreConfig:
    mode: str = choice("off", "off", "seeds", "tree", "search")  # FP4-explore / BF16-train (explore.py); search: the pool is an inference-time search's images (train.loss=nft); off: plain rollouts
    backend: str = choice("nvfp4-emulated", "none", "nvfp4-emulated", "mxfp4-emulated", "fp8-emulated", "fp8-emulated-tensor", "bnb-fp4", "bnb-nf4", "te-nvfp4", "te-fp8", "torchao-fp8")  # explorer copy (quant.py); none: the policy itself
    pool: int = positive(32)  # seeds mode: candidate seeds per prompt
    keep: int = positive(8)  # kept per prompt: seeds (seeds mode) or leaves (tree mode)
    selection: str = choice("best_worst", "best_worst", "random", "mean_deviation", "extremes_random")  # contrastive subset
    preview_steps: int = in_range(0, 0, MAX_STEPS)  # seeds mode: steps of the preview (0: sampling.num_steps)
    preview_sampler: str = choice("ode", "ode", "sde")  # seeds mode: ODE preview (Sol-RL) or the training SDE
    min_features: int = non_negative(0)  # linear layers with fewer in·out weights stay unquantised
    fidelity_every: int = non_negative(10)  # every n iterations grow the whole pool with the policy too: explore_spearman_pool (0: never; not in search mode)
    search: str = choice("dts-star", *SEARCHES)  # search mode: the search (branchdiff/search/, docs/search.md)
    search_budget: int = positive(160)  # search mode: network rows each prompt's search spends per iteration (a 10-step image costs 10)


@dataclass
class WatchConfig:
    gold: str = ""  # held-out score watched against the training reward (e.g. tiny-geneval.strict); "" = the first eval reward's score
    window: int = positive(2)  # evaluations between the two compared (branchdiff/training/hacking.py)
    tolerance: float = non_negative(0.02)  # the gold score must fall by more than this to flag divergence
    stop: bool = False  # stop the run, after a checkpoint, when divergence is flagged


@dataclass
class LogConfig:
    sample_every: int = non_negative(10)  # save a grid of leaf samples every n iterations (0: never)
    checkpoint_every: int = non_negative(10)  # accelerator.save_state every n iterations (and at the end)
    checkpoints_total_limit: int = positive(2)  # newest checkpoints kept (older ones deleted after each save)
    report_to: str | list[str] = "tensorboard"  # experiment trackers through accelerate: tensorboard | wandb | swanlab | none, or a list (branchdiff/training/trackers.py)


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
    reward_combine: str = choice("sum_then_normalize", "sum_then_normalize", "normalize_then_sum")  # how several rewards combine (branchdiff/rewards/combine.py)
    reward_overlap: bool = False  # score each finished part of the rollout while the next part grows (branchdiff/training/overlap.py)
    model: ModelConfig = field(default_factory=ModelConfig)
    prompts: PromptConfig = field(default_factory=PromptConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)  # train at one size, evaluate at another (docs/models.md)
    sources: SourcesConfig = field(default_factory=SourcesConfig)  # source images of editing and image-to-video prompts (docs/editing.md)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    tree: TreeConfig = field(default_factory=TreeConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    prune: PruneConfig = field(default_factory=PruneConfig)
    train: OptimConfig = field(default_factory=OptimConfig)
    objectives: dict[str, Any] = field(default_factory=lambda: objective_keys(), metadata={"sections": True})  # each objective's keys by section (nft.*, awm.*, ...; branchdiff/objectives/keys.py): `config.nft`, `config.awm`, ...
    explore: ExploreConfig = field(default_factory=ExploreConfig)
    watch: WatchConfig = field(default_factory=WatchConfig)  # the reward-hacking watch (needs eval_every)
    logging: LogConfig = field(default_factory=LogConfig)

    def __getattr__(self, name: str) -> Any:
        """An objective's keys by its section's name (`config.nft.beta`): the objectives register them, the settings list none."""
        sections = self.__dict__.get("objectives")
        if sections is not None and name in sections:
            return sections[name]
        raise AttributeError(f"{type(self).__name__!r} has no key or objective section {name!r}")


def objective_keys() -> dict[str, Any]:
    """Every registered objective's keys at their defaults, by section (branchdiff/objectives/registry.py `key_sections`)."""
    own = {f.name for f in fields(TrainConfig)}
    sections = key_sections()
    clash = sorted(own & set(sections))
    if clash:
        raise ValueError(f"an objective reads its keys from '{clash[0]}', a section of the settings themselves; give its class another `section`")
    return {name: keys() for name, keys in sections.items()}
