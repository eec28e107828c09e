"""Tracing a hook body with torch.fx and lowering it to the IR; every "cannot compile" error is raised here."""

from __future__ import annotations

import builtins
import contextlib
import functools
import inspect
import numbers
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode

from .ir import (
    DTYPE_ARGS,
    FLOAT_DTYPES,
    NUMBER_ARGS,
    OPERATOR_OPS,
    OPTION_ARGS,
    SIGNATURES,
    TESTS,
    Graph,
    Node,
    bind,
    computes_in_operand_dtype,
    eager,
    is_number,
    is_reduction,
    reduction_spec,
)


class CompileError(TypeError):
    """A hook body that fusedhooks cannot compile; raised when the function is decorated."""


SUPPORTED_HINT = "See docs/supported-ops.md in the fusedhooks repository (fusedhooks.supported_ops() lists them)."

#: dtypes a value inside a hook body may have
BODY_DTYPES = FLOAT_DTYPES + (torch.bool, torch.int32, torch.int64)

_OPERATORS = {
    operator.add: "add", operator.sub: "sub", operator.mul: "mul", operator.truediv: "div",
    operator.neg: "neg", operator.abs: "abs", operator.pow: "pow",
    operator.eq: "eq", operator.ne: "ne", operator.lt: "lt", operator.le: "le",
    operator.gt: "gt", operator.ge: "ge",
    operator.and_: "bitwise_and", operator.or_: "bitwise_or", operator.xor: "bitwise_xor",
    operator.invert: "bitwise_not",
}
_ALIASES = {
    "clip": "clamp", "absolute": "abs", "negative": "neg", "multiply": "mul", "divide": "div",
    "true_divide": "div", "subtract": "sub", "greater": "gt", "greater_equal": "ge", "less": "lt",
    "less_equal": "le", "not_equal": "ne", "clip_min": "clamp_min", "clip_max": "clamp_max",
}
#: what to write instead of a tensor where an op takes only a Python number (NUMBER_ARGS)
_NUMBER_ARG_HINTS = {
    "pow": "; a tensor exponent (`x ** s`, `2 ** x`) is not supported",
    "fill": "; to fill with a tensor `s`, write `x.copy_(s)`",
    "full_like": "; for a tensor `s`, write `torch.zeros_like(x).copy_(s)`",
    "add": "; for a tensor `s`, write `x + y * s` (which rounds `y * s` first)",
    "sub": "; for a tensor `s`, write `x - y * s` (which rounds `y * s` first)",
    "nan_to_num": "; for a tensor `s`, write `torch.where(x.isnan(), s, x)` (and likewise for the infinities)",
}
_CAST_METHODS = {"float": torch.float32, "half": torch.float16, "bfloat16": torch.bfloat16,
                 "double": torch.float64}
#: methods that read a traced value on the host; named in their own error
_HOST_READS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__index__", "__len__")


def supported_ops() -> list[str]:
    """Names of the ops a hook body may use (also as in-place methods `op_` where torch has them)."""
    names = set(SIGNATURES) - {"fill", "zero", "copy", "to"}
    names |= {"fill_", "zero_", "copy_", "float", "half", "bfloat16", "double", "to(dtype)"}
    return sorted(names | set(_ALIASES))


# --- tracing ---------------------------------------------------------------------------------------

def _host_read(name):
    label = f"{name.strip('_')}()" if name.startswith("__") else f".{name}()"

    def refuse(self, *args, **kwargs):
        raise CompileError(
            f"`{label}` of a traced value needs a host sync and cannot be compiled into the kernel: "
            "the hook body must stay on the device. Use tensor ops (torch.where, clamp) instead.")
    return refuse


def _inplace_operator(method):
    def apply(self, other):
        return self.tracer.create_proxy("call_method", method, (self, other), {})
    return apply


