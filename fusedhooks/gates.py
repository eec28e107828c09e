"""When a registration processes its gradients: every backward, every n-th (gradient accumulation), or when a
condition the user gives holds (`register(..., accumulation_steps=n)`, `register(..., when=fn)`)."""

from __future__ import annotations

import sys
import threading
import weakref

import torch


class _Running:
    """Queued as an end-of-backward callback: alive while its backward runs (a backward that raises drops its
    callbacks, and with them this object); `ended[0]` is set once the backward has ended normally (a list the
    Backwards keeps, so that it outlives this object)."""

    __slots__ = ("ended", "__weakref__")

    def __init__(self, ended: list[bool]):
        self.ended = ended

    def __call__(self) -> None:
        self.ended[0] = True


def callbacks_run(key: int) -> bool:
    """Will an end-of-backward callback queued now run when the backward `key` (graph task id) ends normally? Not
    outside a backward, nor in another graph task, nor while compiled autograd runs its graph (the engine then
    drops what is queued from inside an op)."""
    if key < 0 or key != torch._C._current_graph_task_id():
        return False
    compiled_autograd = sys.modules.get("torch._dynamo.compiled_autograd")
    return compiled_autograd is None or not compiled_autograd.in_compiled_autograd_region


def _running(marker) -> bool:
    return marker is not None and marker[0]() is not None and not marker[1][0]


def _failed(marker) -> bool:
    """Did the backward of `marker` raise (its callback dropped before it ran)?"""
    return marker is not None and marker[0]() is None and not marker[1][0]


class Backwards:
    """Numbers the backwards in which something fires (statistics rows, `accumulation_steps=`), told apart by
    autograd's graph task.

    Backwards that overlap in time count as one: a backward started while a numbered one still runs (the nested
    backward of reentrant activation checkpointing, another thread's backward on a shared hook) gets its number.
    A backward that raises ends with it; with count_failed=False its number is given again to the next backward
    (for `accumulation_steps=`: a failed backward is no micro-batch). Firings outside any backward (calls by hand,
    graph task -1) count as one backward, until a backward fires.
    """

    __slots__ = ("number", "count_failed", "key", "_members", "_lock")

    def __init__(self, count_failed: bool = True):
        self.number = 0  # of the current backward; 0 before the first
        self.count_failed = count_failed
        #: the graph task of the last firing (read-only: `enter` returns at once for it)
        self.key: int | None = None
        #: graph tasks of the current number -> (weak reference to its _Running, its `ended`), None outside a backward
        self._members: dict[int, tuple | None] = {}
        self._lock = threading.Lock()

    def enter(self, key: int) -> None:
        """A firing in graph task `key` (-1: outside a backward): `number` is then its backward's."""
        if key == self.key:
            return
        with self._lock:
            self.key = key
            if key in self._members:
                return
            members = self._members.values()
            if not any(map(_running, members)) and (key != -1 or -1 not in self._members):
                if self.count_failed or not members or not all(map(_failed, members)):
                    self.number += 1
                self._members = {}
            marker = None
            if callbacks_run(key):
                ended = [False]
                m = _Running(ended)
                torch.autograd.Variable._execution_engine.queue_callback(m)
                marker = (weakref.ref(m), ended)
            self._members[key] = marker


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
            outside_graph(run, param)
        else:
            run(param)
    return hook
