"""The eager CPU backend (`auto` on CPU without the interpreter): bodies in place, statistics in the gradient's
precision. Its numerics also run in every test that takes the `backend` fixture; these check what is its own."""

import math
import threading

import pytest
import torch

import fusedhooks as fh
from fusedhooks.runtime import eager
from fusedhooks.runtime import launcher as runtime

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def ids(dtype):
    return str(dtype).removeprefix("torch.")


def fire(hook, grad, param=None):
    p = torch.nn.Parameter(param if param is not None else torch.zeros_like(grad))
    p.grad = grad
    hook.register(p, name="p")
    hook(p)
    return p


def test_auto_is_eager_on_cpu_without_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("FUSEDHOOKS_BACKEND", raising=False)
    assert runtime.choose_backend(torch.device("cpu")) == "eager"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert runtime.choose_backend(torch.device("cpu")) == "triton"
    assert runtime.choose_backend(torch.device("cpu"), "reference") == "reference"


def test_a_chain_of_ops_runs_in_place_on_the_gradient():
    scale = torch.tensor(0.5)
    hook = fh.grad_hook(lambda grad: grad.clamp(-1.0, 1.0) * scale, backend="eager")
    body = eager.compile_body(hook.graph(torch.float32))
    assert "clamp_(" in body.source and "mul_(" in body.source and "eager(" not in body.source
    grad = torch.randn(1000) * 3
    expected = grad.clamp(-1.0, 1.0) * scale
    storage = grad.data_ptr()
    p = fire(hook, grad)
    assert p.grad.data_ptr() == storage
    assert torch.equal(p.grad, expected)


