"""The CPU backend (`auto` on CPU without the Triton interpreter): a plan as eager torch, at the speed of the eager
hook it replaces.

Where `reference` (the tests' oracle) computes every statistic from a float64 copy and runs the body out of place,
this backend
- runs the body in place on the gradient wherever torch's in-place op gives the out-of-place op's values (same
  dtype and shape, the operand not read again): `grad.clamp(-1, 1) * s` is `grad.clamp_(-1, 1).mul_(s)`;
- computes statistics in the gradient's precision (float32 for float16/bfloat16, whose values it holds exactly)
  with torch's cascade-summed `sum` (sum, mean, sum of squares, and var/std as the corrected two-pass sum around
  the mean), `aminmax` for min/max/absmax, `count_nonzero` for zeros; NaN/Inf are counted only when min or max is
  not finite, and gradients whose magnitude would overflow or underflow float32 squares are summed in float64.
Values: the body's bits are eager torch's; statistics agree with the float64 reference to float32 rounding
(DESIGN's accuracy targets), min/max/absmax and counts exactly.
"""

from __future__ import annotations

import functools
import math
import re

import torch

from ..compiler.ir import MOMENT_STATS, Graph, Node, eager
from ..compiler.plan import Plan
from . import reference

#: In-place forms: op -> (method of the first operand, its other arguments in order). Each computes what the op
#: computes when the result has the first operand's dtype and shape.
_IN_PLACE = {
    "add": ("add_", ("other", "alpha=alpha")), "sub": ("sub_", ("other", "alpha=alpha")), "mul": ("mul_", ("other",)),
    "div": ("div_", ("other", "rounding_mode=rounding_mode")), "pow": ("pow_", ("exponent",)),
    "clamp_min": ("clamp_min_", ("min",)), "clamp_max": ("clamp_max_", ("max",)),
    "nan_to_num": ("nan_to_num_", ("nan", "posinf", "neginf")),
    **{op: (op + "_", ()) for op in ("neg", "abs", "sign", "sqrt", "rsqrt", "exp", "log", "reciprocal", "square")},
}
_HALF = (torch.float16, torch.bfloat16)


#: Out-of-place ops written as the torch call ir.eager makes for them (without its dispatch, at every firing)
_OPERATORS = {"add": "+", "sub": "-", "mul": "*", "div": "/"}
_REDUCTIONS_OVER = ("sum", "mean", "amax", "amin", "all", "any")


def _direct_call(n: Node, ref) -> str | None:
    """The torch call of op node `n` as source text (ref(value) names an argument), or None: ir.eager's dispatch."""
    a = n.args
    x = ref(a["input"]) if "input" in a else None
    if n.op in _OPERATORS and a.get("alpha", 1) == 1 and a.get("rounding_mode") is None:
        return f"{x} {_OPERATORS[n.op]} {ref(a['other'])}"
    if n.op in _REDUCTIONS_OVER:
        dims = "" if a.get("dim") is None else f", dim={a['dim']!r}, keepdim={a['keepdim']!r}"
        return f"torch.{n.op}({x}{dims})"
    if n.op in ("norm", "vector_norm"):
        order = a["p"] if n.op == "norm" else a["ord"]
        dims = "" if a.get("dim") is None else f", dim={a['dim']!r}, keepdim={a['keepdim']!r}"
        fn = "torch.norm" if n.op == "norm" else "torch.linalg.vector_norm"
        return f"{fn}({x}, {_number(order)}{dims})"
    if n.op == "unsqueeze":
        return f"torch.unsqueeze({x}, {a['dim']!r})"
    return None


def _number(v) -> str:
    """A Python number or string option as source text (inf has no literal)."""
    return f'float("{v}")' if isinstance(v, float) and not math.isfinite(v) else repr(v)


def _can_overwrite(n: Node, first: Node | None, i: int, last_use: dict, owned: set) -> bool:
    """May op node `n` (the i-th live node) write its result into its first operand's tensor?"""
    if first is None or first.index not in owned or last_use[first.index] != i or first.dtype != n.dtype:
        return False
    if not (n.full and first.full) or any(v is first for k, v in n.args.items() if k != "input"):
        return False
    if n.op == "clamp":  # a tensor bound with a number bound: eager() turns the number into a tensor first
        bounds = [n.args["min"], n.args["max"]]
        return all(b is None or not isinstance(b, Node) or b.kind == "const" for b in bounds) or \
            all(isinstance(b, Node) and b.kind != "const" for b in bounds)
    return n.op in _IN_PLACE or n.op in ("minimum", "maximum")


