"""The memory a run needs, phase by phase, per process (docs/plan.md gives every formula).

An iteration's peak is the memory resident all run (`static`: weights, trained parameters with their
gradients' bucket, optimizer moments and weight average, the tree's latents, the explore copy) plus the largest of
what each phase adds on top while it runs:

| phase      | adds                                                                                          |
|------------|-----------------------------------------------------------------------------------------------|
| encode     | the text encoders, where `model.offload` keeps them on the host between uses                  |
| rollout    | one chunk of `sampling.max_batch` network rows, no grad (+ a block cache's kept residuals)    |
| reward     | the VAE decoding `decode_batch` leaves at a time, every decoded leaf (fp32)                   |
| train      | the trained parameters' gradients + a minibatch's forward and backward (checkpointing: saved  |
|            | set + one block recomputed); with a KL term, the reference forward while the graph is held    |
| optimizer  | the gradients (AdamW's fused step and bitsandbytes' 8-bit one update in place); under FSDP, + |
|            | AdamW's foreach temporaries on the sharded parameters (two fp32 copies of the trained ones)   |
| explore    | refreshing the explore copy (every LoRA layer's W + B·A in fp32), the seeds pool's decode     |
| eval       | the eval rewards' weights + an evaluation chunk's forward or decode                           |
| start-up   | (absolute) the explore copy's build: the policy copied before it is quantised                 |

FSDP2 over N processes divides the denoiser's weights and the trained state by N and adds two
gathered blocks (the one computing and the next, prefetched); `fsdp-offload` keeps the shards in
host memory (one gathered block pair on the GPU).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from branchdiff.data.demonstrations import FIELDS
from branchdiff.models.loading import quiet_loading
from branchdiff.objectives.registry import dataset_kind, decoupled, needs_reference
from branchdiff.plan.clock import GPU, GPUS, TARGET_GPU, UTILISATION, modelled_seconds
from branchdiff.plan.families import Family, Size, eval_size_of, family_for, size_of
from branchdiff.plan.measure import DTYPES, Measured, measure, reward_bytes

GIB = 2**30
RESERVE = 2 * GIB  # what a plan leaves free on the GPU: the CUDA context (~1 GiB) and the caching allocator's slack
EVAL_CHUNK = 16  # prompts per evaluate() chunk (its default)
SHARDING = ("none", "fsdp", "fsdp-offload")


@dataclass(frozen=True)
class Target:
    """Where a run is planned: processes (one per GPU), sharding, and the GPU."""

    processes: int = 1
    sharding: str = "none"
    gpu: GPU | None = None  # None: the family's target GPU
    tflops: float | None = None
    utilisation: float = UTILISATION
    nodes: int = 1  # machines the processes are spread over (the network between them carries the gradients' all-reduce)


@dataclass
class Plan:
    """Bytes per process; FLOPs and seconds per iteration."""

    family: str
    label: str
    source: str
    gpu: str
    capacity: float
    settings: dict[str, Any]
    parameters: dict[str, Any]
    static: dict[str, float]
    phases: dict[str, float]
    rows: dict[str, int]
    flops: dict[str, float]
    seconds: float
    change: str = ""  # the smallest change that brings the peak under capacity − RESERVE ("" when it fits)
    change_peak: float = 0.0
    notes: list[str] = field(default_factory=list)
    network: dict[str, float] = field(default_factory=dict)  # several machines: the all-reduce's bytes across the network (`internode_traffic`)

    def phase_peak(self, phase: str) -> float:
        """The peak while `phase` runs: static + what it adds (the start-up copy is absolute)."""
        return self.phases[phase] if phase == "start-up" else sum(self.static.values()) + self.phases[phase]

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phase_peak)

    @property
    def peak(self) -> float:
        return self.phase_peak(self.peak_phase)

    @property
    def fits(self) -> bool:
        return self.peak <= self.capacity - RESERVE

    def to_json(self) -> dict[str, Any]:
        """The plan as JSON: bytes in GiB, the peak of every phase, whether it fits."""
        gib = lambda mapping: {k: round(v / GIB, 4) for k, v in mapping.items()}
        data = {k: v for k, v in asdict(self).items() if k not in ("static", "phases", "capacity", "change_peak")}
        data.update(peak_phase=self.peak_phase, static_gib=gib(self.static), phases_gib=gib(self.phases),
                    phase_peaks_gib=gib({p: self.phase_peak(p) for p in self.phases}),
                    peak_gib=round(self.peak / GIB, 4), capacity_gib=round(self.capacity / GIB, 4), reserve_gib=RESERVE / GIB, fits=self.fits,
                    change_peak_gib=round(self.change_peak / GIB, 4))
        return data


class Estimator:
    """Estimates for runs, measuring each family's figures once per (family, dtype, rank, size, autocast, targets)."""

    def __init__(self) -> None:
        self.known: dict[str, Family] | None = None
        self.cache: dict[tuple, Measured] = {}

    def family(self, config: Any) -> Family:
        if self.known is None:
            from branchdiff.plan.families import families

            self.known = families()
        return family_for(config, self.known)

    def measured(self, family: Family, config: Any, size: Size | None = None) -> Measured:
        """The family's figures for `config` at `size` (None: the training's, `size_of`)."""
        dtype = DTYPES[config.model.dtype]
        autocast = torch.bfloat16 if config.train.mixed_precision == "bf16" else None
        targets = config.model.lora_targets
        size = size or size_of(config)
        key = (family.name, family.source, dtype, config.train.lora_rank, config.train.lora_alpha, size, autocast, str(targets))
        if key not in self.cache:
            with quiet_loading():  # diffusers' notices about casting a model built from its config
                self.cache[key] = measure(family, dtype, config.train.lora_rank, config.train.lora_alpha, size, autocast, targets)
        return self.cache[key]


