"""fh.AdamW and fh.SGD against torch.optim: each step from the same parameters and states (the tolerance of one
step, from the arithmetic), trajectories over many steps, state_dict both ways, a schedule, the torch fallback and the
errors."""

import copy
import itertools
import math

import pytest
import torch

import fusedhooks as fh
from fusedhooks.runtime import launcher

from helpers import FLOAT_DTYPES

#: odd sizes: one element, a prime, a 2-D tensor, several programs of the interpreter's largest block (32768), empty
SHAPES = [(1,), (37,), (5, 7), (40_009,), (0,)]

ADAMW_GRID = [dict(zip(("amsgrad", "maximize", "weight_decay", "betas"), values)) for values in itertools.product(
    (False, True), (False, True), (0.0, 0.1), ((0.9, 0.999), (0.5, 0.9)))]
SGD_GRID = [dict(momentum=0.0), dict(momentum=0.9), dict(momentum=0.9, nesterov=True, weight_decay=0.1),
            dict(momentum=0.9, dampening=0.5, maximize=True), dict(momentum=0.5, weight_decay=0.01, maximize=True)]


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The unit in the last place of |x| in `dtype` (as float64), at least that of its smallest normal."""
    finfo = torch.finfo(dtype)
    return finfo.eps * torch.exp2(torch.floor(torch.log2(x.double().abs().clamp_min(finfo.tiny))))


def assert_within_ulps(actual: torch.Tensor, expected: torch.Tensor, reads: torch.Tensor, ulps: float, what: str):
    """|actual - expected| <= ulps units in the last place of the larger of |reads| (the magnitudes the step read
    and combined) and |expected|: a step's roundings are relative to those, not to a result that cancels to near 0."""
    scale = ulp(torch.maximum(reads.double().abs(), expected.double().abs()), expected.dtype)
    error = (actual.double() - expected.double()).abs()
    assert torch.equal(actual.isnan(), expected.isnan()), what
    assert (error <= ulps * scale).all(), f"{what}: {(error / scale).max().item():.2f} ulps"


def magnitude(t: torch.Tensor) -> float:
    """The largest |element| of t (0 when empty)."""
    return t.detach().abs().max().item() if t.numel() else 0.0


def make_params(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in SHAPES]


def set_grads(params, others, dtype, gen):
    for p, q in zip(params, others):
        g = torch.randn(p.shape, generator=gen).to(dtype)
        p.grad, q.grad = g.clone(), g.clone()


def state_of(opt, p) -> dict:
    return {k: v for k, v in opt.state[p].items()}


def copy_state(src_opt, src_params, dst_opt, dst_params):
    """Make dst's parameters and states those of src (the next step then starts from the same values)."""
    with torch.no_grad():
        for p, q in zip(src_params, dst_params):
            q.copy_(p)
            for key, value in src_opt.state[p].items():
                if key in dst_opt.state[q] and isinstance(value, torch.Tensor):
                    dst_opt.state[q][key].copy_(value)


def one_step_tolerance(dtype, rounds_intermediates: bool = False) -> float:
    """ulps of one step, of the largest magnitude it reads or writes (see assert_within_ulps). fp32/fp64: both sides
    round about five operations of the update (sqrt, divisions, products, the final difference; torch's CPU fused
    kernels take some products in double), each within half an ulp of a magnitude at most the largest: 8. 16-bit
    values come from fp32 math on both sides, rounded once: 1 ulp; 3 against torch's single-tensor SGD, which rounds
    four intermediates to the dtype (the weight-decayed gradient, the momentum buffer twice, Nesterov's sum), each
    half an ulp of a magnitude at most the update's, besides the parameter's own rounding on each side."""
    if dtype in (torch.float32, torch.float64):
        return 8.0
    return 3.0 if rounds_intermediates else 1.0


