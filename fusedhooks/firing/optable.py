"""What the fusedhooks operators (ops.py) call, by the int key a traced call names its target with.

ops.py is imported only under torch.compile and imports no module above it: a hook enters itself here when it is
made (`add`), and each module that implements an operator enters that implementation when it is imported
(`implement`); the operators look both up when they run.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable

_keys = itertools.count(1)
#: key -> the object a traced operator call names (a hook's traced.TracedFiring, a GradHook), held weakly
_targets: weakref.WeakValueDictionary[int, object] = weakref.WeakValueDictionary()
#: operator name ("fire", "clip_grad_norm_") -> its eager implementation, `fn(target, ...)`
_implementations: dict[str, Callable] = {}


def add(target: object) -> int:
    """A process-unique key naming `target` (held weakly) in traced operator calls."""
    key = next(_keys)
    _targets[key] = target
    return key


def target(key: int) -> object | None:
    """The object `key` names, None once it is collected."""
    return _targets.get(key)


def implement(op: str, fn: Callable) -> None:
    """Make `fn(target, ...)` the eager implementation of the fusedhooks operator `op`."""
    _implementations[op] = fn


def implementation(op: str) -> Callable:
    """The eager implementation of the fusedhooks operator `op` (see `implement`)."""
    return _implementations[op]
