"""A plan to Triton source text, and loading that source (cached on disk by content hash).

The generated kernel processes the gradient's storage span in blocks of BLOCK elements: it loads
the gradient (and the parameter), evaluates the body in fp32 (fp64 for float64), rounding every
fp16/bf16 intermediate as eager torch does, stores the result, and reduces statistics.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import sys
import tempfile
from dataclasses import dataclass, field

import torch

from . import config, dims
from .emit import FLOAT_CT, Emitter, UnitsEmitter, compute_type, convert, full, literal, rounded, widen
from .ir import STAT_NAMES, Graph, Node, is_reduction, reduction_spec
from .plan import PARTIAL_FLAGS, Plan, partial_flags

KERNEL_NAME = "fused_hook"
#: fp64 values in a row of partial statistics (kernels.stats.N_PARTIALS)
PARTIAL_WIDTH = 8
#: The bucket table's per-tensor parts, in order, each n_tensors int64s; then (tensor, block) per program.
TABLE_PARTS = ("grad", "param", "numel", "blocks", "stats_offset", "partials_offset", "n_units", "unit_numel")


@dataclass(frozen=True)
class LaunchSpec:
    """How to launch the kernels generated for a plan; `generate_with_spec` returns it with their source, and
    the runtime, tune and clip only read it.

    args / multi_args: the role of each argument of the single-tensor / bucket (`..._multi`) kernels, in order:
    "grad", "param" (pointers to the spans), "scalar<i>" (closed-over 0-dim tensors), "scale", "found_inf"
    (AMP), "reduced" (fp64 [n_reductions] per tensor), "stats" (the row, or the whole buffer for a bucket),
    "partials" (fp64 [programs, partial_sets, PARTIAL_WIDTH]), "counter" (int32, one per tensor), "hist"
    (int64 [hist_sets, hist_pad] per tensor), "numel", "table" (int64, TABLE_PARTS then programs),
    "n_tensors", then the constexprs "ALIGNED", "BLOCK", "RBLOCK".
    kernels / single_kernels / multi_kernels: the kernels launched, in order, on a grid of several programs,
    on a grid of one program, and for a bucket.
    """

    args: tuple[str, ...]
    multi_args: tuple[str, ...]
    kernels: tuple[str, ...]
    single_kernels: tuple[str, ...]
    multi_kernels: tuple[str, ...]
    n_slots: int
    n_reductions: int
    partial_sets: int
    hist_sets: int
    hist_pad: int
    table_parts: tuple[str, ...] = TABLE_PARTS
    #: (kernel, programs per gradient) of the kernels over the units of one gradient shape (fusedhooks.dims), which
    #: do not run on the grid of blocks; units_values: fp64 per gradient of the units workspace; one_pass: the one
    #: kernel runs over whole units, UNITS per program (the runtime chooses UNITS and ELEMENTS, see units_launch)
    fixed_grids: tuple[tuple[str, int], ...] = ()
    units_values: int = 0
    one_pass: bool = False
    #: fp64 accumulators and int32 counters per gradient of the reduction passes whose programs share blocks of units
    unit_partial_values: int = 0
    unit_counter_values: int = 0

    def kernels_for(self, grid: int) -> tuple[str, ...]:
        """The kernels to launch, in order, for one gradient on a grid of `grid` programs."""
        return self.single_kernels if grid == 1 else self.kernels

    def grid_of(self, kernel: str, blocks: int, n_tensors: int = 1) -> int:
        """Programs of a launch of `kernel` on `n_tensors` gradients (of one shape, for a kernel over units) whose
        blocks number `blocks` in all."""
        return dict(self.fixed_grids).get(kernel, 0) * n_tensors or blocks

    def partial_values(self, programs: int) -> int:
        """fp64 values of partials `programs` programs write."""
        return programs * self.partial_sets * PARTIAL_WIDTH

    @property
    def hist_values(self) -> int:
        """int64 histogram accumulators per tensor."""
        return self.hist_sets * self.hist_pad

@dataclass
class _ReductionSet:
    """Partials of one value over the gradient and what is done with the merged result.

    x: the value (a float expression); flags: kernels.stats flags; correction: for var/std;
    uses: (stat name, action) pairs, action a format string taking the merged value `{}`.
    """

    x: str
    flags: dict
    correction: float = 1.0
    uses: list = field(default_factory=list)


class _KernelWriter:
    """Writes the kernels of one plan; they share one signature (see `signature`)."""

    def __init__(self, plan: Plan, device_type: str, multi: bool = False):
        self.plan = plan
        self.multi = multi
        self.suffix = "_multi" if multi else ""
        self.g = plan.graph
        self.device_type = device_type
        self.ct = compute_type(self.g.grad_dtype)
        #: the reductions over dimensions (fusedhooks.dims), for a body planned for one gradient shape
        self.units = plan.units
        #: the whole-tensor reductions (their results: reduced_ptr)
        self.reductions = [n for n in self.g.reductions() if not dims.is_dim_reduction(n)]
        self.reduction_slot = {n.index: k for k, n in enumerate(self.reductions)}
        self.hist_sets = [kind for kind, names in plan.stat_sets if "hist" in names]
        self.signatures: dict[str, dict[str, str]] = {}

    # --- signature -----------------------------------------------------------------------------

    def kernel(self, name: str, args: list[str], body: list[str], doc: str) -> list[str]:
        """The source lines of kernel `name`; its argument types go into `self.signatures` (see SIGNATURES)."""
        self.signatures[name] = {a.split(",")[0].split(":")[0]: _sig_type(a) for a in args}
        return _kernel(name, args, body, doc)

    def signature(self) -> list[str]:
        """The kernels' argument lines, in order (their roles: `roles`)."""
        return [line for _, line in self.arguments()]

    def roles(self) -> tuple[str, ...]:
        """What each argument is, in order (see LaunchSpec)."""
        return tuple(role for role, _ in self.arguments())

    def arguments(self) -> list[tuple[str, str]]:
        """(role, source line) of each argument, constexprs last."""
        p, g = self.plan, self.g
        if self.multi:
            parts = ", ".join(TABLE_PARTS)
            args = [("table", f"table_ptr,  # *int64: the bucket's table (runtime.BucketTable): {parts}, each "
                              "n_tensors long, then (tensor, block) per program"),
                    ("n_tensors", "n_tensors,  # gradients in the bucket")]
        else:
            args = [("grad", f"grad_ptr,  # *{g.grad_dtype}: the gradient's storage span, updated in place")]
            if g.uses_param:
                args.append(("param", f"param_ptr,  # *{g.grad_dtype}: the parameter, same layout as grad"))
        args += [(f"scalar{i}", f"scalar{i}_ptr,  # *{dt}: closed-over tensor {i}, read at every run")
                 for i, dt in enumerate(g.scalar_dtypes)]
        if p.amp:
            args += [("scale", "scale_ptr,  # *fp32 [1]: GradScaler's scale; the body sees grad / scale"),
                     ("found_inf", "found_inf_ptr,  # *fp32 0-dim: set to 1.0 when the scaled gradient has a NaN/Inf")]
        per = "per gradient of the bucket: " if self.multi else ""
        if self.reductions:
            args.append(("reduced", f"reduced_ptr,  # *fp64 [{len(self.reductions)}]: {per}results of the body's "
                                    "reductions"))
        if self.units is not None and not self.units.one_pass:  # (one pass: the program holds the results)
            args.append(("units", f"units_ptr,  # *fp64 [{self.units.n_values}]: {per}results of the reductions over "
                                  "dimensions, per unit"))
            partial_values, counters = self.split_sizes()
            if counters:
                args += [("unit_partials", f"unit_partials_ptr,  # *fp64 [{partial_values}]: {per}the accumulators "
                                           "of the programs that share a block of units"),
                         ("unit_counters", f"unit_counters_ptr,  # *int32 [{counters}]: {per}programs finished per "
                                           "block of units; the last one merges and resets it to 0")]
        if p.slots:
            rows = "the statistics buffer (rows from the table)" if self.multi else "this parameter's statistics row"
            args.append(("stats", f"stats_ptr,  # *fp64 [{len(p.slots)}]: {rows}"))
        if self.reductions or p.slots:
            args += [("partials", f"partials_ptr,  # *fp64 [blocks, sets, {PARTIAL_WIDTH}]: {per}per-program "
                                  "partial statistics"),
                     ("counter", f"counter_ptr,  # *int32 [1]: {per}programs finished; the last one merges and "
                                 "resets it to 0")]
        if self.hist_sets:
            args.append(("hist", f"hist_ptr,  # *int64 [{len(self.hist_sets)}, HIST_PAD]: {per}histogram "
                                 "accumulators, zeroed by the last program"))
        if not self.multi:
            args.append(("numel", "numel,  # elements in the span"))
        one_pass = self.units is not None and self.units.one_pass
        if one_pass and not self.multi:
            args += [("n_units", "n_units,  # units of the gradient (fusedhooks.dims)"),
                     ("unit_numel", "unit_numel,  # elements of each unit (one span each)")]
        args += [("ALIGNED", "ALIGNED: tl.constexpr,  # gradient (and parameter) addresses 16-byte aligned and "
                             "every numel a multiple of 16 bytes: a vectorisation hint, true whenever set "
                             "(runtime.aligned)"),
                 ("BLOCK", "BLOCK: tl.constexpr,  # elements per program"),
                 ("RBLOCK", "RBLOCK: tl.constexpr,  # partial rows merged at a time")]
        if one_pass:
            args += [("UNITS", "UNITS: tl.constexpr,  # units per program"),
                     ("ELEMENTS", "ELEMENTS: tl.constexpr,  # lanes per unit: a power of two >= every unit_numel")]
        return args

    # --- pieces --------------------------------------------------------------------------------

    def prologue(self) -> list[str]:
        """The lines before the body of a kernel over blocks of BLOCK elements: `header` and `loads`."""
        return self.header() + ["offs = pid * BLOCK + tl.arange(0, BLOCK)", "mask = offs < numel"] + self.loads()

    def header(self, programs: int | None = None) -> list[str]:
        """Which program this is (`pid`; for a bucket, of gradient `t`), and the pointers of its gradient.

        programs: programs per gradient of a kernel over units (fusedhooks.dims), else over blocks of BLOCK."""
        g = self.g
        if self.multi:
            storage = f"tl.pointer_type({_storage_type(g.grad_dtype)})"
            if programs is None:
                lines = ["prog = tl.program_id(0).to(tl.int64)",
                         f"t = tl.load(table_ptr + {len(TABLE_PARTS)} * n_tensors + 2 * prog)  # which gradient of "
                         "the bucket",
                         f"pid = tl.load(table_ptr + {len(TABLE_PARTS)} * n_tensors + 2 * prog + 1)  # which block "
                         "of it"]
            else:
                lines = ["prog = tl.program_id(0).to(tl.int64)",
                         f"t = prog // {programs}  # which gradient of the bucket (all of one shape)",
                         f"pid = prog % {programs}  # which program of it"]
            lines += [f"grad_ptr = tl.load({_table_part('grad')}).to({storage})",
                     f"numel = tl.load({_table_part('numel')})",
                     f"num_blocks = tl.load({_table_part('blocks')})"]
            if g.uses_param:
                lines.append(f"param_ptr = tl.load({_table_part('param')}).to({storage})")
            if self.plan.slots:
                lines.append(f"stats_ptr += tl.load({_table_part('stats_offset')})")
            if self.reductions or self.plan.slots:
                lines += [f"partials_ptr += tl.load({_table_part('partials_offset')})", "counter_ptr += t"]
            if self.reductions:
                lines.append(f"reduced_ptr += t * {len(self.reductions)}")
            if self.units is not None and not self.units.one_pass:
                lines.append(f"units_ptr += t * {self.units.n_values}")
                partial_values, counters = self.split_sizes()
                if counters:
                    lines += [f"unit_partials_ptr += t * {partial_values}", f"unit_counters_ptr += t * {counters}"]
            if self.hist_sets:
                lines.append(f"hist_ptr += t * {len(self.hist_sets)} * HIST_PAD")
            if programs is not None:
                lines.append(f"num_blocks = {programs}")
        else:
            lines = ["pid = tl.program_id(0).to(tl.int64)", "num_blocks = tl.num_programs(0)"]
        vec = 16 // _ELEMENT_SIZE[g.grad_dtype]
        lines += ["if ALIGNED:  # the mask is uniform over each 16 bytes: 128-bit loads and stores",
                  f"    numel = tl.multiple_of(numel.to(tl.int64), {vec})"]
        lines.append("    grad_ptr = tl.multiple_of(grad_ptr, 16)")
        if g.uses_param:
            lines.append("    param_ptr = tl.multiple_of(param_ptr, 16)")
        return lines

    def loads(self) -> list[str]:
        """The gradient (unscaled for AMP) and the parameter at `offs`, `mask`."""
        ct, g = self.ct, self.g
        lines = [f"grad = {widen('tl.load(grad_ptr + offs, mask=mask, other=0)', g.grad_dtype)}"]
        if self.plan.amp:
            # as torch._amp_foreach_non_finite_check_and_unscale_: grad * fp32(1 / fp64(scale))
            inv = "(1.0 / tl.load(scale_ptr).to(tl.float64)).to(tl.float32)"
            if ct != "tl.float32":
                inv += f".to({ct})"
            lines += ["scaled = grad", f"inv_scale = {inv}",
                      f"grad = {rounded('scaled * inv_scale', g.grad_dtype)}"]
        if g.uses_param:
            lines.append(f"param = {widen('tl.load(param_ptr + offs, mask=mask, other=0)', g.grad_dtype)}")
        return lines

    def emitter(self, available: dict[int, str], read=None) -> Emitter:
        """An emitter that knows the `available` names; for a body reducing over dimensions, one reading their
        results with `read` (default: gathers from units_ptr)."""
        if self.units is None:
            em = Emitter(self.plan, self.device_type)
        else:
            em = UnitsEmitter(self.plan, self.device_type, self.units, read or self.gather)
        em.names.update(available)
        return em

    def gather(self, em: UnitsEmitter, r: dims.UnitReduction, m: tuple) -> str:
        """Read the result of reduction `r` of each lane's unit (map `m`) from the units workspace."""
        name = f"u{r.node.index}_{len(em.at_names)}"
        loaded = f"tl.load({_units_slots(r)} + ({em.unit_index(r, m)}), mask=mask, other=0)"
        ct = compute_type(r.node.dtype)
        em.lines.append(f"{name} = {f'({loaded} != 0)' if ct == 'tl.int1' else convert(loaded, _units_type(r), ct)}")
        return name

    def set_value(self, em: Emitter, node: Node, of_abs: bool) -> str:
        x = em.names[node.index] if node.kind != "const" else literal(node.value, "tl.float32")
        src = compute_type(node.dtype) if node.kind != "const" else "tl.float32"
        if src not in FLOAT_CT:
            x = f"{x}.to(tl.float32)"
        return f"tl.abs({x})" if of_abs else x

    def reduction_sets(self, em: Emitter, level: int, action) -> list[_ReductionSet]:
        """Sets for the reductions of `level`; action(node) gives the format string applied to each result."""
        sets: dict[tuple, _ReductionSet] = {}
        for n in self.reductions:
            if self.g.depth(n) != level or dims.is_units_value(n.args["input"]):
                continue  # (a whole-tensor reduction of a value reduced over dimensions: whole_of_units_kernel)
            spec = reduction_spec(n)
            key = (n.args["input"].index, spec.of_abs, spec.correction)
            if key not in sets:
                sets[key] = _ReductionSet(self.set_value(em, n.args["input"], spec.of_abs), {}, spec.correction)
            st = sets[key]
            names = [spec.stat] + (["count"] if spec.test == "any" else [])
            for flag, on in partial_flags(tuple(names)).items():
                st.flags[flag] = st.flags.get(flag, False) or on
            st.uses.append((spec, n, action(n)))
        return list(sets.values())

    def stat_sets(self, out_value: str) -> list[_ReductionSet]:
        sets, slot = [], 0
        for kind, names in self.plan.stat_sets:
            scalars = tuple(name for name in names if name != "hist")
            if scalars:
                rs = _ReductionSet(out_value if kind == "output" else "grad", partial_flags(scalars))
                for name in scalars:
                    rs.uses.append((name, None, f"tl.store(stats_ptr + {slot}, {{}})  # {kind} {name}"))
                    slot += 1
                sets.append(rs)
            if "hist" in names:
                slot += self.plan.hist_bins
        return sets

    def merge_lines(self, sets: list[_ReductionSet], num_blocks: str, per_program: str = "BLOCK") -> list[str]:
        lines = []
        for k, rs in enumerate(sets):
            flags = ", ".join(f"{f}={rs.flags.get(f, False)}" for f in PARTIAL_FLAGS)
            lines.append(f"st = finalize_stats(partials_ptr, {k}, {len(sets)}, numel, {num_blocks}, {per_program}, "
                         "RBLOCK, "
                         f"{rs.correction!r}, {flags})")
            for spec, _node, action in rs.uses:
                lines.append(action.format(_merged(spec)))
        return lines

    def partial_lines(self, sets: list[_ReductionSet]) -> list[str]:
        lines = []
        for k, rs in enumerate(sets):
            flags = ", ".join(f"{f}={rs.flags.get(f, False)}" for f in PARTIAL_FLAGS)
            row = f"partials_ptr + (pid * {len(sets)} + {k}) * {PARTIAL_WIDTH}"
            lines.append(f"store_partials({rs.x}, mask, n_valid, {row}, {flags})")
        return lines

    def hist_lines(self, out_value: str) -> tuple[list[str], list[str]]:
        """(accumulate lines, flush lines for the last program)."""
        acc, flush, slot = [], [], 0
        lo, bins = self.plan.hist_range[0] if self.plan.hist_range else 0, self.plan.hist_bins
        for kind, names in self.plan.stat_sets:
            scalars = [n for n in names if n != "hist"]
            slot += len(scalars)
            if "hist" in names:
                h = self.hist_sets.index(kind)
                x = out_value if kind == "output" else "grad"
                acc.append(f"hist_accumulate({x}, mask, hist_ptr + {h} * HIST_PAD, {lo}, {bins}, HIST_PAD)")
                flush.append(f"hist_flush(hist_ptr + {h} * HIST_PAD, stats_ptr + {slot}, {bins}, HIST_PAD)"
                             f"  # {kind} hist")
                slot += bins
        return acc, flush

    # --- kernels -------------------------------------------------------------------------------

    def final_body(self, em: Emitter, single: bool, per_program: str = "BLOCK") -> list[str]:
        """The elementwise pass: body, store, found_inf, statistics (merged by the last program).

        per_program: the elements each program covers (a kernel over units: whole units, see `one_pass_kernel`)."""
        g, ct, lines = self.g, self.ct, []
        em.emit_nodes(self.g.live_nodes())
        out_value = "grad"
        if g.writes or self.plan.amp:
            r = g.result
            expr = em.result_value(ct)
            if r.kind == "const":
                expr = full(f"[{em.block}]", r.value, ct)
            elif not r.full:  # without arithmetic, which would turn -0.0 into 0.0
                expr = f"tl.broadcast_to({expr}, [{em.block}])"
            if r.dtype != g.grad_dtype:
                expr = rounded(expr, g.grad_dtype)
            lines += em.lines
            em.lines = []
            lines.append(f"out = {expr}")
            store = "to_bf16(out)" if g.grad_dtype == torch.bfloat16 else f"out.to({_storage_type(g.grad_dtype)})"
            lines.append(f"tl.store(grad_ptr + offs, {store}, mask=mask)")
            out_value = "out"
        lines += em.lines
        if self.plan.amp:
            lines += ['bad = tl.sum((mask & ~(tl.abs(scaled) < float("inf"))).to(tl.int32), axis=0)',
                      "if bad > 0:", "    tl.store(found_inf_ptr, 1.0)"]
        sets = self.stat_sets(out_value)
        hist_acc, hist_flush = self.hist_lines(out_value)
        if not sets and not hist_acc:
            return lines
        lines.append(f"n_valid = tl.minimum(numel - pid * {per_program}, {per_program})")
        if single:
            lines.append("tl.debug_barrier()")
        lines += self.partial_lines(sets) + hist_acc
        merge = self.merge_lines(sets, "1" if single else "num_blocks", per_program) + hist_flush
        if single:
            return lines + ["tl.debug_barrier()"] + merge
        return lines + _last_program(merge)

    def simple_kernel(self) -> list[str]:
        em = self.emitter({})
        return self.kernel(KERNEL_NAME + self.suffix, self.signature(),
                           self.prologue() + self.final_body(em, single=False),
                           "the body, its store and the statistics, in one pass")

    def reduced_before(self, level: int) -> tuple[dict[int, str], list[str]]:
        """The whole-tensor reductions of the levels below `level`: their names (for an emitter's `available`) and
        the lines loading them from reduced_ptr."""
        done = [n for n in self.reductions if self.g.depth(n) < level]
        names = {n.index: f"r{self.reduction_slot[n.index]}" for n in done}
        loads = [f"{names[n.index]} = {_from_reduced(n, f'tl.load(reduced_ptr + {self.reduction_slot[n.index]})')}"
                 for n in done]
        return names, loads

    def reduce_kernel(self, level: int) -> list[str]:
        available, loads = self.reduced_before(level)
        em = self.emitter(available)
        targets = [n.args["input"] for n in self.reductions if self.g.depth(n) == level]
        em.emit_nodes(_cone(self.g, [x for x in targets if self.units is None or not dims.is_units_value(x)]))
        sets = self.reduction_sets(em, level, lambda n: f"tl.store(reduced_ptr + {self.reduction_slot[n.index]}, "
                                                       f"({{}}).to(tl.float64))  # {n.name}")
        body = self.prologue() + loads + em.lines + ["n_valid = tl.minimum(numel - pid * BLOCK, BLOCK)"]
        body += self.partial_lines(sets) + _last_program(self.merge_lines(sets, "num_blocks"))
        return self.kernel(f"reduce_level{level}{self.suffix}", self.signature(), body,
                       f"reduction pass {level}: leaves its results in reduced_ptr")

    def final_kernel(self) -> list[str]:
        available, loads = self.reduced_before(self.plan.levels + 1)
        em = self.emitter(available)
        return self.kernel(KERNEL_NAME + self.suffix, self.signature(),
                       self.prologue() + loads + self.final_body(em, single=False),
                       "the elementwise pass, reading the reductions' results")

    def single_kernel(self) -> list[str]:
        """Every pass in one program: the gradient is read from memory once."""
        em = self.emitter({})
        body = self.prologue() + ["n_valid = tl.minimum(numel - pid * BLOCK, BLOCK)"]
        for level in range(1, self.plan.levels + 1):
            targets = [n.args["input"] for n in self.reductions if self.g.depth(n) == level]
            em.emit_nodes(_cone(self.g, targets))
            body += em.lines
            em.lines = []
            sets = self.reduction_sets(em, level, lambda n: f"r{self.reduction_slot[n.index]} = "
                                                           f"{_from_merged(n, '{}')}")
            body += ["tl.debug_barrier()"] + self.partial_lines(sets) + ["tl.debug_barrier()"]
            body += self.merge_lines(sets, "1")
            for n in self.reductions:
                if self.g.depth(n) == level:
                    em.names[n.index] = f"r{self.reduction_slot[n.index]}"
        body += self.final_body(em, single=True)
        return self.kernel(f"{KERNEL_NAME}_single", self.signature(), body,
                       "all passes in one program (the gradient fits one block)")

    # --- reductions over dimensions (fusedhooks.dims) ------------------------------------------------------------

    def split_sizes(self) -> tuple[int, int]:
        """(fp64 accumulators, counters) per gradient that the reduction passes whose programs share blocks of units
        (dims.Units.reduce_splits) need: the most any of them needs (they run one after another); (0, 0) if none."""
        values, counters = 0, 0
        for launch in self.units.schedule(self.g):
            if launch[0] != "units":
                continue
            group = launch[3]
            splits, _ = self.units.reduce_splits(group[0])
            if splits > 1:
                tile = self.units.reduce_tile(group[0])
                blocks = tile.programs(group[0].n_units)
                values = max(values, blocks * splits * tile.units * sum(_parts_of(r.node) for r in group))
                counters = max(counters, blocks)
        return values, counters

    def unit_lanes(self, tile: dims.Tile, kept: tuple[int, ...], block: str = "pid") -> list[str]:
        """`unit` and `element` of each lane of the tile of block of units `block`, and `unit_offs`, the offset of
        its unit."""
        t = tile
        if t.rows:
            lines = [f"unit = {block} * {t.units} + lane // {t.elements}", f"element = lane % {t.elements}"]
        else:
            lines = [f"unit = {block} * {t.units} + lane % {t.units}", f"element = lane // {t.units}"]
        return ["lane = tl.arange(0, " + str(t.size) + ")"] + lines + [f"unit_offs = {self.span('unit', kept)}"]

    def span(self, index: str, dims_: tuple[int, ...]) -> str:
        """The offset in the gradient of the element numbered `index` row-major over gradient dims `dims_`."""
        shape = self.units.shape
        strides = dims.row_major_strides(shape)
        inner = dims.row_major_strides(tuple(shape[d] for d in dims_))
        terms = []
        for k, d in enumerate(dims_):
            term = f"({index})" if inner[k] == 1 else f"(({index}) // {inner[k]})"
            if k > 0:
                term = f"({term} % {shape[d]})"
            terms.append(term if strides[d] == 1 else f"{term} * {strides[d]}")
        return " + ".join(terms) if terms else f"({index}) * 0"

    def unit_reduction(self, em: Emitter, r: dims.UnitReduction, tile: tuple[str, str, str], count: str, n: str,
                       x: str | None = None) -> tuple[list[str], list[str], str, list, list[str]]:
        """(accumulator lines, lines adding this chunk of each unit's elements, the fp64 [units] result, the
        accumulators as (name, type), lines merging another program's accumulators `{0}`, `{1}`, ... into them) of
        reduction `r` over the lanes in `mask`.

        tile: (units, elements, rows) of the kernel's tile (see dims.Tile), as source text; count: the elements of
        each unit in the chunk, n: in the unit (fp64 expressions); x: the name of the input (default: its name in
        `em`)."""
        spec = reduction_spec(r.node)
        k = r.node.index
        if x is None:
            x = em.value(r.node.args["input"], compute_type(r.node.args["input"].dtype))
        x64 = f"{x}.to(tl.float64)"
        if spec.of_abs:
            x64 = f"tl.abs({x64})"
        units = tile[0]
        shape = ", ".join(tile)
        axis = 1 if tile[2] == "True" else 0

        def per_unit(reduce: str, value: str) -> str:  # each unit's lanes of `value` reduced (tl.sum/max/min)
            return f"tl.{reduce}(as_units({value}, {shape}), axis={axis})"

        acc, add = f"a{k}", []
        if spec.stat in ("sum", "mean", "norm"):
            init = [f"{acc} = tl.zeros([{units}], tl.float64)"]
            value = f"{x64} * {x64}" if spec.stat == "norm" else x64
            add = [f"{acc} += {per_unit('sum', f'tl.where(mask, {value}, 0.0)')}"]
            result = {"sum": acc, "mean": f"{acc} / {n}", "norm": f"tl.sqrt({acc})"}[spec.stat]
            parts, merge = [(acc, "tl.float64")], [f"{acc} += {{0}}"]
        elif spec.stat in ("var", "std"):  # Chan's merge of each chunk's mean and squared deviations
            init = [f"{acc}_mean = tl.zeros([{units}], tl.float64)", f"{acc}_m2 = tl.zeros([{units}], tl.float64)",
                    f"{acc}_n = tl.zeros([{units}], tl.float64)"]
            add = [f"c{k} = {count}",
                   f"mean{k} = {per_unit('sum', f'tl.where(mask, {x64}, 0.0)')} / c{k}",
                   f"dev{k} = tl.where(mask, {x64} - to_lanes(mean{k}, {shape}), 0.0)",
                   f"delta{k} = mean{k} - {acc}_mean",
                   f"n{k} = {acc}_n + c{k}",
                   f"{acc}_mean += delta{k} * (c{k} / n{k})",
                   f"{acc}_m2 += {per_unit('sum', f'dev{k} * dev{k}')} "
                   f"+ delta{k} * delta{k} * ({acc}_n * c{k} / n{k})",
                   f"{acc}_n = n{k}"]
            var = f"{acc}_m2 / tl.maximum({n} - {spec.correction!r}, 0.0)"
            result = var if spec.stat == "var" else f"tl.sqrt({var})"
            parts = [(f"{acc}_n", "tl.float64"), (f"{acc}_mean", "tl.float64"), (f"{acc}_m2", "tl.float64")]
            merge = [f"delta{k} = {{1}} - {acc}_mean", f"n{k} = {acc}_n + {{0}}",
                     f"{acc}_mean += delta{k} * ({{0}} / n{k})",
                     f"{acc}_m2 += {{2}} + delta{k} * delta{k} * ({acc}_n * {{0}} / n{k})", f"{acc}_n = n{k}"]
        elif spec.stat in ("max", "min", "absmax"):  # NaN propagates, as torch's amax/amin
            largest = spec.stat != "min"
            fill = '-float("inf")' if largest else 'float("inf")'
            if spec.stat == "absmax":
                x64 = f"tl.abs({x64})"
            init = [f"{acc} = tl.full([{units}], {fill}, tl.float64)", f"{acc}_nan = tl.zeros([{units}], tl.int32)"]
            merge = "tl.maximum" if largest else "tl.minimum"
            numbers = f"tl.where(mask & ({x64} == {x64}), {x64}, {fill})"
            add = [f"{acc} = {merge}({acc}, {per_unit('max' if largest else 'min', numbers)})",
                   f"{acc}_nan += {per_unit('sum', f'(mask & ({x64} != {x64})).to(tl.int32)')}"]
            result = f'tl.where({acc}_nan > 0, float("nan"), {acc})'
            parts = [(acc, "tl.float64"), (f"{acc}_nan", "tl.int32")]
            merge = [f"{acc} = {merge}({acc}, {{0}})", f"{acc}_nan += {{1}}"]
        else:  # all / any: zeros counted
            init = [f"{acc} = tl.zeros([{units}], tl.int32)"]
            add = [f"{acc} += {per_unit('sum', f'(mask & ({x64} == 0)).to(tl.int32)')}"]
            result = f"({acc} == 0)" if spec.test == "all" else f"({acc} < {n})"
            parts, merge = [(acc, "tl.int32")], [f"{acc} += {{0}}"]
        return init, add, result, parts, merge

    def units_reduce_kernel(self, level: int, k: int, group: list[dims.UnitReduction]) -> list[str]:
        """The reductions over dims group[0].reduced of `level`: each program reduces `tile.units` whole units,
        `tile.elements` of their elements at a time, and stores their results in units_ptr."""
        tile = self.units.reduce_tile(group[0])
        r0 = group[0]
        available, loads = self.reduced_before(level)
        em = self.emitter(available)
        em.block = str(tile.size)
        em.emit_nodes(_cone(self.g, [r.node.args["input"] for r in group]))
        inits, adds, stores = [], [], []
        splits, span = self.units.reduce_splits(r0)
        saves, merged_in = [], []  # (splits > 1) this program's accumulators; the last one's merge of them all
        block = "pid" if splits == 1 else "ublock"
        out_units = f"{block} * {tile.units} + tl.arange(0, {tile.units})"
        accumulators = [self.unit_reduction(em, r, _tile_text(tile), f"tl.minimum({r0.n_reduced} - start, "
                                            f"{tile.elements}).to(tl.float64)", f"{float(r0.n_reduced)!r}")
                        for r in group]
        n_parts = sum(len(parts) for *_, parts, _ in accumulators)
        assert n_parts == sum(_parts_of(r.node) for r in group)  # what split_sizes allots
        slot = 0
        for r, (init, add, result, parts, merge) in zip(group, accumulators):
            inits += init
            adds += add
            value = _from_merged(r.node, result)  # rounded to the result's dtype once, as eager torch does
            stores.append(f"tl.store({_units_slots(r)} + out_units, ({value}).to({_units_type(r)}), "
                          f"mask=out_units < {r.n_units})  # {r.node.name}")
            names = []
            for name, ty in parts:
                where = (f"unit_partials_ptr + ((ublock * {splits} + {{}}) * {n_parts} + {slot}) * {tile.units} "
                         f"+ tl.arange(0, {tile.units})")
                saves.append(f"tl.store({where.format('split')}, {name}.to(tl.float64))")
                loaded = f"tl.load({where.format('s')})"
                merged_in.append(f"p{slot} = {loaded}" + ("" if ty == "tl.float64" else f".to({ty})"))
                names.append(f"p{slot}")
                slot += 1
            merged_in += [line.format(*names) for line in merge]
        loop = ([f"offs = unit_offs + {self.span('start + element', r0.reduced)}",
                 f"mask = (unit < {r0.n_units}) & (start + element < {r0.n_reduced})"]
                + self.loads() + em.lines + adds)
        body = self.header(tile.programs(r0.n_units) * splits)
        if splits == 1:
            body += (self.unit_lanes(tile, r0.kept) + loads + inits
                     + [f"for start in range(0, {r0.n_reduced}, {tile.elements}):"] + ["    " + line for line in loop]
                     + [f"out_units = {out_units}"] + stores)
            how = f"{tile.units} units of {r0.n_reduced} elements per program"
        else:  # `splits` programs per block of units, `span` elements each; the last to finish merges and stores
            body += ([f"ublock = pid // {splits}  # which block of units", f"split = pid % {splits}  # which part of "
                      "their elements"] + self.unit_lanes(tile, r0.kept, block) + loads + inits
                     + [f"for start in range(split * {span}, tl.minimum(split * {span} + {span}, {r0.n_reduced}), "
                        f"{tile.elements}):"] + ["    " + line for line in loop] + saves
                     + ["tl.debug_barrier()",
                        "done = tl.atomic_add(unit_counters_ptr + ublock, 1)  # acq_rel: the partials above are "
                        "visible to the last program", f"if done == {splits} - 1:", "    tl.debug_barrier()"]
                     + ["    " + line for line in inits] + [f"    for s in range({splits}):"]
                     + ["        " + line for line in merged_in]
                     + ["    " + line for line in [f"out_units = {out_units}"] + stores]
                     + ["    tl.store(unit_counters_ptr + ublock, 0)"])
            how = (f"{tile.units} units per block, {splits} programs of {span} of their {r0.n_reduced} elements "
                   "each, merged by the last")
        return self.kernel(f"reduce_units{level}_{k}{self.suffix}", self.signature(), body,
                           f"reductions over dims {list(r0.reduced)} of level {level}: {how}; results into units_ptr")

    def whole_of_units_kernel(self, level: int, k: int, node: Node) -> list[str]:
        """Whole-tensor reduction `node` of a value reduced over dimensions: one program over the value's elements,
        read from the units workspace; its result goes to reduced_ptr."""
        r = self.units.whole_of(node)
        x = node.args["input"]
        size = min(dims.REDUCE_TILE, dims.next_pow2(r.n_reduced))
        tile = dims.Tile(1, size, True)
        available, loads = self.reduced_before(level)
        em = UnitsEmitter(self.plan, self.device_type, dims.Units(x.shape, self.units.dtype, self.units.reductions,
                                                                    [], False), self.gather)
        em.names.update(available)
        em.block = str(size)
        name = em.at(x, dims.full_map(x.shape))  # the value's own dims index it: `offs` runs over its elements
        init, add, result, _, _ = self.unit_reduction(em, r, _tile_text(tile),
                                                f"tl.minimum({r.n_reduced} - start, {size}).to(tl.float64)",
                                                f"{float(r.n_reduced)!r}", x=name)
        loop = [f"offs = start + tl.arange(0, {size})", f"mask = offs < {r.n_reduced}"] + em.lines + add
        slot = self.reduction_slot[node.index]
        body = (self.header(1) + loads + init + [f"for start in range(0, {r.n_reduced}, {size}):"]
                + ["    " + line for line in loop]
                + [f"tl.store(reduced_ptr + {slot} + tl.arange(0, 1), ({result}).to(tl.float64))  # {node.name}"])
        return self.kernel(f"reduce_whole{level}_{k}{self.suffix}", self.signature(), body,
                           f"{node.op} of the {r.n_reduced} elements of {x.name}, reduced over dimensions: one program")

    def one_pass_kernel(self) -> list[str]:
        """Every pass in one launch, each program holding UNITS whole units (each one span of unit_numel <= ELEMENTS
        elements; the sizes are arguments, so gradients of any shape share the kernel): the reductions of every
        level, the body, its store and the statistics; each element is read and written once."""
        units = self.units
        held: dict[int, str] = {}
        em = self.emitter({}, read=lambda em, r, m: held[r.node.index])
        em.block = "UNITS * ELEMENTS"
        body = self.header()
        if self.multi:
            body += [f"n_units = tl.load({_table_part('n_units')})",
                     f"unit_numel = tl.load({_table_part('unit_numel')})"]
        vec = 16 // _ELEMENT_SIZE[self.g.grad_dtype]
        body += ["if ALIGNED:  # (for this kernel ALIGNED also means: every unit a multiple of 16 bytes)",
                 f"    unit_numel = tl.multiple_of(unit_numel.to(tl.int64), {vec})"]
        body += ["lane = tl.arange(0, UNITS * ELEMENTS)", "unit = pid * UNITS + lane // ELEMENTS",
                 "element = lane % ELEMENTS", "offs = unit * unit_numel + element",
                 "mask = (unit < n_units) & (element < unit_numel)"] + self.loads()
        tile = ("UNITS", "ELEMENTS", "True")
        n = "unit_numel.to(tl.float64)"
        for level in range(1, self.plan.levels + 1):
            group = [r for r in units.reductions if self.g.depth(r.node) == level]
            em.emit_nodes(_cone(self.g, [r.node.args["input"] for r in group]))
            for r in group:
                init, add, result, _, _ = self.unit_reduction(em, r, tile, n, n)
                em.lines += init + add
                name = held[r.node.index] = f"b{r.node.index}"
                em.lines.append(f"{name} = to_lanes({_from_merged(r.node, result)}, UNITS, ELEMENTS, True)")
        body += em.lines
        em.lines = []
        body += self.final_body(em, single=False, per_program="UNITS * unit_numel")
        return self.kernel(f"{KERNEL_NAME}_units{self.suffix}", self.signature(), body,
                           "all passes in one launch: each program holds UNITS whole units")


