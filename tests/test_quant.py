"""4-bit formats against independent float64 references, and quantised exploration copies."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from branchdiff.quant import (
    BACKENDS,
    DEFAULT_SKIPS,
    QuantConfig,
    fake_quantize_mxfp4,
    fake_quantize_nvfp4,
    is_skipped,
    make_quantized_copy,
    mxfp4_quantize,
    nvfp4_quantize,
    quantized_layer_names,
    refresh_quantized_copy,
    round_to_e2m1,
)

torch.set_num_threads(1)

E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
SIGNED_E2M1 = sorted({s * v for s in (-1.0, 1.0) for v in E2M1_GRID.tolist()})


def e4m3_grid() -> torch.Tensor:
    """All non-negative finite float8_e4m3fn values, ascending; index parity = mantissa parity."""
    subnormal = [m * 2.0**-9 for m in range(8)]
    normal = [(1 + m / 8) * 2.0 ** (e - 7) for e in range(1, 16) for m in range(8) if (e, m) != (15, 7)]
    return torch.tensor(subnormal + normal, dtype=torch.float64)


def round_to_grid(x: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """Nearest point of an ascending non-negative grid to |x| (ties: even index), with x's sign;
    beyond the grid it saturates at the largest point."""
    distance = (x.abs().unsqueeze(-1) - grid).abs()  # (..., G)
    nearest = distance == distance.min(dim=-1, keepdim=True).values
    preference = nearest * (2 - torch.arange(len(grid)) % 2)  # an even index wins a tie
    return torch.sign(x) * grid[preference.argmax(dim=-1)]


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    return ((approx.float() - exact.float()).norm() / exact.float().norm()).item()


# --- formats ----------------------------------------------------------------------------------


def test_e2m1_values_round_trip_exactly():
    values = torch.tensor(SIGNED_E2M1)
    assert len(SIGNED_E2M1) == 15
    assert torch.equal(round_to_e2m1(values), values)


def test_e2m1_midpoints_round_to_even_and_saturate():
    midpoints = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    expected = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0])  # the even-mantissa neighbour
    assert torch.equal(round_to_e2m1(midpoints), expected)
    assert torch.equal(round_to_e2m1(-midpoints), -expected)
    assert torch.equal(round_to_e2m1(torch.tensor([5.01, 6.5, 1e9, float("inf")])), torch.full((4,), 6.0))
    assert torch.equal(round_to_e2m1(torch.tensor([-7.0, -float("inf")])), torch.full((2,), -6.0))


def test_e2m1_matches_nearest_even_reference():
    x = torch.linspace(-8, 8, 4001, dtype=torch.float64)  # step 0.004 hits every midpoint exactly
    assert torch.equal(round_to_e2m1(x).double(), round_to_grid(x, E2M1_GRID))


def test_nvfp4_matches_float64_reference():
    torch.manual_seed(0)
    multipliers = torch.tensor([1.0, 1e-3, 1e-5, 0.0, 30.0, 0.1])  # normal, subnormal, zero scales
    w = (torch.randn(3, 6, 16) * multipliers[:, None]).reshape(3, 96)
    parts = nvfp4_quantize(w)
    assert parts.values.shape == (3, 96) and parts.block_scales.shape == (3, 6) and parts.tensor_scale.shape == ()
    assert parts.block_scales.dtype == torch.float8_e4m3fn

    w64 = w.double()
    tensor_scale = (w64.abs().max() / (448 * 6)).float()  # one correct rounding of the quotient
    assert parts.tensor_scale.item() == tensor_scale.item()
    blocks = w64.reshape(3, 6, 16)
    block_scales = round_to_grid((blocks.abs().amax(-1) / 6) / tensor_scale.double(), e4m3_grid())  # (3, 6)
    assert torch.equal(parts.block_scales.double(), block_scales)
    assert (block_scales[:, 1] < 2**-6).all() and (block_scales[:, 2:4] == 0).all()  # subnormal, zero
    scale = (block_scales * tensor_scale.double()).unsqueeze(-1)  # (3, 6, 1)
    values = torch.where(scale > 0, round_to_grid(blocks / scale.clamp(min=1e-300), E2M1_GRID), 0.0)
    assert torch.equal(parts.values.double(), values.reshape(3, 96))
    exact = (values * scale).reshape(3, 96)  # exact in float64: 2 + 4 + 24 significant bits
    dequantized = fake_quantize_nvfp4(w)
    torch.testing.assert_close(dequantized.double(), exact, rtol=2.5e-7, atol=0)  # ≤ 2 fp32 roundings


def test_nvfp4_zeros_give_zeros_and_shapes_are_checked():
    zeros = torch.zeros(4, 32)
    assert torch.equal(fake_quantize_nvfp4(zeros), zeros)
    assert torch.equal(fake_quantize_mxfp4(zeros), zeros)
    with pytest.raises(ValueError, match=r"\(4, 20\)"):
        nvfp4_quantize(torch.randn(4, 20))
    with pytest.raises(ValueError, match=r"\(2, 48\)"):
        mxfp4_quantize(torch.randn(2, 48))
    w = torch.randn(4, 20)
    padded = fake_quantize_nvfp4(w)  # a short final block is zero-padded
    assert padded.shape == w.shape and torch.isfinite(padded).all() and relative_error(padded, w) < 0.15
    assert fake_quantize_nvfp4(w.bfloat16()).dtype == torch.bfloat16


def test_mxfp4_power_of_two_scales_on_32_blocks():
    torch.manual_seed(1)
    w = torch.randn(4, 128) * torch.logspace(-3, 2, 4)[:, None]
    parts = mxfp4_quantize(w)
    assert parts.scales.shape == (4, 4)
    exponents = torch.log2(parts.scales.double())
    assert torch.equal(exponents, exponents.round())
    block_amax = w.double().reshape(4, 4, 32).abs().amax(-1)
    assert torch.equal(exponents, torch.floor(torch.log2(block_amax)) - 2)
    values = (w.double().reshape(4, 4, 32) / parts.scales.double().unsqueeze(-1))
    assert torch.equal(parts.values.double(), round_to_grid(values, E2M1_GRID).reshape(4, 128))
    assert set(parts.values.unique().tolist()) <= set(SIGNED_E2M1)


def test_relative_errors_on_randn_weights(capsys):
    torch.manual_seed(2)
    w = torch.randn(256, 512)
    nvfp4, mxfp4 = relative_error(fake_quantize_nvfp4(w), w), relative_error(fake_quantize_mxfp4(w), w)
    with capsys.disabled():
        print(f"\nrelative weight error on randn(256, 512): nvfp4 {nvfp4:.4f}, mxfp4 {mxfp4:.4f}")
    assert 0.085 < nvfp4 < 0.105
    assert nvfp4 < mxfp4 < 0.13


def test_matches_torchao_emulation_bit_for_bit():
    nvfp4_tensor = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")
    mx_tensor = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    torch.manual_seed(3)
    w = torch.randn(64, 128)
    scale = nvfp4_tensor.per_tensor_amax_to_scale(w.abs().amax())
    reference = nvfp4_tensor.NVFP4Tensor.to_nvfp4(w, per_tensor_scale=scale).dequantize(torch.float32)
    assert torch.equal(fake_quantize_nvfp4(w), reference)
    reference = mx_tensor.MXTensor.to_mx(w, torch.float4_e2m1fn_x2, 32).dequantize(torch.float32)
    assert torch.equal(fake_quantize_mxfp4(w), reference)


# --- configs and layer selection --------------------------------------------------------------


def test_config_validation():
    with pytest.raises(ValueError, match="bnb-nf4"):
        QuantConfig(backend="int4")
    with pytest.raises(ValueError, match="min_features"):
        QuantConfig(min_features=-1)
    with pytest.raises(ValueError, match="sana"):
        QuantConfig.for_family("sdxl")
    assert QuantConfig.for_family("flux", "bnb-nf4").skip_modules == DEFAULT_SKIPS["flux"]


def test_skip_patterns_are_anchored_dotted_paths():
    assert is_skipped("proj_out", ("proj_out",))
    assert is_skipped("norm_out.linear", ("norm_out",))
    assert not is_skipped("single_transformer_blocks.3.proj_out", ("proj_out",))
    assert not is_skipped("norm_out_extra", ("norm_out",))
    assert is_skipped("transformer_blocks.0.norm1.linear", ("*.norm1",))


class Net(nn.Module):
    """A residual MLP with named layers: embed → h + down(gelu(up(h))) → out."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.up, self.down, self.out = nn.Linear(8, 64), nn.Linear(64, 128), nn.Linear(128, 64), nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)  # (B, 64)
        return self.out(h + self.down(nn.functional.gelu(self.up(h))))


