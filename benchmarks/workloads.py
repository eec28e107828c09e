"""What is benchmarked: the gradient work (workloads) and who does it (providers).

A workload is one piece of gradient work (clip + scale, clip + every statistic, ...). Every provider does the
same work on the same gradients, its own way:

    fusedhooks      the compiled hook (`fh.grad_hook`), registered with `hook.register`
    fusedhooks buckets  the same, registered with `bucket_mb=25` (the model step only)
    eager           the same body as eager torch ops in a post-accumulate-grad hook, no host sync
                    (statistics are written into a device buffer)
    eager+item      the seed-style hook: the same eager ops, every statistic or scalar read with `.item()`
    torch built-in  `clip_grad_value_`, `clip_grad_norm_`, `GradScaler.unscale_`, where one applies
    fusedhooks folded  `fh.clip_grad_norm_(hook, max_norm, optimizer=opt)` into a fused optimizer (clip_step only)
    fusedhooks step    the same fold into fusedhooks' own optimizer, `fh.AdamW` (clip_step only)
    fusedhooks in backward  `fh.AdamW` stepping each parameter at its firing: clip_step's, clipped by the previous
                    step's total norm; the model step's, the fusedhooks hook registered with optimizer=
    torch step      torch's fused AdamW step alone, no clip (clip_step only)
    torch.compile   the `eager` hook function, compiled (default options)
    no hook         nothing: the baseline of the model step

A provider turns a workload into an `Impl`: one callable per parameter (called as torch calls
post-accumulate-grad hooks, `hook(param)`), and optionally `after()`, the work after backward (global clipping).
Each Impl also says how many bytes per gradient element it moves (see benchmarks/README.md, "Bytes").
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

import fusedhooks as fh

#: Clip bound of the clipping workloads, and the max_norm of global clipping.
CLIP = 1.0
MAX_NORM = 1.0
EPS = 1e-6
#: The statistics of stats="all", without "count" (a constant the eager hooks store once).
EAGER_STATS = tuple(n for n in fh.STAT_NAMES if n != "count")


class NotApplicable(Exception):
    """The provider has no way to do this workload (the table and the JSON say why)."""


@dataclass
class Env:
    """The gradients a workload runs on: leaf parameters with their `.grad` set, and the optimizer stepping them."""

    device: torch.device
    dtype: torch.dtype
    params: list[tuple[str, torch.Tensor]]
    optimizer: torch.optim.Optimizer

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [p for _, p in self.params]


@dataclass
class Impl:
    """One provider's implementation of a workload on `env.params`.

    hooks: one callable per parameter, in env.params order (empty: no per-parameter work).
    after: work after backward (e.g. global clipping), or None.
    bytes_per_element: bytes the provider moves per gradient element (None: unknown).
    fh_hook: the fusedhooks hook (fusedhooks provider only), to count its launches.
    fh_structure: what fusedhooks plans per step, summed over the parameters: passes (reads of the gradients),
    writes, launches, and where the launch count comes from. Structural: the same on every device and backend.
    """

    hooks: list[Callable] = field(default_factory=list)
    after: Callable | None = None
    bytes_per_element: float | None = None
    fh_hook: fh.GradHook | None = None
    fh_structure: dict | None = None
    bucket_mb: float | None = None  # fusedhooks: register(..., bucket_mb=) (None: each gradient at its firing)
    #: fusedhooks: register(..., optimizer=): this optimizer steps each parameter at its firing, and the model step
    #: calls its step() (which then steps nothing) instead of the environment's
    optimizer: torch.optim.Optimizer | None = None
    _handles: list = field(default_factory=list)

    @property
    def does_nothing(self) -> bool:
        return not self.hooks and self.after is None

    def attach(self, env: Env) -> None:
        """Register the hooks with torch. fusedhooks: `hook.register(params, bucket_mb=self.bucket_mb)`, the way users
        register a model (by default each gradient processed at its own firing; with bucket_mb, in end-of-backward
        buckets); its launch count then comes from `hook.explain()`."""
        if self.fh_hook is not None:
            self._handles.append(self.fh_hook.register(env.params, bucket_mb=self.bucket_mb,
                                                       optimizer=self.optimizer))
            if len(env.params) > 1:
                self.fh_structure.update(launches=self.fh_hook.explain().launches_per_backward,
                                         launches_from="hook.explain(): launches per backward (an upper bound)")
        else:
            self._handles += [p.register_post_accumulate_grad_hook(h) for p, h in zip(env.tensors, self.hooks)]

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def record(row: torch.Tensor | None, values: list[torch.Tensor], sync: bool):
    """Keep a hook's statistics: stacked into a device row (no sync), or read to the host one by one with
    `.item()` (the seed-style hook: one sync each)."""
    if sync:
        return [v.item() for v in values]
    row.copy_(torch.stack([v.float() for v in values]))
    return None


def eager_all_stats(g: torch.Tensor) -> list[torch.Tensor]:
    """EAGER_STATS of `g` with eager torch ops, as 0-dim tensors: 7 reads of g and 3 bool temporaries
    (sum, vector_norm, var, aminmax, then isnan/isinf/eq each written to a bool tensor and summed)."""
    n = g.numel()
    total = g.sum(dtype=torch.float32)
    norm = torch.linalg.vector_norm(g, dtype=torch.float32)
    var = torch.var(g).float()
    lo, hi = torch.aminmax(g)
    lo, hi = lo.float(), hi.float()
    return [total, total / n, norm * norm, norm, var, var.sqrt(), lo, hi, torch.maximum(-lo, hi),
            g.isnan().sum(), g.isinf().sum(), (g == 0).sum()]


class Workload:
    """A piece of gradient work. Subclasses define the fusedhooks hook, the eager per-parameter function
    (`on_grad(g, state, sync)`: a staticmethod, so that torch.compile sees one function), and, where they
    exist, the after-backward work and a torch built-in.

    Traffic (bytes per element) is given in units of the gradient's element size plus bytes of bool temporaries.
    """

    name = ""
    title = ""
    #: (elements' worth of reads+writes, bool temporary bytes) per element for eager / eager+item / built-in.
    eager_traffic: tuple[float, float] = (0, 0)
    builtin_traffic: tuple[float, float] | None = None
    #: Whether the seed-style hook differs from `eager` (it reads something with .item()).
    has_item_variant = True
    #: Time only `after` (the work after backward); the per-parameter hooks run before each call, untimed.
    after_backward_only = False

    def param_shape(self, numel: int) -> tuple[int, ...]:
        """The shape of the parameter of `numel` elements the sweep runs on (default: 1-d)."""
        return (numel,)

    # --- fusedhooks ---------------------------------------------------------------------------------------------

    def fusedhooks_hook(self, env: Env) -> fh.GradHook:
        raise NotImplementedError

    def fusedhooks_after(self, hook: fh.GradHook, env: Env) -> tuple[Callable | None, int, int, int]:
        """(after, launches, reads, writes) of the work after backward, reads and writes in passes over the
        gradients; none by default."""
        return None, 0, 0, 0

    def fusedhooks(self, env: Env) -> Impl:
        hook = self.fusedhooks_hook(env)
        after, launches, reads, writes = self.fusedhooks_after(hook, env)
        plans = [hook.plan(shape=tuple(p.shape), dtype=p.dtype, device=env.device) for p in env.tensors]
        total = sum(p.numel() for p in env.tensors)
        moved = sum(pl.bytes_per_element * p.numel() for pl, p in zip(plans, env.tensors))
        moved += (reads + writes) * env.dtype.itemsize * total
        structure = {"passes": sum(pl.passes for pl in plans) + reads,
                     "writes": sum(pl.writes for pl in plans) + writes,
                     "launches": sum(pl.launches for pl in plans) + launches,
                     "launches_from": "hook.plan(shape=, dtype=).launches" + (" + the global clip's" if after else "")}
        return Impl(hooks=[hook] * len(env.params), after=after, bytes_per_element=moved / total, fh_hook=hook,
                    fh_structure=structure)

    # --- eager, eager+item, torch.compile -----------------------------------------------------------------------

    def setup(self, env: Env, sync: bool) -> tuple[list, object]:
        """(the state handed to on_grad for each parameter, anything eager_after needs); default: nothing."""
        return [None] * len(env.params), None

    @staticmethod
    def on_grad(g: torch.Tensor, state, sync: bool) -> None:
        """The eager hook's body, on the gradient `g` (in place); sync: read statistics with .item()."""
        raise NotImplementedError

    def eager_after(self, env: Env, shared, sync: bool, wrap: Callable) -> Callable | None:
        return None

    def eager(self, env: Env, sync: bool = False, wrap: Callable = lambda f: f) -> Impl:
        """The eager hook; `wrap` = torch.compile gives the compiled provider (same function)."""
        if sync and not self.has_item_variant:
            raise NotApplicable("nothing to read with .item(): the seed-style hook is the eager one")
        fn = wrap(self.on_grad)
        states, shared = self.setup(env, sync)
        return Impl(hooks=[functools.partial(_on_param_grad, fn, state=s, sync=sync) for s in states],
                    after=self.eager_after(env, shared, sync, wrap),
                    bytes_per_element=_bytes(self.eager_traffic, env.dtype))

    def compiled(self, env: Env) -> Impl:
        impl = self.eager(env, wrap=torch.compile)
        # Inductor's schedule varies with the graph: count it as the fused minimum (the fusedhooks plan).
        impl.bytes_per_element = self.fusedhooks(env).bytes_per_element
        return impl

    def builtin(self, env: Env) -> Impl:
        raise NotApplicable("no torch built-in does this")

    def folded(self, env: Env) -> Impl:
        raise NotApplicable("nothing to fold: the global clip into a fused optimizer's step is clip_step's")

    def owned_step(self, env: Env) -> Impl:
        raise NotApplicable("no optimizer step: fh.AdamW's step is clip_step's")

    def in_backward(self, env: Env) -> Impl:
        raise NotApplicable("no optimizer step: fh.AdamW's step inside the backward is clip_step's")

    def torch_step(self, env: Env) -> Impl:
        raise NotApplicable("no optimizer step: torch's fused AdamW alone is clip_step's")


