"""fusedhooks' firing and `clip_grad_norm_` as torch operators, for code that torch.compile traces.

Under `torch.compile`, compiled autograd traces a post-accumulate hook's Python into the backward graph;
fusedhooks' firing path (registries, weak references, caches, the GradScaler's books) is not something
dynamo should trace. So a hook called while `torch.compiler.is_compiling()` only calls one operator,
`torch.ops.fusedhooks.fire`, whose arguments name what the firing touches:

- `grad` (written in place by the body), `stats` (the hook's statistics buffer, one row written) and
  `found_inf` (AMP's flag, when the hook has one on that device yet) are declared mutated;
- `param` and the body's closed-over scalars are read.

Its real implementation runs the ordinary eager firing (`GradHook.fire`, also for a hook registered with
`bucket_mb=N`: under compile each gradient is processed at its own firing), so there is one implementation
of a firing, not two; its fake implementation returns nothing. The compiler sees an opaque call with
accurate side effects and no graph break. A gradient that requires grad (`create_graph=True`) is fired
outside the graph instead (`torch.compiler.disable`), so that autograd records the body.

`fh.clip_grad_norm_(hook, ...)` in a compiled step (a training step under `torch.compile`) is likewise one
operator, `torch.ops.fusedhooks.clip_grad_norm_`: dynamo traces only the walk over the hook's parameters that
gathers their `.grad` tensors (declared mutated: they are scaled in place); the hook's statistics buffer is
read; the real implementation is the eager `clip_grad_norm_` (so the Triton interpreter or the Triton launch is
never traced), the fake one returns a 0-dim tensor of the total norm's dtype and device.

This module is imported only when a hook fires, or clip_grad_norm_ runs, under compile (importing fusedhooks
imports neither it nor triton).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .api import GradHook


@torch.library.custom_op("fusedhooks::fire", mutates_args=("grad", "stats", "found_inf"))
def fire(grad: torch.Tensor, param: torch.Tensor, stats: torch.Tensor | None, found_inf: torch.Tensor | None,
         scalars: list[torch.Tensor], hook_key: int) -> None:
    """One firing of the hook `api.HOOKS[hook_key]` on `param`'s gradient `grad`: the eager path
    (`GradHook.fire`). `grad` is processed as given: compiled autograd passes the accumulated gradient
    before it sets `param.grad` to it on a parameter's first backward."""
    from .api import HOOKS

    hook = HOOKS.get(hook_key)
    if hook is None or hook._paused:
        return
    hook.fire(param, hook.registry.get(param), grad=grad)
    # aot_autograd may functionalize the op: call it on copies of the mutated tensors, then copy them back.
    # The firing wrote the hook's own buffers; make the copies say what the firing wrote.
    buffer = hook.stats._buffer
    if stats is not None and buffer is not None and stats is not buffer:
        stats.copy_(buffer)
    if found_inf is not None:
        written = hook._found_inf.get(found_inf.device)
        if written is not None and written is not found_inf:
            found_inf.copy_(written)


@fire.register_fake
def _(grad, param, stats, found_inf, scalars, hook_key) -> None:
    return None


@torch.compiler.disable
def _fire_eager(hook: GradHook, param: torch.Tensor) -> None:
    """The eager firing, run outside the compiled graph (one graph break): for a gradient that requires grad
    (backward(create_graph=True)), whose body runs as eager torch ops that autograd records."""
    if not hook._paused:
        hook.fire(param, hook.registry.get(param))


def fire_compiling(hook: GradHook, param: torch.Tensor) -> None:
    """What a hook does when called while torch.compile traces it: one call of fusedhooks::fire, for each
    gradient at its own firing (a hook registered with bucket_mb= too: see docs/compile.md)."""
    grad = param.grad
    if grad is None:
        return
    if hook.records(grad, param):  # backward(create_graph=True): the body must run as ops autograd records
        _fire_eager(hook, param)
        return
    stats = hook.stats._buffer if hook.stats.slot_names else None
    found_inf = hook._found_inf.get(grad.device) if hook.scaler is not None else None
    torch.ops.fusedhooks.fire(grad, param, stats, found_inf, list(hook._body.scalars), hook._op_key)


def _call(fn, *args) -> None:
    fn(*args)


