"""The public API: `grad_hook`, the compiled hook object, registration and handles."""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from . import codegen, runtime
from .ir import STAT_NAMES, Graph
from .layout import flat_span
from .plan import DEFAULT_HIST_RANGE, Plan, make_plan
from .stats import HookStats
from .trace import CompileError, TracedBody, lower, trace


def _identity(grad):
    return None


def _parse_stats(option, what: str) -> tuple[str, ...]:
    if option is None:
        return ()
    if not isinstance(option, (str, list, tuple, set, frozenset)):
        raise TypeError(f"{what}= takes a statistic name, a sequence of names or 'all'; got {option!r}")
    names = (option,) if isinstance(option, str) else tuple(option)
    if not all(isinstance(n, str) for n in names):
        raise TypeError(f"{what}= takes statistic names (strings); got {option!r}")
    if "all" in names:
        names = STAT_NAMES + tuple(n for n in names if n == "hist")
    unknown = [n for n in names if n not in STAT_NAMES + ("hist",)]
    if unknown:
        raise ValueError(f"unknown statistic {unknown[0]!r} in {what}=; known: {', '.join(STAT_NAMES)}, hist, "
                         "or 'all' (every one but hist)")
    order = {name: i for i, name in enumerate(STAT_NAMES + ("hist",))}
    return tuple(sorted(set(names), key=order.get))  # the stats row layout follows STAT_NAMES


#: Bucket size of a multi-tensor registration, in MB of gradients. Not yet measured on a GPU (no GPU run so
#: far): 25 MB, DDP's default, amortises a launch over microseconds of memory traffic.
DEFAULT_BUCKET_MB = 25


def _parse_hist_range(hist_range) -> tuple[int, int]:
    if hist_range is None:
        return DEFAULT_HIST_RANGE
    lo, hi = hist_range
    if not (isinstance(lo, int) and isinstance(hi, int) and -126 <= lo < hi <= 128):
        raise ValueError(f"hist_range=(lo, hi) takes integer exponents with -126 <= lo < hi <= 128 "
                         f"(bins of floor(log2|g|)); got {hist_range!r}")
    return lo, hi


@dataclass
class _Entry:
    """A parameter this hook fires on: a weak reference and its stats row."""

    ref: weakref.ref
    name: str
    row: int
    checked_shape: tuple | None = None
    bucket_bytes: int = 0  # > 0: processed in buckets of this many gradient bytes (see GradHook._enqueue)
    #: (data_ptr, _version) of the gradient when the hook last processed it: its statistics row describes that
    #: gradient only while both are unchanged (zero_grad(set_to_none=False) or any in-place op changes them)
    measured: tuple | None = None


@dataclass
class BackwardPlan:
    """What one backward costs for a hook's registered tensors (see GradHook.explain)."""

    launches_per_backward: int
    text: str

    def __str__(self) -> str:
        return self.text


@dataclass
class _Compiled:
    plan: Plan
    kernel: object  # the @triton.jit kernel, or None for the reference backend


