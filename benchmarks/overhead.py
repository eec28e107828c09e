"""fusedhooks' own host time per firing, its kernel launches excluded (`runtime.launch` replaced by a no-op).

Figures per dtype, for a hook that clips, scales and records every statistic (the model workload's):

- one tensor: the function register() installs as the post-accumulate hook of a 64K-element parameter, called
  directly with grad mode off (a firing as a backward makes it, without torch's own call into Python), µs per call,
  against the 3 µs target, and next to it the eager clamp hook called the same way (on CPU its
  kernel, a clamp over 64K elements, is in its figure);
- a bucket: a backward over 64 parameters of 1K elements registered with `bucket_mb=25` (one bucket, processed
  at the end of the backward), minus the same backward with no hook, per parameter: everything fusedhooks adds,
  torch's call of a Python hook per parameter included, and the same less that call (`empty python hook`).

The reference Python hooks say what any hook costs in the same backward: torch's call of an empty one, one that
reads `.grad` (which makes the gradient's Python object), one that also keeps a weak reference to it (as the
statistics do, so that a row never describes another gradient).

On CPU the kernels are those of the Triton interpreter (TRITON_INTERPRET=1 while measuring); none runs.

On CPU, the time a clamp hook adds per parameter to the backward of a model of 100 Linear(64, 64) layers, side by
side: the eager hook `p.grad.clamp_(-1, 1)`, fusedhooks' eager backend, fusedhooks' triton host path (launches
stubbed), and the eager hook and fusedhooks under compiled autograd with inductor (each firing traced into the
backward graph as fusedhooks::firing), with the number of Python calls fusedhooks' own code makes per parameter in a
warm backward (none under compiled autograd: the firing is a function of tensors). Under compiled autograd
fusedhooks' target is TRACED_RATIO times what the traced eager hook adds, counted as TRACED_FLOOR_US at least.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
import weakref

import torch

import fusedhooks as fh
from fusedhooks.runtime import launcher as runtime
from fusedhooks.testing import python_calls as python_calls_of

SINGLE_NUMEL = 1 << 16
BUCKET_PARAMS, BUCKET_NUMEL = 64, 1 << 10


@contextlib.contextmanager
def launches_stubbed(device: torch.device):
    """No kernel runs; on CPU the triton backend is chosen (the interpreter's kernels are generated)."""
    saved_launch, saved_env = runtime.launch, os.environ.get("TRITON_INTERPRET")
    runtime.launch = lambda *args: None
    if device.type == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        runtime.launch = saved_launch
        if device.type == "cpu":
            if saved_env is None:
                os.environ.pop("TRITON_INTERPRET", None)
            else:
                os.environ["TRITON_INTERPRET"] = saved_env


def _hook():
    return fh.grad_hook(lambda grad: grad.clamp(-1.0, 1.0) * 0.5, stats="all", backend="triton")


def _best_of(fn, calls: int, rounds: int) -> float:
    """Seconds per call: the fastest of `rounds` rounds of `calls` calls (host timing noise only adds)."""
    fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def single_us(device: torch.device, dtype: torch.dtype, quick: bool, hook_kind: str = "fusedhooks") -> float:
    """µs per firing on a SINGLE_NUMEL-element gradient, called as a backward calls it (grad mode off): fusedhooks'
    hook ("fusedhooks": the post-accumulate hook register() installs, launches stubbed), or the eager clamp hook
    `p.grad.clamp_(-1, 1)` ("eager"; its kernel runs: on CUDA it only queues it)."""
    param = torch.nn.Parameter(torch.zeros(SINGLE_NUMEL, device=device, dtype=dtype))
    param.grad = torch.zeros_like(param)
    calls = 200 if quick else 2000
    if hook_kind == "eager":
        with torch.no_grad():
            return 1e6 * _best_of(lambda: _eager_clamp_hook(param), calls, 5)
    hook = _hook()
    with launches_stubbed(device), hook.register(param), torch.no_grad():
        fire = next(reversed(param._post_accumulate_grad_hooks.values()))  # what torch calls after accumulating
        return 1e6 * _best_of(lambda: fire(param), calls, 5)


_kept: dict[int, weakref.ref] = {}

#: reference Python hooks (name -> post-accumulate hook): what any hook costs in the bucket's backward
PYTHON_HOOKS = {
    "empty python hook": lambda p: None,
    "python hook reading .grad": lambda p: None if p.grad is None else None,
    "python hook keeping a weak reference to .grad": lambda p: _kept.__setitem__(id(p), weakref.ref(p.grad)),
}


def bucket_us(device: torch.device, dtype: torch.dtype, quick: bool, hook_kind: str = "fusedhooks") -> float:
    """µs per parameter that `hook_kind` adds to a backward: "fusedhooks" (registered with `bucket_mb=25`),
    "fusedhooks at firing" (`bucket_mb=0`, the default), or a key of PYTHON_HOOKS."""
    params = [torch.nn.Parameter(torch.zeros(BUCKET_NUMEL, device=device, dtype=dtype))
              for _ in range(BUCKET_PARAMS)]

    def step():
        for p in params:
            p.grad = None
        sum((p * p).sum() for p in params).backward()

    @contextlib.contextmanager
    def registered():
        """The hook on every parameter, for one round. Rounds without and with it alternate, and the figure is the
        median of each pair's difference: load that comes and goes weighs on both sides of most pairs."""
        if hook_kind.startswith("fusedhooks"):
            with hook.register(params, bucket_mb=25 if hook_kind == "fusedhooks" else 0):
                yield
            return
        handles = [p.register_post_accumulate_grad_hook(PYTHON_HOOKS[hook_kind]) for p in params]
        try:
            yield
        finally:
            for h in handles:
                h.remove()
            _kept.clear()

    calls, rounds = (10, 5) if quick else (20, 31)
    differences = []
    with launches_stubbed(device):
        hook = _hook()
        for _ in range(rounds):
            base = _best_of(step, calls, 1)
            with registered():
                differences.append(_best_of(step, calls, 1) - base)
    return 1e6 * statistics.median(differences) / BUCKET_PARAMS


#: the model of the per-parameter figures (docs/benchmarks.md, "In a backward"): LAYERS x Linear(WIDTH, WIDTH),
#: 2 parameters each
LAYERS, WIDTH = 100, 64


def _clamp(grad):
    return grad.clamp(-1.0, 1.0)


def _eager_clamp_hook(param):
    param.grad.clamp_(-1.0, 1.0)


#: kind -> (how the hook is made and registered, whether the backward runs under compiled autograd + inductor)
BACKWARD_KINDS = {
    "eager hook `p.grad.clamp_(-1, 1)`": ("python", False),
    "fusedhooks, eager backend": ("eager", False),
    "fusedhooks, triton host path (launch stubbed)": ("triton", False),
    "eager hook under compiled autograd + inductor (traced)": ("python", True),
    "fusedhooks under compiled autograd + inductor (the traced firing)": ("eager", True),
}
#: The compiled autograd rows: fusedhooks may add at most this many times what the traced eager hook adds ...
TRACED_RATIO = 3.0
#: ... counted as at least this many µs (a hook traced into the graph may cost nothing)
TRACED_FLOOR_US = 2.0


def backward_us(kind: str, quick: bool) -> tuple[float, float]:
    """(µs per parameter that a clamp hook of `kind` (a key of BACKWARD_KINDS) adds to the backward of LAYERS
    Linear(WIDTH, WIDTH) layers on CPU, fusedhooks' Python calls per parameter in one such backward once warm).

    Two copies of the model, the hooks registered once on one of them: their backwards alternate (under compiled
    autograd each is compiled once and then found in its cache), and the figure is the median of the pairs'
    differences, so that load that comes and goes weighs on both sides of most pairs."""
    from torch._dynamo import compiled_autograd

    def make_model():
        torch.manual_seed(0)
        model = torch.nn.Sequential(*(torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)))
        with torch.no_grad():  # norm-preserving layers: default ones shrink 100 layers deep into subnormals (slow)
            for layer in model:
                torch.nn.init.orthogonal_(layer.weight)
        return model

    plain, hooked = make_model(), make_model()
    x = torch.randn(8, WIDTH)
    how, compiled = BACKWARD_KINDS[kind]

    def backward_of(model):
        params = list(model.parameters())

        def backward():
            for p in params:
                p.grad = None
            loss = model(x).square().sum()
            if compiled:
                with compiled_autograd._enable(torch.compile(backend="inductor")):
                    loss.backward()
            else:
                loss.backward()
        return backward

    base, with_hooks = backward_of(plain), backward_of(hooked)
    calls, rounds = (3, 5) if quick else (10, 21)
    differences = []
    stub = launches_stubbed(torch.device("cpu")) if how == "triton" else contextlib.nullcontext()
    with stub:
        if how == "python":
            for p in hooked.parameters():
                p.register_post_accumulate_grad_hook(_eager_clamp_hook)
        else:
            fh.grad_hook(_clamp, backend=how).register(hooked)
        base(), with_hooks()
        python_calls = python_calls_of(with_hooks)
        for _ in range(rounds):
            differences.append(_best_of(with_hooks, calls, 1) - _best_of(base, calls, 1))
    return 1e6 * statistics.median(differences) / (2 * LAYERS), python_calls / (2 * LAYERS)