class _HookProxy(fx.Proxy):
    """fx.Proxy that records `x += y` as the in-place `x.add_(y)` (torch semantics) and refuses host reads."""

    __iadd__ = _inplace_operator("add_")
    __isub__ = _inplace_operator("sub_")
    __imul__ = _inplace_operator("mul_")
    __itruediv__ = _inplace_operator("div_")
    __iand__ = _inplace_operator("bitwise_and_")
    __ior__ = _inplace_operator("bitwise_or_")
    __ixor__ = _inplace_operator("bitwise_xor_")

    def __abs__(self):
        return self.tracer.create_proxy("call_method", "abs", (self,), {})

    for _name in _HOST_READS:
        locals()[_name] = _host_read(_name)
    del _name


class _HookTracer(fx.Tracer):
    def proxy(self, node):
        return _HookProxy(node, self)


_FORMATTING = {torch.Tensor.__repr__, torch.Tensor.__str__, torch.Tensor.__format__}


class _LiftClosedTensors(TorchFunctionMode):
    """While tracing, an op on closed-over tensors alone (`scale * 2`, `s.mul_(2)`) is recorded on them
    instead of running once at decoration: the kernel then recomputes it from their current values."""

    def __init__(self, tracer: fx.Tracer):
        super().__init__()
        self.tracer = tracer

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat = pytree.tree_leaves((args, kwargs))
        if func in _FORMATTING or any(isinstance(a, fx.Proxy) for a in flat) or \
                not any(isinstance(a, torch.Tensor) for a in flat):
            return func(*args, **kwargs)
        lift = lambda a: self.tracer.proxy(self.tracer.create_arg(a)) if isinstance(a, torch.Tensor) else a
        args, kwargs = pytree.tree_map(lift, (args, kwargs))
        name = getattr(func, "__name__", "")
        if args and isinstance(args[0], fx.Proxy) and getattr(torch.Tensor, name, None) is func:
            # `1 / s` is Tensor.__rdiv__ (torch's name for __rtruediv__), which fx.Proxy records as operator.div
            name = "__rtruediv__" if name == "__rdiv__" else name
            return getattr(args[0], name)(*args[1:], **kwargs)  # a method: record call_method
        return func(*args, **kwargs)


@dataclass
class TracedBody:
    """A traced hook function: its fx graph, the tensors it closes over, and whether it reads the param."""

    name: str
    graph: fx.Graph
    scalars: list[torch.Tensor]
    scalar_of: dict[str, int]       # get_attr target -> index into scalars
    uses_param: bool
    #: what each closed-over tensor is called in the function's code (shown in plans)
    scalar_names: tuple[str, ...] = ()

    def __post_init__(self):
        self._traced = [(t.dtype, t.shape, t.device) for t in self.scalars]  # what the plans were lowered for
        self._addresses = [t.data_ptr() for t in self.scalars]

    def check_scalars(self) -> None:
        """Raise when a closed-over tensor is no longer the dtype, shape or device it was traced with (`s.data = t`,
        `s.set_(t)`, `s.resize_(n)` change it in place without a new trace): the kernels would read it as traced.
        Checked at each firing; costs one `data_ptr()` per tensor while none was given other storage."""
        for i, t in enumerate(self.scalars):
            if t.data_ptr() != self._addresses[i]:
                dtype, shape, device = self._traced[i]
                if (t.dtype, t.shape, t.device) != (dtype, shape, device):
                    raise RuntimeError(
                        f"{self.name}: closed-over tensor {i} was traced as a {dtype} tensor of shape {tuple(shape)} "
                        f"on {device}, and is now a {t.dtype} tensor of shape {tuple(t.shape)} on {t.device} "
                        "(given other storage: `.data =`, `set_`, `resize_`). Change its value in place "
                        "(`s.fill_(v)`, `s.copy_(v)`), or decorate the function again for the new tensor")
                self._addresses[i] = t.data_ptr()


def _arity(fn) -> int:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        raise CompileError(f"cannot inspect the signature of {fn!r}") from None
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    others = [p for p in params if p not in positional or p.default is not p.empty]
    if not 1 <= len(positional) <= 2 or others:
        raise CompileError(
            f"a hook function takes the gradient and, optionally, the parameter: `def {fn.__name__}(grad)` "
            f"or `def {fn.__name__}(grad, param)`; got {fn.__name__}{inspect.signature(fn)}")
    return len(positional)


