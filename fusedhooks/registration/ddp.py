"""DDP (`hook.register(ddp_model)`): DDP's communication hook is ours. It all-reduces each bucket (the average, as DDP
does) and, when backward ends, the averaged flat bucket is processed (one multi-tensor launch per pass over the bucket's
per-parameter views) before DDP's own finalisation copies it into `.grad`. Every rank sees the same averaged gradients
and records the same statistics."""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING

import torch

from ..firing.registry import Entry, RegistrationHandle
from ..runtime.layout import flat_span
from ..stats.backwards import kept_until_end
from . import gates
from .register import check_name

if TYPE_CHECKING:
    from collections.abc import Callable

    from ..firing.buckets import Buckets, FiringCalls
    from .register import Registration


class _DDPState:
    """What the communication hook of one `register(ddp_model)` needs (DDP keeps it as the hook's state): the hook's
    `buckets` (which process DDP's buckets together) and its firing `calls` (None once removed)."""

    def __init__(self, buckets: Buckets, calls: FiringCalls, process_group, entries: dict[int, Entry]):
        self.buckets, self.calls = buckets, calls
        self.process_group = process_group
        self.entries = entries  # id(parameter) -> its entry
        self.active = True  # False after handle.remove(): DDP cannot unregister a comm hook; it just all-reduces
        self.running: weakref.WeakValueDictionary[int, _PendingBuckets] = weakref.WeakValueDictionary()
        self.lock = threading.Lock()

    def deactivate(self) -> None:
        """handle.remove(): from now on only all-reduce, and let the hook go (a backward running keeps its own)."""
        self.active, self.calls = False, None


def register_ddp(registration: Registration, calls: FiringCalls, ddp, name: str | None, bucket_mb, accumulation_steps,
                 when, handle: RegistrationHandle) -> RegistrationHandle:
    """`hook.register(ddp_model)`: process the averaged gradients of `ddp_model.module`'s parameters (keyed by
    their names there, `name` a prefix) inside DDP's communication hook. registration: the hook's (its checks,
    entries and buckets); calls: its firing calls, held by DDP's communication hook while registered; handle: the
    new, empty handle the registration goes into (returned)."""
    check_name(name)
    if gates.parse(accumulation_steps, when) is not None:
        raise ValueError("register(ddp_model) takes no accumulation_steps= or when=: run the micro-batches "
                         "that do not step under ddp_model.no_sync(); DDP then communicates, and the hook "
                         "runs, only in the synchronising backward, on the accumulated average")
    if bucket_mb:
        raise ValueError("register(ddp_model) processes DDP's own buckets, one launch per pass each (their size is "
                         "DistributedDataParallel's bucket_cap_mb=); do not pass bucket_mb=")
    if getattr(ddp, "static_graph", False):
        raise ValueError("register(ddp_model) does not support DistributedDataParallel(static_graph=True) yet: on its "
                         "first iteration DDP reduces every bucket after backward, past the point where fusedhooks "
                         "processes them; use static_graph=False. Reentrant activation checkpointing, which DDP runs "
                         "with static_graph=True, works with checkpoint(..., use_reentrant=False) and "
                         "static_graph=False, or with the hook registered on ddp_model.module (each rank's own "
                         "gradient, before DDP averages it)")
    pairs = [(n, p) for n, p in registration.named_targets(ddp.module, name) if p.requires_grad]
    registration.check_targets(pairs)
    ignored_names = set(getattr(ddp, "parameters_to_ignore", ()) or ())
    ignored = {id(p) for n, p in ddp.module.named_parameters() if n in ignored_names}
    local = [(n, p) for n, p in pairs if id(p) in ignored]  # DDP neither averages them nor passes them to its hook
    pairs = [(n, p) for n, p in pairs if id(p) not in ignored]
    entries, added = {}, []
    try:
        for pname, p in pairs:
            entry = registration.add_tensor(pname, p)
            added.append(entry)
            entry.checked_shape = p.shape
            entry.averaged = True
            entries[id(p)] = entry
        removed = next((s for h, s in getattr(ddp, "_comm_hooks", ()) if h is _comm_hook and not s.active), None)
        if removed is not None:  # an earlier register(ddp_model), removed: DDP keeps its hook, which we take over
            state = removed
            state.buckets, state.calls = registration.buckets, calls
            state.entries, state.running = entries, weakref.WeakValueDictionary()
            state.active = True
        else:
            state = _DDPState(registration.buckets, calls, ddp.process_group, entries)
            try:
                ddp.register_comm_hook(state, _comm_hook)
            except RuntimeError as e:
                raise RuntimeError(f"{e} (fusedhooks processes the averaged gradients in a DDP communication hook "
                                   "of its own, and DDP takes one per model: register the fusedhooks hook on a DDP "
                                   "model without a communication hook)") from e
    except BaseException:
        registration.registry.discard(added)
        raise
    for _, p in pairs:
        handle.add(p, _NoTorchHook(), registration.registry)
    handle.on_remove(state.deactivate)
    if local:  # processed at their own firing: their gradient is each rank's own, which is all DDP gives them
        ddp_ref = weakref.ref(ddp)

        def synchronising() -> bool:  # as the others: not under ddp_model.no_sync(), only in the backward that syncs
            model = ddp_ref()
            return model is None or model.require_backward_grad_sync

        try:
            registration.register_pairs(local, 0, handle, calls, ddp_ignored=True, when=synchronising)
        except BaseException:
            handle.remove()
            raise
    return handle