def measure_backward(quick: bool) -> list[dict]:
    """Rows {"case", "dtype", "us", "target_us", "python_calls"}: BACKWARD_KINDS side by side, in one run (with
    `quick`, those without compiled autograd: inductor's C++ compiles take minutes on a small machine)."""
    rows, traced_hook_us = [], None
    for kind, (how, compiled) in BACKWARD_KINDS.items():
        if quick and compiled:
            continue
        us, calls = backward_us(kind, quick)
        target = None
        if compiled and how == "python":
            traced_hook_us = us
        elif compiled:  # fusedhooks: within TRACED_RATIO of the traced eager hook (of TRACED_FLOOR_US at least)
            target = TRACED_RATIO * max(traced_hook_us, TRACED_FLOOR_US)
        rows.append({"case": f"{kind}, µs added per parameter ({LAYERS} x Linear({WIDTH}, {WIDTH}))",
                     "dtype": "float32", "us": us, "target_us": target, "python_calls": calls})
    return rows


def measure(device: torch.device, dtypes: list[torch.dtype], quick: bool) -> list[dict]:
    """Rows {"case", "dtype", "us", "target_us"}."""
    python_hooks = {kind: bucket_us(device, dtypes[0], quick, kind) for kind in PYTHON_HOOKS}
    rows = []
    for dtype in dtypes:
        name = str(dtype).removeprefix("torch.")
        rows.append({"case": f"one tensor ({SINGLE_NUMEL:,} elements), µs per firing (fusedhooks' own host time, "
                             "launch stubbed)", "dtype": name, "us": single_us(device, dtype, quick), "target_us": 3.0})
        rows.append({"case": "the same tensor, the eager hook `p.grad.clamp_(-1, 1)` called directly, µs per call "
                             "(its kernel included)", "dtype": name, "us": single_us(device, dtype, quick, "eager"),
                     "target_us": None})
        bucket = bucket_us(device, dtype, quick)
        rows.append({"case": f"bucket of {BUCKET_PARAMS} parameters, µs per parameter", "dtype": name,
                     "us": bucket, "target_us": 3.0})
        rows.append({"case": "the same, less torch's call of a Python hook", "dtype": name,
                     "us": bucket - python_hooks["empty python hook"], "target_us": 3.0})
        rows.append({"case": "the same backward, the hook registered at firing (`bucket_mb=0`), µs per parameter",
                     "dtype": name, "us": bucket_us(device, dtype, quick, "fusedhooks at firing"), "target_us": None})
    rows += [{"case": f"{kind}, µs per parameter", "dtype": str(dtypes[0]).removeprefix("torch."), "us": us,
              "target_us": None} for kind, us in python_hooks.items()]
    if device.type == "cpu":
        rows += measure_backward(quick)
    return rows
