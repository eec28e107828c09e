"""fh.zclip: ZClip's spike guard on the device, against a float64 re-implementation of its published rule."""

import copy
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fusedhooks as fh

from helpers import FUSED_OPTIMIZERS, PublishedZClip, assert_close_to, mlp, optimizer_state, torch_fp32_norm_rtol

STEPS, WARMUP = 40, 10
SPIKES = (15, 22, 23, 31)  # the loss is multiplied by 50 there (after the warm-up)
DATA_SEED = 5  # batches whose norms have no natural z-score spike (with seed 1, step 13 is one, flagged by both)
SIZES = ((7, 13), (5, 7))  # Linear(13, 7) -> Linear(7, 5): odd sizes


def unit_roundoff(dtype):
    return torch.finfo(dtype).eps / 2


def total_norm_rtol(dtype, n_params):
    """fusedhooks' total norm against the float64 one: each recorded norm rounded to the dtype (u), the total computed
    from them in float32 (torch's bound) and rounded to the dtype (u)."""
    return 2 * unit_roundoff(dtype) + torch_fp32_norm_rtol([1] * n_params)


def coef_rtol(ref, total, clip_val, e, max_total, u):
    """Bound on the relative error of the coefficient limit / (total + 1e-6): e relative on the total, e * max_total
    on the EMA mean and 4 e max_total^2 on the variance (each EMA input is a total or a threshold within e * max_total,
    and d(v - m)^2 <= 2 |v - m| d(v - m)), carried through the threshold's formula; plus two roundings of the
    product."""
    if clip_val is None or (ref.max_grad_norm is not None and ref.max_grad_norm < clip_val):
        return e + 2 * u
    dm, dv = e * max_total, 4 * e * max_total ** 2
    std, gap = ref.var ** 0.5, total - ref.mean
    if ref.mode == "percentile":
        d_threshold = dm + ref.z_thresh * dv / (2 * std)
    elif ref.clip_option == "mean":
        d_threshold = dm
    else:  # (m + z_thresh^2 std (std + eps) / (total - m)) * clip_factor
        d_threshold = ref.clip_factor * (dm + ref.z_thresh ** 2 * (dv / gap + (std * std + 1e-6) * (e * total + dm)
                                                                     / gap ** 2))
    return d_threshold / clip_val + e + 2 * u


def make_model(dtype):
    return mlp((13, 7, 5), dtype=dtype)


def backward(model, dtype, step, gen, spikes=SPIKES):
    x, y = torch.randn(11, 13, generator=gen).to(dtype), torch.randn(11, 5, generator=gen).to(dtype)
    loss = torch.nn.functional.mse_loss(model(x), y)
    (loss * 50 if step in spikes else loss).backward()


def guard_state(guard):
    return guard.mean.item(), guard.var.item()


