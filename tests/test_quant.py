"""4-bit and FP8 formats against independent references (float64 grids, torch's float8 cast,
torchao), and quantised exploration copies."""

from __future__ import annotations

import copy
import functools
import re
import sys

import pytest
import torch
from torch import nn

from branchdiff.explore.formats import (
    fake_quantize_fp8,
    fake_quantize_mxfp4,
    fake_quantize_nvfp4,
    fp8_quantize,
    mxfp4_quantize,
    nvfp4_quantize,
    round_to_e2m1,
    round_to_e4m3,
)
from branchdiff.explore.quant import (
    BACKENDS,
    GPU_BACKENDS,
    FP8EmulatedLinear,
    QuantConfig,
    is_skipped,
    make_quantized_copy,
    quantized_layer_names,
    refresh_quantized_copy,
)
from branchdiff.models.tiny import TinyAdapter
from branchdiff.settings.load import load_config

SD3_SKIPS = TinyAdapter.quant_skip_modules  # the SD3 architecture's embedders, output norm and projection

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


FAKE_QUANTIZE = {  # emulated backend -> what its copy's weights must equal
    "nvfp4-emulated": fake_quantize_nvfp4,
    "mxfp4-emulated": fake_quantize_mxfp4,
    "fp8-emulated": functools.partial(fake_quantize_fp8, granularity="row"),
    "fp8-emulated-tensor": functools.partial(fake_quantize_fp8, granularity="tensor"),
}


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


def e4m3_test_values() -> torch.Tensor:
    """Every E4M3 value, every midpoint (ties) and its float32 neighbours, subnormals and below,
    log-uniform values over the whole range, saturation and NaN; both signs."""
    grid = e4m3_grid().float()
    midpoints = (grid[1:] + grid[:-1]) / 2  # exact in float32 (5 significant bits)
    edges = torch.cat([midpoints, torch.tensor([464.0])])  # 464: halfway from 448 to the missing 480
    near = torch.cat([torch.nextafter(edges, torch.tensor(0.0)), torch.nextafter(edges, torch.tensor(1e9))])
    spread = torch.logspace(-14, 3, 20001, base=2.0)  # 2^-14 .. 2^3, then scaled over the range
    spread = torch.cat([spread * 2.0**k for k in range(0, 9, 3)])
    special = torch.tensor([2.0**-10, 2.0**-11, 1e-30, 449.0, 479.0, 480.0, 1e9, float("inf"), float("nan")])
    positive = torch.cat([grid, edges, near, spread, special])
    return torch.cat([positive, -positive])


def test_e4m3_matches_torch_float8_cast():
    x = e4m3_test_values()
    rounded = round_to_e4m3(x)
    # torch's own cast, an independent implementation; clamping first makes it saturating whatever
    # this torch version does with overflow (2.15 saturates on CPU; older versions give NaN)
    reference = x.clamp(-448, 448).to(torch.float8_e4m3fn).float()
    torch.testing.assert_close(rounded, reference, rtol=0, atol=0, equal_nan=True)
    finite = torch.isfinite(x)
    assert torch.equal(rounded[finite].double(), round_to_grid(x[finite].double(), e4m3_grid()))
    assert torch.isnan(round_to_e4m3(torch.tensor(float("nan"))))


def test_e4m3_ties_subnormals_and_saturation():
    ties = torch.tensor([2.0**-10, 3 * 2.0**-10, 1.0625, 1.1875, 17.0, 432.0, 464.0])
    expected = torch.tensor([0.0, 2.0**-8, 1.0, 1.25, 16.0, 448.0, 448.0])  # the even-mantissa neighbour
    assert torch.equal(round_to_e4m3(ties), expected) and torch.equal(round_to_e4m3(-ties), -expected)
    subnormals = torch.arange(8) * 2.0**-9  # m · 2^-9, m = 0..7, and the smallest normal 2^-6 = 8 · 2^-9
    assert torch.equal(round_to_e4m3(subnormals), subnormals)
    assert round_to_e4m3(torch.tensor(0.9 * 2.0**-9)).item() == 2.0**-9
    assert torch.equal(round_to_e4m3(torch.tensor([465.0, 1e30, float("inf")])), torch.full((3,), 448.0))
    assert torch.equal(round_to_e4m3(torch.tensor([-500.0, -float("inf")])), torch.full((2,), -448.0))