BODIES = {
    "reads_grad_again": lambda grad: torch.where(grad > 0, grad, grad * 0.5) + grad,
    "float_aliases_for_fp32": lambda grad: grad.float() * 2.0 + grad,
    "reads_param": lambda grad, param: grad + param * 1e-2,
    "square_then_sub": lambda grad: grad * grad - grad,
    "normalise": lambda grad: grad / (grad.norm() + 1e-6),
    "min_max": lambda grad: torch.maximum(grad.clamp(min=-0.5), grad * 0.25),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("name", BODIES)
def test_bodies_equal_eager_torch_bit_for_bit_and_leave_the_parameter_alone(name, dtype):
    fn = BODIES[name]
    torch.manual_seed(3)
    grad = torch.randn(1031).to(dtype)
    param = torch.randn(1031).to(dtype)
    param_before = param.clone()
    args = (grad.clone(), param) if fn.__code__.co_argcount == 2 else (grad.clone(),)
    expected = fn(*args)
    p = fire(fh.grad_hook(fn, backend="eager"), grad, param)
    assert torch.equal(p.grad, expected.to(dtype))
    assert torch.equal(p.detach(), param_before)


def test_statistics_meet_the_design_accuracy_targets_at_a_million_elements():
    torch.manual_seed(5)
    grad = torch.randn(1 << 20) * 3 + 0.5
    grad[::1001] = 0.0
    x64 = grad.double()
    hook = fh.grad_hook(stats="all", backend="eager")
    fire(hook, grad.clone())
    got = hook.stats.read()["p"]
    magnitude = x64.abs().sum().item()
    assert abs(got["sum"] - x64.sum().item()) <= 1e-5 * magnitude
    assert abs(got["mean"] - x64.mean().item()) <= 1e-5 * magnitude / x64.numel()
    for name, ref in (("sumsq", (x64 * x64).sum()), ("norm", x64.norm()), ("var", x64.var()), ("std", x64.std())):
        assert got[name] == pytest.approx(ref.item(), rel=1e-5), name
    assert (got["min"], got["max"], got["absmax"]) == (x64.min().item(), x64.max().item(), x64.abs().max().item())
    assert (got["nan"], got["inf"], got["zeros"]) == (0, 0, (x64 == 0).sum().item())


def test_std_far_from_zero_mean():
    torch.manual_seed(6)
    grad = torch.randn(1 << 20) + 1000.0  # |mean| / std = 1e3
    hook = fh.grad_hook(stats=("std",), backend="eager")
    fire(hook, grad.clone())
    assert hook.stats.read()["p"]["std"] == pytest.approx(grad.double().std().item(), rel=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=ids)
def test_nan_and_inf_are_counted_when_present(dtype):
    grad = torch.tensor([1.0, float("nan"), float("inf"), -float("inf"), 0.0, float("nan")]).to(dtype)
    hook = fh.grad_hook(stats=("nan", "inf", "zeros", "min", "absmax", "sum"), backend="eager")
    fire(hook, grad)
    got = hook.stats.read()["p"]
    assert (got["nan"], got["inf"], got["zeros"]) == (2, 2, 1)
    assert math.isnan(got["min"]) and math.isnan(got["absmax"]) and math.isnan(got["sum"])


def test_large_temporaries_are_reused_between_firings():
    hook = fh.grad_hook(stats=("norm", "var"), backend="eager")
    p = fire(hook, torch.randn(1 << 16))
    workspace = hook.workspace(p.device)
    first = {dtype: t.data_ptr() for dtype, t in workspace._scratch.items()}
    assert first
    hook(p)
    assert {dtype: t.data_ptr() for dtype, t in workspace._scratch.items()} == first


# --- the lean firing (Dispatch.lean_firing): what process() does, with fewer lookups --------------------------


def _spy_process(hook, monkeypatch) -> list:
    """The gradients the full path (`hook.dispatch.process`) is called with."""
    calls, process = [], hook.dispatch.process
    monkeypatch.setattr(hook.dispatch, "process",
                        lambda entry, grad, *args: (calls.append(grad), process(entry, grad, *args)))
    return calls


@pytest.mark.parametrize("backend", ["eager", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=ids)
@pytest.mark.parametrize("stats", [(), "all"], ids=["no_stats", "all_stats"])
def test_the_lean_firing_equals_the_full_path(dtype, stats, backend, monkeypatch):
    scale = torch.tensor(0.5)
    hooks = [fh.grad_hook(lambda grad: grad.clamp(-1.0, 1.0) * scale, stats=stats, backend=backend) for _ in range(2)]
    lean, full = hooks
    params = [torch.nn.Parameter(torch.zeros(64, 33, dtype=dtype)) for _ in hooks]
    for hook, p in zip(hooks, params):
        hook.register(p, name="w")
    calls = _spy_process(lean, monkeypatch)
    for _ in range(3):
        grad = torch.randn(64, 33, dtype=dtype) * 2
        for p in params:
            p.grad = grad.clone()
        versions = [p.grad._version for p in params]
        lean(params[0])  # the first firing goes through process() and leaves the lean firing behind
        full.process(full.registry.get(params[1]), params[1].grad, params[1], -1)
        assert torch.equal(params[0].grad, params[1].grad)
        assert params[0].grad._version - versions[0] == params[1].grad._version - versions[1] > 0
        assert lean.stats.read() == full.stats.read()
        if stats:
            assert lean.registry.get(params[0]).measurement.describes(params[0].grad)
    assert len(calls) == 1 and (dtype, False, -1, threading.get_ident()) in lean.dispatch.lean_firings
    if stats:
        norms = [fh.clip_grad_norm_(hook, 0.1) for hook in hooks]
        assert torch.equal(norms[0], norms[1]) and torch.equal(params[0].grad, params[1].grad)


class _Subclass(torch.Tensor):
    pass


@pytest.mark.parametrize("backend", ["eager", "triton"])
def test_the_lean_firing_steps_aside(backend, monkeypatch):
    hook = fh.grad_hook(lambda grad: grad * 2.0, stats=("norm",), backend=backend)
    p = torch.nn.Parameter(torch.zeros(8))
    q = torch.nn.Parameter(torch.zeros(8, dtype=torch.float64))
    hook.register([("p", p), ("q", q)])
    calls = _spy_process(hook, monkeypatch)
    p.grad = torch.ones(8)
    hook(p)
    hook(p)
    assert len(calls) == 1 and torch.equal(p.grad, torch.full((8,), 4.0))
    with hook.paused():
        hook(p)
    assert torch.equal(p.grad, torch.full((8,), 4.0))
    q.grad = torch.ones(8, dtype=torch.float64)  # another dtype: its own first firing through process()
    hook(q)
    assert len(calls) == 2 and torch.equal(q.grad, torch.full((8,), 2.0, dtype=torch.float64))
    for grad in (torch.ones(8).as_subclass(_Subclass),  # not a plain tensor (a DTensor is not either)
                 torch.ones(8, requires_grad=True) * 1.0):  # create_graph=True: autograd records the body
        p.grad = grad
        hook(p)
        assert calls[-1] is grad
        assert torch.equal(p.grad.detach(), torch.full((8,), 2.0))
    assert len(calls) == 4
    assert hook.stats.read()["p"]["norm"] == pytest.approx(math.sqrt(8 * 4.0))


def test_the_lean_firing_in_a_backward():
    hook = fh.grad_hook(lambda grad: grad.clamp(-1.0, 1.0), stats=("max",), backend="eager")
    w = torch.nn.Parameter(torch.zeros(4))
    hook.register(w, name="w")
    for step in range(3):
        w.grad = None
        (w * torch.tensor([3.0, -3.0, 0.5, 1.0]) * (step + 1)).sum().backward()
        assert torch.equal(w.grad, torch.tensor([1.0, -1.0, min(0.5 * (step + 1), 1.0), 1.0]))
        assert hook.stats.read()["w"].fresh
    assert (torch.float32, False, -1, threading.get_ident()) in hook.dispatch.lean_firings


@pytest.mark.parametrize("contiguous", [True, False], ids=["contiguous", "transposed"])
def test_a_large_gradient_runs_the_eager_hooks_ops_whole_with_the_same_bits(contiguous):
    """A gradient of several MiB runs the body's in-place torch ops once each on the whole gradient, as the eager
    hook it replaces (no loop over blocks), with eager torch's bits."""
    scale = torch.tensor(0.75)
    hook = fh.grad_hook(lambda grad, param: grad.clamp(-1.0, 1.0) * scale + param * 1e-3, stats=("norm", "max"),
                        backend="eager")
    source = eager.compile_body(hook.graph(torch.float32)).source
    assert "for " not in source and source.count("clamp_(") == 1 and source.count("mul_(") == 1, source
    numel = (1 << 20) + 4099  # 4 MiB and a bit, odd
    param = torch.randn(numel // 3, 3)
    grad = torch.randn(numel // 3, 3) * 2
    if not contiguous:
        param, grad = param.t().contiguous().t(), grad.t().contiguous().t()
    expected = grad.clamp(-1.0, 1.0) * scale + param * 1e-3
    p = fire(hook, grad, param)
    assert torch.equal(p.grad, expected)
    assert hook.stats.read()["p"]["max"] == expected.max().item()


def test_the_single_launch_follows_each_gradients_size_and_alignment(monkeypatch):
    """`runtime.single_launch` keeps the last Bound it launched: gradients of other sizes and alignments, fired one
    after another through one lean firing, each launch with their own (numel, ALIGNED) and are processed whole."""
    hook = fh.grad_hook(lambda grad: grad.clamp(-1.0, 1.0), stats=("sum",), backend="triton")
    p, q = torch.nn.Parameter(torch.zeros(4100)), torch.nn.Parameter(torch.zeros(84))  # 16-byte multiples
    hook.register([("p", p), ("q", q)])
    torch.manual_seed(0)
    launched, launch = [], runtime.launch
    monkeypatch.setattr(runtime, "launch", lambda kernel, grid, args, meta, fast=None: (
        launched.append((grid, meta["ALIGNED"])), launch(kernel, grid, args, meta, fast)))
    storage = torch.empty(4101)
    grads = {"aligned": lambda: torch.randn(4100) * 2, "unaligned": lambda: storage[1:].copy_(torch.randn(4100) * 2)}
    block = runtime.block_size(None, torch.device("cpu"))
    for tensor, kind in [(p, "aligned"), (q, "aligned"), (p, "unaligned"), (p, "unaligned"), (p, "aligned"),
                         (q, "aligned")]:
        grad = grads[kind]() if tensor is p else torch.randn(84) * 2
        tensor.grad = grad
        expected = grad.clamp(-1.0, 1.0)
        del launched[:]
        hook(tensor)
        assert tensor.grad is grad and torch.equal(grad, expected)
        expected64 = expected.double()  # the kernel sums in another order: within DESIGN's 1e-5 of the magnitude
        got = hook.stats.read()["p" if tensor is p else "q"]["sum"]
        assert abs(got - expected64.sum().item()) <= 1e-5 * expected64.abs().sum().item()
        assert {hint for _, hint in launched} == {kind == "aligned"}, (kind, launched)
        assert launched[0][0] == (-(-tensor.numel() // block),)
    assert len(hook.dispatch.lean_firings) == 1
