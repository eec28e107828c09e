"""What a backward is: the outermost one the user started. Statistics rows, GradScaler's books, accumulation
counts and FSDP2's merges are each kept per backward.

A nested backward (reentrant activation checkpointing, or `torch.autograd.grad`/`backward` called inside a custom
Function's backward) is its own autograd graph task, run while a node of the outer one executes: `track` learns which
backward it is nested in when it ends (a post-hook on the node that ran it fires in the outer graph task), so that
every book counting backwards counts the two as one, whatever order they fire in (docs/semantics.md, "What a backward
is")."""

from __future__ import annotations

import inspect
import sys
import threading
import weakref
from collections.abc import Callable

import torch


def callbacks_run(key: int) -> bool:
    """Will an end-of-backward callback queued now run when the backward `key` (graph task id) ends normally? Not
    outside a backward, nor in another graph task, nor while compiled autograd runs its graph (the engine then
    drops what is queued from inside an op)."""
    if key < 0 or key != torch._C._current_graph_task_id():
        return False
    compiled_autograd = sys.modules.get("torch._dynamo.compiled_autograd")
    return compiled_autograd is None or not compiled_autograd.in_compiled_autograd_region


class GraphTask:
    """One autograd graph task in which fusedhooks did something, as far as it knows it: `ended` once its
    end-of-backward callback ran; `outer`, the GraphTask of the backward it is nested in, learnt when it ended (None:
    not nested, or not known). Outlives its callback (`_TaskEnd`), which the engine drops when the backward raises:
    `alive()` is then None while `ended` is False."""

    __slots__ = ("key", "ended", "nested", "outer", "alive", "at_end", "links", "__weakref__")

    def __init__(self, key: int):
        self.key = key
        self.ended = False
        #: set when it ends: was it run by a node of another backward (a nested backward)?
        self.nested = False
        self.outer: GraphTask | None = None
        self.alive: Callable[[], object] = _dead
        #: what runs when the outermost backward holding this one ends normally (see `at_end`)
        self.at_end: list[Callable[[], None]] = []
        #: the handles of the post-hooks that link the backwards nested in this one (removed when it ends)
        self.links: list = []

    def innermost_unended(self) -> GraphTask | None:
        """This task or the first of its outer ones that has not ended (None: all have)."""
        task = self
        while task is not None and task.ended:
            task = task.outer
        return task

    def running(self) -> bool:
        """Is the outermost backward holding this one still running (not ended, not raised)?"""
        task = self.innermost_unended()
        return task is not None and task.alive() is not None

    def failed(self) -> bool:
        """Did the outermost backward holding this one raise (its callback dropped before it ran)?"""
        task = self.innermost_unended()
        return task is not None and task.alive() is None


def _dead():
    return None


class _TaskEnd:
    """Queued as the end-of-backward callback of a GraphTask's graph task (which holds it, and through it the
    GraphTask): marks it ended, and, if the graph task was nested in another (a node of an outer backward is being
    evaluated on this thread), asks for a post-hook on that node, which links it to the outer backward when it runs
    there; what the GraphTask keeps for the end of the outermost backward (`at_end`) goes along, and runs then."""

    __slots__ = ("task", "__weakref__")

    def __init__(self, task: GraphTask):
        self.task = task

    def __call__(self) -> None:
        task = self.task
        task.ended = True
        for handle in task.links:
            handle.remove()
        task.links.clear()
        node = torch._C._current_autograd_node()
        task.nested = node is not None
        if node is None:  # the outermost backward ended
            at_end, task.at_end = task.at_end, []
            for fn in at_end:
                fn()
            return
        linked = [False]

        def link(grad_inputs, grad_outputs) -> None:
            if linked[0]:  # a retained graph's node run again
                return
            linked[0] = True
            outer = track(torch._C._current_graph_task_id())
            task.outer = outer
            if outer is not None:
                outer.links.append(handle)
                outer.at_end += task.at_end
            task.at_end = []

        handle = node.register_hook(link)


#: graph task id -> its GraphTask, while its callback or a book holds it
_tasks: weakref.WeakValueDictionary[int, GraphTask] = weakref.WeakValueDictionary()
_tasks_lock = threading.Lock()


