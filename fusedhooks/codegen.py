"""A plan to Triton source text, and loading that source (cached on disk by content hash).

The generated kernel processes the gradient's storage span in blocks of BLOCK elements: it loads
the gradient (and the parameter), evaluates the body in fp32 (fp64 for float64), rounding every
fp16/bf16 intermediate as eager torch does, stores the result, and reduces statistics.
"""

from __future__ import annotations

import hashlib
import importlib.util
import math
import os
import re
import sys
import tempfile
from dataclasses import dataclass, field

import torch

from . import config, dims
from .ir import COMPARISONS, STAT_NAMES, Graph, Node, computes_in_operand_dtype, is_reduction, reduction_spec
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

_COMPUTE = {
    torch.float16: "tl.float32", torch.bfloat16: "tl.float32", torch.float32: "tl.float32",
    torch.float64: "tl.float64", torch.bool: "tl.int1", torch.int32: "tl.int32", torch.int64: "tl.int64",
}
_ROUND = {torch.float16: "round_to_fp16", torch.bfloat16: "round_to_bf16"}
_FLOAT_CT = ("tl.float32", "tl.float64")


def compute_type(dtype: torch.dtype) -> str:
    """The Triton type a value of torch `dtype` is carried in inside the kernel."""
    return _COMPUTE[dtype]


def _float_text(v: float) -> str:
    """A Python float as source text (inf and nan have no literal)."""
    return repr(v) if math.isfinite(v) else f'float("{v}")'


def split_exponent(e: float) -> tuple[float, float]:
    """(hi, lo) with hi + lo == e exactly and at most 27 significant bits in each; (0.0, 0.0) for an infinite
    or NaN e. `pow_scalar` (kernels/elementwise.py) multiplies each by an integer of at most 11 bits, exactly."""
    if not math.isfinite(e):
        return 0.0, 0.0
    mantissa, exp = math.frexp(e)
    hi = math.ldexp(float(math.trunc(mantissa * 2.0**26)), exp - 26)  # |hi| <= |e|: never overflows
    return hi, e - hi


def literal(value, ctype: str) -> str:
    """A Python number as a Triton expression of type `ctype`."""
    if ctype == "tl.int1":
        return f"tl.full([], {int(bool(value))}, tl.int1)"
    if ctype in ("tl.int32", "tl.int64"):  # wrapped to the type's width, as torch converts a Python int
        bits = 32 if ctype == "tl.int32" else 64
        return f"tl.full([], {(int(value) + 2 ** (bits - 1)) % 2 ** bits - 2 ** (bits - 1)}, {ctype})"
    v = float(value)
    if v == 0.0 and math.copysign(1.0, v) < 0:
        return full("[]", v, ctype)
    text = _float_text(v)
    return text if ctype == "tl.float32" and math.isfinite(v) else f"tl.full([], {text}, {ctype})"


def full(shape: str, value, ctype: str) -> str:
    """`tl.full(shape, value, ctype)` as source. A float -0.0 is built from its bits: triton 3.6 makes every scalar
    constant equal to 0 a +0.0 (semantic.scalar_constant), on the GPU and in the interpreter."""
    if ctype in _FLOAT_CT and float(value) == 0.0 and math.copysign(1.0, float(value)) < 0:
        bits, ints = ("0x8000000000000000", "tl.uint64") if ctype == "tl.float64" else ("0x80000000", "tl.uint32")
        return f"tl.full({shape}, {bits}, {ints}).to({ctype}, bitcast=True)"
    return f"tl.full({shape}, {_fill_value(value, ctype)}, {ctype})"


def _convert(expr: str, src: str, dst: str) -> str:
    """Convert an expression between compute types (bool conversions as torch does them)."""
    if src == dst:
        return expr
    if dst == "tl.int1":
        return f"({expr} != 0)"
    return f"{expr}.to({dst})"


