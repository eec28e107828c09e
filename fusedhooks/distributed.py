"""Distributed training: DDP and FSDP2.

- DDP (`hook.register(ddp_model)`): DDP's communication hook is ours: it all-reduces each bucket (the average, as
  DDP does) and, when backward ends, the averaged flat bucket is processed (one multi-tensor launch per pass over
  the bucket's per-parameter views) before DDP's own finalisation copies it into `.grad`. Every rank sees the
  same averaged gradients and records the same statistics.
- FSDP2 (`fully_shard`): FSDP calls post-accumulate hooks on the sharded DTensor parameters after its
  reduce-scatter. The body runs on this rank's shard in place; the statistics recorded on the shard are
  partials (`partial_stats`) that one collective per backward (`ShardStats`) merges into the statistics of the
  whole parameter, identical on every rank.
"""

from __future__ import annotations

import math
import threading
import weakref
from typing import TYPE_CHECKING

import torch

from . import gates, runtime
from .firing import ShardFiring
from .ir import STAT_NAMES
from .layout import flat_span, is_dtensor
from .registry import Entry, RegistrationHandle
from .stats import HookStats

if TYPE_CHECKING:
    from collections.abc import Callable

    from .buckets import Buckets, FiringCalls
    from .compilation import HookCompilation, Workspaces
    from .registration import Registration


class LocalGradientWarning(UserWarning):
    """A hook in a process group of several ranks processes each rank's own (under DDP: un-averaged) gradient."""


def _dist():
    return torch.distributed if torch.distributed.is_available() else None


def _all_gather_single(dist):
    """torch.distributed's all-gather into one tensor: `all_gather_single` (torch >= 2.13, which deprecates
    `all_gather_into_tensor` with a FutureWarning on every call), else `all_gather_into_tensor`."""
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def world_size() -> int | None:
    """The default process group's size, or None when there is none (yet)."""
    dist = _dist()
    if dist is None or not dist.is_initialized():
        return None
    return dist.get_world_size()


def is_ddp(target) -> bool:
    dist = _dist()
    return dist is not None and isinstance(target, torch.nn.parallel.DistributedDataParallel)


# --- DDP: the averaged bucket, in DDP's communication hook ---------------------------------------------------

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


def register_ddp(registration: Registration, calls: FiringCalls, ddp, name: str | None, bucket_mb,
                 handle: RegistrationHandle) -> RegistrationHandle:
    """`hook.register(ddp_model)`: process the averaged gradients of `ddp_model.module`'s parameters (keyed by
    their names there, `name` a prefix) inside DDP's communication hook. registration: the hook's (its checks,
    entries and buckets); calls: its firing calls, held by DDP's communication hook while registered; handle: the
    new, empty handle the registration goes into (returned)."""
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
    pending = _pending_for(state.running, state.lock, backward_key, lambda: _PendingBuckets(state, backward_key))
    pending.buckets.append((fut, items))
    return fut


def _pending_for(running: weakref.WeakValueDictionary, lock: threading.Lock, backward_key: int, make):
    """The pending state of the running backward `backward_key`: made by `make()` at its first use and held
    strongly only by the end-of-backward callback (its `run`) queued then, so a backward that raises drops it."""
    with lock:
        pending = running.get(backward_key)
        if pending is None:
            pending = make()
            torch.autograd.Variable._execution_engine.queue_callback(pending.run)
            running[backward_key] = pending
    return pending


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

    def run(self) -> None:
        entries = []
        for fut, items in self.buckets:  # waiting here: the all-reduce is done (CUDA: the stream waits for it)
            _process_bucket(self.owner, self.calls.process, fut, items, self.backward_key)
            entries += [e for e, _, _ in items]
        # queued from a callback: runs after DDP's finalisation, when `.grad` holds the processed values
        stats = self.owner.stats
        torch.autograd.Variable._execution_engine.queue_callback(lambda: _record_final(stats, entries))


def _record_final(stats: HookStats, entries: list[Entry]) -> None:
    """The statistics rows describe the final `.grad`s (DDP copied the buckets into them, or they are views).
    A parameter no rank used (find_unused_parameters=True) keeps no `.grad`: no eager hook would have fired on
    it, so its row (of the bucket's zeros) is cleared."""
    for entry in entries:
        p = entry.tensor
        if p is None:
            continue
        if p.grad is None:
            stats.clear_row(entry.row)
            entry.measured = None
        else:
            entry.record(p.grad)


# --- FSDP2: shards processed locally, statistics merged across ranks ------------------------------------------

