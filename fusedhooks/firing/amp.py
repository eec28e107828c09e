"""GradScaler's unscale made visible to version counters.

`GradScaler.unscale_(optimizer)` multiplies every gradient by 1/scale in place with
`torch._amp_foreach_non_finite_check_and_unscale_`, which does not bump the gradients' version counters. A
statistics row that measured the scaled gradient would then still look current to `fh.clip_grad_norm_`, which
would clip by a norm `scale` times too large. The first hook recording statistics (`install()`, from GradHook;
importing fusedhooks patches nothing in torch) wraps `_unscale_grads_` of GradScaler and of
its subclasses (FSDP's ShardedGradScaler, defined later) so that the gradients it unscaled have their versions
bumped afterwards, as any in-place op bumps them: nothing else changes.
"""

from __future__ import annotations

import functools
import threading
import weakref

import torch
from torch.amp import GradScaler
from torch.autograd.graph import increment_version

from ..runtime.layout import static
from ..stats.backwards import GraphTask, at_end, callbacks_run, same_backward, track

_WRAPPED = "__fusedhooks_bumps_versions__"
_installed = False

#: What a gradient unscaled twice (accumulated over backwards that each unscaled it) is refused with
ACCUMULATED_MESSAGE = (
    "already unscaled this gradient since the last scaler.update(), and a backward added scaled values to it: with "
    "gradient accumulation, register the hook with accumulation_steps=n (or when=, or fire it under hook.paused() in "
    "the other micro-batches) so that it unscales the accumulated gradient once per optimizer step. After a dropped "
    "iteration, call scaler.update() or optimizer.zero_grad(set_to_none=True) first")
#: What a gradient unscaled at an earlier firing of the same backward is refused with
SAME_BACKWARD_MESSAGE = (
    "fired twice on one gradient in the same backward, and its first firing unscaled a partial gradient to which the "
    "backward then added scaled values: the parameter is used in several reentrant activation checkpoints (or "
    "inside one and outside it, or in several nested backwards), whose backwards each fire its hook. Use "
    "checkpoint(..., use_reentrant=False), which fires each hook once per backward, or leave scaler= out and call "
    "scaler.unscale_(optimizer) after the backward (the hook then sees scaled gradients)")
#: What scaler.unscale_(optimizer) is refused with when a hook with scaler= unscaled the gradients
UNSCALED_MESSAGE = ("a hook with scaler= unscales the gradients itself: do not call scaler.unscale_(optimizer), and "
                    "call scaler.update() after scaler.step()")


def bump_versions(optimizer: torch.optim.Optimizer) -> None:
    """Bump the version of every dense gradient of `optimizer`'s parameters (of a DTensor's, its local shard's too)."""
    grads = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            grad = param.grad
            if grad is None or grad.layout != torch.strided:
                continue
            grads.append(grad)
            local = getattr(grad, "_local_tensor", None)
            if local is not None:
                grads.append(local)
    if grads:
        increment_version(grads)


def _wrap_method(cls: type, name: str, make) -> None:
    """Replace `cls.<name>` (if `cls` itself defines it, and it is not wrapped yet) by `make(the method)`."""
    method = cls.__dict__.get(name)
    if method is None or getattr(method, _WRAPPED, False):
        return
    wrapped = functools.wraps(method)(make(method))
    setattr(wrapped, _WRAPPED, True)
    setattr(cls, name, wrapped)


def _bumping_versions(unscale):
    def _unscale_grads_(self, optimizer, *args, **kwargs):
        try:
            return unscale(self, optimizer, *args, **kwargs)
        finally:
            bump_versions(optimizer)
    return _unscale_grads_


def _refusing_after_traced_firings(unscale):
    def unscale_(self, optimizer, *args, **kwargs):
        if _traced_counts(self, optimizer, peek=True):
            raise RuntimeError(UNSCALED_MESSAGE)
        return unscale(self, optimizer, *args, **kwargs)
    return unscale_