def largest(*tensors: torch.Tensor) -> torch.Tensor:
    """The elementwise largest magnitude of `tensors` (float64)."""
    out = tensors[0].double().abs()
    for t in tensors[1:]:
        out = torch.maximum(out, t.double().abs())
    return out


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("options", ADAMW_GRID, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_adamw_step_matches_torch_fused_adamw(options, dtype):
    """Five steps, each from the same parameters and states: parameters, exp_avg, exp_avg_sq (and max_exp_avg_sq)
    within one step's tolerance of torch.optim.AdamW(fused=True); the step counts equal."""
    ours, theirs = make_params(dtype), make_params(dtype)
    opt = fh.AdamW(ours, lr=1e-2, **options)
    ref = torch.optim.AdamW(theirs, lr=1e-2, fused=True, **options)
    gen = torch.Generator().manual_seed(1)
    tolerance = one_step_tolerance(dtype)
    for step in range(5):
        before = [q.detach().clone() for q in theirs]
        states = [{k: v.clone() for k, v in ref.state[q].items()} for q in theirs]
        set_grads(ours, theirs, dtype, gen)
        opt.step()
        ref.step()
        for i, (p, q) in enumerate(zip(ours, theirs)):
            g = q.grad.double() * (-1 if options["maximize"] else 1)
            # the update's magnitude before exp_avg's cancellation: step_size (|beta1 m| + |(1 - beta1) g|) / denom
            beta1, beta2 = options["betas"]
            t = step + 1
            m_reads = beta1 * states[i].get("exp_avg", torch.zeros_like(g)).double().abs() + (1 - beta1) * g.abs()
            v = ref.state[q]["max_exp_avg_sq" if options["amsgrad"] else "exp_avg_sq"].double()
            denom = v.sqrt() / math.sqrt(1 - beta2**t) + 1e-8
            update = 1e-2 / (1 - beta1**t) * m_reads / denom
            assert_within_ulps(p.detach(), q.detach(), largest(before[i], update), tolerance, f"step {step} param {i}")
            reads = {"exp_avg": g, "exp_avg_sq": g * g, "max_exp_avg_sq": g * g}
            for key, value in ref.state[q].items():
                if key == "step":
                    assert opt.state[p]["step"].item() == value.item() == step + 1
                else:
                    old = states[i].get(key, torch.zeros_like(value))
                    assert_within_ulps(opt.state[p][key], value, largest(old, reads[key]), tolerance, f"{key} {i}")
        copy_state(ref, theirs, opt, ours)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("options", SGD_GRID, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_sgd_step_matches_torch_sgd(options, dtype):
    """Five steps, each from the same parameters and momentum buffers, against torch.optim.SGD: fused=True for fp32
    and fp64; for fp16 and bf16 the single-tensor step (torch's CPU fused SGD of 16-bit tensors is itself several ulps
    from fp32 math), which rounds intermediates to the dtype where fusedhooks rounds once."""
    ours, theirs = make_params(dtype), make_params(dtype)
    opt = fh.SGD(ours, lr=1e-2, **options)
    fused = dtype in (torch.float32, torch.float64)
    ref = torch.optim.SGD(theirs, lr=1e-2, fused=fused or None, foreach=False if not fused else None, **options)
    gen = torch.Generator().manual_seed(1)
    tolerance = one_step_tolerance(dtype, rounds_intermediates=not fused)
    for step in range(5):
        before = [q.detach().clone() for q in theirs]
        bufs = [ref.state[q].get("momentum_buffer") for q in theirs]
        bufs = [None if b is None else b.clone() for b in bufs]
        set_grads(ours, theirs, dtype, gen)
        opt.step()
        ref.step()
        for i, (p, q) in enumerate(zip(ours, theirs)):
            # the update's magnitude before the momentum buffer's cancellation: lr (|momentum buf| + |d_p|), and
            # (1 + momentum) times that with Nesterov
            momentum = options["momentum"]
            d_p = q.grad.double().abs() + options.get("weight_decay", 0.0) * before[i].double().abs()
            reads = d_p if bufs[i] is None else momentum * bufs[i].double().abs() + d_p
            update = 1e-2 * (1 + momentum) * reads
            assert_within_ulps(p.detach(), q.detach(), largest(before[i], update), tolerance, f"step {step} param {i}")
            if momentum:
                buf = ref.state[q]["momentum_buffer"]
                assert_within_ulps(opt.state[p]["momentum_buffer"], buf, reads, tolerance, f"buf {i}")
            else:
                assert "momentum_buffer" not in opt.state[p]
        copy_state(ref, theirs, opt, ours)


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_fp32_trajectory_of_50_steps_stays_with_torch(name):
    """A small MLP trained 50 steps by each optimizer from the same start: the parameters stay within a
    few fp32 ulps per step of torch's fused optimizer's."""
    torch.manual_seed(0)
    models = [torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    if name == "adamw":
        opts = [fh.AdamW(models[0].parameters(), lr=1e-2, weight_decay=0.1),
                torch.optim.AdamW(models[1].parameters(), lr=1e-2, weight_decay=0.1, fused=True)]
    else:
        opts = [fh.SGD(models[0].parameters(), lr=1e-2, momentum=0.9, nesterov=True),
                torch.optim.SGD(models[1].parameters(), lr=1e-2, momentum=0.9, nesterov=True, fused=True)]
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        x = torch.randn(32, 8, generator=gen)
        for model, opt in zip(models, opts):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(p, q, rtol=50 * 4 * 2**-24, atol=50 * 4 * 2**-24 * q.abs().max().item())


@pytest.mark.parametrize("direction", ["fusedhooks to torch", "torch to fusedhooks"])
@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_state_dict_loads_both_ways(name, direction):
    """Three steps by one, its state_dict loaded into the other, three more steps by both from there: the same
    parameters (within one step's tolerance per step) and states; the layouts' keys are torch's."""
    make = {"adamw": (lambda ps: fh.AdamW(ps, lr=1e-2, amsgrad=True),
                      lambda ps: torch.optim.AdamW(ps, lr=1e-2, amsgrad=True, fused=True)),
            "sgd": (lambda ps: fh.SGD(ps, lr=1e-2, momentum=0.9),
                    lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, fused=True))}[name]
    first, second = make if direction == "fusedhooks to torch" else make[::-1]
    a, b = make_params(torch.float32), make_params(torch.float32)
    opt_a = first(a)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        set_grads(a, b, torch.float32, gen)
        opt_a.step()
    with torch.no_grad():
        for p, q in zip(a, b):
            q.copy_(p)
    saved = copy.deepcopy(opt_a.state_dict())  # (a state_dict's tensors are the optimizer's own, not copies)
    opt_b = second(b)
    opt_b.load_state_dict(saved)
    assert opt_b.state_dict()["param_groups"] == saved["param_groups"]
    assert all(opt_b.state_dict()["state"][k].keys() == v.keys() for k, v in saved["state"].items())
    for _ in range(3):
        set_grads(a, b, torch.float32, gen)
        opt_a.step()
        opt_b.step()
    for p, q in zip(a, b):  # three steps of one step's tolerance each, of the largest magnitude
        torch.testing.assert_close(p, q, rtol=0, atol=3 * 8 * 2**-24 * magnitude(q))
        for key, value in opt_a.state[p].items():
            torch.testing.assert_close(opt_b.state[q][key].cpu(), value.cpu(), rtol=0,
                                       atol=3 * 8 * 2**-24 * magnitude(value))


def test_lambda_lr_schedule_changes_lr_without_new_launch_configurations(monkeypatch):
    """LambdaLR changes lr at every step: the results follow torch's, and every launch has the same constexprs and
    options (nothing to compile again: lr is read on the device)."""
    metas = []
    real_launch = launcher.launch

    def recording_launch(kernel, grid, args, meta, *rest):
        metas.append(tuple(sorted((k, str(v)) for k, v in meta.items())))
        return real_launch(kernel, grid, args, meta, *rest)

    monkeypatch.setattr(launcher, "launch", recording_launch)
    a, b = make_params(torch.float32), make_params(torch.float32)
    opt, ref = fh.AdamW(a, lr=1e-2), torch.optim.AdamW(b, lr=1e-2, fused=True)
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, lambda step: 1.0 / (1 + step)) for o in (opt, ref)]
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        set_grads(a, b, torch.float32, gen)
        opt.step()
        ref.step()
        for s in schedules:
            s.step()
    assert opt.param_groups[0]["lr"] == ref.param_groups[0]["lr"] == 1e-2 / 5
    assert len(metas) == 4 and len(set(metas)) == 1
    for p, q in zip(a, b):
        torch.testing.assert_close(p, q, rtol=4 * 4 * 2**-24, atol=1e-7)


