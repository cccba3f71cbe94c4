"""Tests for branchdiff/schedulers/flow.py against independent float64 references built from the papers' formulas (DanceGRPO, Flow-GRPO).

The references below are written from the papers' formulas, not from the module's helpers:

  Δ = σ' - σ,  x̂0 = x - σ·v
  ode   : μ = x + Δ·v,                                   std = 0
  dance : ŝ = -(x - (1-σ)·x̂0)/σ²,  μ = x + Δ·v - ½η²·ŝ·Δ,  std = η·√(σ - σ')
  flow  : s_t = a·√(σ/(1-σ)) (σ_1 in the denominator when σ = 1),
          μ = x·(1 + s_t²·Δ/(2σ)) + v·(1 + s_t²·(1-σ)/(2σ))·Δ,  std = s_t·√(-Δ)
  cps   : std = σ'·sin(aπ/2),  x̂1 = x + (1-σ)·v,  μ = x̂0·(1-σ') + x̂1·√(σ'² - std²)

Everything is tiny (a few hundred elements, one 20000×3 moment check) so the file runs in ~1 s.
"""

from __future__ import annotations

import math

import pytest
import torch

from branchdiff.schedulers.flow import STEP_KINDS, StepOutput, gaussian_log_prob, sigma_schedule, step

torch.set_num_threads(1)

SHAPE = (3, 2, 4, 4)  # (B, C, H, W): small latent-like tensors


def f32(value: float) -> float:
    """The float32-rounded value as a Python float (the module computes in float32)."""
    return float(torch.tensor(value, dtype=torch.float32))


def make_inputs(seed: int = 0, shape=SHAPE):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    v = torch.randn(shape, generator=g)
    noise = torch.randn(shape, generator=g)
    return x, v, noise


# ---------------------------------------------------------------------------------------------
# float64 reference from the papers' formulas (scalars are Python floats, tensors float64)
# ---------------------------------------------------------------------------------------------
def ref_step(kind, x, v, sigma, sigma_next, a, sigma_1=None):
    x, v = x.double(), v.double()
    s, sn = f32(sigma), f32(sigma_next)
    delta = sn - s
    if kind == "ode":
        return x + delta * v, 0.0
    if kind == "dance":
        x0 = x - s * v
        score = -(x - (1 - s) * x0) / s**2
        mean = x + delta * v - 0.5 * a**2 * score * delta
        return mean, a * math.sqrt(s - sn)
    if kind == "flow":
        denom_sigma = f32(sigma_1) if s == 1.0 else s
        st = a * math.sqrt(s / (1 - denom_sigma))  # numerator keeps σ; only the denominator uses σ_1
        mean = x * (1 + st**2 * delta / (2 * s)) + v * (1 + st**2 * (1 - s) / (2 * s)) * delta
        return mean, st * math.sqrt(-delta)
    if kind == "cps":
        std = sn * math.sin(a * math.pi / 2)
        x0 = x - s * v
        x1 = x + (1 - s) * v
        mean = x0 * (1 - sn) + x1 * math.sqrt(max(sn**2 - std**2, 0.0))
        return mean, std
    raise AssertionError(kind)


def ref_shift(t: float, s: float) -> float:
    return s * t / (1 + (s - 1) * t)


SIGMA_1 = ref_shift(0.9, 3.0)  # σ_1 of a T = 10, shift 3 schedule (≈ 0.9643)

# (kind, σ, σ', noise level, sigma_for_noise_level)
GRID = []
for _kind, _levels in (("ode", (0.0,)), ("dance", (0.3, 1.0)), ("flow", (0.7, 0.3)), ("cps", (0.8, 0.5, 1.0))):
    for _a in _levels:
        for _s, _sn in ((0.9, 0.8), (0.5, 0.45), (0.2, 0.1), (0.05, 0.0)):  # includes the last step σ' = 0
            GRID.append((_kind, _s, _sn, _a, None))
        # first step σ = 1 (flow needs σ_1 for its noise level)
        GRID.append((_kind, 1.0, SIGMA_1, _a, SIGMA_1 if _kind == "flow" else None))
