"""fh.clip_grad_norm_(..., optimizer=opt) with a fused optimizer: the coefficient folded into opt.grad_scale."""

import math

import pytest
import torch

import fusedhooks as fh
from fusedhooks.runtime import launcher

from helpers import FUSED_OPTIMIZERS, assert_close_after_steps, coef_rtol, mlp, optimizer_state, torch_fp32_norm_rtol

STEPS, MAX_NORM = 4, 0.5


def make_model(dtype, narrow=False):
    """narrow: a hidden width of 1, so that every parameter has fewer than 16 elements (see `narrow_for`)."""
    return mlp((8, 1 if narrow else 16, 5), dtype=dtype)


def narrow_for(name, dtype) -> bool:
    """torch 2.13's fused CPU SGD steps bfloat16 tensors of 16 or more elements wrongly (its parameters end up 0.4-0.9
    away from SGD(fused=False) after 3 steps, momentum or not; below 16 elements they agree), so the reference
    recipe and the fold are compared on a model whose parameters all have fewer than 16 elements there."""
    return name == "SGD" and dtype == torch.bfloat16


def train(make_optimizer, dtype, use_fh, backend, with_scaler=False, norm_type=2.0, inf_step=None, steps=STEPS,
          accumulation=1, narrow=False):
    """`steps` steps (each of `accumulation` micro-batches) of torch's recipe (clip_grad_norm_ after unscale_, then
    step) or of fusedhooks' (a statistics hook, with scaler= when there is a GradScaler, and
    fh.clip_grad_norm_(..., optimizer=opt)); the loss is large enough that every step clips. Returns (model,
    optimizer, total norms, scales)."""
    model = make_model(dtype, narrow)
    opt = make_optimizer(model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8) if with_scaler else None
    if use_fh:
        hook = fh.grad_hook(stats=("norm", "absmax"), backend=backend, scaler=scaler,
                            optimizer=opt if with_scaler else None)
        hook.register(model, accumulation_steps=accumulation)  # fires on the accumulated gradient
    gen = torch.Generator().manual_seed(1)
    totals, scales = [], []
    for step in range(steps):
        opt.zero_grad(set_to_none=step % 2 == 0)
        for _ in range(accumulation):
            x, y = torch.randn(16, 8, generator=gen).to(dtype), torch.randn(16, 5, generator=gen).to(dtype)
            loss = torch.nn.functional.mse_loss(model(x), y) * (20 / accumulation)
            if step == inf_step:
                loss = loss * math.inf
            if scaler is None:
                loss.backward()
            else:
                scaler.scale(loss).backward()
        if scaler is not None and not use_fh:
            scaler.unscale_(opt)
        if use_fh:
            totals.append(fh.clip_grad_norm_(hook, MAX_NORM, norm_type, optimizer=opt))
        else:
            totals.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, norm_type))
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        assert "grad_scale" not in vars(opt)  # consumed by this step, nothing left behind
    return model, opt, totals, scales


def assert_trains_as_torch(name, dtype, backend, fh_optimizer=None, **kwargs):
    """fusedhooks' recipe against torch's with the fused optimizer `name`; fh_optimizer: the optimizer of
    fusedhooks' recipe instead (the same hyper-parameters), which reads the fold as torch's fused step does."""
    kwargs["narrow"] = narrow_for(name, dtype)
    expected_model, expected_opt, expected_totals, expected_scales = train(FUSED_OPTIMIZERS[name], dtype, False,
                                                                           backend, **kwargs)
    model, opt, totals, scales = train(fh_optimizer or FUSED_OPTIMIZERS[name], dtype, True, backend, **kwargs)
    start = make_model(dtype, kwargs["narrow"])
    delta = coef_rtol(dtype, kwargs.get("norm_type", 2.0), [p.numel() for p in start.parameters()])
    assert scales == expected_scales
    for total, expected in zip(totals, expected_totals):
        assert total.dtype == expected.dtype
        torch.testing.assert_close(total, expected, rtol=delta, atol=0, equal_nan=True)
    steps = kwargs.get("steps", STEPS)
    for p, e, s in zip(model.parameters(), expected_model.parameters(), start.parameters()):
        assert_close_after_steps(p.detach(), e.detach(), s.detach(), delta, steps)
    state, expected_state = optimizer_state(opt), optimizer_state(expected_opt)
    assert len(state) == len(expected_state) > 0
    for t, e in zip(state, expected_state):
        assert t.dtype == e.dtype
        assert_close_after_steps(t, e, torch.zeros_like(e), delta, steps)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", FUSED_OPTIMIZERS)
