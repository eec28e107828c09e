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
    check_adamw_steps(options, dtype)


def set_grad_scale(opts, grad_scale: float | None, found_inf: float = 0.0):
    """Set `grad_scale` and `found_inf` on each of `opts` as GradScaler.step sets them (float32 0-dim)."""
    if grad_scale is not None:
        for opt in opts:
            opt.grad_scale = torch.tensor(grad_scale, dtype=torch.float32)
            opt.found_inf = torch.tensor(found_inf, dtype=torch.float32)


def random_grads(dtype):
    """set_step_grads(ours, theirs, step) of check_*_steps: the same random gradients on both sides."""
    gen = torch.Generator().manual_seed(1)
    return lambda ours, theirs, step: set_grads(ours, theirs, dtype, gen)


def check_adamw_steps(options, dtype, grad_scale=None, steps=5, params=None, set_step_grads=None):
    """`steps` steps of fh.AdamW and torch.optim.AdamW(fused=True), each from the same parameters and states (see
    test_adamw_step_matches_torch_fused_adamw); grad_scale: set on both before each step (torch's divides the
    gradients and writes them back; fusedhooks' leaves them). params: (ours, theirs), equal lists of parameters
    (default: make_params); set_step_grads(ours, theirs, step) gives both the same gradients (default: random)."""
    ours, theirs = params or (make_params(dtype), make_params(dtype))
    opt = fh.AdamW(ours, lr=1e-2, **options)
    ref = torch.optim.AdamW(theirs, lr=1e-2, fused=True, **options)
    set_step_grads = set_step_grads or random_grads(dtype)
    tolerance = one_step_tolerance(dtype)
    for step in range(steps):
        before = [q.detach().clone() for q in theirs]
        states = [{k: v.clone() for k, v in ref.state[q].items()} for q in theirs]
        set_step_grads(ours, theirs, step)
        grads = [p.grad.clone() for p in ours]
        set_grad_scale((opt, ref), grad_scale)
        opt.step()
        ref.step()
        assert all(torch.equal(p.grad, g) for p, g in zip(ours, grads))
        for i, (p, q) in enumerate(zip(ours, theirs)):
            g = grads[i].double() / (grad_scale or 1.0) * (-1 if options["maximize"] else 1)
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
    check_sgd_steps(options, dtype)


def check_sgd_steps(options, dtype, grad_scale=None, steps=5, params=None, set_step_grads=None):
    """`steps` steps of fh.SGD and torch.optim.SGD, each from the same parameters and buffers (see
    test_sgd_step_matches_torch_sgd); grad_scale: set on both before each step where torch's is fused; torch's
    single-tensor step (16-bit) is given the gradients divided in fp32 and rounded to the dtype instead. params,
    set_step_grads: as check_adamw_steps'."""
    ours, theirs = params or (make_params(dtype), make_params(dtype))
    opt = fh.SGD(ours, lr=1e-2, **options)
    fused = dtype in (torch.float32, torch.float64)
    ref = torch.optim.SGD(theirs, lr=1e-2, fused=fused or None, foreach=False if not fused else None, **options)
    set_step_grads = set_step_grads or random_grads(dtype)
    tolerance = one_step_tolerance(dtype, rounds_intermediates=not fused)
    for step in range(steps):
        before = [q.detach().clone() for q in theirs]
        bufs = [ref.state[q].get("momentum_buffer") for q in theirs]
        bufs = [None if b is None else b.clone() for b in bufs]
        set_step_grads(ours, theirs, step)
        grads = [p.grad.clone() for p in ours]
        set_grad_scale((opt, ref) if fused else (opt,), grad_scale)
        if grad_scale is not None and not fused:
            for q in theirs:
                q.grad = (q.grad.float() / grad_scale).to(dtype)
        opt.step()
        ref.step()
        assert all(torch.equal(p.grad, g) for p, g in zip(ours, grads))
        for i, (p, q) in enumerate(zip(ours, theirs)):
            # the update's magnitude before the momentum buffer's cancellation: lr (|momentum buf| + |d_p|), and
            # (1 + momentum) times that with Nesterov
            momentum = options["momentum"]
            g = grads[i].double() / (grad_scale or 1.0)
            d_p = g.abs() + options.get("weight_decay", 0.0) * before[i].double().abs()
            reads = d_p if bufs[i] is None else momentum * bufs[i].double().abs() + d_p
            update = 1e-2 * (1 + momentum) * reads
            assert_within_ulps(p.detach(), q.detach(), largest(before[i], update), tolerance, f"step {step} param {i}")
            if momentum:
                buf = ref.state[q]["momentum_buffer"]
                assert_within_ulps(opt.state[p]["momentum_buffer"], buf, reads, tolerance, f"buf {i}")
            else:
                assert "momentum_buffer" not in opt.state[p]
        copy_state(ref, theirs, opt, ours)