# flow at σ = 1 on a strongly shifted schedule too
GRID.append(("flow", 1.0, ref_shift(0.95, 5.0), 0.7, ref_shift(0.95, 5.0)))


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float):
    """|actual - expected| <= atol + rtol·|expected| elementwise (a light stand-in for
    torch.testing.assert_close, whose first call costs ~1 s of imports on this machine)."""
    actual, expected = actual.double(), expected.double()
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    err = (actual - expected).abs()
    bound = atol + rtol * expected.abs()
    assert torch.isfinite(actual).all(), "non-finite values"
    assert bool((err <= bound).all()), f"max abs err {float(err.max()):.3e}, max err/bound {float((err / bound).max()):.3g}"


def assert_close_rel(actual: torch.Tensor, expected: torch.Tensor, rtol: float = 1e-5):
    """Relative closeness: elementwise rtol, with an absolute floor of rtol·max|expected| for
    elements that happen to be near zero."""
    atol = rtol * max(float(expected.double().abs().max()), 1e-12)
    assert_close(actual, expected, rtol=rtol, atol=atol)


# ---------------------------------------------------------------------------------------------
# 1. mean and std against the float64 reference
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind,sigma,sigma_next,level,sigma_1", GRID)
def test_step_mean_std_match_float64_reference(kind, sigma, sigma_next, level, sigma_1):
    x, v, noise = make_inputs()
    out = step(kind, x, v, sigma, sigma_next, noise, level, sigma_for_noise_level=sigma_1)
    ref_mean, ref_std = ref_step(kind, x, v, sigma, sigma_next, level, sigma_1)

    assert isinstance(out, StepOutput)
    assert out.mean.dtype == out.sample.dtype == out.std.dtype == torch.float32
    assert out.mean.shape == out.sample.shape == x.shape
    assert out.std.shape == (x.shape[0],)
    assert torch.isfinite(out.mean).all() and torch.isfinite(out.std).all()

    assert_close_rel(out.mean, ref_mean)
    assert_close_rel(out.std, torch.full((x.shape[0],), ref_std, dtype=torch.float64))
    # sample = mean + std·noise
    expected_sample = ref_mean + ref_std * noise.double()
    assert_close_rel(out.sample, expected_sample)


@pytest.mark.parametrize("kind,level", [("dance", 0.3), ("flow", 0.7), ("cps", 0.8), ("ode", 0.0)])
def test_step_per_sample_sigmas(kind, level):
    """(B,) sigma tensors: each sample uses its own (σ, σ'), including σ = 1 and σ' = 0."""
    x, v, noise = make_inputs(1)
    sig = torch.tensor([1.0, 0.5, 0.05], dtype=torch.float64)
    sig_next = torch.tensor([SIGMA_1, 0.4, 0.0], dtype=torch.float64)
    out = step(kind, x, v, sig, sig_next, noise, level, sigma_for_noise_level=SIGMA_1)
    for b in range(x.shape[0]):
        ref_mean, ref_std = ref_step(kind, x[b : b + 1], v[b : b + 1], float(sig[b]), float(sig_next[b]), level, SIGMA_1)
        assert_close_rel(out.mean[b : b + 1], ref_mean)
        assert abs(float(out.std[b]) - ref_std) <= 1e-5 * max(ref_std, 1e-12)


def test_step_other_input_dtypes_compute_in_float32():
    x, v, noise = make_inputs(2)
    ref = step("flow", x, v, 0.6, 0.5, noise, 0.7)
    out = step("flow", x.double(), v.double(), 0.6, 0.5, noise.double(), 0.7)
    assert out.sample.dtype == torch.float32
    assert_close(out.mean, ref.mean, rtol=1e-6, atol=1e-6)
    out_bf16 = step("dance", x.bfloat16(), v.bfloat16(), 0.6, 0.5, noise.bfloat16(), 0.3)
    assert out_bf16.mean.dtype == torch.float32


