"""skew and kurtosis, the optional statistics (not in "all"): against a float64 reference, at odd sizes over several
programs, far from 0, with NaN/Inf, and merged from shards (docs/statistics.md)."""

import math

import pytest
import torch

import fusedhooks as fh
from fusedhooks import STAT_NAMES
from fusedhooks.runtime.reference import tensor_stats
from fusedhooks.stats.merge import merge_partials, partial_stats

from helpers import FLOAT_DTYPES
from test_ops import fire

MOMENTS = ("skew", "kurtosis")
SIZES = [2, 3, 97, 128, 129, 1021, 4099]


def moment_tolerance(x: torch.Tensor) -> float:
    """What the kernel's float32 deviations may cost skew and kurtosis (absolute): a deviation from a block's mean
    is within 2u (|mean| + |x - mean|) (u = 2**-24: the mean rounded to float32 once), so a standardised value z is
    within 2u (kappa + |z|), kappa = |mean| / std; skew = E z^3 then moves by at most 6u (kappa E|z|^3 + E z^4) and
    kurtosis = E z^4 - 3 by 8u (kappa E|z|^3 + E z^4); the float32 sums' own rounding adds 32u E z^4 at most (a value
    is added at most 32 times)."""
    x64 = x.double()
    mean, std = x64.mean(), x64.std(correction=0)
    z = (x64 - mean) / std
    kappa = (mean.abs() / std).item()
    u = 2.0 ** -24
    return 8 * u * (kappa * z.abs().pow(3).mean().item() + z.pow(4).mean().item()) + 32 * u * z.pow(4).mean().item()


def check_moments(got: dict, x: torch.Tensor, prefix: str = "") -> None:
    expected = dict(zip(MOMENTS, (v.item() for v in tensor_stats(x, MOMENTS))))
    tol = moment_tolerance(x)
    for name in MOMENTS:
        assert abs(got[prefix + name] - expected[name]) <= tol, (name, got[prefix + name], expected[name], tol)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_moments_match_float64_reference(n, dtype, backend, monkeypatch):
    """A skewed, heavy-tailed gradient (exp of normal values), before and after a body, over programs of 128
    elements (several programs' moments merged)."""
    monkeypatch.setenv("FUSEDHOOKS_BLOCK", "128")
    grad = torch.randn(n, generator=torch.Generator().manual_seed(n)).exp().to(dtype)
    before = grad.clone()
    hook = fh.grad_hook(lambda g: g * 2.0 - 1.0, stats=MOMENTS, input_stats=MOMENTS, backend=backend)
    fire(hook, grad)
    got = hook.stats.read()["param0"]
    assert set(got) == {*MOMENTS, *("input." + m for m in MOMENTS)}
    check_moments(got, grad)
    check_moments(got, before, prefix="input.")
    if n >= 97:  # right-skewed and heavy-tailed (two or three values are not): the test checks something
        assert got["skew"] > 0.5 and got["kurtosis"] > 0.5