def _body_lines(plan: Plan) -> list[str]:
    """The body, for the generated source's header; for a one-pass body over units without its shapes and dims (the
    kernel takes the sizes: gradients of every shape share it)."""
    lines = str(plan.graph).splitlines()
    if plan.units is None or not plan.units.one_pass:
        return lines
    return [re.sub(r"dim=(\([^)]*\)|-?\d+), ", "", re.sub(r" shape \([^)]*\)", " per unit", line)) for line in lines]


def _units_type(r: dims.UnitReduction) -> str:
    """The type a reduction's per-unit results are kept in, in the units workspace: its compute type, fp32 for bool
    (fewer registers where the elementwise pass gathers them than fp64)."""
    ct = compute_type(r.node.dtype)
    return ct if ct in ("tl.float64", "tl.int64") else "tl.float32"


def _units_slots(r: dims.UnitReduction) -> str:
    """The address of the first per-unit result of `r` (the workspace is fp64: fp32 results use half of each slot)."""
    slots = f"(units_ptr + {r.offset})"
    ty = _units_type(r)
    return slots if ty == "tl.float64" else f"{slots}.to(tl.pointer_type({ty}))"


def _parts_of(node: Node) -> int:
    """Accumulators per unit of a reduction over dimensions (see _KernelWriter.unit_reduction)."""
    return {"var": 3, "std": 3, "max": 2, "min": 2, "absmax": 2}.get(reduction_spec(node).stat, 1)


