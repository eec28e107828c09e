"""fh.AdamW / fh.SGD(stochastic_rounding=True): bf16 parameter stores rounded stochastically (torchao's
bf16_stochastic_round): each value one of the two bf16 neighbours of the fp32 result, rounded away from zero with
probability the dropped fraction (so unbiased), seeded, everything else as with rounding to nearest; the refusals."""

import math

import pytest
import torch

import fusedhooks as fh


def neighbours(exact: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(towards zero, away from zero): the bf16 values around each fp32 `exact`, as float32."""
    bits = exact.view(torch.int32)
    down = (bits & ~0xFFFF).view(torch.float32)
    up = ((bits & ~0xFFFF) + 0x10000).view(torch.float32)
    return down, up


@pytest.mark.parametrize("start, grad", [(1.0, 2.0 ** -10), (-1.0, -2.0 ** -10), (3.0, 0.001), (-0.3, 1e-4),
                                         (1.0, 3 * 2.0 ** -10)],
                         ids=["quarter-ulp", "negative", "three", "small", "three-quarters"])
def test_each_store_is_a_neighbour_drawn_with_the_fraction_as_probability(start, grad):
    """SGD(lr=1) of n equal bf16 values by one gradient: the fp32 result's two bf16 neighbours only, the one away from
    zero in a share within 5 standard deviations of the dropped fraction (the rounding is unbiased)."""
    n = 40_000
    p = torch.nn.Parameter(torch.full((n,), start, dtype=torch.bfloat16))
    p.grad = torch.full((n,), grad, dtype=torch.bfloat16)
    exact = (p.detach().float() - p.grad.float())[:1]
    fh.SGD([p], lr=1.0, stochastic_rounding=True, seed=3).step()
    down, up = neighbours(exact)
    values = p.detach().float()
    assert ((values == down) | (values == up)).all()
    fraction = ((exact - down) / (up - down)).item()
    assert 0 < fraction < 1
    share = (values == up).double().mean().item()
    assert abs(share - fraction) <= 5 * math.sqrt(fraction * (1 - fraction) / n), (share, fraction)


def test_seeded_reproducible_and_a_new_draw_each_step():
    """The same seed gives the same parameters bit for bit; another seed other ones; two steps of one optimizer
    draw differently (the same update from the same values rounds otherwise)."""
    def run(seed, steps=1):
        p = torch.nn.Parameter(torch.full((4099,), 1.0, dtype=torch.bfloat16))
        opt = fh.AdamW([p], lr=1e-3, stochastic_rounding=True, seed=seed)
        out = []
        for _ in range(steps):
            p.grad = torch.full_like(p, 0.5)
            opt.step()
            out.append(p.detach().clone())
        return out

    assert torch.equal(run(5)[0], run(5)[0])
    assert not torch.equal(run(5)[0], run(6)[0])
    first, second = run(5, steps=2)
    assert not torch.equal(first != first[0], second != second[0])  # which elements rounded up differs


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_only_the_parameter_store_changes(name):
    """One step from the same values: the states equal those of rounding to nearest bit for bit, and each parameter
    is the nearest's value or its bf16 neighbour; an fp32 parameter in the same optimizer is not affected."""
    gen = torch.Generator().manual_seed(0)
    values = [torch.randn(s, generator=gen) for s in (1, 37, 40_009)]
    grads = [torch.randn(v.shape, generator=gen) for v in values]
    make = {"adamw": lambda ps, **kw: fh.AdamW(ps, lr=1e-2, weight_decay=0.1, **kw),
            "sgd": lambda ps, **kw: fh.SGD(ps, lr=1e-2, momentum=0.9, **kw)}[name]
    sides = []
    for stochastic in (False, True):
        params = [torch.nn.Parameter(v.to(torch.bfloat16)) for v in values] + [torch.nn.Parameter(values[2].clone())]
        for p, g in zip(params, grads + grads[2:]):
            p.grad = g.to(p.dtype)
        opt = make(params, stochastic_rounding=stochastic)
        opt.step()
        sides.append((params, opt))
    (nearest, nopt), (stochastic, sopt) = sides
    for p, q in zip(stochastic, nearest):
        if p.dtype == torch.float32:
            assert torch.equal(p, q)
            continue
        spacing = torch.finfo(torch.bfloat16).eps * torch.maximum(p.detach().float().abs(), q.detach().float().abs())
        assert ((p.float() - q.float()).abs() <= spacing).all()
        for key, value in nopt.state[q].items():
            assert torch.equal(sopt.state[p][key], value), key


def test_non_finite_values_stay():
    p = torch.nn.Parameter(torch.tensor([1.0, 2.0, math.inf, -1.0], dtype=torch.bfloat16))
    p.grad = torch.tensor([math.nan, 0.0, 0.0, -math.inf], dtype=torch.bfloat16)
    fh.SGD([p], lr=1.0, stochastic_rounding=True).step()
    assert p[0].isnan() and p[1] == 2.0 and p[2] == math.inf and p[3] == math.inf  # as torch's SGD gives them


def test_refusals(monkeypatch):
    with pytest.raises(ValueError, match="float16"):
        fh.AdamW([torch.nn.Parameter(torch.ones(3, dtype=torch.float16))], stochastic_rounding=True)
    with pytest.raises(ValueError, match="seed"):
        fh.SGD([torch.nn.Parameter(torch.ones(3))], lr=0.1, seed=-1)
    p = torch.nn.Parameter(torch.ones(4, 3, dtype=torch.bfloat16).t())  # not contiguous: torch's step would take it
    p.grad = torch.ones_like(p)
    with pytest.raises(RuntimeError, match="rounded to nearest"):
        fh.AdamW([p], stochastic_rounding=True).step()
    monkeypatch.setenv("FUSEDHOOKS_BACKEND", "eager")  # CPU without the interpreter: torch's step for everything
    q = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    q.grad = torch.ones_like(q)
    with pytest.raises(RuntimeError, match="rounded to nearest"):
        fh.SGD([q], lr=0.1, stochastic_rounding=True).step()