NET_CONFIG = dict(skip_modules=("embed", "out"), min_features=0)


@pytest.fixture(scope="module")
def sd3():
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(4)
    return diffusers.SD3Transformer2DModel(
        sample_size=32, patch_size=8, in_channels=3, out_channels=3, num_layers=1, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=16, caption_projection_dim=16, pooled_projection_dim=16,
        pos_embed_max_size=4,
    )


def sd3_forward(model: nn.Module) -> torch.Tensor:
    generator = torch.Generator().manual_seed(5)
    inputs = dict(
        hidden_states=torch.randn(2, 3, 32, 32, generator=generator),
        encoder_hidden_states=torch.randn(2, 4, 16, generator=generator),
        pooled_projections=torch.randn(2, 16, generator=generator),
        timestep=torch.tensor([500.0, 900.0]),
    )
    with torch.no_grad():
        return model(**inputs, return_dict=False)[0]  # (2, 3, 32, 32)


def test_layer_names_respect_default_skips_and_min_features(sd3):
    linear = [n for n, m in sd3.named_modules() if isinstance(m, nn.Linear)]
    names = quantized_layer_names(sd3, QuantConfig.for_family("sd3"))
    expected = [n for n in linear if not n.startswith(DEFAULT_SKIPS["sd3"])]
    assert names == expected and "transformer_blocks.0.attn.to_q" in names and "proj_out" not in names
    big = quantized_layer_names(sd3, QuantConfig.for_family("sd3", min_features=16 * 17))
    assert big == [n for n in expected if sd3.get_submodule(n).weight.numel() >= 16 * 17] and len(big) < len(names)