def _tile_text(tile: dims.Tile) -> tuple[str, str, str]:
    return str(tile.units), str(tile.elements), str(tile.rows)


def _cone(g: Graph, roots: list[Node]) -> list[Node]:
    """Nodes the roots depend on, stopping at reductions (their results are inputs), in program order."""
    seen, stack = set(), list(roots)
    while stack:
        n = stack.pop()
        if n.index in seen:
            continue
        seen.add(n.index)
        if not (n.kind == "op" and is_reduction(n.op, n.args)) or n in roots:
            stack.extend(n.inputs())
    return [n for n in g.nodes if n.index in seen]


def _merged(spec) -> str:
    """The fp64 (or bool) result of a reduction / statistic from the merged tuple `st`."""
    if isinstance(spec, str):
        return f"st[{_STAT_INDEX[spec]}]"
    if spec.test == "all":
        return f"st[{_STAT_INDEX['zeros']}] == 0"
    if spec.test == "any":
        return f"st[{_STAT_INDEX['zeros']}] < st[{_STAT_INDEX['count']}]"
    return f"st[{_STAT_INDEX[spec.stat]}]"


def _from_merged(node: Node, value: str) -> str:
    """A merged reduction result (fp64 or bool) as a value of `node`'s dtype."""
    ct = compute_type(node.dtype)
    if ct == "tl.int1":
        return f"({value})"
    return rounded(f"({value}).to({ct})", node.dtype)


