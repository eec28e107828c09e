"""Triton expressions for the IR's values and ops, each as eager torch computes it on the device the kernel is for.

`Emitter` turns a traced body's nodes into lines of Triton source (one name per node); `UnitsEmitter` does the same
for a body that reduces over dimensions. The rules that differ by device live here: torch's CPU and CUDA kernels
round scalar operands, divide by Python numbers, raise to powers and compute transcendentals differently, and the
generated source follows the device it is for (measured on CPU with torch 2.13 and on an H200 with torch 2.11).
kernel_writer.py and units_kernels.py assemble these expressions into kernels (generate.py: the whole source).
"""

from __future__ import annotations

import math

import torch

from .. import config
from ..compiler import dims
from ..compiler.ir import COMPARISONS, Node, computes_in_operand_dtype
from ..compiler.plan import Plan

COMPUTE_TYPES = {
    torch.float16: "tl.float32", torch.bfloat16: "tl.float32", torch.float32: "tl.float32",
    torch.float64: "tl.float64", torch.bool: "tl.int1", torch.int32: "tl.int32", torch.int64: "tl.int64",
}
ROUND = {torch.float16: "round_to_fp16", torch.bfloat16: "round_to_bf16"}
FLOAT_CT = ("tl.float32", "tl.float64")


def compute_type(dtype: torch.dtype) -> str:
    """The Triton type a value of torch `dtype` is carried in inside the kernel."""
    return COMPUTE_TYPES[dtype]


def float_text(v: float) -> str:
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
    text = float_text(v)
    return text if ctype == "tl.float32" and math.isfinite(v) else f"tl.full([], {text}, {ctype})"


def full(shape: str, value, ctype: str) -> str:
    """`tl.full(shape, value, ctype)` as source. A float -0.0 is built from its bits: triton 3.6 makes every scalar
    constant equal to 0 a +0.0 (semantic.scalar_constant), on the GPU and in the interpreter."""
    if ctype in FLOAT_CT and float(value) == 0.0 and math.copysign(1.0, float(value)) < 0:
        bits, ints = ("0x8000000000000000", "tl.uint64") if ctype == "tl.float64" else ("0x80000000", "tl.uint32")
        return f"tl.full({shape}, {bits}, {ints}).to({ctype}, bitcast=True)"
    return f"tl.full({shape}, {fill_value(value, ctype)}, {ctype})"


def rounded(expr: str, dtype: torch.dtype) -> str:
    """`expr` rounded to `dtype` if that is a half-precision type (each eager op rounds its result)."""
    return f"{ROUND[dtype]}({expr})" if dtype in ROUND else expr


def divide(p: str, q: str, ct: str) -> str:
    """p / q correctly rounded in compute type `ct`: on a GPU, fp32 `/` is the fast approximate instruction."""
    return f"tl.math.div_rn({p}, {q})" if ct == "tl.float32" else f"{p} / {q}"


def sqrt(x: str, ct: str) -> str:
    """sqrt(x) correctly rounded in compute type `ct`, as torch's (fp32 `tl.sqrt` is approximate on a GPU)."""
    return f"tl.math.sqrt_rn({x})" if ct == "tl.float32" else f"tl.sqrt({x})"


def convert(expr: str, src: str, dst: str) -> str:
    """Convert an expression between compute types (bool conversions as torch does them)."""
    if src == dst:
        return expr
    if dst == "tl.int1":
        return f"({expr} != 0)"
    return f"{expr}.to({dst})"


