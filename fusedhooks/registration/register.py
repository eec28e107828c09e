"""Registration (DESIGN.md, Architecture): what `register()` checks, the entries and statistics rows it gives the
tensors, and the torch post-accumulate hooks it registers on them; module and iterable targets, names, FSDP2-sharded
parameters (a module registration follows its parameters: `follow_parameters`), and tensors registered through torch
directly, at their first firing. DDP models are registered by `ddp.register_ddp`.

`Registration` is handed the hook's parts (its registry, compilation cache and buckets), never the hook; the calls
into the hook's firing come with each registration (`buckets.FiringCalls`), held by what torch holds for it."""

from __future__ import annotations

import functools
import math
import threading
import warnings
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch

from ..compiler import dims
from ..compiler.trace import CompileError
from ..firing.registry import Entry, RegistrationHandle, Registry
from ..runtime import process_groups
from ..runtime.layout import is_dtensor
from . import gates

if TYPE_CHECKING:
    from collections.abc import Callable

    from ..firing.buckets import Buckets, FiringCalls
    from ..runtime.compilation import HookCompilation

#: the gradient dtypes a hook processes
GRAD_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

#: register()'s warning when torch.__future__.set_swap_module_params_on_conversion(True) is on
SWAP_CONVERSION_WARNING = (
    "torch.__future__.set_swap_module_params_on_conversion(True) is on: converting the module after this "
    "register() (model.to(dtype or device), .half(), .cuda()) swaps its parameter tensors, which torch refuses "
    "while fusedhooks holds them (RuntimeError: Couldn't swap ...), and a swapped parameter's post-accumulate-grad "
    "hooks, fusedhooks' or anyone's, no longer fire, even registered again. Convert the model first, then register "
    "the hook; or leave that flag off")


def check_dtype(name: str, dtype) -> None:
    """Refuse a gradient dtype the hooks cannot process."""
    if dtype not in GRAD_DTYPES:
        raise TypeError(f"{name}: dtype {dtype} is not supported; gradients must be float16, bfloat16, "
                        "float32 or float64")


def check_name(name) -> None:
    """Refuse a name= of register() that is not None or a non-empty string."""
    if name is not None and (not isinstance(name, str) or not name):
        raise ValueError(f"name= takes a non-empty string (a tensor's key in stats.read(), or a module's prefix), "
                         f"not {name!r}")


def check_param(name: str, t) -> None:
    """Refuse what torch would refuse, and what a hook cannot process, before any backward runs."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise TypeError(f"{name}: {t.layout} tensors are not supported; gradient hooks process dense gradients")
    check_dtype(name, t.dtype)
    if t.device.type == "meta":
        raise ValueError(f"{name}: is a meta tensor (no data, so no gradient to process); register the hook "
                         "after the module is materialized (module.to_empty(device=...) and loading its weights)")
    if not t.requires_grad:
        raise ValueError(f"{name}: cannot register a hook on a tensor that doesn't require grad")
    if not t.is_leaf:
        raise ValueError(f"{name}: is not a leaf tensor; gradient hooks fire on leaf tensors (parameters) "
                         "after their .grad is accumulated")


def named_tensors(target, name: str | None, auto_name: Callable[[list[str]], str]
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of a register() target: a Tensor (`name`, or auto_name(())), an nn.Module (its
    parameters with requires_grad, `name` as a prefix) or an iterable of Tensors (auto_name(names so far))
    and (name, Tensor) pairs. Not checked here (see check_param)."""
    if isinstance(target, torch.nn.Module):  # FSDP2's sharded parameters, also while it holds unsharded ones
        yield from current_parameters(target, name)
    elif isinstance(target, torch.Tensor):
        yield (name or auto_name(()), target)
    elif isinstance(target, Iterable) and not isinstance(target, (str, bytes)):
        taken = []
        for item in target:
            if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
                yield item
            elif isinstance(item, torch.Tensor):
                taken.append(auto_name(taken))
                yield (taken[-1], item)
            else:
                raise TypeError(f"register() takes Tensors or (name, Tensor) pairs; got {type(item).__name__}")
    else:
        raise TypeError(f"register() takes a Tensor, an nn.Module or an iterable of them, "
                        f"not {type(target).__name__}")


def run_outside_graph(fn, *args) -> None:
    """`fn(*args)` outside the graph torch.compile traces (`ops.outside_graph`, imported when first needed): how
    the gates of `register(..., accumulation_steps=, when=)` run under compile (see `gates.gated`)."""
    from ..firing import ops

    ops.outside_graph(fn, *args)