class _NoTorchHook:
    """The torch-hook slot of a DDP registration (there is none: DDP's communication hook is ours)."""

    def remove(self) -> None:
        pass


def _bucket_views(buffer: torch.Tensor, params: list[torch.Tensor], offsets: list[int]) -> list[torch.Tensor]:
    """Each parameter's gradient in DDP's flat bucket, laid out as DDP lays it out (the parameter's strides when
    it is dense, else contiguous)."""
    views = []
    for p, offset in zip(params, offsets):
        if flat_span(p) is not None:
            views.append(buffer.as_strided(p.shape, p.stride(), buffer.storage_offset() + offset))
        else:
            views.append(buffer.narrow(0, offset, p.numel()).view(p.shape))
    return views


def _comm_hook(state, bucket):  # no annotations: DDP checks them, and `from __future__ import annotations` strings them
    """DDP's communication hook: all-reduce the bucket (the average, as DDP does), then process it in place."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    fut = allreduce_hook(state.process_group, bucket)
    if not state.active or state.calls.is_paused():
        return fut
    buffer = bucket.buffer()
    params = bucket.parameters()
    offsets = [g.storage_offset() - buffer.storage_offset() for g in bucket.gradients()]
    items = [(state.entries.get(id(p)), p, offset) for p, offset in zip(params, offsets)]
    items = [(e, p, offset) for e, p, offset in items if e is not None]
    if not items:
        return fut
    backward_key = torch._C._current_graph_task_id()
    if backward_key < 0:  # not from a backward (DDP always calls it from one): processed when reduced
        buckets, process = state.buckets, state.calls.process
        return fut.then(lambda f: _process_bucket(buckets, process, f, items, backward_key))
    with state.lock:
        pending = kept_until_end(state.running, backward_key, lambda: _PendingBuckets(state, backward_key))
    pending.buckets.append((fut, items))
    return fut


def _process_bucket(buckets: Buckets, process: Callable, fut: torch.futures.Future, items: list, backward_key: int
                    ) -> torch.Tensor:
    """Process the averaged flat bucket `fut` holds: one launch per pass for its parameters, by the hook's `buckets`
    (`Buckets.process_together`; `process`: FiringCalls.process, for a gradient processed alone)."""
    flat = fut.wait()
    if isinstance(flat, list):
        flat = flat[0]
    views = _bucket_views(flat, [p for _, p, _ in items], [offset for _, _, offset in items])
    buckets.process_together([(e, v, p) for (e, p, _), v in zip(items, views)], backward_key, process)
    return flat


class _PendingBuckets:
    """The buckets of one backward, processed when it ends, on the autograd thread, before DDP's finalisation
    copies them into `.grad` (DDP queues that callback after ours, and waits for the same futures). Held by
    the callback only: a backward that raises leaves nothing behind. It keeps the hook's buckets and firing calls
    of the backward's first bucket: a remove() during the backward stops later buckets only."""

    def __init__(self, state: _DDPState, backward_key: int):
        self.owner, self.calls = state.buckets, state.calls  # the hook's Buckets, its firing calls
        self.backward_key = backward_key
        self.buckets: list[tuple[torch.futures.Future, list]] = []

    def end(self) -> None:
        """The end-of-backward callback: process the buckets, then record the final gradients."""
        entries = []
        for fut, items in self.buckets:  # waiting here: the all-reduce is done (CUDA: the stream waits for it)
            _process_bucket(self.owner, self.calls.process, fut, items, self.backward_key)
            entries += [e for e, _, _ in items]
        # queued from a callback: runs after DDP's finalisation, when `.grad` holds the processed values
        firing = self.owner.firing
        torch.autograd.Variable._execution_engine.queue_callback(lambda: firing.record_final(entries))