def trace(fn) -> TracedBody:
    """Trace `fn(grad[, param])` with torch.fx. Raises CompileError for what cannot be compiled."""
    name = getattr(fn, "__name__", repr(fn))
    arity = _arity(fn)
    tracer = _HookTracer()
    real_print = builtins.print

    def guarded_print(*args, **kwargs):
        if any(isinstance(a, fx.Proxy) for a in args):
            raise CompileError("`print` of a traced value needs a host sync; record statistics with "
                               "stats=(...) and read them with hook.stats.read()")
        return real_print(*args, **kwargs)

    builtins.print = guarded_print
    try:
        with _LiftClosedTensors(tracer):
            graph = tracer.trace(fn)
    except CompileError as e:
        raise CompileError(f"cannot compile {name}: {e}") from None
    except fx.proxy.TraceError as e:
        raise CompileError(
            f"cannot compile {name}: data-dependent Python control flow (`if`, `while`, `bool()`, "
            f"iteration) on a traced value cannot be compiled ({e}). Use torch.where instead.") from None
    except Exception as e:  # anything else the body did to a Proxy
        raise CompileError(f"cannot compile {name}: {type(e).__name__}: {e}. {SUPPORTED_HINT}") from None
    finally:
        builtins.print = real_print

    scalars, scalar_of = [], {}
    for node in graph.nodes:
        if node.op == "get_attr" and node.target not in scalar_of:
            t = getattr(tracer.root, node.target)
            _check_closed_tensor(name, t)
            scalar_of[node.target] = len(scalars)
            scalars.append(t)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    uses_param = arity == 2 and len(placeholders[1].users) > 0
    return TracedBody(name, graph, scalars, scalar_of, uses_param, _names_in_code(fn, scalars))


def _names_in_code(fn, tensors: list[torch.Tensor]) -> tuple[str, ...]:
    """The name `fn` reads each of `tensors` by (a closure variable or a global), or "closed-over tensor <i>"."""
    code = getattr(fn, "__code__", None)
    named = []
    if code is not None:
        for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
            with contextlib.suppress(ValueError):  # an empty cell
                named.append((name, cell.cell_contents))
        named += [(n, fn.__globals__[n]) for n in code.co_names if n in fn.__globals__]
    return tuple(next((n for n, v in named if v is t), f"closed-over tensor {i}") for i, t in enumerate(tensors))


def _check_closed_tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise CompileError(f"cannot compile {name}: closes over a {type(t).__name__}; only tensors and numbers")
    if t.layout != torch.strided:
        raise CompileError(f"cannot compile {name}: closed-over tensor has layout {t.layout}; use a dense tensor")
    if t.numel() != 1:
        raise CompileError(
            f"cannot compile {name}: closes over a tensor of shape {tuple(t.shape)}; only 0-dim (one-element) "
            "tensors can be read by the kernel (a scale, a schedule, GradScaler's scale)")
    if t.dtype not in BODY_DTYPES:
        raise CompileError(f"cannot compile {name}: closed-over tensor has dtype {t.dtype}; "
                           f"supported: {', '.join(str(d) for d in BODY_DTYPES)}")


# --- lowering --------------------------------------------------------------------------------------

def _resolve(fxn: fx.Node) -> tuple[str, bool]:
    """(canonical op name, in-place) for a call node; raises CompileError for unsupported targets."""
    if fxn.op == "call_function":
        if fxn.target in _OPERATORS:
            return _OPERATORS[fxn.target], False
        if fxn.target is operator.pos:
            return "pos", False
        if fxn.target is torch.linalg.vector_norm:
            return "vector_norm", False
        if fxn.target is operator.getitem:
            raise CompileError("indexing a traced value is not supported: a hook body is elementwise")
        if fxn.target is getattr:
            raise CompileError(f"attribute access `.{fxn.args[1]}` is not supported: the body must not "
                               "depend on the gradient's shape, dtype or device")
        name = getattr(fxn.target, "__name__", str(fxn.target))
        module = getattr(fxn.target, "__module__", "") or ""
        is_torch = getattr(torch, name, None) is fxn.target or module.startswith("torch._C")
        if not is_torch:
            raise CompileError(f"`{module}.{name}` is not supported in a hook body. {SUPPORTED_HINT}")
        label = f"torch.{name}"
    elif fxn.op == "call_method":
        name, label = fxn.target, f"Tensor.{fxn.target}"
        if name in _CAST_METHODS:
            return name, False
    else:
        raise CompileError(f"`{fxn.op} {fxn.target}` is not supported in a hook body. {SUPPORTED_HINT}")
    inplace = name.endswith("_") and not name.startswith("_")
    base = name[:-1] if inplace else name
    base = _ALIASES.get(base, base)
    if base in ("fill", "zero", "copy") and not inplace:
        base = "?"
    if base not in SIGNATURES:
        raise CompileError(f"`{label}` is not supported in a hook body. {SUPPORTED_HINT}")
    return base, inplace


