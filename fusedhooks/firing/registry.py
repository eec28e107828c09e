"""The tensors a hook fires on: their entries, statistics rows, which gradient each row measured, and the handles
register() returns."""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from operator import itemgetter

import torch

from ..stats.buffer import HookStats


class Measurement(tuple):
    """The gradient a statistics row describes: that tensor object (not its address alone: a freed gradient's
    address is often reused by the next one) at that version and address (`p.grad.data = t` keeps the object and
    its version, not its storage). `coef`: a 0-dim device tensor the gradient
    was multiplied by afterwards without a version bump (clip_grad_norm_ with max_norm=inf multiplies by 1,
    or by NaN when the total norm is not finite), so the recorded norm times `coef` is its norm now.

    A view of `Entry.measured`, the plain tuple (grad, version, address, coef) that every firing recording
    statistics makes (a tuple subclass, made and freed at each firing, cost it about 0.3 µs more):
    `entry.measurement` reads it."""

    __slots__ = ()

    grad: weakref.ref = property(itemgetter(0))  # type: ignore[assignment]
    version: int = property(itemgetter(1))  # type: ignore[assignment]
    address: int = property(itemgetter(2))  # type: ignore[assignment]
    coef: torch.Tensor | None = property(itemgetter(3))  # type: ignore[assignment]

    def describes(self, grad: torch.Tensor, bumps: int = 0) -> bool:
        """Is `grad` the measured gradient, unchanged since (but for `bumps` version bumps known to write nothing)?"""
        return self[0]() is grad and self[1] + bumps == grad._version and self[2] == grad.data_ptr()


@dataclass(eq=False)
class Entry:
    """One registered tensor: a weak reference, its statistics key and row."""

    ref: weakref.ref
    name: str
    row: int
    checked_shape: tuple | None = None
    bucket_bytes: int = 0  # > 0: processed in end-of-backward buckets of this many gradient bytes
    torch_hook_id: int | None = None  # our key in the tensor's _post_accumulate_grad_hooks
    averaged: bool = False  # registered through DDP's communication hook (register(ddp_model))
    ddp_ignored: bool = False  # of register(ddp_model), a parameter DDP ignores: its own gradient, at its firing
    sharded: bool | None = None  # the tensor is a DTensor (FSDP2); None: not known yet (its first firing)
    steps_in_backward: bool = False  # an optimizer steps it right after its firing (register(..., optimizer=))
    #: what its statistics row describes, (grad, version, address, coef) as a plain tuple (see Measurement, and
    #: `measurement`), None before its first firing
    measured: tuple | None = None

    @property
    def tensor(self) -> torch.Tensor | None:
        return self.ref()

    @property
    def measurement(self) -> Measurement | None:
        """What its statistics row describes (None before its first firing)."""
        return None if self.measured is None else Measurement(self.measured)

    def has_later_hooks(self, t: torch.Tensor) -> bool:
        """Does a post-accumulate hook registered after ours run on `t` (it must see the processed gradient)?"""
        hooks = t._post_accumulate_grad_hooks
        return bool(hooks) and self.torch_hook_id is not None and next(reversed(hooks)) != self.torch_hook_id


def record_all(entries: list[Entry], grads: list[torch.Tensor]) -> None:
    """The statistics row of each entry now describes its gradient as it is (a firing's: one gradient, or a
    bucket's)."""
    if len(entries) == 1:  # one gradient at its firing: no zip (about 0.15 µs of a 3 µs firing)
        grad = grads[0]
        entries[0].measured = (_ref(grad), grad._version, grad.data_ptr(), None)
        return
    for entry, grad in zip(entries, grads):
        entry.measured = (_ref(grad), grad._version, grad.data_ptr(), None)


_ref = weakref.ref