def _on_param_grad(fn: Callable, p: torch.Tensor, state, sync: bool) -> None:
    """A post-accumulate-grad hook (torch passes the parameter) running `fn` on the gradient. Compiled, `fn` gets
    the gradient as its input: dynamo cannot guard the sizes of `p.grad` of a dynamic-shape parameter."""
    fn(p.grad, state, sync)


def _bytes(traffic: tuple[float, float], dtype: torch.dtype) -> float:
    passes, bool_bytes = traffic
    return passes * dtype.itemsize + bool_bytes


class ClipScale(Workload):
    """grad.clamp(-1, 1) * scale, with `scale` a 0-dim fp32 device tensor (as a schedule would be). It holds
    1.0, so that repeated firings on the same gradient keep its values in range; no provider can tell."""

    name, title = "clip_scale", "clip + scale"
    eager_traffic = (4, 0)  # clamp_ r+w, mul_ r+w
    builtin_traffic = (6, 0)  # clip_grad_value_ (clamp_min_, clamp_max_: 2 r+w), mul_ r+w
    has_item_variant = False

    def scale(self, env: Env) -> torch.Tensor:
        return torch.ones((), dtype=torch.float32, device=env.device)

    def fusedhooks_hook(self, env):
        scale = self.scale(env)
        return fh.grad_hook(lambda grad: grad.clamp(-CLIP, CLIP) * scale)

    def setup(self, env, sync):
        return [self.scale(env)] * len(env.params), None

    @staticmethod
    def on_grad(g, state, sync):
        g.clamp_(-CLIP, CLIP).mul_(state)

    def builtin(self, env):
        scale = self.scale(env)

        def hook(p):
            torch.nn.utils.clip_grad_value_(p, CLIP)
            p.grad.mul_(scale)

        return Impl(hooks=[hook] * len(env.params), bytes_per_element=_bytes(self.builtin_traffic, env.dtype))