def _from_reduced(node: Node, loaded: str) -> str:
    """A reduction result stored as fp64 in reduced_ptr, as a value of `node`'s dtype."""
    if compute_type(node.dtype) == "tl.int1":
        return f"({loaded} != 0)"
    return _from_merged(node, loaded)


def _last_program(lines: list[str]) -> list[str]:
    return ["tl.debug_barrier()",
            "done = tl.atomic_add(counter_ptr, 1)  # acq_rel: the partials above are visible to the last program",
            "if done == num_blocks - 1:", "    tl.debug_barrier()"] + \
           ["    " + line for line in lines] + ["    tl.store(counter_ptr, 0)"]


def _kernel(name: str, args: list[str], body: list[str], doc: str) -> list[str]:
    # Triton turns an integer argument equal to 1 into a constexpr (then `numel.to(...)` fails to compile):
    # a 1-element gradient or bucket must not change the kernel
    unspecialized = [a.split(",")[0] for a in args if a.startswith(("numel,", "n_tensors,", "n_units,", "unit_numel,"))]
    return (["", "", f"@triton.jit(do_not_specialize={unspecialized})", f"def {name}("]
            + ["    " + a for a in args] + ["):", f'    """{doc}"""']
            + ["    " + line for line in body])


def generate(plan: Plan, device_type: str) -> str:
    """Triton source of the kernels for `plan` (device_type: "cuda", or "cpu" for the interpreter); see
    `generate_with_spec`."""
    return generate_with_spec(plan, device_type)[0]


