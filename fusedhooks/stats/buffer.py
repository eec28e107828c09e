"""The device statistics buffer of a hook and its readers."""

from __future__ import annotations

import fnmatch
import math
import threading

import torch

from ..compiler.ir import ALL_STAT_NAMES, COUNT_STATS
from ..compiler.plan import slot_names
from ..runtime.layout import static
from .backwards import Backwards


class ParamStats(dict):
    """One parameter's statistics {name: value}; `fresh` is True when the most recent backward in which the
    hook fired wrote them, False when they were recorded earlier (the parameter got no gradient since)."""

    fresh: bool = True


class StatsReading(dict):
    """What `HookStats.read()` returns: {parameter name: ParamStats}; `stale` lists the parameters whose rows
    were not written by the most recent backward in which the hook fired; `names` every registered parameter, in
    registration order (those that have not fired too)."""

    def __init__(self, names: list[str] = ()):
        super().__init__()
        self.names = list(names)

    @property
    def stale(self) -> list[str]:
        return [name for name, row in self.items() if not row.fresh]


class ScalarSelection:
    """Which statistics `HookStats.to_scalars` gives (the one selection of `to_scalars` and the training callbacks).

    stats: statistic names, as `read()` keys them ("norm", "input.max"; a str: one); None: all the hook records.
    params: fnmatch patterns (case-sensitive) over parameter names ("transformer.h.0.*"; a str: one); None: all.
    top_k: None: every selected parameter; k >= 0: a summary, `total_norm` (the L2 norm of the selected gradients,
    from their recorded norms) and the statistics of the k selected parameters with the largest norms (a NaN norm
    counts as the largest), largest first.
    summary: a fixed set of scalars over the selected parameters, as many for any model (no per-parameter keys):
    `total_norm` (L2, from the recorded norms), `absmax` (the largest absmax; a NaN counts as the largest) and
    `absmax_index` (its parameter's index in `names`, registration order: stable keys, whichever parameter it is), the
    totals `nan`, `inf` (and `input.nan`, `input.inf`), and `shrunk`, how many gradients the body left with a smaller
    absmax than they came with (clipped or scaled down); each where the hook records what it needs.
    """

    def __init__(self, stats=None, params=None, top_k: int | None = None, summary: bool = False):
        self.stats = _names(stats, "stats")
        self.params = _names(params, "params")
        if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0):
            raise ValueError(f"top_k= takes a number of parameters >= 0 (None: every parameter), not {top_k!r}")
        if summary and (self.stats is not None or top_k is not None):
            raise ValueError("the summary is a fixed set of scalars: select with stats= or top_k=, or summarise "
                             "(params= chooses the parameters either way)")
        self.top_k = top_k
        self.summary = summary

    def check_stats(self, slot_names: tuple[str, ...]) -> None:
        """Refuse statistics the hook (whose row layout is `slot_names`) does not record, and a summary without
        "norm"."""
        recorded = [name for name in dict.fromkeys(slot_names) if not name.endswith("hist")]
        for name in self.stats or ():
            if name.endswith("hist"):
                raise ValueError(f"stats= selects scalars; {name!r} is a histogram: read it with "
                                 "hook.stats.histogram(name) (or log_to_tensorboard)")
            if name not in recorded and name.removeprefix("input.") not in ALL_STAT_NAMES:
                raise ValueError(f"stats= names {name!r}, which is no statistic: this hook records {recorded} "
                                 f"(every statistic: {list(ALL_STAT_NAMES)}, 'input.<name>' for input_stats=)")
            if name not in recorded:
                option = "input_stats" if name.startswith("input.") else "stats"
                raise ValueError(f"stats= names {name!r}, which this hook does not record: choose among "
                                 f"{recorded}, or add {name.removeprefix('input.')!r} to the hook's {option}=")
        if self.top_k is not None and "norm" not in recorded:
            raise ValueError("top_k= ranks the parameters by their gradient's norm: create the hook with \"norm\" "
                             "among its stats (fh.grad_hook(..., stats=(\"norm\", ...)))")

    def check(self, slot_names: tuple[str, ...], names: list[str]) -> None:
        """`check_stats`, and refuse a params= pattern that matches none of the registered parameters `names`."""
        self.check_stats(slot_names)
        for pattern in self.params or ():
            if not any(fnmatch.fnmatchcase(name, pattern) for name in names):
                listed = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
                raise ValueError(f"params= pattern {pattern!r} matches none of the hook's parameters "
                                 f"({listed or 'none registered'}); patterns are fnmatch-style over these names, "
                                 "e.g. 'layer.0.*' or '*.bias'")

    def scalars(self, reading: StatsReading, prefix: str) -> dict[str, float | int]:
        """The selected scalars of `reading`'s fresh rows, histograms left out."""
        rows = [(name, row) for name, row in reading.items() if row.fresh and
                (self.params is None or any(fnmatch.fnmatchcase(name, pattern) for pattern in self.params))]
        if self.summary:
            return _summary(rows, prefix, reading.names)
        out = {}
        if self.top_k is not None and rows:
            out[f"{prefix}total_norm"] = _total_norm(rows)
            rows = sorted(rows, key=lambda item: -math.inf if math.isnan(item[1]["norm"]) else -item[1]["norm"])
            rows = rows[:self.top_k]
        out.update((f"{prefix}{name}/{stat}", value) for name, row in rows for stat, value in row.items()
                   if not stat.endswith("hist") and (self.stats is None or stat in self.stats))
        return out


