"""The small IR a hook body is lowered to.

A `Graph` is a list of `Node`s in program order (SSA: in-place ops in the body become new values
that later reads see). Every value is either *full* (shaped like the gradient) or *scalar*
(a Python literal, or a closed-over 0-dim tensor read by the kernel at each run).
Dtypes follow torch's type promotion, computed by running each op on meta tensors.
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
import operator
from dataclasses import dataclass, field

import torch

# --- statistics ------------------------------------------------------------------------------------

#: The statistics of stats="all", in the order of the slots of a stats row.
STAT_NAMES = (
    "count", "sum", "mean", "sumsq", "norm", "var", "std",
    "min", "max", "absmax", "nan", "inf", "zeros",
)
#: Statistics recorded only when named (not part of "all"): the third and fourth standardised moments, after them in
#: a stats row.
MOMENT_STATS = ("skew", "kurtosis")
#: Every statistic a hook can record, in the order of the slots of a stats row ("hist" last).
ALL_STAT_NAMES = STAT_NAMES + MOMENT_STATS
#: Statistics read back as Python ints.
COUNT_STATS = frozenset({"count", "nan", "inf", "zeros"})

# --- ops -------------------------------------------------------------------------------------------

#: Canonical op name -> signature (argument names, as torch spells them). Ops with a tensor result
#: shaped like their first argument; the reference backend and codegen implement each of them.
SIGNATURES: dict[str, str] = {
    # arithmetic
    "add": "input, other, *, alpha=1",
    "sub": "input, other, *, alpha=1",
    "mul": "input, other",
    "div": "input, other, *, rounding_mode=None",
    "neg": "input",
    "abs": "input",
    "sign": "input",
    "sqrt": "input",
    "rsqrt": "input",
    "exp": "input",
    "log": "input",
    "reciprocal": "input",
    "square": "input",
    "pow": "input, exponent",
    # clipping, selection
    "clamp": "input, min=None, max=None",
    "clamp_min": "input, min",
    "clamp_max": "input, max",
    "minimum": "input, other",
    "maximum": "input, other",
    "where": "condition, input, other",
    # comparisons, logic
    "eq": "input, other",
    "ne": "input, other",
    "lt": "input, other",
    "le": "input, other",
    "gt": "input, other",
    "ge": "input, other",
    "logical_and": "input, other",
    "logical_or": "input, other",
    "logical_xor": "input, other",
    "logical_not": "input",
    "bitwise_and": "input, other",
    "bitwise_or": "input, other",
    "bitwise_xor": "input, other",
    "bitwise_not": "input",
    # special values
    "isnan": "input",
    "isinf": "input",
    "isfinite": "input",
    "nan_to_num": "input, nan=0.0, posinf=None, neginf=None",
    # constructors and copies
    "zeros_like": "input, *, dtype=None",
    "ones_like": "input, *, dtype=None",
    "full_like": "input, fill_value, *, dtype=None",
    "fill": "input, value",
    "zero": "input",
    "copy": "input, src",
    "to": "input, dtype",
    # shapes (of values reduced over dimensions, to broadcast them back)
    "unsqueeze": "input, dim",
    # reductions: of the whole tensor (dim=None: a 0-dim result, broadcast over the gradient where used) or over
    # dimensions (dim= an int or a tuple, keepdim=)
    "sum": "input, dim=None, keepdim=False",
    "mean": "input, dim=None, keepdim=False",
    "norm": "input, p='fro', dim=None, keepdim=False",
    "vector_norm": "input, ord=2, dim=None, keepdim=False",
    "var": "input, dim=None, unbiased=None, keepdim=False, *, correction=None",
    "std": "input, dim=None, unbiased=None, keepdim=False, *, correction=None",
    "amax": "input, dim=None, keepdim=False",
    "amin": "input, dim=None, keepdim=False",
    "max": "input, other=None",
    "min": "input, other=None",
    "all": "input, dim=None, keepdim=False",
    "any": "input, dim=None, keepdim=False",
}

#: ops that reduce the whole tensor (max/min only in their one-argument form)
REDUCTIONS = frozenset({"sum", "mean", "norm", "vector_norm", "var", "std", "amax", "amin", "max", "min",
                        "all", "any"})


def is_reduction(op: str, args: dict) -> bool:
    return op in REDUCTIONS and not (op in ("max", "min") and args.get("other") is not None)


def reduces_over_dims(node: Node) -> bool:
    """A reduction over some dimensions (dim=), or a shape op: a value shaped neither like the gradient nor 0-dim,
    which only the eager and reference backends compute for now."""
    return node.kind == "op" and (node.op == "unsqueeze" or (is_reduction(node.op, node.args)
                                                             and node.args.get("dim") is not None))


@dataclass(frozen=True)
class ReductionSpec:
    """How a reduction node is computed from block partials (see kernels/stats.py).

    stat: the statistic of `abs(x)` if `of_abs` else of `x` (a STAT_NAMES entry);
    correction: for var/std; test: "all"/"any" turn the zero count into a bool, None keeps the value.
    """

    stat: str
    of_abs: bool = False
    correction: float = 1.0
    test: str | None = None


def reduction_spec(node: Node) -> ReductionSpec:
    op, a = node.op, node.args
    if op in ("sum", "mean"):
        return ReductionSpec(op)
    if op in ("norm", "vector_norm"):
        p = a.get("p", a.get("ord"))
        if p in ("fro", 2, 2.0):
            return ReductionSpec("norm")
        if p in (1, 1.0):
            return ReductionSpec("sum", of_abs=True)
        if p == math.inf:
            return ReductionSpec("absmax")
        if p == -math.inf:
            return ReductionSpec("min", of_abs=True)
        raise ValueError(f"{op} of order {p!r} is not supported (orders 1, 2, inf, -inf)")
    if op in ("var", "std"):
        correction = a["correction"]
        if correction is None:
            correction = 0.0 if a["unbiased"] is False else 1.0
        return ReductionSpec(op, correction=float(correction))
    if op in ("amax", "max"):
        return ReductionSpec("max")
    if op in ("amin", "min"):
        return ReductionSpec("min")
    if op in ("all", "any"):
        return ReductionSpec("zeros", test=op)
    raise KeyError(op)

#: Arguments that must be Python numbers (compile-time constants), not tensors.
NUMBER_ARGS = {
    "add": ("alpha",), "sub": ("alpha",), "pow": ("exponent",),
    "nan_to_num": ("nan", "posinf", "neginf"), "full_like": ("fill_value",), "fill": ("value",),
}
#: Arguments that are Python options (numbers, strings, bools), kept as they are.
OPTION_ARGS = {"norm": ("p", "dim", "keepdim"), "vector_norm": ("ord", "dim", "keepdim"),
               "var": ("unbiased", "correction", "dim", "keepdim"), "std": ("unbiased", "correction", "dim", "keepdim"),
               **{op: ("dim", "keepdim") for op in ("sum", "mean", "amax", "amin", "all", "any")},
               "unsqueeze": ("dim",)}
#: Arguments that are dtypes.
DTYPE_ARGS = {"zeros_like": ("dtype",), "ones_like": ("dtype",), "full_like": ("dtype",), "to": ("dtype",)}


def _make_signature(spec: str) -> inspect.Signature:
    params, kind = [], inspect.Parameter.POSITIONAL_OR_KEYWORD
    for part in (p.strip() for p in spec.split(",")):
        if part == "*":
            kind = inspect.Parameter.KEYWORD_ONLY
            continue
        name, _, default = part.partition("=")
        params.append(inspect.Parameter(
            name, kind, default=eval(default) if default else inspect.Parameter.empty))
    return inspect.Signature(params)


_SIGNATURE_OBJECTS = {name: _make_signature(spec) for name, spec in SIGNATURES.items()}


def bind(op: str, args: tuple, kwargs: dict) -> dict:
    """Bind a call's arguments to `op`'s signature; raises TypeError naming the op."""
    try:
        bound = _SIGNATURE_OBJECTS[op].bind(*args, **kwargs)
    except TypeError as e:
        raise TypeError(f"{op}({SIGNATURES[op]}): {e}") from None
    bound.apply_defaults()
    return dict(bound.arguments)


#: comparisons: a bool result, computed in the promoted dtype of the operands
COMPARISONS = ("eq", "ne", "lt", "le", "gt", "ge")
#: elementwise tests: a bool result, computed in the operand's dtype
TESTS = ("isnan", "isinf", "isfinite")


def computes_in_operand_dtype(op: str) -> bool:
    """Ops whose operands are not first converted to the result's dtype (comparisons, tests, logic)."""
    return op in COMPARISONS or op in TESTS or op.startswith(("logical_", "bitwise_"))