# ---------------------------------------------------------------------------------------------
# 2. gaussian_log_prob
# ---------------------------------------------------------------------------------------------
def test_gaussian_log_prob_matches_float64_and_torch_normal():
    g = torch.Generator().manual_seed(3)
    mean = torch.randn(SHAPE, generator=g)
    std = torch.tensor([0.05, 0.7, 2.5])
    sample = mean + std.view(-1, 1, 1, 1) * torch.randn(SHAPE, generator=g) * 1.3
    got = gaussian_log_prob(sample, mean, std)
    assert got.shape == (SHAPE[0],) and got.dtype == torch.float32

    # float64 by hand: mean over all non-batch dimensions (not sum)
    s64, m64, sd64 = sample.double(), mean.double(), std.double().view(-1, 1, 1, 1)
    dens = -((s64 - m64) ** 2) / (2 * sd64**2) - torch.log(sd64) - 0.5 * math.log(2 * math.pi)
    ref = dens.reshape(SHAPE[0], -1).mean(dim=1)
    assert_close_rel(got, ref)

    # second, independent reference: torch.distributions.Normal
    normal = torch.distributions.Normal(m64, sd64.expand_as(m64))
    ref2 = normal.log_prob(s64).reshape(SHAPE[0], -1).mean(dim=1)
    assert_close_rel(got, ref2)


def test_gaussian_log_prob_of_step_sample():
    """log-prob of x' = μ + std·ε is mean(-ε²/2) - log std - ½log2π."""
    x, v, noise = make_inputs(4)
    out = step("flow", x, v, 0.7, 0.6, noise, 0.7)
    got = gaussian_log_prob(out.sample, out.mean, out.std)
    ref = (-0.5 * noise.double() ** 2).reshape(SHAPE[0], -1).mean(1) - torch.log(out.std.double()) - 0.5 * math.log(2 * math.pi)
    assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# 3. sampling moments
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kind,sigma,sigma_next,level,sigma_1",
    [("dance", 0.6, 0.5, 0.3, None), ("flow", 0.6, 0.5, 0.7, None), ("flow", 1.0, SIGMA_1, 0.7, SIGMA_1), ("cps", 0.6, 0.5, 0.8, None)],
)
def test_sampling_moments(kind, sigma, sigma_next, level, sigma_1):
    n, d = 20000, 3
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, d, generator=g).expand(n, d)
    v = torch.randn(1, d, generator=g).expand(n, d)
    noise = torch.randn(n, d, generator=g)
    out = step(kind, x, v, sigma, sigma_next, noise, level, sigma_for_noise_level=sigma_1)
    mean, std = out.mean[0].double(), float(out.std[0])
    assert torch.all(out.std == out.std[0])
    samples = out.sample.double()
    se_mean = std / math.sqrt(n)
    se_std = std / math.sqrt(2 * (n - 1))
    assert (samples.mean(0) - mean).abs().max() < 5 * se_mean
    assert (samples.std(0) - std).abs().max() < 5 * se_std


# ---------------------------------------------------------------------------------------------
# 4. ratio exactly 1 on re-evaluation
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind,level,sigma_1", [("dance", 0.3, None), ("flow", 0.7, SIGMA_1), ("cps", 0.8, None)])
def test_recomputed_log_prob_is_bitwise_identical(kind, level, sigma_1):
    x, v, noise = make_inputs(6)
    sig = torch.tensor([1.0, 0.5, 0.2])
    sig_next = torch.tensor([SIGMA_1, 0.4, 0.1])
    first = step(kind, x, v, sig, sig_next, noise, level, sigma_for_noise_level=sigma_1)
    logp_old = gaussian_log_prob(first.sample, first.mean, first.std)
    assert torch.isfinite(logp_old).all()

    # training recomputes mean/std from the stored x (noise is irrelevant for mean/std)
    again = step(kind, x.clone(), v.clone(), sig.clone(), sig_next.clone(), torch.zeros_like(noise), level, sigma_for_noise_level=sigma_1)
    logp_new = gaussian_log_prob(first.sample, again.mean, again.std)
    assert torch.equal(logp_new, logp_old)
    assert torch.equal(torch.exp(logp_new - logp_old), torch.ones_like(logp_old))

    # recomputation at a different batch size (one sample at a time) gives the same bits too
    for b in range(x.shape[0]):
        one = step(kind, x[b : b + 1], v[b : b + 1], sig[b : b + 1], sig_next[b : b + 1], noise[b : b + 1], level, sigma_for_noise_level=sigma_1)
        assert torch.equal(gaussian_log_prob(first.sample[b : b + 1], one.mean, one.std), logp_old[b : b + 1])


