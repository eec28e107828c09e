"""End-of-backward buckets (`register(..., bucket_mb=N)`, N > 0): gradients collected during one backward
and processed by one multi-tensor launch per pass.

The pending gradients belong to the backward they fired in (autograd's graph task): each backward gets its
own `PendingBackward`, flushed by the end-of-backward callback queued on that graph task. A backward that
raises never runs its callback; its graph task, and with it the only strong reference to its pending
state, is then freed, so nothing carries over into later backwards, and concurrent backwards in other
threads never see each other's gradients.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.compiler import is_dynamo_compiling as _is_compiling  # checked at every firing (see ops)

from ..runtime import launcher
from ..runtime.layout import flat_span, is_dtensor
from ..stats.backwards import kept_until_end
from .registry import Entry

if TYPE_CHECKING:
    from ..runtime.compilation import HookCompilation, Workspaces
    from ..stats.buffer import HookStats
    from .sequence import Firing

#: `torch_hook(param)`: what torch calls after accumulating a registered tensor's gradient
TorchHook = Callable[[torch.Tensor], None]


@dataclass(frozen=True, eq=False)
class FiringCalls:
    """The calls a registration makes into its hook's firing, built by the hook (`GradHook.firing_calls`) for each
    registration; never the hook itself.

    Held by what torch holds for the registration (its tensors' torch hooks, the pending buckets of a running
    backward, DDP's communication hook, the forward pre-hook that follows fully_shard), so that a registration
    keeps its hook alive, as torch keeps an eager hook; never by the hook's own parts (no reference cycle).

    fire(param, entry, backward_key): process `param.grad` now, one firing (`dispatch.Dispatch.fire`);
    fire_compiling(param): that firing while torch.compile traces the torch hook (one fusedhooks::fire op);
    process(entry, grad, param, backward_key): process `grad` (`param.grad`, or DDP's averaged view of it) in place,
    one firing of its own (`Dispatch.process`); check_distributed(entry, backward_key): the check of a first firing
    in a process group (`Dispatch.check_distributed`); is_paused(): is the hook in a `paused()` block; at_firing(entry):
    the torch hook of a tensor processed at its own firing (bucket_mb=0, `Dispatch.torch_hook`)."""

    fire: Callable[[torch.Tensor, Entry, int], None]
    fire_compiling: TorchHook
    process: Callable[[Entry, torch.Tensor, torch.Tensor, int], None]
    check_distributed: Callable[[Entry, int], None]
    is_paused: Callable[[], bool]
    at_firing: Callable[[Entry], TorchHook]


#: Buckets._last when no backward runs alone
_NOT_ALONE: tuple[int, weakref.ref] = (-2, lambda: None)


class _Bucket:
    """The (entry, param) pairs of one (device, dtype) collected so far, in firing order, and their gradients'
    bytes."""

    __slots__ = ("items", "nbytes")

    def __init__(self):
        self.items: list[tuple[Entry, torch.Tensor]] = []
        self.nbytes = 0


class PendingBackward:
    """The gradients of one backward waiting in buckets, per (device, dtype), processed by `owner` (the hook's
    Buckets) with `calls` (its firing calls, see FiringCalls)."""

    def __init__(self, owner: Buckets, calls: FiringCalls, backward_key: int):
        self.owner, self.calls = owner, calls
        self.backward_key = backward_key
        self.thread = threading.get_ident()  # a nested (reentrant) backward runs on its parent's thread
        self.buckets: dict[tuple, _Bucket] = {}
        self.seen: set[int] = set()  # id() of every tensor collected in this backward
        self.done = False

    def __contains__(self, param: torch.Tensor) -> bool:
        return id(param) in self.seen

    def end(self) -> None:
        """The end-of-backward callback: process everything still pending."""
        self.done = True
        for key in list(self.buckets):
            self.flush(key)

    def flush(self, key: tuple) -> None:
        """Process the pending gradients of (device, dtype) `key` (see `process_together`). A tensor whose
        registration was removed after it fired is processed too: remove() stops later firings only."""
        bucket = self.buckets.pop(key, None)
        if bucket is not None:
            self.owner.process_together(
                [(entry, grad, p) for entry, p in bucket.items if (grad := p.grad) is not None], self.backward_key,
                self.calls.process)


def _dense(t: torch.Tensor) -> bool:
    """Is `t` one flat span of storage (layout.flat_span), checked without building the view when it is
    contiguous?"""
    return t.is_contiguous() or flat_span(t) is not None


class Buckets:
    """A hook's buckets: the PendingBackward of each backward now running its end-of-backward buckets, and how a
    bucket of its gradients is processed together (`process_together`: these buckets and DDP's).

    Handed the hook's parts, never the hook: `stats` (its statistics: numbers its backwards, holds the rows),
    `firing` (the firing sequence one bucket runs), `compilation` (its plans and kernels, body scalars and
    whether it is planned per gradient shape) and `workspaces` (its per-thread scratch on each device). The calls
    into the hook's firing come with each torch hook (`torch_hook`), in a `FiringCalls`."""

    def __init__(self, stats: HookStats, firing: Firing, compilation: HookCompilation, workspaces: Workspaces):
        self.stats, self.firing, self.compilation, self.workspaces = stats, firing, compilation, workspaces
        #: graph task id -> its pending state, held strongly only by the callback queued on that graph task
        self._running: weakref.WeakValueDictionary[int, PendingBackward] = weakref.WeakValueDictionary()
        self._lock = threading.Lock()
        #: True once the hook runs in a process group of several ranks (see `process_at_firing`)
        self.at_firing = False
        #: (graph task id, weak reference to its PendingBackward) of the last backward enqueued into while it was
        #: the only one running (-2 otherwise: every firing takes the checks of `_enqueue`)
        self._last: tuple[int, weakref.ref] = _NOT_ALONE

    def process_at_firing(self) -> None:
        """From now on process every gradient at its own firing: in a process group of several ranks, DDP's reducer
        may read each gradient right after our firing, so nothing waits for the end of backward."""
        self.at_firing = True
        self._last = _NOT_ALONE  # every firing takes the checks of `_enqueue`

    def torch_hook(self, entry: Entry, calls: FiringCalls) -> TorchHook:
        """The torch hook of a bucketed tensor, `hook(param)`, calling into its hook's firing through `calls` (which
        it holds: the tensor keeps the hook alive). Processed now, at its own firing, when the gradient must be
        final before anything else runs (a post-accumulate hook registered after ours on the tensor), when autograd
        records the body (a backward with create_graph=True), outside a backward, for a sharded (FSDP2) gradient, in
        a process group of several ranks (see Dispatch.check_distributed), and while torch.compile traces it (one
        `fusedhooks::fire` op, see `ops`)."""
        fire, fire_compiling, is_paused = calls.fire, calls.fire_compiling, calls.is_paused
        graph_task_id, grad_enabled = torch._C._current_graph_task_id, torch.is_grad_enabled

        def enqueue(param: torch.Tensor) -> None:
            if _is_compiling():  # processed at its own firing by one fusedhooks::fire op (see ops)
                fire_compiling(param)
                return
            if is_paused():
                return
            grad = param.grad
            if grad is None:
                return
            key, pending = self._last
            if (key != graph_task_id() or (pending := pending()) is None or pending.done or grad.requires_grad
                    or grad_enabled()
                    or entry.sharded
                    or next(reversed(param._post_accumulate_grad_hooks), None) != entry.torch_hook_id):
                # not the common case (the one backward running, already seen, ours the tensor's last hook): see
                # _enqueue
                pending = self._enqueue(entry, param, grad, graph_task_id(), calls)
                if pending is None:
                    return
            try:
                nbytes = grad.nbytes
            except RuntimeError:  # a sparse gradient: refused by name at its firing
                fire(param, entry, graph_task_id())
                return
            ident = id(param)
            if ident in pending.seen:  # a second firing in the same backward is processed once
                return
            pending.seen.add(ident)
            bucket_key = (grad.device, grad.dtype)
            bucket = pending.buckets.get(bucket_key)
            if bucket is None:
                bucket = pending.buckets[bucket_key] = _Bucket()
            bucket.items.append((entry, param))
            bucket.nbytes += nbytes
            if bucket.nbytes >= entry.bucket_bytes:
                pending.flush(bucket_key)
        return enqueue

    def _enqueue(self, entry: Entry, param: torch.Tensor, grad: torch.Tensor, backward_key: int, calls: FiringCalls
                 ) -> PendingBackward | None:
        """The firing's checks, when it is not the common case: the pending state of its backward that `param`'s
        gradient goes into, or None when it is processed now or not at all."""
        if entry.sharded is None:
            entry.sharded = is_dtensor(grad)
        if not entry.sharded:
            calls.check_distributed(entry, backward_key)
        if (backward_key < 0 or grad.requires_grad or torch.is_grad_enabled() or entry.has_later_hooks(param)
                or self.at_firing
                or entry.sharded):
            calls.fire(param, entry, backward_key)
            return None
        with self._lock:
            pending = self._running.get(backward_key)
            thread = threading.get_ident()
            if len(self._running) > (pending is not None) and any(
                    param in p for k, p in self._running.items()
                    if k != backward_key and not p.done and p.thread == thread):
                # fired again inside a nested backward (reentrant checkpointing) while the outer backward
                # still holds it: processed once, at the outer backward's end, on the full gradient
                return None
            if pending is None:
                self.firing.begin(backward_key)  # numbered from its first firing (see backwards.Backwards)
                pending = kept_until_end(self._running, backward_key,
                                         lambda: PendingBackward(self, calls, backward_key))
            self._last = (backward_key, weakref.ref(pending)) if len(self._running) == 1 else _NOT_ALONE
        return pending

    def process_together(self, items: list[tuple[Entry, torch.Tensor, torch.Tensor]], backward_key: int,
                         process: Callable[[Entry, torch.Tensor, torch.Tensor, int], None]) -> None:
        """Process (entry, grad, param) `items` of one backward, gradients of one device and dtype: one launch per
        pass for those that can share it, the others (empty, not dense, a shape not yet checked) one by one, each
        by `process(entry, grad, param, backward_key)` (`FiringCalls.process`)."""
        if not items:
            return
        device, dtype = items[0][1].device, items[0][1].dtype
        compiled_for = self.compilation.compiled
        if not self.compilation.reduces_over_dims:
            self._process_bucket(items, backward_key, process, compiled_for(dtype, device))
            return
        # a plan per gradient shape; gradients whose kernels are the same (one-pass kernels over units take the sizes
        # as arguments) share a bucket
        groups: dict[object, tuple] = {}
        for item in items:
            compiled = compiled_for(dtype, device, shape=item[1].shape)
            key = compiled.kernel if compiled.plan.backend == "triton" else item[1].shape
            group = groups.get(key) or groups.setdefault(key, (compiled, [], []))
            group[1].append(item)
            group[2].append(compiled.plan)
        for compiled, group, plans in groups.values():
            self._process_bucket(group, backward_key, process, compiled, plans)

    def _process_bucket(self, items: list[tuple[Entry, torch.Tensor, torch.Tensor]], backward_key: int,
                        process: Callable[[Entry, torch.Tensor, torch.Tensor, int], None], compiled,
                        plans: list | None = None) -> None:
        """`process_together` for gradients of one set of kernels, `compiled`. plans: each gradient's, for a body that
        reduces over dimensions (a plan per shape; their kernels index each gradient as contiguous)."""
        device, dtype = items[0][1].device, items[0][1].dtype
        plan = compiled.plan
        if plan.backend != "triton":  # one by one, each a firing of its own
            for entry, grad, p in items:
                process(entry, grad, p, backward_key)
            return
        uses_param = plan.graph.uses_param
        is_cuda, index = device.type == "cuda", items[0][1].get_device()  # compared without building torch.devices
        entries, grads, params, numels = [], [], [], []
        units = [] if compiled.kernel.SPEC.one_pass else None  # (units, elements of each) of each gradient
        alone = []
        for k, (entry, grad, p) in enumerate(items):
            if (grad.dtype == dtype and grad.get_device() == index and grad.is_cuda == is_cuda
                    and not grad.requires_grad and (numel := grad.numel()) and entry.checked_shape == grad.shape
                    and (grad.is_contiguous() or (plans is None and flat_span(grad) is not None))
                    and (not uses_param or (p.stride() == grad.stride() and _dense(p)))):
                entries.append(entry)
                grads.append(grad)
                params.append(p)
                numels.append(numel)
                if units is not None:
                    units.append(plans[k].units.unit_sizes)
            else:
                alone.append((entry, grad, p))
        for entry, grad, p in alone:  # each a firing of its own
            process(entry, grad, p, backward_key)
        if entries:
            workspace, scalars = self.workspaces.workspace(device), self.compilation.scalars
            units = None if units is None else tuple(units)
            rows = [entry.row for entry in entries]

            def launch(grads: list, params: list, stats: torch.Tensor | None, amp: tuple | None) -> None:
                launcher.fire_bucket(plan, compiled.kernel, grads, params, rows, scalars, stats, workspace, amp, units,
                                    tuple(numels))
            self.firing.run(plan, launch, backward_key, entries, rows, grads, params, whole=True)