def _meta(node: Node, shape):
    if node.kind == "const":
        return node.value
    if node.kind == "scalar":
        return torch.empty(node.value_shape, dtype=node.dtype, device="meta")
    return torch.empty(shape if node.full else (), dtype=node.dtype, device="meta")


def lower(body: TracedBody, grad_dtype: torch.dtype, shape=(2,), dtype_known: bool = True) -> tuple[Graph, tuple]:
    """Lower the traced body for gradients of `grad_dtype` and `shape`.

    dtype_known: the gradients are of `grad_dtype` (False at decoration, where it stands for any dtype): refuse
    Python numbers that torch refuses for the values' dtypes, and take a cast to a value's own dtype for the value
    itself, as torch returns it (whether `p.float()` writes through to `p` depends on p's dtype).

    Returns (graph, result_shape). Raises CompileError naming the offending op.
    """
    nodes: list[Node] = []
    metas: dict[int, object] = {}
    checked_dtype = grad_dtype if dtype_known else None
    value_of: dict[str, Node] = {}     # alias root (fx node name) -> current value
    root_of: dict[str, str] = {}       # fx node name -> alias root

    def add(kind, dtype, full, meta, **kw) -> Node:
        n = Node(len(nodes), kind, dtype, full, **kw)
        nodes.append(n)
        metas[n.index] = meta
        if isinstance(meta, torch.Tensor):
            n.shape = tuple(meta.shape)
        return n

    def const(v) -> Node:
        v = bool(v) if isinstance(v, bool) else int(v) if isinstance(v, numbers.Integral) else float(v)
        return add("const", None, False, v, value=v)

    pairs: set[str] = set()  # fx nodes of max(dim)/min(dim): (values, indices), read through .values or [0]

    def arg(a, op):
        if isinstance(a, fx.Node):
            if a.name in pairs:
                raise CompileError(f"cannot compile {body.name}: `{op}` got the (values, indices) pair of max(dim)/"
                                   "min(dim); take its .values (or [0])")
            return value_of[root_of[a.name]]
        if is_number(a):
            return const(a)
        if a is None or isinstance(a, torch.dtype):
            return a
        raise CompileError(f"cannot compile {body.name}: `{op}` got an argument of type {type(a).__name__} "
                           f"({a!r}); arguments must be the gradient, the parameter, traced values, real "
                           "numbers or dtypes")

    placeholders = 0
    result = None
    for fxn in body.graph.nodes:
        if (fxn.op == "call_function" and fxn.target in (getattr, operator.getitem)
                and isinstance(fxn.args[0], fx.Node) and fxn.args[0].name in pairs):
            if fxn.args[1] not in ("values", 0):
                raise CompileError(f"cannot compile {body.name}: the indices of max(dim)/min(dim) are not "
                                   "supported; take its .values (or [0])")
            value_of[fxn.name] = value_of[root_of[fxn.args[0].name]]
            root_of[fxn.name] = fxn.name
            continue
        if fxn.op == "placeholder":
            kind = ("grad", "param")[placeholders]
            placeholders += 1
            n = add(kind, grad_dtype, True, torch.empty(shape, dtype=grad_dtype, device="meta"))
        elif fxn.op == "get_attr":
            index = body.scalar_of[fxn.target]
            t = body.scalars[index]
            n = add("scalar", t.dtype, False, None, value=index)
            n.value_shape = tuple(t.shape)
            metas[n.index] = _meta(n, shape)
            n.shape = n.value_shape
        elif fxn.op == "output":
            out = fxn.args[0]
            if out is None:
                result = value_of[_first_placeholder(body)]
            elif isinstance(out, fx.Node):
                result = arg(out, "return")
            elif is_number(out):
                result = _op_node(add, "full_like", {"input": value_of[_first_placeholder(body)],
                                                      "fill_value": out, "dtype": None}, metas, body, shape,
                                  checked_dtype)
            else:
                kind = next((k.__name__ for k in (tuple, list, dict) if isinstance(out, k)), type(out).__name__)
                raise CompileError(f"cannot compile {body.name}: it returns a {kind}; a hook "
                                   "returns None (in-place body) or one tensor to write into .grad")
            break
        else:
            op, inplace = _resolve_named(body, fxn)
            raw = list(fxn.args)
            if op in _CAST_METHODS:
                op, raw = "to", raw + [_CAST_METHODS[fxn.target]]
            if op == "pos":  # torch.positive returns its operand itself
                if arg(raw[0], "pos").dtype == torch.bool:
                    raise CompileError(f"cannot compile {body.name}: the `+` operator on a bool value is not "
                                       "supported (torch refuses it)")
                root_of[fxn.name] = root_of[raw[0].name]
                continue
            kwargs = dict(fxn.kwargs)
            if op == "norm":  # torch.norm (torch/functional.py) forwards its out=None, dtype=None to a traced tensor
                kwargs = {k: v for k, v in kwargs.items() if not (k in ("out", "dtype") and v is None)}
            if op in ("var", "std") and len(raw) > 1 and isinstance(raw[1], bool):  # var(unbiased), not var(dim)
                kwargs["unbiased"] = raw.pop(1)
            pair = op in ("max", "min") and ("dim" in kwargs or (len(raw) > 1 and is_number(raw[1])))
            if pair:  # max(dim)/min(dim): its values are amax(dim)/amin(dim), NaN included
                dim = kwargs.pop("dim") if "dim" in kwargs else raw.pop(1)
                if isinstance(dim, bool) or not isinstance(dim, int):
                    raise CompileError(f"cannot compile {body.name}: `{op}(dim)` takes one dimension, an int, as "
                                       f"torch's does (amax/amin take a tuple); got {dim!r}")
                kwargs["dim"] = dim
                if len(raw) > 1:  # max(dim, keepdim) positionally
                    if "keepdim" in kwargs or len(raw) > 2:
                        raise CompileError(f"cannot compile {body.name}: `{op}(dim, keepdim)` takes no more "
                                           "arguments")
                    kwargs["keepdim"] = raw.pop(1)
                op = "amax" if op == "max" else "amin"
            try:
                bound = bind(op, tuple(raw), kwargs)
            except TypeError as e:
                raise CompileError(f"cannot compile {body.name}: {e}") from None
            if isinstance(bound.get("dim"), list):
                bound["dim"] = tuple(bound["dim"])
            dim = bound.get("dim")
            if dim is not None and not (isinstance(dim, int) or (isinstance(dim, tuple) and dim
                                                                  and all(isinstance(d, int) for d in dim))):
                raise CompileError(f"cannot compile {body.name}: `{op}` takes dim= as an int or a non-empty tuple "
                                   f"of ints, not {dim!r}")
            for k in NUMBER_ARGS.get(op, ()):
                v = bound.get(k)
                if v is not None and not is_number(v):
                    got = "a tensor" if isinstance(v, fx.Node) else repr(v)
                    raise CompileError(f"cannot compile {body.name}: `{op}` takes `{k}` only as a Python number (a "
                                       f"compile-time constant), not {got}{_NUMBER_ARG_HINTS.get(op, '')}")
            for k in DTYPE_ARGS.get(op, ()):
                v = bound.get(k)
                if v is not None and not isinstance(v, torch.dtype):
                    raise CompileError(f"cannot compile {body.name}: `{op}` takes only a dtype here, got {v!r}")
            if (dtype_known and op == "to" and isinstance(bound["input"], fx.Node)
                    and arg(bound["input"], op).dtype == bound["dtype"]):
                root_of[fxn.name] = root_of[bound["input"].name]  # a cast to its own dtype returns the tensor itself
                continue
            args = {}
            for k, v in bound.items():
                if k in NUMBER_ARGS.get(op, ()) or k in DTYPE_ARGS.get(op, ()) or k == "rounding_mode":
                    args[k] = v
                elif k in OPTION_ARGS.get(op, ()):
                    if isinstance(v, fx.Node):
                        raise CompileError(f"cannot compile {body.name}: `{op}` needs a Python value for `{k}`")
                    args[k] = v
                else:
                    args[k] = arg(v, op)
            if not isinstance(args.get("input"), Node) and op != "where":
                if op not in OPERATOR_OPS or not isinstance(args.get("other"), Node):
                    raise CompileError(f"cannot compile {body.name}: `{op}` needs a tensor argument")
            if op == "pow" and not isinstance(args["input"], Node):
                raise CompileError(f"cannot compile {body.name}: pow with a tensor exponent is not supported")
            if op == "pow" and not args["input"].dtype.is_floating_point:
                raise CompileError(f"cannot compile {body.name}: pow of a {args['input'].dtype} value is not "
                                   "supported; convert it with .float() first")
            if args.get("rounding_mode") is not None:
                raise CompileError(f"cannot compile {body.name}: div(rounding_mode={args['rounding_mode']!r}) "
                                   "is not supported; only true division")
            n = _op_node(add, op, args, metas, body, shape, checked_dtype)
            if pair:
                pairs.add(fxn.name)
            if inplace:
                root = root_of[fxn.args[0].name]
                target = value_of[root]
                if target.kind == "param":
                    raise CompileError(f"cannot compile {body.name}: `{fxn.target}` writes to the parameter; "
                                       "the parameter is read-only in a hook (write the gradient instead)")
                if target.kind == "scalar":
                    raise CompileError(f"cannot compile {body.name}: `{fxn.target}` writes to a closed-over "
                                       "tensor; a hook body may only write the gradient")
                _check_inplace(body, fxn.target, metas[target.index], metas[n.index])
                if n.full != target.full and not target.full:
                    raise CompileError(f"cannot compile {body.name}: `{fxn.target}` would broadcast into a scalar")
                if n.dtype != target.dtype:
                    n = _op_node(add, "to", {"input": n, "dtype": target.dtype}, metas, body, shape,
                                     checked_dtype)
                value_of[root] = n
                root_of[fxn.name] = root
                continue
        value_of[fxn.name] = n
        root_of[fxn.name] = fxn.name

    if result.dtype not in BODY_DTYPES:
        raise CompileError(f"cannot compile {body.name}: the result has dtype {result.dtype}")
    result_meta = metas[result.index]
    result_shape = tuple(result_meta.shape) if isinstance(result_meta, torch.Tensor) else ()
    scalar_dtypes = tuple(t.dtype for t in body.scalars)
    graph = Graph(grad_dtype, nodes, result, scalar_dtypes, body.uses_param, body.scalar_names)
    return graph, result_shape