class GradHook:
    """A gradient hook compiled into one in-place kernel per gradient.

    Called with a parameter (as torch calls post-accumulate-grad hooks), it processes `param.grad`
    in place and returns None. Without a body function it is a statistics-only hook that also works
    as a decorator: called with a function it returns a new hook with the same options.
    """

    def __init__(self, fn=None, *, stats=(), input_stats=(), backend: str | None = None,
                 scaler=None, optimizer=None, hist_range: tuple[int, int] | None = None):
        self.fn = fn
        self.stat_names = _parse_stats(stats, "stats")
        self.input_stat_names = _parse_stats(input_stats, "input_stats")
        if backend not in (None, "auto", "triton", "reference"):
            raise ValueError(f"backend must be 'auto', 'triton' or 'reference', not {backend!r}")
        self.backend = backend
        self.hist_range = _parse_hist_range(hist_range)
        if (scaler is None) != (optimizer is None):
            raise ValueError("scaler= and optimizer= go together: the hook unscales the gradients for that "
                             "optimizer's step (scaler.step(optimizer) then neither unscales again nor steps "
                             "on NaN/Inf)")
        if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
            raise TypeError(f"scaler= takes a torch.amp.GradScaler, not {type(scaler).__name__}")
        self.scaler, self.optimizer = scaler, optimizer
        self._found_inf: dict[torch.device, torch.Tensor] = {}
        self._paused = False
        self._flush_queued = False
        self._pending: dict[tuple, dict[int, torch.Tensor]] = {}
        self._pending_bytes: dict[tuple, int] = {}
        if fn is not None and not callable(fn):
            raise TypeError(f"grad_hook takes a function, not {type(fn).__name__}")
        self._body: TracedBody = trace(fn if fn is not None else _identity)
        lower(self._body, torch.float32)  # every "cannot compile" error surfaces now, at decoration
        self.stats = HookStats(self.stat_names, self.input_stat_names, self.hist_range)
        self._graphs: dict[torch.dtype, Graph] = {}
        self._compiled: dict[tuple, _Compiled] = {}
        self._entries: dict[int, _Entry] = {}
        self._workspaces: dict[torch.device, runtime.Workspace] = {}
        if fn is not None:
            functools.update_wrapper(self, fn, updated=())
        else:
            self.__name__ = "stats_only_hook"

    # --- calling ----------------------------------------------------------------------------------

    def __call__(self, arg):
        if isinstance(arg, torch.Tensor):
            if not self._paused:
                self._fire(arg)
            return None
        if self.fn is None and callable(arg):
            return GradHook(arg, stats=self.stat_names, input_stats=self.input_stat_names, backend=self.backend,
                            scaler=self.scaler, optimizer=self.optimizer, hist_range=self.hist_range)
        raise TypeError(f"a compiled hook is called with a parameter tensor (as torch does), not "
                        f"{type(arg).__name__}")

    def _fire(self, param: torch.Tensor) -> None:
        grad = param.grad
        if grad is None:
            return
        entry = self._entries.get(id(param))
        if entry is None or entry.ref() is not param:
            entry = self._add(self._auto_name(), param)  # registered through torch directly
        compiled = self._compiled.get((grad.dtype, grad.device))
        if compiled is None:
            compiled = self._compile(grad.dtype, grad.device)
        if entry.checked_shape != grad.shape:
            self._check_shape(entry.name, grad)
            entry.checked_shape = grad.shape
        stats_row = self.stats.row(entry.row) if compiled.plan.slots else None
        amp = self._amp_tensors(grad.device) if compiled.plan.amp else None
        runtime.fire(compiled.plan, compiled.kernel, grad, param, self._body.scalars, stats_row,
                     self._workspace(grad.device), amp)
        entry.measured = (grad.data_ptr(), grad._version)

    def _amp_tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(scale, found_inf) for this iteration; marks the optimizer as unscaled in the scaler's books,
        as scaler.unscale_(optimizer) would, so that scaler.step() neither unscales again nor steps on
        NaN/Inf, and scaler.update() backs off as usual. Host bookkeeping only: no sync."""
        from torch.amp.grad_scaler import OptState

        scaler = self.scaler
        state = scaler._per_optimizer_states[id(self.optimizer)]
        if state["stage"] is OptState.READY:
            if scaler._scale is None:
                raise RuntimeError("the GradScaler has no scale yet: call scaler.scale(loss) before backward")
            self._check_covers_optimizer()
            state["stage"] = OptState.UNSCALED
            state["fusedhooks"] = True
        elif state["stage"] is OptState.STEPPED or not state.get("fusedhooks"):
            raise RuntimeError("a hook with scaler= unscales the gradients itself: do not call "
                               "scaler.unscale_(optimizer), and call scaler.update() after scaler.step()")
        found = state["found_inf_per_device"].get(device)
        if found is None:
            found = self._found_inf.get(device)
            if found is None:
                found = self._found_inf[device] = torch.zeros(1, dtype=torch.float32, device=device)
            else:
                found.zero_()
            state["found_inf_per_device"][device] = found
        return scaler._scale, found

    def _check_covers_optimizer(self) -> None:
        registered = {id(e.ref()) for e in self._entries.values() if e.ref() is not None}
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad and id(p) not in registered:
                    raise RuntimeError("with scaler=, the hook unscales for the whole optimizer: register it on "
                                       "every parameter the optimizer steps (a parameter of shape "
                                       f"{tuple(p.shape)} is not registered)")

    # --- compiling --------------------------------------------------------------------------------

    def _graph(self, dtype: torch.dtype) -> Graph:
        graph = self._graphs.get(dtype)
        if graph is None:
            graph, _ = lower(self._body, dtype)
            self._graphs[dtype] = graph
        return graph

    def _compile(self, dtype: torch.dtype, device: torch.device) -> _Compiled:
        for i, s in enumerate(self._body.scalars):
            if s.device != device and not (device.type == "cpu" and s.device.type == "cpu"):
                raise ValueError(f"{self.__name__}: closed-over tensor {i} is on {s.device} but the gradient is on "
                                 f"{device}; move it to {device} (the kernel reads it there, with no copy)")
        backend = runtime.choose_backend(device, self.backend)
        plan = make_plan(self._graph(dtype), self.stat_names, self.input_stat_names, backend=backend,
                         amp=self._amp, hist_range=self.hist_range)
        kernel = codegen.load(codegen.generate(plan, device.type)) if backend == "triton" else None
        compiled = _Compiled(plan, kernel)
        self._compiled[(dtype, device)] = compiled
        return compiled

    def _check_shape(self, name: str, t: torch.Tensor) -> None:
        _, result_shape = lower(self._body, t.dtype, tuple(t.shape))
        if torch.broadcast_shapes(result_shape, t.shape) != t.shape:
            raise CompileError(f"{self.__name__}: the body's result has shape {result_shape}, which does not "
                               f"broadcast to the gradient of {name} (shape {tuple(t.shape)})")

    def _workspace(self, device: torch.device) -> runtime.Workspace:
        ws = self._workspaces.get(device)
        if ws is None:
            ws = self._workspaces[device] = runtime.Workspace(device)
        return ws

    # --- registration -----------------------------------------------------------------------------

    def register(self, target, name: str | None = None, bucket_mb: float | None = None) -> RegistrationHandle:
        """Fire on the gradient of `target` after each accumulation.

        target: a leaf Tensor that requires grad (keyed by `name`, or "param<i>"), an nn.Module (every
        parameter with requires_grad; `name` prefixes their names), or an iterable of Tensors or
        (name, Tensor) pairs. Returns a handle with `remove()`, also a context manager.
        Everything is checked before anything is registered.

        bucket_mb: several tensors (a module, an iterable) are processed in buckets: gradients are
        collected in backward order and each bucket of about `bucket_mb` MB (default DEFAULT_BUCKET_MB)
        goes in one launch per pass; what is left is processed when backward ends, so `.grad` is final
        when `backward()` returns. 0 processes each gradient at its own firing. A single tensor is never
        bucketed.
        """
        if bucket_mb is not None and not (isinstance(bucket_mb, (int, float)) and bucket_mb >= 0):
            raise ValueError(f"bucket_mb must be a number >= 0, not {bucket_mb!r}")
        pairs = list(self._targets(target, name))
        seen, names = set(), set()
        active = {e.name for e in self._entries.values() if e.ref() is not None}
        for pname, t in pairs:
            _check_param(pname, t)
            entry = self._entries.get(id(t))
            if entry is not None and entry.ref() is t:
                raise ValueError(f"{entry.name!r} is already registered with this hook (the same tensor)")
            if id(t) in seen:
                raise ValueError(f"{pname}: this tensor is already registered in this same register() call")
            if pname in names or pname in active:
                raise ValueError(f"a parameter named {pname!r} is already registered with this hook; "
                                 "pass a different name=")
            seen.add(id(t))
            names.add(pname)
            self._compile(t.dtype, t.device) if (t.dtype, t.device) not in self._compiled else None
            self._check_shape(pname, t)
            if self.stats.device is not None and self.stats.device != t.device and self.stats.slot_names:
                raise ValueError(f"{pname} is on {t.device} but this hook records statistics on "
                                 f"{self.stats.device}; register parameters of another device with another hook")
        handle = RegistrationHandle(self)
        bucketed = not isinstance(target, torch.Tensor) and bucket_mb != 0
        bucket_bytes = int((DEFAULT_BUCKET_MB if bucket_mb is None else bucket_mb) * 2**20) if bucketed else 0
        for pname, t in pairs:
            entry = self._add(pname, t)
            entry.checked_shape = t.shape  # checked above
            entry.bucket_bytes = max(bucket_bytes, 1) if bucketed else 0
            handle._add(t, t.register_post_accumulate_grad_hook(self._enqueue if bucketed else self))
        return handle

    # --- buckets ----------------------------------------------------------------------------------

    def _enqueue(self, param: torch.Tensor) -> None:
        """The torch hook of a bucketed parameter: collect its gradient; launch when the bucket is full."""
        if self._paused or param.grad is None:
            return
        if not self._flush_queued:
            try:  # run _flush_all once this backward has written every .grad
                torch.autograd.Variable._execution_engine.queue_callback(self._flush_all)
            except RuntimeError:  # not inside a backward (called by hand): process it now
                self._fire(param)
                return
            self._flush_queued = True
        grad = param.grad
        key = (grad.device, grad.dtype)
        bucket = self._pending.setdefault(key, {})
        if id(param) in bucket:  # fired again in this backward (reentrant checkpointing): processed once
            return
        bucket[id(param)] = param
        self._pending_bytes[key] = self._pending_bytes.get(key, 0) + grad.numel() * grad.element_size()
        entry = self._entries.get(id(param))
        if entry is not None and self._pending_bytes[key] >= entry.bucket_bytes:
            self._flush(key)

    def _flush_all(self) -> None:
        self._flush_queued = False
        for key in list(self._pending):
            self._flush(key)

    def _flush(self, key) -> None:
        """Process the pending gradients of (device, dtype) `key`: one launch per pass for those that can
        share it, the others (empty, not dense, another backend) one by one."""
        params = list(self._pending.pop(key, {}).values())
        self._pending_bytes.pop(key, None)
        if not params:
            return
        device, dtype = key
        compiled = self._compiled.get(key) or self._compile(dtype, device)
        plan, together = compiled.plan, []
        for p in params:
            entry = self._entries.get(id(p))
            grad = p.grad
            if entry is None or entry.ref() is not p or grad is None:
                continue
            shareable = (plan.backend == "triton" and grad.numel() > 0 and flat_span(grad) is not None
                         and entry.checked_shape == grad.shape
                         and (not plan.graph.uses_param or (p.stride() == grad.stride() and flat_span(p) is not None)))
            if shareable:
                together.append((grad, p, entry.row))
                self.stats.row(entry.row)  # marks it fired
            else:
                self._fire(p)
        if together:
            amp = self._amp_tensors(device) if plan.amp else None
            runtime.fire_bucket(plan, compiled.kernel, together, self._body.scalars,
                                self.stats.tensor if plan.slots else None, self._workspace(device), amp)
            for grad, p, _ in together:
                self._entries[id(p)].measured = (grad.data_ptr(), grad._version)

    def explain(self) -> BackwardPlan:
        """Launches per backward for the tensors this hook is registered on (an upper bound)."""
        groups: dict[tuple, list] = {}
        for e in self._entries.values():
            t = e.ref()
            if t is not None:
                groups.setdefault((t.device, t.dtype, e.bucket_bytes), []).append(t)
        lines, total = [], 0
        for (device, dtype, bucket_bytes), tensors in groups.items():
            plan = self.plan(numel=1 << 30, dtype=dtype, device=device)
            passes = plan.levels + 1
            nbytes = sum(t.numel() * t.element_size() for t in tensors)
            if bucket_bytes:
                buckets = nbytes // bucket_bytes + 1
                launches = buckets * passes
                how = f"at most {buckets} bucket(s) of {bucket_bytes / 2**20:g} MB x {passes} pass(es)"
            else:
                launches = sum(self.plan(numel=t.numel(), dtype=dtype, device=device).launches for t in tensors)
                how = "one firing per tensor"
            total += launches
            lines.append(f"  {device} {str(dtype).removeprefix('torch.')}: {len(tensors)} tensors, "
                         f"{nbytes / 2**20:.2f} MB of gradients, {how}: <= {launches} launches")
        return BackwardPlan(total, "\n".join([f"fusedhooks backward plan: <= {total} launches per backward"]
                                             + lines))

    @contextlib.contextmanager
    def paused(self):
        """Within this block the hook does nothing (gradient accumulation: clip and record statistics once,
        on the accumulated gradient of the last micro-batch, outside the block)."""
        previous, self._paused = self._paused, True
        try:
            yield self
        finally:
            self._paused = previous

    def _targets(self, target, name):
        if isinstance(target, torch.nn.Module):
            prefix = f"{name}." if name else ""
            yield from ((prefix + n, p) for n, p in target.named_parameters() if p.requires_grad)
        elif isinstance(target, torch.Tensor):
            yield (name or self._auto_name(), target)
        elif isinstance(target, Iterable) and not isinstance(target, (str, bytes)):
            taken = []
            for item in target:
                if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
                    yield item
                elif isinstance(item, torch.Tensor):
                    taken.append(self._auto_name(taken))
                    yield (taken[-1], item)
                else:
                    raise TypeError(f"register() takes Tensors or (name, Tensor) pairs; got {type(item).__name__}")
        else:
            raise TypeError(f"register() takes a Tensor, an nn.Module or an iterable of them, "
                            f"not {type(target).__name__}")

    def _auto_name(self, taken=()) -> str:
        """"param<i>": i counts registrations, skipping names already in use."""
        i = len(self.stats.names) + len(taken)
        while f"param{i}" in self.stats.names or f"param{i}" in taken:
            i += 1
        return f"param{i}"

    def _add(self, name: str, t: torch.Tensor) -> _Entry:
        _check_param(name, t)
        if name in self.stats.names and not any(e.name == name for e in self._entries.values()):
            row = self.stats.names.index(name)  # a parameter registered again after remove()
        else:
            row = self.stats.add_row(name, t.device)
        entry = _Entry(weakref.ref(t), name, row)
        self._entries[id(t)] = entry
        return entry

    def _remove(self, t: torch.Tensor) -> None:
        entry = self._entries.get(id(t))
        if entry is not None and entry.ref() is t:
            del self._entries[id(t)]

    # --- introspection ----------------------------------------------------------------------------

    def plan(self, numel: int | None = None, dtype: torch.dtype = torch.float32, device=None) -> Plan:
        """The kernel plan for a gradient of `numel` elements and `dtype` (device: default CUDA if present)."""
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        backend = runtime.choose_backend(device, self.backend)
        module = None
        if backend == "triton" and numel and runtime.tuning.cache_path().exists():  # a tuned BLOCK applies
            module = (self._compiled.get((dtype, device)) or self._compile(dtype, device)).kernel
        block = runtime.launch_config(numel, device.type, module, device)[0] if numel else None
        return make_plan(self._graph(dtype), self.stat_names, self.input_stat_names, numel, backend,
                         amp=self._amp, hist_range=self.hist_range, block=block)

    def source(self, dtype: torch.dtype = torch.float32, device_type: str = "cuda") -> str:
        """The generated Triton source for gradients of `dtype`."""
        plan = make_plan(self._graph(dtype), self.stat_names, self.input_stat_names, amp=self._amp,
                         hist_range=self.hist_range)
        return codegen.generate(plan, device_type)

    @property
    def _amp(self) -> bool:
        return self.scaler is not None and self.scaler.is_enabled()

    def __repr__(self) -> str:
        return (f"<fusedhooks.GradHook {self.__name__} stats={list(self.stat_names)} "
                f"input_stats={list(self.input_stat_names)} on {len(self._entries)} tensors>")


def _check_param(name: str, t) -> None:
    """Refuse what torch would refuse, and what a hook cannot process, before any backward runs."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise TypeError(f"{name}: {t.layout} tensors are not supported; gradient hooks process dense gradients")
    if not t.dtype.is_floating_point or t.dtype not in (torch.float16, torch.bfloat16, torch.float32,
                                                         torch.float64):
        raise TypeError(f"{name}: dtype {t.dtype} is not supported; gradients must be float16, bfloat16, "
                        "float32 or float64")
    if not t.requires_grad:
        raise ValueError(f"{name}: cannot register a hook on a tensor that doesn't require grad")
    if not t.is_leaf:
        raise ValueError(f"{name}: is not a leaf tensor; gradient hooks fire on leaf tensors (parameters) "
                         "after their .grad is accumulated")