def run_against_reference(dtype, options, backend=None, spikes=SPIKES):
    """STEPS steps with fh.zclip; at each step the reference applies the published rule to a copy of the same
    gradients, and the total norm, spike, EMA state and clipped gradients are compared. Returns the spike steps."""
    model = make_model(dtype)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.01)
    hook = fh.grad_hook(stats=("norm",), backend=backend)
    hook.register(model)
    guard = fh.zclip(hook, warmup_steps=WARMUP, **options)
    ref = PublishedZClip(warmup_steps=WARMUP, **{"max_grad_norm": None, **options})
    e, u = total_norm_rtol(dtype, len(params)), unit_roundoff(dtype)
    gen = torch.Generator().manual_seed(DATA_SEED)
    caught, max_total = [], 0.0
    for step in range(STEPS):
        opt.zero_grad()
        backward(model, dtype, step, gen, spikes)
        ref_params = [p.detach().clone().requires_grad_() for p in params]
        for rp, p in zip(ref_params, params):
            rp.grad = p.grad.clone()
        warm = not ref.initialized
        ref_total, clip_val = ref.step(ref_params)
        max_total = max(max_total, ref_total)
        total = guard.step(opt)
        assert total.dim() == 0 and total.dtype == dtype
        assert abs(total.item() - ref_total) <= e * ref_total, step
        if not warm:  # the rule's decision must not hang on rounding for the comparison to mean anything
            assert abs(ref.last_z - ref.z_thresh) > 1e-3, f"ill-conditioned test: z={ref.last_z} at step {step}"
        assert guard.spike.item() == (clip_val is not None), step
        if clip_val is not None:
            caught.append(step)
        if ref.initialized:
            mean, var = guard_state(guard)
            assert abs(mean - ref.mean) <= e * max_total, step
            assert abs(var - ref.var) <= 4 * e * max_total ** 2, step
        else:
            assert math.isnan(guard.mean.item()) and math.isnan(guard.var.item())
        if options.get("on_spike", "clip") == "clip":
            rtol = coef_rtol(ref, ref_total, clip_val, e, max_total, u)
            for p, rp in zip(params, ref_params):
                assert_close_to(p.grad, rp.grad, rtol)
        opt.step()
    return caught


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("options", [
    {},
    {"clip_option": "mean"},
    {"mode": "percentile"},
    {"clip_factor": 0.7, "skip_update_on_spike": True},
    {"max_grad_norm": 0.6, "z_thresh": 2.0},
], ids=["adaptive_scaling", "mean", "percentile", "clip_factor-skip_update", "max_grad_norm"])
def test_matches_published_rule(dtype, options):
    spikes = run_against_reference(dtype, options)
    assert tuple(spikes) == SPIKES  # the injected spikes, and only they, are caught after the warm-up


@pytest.mark.parametrize("backend", ["reference", "eager"])
def test_matches_published_rule_other_backends(backend):
    assert tuple(run_against_reference(torch.float32, {}, backend=backend)) == SPIKES


@pytest.mark.parametrize("options", [{}, {"max_grad_norm": 0.6}], ids=["no-max_grad_norm", "max_grad_norm"])
def test_warmup_spike(options):
    """A spike in the warm-up is recorded, not clipped (but for max_grad_norm, as torch's clip_grad_norm_ would), and
    enters the mean and variance the EMA starts from, as in ZClip; the rule then compares later norms with them."""
    caught = run_against_reference(torch.float32, options, spikes=(4, 15))
    assert caught == [15]


def test_warmup_zero_is_one_step():
    """ZClip initializes its EMA after one norm when warmup_steps=0: the second step already uses the rule."""
    model = make_model(torch.float32)
    hook = fh.grad_hook(stats=("norm",))
    hook.register(model)
    guard = fh.zclip(hook, warmup_steps=0)
    gen = torch.Generator().manual_seed(DATA_SEED)
    backward(model, torch.float32, 0, gen)
    total = guard.step()
    assert guard.count.item() == 1
    assert guard.mean.item() == pytest.approx(total.item(), rel=1e-6) and guard.var.item() == 0.0


#: optimizers whose step reads found_inf on the device: torch's fused ones, fusedhooks' own
SKIPPING_OPTIMIZERS = {
    "torch-AdamW-fused": lambda params: torch.optim.AdamW(params, lr=0.01, fused=True),
    "fh-AdamW": lambda params: fh.AdamW(params, lr=0.01),
    "fh-SGD": lambda params: fh.SGD(params, lr=0.01, momentum=0.9),
}


@pytest.mark.parametrize("make_optimizer", SKIPPING_OPTIMIZERS.values(), ids=SKIPPING_OPTIMIZERS)
def test_skip_on_spike_fused_optimizer(make_optimizer):
    """on_spike="skip" with a fused optimizer: exactly the injected steps after the warm-up leave the parameters and
    the optimizer state (step counts included) as they were; every other step changes them; nothing is left on the
    optimizer."""
    model = make_model(torch.float32)
    opt = make_optimizer(model.parameters())
    hook = fh.grad_hook(stats=("norm",))
    hook.register(model)
    guard = fh.zclip(hook, warmup_steps=WARMUP, on_spike="skip")
    gen = torch.Generator().manual_seed(DATA_SEED)
    skipped = []
    for step in range(STEPS):
        opt.zero_grad()
        backward(model, torch.float32, step, gen)
        before = [p.detach().clone() for p in model.parameters()]
        state_before = [t.clone() for t in optimizer_state(opt)]
        guard.step(opt)
        opt.step()
        assert "found_inf" not in vars(opt) and "grad_scale" not in vars(opt)
        unchanged = all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
        if unchanged:
            skipped.append(step)
            assert all(torch.equal(b, a) for b, a in zip(state_before, optimizer_state(opt)))
        else:
            assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert tuple(skipped) == SPIKES


