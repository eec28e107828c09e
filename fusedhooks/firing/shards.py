"""FSDP2 (`fully_shard`): FSDP calls post-accumulate hooks on the sharded DTensor parameters after its
reduce-scatter. The body runs on this rank's shard in place; the statistics recorded on the shard are partials
(`stats.merge.partial_stats`) that one collective per backward (`ShardStats`) merges into the statistics of the whole
parameter, identical on every rank."""

from __future__ import annotations

import functools
import threading
import weakref
from typing import TYPE_CHECKING

import torch

from ..runtime import launcher
from ..runtime.process_groups import (
    ShardSpread,
    all_gather_single,
    covers_world,
    dist_module,
    holds_reduced,
    partial_dims,
    reduce_partial,
    shard_spread,
    spread_ranks,
)
from ..stats import backwards
from ..stats.buffer import HookStats
from ..stats.merge import merge_partials
from .registry import Entry
from .sequence import ShardFiring

if TYPE_CHECKING:
    from collections.abc import Callable

    from ..runtime.compilation import HookCompilation, Workspaces


class _PendingMerge:
    """The sharded parameters that fired in one backward, merged when it ends: the outermost backward, whose nested
    ones (reentrant activation checkpointing) add their rows to it (`backwards.at_end` holds it)."""

    def __init__(self, shards: ShardStats, task: backwards.GraphTask | None):
        self.shards = shards
        self.task = task
        self.rows: dict[ShardSpread | None, set[int]] = {}  # where the shards are -> statistics rows

    def run(self) -> None:
        self.shards.merge(self.rows)


def _partial_row(partials: HookStats, stats: HookStats, row: int, device: torch.device) -> torch.Tensor:
    """Row `row` of `partials`, whose rows follow the hook's statistics rows `stats` (added up to `row`)."""
    names = stats.names
    while len(partials.names) <= row:
        partials.add_row(names[len(partials.names)], device)
    return partials.row(row)


class ShardLaunch:
    """The launch of one sharded parameter's shards (`sequence.Launch`), bound at their first firing of a dtype,
    device, shape and placement: the plan and kernels for shards, the body's closed-over tensors `scalars`, the hook's
    per-thread `workspaces`, the ranks its shards are spread over (`spread`, None: whole on every rank) and the mesh
    dimensions along which its gradient is a partial sum (`partial`, of `mesh`)."""

    __slots__ = ("plan", "kernel", "scalars", "workspaces", "spread", "mesh", "partial")

    def __init__(self, plan, kernel, scalars: list[torch.Tensor], workspaces: Workspaces,
                 spread: ShardSpread | None, mesh, partial: list[int]):
        self.plan, self.kernel, self.scalars, self.workspaces = plan, kernel, scalars, workspaces
        self.spread, self.mesh, self.partial = spread, mesh, partial

    def __call__(self, grads: list, params: list, partial_row: torch.Tensor | None, amp: tuple | None) -> None:
        local, local_param = grads[0], params[0]
        workspace = self.workspaces.workspace(local.device)
        if not self.partial:
            launcher.fire(self.plan, self.kernel, local, local_param, self.scalars, partial_row, workspace)
            return
        # a partial sum is never processed as the whole: reduced, processed identically on every rank, and held by
        # the first rank of the partial dimensions (the others zero), so that torch's later sum is the result
        whole = reduce_partial(local, self.mesh, self.partial)
        launcher.fire(self.plan, self.kernel, whole, local_param, self.scalars, partial_row, workspace)
        if holds_reduced(self.mesh, self.partial):
            local.copy_(whole)
        else:
            local.zero_()


