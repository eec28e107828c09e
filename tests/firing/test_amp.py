"""AMP: a hook with scaler= unscales in its own pass and keeps GradScaler's books like unscale_()."""

import copy
import functools

import pytest
import torch

import fusedhooks as fh

from helpers import FLOAT_DTYPES, FUSED_OPTIMIZERS, ROOT, RaisingBackward, assert_same_values, mlp, optimizer_state


def make_model():
    return mlp((8, 16, 4))


def train(model, steps, use_hook, backend, clip=0.05, inf_steps=(7,), make_optimizer=None):
    if make_optimizer is None:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    else:
        opt = make_optimizer(model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=3)
    if use_hook:
        hook = fh.grad_hook(lambda grad: grad.clamp(-clip, clip), stats=("norm", "inf"), input_stats=("nan",),
                            scaler=scaler, optimizer=opt, backend=backend)
        hook.register(model)
    gen = torch.Generator().manual_seed(1)
    scales, skipped = [], []
    for step in range(steps):
        x = torch.randn(32, 8, generator=gen)
        y = torch.randn(32, 4, generator=gen)
        opt.zero_grad(set_to_none=step % 2 == 0)
        loss = torch.nn.functional.mse_loss(model(x), y)
        if step in inf_steps:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        if not use_hook:
            scaler.unscale_(opt)
            for p in model.parameters():
                p.grad.clamp_(-clip, clip)
        before = [p.detach().clone() for p in model.parameters()]
        scaler.step(opt)
        scaler.update()
        skipped.append(all(torch.equal(b, p) for b, p in zip(before, model.parameters())))
        scales.append(scaler.get_scale())
    if make_optimizer is not None:
        return scales, skipped, opt
    return scales, skipped