@pytest.mark.parametrize("make_optimizer", SKIPPING_OPTIMIZERS.values(), ids=SKIPPING_OPTIMIZERS)
def test_skip_composes_with_grad_scaler(make_optimizer):
    """Under GradScaler.step (which sets its own found_inf) a spike still skips the step, and the scaler's books
    (its scale) do not count it as an overflow."""
    model = make_model(torch.float32)
    opt = make_optimizer(model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4, growth_interval=1000)
    hook = fh.grad_hook(stats=("norm",), scaler=scaler, optimizer=opt)
    hook.register(model)
    guard = fh.zclip(hook, warmup_steps=3, on_spike="skip")
    gen = torch.Generator().manual_seed(DATA_SEED)
    for step in range(6):
        opt.zero_grad()
        x, y = torch.randn(11, 13, generator=gen), torch.randn(11, 5, generator=gen)
        loss = torch.nn.functional.mse_loss(model(x), y) * (50.0 if step == 5 else 1.0)
        scaler.scale(loss).backward()
        before = [p.detach().clone() for p in model.parameters()]
        guard.step(opt)
        scaler.step(opt)
        scaler.update()
        unchanged = all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
        assert unchanged == (step == 5), step
        assert scaler.get_scale() == 2.0 ** 4
        assert "found_inf" not in vars(opt)


@pytest.mark.parametrize("name", ["AdamW", "SGD"])
def test_fused_optimizer_folds_the_coefficient(name):
    """guard.step(fused optimizer) folds the coefficient into grad_scale (the gradients are not rewritten before the
    step) and the step equals the published rule's clipping followed by the same optimizer's step."""
    make_optimizer = FUSED_OPTIMIZERS[name]
    model = make_model(torch.float32)
    opt = make_optimizer(model.parameters())
    hook = fh.grad_hook(stats=("norm",))
    hook.register(model)
    guard = fh.zclip(hook, warmup_steps=WARMUP, max_grad_norm=0.6)
    ref = PublishedZClip(warmup_steps=WARMUP, max_grad_norm=0.6)
    gen = torch.Generator().manual_seed(DATA_SEED)
    e, u = total_norm_rtol(torch.float32, 4), unit_roundoff(torch.float32)
    folded_clips = 0
    for step in range(STEPS):
        opt.zero_grad()
        backward(model, torch.float32, step, gen)
        ref_model = copy.deepcopy(model)
        ref_params = list(ref_model.parameters())
        for rp, p in zip(ref_params, model.parameters()):
            rp.grad = p.grad.clone()
        ref_opt = make_optimizer(ref_params)
        ref_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
        ref_total, clip_val = ref.step(ref_params)
        grads = [p.grad.clone() for p in model.parameters()]
        guard.step(opt)
        assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))  # no pass over them
        folded_clips += not torch.equal(ref_params[0].grad, grads[0])
        opt.step()
        ref_opt.step()
        assert "grad_scale" not in vars(opt)
        rtol = coef_rtol(ref, ref_total, clip_val, e, ref_total, u) + 8 * u
        for p, rp in zip(model.parameters(), ref_params):
            assert_close_to(p.detach(), rp.detach(), rtol)
    assert folded_clips >= len(SPIKES)  # the comparison covered clipped steps


@pytest.mark.parametrize("optimizer", [None, "SGD", "AdamW-unfused"])
def test_skip_refused_without_fused_optimizer(optimizer):
    model = make_model(torch.float32)
    opt = {None: None, "SGD": torch.optim.SGD(model.parameters(), lr=0.1),
           "AdamW-unfused": torch.optim.AdamW(model.parameters())}[optimizer]
    hook = fh.grad_hook(stats=("norm",))
    hook.register(model)
    guard = fh.zclip(hook, on_spike="skip")
    backward(model, torch.float32, 0, torch.Generator().manual_seed(DATA_SEED))
    grads = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="fused=True.*on_spike='clip'"):
        guard.step(opt)
    assert guard.count.item() == 0  # refused before anything changed
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))


