"""The kernels of a plan whose body reduces over dimensions (fusedhooks.dims), planned for one gradient shape: the
passes over blocks of units, the whole-tensor reductions of values reduced over dimensions, and the one-pass kernel
over whole units (`UnitsKernelWriter`, `write_units_kernels`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..compiler import dims
from ..compiler.ir import Node, reduction_spec
from ..compiler.plan import Plan
from .emit import Emitter, UnitsEmitter, compute_type, convert
from .kernel_writer import ELEMENT_SIZE, KernelWriter, cone, from_merged, table_part
from .launch_spec import KERNEL_NAME, LaunchSpec, hist_pad


@dataclass(frozen=True)
class UnitAccumulators:
    """The source lines of one reduction over dimensions in a kernel that steps through chunks of its units.

    lanes: before the first chunk, the accumulators (per lane, or per unit for var/std); add: per chunk (inputs in
    `mask`); finish: after the last, each unit's accumulators (`parts`) from the lanes'; units: the per-unit
    accumulators at their identity (the last program's merge of the programs sharing a block of units); result: the
    fp64 [units] result from `parts`; merge: lines merging another program's parts `{0}`, `{1}`, ... into them."""

    lanes: list[str]
    add: list[str]
    finish: list[str]
    units: list[str]
    result: str
    parts: list[tuple[str, str]]
    merge: list[str]


class UnitsKernelWriter(KernelWriter):
    """Writes the kernels of a plan that reduces over dimensions (plan.units); they share one signature."""

    full_blocks = False  # no FULL_BLOCKS: their statistics keep the mask

    def workspace_arguments(self, per: str) -> list[tuple[str, str]]:
        """The units workspace and, where programs share blocks of units, their accumulators and counters (one
        pass: none, the program holds the results)."""
        if self.units.one_pass:
            return []
        args = [("units", f"units_ptr,  # *fp64 [{self.units.n_values}]: {per}results of the reductions over "
                          "dimensions, per unit")]
        partial_values, counters = self.split_sizes()
        if counters:
            args += [("unit_partials", f"unit_partials_ptr,  # *fp64 [{partial_values}]: {per}the accumulators "
                                       "of the programs that share a block of units"),
                     ("unit_counters", f"unit_counters_ptr,  # *int32 [{counters}]: {per}programs finished per "
                                       "block of units; the last one merges and resets it to 0")]
        return args

    def size_arguments(self) -> list[tuple[str, str]]:
        """One pass: the units and their size (a bucket kernel reads them from its table)."""
        if not self.units.one_pass or self.multi:
            return []
        return [("n_units", "n_units,  # units of the gradient (fusedhooks.dims)"),
                ("unit_numel", "unit_numel,  # elements of each unit (one span each)")]

    def tile_arguments(self) -> list[tuple[str, str]]:
        """One pass: the tile of units each program holds."""
        if not self.units.one_pass:
            return []
        return [("UNITS", "UNITS: tl.constexpr,  # units per program"),
                ("ELEMENTS", "ELEMENTS: tl.constexpr,  # lanes per unit: a power of two >= every unit_numel")]

    def workspace_offsets(self) -> list[str]:
        """A bucket kernel's lines moving the units workspace (and the accumulators and counters) to gradient `t`."""
        if self.units.one_pass:
            return []
        lines = [f"units_ptr += t * {self.units.n_values}"]
        partial_values, counters = self.split_sizes()
        if counters:
            lines += [f"unit_partials_ptr += t * {partial_values}", f"unit_counters_ptr += t * {counters}"]
        return lines

    def emitter(self, available: dict[int, str], read=None) -> UnitsEmitter:
        """An emitter that knows the `available` names and reads the results of the reductions over dimensions with
        `read` (default: gathers from units_ptr)."""
        em = UnitsEmitter(self.plan, self.device_type, self.units, read or self.gather)
        em.names.update(available)
        em.block = "TILE"  # as the kernels over blocks' (KernelWriter.emitter); a kernel over units sets its own
        return em

    def gather(self, em: UnitsEmitter, r: dims.UnitReduction, m: tuple) -> str:
        """Read the result of reduction `r` of each lane's unit (map `m`) from the units workspace."""
        name = f"u{r.node.index}_{len(em.at_names)}"
        loaded = f"tl.load({_units_slots(r)} + ({em.unit_index(r, m)}), mask=mask, other=0)"
        ct = compute_type(r.node.dtype)
        em.lines.append(f"{name} = {f'({loaded} != 0)' if ct == 'tl.int1' else convert(loaded, _units_type(r), ct)}")
        return name

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
                       x: str | None = None) -> UnitAccumulators:
        """The lines of reduction `r` over the lanes in `mask` (see UnitAccumulators): sums, norms, extrema and
        counts accumulate per lane across the chunks (one reduction per unit after the last); var/std merge each
        chunk's mean and squared deviations into per-unit accumulators (Chan).

        tile: (units, elements, rows) of the kernel's tile (see dims.Tile), as source text; count: the elements of
        each unit in the chunk, n: in the unit (fp64 expressions); x: the name of the input (default: its name in
        `em`)."""
        spec = reduction_spec(r.node)
        k = r.node.index
        ct = compute_type(r.node.args["input"].dtype)
        if x is None:
            x = em.value(r.node.args["input"], ct)
        x64 = f"{x}.to(tl.float64)"
        if spec.of_abs:
            x64 = f"tl.abs({x64})"
        units = tile[0]
        shape = ", ".join(tile)
        lanes = f"{tile[0]} * {tile[1]}"
        axis = 1 if tile[2] == "True" else 0

        def per_unit(reduce: str, value: str) -> str:  # each unit's lanes of `value` reduced (tl.sum/max/min)
            return f"tl.{reduce}(as_units({value}, {shape}), axis={axis})"

        acc, lane = f"a{k}", f"l{k}"
        if spec.stat in ("sum", "mean", "norm"):
            # a loaded gradient or parameter is 0 outside `mask` already (AMP's unscaled one is not: 0 * Inf)
            loaded = r.node.args["input"].kind == "param" or (r.node.args["input"].kind == "grad" and not self.plan.amp)
            wide = f"{x}.to(tl.float64)" if loaded else f"tl.where(mask, {x}, 0).to(tl.float64)"
            add = [f"w{k} = {f'tl.abs({wide})' if spec.of_abs else wide}"]
            add.append(f"{lane} += w{k} * w{k}" if spec.stat == "norm" else f"{lane} += w{k}")
            result = {"sum": acc, "mean": f"{acc} / {n}", "norm": f"tl.sqrt({acc})"}[spec.stat]
            return UnitAccumulators(
                lanes=[f"{lane} = tl.zeros([{lanes}], tl.float64)"], add=add,
                finish=[f"{acc} = {per_unit('sum', lane)}"],
                units=[f"{acc} = tl.zeros([{units}], tl.float64)"],
                result=result, parts=[(acc, "tl.float64")], merge=[f"{acc} += {{0}}"])
        if spec.stat in ("var", "std"):  # Chan's merge of each chunk's mean and squared deviations
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
            merge = [f"delta{k} = {{1}} - {acc}_mean", f"n{k} = {acc}_n + {{0}}",
                     f"{acc}_mean += delta{k} * ({{0}} / n{k})",
                     f"{acc}_m2 += {{2}} + delta{k} * delta{k} * ({acc}_n * {{0}} / n{k})", f"{acc}_n = n{k}"]
            return UnitAccumulators(
                lanes=init, add=add, finish=[], units=init,
                result=var if spec.stat == "var" else f"tl.sqrt({var})",
                parts=[(f"{acc}_n", "tl.float64"), (f"{acc}_mean", "tl.float64"), (f"{acc}_m2", "tl.float64")],
                merge=merge)
        if spec.stat in ("max", "min", "absmax"):  # NaN propagates, as torch's amax/amin
            largest = spec.stat != "min"
            fill = '-float("inf")' if largest else 'float("inf")'
            if ct in ("tl.float32", "tl.float64"):  # extrema are exact in the compute type: no fp64 per element
                v, lane_type = x, ct
            else:
                v, lane_type = f"{x}.to(tl.float64)", "tl.float64"
            if spec.of_abs or spec.stat == "absmax":
                v = f"tl.abs({v})"
            pick = "tl.maximum" if largest else "tl.minimum"
            return UnitAccumulators(
                lanes=[f"{lane} = tl.full([{lanes}], {fill}, {lane_type})",
                       f"{lane}_nan = tl.zeros([{lanes}], tl.int32)"],
                add=[f"e{k} = {v}", f"{lane} = {pick}({lane}, tl.where(mask & (e{k} == e{k}), e{k}, {fill}))",
                     f"{lane}_nan += (mask & (e{k} != e{k})).to(tl.int32)"],
                finish=[f"{acc} = {per_unit('max' if largest else 'min', lane)}.to(tl.float64)",
                        f"{acc}_nan = {per_unit('sum', f'{lane}_nan')}"],
                units=[f"{acc} = tl.full([{units}], {fill}, tl.float64)", f"{acc}_nan = tl.zeros([{units}], tl.int32)"],
                result=f'tl.where({acc}_nan > 0, float("nan"), {acc})',
                parts=[(acc, "tl.float64"), (f"{acc}_nan", "tl.int32")],
                merge=[f"{acc} = {pick}({acc}, {{0}})", f"{acc}_nan += {{1}}"])
        # all / any: zeros counted
        return UnitAccumulators(
            lanes=[f"{lane} = tl.zeros([{lanes}], tl.int32)"],
            add=[f"{lane} += (mask & ({x64} == 0)).to(tl.int32)"],
            finish=[f"{acc} = {per_unit('sum', lane)}"],
            units=[f"{acc} = tl.zeros([{units}], tl.int32)"],
            result=f"({acc} == 0)" if spec.test == "all" else f"({acc} < {n})",
            parts=[(acc, "tl.int32")], merge=[f"{acc} += {{0}}"])

    def units_reduce_kernel(self, level: int, k: int, group: list[dims.UnitReduction]) -> list[str]:
        """The reductions over dims group[0].reduced of `level`: each program reduces `tile.units` whole units,
        `tile.elements` of their elements at a time, and stores their results in units_ptr."""
        tile = self.units.reduce_tile(group[0])
        r0 = group[0]
        available, loads = self.reduced_before(level)
        em = self.emitter(available)
        em.block = str(tile.size)
        em.emit_nodes(cone(self.g, [r.node.args["input"] for r in group]))
        inits, adds, finishes, unit_inits, stores = [], [], [], [], []
        splits, span = self.units.reduce_splits(r0)
        saves, merged_in = [], []  # (splits > 1) this program's accumulators; the last one's merge of them all
        block = "pid" if splits == 1 else "ublock"
        out_units = f"{block} * {tile.units} + tl.arange(0, {tile.units})"
        accumulators = [self.unit_reduction(em, r, _tile_text(tile), f"tl.minimum({r0.n_reduced} - start, "
                                            f"{tile.elements}).to(tl.float64)", f"{float(r0.n_reduced)!r}")
                        for r in group]
        n_parts = sum(len(a.parts) for a in accumulators)
        assert n_parts == sum(_parts_of(r.node) for r in group)  # what split_sizes allots
        slot = 0
        for r, a in zip(group, accumulators):
            inits += a.lanes
            adds += a.add
            finishes += a.finish
            unit_inits += a.units
            value = from_merged(r.node, a.result)  # rounded to the result's dtype once, as eager torch does
            stores.append(f"tl.store({_units_slots(r)} + out_units, ({value}).to({_units_type(r)}), "
                          f"mask=out_units < {r.n_units})  # {r.node.name}")
            names = []
            for name, ty in a.parts:
                where = (f"unit_partials_ptr + ((ublock * {splits} + {{}}) * {n_parts} + {slot}) * {tile.units} "
                         f"+ tl.arange(0, {tile.units})")
                saves.append(f"tl.store({where.format('split')}, {name}.to(tl.float64))")
                loaded = f"tl.load({where.format('s')})"
                merged_in.append(f"p{slot} = {loaded}" + ("" if ty == "tl.float64" else f".to({ty})"))
                names.append(f"p{slot}")
                slot += 1
            merged_in += [line.format(*names) for line in a.merge]
        loop = ([f"offs = unit_offs + {self.span('start + element', r0.reduced)}",
                 f"mask = (unit < {r0.n_units}) & (start + element < {r0.n_reduced})"]
                + self.loads() + em.lines + adds)
        body = self.header(tile.programs(r0.n_units) * splits)
        if splits == 1:
            body += (self.unit_lanes(tile, r0.kept) + loads + inits
                     + [f"for start in range(0, {r0.n_reduced}, {tile.elements}):"] + ["    " + line for line in loop]
                     + finishes + [f"out_units = {out_units}"] + stores)
            how = f"{tile.units} units of {r0.n_reduced} elements per program"
        else:  # `splits` programs per block of units, `span` elements each; the last to finish merges and stores
            body += ([f"ublock = pid // {splits}  # which block of units", f"split = pid % {splits}  # which part of "
                      "their elements"] + self.unit_lanes(tile, r0.kept, block) + loads + inits
                     + [f"for start in range(split * {span}, tl.minimum(split * {span} + {span}, {r0.n_reduced}), "
                        f"{tile.elements}):"] + ["    " + line for line in loop] + finishes + saves
                     + ["tl.debug_barrier()",
                        "done = tl.atomic_add(unit_counters_ptr + ublock, 1)  # acq_rel: the partials above are "
                        "visible to the last program", f"if done == {splits} - 1:", "    tl.debug_barrier()"]
                     + ["    " + line for line in unit_inits] + [f"    for s in range({splits}):"]
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
        a = self.unit_reduction(em, r, _tile_text(tile), f"tl.minimum({r.n_reduced} - start, {size}).to(tl.float64)",
                                f"{float(r.n_reduced)!r}", x=name)
        loop = [f"offs = start + tl.arange(0, {size})", f"mask = offs < {r.n_reduced}"] + em.lines + a.add
        slot = self.reduction_slot[node.index]
        body = (self.header(1) + loads + a.lanes + [f"for start in range(0, {r.n_reduced}, {size}):"]
                + ["    " + line for line in loop] + a.finish
                + [f"tl.store(reduced_ptr + {slot} + tl.arange(0, 1), ({a.result}).to(tl.float64))  # {node.name}"])
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
            body += [f"n_units = tl.load({table_part('n_units')})",
                     f"unit_numel = tl.load({table_part('unit_numel')})"]
        vec = 16 // ELEMENT_SIZE[self.g.grad_dtype]
        body += ["if ALIGNED:  # (for this kernel ALIGNED also means: every unit a multiple of 16 bytes)",
                 f"    unit_numel = tl.multiple_of(unit_numel.to(tl.int64), {vec})"]
        body += ["lane = tl.arange(0, UNITS * ELEMENTS)", "unit = pid * UNITS + lane // ELEMENTS",
                 "element = lane % ELEMENTS", "offs = unit * unit_numel + element",
                 "mask = (unit < n_units) & (element < unit_numel)"] + self.loads()
        tile = ("UNITS", "ELEMENTS", "True")
        n = "unit_numel.to(tl.float64)"
        for level in range(1, self.plan.levels + 1):
            group = [r for r in units.reductions if self.g.depth(r.node) == level]
            em.emit_nodes(cone(self.g, [r.node.args["input"] for r in group]))
            for r in group:
                a = self.unit_reduction(em, r, tile, n, n)
                em.lines += a.lanes + a.add + a.finish
                name = held[r.node.index] = f"b{r.node.index}"
                em.lines.append(f"{name} = to_lanes({from_merged(r.node, a.result)}, UNITS, ELEMENTS, True)")
        body += em.lines
        em.lines = []
        body += self.final_body(em, single=False, per_program="UNITS * unit_numel")
        return self.kernel(f"{KERNEL_NAME}_units{self.suffix}", self.signature(), body,
                           "all passes in one launch: each program holds UNITS whole units")



def write_units_kernels(plan: Plan, device_type: str) -> tuple[list[str], dict[str, dict[str, str]], LaunchSpec]:
    """The source lines of the kernels for `plan`, whose body reduces over dimensions (planned for one gradient shape),
    their signatures (kernel -> argument -> Triton type) and how to launch them: one kernel over whole units
    (`fused_hook_units`) when plan.units.one_pass, else per level a whole-tensor reduction pass (`reduce_level<l>`, if
    any) and one `reduce_units<l>_<k>` per reduced dims, then `fused_hook`, which reads the results by index. Each
    also comes as `..._multi`, for a bucket of gradients of that shape."""
    units = plan.units
    kernels, signatures, roles, names, fixed = [], {}, [], [], []
    for multi in (False, True):
        w = UnitsKernelWriter(plan, device_type, multi)
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
    n_reductions = len(w.reductions)
    fixed += [(name + "_multi", programs) for name, programs in fixed]
    spec = LaunchSpec(
        args=roles[0], multi_args=roles[1], kernels=tuple(names), single_kernels=tuple(names),
        multi_kernels=tuple(f"{name}_multi" for name in names), n_slots=len(plan.slots), n_reductions=n_reductions,
        partial_sets=max(len(plan.stat_sets), n_reductions),
        hist_sets=sum("hist" in names_ for _, names_ in plan.stat_sets), hist_pad=hist_pad(plan.hist_bins),
        fixed_grids=tuple(fixed), units_values=0 if units.one_pass else units.n_values, one_pass=units.one_pass,
        unit_partial_values=w.split_sizes()[0] if not units.one_pass else 0,
        unit_counter_values=w.split_sizes()[1] if not units.one_pass else 0)
    return kernels, signatures, spec


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
    """Accumulators per unit of a reduction over dimensions (see UnitsKernelWriter.unit_reduction)."""
    return {"var": 3, "std": 3, "max": 2, "min": 2, "absmax": 2}.get(reduction_spec(node).stat, 1)


def _tile_text(tile: dims.Tile) -> tuple[str, str, str]:
    return str(tile.units), str(tile.elements), str(tile.rows)