#: ops that are Python operators: with a number first (`1 - grad`) torch runs the reflected method
OPERATOR_OPS = {
    "add": operator.add, "sub": operator.sub, "mul": operator.mul, "div": operator.truediv,
    "eq": operator.eq, "ne": operator.ne, "lt": operator.lt, "le": operator.le, "gt": operator.gt,
    "ge": operator.ge, "bitwise_and": operator.and_, "bitwise_or": operator.or_, "bitwise_xor": operator.xor,
}


def eager(op: str, a: dict):
    """Run `op` with bound arguments `a` as eager torch (on real or meta tensors), out of place."""
    x = a.get("input")
    if is_reduction(op, a):
        return _eager_reduction(op, a, x)
    if op in ("max", "min"):
        return torch.maximum(x, a["other"]) if op == "max" else torch.minimum(x, a["other"])
    if op in OPERATOR_OPS and a.get("alpha", 1) == 1 and a.get("rounding_mode") is None:
        return OPERATOR_OPS[op](x, a["other"])
    if op in ("add", "sub"):
        return getattr(torch, op)(x, a["other"], alpha=a["alpha"])
    if op == "div":
        return torch.div(x, a["other"], rounding_mode=a["rounding_mode"])
    if op == "pow":
        return torch.pow(x, a["exponent"])
    if op == "clamp":
        lo, hi = a["min"], a["max"]
        if isinstance(lo, torch.Tensor) != isinstance(hi, torch.Tensor) and lo is not None and hi is not None:
            # torch would read the tensor bound with .item() (a host sync); a tensor for both is the same
            device = (lo if isinstance(lo, torch.Tensor) else hi).device
            lo, hi = (v if isinstance(v, torch.Tensor) else torch.tensor(v, device=device) for v in (lo, hi))
        return torch.clamp(x, lo, hi)
    if op == "clamp_min":
        return torch.clamp_min(x, a["min"])
    if op == "clamp_max":
        return torch.clamp_max(x, a["max"])
    if op == "where":
        return torch.where(a["condition"], x, a["other"])
    if op == "nan_to_num":
        return torch.nan_to_num(x, a["nan"], a["posinf"], a["neginf"])
    if op in ("zeros_like", "ones_like"):
        return getattr(torch, op)(x, dtype=a["dtype"])
    if op == "full_like":
        return torch.full_like(x, a["fill_value"], dtype=a["dtype"])
    if op == "fill":
        return torch.full_like(x, a["value"])
    if op == "zero":
        return torch.zeros_like(x)
    if op == "copy":
        return torch.empty_like(x).copy_(a["src"])
    if op == "to":
        return x.to(a["dtype"])
    if op == "unsqueeze":
        return torch.unsqueeze(x, a["dim"])
    if "other" in a:
        return getattr(torch, op)(x, a["other"])
    return getattr(torch, op)(x)