def generate_with_spec(plan: Plan, device_type: str) -> tuple[str, LaunchSpec]:
    """Triton source of the kernels for `plan` (device_type: "cuda", or "cpu" for the interpreter) and how to
    launch them.

    Without reductions in the body: one kernel, `fused_hook`. With them: `fused_hook_single` (all
    passes in one program, for gradients that fit one block), `reduce_level1..L` and `fused_hook`.
    Each but `fused_hook_single` also comes as `..._multi`, which processes a bucket of gradients
    through a table (one launch per pass for the whole bucket).
    """
    header = [
        f"# Generated by fusedhooks for {plan.graph.grad_dtype} gradients on {device_type}. Do not edit.",
        "import triton",
        "import triton.language as tl",
        "from triton.language.extra import libdevice",
        "",
        "from fusedhooks.kernels.elementwise import (bf16_to_fp32, negate, pow_scalar, round_to_bf16, round_to_fp16,",
        "                                            to_bf16)",
        "from fusedhooks.kernels.stats import finalize_stats, hist_accumulate, hist_flush, store_partials",
        *(["from fusedhooks.kernels.units import as_units, to_lanes"]
          if plan.units is not None else []),
        "",
        f"HIST_PAD = tl.constexpr({_hist_pad(plan.hist_bins)})",
        "",
        "# body:",
        *("#   " + line for line in _body_lines(plan)),
    ]
    if plan.units is not None:
        return _generate_units(plan, device_type, header)
    kernels, signatures, roles = [], {}, []
    for multi in (False, True):
        w = _KernelWriter(plan, device_type, multi)
        if plan.levels == 0:
            kernels += w.simple_kernel()
        else:
            if not multi:
                kernels += w.single_kernel()
            for level in range(1, plan.levels + 1):
                kernels += w.reduce_kernel(level)
            kernels += w.final_kernel()
        signatures.update(w.signatures)
        roles.append(w.roles())
    footer = ["", "", "#: Each kernel's arguments and their Triton types (ahead-of-time builds: fusedhooks.build)",
              f"SIGNATURES = {signatures!r}"]
    n_reductions = len(plan.graph.reductions())
    levels = tuple(f"reduce_level{level}" for level in range(1, plan.levels + 1))
    spec = LaunchSpec(
        args=roles[0], multi_args=roles[1],
        kernels=levels + (KERNEL_NAME,),
        single_kernels=(KERNEL_NAME,) if plan.levels == 0 else (f"{KERNEL_NAME}_single",),
        multi_kernels=tuple(f"{name}_multi" for name in levels + (KERNEL_NAME,)),
        n_slots=len(plan.slots), n_reductions=n_reductions,
        # rows of partials a program writes: one per statistics set, or per reduction set of a level
        partial_sets=max(len(plan.stat_sets), n_reductions),
        hist_sets=sum("hist" in names for _, names in plan.stat_sets), hist_pad=_hist_pad(plan.hist_bins))
    return "\n".join(header + kernels + footer) + "\n", spec