def test_folded_clip_trains_as_torchs_clip_and_step(name, dtype, backend):
    assert_trains_as_torch(name, dtype, backend)


#: fusedhooks' optimizers, with the hyper-parameters of FUSED_OPTIMIZERS' torch optimizer of the same name
FH_OPTIMIZERS = {
    "AdamW": lambda params: fh.AdamW(params, lr=0.01, weight_decay=0.1),
    "SGD": lambda params: fh.SGD(params, lr=0.1, momentum=0.9),
}


@pytest.mark.parametrize("with_scaler", [False, True], ids=["plain", "grad_scaler"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", FH_OPTIMIZERS)
def test_clip_folded_into_fh_optimizers_trains_as_torchs_clip_and_fused_step(name, dtype, with_scaler):
    """fh.clip_grad_norm_(..., optimizer=fh.AdamW/fh.SGD) against torch's clip then torch's fused step (with a
    GradScaler: unscale_, clip, scaler.step; step 2 overflows, skipped by both)."""
    assert_trains_as_torch(name, dtype, "triton", fh_optimizer=FH_OPTIMIZERS[name], with_scaler=with_scaler,
                           inf_step=2 if with_scaler else None)


@pytest.mark.parametrize("name", FH_OPTIMIZERS)
def test_clip_folded_into_fh_optimizer_costs_no_pass_and_leaves_the_gradients(name, monkeypatch):
    """With fh's optimizers the fold launches nothing (the clip reads the hook's norms) and the step is the
    optimizer's one launch, which divides by grad_scale without writing the gradients back: `.grad` holds the
    unclipped gradient after the step, its version unchanged, and its statistics stay current."""
    params, opt, hook = small_setup("triton", FH_OPTIMIZERS[name])
    backward(params)
    grads = [p.grad.clone() for p in params]
    launched = []
    real_launch = launcher.launch

    def recording_launch(kernel, grid, args, meta, *rest):
        launched.append(kernel.fn.__name__ if hasattr(kernel, "fn") else kernel.__name__)
        return real_launch(kernel, grid, args, meta, *rest)

    monkeypatch.setattr(launcher, "launch", recording_launch)
    total = fh.clip_grad_norm_(hook, MAX_NORM, optimizer=opt)
    versions = [p.grad._version for p in params]
    assert launched == [] and opt.grad_scale.item() == (MAX_NORM / (total + 1e-6)).reciprocal().item()
    opt.step()
    assert launched == [f"{name.lower()}_kernel"]
    assert "grad_scale" not in vars(opt)
    assert all(torch.equal(p.grad, g) and p.grad._version == v for p, g, v in zip(params, grads, versions))
    assert fh.clip_grad_norm_(hook, math.inf).item() == total.item()  # the rows still describe the gradients


#: the 50-step runs: every fused optimizer on the eager backend; the Triton kernels (interpreted: 20x slower) with
#: AdamW. Not SGD in bfloat16: torch's fused CPU SGD is wrong there from 16 elements on (see `narrow_for`), and on the
#: narrow model momentum SGD rounds its bf16 parameters to a neighbour within a few steps, after which the two runs'
#: later norms drift apart by more than one step's rounding; the 4-step tests cover it on the narrow model.
FIFTY_STEP_CASES = [(name, "eager", dtype) for name in FUSED_OPTIMIZERS for dtype in (torch.float32, torch.bfloat16)
                    if not (name == "SGD" and dtype == torch.bfloat16)]
FIFTY_STEP_CASES += [("AdamW", "triton", dtype) for dtype in (torch.float32, torch.bfloat16)]


@pytest.mark.parametrize("with_scaler", [False, True], ids=["plain", "grad_scaler"])
@pytest.mark.parametrize("name, fifty_backend, dtype", FIFTY_STEP_CASES,
                         ids=lambda v: str(v).removeprefix("torch."))
def test_fifty_accumulated_steps_train_as_torchs(name, fifty_backend, dtype, with_scaler):
    """50 optimizer steps of 2 accumulated micro-batches each (the hook registered with accumulation_steps=2: it
    fires on the accumulated gradient), with and without a GradScaler (step 7 overflows). The fold does not depend
    on the backend (the 4-step tests above run every optimizer on every backend)."""
    assert_trains_as_torch(name, dtype, fifty_backend, steps=50, accumulation=2, with_scaler=with_scaler,
                           inf_step=7 if with_scaler else None)


@pytest.mark.parametrize("name", FUSED_OPTIMIZERS)
def test_folded_inf_norm_clip_trains_as_torchs(name, backend):
    """The inf norm is exact (absmax): only the fold's roundings differ from torch's product."""
    assert_trains_as_torch(name, torch.float32, backend, norm_type=math.inf)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", FUSED_OPTIMIZERS)
def test_folded_clip_with_grad_scaler_trains_as_torchs_recipe(name, dtype, backend):
    """With a scaler= hook (no unscale_ call) against scaler.unscale_ + clip_grad_norm_; step 2 overflows: skipped
    by both, and the scale backed off."""
    assert_trains_as_torch(name, dtype, backend, with_scaler=True, inf_step=2)


def small_setup(backend, make_optimizer=FUSED_OPTIMIZERS["Adam"]):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(7)), torch.nn.Parameter(torch.randn(3, 5))]
    opt = make_optimizer(params)
    hook = fh.grad_hook(stats=("norm",), backend=backend)
    hook.register(params)
    return params, opt, hook


