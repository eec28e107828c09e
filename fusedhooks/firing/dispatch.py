"""The eager firing's dispatch (DESIGN.md, Architecture: "the firing"): what a call of a hook on one gradient does
before the firing sequence (`firing.Firing`) runs. It skips a paused hook and a missing gradient, gives a tensor
registered through torch directly its entry, hands a plain dense gradient of a dtype and device (and thread) it has
processed before to that one's lean firing, a sharded (FSDP2) gradient to `shards.ShardStats`, and every other
gradient to `process`: a first firing, a gradient autograd records the body on (backward(create_graph=True)), the
first firing in a process group.

`Dispatch` is handed the hook's parts, never the hook; the torch hook of a tensor processed at its own firing
(`Dispatch.torch_hook`) calls `Dispatch.fire` with nothing in between."""

from __future__ import annotations

import contextlib
import functools
import threading
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch.compiler import is_dynamo_compiling as _is_compiling  # checked at every firing (see ops)

from ..runtime import launcher, process_groups
from ..runtime.layout import is_dtensor
from .registry import Entry, Registry

if TYPE_CHECKING:
    from ..runtime.compilation import Compiled, HookCompilation, Workspaces
    from .sequence import Firing
    from .shards import ShardStats

# read at every firing: bound once
_get_ident = threading.get_ident
_graph_task_id, _grad_enabled, _set_grad_enabled = (torch._C._current_graph_task_id, torch.is_grad_enabled,
                                                    torch._C._set_grad_enabled)
_Tensor, _strided = torch.Tensor, torch.strided

#: `lean_firing(backward_key, [entry], [entry.row], [grad], [param])`, with `launches_only`: see Dispatch.lean_firing
LeanFiring = Callable[[int, list, list, list, list], None]