#: not a power of two: the division rounds (GradScaler's scales are powers of two; a folded clip's are not)
GRAD_SCALE = 3.7


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("options", ADAMW_GRID[::5], ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_adamw_step_divides_by_grad_scale_as_torch_fused_adamw(options, dtype):
    """opt.grad_scale and found_inf = 0 set as GradScaler.step and a folded clip set them: each step within one
    step's tolerance of torch's fused step given the same; `.grad` is left as the backward made it."""
    check_adamw_steps(options, dtype, GRAD_SCALE)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("options", SGD_GRID[1:3], ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_sgd_step_divides_by_grad_scale_as_torch_sgd(options, dtype):
    check_sgd_steps(options, dtype, GRAD_SCALE)


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_a_found_inf_step_changes_nothing(name):
    """found_inf = 1 (a GradScaler overflow, a ZClip skip): parameters, states and step counts stay as they were,
    also for a first step (SGD's momentum buffer does not start: one host sync) and for the parameters torch's
    single-tensor step takes (a transposed one); the next step with found_inf = 0 is a first step."""
    gen = torch.Generator().manual_seed(0)
    params = make_params(torch.float32) + [torch.nn.Parameter(torch.randn(5, 3, generator=gen).t())]
    opt = fh.AdamW(params, lr=0.1) if name == "adamw" else fh.SGD(params, lr=0.1, momentum=0.9)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ref = fh.AdamW(twins, lr=0.1) if name == "adamw" else fh.SGD(twins, lr=0.1, momentum=0.9)
    set_grads(params, twins, torch.float32, gen)
    start = [p.detach().clone() for p in params]
    for _ in range(2):
        set_grad_scale((opt,), 2.0, found_inf=1.0)
        opt.step()
        assert all(torch.equal(p, s) for p, s in zip(params, start))
        state = opt.state_dict()["state"]
        if name == "sgd":
            assert not any(state.values())  # the first step did not happen: no momentum buffer
        else:  # as torch's fused AdamW: the state is made, and stays at step 0
            assert len(state) == len(params) and all(
                not value.any() for entry in state.values() for value in entry.values())
    del opt.grad_scale, opt.found_inf
    opt.step()
    ref.step()
    for p, q in zip(params, twins):
        assert torch.equal(p, q)
        for key, value in ref.state[q].items():
            assert torch.equal(opt.state[p][key], value)


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_grad_scaler_steps_as_with_torchs_optimizer(name):
    """scaler.scale(loss).backward(); scaler.step(opt); scaler.update() for 8 steps, two of which overflow (the
    first one among them: SGD's momentum starts later): fh's optimizer against torch's (fused AdamW; SGD without
    fused=True, whose first skipped step would leave an uninitialised buffer), the same scales, and parameters within
    a few fp32 ulps per step."""
    torch.manual_seed(0)
    models = [torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    if name == "adamw":
        opts = [fh.AdamW(models[0].parameters(), lr=1e-2), torch.optim.AdamW(models[1].parameters(), lr=1e-2,
                                                                             fused=True)]
    else:
        opts = [fh.SGD(models[0].parameters(), lr=1e-2, momentum=0.9),
                torch.optim.SGD(models[1].parameters(), lr=1e-2, momentum=0.9)]
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0 ** 10) for _ in range(2)]
    gen = torch.Generator().manual_seed(0)
    for step in range(8):
        x = torch.randn(32, 8, generator=gen)
        for model, opt, scaler in zip(models, opts, scalers):
            opt.zero_grad()
            loss = model(x).square().mean() * (math.inf if step in (0, 5) else 1.0)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            assert "grad_scale" not in vars(opt) and "found_inf" not in vars(opt)
        assert scalers[0].get_scale() == scalers[1].get_scale()
    assert scalers[0].get_scale() == 2.0 ** 8
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(p, q, rtol=8 * 4 * 2**-24, atol=8 * 4 * 2**-24 * q.abs().max().item())
        for key, value in opts[1].state[q].items():
            assert opts[0].state[p][key].shape == value.shape
            torch.testing.assert_close(opts[0].state[p][key], value.to(opts[0].state[p][key].device),
                                       rtol=8 * 4 * 2**-24, atol=8 * 4 * 2**-24 * value.abs().max().item())
    assert name == "sgd" or opts[0].state[next(models[0].parameters())]["step"].item() == 6


def demo_model() -> torch.nn.Module:
    from fusedhooks.cli.demo import make_model

    torch.manual_seed(0)
    return make_model("cpu")


def model_grads(model_ref, batches):
    """set_step_grads of check_*_steps: torch's model `model_ref` (the reference optimizer's parameters) computes
    the gradients of batch `step` (forward, loss, backward), and fusedhooks' parameters get copies of them."""
    def set_step_grads(ours, theirs, step):
        inputs, targets = batches(step)
        model_ref.zero_grad(set_to_none=True)
        logits = model_ref(inputs)
        torch.nn.functional.cross_entropy(logits.flatten(0, -2), targets.flatten()).backward()
        for p, q in zip(ours, theirs):
            p.grad = q.grad.clone()
    return set_step_grads


def demo_batches(step):
    gen = torch.Generator().manual_seed(step)
    return torch.randn(64, 32, generator=gen), torch.randint(0, 10, (64,), generator=gen)


#: the 100-step runs: the demo's model over a grid, and GPT2Config.tiny (2 layers, d_model 64, 0.14 M parameters; the
#: interpreter steps nanoGPT's 10.7 M-parameter character model in about 4 s a step: its run is test_gpu's)
HUNDRED_STEP_CASES = [("adamw", "demo", dict(amsgrad=False, maximize=False, weight_decay=0.01, betas=(0.9, 0.999))),
                      ("adamw", "demo", dict(amsgrad=True, maximize=True, weight_decay=0.1, betas=(0.8, 0.95))),
                      ("adamw", "gpt", dict(amsgrad=False, maximize=False, weight_decay=0.1, betas=(0.9, 0.95))),
                      ("sgd", "demo", dict(momentum=0.9, nesterov=True, weight_decay=0.01)),
                      ("sgd", "demo", dict(momentum=0.9, dampening=0.3))]


@pytest.mark.slow
@pytest.mark.parametrize("name, model, options", HUNDRED_STEP_CASES,
                         ids=lambda v: v if isinstance(v, str) else "-".join(f"{k}={x}" for k, x in v.items()))
def test_hundred_training_steps_of_a_model_stay_within_a_steps_tolerance(name, model, options):
    """100 training steps of a real model's gradients (fp32): at every step, from the same parameters and states,
    fh's optimizer is within one step's tolerance of torch's fused one (the per-step bound of the tests above; then
    both go on from torch's values, so that the bound is each step's, not a sum that grows)."""
    from fusedhooks.testing import GPT2Config, gpt2, synthetic_batch

    if model == "demo":
        pair = (demo_model(), demo_model())
        batches = demo_batches
    else:
        config = GPT2Config.tiny()
        pair = (gpt2(config), gpt2(config))
        pair[1].load_state_dict(pair[0].state_dict())

        def batches(step):
            return synthetic_batch(config, 4, 32, generator=torch.Generator().manual_seed(step))
    params = (list(pair[0].parameters()), list(pair[1].parameters()))
    check = check_adamw_steps if name == "adamw" else check_sgd_steps
    check(options, torch.float32, steps=100, params=params, set_step_grads=model_grads(pair[1], batches))


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


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_a_tensor_lr_steps_as_the_same_float(name):
    """lr given as a 0-dim tensor (as torch's optimizers take it) is read on the device beside the float
    hyper-parameters (`_hyper`): the same parameters and states, bit for bit, as the same lr as a float, and a tensor
    changed in place between steps is the next step's lr."""
    make = (lambda ps, lr: fh.AdamW(ps, lr=lr, weight_decay=0.1)) if name == "adamw" else (
        lambda ps, lr: fh.SGD(ps, lr=lr, momentum=0.9))
    a, b = make_params(torch.float32), make_params(torch.float32)
    lr = torch.tensor(2.0 ** -7, dtype=torch.float64)
    opts = make(a, lr), make(b, 2.0 ** -7)
    gen = torch.Generator().manual_seed(2)
    for step in range(3):
        set_grads(a, b, torch.float32, gen)
        for o in opts:
            o.step()
        lr.fill_(2.0 ** -8)  # the next step's, for the tensor; the float changed as a schedule changes it
        opts[1].param_groups[0]["lr"] = 2.0 ** -8
        for p, q in zip(a, b):
            assert torch.equal(p, q), (step, p.shape)
            assert all(torch.equal(v, opts[1].state[q][k]) for k, v in opts[0].state[p].items() if k != "step")


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


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_no_weight_decay_term_at_zero_weight_decay(name):
    """weight_decay=0 adds no term, as torch's steps: an Inf parameter with a zero gradient stays Inf (0 * Inf would
    make it NaN), a NaN gradient makes NaN; the same values as torch's fused step."""
    values = torch.tensor([math.inf, -math.inf, 1.0, 2.0])
    grads = torch.tensor([0.0, 0.0, math.nan, 0.5])
    make = {"adamw": (lambda ps: fh.AdamW(ps, lr=0.1, weight_decay=0.0),
                      lambda ps: torch.optim.AdamW(ps, lr=0.1, weight_decay=0.0, fused=True)),
            "sgd": (lambda ps: fh.SGD(ps, lr=0.1), lambda ps: torch.optim.SGD(ps, lr=0.1, fused=True))}[name]
    ours, theirs = torch.nn.Parameter(values.clone()), torch.nn.Parameter(values.clone())
    ours.grad, theirs.grad = grads.clone(), grads.clone()
    make[0]([ours]).step()
    make[1]([theirs]).step()
    assert torch.equal(ours.isnan(), theirs.isnan()) and ours[:2].isinf().all()
    torch.testing.assert_close(ours, theirs, equal_nan=True)
