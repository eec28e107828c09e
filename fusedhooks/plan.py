"""Scheduling a lowered hook body and its statistics into passes over the gradient."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .ir import Graph

#: Which partials (see kernels/stats.py) each statistic needs.
_NEEDS = {
    "count": (), "sum": ("SUM",), "mean": ("SUM",), "sumsq": ("SUMSQ",), "norm": ("SUMSQ",),
    "var": ("SUM", "M2"), "std": ("SUM", "M2"), "min": ("MINMAX", "COUNTS"), "max": ("MINMAX", "COUNTS"),
    "absmax": ("MINMAX", "COUNTS"), "nan": ("COUNTS",), "inf": ("COUNTS",), "zeros": ("COUNTS",),
}
PARTIAL_FLAGS = ("SUM", "M2", "SUMSQ", "MINMAX", "COUNTS")


def partial_flags(names: tuple[str, ...]) -> dict[str, bool]:
    """Flags for kernels.stats.store_partials / finalize_stats that cover `names`."""
    needed = {flag for name in names for flag in _NEEDS[name]}
    return {flag: flag in needed for flag in PARTIAL_FLAGS}


@dataclass
class Plan:
    """How one firing processes one gradient.

    graph: the lowered body; stats / input_stats: statistics on the gradient after / before the body;
    slots: the stats row layout, ("output" | "input", name) per slot.
    passes: reads of the gradient; writes: writes of it; launches: kernel launches per firing;
    bytes_per_element: bytes moved per gradient element (gradient reads + writes + parameter reads).
    numel: the gradient's number of elements (None: any); block, grid: the launch, filled by the runtime.
    """

    graph: Graph
    stats: tuple[str, ...]
    input_stats: tuple[str, ...]
    numel: int | None = None
    backend: str = "triton"
    block: int | None = None
    grid: int | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.graph.grad_dtype

    @property
    def slots(self) -> list[tuple[str, str]]:
        return [("output", s) for s in self.stats] + [("input", s) for s in self.input_stats]

    @property
    def stat_sets(self) -> list[tuple[str, tuple[str, ...]]]:
        """Statistics sets the kernel reduces, in partials order."""
        return [(kind, names) for kind, names in (("output", self.stats), ("input", self.input_stats)) if names]

    @property
    def empty(self) -> bool:
        return self.numel == 0

    @property
    def passes(self) -> int:
        return 0 if self.empty or not (self.graph.writes or self.slots) else 1

    @property
    def writes(self) -> int:
        return 0 if self.empty or not self.graph.writes else 1

    @property
    def launches(self) -> int:
        return self.passes

    @property
    def bytes_per_element(self) -> int:
        param_reads = 1 if self.graph.uses_param and self.passes else 0
        return self.dtype.itemsize * (self.passes + self.writes + param_reads)

    def __str__(self) -> str:
        size = "any size" if self.numel is None else f"numel={self.numel:,}"
        lines = [
            f"fusedhooks plan: {size}, dtype={str(self.dtype).removeprefix('torch.')}, backend={self.backend}",
            f"  passes={self.passes} (reads of the gradient)  writes={self.writes}  launches={self.launches}  "
            f"bytes/element={self.bytes_per_element}",
        ]
        if self.block is not None:
            merged = ", statistics merged by the last program (no host sync)" if self.slots else ""
            lines.append(f"  launch: grid={self.grid} programs x BLOCK={self.block}{merged}")
        lines.append(f"  stats (after the body): {', '.join(self.stats) or '-'}")
        lines.append(f"  input_stats (as accumulated): {', '.join(self.input_stats) or '-'}")
        lines.append("  body:")
        lines.extend("    " + line for line in str(self.graph).splitlines())
        return "\n".join(lines)


def make_plan(graph: Graph, stats: tuple[str, ...], input_stats: tuple[str, ...], numel: int | None = None,
              backend: str = "triton") -> Plan:
    """One pass: the body, the input statistics and the output statistics all read the gradient once.

    stats / input_stats: names in STAT_NAMES order (the stats row layout).
    """
    return Plan(graph, tuple(stats), tuple(input_stats), numel, backend)
