"""fusedhooks' firing as a torch operator, for code that torch.compile traces (compiled autograd).

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
outside the graph instead (`torch.compiler.disable`), so that autograd records the body. This module is
imported only when a hook fires under compile (importing fusedhooks imports neither it nor triton).
"""

from __future__ import annotations

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
    gradient at its own firing (a hook registered with bucket_mb= too: see README, "torch.compile")."""
    grad = param.grad
    if grad is None:
        return
    if grad.requires_grad:  # backward(create_graph=True): the body must run as ops autograd records
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
