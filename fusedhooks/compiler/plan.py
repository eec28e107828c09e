"""Scheduling a lowered hook body and its statistics into passes over the gradient."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from . import dims
from .ir import Graph

#: Which partials (see kernels/stats.py) each statistic needs.
_NEEDS = {
    "count": (), "sum": ("SUM",), "mean": ("SUM",), "sumsq": ("SUMSQ",), "norm": ("SUMSQ",),
    "var": ("SUM", "M2"), "std": ("SUM", "M2"), "min": ("MINMAX", "COUNTS"), "max": ("MINMAX", "COUNTS"),
    "absmax": ("MINMAX", "COUNTS"), "nan": ("COUNTS",), "inf": ("COUNTS",), "zeros": ("COUNTS",), "hist": (),
    "skew": ("SUM", "M2", "M34"), "kurtosis": ("SUM", "M2", "M34"),
}
PARTIAL_FLAGS = ("SUM", "M2", "SUMSQ", "MINMAX", "COUNTS", "M34")
#: What the backends other than "triton" run (Plan.__str__).
_RUNS_AS = {
    "eager": "eager torch ops on the CPU tensor, the body in place on the gradient where torch's in-place op gives "
             "the same values; statistics by torch reductions (sum, aminmax, count_nonzero) in the gradient's "
             "precision (float32 for 16-bit gradients), read on the host at each firing",
    "reference": "eager torch ops, out of place (autograd records them when .grad requires grad), the result copied "
                 "into the gradient; statistics by torch reductions of a float64 copy",
}
#: Default histogram range: exponents floor(log2|g|) from -40 up to 8 (48 bins).
DEFAULT_HIST_RANGE = (-40, 8)


def slot_names(stats: tuple[str, ...], input_stats: tuple[str, ...], hist_range: tuple[int, int]) -> tuple[str, ...]:
    """The statistics row layout, one name per float64 slot: the statistics after the body, then "input.<name>"
    ones, each in the order given (STAT_NAMES order, "hist" last); "hist" takes hi - lo slots. The one layout
    of the kernels (Plan.slots), the statistics buffer (HookStats) and the merge of FSDP2 shards."""
    bins = hist_range[1] - hist_range[0]
    return tuple(prefix + name for prefix, names in (("", stats), ("input.", input_stats))
                 for name in names for _ in range(bins if name == "hist" else 1))


def partial_flags(names: tuple[str, ...]) -> dict[str, bool]:
    """Flags for kernels.stats.store_partials / finalize_stats that cover `names`."""
    needed = {flag for name in names for flag in _NEEDS[name]}
    return {flag: flag in needed for flag in PARTIAL_FLAGS}


@dataclass
class Plan:
    """How one firing processes one gradient.

    graph: the lowered body; stats / input_stats: statistics on the gradient after / before the body
    (STAT_NAMES order, "hist" last); hist_range: (lo, hi) exponents of the histogram bins;
    amp: the gradient is unscaled by a GradScaler's scale first (and checked for NaN/Inf).
    levels: reduction passes the body needs before its elementwise pass (0: none).
    passes: reads of the gradient; writes: writes of it; launches: kernel launches per firing;
    bytes_per_element: bytes moved per gradient element (gradient reads + writes + parameter reads).
    A plan is not changed after make_plan (slots, stat_sets and levels are cached: they are read at every firing).
    numel: the gradient's number of elements (None: any); block, grid: the launch, filled by the runtime.
    The counts describe the Triton kernels of the plan, also for the eager and reference backends, which launch
    none (their str() says what they run instead). torch_ops: the eager backend's body as the torch calls it runs
    (eager.compile_body), shown by str().
    """

    graph: Graph
    stats: tuple[str, ...]
    input_stats: tuple[str, ...]
    numel: int | None = None
    backend: str = "triton"
    block: int | None = None
    grid: int | None = None
    amp: bool = False
    hist_range: tuple[int, int] | None = None
    torch_ops: str | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.graph.grad_dtype

    @property
    def hist_bins(self) -> int:
        return 0 if self.hist_range is None else self.hist_range[1] - self.hist_range[0]

    @functools.cached_property
    def slots(self) -> list[tuple[str, str]]:
        """The stats row layout (`slot_names`) as ("output" | "input", name) per slot."""
        return [("input", n.removeprefix("input.")) if n.startswith("input.") else ("output", n)
                for n in slot_names(self.stats, self.input_stats, self.hist_range or DEFAULT_HIST_RANGE)]

    @functools.cached_property
    def stat_sets(self) -> list[tuple[str, tuple[str, ...]]]:
        """Statistics sets the kernel reduces, in partials order."""
        return [(kind, names) for kind, names in (("output", self.stats), ("input", self.input_stats)) if names]

    @functools.cached_property
    def units(self) -> dims.Units | None:
        """The reductions over dimensions of a plan for one gradient shape, as the Triton kernels run them (the
        passes of every backend's plan are the kernels'); None: the body has none. For a Triton plan, raises
        dims.Unsupported for a body the kernels do not compile; for the others, None then."""
        if not self.graph.reduces_over_dims:
            return None
        try:
            return dims.analyse(self.graph)
        except dims.Unsupported:
            if self.backend == "triton":
                raise
            return None

    @functools.cached_property
    def levels(self) -> int:
        return max((self.graph.depth(n) for n in self.graph.reductions()), default=0)

    @property
    def empty(self) -> bool:
        return self.numel == 0

    @property
    def single_program(self) -> bool:
        """The gradient fits one program: every pass happens in one launch, reading memory once (the program's later
        passes over its block, at most BLOCK elements, read it again from the cache)."""
        return self.grid == 1

    @property
    def writes(self) -> int:
        return 0 if self.empty or not (self.graph.writes or self.amp) else 1

    @property
    def passes(self) -> int:
        if self.empty or not (self.writes or self.slots):
            return 0
        if self.units is not None:
            return 1 if self.units.one_pass else self.levels + 1
        return 1 if self.levels == 0 or self.single_program else self.levels + 1

    @property
    def launches(self) -> int:
        if self.units is None or self.units.one_pass or not self.passes:
            return self.passes
        return len(self.units.schedule(self.graph))

    @property
    def bytes_per_element(self) -> int:
        param_reads = self.passes if self.graph.uses_param else 0
        return self.dtype.itemsize * (self.passes + self.writes + param_reads)

    def __str__(self) -> str:
        size = "any size" if self.numel is None else f"numel={self.numel:,}"
        counts = (f"passes={self.passes} (reads of the gradient)  writes={self.writes}  launches={self.launches}  "
                  f"bytes/element={self.bytes_per_element}")
        lines = [f"fusedhooks plan: {size}, dtype={str(self.dtype).removeprefix('torch.')}, backend={self.backend}"]
        if self.backend == "triton":
            lines.append("  " + counts)
            lines += self._kernel_lines()
        else:
            lines.append(f"  no Triton kernels: {_RUNS_AS[self.backend]}")
            compiled = not self.graph.reduces_over_dims or self.units is not None
            lines.append(f"  the Triton backend's kernels would make: {counts}" if compiled else
                         "  the Triton backend does not compile this body")
        if self.amp:
            lines.append("  AMP: grad * (1 / scale) first; NaN/Inf of the scaled gradient sets found_inf")
        lines.append(f"  stats (after the body): {', '.join(self.stats) or '-'}")
        accumulated = "as accumulated, unscaled" if self.amp else "as accumulated"
        lines.append(f"  input_stats ({accumulated}): {', '.join(self.input_stats) or '-'}")
        if self.hist_range:
            lines.append(f"  hist: {self.hist_bins} bins of floor(log2|g|) from {self.hist_range[0]} "
                         f"to {self.hist_range[1]}")
        lines.append("  body:")
        lines.extend("    " + line for line in str(self.graph).splitlines())
        if self.torch_ops:
            lines.append("  as torch runs it (overwriting grad and intermediates no longer read):")
            lines.extend("    " + line for line in self.torch_ops.splitlines())
        return "\n".join(lines)

    def _kernel_lines(self) -> list[str]:
        """The reductions and launches of the Triton kernels."""
        lines = []
        if self.units is not None:
            for r in self.units.reductions:
                lines.append(f"  {r.node.name} = {r.node.op} over dims {list(r.reduced)}: {r.n_units:,} units of "
                             f"{r.n_reduced:,} elements")
            how = ("in one pass: each program holds whole units, every reduction in registers" if self.units.one_pass
                   else "per-unit results left in the workspace by the reduction passes, read by index in the "
                        "elementwise pass")
            lines.append(f"  body reductions: {len(self.graph.reductions())}, {how}")
        elif self.levels:
            how = ("in one program" if self.single_program else
                   f"{self.levels} reduction pass(es) leave scalars on the device, then the elementwise pass")
            lines.append(f"  body reductions: {len(self.graph.reductions())}, {how}")
        if self.block is not None:
            merged = ", statistics merged by the last program (no host sync)" if self.slots else ""
            if self.units is not None and self.units.one_pass:
                n_units, elements = self.units.unit_sizes
                meta = dims.units_launch(self.block, [(n_units, elements)], self.graph.grad_dtype.itemsize)
                lines.append(f"  launch: {-(-n_units // meta['UNITS']):,} programs x {meta['UNITS']} units of "
                             f"{meta['ELEMENTS']} lanes{merged}")
            elif self.units is not None:
                for r in self.units.reductions:
                    tile = self.units.reduce_tile(r)
                    splits, span = self.units.reduce_splits(r)
                    shared = f", {splits} programs per block sharing its elements ({span} each)" if splits > 1 else ""
                    lines.append(f"  reduction pass of {r.node.name}: {tile.programs(r.n_units) * splits:,} programs x "
                                 f"{tile.units} units, {tile.elements} elements of each at a time{shared}")
                lines.append(f"  elementwise pass: grid={self.grid} programs x BLOCK={self.block}{merged}")
            else:
                lines.append(f"  launch: grid={self.grid} programs x BLOCK={self.block}{merged}")
        return lines


def make_plan(graph: Graph, stats: tuple[str, ...], input_stats: tuple[str, ...], numel: int | None = None,
              backend: str = "triton", *, amp: bool = False, hist_range: tuple[int, int] | None = None,
              block: int | None = None, torch_ops: str | None = None) -> Plan:
    """Schedule `graph`: the body, the input statistics and the output statistics share passes.

    stats / input_stats: names in STAT_NAMES order (the stats row layout), "hist" last.
    block: elements per program (from the runtime), which decides whether one program suffices.
    torch_ops: see Plan.
    """
    wants_hist = "hist" in stats or "hist" in input_stats
    plan = Plan(graph, tuple(stats), tuple(input_stats), numel, backend, amp=amp,
                hist_range=(hist_range or DEFAULT_HIST_RANGE) if wants_hist else None, torch_ops=torch_ops)
    if numel and block:
        plan.block, plan.grid = block, -(-numel // block)
    return plan