# ---------------------------------------------------------------------------------------------
# 5. noise -> 0 limits give the ODE step
# ---------------------------------------------------------------------------------------------
def test_cps_zero_noise_mean_is_ode_step_algebraically():
    """With std = 0 (a = 0) the cps mean is the Euler/ODE step:
        x̂0·(1-σ') + x̂1·√(σ'² - 0) = (x - σv)(1 - σ') + (x + (1-σ)v)·σ'
                                   = x - xσ' - σv + σσ'v + xσ' + σ'v - σσ'v = x + (σ' - σ)·v.
    The difference of both sides is a polynomial of degree <= 1 in each of x, v, σ, σ'; such a
    polynomial that vanishes on every point of {0,1}^4 is identically zero, so the exact rational
    check below (with extra points for good measure) is a proof, not a sample."""
    from fractions import Fraction
    from itertools import product

    points = [Fraction(0), Fraction(1), Fraction(-3, 7), Fraction(5, 2)]
    for x, v, s, sn in product(points, repeat=4):
        cps_mean = (x - s * v) * (1 - sn) + (x + (1 - s) * v) * sn
        assert cps_mean == x + (sn - s) * v


@pytest.mark.parametrize("sigma,sigma_next", [(0.9, 0.8), (0.3, 0.2), (0.05, 0.0), (1.0, SIGMA_1)])
def test_zero_noise_limits_equal_ode(sigma, sigma_next):
    x, v, noise = make_inputs(7)
    ode = step("ode", x, v, sigma, sigma_next, None, 0.0)
    assert torch.equal(ode.std, torch.zeros(x.shape[0]))
    assert torch.equal(ode.sample, ode.mean)
    ode_ref, _ = ref_step("ode", x, v, sigma, sigma_next, 0.0)
    assert_close_rel(ode.mean, ode_ref)

    s1 = SIGMA_1 if sigma == 1.0 else None
    for kind in ("dance", "flow", "cps"):
        exact = step(kind, x, v, sigma, sigma_next, noise, 0.0, sigma_for_noise_level=s1)
        assert torch.equal(exact.std, torch.zeros(x.shape[0])), kind
        assert_close(exact.mean, ode.mean, rtol=1e-5, atol=1e-6)
        assert_close(exact.sample, ode.mean, rtol=1e-5, atol=1e-6)
        # small but non-zero noise level: the mean approaches the ODE mean (O(level²) for dance/flow)
        near = step(kind, x, v, sigma, sigma_next, noise, 1e-3, sigma_for_noise_level=s1)
        assert (near.mean - ode.mean).abs().max() < 1e-3, kind
        assert float(near.std.max()) < 1e-2, kind


# ---------------------------------------------------------------------------------------------
# 6. sigma schedule
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_steps,shift", [(1, 1.0), (10, 1.0), (10, 3.0), (20, 3.0), (16, 0.5)])
def test_sigma_schedule(num_steps, shift):
    sig = sigma_schedule(num_steps, shift)
    assert sig.shape == (num_steps + 1,)
    assert sig.dtype == torch.float32
    assert float(sig[0]) == 1.0 and float(sig[-1]) == 0.0
    assert torch.all(sig[1:] < sig[:-1])
    ref = torch.tensor([ref_shift(1 - i / num_steps, shift) for i in range(num_steps + 1)], dtype=torch.float64)
    assert_close(sig.double(), ref, rtol=1e-6, atol=1e-7)
    if shift == 1.0:
        assert_close(sig, torch.linspace(1, 0, num_steps + 1), rtol=0, atol=1e-7)