def backward(params, scale=10.0):
    sum(((p * scale) ** 2).sum() for p in params).backward()


def test_the_fold_leaves_the_gradients_to_the_step(backend):
    """Which path ran: the gradients are untouched and opt.grad_scale is 1 / coef until the step, which divides the
    gradients (writing them back, their versions bumped) and takes grad_scale away."""
    params, opt, hook = small_setup(backend)
    backward(params)
    grads = [p.grad.clone() for p in params]
    total = fh.clip_grad_norm_(hook, MAX_NORM, optimizer=opt)
    assert all(torch.equal(p.grad, g) for p, g in zip(params, grads))
    coef = MAX_NORM / (total + 1e-6)
    assert opt.grad_scale.dtype == torch.float32 and opt.grad_scale.shape == ()
    assert opt.grad_scale.item() == coef.reciprocal().item()
    versions = [p.grad._version for p in params]
    opt.step()
    assert "grad_scale" not in vars(opt)
    assert all(p.grad._version > v for p, v in zip(params, versions))
    for p, g in zip(params, grads):
        torch.testing.assert_close(p.grad, g * coef, rtol=4 * 2.0 ** -24, atol=0)
    assert fh.clip_grad_norm_(hook, math.inf).item() == pytest.approx(MAX_NORM, rel=1e-5)  # re-measured