@functools.lru_cache(maxsize=256)
def compile_body(graph: Graph):
    """The body as a Python function body(grad, param, scalars) that writes the body's result into `grad`, eager
    torch op by op, overwriting `grad` and its own intermediates once they are no longer read (so the result is
    often `grad` itself, already written: then nothing is copied), each op on the whole gradient, as the eager hook
    it replaces runs them (cutting a large gradient into cache-sized blocks was measured slower on 1M-16M fp32
    gradients: each block's ops pay torch's dispatch and thread start again). Written once per graph: at each
    firing it costs what the torch calls cost."""
    nodes = graph.live_nodes()
    last_use: dict[int, int] = {}
    for i, n in enumerate(nodes):
        for v in n.inputs():
            last_use[v.index] = i
    last_use[graph.result.index] = len(nodes)
    consts: list = []
    owned: set[int] = set()  # nodes whose tensor may be overwritten: the gradient and fresh intermediates

    def ref(v) -> str:
        if isinstance(v, Node) and v.kind != "const":
            return f"v{v.index}"
        consts.append(v.value if isinstance(v, Node) else v)
        return f"c[{len(consts) - 1}]"

    lines = []
    for i, n in enumerate(nodes):
        if n.kind == "grad":
            lines.append(f"v{n.index} = grad")
            owned.add(n.index)
        elif n.kind == "param":
            lines.append(f"v{n.index} = param")
        elif n.kind == "scalar":
            lines.append(f"v{n.index} = scalars[{n.value}]")
        elif n.kind == "op":
            first = n.args.get("input")
            first = first if isinstance(first, Node) and first.kind != "const" else None
            if _can_overwrite(n, first, i, last_use, owned):
                x = ref(first)
                if n.op in ("minimum", "maximum"):
                    call = f"torch.{n.op}({x}, {ref(n.args['other'])}, out={x})"
                elif n.op == "clamp":
                    call = f"{x}.clamp_({ref(n.args['min'])}, {ref(n.args['max'])})"
                else:
                    method, params = _IN_PLACE[n.op]
                    if (n.op in ("add", "sub") and n.args["alpha"] == 1) or (n.op == "div"
                                                                              and n.args["rounding_mode"] is None):
                        params = ("other",)  # the default: the plain call
                    args = [f"{p.split('=')[0]}={ref(n.args[p.split('=')[1]])}" if "=" in p else ref(n.args[p])
                            for p in params]
                    call = f"{x}.{method}({', '.join(args)})"
                owned.add(n.index)
            else:
                call = _direct_call(n, ref)
                if call is None:
                    args = ", ".join(f"{k!r}: {ref(v)}" for k, v in n.args.items())
                    call = f"eager({n.op!r}, {{{args}}})"
                if not (n.op == "to" and isinstance(first, Node) and first.dtype == n.dtype):
                    owned.add(n.index)  # a fresh tensor (x.to(its own dtype) is x itself)
            lines.append(f"v{n.index} = {call}")
    lines += [f"result = {ref(graph.result)}", "if result is not grad:", "    grad.copy_(result)"]
    source = "def body(grad, param, scalars):\n" + "".join(f"    {line}\n" for line in lines)
    scope = {"torch": torch, "eager": eager, "c": consts}
    exec(compile(source, f"<fusedhooks eager body {id(graph):x}>", "exec"), scope)
    body = scope["body"]
    body.source = source
    shown = {i: _number(v) for i, v in enumerate(consts) if v is None or isinstance(v, (bool, int, float, str))}
    #: the source with the numbers it reads written out (for plans)
    body.shown = re.sub(r"\bc\[(\d+)\]", lambda m: shown.get(int(m.group(1)), m.group(0)), source)
    return body


def _sum_of_squares(x: torch.Tensor, scratch: torch.Tensor) -> float:
    torch.mul(x, x, out=scratch)
    return scratch.sum().item()


