"""The public API: `grad_hook` and the compiled hook object, a facade over the rooms below (DESIGN.md, Architecture):
its options, decoration, `register` (registration/), `stats`, `plan`/`explain`, and the firing's entry points."""

from __future__ import annotations

import contextlib
import functools
import math
import weakref

import torch
from torch.compiler import is_compiling as _is_compiling  # a call by hand may be traced by an export too (see ops)

from .codegen import generate
from .compiler import dims
from .compiler.ir import ALL_STAT_NAMES, MOMENT_STATS, STAT_NAMES, Graph
from .compiler.plan import DEFAULT_HIST_RANGE, Plan, make_plan
from .compiler.trace import CompileError, TracedBody, lower, trace
from .firing import amp, optable, sequence, shards
from .firing.buckets import Buckets, FiringCalls
from .firing.dispatch import Dispatch
from .firing.registry import Entry, RegistrationHandle, Registry
from .firing.traced import TracedFiring
from .registration import ddp
from .registration.register import Registration, check_dtype, steps_in_backward
from .runtime import launcher, process_groups
from .runtime.compilation import BackwardPlan, Compiled, HookCompilation, Workspaces
from .stats.buffer import HookStats
from .stats.merge import partial_stats

# read at every call of a hook: bound once
_graph_task_id, _grad_enabled = torch._C._current_graph_task_id, torch.is_grad_enabled


#: the shape a body is first lowered for, at decoration
REPRESENTATIVE_SHAPE = (3, 3, 3, 3, 3, 3)


def _weak_method(obj, name: str):
    """`getattr(obj, name)` called through a weak reference to `obj` (handed to what `obj` holds: no cycle)."""
    ref = weakref.ref(obj)

    def call(*args):
        return getattr(ref(), name)(*args)
    return call


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
        names = STAT_NAMES + tuple(n for n in names if n != "all")  # with "hist", "skew", "kurtosis" if named
    unknown = [n for n in names if n not in ALL_STAT_NAMES + ("hist",)]
    if unknown:
        raise ValueError(f"unknown statistic {unknown[0]!r} in {what}=; known: {', '.join(ALL_STAT_NAMES)}, hist, "
                         f"or 'all' (every one but {', '.join(MOMENT_STATS)} and hist)")
    order = {name: i for i, name in enumerate(ALL_STAT_NAMES + ("hist",))}
    return tuple(sorted(set(names), key=order.get))  # the stats row layout follows ALL_STAT_NAMES


def _parse_hist_range(hist_range) -> tuple[int, int]:
    if hist_range is None:
        return DEFAULT_HIST_RANGE
    if not (isinstance(hist_range, (tuple, list)) and len(hist_range) == 2
            and all(isinstance(e, int) and not isinstance(e, bool) for e in hist_range)):
        raise ValueError(f"hist_range= takes two integer exponents (lo, hi), bins of floor(log2|g|) from lo to "
                         f"hi - 1; got {hist_range!r}")
    lo, hi = hist_range
    if not -126 <= lo < hi <= 128:
        raise ValueError(f"hist_range=(lo, hi) takes integer exponents with -126 <= lo < hi <= 128 "
                         f"(bins of floor(log2|g|)); got {hist_range!r}")
    return lo, hi


