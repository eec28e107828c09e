"""What a bound launch keeps for launching its compiled kernels directly (fusedhooks/runtime/fastlaunch.py).

On a GPU `fastlaunch.launch` keys the compiled kernels it keeps by the specialisation of the arguments that may
change between launches only (`Kept.varying`): the firing's tensors and the closed-over ones. These tests check,
on CPU, that every other argument of a bound launch is one the binding owns, and the key's logic, with a stand-in
for Triton's driver (the real launch is tests/test_gpu.py's `test_repeated_firings_launch_through_the_compiled_kernel`).
"""

import pytest
import torch
import triton

import fusedhooks as fh
from fusedhooks.runtime import fastlaunch
from fusedhooks.runtime import launcher as runtime


@pytest.mark.parametrize("stats", [(), ("norm", "mean")], ids=["no_stats", "stats"])
def test_a_bound_launch_varies_only_in_the_firings_and_the_closed_over_tensors(stats):
    scale = torch.tensor(0.5)
    hook = fh.grad_hook(lambda grad: grad.clamp(-1.0, 1.0) * scale, stats=stats, backend="triton")
    p = torch.zeros(4099, requires_grad=True)
    p.grad = torch.randn(4099)
    hook(p)
    workspace = hook.workspace(torch.device("cpu"))
    (bound,) = workspace.bound.values()
    owned = [workspace.buffer(role, 0) for role in runtime.WORKSPACE_BUFFERS]
    varying = {position for _, position in bound.slots} | {i for i, a in enumerate(bound.args) if a is scale}
    assert any(a is scale for a in bound.args)
    for kept in bound.fast:
        assert set(kept.varying) == varying
    for i, a in enumerate(bound.args):
        if i not in varying:  # the same object for the bound launch's lifetime: an int, or a buffer it owns
            assert type(a) is int or any(a is b for b in owned), (i, a)


class _Compiled:
    """A compiled kernel as `JITFunction.run` returns it, recording its launches."""
    packed_metadata, function = "metadata", "function"

    def __init__(self, runs: list):
        self.runs = runs

    def launch_metadata(self, grid, stream, *args):
        return None

    def run(self, *args):
        self.runs.append(args)


class _Kernel:
    """A @triton.jit kernel `f(x, y, n, BLOCK: tl.constexpr)`: each dispatch through Triton (`kernel[grid]`) is
    counted and returns a _Compiled."""
    arg_names = ["x", "y", "n", "BLOCK"]

    def __init__(self):
        self.params = [type("Param", (), {"name": n, "is_constexpr": n == "BLOCK"}) for n in self.arg_names]
        self.dispatches, self.runs = [], []

    def __getitem__(self, grid):
        def dispatch(*args, **meta):
            self.dispatches.append(args)
            return _Compiled(self.runs)
        return dispatch


class _Driver:
    def get_current_device(self):
        return 0

    def get_current_stream(self, device):
        return 0


def test_the_compiled_kernel_is_kept_by_the_varying_arguments_alone(monkeypatch):
    monkeypatch.setattr(type(triton.runtime.driver), "active", property(lambda self: _Driver()))
    kernel, kept = _Kernel(), fastlaunch.Kept((0,))  # x varies; y (a buffer the binding owns) and n do not
    storage = torch.zeros(64)
    aligned, unaligned, owned = storage[:8], storage[1:9], torch.zeros(8)
    fastlaunch.launch(kernel, (2,), (aligned, owned, 8), {"BLOCK": 16}, kept)
    fastlaunch.launch(kernel, (2,), (aligned, owned, 8), {"BLOCK": 16}, kept)
    assert len(kernel.dispatches) == 1 and len(kernel.runs) == 1  # the second launch: the kept kernel
    assert kernel.runs[0][-4:] == (aligned, owned, 8, 16)  # the arguments, then the constexprs
    fastlaunch.launch(kernel, (2,), (unaligned, owned, 8), {"BLOCK": 16}, kept)
    assert len(kernel.dispatches) == 2  # x is no longer 16-byte aligned: Triton specialises again
    fastlaunch.launch(kernel, (2,), (unaligned, owned, 8), {"BLOCK": 16}, kept)
    assert len(kernel.dispatches) == 2 and len(kernel.runs) == 2


def test_fast_launch_off_dispatches_every_launch_through_triton(monkeypatch):
    monkeypatch.setattr(type(triton.runtime.driver), "active", property(lambda self: _Driver()))
    monkeypatch.setenv("FUSEDHOOKS_FAST_LAUNCH", "0")
    kernel, kept = _Kernel(), fastlaunch.Kept((0,))
    x = torch.zeros(8)
    for _ in range(3):
        fastlaunch.launch(kernel, (1,), (x, x, 8), {"BLOCK": 16}, kept)
    assert len(kernel.dispatches) == 3 and not kernel.runs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_lean_firing_makes_at_most_eight_calls(monkeypatch, dtype):
    """A warm firing of a clip + scale + every statistic hook, as a backward makes it (grad mode off), runs at most 8
    Python functions of fusedhooks (the torch hook, the dispatch, the firing sequence, the books, the launch), its
    kernel launches left out (benchmarks/overhead.py times the same firing)."""
    from fusedhooks.testing import python_calls

    hook = fh.grad_hook(lambda grad: grad.clamp(-1.0, 1.0) * 0.5, stats="all", backend="triton")
    param = torch.nn.Parameter(torch.zeros(1 << 10, dtype=dtype))
    param.grad = torch.randn(1 << 10).to(dtype)
    launched = []
    monkeypatch.setattr(runtime, "launch", lambda kernel, grid, args, meta, fast=None: launched.append(kernel))
    with hook.register(param), torch.no_grad():
        fire = next(reversed(param._post_accumulate_grad_hooks.values()))  # what torch calls after accumulating
        fire(param)
        fire(param)
        launched.clear()
        calls = python_calls(lambda: fire(param))
    assert launched and calls <= 8, calls
