"""fusedhooks' firing and `clip_grad_norm_` as torch operators, for code that torch.compile traces.

Under `torch.compile`, compiled autograd traces a post-accumulate hook's Python into the backward graph;
fusedhooks' firing path (registries, weak references, caches, the GradScaler's books) is not something
dynamo should trace. So a hook called while `torch.compiler.is_dynamo_compiling()` only calls one operator,
`torch.ops.fusedhooks.fire`, whose arguments name what the firing touches:

- `grad` (written in place by the body), `stats` (the hook's statistics buffer, one row written) and
  `found_inf` (AMP's flag, when the hook has one on that device yet) are declared mutated;
- `param` and the body's closed-over scalars are read.

(The torch hooks ask `is_dynamo_compiling()` at every firing, not `is_compiling()`: one Python call against two.
`is_compiling()` is also true in a non-strict export and while dynamo compiles code it does not trace, where no
backward runs, so no torch hook. A hook called by hand, `hook(param)`, may be: it asks `is_compiling()`.)

Its real implementation runs the ordinary eager firing (`Dispatch.fire`, also for a hook registered with
`bucket_mb=N`: under compile each gradient is processed at its own firing), so there is one implementation
of a firing, not two; its fake implementation returns nothing. The compiler sees an opaque call with
accurate side effects and no graph break. A gradient that requires grad (`create_graph=True`) is fired
outside the graph instead (`torch.compiler.disable`), so that autograd records the body.

`fh.clip_grad_norm_(hook, ...)` in a compiled step (a training step under `torch.compile`) is likewise one
operator, `torch.ops.fusedhooks.clip_grad_norm_`: dynamo traces only the walk over the hook's parameters that
gathers their `.grad` tensors (declared mutated: they are scaled in place); the hook's statistics buffer is
read; the real implementation is the eager `clip_grad_norm_` (so the Triton interpreter or the Triton launch is
never traced), the fake one returns a 0-dim tensor of the total norm's dtype and device. (Once compiled autograd
traces the hook's firings, clip.py traces torch's own clip instead: no operator.)

The calls into the modules above (traced.py, clip.py) go through `optable`, where they enter their implementations:
this module imports none of them. It is imported only when a hook fires, or clip_grad_norm_ runs, under compile
(importing fusedhooks imports neither it nor triton).
"""

from __future__ import annotations

import functools

import torch

from ..runtime import launcher
from . import optable
from .sequence import run_traced

#: Both operators keep Python books at every call (the rows a firing wrote, the records clip_grad_norm_ trusts,
#: GradScaler's books): a CUDA graph replaying the kernels without the Python would leave them stale, silently. Tagged
#: so that torch.compile(mode="reduce-overhead") runs them outside its CUDA graphs (it partitions the graph around
#: them, or skips CUDA graphs for it), until a firing is a function of tensors alone.
_TAGS = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()


@torch.library.custom_op("fusedhooks::fire", mutates_args=("grad", "stats", "found_inf"), tags=_TAGS)
def fire(grad: torch.Tensor, param: torch.Tensor, stats: torch.Tensor | None, found_inf: torch.Tensor | None,
         scalars: list[torch.Tensor], hook_key: int) -> None:
    """One firing of the hook whose `traced.TracedFiring` is `optable.target(hook_key)` on `param`'s gradient `grad`:
    the eager path (`optable.implementation("fire")`, `TracedFiring.fire_in_op`). `grad` is processed as given:
    compiled autograd passes the accumulated gradient before it sets `param.grad` to it on a parameter's first
    backward."""
    traced = optable.target(hook_key)
    if traced is None:
        return
    written = optable.implementation("fire")(traced, param, grad)
    if written is None:  # the hook is paused
        return
    # aot_autograd may functionalize the op: call it on copies of the mutated tensors, then copy them back.
    # The firing wrote the hook's own buffers; make the copies say what the firing wrote.
    buffer, found_infs = written
    if stats is not None and buffer is not None and stats is not buffer:
        stats.copy_(buffer)
    if found_inf is not None:
        written_found_inf = found_infs.get(found_inf.device)
        if written_found_inf is not None and written_found_inf is not found_inf:
            found_inf.copy_(written_found_inf)


@fire.register_fake
def _(grad, param, stats, found_inf, scalars, hook_key) -> None:
    return None


@torch.library.triton_op("fusedhooks::firing",
                         mutates_args=("grad", "stats", "generations", "epoch", "found_inf", "unscaled_backwards"))