class GradHook:
    """A gradient hook compiled into one in-place kernel per gradient.

    Called with a parameter (as torch calls post-accumulate-grad hooks), it processes `param.grad`
    in place and returns None. Without a body function it is a statistics-only hook that also works
    as a decorator: called with a function it returns a new hook with the same options.
    """

    #: the traced body depends on the gradient's shape (a subclass's `_body_for`, such as `fh.agc`'s, by rank): it
    #: is lowered and planned for each gradient shape, as a body that reduces over dimensions is
    body_per_shape = False

    def __init__(self, fn=None, *, stats=(), input_stats=(), backend: str | None = None,
                 scaler=None, optimizer=None, hist_range: tuple[int, int] | None = None):
        self.fn = fn
        self.stat_names = _parse_stats(stats, "stats")
        self.input_stat_names = _parse_stats(input_stats, "input_stats")
        if backend is not None:
            launcher.check_backend(backend)
        self.backend = backend
        self.hist_range = _parse_hist_range(hist_range)
        if (scaler is None) != (optimizer is None):
            raise ValueError("scaler= and optimizer= go together: the hook unscales the gradients for that "
                             "optimizer's step (scaler.step(optimizer) then neither unscales again nor steps "
                             "on NaN/Inf)")
        if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
            raise TypeError(f"scaler= takes a torch.amp.GradScaler, not {type(scaler).__name__}")
        self.scaler, self.optimizer = scaler, optimizer
        if fn is not None and not callable(fn):
            raise TypeError(f"grad_hook takes a function, not {type(fn).__name__}")
        self._body: TracedBody = trace(fn if fn is not None else _identity)
        # every "cannot compile" error surfaces now, at decoration (of a body that reduces over dimensions: those
        # that hold for a 6-d gradient; its fit to each parameter's shape is checked at register), except Python
        # numbers the gradient's dtype cannot hold: checked at register (or plan), for each gradient's dtype
        graph, _ = lower(self._body, torch.float32, REPRESENTATIVE_SHAPE, dtype_known=False)
        #: the body reduces over some dimensions (or depends on the shape: `body_per_shape`): it is lowered and
        #: planned for each gradient shape
        self.reduces_over_dims = graph.reduces_over_dims or self.body_per_shape
        if self.stat_names:  # fh.clip_grad_norm_ may read them: a norm recorded before GradScaler.unscale_ must
            amp.install()    # not look current after it
        self.stats = HookStats(self.stat_names, self.input_stat_names, self.hist_range)
        self.registry = Registry(self.stats)
        #: what a traced call of fusedhooks::clip_grad_norm_ names this hook by (see ops.py, optable.py); the firing
        #: operators name `traced` by its own key
        self.op_key = optable.add(self)
        if fn is not None:
            functools.update_wrapper(self, fn, updated=())
        else:
            self.__name__ = "stats_only_hook"
        #: the plans and kernels, compiled on first use for each dtype, device (and shape) and cached
        self.compilation = HookCompilation(
            _weak_method(self, "_body_for"), self._body.scalars, reduces_over_dims=self.reduces_over_dims,
            stats=(self.stat_names, self.input_stat_names),
            shard_stats=(partial_stats(self.stat_names), partial_stats(self.input_stat_names)),
            hist_range=self.hist_range, backend=self.backend, amp=self._amp, name=self.__name__)
        #: this hook's scratch on each device, per thread
        self.workspaces = Workspaces()
        #: the GradScaler books of scaler= (None without it)
        self.amp = None if scaler is None else amp.HookAmp(scaler, optimizer, self.__name__, self.op_key,
                                                            self.registry)
        #: the firing sequence (`sequence.Firing`): one gradient, a bucket and a shard all run it; AMP's tensors and
        #: books from `amp` (only a hook with a scaler has plans that unscale)
        self.firing = sequence.Firing(self.stats, self._body.scalars, self._body.check_scalars,
                                      None if self.amp is None else self.amp.tensors)
        # the rooms below, handed the parts they need (never the hook); the calls into the firing come with each
        # registration (`firing_calls`)
        #: end-of-backward buckets, and how a bucket of gradients (DDP's too) is processed together
        self._buckets = Buckets(self.stats, self.firing, self.compilation, self.workspaces)
        #: the checks, entries and torch hooks of `register` (see registration/register.py)
        self.registration = Registration(self.registry, self.compilation, self._buckets)
        #: the statistics of sharded (FSDP2) parameters, merged across ranks when a backward ends
        self._shards = shards.ShardStats(self.stats, self.compilation, self.workspaces, self._body.check_scalars,
                                         self.registration.check_sharded)
        #: the eager firing, one gradient at a time (`fire`, `process`; see firing/dispatch.py), and the pause flag
        self.dispatch = Dispatch(self.registry, self.registration.add_at_firing, self.compilation, self.workspaces,
                                 self.firing, self._shards, self._buckets.process_at_firing)
        #: the firing while torch.compile traces a torch hook, and what the fusedhooks operators call (firing/traced.py)
        self.traced = TracedFiring(self.dispatch, self.registry, self.stats, self.amp, self.compilation,
                                   self._body.scalars, self._body.check_scalars)

    # --- calling ----------------------------------------------------------------------------------

    def __call__(self, arg):
        if isinstance(arg, torch.Tensor):
            dispatch = self.dispatch
            if _is_compiling():
                self.traced.fire_compiling(arg)
            elif dispatch.is_paused:
                pass
            elif (_grad_enabled() and _graph_task_id() == -1
                  and ((grad := arg.grad) is None or not grad.requires_grad)):
                # by hand: as in a backward without create_graph: nothing recorded
                dispatch.fire(arg, None, -1, None, True)
            else:
                dispatch.fire(arg)
            return None
        if self.fn is None and callable(arg):
            return GradHook(arg, stats=self.stat_names, input_stats=self.input_stat_names, backend=self.backend,
                            scaler=self.scaler, optimizer=self.optimizer, hist_range=self.hist_range)
        raise TypeError(f"a compiled hook is called with a parameter tensor (as torch does), not "
                        f"{type(arg).__name__}")

    def fire(self, param: torch.Tensor, entry: Entry | None = None, backward_key: int | None = None,
             grad: torch.Tensor | None = None, by_hand: bool = False) -> None:
        """Process `param.grad` now, in place, and record its statistics (one firing; `Dispatch.fire`).

        entry: its registration (looked up, or made for a tensor registered through torch directly);
        backward_key: the autograd graph task the firing belongs to (default: the current one). When `.grad`
        itself requires grad (backward(create_graph=True)) the body runs as eager torch ops that autograd
        records, as an eager hook's would, instead of a kernel writing behind autograd's back. A sharded
        (FSDP2, DTensor) gradient is processed on this rank's shard; its statistics, those of the whole
        parameter, are merged across ranks when the backward ends (see `shards.ShardStats`). grad: the
        gradient to process instead of `param.grad` (compiled autograd hands it over before setting .grad).
        by_hand: a call by hand with grad mode on, outside a backward, on a gradient that does not require grad:
        processed as in a backward without create_graph, with grad mode off (nothing recorded; a firing that only
        launches kernels, `launcher.launches_only`, records nothing anyway and leaves grad mode as it is)."""
        self.dispatch.fire(param, entry, backward_key, grad, by_hand)

    def process(self, entry: Entry, grad: torch.Tensor, param: torch.Tensor, backward_key: int) -> None:
        """Apply the body to `grad` (param.grad, or DDP's averaged bucket view of it) in place and record its
        statistics in `entry`'s row, as one firing of the backward `backward_key` (`Dispatch.process`)."""
        self.dispatch.process(entry, grad, param, backward_key)

    @property
    def is_paused(self) -> bool:
        """True while any paused() block runs, in any thread (read-only: set by paused())."""
        return self.dispatch.is_paused

    @property
    def scalars(self) -> list[torch.Tensor]:
        """The 0-dim tensors the body closes over, in kernel-argument order (read at every firing)."""
        return self._body.scalars

    def check_scalars(self) -> None:
        """Refuse closed-over tensors the kernels cannot read as they are now (see TracedBody.check_scalars): before
        each launch, when `scalars` is not empty."""
        self._body.check_scalars()

    # --- compiling (the cache: compilation.HookCompilation, compilation.Workspaces) ------------------

    def graph(self, dtype: torch.dtype, shape: tuple | None = None) -> Graph:
        """The body lowered for gradients of `dtype` (and `shape`, for a body that reduces over dimensions)."""
        return self.compilation.graph(dtype, shape)

    def _body_for(self, shape: tuple | None) -> TracedBody:
        """The traced body for gradients of `shape` (one body for every shape, except in subclasses whose body
        depends on the gradient's rank, such as `fh.agc`): what the compilation cache lowers."""
        return self._body

    def compiled(self, dtype: torch.dtype, device: torch.device, shard: bool = False,
                 shape: tuple | None = None) -> Compiled:
        """The plan and kernels for gradients of `dtype` on `device` (compiled on first use, then cached; see
        `HookCompilation.compiled`): shard: for one rank's shard of an FSDP2 gradient; shape: the gradient's, for a
        body that reduces over dimensions (ignored otherwise)."""
        return self.compilation.compiled(dtype, device, shard, shape)

    def workspace(self, device: torch.device) -> launcher.Workspace:
        """This thread's scratch on `device` (concurrent backwards in other threads use their own)."""
        return self.workspaces.workspace(device)

    # --- registration -----------------------------------------------------------------------------

    def register(self, target, name: str | None = None, bucket_mb: float | None = None,
                 accumulation_steps: int | None = None, when=None, optimizer=None,
                 keep_grads: bool = False) -> RegistrationHandle:
        """Fire on the gradient of `target` after each accumulation.

        target: a leaf Tensor that requires grad (keyed by `name`, or "param<i>"), an nn.Module (every
        parameter with requires_grad; `name` prefixes their names), or an iterable of Tensors or
        (name, Tensor) pairs. Returns a handle with `remove()`, also a context manager.
        All or nothing: everything is checked before anything is registered, and an error leaves nothing
        registered.

        By default (bucket_mb None or 0) each gradient is processed at its own firing, exactly where an eager
        torch hook would run. bucket_mb > 0 (a module or an iterable) opts into end-of-backward buckets:
        gradients are collected in backward order and each bucket of about `bucket_mb` MB goes in one launch
        per pass; what is left is processed when backward ends, so `.grad` is final when `backward()`
        returns, but not yet when hooks that run after ours during backward see it. A tensor with a
        post-accumulate hook registered after ours is still processed at its own firing; AccumulateGrad
        node hooks (DDP's reducer, for one) cannot be seen from Python and do see the unprocessed gradient.
        A single tensor is never bucketed.

        Gradient accumulation: accumulation_steps=n processes the gradients in the n-th, 2n-th, ... backward in
        which the registration fires (the last micro-batch of every n, on the accumulated gradient) and does
        nothing in the others; when=fn (a function of no arguments) processes them in the backwards where
        `fn()`, called at the firing, is true (a training framework's "this micro-batch steps").

        Distributed: `register(ddp_model)` (a DistributedDataParallel) processes the averaged gradient, through
        DDP's communication hook, keyed by `ddp_model.module`'s parameter names. Registered on a module (or
        tensors) of a process group of several ranks otherwise, the hook processes each rank's own gradient
        at its firing, and warns once (LocalGradientWarning). FSDP2 (fully_shard, before or after this call):
        each rank's shard is processed in place; statistics are those of the whole parameter. See
        docs/distributed.md.

        The optimizer step inside the backward: optimizer=opt (fh.AdamW or fh.SGD, built on these parameters) steps
        each parameter right after its firing, from the gradient as the hook left it (any per-tensor clip in the
        body), and then frees the gradient (`.grad = None`, unless keep_grads=True): no gradient outlives its
        firing, and `opt.step()` leaves these parameters alone. With accumulation_steps= (or when=) the step comes
        in the backwards that process. Not with bucket_mb=, scaler=, DDP, FSDP2 or under torch.compile (refused);
        a global-norm clip of the same backward cannot exist (each parameter is stepped before the later gradients
        exist): fh.clip_grad_norm_ refuses these gradients. See docs/optimizers.md.
        """
        handle, calls = RegistrationHandle(self), self.firing_calls()
        step_in_backward = steps_in_backward(optimizer, keep_grads)
        if process_groups.is_ddp(target):
            if step_in_backward is not None:
                raise ValueError("register(ddp_model, optimizer=...): the optimizer step inside the backward does "
                                 "not take DDP yet (the averaged gradient exists only after each bucket's "
                                 "all-reduce). Register without optimizer= and call opt.step() after the backward")
            return ddp.register_ddp(self.registration, calls, target, name, bucket_mb, accumulation_steps, when, handle)
        return self.registration.register(target, name, bucket_mb, accumulation_steps, when, handle, calls,
                                          step_in_backward)

    def firing_calls(self) -> FiringCalls:
        """The calls a registration makes into this hook's firing (see `buckets.FiringCalls`): the dispatch's (its
        pause flag read without a Python call), and the firing while torch.compile traces, which holds the hook. Made
        for each registration and held by what torch holds for it (the tensors' torch hooks, ...), never by the hook's
        parts, so that a registration keeps the hook alive as torch keeps an eager hook, without a reference cycle."""
        dispatch, traced = self.dispatch, self.traced

        # a function, not a partial: dynamo guards it in fewer checks; `hook` keeps the hook alive (never read)
        def fire_compiling(param: torch.Tensor, hook: GradHook = self) -> None:
            traced.fire_compiling(param)
        return FiringCalls(fire=dispatch.fire, fire_compiling=fire_compiling, process=dispatch.process,
                           check_distributed=dispatch.check_distributed,
                           is_paused=functools.partial(getattr, dispatch, "is_paused"),
                           at_firing=functools.partial(dispatch.torch_hook, fire_compiling))

    def explain(self) -> BackwardPlan:
        """Launches per backward for the tensors this hook is registered on (an upper bound)."""
        return self.compilation.explain([(e.tensor, e.bucket_bytes, e.averaged) for e in self.registry], self._amp)

    @contextlib.contextmanager
    def paused(self):
        """Within this block the hook does nothing (gradient accumulation: clip and record statistics once,
        on the accumulated gradient of the last micro-batch, outside the block). It pauses the hook object,
        for every thread, while any such block runs (blocks in several threads may overlap)."""
        with self.dispatch.paused():
            yield self

    # --- introspection ----------------------------------------------------------------------------

    def plan(self, numel: int | None = None, dtype: torch.dtype = torch.float32, device=None,
             shape: tuple | None = None) -> Plan:
        """The kernel plan for a gradient of `numel` elements (or of `shape`: needed by a body that reduces over
        dimensions) and `dtype` (device: default CUDA if present)."""
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        check_dtype("plan()", dtype)
        if shape is not None:
            numel = math.prod(shape)
        if numel is not None and (not isinstance(numel, int) or isinstance(numel, bool) or numel < 0):
            raise ValueError(f"plan(): numel= takes a whole number of elements >= 0, not {numel!r}")
        return self.compilation.plan(numel, dtype, device, shape, self._amp)

    def source(self, dtype: torch.dtype = torch.float32, device_type: str = "cuda", shape: tuple | None = None
               ) -> str:
        """The generated Triton source for gradients of `dtype` (and `shape`: needed by a body that reduces over
        dimensions)."""
        check_dtype("source()", dtype)
        plan = make_plan(self.graph(dtype, shape), self.stat_names, self.input_stat_names, amp=self._amp,
                         hist_range=self.hist_range)
        try:
            return generate.generate(plan, device_type)
        except dims.Unsupported as e:
            raise CompileError(f"{self.__name__} has {e}: it runs as eager torch ops, not as Triton kernels") from None

    @property
    def _amp(self) -> bool:
        return self.scaler is not None and self.scaler.is_enabled()

    def __repr__(self) -> str:
        return (f"<fusedhooks.GradHook {self.__name__} stats={list(self.stat_names)} "
                f"input_stats={list(self.input_stat_names)} on {len(self.registry)} tensors>")