def test_fp8_scales_per_row_and_per_tensor_by_hand():
    w = torch.tensor([[7.0, -3.3, 0.005, 0.5], [0.0, 0.0, 0.0, 0.0], [-896.0, 3.0, 1e-3, 100.0]])
    # per row: s = amax/448 = 1/64, 1 (zero row), 2. Row 0: 3.3·64 = 211.2 → 208 (spacing 16);
    # 0.005·64 = 0.32 → 0.3125 (spacing 2^-5). Row 2: 1e-3/2 = 2^-9 · 0.256 → 0; 100/2 = 50 is a tie
    # between 48 and 52 → 48 (even mantissa)
    rows = fp8_quantize(w, "row")
    assert torch.equal(rows.scales, torch.tensor([[1 / 64], [1.0], [2.0]]))
    assert torch.equal(rows.values, torch.tensor([[448.0, -208.0, 0.3125, 32.0], [0.0] * 4, [-448.0, 1.5, 0.0, 48.0]]))
    assert torch.equal(fake_quantize_fp8(w, "row"), torch.tensor(
        [[7.0, -3.25, 0.0048828125, 0.5], [0.0] * 4, [-896.0, 3.0, 0.0, 96.0]]))
    # per tensor: s = 896/448 = 2 for every row; row 0 now lands in the subnormals: 0.005/2 → 2^-9
    whole = fp8_quantize(w, "tensor")
    assert whole.scales.shape == () and whole.scales.item() == 2.0
    assert torch.equal(whole.values[0], torch.tensor([3.5, -1.625, 2.0**-9, 0.25]))
    assert torch.equal(fake_quantize_fp8(w, "tensor")[0], torch.tensor([7.0, -3.25, 2.0**-8, 0.5]))
    assert torch.equal(fake_quantize_fp8(torch.zeros(3, 5), "tensor"), torch.zeros(3, 5))
    assert fake_quantize_fp8(w.bfloat16()).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="granularity='block'"):
        fp8_quantize(w, "block")


def test_fp8_relative_error_on_randn_weights(capsys):
    torch.manual_seed(2)
    w = torch.randn(256, 512)
    row, tensor = relative_error(fake_quantize_fp8(w, "row"), w), relative_error(fake_quantize_fp8(w, "tensor"), w)
    nvfp4 = relative_error(fake_quantize_nvfp4(w), w)
    with capsys.disabled():
        print(f"\nrelative weight error on randn(256, 512): fp8 per-row {row:.4f}, per-tensor {tensor:.4f}, nvfp4 {nvfp4:.4f}")
    # 3 mantissa bits: uniform rounding error of spacing 2^(e-3) on [2^e, 2^(e+1)) is ≈ 2.6% RMS
    assert 0.022 < row < 0.030 and 0.022 < tensor < 0.030
    assert row < nvfp4 / 3


def test_fp8_matches_torchao_bit_for_bit():
    primitives = pytest.importorskip("torchao.quantization.quant_primitives")
    if not hasattr(primitives, "_choose_scale_float8"):
        pytest.skip("this torchao has no _choose_scale_float8")
    torch.manual_seed(3)
    w = torch.randn(64, 128) * torch.logspace(-4, 2, 64)[:, None]
    for granularity, block in (("row", [1, 128]), ("tensor", [64, 128])):
        scale = primitives._choose_scale_float8(w, block)
        reference = primitives._dequantize_affine_float8(primitives._quantize_affine_float8(w, scale), scale)
        assert torch.equal(fake_quantize_fp8(w, granularity), reference), granularity


@pytest.mark.parametrize("granularity", ["row", "tensor"])
def test_fp8_emulated_linear_is_the_scaled_fp8_matmul(granularity):
    torch.manual_seed(8)
    weight, bias = torch.randn(24, 40), torch.randn(24)
    x = torch.randn(2, 5, 40) * torch.logspace(-2, 2, 5)[:, None]  # tokens of very different scales
    layer = FP8EmulatedLinear(weight, bias, granularity)
    assert torch.equal(layer.weight, fake_quantize_fp8(weight, granularity))
    # what an FP8 GEMM computes: exact products of E4M3 values, then the two scales
    x_parts, w_parts = fp8_quantize(x, granularity), fp8_quantize(weight, granularity)
    products = x_parts.values.double() @ w_parts.values.double().T  # (2, 5, 24)
    w_scales = w_parts.scales.double().reshape(-1) if granularity == "row" else w_parts.scales.double()
    expected = x_parts.scales.double() * products * w_scales + bias.double()
    with torch.no_grad():
        torch.testing.assert_close(layer(x).double(), expected, rtol=1e-5, atol=1e-5)
        assert relative_error(layer(x), nn.functional.linear(x, weight, bias)) < 0.06
    if granularity == "row":  # a token's output depends only on its own scale
        scaled = x.clone()
        scaled[0, 0] *= 1000
        with torch.no_grad():
            assert torch.equal(layer(scaled)[:, 1:], layer(x)[:, 1:]) and torch.equal(layer(scaled)[1], layer(x)[1])


# --- configs and layer selection --------------------------------------------------------------