def _eager_reduction(op: str, a: dict, x):
    dim = a.get("dim")
    if dim is not None:
        return _eager_reduction_over(op, a, x, dim, a["keepdim"])
    if op == "norm":
        return torch.norm(x, a["p"])
    if op == "vector_norm":
        return torch.linalg.vector_norm(x, a["ord"])
    if op in ("var", "std"):
        fn = getattr(torch, op)
        if a["correction"] is not None:
            return fn(x, correction=a["correction"])
        return fn(x) if a["unbiased"] is None else fn(x, a["unbiased"])
    return getattr(torch, op)(x)


def _eager_reduction_over(op: str, a: dict, x, dim, keepdim: bool):
    if op == "norm":
        return torch.norm(x, a["p"], dim=dim, keepdim=keepdim)
    if op == "vector_norm":
        return torch.linalg.vector_norm(x, a["ord"], dim=dim, keepdim=keepdim)
    if op in ("var", "std"):
        correction = a["correction"]
        if correction is None:
            correction = 0 if a["unbiased"] is False else 1
        return getattr(torch, op)(x, dim=dim, correction=correction, keepdim=keepdim)
    return getattr(torch, op)(x, dim=dim, keepdim=keepdim)


# --- the graph -------------------------------------------------------------------------------------

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(eq=False)
class Node:
    """One value of the hook body.

    kind: "grad" | "param" (inputs, full), "const" (a Python literal, `value`),
          "scalar" (closed-over tensor number `value`), or "op" (`op` applied to `args`).
    args: for "op", the bound arguments: name -> Node, Python number, dtype or None.
    dtype: the torch dtype of the value (None for a Python literal).
    full: shaped like the gradient (True) or a scalar broadcast over it (False).
    """

    index: int
    kind: str
    dtype: torch.dtype | None
    full: bool
    op: str | None = None
    args: dict = field(default_factory=dict)
    value: object = None
    #: the dtype the op computes in, before its result is cast to `dtype` (comparisons, casts)
    op_dtype: torch.dtype | None = None
    #: the value's shape, for the gradient shape the graph was lowered for (() for Python literals)
    shape: tuple = ()

    def inputs(self) -> list[Node]:
        return [v for v in self.args.values() if isinstance(v, Node)]

    def __repr__(self) -> str:
        if self.kind == "op":
            shown = ", ".join(f"{k}={_shown(v)}" for k, v in self.args.items())
            shape = "" if self.full else f" shape {self.shape}" if self.shape else " scalar"
            return f"{self.name} = {self.op}({shown}) : {_dt(self.dtype)}{shape}"
        if self.kind == "const":
            return f"{self.name} = {self.value!r}"
        if self.kind == "scalar":
            return f"{self.name} = scalar[{self.value}] : {_dt(self.dtype)}"
        return f"{self.name} = {self.kind} : {_dt(self.dtype)}"

    @property
    def name(self) -> str:
        return {"grad": "grad", "param": "param"}.get(self.kind, f"v{self.index}")