class Emitter:
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
        return convert(self.names[node.index], compute_type(node.dtype), ctype)

    def truth(self, node: Node) -> str:
        return self.value(node, "tl.int1")

    def operand(self, n: Node, key: str, ct: str) -> str:
        """Argument `key` of `n` in compute type `ct`; a scalar operand of a half-precision op is first
        rounded to that precision where eager torch on this device does so (see `_rounds_scalar`)."""
        arg = n.args[key]
        half = n.op_dtype if n.op_dtype in ROUND else None
        if half is None or arg.full or not _rounds_scalar(n.op, key, arg.kind, self.device_type):
            return self.value(arg, ct)
        if arg.kind == "const":
            return literal(torch.tensor(float(arg.value)).to(half).item(), ct)
        return f"{ROUND[half]}({self.value(arg, ct)})"

    def op(self, n: Node) -> str:
        a, op = n.args, n.op
        ct = compute_type(n.op_dtype)
        v = lambda key: self.operand(n, key, ct)
        is_float = ct in FLOAT_CT
        if op == "div" and a["input"].kind == "const":
            # `c / x` is Tensor.__rtruediv__: torch computes x.reciprocal() * c, rounding in between
            recip = rounded(divide("1.0", self.value(a["other"], ct), ct), n.op_dtype)
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
            if self.device_type == "cuda" and other.kind == "const" and ct in FLOAT_CT:
                # torch's CUDA kernel (div_true_kernel_cuda) multiplies by the reciprocal of a Python-number
                # divisor, computed in the op's math type (fp32 for fp32/fp16/bf16, fp64 for fp64)
                divisor = torch.tensor(float(other.value), dtype=torch.float64 if ct == "tl.float64" else None)
                return f"{v('input')} * {literal((1.0 / divisor).item(), ct)}"
            return divide(v("input"), v("other"), ct)
        if op == "neg":  # triton 3.6 compiles -x as 0 - x, which leaves +0.0 positive
            return f"negate({v('input')})" if is_float else f"-{v('input')}"
        if op == "abs":
            return f"tl.abs({v('input')})"
        if op == "sign":
            x = v("input")
            return f"tl.where({x} > 0, {literal(1, ct)}, tl.where({x} < 0, {literal(-1, ct)}, {literal(0, ct)}))"
        if op == "sqrt":
            return sqrt(v("input"), ct)
        if op == "rsqrt":
            return self.rsqrt(v("input"), ct)
        if op in ("exp", "log"):
            return f"{'libdevice' if self.libdevice else 'tl'}.{op}({v('input')})"
        if op == "reciprocal":
            return divide("1.0", v("input"), ct)
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
        return divide("1.0", sqrt(x, ct), ct)

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
        cpu_half = dtype if dtype in ROUND else None
        if cpu_half is torch.float16 or (cpu_half is torch.bfloat16 and e not in (0.5, -0.5, -1.0)):
            e = torch.tensor(e).to(cpu_half).item()
        square = rounded(f"{x} * {x}", dtype) if cpu_half is torch.bfloat16 else f"({x} * {x})"
        root = sqrt(x, ct)
        if cpu_half is torch.float16:  # C pow: (-0.0) ** 0.5 == +0.0 and (-inf) ** 0.5 == +inf
            root = f'tl.where({x} == float("-inf"), float("inf"), {root} + 0.0)'
        special = {0.0: full(f"[{self.block}]", 1.0, ct), 1.0: x, 2.0: f"{x} * {x}", 3.0: f"{square} * {x}",
                   0.5: root, -0.5: divide("1.0", root, ct), -1.0: divide("1.0", x, ct),
                   -2.0: divide("1.0", square, ct)}
        if e in special:
            return special[e]
        return self.pow_general(x, e, ct)

    def pow_cuda(self, x: str, e: float, ct: str, dtype: torch.dtype) -> str:
        """x ** e as torch's CUDA kernel (PowKernel.cu; measured on an H200, torch 2.11): 0.5, -0.5 and -1 go to the
        sqrt, rsqrt and reciprocal kernels; any other exponent is first rounded to the tensor's dtype, then 2, 3 and -2
        are computed as base * base (* base), 1.0 / (base * base) in the dtype's own arithmetic (fp16/bf16 round
        after each multiply; the division is in double), the rest by C pow (powf/pow)."""
        if e == 0.5:
            return sqrt(x, ct)
        if e == -0.5:
            return self.rsqrt(x, ct)
        if e == -1.0:
            return divide("1.0", x, ct)
        if dtype != torch.float64:
            e = torch.tensor(e).to(dtype if dtype in ROUND else torch.float32).item()
        square = rounded(f"{x} * {x}", dtype)
        if e == 0.0:
            return full(f"[{self.block}]", 1.0, ct)
        if e == 1.0:
            return x
        if e == 2.0:
            return f"{x} * {x}"
        if e == 3.0:
            return f"{square} * {x}"
        if e == -2.0:
            return f"1.0 / ({square})" if ct == "tl.float64" else f"(1.0 / ({square}).to(tl.float64)).to({ct})"
        if self.libdevice:
            return f"libdevice.pow({x}, tl.full([], {float_text(e)}, {ct}))"
        return self.pow_general(x, e, ct)

    def pow_general(self, x: str, e: float, ct: str) -> str:
        """x ** e by C pow's rules (kernels/elementwise.py's pow_scalar), for an exponent with no special case."""
        is_int = e.is_integer() or math.isinf(e)  # C pow treats +-inf as an even integer: (-2) ** inf == inf
        odd = e.is_integer() and int(e) % 2 == 1
        hi, lo = split_exponent(e)
        split = math.isfinite(e) and ct == "tl.float64"  # fp32 needs no more than exp2/log2 in fp64 (pow_scalar)
        return f"pow_scalar({x}, {float_text(e)}, {is_int}, {odd}, {split}, {hi!r}, {lo!r})"

    def expression(self, n: Node) -> str:
        """The expression of an "op" or "scalar" node, from the names of its inputs."""
        if n.kind == "scalar":
            return widen(f"tl.load(scalar{n.value}_ptr)", n.dtype)
        expr = self.op(n)
        result_ct = compute_type(n.dtype)
        op_ct = compute_type(n.op_dtype)
        if op_ct != result_ct and not computes_in_operand_dtype(n.op):
            expr = convert(f"({expr})", op_ct, result_ct)
        return rounded(expr, n.dtype)

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


class UnitsEmitter(Emitter):
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
        return convert(name, compute_type(r.dtype), ct)


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


def fill_value(value, ct: str) -> str:
    if ct == "tl.int1":
        return str(int(bool(value)))
    if ct in ("tl.int32", "tl.int64"):
        return str(int(value))
    return float_text(float(value))


def widen(loaded: str, dtype: torch.dtype) -> str:
    """A loaded value of torch `dtype` in its compute type (bf16 through bits, exact everywhere)."""
    if dtype == torch.bfloat16:
        return f"bf16_to_fp32({loaded})"
    ct = compute_type(dtype)
    return f"{loaded}.to({ct})" if ct in FLOAT_CT else loaded