@pytest.mark.parametrize("first_fold_in_closure", [True, False], ids=["first", "after-a-plain-fold"])
def test_a_fold_in_the_steps_closure_is_consumed_by_that_step(backend, first_fold_in_closure):
    """Lightning clips inside the closure optimizer.step runs (after the step's pre-hooks): that step reads the fold
    and its post-hook takes it away and bumps the versions, as for a fold made before the step; also when the step
    hooks are first registered by that very fold. Two steps: the second sees no leftover coefficient."""
    params, opt, hook = small_setup(backend)
    expected = [p.detach().clone().requires_grad_() for p in params]
    expected_opt = FUSED_OPTIMIZERS["Adam"](expected)
    start = [p.detach().clone() for p in params]
    if not first_fold_in_closure:  # the step hooks are registered already
        backward(params)
        fh.clip_grad_norm_(hook, MAX_NORM, optimizer=opt)
        opt.step()
        backward(expected)
        torch.nn.utils.clip_grad_norm_(expected, MAX_NORM)
        expected_opt.step()
    for scale in (10.0, 20.0):
        seen = []

        def closure(scale=scale, seen=seen):
            opt.zero_grad()
            backward(params, scale)
            seen.append([p.grad.clone() for p in params])
            return fh.clip_grad_norm_(hook, MAX_NORM, optimizer=opt)

        def expected_closure(scale=scale):
            expected_opt.zero_grad()
            backward(expected, scale)
            return torch.nn.utils.clip_grad_norm_(expected, MAX_NORM)

        total = opt.step(closure)
        expected_total = expected_opt.step(expected_closure)
        assert "grad_scale" not in vars(opt)
        coef = MAX_NORM / (total + 1e-6)
        assert coef < 0.01  # it clips
        torch.testing.assert_close(total, expected_total, rtol=torch_fp32_norm_rtol([7, 15]), atol=0)
        for p, g in zip(params, seen[0]):
            torch.testing.assert_close(p.grad, g * coef, rtol=4 * 2.0 ** -24, atol=0)  # divided by the step
        delta = coef_rtol(torch.float32, 2.0, [7, 15])
        for p, e, s in zip(params, expected, start):
            assert_close_after_steps(p.detach(), e.detach(), s, delta, expected_opt.state[e]["step"].item())
    assert fh.clip_grad_norm_(hook, math.inf).item() == pytest.approx(MAX_NORM, rel=1e-5)  # versions bumped


def test_a_user_set_grad_scale_is_divided_by_the_coefficient_and_put_back(backend):
    params, opt, hook = small_setup(backend)
    backward(params)
    user_scale = torch.tensor(4.0)
    opt.grad_scale = user_scale
    total = fh.clip_grad_norm_(hook, MAX_NORM, optimizer=opt)
    assert opt.grad_scale.item() == (4.0 * (MAX_NORM / (total + 1e-6)).reciprocal()).item()
    opt.step()
    assert opt.grad_scale is user_scale


def test_a_step_that_raises_leaves_no_scale_behind(backend):
    """The fold of a step that raised is never applied again: the next step (without a clip) sees no grad_scale."""
    params, opt, hook = small_setup(backend)
    backward(params)
    fh.clip_grad_norm_(hook, MAX_NORM, optimizer=opt)
    handle = opt.register_step_pre_hook(raising_pre_hook)
    with pytest.raises(FloatingPointError):
        opt.step()
    handle.remove()
    reference = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ref_opt = FUSED_OPTIMIZERS["Adam"](reference)
    for p, r in zip(params, reference):
        r.grad = p.grad.clone()
    opt.step()                                                    # no clip this time: the gradients as they are
    ref_opt.step()
    assert "grad_scale" not in vars(opt)
    assert all(torch.equal(p, r) for p, r in zip(params, reference))


def raising_pre_hook(optimizer, args, kwargs):
    raise FloatingPointError("a step that raises")


def test_a_step_that_raises_inside_grad_scaler_step_leaves_no_scale_behind(backend):
    """GradScaler.step copies the fold (the optimizer being unscaled) and would keep it after a step that raised;
    the next iteration's clip replaces it, and its step divides by that one coefficient only."""
    params, opt, hook = small_setup(backend)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    backward(params)
    scaler.scale(torch.ones(()))
    scaler.unscale_(opt)                                          # nothing to unscale: the loss was not scaled
    fh.clip_grad_norm_(hook, MAX_NORM, optimizer=opt)
    handle = opt.register_step_pre_hook(raising_pre_hook)
    with pytest.raises(FloatingPointError):
        scaler.step(opt)
    handle.remove()
    opt.zero_grad()
    scaler.update()
    backward(params, scale=100.0)
    scaler.unscale_(opt)
    total = fh.clip_grad_norm_(hook, MAX_NORM, optimizer=opt)
    grads = [p.grad.clone() for p in params]
    scaler.step(opt)
    scaler.update()
    assert "grad_scale" not in vars(opt) and "found_inf" not in vars(opt)
    for p, g in zip(params, grads):
        torch.testing.assert_close(p.grad, g * (MAX_NORM / (total + 1e-6)), rtol=4 * 2.0 ** -24, atol=0)