_call_outside_graph = torch.compiler.disable(_call)


def outside_graph(fn, *args) -> None:
    """`fn(*args)` run eagerly, outside the graph torch.compile is tracing (a graph break): for Python state of the
    training loop read at each backward (the gates of `register(..., accumulation_steps=, when=)`)."""
    _call_outside_graph(fn, *args)


@torch.library.custom_op("fusedhooks::clip_grad_norm_", mutates_args=("grads",))
def clip_grad_norm(grads: list[torch.Tensor], stats: torch.Tensor | None, hook_key: int, max_norm: float,
                   norm_type: float, error_if_nonfinite: bool, foreach: bool | None,
                   max_norm_tensor: torch.Tensor | None) -> torch.Tensor:
    """`fh.clip_grad_norm_(api.HOOKS[hook_key], ...)` scaling `grads`: the gradients of the hook's parameters
    that are not None, in registration order, as `.grad` holds them or (aot_autograd functionalizes the op)
    copies of them. `stats` is the hook's statistics buffer when norm_type is 2.0 or inf (the norms are read
    from it), else None. `max_norm_tensor`: a max_norm given as a tensor (read with float() here, as eager
    does), else None and `max_norm` is it."""
    from .api import HOOKS
    from .clip import _clip

    hook = HOOKS.get(hook_key)
    if hook is None:
        raise RuntimeError("fusedhooks::clip_grad_norm_: the hook it was traced with no longer exists")
    # called through the op's ADInplaceOrView kernel (not excluded), which bumped the version of every gradient
    # before this call: a gradient the hook measured is still described by its measurement
    bumps = 0 if torch._C._dispatch_tls_is_dispatch_key_excluded(torch._C.DispatchKey.ADInplaceOrView) else 1
    if max_norm_tensor is not None:
        max_norm = max_norm_tensor
    return _clip(hook, max_norm, norm_type, error_if_nonfinite, foreach, given=grads, bumps=bumps)


@clip_grad_norm.register_fake
def _(grads, stats, hook_key, max_norm, norm_type, error_if_nonfinite, foreach, max_norm_tensor):
    # the eager total norm: the norms vector's vector_norm, in the gradients' promoted dtype, on the statistics'
    # device (norms recorded by the hook) or the first gradient's (norms computed from the gradients)
    dtype = functools.reduce(torch.promote_types, (g.dtype for g in grads))
    return torch.empty((), dtype=dtype, device=grads[0].device if stats is None else stats.device)


def _clip_call(*args) -> torch.Tensor:
    from .clip import _clip

    return _clip(*args)


_clip_outside_graph = torch.compiler.disable(_clip_call)


def clip_compiling(hook: GradHook, max_norm, norm_type, error_if_nonfinite, foreach) -> torch.Tensor:
    """What `fh.clip_grad_norm_` does while torch.compile traces it: one call of fusedhooks::clip_grad_norm_ on
    the gradients it would clip. Outside the graph instead (graph breaks, the eager call): a sharded (FSDP2)
    gradient, a norm_type that is not a Python number, and anything but a hook (eager's TypeError)."""
    from .api import GradHook
    from .clip import _SOURCES, grads_of
    from .distributed import is_dtensor

    max_norm_tensor = max_norm if isinstance(max_norm, torch.Tensor) else None
    if not (isinstance(hook, GradHook) and isinstance(norm_type, (int, float))
            and (max_norm_tensor is not None or isinstance(max_norm, (int, float)))):
        return _clip_outside_graph(hook, max_norm, norm_type, error_if_nonfinite, foreach)
    grads = []
    for _, g in grads_of(hook):
        if is_dtensor(g):
            return _clip_outside_graph(hook, max_norm, norm_type, error_if_nonfinite, foreach)
        grads.append(g)
    norm_type = float(norm_type)
    if not grads:  # as eager: a float32 zero, nothing scaled
        return torch.zeros((), device=hook.stats.device or "cpu")
    stats = hook.stats._buffer if norm_type in _SOURCES else None
    with torch.no_grad():
        return torch.ops.fusedhooks.clip_grad_norm_(grads, stats, hook._op_key,
                                                    0.0 if max_norm_tensor is not None else float(max_norm),
                                                    norm_type, bool(error_if_nonfinite), foreach, max_norm_tensor)