def _total_norm(rows: list[tuple[str, ParamStats]]) -> float:
    """The L2 norm of the gradients of the (name, row) `rows`, from their recorded norms."""
    return math.sqrt(math.fsum(row["norm"] ** 2 for _, row in rows))


def _summary(rows: list[tuple[str, ParamStats]], prefix: str, names: list[str]) -> dict[str, float | int]:
    """ScalarSelection's summary of the (name, row) `rows` of the parameters `names` (see its docstring)."""
    if not rows:
        return {}
    out = {}
    recorded = rows[0][1].keys()
    if "norm" in recorded:
        out[f"{prefix}total_norm"] = _total_norm(rows)
    if "absmax" in recorded:
        name, row = max(rows, key=lambda item: math.inf if math.isnan(item[1]["absmax"]) else item[1]["absmax"])
        out[f"{prefix}absmax"], out[f"{prefix}absmax_index"] = row["absmax"], names.index(name)
    for stat in ("nan", "inf", "input.nan", "input.inf"):
        if stat in recorded:
            out[f"{prefix}{stat}"] = sum(row[stat] for _, row in rows)
    if "absmax" in recorded and "input.absmax" in recorded:
        out[f"{prefix}shrunk"] = sum(row["absmax"] < row["input.absmax"] for _, row in rows)
    return out


def _names(value, option: str) -> tuple[str, ...] | None:
    """A str or an iterable of str as a tuple; None stays None."""
    if value is None:
        return None
    names = (value,) if isinstance(value, str) else value
    try:
        names = tuple(names)
    except TypeError:
        names = None
    if names is None or not names or not all(isinstance(name, str) for name in names):
        raise ValueError(f"{option}= takes a name or a non-empty sequence of names (None: all), not {value!r}")
    return names


def scalars_of(reading: StatsReading, prefix: str, selection: ScalarSelection | None = None) -> dict[str, float | int]:
    """`HookStats.to_scalars` of a `read()` already made: its fresh rows, flat, histograms left out; only the
    statistics `selection` selects (None: all)."""
    return (selection or ScalarSelection()).scalars(reading, prefix)