class NoHostSync(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            raise AssertionError("host sync (.item(), bool() of a tensor)")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("case", ["SGD", "fused-skip", "percentile-max_grad_norm"])
def test_no_host_sync(case):
    """guard.step reads nothing back to the host, in the warm-up, at its end and afterwards, spikes included."""
    model = make_model(torch.float32)
    fused = case == "fused-skip"
    opt = torch.optim.AdamW(model.parameters(), fused=True) if fused else torch.optim.SGD(model.parameters(), lr=0.01)
    hook = fh.grad_hook(stats=("norm",))
    hook.register(model)
    options = {"on_spike": "skip"} if fused else {"mode": "percentile", "max_grad_norm": 0.5} if "max" in case else {}
    guard = fh.zclip(hook, warmup_steps=3, **options)
    gen = torch.Generator().manual_seed(DATA_SEED)
    with NoHostSync():  # the mode sees this call too: it raises if the check is not in force
        with pytest.raises(AssertionError, match="host sync"):
            torch.ones(()).item()
    for step in range(6):
        opt.zero_grad()
        backward(model, torch.float32, step if step != 5 else SPIKES[1], gen)
        with NoHostSync():
            guard.step(opt)
        opt.step()
    assert guard.count.item() == 3


def test_state_dict_round_trip():
    """A guard loaded with another's state_dict continues exactly as that one does."""
    models = [make_model(torch.float32) for _ in range(2)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.01) for m in models]
    hooks = [fh.grad_hook(stats=("norm",)) for _ in range(2)]
    for h, m in zip(hooks, models):
        h.register(m)
    guards = [fh.zclip(h, warmup_steps=WARMUP) for h in hooks]
    gens = [torch.Generator().manual_seed(DATA_SEED) for _ in range(2)]
    for step in range(STEPS):
        if step == 17:  # after the warm-up, mid-run: the second guard is replaced by a fresh one loaded from the first
            state = guards[0].state_dict()
            guards[1] = fh.zclip(hooks[1], warmup_steps=WARMUP)
            guards[1].load_state_dict(state)
        elif step == 5:  # in the warm-up
            fresh = fh.zclip(hooks[1], warmup_steps=WARMUP)
            fresh.load_state_dict(guards[1].state_dict())
            guards[1] = fresh
        totals = []
        for m, o, g, gen in zip(models, opts, guards, gens):
            o.zero_grad()
            backward(m, torch.float32, step, gen)
            totals.append(g.step(o))
            o.step()
        assert torch.equal(totals[0], totals[1])
        for name in ("count", "norms", "mean", "var", "spike"):
            assert torch.equal(getattr(guards[0], name), getattr(guards[1], name)) or (
                name in ("mean", "var") and getattr(guards[0], name).isnan() and getattr(guards[1], name).isnan())
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="warmup_steps"):
        fh.zclip(hooks[1], warmup_steps=WARMUP + 1).load_state_dict(guards[0].state_dict())


def test_non_finite_norm_leaves_state():
    """An overflow (inf loss: NaN/inf gradients) neither enters the warm-up nor moves the EMA (fusedhooks'
    documented deviation from ZClip's code, which would make its EMA NaN for good)."""
    model = make_model(torch.float32)
    hook = fh.grad_hook(stats=("norm",))
    hook.register(model)
    guard = fh.zclip(hook, warmup_steps=3)
    ref = PublishedZClip(warmup_steps=3, max_grad_norm=None)
    gen = torch.Generator().manual_seed(DATA_SEED)
    for step in range(8):
        model.zero_grad()
        x, y = torch.randn(11, 13, generator=gen), torch.randn(11, 5, generator=gen)
        loss = torch.nn.functional.mse_loss(model(x), y) * (math.inf if step in (1, 5) else 1.0)
        loss.backward()
        ref_params = [p.detach().clone().requires_grad_() for p in model.parameters()]
        for rp, p in zip(ref_params, model.parameters()):
            rp.grad = p.grad.clone()
        ref_total, _ = ref.step(ref_params)
        total = guard.step()
        assert math.isfinite(ref_total) == (step not in (1, 5))
        assert total.isfinite().item() == math.isfinite(ref_total)
        if ref.initialized:
            assert guard.mean.item() == pytest.approx(ref.mean, rel=1e-5)
            assert guard.var.item() == pytest.approx(ref.var, rel=1e-4)
    assert guard.count.item() == 3 and math.isfinite(guard.mean.item())


