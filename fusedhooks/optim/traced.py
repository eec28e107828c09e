"""The optimizer step inside the backward as a torch operator, for a backward that compiled autograd traces.

`fusedhooks::step_in_backward` steps one parameter from its gradient with the tensors of its optimizer state, all
handed to it: the parameter and its state declared mutated, the gradient read. The state's tensors are looked up (and
at a first step made) while the hook is traced, so they are the graph's inputs (or its outputs); the implementation
(`BackwardSteps.step_given`) is the eager step of these tensors (the optimizer's `_step_group`, the group's
hyper-parameters and lr read when it runs, so a schedule changing lr compiles nothing new) and writes nothing else:
aot_autograd may functionalize the call and hand copies, which the compiled graph copies back, and inductor may order
the parameter's other reads around it as the declared mutation allows (a step of the parameter itself, behind the
graph's back, was read by a later gradient computation there). The compiled graph holds one call per parameter
instead of a graph break. Like `fusedhooks::fire` it keeps Python books at each call (the launch tables, the
stochastic rounding's draws, the check of a parameter fired twice): tagged `cudagraph_unsafe`.

Imported when a step is first traced (importing fusedhooks does not import it).
"""

from __future__ import annotations

import torch

from ..firing import optable

_TAGS = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()


@torch.library.custom_op("fusedhooks::step_in_backward", mutates_args=("param", "states"), tags=_TAGS)
def step_in_backward(param: torch.Tensor, grad: torch.Tensor, states: list[torch.Tensor], steps_key: int, slot: int,
                     first: bool) -> None:
    """Step `param` from `grad` with `states` (its state's tensors, in the order of the optimizer's `state_names`;
    `first`: made for this step, unwritten): the parameter at position `slot` of the BackwardSteps that
    `optable.target(steps_key)` names."""
    steps = optable.target(int(steps_key))
    if steps is None:
        raise RuntimeError("fusedhooks::step_in_backward: the optimizer step it was traced with no longer exists")
    steps.step_given(param, grad, states, int(slot), bool(first))


@step_in_backward.register_fake
def _(param, grad, states, steps_key, slot, first) -> None:
    return None