def _first_placeholder(body: TracedBody) -> str:
    return next(n.name for n in body.graph.nodes if n.op == "placeholder")


def _resolve_named(body: TracedBody, fxn: fx.Node) -> tuple[str, bool]:
    try:
        return _resolve(fxn)
    except CompileError as e:
        raise CompileError(f"cannot compile {body.name}: {e}") from None


def _op_node(add, op: str, args: dict, metas: dict, body: TracedBody, shape, checked_dtype) -> Node:
    """The node of `op` on `args`; checked_dtype: the gradients' dtype, for `_check_numbers_fit` (None: unchecked)."""
    meta_args = {k: (metas[v.index] if isinstance(v, Node) else v) for k, v in args.items()}
    try:
        out = eager(op, meta_args)
    except Exception as e:
        raise CompileError(f"cannot compile {body.name}: `{op}` failed on these arguments: {e}") from None
    if checked_dtype is not None:
        _check_numbers_fit(body, op, args, out.dtype, checked_dtype)
    if out.dtype not in BODY_DTYPES:
        raise CompileError(f"cannot compile {body.name}: `{op}` gives dtype {out.dtype}; values in a hook body "
                           f"may be {', '.join(str(d).removeprefix('torch.') for d in BODY_DTYPES)}")
    full = (any(v.full for v in args.values() if isinstance(v, Node)) and not is_reduction(op, args)
            and tuple(out.shape) == tuple(shape))
    if is_reduction(op, args):
        if op in ("norm", "vector_norm"):
            try:
                reduction_spec(Node(0, "op", out.dtype, False, op=op, args=args))
            except ValueError as e:
                raise CompileError(f"cannot compile {body.name}: {e}") from None
    tensors = [v for v in args.values() if isinstance(v, Node) and v.kind != "const"]
    op_dtype = out.dtype
    if op in TESTS:
        op_dtype = tensors[0].dtype
    elif computes_in_operand_dtype(op) or op in ("minimum", "maximum"):
        operands = [meta_args[k] for k in ("input", "other") if k in meta_args]
        op_dtype = torch.result_type(*operands) if len(operands) == 2 else operands[0].dtype
    return add("op", out.dtype, full, out, op=op, args=args, op_dtype=op_dtype)