class Dispatch:
    """The eager firing of one hook, one gradient at a time (`fire`, `process`), and whether the hook is paused.

    Handed the hook's parts, never the hook: `registry` (its entries), `add_at_firing(t)` -> Entry (registers a
    tensor registered through torch directly, at its first firing: `registration.Registration.add_at_firing`),
    `compilation` (the plans and kernels by the gradient's dtype, device and shape, the shape check, the body for a
    shape, whether it is planned per shape, the hook's name for messages), `workspaces` (its per-thread scratch),
    `firing` (the firing sequence, the body's closed-over tensors `firing.scalars` and their check), `shards` (the
    firing of sharded gradients, `shards.ShardStats`) and `process_at_firing()` (its end-of-backward buckets
    processed at each firing from now on, `buckets.Buckets.process_at_firing`)."""

    def __init__(self, registry: Registry, add_at_firing: Callable[[torch.Tensor], Entry],
                 compilation: HookCompilation, workspaces: Workspaces, firing: Firing,
                 shards: ShardStats, process_at_firing: Callable[[], None]):
        self.registry, self.add_at_firing = registry, add_at_firing
        # the per-firing lookups, bound (no call between): `compiled` by the gradient's dtype and device index, the
        # reference plan autograd records, this thread's workspace on the gradient's device
        self.compiled_for = compilation.compiled_for
        self.compiled_for_autograd = compilation.compiled_for_autograd
        self.workspace_for = workspaces.for_grad
        self.check_shape, self.body_for = compilation.check_shape, compilation.body_for
        #: the body is lowered and planned for each gradient shape: the lean firings are kept by shape too
        self.reduces_over_dims = compilation.reduces_over_dims
        #: the hook's name, for messages
        self.hook_name = compilation.name
        self.firing, self.scalars, self.check_scalars = firing, firing.scalars, firing.check_scalars
        self.shards, self.process_at_firing = shards, process_at_firing
        #: True while any `paused()` block runs, in any thread (read-only: set by paused())
        self.is_paused = False
        self._pauses = 0
        self._pause_lock = threading.Lock()
        self._distributed_checked = False
        self._distributed_seen = -1  # the backward in which no process group was running, last checked
        #: `lean_key(grad)` -> the `lean_firing` of such gradients (eager and triton backends)
        self.lean_firings: dict[tuple, LeanFiring] = {}

    def torch_hook(self, fire_compiling: Callable[[torch.Tensor], None], entry: Entry
                   ) -> Callable[[torch.Tensor], None]:
        """The torch hook of a tensor registered by register() (bucket_mb=0): `hook(param)` for its entry, calling
        `fire` directly; while torch.compile traces it, `fire_compiling(param)` (one `fusedhooks::fire` op, see
        `ops`), which holds the hook: the tensor keeps it alive."""
        dispatch_fire = self.fire

        def fire(param: torch.Tensor) -> None:
            if _is_compiling():
                fire_compiling(param)
            elif not self.is_paused:
                dispatch_fire(param, entry if entry.ref() is param else None)
        return fire

    @contextlib.contextmanager
    def paused(self):
        """`GradHook.paused`: `is_paused` while any such block runs, in any thread."""
        with self._pause_lock:
            self._pauses += 1
            self.is_paused = True
        try:
            yield
        finally:
            with self._pause_lock:
                self._pauses -= 1
                self.is_paused = self._pauses > 0

    def fire(self, param: torch.Tensor, entry: Entry | None = None, backward_key: int | None = None,
             grad: torch.Tensor | None = None, by_hand: bool = False) -> None:
        """`GradHook.fire` (see its docstring): process `param.grad` (or `grad`) now, in place, one firing of the
        backward `backward_key` (default: the current one) for `entry` (looked up, or made at a first firing)."""
        if grad is None:
            grad = param.grad
            if grad is None:
                return
        if entry is None:
            entry = self.registry.get(param) or self.add_at_firing(param)
        if backward_key is None:
            backward_key = _graph_task_id()
        key = (grad.dtype, grad.is_cuda, grad.get_device(), _get_ident())  # `lean_key(grad)`, written out
        if self.reduces_over_dims:
            key += (grad.shape,)
        lean_firing = self.lean_firings.get(key)
        if (lean_firing is not None and type(grad) is _Tensor and grad.layout == _strided
                and not grad.requires_grad and (lean_firing.launches_only if by_hand else not _grad_enabled())
                and grad.numel() and entry.checked_shape == grad.shape
                and (self._distributed_checked or backward_key == self._distributed_seen)):
            lean_firing(backward_key, [entry], [entry.row], [grad], [param])  # process(), with fewer lookups
            return
        if by_hand:
            _set_grad_enabled(False)
            try:
                self.fire(param, entry, backward_key, grad)
            finally:
                _set_grad_enabled(True)
            return
        if is_dtensor(grad):
            self.shards.fire(entry, param, grad, backward_key)
            return
        if not self._distributed_checked:
            self.check_distributed(entry, backward_key)
        self.process(entry, grad, param, backward_key)

    def fire_unless_paused(self, param: torch.Tensor) -> None:
        """The eager firing, run outside the graph torch.compile traces: for a gradient that requires grad
        (backward(create_graph=True)), whose body runs as eager torch ops that autograd records."""
        if not self.is_paused:
            self.fire(param, self.registry.get(param))

    def process(self, entry: Entry, grad: torch.Tensor, param: torch.Tensor, backward_key: int) -> None:
        """`GradHook.process`: apply the body to `grad` (param.grad, or DDP's averaged bucket view of it) in place
        and record its statistics in `entry`'s row, as one firing of the backward `backward_key`; leave the lean
        firing of such gradients behind for `fire`."""
        if grad.layout != torch.strided:
            raise TypeError(f"{entry.name}: its gradient is a {grad.layout} tensor; gradient hooks process dense "
                            "gradients: make the module produce dense ones (nn.Embedding(sparse=False)) or register "
                            "the hook on the other parameters only")
        if self.records(grad, param):
            compiled = self.compiled_for_autograd(grad.dtype, grad.shape)
        else:
            compiled = self.compiled_for(grad)
        if entry.checked_shape != grad.shape:
            self.check_shape(entry.name, grad)
            entry.checked_shape = grad.shape
        self.firing_for(compiled, grad)(backward_key, [entry], [entry.row], [grad], [param])
        key = self.lean_key(grad)
        if (compiled.plan.backend in ("eager", "triton") and key not in self.lean_firings
                and not torch.is_grad_enabled() and not grad.requires_grad and grad.numel()):
            if len(self.lean_firings) > 256:  # shapes keep changing: keep it small
                self.lean_firings.clear()
            self.lean_firings[key] = self.lean_firing(compiled, grad)

    def records(self, grad: torch.Tensor, param: torch.Tensor) -> bool:
        """Does an eager hook's body on `grad` make autograd record it here: `.grad` requires grad, or, with grad
        mode on (a backward(create_graph=True)), the body reads a tensor that does (the parameter, a closed-over
        tensor)? Then the body runs as eager torch ops that autograd records, as an eager hook's would."""
        if grad.requires_grad:
            return True
        if not torch.is_grad_enabled():
            return False
        return ((param.requires_grad and self.body_for(tuple(grad.shape)).uses_param)
                or any(s.requires_grad for s in self.scalars))

    def lean_key(self, grad: torch.Tensor) -> tuple:
        """What a lean firing is kept by: the gradient's dtype and device, read without building a torch.device, the
        thread (whose workspace its launch writes) (and the shape, for a body planned per shape)."""
        key = (grad.dtype, grad.is_cuda, grad.get_device(), _get_ident())
        return key + (grad.shape,) if self.reduces_over_dims else key

    def lean_firing(self, compiled: Compiled, grad: torch.Tensor) -> LeanFiring:
        """`process` for a plain (not a DTensor, not requiring grad), dense, non-empty gradient of `compiled`'s dtype
        and device (`grad`'s) whose shape is checked, in this thread, as `fire` calls it once the distributed check is
        done for this backward: `firing(backward_key, [entry], [entry.row], [grad], [param])`, on the eager and triton
        backends. It does only what the plan needs: on the eager backend without statistics and AMP, the body alone
        (no backward numbering, row, or record for clip_grad_norm_, which only reads hooks that record statistics).
        Its `launches_only`: whether it only launches kernels (`launcher.launches_only`), which record nothing with
        grad mode on."""
        plan, module, scalars, check_scalars = compiled.plan, compiled.kernel, self.scalars, self.check_scalars
        if plan.backend == "eager" and not (plan.slots or plan.amp):
            def body_alone(backward_key: int, entries: list, rows: list, grads: list, params: list) -> None:
                if scalars:
                    check_scalars()
                module(grads[0], params[0], scalars)
            body_alone.launches_only = False
            return body_alone
        lean = self.firing_for(compiled, grad)
        lean.launches_only = launcher.launches_only(plan, module)
        return lean

    def firing_for(self, compiled: Compiled, grad: torch.Tensor) -> functools.partial:
        """The firing of gradients of `compiled`'s dtype and device (`grad`'s) in this thread (`process` and the lean
        firing call it): `firing.Firing.run` (the sequence, written once) with the plan and the launch of one gradient
        (`launcher.single_launch`) into this thread's workspace on that device bound, as
        `firing(backward_key, [entry], [entry.row], [grad], [param])`."""
        plan = compiled.plan
        launch = launcher.single_launch(plan, compiled.kernel, self.scalars, self.workspace_for(grad))
        firing = self.firing
        return functools.partial(type(firing).run, firing, plan, launch)  # a function, not a bound method: one call

    def check_distributed(self, entry: Entry, backward_key: int) -> None:
        """At the first firing on a gradient of this rank alone in a process group of several ranks: say once
        that the hook sees local gradients (under DDP, before they are averaged), and process end-of-backward
        buckets at each firing from now on, before DDP's reducer (which Python cannot see) reads them. Without
        a process group, checked again at the next backward; once checked, nothing."""
        if self._distributed_checked or backward_key == self._distributed_seen or entry.ddp_ignored:
            return
        world = process_groups.world_size()
        if world is None:
            self._distributed_seen = backward_key
            return
        self._distributed_checked = True
        if world > 1:
            self.process_at_firing()
            warnings.warn(process_groups.LocalGradientWarning(
                f"fusedhooks: {self.hook_name} processes each rank's own gradient of {entry.name} (a process group "
                f"of {world} ranks is running). Under DistributedDataParallel that is the local, un-averaged "
                "gradient, processed before DDP averages it, as an eager torch hook would be; to process the "
                "averaged gradient instead, register the hook on the DDP model itself: hook.register(ddp_model). "
                "End-of-backward buckets (bucket_mb=) of this hook are processed at each firing from now on, "
                "so that DDP reads the processed gradients."), stacklevel=3)
