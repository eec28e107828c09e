"""The firing: what one firing reads and writes, in what order, written once (DESIGN.md, Architecture: "the
firing"). One gradient at its own firing, a bucket of gradients (`buckets`, DDP's buckets) and a shard of a
sharded parameter (`distributed.ShardStats`) all run `Firing.run`; they differ only in the launch they hand it,
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

from .registry import Entry, record_all
from .stats import HookStats

#: `launch(grads, params, stats, amp)`: apply the plan to `grads` in place, writing the statistics into `stats` (a
#: row view, the whole buffer, or None) with AMP's (scale, found_inf) `amp` (or None)
Launch = Callable[[list, list, "torch.Tensor | None", "tuple | None"], None]


class Firing:
    """The firing sequence of one hook, handed what it needs from the hook (not the hook): its statistics `stats`
    (which number its backwards and hold its rows), the body's closed-over tensors `scalars` and their
    `check_scalars()`, and `amp_tensors(device, backward_key, rows, grads)` -> (scale, found_inf) (keeps the
    scaler's books; called only by plans with AMP; None for a hook without a scaler)."""

    __slots__ = ("stats", "scalars", "check_scalars", "amp_tensors")

    def __init__(self, stats: HookStats, scalars: list[torch.Tensor], check_scalars: Callable[[], None],
                 amp_tensors: Callable | None):
        self.stats = stats
        self.scalars = scalars
        self.check_scalars = check_scalars
        self.amp_tensors = amp_tensors

    def run(self, plan, backward_key: int, entries: list[Entry], rows: list[int], grads: list[torch.Tensor],
            params: list[torch.Tensor], launch: Launch, whole: bool = False) -> None:
        """One firing of `plan` on `grads` (of `params`; `entries` and their statistics `rows`) in the backward
        `backward_key`, launched by `launch`. whole: the launch writes the statistics through the whole buffer
        (a bucket's table) instead of one row view (one gradient)."""
        if self.scalars:
            self.check_scalars()
        self.stats.begin_firing(backward_key)
        buffer = written = None
        if plan.slots:
            buffer, written = self.rows(rows, grads, whole)
        amp = self.amp_tensors(grads[0].device, backward_key, rows, grads) if plan.amp else None
        launch(grads, params, written, amp)
        if buffer is not None:
            self.settle(buffer, rows)
        record_all(entries, grads)

    def rows(self, rows: list[int], grads: list[torch.Tensor], whole: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(the buffer, what the launch writes the statistics of `rows` into)."""
        if whole:
            buffer = self.stats.tensor
            return buffer, buffer
        return self.stats.writable_row(rows[0])

    def settle(self, buffer: torch.Tensor, rows: list[int]) -> None:
        """Rows `rows` of `buffer` were written by this firing (see HookStats.settle)."""
        self.stats.settle(buffer, rows)


class ShardFiring(Firing):
    """The firing of one rank's shard of a sharded (FSDP2) gradient: its statistics are partials, written into
    `partials` (a HookStats of `distributed.partial_stats` slots, its rows the hook's, grown by `partial_row(row,
    device)`), merged into the hook's rows when the backward ends; the hook's rows are marked as written by this
    backward."""

    __slots__ = ("partial_row",)

    def __init__(self, stats: HookStats, scalars: list[torch.Tensor], check_scalars: Callable[[], None],
                 partial_row: Callable[[int, torch.device], torch.Tensor]):
        super().__init__(stats, scalars, check_scalars, None)  # no AMP on shards (refused at registration)
        self.partial_row = partial_row

    def rows(self, rows: list[int], grads: list[torch.Tensor], whole: bool) -> tuple[torch.Tensor, torch.Tensor]:
        row = self.partial_row(rows[0], grads[0].device)
        return row, row

    def settle(self, buffer: torch.Tensor, rows: list[int]) -> None:
        self.stats.mark_written(rows)  # by this backward: merged into when it ends