def _check_numbers_fit(body: TracedBody, op: str, args: dict, dtype: torch.dtype, grad_dtype: torch.dtype) -> None:
    """Refuse Python-number arguments of `op` (result `dtype`) that torch refuses for these operand dtypes ("value
    cannot be converted to type ... without overflow": clamp bounds, where branches, fill values, alpha, exponents)."""
    if is_reduction(op, args) or op == "unsqueeze":
        return
    numbers = {k: v.value if isinstance(v, Node) else v for k, v in args.items()
               if (isinstance(v, Node) and v.kind == "const") or is_number(v)}
    if not numbers:
        return
    operands = tuple((k, ("tensor", v.dtype, (2,) if v.full else (1,) * len(v.shape))
                      if isinstance(v, Node) and v.kind != "const" else
                      ("value", type(v.value), v.value) if isinstance(v, Node) else ("value", type(v), v))
                     for k, v in args.items())
    error = _torch_refuses(op, operands)
    if error is None:
        return
    shown = ", ".join(f"{k}={v!r}" for k, v in numbers.items())
    if dtype.is_floating_point:
        fit = f" (at most {torch.finfo(dtype).max:g} in magnitude, or an infinity)"
    else:
        fit = f" ({torch.iinfo(dtype).min} to {torch.iinfo(dtype).max})" if dtype != torch.bool else ""
    raise CompileError(f"cannot compile {body.name} for {grad_dtype} gradients: `{op}` with {shown} on a {dtype} "
                       f"value: torch raises ({error}); use numbers a {dtype} value can hold{fit}")