def grad_hook(fn=None, *, stats=(), input_stats=(), backend: str | None = None, scaler=None, optimizer=None,
              hist_range: tuple[int, int] | None = None) -> GradHook:
    """Compile `fn(grad[, param])` into a fused in-place gradient hook.

    Use bare (`@fh.grad_hook`), with options (`@fh.grad_hook(stats=("norm",))`), or without a function
    for a statistics-only hook. stats / input_stats: statistic names, "hist", or "all", measured after /
    before the body. backend: "auto" (default), "triton", "eager" or "reference" (see docs/environment.md).
    scaler, optimizer: a torch.amp.GradScaler and the optimizer it steps: the body sees the unscaled
    gradient and the scaler's books are kept (see docs/clipping.md, AMP). hist_range: (lo, hi) exponents of the
    "hist" bins, default (-40, 8).
    """
    if isinstance(fn, GradHook):  # a decorated function, compiled again with these options
        fn = fn.fn
    if hist_range is not None and "hist" not in _parse_stats(stats, "stats") + _parse_stats(input_stats, "input_stats"):
        raise ValueError(f"hist_range={hist_range!r} sets the bins of the 'hist' statistic: add 'hist' to stats= or "
                         "input_stats=, or leave hist_range out")
    return GradHook(fn, stats=stats, input_stats=input_stats, backend=backend, scaler=scaler,
                    optimizer=optimizer, hist_range=hist_range)