@pytest.mark.parametrize("backend", ["nvfp4-emulated", "mxfp4-emulated"])
def test_emulated_copy_quantises_only_eligible_layers(sd3, backend):
    before = {k: v.clone() for k, v in sd3.state_dict().items()}
    config = QuantConfig.for_family("sd3", backend)
    quantized = make_quantized_copy(sd3, config)
    assert all(torch.equal(v, before[k]) for k, v in sd3.state_dict().items())  # original untouched
    assert not quantized.training and not any(p.requires_grad for p in quantized.parameters())
    fake = fake_quantize_nvfp4 if backend == "nvfp4-emulated" else fake_quantize_mxfp4
    names = quantized_layer_names(sd3, config)
    for key, value in quantized.state_dict().items():
        layer = key.rpartition(".")[0]
        expected = fake(before[key]) if layer in names and key.endswith("weight") else before[key]
        assert torch.equal(value, expected), key
    error = relative_error(sd3_forward(quantized), sd3_forward(sd3))
    assert 0 < error < 0.2


def test_te_nvfp4_raises_a_clear_error(sd3):
    with pytest.raises(RuntimeError, match="te-nvfp4 needs .*backends that work here: nvfp4-emulated"):
        make_quantized_copy(sd3, QuantConfig.for_family("sd3", "te-nvfp4"))
    assert "te-nvfp4" in BACKENDS