def _generate_units(plan: Plan, device_type: str, header: list[str]) -> tuple[str, LaunchSpec]:
    """`generate_with_spec` for a body that reduces over dimensions, planned for one gradient shape: one kernel
    over whole units (`fused_hook_units`) when plan.units.one_pass, else per level a whole-tensor reduction pass
    (`reduce_level<l>`, if any) and one `reduce_units<l>_<k>` per reduced dims, then `fused_hook`, which reads the
    results by index. Each also comes as `..._multi`, for a bucket of gradients of that shape."""
    units = plan.units
    kernels, signatures, roles, names, fixed = [], {}, [], [], []
    for multi in (False, True):
        w = _KernelWriter(plan, device_type, multi)
        if units.one_pass:
            kernels += w.one_pass_kernel()
            if not multi:
                names.append(f"{KERNEL_NAME}_units")
        else:
            for launch in units.schedule(plan.graph):
                if launch[0] == "whole":
                    kernels += w.reduce_kernel(launch[1])
                    name, programs = f"reduce_level{launch[1]}", None
                elif launch[0] == "units":
                    _, level, k, group = launch
                    kernels += w.units_reduce_kernel(level, k, group)
                    programs = units.reduce_tile(group[0]).programs(group[0].n_units) * units.reduce_splits(group[0])[0]
                    name = f"reduce_units{level}_{k}"
                elif launch[0] == "whole_of_units":
                    _, level, k, node = launch
                    kernels += w.whole_of_units_kernel(level, k, node)
                    name, programs = f"reduce_whole{level}_{k}", 1
                else:
                    kernels += w.final_kernel()
                    name, programs = KERNEL_NAME, None
                if not multi:
                    names.append(name)
                    if programs is not None:
                        fixed.append((name, programs))
        signatures.update(w.signatures)
        roles.append(w.roles())
    footer = ["", "", "#: Each kernel's arguments and their Triton types (ahead-of-time builds: fusedhooks.build)",
              f"SIGNATURES = {signatures!r}"]
    n_reductions = len(w.reductions)
    fixed += [(name + "_multi", programs) for name, programs in fixed]
    spec = LaunchSpec(
        args=roles[0], multi_args=roles[1], kernels=tuple(names), single_kernels=tuple(names),
        multi_kernels=tuple(f"{name}_multi" for name in names), n_slots=len(plan.slots), n_reductions=n_reductions,
        partial_sets=max(len(plan.stat_sets), n_reductions),
        hist_sets=sum("hist" in names_ for _, names_ in plan.stat_sets), hist_pad=_hist_pad(plan.hist_bins),
        fixed_grids=tuple(fixed), units_values=0 if units.one_pass else units.n_values, one_pass=units.one_pass,
        unit_partial_values=w.split_sizes()[0] if not units.one_pass else 0,
        unit_counter_values=w.split_sizes()[1] if not units.one_pass else 0)
    return "\n".join(header + kernels + footer) + "\n", spec