def steps_in_backward(optimizer, keep_grads: bool):
    """register(..., optimizer=, keep_grads=)'s step inside the backward: `optimizer.step_in_backward` with keep_grads
    bound (given the tensors, it returns the step that runs after each firing, see `stepping`), or None without an
    optimizer. Refuses an optimizer without that step, and keep_grads=True without an optimizer."""
    if optimizer is None:
        if keep_grads:
            raise ValueError("keep_grads=True keeps the gradients an optimizer step inside the backward would free: "
                             "it goes with optimizer=")
        return None
    make = getattr(optimizer, "step_in_backward", None)
    if not callable(make):
        raise TypeError(f"register(optimizer=...) takes fh.AdamW or fh.SGD (their step runs inside the backward), "
                        f"not {type(optimizer).__name__}")
    return functools.partial(make, keep_grads=keep_grads)


def stepping(fire, step, paused, fire_traces: bool = True):
    """The torch hook that fires on a parameter's gradient (`fire(param)`) and then steps the parameter
    (`step(param)`: the optimizer's step inside the backward), unless the hook is `paused()`. In a backward that
    compiled autograd traces both are traced: the firing as always, the step as one operator (`BackwardSteps`).
    Where the step leaves the graph (`step.leaves_graph(param)`: a hook frame dynamo compiles on its own, master
    weights, a DTensor), or `fire` is Python that is not to be traced (not `fire_traces`: AdaGC's state update),
    both run outside it from the start (`run_outside_graph`), as the gates run: nothing traced before the break
    differs between parameters."""
    def run(param: torch.Tensor) -> None:
        fire(param)
        if not paused():
            step(param)

    def hook(param: torch.Tensor) -> None:
        if torch.compiler.is_dynamo_compiling() and (not fire_traces or step.leaves_graph(param)):
            run_outside_graph(run, param)
        else:
            run(param)
    return hook


def _parse_bucket_mb(bucket_mb) -> int:
    """bucket_mb= of register(): None or 0 -> 0 (each gradient at its own firing), else bytes per bucket."""
    if bucket_mb is None:
        return 0
    if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float)) or not 0 <= bucket_mb < math.inf:
        raise ValueError(f"bucket_mb= takes a finite number of MB >= 0 (0 or None: each gradient is processed at "
                         f"its own firing), not {bucket_mb!r}")
    return max(int(bucket_mb * 2**20), 1) if bucket_mb > 0 else 0


def _check_dense_gradients(module: torch.nn.Module, prefix: str | None) -> None:
    """Refuse a module with a submodule that gives its weight sparse gradients (nn.Embedding(sparse=True),
    nn.EmbeddingBag(sparse=True))."""
    for mname, m in module.named_modules(prefix=prefix or ""):
        if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse and m.weight.requires_grad:
            wname = f"{mname}.weight" if mname else "weight"
            raise TypeError(f"{wname}: {type(m).__name__}(sparse=True) gives it sparse gradients, and gradient hooks "
                            f"process dense gradients: use {type(m).__name__}(sparse=False), or register the hook "
                            f"on the other parameters ([p for n, p in model.named_parameters() if n != {wname!r}])")