def test_moments_far_from_zero(backend, monkeypatch):
    """|mean|/std = 1e3 over 200K elements and blocks of 1024: the deviations are taken from each block's mean and
    moved to the whole's in float64, within the derived bound."""
    monkeypatch.setenv("FUSEDHOOKS_BLOCK", "1024")
    x = torch.randn(200_003, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    grad = (1000.0 + (x - x.mean()) / x.std()).to(torch.float32)
    hook = fh.grad_hook(stats=MOMENTS, backend=backend)
    fire(hook, grad)
    check_moments(hook.stats.read()["param0"], grad)


@pytest.mark.parametrize("values", [[1.0], [3.0, 3.0, 3.0], [1.0, math.nan, 2.0], [1.0, math.inf, 2.0], []],
                         ids=["one", "constant", "nan", "inf", "empty"])
def test_moments_are_nan_where_undefined(values, backend):
    """One element, equal values (variance 0), a NaN or an Inf, no element: NaN, as the float64 reference."""
    grad = torch.tensor(values, dtype=torch.float32)
    hook = fh.grad_hook(stats=MOMENTS + ("count",), backend=backend)
    fire(hook, grad)
    got = hook.stats.read()["param0"]
    assert math.isnan(got["skew"]) and math.isnan(got["kurtosis"])
    assert all(math.isnan(v.item()) for v in tensor_stats(grad, MOMENTS))


def test_moments_are_named_not_in_all():
    """stats="all" is the 13 statistics; skew and kurtosis are recorded when named, after them in the row."""
    assert not set(MOMENTS) & set(fh.grad_hook(stats="all").stats.slot_names)
    hook = fh.grad_hook(stats=("kurtosis", "skew", "norm"))
    assert hook.stats.slot_names == ("norm", "skew", "kurtosis")
    assert set(fh.grad_hook(stats=["all", "skew"]).stats.slot_names) == {*STAT_NAMES, "skew"}
    with pytest.raises(ValueError, match="every one but skew, kurtosis and hist"):
        fh.grad_hook(stats=("skewness",))


def test_bucketed_moments_equal_each_firings(monkeypatch):
    """A bucket's kernel cuts each gradient into the same programs as a firing alone: the same bits."""
    torch.manual_seed(0)
    grads = [torch.randn(n).exp() for n in (300, 1, 4099, 77)]

    def run(bucket_mb):
        params = [torch.zeros(g.numel(), requires_grad=True) for g in grads]
        hook = fh.grad_hook(lambda g: g * 0.5, stats=MOMENTS + ("var",), backend="triton")
        for i, p in enumerate(params):
            hook.register(p, name=f"p{i}", bucket_mb=bucket_mb)
        sum((p * g).sum() for p, g in zip(params, grads)).backward()
        return hook.stats.read()

    bucketed, alone = run(25), run(0)
    assert bucketed.keys() == alone.keys()
    for name in alone:  # bit for bit, NaN (the one-element gradient) where NaN
        torch.testing.assert_close(dict(bucketed[name]), dict(alone[name]), rtol=0, atol=0, equal_nan=True)
    assert not math.isnan(alone["p0"]["skew"])


def test_shards_merge_into_the_whole_moments():
    """FSDP2: each shard records count, sum, var, skew and kurtosis; their merge gives the whole's skew and kurtosis
    (a shard of one element and a shard of equal values included; a NaN in a shard makes them NaN)."""
    torch.manual_seed(1)
    whole = torch.cat([torch.randn(500).exp(), torch.tensor([7.0]), torch.full((40,), 2.0), torch.randn(333) * 3])
    shards = [whole[:500], whole[500:501], whole[501:541], whole[541:]]
    slots = ("skew", "kurtosis")
    partial_slots = partial_stats(slots)
    assert partial_slots == ("count", "sum", "var", "skew", "kurtosis")
    parts = torch.stack([torch.stack(tensor_stats(s, partial_slots)) for s in shards])[:, None, :]
    merged = merge_partials(parts, partial_slots, slots)[0]
    expected = torch.stack(tensor_stats(whole, slots))
    torch.testing.assert_close(merged, expected, rtol=1e-10, atol=1e-12)
    with_nan = parts.clone()
    with_nan[1, 0, partial_slots.index("sum")] = math.nan
    assert merge_partials(with_nan, partial_slots, slots).isnan().all()


def test_moments_of_a_traced_firing_equal_eager():
    """Under compiled autograd the firing is traced (the plan as torch ops on CPU): the eager firing's moments, within
    the derived bound (the traced firing computes them in float64)."""
    from torch._dynamo import compiled_autograd

    def run(compiled):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
        hook = fh.grad_hook(lambda g: g * 0.5, stats=MOMENTS, backend="triton")
        hook.register(model)
        loss = model(torch.randn(32, 8, generator=torch.Generator().manual_seed(1))).square().sum()
        if compiled:
            with compiled_autograd._enable(torch.compile(backend="aot_eager")):
                loss.backward()
        else:
            loss.backward()
        return hook.stats.read(), {n: p.grad for n, p in model.named_parameters()}

    try:
        traced, _ = run(True)
        eager, grads = run(False)
    finally:
        torch._dynamo.reset()
    for name, grad in grads.items():
        check_moments(traced[name], grad)
        check_moments(eager[name], grad)