def firing(grad: torch.Tensor, param: torch.Tensor, stats: torch.Tensor | None, generations: torch.Tensor | None,
           epoch: torch.Tensor | None, scale: torch.Tensor | None, found_inf: torch.Tensor | None,
           unscaled_backwards: torch.Tensor | None, scalars: list[torch.Tensor], hook_key: int, row: int,
           bump: bool) -> None:
    """One firing of the hook whose `traced.TracedFiring` is `optable.target(hook_key)` on `param`'s gradient `grad`
    as a function of tensors: the body applied to `grad` in place, the statistics written into row `row` of `stats`
    ([parameters, slots] float64, None: the hook records none) and the backward's number into `generations[row]`
    (int64 [parameters]), `epoch` (int64, 0-dim) first incremented when `bump` (the first firing of the hook in a
    traced backward on this device).
    With scaler=: `grad` unscaled by GradScaler's `scale` first, NaN/Inf found added to `found_inf` (float32, 0-dim),
    which `bump` zeroes first, counting the backward in `unscaled_backwards` (int64, 0-dim: see amp.traced_books).

    A `torch.library.triton_op`: torch.compile traces into it, so a compiled graph holds its kernels (on CUDA the
    generated Triton kernels through `wrap_triton`, on CPU the plan as torch ops) and no Python of fusedhooks runs
    when the graph runs; its Python runs while tracing only, where the plan for `grad`'s dtype, device and shape is
    looked up (`optable.implementation("traced_plan")`)."""
    # compiled autograd with dynamic=True hands the two ints in as symbolic ints: specialized (they name a hook and
    # a row, constants of the graph; a new registration recompiles anyway)
    hook_key, row = int(hook_key), int(row)
    plan, module = optable.implementation("traced_plan")(hook_key, row, grad)
    stats_row = None if stats is None or not plan.slots else stats[row]
    run_traced(lambda amp: launcher.fire_traced(plan, module, grad, param, scalars, stats_row, amp), row, generations,
               epoch, scale, found_inf, unscaled_backwards, bump)


def _call(fn, *args):
    return fn(*args)


_call_outside_graph = torch.compiler.disable(_call)


def outside_graph(fn, *args):
    """`fn(*args)` run eagerly, outside the graph torch.compile is tracing (a graph break), and its result: for
    Python state of the training loop read at each backward (the gates of `register(..., accumulation_steps=,
    when=)`), a body autograd records, a clip_grad_norm_ the operator does not cover."""
    return _call_outside_graph(fn, *args)


@torch.library.custom_op("fusedhooks::clip_grad_norm_", mutates_args=("grads",), tags=_TAGS)
def clip_grad_norm(grads: list[torch.Tensor], stats: torch.Tensor | None, hook_key: int, max_norm: float,
                   norm_type: float, error_if_nonfinite: bool, foreach: bool | None,
                   max_norm_tensor: torch.Tensor | None) -> torch.Tensor:
    """`fh.clip_grad_norm_(optable.target(hook_key), ...)` (`optable.implementation("clip_grad_norm_")`) scaling
    `grads`: the gradients of the hook's parameters that are not None, in registration order, as `.grad` holds
    them or (aot_autograd functionalizes the op) copies of them. `stats` is the hook's statistics buffer when
    norm_type is 2.0 or inf (the norms are read from it), else None. `max_norm_tensor`: a max_norm given as a
    tensor (read with float() here, as eager does), else None and `max_norm` is it."""
    hook = optable.target(hook_key)
    if hook is None:
        raise RuntimeError("fusedhooks::clip_grad_norm_: the hook it was traced with no longer exists")
    # called through the op's ADInplaceOrView kernel (not excluded), which bumped the version of every gradient
    # before this call: a gradient the hook measured is still described by its measurement
    bumps = 0 if torch._C._dispatch_tls_is_dispatch_key_excluded(torch._C.DispatchKey.ADInplaceOrView) else 1
    if max_norm_tensor is not None:
        max_norm = max_norm_tensor
    return optable.implementation("clip_grad_norm_")(hook, max_norm, norm_type, error_if_nonfinite, foreach,
                                                     given=grads, bumps=bumps)


@clip_grad_norm.register_fake
def _(grads, stats, hook_key, max_norm, norm_type, error_if_nonfinite, foreach, max_norm_tensor):
    # the eager total norm: the norms vector's vector_norm, in the gradients' promoted dtype, on the statistics'
    # device (norms recorded by the hook) or the first gradient's (norms computed from the gradients)
    dtype = functools.reduce(torch.promote_types, (g.dtype for g in grads))
    return torch.empty((), dtype=dtype, device=grads[0].device if stats is None else stats.device)
