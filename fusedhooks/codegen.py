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
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .ir import COMPARISONS, STAT_NAMES, Graph, Node, computes_in_operand_dtype, is_reduction, reduction_spec
from .plan import PARTIAL_FLAGS, Plan, partial_flags

KERNEL_NAME = "fused_hook"
#: fp64 values in a row of partial statistics (kernels.stats.N_PARTIALS)
PARTIAL_WIDTH = 8
#: The bucket table's per-tensor parts, in order, each n_tensors int64s; then (tensor, block) per program.
TABLE_PARTS = ("grad", "param", "numel", "blocks", "stats_offset", "partials_offset")


@dataclass(frozen=True)
class LaunchSpec:
    """How to launch the kernels generated for a plan; `generate_with_spec` returns it with their source, and
    the runtime, tune and clip only read it.

    args / multi_args: the role of each argument of the single-tensor / bucket (`..._multi`) kernels, in order:
    "grad", "param" (pointers to the spans), "scalar<i>" (closed-over 0-dim tensors), "scale", "found_inf"
    (AMP), "reduced" (fp64 [n_reductions] per tensor), "stats" (the row, or the whole buffer for a bucket),
    "partials" (fp64 [programs, partial_sets, PARTIAL_WIDTH]), "counter" (int32, one per tensor), "hist"
    (int32 [hist_sets, hist_pad] per tensor), "numel", "table" (int64, TABLE_PARTS then programs),
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

    def kernels_for(self, grid: int) -> tuple[str, ...]:
        """The kernels to launch, in order, for one gradient on a grid of `grid` programs."""
        return self.single_kernels if grid == 1 else self.kernels

    @property
    def uses_workspace(self) -> bool:
        return "partials" in self.args

    def partial_values(self, programs: int) -> int:
        """fp64 values of partials `programs` programs write."""
        return programs * self.partial_sets * PARTIAL_WIDTH

    @property
    def hist_values(self) -> int:
        """int32 histogram accumulators per tensor."""
        return self.hist_sets * self.hist_pad

_COMPUTE = {
    torch.float16: "tl.float32", torch.bfloat16: "tl.float32", torch.float32: "tl.float32",
    torch.float64: "tl.float64", torch.bool: "tl.int1", torch.int32: "tl.int32", torch.int64: "tl.int64",
}
_ROUND = {torch.float16: "round_to_fp16", torch.bfloat16: "round_to_bf16"}
_FLOAT_CT = ("tl.float32", "tl.float64")
_NAN_ALL = "propagate_nan=tl.PropagateNan.ALL"


def compute_type(dtype: torch.dtype) -> str:
    """The Triton type a value of torch `dtype` is carried in inside the kernel."""
    return _COMPUTE[dtype]


def _float_text(v: float) -> str:
    """A Python float as source text (inf and nan have no literal)."""
    return repr(v) if math.isfinite(v) else f'float("{v}")'


def literal(value, ctype: str) -> str:
    """A Python number as a Triton expression of type `ctype`."""
    if ctype == "tl.int1":
        return f"tl.full([], {int(bool(value))}, tl.int1)"
    if ctype in ("tl.int32", "tl.int64"):
        return f"tl.full([], {int(value)}, {ctype})"
    v = float(value)
    text = _float_text(v)
    return text if ctype == "tl.float32" and math.isfinite(v) else f"tl.full([], {text}, {ctype})"


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
        self.lines: list[str] = []
        self.names: dict[int, str] = {}

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
            if ct == "tl.float32":
                if self.device_type == "cuda" and other.kind == "const":
                    # torch's CUDA kernel multiplies by the fp32 reciprocal of a Python-number divisor
                    recip = (torch.tensor(1.0) / torch.tensor(float(other.value))).item()
                    return f"{v('input')} * {literal(recip, ct)}"
                return f"tl.math.div_rn({v('input')}, {v('other')})"
            return f"{v('input')} / {v('other')}"
        if op == "neg":
            return f"-{v('input')}"
        if op == "abs":
            return f"tl.abs({v('input')})"
        if op == "sign":
            x = v("input")
            return f"tl.where({x} > 0, {literal(1, ct)}, tl.where({x} < 0, {literal(-1, ct)}, {literal(0, ct)}))"
        if op == "sqrt":
            return f"tl.math.sqrt_rn({v('input')})" if ct == "tl.float32" else f"tl.sqrt({v('input')})"
        if op == "rsqrt":
            if ct == "tl.float32":
                return f"tl.math.div_rn(1.0, tl.math.sqrt_rn({v('input')}))"
            return f"1.0 / tl.sqrt({v('input')})"
        if op in ("exp", "log"):
            return f"tl.{op}({v('input')})"
        if op == "reciprocal":
            return f"tl.math.div_rn(1.0, {v('input')})" if ct == "tl.float32" else f"1.0 / {v('input')}"
        if op == "square":
            return f"{v('input')} * {v('input')}"
        if op == "pow":
            return self.pow(v("input"), a["exponent"], ct, n.op_dtype)
        if op in ("clamp", "clamp_min", "clamp_max"):
            x = v("input")
            nan = f", {_NAN_ALL}" if is_float else ""
            if a.get("min") is not None:
                x = f"tl.maximum({x}, {v('min')}{nan})"
            if a.get("max") is not None:
                x = f"tl.minimum({x}, {v('max')}{nan})"
            return x
        if op in ("minimum", "maximum"):
            nan = f", {_NAN_ALL}" if is_float else ""
            return f"tl.{op}({v('input')}, {v('other')}{nan})"
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
            return f"tl.full([BLOCK], {_fill_value(value, ct)}, {ct})"
        if op == "copy":
            return self.value(a["src"], ct)
        if op == "to":
            return self.value(a["input"], ct)
        raise NotImplementedError(f"codegen has no rule for {op}")  # trace.py admits only ops with rules

    def pow(self, x: str, e, ct: str, dtype: torch.dtype) -> str:
        """x ** e (a compile-time exponent) as torch's pow_tensor_scalar kernel computes it.

        On CPU, torch rounds the exponent to fp16/bf16 for those dtypes; float16 goes through C pow
        for every exponent (so (-0.0) ** 0.5 is +0.0); bfloat16 computes x**3 and x**-2 in bf16 steps.
        On CUDA every dtype follows the float32 rules (from torch's source; not yet measured).
        """
        e = float(e)
        div = (lambda p, q: f"tl.math.div_rn({p}, {q})") if ct == "tl.float32" else (lambda p, q: f"{p} / {q}")
        sqrt = "tl.math.sqrt_rn" if ct == "tl.float32" else "tl.sqrt"
        cpu_half = dtype if self.device_type == "cpu" and dtype in _ROUND else None
        if cpu_half is torch.float16 or (cpu_half is torch.bfloat16 and e not in (0.5, -0.5, -1.0)):
            e = torch.tensor(e).to(cpu_half).item()
        square = self.rounded(f"{x} * {x}", dtype) if cpu_half is torch.bfloat16 else f"({x} * {x})"
        root = f"{sqrt}({x})"
        if cpu_half is torch.float16:  # C pow: (-0.0) ** 0.5 == +0.0 and (-inf) ** 0.5 == +inf
            root = f'tl.where({x} == float("-inf"), float("inf"), {sqrt}({x}) + 0.0)'
        special = {0.0: f"tl.full([BLOCK], 1.0, {ct})", 1.0: x, 2.0: f"{x} * {x}", 3.0: f"{square} * {x}",
                   0.5: root, -0.5: div("1.0", root), -1.0: div("1.0", x), -2.0: div("1.0", square)}
        if e in special:
            return special[e]
        is_int = e.is_integer() or math.isinf(e)  # C pow treats +-inf as an even integer: (-2) ** inf == inf
        odd = e.is_integer() and int(e) % 2 == 1
        return f"pow_scalar({x}, {_float_text(e)}, {is_int}, {odd})"

    def emit_nodes(self, nodes: list[Node]) -> None:
        """Emit a line for each node not emitted yet (reductions must already have a name)."""
        for n in nodes:
            if n.kind == "const" or n.index in self.names:
                continue
            name = n.name
            if n.kind == "grad":
                self.names[n.index] = "grad"
                continue
            if n.kind == "param":
                self.names[n.index] = "param"
                continue
            if n.kind == "scalar":
                expr = _widen(f"tl.load(scalar{n.value}_ptr)", n.dtype)
            else:
                expr = self.op(n)
                result_ct = compute_type(n.dtype)
                op_ct = compute_type(n.op_dtype)
                if op_ct != result_ct and not computes_in_operand_dtype(n.op):
                    expr = _convert(f"({expr})", op_ct, result_ct)
                if n.dtype in _ROUND:
                    expr = f"{_ROUND[n.dtype]}({expr})"
            self.lines.append(f"{name} = {expr}")
            self.names[n.index] = name



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
        self.reductions = self.g.reductions()
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
                     ("found_inf", "found_inf_ptr,  # *fp32 [1]: set to 1.0 when the scaled gradient has a NaN/Inf")]
        per = "per gradient of the bucket: " if self.multi else ""
        if self.reductions:
            args.append(("reduced", f"reduced_ptr,  # *fp64 [{len(self.reductions)}]: {per}results of the body's "
                                    "reductions"))
        if p.slots:
            rows = "the statistics buffer (rows from the table)" if self.multi else "this parameter's statistics row"
            args.append(("stats", f"stats_ptr,  # *fp64 [{len(p.slots)}]: {rows}"))
        if self.reductions or p.slots:
            args += [("partials", f"partials_ptr,  # *fp64 [blocks, sets, {PARTIAL_WIDTH}]: {per}per-program "
                                  "partial statistics"),
                     ("counter", f"counter_ptr,  # *int32 [1]: {per}programs finished; the last one merges and "
                                 "resets it to 0")]
        if self.hist_sets:
            args.append(("hist", f"hist_ptr,  # *int32 [{len(self.hist_sets)}, HIST_PAD]: {per}histogram "
                                 "accumulators, zeroed by the last program"))
        if not self.multi:
            args.append(("numel", "numel,  # elements in the span"))
        args += [("ALIGNED", "ALIGNED: tl.constexpr,  # gradient (and parameter) addresses 16-byte aligned and "
                             "every numel a multiple of 16 bytes: a vectorisation hint, true whenever set "
                             "(runtime.aligned)"),
                 ("BLOCK", "BLOCK: tl.constexpr,  # elements per program"),
                 ("RBLOCK", "RBLOCK: tl.constexpr,  # partial rows merged at a time")]
        return args

    # --- pieces --------------------------------------------------------------------------------

    def prologue(self) -> list[str]:
        ct, g = self.ct, self.g
        if self.multi:
            storage = f"tl.pointer_type({_storage_type(g.grad_dtype)})"
            lines = ["prog = tl.program_id(0).to(tl.int64)",
                     f"t = tl.load(table_ptr + {len(TABLE_PARTS)} * n_tensors + 2 * prog)  # which gradient of the "
                     "bucket",
                     f"pid = tl.load(table_ptr + {len(TABLE_PARTS)} * n_tensors + 2 * prog + 1)  # which block of it",
                     f"grad_ptr = tl.load({_table_part('grad')}).to({storage})",
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
            if self.hist_sets:
                lines.append(f"hist_ptr += t * {len(self.hist_sets)} * HIST_PAD")
        else:
            lines = ["pid = tl.program_id(0).to(tl.int64)", "num_blocks = tl.num_programs(0)"]
        vec = 16 // _ELEMENT_SIZE[g.grad_dtype]
        lines += ["if ALIGNED:  # the mask is uniform over each 16 bytes: 128-bit loads and stores",
                  f"    numel = tl.multiple_of(numel.to(tl.int64), {vec})"]
        lines.append("    grad_ptr = tl.multiple_of(grad_ptr, 16)")
        if g.uses_param:
            lines.append("    param_ptr = tl.multiple_of(param_ptr, 16)")
        lines += ["offs = pid * BLOCK + tl.arange(0, BLOCK)", "mask = offs < numel",
                  f"grad = {_widen('tl.load(grad_ptr + offs, mask=mask, other=0)', g.grad_dtype)}"]
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

    def emitter(self, available: dict[int, str]) -> _Emitter:
        em = _Emitter(self.plan, self.device_type)
        em.names.update(available)
        return em

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
            if self.g.depth(n) != level:
                continue
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

    def merge_lines(self, sets: list[_ReductionSet], num_blocks: str) -> list[str]:
        lines = []
        for k, rs in enumerate(sets):
            flags = ", ".join(f"{f}={rs.flags.get(f, False)}" for f in PARTIAL_FLAGS)
            lines.append(f"st = finalize_stats(partials_ptr, {k}, {len(sets)}, numel, {num_blocks}, BLOCK, RBLOCK, "
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

    def final_body(self, em: _Emitter, single: bool) -> list[str]:
        """The elementwise pass: body, store, found_inf, statistics (merged by the last program)."""
        g, ct, lines = self.g, self.ct, []
        em.emit_nodes(self.g.live_nodes())
        lines += em.lines
        out_value = "grad"
        if g.writes or self.plan.amp:
            r = g.result
            expr = em.value(r, ct) if r.kind != "const" else literal(r.value, ct)
            if not r.full:
                expr = f"({expr}) + tl.zeros([BLOCK], {ct})"
            if g.grad_dtype in _ROUND and r.dtype != g.grad_dtype:
                expr = f"{_ROUND[g.grad_dtype]}({expr})"
            lines.append(f"out = {expr}")
            store = "to_bf16(out)" if g.grad_dtype == torch.bfloat16 else f"out.to({_storage_type(g.grad_dtype)})"
            lines.append(f"tl.store(grad_ptr + offs, {store}, mask=mask)")
            out_value = "out"
        if self.plan.amp:
            lines += ['bad = tl.sum((mask & ~(tl.abs(scaled) < float("inf"))).to(tl.int32), axis=0)',
                      "if bad > 0:", "    tl.store(found_inf_ptr, 1.0)"]
        sets = self.stat_sets(out_value)
        hist_acc, hist_flush = self.hist_lines(out_value)
        if not sets and not hist_acc:
            return lines
        lines.append("n_valid = tl.minimum(numel - pid * BLOCK, BLOCK)")
        if single:
            lines.append("tl.debug_barrier()")
        lines += self.partial_lines(sets) + hist_acc
        merge = self.merge_lines(sets, "1" if single else "num_blocks") + hist_flush
        if single:
            return lines + ["tl.debug_barrier()"] + merge
        return lines + _last_program(merge)

    def simple_kernel(self) -> list[str]:
        em = self.emitter({})
        return self.kernel(KERNEL_NAME + self.suffix, self.signature(),
                           self.prologue() + self.final_body(em, single=False),
                           "the body, its store and the statistics, in one pass")

    def reduce_kernel(self, level: int) -> list[str]:
        available = {n.index: f"r{self.reduction_slot[n.index]}" for n in self.reductions if self.g.depth(n) < level}
        em = self.emitter(available)
        loads = [f"r{self.reduction_slot[i]} = {_from_reduced(n, f'tl.load(reduced_ptr + {self.reduction_slot[i]})')}"
                 for i, n in ((n.index, n) for n in self.reductions if self.g.depth(n) < level)]
        targets = [n.args["input"] for n in self.reductions if self.g.depth(n) == level]
        em.emit_nodes(_cone(self.g, targets))
        sets = self.reduction_sets(em, level, lambda n: f"tl.store(reduced_ptr + {self.reduction_slot[n.index]}, "
                                                       f"({{}}).to(tl.float64))  # {n.name}")
        body = self.prologue() + loads + em.lines + ["n_valid = tl.minimum(numel - pid * BLOCK, BLOCK)"]
        body += self.partial_lines(sets) + _last_program(self.merge_lines(sets, "num_blocks"))
        return self.kernel(f"reduce_level{level}{self.suffix}", self.signature(), body,
                       f"reduction pass {level}: leaves its results in reduced_ptr")

    def final_kernel(self) -> list[str]:
        em = self.emitter({n.index: f"r{self.reduction_slot[n.index]}" for n in self.reductions})
        loads = [f"r{k} = {_from_reduced(n, f'tl.load(reduced_ptr + {k})')}" for k, n in enumerate(self.reductions)]
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
    unspecialized = [a.split(",")[0] for a in args if a.startswith(("numel,", "n_tensors,"))]
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
        "",
        "from fusedhooks.kernels.elementwise import bf16_to_fp32, pow_scalar, round_to_bf16, round_to_fp16, to_bf16",
        "from fusedhooks.kernels.stats import finalize_stats, hist_accumulate, hist_flush, store_partials",
        "",
        f"HIST_PAD = tl.constexpr({_hist_pad(plan.hist_bins)})",
        "",
        "# body:",
        *("#   " + line for line in str(plan.graph).splitlines()),
    ]
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

def cache_dir() -> Path:
    """FUSEDHOOKS_CACHE_DIR, else $XDG_CACHE_HOME/fusedhooks, else ~/.cache/fusedhooks."""
    env = os.environ.get("FUSEDHOOKS_CACHE_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "fusedhooks"


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
    directory = cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
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
