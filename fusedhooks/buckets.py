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
from typing import TYPE_CHECKING

import torch

from . import distributed, runtime
from .layout import flat_span
from .registry import Entry

if TYPE_CHECKING:
    from .api import GradHook


class PendingBackward:
    """The gradients of one backward waiting in buckets, per (device, dtype)."""

    def __init__(self, hook: GradHook, backward_key: int):
        self.hook = hook
        self.backward_key = backward_key
        self.thread = threading.get_ident()  # a nested (reentrant) backward runs on its parent's thread
        self.groups: dict[tuple, dict[int, tuple[Entry, torch.Tensor]]] = {}
        self.nbytes: dict[tuple, int] = {}
        self.done = False

    def __contains__(self, param: torch.Tensor) -> bool:
        return any(id(param) in group for group in self.groups.values())

    def add(self, entry: Entry, param: torch.Tensor) -> None:
        """Collect `param`'s gradient; launch its bucket once it holds entry.bucket_bytes."""
        grad = param.grad
        key = (grad.device, grad.dtype)
        self.groups.setdefault(key, {})[id(param)] = (entry, param)
        self.nbytes[key] = self.nbytes.get(key, 0) + grad.numel() * grad.element_size()
        if self.nbytes[key] >= entry.bucket_bytes:
            self.flush(key)

    def flush_all(self) -> None:
        """The end-of-backward callback: process everything still pending."""
        self.done = True
        for key in list(self.groups):
            self.flush(key)

    def flush(self, key: tuple) -> None:
        """Process the pending gradients of (device, dtype) `key` (see `process_together`). A tensor whose
        registration was removed after it fired is processed too: remove() stops later firings only."""
        items = list(self.groups.pop(key, {}).values())
        self.nbytes.pop(key, None)
        process_together(self.hook, [(entry, p.grad, p) for entry, p in items if p.grad is not None],
                         self.backward_key)


def process_together(hook: GradHook, items: list[tuple[Entry, torch.Tensor, torch.Tensor]], backward_key: int) -> None:
    """Process (entry, grad, param) `items` of one backward, gradients of one device and dtype: one launch per
    pass for those that can share it, the others (empty, not dense, a shape not yet checked) one by one."""
    if not items:
        return
    device, dtype = items[0][1].device, items[0][1].dtype
    compiled = hook.compiled(dtype, device)
    plan, together = compiled.plan, []
    hook.stats.begin_firing(backward_key)
    for entry, grad, p in items:
        shareable = (plan.backend == "triton" and grad.numel() > 0 and not grad.requires_grad
                     and grad.dtype == dtype and grad.device == device
                     and flat_span(grad) is not None and entry.checked_shape == grad.shape
                     and (not plan.graph.uses_param or (p.stride() == grad.stride() and flat_span(p) is not None)))
        if shareable:
            together.append((entry, grad, p))
        else:
            hook.process(entry, grad, p, backward_key)
    if together:
        for entry, _, _ in together:
            hook.stats.row(entry.row)  # marks it written by this backward
        amp = hook.amp_tensors(device) if plan.amp else None
        runtime.fire_bucket(plan, compiled.kernel, [(g, p, e.row) for e, g, p in together], hook.scalars,
                            hook.stats.tensor if plan.slots else None, hook.workspace(device), amp)
        for entry, grad, _ in together:
            entry.record(grad)


class Buckets:
    """A hook's end-of-backward buckets: the PendingBackward of each backward now running."""

    def __init__(self, hook: GradHook):
        self._hook = weakref.ref(hook)
        #: graph task id -> its pending state, held strongly only by the callback queued on that graph task
        self._running: weakref.WeakValueDictionary[int, PendingBackward] = weakref.WeakValueDictionary()
        self._lock = threading.Lock()
        #: True once the hook runs in a process group of several ranks: DDP's reducer may read each gradient
        #: right after our firing, so nothing waits for the end of backward
        self.at_firing = False

    def enqueue(self, entry: Entry, param: torch.Tensor) -> None:
        """The torch hook of a bucketed tensor. Processed now, at its own firing, when the gradient must be
        final before anything else runs (a post-accumulate hook registered after ours on the tensor), when
        autograd records the body (`.grad` requires grad: create_graph=True), outside a backward, for a sharded
        (FSDP2) gradient, and in a process group of several ranks (see GradHook._check_distributed)."""
        hook = self._hook()
        grad = param.grad
        if hook is None or grad is None:
            return
        backward_key = torch._C._current_graph_task_id()
        sharded = distributed.is_dtensor(grad)
        if not hook._distributed_checked and not sharded:
            hook._check_distributed(entry)
        if (backward_key < 0 or grad.requires_grad or entry.has_later_hooks(param) or self.at_firing
                or sharded):
            hook.fire(param, entry, backward_key)
            return
        with self._lock:
            pending = self._running.get(backward_key)
            thread = threading.get_ident()
            if any(param in p for k, p in self._running.items()
                   if k != backward_key and not p.done and p.thread == thread):
                # fired again inside a nested backward (reentrant checkpointing) while the outer backward
                # still holds it: processed once, at the outer backward's end, on the full gradient
                return
            if pending is None:
                pending = PendingBackward(hook, backward_key)
                torch.autograd.Variable._execution_engine.queue_callback(pending.flush_all)
                self._running[backward_key] = pending
        if param not in pending:  # a second firing in the same backward is processed once, too
            pending.add(entry, param)