@pytest.mark.parametrize("options, match", [
    ({"alpha": 0.0}, "alpha"), ({"alpha": 1.0}, "alpha"), ({"alpha": -0.5}, "alpha"), ({"alpha": 1.5}, "alpha"),
    ({"alpha": math.nan}, "alpha"), ({"z_thresh": -1.0}, "z_thresh"), ({"z_thresh": 0}, "z_thresh"),
    ({"clip_factor": 0.0}, "clip_factor"), ({"max_grad_norm": -1.0}, "max_grad_norm"),
    ({"max_grad_norm": math.inf}, "max_grad_norm"), ({"warmup_steps": -1}, "warmup_steps"),
    ({"warmup_steps": 2.5}, "warmup_steps"), ({"eps": -1e-6}, "eps"), ({"mode": "median"}, "mode"),
    ({"clip_option": "max"}, "clip_option"), ({"on_spike": "ignore"}, "on_spike"), ({"mode": None}, "mode"),
])
def test_bad_options_refused(options, match):
    hook = fh.grad_hook(stats=("norm",))
    with pytest.raises(ValueError, match=match):
        fh.zclip(hook, **options)


def test_hook_without_norm_refused():
    with pytest.raises(ValueError, match=r"add 'norm' to its stats="):
        fh.zclip(fh.grad_hook(stats=("mean", "max")))
    with pytest.raises(TypeError, match="fusedhooks hook"):
        fh.zclip(torch.nn.Linear(2, 2))
    fh.zclip(fh.grad_hook(stats=("sumsq",)))  # the norms follow from sumsq as well


@pytest.mark.parametrize("in_closure", [False, True], ids=["after_backward", "in_the_step_closure"])
def test_skip_armed_inside_the_steps_closure_skips_that_step(in_closure):
    """guard.step(opt) inside opt.step(closure) (as Lightning's on_before_optimizer_step runs), after the step's
    pre-hook: the spike's step is skipped all the same, and only that one."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    hook = fh.grad_hook(stats=("norm",), backend="eager")
    hook.register(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    guard = fh.zclip(hook, warmup_steps=3, on_spike="skip")
    x, y = torch.randn(16, 8), torch.randn(16, 4)
    skipped = []
    for step in range(8):
        def closure(scale=1000.0 if step == 5 else 1.0):
            opt.zero_grad()
            loss = ((model(x) - y) ** 2).mean() * scale
            loss.backward()
            if in_closure:
                guard.step(opt)
            return loss

        before = [p.detach().clone() for p in model.parameters()]
        if in_closure:
            opt.step(closure)
        else:
            closure()
            guard.step(opt)
            opt.step()
        skipped.append(all(torch.equal(b, p) for b, p in zip(before, model.parameters())))
        assert bool(guard.spike) == (step == 5)
        assert "found_inf" not in vars(opt)
    assert skipped == [step == 5 for step in range(8)]


def test_a_refused_fold_leaves_the_guards_state_as_it_was():
    """float64 gradients cannot be folded into a fused step (grad_scale is read as float32): refused before the
    rule advances, so a retry with optimizer=None counts the step once."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4).double()
    hook = fh.grad_hook(stats=("norm",), backend="eager")
    hook.register(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    guard = fh.zclip(hook, warmup_steps=3, max_grad_norm=0.1)
    model(torch.randn(16, 8, dtype=torch.float64)).pow(2).sum().backward()
    with pytest.raises(ValueError, match="float64 gradients"):
        guard.step(opt)
    assert guard.count.item() == 0 and guard.norms.tolist() == [0.0, 0.0, 0.0]
    guard.step(None)
    assert guard.count.item() == 1
