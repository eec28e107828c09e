"""fusedhooks' own host time per firing, its kernel launches excluded (`runtime.launch` replaced by a no-op).

Two figures per dtype, for a hook that clips, scales and records every statistic (the model workload's):

- one tensor: `hook(param)` called directly on a 64K-element gradient (a firing as torch makes it, without
  torch's own call into Python), µs per call;
- a bucket: a backward over 64 parameters of 1K elements registered with `bucket_mb=25` (one bucket, processed
  at the end of the backward), minus the same backward with no hook, per parameter: everything fusedhooks adds,
  torch's call of a Python hook per parameter included (about 1 µs on CPU; `empty python hook` measures it).

On CPU the kernels are those of the Triton interpreter (TRITON_INTERPRET=1 while measuring); none runs.
"""

from __future__ import annotations

import contextlib
import os
import time

import torch

import fusedhooks as fh
from fusedhooks import runtime

SINGLE_NUMEL = 1 << 16
BUCKET_PARAMS, BUCKET_NUMEL = 64, 1 << 10


@contextlib.contextmanager
def launches_stubbed(device: torch.device):
    """No kernel runs; on CPU the triton backend is chosen (the interpreter's kernels are generated)."""
    saved_launch, saved_env = runtime.launch, os.environ.get("TRITON_INTERPRET")
    runtime.launch = lambda *args, **meta: None
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


def single_us(device: torch.device, dtype: torch.dtype, quick: bool) -> float:
    param = torch.nn.Parameter(torch.zeros(SINGLE_NUMEL, device=device, dtype=dtype))
    param.grad = torch.zeros_like(param)
    hook = _hook()
    with launches_stubbed(device), hook.register(param):
        return 1e6 * _best_of(lambda: hook(param), 200 if quick else 2000, 5)


def bucket_us(device: torch.device, dtype: torch.dtype, quick: bool, hook_kind: str = "fusedhooks") -> float:
    """µs per parameter that `hook_kind` ("fusedhooks" buckets, or "empty python hook") adds to a backward."""
    params = [torch.nn.Parameter(torch.zeros(BUCKET_NUMEL, device=device, dtype=dtype))
              for _ in range(BUCKET_PARAMS)]

    def step():
        for p in params:
            p.grad = None
        sum((p * p).sum() for p in params).backward()

    calls, rounds = (20, 3) if quick else (100, 5)
    with launches_stubbed(device):
        base = _best_of(step, calls, rounds)
        if hook_kind == "fusedhooks":
            hook = _hook()
            handle = hook.register(params, bucket_mb=25)
        else:
            handles = [p.register_post_accumulate_grad_hook(lambda p: None) for p in params]
        try:
            hooked = _best_of(step, calls, rounds)
        finally:
            if hook_kind == "fusedhooks":
                handle.remove()
            else:
                for h in handles:
                    h.remove()
    return 1e6 * (hooked - base) / BUCKET_PARAMS


def measure(device: torch.device, dtypes: list[torch.dtype], quick: bool) -> list[dict]:
    """Rows {"case", "dtype", "us", "target_us"}."""
    rows = []
    for dtype in dtypes:
        name = str(dtype).removeprefix("torch.")
        rows.append({"case": f"one tensor ({SINGLE_NUMEL:,} elements), µs per firing", "dtype": name,
                     "us": single_us(device, dtype, quick), "target_us": 10.0})
        rows.append({"case": f"bucket of {BUCKET_PARAMS} parameters, µs per parameter", "dtype": name,
                     "us": bucket_us(device, dtype, quick), "target_us": 3.0})
    rows.append({"case": "empty python hook (torch's cost of any Python hook), µs per parameter", "dtype": "-",
                 "us": bucket_us(device, dtypes[0], quick, "empty python hook"), "target_us": None})
    return rows