#: Triton signature types of the argument comments' "*<type>" (torch dtypes and the workspace types)
_SIG_TYPES = {"fp16": "*fp16", "bf16": "*bf16", "fp32": "*fp32", "fp64": "*fp64", "int32": "*i32", "int64": "*i64"}
_SIG_TYPES.update({str(dtype): "*" + name for dtype, name in (
    (torch.float16, "fp16"), (torch.bfloat16, "bf16"), (torch.float32, "fp32"), (torch.float64, "fp64"),
    (torch.bool, "i1"), (torch.int8, "i8"), (torch.uint8, "u8"), (torch.int16, "i16"), (torch.int32, "i32"),
    (torch.int64, "i64"))})


def _sig_type(arg: str) -> str:
    """The Triton signature type of one argument line `name,  # *type ...: doc` ("i32" for plain ints)."""
    name, _, comment = arg.partition("#")
    if "tl.constexpr" in name:
        return "constexpr"
    comment = comment.strip()
    if not comment.startswith("*"):
        return "i32"
    return _SIG_TYPES[comment[1:].split()[0].rstrip(":")]


def _table_part(part: str) -> str:
    """The address of tensor t's entry in part `part` of the bucket table (TABLE_PARTS)."""
    k = TABLE_PARTS.index(part)
    return f"table_ptr + {k} * n_tensors + t" if k else "table_ptr + t"