#: The partials each statistic of a whole parameter is merged from.
_PARTIALS = {
    "count": ("count",), "sum": ("sum",), "mean": ("count", "sum"), "sumsq": ("sumsq",), "norm": ("norm",),
    "var": ("count", "sum", "var"), "std": ("count", "sum", "var"), "min": ("count", "min"),
    "max": ("count", "max"), "absmax": ("count", "absmax"), "nan": ("nan",), "inf": ("inf",),
    "zeros": ("zeros",), "hist": ("hist",),
}
_SUMMED = frozenset({"count", "sum", "sumsq", "nan", "inf", "zeros"})


def partial_stats(names: tuple[str, ...]) -> tuple[str, ...]:
    """The statistics a shard records so that `names` of the whole parameter can be merged from the ranks'."""
    needed = {p for n in names for p in _PARTIALS[n]}
    return tuple(n for n in STAT_NAMES + ("hist",) if n in needed)


def shard_group(name: str, t: torch.Tensor):
    """The process group across which `t`'s (a DTensor's) shards are spread: its mesh dimension of Shard
    placement (other dimensions must be Replicate: HSDP keeps whole copies there)."""
    from torch.distributed.tensor import Replicate, Shard

    shard_dims = [i for i, p in enumerate(t.placements) if isinstance(p, Shard)]
    others = [p for p in t.placements if not isinstance(p, (Shard, Replicate))]
    if others or len(shard_dims) > 1:
        raise ValueError(f"{name}: a DTensor placed as {tuple(t.placements)}; fusedhooks merges the statistics "
                         "of parameters sharded along one mesh dimension (FSDP2's Shard, HSDP's Replicate + "
                         "Shard); other placements are not supported")
    if not shard_dims:
        return None
    return t.device_mesh.get_group(shard_dims[0])


def partial_dims(name: str, param: torch.Tensor, grad: torch.Tensor) -> list[int]:
    """The mesh dimensions along which the DTensor `grad` (of `param`) is a partial sum: each rank holds a part of
    the gradient whose sum over those ranks is the gradient (a norm layer under tensor parallelism's
    SequenceParallel: the parameter is Replicate, its gradient Partial(sum) until torch reduces it, later). Refuses
    partial reductions other than a sum, and a partial dimension along which the parameter is not replicated."""
    from torch.distributed.tensor import Partial, Replicate

    dims = [i for i, p in enumerate(grad.placements) if isinstance(p, Partial)]
    for i in dims:
        op = grad.placements[i].reduce_op
        if op != "sum" or not isinstance(param.placements[i], Replicate):
            raise ValueError(f"{name}: its gradient is placed as {tuple(grad.placements)} and the parameter as "
                             f"{tuple(param.placements)}; fusedhooks processes partial gradients that are a sum "
                             "over ranks holding the whole parameter (Partial(sum) where the parameter is Replicate: "
                             "it reduces them first). Register the hook on the other parameters, or make this "
                             "gradient whole before the hook fires")
    return dims


def reduce_partial(grad: torch.Tensor, dims: list[int]) -> torch.Tensor:
    """The sum over the ranks of mesh dimensions `dims` of the DTensor `grad`'s local tensors (a new plain tensor, the
    same on every rank): one all-reduce per dimension, which torch would otherwise run later (when the optimizer or
    clip_grad_norm_ reads the gradient). Every rank of those dimensions must call it."""
    dist = _dist()
    whole = grad._local_tensor.clone()
    for i in dims:
        dist.all_reduce(whole, group=grad.device_mesh.get_group(i))
    return whole


def holds_reduced(grad: torch.Tensor, dims: list[int]) -> bool:
    """Does this rank hold the reduced gradient in a Partial(sum) DTensor `grad` (the first rank along every partial
    dimension `dims`), the other ranks holding zeros: the sum over the ranks is then the value, exactly?"""
    coordinate = grad.device_mesh.get_coordinate()
    return all(coordinate[i] == 0 for i in dims)


def shard_dim(t: torch.Tensor) -> int | None:
    """The tensor dim along which a DTensor is sharded (its Shard placement; see shard_group), None if none."""
    from torch.distributed.tensor import Shard

    return next((p.dim % t.ndim for p in t.placements if isinstance(p, Shard)), None)