def track(key: int) -> GraphTask | None:
    """The GraphTask of the backward `key` (graph task id), followed from its first call (its end-of-backward callback
    queued then); None outside a backward, or where no callback can be queued (see `callbacks_run`)."""
    task = _tasks.get(key)
    if task is not None or not callbacks_run(key):
        return task
    with _tasks_lock:
        task = _tasks.get(key)
        if task is None:
            task = _tasks[key] = GraphTask(key)
            end = _TaskEnd(task)
            task.alive = weakref.ref(end)
            torch.autograd.Variable._execution_engine.queue_callback(end)
    return task


def kept_until_end(running: weakref.WeakValueDictionary, key: int, make: Callable[[], object]):
    """The state `running` keeps for the running backward `key` (an autograd graph task): made by `make()` at its first
    use and held strongly only by the end-of-backward callback queued then (the state's `end()`), so that a backward
    that raises drops it and leaves nothing behind. The caller holds the lock that guards `running`."""
    state = running.get(key)
    if state is None:
        state = make()
        torch.autograd.Variable._execution_engine.queue_callback(state.end)
        running[key] = state
    return state


def at_end(key: int, fn: Callable[[], None]) -> bool:
    """Run `fn()` when the outermost backward holding the backward `key` ends normally (dropped if it raises); False
    (nothing queued) where no end-of-backward callback can run (see `callbacks_run`)."""
    if not callbacks_run(key):
        return False
    task = track(key)
    while task.ended and task.outer is not None:  # linked already: the backward it is nested in keeps it
        task = task.outer
    if task.ended and not task.nested:  # called from its own end-of-backward callbacks: runs after them
        torch.autograd.Variable._execution_engine.queue_callback(fn)
    else:
        task.at_end.append(fn)
    return True


def same_backward(task: GraphTask | None) -> bool:
    """Is `task` (a GraphTask, or None) part of a backward that still runs: the one a firing now belongs to?"""
    return task is not None and task.running()


#: What a firing in a backward nested in one that compiled autograd runs is refused with
NESTED_UNDER_COMPILED_AUTOGRAD = (
    "fusedhooks: a hook that counts backwards (statistics, scaler=, accumulation_steps= or when=) fired in a backward "
    "nested in another under compiled autograd (reentrant activation checkpointing, checkpoint(..., "
    "use_reentrant=True), or torch.autograd.grad/backward inside a custom Function's backward): compiled autograd "
    "compiles the nested backward as a graph of its own, run from inside the outer one, where fusedhooks cannot "
    "count the two as one backward. Use checkpoint(..., use_reentrant=False) (torch's recommendation; compiled "
    "autograd traces it into the outer graph), or run this backward without compiled autograd")


class NestedCompiledBackwardError(RuntimeError):
    """See NESTED_UNDER_COMPILED_AUTOGRAD."""


def refuse_nested_compiled_backward() -> None:
    """Called while torch.compile traces a firing: refuse it if compiled autograd is tracing a backward nested in one
    whose compiled graph runs now (its firings would be numbered as a backward of their own): on this thread's
    stack, a backward started (torch.autograd.graph._engine_run_backward) from inside a running compiled autograd
    graph (compiled_autograd's runtime_wrapper). A frame that dynamo resumes inside the running graph (after a graph
    break) is traced there too, with no backward started in between: not refused."""
    frame = inspect.currentframe().f_back
    started = False
    while frame is not None:
        code = frame.f_code
        if code.co_name == "_engine_run_backward" and code.co_filename.endswith(("autograd/graph.py",
                                                                                 "autograd\\graph.py")):
            started = True
        elif code.co_name == "runtime_wrapper" and "compiled_autograd" in code.co_filename:
            if started:
                raise NestedCompiledBackwardError(NESTED_UNDER_COMPILED_AUTOGRAD)
            return
        frame = frame.f_back


class Backwards:
    """Numbers the backwards in which something fires (statistics rows, `accumulation_steps=`), told apart by
    autograd's graph task.

    Backwards that overlap in time count as one: a backward started while a numbered one still runs (another
    thread's backward on a shared hook) gets its number, and so does each backward nested in a numbered one (reentrant
    activation checkpointing: `track`), before or after the outer one fires.
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
        #: graph tasks of the current number -> their GraphTask (`track`), None outside a backward
        self._members: dict[int, GraphTask | None] = {}
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
            if not any(map(same_backward, members)) and (key != -1 or -1 not in self._members):
                if self.count_failed or not members or not all(task is not None and task.failed() for task in members):
                    self.number += 1
                self._members = {}
            self._members[key] = track(key)
