"""Adaptive per-tensor gradient clipping (AdaGC, arXiv 2502.11034) as a ready-made hook."""

from __future__ import annotations

import contextlib
import functools
import math

import torch

from ..api import GradHook, RegistrationHandle
from ..registration import gates
from ..registration.register import check_param, named_tensors, run_outside_graph, stepping, steps_in_backward
from ..runtime import launcher
from ..stats import backwards
from ..stats.buffer import ParamStats, ScalarSelection, StatsReading


def _adagc_body(state: torch.Tensor, ratio: float, max_norm: float, warmup_steps: int):
    """The compiled body for one parameter; `state` = [gamma, step] on the parameter's device (fp32)."""
    gamma, step = state[0], state[1]

    def adagc(grad):
        norm = grad.float().norm()
        limit = torch.where(step < warmup_steps, max_norm, ratio * gamma)
        coef = torch.where(norm > 0, torch.clamp(limit / norm, max=1.0), 1.0)
        return grad * coef

    return adagc


class AdaptiveClip:
    """Adaptive per-tensor clipping: each gradient is clipped against an EMA of its own clipped norms.

    For parameter i at firing t (t counts from 0), with g its gradient and gamma its state:

        warm-up (t < warmup_steps):  h = min(max_norm / ||g||, 1)         g <- h * g
                                     gamma = min(gamma, ||g||)           (gamma starts at +inf)
        afterwards:                  h = min(ratio * gamma / ||g||, 1)    g <- h * g
                                     gamma = beta * gamma + (1 - beta) * ||g||

    (||g|| after the assignment is the clipped norm; h = 1 when ||g|| = 0; a non-finite ||g||, an overflow that
    GradScaler skips, leaves gamma as it was.) The paper's warm-up clips
    by the global norm; a per-parameter hook sees one tensor, so the warm-up threshold applies per
    tensor here. That is what makes it usable where global clipping is not: optimizer-in-backward,
    FSDP2 shards. The state lives on the device (`state(name)` -> tensor [gamma, step]); nothing syncs.
    Each firing is one fused clip kernel (two passes for gradients larger than one block) plus a few
    0-dim tensor ops that update the state. Statistics (`stats`, read as a GradHook's): "norm" (clipped),
    "input.norm", "norm_ema" (gamma) and "step" per parameter.
    """

    def __init__(self, beta: float = 0.98, ratio: float = 1.05, warmup_steps: int = 100, max_norm: float = 1.0,
                 backend: str | None = None):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"beta must be in [0, 1), got {beta}")
        for option, value in (("ratio", ratio), ("max_norm", max_norm)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"{option} must be a finite number > 0, got {value!r}")
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"warmup_steps must be a whole number >= 0, got {warmup_steps!r}")
        self.beta, self.ratio, self.warmup_steps, self.max_norm = beta, ratio, warmup_steps, max_norm
        if backend is not None:  # now rather than at register()
            launcher.check_backend(backend)
        self.backend = backend
        self._hooks: dict[str, GradHook] = {}
        self._states: dict[str, torch.Tensor] = {}
        self._backwards = backwards.Backwards()  # numbers the backwards in which any parameter is processed
        self._written: dict[str, int] = {}  # per parameter: the number of the backward that last processed it
        self.stats = AdaptiveClipStats(self)

    def register(self, target, name: str | None = None, accumulation_steps: int | None = None,
                 when=None, optimizer=None, keep_grads: bool = False) -> RegistrationHandle:
        """Register on a leaf Tensor, an nn.Module or an iterable of them (as GradHook.register), all or
        nothing. Each tensor gets its own compiled hook (its state is a closed-over device tensor), registered
        through `GradHook.register`, and an update of its state right after it, which runs only when the hook
        processed the gradient (accumulation_steps=, when=, paused(): as GradHook's). optimizer= (fh.AdamW or
        fh.SGD): each parameter is stepped right after its state's update, and its gradient freed unless
        keep_grads=True (the optimizer step inside the backward, see GradHook.register)."""
        gate = gates.parse(accumulation_steps, when)  # one for all the tensors: they count the same micro-batches
        make_steps = steps_in_backward(optimizer, keep_grads)
        pairs = list(named_tensors(target, name, lambda taken: f"param{len(self._hooks) + len(taken)}"))
        names = set()
        for pname, t in pairs:
            check_param(pname, t)
            if pname in self._hooks or pname in names:
                raise ValueError(f"{pname!r} is already registered with this adaptive clip; pass a different name=")
            names.add(pname)
        handle = RegistrationHandle(self)
        steps = None
        if make_steps is not None:
            steps = make_steps([t for _, t in pairs])  # checks them: before registering
            handle.on_remove(steps.remove)
        try:
            for pname, t in pairs:
                state = torch.tensor([math.inf, 0.0], dtype=torch.float32, device=t.device)
                hook = GradHook(_adagc_body(state, self.ratio, self.max_norm, self.warmup_steps), stats=("norm",),
                                input_stats=("norm",), backend=self.backend)
                handle.extend(hook.register(t, name=pname, when=gate))
                self._hooks[pname], self._states[pname] = hook, state
                handle.on_remove(functools.partial(self._forget, pname, hook))
                update = self._update(pname, hook, state)
                if steps is not None:  # the step after the update (which reads the firing's statistics row)
                    update = stepping(update, steps, lambda hook=hook: hook.is_paused, fire_traces=False)
                if gate is not None:  # the registration's gate: the same decision as the hook's in each backward
                    update = gates.gated(update, gate, run_outside_graph, lambda hook=hook: hook.is_paused)
                handle.add(t, t.register_post_accumulate_grad_hook(update))
        except BaseException:
            handle.remove()
            raise
        return handle

    def _forget(self, pname: str, hook: GradHook) -> None:
        if self._hooks.get(pname) is hook:
            del self._hooks[pname], self._states[pname]
            self._written.pop(pname, None)

    def _update(self, pname: str, hook: GradHook, state: torch.Tensor):
        """The state update, a torch hook registered right after `hook` (so it runs after its kernel); it also
        marks parameter `pname`'s statistics as written by the current backward."""
        beta = self.beta
        warmup = self.warmup_steps
        slot = hook.stats.slot_names.index("norm")
        row = len(hook.stats.names) - 1  # hook is registered on this one tensor

        def update(param: torch.Tensor) -> None:
            if param.grad is None or hook.is_paused:
                return
            clipped = hook.stats.tensor[row, slot].to(torch.float32)
            gamma, step = state[0], state[1]
            updated = torch.where(step < warmup, torch.minimum(gamma, clipped), beta * gamma + (1 - beta) * clipped)
            gamma.copy_(torch.where(clipped.isfinite(), updated, gamma))
            step.add_(1)
            self._backwards.enter(torch._C._current_graph_task_id())
            self._written[pname] = self._backwards.number

        return update

    @contextlib.contextmanager
    def paused(self):
        """Within this block no parameter is clipped and no state changes (gradient accumulation: clip once, on
        the accumulated gradient of the last micro-batch, outside the block); as GradHook.paused()."""
        with contextlib.ExitStack() as stack:
            for hook in list(self._hooks.values()):
                stack.enter_context(hook.paused())
            yield self

    def state(self, name: str) -> torch.Tensor:
        """The device tensor [gamma, step] of parameter `name` (float32)."""
        return self._states[name]

    def read(self) -> StatsReading:
        """`stats.read()`, with each row's "norm_ema" also under its former name "gamma"."""
        reading = self.stats.read()
        for row in reading.values():
            row["gamma"] = row["norm_ema"]
        return reading


