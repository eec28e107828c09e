"""torch.compile and compiled autograd: the same gradients and statistics as eager, and no graph break caused by
fusedhooks (a registered hook is one `fusedhooks::process` op in the traced backward)."""

import pytest
import torch
from torch._dynamo.utils import counters

import fusedhooks as fh


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _hook(backend):
    return fh.grad_hook(lambda grad: grad.clamp(-0.05, 0.05) * 0.5, stats=("norm", "max", "nan"),
                        input_stats=("absmax",), backend=backend)


def _batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(5, 4, generator=g) for _ in range(3)]


def _eager_run(backend, bucket_mb=None):
    model, hook = _model(), _hook(backend)
    hook.register(model, bucket_mb=bucket_mb)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x in _batches():
        opt.zero_grad()
        model(x).pow(2).sum().backward()
        opt.step()
    return model, hook


def _graph_breaks():
    return sum(counters["graph_break"].values())


def _compiled_autograd_run(backend, compile_backend, bucket_mb=None, hooked=True):
    torch._dynamo.reset()
    counters.clear()
    model = _model()
    hook = _hook(backend)
    if hooked:
        hook.register(model, bucket_mb=bucket_mb)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x in _batches():
        opt.zero_grad()
        loss = model(x).pow(2).sum()
        with torch._dynamo.compiled_autograd._enable(torch.compile(backend=compile_backend)):
            loss.backward()
        opt.step()
    return model, hook, _graph_breaks()


def _assert_same(model, hook, expected_model, expected_hook):
    for p, q in zip(model.parameters(), expected_model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-8)
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-8)
    got, expected = hook.stats.read(), expected_hook.stats.read()
    assert sorted(got) == sorted(expected) and not got.stale
    for name in expected:
        assert got[name] == pytest.approx(expected[name], rel=1e-6)


@pytest.mark.parametrize("bucket_mb", [None, 25], ids=["per-firing", "buckets"])
@pytest.mark.parametrize("compile_backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("backend", ["triton", "eager"])
def test_compiled_autograd_equals_eager_without_graph_breaks(backend, compile_backend, bucket_mb):
    expected_model, expected_hook = _eager_run(backend)
    _, _, baseline_breaks = _compiled_autograd_run(backend, compile_backend, hooked=False)
    model, hook, breaks = _compiled_autograd_run(backend, compile_backend, bucket_mb)
    assert breaks == baseline_breaks == 0
    _assert_same(model, hook, expected_model, expected_hook)
    assert model[0].weight.grad.abs().max() <= 0.025  # the body ran on the compiled backward's gradients


def test_compiled_step_with_inductor():
    """A torch.compile'd model (inductor) with compiled autograd over its backward."""
    expected_model, expected_hook = _eager_run("triton")
    torch._dynamo.reset()
    counters.clear()
    model, hook = _model(), _hook("triton")
    hook.register(model)
    compiled = torch.compile(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x in _batches():
        opt.zero_grad()
        loss = compiled(x).pow(2).sum()
        with torch._dynamo.compiled_autograd._enable(torch.compile()):
            loss.backward()
        opt.step()
    assert _graph_breaks() == 0
    for p, q in zip(model.parameters(), expected_model.parameters()):  # inductor's matmuls round differently
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    got, expected = hook.stats.read(), expected_hook.stats.read()
    for name in expected:
        assert got[name] == pytest.approx(expected[name], rel=1e-4, abs=1e-7)


@pytest.mark.parametrize("backend", ["triton", "eager"])
def test_compiled_forward_runs_hooks_eagerly(backend):
    """torch.compile(model) alone: the backward's AccumulateGrad runs the hooks as usual."""
    expected_model, expected_hook = _eager_run(backend)
    torch._dynamo.reset()
    counters.clear()
    model, hook = _model(), _hook(backend)
    hook.register(model)
    compiled = torch.compile(model, backend="aot_eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x in _batches():
        opt.zero_grad()
        compiled(x).pow(2).sum().backward()
        opt.step()
    assert _graph_breaks() == 0
    _assert_same(model, hook, expected_model, expected_hook)


def test_hook_registered_through_torch_runs_outside_the_graph():
    """t.register_post_accumulate_grad_hook(hook): found at its firing, so it runs eagerly (one graph break),
    with eager's results."""
    def run(compiled):
        torch._dynamo.reset()
        counters.clear()
        w = torch.nn.Parameter(torch.tensor([0.5, -2.0, 3.0]))
        hook = _hook("triton")
        w.register_post_accumulate_grad_hook(hook)
        loss = (w * torch.tensor([0.01, -1.0, 2.0])).sum()
        if compiled:
            with torch._dynamo.compiled_autograd._enable(torch.compile(backend="eager")):
                loss.backward()
        else:
            loss.backward()
        return w.grad, hook.stats.read(), _graph_breaks()

    grad, stats, _ = run(False)
    grad_c, stats_c, breaks = run(True)
    expected = (torch.tensor([0.01, -1.0, 2.0]).clamp(-0.05, 0.05) * 0.5)
    assert torch.equal(grad, grad_c) and stats == stats_c and torch.equal(grad, expected)
    assert breaks >= 1


def test_paused_hook_under_compiled_autograd_does_nothing():
    torch._dynamo.reset()
    model, hook = _model(), _hook("triton")
    hook.register(model)
    x = _batches()[0]
    reference = _model()
    reference(x).pow(2).sum().backward()
    with hook.paused(), torch._dynamo.compiled_autograd._enable(torch.compile(backend="eager")):
        model(x).pow(2).sum().backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    assert hook.stats.read() == {}
    model.zero_grad()
    with torch._dynamo.compiled_autograd._enable(torch.compile(backend="eager")):  # unpaused: processed
        model(x).pow(2).sum().backward()
    assert sorted(hook.stats.read()) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert model[0].weight.grad.abs().max() <= 0.025


def test_traced_backward_holds_one_op_per_gradient():
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    model, hook = _model(), _hook("triton")
    hook.register(model)
    loss = model(_batches()[0]).pow(2).sum()
    with torch._dynamo.compiled_autograd._enable(torch.compile(backend=backend)):
        loss.backward()
    ops = (torch.ops.fusedhooks.process, torch.ops.fusedhooks.process.default)
    calls = [n for gm in graphs for n in gm.graph.nodes if n.target in ops]
    assert len(calls) == 4


def test_accumulation_steps_under_compiled_autograd_equal_eager():
    """The gate of accumulation_steps= runs outside the graph (a graph break) and keeps eager's results."""
    def run(compiled):
        torch._dynamo.reset()
        model, hook = _model(), _hook("triton")
        hook.register(model, accumulation_steps=2)
        for x in _batches():
            loss = model(x).pow(2).sum()
            if compiled:
                with torch._dynamo.compiled_autograd._enable(torch.compile(backend="eager")):
                    loss.backward()
            else:
                loss.backward()
        return [p.grad.clone() for p in model.parameters()], hook.stats.read()

    grads, stats = run(False)
    grads_c, stats_c = run(True)
    for g, h in zip(grads, grads_c):
        torch.testing.assert_close(g, h, rtol=1e-6, atol=1e-8)
    assert sorted(stats_c) == sorted(stats)
    for name in stats:
        assert stats_c[name] == pytest.approx(stats[name], rel=1e-6)