def _committing_traced_firings(step):
    def step_(self, optimizer, *args, **kwargs):
        commit_traced(self, optimizer)
        return step(self, optimizer, *args, **kwargs)
    return step_


def _wrap(cls: type) -> None:
    """Wrap `cls._unscale_grads_` (if `cls` defines it) so that it bumps the versions of what it unscaled, and
    `cls.unscale_` and `cls.step` so that they take what traced firings found first (`commit_traced`)."""
    _wrap_method(cls, "_unscale_grads_", _bumping_versions)
    _wrap_method(cls, "unscale_", _refusing_after_traced_firings)
    _wrap_method(cls, "step", _committing_traced_firings)


#: optimizer -> [(weak reference to its GradScaler, device, found_inf, backwards)]: what the traced firings of hooks
#: with scaler= found (found_inf, float32 0-dim) and how many traced backwards unscaled its gradients since the last
#: commit (int64 0-dim), written on the device by the firings (see `traced_books`)
_traced: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def traced_books(scaler: GradScaler, optimizer: torch.optim.Optimizer, device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(found_inf, backwards) that the traced firings on `device` of hooks unscaling for `scaler` and `optimizer`
    write: the first firing of each traced backward zeroes found_inf and counts the backward; the others add what
    they find. GradScaler.step then takes them as unscale_ would have found them (`commit_traced`). Called at trace
    time; the tensors keep their address (CUDA graphs)."""
    install()
    entries = _traced.setdefault(optimizer, [])
    for ref, known, found, backwards in entries:
        if ref() is scaler and known == device:
            return found, backwards
    found = static(torch.zeros((), dtype=torch.float32, device=device))  # as torch's found_inf
    backwards = static(torch.zeros((), dtype=torch.int64, device=device))
    entries.append((weakref.ref(scaler), device, found, backwards))
    return found, backwards


def _traced_counts(scaler: GradScaler, optimizer: torch.optim.Optimizer, peek: bool = False
                   ) -> dict[torch.device, tuple[torch.Tensor, int]]:
    """{device: (found_inf, traced backwards that unscaled since the last commit)} of `scaler` and `optimizer`'s
    traced books, those that unscaled only (one sync per device); the counts are reset unless `peek`."""
    counts = {}
    for ref, device, found, backwards in _traced.get(optimizer, ()):
        if ref() is scaler:
            n = int(backwards.item())
            if n:
                counts[device] = (found, n)
                if not peek:
                    backwards.zero_()
    return counts


def commit_traced(scaler: GradScaler, optimizer: torch.optim.Optimizer) -> None:
    """Before `scaler.step(optimizer)`: if traced firings unscaled the optimizer's gradients since the last step, mark
    it as unscaled with what they found, as the eager firings do at the end of their backward (one sync per device:
    GradScaler.step syncs on found_inf anyway). Refuses gradients that two backwards unscaled (gradient accumulation
    without accumulation_steps=), leaving books that skip the step (found_inf set), which scaler.update() clears.
    Nothing (and no sync) for an optimizer no traced firing unscales for."""
    if optimizer not in _traced:
        return
    from torch.amp.grad_scaler import OptState

    counts = _traced_counts(scaler, optimizer)
    if not counts:
        return
    state = scaler._per_optimizer_states[id(optimizer)]
    twice = any(n > 1 for _, n in counts.values()) or state.get("fusedhooks")
    if state["stage"] is not OptState.READY and not twice:
        raise RuntimeError(UNSCALED_MESSAGE)
    found = {device: found for device, (found, _) in counts.items()}
    if twice:  # books that skip this step whatever happens next: scaler.update() then backs off and clears them
        for value in found.values():
            value.fill_(1.0)
    commit(state, found, {})
    if twice:
        raise RuntimeError(f"fusedhooks: a hook with scaler= {ACCUMULATED_MESSAGE}")


def _subclasses(cls: type) -> list[type]:
    out = []
    for sub in cls.__subclasses__():
        out += [sub, *_subclasses(sub)]
    return out


def install() -> None:
    """Wrap GradScaler, its subclasses defined so far and those defined from now on (once)."""
    global _installed
    if _installed:
        return
    _installed = True
    for cls in (GradScaler, *_subclasses(GradScaler)):
        _wrap(cls)

    def __init_subclass__(cls, **kwargs):
        super(GradScaler, cls).__init_subclass__(**kwargs)
        _wrap(cls)

    GradScaler.__init_subclass__ = classmethod(__init_subclass__)


class BackwardBooks:
    """What the firings of one graph task found for a GradScaler: found_inf per device, written into the scaler's
    books (`_per_optimizer_states[id(optimizer)]`: stage UNSCALED, found_inf_per_device) only when the backward
    ends normally: the outermost one, for a nested backward (`backwards.at_end`, which holds it). A backward that raises
    drops it, and the books stay as they were, as torch's recipe never reaches `scaler.unscale_` in a failed
    iteration. `task`: its graph task (backwards.GraphTask)."""

    __slots__ = ("state", "task", "found", "unscaled", "__weakref__")

    def __init__(self, state: dict, task: GraphTask | None):
        self.state, self.task = state, task
        self.found: dict[torch.device, torch.Tensor] = {}
        #: (hook key, statistics row) -> weak reference to the gradient tensor it unscaled
        self.unscaled: dict[tuple[int, int], weakref.ref] = {}

    def __call__(self) -> None:
        commit(self.state, self.found, self.unscaled)


def commit(state: dict, found: dict[torch.device, torch.Tensor], unscaled: dict[tuple[int, int], weakref.ref]) -> None:
    """Mark the optimizer of `state` as unscaled by fusedhooks, its found_inf per device summed with `found`'s, and
    the gradients `unscaled` ((hook key, row) -> the gradient tensor) as unscaled until scaler.update() (which
    replaces `state`)."""
    from torch.amp.grad_scaler import OptState

    state["stage"] = OptState.UNSCALED
    state["fusedhooks"] = True
    state.setdefault("fusedhooks_unscaled", {}).update(unscaled)
    books = state["found_inf_per_device"]
    for device, value in found.items():
        kept = books.get(device)
        if kept is None:
            books[device] = value
        elif kept is not value:
            kept.add_(value)


class HookAmp:
    """The GradScaler books of one hook with scaler=, optimizer= (the eager firings' and the traced firings'): the
    hook's name (for messages), its operator key and its registry (the tensors it processes) are all it is handed."""

    def __init__(self, scaler: GradScaler, optimizer: torch.optim.Optimizer, name: str, key: int, registry):
        self.scaler, self.optimizer, self.name, self.key, self.registry = scaler, optimizer, name, key, registry
        #: device -> the hook's own found_inf (fp32, 0-dim), reused while the scaler's books do not hold it
        self.found_inf: dict[torch.device, torch.Tensor] = {}
        self._holder: dict[torch.device, weakref.ref | None] = {}  # the running backward using it
        #: graph task id -> what its firings found for the scaler, held by its end-of-backward callback
        self._backwards: weakref.WeakValueDictionary[int, BackwardBooks] = weakref.WeakValueDictionary()
        #: device -> (found_inf, backwards) of its traced firings (see `traced_books`)
        self.traced: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self._lock = threading.Lock()

    def tensors(self, device: torch.device, backward_key: int, rows: list[int],
                grads: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(scale, found_inf) for a firing on the gradients `grads` of `rows` in the backward `backward_key`; when
        that backward ends normally, the optimizer is marked as unscaled in the scaler's books with what it found
        (`BackwardBooks`), as scaler.unscale_(optimizer) would, so that scaler.step() neither unscales again nor
        steps on NaN/Inf, and scaler.update() backs off as usual; a backward that raises leaves the books as they
        were. Outside a backward (a call by hand) the books are kept at once. A gradient tensor this hook already
        unscaled since the last scaler.update() (in an earlier backward, or earlier in an overlapping one) is
        refused: a backward added scaled values to it (gradient accumulation without accumulation_steps=). A new
        gradient tensor (zero_grad(set_to_none=True) after a dropped iteration) is not. Host bookkeeping only."""
        from torch.amp.grad_scaler import OptState

        scaler = self.scaler
        state = scaler._per_optimizer_states[id(self.optimizer)]
        unscaled = [(state.get("fusedhooks_unscaled") or {}, None)]
        unscaled += [(b.unscaled, b.task) for b in list(self._backwards.values()) if b.state is state]
        for row, grad in zip(rows, grads):
            for done, task in unscaled:
                if (ref := done.get((self.key, row))) is not None and ref() is grad:
                    message = SAME_BACKWARD_MESSAGE if same_backward(task) else ACCUMULATED_MESSAGE
                    raise RuntimeError(f"fusedhooks: {self.name} (scaler=) {message}")
        books = self._backwards.get(backward_key) if backward_key >= 0 else None
        if books is None or books.state is not state:
            if state["stage"] is OptState.READY:
                self.check_scale()
                self.check_covers_optimizer()
            elif state["stage"] is OptState.STEPPED or not state.get("fusedhooks"):
                raise RuntimeError(UNSCALED_MESSAGE)
            books = None
            if callbacks_run(backward_key):
                books = self._backwards[backward_key] = BackwardBooks(state, track(backward_key))
                at_end(backward_key, books)
        if books is None:  # outside a backward (or under compiled autograd): into the books now
            found = state["found_inf_per_device"].get(device)
            if found is None:
                found = self._found_inf_buffer(device, state)
            commit(state, {device: found}, {(self.key, row): weakref.ref(g) for row, g in zip(rows, grads)})
            return scaler._scale, found
        books.unscaled.update({(self.key, row): weakref.ref(g) for row, g in zip(rows, grads)})
        found = books.found.get(device)
        if found is None:
            found = books.found[device] = self._found_inf_buffer(device, state, books)
        return scaler._scale, found

    def _found_inf_buffer(self, device: torch.device, state: dict, books: BackwardBooks | None = None) -> torch.Tensor:
        """A zeroed found_inf for `device` (for the backward of `books`): the hook's own (no allocation once warmed
        up, for CUDA graphs), or a new one while the hook's own is taken: by the scaler's books (an earlier
        backward of this iteration found it) or by another backward still running (in another thread)."""
        with self._lock:
            found = self.found_inf.get(device)
            holder = self._holder.get(device)
            if (found is None or state["found_inf_per_device"].get(device) is found
                    or (holder is not None and holder() is not None and holder() is not books)):
                found = self.found_inf[device] = torch.zeros((), device=device)  # fp32, 0-dim: as torch's
            else:
                found.zero_()
            self._holder[device] = None if books is None else weakref.ref(books)
            return found

    def check_scale(self) -> None:
        """Refuse to unscale before the GradScaler has a scale (scaler.scale(loss) makes it)."""
        if self.scaler._scale is None:
            raise RuntimeError("the GradScaler has no scale yet: call scaler.scale(loss) before backward")

    def check_covers_optimizer(self) -> None:
        """Refuse an optimizer stepping a parameter the hook is not registered on (it unscales for all of them)."""
        registered = {id(e.tensor) for e in self.registry}
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad and id(p) not in registered:
                    raise RuntimeError("with scaler=, the hook unscales for the whole optimizer: register it on "
                                       "every parameter the optimizer steps (a parameter of shape "
                                       f"{tuple(p.shape)} is not registered)")

    def traced_books(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(found_inf, backwards) the hook's traced firings on `device` write (module-level `traced_books`), made on
        first use (at trace time)."""
        books = self.traced.get(device)
        if books is None:
            books = self.traced[device] = traced_books(self.scaler, self.optimizer, device)
        return books