class ShardStats:
    """A hook's statistics of sharded (FSDP2) parameters: each firing records its shard's partials in
    `partials` (a HookStats of `partial_stats` slots, rows as the hook's); when the backward ends, one
    all-gather per process group (one in all for FSDP2) brings every rank's partials, and each rank merges them
    the same way into the hook's statistics rows.

    Handed the hook's parts, never the hook: `stats` (its statistics rows), `compilation` (its plans and kernels for
    shards, `compilation.shard_stats` the partials they record; the body's scalars), `workspaces` (its per-thread
    scratch), `check_scalars()` (refuses closed-over tensors the kernels cannot read: handed to the shards' firing
    sequence) and `check_sharded(name, t)` (what a hook cannot do on a sharded parameter,
    `registration.Registration.check_sharded`)."""

    def __init__(self, stats: HookStats, compilation: HookCompilation, workspaces: Workspaces,
                 check_scalars: Callable[[], None], check_sharded: Callable[[str, torch.Tensor], None]):
        self.stats, self.compilation, self.workspaces = stats, compilation, workspaces
        self.check_sharded = check_sharded
        self.partials = HookStats(*compilation.shard_stats, compilation.hist_range)
        self._running: weakref.WeakValueDictionary[int, _PendingMerge] = weakref.WeakValueDictionary()
        self._lock = threading.Lock()
        self._index: dict[tuple, torch.Tensor] = {}
        #: the firing sequence of a shard, its statistics written into its row of `partials` (grown to the hook's rows)
        self.firing = ShardFiring(stats, compilation.scalars, check_scalars,
                                  functools.partial(_partial_row, self.partials, stats))
        #: (row, dtype, device, shape, placements, mesh) of a parameter's shards -> their launch (see `_bind`)
        self._launches: dict[tuple, ShardLaunch] = {}

    def fire(self, entry: Entry, param: torch.Tensor, grad: torch.Tensor, backward_key: int) -> None:
        """Process this rank's shard of `grad` (a DTensor) in place; record its partials for the merge."""
        if entry.checked_shape != grad.shape:
            self.check_sharded(entry.name, param)
            self.compilation.check_shape(entry.name, grad)
            entry.checked_shape = grad.shape
        local, local_param = grad._local_tensor, param._local_tensor
        key = (entry.row, local.dtype, local.device, local.shape, grad.placements, grad.device_mesh)
        launch = self._launches.get(key) or self._bind(key, entry, param, grad)
        self.firing.run(launch.plan, launch, backward_key, [entry], [entry.row], [local], [local_param])
        if not launch.plan.slots:
            return
        if backward_key < 0:  # called by hand: every rank calls it, and it merges now
            self.merge({launch.spread: {entry.row}})
            return
        pending = self._running.get(backward_key) or self._pending_merge(backward_key)
        pending.rows.setdefault(launch.spread, set()).add(entry.row)

    def _bind(self, key: tuple, entry: Entry, param: torch.Tensor, grad: torch.Tensor) -> ShardLaunch:
        """The launch of `entry`'s shards of `grad`'s dtype, device, shape and placement, bound at their first firing
        (`key`)."""
        local = grad._local_tensor
        compiled = self.compilation.compiled(local.dtype, local.device, shard=True, shape=tuple(local.shape))
        launch = ShardLaunch(compiled.plan, compiled.kernel, self.compilation.scalars, self.workspaces,
                             shard_spread(entry.name, param), grad.device_mesh,
                             partial_dims(entry.name, param, grad))
        if len(self._launches) > 4096:  # parameters registered again and again: keep it small
            self._launches.clear()
        self._launches[key] = launch
        return launch

    def _pending_merge(self, backward_key: int) -> _PendingMerge:
        """The merge pending for the backward `backward_key`, in a backward that fires here for the first time: that
        of the backward it is nested in, or overlaps (one collective per backward), else a new one."""
        with self._lock:
            task = backwards.track(backward_key)
            pending = next((p for p in self._running.values() if backwards.same_backward(p.task)), None)
            if pending is None:
                pending = _PendingMerge(self, task)
                if not backwards.at_end(backward_key, pending.run):  # no backward the process follows: at its own end
                    torch.autograd.Variable._execution_engine.queue_callback(pending.run)
            self._running[backward_key] = pending
            return pending

    def merge(self, rows_by_spread: dict[ShardSpread | None, set[int]]) -> None:
        """Every rank's partial rows gathered, one all-gather per device mesh when the mesh spans the default process
        group (FSDP2, FSDP2 + TP, HSDP: one per backward), else one per sharded mesh dimension of each spread; every
        rank merges the rows of the ranks holding the other shards of its copy, in the same order, into the same
        values."""
        by_mesh: dict[object, list[ShardSpread | None]] = {}
        for spread in rows_by_spread:
            by_mesh.setdefault(None if spread is None else spread.mesh, []).append(spread)
        for mesh, spreads in by_mesh.items():
            if mesh is not None and covers_world(mesh):
                rows = sorted(set().union(*(rows_by_spread[s] for s in spreads)))
                gathered = self._gather(rows, [None])  # [world, rows, slots], global rank order
                position = {row: i for i, row in enumerate(rows)}
                for spread in spreads:
                    mine = sorted(rows_by_spread[spread])
                    at = self._index_of([position[r] for r in mine], gathered.device)
                    ranks = self._index_of(spread_ranks(spread), gathered.device)
                    self._store(mine, gathered.index_select(0, ranks).index_select(1, at))
                continue
            for spread in spreads:
                rows = sorted(rows_by_spread[spread])
                groups = [] if spread is None else [spread.mesh.get_group(d) for d in spread.dims]
                self._store(rows, self._gather(rows, groups))

    def _gather(self, rows: list[int], groups: list) -> torch.Tensor:
        """Partial rows `rows` of every rank of `groups` (None: the default group), gathered over one after the
        other: float64 [ranks, len(rows), slots], in the same order on every rank (no group: this rank's alone)."""
        device = self.stats.tensor.device
        part = self.partials.tensor.index_select(0, self._index_of(rows, device)).unsqueeze(0)
        dist = dist_module()
        for group in groups:
            ranks = dist.get_world_size(group)
            gathered = torch.empty((ranks * part.shape[0], *part.shape[1:]), dtype=part.dtype, device=device)
            all_gather_single(dist)(gathered, part, group=group)
            part = gathered
        return part

    def _store(self, rows: list[int], gathered: torch.Tensor) -> None:
        """Merge the partials `gathered` ([ranks, len(rows), slots]) into the statistics rows `rows`."""
        stats = self.stats
        merged = merge_partials(gathered, self.partials.slot_names, stats.slot_names)
        stats.tensor.index_copy_(0, self._index_of(rows, stats.tensor.device), merged)

    def _index_of(self, values: list[int], device: torch.device) -> torch.Tensor:
        """`values` (rows, ranks) as an int64 tensor on `device`, kept: the same rows merge at every backward."""
        key = (device, tuple(values))
        index = self._index.get(key)
        if index is None:
            if len(self._index) > 64:
                self._index.clear()
            index = self._index[key] = launcher.host_to_device(values, torch.int64, device)
        return index