class HookStats:
    """Statistics a hook records, one row per registered parameter.

    `tensor` is a float64 device tensor of shape [parameters, slots]; slot j of every row holds
    `slot_names[j]` (statistics after the body first, then "input.<name>" ones). A row is overwritten
    at each firing of its parameter; rows that have not fired hold NaN and are left out of `read()`.
    Each backward in which the hook fires is numbered (`backwards.Backwards`: overlapping backwards, such as
    reentrant checkpointing's nested one or other threads', count as one; calls by hand outside a backward
    count as one); a row remembers the number of the backward that wrote it.

    Firings traced by torch.compile (compiled autograd) run no Python: once a hook is traced (`traced_books`), the
    backward numbers live on the device too, as tensors the traced firing writes: `epoch` (int64, 0-dim, the number
    of the most recent backward in which the hook fired) and `generations` (int64 [parameters], the number of the
    backward that wrote each row, 0 for never). Eager firings then keep them as well (one small write per firing),
    and `read()` tells fresh rows from them.
    """

    def __init__(self, stats: tuple[str, ...], input_stats: tuple[str, ...], hist_range: tuple[int, int]):
        self.hist_range = hist_range
        self.slot_names = slot_names(stats, input_stats, hist_range)
        self.names: list[str] = []
        self._written: list[int] = []  # per row: the number of the backward that wrote it, 0 for never
        self._backwards = Backwards()  # numbers the backwards in which the hook fires
        #: (the buffer, its row views by index), replaced as one when a registration grows the buffer
        self._state: tuple[torch.Tensor | None, dict[int, torch.Tensor]] = (None, {})
        self._lock = threading.Lock()  # buffer growth (a registration) against firings in other threads
        self._growing = False
        #: (generations, epoch) on the device once a firing was traced (see the class docstring), else None
        self._traced: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def buffer(self) -> torch.Tensor | None:
        """The [parameters, slots] float64 buffer, None before the first row (see `tensor`)."""
        return self._state[0]

    @property
    def tensor(self) -> torch.Tensor:
        """The raw [parameters, slots] float64 buffer on the parameters' device (no sync)."""
        if self.buffer is None:
            return torch.empty(0, len(self.slot_names), dtype=torch.float64)
        return self.buffer

    @property
    def device(self) -> torch.device | None:
        return None if self.buffer is None else self.buffer.device

    def add_row(self, name: str, device: torch.device) -> int:
        """Append a row for a new parameter (at registration, never during a firing of another)."""
        if name in self.names:
            raise ValueError(f"a parameter named {name!r} is already registered with this hook; "
                             "pass a different name=")
        if self.buffer is not None and self.buffer.device != device:
            raise ValueError(f"this hook records statistics on {self.buffer.device}; a parameter on {device} "
                             "needs a hook of its own")
        row = torch.full((1, len(self.slot_names)), math.nan, dtype=torch.float64, device=device)
        with self._lock:  # a firing in another thread may be writing a row of the buffer now: see mark_written()
            self._growing = True
            try:
                buffer = row if self.buffer is None else torch.cat([self.buffer, row])
                self._state = (buffer if self._traced is None else static(buffer), {})
            finally:
                self._growing = False
            self.names.append(name)
            self._written.append(0)
            if self._traced is not None:
                generations, epoch = self._traced
                self._traced = (static(torch.cat([generations, generations.new_zeros(1)])), epoch)
            return len(self.names) - 1

    def clear_row(self, index: int) -> None:
        """Forget row `index` (its name is registered again, for another tensor)."""
        self.buffer[index].fill_(math.nan)
        self._written[index] = 0
        if self._traced is not None:
            self._traced[0][index] = 0

    def begin_firing(self, backward_key: int, row: int | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A firing starts in the backward with autograd graph task id `backward_key`; for a firing that writes row
        `row`, (the buffer, its row `row`) for the kernel to write into. Once written, `mark_written([row], buffer)`
        marks it as written by the current backward (a firing that raises before leaves the row's marks as they were:
        never fresh with older values)."""
        backwards = self._backwards
        if backward_key != backwards.key:  # else another firing of the same backward (`enter` would return at once)
            if self._traced is None:
                backwards.enter(backward_key)
            else:
                number = backwards.number
                backwards.enter(backward_key)
                if backwards.number != number:
                    self._traced[1].add_(1)
        if row is None:
            return None
        buffer, views = self._state  # `row(row)` written out: one call less on every firing
        view = views.get(row)
        if view is None:
            view = views[row] = buffer[row]
        return buffer, view

    @property
    def traced(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(generations, epoch) once a firing was traced (see `traced_books`), else None."""
        return self._traced

    def traced_books(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(generations, epoch): the backward numbers on the device that traced firings write (see the class
        docstring), made at the first traced firing from the numbers kept so far: a row the most recent backward
        wrote gets the epoch, 2; a row written earlier 1; a row never written 0. Called at trace time."""
        with self._lock:
            if self._traced is None:
                number, device = self._backwards.number, self.buffer.device
                generations = [0 if w == 0 else 2 if w == number else 1 for w in self._written]
                self._traced = (static(torch.tensor(generations, dtype=torch.int64, device=device)),
                                static(torch.full((), 2, dtype=torch.int64, device=device)))
                static(self.buffer)
            return self._traced

    def fired(self, index: int) -> bool:
        """Has row `index` been written since registration or reset()?"""
        return self._written[index] > 0

    def row(self, index: int) -> torch.Tensor:
        """Row `index` of the buffer (a view, cached); not marked as written (see `mark_written`)."""
        buffer, views = self._state
        view = views.get(index)
        return view if view is not None else views.setdefault(index, buffer[index])

    def mark_written(self, rows: list[int], buffer: torch.Tensor | None = None) -> None:
        """Rows `rows` were just written by a firing of the current backward: mark them so. buffer: what the firing
        wrote them into (from `begin_firing`, or `tensor` through a bucket's table): if another thread's registration
        replaced it meanwhile (add_row copies the buffer as it is then), they are copied into the new one; None when
        they were written elsewhere (a shard's partials, merged into them when the backward ends)."""
        written, backward = self._written, self._backwards.number
        for index in rows:
            written[index] = backward
        if self._traced is not None:
            generations, epoch = self._traced
            for index in rows:
                generations[index] = epoch
        if buffer is not None and (self._growing or buffer is not self._state[0]):
            with self._lock:
                current = self._state[0]
                if buffer is not current:
                    current[rows] = buffer[rows]

    def read(self) -> StatsReading:
        """{parameter name: {statistic: value}} for every parameter that fired; one device-to-host copy.

        Each value is a ParamStats dict whose `fresh` attribute tells whether the most recent backward in
        which the hook fired wrote it; the result's `stale` lists those it did not."""
        out = StatsReading(self.names)
        if self.buffer is None or not self.slot_names:
            return out
        values = self.buffer.tolist()
        marks, latest = self._written, self._backwards.number
        if self._traced is not None:
            marks, latest = self._traced[0].tolist(), self._traced[1].item()
        for name, written, row in zip(self.names, marks, values):
            if written:
                entry = ParamStats()
                entry.fresh = written == latest
                for s, v in zip(self.slot_names, row):
                    if s.endswith("hist"):
                        entry.setdefault(s, []).append(int(v))
                    else:
                        entry[s] = int(v) if s.removeprefix("input.") in COUNT_STATS and not math.isnan(v) else v
                out[name] = entry
        return out

    def to_scalars(self, prefix: str = "grad/", stats=None, params=None, top_k: int | None = None,
                   summary: bool = False) -> dict[str, float | int]:
        """The statistics as one flat dict of numbers, for loggers (TensorBoard, W&B, Trainer's logs); one sync.

        Keys `f"{prefix}{parameter}/{statistic}"` (`"grad/fc.weight/norm"`, `"grad/fc.weight/input.norm"`), in
        read()'s order; counts are ints, the rest floats. Only rows written by the most recent backward in which
        the hook fired (`read().stale` are left out, so that a frozen parameter's old values are not logged
        again as new); histograms are left out (`histogram()` gives them).

        Selection (`ScalarSelection`): `stats=` only these statistics ("norm", "input.max"), `params=` only the
        parameters whose names match these fnmatch patterns ("encoder.*"), `top_k=k` a summary: `f"{prefix}total_norm"`
        (L2, over the selected parameters) first, then the statistics of the k selected parameters with the largest
        norms, largest first; `summary=True` a fixed set of scalars whatever the model's size (`total_norm`, the
        largest absmax and its parameter's index in `names`, NaN/Inf totals, how many gradients the body shrank: see
        ScalarSelection). A statistic the hook does not record, or a pattern that matches no registered parameter, is
        refused (ValueError)."""
        selection = ScalarSelection(stats, params, top_k, summary)
        selection.check(self.slot_names, self.names)
        return selection.scalars(self.read(), prefix)

    def histogram(self, name: str, input: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(counts, edges) of parameter `name`'s "hist" (of the input gradient if `input`); one sync.

        counts: int64 [bins]; edges: float64 [bins + 1], powers of two. Bin k holds elements with
        edges[k] <= |g| < edges[k+1]; the first bin also holds zeros and smaller values, the last larger
        values and +-Inf; NaN is only counted by "nan".
        """
        key = "input.hist" if input else "hist"
        if key not in self.slot_names:
            raise KeyError(f"this hook does not record {key!r}: add 'hist' to {'input_stats' if input else 'stats'}=")
        if name not in self.names:
            raise KeyError(f"no parameter named {name!r}; registered: {self.names}")
        row = self.names.index(name)
        if not (self._written[row] if self._traced is None else self._traced[0][row].item()):
            raise KeyError(f"no histogram of {name!r} yet: the hook has not fired on it since it was registered "
                           "or since reset()")
        columns = [i for i, s in enumerate(self.slot_names) if s == key]
        counts = self.buffer[row, columns[0]:columns[-1] + 1].cpu().to(torch.int64)
        lo, hi = self.hist_range
        return counts, 2.0 ** torch.arange(lo, hi + 1, dtype=torch.float64)

    def reset(self) -> None:
        """Forget every recorded value (no sync)."""
        if self.buffer is not None:
            self.buffer.fill_(math.nan)
        self._written = [0] * len(self._written)
        if self._traced is not None:
            self._traced[0].zero_()

    def __repr__(self) -> str:
        return f"HookStats({len(self.names)} parameters x {list(self.slot_names)})"