def test_amp_loop_is_bit_identical_to_unscale_and_step(backend):
    reference, hooked = make_model(), make_model()
    hooked.load_state_dict(copy.deepcopy(reference.state_dict()))
    ref_scales, ref_skipped = train(reference, 20, use_hook=False, backend=backend)
    scales, skipped = train(hooked, 20, use_hook=True, backend=backend)
    assert skipped == ref_skipped and skipped[7] and not skipped[6]
    assert scales == ref_scales and scales[7] < scales[6]           # backed off after the Inf step
    for p, q in zip(reference.parameters(), hooked.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("name", FUSED_OPTIMIZERS)
def test_a_fused_optimizer_steps_as_with_torchs_unscale(name, backend):
    """torch's fused optimizers (fused=True) take GradScaler's found_inf, summed over devices, as their own and
    subtract it from their 0-dim step counts: the hook's found_inf is 0-dim as torch's (a [1] one made _fused_adam
    raise "output with shape [] doesn't match the broadcast shape [1]"). The hook unscales with the same fp32
    multiplication as scaler.unscale_, and the step then runs the same fused kernel on the same gradients:
    parameters, optimizer state and scales equal torch's recipe exactly (0 ulps), the overflow step (3) skipped
    and the scale backed off."""
    reference, hooked = make_model(), make_model()
    hooked.load_state_dict(copy.deepcopy(reference.state_dict()))
    run = functools.partial(train, steps=6, backend=backend, inf_steps=(3,), make_optimizer=FUSED_OPTIMIZERS[name])
    ref_scales, ref_skipped, ref_opt = run(reference, use_hook=False)
    scales, skipped, opt = run(hooked, use_hook=True)
    assert skipped == ref_skipped and skipped[3] and not any(skipped[:3] + skipped[4:])
    assert scales == ref_scales and scales[3] == scales[2] / 2                   # backed off after the Inf step
    for p, q in zip(reference.parameters(), hooked.parameters()):
        assert_same_values(q.detach(), p.detach())
    state, expected_state = optimizer_state(opt), optimizer_state(ref_opt)
    assert len(state) == len(expected_state) > 0
    for s, e in zip(state, expected_state):
        assert_same_values(s, e)


@pytest.mark.parametrize("dtype", [d for d in FLOAT_DTYPES if d != torch.float16],
                         ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("with_inf", [False, True])
def test_unscale_matches_torch_and_sets_found_inf(dtype, with_inf, backend, monkeypatch):
    monkeypatch.setenv("FUSEDHOOKS_BLOCK", "128")
    p = torch.zeros(1000, dtype=dtype, requires_grad=True)
    opt = torch.optim.SGD([p], lr=1.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=3.0 * 2.0 ** 7)
    scaler.scale(torch.ones(()))                                      # creates the scale tensor
    grad = (torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 300).to(dtype)
    if with_inf:
        grad[999] = float("inf")
    expected = grad.clone()
    found_ref = torch.zeros(())                                       # 0-dim, as scaler.unscale_ makes it
    torch._amp_foreach_non_finite_check_and_unscale_([expected], found_ref, scaler._scale.double().reciprocal().float())
    hook = fh.grad_hook(stats=("max",), scaler=scaler, optimizer=opt, backend=backend)
    hook.register(p)
    p.grad = grad
    hook(p)
    assert_same_values(p.grad, expected)
    found = scaler._per_optimizer_states[id(opt)]["found_inf_per_device"][torch.device("cpu")]
    assert found.item() == found_ref.item() == float(with_inf) and found.shape == found_ref.shape
    assert hook.plan(numel=1000, dtype=dtype).writes == 1             # unscaling writes even without a body


def test_float16_gradients_are_refused_as_torch_refuses_them(backend):
    """GradScaler.unscale_ refuses float16 gradients; scaler= refuses them too: at register, and at the firing of a
    parameter converted to float16 after it."""
    p = torch.zeros(8, dtype=torch.float16, requires_grad=True)
    opt = torch.optim.SGD([p], lr=1.0)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(torch.ones(()))
    p.grad = torch.ones(8, dtype=torch.float16)
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        scaler.unscale_(opt)                                          # torch's own refusal
    hook = fh.grad_hook(lambda g: g.clamp(-1, 1), scaler=scaler, optimizer=opt, backend=backend)
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        hook.register(p)
    assert hook.stats.names == []
    layer = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(layer.parameters(), lr=1.0)
    scaler = torch.amp.GradScaler("cpu")
    fh.grad_hook(lambda g: g.clamp(-1, 1), scaler=scaler, optimizer=opt, backend=backend).register(layer)
    layer.half()
    with pytest.raises(ValueError, match="scaler= unscales the gradients as GradScaler.unscale_ does"):
        scaler.scale(layer(torch.randn(2, 4, dtype=torch.float16)).float().sum()).backward()


def test_amp_misuse_is_refused():
    p = torch.zeros(3, requires_grad=True)
    q = torch.zeros(3, requires_grad=True)
    opt = torch.optim.SGD([p, q], lr=1.0)
    scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(ValueError, match="go together"):
        fh.grad_hook(stats="norm", scaler=scaler)
    with pytest.raises(TypeError, match="GradScaler"):
        fh.grad_hook(stats="norm", scaler=object(), optimizer=opt)
    hook = fh.grad_hook(stats="norm", scaler=scaler, optimizer=opt)
    hook.register(p)                                                  # q is not covered
    with pytest.raises(RuntimeError, match="every parameter the optimizer steps"):
        scaler.scale((p * 2).sum() + (q * 2).sum()).backward()        # refused in the first firing
    p2, q2 = torch.zeros(3, requires_grad=True), torch.zeros(3, requires_grad=True)
    opt2 = torch.optim.SGD([p2, q2], lr=1.0)
    hook2 = fh.grad_hook(stats="norm", scaler=scaler, optimizer=opt2)
    hook2.register([p2, q2])
    p2.grad, q2.grad = torch.ones(3), torch.ones(3)
    scaler.unscale_(opt2)                                             # the user unscaled already
    with pytest.raises(RuntimeError, match="do not call"):
        hook2(p2)


@pytest.mark.parametrize("bucket_mb", [None, 25])
def test_torch_unscale_then_clip_grad_norm_reads_the_unscaled_norms(backend, bucket_mb):
    """torch's AMP recipe with a statistics hook: scaler.unscale_(opt), then fh.clip_grad_norm_. The unscale writes
    the gradients without bumping their versions; fusedhooks bumps them, so the norms recorded on the scaled
    gradients are not taken for the unscaled ones: the same total norm and gradients as torch's clip."""
    results = []
    for use_fh in (True, False):
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        if use_fh:
            hook = fh.grad_hook(stats=("norm",), backend=backend)
            hook.register(model, bucket_mb=bucket_mb)
        x = torch.randn(32, 8, generator=torch.Generator().manual_seed(1))
        scaler.scale(model(x).square().sum()).backward()
        scaler.unscale_(opt)
        if use_fh:
            total = fh.clip_grad_norm_(hook, 1.0)
        else:
            total = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        results.append((total, [p.grad for p in model.parameters()]))
    (total, grads), (expected_total, expected_grads) = results
    torch.testing.assert_close(total, expected_total, rtol=1e-6, atol=0)
    for g, e in zip(grads, expected_grads):
        torch.testing.assert_close(g, e, rtol=1e-6, atol=0)


def test_importing_fusedhooks_patches_nothing_in_torch_until_a_statistics_hook_is_made():
    """In a fresh interpreter: GradScaler's attributes are the same objects after `import fusedhooks`; the first hook
    recording statistics (which fh.clip_grad_norm_ may read after scaler.unscale_) wraps _unscale_grads_."""
    import subprocess
    import sys

    code = """if True:
        import torch
        from torch.amp import GradScaler
        before = dict(vars(GradScaler))
        import fusedhooks as fh
        assert dict(vars(GradScaler)) == before, set(vars(GradScaler).items()) ^ set(before.items())
        fh.grad_hook(lambda grad: grad * 2.0)                       # no statistics: nothing to protect
        assert dict(vars(GradScaler)) == before
        fh.grad_hook(stats=("norm",))
        assert vars(GradScaler)["_unscale_grads_"] is not before["_unscale_grads_"]
    """
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            cwd=ROOT)  # this checkout's fusedhooks
    assert result.returncode == 0, result.stderr


def test_a_grad_scaler_subclass_defined_later_bumps_versions_too():
    """FSDP's ShardedGradScaler overrides _unscale_grads_ and may be defined after fusedhooks is imported."""
    fh.grad_hook(stats=("norm",))                                      # the first statistics hook installs the wrap
    class MyScaler(torch.amp.GradScaler):
        def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
            return super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)

    class MyOtherScaler(torch.amp.GradScaler):   # no override: inherits the wrapped one
        pass

    for cls in (MyScaler, MyOtherScaler):
        p = torch.nn.Parameter(torch.ones(3))
        p.grad = torch.full((3,), 8.0)
        opt = torch.optim.SGD([p], lr=0.1)
        scaler = cls("cpu", init_scale=8.0)
        scaler.scale(torch.ones(()))  # sets the scale
        version = p.grad._version
        scaler.unscale_(opt)
        assert torch.equal(p.grad, torch.ones(3)) and p.grad._version > version, cls.__name__



