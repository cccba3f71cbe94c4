"""Each built-in objective's keys (`nft.*`, `awm.*`, ...): a dataclass per objective, registered with it in
branchdiff/objectives/registry.py (`Registered.keys`, its section's name `Registered.section`). The settings read
them through the registry when a run's YAML is read, so they know no objective: an objective installed by another
package declares its own (`keys`, a dataclass of the same kind, and optionally `section`) and they are read and
checked the same way (branchdiff/settings/typed_yaml.py: types, choices, ranges).

This module imports nothing heavy: the settings load it without loading an objective.
"""

from __future__ import annotations

from dataclasses import dataclass

from branchdiff.settings.typed_yaml import choice, in_range, non_negative, positive


@dataclass
class NFTConfig:
    """DiffusionNFT's keys (train.loss=nft; branchdiff/objectives/nft.py, docs/objectives.md)."""
    beta: float = positive(1.0)  # β of the implicit policies v± (the paper's 1; 0.1 for several rewards)
    advantage_clip: float = positive(5.0)  # A_max: advantages clipped to ±A_max, optimality r = clip(A/A_max, −1, 1)/2 + 1/2
    timesteps: int = positive(2)  # sampler steps each sample is trained at (drawn without replacement per sample and iteration)
    old_decay_rate: float = non_negative(0.001)  # the sampling policy after each iteration: θ_old ← d·θ_old + (1 − d)·θ, d = min(rate·n, max), n = optimizer steps so far
    old_decay_max: float = in_range(0.5, 0.0, 0.999)
    advantage: str = choice("leaf", "leaf", "depthwise")  # leaf: each sample's group-normalised reward; depthwise: a term at step k takes the depth-wise tree advantage (advantage.*) of the leaf's ancestor at depth k + 1
    skip_pure_noise: bool = False  # leave the step at σ = 1 (x_t = ε, the same input whatever the sample) out of the steps a sample is trained at


@dataclass
class AWMConfig:
    """Advantage Weighted Matching's keys (train.loss=awm; branchdiff/objectives/awm.py, docs/objectives.md). Defaults: the
    public SD3.5-M PickScore recipe of Flow-Factory's AWM (ghuber p = 0.25, clip 1, advantages clipped to ±1, KL weight 1 to the average)."""
    weighting: str = choice("ghuber", "uniform", "t", "t2", "huber", "ghuber")  # w(ℓ, σ) of the denoising error ℓ at noise level σ
    power: float = positive(0.25)  # p of the ghuber weighting
    timesteps: int = positive(2)  # sampler steps each sample is trained at (drawn without replacement per sample and iteration)
    clip_range: float = positive(1.0)  # ε of the clipped matching ratio exp(w_old − w_θ)
    advantage_clip: float = positive(1.0)  # advantages (group-normalised rewards) clipped to ±this
    average_kl: float = non_negative(1.0)  # weight of mean((v_θ − v_avg)²) to the slowly moving average of the policy (0: off)
    average_decay: float = in_range(0.3, 0.0, 0.999)  # after each iteration: θ_avg ← d·θ_avg + (1 − d)·θ, d = min(average_decay, average_decay_rate·n)
    average_decay_rate: float = non_negative(0.001)  # the public recipes' warm-up of d, n = optimizer steps so far (0: d = average_decay from the start)
    skip_pure_noise: bool = False  # leave the step at σ = 1 (x_t = ε) out of the steps a sample is trained at (one public AWM recipe does)


@dataclass
class DGPOConfig:
    """DGPO's keys (train.loss=dgpo; branchdiff/objectives/dgpo.py, docs/objectives.md). Defaults: the paper's public recipe
    (rollout with CFG, training without: dpo_beta 100, clip 1e-3)."""
    dpo_beta: float = positive(100.0)  # β of the group preference σ(−z_g)
    timesteps: int = positive(2)  # sampler steps each group is trained at (the same steps and noise for every sample of a group)
    clip_range: float = non_negative(1e-3)  # ε of the clip on exp(ℓ_old − ℓ_θ) against the rollout's weights (0: off)
    advantage_clip: float = positive(5.0)  # advantages clipped to ±this
    reference: str = choice("base", "base", "ema")  # base: ℓ_ref the frozen base model's, the clip against the rollout's weights; ema: both against a fast-moving average of the policy (the public code's dynamic reference)
    ema_decay_rate: float = non_negative(0.001)  # reference=ema: after each optimizer step θ_ref ← d·θ_ref + (1 − d)·θ, d = min(rate·n, ema_decay_max), n = optimizer steps so far
    ema_decay_max: float = in_range(0.3, 0.0, 0.999)
    skip_pure_noise: bool = False  # leave the step at σ = 1 (x_t = ε: every sample of a group sees one input) out of the steps a group is trained at


