"""The "hist" statistic: counts of floor(log2|g|) in power-of-two bins, against torch.bucketize."""

import pytest
import torch

import fusedhooks as fh

from helpers import FLOAT_DTYPES
from test_ops import fire, special_values


def bucketize_reference(x: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Counts per bin with torch.bucketize of |x| against the edges 2**lo .. 2**hi (NaN dropped)."""
    x = x.double().reshape(-1)
    x = x[~torch.isnan(x)].abs()
    edges = 2.0 ** torch.arange(lo + 1, hi, dtype=torch.float64)   # inner edges: bin k is [2**(lo+k), 2**(lo+k+1))
    bins = torch.bucketize(x, edges, right=True)
    return torch.bincount(bins, minlength=hi - lo)


@pytest.mark.parametrize("programs", ["one", "several"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_hist_counts_equal_bucketize(dtype, programs, backend, monkeypatch):
    if programs == "several":
        monkeypatch.setenv("FUSEDHOOKS_BLOCK", "128")
    grad = special_values(3001, dtype)
    gen = torch.Generator().manual_seed(0)
    exponents = torch.randint(-45, 12, (400,), generator=gen).double()   # every bin, and past both ends
    grad[:400] = (torch.randn(400, generator=gen) * 2.0 ** exponents).to(dtype)
    grad[400:420] = 0.0
    before = grad.clone()
    hook = fh.grad_hook(lambda grad: grad * 0.5, stats=("hist", "nan"), input_stats=("hist",), backend=backend)
    fire(hook, grad)
    counts, edges = hook.stats.histogram("param0")
    lo, hi = fh.compiler.plan.DEFAULT_HIST_RANGE
    assert torch.equal(counts, bucketize_reference(grad, lo, hi))
    assert torch.equal(hook.stats.histogram("param0", input=True)[0], bucketize_reference(before, lo, hi))
    assert torch.equal(edges, 2.0 ** torch.arange(lo, hi + 1, dtype=torch.float64))
    finite_or_inf = int((~torch.isnan(grad)).sum())
    assert int(counts.sum()) == finite_or_inf                      # every non-NaN element in exactly one bin
    read = hook.stats.read()["param0"]
    assert read["hist"] == counts.tolist() and read["nan"] == grad.numel() - finite_or_inf


def test_hist_range_option(backend):
    grad = torch.tensor([0.0, 0.3, 1.0, 1.5, 2.0, 3.9, 4.0, 100.0, -float("inf"), float("nan")])
    hook = fh.grad_hook(stats="hist", hist_range=(-1, 2), backend=backend)
    fire(hook, grad)
    counts, edges = hook.stats.histogram("param0")
    assert edges.tolist() == [0.5, 1.0, 2.0, 4.0]
    # bin 0: 0, 0.3 (below 0.5: first bin); [1, 2): 1, 1.5; last: 2, 3.9, 4, 100, -inf
    assert counts.tolist() == [2, 2, 5]


def test_hist_repeated_firings_do_not_accumulate(backend, monkeypatch):
    monkeypatch.setenv("FUSEDHOOKS_BLOCK", "64")
    hook = fh.grad_hook(stats="hist", backend=backend)
    for _ in range(3):
        fire(hook, torch.ones(1000))
    counts, _ = hook.stats.histogram("param0")
    assert int(counts.sum()) == 1000


def test_hist_is_not_in_all_and_bad_options_are_refused():
    assert "hist" not in fh.grad_hook(stats="all").stats.slot_names
    with pytest.raises(ValueError, match="hist_range"):
        fh.grad_hook(stats="hist", hist_range=(4, 2))
    with pytest.raises(ValueError, match="hist_range"):
        fh.grad_hook(stats="hist", hist_range=(-200, 2))
    with pytest.raises(KeyError, match="hist"):
        fh.grad_hook(stats="norm").stats.histogram("param0")


@pytest.mark.parametrize("hist_range", [(0, 1, 2), (0,), 5, (0.0, 4.0), ("a", "b"), (True, 4)])
def test_malformed_hist_range_is_refused_by_name(hist_range):
    with pytest.raises(ValueError, match="hist_range"):
        fh.grad_hook(stats="hist", hist_range=hist_range)


def test_histogram_before_any_firing_is_refused(backend):
    hook = fh.grad_hook(stats="hist", backend=backend)
    t = torch.zeros(4, requires_grad=True)
    hook.register(t, name="w")
    with pytest.raises(KeyError, match="has not fired"):
        hook.stats.histogram("w")
    t.grad = torch.ones(4)
    hook(t)
    counts, _ = hook.stats.histogram("w")
    assert int(counts.sum()) == 4
    hook.stats.reset()
    with pytest.raises(KeyError, match="has not fired"):
        hook.stats.histogram("w")


@pytest.mark.parametrize("programs", ["one", "several"])
def test_a_bin_counts_past_2_to_the_31(programs, monkeypatch):
    """A bin of one gradient may hold 2**31 elements or more (the zero rows of a 262144 x 8192 embedding): the
    kernels' accumulators are int64. Made cheap by starting bin 0's accumulator just below 2**31 (the workspace
    buffer the kernels add into; they leave it zeroed)."""
    if programs == "several":
        monkeypatch.setenv("FUSEDHOOKS_BLOCK", "64")
    hook = fh.grad_hook(stats=("hist",), backend="triton")
    grad = torch.zeros(1000)
    grad[:10] = 1.0
    param = fire(hook, grad)  # sizes the workspace
    accumulators = hook.workspace(grad.device).buffer("hist", 1)
    assert accumulators.dtype == torch.int64 and not accumulators.any()
    accumulators[0] = 2**31 - 5
    hook(param)
    counts, _ = hook.stats.histogram("param0")
    assert counts[0].item() == 2**31 - 5 + 990 and int(counts.sum()) == 2**31 - 5 + 1000
    assert not accumulators.any()