@functools.lru_cache(maxsize=1024)
def _torch_refuses(op: str, operands: tuple) -> str | None:
    """torch's error when it runs `op` on real CPU tensors of these dtypes and shapes with these numbers (it checks
    that a number fits the computation's dtype only on real tensors, a fill only of more than one element), or None.
    operands: (argument, ("tensor", dtype, shape) or ("value", type, value)) pairs."""
    try:
        eager(op, {k: torch.zeros(spec[2], dtype=spec[1]) if spec[0] == "tensor" else spec[2] for k, spec in operands})
    except RuntimeError as e:
        return str(e)
    return None


def _check_inplace(body: TracedBody, method: str, target_meta, out_meta) -> None:
    """Refuse in-place ops that torch itself refuses (a float result into a bool value, broadcasting)."""
    if not torch.can_cast(out_meta.dtype, target_meta.dtype):
        raise CompileError(f"cannot compile {body.name}: `{method}` would store a {out_meta.dtype} result "
                           f"into a {target_meta.dtype} value, which torch refuses")
    if torch.broadcast_shapes(out_meta.shape, target_meta.shape) != target_meta.shape:
        raise CompileError(f"cannot compile {body.name}: `{method}` result of shape {tuple(out_meta.shape)} "
                           f"does not fit a value of shape {tuple(target_meta.shape)}")
