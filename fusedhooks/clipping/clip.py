"""Global-norm gradient clipping fed by the norms a hook recorded during backward: `clip_grad_norm_`."""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.autograd.graph import increment_version
from torch.compiler import is_compiling as _is_compiling  # bound once: checked at every call

from ..api import GradHook
from ..firing import optable
from ..firing.registry import Entry
from ..runtime import launcher, process_groups
from ..runtime.layout import is_dtensor
from . import fold

if TYPE_CHECKING:  # importing the kernels imports triton: keep `import fusedhooks` free of it, so that
    from ..kernels import multi_tensor  # TRITON_INTERPRET can still be set after importing the package

#: Statistic slots that give each parameter's norm, by norm type, in order of preference, and how a
#: recorded float64 value becomes the norm.
_SOURCES = {
    2.0: (("norm", None), ("sumsq", torch.sqrt)),
    math.inf: (("absmax", None),),
}


@dataclass
class _Group:
    """The gradients of one (device, dtype), in torch's grouping order."""

    device: torch.device
    dtype: torch.dtype
    start: int  # this group's slice of the per-parameter norms vector
    stop: int
    members: list[int]  # indices into the list of counted gradients
    round_coef: bool  # CUDA torch rounds a coefficient of another dtype to the gradients' dtype first
    table: multi_tensor.ScaleTable | None = None  # built on the first Triton launch
    table_addresses: tuple = ()  # the gradients' data_ptr()s the table was built for: rebuilt when they move


@dataclass
class _Layout:
    """What clipping a given set of gradients needs, cached while their rows, devices, sizes and dtypes stay the same
    (new gradient tensors at every step keep it; the groups' scale tables follow their addresses)."""

    key: tuple
    groups: list[_Group]
    index: torch.Tensor | None  # int64: flat positions of the norms in the stats buffer, in group order
    empty_mask: torch.Tensor | None  # True for empty gradients (their norm is 0; absmax records NaN)
    first_device: torch.device  # where torch stacks the norms: the first gradient's device


_layouts: weakref.WeakKeyDictionary[GradHook, dict] = weakref.WeakKeyDictionary()