class ClipStats(ClipScale):
    """clip + scale, and every statistic (stats="all") of the clipped gradient."""

    name, title = "clip_stats", "clip + all stats"
    eager_traffic = (11, 6)  # clip 4 + 7 reads; isnan/isinf/eq: bool written and read (2 bytes each)
    builtin_traffic = None
    has_item_variant = True

    def fusedhooks_hook(self, env):
        scale = self.scale(env)
        return fh.grad_hook(lambda grad: grad.clamp(-CLIP, CLIP) * scale, stats="all")

    def setup(self, env, sync):
        scale = self.scale(env)
        rows = torch.zeros(len(env.params), len(EAGER_STATS), device=env.device)  # the device statistics buffer
        return [(scale, rows[i]) for i in range(len(env.params))], rows

    @staticmethod
    def on_grad(g, state, sync):
        scale, row = state
        g.clamp_(-CLIP, CLIP).mul_(scale)
        record(row, eager_all_stats(g), sync)

    def builtin(self, env):
        raise NotApplicable("no torch built-in computes these statistics")

    def in_backward(self, env):
        """The model step with the hook registered with optimizer=fh.AdamW (the environment's AdamW's
        hyper-parameters): each parameter stepped at its firing, its gradient freed."""
        if len(env.params) < 2:
            raise NotApplicable("the step inside the backward: the model step's (and clip_step's)")
        impl = self.fusedhooks(env)
        defaults = env.optimizer.defaults
        impl.optimizer = fh.AdamW(env.tensors, **{k: defaults[k] for k in ("lr", "betas", "eps", "weight_decay")})
        return impl