def test_parameters_the_kernels_do_not_take_are_stepped_by_torch(monkeypatch):
    """A transposed (non-contiguous) parameter in the same group as contiguous ones, and a whole optimizer with the
    eager backend (CPU without the interpreter): torch's single-tensor step, the same results."""
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(7, 5, generator=gen)
    a = [torch.nn.Parameter(base.clone().t()), torch.nn.Parameter(torch.randn(9, generator=gen))]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    assert not a[0].is_contiguous()
    opt, ref = fh.AdamW(a, lr=1e-2), torch.optim.AdamW(b, lr=1e-2, foreach=False)
    for _ in range(3):
        set_grads(a, b, torch.float32, gen)
        opt.step()
        ref.step()
    for p, q in zip(a, b):
        torch.testing.assert_close(p, q, rtol=3 * 4 * 2**-24, atol=1e-7)
    monkeypatch.setenv("FUSEDHOOKS_BACKEND", "eager")
    launches = []
    monkeypatch.setattr(launcher, "launch", lambda *args: launches.append(args))
    c = [torch.nn.Parameter(torch.randn(9, generator=gen))]
    d = [torch.nn.Parameter(c[0].detach().clone())]
    opt, ref = fh.SGD(c, lr=0.1, momentum=0.9), torch.optim.SGD(d, lr=0.1, momentum=0.9, foreach=False)
    for _ in range(2):
        set_grads(c, d, torch.float32, gen)
        opt.step()
        ref.step()
    assert launches == []
    assert torch.equal(c[0], d[0])
    assert torch.equal(opt.state[c[0]]["momentum_buffer"], ref.state[d[0]]["momentum_buffer"])


def test_closure_loss_is_returned_and_parameters_without_gradients_are_left_alone():
    p, idle = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    opt = fh.AdamW([p, idle], lr=0.1)

    def closure():
        opt.zero_grad()
        loss = (p * 2).sum()
        loss.backward()
        return loss

    assert opt.step(closure).item() == 6.0
    assert torch.equal(idle, torch.ones(3)) and idle not in opt.state
    assert p.lt(1).all() and opt.state[p]["step"].item() == 1


def test_bad_hyper_parameters_and_sparse_gradients_are_refused():
    p = torch.nn.Parameter(torch.ones(3))
    with pytest.raises(ValueError, match="learning rate"):
        fh.AdamW([p], lr=-1.0)
    with pytest.raises(ValueError, match="beta"):
        fh.AdamW([p], betas=(1.0, 0.999))
    with pytest.raises(ValueError, match="Nesterov"):
        fh.SGD([p], lr=0.1, nesterov=True)
    p.grad = torch.ones(3).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        fh.AdamW([p]).step()
    with pytest.raises(RuntimeError, match="sparse"):
        fh.SGD([p], lr=0.1).step()