def _shown(v) -> str:
    if isinstance(v, Node):
        return repr(v.value) if v.kind == "const" else v.name
    return repr(v)


def _dt(dtype) -> str:
    return "python" if dtype is None else str(dtype).removeprefix("torch.")


@dataclass(eq=False)
class Graph:
    """A lowered hook body for one gradient dtype.

    nodes: every value, in program order; result: what is written into `.grad` (cast to `grad_dtype`);
    scalar_dtypes: dtype of each closed-over tensor the kernel reads (index = `Node.value`); scalar_names: what the
    hook function calls each (shown by str()).
    """

    grad_dtype: torch.dtype
    nodes: list[Node]
    result: Node
    scalar_dtypes: tuple[torch.dtype, ...]
    uses_param: bool
    scalar_names: tuple[str, ...] = ()

    @property
    def writes(self) -> bool:
        """False when the body leaves the gradient as it is (statistics only)."""
        return self.result.kind != "grad"

    @functools.cached_property
    def reduces_over_dims(self) -> bool:
        """Does the body reduce over some dimensions, or change a value's shape (see `reduces_over_dims`)?"""
        return any(reduces_over_dims(n) for n in self.live_nodes())

    @functools.cached_property
    def _reductions(self) -> list[Node]:
        return [n for n in self.live_nodes() if n.kind == "op" and is_reduction(n.op, n.args)]

    def reductions(self) -> list[Node]:
        """The live whole-tensor reductions, in program order (a graph is not changed after lowering)."""
        return self._reductions

    def depth(self, node: Node) -> int:
        """Reduction passes needed before `node` is known: 0 for elementwise values of the inputs."""
        memo: dict[int, int] = self.__dict__.setdefault("_depth", {})
        if node.index not in memo:
            below = max((self.depth(i) for i in node.inputs()), default=0)
            memo[node.index] = below + (1 if node.kind == "op" and is_reduction(node.op, node.args) else 0)
        return memo[node.index]

    def live_nodes(self) -> list[Node]:
        """Nodes the result depends on, in program order."""
        return self._live_nodes

    @functools.cached_property
    def _live_nodes(self) -> list[Node]:
        live, stack = set(), [self.result]
        while stack:
            n = stack.pop()
            if n.index not in live:
                live.add(n.index)
                stack.extend(n.inputs())
        return [n for n in self.nodes if n.index in live]

    def __str__(self) -> str:
        lines = [repr(n) if n.kind != "scalar" or n.value >= len(self.scalar_names) else
                 f"{n.name} = {self.scalar_names[n.value]} : {_dt(n.dtype)} (closed-over tensor {n.value}, read at "
                 "each firing)" for n in self.live_nodes() if n.kind != "const"]
        lines.append(f"grad <- {self.result.name}")
        return "\n".join(lines)


def is_number(x) -> bool:
    return isinstance(x, numbers.Number) and not isinstance(x, complex)
