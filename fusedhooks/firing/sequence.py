"""The firing: what one firing reads and writes, in what order, written once (DESIGN.md, Architecture: "the
firing"). One gradient at its own firing, a bucket of gradients (`buckets`, DDP's buckets) and a shard of a
sharded parameter (`shards.ShardStats`) all run `Firing.run`; they differ only in the launch they hand it,
in where the statistics rows are written (a row of the hook's buffer, the whole buffer through a bucket's table,
or the shard's partials row) and in how rows are marked as written.

The sequence: the closed-over tensors checked, the backward numbered (only once the checks have passed), the
statistics rows taken, AMP's (scale, found_inf) taken (the scaler's books kept), the launch, the rows marked as
written by this backward (only once the launch has returned: a firing that raises leaves the marks as they were),
and the gradients recorded as what the rows describe (for clip_grad_norm_).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..stats.buffer import HookStats
from .registry import Entry, record_all

#: `launch(grads, params, stats, amp)`: apply the plan to `grads` in place, writing the statistics into `stats` (a
#: row view, the whole buffer, or None) with AMP's (scale, found_inf) `amp` (or None)
Launch = Callable[[list, list, "torch.Tensor | None", "tuple | None"], None]


class Firing:
    """The firing sequence of one hook, handed what it needs from the hook (not the hook): its statistics `stats`
    (which number its backwards and hold its rows), the body's closed-over tensors `scalars` and their
    `check_scalars()`, and `amp_tensors(device, backward_key, rows, grads)` -> (scale, found_inf) (keeps the
    scaler's books; called only by plans with AMP; None for a hook without a scaler).

    partial_row: None for a hook's own rows; for the shards of a sharded gradient (see ShardFiring) `partial_row(row,
    device)` -> the partials row the launch writes instead."""

    __slots__ = ("stats", "scalars", "check_scalars", "amp_tensors", "partial_row")

    def __init__(self, stats: HookStats, scalars: list[torch.Tensor], check_scalars: Callable[[], None],
                 amp_tensors: Callable | None, partial_row: Callable[[int, torch.device], torch.Tensor] | None = None):
        self.stats = stats
        self.scalars = scalars
        self.check_scalars = check_scalars
        self.amp_tensors = amp_tensors
        self.partial_row = partial_row

    def run(self, plan, launch: Launch, backward_key: int, entries: list[Entry], rows: list[int],
            grads: list[torch.Tensor], params: list[torch.Tensor], whole: bool = False) -> None:
        """One firing of `plan` on `grads` (of `params`; `entries` and their statistics `rows`) in the backward
        `backward_key`, launched by `launch`. whole: the launch writes the statistics through the whole buffer
        (a bucket's table) instead of one row view (one gradient).

        The launch writes the statistics into (buffer, written): (the buffer, row rows[0] of it), or (the buffer,
        the buffer) when whole, or (the partials row, the partials row) on a shard; after it, the rows are marked
        as written by this backward (`HookStats.mark_written`; a shard's partials are merged into them when the
        backward ends)."""
        if self.scalars:
            self.check_scalars()
        stats, partial_row = self.stats, self.partial_row
        buffer = written = None
        if not plan.slots:
            stats.begin_firing(backward_key)
        elif partial_row is not None:
            stats.begin_firing(backward_key)
            buffer = written = partial_row(rows[0], grads[0].device)
        elif whole:
            stats.begin_firing(backward_key)
            buffer = written = stats.tensor
        else:
            buffer, written = stats.begin_firing(backward_key, rows[0])
        amp = self.amp_tensors(grads[0].device, backward_key, rows, grads) if plan.amp else None
        launch(grads, params, written, amp)
        if buffer is not None:
            stats.mark_written(rows, buffer if partial_row is None else None)
        record_all(entries, grads)

    def begin(self, backward_key: int) -> None:
        """The backward `backward_key` is numbered now, before any launch (a bucket, from its first firing)."""
        self.stats.begin_firing(backward_key)

    def record_final(self, entries: list[Entry]) -> None:
        """The statistics rows of `entries` describe their tensors' final `.grad`s, which another copy wrote after the
        launch (DDP's finalisation copies its buckets into them, or they are views). A tensor without `.grad` (a
        parameter no rank used, under find_unused_parameters=True: no eager hook would have fired on it) has its row
        (of the bucket's zeros) cleared."""
        for entry in entries:
            p = entry.tensor
            if p is None:
                continue
            if p.grad is None:
                self.stats.clear_row(entry.row)
                entry.measured = None
            else:
                record_all([entry], [p.grad])


def run_traced(launch: Callable[[tuple | None], None], row: int, generations: torch.Tensor | None,
               epoch: torch.Tensor | None, scale: torch.Tensor | None, found_inf: torch.Tensor | None,
               unscaled_backwards: torch.Tensor | None, bump: bool) -> None:
    """The firing sequence of a traced firing (`ops.firing`), whose books are tensors on the device, written in the
    graph: the backward's number into `generations[row]` (int64 [parameters]), `epoch` (int64, 0-dim) first
    incremented when `bump` (the hook's first firing in the traced backward); with AMP, `found_inf` (float32, 0-dim)
    zeroed and `unscaled_backwards` (int64, 0-dim) counted when `bump`; then `launch(amp)`, amp (scale, found_inf) or
    None. The rows are marked and the gradients recorded by those books alone (no Python runs in the graph)."""
    if generations is not None and epoch is not None:
        if bump:
            epoch.add_(1)
        generations[row].copy_(epoch)
    amp = None
    if scale is not None and found_inf is not None and unscaled_backwards is not None:
        if bump:
            found_inf.zero_()
            unscaled_backwards.add_(1)
        amp = (scale, found_inf)
    launch(amp)


class ShardFiring(Firing):
    """The firing of one rank's shard of a sharded (FSDP2) gradient: its statistics are partials, written into
    `partials` (a HookStats of `stats.merge.partial_stats` slots, its rows the hook's, grown by `partial_row(row,
    device)`), merged into the hook's rows when the backward ends; the hook's rows are marked as written by this
    backward."""

    __slots__ = ()

    def __init__(self, stats: HookStats, scalars: list[torch.Tensor], check_scalars: Callable[[], None],
                 partial_row: Callable[[int, torch.device], torch.Tensor]):
        super().__init__(stats, scalars, check_scalars, None, partial_row)  # no AMP on shards (refused at registration)