class _Emitter:
    def __init__(self, plan: Plan, device_type: str):
        self.plan = plan
        self.graph = plan.graph
        self.device_type = device_type
        #: CUDA's own math library (what torch's CUDA kernels call: expf, logf, rsqrtf, powf) for transcendentals;
        #: the interpreter has no libdevice, so interpreted kernels use tl's (on CUDA tensors too)
        self.libdevice = device_type == "cuda" and not config.triton_interpret()
        self.lines: list[str] = []
        self.names: dict[int, str] = {}
        #: lanes of the kernel's block (a name or a number), for values built from nothing (fills)
        self.block = "BLOCK"

    def value(self, node: Node, ctype: str) -> str:
        """`node` as an expression of compute type `ctype`."""
        if node.kind == "const":
            return literal(node.value, ctype)
        return _convert(self.names[node.index], compute_type(node.dtype), ctype)

    def truth(self, node: Node) -> str:
        return self.value(node, "tl.int1")

    def operand(self, n: Node, key: str, ct: str) -> str:
        """Argument `key` of `n` in compute type `ct`; a scalar operand of a half-precision op is first
        rounded to that precision where eager torch on this device does so (see `_rounds_scalar`)."""
        arg = n.args[key]
        half = n.op_dtype if n.op_dtype in _ROUND else None
        if half is None or arg.full or not _rounds_scalar(n.op, key, arg.kind, self.device_type):
            return self.value(arg, ct)
        if arg.kind == "const":
            return literal(torch.tensor(float(arg.value)).to(half).item(), ct)
        return f"{_ROUND[half]}({self.value(arg, ct)})"

    def rounded(self, expr: str, dtype: torch.dtype) -> str:
        """`expr` rounded to `dtype` if that is a half-precision type (each eager op rounds its result)."""
        return f"{_ROUND[dtype]}({expr})" if dtype in _ROUND else expr

    def op(self, n: Node) -> str:
        a, op = n.args, n.op
        ct = compute_type(n.op_dtype)
        v = lambda key: self.operand(n, key, ct)
        is_float = ct in _FLOAT_CT
        if op == "div" and a["input"].kind == "const":
            # `c / x` is Tensor.__rtruediv__: torch computes x.reciprocal() * c, rounding in between
            one = "tl.math.div_rn(1.0, {})" if ct == "tl.float32" else "1.0 / {}"
            recip = self.rounded(one.format(self.value(a["other"], ct)), n.op_dtype)
            return f"{recip} * {v('input')}"
        if op in ("add", "sub"):
            sign = "+" if op == "add" else "-"
            if a["alpha"] == 1:
                return f"{v('input')} {sign} {v('other')}"
            alpha = a["alpha"] if op == "add" else -a["alpha"]
            return f"tl.fma({v('other')}, {literal(alpha, ct)}, {v('input')})"
        if op == "mul":
            return f"{v('input')} * {v('other')}"
        if op == "div":
            other = a["other"]
            if self.device_type == "cuda" and other.kind == "const" and ct in _FLOAT_CT:
                # torch's CUDA kernel (div_true_kernel_cuda) multiplies by the reciprocal of a Python-number
                # divisor, computed in the op's math type (fp32 for fp32/fp16/bf16, fp64 for fp64)
                divisor = torch.tensor(float(other.value), dtype=torch.float64 if ct == "tl.float64" else None)
                return f"{v('input')} * {literal((1.0 / divisor).item(), ct)}"
            if ct == "tl.float32":
                return f"tl.math.div_rn({v('input')}, {v('other')})"
            return f"{v('input')} / {v('other')}"
        if op == "neg":  # triton 3.6 compiles -x as 0 - x, which leaves +0.0 positive
            return f"negate({v('input')})" if is_float else f"-{v('input')}"
        if op == "abs":
            return f"tl.abs({v('input')})"
        if op == "sign":
            x = v("input")
            return f"tl.where({x} > 0, {literal(1, ct)}, tl.where({x} < 0, {literal(-1, ct)}, {literal(0, ct)}))"
        if op == "sqrt":
            return f"tl.math.sqrt_rn({v('input')})" if ct == "tl.float32" else f"tl.sqrt({v('input')})"
        if op == "rsqrt":
            return self.rsqrt(v("input"), ct)
        if op in ("exp", "log"):
            return f"{'libdevice' if self.libdevice else 'tl'}.{op}({v('input')})"
        if op == "reciprocal":
            return f"tl.math.div_rn(1.0, {v('input')})" if ct == "tl.float32" else f"1.0 / {v('input')}"
        if op == "square":
            return f"{v('input')} * {v('input')}"
        if op == "pow":
            return self.pow(v("input"), a["exponent"], ct, n.op_dtype)
        if op in ("clamp", "clamp_min", "clamp_max"):
            x = v("input")
            if a.get("min") is not None:
                x = self.select("max", x, v("min"), a["min"], is_float)
            if a.get("max") is not None:
                x = self.select("min", x, v("max"), a["max"], is_float)
            return x
        if op in ("maximum", "minimum"):
            return self.select(op[:3], v("input"), v("other"), a["other"], is_float)
        if op == "where":
            return f"tl.where({self.truth(a['condition'])}, {v('input')}, {v('other')})"
        if op in COMPARISONS:
            sym = {"eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}[op]
            return f"{v('input')} {sym} {v('other')}"
        if op.startswith("logical_"):
            if op == "logical_not":
                return f"{self.truth(a['input'])} == 0"
            sym = {"logical_and": "&", "logical_or": "|", "logical_xor": "^"}[op]
            return f"{self.truth(a['input'])} {sym} {self.truth(a['other'])}"
        if op.startswith("bitwise_"):
            if op == "bitwise_not":
                return f"{v('input')} == 0" if ct == "tl.int1" else f"~{v('input')}"
            sym = {"bitwise_and": "&", "bitwise_or": "|", "bitwise_xor": "^"}[op]
            return f"{v('input')} {sym} {v('other')}"
        if op in ("isnan", "isinf", "isfinite"):
            if not is_float:
                return literal(op == "isfinite", "tl.int1") + f" | ({v('input')} != {v('input')})"
            x = v("input")
            return {"isnan": f"{x} != {x}", "isinf": f'tl.abs({x}) == float("inf")',
                    "isfinite": f'tl.abs({x}) < float("inf")'}[op]
        if op == "nan_to_num":
            out = compute_type(n.dtype)
            info = torch.finfo(n.dtype)
            posinf = info.max if a["posinf"] is None else a["posinf"]
            neginf = info.min if a["neginf"] is None else a["neginf"]
            x = v("input")
            return (f"tl.where({x} != {x}, {literal(a['nan'], out)}, tl.where({x} == float(\"inf\"), "
                    f"{literal(posinf, out)}, tl.where({x} == float(\"-inf\"), {literal(neginf, out)}, {x})))")
        if op in ("zeros_like", "ones_like", "full_like", "fill", "zero"):
            value = {"zeros_like": 0, "ones_like": 1, "zero": 0}.get(op, a.get("fill_value", a.get("value")))
            return full(f"[{self.block}]", value, ct)
        if op == "copy":
            return self.value(a["src"], ct)
        if op in ("to", "unsqueeze"):  # unsqueeze: the same values, read where the dims put them (dims.input_map)
            return self.value(a["input"], ct)
        raise NotImplementedError(f"codegen has no rule for {op}")  # trace.py admits only ops with rules

    def rsqrt(self, x: str, ct: str) -> str:
        """1 / sqrt(x) as torch computes it on this device (the op and pow(x, -0.5) on CUDA)."""
        if self.libdevice:
            return f"libdevice.rsqrt({x})"
        if ct == "tl.float32":
            return f"tl.math.div_rn(1.0, tl.math.sqrt_rn({x}))"
        return f"1.0 / tl.sqrt({x})"

    def select(self, which: str, x: str, y: str, y_node: Node, is_float: bool) -> str:
        """max(x, y) or min(x, y) (`which`) as torch's `maximum`/`minimum(x, y)` and a lower/upper clamp bound y
        compute it: NaN if either is NaN, else y only where it is strictly beyond x, so x on a tie: -0.0 stays -0.0
        under clamp(min=0.0), and maximum(-0.0, 0.0) is -0.0. A select on comparisons gives the same bits on every
        device (tl.maximum/tl.minimum decide signed zeros and NaN differently in the interpreter and on the GPU).
        Zero ties are decided as torch's scalar code, its CUDA kernels and every CPU clamp with number bounds do;
        docs/supported-ops.md (Precision) names the vectorised CPU loops that return y instead."""
        if not is_float:
            return f"tl.{which}imum({x}, {y})"
        beyond = f"{y} > {x}" if which == "max" else f"{y} < {x}"
        if y_node.kind != "const":
            # nested, not `|`: an `|` with a 0-dim y (a scalar read) fails in the interpreter
            return f"tl.where({y} != {y}, {y}, tl.where({beyond}, {y}, {x}))"
        if math.isnan(float(y_node.value)):
            return f"tl.where({x} == {x}, {y}, {x})"  # NaN everywhere (torch fills NaN for a NaN bound)
        return f"tl.where({beyond}, {y}, {x})"

    def pow(self, x: str, e, ct: str, dtype: torch.dtype) -> str:
        """x ** e (a compile-time exponent) as torch's pow_tensor_scalar kernel on this device computes it.

        On CPU, torch rounds the exponent to fp16/bf16 for those dtypes; float16 goes through C pow
        for every exponent (so (-0.0) ** 0.5 is +0.0); bfloat16 computes x**3 and x**-2 in bf16 steps.
        On CUDA: see `pow_cuda`.
        """
        e = float(e)
        if self.device_type == "cuda":
            return self.pow_cuda(x, e, ct, dtype)
        div = (lambda p, q: f"tl.math.div_rn({p}, {q})") if ct == "tl.float32" else (lambda p, q: f"{p} / {q}")
        sqrt = "tl.math.sqrt_rn" if ct == "tl.float32" else "tl.sqrt"
        cpu_half = dtype if dtype in _ROUND else None
        if cpu_half is torch.float16 or (cpu_half is torch.bfloat16 and e not in (0.5, -0.5, -1.0)):
            e = torch.tensor(e).to(cpu_half).item()
        square = self.rounded(f"{x} * {x}", dtype) if cpu_half is torch.bfloat16 else f"({x} * {x})"
        root = f"{sqrt}({x})"
        if cpu_half is torch.float16:  # C pow: (-0.0) ** 0.5 == +0.0 and (-inf) ** 0.5 == +inf
            root = f'tl.where({x} == float("-inf"), float("inf"), {sqrt}({x}) + 0.0)'
        special = {0.0: f"tl.full([{self.block}], 1.0, {ct})", 1.0: x, 2.0: f"{x} * {x}", 3.0: f"{square} * {x}",
                   0.5: root, -0.5: div("1.0", root), -1.0: div("1.0", x), -2.0: div("1.0", square)}
        if e in special:
            return special[e]
        return self.pow_general(x, e, ct)

    def pow_cuda(self, x: str, e: float, ct: str, dtype: torch.dtype) -> str:
        """x ** e as torch's CUDA kernel (PowKernel.cu; measured on an H200, torch 2.11): 0.5, -0.5 and -1 go to the
        sqrt, rsqrt and reciprocal kernels; any other exponent is first rounded to the tensor's dtype, then 2, 3 and -2
        are computed as base * base (* base), 1.0 / (base * base) in the dtype's own arithmetic (fp16/bf16 round
        after each multiply; the division is in double), the rest by C pow (powf/pow)."""
        if e == 0.5:
            return f"tl.math.sqrt_rn({x})" if ct == "tl.float32" else f"tl.sqrt({x})"
        if e == -0.5:
            return self.rsqrt(x, ct)
        if e == -1.0:
            return f"tl.math.div_rn(1.0, {x})" if ct == "tl.float32" else f"1.0 / {x}"
        if dtype != torch.float64:
            e = torch.tensor(e).to(dtype if dtype in _ROUND else torch.float32).item()
        square = self.rounded(f"{x} * {x}", dtype)
        if e == 0.0:
            return f"tl.full([{self.block}], 1.0, {ct})"
        if e == 1.0:
            return x
        if e == 2.0:
            return f"{x} * {x}"
        if e == 3.0:
            return f"{square} * {x}"
        if e == -2.0:
            return f"1.0 / ({square})" if ct == "tl.float64" else f"(1.0 / ({square}).to(tl.float64)).to({ct})"
        if self.libdevice:
            return f"libdevice.pow({x}, tl.full([], {_float_text(e)}, {ct}))"
        return self.pow_general(x, e, ct)

    def pow_general(self, x: str, e: float, ct: str) -> str:
        """x ** e by C pow's rules (kernels/elementwise.py's pow_scalar), for an exponent with no special case."""
        is_int = e.is_integer() or math.isinf(e)  # C pow treats +-inf as an even integer: (-2) ** inf == inf
        odd = e.is_integer() and int(e) % 2 == 1
        hi, lo = split_exponent(e)
        split = math.isfinite(e) and ct == "tl.float64"  # fp32 needs no more than exp2/log2 in fp64 (pow_scalar)
        return f"pow_scalar({x}, {_float_text(e)}, {is_int}, {odd}, {split}, {hi!r}, {lo!r})"

    def expression(self, n: Node) -> str:
        """The expression of an "op" or "scalar" node, from the names of its inputs."""
        if n.kind == "scalar":
            return _widen(f"tl.load(scalar{n.value}_ptr)", n.dtype)
        expr = self.op(n)
        result_ct = compute_type(n.dtype)
        op_ct = compute_type(n.op_dtype)
        if op_ct != result_ct and not computes_in_operand_dtype(n.op):
            expr = _convert(f"({expr})", op_ct, result_ct)
        if n.dtype in _ROUND:
            expr = f"{_ROUND[n.dtype]}({expr})"
        return expr

    def emit_nodes(self, nodes: list[Node]) -> None:
        """Emit a line for each node not emitted yet (reductions must already have a name)."""
        for n in nodes:
            if n.kind == "const" or n.index in self.names:
                continue
            if n.kind in ("grad", "param"):
                self.names[n.index] = n.kind
                continue
            self.lines.append(f"{n.name} = {self.expression(n)}")
            self.names[n.index] = n.name

    def result_value(self, ct: str) -> str:
        """The body's result as an expression of compute type `ct` (a scalar result is broadcast by the caller)."""
        r = self.graph.result
        return self.value(r, ct) if r.kind != "const" else literal(r.value, ct)


class _UnitsEmitter(_Emitter):
    """An emitter for a body that reduces over dimensions (see fusedhooks.dims): a value shaped like the gradient
    reads a value reduced over dimensions where it broadcasts it, through `read(reduction, map)` (a gather from the
    units workspace, or a value the program holds); other such values are computed at each read (`at`)."""

    def __init__(self, plan: Plan, device_type: str, units: dims.Units, read):
        super().__init__(plan, device_type)
        self.units, self.read = units, read
        self.shape = units.shape
        self.at_names: dict[tuple, str] = {}
        self.index_names: dict[int, str] = {}

    def grad_index(self, d: int) -> str:
        """The index along gradient dim `d` of each lane (from `offs`)."""
        if d not in self.index_names:
            offs = "offs"
            if math.prod(self.shape) < 2**31:  # int32 index arithmetic: fewer registers than int64
                offs = "offs32"
                if not self.index_names:
                    self.lines.append("offs32 = offs.to(tl.int32)")
            stride = dims.row_major_strides(self.shape)[d]
            expr = f"{offs} // {stride}" if stride > 1 else offs
            if d > 0:
                expr = f"({expr}) % {self.shape[d]}"
            self.lines.append(f"j{d} = {expr}")
            self.index_names[d] = f"j{d}"
        return self.index_names[d]

    def unit_index(self, r: dims.UnitReduction, m: tuple) -> str:
        """The slot (from r.offset) of the unit of `r` a read with map `m` reads, for each lane."""
        strides = dims.row_major_strides(r.node.shape)
        terms = [f"{self.grad_index(m[e])} * {strides[e]}" if strides[e] > 1 else self.grad_index(m[e])
                 for e, s in enumerate(r.node.shape) if s > 1 and m[e] is not None and self.shape[m[e]] > 1]
        return " + ".join(terms) if terms else "offs * 0"

    def at(self, node: Node, m: tuple) -> str:
        """The name of units value `node` read with map `m` (emitted once per map)."""
        key = (node.index, m)
        if key not in self.at_names:
            if dims.is_dim_reduction(node):
                name = self.read(self, self.units.of(node), m)
            else:
                self.emit_nodes([i for i in node.inputs() if not dims.is_units_value(i)])
                bound = {i.index: self.at(i, dims.input_map(node, m, i)) for i in node.inputs()
                         if dims.is_units_value(i)}
                self.names.update(bound)
                name = f"{node.name}_{len(self.at_names)}"
                self.lines.append(f"{name} = {self.expression(node)}")
                for index in bound:
                    del self.names[index]
            self.at_names[key] = name
        return self.at_names[key]

    def emit_nodes(self, nodes: list[Node]) -> None:
        for n in nodes:
            if n.kind == "const" or n.index in self.names or dims.is_units_value(n):
                continue  # units values: computed where a value shaped like the gradient reads them
            units_inputs = [i for i in n.inputs() if dims.is_units_value(i)]
            if not units_inputs:
                super().emit_nodes([n])
                continue
            self.emit_nodes([i for i in n.inputs() if not dims.is_units_value(i)])
            full = dims.full_map(self.shape)
            bound = {i.index: self.at(i, dims.input_map(n, full, i)) for i in units_inputs}
            self.names.update(bound)
            super().emit_nodes([n])
            for index in bound:
                del self.names[index]

    def result_value(self, ct: str) -> str:
        r = self.graph.result
        if not dims.is_units_value(r):
            return super().result_value(ct)
        name = self.at(r, dims.input_map(dims.Broadcast(self.shape), dims.full_map(self.shape), r))
        return _convert(name, compute_type(r.dtype), ct)


def _rounds_scalar(op: str, key: str, kind: str, device_type: str) -> bool:
    """Does eager torch round scalar operand `key` ("const": a Python number, "scalar": a 0-dim tensor)
    of a half-precision `op` to the op's dtype before computing?

    CPU (measured, torch 2.13): add/sub and comparisons round it; mul/div use the fp32 value when the
    scalar is the second operand (TensorIterator's scalar fast path), and round a first-operand tensor.
    CUDA (from torch's source, gpu_kernel_with_scalars): Python numbers stay fp32; a 0-dim CUDA tensor
    is an ordinary operand, cast to the common dtype.
    """
    if op not in ("add", "sub", "mul", "div") + COMPARISONS:
        return False
    if device_type == "cuda":
        return kind == "scalar"
    if op in ("mul", "div"):
        return kind == "scalar" and key == "input"
    return True


def _fill_value(value, ct: str) -> str:
    if ct == "tl.int1":
        return str(int(bool(value)))
    if ct in ("tl.int32", "tl.int64"):
        return str(int(value))
    return _float_text(float(value))


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
        lines = [f"grad = {_widen('tl.load(grad_ptr + offs, mask=mask, other=0)', g.grad_dtype)}"]
        if self.plan.amp:
            # as torch._amp_foreach_non_finite_check_and_unscale_: grad * fp32(1 / fp64(scale))
            inv = "(1.0 / tl.load(scale_ptr).to(tl.float64)).to(tl.float32)"
            if ct != "tl.float32":
                inv += f".to({ct})"
            lines += ["scaled = grad", f"inv_scale = {inv}",
                      f"grad = {_rounded_expr('scaled * inv_scale', g.grad_dtype)}"]
        if g.uses_param:
            lines.append(f"param = {_widen('tl.load(param_ptr + offs, mask=mask, other=0)', g.grad_dtype)}")
        return lines

    def emitter(self, available: dict[int, str], read=None) -> _Emitter:
        """An emitter that knows the `available` names; for a body reducing over dimensions, one reading their
        results with `read` (default: gathers from units_ptr)."""
        if self.units is None:
            em = _Emitter(self.plan, self.device_type)
        else:
            em = _UnitsEmitter(self.plan, self.device_type, self.units, read or self.gather)
        em.names.update(available)
        return em

    def gather(self, em: _UnitsEmitter, r: dims.UnitReduction, m: tuple) -> str:
        """Read the result of reduction `r` of each lane's unit (map `m`) from the units workspace."""
        name = f"u{r.node.index}_{len(em.at_names)}"
        loaded = f"tl.load({_units_slots(r)} + ({em.unit_index(r, m)}), mask=mask, other=0)"
        ct = compute_type(r.node.dtype)
        em.lines.append(f"{name} = {f'({loaded} != 0)' if ct == 'tl.int1' else _convert(loaded, _units_type(r), ct)}")
        return name

    def set_value(self, em: _Emitter, node: Node, of_abs: bool) -> str:
        x = em.names[node.index] if node.kind != "const" else literal(node.value, "tl.float32")
        src = compute_type(node.dtype) if node.kind != "const" else "tl.float32"
        if src not in _FLOAT_CT:
            x = f"{x}.to(tl.float32)"
        return f"tl.abs({x})" if of_abs else x

    def reduction_sets(self, em: _Emitter, level: int, action) -> list[_ReductionSet]:
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

    def final_body(self, em: _Emitter, single: bool, per_program: str = "BLOCK") -> list[str]:
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
            if g.grad_dtype in _ROUND and r.dtype != g.grad_dtype:
                expr = f"{_ROUND[g.grad_dtype]}({expr})"
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

    def unit_reduction(self, em: _Emitter, r: dims.UnitReduction, tile: tuple[str, str, str], count: str, n: str,
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
        em = _UnitsEmitter(self.plan, self.device_type, dims.Units(x.shape, self.units.dtype, self.units.reductions,
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
    return _rounded_expr(f"({value}).to({ct})", node.dtype)


def _from_reduced(node: Node, loaded: str) -> str:
    """A reduction result stored as fp64 in reduced_ptr, as a value of `node`'s dtype."""
    if compute_type(node.dtype) == "tl.int1":
        return f"({loaded} != 0)"
    return _from_merged(node, loaded)


def _widen(loaded: str, dtype: torch.dtype) -> str:
    """A loaded value of torch `dtype` in its compute type (bf16 through bits, exact everywhere)."""
    if dtype == torch.bfloat16:
        return f"bf16_to_fp32({loaded})"
    ct = compute_type(dtype)
    return f"{loaded}.to({ct})" if ct in _FLOAT_CT else loaded


def _rounded_expr(expr: str, dtype: torch.dtype) -> str:
    return f"{_ROUND[dtype]}({expr})" if dtype in _ROUND else expr


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