def _hist_pad(bins: int) -> int:
    """Histogram slots per set: a power of two above `bins` (the extra slots take masked lanes)."""
    return 1 << bins.bit_length() if bins else 1


_STAT_INDEX = {name: i for i, name in enumerate(STAT_NAMES)}  # finalize_stats returns them in this order


_ELEMENT_SIZE = {torch.float16: 2, torch.bfloat16: 2, torch.float32: 4, torch.float64: 8}


def _storage_type(dtype: torch.dtype) -> str:
    return {torch.float16: "tl.float16", torch.bfloat16: "tl.bfloat16", torch.float32: "tl.float32",
            torch.float64: "tl.float64"}[dtype]


# --- the on-disk cache -----------------------------------------------------------------------------

_loaded: dict[str, object] = {}


def load(source: str, spec: LaunchSpec | None = None):
    """The module of @triton.jit kernels defined by `source`, written once to the cache directory by
    content hash; spec (from `generate_with_spec`) becomes its SPEC."""
    digest = hashlib.sha256(source.encode()).hexdigest()[:24]
    if digest in _loaded:
        module = _loaded[digest]
        if spec is not None:
            module.SPEC = spec
        return module
    directory = config.cache_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OSError(f"fusedhooks writes its generated kernels to {directory} (FUSEDHOOKS_CACHE_DIR, else "
                      f"$XDG_CACHE_HOME/fusedhooks or ~/.cache/fusedhooks), which cannot be made a directory: {e}. "
                      "Set FUSEDHOOKS_CACHE_DIR to a writable directory") from None
    path = directory / f"fh_{digest}.py"
    if not path.exists() or path.read_text() != source:
        fd, tmp = tempfile.mkstemp(dir=directory, suffix=".py.tmp")
        with os.fdopen(fd, "w") as f:
            f.write(source)
        os.replace(tmp, path)
    module_name = f"fusedhooks_generated_{digest}"
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module
    module_spec.loader.exec_module(module)
    module.DIGEST = digest  # names the kernels in the tuning cache
    module.SPEC = spec
    _loaded[digest] = module
    return module