def merge_partials(parts: torch.Tensor, partial_slots: tuple[str, ...], slots: tuple[str, ...]) -> torch.Tensor:
    """The statistics `slots` of whole parameters from their ranks' partials.

    parts: float64 [ranks, parameters, len(partial_slots)], rank order; returns float64 [parameters, len(slots)].
    Counts and sums add, min/max/absmax over the ranks whose shard is not empty (NaN propagates), variance by
    the stable pairwise merge (Chan et al.) of each shard's count, mean and M2.
    """
    first = {}
    for j, s in enumerate(partial_slots):
        first.setdefault(s, j)
    out, j = [], 0
    while j < len(slots):
        s = slots[j]
        prefix = "input." if s.startswith("input.") else ""
        name = s[len(prefix):]
        if name == "hist":
            k, bins = first[s], slots.count(s)
            out.extend(parts[:, :, k:k + bins].sum(0).unbind(-1))
            j += bins
            continue
        out.append(_merge_one(name, lambda stat, prefix=prefix: parts[:, :, first[prefix + stat]]))
        j += 1
    return torch.stack(out, dim=-1)


def _merge_one(name: str, col) -> torch.Tensor:
    if name in _SUMMED:
        return col(name).sum(0)
    if name == "norm":
        norms = col("norm")  # scaled by the largest, so that squares of fp64 norms cannot overflow
        scale = norms.abs().amax(0).clamp_min(torch.finfo(torch.float64).tiny)
        merged = (norms / scale).square().sum(0).sqrt() * scale
        infinite = norms.isinf().any(0) & ~norms.isnan().any(0)
        return torch.where(infinite, math.inf, merged)
    count = col("count")
    total = count.sum(0)
    nan = torch.tensor(math.nan, dtype=torch.float64, device=count.device)
    if name == "mean":
        return torch.where(total > 0, col("sum").sum(0) / total, nan)
    if name in ("var", "std"):
        sums = col("sum")
        mean = sums.sum(0) / total
        m2 = torch.where(count > 1, col("var") * (count - 1), 0.0).sum(0)
        spread = torch.where(count > 0, count * (sums / count - mean).square(), 0.0).sum(0)
        var = torch.where(total > 1, (m2 + spread) / (total - 1), nan)
        return var if name == "var" else var.sqrt()
    fill = math.inf if name == "min" else -math.inf
    values = torch.where(count > 0, col(name), fill)
    merged = values.amin(0) if name == "min" else values.amax(0)
    return torch.where(total > 0, merged, nan)


class _PendingMerge:
    """The sharded parameters that fired in one backward, merged when it ends: the outermost backward, whose nested
    ones (reentrant activation checkpointing) add their rows to it (`gates.at_end` holds it)."""

    def __init__(self, shards: ShardStats, task: gates.GraphTask | None):
        self.shards = shards
        self.task = task
        self.rows: dict[object, set[int]] = {}  # process group -> statistics rows

    def run(self) -> None:
        self.shards.merge(self.rows)


