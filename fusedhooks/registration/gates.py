"""When a registration processes its gradients: every backward, every n-th (gradient accumulation), or when a
condition the user gives holds (`register(..., accumulation_steps=n)`, `register(..., when=fn)`). Backwards are
counted as `backwards.Backwards` counts them."""

from __future__ import annotations

import torch

from ..stats.backwards import Backwards, refuse_nested_compiled_backward


class EveryNthBackward:
    """`when=` of `register(..., accumulation_steps=steps)`: true in the backwards numbered steps, 2 * steps, ...
    of those in which the registration fires (counted from 1, as `Backwards` counts them; a backward that raised is
    not counted), false in the others.
    """

    def __init__(self, steps: int):
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"accumulation_steps= takes a whole number of micro-batches >= 1, not {steps!r}")
        self.steps = steps
        self._backwards = Backwards(count_failed=False)

    @property
    def backwards(self) -> int:
        """Backwards counted so far."""
        return self._backwards.number

    def __call__(self) -> bool:
        self._backwards.enter(torch._C._current_graph_task_id())
        return self._backwards.number % self.steps == 0


def parse(accumulation_steps, when):
    """The gate of a registration (None: every firing processes) from register()'s two options."""
    if accumulation_steps is not None and when is not None:
        raise ValueError("pass accumulation_steps= or when=, not both")
    if when is not None:
        if not callable(when):
            raise TypeError(f"when= takes a function of no arguments returning a bool, not {type(when).__name__}")
        return when
    if accumulation_steps is None:
        return None
    gate = EveryNthBackward(accumulation_steps)
    return gate if gate.steps > 1 else None


def gated(fire, when, outside_graph, paused=None):
    """The torch hook that calls `fire(param)` only when `when()` is true; while torch.compile traces it, both
    run outside the graph, by `outside_graph(fn, *args)` (a graph break: `when` is Python state of the training
    loop, read at each backward).
    While `paused()` (the hook's `paused()` block) `when` is not called: a paused backward is no micro-batch of
    `accumulation_steps=`, as the hook does not fire in it."""
    def run(param: torch.Tensor) -> None:
        if (paused is None or not paused()) and when():
            fire(param)

    def hook(param: torch.Tensor) -> None:
        if torch.compiler.is_dynamo_compiling():  # see ops
            refuse_nested_compiled_backward()
            outside_graph(run, param)
        else:
            run(param)
    return hook