@dataclass
class DPPOConfig:
    """Flow-DPPO's keys (train.loss=dppo; branchdiff/objectives/dppo.py, docs/objectives.md)."""
    kl_mask_threshold: float = positive(1e-6)  # an edge's gradient is held when KL(current ‖ rollout step) exceeds this and the update goes the wrong way


@dataclass
class DPOConfig:
    """Online Diffusion-DPO's keys (train.loss=dpo; branchdiff/objectives/dpo.py, docs/objectives.md)."""
    beta: float = positive(100.0)  # β of −log σ(−β/2·[(ℓ_θ(w) − ℓ_ref(w)) − (ℓ_θ(l) − ℓ_ref(l))]) on the errors `error` names (velocity: the flow-matching recipes' 100; ε: the paper's SD 1.5 2000–5000)
    error: str = choice("velocity", "velocity", "epsilon")  # ℓ: the velocity error, or the ε error (1 − σ)²·ℓ_v the paper's β is in (β_v = β_ε·(1 − σ)²)
    timesteps: int = positive(2)  # sampler steps each pair is trained at (one (σ, ε) shared by a group's samples)
    pairs: str = choice("group", "group", "siblings")  # group: each prompt's best with its worst, second best with second worst, ...; siblings: the same among leaves that share their last split
    skip_pure_noise: bool = False  # leave the step at σ = 1 (x_t = ε: both samples of a pair see one input) out of the steps a pair is trained at


@dataclass
class SFTConfig:
    """Supervised fine-tuning's keys (train.loss=sft; branchdiff/objectives/sft.py, docs/objectives.md)."""
    data: str = "tiny:demonstrations"  # the demonstrations: JSONL rows {"prompt", "image"} (paths relative to the file), or tiny:demonstrations / tiny-video:demonstrations
    timesteps: int = positive(2)  # noise levels each demonstration is trained at per iteration
    sigma_sampling: str = choice("logit-normal", "logit-normal", "uniform")  # t ~ sigmoid(N(mean, std)) or U(0, 1), then σ the family's shifted schedule at t
    logit_mean: float = 0.0  # the logit-normal's mean (SD3's 0)
    logit_std: float = positive(1.0)  # and its std (SD3's 1)


@dataclass
class DPOOfflineConfig:
    """Offline Diffusion-DPO's keys (train.loss=dpo-offline; branchdiff/objectives/dpo_offline.py, docs/objectives.md)."""
    data: str = "tiny:preferences"  # the pairs: JSONL rows {"prompt", "chosen", "rejected"} (paths relative to the file), or tiny:preferences / tiny-video:preferences
    beta: float = positive(100.0)  # β of −log σ(−β/2·[(ℓ_θ(w) − ℓ_ref(w)) − (ℓ_θ(l) − ℓ_ref(l))]) on the errors `error` names (velocity: the flow-matching recipes' 100; ε: the paper's SD 1.5 2000–5000)
    error: str = choice("velocity", "velocity", "epsilon")  # ℓ: the velocity error, or the ε error (1 − σ)²·ℓ_v the paper's β is in
    timesteps: int = positive(2)  # noise levels each pair is trained at per iteration (one (σ, ε) for both images)
    sigma_sampling: str = choice("uniform", "logit-normal", "uniform")  # the paper draws its timesteps uniformly
    logit_mean: float = 0.0
    logit_std: float = positive(1.0)


@dataclass
class GuardConfig:
    """GRPO-Guard's keys (train.loss=grpo-guard; branchdiff/objectives/grpo_guard.py, docs/objectives.md)."""
    clip_range: float = positive(2e-6)  # ε of the re-centred ratio ρ̃ (its log is about the per-step change of the mean: far smaller than plain GRPO's)
    reweight: bool = True  # divide each step's loss by its σ step size (the paper's gradient reweighting)


@dataclass
class LayerTuningConfig:
    """LayerTuning-RL's keys (train.loss=grpo-layertuning; branchdiff/objectives/layertuning.py, docs/objectives.md)."""
    sft_weight: float = non_negative(0.01)  # λ: the SFT term toward each group's best sample, times the edge's positive advantage (0: off; 0.1 collapsed on the tiny task, docs/sweep.md)
    clip_sensitivity: float = non_negative(1.0)  # η: the clip bound on an edge's side opens to ε·(1 + η·|A|) (0: plain clipping)