def test_sigma_schedule_shift_pushes_sigmas_up():
    assert torch.all(sigma_schedule(10, 3.0)[1:-1] > sigma_schedule(10, 1.0)[1:-1])


# ---------------------------------------------------------------------------------------------
# 7. golden numbers (regression pins; computed once from the formulas above)
# ---------------------------------------------------------------------------------------------
GOLDEN = {
    # (kind, σ, σ', level, σ_1): (sample.sum(), std[0]); inputs: torch.manual_seed(0), randn(2,4,8,8)
    # for x, v, noise in that order. Values from the float64 reference. Note the flow first step:
    # s_t = a·√(1/(1-σ_1)) so std = s_t·√(1-σ_1) = a exactly.
    ("ode", 0.7, 0.6, 0.0, None): (31.885301, 0.0),
    ("dance", 0.7, 0.6, 0.3, None): (34.738391, 0.0948683),
    ("flow", 0.7, 0.6, 0.7, None): (40.158476, 0.3381321),
    ("flow", 1.0, SIGMA_1, 0.7, SIGMA_1): (46.694058, 0.7),
    ("cps", 0.7, 0.6, 0.8, None): (36.916328, 0.5706339),
}


def golden_inputs():
    torch.manual_seed(0)
    x = torch.randn(2, 4, 8, 8)
    v = torch.randn(2, 4, 8, 8)
    noise = torch.randn(2, 4, 8, 8)
    return x, v, noise


@pytest.mark.parametrize("key", list(GOLDEN))
def test_golden_sample_sums(key):
    kind, sigma, sigma_next, level, sigma_1 = key
    x, v, noise = golden_inputs()
    out = step(kind, x, v, sigma, sigma_next, None if kind == "ode" else noise, level, sigma_for_noise_level=sigma_1)
    expected_sum, expected_std = GOLDEN[key]
    assert abs(float(out.sample.sum()) - expected_sum) < 1e-3
    assert abs(float(out.std[0]) - expected_std) < 1e-6


# ---------------------------------------------------------------------------------------------
# 8. errors
# ---------------------------------------------------------------------------------------------
def test_unknown_kind_raises():
    x, v, noise = make_inputs()
    with pytest.raises(ValueError):
        step("euler", x, v, 0.5, 0.4, noise, 0.3)
    assert set(STEP_KINDS) == {"ode", "dance", "flow", "cps"}


@pytest.mark.parametrize("kind", ["dance", "flow", "cps"])
def test_sde_without_noise_raises(kind):
    x, v, _ = make_inputs()
    with pytest.raises(ValueError):
        step(kind, x, v, 0.5, 0.4, None, 0.5)


def test_flow_first_step_without_sigma_1_raises():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="sigma_for_noise_level"):
        step("flow", x, x, 1.0, 0.9, torch.zeros_like(x), 0.7)


def test_predicted_x0_inverts_the_forward_process_of_both_kinds():
    """x = (1 − σ)·x0 + σ·ε with the velocity ε − x0 (flow), x = √ᾱ·x0 + √(1 − ᾱ)·ε with ε itself (DDIM): x̂0 = x0."""
    from branchdiff.schedulers.schedule import DDIMSchedule, FlowSchedule

    x0, eps, index = torch.randn(3, 4, 2), torch.randn(3, 4, 2), torch.tensor([0, 2, 4])
    flow = FlowSchedule.shifted(5, 3.0, 1000.0)
    sigma = flow.sigmas[index].reshape(-1, 1, 1)
    assert torch.allclose(flow.predicted_x0((1 - sigma) * x0 + sigma * eps, eps - x0, index), x0, atol=1e-5)
    alpha_bars = torch.linspace(0.05, 0.99, 6, dtype=torch.float64)
    ddim = DDIMSchedule(alpha_bars, torch.arange(5))
    a = alpha_bars[index].reshape(-1, 1, 1).float()
    assert torch.allclose(ddim.predicted_x0(a.sqrt() * x0 + (1 - a).sqrt() * eps, eps, index), x0, atol=1e-5)