class RegistrationHandle:
    """What `register` returns: `remove()` stops the hook on those tensors; usable as a context manager."""

    def __init__(self, hook: GradHook):
        self.hook = hook
        self._items: list[tuple[weakref.ref, object]] = []

    def _add(self, t: torch.Tensor, torch_handle) -> None:
        self._items.append((weakref.ref(t), torch_handle))

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [t for ref, _ in self._items if (t := ref()) is not None]

    def remove(self) -> None:
        for ref, torch_handle in self._items:
            torch_handle.remove()
            t = ref()
            if t is not None:
                self.hook._remove(t)
        self._items.clear()

    def __enter__(self) -> RegistrationHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def __len__(self) -> int:
        return len(self._items)


def grad_hook(fn=None, *, stats=(), input_stats=(), backend: str | None = None, scaler=None, optimizer=None,
              hist_range: tuple[int, int] | None = None) -> GradHook:
    """Compile `fn(grad[, param])` into a fused in-place gradient hook.

    Use bare (`@fh.grad_hook`), with options (`@fh.grad_hook(stats=("norm",))`), or without a function
    for a statistics-only hook. stats / input_stats: statistic names, "hist", or "all", measured after /
    before the body. backend: "auto" (default), "triton" or "reference" (see README, environment variables).
    scaler, optimizer: a torch.amp.GradScaler and the optimizer it steps: the body sees the unscaled
    gradient and the scaler's books are kept (see README, AMP). hist_range: (lo, hi) exponents of the
    "hist" bins, default (-40, 8).
    """
    return GradHook(fn, stats=stats, input_stats=input_stats, backend=backend, scaler=scaler,
                    optimizer=optimizer, hist_range=hist_range)
