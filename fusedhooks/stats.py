"""The device statistics buffer of a hook and its readers."""

from __future__ import annotations

import math

import torch

from .ir import COUNT_STATS


class HookStats:
    """Statistics a hook records, one row per registered parameter.

    `tensor` is a float64 device tensor of shape [parameters, slots]; slot j of every row holds
    `slot_names[j]` (statistics after the body first, then "input.<name>" ones). A row is overwritten
    at each firing of its parameter; rows that have not fired hold NaN and are left out of `read()`.
    """

    def __init__(self, stats: tuple[str, ...], input_stats: tuple[str, ...], hist_range: tuple[int, int]):
        self.hist_range = hist_range
        bins = hist_range[1] - hist_range[0]
        slots = []
        for prefix, names in (("", stats), ("input.", input_stats)):
            for name in names:
                slots += [prefix + name] * (bins if name == "hist" else 1)
        self.slot_names = tuple(slots)
        self.names: list[str] = []
        self._fired: list[bool] = []
        self._buffer: torch.Tensor | None = None
        self._rows: dict[int, torch.Tensor] = {}

    @property
    def tensor(self) -> torch.Tensor:
        """The raw [parameters, slots] float64 buffer on the parameters' device (no sync)."""
        if self._buffer is None:
            return torch.empty(0, len(self.slot_names), dtype=torch.float64)
        return self._buffer

    @property
    def device(self) -> torch.device | None:
        return None if self._buffer is None else self._buffer.device

    def add_row(self, name: str, device: torch.device) -> int:
        """Append a row for a new parameter (at registration, never during a firing of another)."""
        if name in self.names:
            raise ValueError(f"a parameter named {name!r} is already registered with this hook; "
                             "pass a different name=")
        if self._buffer is not None and self._buffer.device != device:
            raise ValueError(f"this hook records statistics on {self._buffer.device}; a parameter on {device} "
                             "needs a hook of its own")
        row = torch.full((1, len(self.slot_names)), math.nan, dtype=torch.float64, device=device)
        self._buffer = row if self._buffer is None else torch.cat([self._buffer, row])
        self._rows = {}
        self.names.append(name)
        self._fired.append(False)
        return len(self.names) - 1

    def row(self, index: int) -> torch.Tensor:
        """Row `index` of the buffer, marked as fired (a view, cached; the kernel writes into it)."""
        self._fired[index] = True
        row = self._rows.get(index)
        if row is None:
            row = self._rows[index] = self._buffer[index]
        return row

    def read(self) -> dict[str, dict[str, float | int]]:
        """{parameter name: {statistic: value}} for every parameter that fired; one device-to-host copy."""
        if self._buffer is None or not self.slot_names:
            return {}
        values = self._buffer.tolist()
        out = {}
        for name, fired, row in zip(self.names, self._fired, values):
            if fired:
                entry = {}
                for s, v in zip(self.slot_names, row):
                    if s.endswith("hist"):
                        entry.setdefault(s, []).append(int(v))
                    else:
                        entry[s] = int(v) if s.removeprefix("input.") in COUNT_STATS and not math.isnan(v) else v
                out[name] = entry
        return out

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
        columns = [i for i, s in enumerate(self.slot_names) if s == key]
        counts = self._buffer[row, columns[0]:columns[-1] + 1].cpu().to(torch.int64)
        lo, hi = self.hist_range
        return counts, 2.0 ** torch.arange(lo, hi + 1, dtype=torch.float64)

    def reset(self) -> None:
        """Forget every recorded value (no sync)."""
        if self._buffer is not None:
            self._buffer.fill_(math.nan)
        self._fired = [False] * len(self._fired)

    def __repr__(self) -> str:
        return f"HookStats({len(self.names)} parameters x {list(self.slot_names)})"