class Registry:
    """The live registrations of one hook, in registration order, and their rows in `stats`.

    An entry goes away when its tensor is garbage-collected or removed; a name that is no longer in use
    can be registered again and gets its old row back, cleared.
    """

    def __init__(self, stats: HookStats):
        self.stats = stats
        self._entries: dict[int, Entry] = {}

    def __iter__(self) -> Iterator[Entry]:
        """Live entries in registration order."""
        return (e for e in list(self._entries.values()) if e.ref() is not None)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def get(self, t: torch.Tensor) -> Entry | None:
        entry = self._entries.get(id(t))
        return entry if entry is not None and entry.ref() is t else None

    def get_live(self, t: torch.Tensor) -> Entry | None:
        """`get` for a tensor that is alive and registered or not: its entry found by its id alone (an entry goes
        away as soon as its tensor is freed, so an id found is its tensor's). What dynamo traces (guards on the
        id, not on calling a weak reference)."""
        return self._entries.get(id(t))

    def names(self) -> set[str]:
        return {e.name for e in self}

    def add(self, name: str, t: torch.Tensor) -> Entry:
        """Register `t` under `name` (checked by the caller: not registered, name free)."""
        if name in self.stats.names:
            row = self.stats.names.index(name)  # registered before, then removed or collected
            self.stats.clear_row(row)
        else:
            row = self.stats.add_row(name, t.device)
        key = id(t)
        registry = weakref.ref(self)

        def forget(ref, key=key):  # (no reference to the entry: remove() frees it, and its weak reference, at once)
            reg = registry()
            if reg is not None and (entry := reg._entries.get(key)) is not None and entry.ref is ref:
                del reg._entries[key]

        entry = Entry(weakref.ref(t, forget), name, row)
        self._entries[key] = entry
        return entry

    def remove(self, t: torch.Tensor) -> None:
        if self.get(t) is not None:
            del self._entries[id(t)]

    def discard(self, entries: list[Entry]) -> None:
        """Undo `add` for these entries (a register() call that failed part-way)."""
        for e in entries:
            t = e.ref()
            if t is not None and self._entries.get(id(t)) is e:
                del self._entries[id(t)]


class RegistrationHandle:
    """What `register` returns: `remove()` stops the hook on those tensors; usable as a context manager."""

    def __init__(self, hook):
        self.hook = hook
        self._items: list[tuple[weakref.ref, object, Registry | None]] = []
        self._on_remove: list = []
        self.when = None  # register()'s gate (accumulation_steps=, when=): None processes every firing
        self.step_in_backward = None  # register()'s optimizer step after each firing (optimizer=), or None

    def add(self, t: torch.Tensor, torch_handle, registry: Registry | None = None) -> None:
        """Track a torch hook handle on `t`; `registry`: where `t` is registered, forgotten at remove()."""
        self._items.append((weakref.ref(t), torch_handle, registry))

    def on_remove(self, fn) -> None:
        """Call `fn()` at remove()."""
        self._on_remove.append(fn)

    def extend(self, other: RegistrationHandle) -> None:
        """Take over everything `other` would remove."""
        self._items += other._items
        self._on_remove += other._on_remove
        other._items, other._on_remove = [], []

    @property
    def tracked(self) -> int:
        """How many torch hook handles it tracks (where `untrack(start=)` starts)."""
        return len(self._items)

    @property
    def first_tensor(self) -> torch.Tensor | None:
        """The tensor of the first handle tracked; None when it was collected, or when none is tracked."""
        return self._items[0][0]() if self._items else None

    def untrack(self, start: int = 0, forget: bool = True) -> None:
        """Remove the torch hooks tracked from the `start`-th on and stop tracking them (the functions of
        `on_remove` stay). forget: also forget their tensors in their registries (a failed registration's rollback
        leaves that to its caller)."""
        for ref, torch_handle, registry in self._items[start:]:
            torch_handle.remove()
            t = ref()
            if forget and t is not None and registry is not None:
                registry.remove(t)
        del self._items[start:]

    @property
    def tensors(self) -> list[torch.Tensor]:
        seen, out = set(), []
        for ref, _, _ in self._items:
            t = ref()
            if t is not None and id(t) not in seen:
                seen.add(id(t))
                out.append(t)
        return out

    def remove(self) -> None:
        """Stop the hook on these tensors: later firings only (a gradient already waiting in an end-of-backward
        bucket of the running backward is still processed)."""
        self.untrack()
        for fn in self._on_remove:
            fn()
        self._on_remove.clear()

    def __enter__(self) -> RegistrationHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def __len__(self) -> int:
        return len(self.tensors)
