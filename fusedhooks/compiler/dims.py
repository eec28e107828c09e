"""Reductions over dimensions (dim=) in a body lowered for one gradient shape: their units, how the Triton kernels
tile them, and where each element of the gradient reads their results.

A reduction over dims D of a gradient of shape S (its contiguous span) has one result per *unit*, an index of the
other dims K. Only dims of size > 1 count (`reduced`, `kept`): units are numbered row-major over K, the elements of
a unit row-major over D. A value reduced over dims is read where the body broadcasts it; each read is a *map*, one
entry per dim of the value: the gradient dim that indexes it (None: a dim of size 1, index 0).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from .ir import Graph, Node, is_reduction

#: Elements of one unit-reduction kernel's tile (fp64: half as many).
REDUCE_TILE = 2048
#: Units side by side in a tile when the innermost dim is kept (column-wise): from 16 (64 contiguous bytes of fp32 per
#: row of the tile) to 64, fewer when that leaves under TARGET_PROGRAMS programs (each reduces its units alone).
COLUMN_UNITS = (16, 64)
TARGET_PROGRAMS = 256


class Unsupported(Exception):
    """A body the Triton kernels do not compile (the reason is the message); it runs as eager torch ops."""


def unit_limit(dtype: torch.dtype) -> int:
    """The most elements of one unit that one program holds with every pass done in registers: the most lanes of a
    one-pass program over units (`units_launch`), which holds all its elements at once (the kernels over blocks step
    through theirs in tiles)."""
    return _lanes_held(dtype.itemsize)


def _lanes_held(itemsize: int) -> int:
    """The most lanes of a program that holds its elements of `itemsize` bytes at once."""
    return 4096 if itemsize <= 4 else 1024


def is_dim_reduction(n: Node) -> bool:
    """A reduction over some dimensions with a result that is not 0-dim (one over every dim is a whole-tensor one)."""
    return n.kind == "op" and is_reduction(n.op, n.args) and n.args.get("dim") is not None and n.shape != ()


def is_units_value(n: Node) -> bool:
    """A value shaped neither like the gradient nor 0-dim: reduced over dimensions, or computed from such values."""
    return n.kind != "const" and not n.full and n.shape != ()


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(n - 1, 0).bit_length()


def units_launch(block: int, units: list[tuple[int, int]], itemsize: int) -> dict:
    """UNITS and ELEMENTS of a one-pass launch over whole units (launch_spec.LaunchSpec.one_pass) on gradients of
    `units` ((units, elements of each) per gradient) of `itemsize` bytes: ELEMENTS lanes hold the longest unit, UNITS
    units fill BLOCK lanes, at most those a program holds at once (`unit_limit`) (at least one, no more than a
    gradient has)."""
    elements = next_pow2(max(n for _, n in units))
    lanes = min(block, _lanes_held(itemsize))
    return {"UNITS": max(1, min(lanes // elements, next_pow2(max(u for u, _ in units)))), "ELEMENTS": elements}


@dataclass(frozen=True)
class UnitReduction:
    """One reduction over dimensions: `node` over the gradient dims `reduced` (size > 1), keeping `kept`; its
    n_units results are fp64 slots offset.. of the units workspace. origin: for each dim of the result's shape, the
    gradient dim that indexes it as a unit (None: size 1)."""

    node: Node
    shape: tuple[int, ...]
    reduced: tuple[int, ...]
    kept: tuple[int, ...]
    origin: tuple
    offset: int

    @property
    def n_units(self) -> int:
        return math.prod(self.shape[d] for d in self.kept)

    @property
    def n_reduced(self) -> int:
        return math.prod(self.shape[d] for d in self.reduced)

    @property
    def contiguous(self) -> bool:
        """Each unit is one span of n_reduced elements (every kept dim comes before every reduced one)."""
        return not self.kept or not self.reduced or max(self.kept) < min(self.reduced)

    @property
    def rows(self) -> bool:
        """Tiles run along the reduced elements (the innermost dim of size > 1 is reduced), else along the units."""
        inner = [d for d, s in enumerate(self.shape) if s > 1]
        return not inner or inner[-1] in self.reduced


@dataclass(frozen=True)
class Tile:
    """A unit kernel's tile: `units` units side by side, `elements` elements of each (powers of two); rows: the
    elements of a unit are adjacent lanes (else the units are)."""

    units: int
    elements: int
    rows: bool

    @property
    def size(self) -> int:
        return self.units * self.elements

    def programs(self, n_units: int) -> int:
        return -(-n_units // self.units)


@dataclass
class Units:
    """The reductions over dimensions of a graph, and how its kernels run them.

    shape: the gradient's; reductions: in program order; uses: (reduction, map) of every read of a result where a
    value shaped like the gradient uses it; one_pass: one kernel does everything (each program holds whole units,
    see `analyse`); n_values: fp64 slots of the units workspace per gradient.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    reductions: list[UnitReduction]
    uses: list[tuple[Node, tuple]]
    one_pass: bool

    @property
    def n_values(self) -> int:
        return sum(r.n_units for r in self.reductions)

    @functools.cached_property
    def unit_sizes(self) -> tuple[int, int]:
        """(units, elements of each) of a one-pass body's reductions (they all have the same units); read at every
        firing."""
        return self.reductions[0].n_units, self.reductions[0].n_reduced

    def of(self, node: Node) -> UnitReduction:
        return next(r for r in self.reductions if r.node is node)

    def reduce_tile(self, r: UnitReduction) -> Tile:
        size = REDUCE_TILE if self.dtype.itemsize <= 4 else REDUCE_TILE // 2
        if r.rows:
            elements = min(next_pow2(r.n_reduced), size)
            return Tile(min(size // elements, next_pow2(r.n_units)), elements, True)
        low, high = COLUMN_UNITS
        units = min(next_pow2(r.n_units), max(low, min(high, next_pow2(r.n_units) // TARGET_PROGRAMS)))
        return Tile(units, min(size // units, next_pow2(r.n_reduced)), False)

    def reduce_splits(self, r: UnitReduction) -> tuple[int, int]:
        """(splits, span) of a reduction pass: with few unit blocks (under TARGET_PROGRAMS programs) and several
        chunks of elements, `splits` programs share each block's elements, `span` each (whole chunks), and the last
        of them merges their partial results; else (1, n_reduced): one program reduces its units alone."""
        tile = self.reduce_tile(r)
        chunks = -(-r.n_reduced // tile.elements)
        programs = tile.programs(r.n_units)
        if chunks == 1 or programs >= TARGET_PROGRAMS:
            return 1, r.n_reduced
        per_split = -(-chunks // min(chunks, -(-TARGET_PROGRAMS // programs)))
        return -(-chunks // per_split), per_split * tile.elements

    def groups(self, graph: Graph, level: int) -> list[list[UnitReduction]]:
        """The reductions of `level` (Graph.depth), one list per reduced dims: one kernel each."""
        groups: dict[tuple, list[UnitReduction]] = {}
        for r in self.reductions:
            if graph.depth(r.node) == level:
                groups.setdefault(r.reduced, []).append(r)
        return list(groups.values())

    def schedule(self, graph: Graph) -> list[tuple]:
        """The launches of the passes (unless one_pass), in order: per level ("whole", level) for the whole-tensor
        reductions of values shaped like the gradient (one pass over blocks), ("units", level, k, group) for each
        group of `groups`, ("whole_of_units", level, k, node) for a whole-tensor reduction of a value reduced over
        dimensions (one program over its elements); then ("final",)."""
        out = []
        levels = max((graph.depth(n) for n in graph.reductions()), default=0)
        for level in range(1, levels + 1):
            at_level = [n for n in graph.reductions() if graph.depth(n) == level and not is_dim_reduction(n)]
            if any(not is_units_value(n.args["input"]) for n in at_level):
                out.append(("whole", level))
            out += [("units", level, k, group) for k, group in enumerate(self.groups(graph, level))]
            out += [("whole_of_units", level, k, n)
                    for k, n in enumerate(n for n in at_level if is_units_value(n.args["input"]))]
        return out + [("final",)]

    def whole_of(self, node: Node) -> UnitReduction:
        """A whole-tensor reduction of a value reduced over dimensions, as a reduction of one unit: every element
        of its input (`shape`: the input's)."""
        shape = node.args["input"].shape
        return UnitReduction(node, shape, tuple(d for d, s in enumerate(shape) if s > 1), (), (), 0)

    def is_own(self, r: UnitReduction, m: tuple) -> bool:
        """Does a read with map `m` read the unit the element belongs to?"""
        return all(s == 1 or m[e] == r.origin[e] for e, s in enumerate(r.node.shape))


def input_map(consumer: Node, m: tuple, inp: Node) -> tuple:
    """The map of `inp` where `consumer` (read with map `m`) reads it: broadcasting aligns dims on the right;
    unsqueeze drops its new dim."""
    if consumer.op == "unsqueeze":
        d = consumer.args["dim"] % len(consumer.shape)
        return m[:d] + m[d + 1:]
    shift = len(consumer.shape) - len(inp.shape)
    return tuple(None if s == 1 else m[e + shift] for e, s in enumerate(inp.shape))


def full_map(shape: tuple) -> tuple:
    """The map of a value shaped like the gradient: each dim indexes itself."""
    return tuple(range(len(shape)))


def _reads(node: Node, m: tuple, out: dict) -> None:
    """Collect into `out` the (reduction, map) reads a units value `node` read with map `m` makes."""
    if is_dim_reduction(node):
        out[(node.index, m)] = (node, m)
        return
    for i in node.inputs():
        if is_units_value(i):
            _reads(i, input_map(node, m, i), out)


def reduced_dims(node: Node, shape: tuple) -> tuple[int, ...]:
    """The gradient dims a reduction over dimensions reduces, normalised (size-1 dims included), sorted."""
    dim = node.args["dim"]
    dims = dim if isinstance(dim, tuple) else (dim,)
    return tuple(sorted({d % len(shape) for d in dims})) if shape else ()


def analyse(graph: Graph) -> Units:
    """The units of `graph` (lowered for one gradient shape); raises Unsupported for what the kernels do not
    compile: a reduction over dimensions of a value that is itself reduced over dimensions
    (`x.sum(dim=1).amax(dim=0)`; a whole-tensor reduction of one, `x.sum(dim=1).amax()`, is compiled), a
    closed-over tensor that is not 0-dim.

    One pass when every reduction in the body is over the same dims, each unit is one span of at most `unit_limit`
    elements, and every read of a result is from an element of its own unit: then a program holds whole units and
    reads and writes each element once."""
    shape = next(n for n in graph.nodes if n.kind == "grad").shape
    live = graph.live_nodes()
    reductions, offset = [], 0
    whole = False
    for n in live:
        if n.kind == "scalar" and n.shape != ():
            raise Unsupported(f"a closed-over tensor of shape {n.shape} (the kernels read 0-dim ones)")
        if not (n.kind == "op" and is_reduction(n.op, n.args)):
            continue
        x = n.args["input"]
        if is_dim_reduction(n):
            if not x.full:
                raise Unsupported(f"`{n.op}` over dimensions of a value that is not shaped like the gradient")
            all_reduced = reduced_dims(n, shape)
            kept_all = [d for d in range(len(shape)) if d not in all_reduced]
            if n.args.get("keepdim"):
                origin = tuple(None if s == 1 else e for e, s in enumerate(n.shape))
            else:
                origin = tuple(None if s == 1 else kept_all[e] for e, s in enumerate(n.shape))
            r = UnitReduction(n, shape, tuple(d for d in all_reduced if shape[d] > 1),
                              tuple(d for d in kept_all if shape[d] > 1), origin, offset)
            reductions.append(r)
            offset += r.n_units
        else:
            whole = True
    reads: dict = {}
    for n in live:
        if n.full and n.kind == "op":
            for i in n.inputs():
                if is_units_value(i):
                    _reads(i, input_map(n, full_map(shape), i), reads)
    result = graph.result
    if is_units_value(result):
        _reads(result, input_map(Broadcast(shape), full_map(shape), result), reads)
    units = Units(shape, graph.grad_dtype, reductions, list(reads.values()), False)
    first = reductions[0] if reductions else None
    units.one_pass = bool(first) and not whole and all(
        r.reduced == first.reduced for r in reductions) and first.contiguous and (
        first.n_reduced <= unit_limit(graph.grad_dtype)) and all(
        units.is_own(units.of(node), m) for node, m in units.uses)
    return units


@dataclass
class Broadcast:
    """The write of a result into the gradient, as a consumer (see input_map)."""

    shape: tuple
    op: str = "broadcast"


@functools.cache
def row_major_strides(shape: tuple) -> tuple[int, ...]:
    strides, step = [], 1
    for s in reversed(shape):
        strides.append(step)
        step *= s
    return tuple(reversed(strides))
