"""register(..., accumulation_steps=n | when=fn): the hook processes the last micro-batch of every n, on the
accumulated gradient, and does nothing in the others; compared with an eager hook paused by hand."""

import pytest
import torch
import torch.utils.checkpoint

import fusedhooks as fh

from helpers import RaisingBackward


def _clip_hook(backend):
    return fh.grad_hook(lambda grad: grad.clamp(-0.5, 0.5) * 0.5, stats=("norm", "count"), backend=backend)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))


def _batches(n):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(4, 5, generator=g) * 3 for _ in range(n)]


def _expected(micro_batches, steps):
    """Eager torch: accumulate, clamp and scale once on the last micro-batch of every `steps`, then step."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i, x in enumerate(micro_batches):
        model(x).pow(2).sum().backward()
        if (i + 1) % steps == 0:
            for p in model.parameters():
                p.grad.clamp_(-0.5, 0.5).mul_(0.5)
            opt.step()
            opt.zero_grad()
    return model


@pytest.mark.parametrize("bucket_mb", [None, 25], ids=["per-firing", "buckets"])
@pytest.mark.parametrize("steps", [1, 2, 3])
def test_accumulation_steps_process_the_last_micro_batch_only(steps, bucket_mb, backend):
    model = _model()
    hook = _clip_hook(backend)
    hook.register(model, accumulation_steps=steps, bucket_mb=bucket_mb)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = _batches(6)
    last = {}
    for i, x in enumerate(batches):
        model(x).pow(2).sum().backward()
        if (i + 1) % steps:
            assert hook.stats.read() == last  # nothing fired
        else:
            last = hook.stats.read()
            norms = {name: row["norm"] for name, row in hook.stats.read().items()}
            grads = {name: p.grad.clone() for name, p in model.named_parameters()}
            for name, g in grads.items():
                assert abs(norms[name] - g.double().norm().item()) <= 1e-5 * norms[name]
                assert g.abs().max() <= 0.25
            opt.step()
            opt.zero_grad()
    for p, q in zip(model.parameters(), _expected(batches, steps).parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_accumulation_steps_one_is_every_backward():
    hook = _clip_hook("reference")
    handle = hook.register(_model(), accumulation_steps=1)
    assert handle.when is None


def test_when_decides_at_each_firing(backend):
    model = _model()
    hook = _clip_hook(backend)
    steps = []
    hook.register(model, when=lambda: steps[-1])
    for step in (False, True, False):
        steps.append(step)
        model(_batches(1)[0]).sum().backward()
    # the second backward was processed, the third was not: the accumulated gradient is clip(g1 + g2) + g3
    model2 = _model()
    for i in range(3):
        model2(_batches(1)[0]).sum().backward()
        if i == 1:
            for p in model2.parameters():
                p.grad.clamp_(-0.5, 0.5).mul_(0.5)
    for p, q in zip(model.parameters(), model2.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7)


def test_reentrant_checkpoint_backward_is_one_micro_batch():
    """The nested backward of reentrant checkpointing belongs to the outer micro-batch."""
    torch.manual_seed(0)
    first, second = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
    hook = _clip_hook("reference")
    handle = hook.register([("first.weight", first.weight), ("second.weight", second.weight)],
                           accumulation_steps=2)
    x = torch.randn(3, 4, requires_grad=True)  # reentrant checkpointing needs an input that requires grad
    for i in range(2):
        h = torch.utils.checkpoint.checkpoint(first, x, use_reentrant=True)
        second(h).sum().backward()
        assert handle.when.backwards == i + 1
        assert sorted(hook.stats.read()) == ([] if i == 0 else ["first.weight", "second.weight"])


def test_a_backward_that_raises_is_not_counted_and_leaves_no_state():
    model = _model()
    hook = _clip_hook("reference")
    handle = hook.register(model, accumulation_steps=2)

    class Boom(Exception):
        pass

    def fail(grad):
        raise Boom

    # the last layer's gradient fires, then autograd reaches the hook that raises: the backward is not counted
    model[0].weight.register_hook(fail)
    with pytest.raises(Boom):
        model(_batches(1)[0]).sum().backward()
    model.zero_grad()
    model[0].weight._backward_hooks.clear()
    model(_batches(1)[0]).sum().backward()  # the first micro-batch
    assert handle.when.backwards == 1
    assert hook.stats.read() == {}
    model(_batches(1)[0]).sum().backward()  # the second micro-batch: processed
    assert handle.when.backwards == 2
    assert sorted(hook.stats.read()) == ["0.bias", "0.weight", "2.bias", "2.weight"]


@pytest.mark.parametrize("bad", [0, -1, 2.5, "2", True])
def test_accumulation_steps_refuses_what_is_not_a_count(bad):
    with pytest.raises(ValueError, match="accumulation_steps= takes a whole number"):
        _clip_hook("reference").register(_model(), accumulation_steps=bad)


def test_when_refuses_a_non_callable_and_both_options():
    with pytest.raises(TypeError, match="when= takes a function"):
        _clip_hook("reference").register(_model(), when=True)
    with pytest.raises(ValueError, match="not both"):
        _clip_hook("reference").register(_model(), when=lambda: True, accumulation_steps=2)


def test_accumulation_follows_the_handle_until_removed():
    model = _model()
    hook = _clip_hook("reference")
    handle = hook.register(model, accumulation_steps=2)
    model(_batches(1)[0]).sum().backward()
    assert hook.stats.read() == {}
    handle.remove()
    model(_batches(1)[0]).sum().backward()
    assert hook.stats.read() == {}


def test_a_paused_backward_is_no_micro_batch():
    """A backward inside hook.paused() (an extra gradient computed between micro-batches) does not count towards
    accumulation_steps=: the hook still processes the last micro-batch of every n, as an eager hook paused the
    same way would."""
    model = _model()
    hook = _clip_hook("reference")
    handle = hook.register(model, accumulation_steps=2)
    with hook.paused():
        model(_batches(1)[0]).sum().backward()
    model.zero_grad()
    assert handle.when.backwards == 0 and hook.stats.read() == {}
    batches = _batches(2)
    model(batches[0]).pow(2).sum().backward()
    assert hook.stats.read() == {}  # the first micro-batch: nothing processed
    model(batches[1]).pow(2).sum().backward()
    assert handle.when.backwards == 2 and sorted(hook.stats.read()) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    expected = _model()
    for x in batches:
        expected(x).pow(2).sum().backward()
    for p, q in zip(model.parameters(), expected.parameters()):
        torch.testing.assert_close(p.grad, q.grad.clamp(-0.5, 0.5) * 0.5, rtol=1e-6, atol=1e-7)



@pytest.mark.parametrize("bucket_mb", [None, 25], ids=["per-firing", "buckets"])
def test_a_backward_that_raises_is_no_micro_batch(bucket_mb, backend):
    """The loop drops the failed micro-batch (zero_grad) and goes on: the next two backwards are micro-batches 1
    and 2, the second processed, as with an eager hook gated by a count of the backwards that completed."""
    model = _model()
    hook = _clip_hook(backend)
    hook.register(model, accumulation_steps=2, bucket_mb=bucket_mb)
    batches = _batches(3)
    with pytest.raises(FloatingPointError):
        model[2](RaisingBackward.apply(model[1](model[0](batches[0])))).pow(2).sum().backward()
    model.zero_grad(set_to_none=True)
    model(batches[1]).pow(2).sum().backward()
    model(batches[2]).pow(2).sum().backward()
    expected = _model()
    for x in batches[1:]:
        expected(x).pow(2).sum().backward()
    for p, q in zip(model.parameters(), expected.parameters()):
        assert torch.equal(p.grad, q.grad.clamp(-0.5, 0.5) * 0.5)
    assert all(row.fresh for row in hook.stats.read().values())