class Registration:
    """The registrations of one hook: checks, entries and statistics rows (in `registry`), and torch hooks.

    Handed the hook's parts, never the hook: `registry` (its registered tensors, their rows in `registry.stats`),
    `compilation` (its plans and kernels, compiled at register for each tensor, and its name, for messages) and
    `buckets` (the torch hooks of tensors in end-of-backward buckets, and how DDP's buckets are processed). What
    calls into the hook's firing comes with each registration (`FiringCalls`: the torch hooks hold it)."""

    def __init__(self, registry: Registry, compilation: HookCompilation, buckets: Buckets):
        self.registry, self.stats = registry, registry.stats
        self.compilation, self.buckets = compilation, buckets
        #: the hook's name, for messages
        self.hook_name = compilation.name
        #: held by registrations, at register() and at first firings (`add_at_firing`), against other threads'
        self.lock = threading.RLock()

    # --- register() -------------------------------------------------------------------------------

    def register(self, target, name: str | None, bucket_mb: float | None, accumulation_steps: int | None, when,
                 handle: RegistrationHandle, calls: FiringCalls, step_in_backward=None) -> RegistrationHandle:
        """`GradHook.register` (see its docstring) of anything but a DDP model (`ddp.register_ddp`): register `target`
        into `handle` (new and empty; returned), its torch hooks calling into the hook's firing through `calls`.
        step_in_backward: `optimizer.step_in_backward` (register(..., optimizer=)): given the tensors, it returns the
        step that runs after each firing (see `stepping`)."""
        check_name(name)
        when = gates.parse(accumulation_steps, when)
        bucket_bytes = _parse_bucket_mb(bucket_mb) if not isinstance(target, torch.Tensor) else 0
        if step_in_backward is not None:
            if bucket_bytes:
                raise ValueError("register(optimizer=...) steps each parameter right after its own firing: it does "
                                 "not take bucket_mb= (end-of-backward buckets)")
            if self.compilation.amp:
                raise ValueError(f"{self.hook_name}: register(optimizer=...) does not take a hook with scaler= yet: a "
                                 "GradScaler skips a whole step when any gradient overflows, which a step per "
                                 "parameter inside the backward cannot do. Step after the backward "
                                 "(scaler.step(opt)) or train without a scaler (bf16)")
        handle.when = when
        with self.lock:  # against other threads' registrations, first firings included
            pairs = list(self.named_targets(target, name))
            if not pairs:
                raise ValueError(f"register() found no tensor to register in {type(target).__name__} {target!r:.80}: "
                                 "a module registers its parameters with requires_grad (none here: frozen, or none "
                                 "at all), an iterable its tensors")
            if isinstance(target, torch.nn.Module):
                _check_dense_gradients(target, name)
            self.check_targets(pairs)
            if torch.__future__.get_swap_module_params_on_conversion():
                warnings.warn(SWAP_CONVERSION_WARNING, stacklevel=3)  # at the caller of GradHook.register
            if step_in_backward is not None:
                handle.step_in_backward = step_in_backward([t for _, t in pairs])  # checks them: before registering
                handle.on_remove(handle.step_in_backward.remove)
            try:
                self.register_pairs(pairs, bucket_bytes, handle, calls)
            except BaseException:
                if handle.step_in_backward is not None:
                    handle.step_in_backward.remove()
                raise
        if isinstance(target, torch.nn.Module):
            follow_parameters(self, calls, target, name, bucket_bytes, handle)
        return handle

    def named_targets(self, target, name: str | None) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) pairs of a register() target, unnamed tensors named "param<i>" (see named_tensors)."""
        return named_tensors(target, name, self.auto_name)

    def auto_name(self, taken=()) -> str:
        """"param<i>": i counts registrations, skipping names already in use (and those `taken`)."""
        names = self.stats.names
        i = len(names) + len(taken)
        while f"param{i}" in names or f"param{i}" in taken:
            i += 1
        return f"param{i}"

    def check_targets(self, pairs: list[tuple[str, torch.Tensor]]) -> None:
        """Everything register() refuses, checked before anything is registered."""
        seen, names = set(), set()
        active = self.registry.names()
        first_device = next((t.device for _, t in pairs if isinstance(t, torch.Tensor)), None)
        for pname, t in pairs:
            if not isinstance(pname, str) or not pname:
                raise ValueError(f"a tensor's name takes a non-empty string (its key in stats.read()), not {pname!r}")
            check_param(pname, t)
            entry = self.registry.get(t)
            if entry is not None:
                raise ValueError(f"{entry.name!r} is already registered with this hook (the same tensor)")
            if id(t) in seen:
                raise ValueError(f"{pname}: this tensor is already registered in this same register() call")
            if pname in names or pname in active:
                raise ValueError(f"a parameter named {pname!r} is already registered with this hook; "
                                 "pass a different name=")
            seen.add(id(t))
            names.add(pname)
            if is_dtensor(t):
                self.check_sharded(pname, t)
            self.compilation.check_shape(pname, t)
            self.compilation.compiled(t.dtype, t.device, shape=t.shape)
            stats_device = self.stats.device or first_device
            if self.stats.slot_names and t.device != stats_device:
                raise ValueError(f"{pname} is on {t.device} but this hook records statistics on "
                                 f"{stats_device}; register parameters of another device with another hook")

    def check_sharded(self, name: str, t: torch.Tensor) -> None:
        """What a hook cannot do on a sharded (FSDP2, tensor parallel: DTensor) parameter `t`, refused with what to do
        instead."""
        process_groups.shard_spread(name, t)  # refuses placements other than Shard and Replicate
        graph = self.compilation.graph(t.dtype, t.shape)
        if graph.reductions():
            sharded = process_groups.sharded_dims(t)
            along = f" along dim{'s' if len(sharded) > 1 else ''} {', '.join(map(str, sharded))}" if sharded else ""
            per_shard = (f"{name} is sharded (FSDP2 or tensor parallel, DTensor){along}: each rank holds a part of "
                         "its gradient, and the body")
            advice = ("Sharded parameters take elementwise bodies, and reductions over dimensions other than the "
                      "sharded ones (each unit within a shard: `g.norm(dim=1, keepdim=True)`); their statistics "
                      "(stats=) are those of the whole parameter, merged across ranks, and a global clip is "
                      "fh.clip_grad_norm_(hook, max_norm)")
            whole = [n for n in graph.reductions() if not dims.is_dim_reduction(n)]
            if whole:
                raise CompileError(f"{self.hook_name}: {per_shard} reduces over the whole tensor (`{whole[0].op}`), "
                                   f"which would be computed per shard. {advice}")
            try:
                units = dims.analyse(graph)
            except dims.Unsupported as e:
                raise CompileError(f"{self.hook_name}: {per_shard} has {e}. {advice}") from None
            for r in units.reductions:
                cut = [d for d in sharded if d in dims.reduced_dims(r.node, tuple(t.shape))]
                if cut:
                    raise CompileError(f"{self.hook_name}: {per_shard} reduces over dim {cut[0]} (`{r.node.op}`), "
                                       f"whose units would be cut by the shards. {advice}")
            if not all(units.is_own(units.of(node), m) for node, m in units.uses):
                raise CompileError(f"{self.hook_name}: {per_shard} broadcasts a value reduced over dimensions onto "
                                   f"other units than its own, which may be on other ranks. {advice}")
        if self.compilation.amp:
            raise ValueError(f"{self.hook_name}: scaler= is not supported on sharded (FSDP2) parameters ({name}): "
                             "unscale with torch's GradScaler (scaler.unscale_(optimizer)) instead")

    # --- entries and torch hooks ------------------------------------------------------------------

    def add_tensor(self, name: str, t: torch.Tensor) -> Entry:
        """Check `t` (check_param) and give it an entry and a statistics row under `name`; no torch hook."""
        check_param(name, t)
        return self.registry.add(name, t)

    def add_at_firing(self, t: torch.Tensor) -> Entry:
        """Register `t`, registered through torch directly (`t.register_post_accumulate_grad_hook(hook)`), at its
        first firing; threads firing on new tensors at once get one row each."""
        with self.lock:
            return self.registry.get(t) or self.add_tensor(self.auto_name(), t)

    def register_pairs(self, pairs: list[tuple[str, torch.Tensor]], bucket_bytes: int, handle: RegistrationHandle,
                       calls: FiringCalls, ddp_ignored: bool = False, when=None) -> None:
        """Register checked (name, tensor) pairs through torch's post-accumulate hooks, into `handle`; all or
        nothing. bucket_bytes: > 0, in end-of-backward buckets of that many bytes (`Buckets.torch_hook`), else each
        at its own firing (`calls.at_firing`); ddp_ignored: parameters a DDP model registered with the hook ignores
        (see Entry); when: their gate (default: the handle's)."""
        when = handle.when if when is None else when
        added, before = [], handle.tracked
        try:
            for pname, t in pairs:
                entry = self.add_tensor(pname, t)
                added.append(entry)
                entry.checked_shape = t.shape  # checked above
                entry.ddp_ignored = ddp_ignored
                entry.bucket_bytes = bucket_bytes
                fire = self.buckets.torch_hook(entry, calls) if bucket_bytes else calls.at_firing(entry)
                if handle.step_in_backward is not None:
                    entry.steps_in_backward = True
                    fire = stepping(fire, handle.step_in_backward, calls.is_paused)
                if when is not None:
                    fire = gates.gated(fire, when, run_outside_graph, calls.is_paused)
                torch_handle = t.register_post_accumulate_grad_hook(fire)
                entry.torch_hook_id = torch_handle.id
                handle.add(t, torch_handle, self.registry)
        except BaseException:
            handle.untrack(before, forget=False)
            self.registry.discard(added)
            raise


# --- a module registration follows its parameters (fully_shard replaces them) --------------------------------

def current_parameters(module: torch.nn.Module, prefix: str | None) -> list[tuple[str, torch.Tensor]]:
    """(name, parameter) of `module` as a hook registers them, FSDP2-managed ones as their sharded DTensor
    parameters (inside FSDP's forward the module holds unsharded ones)."""
    sharded = {}
    dist = process_groups.dist_module()
    if dist is not None:
        try:
            from torch.distributed.fsdp import FSDPModule
        except ImportError:  # pragma: no cover
            FSDPModule = ()
        for m in module.modules():
            if isinstance(m, FSDPModule):
                for group in m._get_fsdp_state()._fsdp_param_groups:
                    for fp in group.fsdp_params:
                        sharded[id(fp.sharded_param)] = fp.sharded_param
                        unsharded = getattr(fp, "_unsharded_param", None)
                        if unsharded is not None:
                            sharded[id(unsharded)] = fp.sharded_param
    head = f"{prefix}." if prefix else ""
    return [(head + n, sharded.get(id(p), p)) for n, p in module.named_parameters() if p.requires_grad]


def _fingerprint(module: torch.nn.Module) -> tuple:
    # fully_shard changes the class of every module it is applied to
    return tuple(type(m) for m in module.modules())


class _FollowParameters:
    """The forward pre-hook of `follow_parameters`. A copy of its module (copy.deepcopy, pickle, torch.save) gets
    `_NotFollowing` instead: torch does not copy the parameters' hooks either, so the copy is not registered."""

    def __init__(self, registration: Registration, calls: FiringCalls, prefix: str | None, bucket_bytes: int,
                 handle: RegistrationHandle, fingerprint):
        self.registration, self.calls = registration, calls
        self.prefix, self.bucket_bytes, self.handle = prefix, bucket_bytes, handle
        self.seen = fingerprint

    def __call__(self, mod: torch.nn.Module, args) -> None:
        if torch.compiler.is_compiling() or process_groups.world_size() is None:
            return
        fingerprint = _fingerprint(mod)
        if fingerprint == self.seen:
            if self._replaced_around(mod):
                raise RuntimeError(
                    f"{self.registration.hook_name} was registered on this {type(mod).__name__}'s parameters, which "
                    "have been replaced since (by tensor parallelism's parallelize_module, which makes them "
                    "DTensors, by fully_shard applied to a module around it, or by assignment): the hook would never "
                    "fire. Register the hook after parallelize_module and fully_shard (or on the module given to "
                    "fully_shard, whose registration follows it)")
            return
        registration, handle = self.registration, self.handle
        pairs = current_parameters(mod, self.prefix)
        now = {id(t) for t in handle.tensors}
        if {id(t) for _, t in pairs} != now:
            if handle.step_in_backward is not None:
                raise RuntimeError(f"{registration.hook_name} was registered with optimizer= on this "
                                   f"{type(mod).__name__}, whose parameters fully_shard has replaced since: the "
                                   "optimizer holds the parameters of before, which no gradient reaches any more. "
                                   "Build the optimizer on the sharded parameters and register after fully_shard")
            handle.untrack()
            registration.check_targets(pairs)
            registration.register_pairs(pairs, self.bucket_bytes, handle, self.calls)
        self.seen = fingerprint  # only once followed: a refusal is raised again at every forward, never silent

    def _replaced_around(self, mod: torch.nn.Module) -> bool:
        """Are the registered tensors no longer the module's parameters though no module of it was fully_shard'ed
        (its classes are as they were)? Checked on the first one (it is the module's first, unless replaced); one
        collected while the module still has parameters was replaced (the module held it)."""
        if not self.handle.tracked:
            return False
        first = self.handle.first_tensor
        if first is None:
            return next(mod.parameters(), None) is not None
        return not is_dtensor(first) and all(p is not first for p in mod.parameters())

    def __reduce__(self):
        return _NotFollowing, ()


class _NotFollowing:
    """What a `_FollowParameters` becomes in a copy of its module: nothing to follow."""

    def __call__(self, mod: torch.nn.Module, args) -> None:
        return None


def follow_parameters(registration: Registration, calls: FiringCalls, module: torch.nn.Module, prefix: str | None,
                      bucket_bytes: int, handle: RegistrationHandle) -> None:
    """Keep a module registration on the module's current parameters: at each forward in a process group,
    when a module of it has been `fully_shard`ed since (its class changed), the hook moves to the sharded
    parameters (same names, rows cleared), registered again by `registration` with the firing `calls` (which the
    module's forward pre-hook holds, as the tensors' torch hooks do)."""
    check = _FollowParameters(registration, calls, prefix, bucket_bytes, handle, _fingerprint(module))
    pre = module.register_forward_pre_hook(check)
    handle.on_remove(pre.remove)