class Normalize(Workload):
    """grad / (grad.norm() + 1e-6): a whole-tensor reduction, then the elementwise pass."""

    name, title = "normalize", "normalise by norm"
    eager_traffic = (3, 0)  # norm read, div_ r+w

    def fusedhooks_hook(self, env):
        return fh.grad_hook(lambda grad: grad / (grad.norm() + EPS))

    @staticmethod
    def on_grad(g, state, sync):
        norm = g.norm()
        g.div_(norm.item() + EPS if sync else norm + EPS)

    def builtin(self, env):
        raise NotApplicable("no torch built-in normalises a tensor by its own norm in place")


def rows_of(numel: int, row: int = 1024) -> tuple[int, ...]:
    """A weight of rows of `row` elements holding `numel` (1-d below one row or when it does not divide)."""
    return (numel // row, row) if numel >= row and numel % row == 0 else (numel,)


class CenterColumns(Workload):
    """grad - grad.mean(dim=0) on a weight of rows of 1024 elements: a reduction over dimensions whose units (the
    columns) are strided: a reduction pass leaves the column means in a workspace, the elementwise pass gathers them."""

    name, title = "center_columns", "centre the columns (mean over dim 0)"
    eager_traffic = (3, 0)  # mean R, sub_ R+W
    has_item_variant = False

    def param_shape(self, numel):
        return rows_of(numel)

    def fusedhooks_hook(self, env):
        return fh.grad_hook(lambda grad: grad - grad.mean(dim=0))

    @staticmethod
    def on_grad(g, state, sync):
        g.sub_(g.mean(dim=0))

    def builtin(self, env):
        raise NotApplicable("no torch built-in centres a gradient")


class Agc(Workload):
    """Unit-wise adaptive gradient clipping (timm's adaptive_clip_grad) of a weight with rows of ROW elements (1-d
    below ROW): each row's gradient norm against clip_factor times its parameter's norm. The parameter is zero, so
    every row is clipped to norm 1e-5 at each firing (repeated firings stay in range)."""

    name, title = "agc", "unit-wise clipping (AGC)"
    eager_traffic = (9, 0)  # param norm read, grad norm read, g * ratio r+w, where r+r+w, copy_ r+w
    has_item_variant = False
    ROW = 1024
    CLIP_FACTOR, AGC_EPS = 0.01, 1e-3

    def param_shape(self, numel):
        return rows_of(numel, self.ROW)

    def fusedhooks_hook(self, env):
        return fh.agc(self.CLIP_FACTOR, self.AGC_EPS)

    def setup(self, env, sync):
        return list(env.tensors), None  # the eager hook reads each gradient's parameter

    @staticmethod
    def on_grad(g, p, sync):
        dims = tuple(range(1, g.ndim))

        def unitwise_norm(x):
            return x.norm(2.0) if x.ndim <= 1 else x.norm(2.0, dim=dims, keepdim=True)

        max_norm = unitwise_norm(p.detach()).clamp_(min=Agc.AGC_EPS).mul_(Agc.CLIP_FACTOR)
        grad_norm = unitwise_norm(g)
        clipped = g * (max_norm / grad_norm.clamp(min=1e-6))
        g.copy_(torch.where(grad_norm < max_norm, g, clipped))

    def builtin(self, env):
        raise NotApplicable("no torch built-in clips unit-wise (timm's adaptive_clip_grad is the eager provider's "
                            "formula)")


class AmpClip(Workload):
    """AMP unscaling, NaN/Inf check and per-parameter norms in the hook, then global-norm clipping.

    The GradScaler's scale is 0.5: each step unscales (x2) and the clip brings the norm back to MAX_NORM, so
    repeated steps on the same gradient stay in range and the clip really scales every time. Each step ends by
    resetting the scaler's per-optimizer books, as scaler.update() does (without its scale-update kernel).
    """

    name, title = "amp_clip", "AMP unscale + global clip"
    eager_traffic = (6, 2)  # mul_ r+w, isfinite (bool w+r) + all, norm read; clip mul_ r+w
    builtin_traffic = (5, 0)  # unscale_ r+w; clip_grad_norm_: norm read, mul_ r+w

    @staticmethod
    def scaler(env: Env) -> torch.amp.GradScaler:
        scaler = torch.amp.GradScaler(env.device.type, init_scale=0.5)
        scaler.scale(torch.ones((), device=env.device))  # creates the scale tensor, as scaling the loss does
        return scaler

    @staticmethod
    def end_of_step(scaler: torch.amp.GradScaler) -> None:
        scaler._per_optimizer_states.clear()  # the books scaler.update() resets (a defaultdict: READY again)

    def fusedhooks_hook(self, env):
        return fh.grad_hook(stats=("norm",), scaler=self.scaler(env), optimizer=env.optimizer)

    def fusedhooks_after(self, hook, env):
        def after():
            fh.clip_grad_norm_(hook, MAX_NORM)
            self.end_of_step(hook.scaler)

        return after, 1, 1, 1  # one multi-tensor launch per (device, dtype): reads and writes when it clips

    def setup(self, env, sync):
        scaler = self.scaler(env)
        if sync:  # the seed-style hook: the scale read once, norms and the NaN/Inf flag collected on the host
            host = {"inv_scale": 1.0 / scaler.get_scale(), "norms": [], "found_inf": False}
            return [host] * len(env.params), host
        inv_scale = scaler._scale.double().reciprocal().float()  # as GradScaler.unscale_ computes it
        found_inf = torch.zeros((), dtype=torch.bool, device=env.device)
        norms = torch.zeros(len(env.params), device=env.device)
        return [(inv_scale, found_inf, norms[i]) for i in range(len(env.params))], (found_inf, norms)

    @staticmethod
    def on_grad(g, state, sync):
        if sync:
            g.mul_(state["inv_scale"])
            state["found_inf"] |= not torch.isfinite(g).all().item()
            state["norms"].append(torch.linalg.vector_norm(g).item())
            return
        inv_scale, found_inf, norm = state
        g.mul_(inv_scale)
        found_inf.logical_or_(torch.isfinite(g).all().logical_not())
        norm.copy_(torch.linalg.vector_norm(g))

    @staticmethod
    def clip_by_norms(grads: list[torch.Tensor], norms: torch.Tensor) -> None:
        """Global clip from per-parameter norms already on the device (the coefficient as clip_grad_norm_'s)."""
        total = torch.linalg.vector_norm(norms)
        torch._foreach_mul_(grads, torch.clamp(MAX_NORM / (total + EPS), max=1.0))

    def eager_after(self, env, shared, sync, wrap):
        if sync:
            def after():
                total = sum(n * n for n in shared["norms"]) ** 0.5
                coef = MAX_NORM / (total + EPS)
                if coef < 1.0:
                    for p in env.tensors:
                        p.grad.mul_(coef)
                shared["norms"].clear()
                shared["found_inf"] = False
            return after

        found_inf, norms = shared
        clip = wrap(self.clip_by_norms)

        def after():
            clip([p.grad for p in env.tensors], norms)
            found_inf.zero_()  # the step would read it; the next one starts clean
        return after

    def builtin(self, env):
        scaler = self.scaler(env)
        try:  # torch 2.11's CUDA unscale kernel has no bf16 (measured on an H200)
            torch._amp_foreach_non_finite_check_and_unscale_(
                [torch.zeros(1, dtype=env.dtype, device=env.device)], torch.zeros(1, device=env.device),
                torch.ones(1, device=env.device))
        except (NotImplementedError, RuntimeError) as e:
            raise NotApplicable(f"torch {torch.__version__}'s GradScaler does not unscale {env.dtype} gradients on "
                                f"{env.device.type}: {str(e).splitlines()[0][:120]}") from None

        def after():
            scaler.unscale_(env.optimizer)
            torch.nn.utils.clip_grad_norm_(env.tensors, MAX_NORM)
            self.end_of_step(scaler)

        return Impl(after=after, bytes_per_element=_bytes(self.builtin_traffic, env.dtype))


class ClipStep(Workload):
    """The optimizer step after backward: a global-norm clip (max_norm MAX_NORM) then a fused AdamW step
    (`torch.optim.AdamW(fused=True)`, lr 0 so that repeated steps leave the parameter as it is; the step does the
    same work). Only the work after backward is timed: the per-parameter hooks (fusedhooks' records the norms)
    run before each timed call, untimed, as backward runs them.

        torch built-in      torch.nn.utils.clip_grad_norm_ + step: norm R, scale R+W, then the step
        fusedhooks          fh.clip_grad_norm_(hook, MAX_NORM) + step: the norms are the hook's, scale R+W
        fusedhooks folded   fh.clip_grad_norm_(hook, MAX_NORM, optimizer=opt) + step: the coefficient folded into
                            opt.grad_scale; the step divides the gradient and writes it back (1 W)
        fusedhooks step     the same fold into fh.AdamW (lr 0): its step divides the gradient as it reads it and
                            writes nothing back (0)
        fusedhooks in backward  fh.AdamW (lr 0) stepping each parameter at its gradient's firing, as
                            `hook.register(model, optimizer=opt)` does inside the backward, the firing scaling the
                            gradient by the previous step's clip coefficient (docs/optimizers.md: the exact global
                            clip cannot exist there): per parameter the firing (R+W, its input norm recorded) then the
                            step; after them the next coefficient from the norms, on the device (2). Timed: all of it,
                            the work a backward would do at the firings plus the coefficient
        torch step          torch's fused AdamW step alone, no clip (0): what the clip adds to the others

    Bytes per element, in element sizes: the step reads grad, param, exp_avg, exp_avg_sq and writes the last three
    (STEP_TRAFFIC = 7, all in the parameter's dtype), plus the clip's gradient traffic (CLIP_TRAFFIC). The gradient
    is drawn with a norm far above MAX_NORM, and after the first clip it stays at MAX_NORM / (1 + 1e-6 MAX_NORM):
    every call clips.
    """

    name, title = "clip_step", "global clip + fused AdamW step"
    STEP_TRAFFIC = 7
    #: gradient reads + writes of each provider's clip (the folded step's write-back of the divided gradient)
    CLIP_TRAFFIC = {"torch built-in": 3, "fusedhooks": 2, "fusedhooks folded": 1, "fusedhooks step": 0,
                    "fusedhooks in backward": 2, "torch step": 0}
    after_backward_only = True

    def optimizer(self, env: Env) -> torch.optim.Optimizer:
        return torch.optim.AdamW(env.tensors, lr=0.0, fused=True)

    def impl(self, env: Env, provider: str, clip: Callable, hook: fh.GradHook | None = None) -> Impl:
        traffic = (self.STEP_TRAFFIC + self.CLIP_TRAFFIC[provider], 0)
        structure = None
        if hook is not None:
            passes = 1 if provider == "fusedhooks" else 0  # the scale pass (the step's own passes not counted)
            structure = {"passes": passes, "writes": passes, "launches": passes,
                         "launches_from": "fh.clip_grad_norm_'s multi-tensor scale, the step's kernels not counted"}
        return Impl(hooks=[hook] * len(env.params) if hook else [], after=clip,
                    bytes_per_element=_bytes(traffic, env.dtype), fh_hook=hook, fh_structure=structure)

    def fusedhooks(self, env, fold=False, provider="fusedhooks"):
        hook = fh.grad_hook(stats=("norm",))
        opt = fh.AdamW(env.tensors, lr=0.0) if provider == "fusedhooks step" else self.optimizer(env)

        def after():
            fh.clip_grad_norm_(hook, MAX_NORM, optimizer=opt if fold else None)
            opt.step()
        return self.impl(env, provider, after, hook)

    def folded(self, env):
        return self.fusedhooks(env, fold=True, provider="fusedhooks folded")

    def owned_step(self, env):
        return self.fusedhooks(env, fold=True, provider="fusedhooks step")

    def builtin(self, env):
        opt = self.optimizer(env)

        def after():
            torch.nn.utils.clip_grad_norm_(env.tensors, MAX_NORM)
            opt.step()
        return self.impl(env, "torch built-in", after)

    def torch_step(self, env):
        return self.impl(env, "torch step", self.optimizer(env).step)

    def in_backward(self, env):
        coef = torch.ones((), device=env.device)  # the previous step's clip coefficient
        hook = fh.grad_hook(lambda g: g * coef, input_stats=("norm",))
        opt = fh.AdamW(env.tensors, lr=0.0)
        steps = opt.step_in_backward(env.tensors, keep_grads=True)  # kept: the next call fires on them again
        column = hook.stats.slot_names.index("input.norm")

        def firings():
            for p in env.tensors:
                hook(p)
                steps(p)
            total = torch.linalg.vector_norm(hook.stats.tensor[:, column].nan_to_num(0.0))
            coef.copy_(torch.clamp(MAX_NORM / (total + EPS), max=1.0))
        impl = self.impl(env, "fusedhooks in backward", firings, hook)
        impl.hooks = []  # nothing before the timed call: the firings are the timed work
        impl.fh_structure.update(passes=1, writes=1, launches=1,
                                 launches_from="the firing's pass per gradient, the step's kernels not counted")
        return impl

    def eager(self, env, sync=False, wrap=lambda f: f):
        raise NotApplicable("torch's clip_grad_norm_ is the eager way: the torch built-in provider")


#: In run order, the headline figure first (so that a run cut short by a time budget has it).
WORKLOADS = {w.name: w for w in (ClipStats(), ClipScale(), Normalize(), AmpClip(), Agc(), CenterColumns(),
                                 ClipStep())}
#: The per-parameter work of the model workload: the target's (clip + all statistics on every parameter).
MODEL_WORK = WORKLOADS["clip_stats"]


def no_hook(workload: Workload, env: Env) -> Impl:
    return Impl(bytes_per_element=0.0)


#: the bucket size of the "fusedhooks buckets" provider (DDP's default bucket size)
BUCKET_MB = 25


def fusedhooks_buckets(workload: Workload, env: Env) -> Impl:
    """fusedhooks registered with explicit end-of-backward buckets: a model's gradients only."""
    if len(env.params) < 2:
        raise NotApplicable("buckets batch the gradients of many parameters: the model step only")
    impl = workload.fusedhooks(env)
    impl.bucket_mb = BUCKET_MB
    return impl


#: provider name -> (how it builds an Impl for a workload on an env)
PROVIDERS: dict[str, Callable[[Workload, Env], Impl]] = {
    "fusedhooks": lambda w, env: w.fusedhooks(env),
    "fusedhooks buckets": fusedhooks_buckets,
    "eager": lambda w, env: w.eager(env),
    "eager+item": lambda w, env: w.eager(env, sync=True),
    "torch built-in": lambda w, env: w.builtin(env),
    "fusedhooks folded": lambda w, env: w.folded(env),
    "fusedhooks step": lambda w, env: w.owned_step(env),
    "fusedhooks in backward": lambda w, env: w.in_backward(env),
    "torch step": lambda w, env: w.torch_step(env),
    "torch.compile": lambda w, env: w.compiled(env),
    "no hook": no_hook,
}