@pytest.mark.parametrize("bucket_mb", [None, 25], ids=["per-firing", "buckets"])
def test_accumulation_unscales_once_per_step_and_a_second_unscale_is_refused(backend, bucket_mb):
    """Two micro-batches per step: a scaler= hook registered with accumulation_steps=2 unscales the accumulated
    gradient once, as torch's recipe (scaler.unscale_ after both backwards); firing at both backwards would add the
    second one's scaled gradient to the unscaled first one (half the gradient, silently): refused, as torch refuses
    a second unscale_ before update(), with a message that says what to do."""
    def run(use_hook, accumulation_steps=2):
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
        if use_hook:
            fh.grad_hook(lambda grad: grad.clamp(-0.05, 0.05), scaler=scaler, optimizer=opt,
                         backend=backend).register(model, bucket_mb=bucket_mb, accumulation_steps=accumulation_steps)
        gen = torch.Generator().manual_seed(3)
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            for _ in range(2):
                scaler.scale(model(torch.randn(8, 8, generator=gen)).square().mean()).backward()
            if not use_hook:
                scaler.unscale_(opt)
                for p in model.parameters():
                    p.grad.clamp_(-0.05, 0.05)
            scaler.step(opt)
            scaler.update()
        return [p.detach() for p in model.parameters()]

    assert all(torch.equal(p, e) for p, e in zip(run(True), run(False)))
    with pytest.raises(RuntimeError, match="already unscaled this gradient since the last scaler.update.*"
                                           "accumulation_steps"):
        run(True, accumulation_steps=None)


@pytest.mark.parametrize("bucket_mb", [None, 25], ids=["per-firing", "buckets"])
def test_a_dropped_iteration_is_no_second_unscale(backend, bucket_mb):
    """A backward, then the iteration dropped (zero_grad(set_to_none=True), no step): the next backward's new
    gradients are unscaled as usual, the step equal to torch's recipe on that backward alone."""
    def run(use_hook):
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
        if use_hook:
            fh.grad_hook(scaler=scaler, optimizer=opt, backend=backend).register(model, bucket_mb=bucket_mb)
        x = torch.randn(8, 8, generator=torch.Generator().manual_seed(4))
        scaler.scale(model(x).square().mean()).backward()
        opt.zero_grad(set_to_none=True)  # dropped
        scaler.scale(model(x * 2).square().mean()).backward()
        if not use_hook:
            scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        return [p.detach() for p in model.parameters()]

    assert all(torch.equal(p, e) for p, e in zip(run(True), run(False)))


