"""When a registration processes its gradients: every backward, every n-th (gradient accumulation), or when a
condition the user gives holds (`register(..., accumulation_steps=n)`, `register(..., when=fn)`)."""

from __future__ import annotations

import weakref

import torch


class _Running:
    """Queued as an end-of-backward callback: alive while its backward runs (a backward that raises drops its
    callbacks, and with them this object), `done` once the backward has ended normally."""

    __slots__ = ("done", "__weakref__")

    def __init__(self):
        self.done = False

    def __call__(self) -> None:
        self.done = True


class EveryNthBackward:
    """`when=` of `register(..., accumulation_steps=steps)`: true in the backwards numbered steps, 2 * steps, ...
    of those in which the registration fires (counted from 1), false in the others.

    A backward started while a counted one still runs (the nested backward of reentrant activation checkpointing)
    is part of it; firings outside any backward (calls by hand) count as one backward, as for statistics rows.
    """

    def __init__(self, steps: int):
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"accumulation_steps= takes a whole number of micro-batches >= 1, not {steps!r}")
        self.steps = steps
        self.backwards = 0  # backwards counted so far
        self._key: int | None = None  # the autograd graph task id of the last one counted
        self._nested: set[int] = set()
        self._running: weakref.ref | None = None
        self._process = False

    def __call__(self) -> bool:
        key = torch._C._current_graph_task_id()
        if key == self._key or key in self._nested:
            return self._process
        running = self._running() if self._running is not None else None
        if running is not None and not running.done:
            self._nested.add(key)
            return self._process
        self._key, self._nested, self._running = key, set(), None
        self.backwards += 1
        self._process = self.backwards % self.steps == 0
        if key != -1:
            running = _Running()
            torch.autograd.Variable._execution_engine.queue_callback(running)
            self._running = weakref.ref(running)
        return self._process


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


def gated(fire, when):
    """The torch hook that calls `fire(param)` only when `when()` is true; while torch.compile traces it, both
    run outside the graph (a graph break: `when` is Python state of the training loop, read at each backward)."""
    def run(param: torch.Tensor) -> None:
        if when():
            fire(param)

    def hook(param: torch.Tensor) -> None:
        if torch.compiler.is_compiling():
            from . import ops

            ops.outside_graph(run, param)
        else:
            run(param)
    return hook