def test_config_validation():
    with pytest.raises(ValueError, match="bnb-nf4"):
        QuantConfig(backend="int4")
    with pytest.raises(ValueError, match="min_features"):
        QuantConfig(min_features=-1)
    for backend in BACKENDS:  # every backend is a valid explore.backend
        assert load_config(None, [f"explore.backend={backend}"]).explore.backend == backend
    shapes = nn.Sequential(nn.Linear(20, 16), nn.Linear(16, 32))  # FP8 GEMMs want dims divisible by 16
    assert quantized_layer_names(shapes, QuantConfig(backend="torchao-fp8", skip_modules=())) == ["1"]
    assert quantized_layer_names(shapes, QuantConfig(backend="fp8-emulated", skip_modules=())) == ["0", "1"]


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
    names = quantized_layer_names(sd3, QuantConfig(skip_modules=SD3_SKIPS))
    expected = [n for n in linear if not n.startswith(SD3_SKIPS)]
    assert names == expected and "transformer_blocks.0.attn.to_q" in names and "proj_out" not in names
    big = quantized_layer_names(sd3, QuantConfig(skip_modules=SD3_SKIPS, min_features=16 * 17))
    assert big == [n for n in expected if sd3.get_submodule(n).weight.numel() >= 16 * 17] and len(big) < len(names)


@pytest.mark.parametrize("backend", list(FAKE_QUANTIZE))
def test_emulated_copy_quantises_only_eligible_layers(sd3, backend):
    before = {k: v.clone() for k, v in sd3.state_dict().items()}
    config = QuantConfig(backend, SD3_SKIPS)
    quantized = make_quantized_copy(sd3, config)
    assert all(torch.equal(v, before[k]) for k, v in sd3.state_dict().items())  # original untouched
    assert not quantized.training and not any(p.requires_grad for p in quantized.parameters())
    fake = FAKE_QUANTIZE[backend]
    names = quantized_layer_names(sd3, config)
    fp8 = backend.startswith("fp8")
    assert all(isinstance(quantized.get_submodule(n), FP8EmulatedLinear) == fp8 for n in names)
    for key, value in quantized.state_dict().items():
        layer = key.rpartition(".")[0]
        expected = fake(before[key]) if layer in names and key.endswith("weight") else before[key]
        assert torch.equal(value, expected), key
    error = relative_error(sd3_forward(quantized), sd3_forward(sd3))
    assert 0 < error < (0.05 if fp8 else 0.2)


GPU_ERRORS = {  # backend -> (what it needs on this machine, its emulation)
    "te-nvfp4": ("NVIDIA Transformer Engine .* and a CUDA Blackwell GPU \\(sm100\\+\\)", "nvfp4-emulated"),
    "te-fp8": ("NVIDIA Transformer Engine .* and a CUDA GPU with FP8 \\(sm89\\+, e.g. H100\\)", "fp8-emulated-tensor"),
    "torchao-fp8": ("a CUDA GPU with FP8 \\(sm89\\+, e.g. H100\\)", "fp8-emulated"),
}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the messages for a machine without CUDA")
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_backends_raise_one_clear_line(sd3, backend):
    needs, emulation = GPU_ERRORS[backend]
    with pytest.raises(RuntimeError) as caught:
        make_quantized_copy(sd3, QuantConfig(backend, SD3_SKIPS))
    message = str(caught.value)
    assert "\n" not in message
    assert re.fullmatch(
        f"backend {backend} needs {needs}; this machine has no CUDA GPU; its emulation is {emulation}; "
        f"backends that work here: nvfp4-emulated, .*fp8-emulated.*bnb-nf4", message), message


def test_torchao_fp8_names_torchao_when_it_is_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.quantization", None)  # makes the import raise ImportError
    with pytest.raises(RuntimeError, match=r"^backend torchao-fp8 needs torchao \(pip install torchao\)"):
        make_quantized_copy(Net(), QuantConfig(backend="torchao-fp8", **NET_CONFIG))


# --- LoRA: the copy follows the policy ----------------------------------------------------------


def randomise_lora(model: nn.Module, std: float) -> None:
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.normal_(0, std)


@pytest.mark.parametrize("backend", ["nvfp4-emulated", "fp8-emulated", "fp8-emulated-tensor"])
def test_peft_lora_is_merged_and_refresh_follows_the_policy(backend):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(6)
    policy = get_peft_model(Net(), LoraConfig(r=4, lora_alpha=4, target_modules=["up", "down"]))
    randomise_lora(policy, 0.2)
    config = QuantConfig(backend=backend, **NET_CONFIG)
    assert quantized_layer_names(policy, config) == ["up", "down"]
    base_before = {k: v.clone() for k, v in policy.state_dict().items()}
    quantized = make_quantized_copy(policy, config)
    assert all(torch.equal(v, base_before[k]) for k, v in policy.state_dict().items())
    merged = copy.deepcopy(policy).merge_and_unload()
    assert torch.equal(quantized.up.weight, FAKE_QUANTIZE[backend](merged.up.weight))
    assert torch.equal(quantized.out.weight, merged.out.weight) and type(quantized.out) is nn.Linear

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
    config = QuantConfig("mxfp4-emulated", SD3_SKIPS)
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