class AdaptiveClipStats:
    """The statistics of an AdaptiveClip, read as a GradHook's `stats`: per parameter "norm" (the clipped
    gradient's), "input.norm" (as accumulated), "norm_ema" (gamma of AdaptiveClip's equations, after the update)
    and "step" (the firings that processed it). Rows appear once a parameter is processed; a row is stale when the
    most recent backward that processed any of the clip's parameters did not process it."""

    slot_names = ("norm", "input.norm", "norm_ema", "step")

    def __init__(self, clip: AdaptiveClip):
        self._clip = clip

    @property
    def names(self) -> list[str]:
        """The registered parameters' names, in registration order."""
        return list(self._clip._hooks)

    def read(self) -> StatsReading:
        """{parameter name: ParamStats {"norm", "input.norm", "norm_ema", "step"}} of every parameter processed
        since registration or reset(); `fresh` / `stale` as HookStats.read()'s. One sync per parameter."""
        clip = self._clip
        out = StatsReading(self.names)
        for name, hook in clip._hooks.items():
            recorded = hook.stats.read().get(name)
            if recorded is None:
                continue
            norm_ema, step = clip._states[name].tolist()
            row = out[name] = ParamStats(norm=recorded["norm"], **{"input.norm": recorded["input.norm"]},
                                         norm_ema=norm_ema, step=int(step))
            row.fresh = clip._written.get(name) == clip._backwards.number
        return out

    def to_scalars(self, prefix: str = "grad/", stats=None, params=None,
                   top_k: int | None = None) -> dict[str, float | int]:
        """The statistics as one flat dict of numbers (`f"{prefix}{parameter}/{statistic}"`), fresh rows only,
        selected as by `HookStats.to_scalars` (stats=, params=, top_k=)."""
        selection = ScalarSelection(stats, params, top_k)
        selection.check(self.slot_names, self.names)
        return selection.scalars(self.read(), prefix)

    def reset(self) -> None:
        """Forget the recorded norms (no sync); the clipping state (norm_ema, step: `state(name)`) is kept."""
        for hook in self._clip._hooks.values():
            hook.stats.reset()

    def __repr__(self) -> str:
        return f"AdaptiveClipStats({len(self._clip._hooks)} parameters x {list(self.slot_names)})"


def adaptive_clip(beta: float = 0.98, ratio: float = 1.05, warmup_steps: int = 100, max_norm: float = 1.0,
                  backend: str | None = None) -> AdaptiveClip:
    """AdaGC (arXiv 2502.11034): per-tensor clipping against an EMA of each tensor's own clipped norm.

    See AdaptiveClip for the equations. Use: `fh.adaptive_clip(warmup_steps=100).register(model)`.
    """
    return AdaptiveClip(beta=beta, ratio=ratio, warmup_steps=warmup_steps, max_norm=max_norm, backend=backend)