class ShardStats:
    """A hook's statistics of sharded (FSDP2) parameters: each firing records its shard's partials in
    `partials` (a HookStats of `partial_stats` slots, rows as the hook's); when the backward ends, one
    all-gather per process group (one in all for FSDP2) brings every rank's partials, and each rank merges them
    the same way into the hook's statistics rows.

    Handed the hook's parts, never the hook: `stats` (its statistics rows), `compilation` (its plans and kernels for
    shards, `compilation.shard_stats` the partials they record; the body's scalars), `workspaces` (its per-thread
    scratch), `check_scalars()` (refuses closed-over tensors the kernels cannot read) and `check_sharded(name, t)`
    (what a hook cannot do on a sharded parameter, `registration.Registration.check_sharded`)."""

    def __init__(self, stats: HookStats, compilation: HookCompilation, workspaces: Workspaces,
                 check_scalars: Callable[[], None], check_sharded: Callable[[str, torch.Tensor], None]):
        self.stats, self.compilation, self.workspaces = stats, compilation, workspaces
        self.check_scalars, self.check_sharded = check_scalars, check_sharded
        self.partials = HookStats(*compilation.shard_stats, compilation.hist_range)
        self._running: weakref.WeakValueDictionary[int, _PendingMerge] = weakref.WeakValueDictionary()
        self._lock = threading.Lock()
        self._index: dict[tuple, torch.Tensor] = {}

    def _partial_row(self, row: int, device: torch.device) -> torch.Tensor:
        names = self.stats.names
        while len(self.partials.names) <= row:
            self.partials.add_row(names[len(self.partials.names)], device)
        return self.partials.row(row)

    def fire(self, entry: Entry, param: torch.Tensor, grad: torch.Tensor, backward_key: int) -> None:
        """Process this rank's shard of `grad` (a DTensor) in place; record its partials for the merge."""
        compilation = self.compilation
        if entry.checked_shape != grad.shape:
            self.check_sharded(entry.name, param)
            compilation.check_shape(entry.name, grad)
            entry.checked_shape = grad.shape
        group = shard_group(entry.name, param)
        local, local_param = grad._local_tensor, param._local_tensor
        compiled = compilation.compiled(local.dtype, local.device, shard=True, shape=tuple(local.shape))
        plan, workspace, scalars = compiled.plan, self.workspaces.workspace(local.device), compilation.scalars
        partial = partial_dims(entry.name, param, grad)

        def launch(grads: list, params: list, partial_row: torch.Tensor | None, amp: tuple | None) -> None:
            if not partial:
                runtime.fire(plan, compiled.kernel, local, local_param, scalars, partial_row, workspace)
                return
            # a partial sum is never processed as the whole: reduced, processed identically on every rank, and held
            # by the first rank of the partial dimensions (the others zero), so that torch's later sum is the result
            whole = reduce_partial(grad, partial)
            runtime.fire(plan, compiled.kernel, whole, local_param, scalars, partial_row, workspace)
            if holds_reduced(grad, partial):
                local.copy_(whole)
            else:
                local.zero_()
        firing = ShardFiring(self.stats, scalars, self.check_scalars, self._partial_row)
        firing.run(plan, launch, backward_key, [entry], [entry.row], [local], [local_param])
        if not plan.slots:
            return
        if backward_key < 0:  # called by hand: every rank calls it, and it merges now
            self.merge({group: {entry.row}})
            return
        pending = self._running.get(backward_key) or self._pending_merge(backward_key)
        pending.rows.setdefault(group, set()).add(entry.row)

    def _pending_merge(self, backward_key: int) -> _PendingMerge:
        """The merge pending for the backward `backward_key`, in a backward that fires here for the first time: that
        of the backward it is nested in, or overlaps (one collective per backward), else a new one."""
        with self._lock:
            task = gates.track(backward_key)
            pending = next((p for p in self._running.values() if gates.same_backward(p.task)), None)
            if pending is None:
                pending = _PendingMerge(self, task)
                if not gates.at_end(backward_key, pending.run):  # no backward the process follows: at its own end
                    torch.autograd.Variable._execution_engine.queue_callback(pending.run)
            self._running[backward_key] = pending
            return pending

    def merge(self, rows_by_group: dict[object, set[int]]) -> None:
        """One all-gather of the partial rows per process group; every rank merges them into the same values."""
        stats = self.stats
        for group, rows in rows_by_group.items():
            rows = sorted(rows)
            device = stats.tensor.device
            key = (device, tuple(rows))
            index = self._index.get(key)
            if index is None:
                if len(self._index) > 64:
                    self._index.clear()
                index = self._index[key] = runtime.host_to_device(rows, torch.int64, device)
            part = self.partials.tensor.index_select(0, index)
            if group is None:
                ranks = 1
                gathered = part
            else:
                dist = _dist()
                ranks = dist.get_world_size(group)
                gathered = torch.empty((ranks * len(rows), part.shape[1]), dtype=part.dtype, device=device)
                _all_gather_single(dist)(gathered, part, group=group)
            merged = merge_partials(gathered.view(ranks, len(rows), -1), self.partials.slot_names,
                                    stats.slot_names)
            stats.tensor.index_copy_(0, index, merged)


def whole_norm(name: str, param: torch.Tensor, norm_type: float) -> torch.Tensor:
    """The `norm_type` norm of a sharded parameter's whole gradient (float64, 0-dim): this rank's part (of a partial
    gradient, reduced first: `reduce_partial`), then one all-reduce across the shards (every rank must call it). An
    empty shard contributes nothing."""
    dist = _dist()
    grad = param.grad
    partial = partial_dims(name, param, grad)
    local = (reduce_partial(grad, partial) if partial else grad._local_tensor).detach().reshape(-1).double()
    zero = torch.zeros((), dtype=torch.float64, device=local.device)
    if norm_type == math.inf:
        value, op = (local.abs().amax() if local.numel() else zero), dist.ReduceOp.MAX
    elif norm_type == -math.inf:
        value = local.abs().amin() if local.numel() else zero + math.inf
        op = dist.ReduceOp.MIN
    else:
        value, op = local.abs().pow(norm_type).sum(), dist.ReduceOp.SUM
    group = shard_group(name, param)
    if group is not None:
        dist.all_reduce(value, op=op, group=group)
    return value if norm_type in (math.inf, -math.inf) else value.pow(1.0 / norm_type)