def test_refusals(backend):
    params, opt, hook = small_setup(backend)
    backward(params)
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        fh.clip_grad_norm_(hook, MAX_NORM, optimizer=object())
    other = torch.nn.Parameter(torch.ones(2))
    other.grad = torch.ones(2)
    with pytest.raises(ValueError, match="exactly the parameters the hook clips"):
        fh.clip_grad_norm_(hook, MAX_NORM, optimizer=FUSED_OPTIMIZERS["Adam"]([*params, other]))
    fh.clip_grad_norm_(hook, MAX_NORM, optimizer=opt)
    with pytest.raises(RuntimeError, match="clip once per step"):
        fh.clip_grad_norm_(hook, MAX_NORM, optimizer=opt)
    params[0].grad.mul_(2.0)                                      # an edit between the clip and the step
    with pytest.raises(RuntimeError, match="gradients changed"):
        opt.step()
    assert "grad_scale" not in vars(opt)
    params64 = [torch.nn.Parameter(torch.randn(3, dtype=torch.float64))]
    hook64 = fh.grad_hook(stats=("norm",), backend=backend)
    hook64.register(params64)
    backward(params64)
    with pytest.raises(ValueError, match="float64"):
        fh.clip_grad_norm_(hook64, MAX_NORM, optimizer=FUSED_OPTIMIZERS["Adam"](params64))


def test_a_new_backward_after_an_unstepped_fold_is_clipped_once():
    """An iteration dropped between the clip and the step (zero_grad, a new backward): its fold is replaced."""
    params, opt, hook = small_setup("eager")
    backward(params)
    fh.clip_grad_norm_(hook, MAX_NORM, optimizer=opt)
    opt.zero_grad()
    backward(params, scale=3.0)
    total = fh.clip_grad_norm_(hook, MAX_NORM, optimizer=opt)
    assert opt.grad_scale.item() == (MAX_NORM / (total + 1e-6)).reciprocal().item()


def test_a_non_fused_optimizer_takes_the_scaling_path_bit_for_bit(backend):
    results = []
    for make_optimizer in (None, torch.optim.Adam, lambda params: torch.optim.SGD(params, lr=0.1)):
        params, _, hook = small_setup(backend)
        opt = make_optimizer(params) if make_optimizer else None
        backward(params)
        total = fh.clip_grad_norm_(hook, MAX_NORM, optimizer=opt)
        assert opt is None or "grad_scale" not in vars(opt)
        results.append((total, [p.grad for p in params]))
    for total, grads in results[1:]:
        assert torch.equal(total, results[0][0])
        assert all(torch.equal(g, e) for g, e in zip(grads, results[0][1]))


def test_the_fold_in_a_compiled_function_runs_eagerly_or_is_refused():
    """dynamo runs the call eagerly (the fold as outside torch.compile); where it would trace it, the call raises
    RuntimeError (not supported under torch.compile): never a fold traced into a graph."""
    params, opt, hook = small_setup("eager")

    @torch.compile(backend="eager")
    def clip(x):
        return fh.clip_grad_norm_(hook, MAX_NORM, optimizer=opt) * x

    backward(params)
    try:
        total = clip(torch.ones(()))
    except RuntimeError as e:
        assert "not supported under torch.compile" in str(e)
        assert "grad_scale" not in vars(opt)
        return
    assert opt.grad_scale.item() == (MAX_NORM / (total + 1e-6)).reciprocal().item()
    opt.step()
    assert "grad_scale" not in vars(opt)