def internode_traffic(gradient_bytes: float, nodes: int, all_reduces: int) -> dict[str, float]:
    """The bytes each machine sends over the network in an iteration's gradient all-reduces (DDP; NCCL's hierarchical
    all-reduce: reduced within a machine, then a ring over the machines, then broadcast within it): each of the
    `all_reduces` moves 2·(M − 1)/M of the `gradient_bytes` out of every one of the M machines (and as many in)."""
    per_reduce = 2 * (nodes - 1) / nodes * gradient_bytes
    return {"nodes": nodes, "gradient_bytes": gradient_bytes, "all_reduces": all_reduces, "bytes_per_machine": per_reduce * all_reduces}


def estimate(config: Any, target: Target, estimator: Estimator) -> Plan:
    """The plan of `config` on `target` (without the smallest change: see `with_change`)."""
    from branchdiff.core.tree import build_tree
    from branchdiff.rewards.combine import parse_reward_specs
    from branchdiff.settings.trees import tree_spec

    family = estimator.family(config)
    m = estimator.measured(family, config)
    dbytes = torch.finfo(DTYPES[config.model.dtype]).bits // 8
    size = size_of(config)
    pixels = math.prod(size) * 3  # values per decoded image (video)
    guidance = family.adapter.default_guidance if config.sampling.guidance is None else config.sampling.guidance
    cfg_rows = family.adapter.cfg_rows(guidance, config.model.path)
    train_rows = config.train.minibatch * cfg_rows
    chunk_rows = max(1, config.sampling.max_batch // cfg_rows) * cfg_rows
    ckpt, offload, full = config.train.gradient_checkpointing, config.model.offload, config.model.finetune == "full"
    sharded = target.sharding != "none"
    processes = target.processes

    both = family.experts == 2 and config.model.expert == "both"  # Wan 2.2 A14B: a LoRA on each expert
    trained = m.denoiser_params - m.unused_params if full else m.lora_params * (2 if both else 1)
    denoiser = (m.denoiser_params + m.denoiser_buffers) * (4 if full else dbytes)  # full fine-tuning trains float32 weights
    encoders = sum(m.encoders.values()) * dbytes
    vae = m.vae_params * dbytes
    helpers = encoders + vae
    reward = sum(reward_bytes(spec) for spec in parse_reward_specs(config.reward))
    moments = 2 if config.train.optimizer == "adamw8bit" else 8  # AdamW: two fp32 moments (bitsandbytes 8-bit: two bytes)
    tree = build_tree(tree_spec(config, 0), config.prompts.per_iteration)
    latents = tree.num_nodes * math.prod(family.latent(m.config, m.geometry, size)) * 4

    static = {
        "denoiser": denoiser,
        "second expert": (m.denoiser_params + m.denoiser_buffers) * dbytes if family.experts == 2 else 0,  # frozen, or with both a LoRA's base
        "text encoders + VAE": 0 if offload else helpers,
        "reward models": reward,
        # (LoRA fp32 weights) + moments + DDP bucket + the weights' moving average (train.ema_decay: an fp32 copy beside them)
        "trained state": trained * ((4 if not full else 0) + moments + (0 if sharded else 4) + (4 if config.train.ema_decay > 0 else 0)),
        "frozen copy": m.denoiser_params * 4 if full and (config.train.kl_beta > 0 or config.final_eval or needs_reference(config.train.loss)) else 0,
        "tree latents": latents,
    }
    # the objective's own tensors: AWM's moving average of the trained weights (fp32, like train.ema_decay's); a decoupled
    # objective's training terms, each a sample's x0, ε and x_t at one noise level and one prediction kept from before the update
    # (the rollout's, the reference's or the average's), `timesteps` per sample; a dataset objective has no tree
    loss, kind = config.train.loss, dataset_kind(config.train.loss)
    static["objective state"] = trained * 4 if loss == "awm" else 0
    samples = config.prompts.per_iteration * len(FIELDS[kind]) if kind else len(tree.leaf_index)  # images a row holds
    terms = samples * getattr(getattr(config, loss.replace("-", "_"), None), "timesteps", 1) if decoupled(loss) else 0
    latent_bytes = math.prod(family.latent(m.config, m.geometry, size)) * 4
    static["training terms"] = terms * latent_bytes * 4
    if kind:
        static["tree latents"] = 0
    grads = trained * 4
    train_act = m.train(train_rows, ckpt)
    # a KL term: the adapter-free reference forward runs without grad while the training forward's graph is still held
    kl_ref = m.held(train_rows, ckpt) + m.rollout(train_rows) if config.train.kl_beta > 0 else 0.0
    decode_batch = family.adapter.decode_batch
    leaves = len(tree.leaf_index)
    decode = min(decode_batch, leaves) * m.decode_image + leaves * pixels * 4
    eval_images = EVAL_CHUNK * config.prompts.eval_seeds
    phases = {
        "encode": encoders if offload else 0.0,
        "rollout": 0.0 if kind else m.rollout(chunk_rows),
        "reward": 0.0 if kind else (vae if offload else 0) + decode,
        "train": grads + max(train_act, kl_ref),
        "optimizer": grads + (2 * trained * 4 if config.train.optimizer == "adamw" and sharded else 0),  # only FSDP's AdamW is not fused
        "eval": 0.0,
    }
    if config.sampling.block_cache > 0 and not kind:  # the nodes' kept residuals: at most the previous depth's, the widest depth's
        # kept per forward and joined at once, and one forward's gathered (branchdiff/models/block_cache.py)
        widest = max(tree.level_start[d + 1] - tree.level_start[d] for d in range(tree.spec.num_steps))
        phases["rollout"] += m.block_cache(2 * widest + chunk_rows // cfg_rows, cfg_rows)
    if config.final_eval or config.eval_every:  # at the evaluations' own size (eval.resolution, eval.frames)
        evaluated = eval_size_of(config)
        m_eval = m if evaluated == size else estimator.measured(family, config, evaluated)
        phases["eval"] = sum(reward_bytes(spec) for spec in parse_reward_specs(config.eval_rewards)) + max(
            encoders if offload else 0, m_eval.rollout(family.adapter.eval_batch),
            (vae if offload else 0) + min(decode_batch, eval_images) * m_eval.decode_image + eval_images * math.prod(evaluated) * 3 * 4)
    if config.explore.mode != "off" and config.explore.backend != "none":
        static["explore copy"] = m.copy_bytes
        explore = m.lora_base_params * 4  # quant._merged_tensors: W + B·A of every LoRA layer in fp32, all alive at once
        if config.explore.mode == "seeds":  # the pool: previewed latents and decoded images of pool × prompts candidates
            pool = config.explore.pool * config.prompts.per_iteration
            preview = config.explore.preview_steps or config.sampling.num_steps
            pool_latents = pool * (preview + 1) * math.prod(family.latent(m.config, m.geometry, size)) * 4
            explore = max(explore, (vae if offload else 0) + min(decode_batch, pool) * m.decode_image + pool * pixels * 4 + pool_latents)
        else:  # tree: the explored tree is kept while its kept paths are regenerated
            static["tree latents"] *= 2
        phases["explore"] = explore
        # start-up: make_quantized_copy deep-copies the policy (bf16 + LoRA) on the GPU before quantising it
        phases["start-up"] = 2 * (denoiser + m.lora_params * 4) + m.lora_params * 4 + reward + (0 if offload else helpers)

    notes = []
    if sharded:
        gathered = 2 * m.block_params * (4 if full else dbytes)
        second = static["second expert"] if both else 0.0  # with expert both, the two experts are sharded (a frozen one is not)
        shard = (static["denoiser"] + second + static["trained state"] + static["frozen copy"] + static["objective state"]) / processes
        if target.sharding == "fsdp-offload":
            shard = 0.0
            notes.append("fsdp-offload: the shards, their gradients and moments live in host memory; the GPU holds two gathered blocks")
        static["denoiser"], static["trained state"], static["frozen copy"], static["objective state"] = shard, 0.0, 0.0, 0.0
        static["second expert"] -= second
        static["gathered blocks"] = gathered
        phases["train"] -= grads * (1 - 1 / processes)
        phases["optimizer"] *= 0 if target.sharding == "fsdp-offload" else 1 / processes

    forward = m.forward_flops()
    rollout_rows = 0 if kind else tree.spec.rollout_nfe * config.prompts.per_iteration * cfg_rows
    # trained forwards: a decoupled objective's terms, else the tree's SDE edges (the no-grad forwards of the predictions kept are not counted)
    trained_rows = (terms if terms else tree.spec.sde_edges() * config.prompts.per_iteration) * cfg_rows
    flops = {"rollout": rollout_rows * forward, "train": trained_rows * forward * (4 if ckpt else 3)}  # backward ≈ 2 forwards
    flops["total"] = flops["rollout"] + flops["train"]
    gpu = target.gpu or GPUS[TARGET_GPU[family.gpu]]
    bf16 = config.train.mixed_precision == "bf16" or config.model.dtype != "float32"
    seconds = modelled_seconds(flops["total"], gpu, bf16, target.utilisation, target.tflops)
    settings = {"processes": processes, "sharding": target.sharding, "dtype": config.model.dtype, "mixed_precision": config.train.mixed_precision,
                "finetune": config.model.finetune, "gradient_checkpointing": ckpt, "offload": offload, "optimizer": config.train.optimizer,
                "max_batch": config.sampling.max_batch, "minibatch": config.train.minibatch, "size": list(size), "cfg_rows": cfg_rows,
                "explore": config.explore.mode, "prompts_per_iteration": config.prompts.per_iteration, "bf16": bf16,
                "utilisation": target.utilisation, "peak_tflops": target.tflops or (gpu.bf16_tflops if bf16 else gpu.tf32_tflops)}
    parameters = {"denoiser": m.denoiser_params, "trained": trained, "lora": m.lora_params, "text_encoders": dict(m.encoders), "vae": m.vae_params,
                  "blocks": dict(m.counts)}
    network = {}
    if target.nodes > 1:  # DDP all-reduces the trained weights' fp32 gradients once an optimizer step
        terms = trained_rows // cfg_rows * processes  # every process's trained edges (or terms)
        steps = 1 if config.train.optimizer_every == 0 else max(1, math.ceil(terms / config.train.optimizer_every))
        network = internode_traffic(trained * 4, target.nodes, steps)
        if sharded:
            notes.append("FSDP2 over several machines also gathers the sharded weights over the network at every forward: not in the "
                         "all-reduce figure")
    settings["nodes"] = target.nodes
    return Plan(family.name, family.label, family.source, gpu.name, gpu.memory, settings, parameters, static, phases,
                {"rollout": rollout_rows, "train": trained_rows}, flops, seconds, notes=notes, network=network)


def with_change(source: str | None, overrides: list[str], target: Target, estimator: Estimator) -> Plan:
    """The plan, and where it does not fit, the smallest change that does: a single setting tried in
    order of cost (checkpointing, the largest `sampling.max_batch`, the largest `train.minibatch`,
    offloading the text encoders and VAE, the 8-bit optimizer), else FSDP2 over 2, 4 or 8 GPUs."""
    from branchdiff.settings.load import load_config

    config = load_config(source, overrides)
    plan = estimate(config, target, estimator)
    if plan.fits:
        return plan

    def planned(*extra: str) -> Plan:
        return estimate(load_config(source, [*overrides, *extra]), target, estimator)

    def setting(change: str) -> tuple[str, Plan]:
        return change, planned(change)

    def largest(name: str, current: int) -> tuple[str, Plan] | None:
        """The largest value below `current` that fits (the peak grows with it: bisection), and its plan."""
        low, high, found = 0, current, None  # low fits (0: nothing found yet), high does not
        while high - low > 1:
            middle = (low + high) // 2
            trial = planned(f"{name}={middle}")
            low, high, found = (middle, high, trial) if trial.fits else (low, middle, found)
        return (f"{name}={low}", found) if found else None

    tries = []  # tried in this order, each only when the ones before do not fit
    if not config.train.gradient_checkpointing:
        tries.append(lambda: setting("train.gradient_checkpointing=true"))
    tries += [lambda: largest("sampling.max_batch", config.sampling.max_batch), lambda: largest("train.minibatch", config.train.minibatch)]
    if not config.model.offload:
        tries.append(lambda: setting("model.offload=true"))
    if config.train.optimizer != "adamw8bit" and target.sharding == "none":
        tries.append(lambda: setting("train.optimizer=adamw8bit"))
    if target.sharding == "none":
        for processes in (2, 4, 8):
            launch = (f"FSDP2 over {processes} GPUs: accelerate launch --config_file $(branchdiff accelerate-config fsdp) "
                      f"--num_processes {processes} (docs/sharding.md)")
            sharded = Target(processes, "fsdp", target.gpu, target.tflops, target.utilisation, target.nodes)
            tries.append(lambda launch=launch, sharded=sharded: (launch, estimate(config, sharded, estimator)))
    for attempt in tries:
        found = attempt()
        if found and found[1].fits:
            plan.change, plan.change_peak = found[0], found[1].peak
            return plan
    plan.change = "none found: no single setting tried (checkpointing, max_batch, minibatch, offload, 8-bit AdamW, FSDP2 over 2-8 GPUs) fits"
    return plan
