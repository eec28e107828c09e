"""The kernels of a plan over blocks of BLOCK elements: the elementwise pass and the statistics and whole-tensor
reductions (`KernelWriter`, `write_block_kernels`); fusedhooks.units_kernels extends the writer to reductions over
dimensions.

Each kernel processes the gradient's storage span in blocks of BLOCK elements: it loads the gradient (and the
parameter), evaluates the body in fp32 (fp64 for float64), rounding every fp16/bf16 intermediate as eager torch does,
stores the result, and reduces statistics.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..compiler import dims
from ..compiler.ir import ALL_STAT_NAMES, Graph, Node, is_reduction, reduction_spec
from ..compiler.plan import PARTIAL_FLAGS, Plan, partial_flags
from .emit import FLOAT_CT, Emitter, compute_type, full, literal, rounded, widen
from .launch_spec import KERNEL_NAME, PARTIAL_WIDTH, TABLE_PARTS, LaunchSpec, hist_pad


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


class KernelWriter:
    """Writes the kernels of one plan; they share one signature (see `signature`).

    A plan that reduces over dimensions (plan.units) has its writer in fusedhooks.units_kernels: it adds the units
    workspace to the signature (`workspace_arguments`, `size_arguments`, `tile_arguments`, `workspace_offsets`) and
    reads the results of those reductions in the body (`emitter`)."""

    def __init__(self, plan: Plan, device_type: str, multi: bool = False):
        self.plan = plan
        self.multi = multi
        self.suffix = "_multi" if multi else ""
        self.g = plan.graph
        self.device_type = device_type
        self.ct = compute_type(self.g.grad_dtype)
        #: the reductions over dimensions (fusedhooks.dims), for a body planned for one gradient shape (its writer:
        #: units_kernels.UnitsKernelWriter)
        self.units = plan.units
        #: the whole-tensor reductions (their results: reduced_ptr)
        self.reductions = [n for n in self.g.reductions() if not dims.is_dim_reduction(n)]
        self.reduction_slot = {n.index: k for k, n in enumerate(self.reductions)}
        self.hist_sets = [kind for kind, names in plan.stat_sets if "hist" in names]
        #: the elementwise pass keeps statistics' running sums over its tiles (a histogram aside)
        self.records_statistics = any(name != "hist" for _, names in plan.stat_sets for name in names)
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
        args += self.workspace_arguments(per)
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
        args += self.size_arguments()
        args += [("ALIGNED", "ALIGNED: tl.constexpr,  # gradient (and parameter) addresses 16-byte aligned and "
                             "every numel a multiple of 16 bytes: a vectorisation hint, true whenever set "
                             "(runtime.aligned)"),
                 ("BLOCK", "BLOCK: tl.constexpr,  # elements per program"),
                 ("RBLOCK", "RBLOCK: tl.constexpr,  # partial rows merged at a time")]
        if self.full_blocks and (self.reductions or p.slots):
            args.append(("FULL_BLOCKS", "FULL_BLOCKS: tl.constexpr,  # every numel a multiple of BLOCK: no "
                                        "program's block is partial (statistics without the mask's selects)"))
        return args + self.tile_arguments()

    def workspace_arguments(self, per: str) -> list[tuple[str, str]]:
        """(role, source line) of the arguments after `reduced` for the workspaces of reductions over dimensions
        (per: how a bucket kernel's argument comments start); none here."""
        return []

    def size_arguments(self) -> list[tuple[str, str]]:
        """(role, source line) of the arguments after `numel` that give the gradient's sizes; none here."""
        return []

    #: the kernels over blocks of BLOCK elements take FULL_BLOCKS (see `tiled`)
    full_blocks = True

    def tile_arguments(self) -> list[tuple[str, str]]:
        """(role, source line) of the constexprs after RBLOCK; none here."""
        return []

    def workspace_offsets(self) -> list[str]:
        """A bucket kernel's lines moving the workspace pointers of `workspace_arguments` to gradient `t`; none
        here."""
        return []

    # --- pieces --------------------------------------------------------------------------------

    def prologue(self, running_sums: bool) -> list[str]:
        """The lines before the tiles of a kernel over blocks of BLOCK elements: `header`, the tile's size and the
        program's valid elements (see `tiled`); `running_sums`: the kernel keeps some over its tiles (statistics,
        whole-tensor reductions; see `tile_elements`)."""
        tile = tile_elements(self.g.grad_dtype, bool(self.hist_sets), running_sums)
        return self.header() + [f"TILE: tl.constexpr = min(BLOCK, {tile})  # elements per step over the block",
                                "n_valid = tl.minimum(numel - pid * BLOCK, BLOCK).to(tl.int32)  # this program's"]

    def tiled(self, tile_lines: list[str], sets: list[_ReductionSet], per_tile: list[str] = ()) -> list[str]:
        """A program's block in tiles of TILE elements: `tile_lines` (which read `offs`, `mask`: loads, body, store)
        for the first tile, the statistics of `sets` started on it (kernels.stats.stats_first), then a loop over the
        others adding theirs (stats_add); `per_tile` after each tile's statistics (the histogram). The statistics'
        running state is reduced and stored once per program by `store_lines`: one reduction per statistic per
        block, not per tile."""
        full = "FULL_BLOCKS" if self.full_blocks else "False"
        first = ["offs = pid * BLOCK + tl.arange(0, TILE)", "mask = offs < numel"] + tile_lines
        rest = ["offs = pid * BLOCK + start + tl.arange(0, TILE)", "mask = offs < numel"] + tile_lines
        vec = f"VEC={16 // ELEMENT_SIZE[self.g.grad_dtype]}"
        for k, rs in enumerate(sets):
            flags = _flags(rs)
            first.append(f"{_state(k)} = stats_first({rs.x}, mask, tl.minimum(n_valid, TILE), {flags}, FULL={full}, "
                         f"{vec})")
            rest.append(f"{_state(k)} = stats_add({rs.x}, mask, {_state(k)}, {flags}, FULL={full}, {vec})")
        return (first + list(per_tile) + ["for start in range(TILE, n_valid, TILE):"]
                + ["    " + line for line in rest + list(per_tile)])

    def store_lines(self, sets: list[_ReductionSet], tiled: bool = True) -> list[str]:
        """Each set's partials row of the program: its running state over the tiles (`tiled`) reduced and stored, or
        (not tiled: a kernel over units, whose program holds all its elements at once) its values reduced."""
        lines = []
        for k, rs in enumerate(sets):
            row = f"partials_ptr + (pid * {len(sets)} + {k}) * {PARTIAL_WIDTH}"
            lines.append(f"stats_store({row}, n_valid, {_state(k)}, {_flags(rs)})" if tiled else
                         f"store_partials({rs.x}, mask, n_valid, {row}, {_flags(rs)}, FULL=False)")
        return lines

    def header(self, programs: int | None = None) -> list[str]:
        """Which program this is (`pid`; for a bucket, of gradient `t`), the pointers of its gradient, and for AMP the
        inverse of the scaler's scale (read once per program, not per tile: `loads` uses it).

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
            lines += [f"grad_ptr = tl.load({table_part('grad')}).to({storage})",
                     f"numel = tl.load({table_part('numel')})",
                     f"num_blocks = tl.load({table_part('blocks')})"]
            if g.uses_param:
                lines.append(f"param_ptr = tl.load({table_part('param')}).to({storage})")
            if self.plan.slots:
                lines.append(f"stats_ptr += tl.load({table_part('stats_offset')})")
            if self.reductions or self.plan.slots:
                lines += [f"partials_ptr += tl.load({table_part('partials_offset')})", "counter_ptr += t"]
            if self.reductions:
                lines.append(f"reduced_ptr += t * {len(self.reductions)}")
            lines += self.workspace_offsets()
            if self.hist_sets:
                lines.append(f"hist_ptr += t * {len(self.hist_sets)} * HIST_PAD")
            if programs is not None:
                lines.append(f"num_blocks = {programs}")
        else:
            lines = ["pid = tl.program_id(0).to(tl.int64)", "num_blocks = tl.num_programs(0)"]
        vec = 16 // ELEMENT_SIZE[g.grad_dtype]
        lines += ["if ALIGNED:  # the mask is uniform over each 16 bytes: 128-bit loads and stores",
                  f"    numel = tl.multiple_of(numel.to(tl.int64), {vec})"]
        lines.append("    grad_ptr = tl.multiple_of(grad_ptr, 16)")
        if g.uses_param:
            lines.append("    param_ptr = tl.multiple_of(param_ptr, 16)")
        if self.plan.amp:
            # as torch._amp_foreach_non_finite_check_and_unscale_: grad * fp32(1 / fp64(scale))
            inv = "(1.0 / tl.load(scale_ptr).to(tl.float64)).to(tl.float32)"
            if self.ct != "tl.float32":
                inv += f".to({self.ct})"
            lines.append(f"inv_scale = {inv}")
        return lines

    def loads(self) -> list[str]:
        """The gradient (unscaled for AMP, by the `inv_scale` of `header`) and the parameter at `offs`, `mask`."""
        g = self.g
        lines = [f"grad = {widen('tl.load(grad_ptr + offs, mask=mask, other=0)', g.grad_dtype)}"]
        if self.plan.amp:
            lines += ["scaled = grad", f"grad = {rounded('scaled * inv_scale', g.grad_dtype)}"]
        if g.uses_param:
            lines.append(f"param = {widen('tl.load(param_ptr + offs, mask=mask, other=0)', g.grad_dtype)}")
        return lines

    def emitter(self, available: dict[int, str]) -> Emitter:
        """An emitter that knows the `available` names."""
        em = Emitter(self.plan, self.device_type)
        em.names.update(available)
        em.block = "TILE"  # the kernels over blocks go over them in tiles (`tiled`)
        return em

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
            flags = _flags(rs)
            lines.append(f"st = finalize_stats(partials_ptr, {k}, {len(sets)}, numel, {num_blocks}, {per_program}, "
                         "RBLOCK, "
                         f"{rs.correction!r}, {flags})")
            for spec, _node, action in rs.uses:
                lines.append(action.format(_merged(spec)))
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
        """The elementwise pass: loads, body, store, found_inf, statistics (merged by the last program), over the
        block in tiles (`tiled`).

        per_program: the elements each program covers (a kernel over units: whole units, see `one_pass_kernel`,
        whose program holds them all at once: no tiles)."""
        g, ct = self.g, self.ct
        lines = self.loads() if per_program == "BLOCK" else []
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
        if per_program == "BLOCK":
            lines = self.tiled(lines, sets, hist_acc)
            if not sets and not hist_acc:
                return lines
            if single:
                lines.append("tl.debug_barrier()")
            lines += self.store_lines(sets)
        else:
            if not sets and not hist_acc:
                return lines
            lines.append(f"n_valid = tl.minimum(numel - pid * {per_program}, {per_program})")
            lines += self.store_lines(sets, tiled=False) + hist_acc
        merge = self.merge_lines(sets, "1" if single else "num_blocks", per_program) + hist_flush
        if single:
            return lines + ["tl.debug_barrier()"] + merge
        return lines + _last_program(merge)

    def simple_kernel(self) -> list[str]:
        em = self.emitter({})
        return self.kernel(KERNEL_NAME + self.suffix, self.signature(),
                           self.prologue(self.records_statistics) + self.final_body(em, single=False),
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
        em.emit_nodes(cone(self.g, [x for x in targets if self.units is None or not dims.is_units_value(x)]))
        sets = self.reduction_sets(em, level, lambda n: f"tl.store(reduced_ptr + {self.reduction_slot[n.index]}, "
                                                       f"({{}}).to(tl.float64))  # {n.name}")
        body = self.prologue(True) + loads + self.tiled(self.loads() + em.lines, sets) + self.store_lines(sets)
        body += _last_program(self.merge_lines(sets, "num_blocks"))
        return self.kernel(f"reduce_level{level}{self.suffix}", self.signature(), body,
                       f"reduction pass {level}: leaves its results in reduced_ptr")

    def final_kernel(self) -> list[str]:
        available, loads = self.reduced_before(self.plan.levels + 1)
        em = self.emitter(available)
        return self.kernel(KERNEL_NAME + self.suffix, self.signature(),
                       self.prologue(self.records_statistics) + loads + self.final_body(em, single=False),
                       "the elementwise pass, reading the reductions' results")

    def single_kernel(self) -> list[str]:
        """Every pass in one program (one launch): a pass over the block's tiles per level, its reductions merged in
        the program, then the elementwise pass (the block's reads after the first come from the cache)."""
        body = self.prologue(self.plan.levels > 0 or self.records_statistics)
        for level in range(1, self.plan.levels + 1):
            available, _ = self.reduced_before(level)
            em = self.emitter(available)
            targets = [n.args["input"] for n in self.reductions if self.g.depth(n) == level]
            em.emit_nodes(cone(self.g, targets))
            sets = self.reduction_sets(em, level, lambda n: f"r{self.reduction_slot[n.index]} = "
                                                           f"{from_merged(n, '{}')}")
            body += self.tiled(self.loads() + em.lines, sets)
            body += ["tl.debug_barrier()"] + self.store_lines(sets) + ["tl.debug_barrier()"]
            body += self.merge_lines(sets, "1")
        available, _ = self.reduced_before(self.plan.levels + 1)
        body += self.final_body(self.emitter(available), single=True)
        return self.kernel(f"{KERNEL_NAME}_single", self.signature(), body,
                       "all passes in one program (the gradient fits one block)")

def write_block_kernels(plan: Plan, device_type: str) -> tuple[list[str], dict[str, dict[str, str]], LaunchSpec]:
    """The source lines of the kernels for `plan` (its body without reductions over dimensions), their signatures
    (kernel -> argument -> Triton type) and how to launch them.

    Without reductions in the body: one kernel, `fused_hook`. With them: `fused_hook_single` (all passes in one
    program, for gradients that fit one block), `reduce_level1..L` and `fused_hook`. Each but `fused_hook_single`
    also comes as `..._multi`, which processes a bucket of gradients through a table (one launch per pass for the
    whole bucket)."""
    kernels, signatures, roles = [], {}, []
    for multi in (False, True):
        w = KernelWriter(plan, device_type, multi)
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
        hist_sets=sum("hist" in names for _, names in plan.stat_sets), hist_pad=hist_pad(plan.hist_bins))
    return kernels, signatures, spec


def cone(g: Graph, roots: list[Node]) -> list[Node]:
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


def from_merged(node: Node, value: str) -> str:
    """A merged reduction result (fp64 or bool) as a value of `node`'s dtype."""
    ct = compute_type(node.dtype)
    if ct == "tl.int1":
        return f"({value})"
    return rounded(f"({value}).to({ct})", node.dtype)


def _from_reduced(node: Node, loaded: str) -> str:
    """A reduction result stored as fp64 in reduced_ptr, as a value of `node`'s dtype."""
    if compute_type(node.dtype) == "tl.int1":
        return f"({loaded} != 0)"
    return from_merged(node, loaded)


def _last_program(lines: list[str]) -> list[str]:
    return ["tl.debug_barrier()",
            "done = tl.atomic_add(counter_ptr, 1)  # acq_rel: the partials above are visible to the last program",
            "if done == num_blocks - 1:", "    tl.debug_barrier()"] + \
           ["    " + line for line in lines] + ["    tl.store(counter_ptr, 0)"]


def _flags(rs: _ReductionSet) -> str:
    """The kernels.stats flags of a set, as keyword arguments."""
    return ", ".join(f"{f}={rs.flags.get(f, False)}" for f in PARTIAL_FLAGS)


def _state(k: int) -> str:
    """The names of statistics set k's running state over a program's tiles (kernels.stats.stats_first)."""
    return ", ".join(f"s{k}_{part}" for part in ("shift", "ks", "mn", "mx", "sx", "sx2", "sd", "sd2", "sd3", "sd4",
                                                 "nan", "inf", "zeros"))


def _kernel(name: str, args: list[str], body: list[str], doc: str) -> list[str]:
    # Triton turns an integer argument equal to 1 into a constexpr (then `numel.to(...)` fails to compile):
    # a 1-element gradient or bucket must not change the kernel
    unspecialized = [a.split(",")[0] for a in args if a.startswith(("numel,", "n_tensors,", "n_units,", "unit_numel,"))]
    return (["", "", f"@triton.jit(do_not_specialize={unspecialized})", f"def {name}("]
            + ["    " + a for a in args] + ["):", f'    """{doc}"""']
            + ["    " + line for line in body])


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


def table_part(part: str) -> str:
    """The address of tensor t's entry in part `part` of the bucket table (TABLE_PARTS)."""
    k = TABLE_PARTS.index(part)
    return f"table_ptr + {k} * n_tensors + t" if k else "table_ptr + t"


_STAT_INDEX = {name: i for i, name in enumerate(ALL_STAT_NAMES)}  # finalize_stats returns them in this order


#: Bytes per element of each gradient dtype
ELEMENT_SIZE = {torch.float16: 2, torch.bfloat16: 2, torch.float32: 4, torch.float64: 8}
#: Elements per step of a program over its block (at most BLOCK) that keeps running sums (statistics, whole-tensor
#: reductions): with 8 warps, 16 per thread for 16-bit gradients (two 128-bit accesses), 8 for fp32 (two), 2 for fp64
#: (one); the running sums take a register per 16 bytes of the tile a thread holds (kernels.stats.stats_first's VEC),
#: not one per element. The 16-bit tile is twice the fp32 one's elements: a tile's fixed work (its largest magnitude
#: reduced over the program, the scale's test) spread over twice the elements, what bounds a 16-bit pass with two
#: statistics sets (docs/benchmarks.md)
TILE_ELEMENTS = {torch.float16: 4096, torch.bfloat16: 4096, torch.float32: 2048, torch.float64: 512}
#: The 16-bit tile of a kernel recording a histogram or keeping no running sums. A histogram: its per-tile histogram
#: of 16 elements a thread takes more than the 128 registers of the build's gate on sm_90 (and spills), 8 do not.
#: No running sums: no per-tile fixed work for a larger tile to spread, and at 16 elements a thread ptxas spilled on
#: sm_80 (an AMP body with `pow`; an AMP pass dividing by column norms)
NARROW_TILE_ELEMENTS = 2048


def tile_elements(dtype: torch.dtype, histogram: bool, running_sums: bool) -> int:
    """The elements of a program's step over its block for `dtype` gradients: TILE_ELEMENTS when the kernel keeps
    running sums over its tiles and records no `histogram`, else at most NARROW_TILE_ELEMENTS."""
    tile = TILE_ELEMENTS[dtype]
    return tile if running_sums and not histogram else min(tile, NARROW_TILE_ELEMENTS)


def _storage_type(dtype: torch.dtype) -> str:
    return {torch.float16: "tl.float16", torch.bfloat16: "tl.bfloat16", torch.float32: "tl.float32",
            torch.float64: "tl.float64"}[dtype]

