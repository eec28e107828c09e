"""Whole-tensor reductions inside hook bodies: every form against eager torch, plans and launches."""

import pytest
import torch

import fusedhooks as fh

from helpers import FLOAT_DTYPES, REDUCTION_RTOL, assert_close_to, assert_same_bits, assert_same_values, count_launches
from test_ops import eager_expected, fire, special_values


def normalize(grad):
    return grad / (grad.norm() + 1e-6)


def clip_by_own_norm(grad):
    return grad * torch.clamp(1.0 / (grad.norm() + 1e-6), max=1.0)


def standardize(grad):
    return (grad - grad.mean()) / (grad.std() + 1e-6)


def finite_guard(grad):
    return torch.where(torch.isfinite(grad).all(), grad, 0.0)


def nan_guard_any(grad):
    return torch.where(torch.isnan(grad).any(), torch.zeros_like(grad), grad)


def l1_normalize(grad):
    return grad / (torch.linalg.vector_norm(grad, 1) + 1)


def linf_normalize(grad):
    return grad / torch.linalg.vector_norm(grad, float("inf"))


def min_max_scale(grad):
    return (grad - grad.amin()) / (grad.amax() - grad.amin())


def abs_max_scale(grad):
    return grad / grad.abs().max()


def sum_var_mix(grad):
    return grad * 0.5 + grad.sum() * 1e-3 - grad.var(correction=0) * 1e-3 + grad.min() * 0 + grad.max() * 0


def two_levels(grad):
    return grad / ((grad - grad.mean()).abs().max() + 1)


def lars_like(grad, param):
    return grad * (param.norm() / (grad.norm() + 1e-6))


def inplace_with_reduction(grad):
    grad.div_(grad.norm() + 1e-6)
    grad.clamp_(-0.1, 0.1)


BODIES = {
    "normalize": normalize, "clip_by_own_norm": clip_by_own_norm, "standardize": standardize,
    "finite_guard": finite_guard, "nan_guard_any": nan_guard_any, "l1_normalize": l1_normalize,
    "linf_normalize": linf_normalize, "min_max_scale": min_max_scale, "abs_max_scale": abs_max_scale,
    "sum_var_mix": sum_var_mix, "two_levels": two_levels, "lars_like": lars_like,
    "inplace_with_reduction": inplace_with_reduction,
}
EXACT = {"finite_guard", "nan_guard_any", "min_max_scale", "abs_max_scale", "linf_normalize"}


@pytest.mark.parametrize("programs", ["one", "several"])
@pytest.mark.parametrize("n", [1, 97, 1000])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("name", list(BODIES))
def test_reduction_body_matches_eager(name, dtype, n, programs, backend, monkeypatch):
    if programs == "several":
        monkeypatch.setenv("FUSEDHOOKS_BLOCK", "64")
    fn = BODIES[name]
    grad = (torch.randn(n, generator=torch.Generator().manual_seed(n)) + 0.3).to(dtype)
    param = torch.randn(n, generator=torch.Generator().manual_seed(1)).to(dtype)
    expected = eager_expected(fn, grad, param)
    fire(fh.grad_hook(fn, backend=backend), grad, param)
    if name in EXACT:
        assert_same_values(grad, expected)
    else:
        assert_close_to(grad, expected, REDUCTION_RTOL[dtype])


@pytest.mark.parametrize("programs", ["one", "several"])
@pytest.mark.parametrize("name", ["normalize", "finite_guard", "nan_guard_any", "standardize", "min_max_scale"])
def test_reduction_body_with_nan_inf(name, programs, backend, monkeypatch):
    """NaN/Inf propagate through the reductions as in torch (a NaN norm makes every element NaN)."""
    if programs == "several":
        monkeypatch.setenv("FUSEDHOOKS_BLOCK", "64")
    for dtype in (torch.float32, torch.bfloat16):
        grad = special_values(500, dtype)
        expected = eager_expected(BODIES[name], grad, grad)
        fire(fh.grad_hook(BODIES[name], backend=backend), grad)
        assert_close_to(grad, expected, REDUCTION_RTOL[dtype])


def test_plan_two_passes_for_large_one_launch_for_small():
    hook = fh.grad_hook(lambda grad: grad / grad.norm(), stats=("norm",))
    large = hook.plan(numel=1 << 24, dtype=torch.bfloat16)
    assert (large.passes, large.launches, large.writes) == (2, 2, 1)
    small = hook.plan(numel=1000)
    assert (small.passes, small.launches) == (1, 1)
    assert "one program" in str(small) and "reduction pass" in str(large)
    two = fh.grad_hook(two_levels).plan(numel=1 << 24)
    assert two.passes == 3


def test_launches_follow_the_plan(monkeypatch):
    monkeypatch.setenv("FUSEDHOOKS_BLOCK", "128")
    hook = fh.grad_hook(normalize, stats="all", backend="triton")
    launches = count_launches(monkeypatch)
    fire(hook, torch.randn(1000))
    assert launches == [("reduce_level1", (8,)), ("fused_hook", (8,))]
    launches.clear()
    fire(hook, torch.randn(100))
    assert launches == [("fused_hook_single", (1,))]


def test_reductions_of_param_and_grad_share_passes():
    g = fh.grad_hook(lars_like).graph(torch.float32)
    assert sorted(g.depth(n) for n in g.reductions()) == [1, 1]


