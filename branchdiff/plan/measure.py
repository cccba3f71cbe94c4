"""A family's figures that do not depend on a run's batch sizes, measured on the meta device and on
fake tensors: exact parameter counts (denoiser, LoRA, text encoders, VAE, the FP8 explore copy), and
per network row the activation memory and floating-point operations of a training forward (with and
without gradient checkpointing), of a no-grad forward, and of a VAE decode.

The denoiser traced is a reduced-depth copy (one block of every kind, full width); its per-block
figures scale to the real number of blocks and linearly in network rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.utils.flop_counter import FlopCounterMode

from branchdiff.models.lora import add_lora
from branchdiff.plan import published as P
from branchdiff.plan.families import Family, Geometry, Size, geometry
from branchdiff.plan.trace import Cost, LiveBytes, Peak, cuda_autocast, efficient_attention, trace_vae_decode

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def numel(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def build_meta(class_name: str, config: dict, dtype: torch.dtype) -> torch.nn.Module:
    """A diffusers model of `class_name` built from `config` on the meta device (no memory)."""
    import diffusers

    with torch.device("meta"):
        model = getattr(diffusers, class_name).from_config(config)
    return model.to(dtype)


def lora_targets_by_formula(model: torch.nn.Module, targets: list[str], rank: int, unused: Sequence[str] = ()) -> tuple[int, int]:
    """Σ r·(in + out) and Σ in·out over the nn.Linear layers whose name ends with a target (peft's
    suffix match) and that are not `unused` (the family's modules no gradient reaches), on a model
    without an adapter."""
    lora = base = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and any(name == t or name.endswith("." + t) for t in targets) and name not in unused:
            lora += rank * (module.in_features + module.out_features)
            base += module.in_features * module.out_features
    return lora, base


def explore_copy_bytes(model: torch.nn.Module, skips: tuple[str, ...], dtype_bytes: int) -> tuple[int, int]:
    """Bytes of the torchao-fp8 exploration copy (branchdiff.explore.quant.make_quantized_copy): LoRA merged,
    the Linear layers quantised: E4M3 weights (1 B/param) with one fp32 scale per output row, bias
    kept; everything else (convs, norms, embedders, skipped layers) in the model dtype. Also returns
    the number of quantised weights (the layers quant.py's own rule picks)."""
    from branchdiff.explore.quant import QuantConfig, quantized_layer_names

    names = set(quantized_layer_names(model, QuantConfig("torchao-fp8", tuple(skips))))
    total = quantised = 0
    for name, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            if "lora_" in name or "lora_" in pname:
                continue  # merged into the base weight
            if name.replace(".base_layer", "") in names and pname == "weight":
                total += p.numel() + p.shape[0] * 4
                quantised += p.numel()
            else:
                total += p.numel() * dtype_bytes
    total += sum(b.numel() for b in model.buffers()) * dtype_bytes
    return total, quantised


@dataclass
class Trace:
    held: Cost = Cost()  # alive after the forward: what autograd keeps for the backward (+ the output)
    peak: Peak = field(default_factory=Peak)  # during the forward
    delta: dict[str, Cost] = field(default_factory=dict)  # per block kind: what the block leaves alive
    transient: dict[str, Peak] = field(default_factory=dict)  # per block kind: its peak above its start
    count: dict[str, int] = field(default_factory=dict)  # blocks of each kind in the traced copy
    flops: float = 0.0  # of the whole traced forward, one row
    block_flops: dict[str, float] = field(default_factory=dict)  # per block kind, one row
    stream_bytes: float = 0.0  # the first block's output (its hidden and text streams), one row: what a block cache keeps per tensor


def units(model: torch.nn.Module, family: Family) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of the blocks whose figures are kept per kind."""
    if family.ckpt_units:
        return [(n, m) for n, m in model.named_modules() if type(m).__name__ in family.ckpt_units]
    return [(f"{lst}.{i}", m) for lst in family.block_lists for i, m in enumerate(getattr(model, lst))]


def trace(model: torch.nn.Module, family: Family, shape: Geometry, size: Size, grad: bool, autocast: torch.dtype | None) -> Trace:
    """One forward of one network row through `model` (already on fake CUDA)."""
    tracker = LiveBytes({id(p.untyped_storage()) for p in model.parameters()})
    counter = FlopCounterMode(display=False)
    result = Trace()
    starts: dict[str, tuple[Cost, float]] = {}
    hooks = []
    for name, module in units(model, family):
        kind = family.block_kind(name, module)
        result.count[kind] = result.count.get(kind, 0) + 1

        def pre(mod, args, name=name):
            starts[name] = (tracker.mark(), counter.get_total_flops())

        def post(mod, args, out, name=name, kind=kind):
            if not result.stream_bytes:  # the first block's
                outputs = out if isinstance(out, tuple) else (out,)
                result.stream_bytes = float(sum(t.numel() * t.element_size() for t in outputs if isinstance(t, torch.Tensor)))
            result.delta[kind] = tracker.live - starts[name][0]  # the last block of a kind stands for all of them
            result.block_flops[kind] = counter.get_total_flops() - starts[name][1]
            if kind not in result.transient or tracker.local.at(1) > result.transient[kind].at(1):
                result.transient[kind] = tracker.local

        hooks += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    try:
        with efficient_attention(), torch.set_grad_enabled(grad), cuda_autocast(autocast), counter, tracker:
            out = model(**family.inputs(model.config, shape, 1, size, model.dtype, family.text_tokens))
            result.held, result.peak = tracker.live, tracker.peak
            del out
        result.flops = float(counter.get_total_flops())
    finally:
        for h in hooks:
            h.remove()
    return result


@dataclass
class Measured:
    denoiser_params: int
    denoiser_buffers: int  # persistent buffers (SD3's positional table), held in the model dtype too
    unused_params: int  # in the modules no gradient reaches (Qwen-Image's last text stream): full fine-tuning freezes them
    lora_params: int
    lora_base_params: int  # weights of the LoRA-wrapped layers
    copy_bytes: int  # fp8 explore copy
    copy_quantised: int
    encoders: dict[str, int]  # params
    vae_params: int
    counts: dict[str, int]  # blocks of each kind in the real denoiser
    block_params: int  # the largest block's parameters: what FSDP2 gathers per unit
    plain: Trace  # training forward, no checkpointing
    ckpt: Trace  # training forward, gradient checkpointing
    nograd: Trace  # rollout forward
    decode_image: float  # VAE decode peak per image
    geometry: Geometry
    config: dict  # the denoiser's full config (its class's defaults filled in)
    decode_flops: float = 0.0  # of one VAE decode (0: a pixel-space model)

    def _scaled(self, t: Trace, per_kind: dict, base: Cost) -> Cost:
        """`base` (the traced copy) + Σ over block kinds (real − traced blocks) × per block: a kind the traced copy
        has and the real model lacks (SD3's dual attention block, for a release without one) is taken out."""
        return sum(((self.counts.get(k, 0) - t.count.get(k, 0)) * per_kind[k] for k in {*self.counts, *t.count} if k in per_kind), base)

    def held(self, rows: int, ckpt: bool) -> float:
        """Alive after the training forward, at the real depth: traced + Σ (real − traced blocks) × per-block."""
        t = self.ckpt if ckpt else self.plain
        return self._scaled(t, t.delta, t.held).at(rows)

    def recompute(self, rows: int) -> float:
        """Checkpointing: one block's saved set, rebuilt during the backward (the largest kind)."""
        return max(((self.plain.delta[k] - self.ckpt.delta[k]).at(rows) for k in self.counts if k in self.plain.delta), default=0.0)

    def backward(self, rows: int) -> float:
        """The backward's working set (gradients of one block's ops), taken as one block's no-grad working set."""
        return max((p.at(rows) for k, p in self.nograd.transient.items() if k in self.counts), default=0.0)

    def train(self, rows: int, ckpt: bool) -> float:
        """Peak of the training forward + backward."""
        return self.held(rows, ckpt) + (self.recompute(rows) if ckpt else 0.0) + self.backward(rows)

    def rollout(self, rows: int) -> float:
        """Peak of a no-grad forward (rollout chunk, KL reference)."""
        return self.nograd.peak.at(rows)

    def block_cache(self, nodes: int, rows_per_node: int) -> float:
        """Bytes a rollout's block cache (`sampling.block_cache`) keeps for `nodes` nodes: per network row the first block's
        residual and the later blocks' residual of each stream, at most twice the first block's output."""
        return 2 * self.nograd.stream_bytes * rows_per_node * nodes

    def forward_flops(self) -> float:
        """Floating-point operations of one network row's forward at the real depth (multiply-add = 2)."""
        t = self.nograd
        return t.flops + sum((self.counts.get(k, 0) - t.count.get(k, 0)) * t.block_flops.get(k, 0.0) for k in {*self.counts, *t.count})


def lora_targets(family: Family, targets: str | list[str]) -> list[str]:
    """The module-name suffixes LoRA wraps: a named set of the family's adapter, or the run's own list."""
    if isinstance(targets, str):
        chosen = family.adapter.target_sets_for(family.config)[targets]
        return [chosen] if isinstance(chosen, str) else list(chosen)
    return list(targets)


def measure(family: Family, dtype: torch.dtype, rank: int, alpha: float, size: Size, autocast: torch.dtype | None,
            targets: str | list[str] = "attention") -> Measured:
    import diffusers
    from torch._subclasses.fake_tensor import FakeTensorMode

    names = lora_targets(family, targets)
    all_linear = names == ["all-linear"]
    dbytes = torch.finfo(dtype).bits // 8
    full = build_meta(family.denoiser, family.config, dtype)
    if all_linear:  # every Linear of the blocks (peft's "all-linear" leaves the output layer out)
        names = sorted({n.split(".")[-1] for lst in family.block_lists for n, m in getattr(full, lst).named_modules()
                        if isinstance(m, torch.nn.Linear)})
    params, buffers = numel(full), sum(b.numel() for b in full.buffers())
    unused = family.adapter.unused_modules_of(full)  # neither LoRA nor full fine-tuning trains them
    unused_params = sum(numel(full.get_submodule(name)) for name in unused)
    lora, lora_base = lora_targets_by_formula(full, names, rank, unused)  # verified against peft below
    counts: dict[str, int] = {}
    for name, module in units(full, family):
        kind = family.block_kind(name, module)
        counts[kind] = counts.get(kind, 0) + 1
    block_params = max((numel(module) for _, module in units(full, family)), default=0)
    copy_bytes, quantised = explore_copy_bytes(full, tuple(family.adapter.quant_skip_modules), dbytes)

    encoders = {}
    for label, build in family.text_encoders:
        with torch.device("meta"):
            encoders[label] = numel(build())
    vae = None
    if family.vae is not None:
        with torch.device("meta"):
            vae = getattr(diffusers, family.vae[0]).from_config(family.vae[1]).to(dtype)
    shape = geometry(vae)

    # the traced copy (the full model itself when nothing is reduced), built on meta outside the
    # fake mode and materialised as fake CUDA tensors inside it
    model = build_meta(family.denoiser, {**family.config, **family.reduced}, dtype) if family.reduced else full
    traced_unused = family.adapter.unused_modules_of(model)
    expected = lora_targets_by_formula(model, names, rank, traced_unused)[0]
    attached = sum(p.numel() for p in add_lora(model, names, rank, alpha, seed=0, unused=traced_unused))  # as the trainer attaches it
    if attached != expected:  # peft's count on the traced copy must equal the formula used for the full model
        raise RuntimeError(f"{family.name}: peft attached {attached} LoRA parameters, r·(in+out) over the targets gives {expected}")
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cuda")
        plain = trace(model, family, shape, size, True, autocast)
        nograd = trace(model, family, shape, size, False, autocast)
        # diffusers' checkpointing (non-reentrant); the RNG state is not saved: there is no CUDA to ask
        model.enable_gradient_checkpointing(
            lambda module, *args: torch.utils.checkpoint.checkpoint(module.__call__, *args, use_reentrant=False, preserve_rng_state=False))
        ckpt = trace(model, family, shape, size, True, autocast)
        decode_image = decode_flops = 0.0
        if vae is not None:
            vae.to_empty(device="cuda")
            decode_image, decode_flops = trace_vae_decode(vae, family.vae_latent(shape, size))
    return Measured(params, buffers, unused_params, lora, lora_base, copy_bytes, quantised, encoders, numel(vae) if vae is not None else 0, counts,
                    block_params, plain, ckpt, nograd, decode_image, shape, dict(full.config), decode_flops)


REWARD_NETWORKS = {"pickscore": "vit-h-14", "hpsv2": "vit-h-14", "hpsv2.1": "vit-h-14", "videoalign": "qwen2-vl-2b"}  # reward: its network
REWARD_PARAMS: dict[str, int] = {}


def reward_network(model: str) -> torch.nn.Module:
    """A reward's network of REWARD_NETWORKS, built from its published config on the current default device (meta, to count):
    "vit-h-14" (HPS v2.1 and PickScore share the geometry) or "qwen2-vl-2b" (VideoAlign)."""
    from transformers import CLIPConfig, CLIPModel, Qwen2VLConfig, Qwen2VLForConditionalGeneration

    return CLIPModel(CLIPConfig(**P.VIT_H14_CLIP)) if model == "vit-h-14" else Qwen2VLForConditionalGeneration(Qwen2VLConfig(**P.QWEN2_VL_2B))


def reward_params(model: str = "vit-h-14") -> int:
    """Parameters of a reward's network (`reward_network`), counted on meta."""
    if model not in REWARD_PARAMS:
        with torch.device("meta"):
            REWARD_PARAMS[model] = numel(reward_network(model))
    return REWARD_PARAMS[model]


def reward_bytes(spec) -> int:
    """Bytes of one reward component's weights: HPS / PickScore fp32 ViT-H-14, VideoAlign's Qwen2-VL-2B
    in its `dtype`; the programmatic rewards (flicker, the verifiers) and remote ones hold none here."""
    network = REWARD_NETWORKS.get(spec.name)
    if network == "vit-h-14":
        return reward_params(network) * 4
    if network == "qwen2-vl-2b":
        return reward_params(network) * torch.finfo(DTYPES[spec.kwargs.get("dtype", "float32")]).bits // 8
    return 0