# --- LoRA: the copy follows the policy ----------------------------------------------------------


def randomise_lora(model: nn.Module, std: float) -> None:
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.normal_(0, std)


def test_peft_lora_is_merged_and_refresh_follows_the_policy():
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(6)
    policy = get_peft_model(Net(), LoraConfig(r=4, lora_alpha=4, target_modules=["up", "down"]))
    randomise_lora(policy, 0.2)
    config = QuantConfig(backend="nvfp4-emulated", **NET_CONFIG)
    assert quantized_layer_names(policy, config) == ["up", "down"]
    base_before = {k: v.clone() for k, v in policy.state_dict().items()}
    quantized = make_quantized_copy(policy, config)
    assert all(torch.equal(v, base_before[k]) for k, v in policy.state_dict().items())
    merged = copy.deepcopy(policy).merge_and_unload()
    assert torch.equal(quantized.up.weight, fake_quantize_nvfp4(merged.up.weight))
    assert torch.equal(quantized.out.weight, merged.out.weight)

    randomise_lora(policy, 0.2)  # an optimizer step on the adapter ...
    with torch.no_grad():
        policy.base_model.model.out.weight.add_(0.1)  # ... and on a non-LoRA parameter
    stale = copy.deepcopy(quantized)
    refresh_quantized_copy(quantized, policy, config)
    assert all(torch.equal(v, base_before[k]) for k, v in policy.state_dict().items() if "lora_" not in k and "out" not in k)
    fresh = make_quantized_copy(policy, config)
    assert all(torch.equal(v, fresh.state_dict()[k]) for k, v in quantized.state_dict().items())
    x = torch.randn(16, 8)
    with torch.no_grad():
        target = policy(x)
        assert relative_error(quantized(x), target) < 0.5 * relative_error(stale(x), target)


def test_diffusers_injected_lora_is_merged(sd3):
    from peft import LoraConfig

    model = copy.deepcopy(sd3)
    model.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=["to_q", "to_v"]))
    randomise_lora(model, 0.3)
    config = QuantConfig.for_family("sd3", "mxfp4-emulated")
    quantized = make_quantized_copy(model, config)
    assert not any("lora_" in k for k in quantized.state_dict())
    attn = model.transformer_blocks[0].attn.to_q
    merged = attn.base_layer.weight + attn.get_delta_weight("default")
    assert torch.equal(quantized.transformer_blocks[0].attn.to_q.weight, fake_quantize_mxfp4(merged))
    randomise_lora(model, 0.3)
    refresh_quantized_copy(quantized, model, config)
    merged = attn.base_layer.weight + attn.get_delta_weight("default")
    assert torch.equal(quantized.transformer_blocks[0].attn.to_q.weight, fake_quantize_mxfp4(merged))


# --- bitsandbytes ---------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["bnb-fp4", "bnb-nf4"])
def test_bnb_forward_on_cpu_approximates_fp32(backend):
    bnb = pytest.importorskip("bitsandbytes")
    torch.manual_seed(7)
    model, x = Net(), torch.randn(16, 8)
    config = QuantConfig(backend=backend, **NET_CONFIG)
    quantized = make_quantized_copy(model, config)
    assert isinstance(quantized.up, bnb.nn.Linear4bit) and type(quantized.out) is nn.Linear
    assert quantized.up.weight.quant_state.quant_type == backend.removeprefix("bnb-")
    with torch.no_grad():
        error = relative_error(quantized(x), model(x))
        assert 0 < error < 0.2
        model.up.weight.mul_(-1)  # a policy change must reach the 4-bit layers
        refresh_quantized_copy(quantized, model, config)
        assert relative_error(quantized(x), model(x)) < 0.2
