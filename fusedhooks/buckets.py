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

from . import runtime
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
        """Process the pending gradients of (device, dtype) `key`: one launch per pass for those that can
        share it, the others (empty, not dense, a shape not yet checked) one by one. A tensor whose
        registration was removed after it fired is processed too: remove() stops later firings only."""
        items = list(self.groups.pop(key, {}).values())
        self.nbytes.pop(key, None)
        if not items:
            return
        hook = self.hook
        device, dtype = key
        compiled = hook.compiled(dtype, device)
        plan, together = compiled.plan, []
        hook.stats.begin_firing(self.backward_key)
        for entry, p in items:
            grad = p.grad
            if grad is None:
                continue
            shareable = (plan.backend == "triton" and grad.numel() > 0 and not grad.requires_grad
                         and grad.dtype == dtype and grad.device == device
                         and flat_span(grad) is not None and entry.checked_shape == grad.shape
                         and (not plan.graph.uses_param or (p.stride() == grad.stride() and flat_span(p) is not None)))
            if shareable:
                together.append((entry, grad, p))
            else:
                hook.fire(p, entry, self.backward_key)
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

    def enqueue(self, entry: Entry, param: torch.Tensor) -> None:
        """The torch hook of a bucketed tensor. Processed now, at its own firing, when the gradient must be
        final before anything else runs (a post-accumulate hook registered after ours on the tensor), when
        autograd records the body (`.grad` requires grad: create_graph=True) or outside a backward."""
        hook = self._hook()
        grad = param.grad
        if hook is None or grad is None:
            return
        backward_key = torch._C._current_graph_task_id()
        if backward_key < 0 or grad.requires_grad or entry.has_later_hooks(param):
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