# --- registration on a module follows its parameters (fully_shard replaces them) -----------------------------

def current_parameters(module: torch.nn.Module, prefix: str | None) -> list[tuple[str, torch.Tensor]]:
    """(name, parameter) of `module` as a hook registers them, FSDP2-managed ones as their sharded DTensor
    parameters (inside FSDP's forward the module holds unsharded ones)."""
    sharded = {}
    dist = _dist()
    if dist is not None:
        try:
            from torch.distributed.fsdp import FSDPModule
        except ImportError:  # pragma: no cover
            FSDPModule = ()
        for m in module.modules():
            if isinstance(m, FSDPModule):
                for group in m._get_fsdp_state()._fsdp_param_groups:
                    for fp in group.fsdp_params:
                        sharded[id(fp.sharded_param)] = fp.sharded_param
                        unsharded = getattr(fp, "_unsharded_param", None)
                        if unsharded is not None:
                            sharded[id(unsharded)] = fp.sharded_param
    head = f"{prefix}." if prefix else ""
    return [(head + n, sharded.get(id(p), p)) for n, p in module.named_parameters() if p.requires_grad]


def _fingerprint(module: torch.nn.Module) -> tuple:
    # fully_shard changes the class of every module it is applied to
    return tuple(type(m) for m in module.modules())


class _FollowParameters:
    """The forward pre-hook of `follow_parameters`. A copy of its module (copy.deepcopy, pickle, torch.save) gets
    `_NotFollowing` instead: torch does not copy the parameters' hooks either, so the copy is not registered."""

    def __init__(self, registration: Registration, calls: FiringCalls, prefix: str | None, bucket_bytes: int,
                 handle: RegistrationHandle, fingerprint):
        self.registration, self.calls = registration, calls
        self.prefix, self.bucket_bytes, self.handle = prefix, bucket_bytes, handle
        self.seen = fingerprint

    def __call__(self, mod: torch.nn.Module, args) -> None:
        if torch.compiler.is_compiling() or world_size() is None:
            return
        fingerprint = _fingerprint(mod)
        if fingerprint == self.seen:
            if self._replaced_around(mod):
                raise RuntimeError(
                    f"{self.registration.hook_name} was registered on this {type(mod).__name__}'s parameters, which "
                    "have been replaced since (by tensor parallelism's parallelize_module, which makes them "
                    "DTensors, by fully_shard applied to a module around it, or by assignment): the hook would never "
                    "fire. Register the hook after parallelize_module and fully_shard (or on the module given to "
                    "fully_shard, whose registration follows it)")
            return
        registration, handle = self.registration, self.handle
        pairs = current_parameters(mod, self.prefix)
        now = {id(t) for t in handle.tensors}
        if {id(t) for _, t in pairs} != now:
            handle.untrack()
            registration.check_targets(pairs)
            registration.register_pairs(pairs, self.bucket_bytes, handle, self.calls)
        self.seen = fingerprint  # only once followed: a refusal is raised again at every forward, never silent

    def _replaced_around(self, mod: torch.nn.Module) -> bool:
        """Are the registered tensors no longer the module's parameters though no module of it was fully_shard'ed
        (its classes are as they were)? Checked on the first one (it is the module's first, unless replaced); one
        collected while the module still has parameters was replaced (the module held it)."""
        if not self.handle.tracked:
            return False
        first = self.handle.first_tensor
        if first is None:
            return next(mod.parameters(), None) is not None
        return not is_dtensor(first) and all(p is not first for p in mod.parameters())

    def __reduce__(self):
        return _NotFollowing, ()


class _NotFollowing:
    """What a `_FollowParameters` becomes in a copy of its module: nothing to follow."""

    def __call__(self, mod: torch.nn.Module, args) -> None:
        return None


def follow_parameters(registration: Registration, calls: FiringCalls, module: torch.nn.Module, prefix: str | None,
                      bucket_bytes: int, handle: RegistrationHandle) -> None:
    """Keep a module registration on the module's current parameters: at each forward in a process group,
    when a module of it has been `fully_shard`ed since (its class changed), the hook moves to the sharded
    parameters (same names, rows cleared), registered again by `registration` with the firing `calls` (which the
    module's forward pre-hook holds, as the tensors' torch hooks do)."""
    check = _FollowParameters(registration, calls, prefix, bucket_bytes, handle, _fingerprint(module))
    pre = module.register_forward_pre_hook(check)
    handle.on_remove(pre.remove)
