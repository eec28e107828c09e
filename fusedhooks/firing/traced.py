"""The firing while torch.compile traces a hook (DESIGN.md, Architecture: "the firing"; docs/compile.md): what a
torch hook does when dynamo traces it, and what the fusedhooks operators (ops.py) call back into while they are
traced or run.

In a backward that compiled autograd traces, each firing is one call of `fusedhooks::firing`, the firing as a
function of tensors, with the parameter's row looked up while tracing (the lookup is guarded: a new registration
recompiles) and the plan, the shape check and the closed-over tensors' check done while tracing (`TracedFiring.plan`);
which firing numbers the backward is decided while tracing too (`numbers_the_backward`). Otherwise (a hook frame
torch.compile compiles on its own, a tensor registered through torch directly at its first firing, a process group
of several ranks) one call of `fusedhooks::fire`, which runs the eager firing (`TracedFiring.fire_in_op`).

`TracedFiring` is handed the hook's parts, never the hook; the operators name it by its key (`optable`).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch

from ..runtime import process_groups
from ..stats import backwards
from . import optable

if TYPE_CHECKING:
    from ..compiler.plan import Plan
    from ..runtime.compilation import HookCompilation
    from ..stats.buffer import HookStats
    from .amp import HookAmp
    from .dispatch import Dispatch
    from .registry import Registry


class TracedFiring:
    """The firing of one hook under torch.compile, handed the hook's parts: `dispatch` (the eager firing, the pause
    flag, whether autograd records the body), `registry` (the rows), `stats` (the buffer and its device books),
    `amp` (GradScaler's books, None without scaler=), `compilation` (plans, kernels, the shape check), the body's
    closed-over tensors `scalars` and their `check_scalars()`. `key`: what the operators name it by."""

    def __init__(self, dispatch: Dispatch, registry: Registry, stats: HookStats, amp: HookAmp | None,
                 compilation: HookCompilation, scalars: list[torch.Tensor], check_scalars):
        self.dispatch, self.registry, self.stats, self.amp = dispatch, registry, stats, amp
        self.compilation, self.scalars, self.check_scalars = compilation, scalars, check_scalars
        self.key = optable.add(self)
        self.key_name = str(self.key)  # what numbers_the_backward is handed: never a symbolic int (dynamic=True)

    def fire_compiling(self, param: torch.Tensor) -> None:
        """What a hook does when called while dynamo traces it, for each gradient at its own firing (a hook
        registered with bucket_mb= too: see docs/compile.md): in a backward that compiled autograd traces, one call
        of fusedhooks::firing (fusedhooks::fire where the firing is not a function of tensors: a process group of
        several ranks, a tensor registered through torch directly before its first firing); a gradient autograd
        records the body on (backward(create_graph=True)) is fired outside the graph. A hook frame that dynamo
        compiles on its own (a backward run inside a torch.compile'd function, compiled autograd off) is one call of
        fusedhooks::fire (the eager firing), with nothing traced that differs between parameters: one compiled frame
        serves them all (tracing the registry lookup there guarded each parameter's identity, one recompile each)."""
        from . import ops

        grad = param.grad
        if grad is None:
            return
        dispatch = self.dispatch
        if dispatch.records(grad, param):  # the body must run as ops autograd records
            ops.outside_graph(dispatch.fire_unless_paused, param)
            return
        entry = self.registry.get_live(param) if compiled_autograd_traces() else None
        stats, amp = self.stats, self.amp
        if entry is not None and grad.layout == torch.strided:
            numbers = numbers_the_backward(self.key_name, grad.device)
            if numbers is not None:
                if dispatch.is_paused:
                    return
                books = stats.traced or (None, None)
                amp_books = amp.traced.get(grad.device, (None, None)) if amp is not None else (None, None)
                torch.ops.fusedhooks.firing(grad, param, stats.buffer if books[0] is not None else None, *books,
                                            amp.scaler._scale if amp_books[0] is not None else None, *amp_books,
                                            list(self.scalars), self.key, entry.row, numbers)
                return
        buffer = stats.buffer if stats.slot_names else None
        found_inf = amp.found_inf.get(grad.device) if amp is not None else None
        torch.ops.fusedhooks.fire(grad, param, buffer, found_inf, list(self.scalars), self.key)

    def fire_in_op(self, param: torch.Tensor, grad: torch.Tensor
                   ) -> tuple[torch.Tensor | None, dict[torch.device, torch.Tensor]] | None:
        """The implementation of fusedhooks::fire (ops.py): the eager firing on `grad`, `param`'s gradient, unless the
        hook is paused (None); else the tensors the firing writes: (the statistics buffer, found_inf by device)."""
        if self.dispatch.is_paused:
            return None
        self.dispatch.fire(param, self.registry.get(param), grad=grad)
        return self.stats.buffer, self.amp.found_inf if self.amp is not None else {}

    def plan(self, row: int, grad: torch.Tensor) -> tuple[Plan, object]:
        """The body of fusedhooks::firing while it is traced: the plan and kernels for `grad` (a fake or functional
        tensor of the gradient's dtype, device and shape), the gradient's shape checked against the body (for row
        `row`'s parameter) and the closed-over tensors checked, as the eager firing checks them."""
        self.compilation.check_shape(self.stats.names[row], grad)
        if self.scalars:
            self.check_scalars()
        compiled = self.compilation.compiled_for(grad)
        if compiled.plan.amp:
            self.amp.check_scale()
            self.amp.check_covers_optimizer()
        return compiled.plan, compiled.kernel


optable.implement("fire", TracedFiring.fire_in_op)


def _traced_plan(key: int, row: int, grad: torch.Tensor) -> tuple[Plan, object]:
    """`TracedFiring.plan` of the firing `key` names (ops.firing's call while traced)."""
    traced = optable.target(key)
    if traced is None:
        raise RuntimeError("fusedhooks::firing: the hook it was traced with no longer exists")
    return traced.plan(row, grad)


optable.implement("traced_plan", _traced_plan)


#: compiled autograd's graph id -> (dynamo frame id, the tracer) of the traced firing that numbers the backward, by
#: firing key (see `numbers_the_backward`)
_numbering_firings: dict[tuple[int, int, torch.device], tuple[int | None, weakref.ref]] = {}


def numbers_the_backward(key: str, device: torch.device) -> bool | None:
    """Called while dynamo traces a firing of the TracedFiring `key` on a gradient on `device` (a constant of the
    graph): None when the firing is not part of a backward that compiled autograd traces (fusedhooks::fire runs it),
    or when a process group of several ranks runs (the eager firing's distributed checks apply); else whether this
    firing numbers the backward on `device` (increments the hook's device epoch; with scaler=, zeroes found_inf and
    counts the backward): the first firing of the hook on `device` traced in compiled autograd's graph. A graph break
    splits that graph into frames run in order: the first frame holding such a firing numbers it, also when dynamo
    traces that frame again (a restart, a recompile). Makes the device books the firing writes, on first use."""
    from torch._dynamo.symbolic_convert import InstructionTranslator
    from torch._guards import CompileContext

    compile_id = CompileContext.current_compile_id()
    if compile_id is None or compile_id.compiled_autograd_id is None:
        return None
    world = process_groups.world_size()
    if world is not None and world > 1:
        return None
    key = int(key)
    traced = optable.target(key)
    if traced.stats.slot_names or traced.amp is not None:
        backwards.refuse_nested_compiled_backward()
    if traced.stats.slot_names:
        traced.stats.traced_books()
    if traced.amp is not None:
        traced.amp.traced_books(device)
    tracer = InstructionTranslator.current_tx().output
    numbering = (compile_id.compiled_autograd_id, key, device)
    known = _numbering_firings.get(numbering)
    if known is not None and (known[1]() is tracer or known[0] != compile_id.frame_id):
        return False
    if len(_numbering_firings) > 1024:
        _numbering_firings.clear()
    _numbering_firings[numbering] = (compile_id.frame_id, weakref.ref(tracer))
    return True


def compiled_autograd_traces() -> bool:
    """Called while dynamo traces a firing (a constant of the graph): is it part of a backward that compiled autograd
    traces (else dynamo compiles the hook's frame on its own)?"""
    from torch._guards import CompileContext

    compile_id = CompileContext.current_compile_id()
    return compile_id is not None and compile_id.compiled_autograd_id is not None


# what torch._dynamo.assume_constant_result does (dynamo calls it while tracing and keeps the result as a constant),
# without importing torch._dynamo with fusedhooks
numbers_the_backward._dynamo_marked_constant = True
compiled_autograd_traces._dynamo_marked_constant = True