def test_repeated_launches_reuse_the_workspace(backend, monkeypatch):
    monkeypatch.setenv("FUSEDHOOKS_BLOCK", "64")
    hook = fh.grad_hook(standardize, stats=("mean", "std"), backend=backend)
    for seed in range(3):
        grad = torch.randn(333, generator=torch.Generator().manual_seed(seed)) * (seed + 1)
        expected = eager_expected(standardize, grad, grad)
        fire(hook, grad)
        assert_close_to(grad, expected, 1e-5)
        got = hook.stats.read()["param0"]
        assert abs(got["mean"]) < 1e-5 and abs(got["std"] - 1) < 1e-5


@pytest.mark.parametrize("body, message", [
    (lambda grad: grad / torch.linalg.vector_norm(grad, 3), "order 3"),
    (lambda grad: grad * grad.max(dim=0).indices, "indices of max"),
    (lambda grad: grad / grad.norm(p=3, dim=0), "order 3"),
])
def test_unsupported_reductions_are_refused(body, message):
    with pytest.raises(fh.CompileError, match=message):
        fh.grad_hook(body)


def centre(grad, reduce=torch.mean):
    return grad - reduce(grad)


def replace_by_std(grad, reduce=torch.std):
    return grad * 0 + reduce(grad)


def replace_by_norm(grad, reduce=torch.norm):
    return grad * 0 + reduce(grad)


def exactly(reduction):
    """`reduction` of the float64 values, rounded once to the input's dtype (what the kernels compute)."""
    return lambda x: reduction(x.double()).to(x.dtype)


def near_max(fi):
    return [fi.max] * 200 + [fi.max / 2] * 3


def alternating_huge(fi):
    return [fi.max * (0.5 + i / 600) * (-1) ** i for i in range(300)]


def subnormals(fi):
    return [fi.smallest_normal / 8] * 150


@pytest.mark.parametrize("fn, reduction, values, dtype", [
    pytest.param(centre, torch.mean, near_max, torch.float32, id="centre_near_max-float32"),
    pytest.param(centre, torch.mean, near_max, torch.bfloat16, id="centre_near_max-bfloat16"),
    pytest.param(replace_by_std, torch.std, alternating_huge, torch.float32, id="std_of_huge-float32"),
    pytest.param(replace_by_norm, torch.norm, subnormals, torch.float32, id="norm_of_subnormals-float32"),
    pytest.param(replace_by_norm, torch.norm, subnormals, torch.bfloat16, id="norm_of_subnormals-bfloat16"),
])
def test_reductions_beyond_float32_accumulators(fn, reduction, values, dtype, backend, monkeypatch):
    """Where torch's float32 accumulator overflows (Inf/NaN) or underflows (0), the kernels' reductions are the true
    value rounded once to the dtype (docs/reductions.md); the eager and reference backends run torch's."""
    monkeypatch.setenv("FUSEDHOOKS_BLOCK", "128")
    grad = torch.tensor(values(torch.finfo(dtype)), dtype=dtype)
    torch_result = eager_expected(lambda g: fn(g), grad, grad)
    exact = eager_expected(lambda g: fn(g, exactly(reduction)), grad, grad)
    assert torch.isfinite(exact).all() and not torch.equal(torch_result, exact)  # torch's accumulator shows here
    fire(fh.grad_hook(lambda g: fn(g), backend=backend), grad)
    assert_close_to(grad, exact if backend == "triton" else torch_result, REDUCTION_RTOL[dtype])


@pytest.mark.parametrize("programs", ["one", "several"])
@pytest.mark.parametrize("body", [lambda g: g * 0 + g.max(), lambda g: g * 0 + g.amin(), lambda g: g / g.abs().amax()],
                         ids=["max", "amin", "abs_amax"])
def test_extrema_of_signed_zeros(body, programs, backend, monkeypatch):
    """All -0.0: every extremum is -0.0, bit for bit, as torch's; +0.0 and -0.0 mixed: a zero of either sign (torch's
    own sign depends on where the zeros lie, docs/reductions.md)."""
    if programs == "several":
        monkeypatch.setenv("FUSEDHOOKS_BLOCK", "16")
    for dtype in (torch.float32, torch.bfloat16):
        grad = torch.full((37,), -0.0, dtype=dtype)
        expected = eager_expected(body, grad, grad)
        fire(fh.grad_hook(body, backend=backend), grad)
        assert_same_bits(grad, expected)
        mixed = torch.tensor([0.0, -0.0] * 20, dtype=dtype)
        expected = eager_expected(body, mixed, mixed)
        fire(fh.grad_hook(body, backend=backend), mixed)
        assert_same_values(mixed, expected)


@pytest.mark.parametrize("body", [
    lambda g: g / (torch.norm(g) + 1e-6),
    lambda g: g / (torch.norm(g, 1) + 1),
    lambda g: g / torch.norm(g, p=float("inf")),
    lambda g: g / (torch.norm(g, dim=1, keepdim=True) + 1e-6),
], ids=["fro", "p1", "pinf", "dim1"])
def test_torch_norm_function_form_compiles(body, backend):
    """torch.norm(g) (a Python function of torch/functional.py) hands its out=None and dtype=None on to the traced
    tensor: they were refused as unexpected keywords, while g.norm() compiled."""
    grad = torch.randn(6, 7, generator=torch.Generator().manual_seed(0))
    expected = eager_expected(body, grad, grad)
    fire(fh.grad_hook(body, backend=backend), grad)
    assert_close_to(grad, expected, REDUCTION_RTOL[torch.float32])
