"""Launching an already compiled Triton kernel directly: the path `JITFunction.run` ends in.

`kernel[grid](*args, **meta)` binds the arguments, computes their specialisation (dtypes, 16-byte alignment,
integer widths), looks the compiled kernel up and calls its launcher: tens of microseconds of Python per
launch. A caller that launches the same kernel with the same meta again and again (runtime.Bound) keeps a
dict; the first launch goes through Triton and leaves the compiled kernel there, keyed by what Triton
specialises on, and the next ones call `CompiledKernel.run` as `JITFunction.run` does (triton 3.6 to 3.9).
FUSEDHOOKS_FAST_LAUNCH=0 turns it off (every launch through `kernel[grid]`): read when a launch finds no compiled
kernel kept, not at every launch (reading os.environ costs about 1 µs).
"""

from __future__ import annotations

import functools

import torch

from .. import config


@functools.cache
def _triton_runtime() -> tuple:
    """triton's (driver, knobs), imported at the first launch (importing fusedhooks does not import triton; an import
    statement in `launch` cost about 0.3 µs each)."""
    from triton import knobs
    from triton.runtime import driver
    return driver, knobs


@functools.cache
def interpreted_function() -> type:
    """The class of Triton interpreter kernels (what @triton.jit makes under TRITON_INTERPRET=1)."""
    from triton.runtime.interpreter import InterpretedFunction
    return InterpretedFunction


class Kept:
    """What `launch` keeps for one kernel of a bound launch (runtime.Bound): the compiled kernels found so far, by
    the specialisation of the arguments at `varying` (positions), and those positions: the arguments whose dtype,
    alignment or width may differ from one launch to the next (the firing's tensors, the closed-over tensors, which
    `s.data = t` may move). Every other argument is an int or a tensor the binding owns (workspace buffers, a
    bucket's table), the same object for the bound launch's lifetime: its specialisation is the first launch's,
    left out of the key (specialising all of them cost about 3 µs of Python a launch)."""

    __slots__ = ("compiled", "varying")

    def __init__(self, varying: tuple[int, ...]):
        self.compiled: dict[tuple, tuple] = {}
        self.varying = varying


def specialization(args) -> tuple:
    """What Triton specialises a kernel on among `args` beyond their roles: each tensor's dtype and 16-byte
    alignment, each int's width (an int equal to 1 or divisible by 16 is specialised too unless the kernel
    says do_not_specialize; fusedhooks' only ints, numel and n_tensors, say so)."""
    return tuple((a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor)
                 else (type(a), isinstance(a, int) and not -(1 << 31) <= a < (1 << 31)) for a in args)


def constexpr_names(kernel) -> tuple[str, ...]:
    """The constexpr parameters of a @triton.jit function, in order (they follow the other arguments in
    fusedhooks' kernels)."""
    return tuple(p.name for p in kernel.params if p.is_constexpr)


def launch(kernel, grid: tuple, args: tuple, meta: dict, kept: Kept) -> None:
    """`kernel[grid](*args, **meta)`, through the compiled kernel `kept` holds for these arguments when there is
    one."""
    driver, knobs = _triton_runtime()
    device = driver.active.get_current_device()
    key = (device, specialization([args[i] for i in kept.varying]))
    entry = kept.compiled.get(key)
    if entry is None:
        compiled = kernel[grid](*args, **meta)
        if config.fast_launch() and hasattr(compiled, "run") and hasattr(compiled, "packed_metadata"):
            names = constexpr_names(kernel)
            if list(kernel.arg_names[len(args):]) == list(names) and all(n in meta for n in names):
                kept.compiled[key] = (compiled, tuple(meta[n] for n in names))
        return
    compiled, constexprs = entry
    stream = driver.active.get_current_stream(device)
    full = (*args, *constexprs)
    grid_1 = grid[1] if len(grid) > 1 else 1
    grid_2 = grid[2] if len(grid) > 2 else 1
    launch_metadata = compiled.launch_metadata(grid, stream, *full)
    compiled.run(grid[0], grid_1, grid_2, stream, compiled.function, compiled.packed_metadata, launch_metadata,
                 knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *full)