def test_a_parameter_inside_and_after_a_reentrant_checkpoint_is_not_unscaled_twice(backend):
    """A layer used inside a reentrant checkpoint and again after it: its gradient accumulates in the outer and in the
    nested backward, each firing once, the second on the already unscaled gradient plus scaled values (silently
    wrong before): refused."""
    from torch.utils.checkpoint import checkpoint

    layer = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    fh.grad_hook(scaler=scaler, optimizer=opt, backend=backend).register(layer)
    x = torch.randn(3, 4, requires_grad=True)
    with pytest.raises(RuntimeError, match="fired twice on one gradient in the same backward"):
        scaler.scale(layer(checkpoint(layer, x, use_reentrant=True)).sum()).backward()


@pytest.mark.parametrize("bucket_mb", [None, 25], ids=["per-firing", "buckets"])
@pytest.mark.parametrize("backwards_per_step", [1, 2])
def test_a_backward_that_raises_leaves_the_scalers_books_as_they_were(backend, bucket_mb, backwards_per_step):
    """The failed backward's last layer fires on an overflowing gradient, then the backward raises; the loop drops
    the iteration (zero_grad) and runs a clean one, of one backward or of two (on disjoint layers, their found_inf
    summed). torch's recipe never reached unscale_ in the failed iteration: the clean step is taken, the scale kept;
    an overflow in the clean iteration's first backward still skips its step."""
    def run(use_hook, overflow_in_clean_step):
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
        if use_hook:
            fh.grad_hook(lambda grad: grad.clamp(-1.0, 1.0), scaler=scaler, optimizer=opt,
                         backend=backend).register(model, bucket_mb=bucket_mb)
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(2))
        with pytest.raises(FloatingPointError):
            scaler.scale(model[2](RaisingBackward.apply(model[1](model[0](x)))).sum() * float("inf")).backward()
        opt.zero_grad(set_to_none=True)
        first = float("inf") if overflow_in_clean_step else 1.0
        if backwards_per_step == 1:
            scaler.scale(model(x).sum() * first).backward()
        else:
            hidden = model[1](model[0](x))
            scaler.scale(model[2](hidden.detach()).sum() * first).backward()
            scaler.scale(hidden.sum()).backward()
        if not use_hook:
            scaler.unscale_(opt)
            for p in model.parameters():
                p.grad.clamp_(-1.0, 1.0)
        before = [p.detach().clone() for p in model.parameters()]
        scaler.step(opt)
        scaler.update()
        stepped = not all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
        return stepped, scaler.get_scale(), [p.detach() for p in model.parameters()]

    for overflow in (False, True):
        stepped, scale, params = run(True, overflow)
        expected_stepped, expected_scale, expected = run(False, overflow)
        assert (stepped, scale) == (expected_stepped, expected_scale) == (not overflow, 2.0 if overflow else 4.0)
        assert all(torch.equal(p, e) for p, e in zip(params, expected))


def test_an_overflow_in_one_threads_backward_survives_another_threads_backward(backend):
    """Two backwards on one scaler= hook overlap in two threads: the first fires on an Inf gradient and is still
    running when the second fires. torch's recipe (unscale_ after both) skips the step and backs the scale off."""
    import threading

    released, fired = threading.Event(), threading.Event()

    class Wait(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            fired.set()
            assert released.wait(30)
            return grad

    def run(use_hook):
        w1, w2 = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4))
        opt = torch.optim.SGD([w1, w2], lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4)
        if use_hook:
            fh.grad_hook(lambda grad: grad.clamp(-1.0, 1.0), scaler=scaler, optimizer=opt,
                         backend=backend).register([w1, w2])

        def first():  # w1 fires on an Inf gradient, then the backward waits inside Wait
            z = Wait.apply(torch.ones(1, requires_grad=True))
            scaler.scale((w1 * float("inf")).sum() + z.sum()).backward()

        thread = threading.Thread(target=first)
        thread.start()
        assert fired.wait(30)
        scaler.scale((w2 * 2.0).sum()).backward()  # a finite gradient, in this thread, while the first runs
        released.set()
        thread.join(30)
        assert not thread.is_alive()
        fired.clear()
        released.clear()
        if not use_hook:
            scaler.unscale_(opt)
        before = [w1.detach().clone(), w2.detach().clone()]
        scaler.step(opt)
        scaler.update()
        return torch.equal(before[0], w1) and torch.equal(before[1], w2), scaler.get_scale()

    assert run(True) == run(False) == (True, 8.0)  # skipped, backed off