def clip_grad_norm_(hook: GradHook, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach: bool | None = None, optimizer: torch.optim.Optimizer | None = None) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` over the parameters `hook` is registered on, fed by its statistics.

    For norm_type 2.0 the per-parameter norms are the ones the hook recorded during backward (its "norm"
    statistic, or the square root of "sumsq"); for norm_type inf its "absmax". The gradients are not read to
    compute them. The total norm and the clip coefficient are then computed on the device with torch ops on
    that small vector, exactly as torch does (each norm in its gradient's dtype, total_norm =
    vector_norm(norms, norm_type), coef = clamp(max_norm / (total_norm + 1e-6), max=1)), and every gradient is
    multiplied by the coefficient in place: with the Triton backend by one multi-tensor launch per
    (device, dtype), which reads and writes nothing when the coefficient is 1; with the eager and reference backends
    (CPU without TRITON_INTERPRET, or backend="eager"/"reference") by `torch._foreach_mul_` as torch does. No host sync
    unless error_if_nonfinite=True.

    Which parameters count: those registered with `hook` whose `.grad` is not None (None is skipped, as torch
    does), as torch measures them. A gradient the hook has not measured as it is now has its norm computed from
    the gradient instead (one read of it): one changed or replaced since the hook last measured it (a parameter the
    last backward did not reach after `zero_grad(set_to_none=False)`, a gradient edited by hand or given other
    storage by `p.grad.data = t`: told by the gradient tensor itself, its version counter and its address, never by
    the address alone, which the allocator reuses), and one it has not fired on since registration or
    `hook.stats.reset()` (a gradient set by hand; one produced only in micro-batches that `accumulation_steps=`,
    `when=` or `hook.paused()` left unprocessed, as an eager hook gated the same way would leave it).

    Versions: the scale bumps every gradient's version counter, as `mul_` does (with the Triton backend too, which
    writes nothing when the coefficient is 1), so that every other hook's record of a gradient is seen as changed.
    With max_norm=inf the coefficient is 1, or NaN (a non-finite total norm, as in torch: every gradient becomes
    NaN); this hook's gradients then stay described by its recorded norms times that coefficient, so calling
    clip_grad_norm_ again reads no gradient.

    Other norm types (1.0, 3.0, -inf, ...) fall back to computing each parameter's norm from the gradients with
    torch (`torch._foreach_norm` / `torch.linalg.vector_norm`, as torch does): one extra read of every
    gradient; the scaling is the same. A hook that does not record the statistic norm_type 2.0 or inf needs
    raises ValueError naming the statistic to add to `stats=`.

    Returns the total norm, a 0-dim tensor on the statistics' device, in the dtype torch gives it (the promoted
    dtype of the gradients). With no gradient: a float32 zero, and nothing is scaled. An empty gradient
    contributes 0 (torch raises for norm_type inf). error_if_nonfinite=True raises RuntimeError, before scaling,
    when the total norm is NaN or Inf (a host sync, as in torch). foreach: as in torch, chooses between
    `torch._foreach_mul_` (None/True) and one `mul_` per gradient (False) on the reference backend; the Triton
    backend always uses its multi-tensor kernel.

    Rounding: the products are torch's, bit for bit (fp32 math rounded to nearest even for fp16/bf16; fp64
    for fp64). The coefficient equals torch's whenever the per-parameter norms do: always for inf (absmax is
    exact), and for 2.0 up to the rounding of the recorded norm (fp32 blocks merged in fp64) to the gradient's
    dtype, within 1e-6 relative of torch's fp32 norm and almost always the same fp16/bf16 value.

    Under torch.compile (a compiled training step) the call is one operator, `torch.ops.fusedhooks.clip_grad_norm_`
    (fusedhooks/firing/ops.py), whose implementation is the eager call: same results, no graph break. Once the hook's
    firings are traced by compiled autograd (which keeps no record of what they measured, so the eager call would
    read every gradient's norm anyway), it is traced instead as torch's own clip over the gradients (`_clip_traced`:
    norms read from them, no fusedhooks Python when the graph runs), but for error_if_nonfinite=True or a tensor
    max_norm, which keep the operator.

    optimizer: the optimizer that steps these gradients next. Which path runs is decided by its type alone: one of
    torch's Adam, AdamW, SGD or Adagrad with fused=True, fh.AdamW or fh.SGD (`fold.folds_into`) gets the coefficient
    folded into its `grad_scale` (`grad_scale = grad_scale so far (or 1) / coef`, float32, on the device): no pass over
    the gradients, which stay as they are until that step divides them (torch's fused step writes them back divided and
    their versions are bumped after it; fh's steps leave `.grad` unclipped). The fold is consumed by exactly that one
    step, or dropped if the step raises; the optimizer must step exactly the parameters the hook clips (else
    ValueError), clip once per step (RuntimeError for a second fold on the same gradients), and gradients changed
    between the clip and the step make that step raise RuntimeError. Not under torch.compile (RuntimeError). Any other
    optimizer, or None: the gradients are scaled in place as described above.
    """
    fold_into = fold.target(optimizer, "clip_grad_norm_(optimizer=...)")
    if _is_compiling():
        if fold_into is not None:
            raise RuntimeError("fh.clip_grad_norm_(..., optimizer=opt) with a fused optimizer folds the coefficient "
                               "into opt.grad_scale, which is not supported under torch.compile: call it outside the "
                               "compiled function, or pass optimizer=None to scale the gradients in place")
        return _clip_compiling(hook, max_norm, norm_type, error_if_nonfinite, foreach)
    return _clip_eager(hook, max_norm, norm_type, error_if_nonfinite, foreach, fold_into=fold_into)


def _clip_compiling(hook: GradHook, max_norm, norm_type, error_if_nonfinite, foreach) -> torch.Tensor:
    """What `fh.clip_grad_norm_` does while torch.compile traces it: one call of fusedhooks::clip_grad_norm_ (see
    ops.py) on the gradients it would clip. Outside the graph instead (graph breaks, the eager call): a sharded
    (FSDP2) gradient, a norm_type that is not a Python number, and anything but a hook (eager's TypeError)."""
    from ..firing import ops

    max_norm_tensor = max_norm if isinstance(max_norm, torch.Tensor) else None
    if not (isinstance(hook, GradHook) and isinstance(norm_type, (int, float))
            and (max_norm_tensor is not None or isinstance(max_norm, (int, float)))):
        return ops.outside_graph(_clip, hook, max_norm, norm_type, error_if_nonfinite, foreach)
    grads = []
    for _, g in grads_of(hook):
        if is_dtensor(g):
            return ops.outside_graph(_clip, hook, max_norm, norm_type, error_if_nonfinite, foreach)
        grads.append(g)
    norm_type = float(norm_type)
    if not grads:  # as eager: a float32 zero, nothing scaled
        return torch.zeros((), device=hook.stats.device or "cpu")
    if hook.stats.traced is not None and max_norm_tensor is None and not error_if_nonfinite:
        _norm_slot(hook, norm_type)  # eager's ValueError for a hook that does not record the statistic
        return _clip_traced(grads, float(max_norm), norm_type, foreach)
    stats = hook.stats.buffer if norm_type in _SOURCES else None
    with torch.no_grad():
        return torch.ops.fusedhooks.clip_grad_norm_(grads, stats, hook.op_key,
                                                    0.0 if max_norm_tensor is not None else float(max_norm),
                                                    norm_type, bool(error_if_nonfinite), foreach, max_norm_tensor)


@torch.no_grad()
def _clip_traced(grads: list[torch.Tensor], max_norm: float, norm_type: float, foreach: bool | None) -> torch.Tensor:
    """clip_grad_norm_ of `grads` (the hook's gradients, registration order) as torch ops that dynamo traces into the
    compiled step, for a hook whose firings compiled autograd traces: they keep no Python record of what they measured,
    so the norms are read from the gradients, as torch's clip_grad_norm_ reads them (each in its gradient's dtype, by
    torch's (device, dtype) groups; an empty gradient contributes 0), and no Python of fusedhooks runs when the graph
    runs. Returns the total norm (0-dim, the gradients' promoted dtype, the first gradient's device)."""
    groups = [(device, dtype, [grads[i] for i in members])
              for (device, dtype), members in _group_by_device_and_dtype(grads)]
    first_device = grads[0].device
    norms = []
    for device, dtype, group in groups:
        counted = [g for g in group if g.numel()]
        values = _norms_from_grads(counted, device, norm_type, foreach) if counted else None
        if len(counted) != len(group):
            found = iter(values.unbind() if counted else ())
            values = torch.stack([next(found) if g.numel() else torch.zeros((), dtype=dtype, device=device)
                                  for g in group])
        norms.append(values.to(first_device))
    total_norm = torch.linalg.vector_norm(norms[0] if len(norms) == 1 else torch.cat(norms), norm_type)
    coef = clip_coefficient(total_norm, max_norm)
    for device, _, group in groups:
        _mul_(group, coef.to(device), foreach)
    return total_norm


def _mul_(grads: list[torch.Tensor], coef: torch.Tensor, foreach: bool | None) -> None:
    """Every gradient of `grads` (one device) times `coef` in place, as torch's clip_grad_norm_ does: one
    `torch._foreach_mul_`, or one `mul_` each when foreach=False."""
    if foreach is False:
        for g in grads:
            g.mul_(coef)
    else:
        torch._foreach_mul_(grads, coef)


@torch.no_grad()
def _clip(hook: GradHook, max_norm: float, norm_type: float, error_if_nonfinite: bool, foreach: bool | None,
          given: list[torch.Tensor] | None = None, bumps: int = 0,
          fold_into: torch.optim.Optimizer | None = None) -> torch.Tensor:
    """clip_grad_norm_ itself. `given`: the gradients the fusedhooks::clip_grad_norm_ op was called with, in
    _collect's order: the live `.grad` tensors, or (aot_autograd functionalizes the op) copies of them, which
    are then the ones measured and scaled, and copied back into `.grad` by the compiled graph. `bumps`: how many
    times the op's caller bumped the version of each live gradient before this call without writing it (the
    dispatcher does so once for an argument a custom op declares mutated). `fold_into`: a fused optimizer to fold the
    coefficient into instead of scaling the gradients."""
    max_norm, norm_type = float(max_norm), float(norm_type)

    def coefficient(total_norm: torch.Tensor) -> torch.Tensor:
        if error_if_nonfinite and torch.logical_or(total_norm.isnan(), total_norm.isinf()):
            raise RuntimeError(
                f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it cannot be "
                "clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
                "`error_if_nonfinite=False`")
        return clip_coefficient(total_norm, max_norm)

    # with max_norm=inf the coefficient is 1, or NaN when the total norm is not finite: the gradients are then
    # exactly their measured values times it, so a later call needs no re-read
    return _scale_by_total_norm(hook, coefficient, norm_type, foreach, given, bumps, fold_into,
                                exact_coef=max_norm == math.inf, fold_sharded=False)


def clip_coefficient(total_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """torch's clip_grad_norm_ coefficient, min(max_norm / (total_norm + 1e-6), 1), in total_norm's dtype, on the
    device."""
    return torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)


def scale_by_total_norm_(hook: GradHook, coefficient, optimizer: torch.optim.Optimizer | None = None) -> torch.Tensor:
    """Multiply every gradient `hook` is registered on by `coefficient(total_norm)`, as `clip_grad_norm_` does with
    its own coefficient: the total 2-norm (0-dim, in the gradients' promoted dtype, on the statistics' device) comes
    from the norms the hook recorded (on one device, DDP or FSDP2: the whole model's), `coefficient` maps it to a
    0-dim float tensor on the same device with torch ops (no host sync), and the gradients are scaled in place by
    one multi-tensor pass per (device, dtype), or, with a fused optimizer (`fold.folds_into`) and unsharded
    gradients, the coefficient is folded into its `grad_scale` for its next step (no pass). Returns the total
    norm; with no gradient a float32 zero, and `coefficient` is not called."""
    fold_into = fold.target(optimizer, "optimizer=")
    return _scale_by_total_norm_eager(hook, coefficient, 2.0, None, fold_into=fold_into, fold_sharded=True)


@torch.no_grad()
def _scale_by_total_norm(hook: GradHook, coefficient, norm_type: float, foreach: bool | None,
                         given: list[torch.Tensor] | None = None, bumps: int = 0,
                         fold_into: torch.optim.Optimizer | None = None, exact_coef: bool = False,
                         fold_sharded: bool = False) -> torch.Tensor:
    """The total norm of `hook`'s gradients and the scaling by `coefficient(total_norm)` that _clip and
    scale_by_total_norm_ share (arguments as theirs). exact_coef: the coefficient is 1 or NaN, so each gradient stays
    described by its recorded norm times it. fold_sharded: with sharded (FSDP2) gradients and `fold_into`, scale
    them in place instead of refusing."""
    if not isinstance(hook, GradHook):
        raise TypeError(f"clip_grad_norm_ takes the fusedhooks hook whose statistics give the norms (e.g. "
                        f"fh.grad_hook(stats=('norm',))), not {type(hook).__name__}")
    slot, transform = _norm_slot(hook, norm_type)
    if any(entry.steps_in_backward for entry in hook.registry):
        raise ValueError(STEPPED_IN_BACKWARD_MESSAGE)
    grads, entries, key = _collect(hook)
    copies = given is not None and _are_copies(given, grads)
    if copies:
        # a copy (which the graph may have changed before the call, `.grad` itself being written only after the
        # graph) is described by the recorded norm of the gradient it holds exactly the values of
        described = [_has_row(hook, e) and (e.measurement.describes(g, bumps) if c is g else
                                            e.measurement.describes(g) and torch.equal(c, g))
                     for e, g, c in zip(entries, grads, given)]
        grads = list(given)
    else:
        described = [_has_row(hook, e) and e.measurement.describes(g, bumps) for e, g in zip(entries, grads)]
    if not grads:
        return torch.zeros((), device=hook.stats.device or "cpu")
    per_hook = _layouts.setdefault(hook, {})
    layout = per_hook.get(slot)
    if layout is None or layout.key != key:
        layout = per_hook[slot] = _build_layout(hook, grads, key, slot)

    if slot is not None:
        values = hook.stats.tensor.reshape(-1).index_select(0, layout.index)
        if layout.empty_mask is not None:
            values = values.masked_fill(layout.empty_mask, 0.0)
        if transform is not None:
            values = transform(values)
        values = _refresh(values, layout, grads, entries, described, norm_type)
        norms = [values[g.start:g.stop].to(g.dtype) for g in layout.groups]
    elif layout.key[-1]:
        raise ValueError(f"clip_grad_norm_ of sharded (FSDP2) parameters takes norm_type 2.0 or inf (the "
                         f"whole-parameter norms come from the hook's statistics), not {norm_type}")
    else:
        norms = [_norms_from_grads([grads[i] for i in g.members], g.device, norm_type, foreach)
                 .to(layout.first_device) for g in layout.groups]
    total_norm = torch.linalg.vector_norm(norms[0] if len(norms) == 1 else torch.cat(norms), norm_type)

    if fold_into is not None and layout.key[-1] and fold_sharded:
        fold_into = None
    if fold_into is not None:  # refused before the coefficient is computed (a spike guard's state advances there)
        if layout.key[-1]:
            raise ValueError("clip_grad_norm_(optimizer=...) does not fold into the step of sharded (FSDP2) "
                             "parameters: pass optimizer=None to scale the gradients in place")
        params = [e.tensor for e in entries]
        fold.check(fold_into, params, grads)
    clip_coef_clamped = coefficient(total_norm)
    if fold_into is not None:
        fold.fold(fold_into, clip_coef_clamped, params, grads)
        return total_norm
    exact_coef = exact_coef and not copies  # a copy's version is not the gradient's
    for g in layout.groups:
        coef = clip_coef_clamped.to(g.device)
        group_grads = [grads[i] for i in g.members]
        if launcher.choose_backend(g.device, hook.backend) != "triton":
            _mul_(group_grads, coef, foreach)
            continue
        addresses = tuple(t.data_ptr() for t in group_grads)
        if g.table is None or copies or g.table_addresses != addresses:
            g.table, g.table_addresses = _multi_tensor().build_table(group_grads), addresses
        _multi_tensor().scale_(g.table, coef, round_coef=g.round_coef, launch=launcher.launch)
        # written through raw pointers: tell autograd and every hook's record, as mul_ would (with max_norm=inf too:
        # a NaN coefficient writes NaN, which another hook sharing the parameter must not take for its norm)
        increment_version(group_grads)
        for i in g.table.left_out:  # not dense: scaled by torch (never the case for gradients torch allocates)
            group_grads[i].mul_(coef)
    if exact_coef:
        for entry, grad, was_described in zip(entries, grads, described):
            if was_described:
                measured = entry.measurement
                entry.measured = (measured.grad, grad._version, measured.address,
                                  clip_coef_clamped if measured.coef is None else measured.coef * clip_coef_clamped)
    return total_norm


def _never_traced(fn):
    """`fn`, never traced by torch.compile: when dynamo skips the frame calling clip_grad_norm_ (a frame holding no
    tensor, such as the rest of a compiled step after `loss.backward()` when the model is a global), the call runs
    eagerly, but dynamo would still compile the frames it calls (this host logic, the launch, the Triton
    interpreter's own Python). About 0.3 us a call. `torch.compiler.disable(fn)` is made at the first call (it
    imports torch._dynamo, hence triton: not at `import fusedhooks`)."""
    disabled = None

    def call(*args, **kwargs):
        nonlocal disabled
        if disabled is None:
            disabled = torch.compiler.disable(fn)
        return disabled(*args, **kwargs)
    return call


_clip_eager = _never_traced(_clip)
_scale_by_total_norm_eager = _never_traced(_scale_by_total_norm)


def _norm_slot(hook: GradHook, norm_type: float):
    """(flat slot index, transform) of the statistic giving each parameter's norm; (None, None) to fall back."""
    sources = _SOURCES.get(norm_type)
    if sources is None:
        return None, None
    names = hook.stats.slot_names
    for name, transform in sources:
        if name in names:
            return names.index(name), transform
    need = sources[0][0]
    raise ValueError(
        f"clip_grad_norm_ with norm_type={norm_type} uses the {need!r} statistic the hook records during backward, "
        f"but {hook.__name__} records {list(names) or 'no statistics'}: add {need!r} to its stats= "
        f"(e.g. fh.grad_hook(stats=({need!r},)))")


def _refresh(values: torch.Tensor, layout: _Layout, grads: list[torch.Tensor], entries: list[Entry],
             described: list[bool], norm_type: float) -> torch.Tensor:
    """The recorded norms (float64, in layout order), made current: a gradient that is not the one the hook
    measured (another tensor object, or changed in place since: a parameter the last backward did not reach
    after zero_grad(set_to_none=False), a gradient edited by hand; or one it has not measured since registration
    or stats.reset(): a gradient set by hand, one a gated micro-batch left unprocessed) has its norm computed from
    the gradient (one read of it); one that an earlier call multiplied by an exact coefficient gets the recorded
    norm times it."""
    recompute, rescale = [], {}
    for g in layout.groups:
        for k, i in enumerate(g.members):
            measured = entries[i].measurement
            if not described[i]:
                recompute.append((g.start + k, i))
            elif measured.coef is not None and grads[i].numel():
                rescale.setdefault(id(measured.coef), (measured.coef, []))[1].append(g.start + k)
    if not recompute and not rescale:
        return values
    values = values.clone()
    for position, i in recompute:
        full = entries[i].tensor.grad
        if is_dtensor(full):  # the whole parameter's norm, from every rank's shard
            norm = process_groups.whole_norm(entries[i].name, entries[i].tensor, norm_type)
            values[position] = norm.to(values.device)
        else:
            values[position] = torch.linalg.vector_norm(grads[i], norm_type).to(values.dtype)
    for coef, positions in rescale.values():
        index = launcher.host_to_device(positions, torch.int64, values.device)  # a pageable copy would sync
        values[index] = values[index] * coef.to(values.device, values.dtype)
    return values


def _are_copies(given: list[torch.Tensor], grads: list[torch.Tensor]) -> bool:
    if len(given) != len(grads):
        raise RuntimeError(f"fusedhooks::clip_grad_norm_ was called with {len(given)} gradients, but {len(grads)} "
                           "parameters registered with the hook have a .grad: a compiled step that sets .grad to "
                           "or from None before fh.clip_grad_norm_ is not supported")
    return any(c is not g for c, g in zip(given, grads))


#: What a clip by the total norm (fh.clip_grad_norm_, fh.zclip's guard.step()) of gradients an optimizer steps inside
#: the backward is refused with
STEPPED_IN_BACKWARD_MESSAGE = (
    "fh.clip_grad_norm_ / fh.zclip: this hook is registered with optimizer= (the step inside the backward), which "
    "steps each parameter at its gradient's firing, before the later gradients exist: no clip by the norm of all of "
    "them (this backward's) can come before those steps, and a ZClip guard fed that norm after the backward would "
    "clip the step after a spike, not the spike. Clip each gradient in the hook's body (e.g. "
    "`g * (max_norm / (g.norm() + 1e-6)).clamp(max=1.0)`), use fh.adaptive_clip (AdaGC: each tensor against its own "
    "history, at its firing), clip by the previous step's total norm (docs/optimizers.md), or register without "
    "optimizer= and clip after the backward, before opt.step()")


def grads_of(hook: GradHook) -> Iterator[tuple[Entry, torch.Tensor]]:
    """(entry, `.grad`) of each tensor registered with `hook` whose `.grad` is not None, in registration order."""
    for entry in hook.registry:
        p = entry.tensor
        if p is not None and (g := p.grad) is not None:
            yield entry, g


def _has_row(hook: GradHook, entry: Entry) -> bool:
    """Does `entry`'s statistics row hold what the hook measured last (it has fired since registration or
    stats.reset(), which leaves `entry.measured` as it was)?"""
    return entry.measured is not None and hook.stats.fired(entry.row)


def _collect(hook: GradHook) -> tuple[list[torch.Tensor], list[Entry], tuple]:
    """The gradients that count (registration order; of a sharded parameter, this rank's shard), their
    entries, and the key telling whether a cached layout still fits (its last item: the positions of sharded
    gradients)."""
    grads, entries, key, sharded = [], [], [], []
    for entry, g in grads_of(hook):
        if is_dtensor(g):  # FSDP2: this rank's shard is scaled; its norm is the whole parameter's
            sharded.append(len(grads))
            g = g._local_tensor
        grads.append(g)
        entries.append(entry)
        key += (entry.row, g.device, g.numel(), g.dtype)  # not the address: new tensors each step keep the layout
    return grads, entries, tuple(key + [tuple(sharded)])


def _build_layout(hook: GradHook, grads: list[torch.Tensor], key: tuple, slot: int | None) -> _Layout:
    rows = key[0:-1:4]
    sharded = set(key[-1])
    grouped = _group_by_device_and_dtype(grads)
    total_dtype = functools.reduce(torch.promote_types, (dtype for (_, dtype), _ in grouped))
    groups, order = [], []
    for (device, dtype), members in grouped:
        round_coef = device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and dtype != total_dtype
        groups.append(_Group(device, dtype, len(order), len(order) + len(members), members, round_coef))
        order += members
    index = empty_mask = None
    if slot is not None:
        device = hook.stats.device
        n_slots = len(hook.stats.slot_names)
        index = launcher.host_to_device([rows[i] * n_slots + slot for i in order], torch.int64, device)
        empty = [grads[i].numel() == 0 and i not in sharded for i in order]  # a shard's row: the whole's norm
        if any(empty):
            empty_mask = launcher.host_to_device(empty, torch.bool, device)
    return _Layout(key, groups, index, empty_mask, grads[0].device)


def _group_by_device_and_dtype(grads: list[torch.Tensor]) -> list[tuple[tuple[torch.device, torch.dtype], list[int]]]:
    """Torch's own grouping (its order decides the order of the norms vector, hence the total norm's bits)."""
    try:
        from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype
        grouped = _group_tensors_by_device_and_dtype([grads], with_indices=True)
        return [(k, list(indices)) for k, (_, indices) in grouped.items()]
    except (ImportError, TypeError):  # pragma: no cover - a torch without it: first-appearance order
        out: dict = {}
        for i, g in enumerate(grads):
            out.setdefault((g.device, g.dtype), []).append(i)
        return list(out.items())


def _norms_from_grads(grads: list[torch.Tensor], device: torch.device, norm_type: float,
                      foreach: bool | None) -> torch.Tensor:
    """Per-gradient norms read from the gradients, as torch's `_get_total_norm` computes them (the fallback)."""
    from torch.utils._foreach_utils import _device_has_foreach_support, _has_foreach_support
    if (foreach is None and _has_foreach_support(grads, device)) or (foreach and _device_has_foreach_support(device)):
        norms = torch._foreach_norm(grads, norm_type)
    elif foreach:
        raise RuntimeError(f"foreach=True was passed, but can't use the foreach API on {device.type} tensors")
    else:
        norms = [torch.linalg.vector_norm(g, norm_type) for g in grads]
    return torch.stack(norms)


def _multi_tensor():
    from ..kernels import multi_tensor

    return multi_tensor


optable.implement("clip_grad_norm_", _clip)