#: Beyond these magnitudes squares (and sums) of float32 values may overflow or underflow: computed in float64
_SAFE_RANGE = (2.0 ** -50, 2.0 ** 50)


def tensor_stats(x: torch.Tensor, names: tuple[str, ...], scratch) -> list[float]:
    """Statistics of `x` (see reference.tensor_stats for their meaning and NaN rules), as Python floats.

    scratch(numel, dtype): a reusable 1-D buffer of that size."""
    flat = x.detach().reshape(-1)
    n = flat.numel()
    if n == 0:
        return [v.item() for v in reference.tensor_stats(flat, names)]
    if flat.dtype in _HALF:
        flat = flat.float()
    want = set(names)
    out = {"count": float(n)}
    if want - {"count", "zeros", *MOMENT_STATS}:
        lo, hi = (v.item() for v in torch.aminmax(flat))
        out["min"], out["max"] = lo, hi
        out["absmax"] = absmax = max(abs(lo), abs(hi)) if not (math.isnan(lo) or math.isnan(hi)) else math.nan
        finite = math.isfinite(lo) and math.isfinite(hi)
        out["nan"] = 0.0 if finite else float(torch.isnan(flat).sum().item())
        out["inf"] = 0.0 if finite else float(torch.isinf(flat).sum().item())
        in_range = absmax == 0 or _SAFE_RANGE[0] <= absmax <= _SAFE_RANGE[1]
        wide = finite and flat.dtype != torch.float64 and not in_range
        values = flat.double() if wide else flat
        if want & {"sum", "mean", "var", "std"}:
            out["sum"] = values.sum().item()
            out["mean"] = out["sum"] / n
        if want & {"sumsq", "norm"}:
            out["sumsq"] = _sum_of_squares(values, scratch(n, values.dtype))
            out["norm"] = math.sqrt(out["sumsq"])
        if want & {"var", "std"}:
            if n < 2:
                out["var"] = out["std"] = math.nan
            else:
                centred = scratch(n, values.dtype)
                torch.sub(values, out["mean"], out=centred)
                # the corrected two-pass sum: less (sum of deviations)^2 / n, which takes out what the rounded mean
                # adds (n * error^2: half the variance of values far from 0 with a small spread), never below 0
                deviations = centred.sum().item()
                m2 = _sum_of_squares(centred, centred) - deviations * deviations / n
                out["var"] = (m2 if m2 >= 0 or m2 != m2 else 0.0) / (n - 1)
                out["std"] = math.sqrt(out["var"]) if out["var"] >= 0 else math.nan
    if "zeros" in want:
        out["zeros"] = float(n - torch.count_nonzero(flat).item())
    moments = [name for name in names if name in MOMENT_STATS]
    if moments:  # in float64, as the reference computes them
        out.update(zip(moments, (v.item() for v in reference.tensor_stats(flat, tuple(moments)))))
    return [out[name] for name in names]


def _stats_values(x: torch.Tensor, names: tuple[str, ...], hist_range, scratch) -> list:
    values = tensor_stats(x, tuple(n for n in names if n != "hist"), scratch)
    if "hist" in names:
        compute = torch.float32 if x.dtype in _HALF else x.dtype
        values += reference.histogram(x, hist_range, compute).tolist()
    return values


def run(plan: Plan, body, grad: torch.Tensor, param: torch.Tensor | None, scalars: list[torch.Tensor],
        stats_row: torch.Tensor | None, amp: tuple | None, scratch) -> None:
    """Apply `plan` to `grad` in place and write the statistics into `stats_row` (see the module docstring).

    body: compile_body(plan.graph); amp: (scale, found_inf): unscale first, exactly as GradScaler.unscale_ does;
    scratch: see tensor_stats."""
    if plan.amp:
        scale, found_inf = amp
        torch._amp_foreach_non_finite_check_and_unscale_([grad], found_inf, scale.double().reciprocal().float())
    values = _stats_values(grad, plan.input_stats, plan.hist_range, scratch) if plan.input_stats else []
    if plan.graph.writes:
        body(grad, param, scalars)
    values = (_stats_values(grad, plan.stats, plan.hist_range, scratch) if plan.stats else []) + values
    if values and stats_row is not None:
        stats_row.copy_(torch.tensor(values, dtype=torch.float64))
