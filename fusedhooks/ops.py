"""A firing as one torch custom op (`torch.ops.fusedhooks.process`), for code that torch.compile traces.

Under compiled autograd (`torch._dynamo.compiled_autograd`) dynamo traces the post-accumulate hooks into the
backward graph; it cannot trace fusedhooks' firing path (registries, weak references, thread ids, the Triton
launcher or interpreter). A hook registered with `register()` therefore calls this opaque op while it is being
compiled: the op's implementation is the ordinary firing (`GradHook.process`), run when the graph runs, and its
fake implementation does nothing, so the traced graph holds one call per gradient and no graph break. The op
mutates the gradient and the hook's statistics buffer (declared in `mutates_args`); it writes into the tensors it
is given, so functionalization's copies (when it makes them) carry the results back.
"""

from __future__ import annotations

import itertools
import weakref

import torch

#: token -> (hook, entry): what a traced call refers to (ints are what a custom op's schema can carry)
_TARGETS: dict[int, tuple[weakref.ref, object]] = {}
_next_token = itertools.count(1)


def token(hook, entry) -> int:
    """A number standing for (hook, entry) in traced graphs; registered at `register()` time."""
    for key, (hook_ref, _entry) in list(_TARGETS.items()):
        if hook_ref() is None:
            del _TARGETS[key]
    key = next(_next_token)
    _TARGETS[key] = (weakref.ref(hook), entry)
    return key


@torch.library.custom_op("fusedhooks::process", mutates_args=("grad", "stats"))
def process(grad: torch.Tensor, param: torch.Tensor, stats: torch.Tensor, token: int) -> None:
    """Process `grad` (the registered parameter's .grad) in place and record its statistics into `stats` (the
    hook's buffer, `hook.stats.tensor`): one firing of the (hook, entry) that `token` stands for."""
    hook_ref, entry = _TARGETS[token]
    hook = hook_ref()
    if hook is not None and entry.ref() is not None:
        hook.process(entry, grad, param, torch._C._current_graph_task_id(), stats=stats)


@process.register_fake
def _(grad, param, stats, token) -> None:
    return None


def fire_traced(hook, key: int, param: torch.Tensor) -> None:
    """The hook of a registered tensor while torch.compile traces it: one `fusedhooks::process` call."""
    if hook._paused or param.grad is None:
        return
    torch.ops.fusedhooks.process(param.grad, param, hook.stats.tensor, key)


def _call(fn, *args) -> None:
    fn(*args)


_outside_graph = []  # torch.compiler.disable(_call), made at first use (it imports dynamo)


def outside_graph(fn, *args) -> None:
    """`fn(*args)` run eagerly, outside the graph torch.compile is tracing (a graph break there)."""
    if not _outside_graph:
        _outside_graph.append(torch.compiler.disable(_call))
    _outside_graph[0](fn, *args)


def fire_untraced(hook, param: torch.Tensor) -> None:
    """`hook(param)` called directly (a tensor registered through torch) while torch.compile traces it: run
    outside the graph, since its registration is found at the firing."""
    outside_graph(_fire_eagerly, hook, param)


def _fire_eagerly(hook, param: torch.Tensor) -> None:
    if not hook._paused:
        hook.fire(param)
