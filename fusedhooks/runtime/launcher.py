"""Running a plan on a gradient: backend choice, block sizes and grids, workspaces, layouts."""

from __future__ import annotations

import array
import functools
import operator
import threading
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import increment_version

from .. import config
from ..compiler.dims import units_launch
from ..compiler.plan import Plan
from . import eager, fastlaunch, reference, tuning
from .layout import flat_span

#: Partial-statistics rows the last program merges at a time.
RBLOCK = 256
#: Elements per program, for every gradient size and device (float64: half as many, see default_block). One BLOCK
#: for all sizes makes a gradient's statistics bit-identical whether it is processed alone or in a bucket with
#: others (same blocks, same reduction order). FUSEDHOOKS_BLOCK overrides it.
DEFAULT_BLOCK = 32768


def default_block(dtype: torch.dtype) -> int:
    """The untuned BLOCK of `dtype` gradients: DEFAULT_BLOCK, a quarter of it for 8-byte types (on sm_90 the float64
    kernels need up to 161 registers per thread at 4096 elements and 8 warps, and at 2048 two of them spill; at
    1024 and 8 warps at most 64 registers, no spill)."""
    return DEFAULT_BLOCK if dtype.itemsize <= 4 else DEFAULT_BLOCK // 4


#: The backends a hook can ask for (grad_hook(backend=), FUSEDHOOKS_BACKEND).
BACKENDS = ("auto", "triton", "eager", "reference")


def check_backend(backend: str, source: str = "") -> None:
    """Refuse a backend name that is not one of BACKENDS; `source`: where it came from, for the message."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(map(repr, BACKENDS))}, not {backend!r}{source}")


def choose_backend(device: torch.device, requested: str | None = None) -> str:
    """"triton", "eager" or "reference" for gradients on `device`.

    requested (or FUSEDHOOKS_BACKEND): "auto" (default: Triton on CUDA, and on CPU under TRITON_INTERPRET=1;
    "eager" on CPU otherwise; "reference" on other devices), "triton", "eager" (CPU tensors only: it reads
    statistics on the host) or "reference" (eager torch in float64: the tests' oracle).
    """
    if requested:
        check_backend(requested)
    else:
        requested = config.backend() or "auto"
        check_backend(requested, " (from the environment variable FUSEDHOOKS_BACKEND)")
    if requested == "reference":
        return "reference"
    if requested == "eager":
        if device.type != "cpu":
            raise RuntimeError(f"the eager backend runs on CPU tensors (it reads statistics on the host); got a "
                               f"{device.type} tensor: use backend='auto' or 'triton'")
        return "eager"
    triton_ok = device.type == "cuda" or (device.type == "cpu" and config.triton_interpret())
    if requested == "triton" and not triton_ok:
        raise RuntimeError(f"the triton backend runs on CUDA tensors, or on CPU tensors with TRITON_INTERPRET=1; "
                           f"got a {device.type} tensor")
    if triton_ok:
        return "triton"
    return "eager" if device.type == "cpu" else "reference"


def block_size(module=None, device: torch.device | None = None, dtype: torch.dtype = torch.float32) -> int:
    """Elements per program for `dtype` gradients: FUSEDHOOKS_BLOCK (a power of two >= 16) if set, else the BLOCK
    tuned for these kernels on this device (`python -m fusedhooks tune`), else default_block(dtype). One BLOCK
    serves every size."""
    override = config.block()
    if override:
        return override
    entry = tuning.lookup(module, device) if module is not None and device is not None else None
    return entry["block"] if entry else default_block(dtype)


def launch_config(numel: int, device_type: str, module=None, device: torch.device | None = None,
                  dtype: torch.dtype = torch.float32) -> tuple[int, int]:
    """(BLOCK, grid) for a gradient of `numel` elements of `dtype` on `device_type` (module, device: see
    block_size)."""
    block = block_size(module, device, dtype)
    return block, -(-numel // block)


def default_num_warps(block: int, dtype: torch.dtype = torch.float32) -> int:
    """Warps of a CUDA launch of `block` elements of `dtype` per program, unless tuned: 8 from 8 KiB of 4-byte (or
    smaller) elements up, else 4."""
    return 8 if block * max(dtype.itemsize, 4) >= 8192 else 4


def launch_options(module, device: torch.device, numel: int, block: int, dtype: torch.dtype = torch.float32) -> dict:
    """Compile options of a launch: tuned num_warps/num_stages for this size, else a heuristic."""
    options = {"enable_fp_fusion": False}
    if device.type == "cuda":
        options["num_warps"] = default_num_warps(block, dtype)
    entry = tuning.lookup(module, device)
    if entry:
        options.update(entry["sizes"].get(tuning.size_key(numel), {}))
    return options


class Workspace:
    """Per-device scratch of a hook, reused by every firing (stream-ordered, so no clashes): partial
    statistics, the programs-finished counters, body reduction results, histogram accumulators, and the
    launches bound so far (`bound`: single gradients; `tables`: buckets)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._buffers: dict[str, torch.Tensor] = {}
        self.tables: dict[tuple, BucketTable] = {}
        self.bound: dict[tuple, Bound] = {}
        self._scratch: dict[torch.dtype, torch.Tensor] = {}

    def scratch(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A 1-D buffer of `numel` elements of `dtype`, reused (the eager backend's temporaries: a fresh large
        CPU allocation costs a page fault per page at first touch)."""
        buffer = self._scratch.get(dtype)
        if buffer is None or buffer.numel() < numel:
            buffer = self._scratch[dtype] = torch.empty(numel, dtype=dtype, device=self.device)
        return buffer[:numel]

    def buffer(self, role: str, n: int) -> torch.Tensor:
        """The buffer of launch-spec role `role` (see WORKSPACE_BUFFERS), grown to at least `n` elements."""
        buffer = self._buffers.get(role)
        if buffer is None or buffer.numel() < n:
            dtype, zeroed = WORKSPACE_BUFFERS[role]
            make = torch.zeros if zeroed else torch.empty
            buffer = self._buffers[role] = make(max(n, 1), dtype=dtype, device=self.device)
        return buffer


class FreshWorkspace:
    """The workspace of a traced firing (`fire_traced`): every buffer allocated at each call, zeroed where the kernels
    expect zeros (`WORKSPACE_BUFFERS`), so that a graph torch.compile traces holds them as its own allocations (no
    tensor of this process captured as a constant; inductor plans their memory, CUDA graphs take them from their
    pool)."""

    def __init__(self, device: torch.device):
        self.device = device

    def buffer(self, role: str, n: int) -> torch.Tensor:
        """A new buffer of launch-spec role `role` of `n` elements (at least one)."""
        dtype, zeroed = WORKSPACE_BUFFERS[role]
        return (torch.zeros if zeroed else torch.empty)(max(n, 1), dtype=dtype, device=self.device)


#: The workspace's buffers, by launch-spec role: (dtype, zeroed: the kernels leave every element 0 again)
WORKSPACE_BUFFERS = {
    "partials": (torch.float64, False), "reduced": (torch.float64, False), "units": (torch.float64, False),
    "unit_partials": (torch.float64, False), "counter": (torch.int32, True), "unit_counters": (torch.int32, True),
    "hist": (torch.int64, True),
}


#: The Triton interpreter keeps the running program's ids in global state: interpreted launches from several
#: threads (DDP's communication callbacks run on the process group's threads) take turns.
_interpreter_lock = threading.Lock()


def host_to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 1-D tensor of `values` on `device`, without a host sync: to a CUDA device through pinned memory, copied
    stream-ordered (a pageable copy is synchronising; torch's pinned-memory allocator records the copy's event and does
    not reuse the block before the copy is done, so the host tensor need not be kept). Every launch table and
    hyper-parameter vector goes to the device through here."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def aligned(*tensors: torch.Tensor | None) -> bool:
    """The kernels' ALIGNED hint: every tensor's address 16-byte aligned and its size a multiple of 16 bytes
    (then the mask is uniform over each 16 bytes and loads and stores are 128-bit vectors)."""
    return all(t is None or (t.data_ptr() % 16 == 0 and t.numel() * t.element_size() % 16 == 0) for t in tensors)


def units_aligned(units, element_size: int) -> bool:
    """The one-pass kernel's part of the ALIGNED hint: every unit ((units, elements of each) per gradient) a multiple
    of 16 bytes, so that each starts 16-byte aligned."""
    return all(elements * element_size % 16 == 0 for _, elements in units)


def launch(kernel, grid: tuple, args: list | tuple, meta: dict, fast: fastlaunch.Kept | None = None) -> None:
    """`kernel[grid](*args, **meta)`: every kernel launch of fusedhooks goes through here (tests count launches by
    wrapping it). The arguments and meta (constexprs, compile options) come as they are kept (a Bound's), not
    repacked at each call.

    fast: what the caller keeps for this kernel, grid and meta (a Bound's): on a GPU the first launch leaves the
    compiled kernel in it and later ones launch that directly (see `fastlaunch.Kept`).

    A kernel of the Triton interpreter (made by @triton.jit under TRITON_INTERPRET=1) runs under a lock: the
    interpreter is not thread-safe. Told by the kernel's type, not the environment (reading os.environ cost about
    0.8 µs a launch)."""
    if isinstance(kernel, fastlaunch.interpreted_function()):
        with _interpreter_lock:
            kernel[grid](*args, **meta)
    elif fast is not None:
        fastlaunch.launch(kernel, grid, args, meta, fast)
    else:
        kernel[grid](*args, **meta)


_PER_FIRING = ("grad", "param", "stats", "scale", "found_inf")


@dataclass
class Bound:
    """The launches of one firing, bound once: the kernels, their grids and meta (constexprs, compile options), and
    the arguments in order with everything that stays the same between firings in place (scalars, workspace
    buffers, numel, the bucket table); `run` puts in the rest (`slots`: role -> position).
    fast: one fastlaunch.Kept per kernel for `launch` (its `varying`: the slots' and the closed-over tensors'
    positions)."""

    kernels: tuple
    grids: tuple
    args: list
    meta: dict
    slots: tuple[tuple[str, int], ...]
    fast: tuple
    #: (index in _PER_FIRING, position) of each role of `slots`: where `fire` puts this firing's tensors
    takes: tuple[tuple[int, int], ...] = ()
    #: (kernel, grid, fast) of each launch, in order
    launches: tuple = ()

    def __post_init__(self):
        self.takes = tuple((_PER_FIRING.index(role), position) for role, position in self.slots)
        self.launches = tuple(zip(self.kernels, self.grids, self.fast))

    def run(self, values: tuple, traced: bool = False) -> None:
        """Launch the kernels with this firing's tensors, `values` in _PER_FIRING order (grad, param, stats, scale,
        found_inf; None where the kernels take none), put at their positions in a copy of the bound arguments: the
        one launch of every firing. traced: through `launch_traced` (the graph torch.compile traces holds them)."""
        args = self.args.copy()
        for index, position in self.takes:
            args[position] = values[index]
        meta = self.meta
        if traced:
            for kernel, grid in zip(self.kernels, self.grids):
                launch_traced(kernel, grid, *args, **meta)
            return
        for kernel, grid, fast in self.launches:
            launch(kernel, grid, args, meta, fast)


def bind(module, multi: bool, grid: int, workspace: Workspace, scalars: list[torch.Tensor], values: dict,
         meta: dict) -> Bound:
    """A Bound for `module`'s single-gradient kernels (multi: its bucket kernels) on `grid` programs, following
    module.SPEC: workspace buffers sized by it, `values` the arguments fixed by the caller (numel, or table and
    n_tensors) and "partial_values" (fp64 partials the launch needs)."""
    spec = module.SPEC
    roles = spec.multi_args if multi else spec.args
    n = values.get("n_tensors", 1)
    sizes = {"reduced": n * spec.n_reductions, "units": n * spec.units_values,
             "unit_partials": n * spec.unit_partial_values, "unit_counters": n * spec.unit_counter_values,
             "partials": values.get("partial_values", 0), "counter": n, "hist": n * spec.hist_values}
    args, slots, varying = [], [], []
    for role in roles:
        if role in meta:
            continue  # ALIGNED, BLOCK, RBLOCK
        if role.startswith("scalar"):
            varying.append(len(args))
            args.append(scalars[int(role.removeprefix("scalar"))])
        elif role in sizes:
            args.append(workspace.buffer(role, sizes[role]))
        elif role in _PER_FIRING:
            varying.append(len(args))
            slots.append((role, len(args)))
            args.append(None)
        else:
            args.append(values[role])
    names = spec.multi_kernels if multi else spec.kernels_for(grid)
    grids = tuple((spec.grid_of(name, grid, n),) for name in names)
    return Bound(tuple(getattr(module, name) for name in names), grids, args, meta, tuple(slots),
                 tuple(fastlaunch.Kept(tuple(varying)) for _ in names))


def launch_traced(kernel, grid: tuple, *args, **meta) -> None:
    """A kernel launch of a traced firing (`fire_traced`): through `torch.library.wrap_triton`, so that the graph
    torch.compile traces holds it (a triton_kernel_wrapper node: inductor schedules the kernel and knows what it
    writes; outside tracing it launches the kernel). num_warps/num_stages become the one configuration of the
    kernel; `enable_fp_fusion` is a compile option the graph's eager run honours and inductor does not (it compiles a
    user kernel with Triton's default, FMA contraction on)."""
    torch.library.wrap_triton(kernel)[grid](*args, **meta)


def kernel_meta(module, device: torch.device, numel: int, block: int, hint: bool, dtype: torch.dtype,
                full_blocks: bool = False) -> dict:
    """The constexprs and compile options of a launch of `module`'s kernels on `numel` elements of `dtype`;
    full_blocks: every gradient's numel a multiple of `block` (FULL_BLOCKS, for kernels that take it)."""
    meta = {"ALIGNED": hint, "BLOCK": block, "RBLOCK": RBLOCK}
    if "FULL_BLOCKS" in module.SPEC.args:
        meta["FULL_BLOCKS"] = full_blocks
    return meta | launch_options(module, device, numel, block, dtype)


def bind_single(module, numel: int, hint: bool, device: torch.device, dtype: torch.dtype, workspace: Workspace,
                scalars: list[torch.Tensor], config: dict | None = None, units: tuple[int, int] | None = None
                ) -> Bound:
    """The Bound of `module`'s single-gradient kernels for a gradient of `numel` elements of `dtype`; config: a
    launch configuration ({"block", "num_warps", "num_stages"}) instead of the runtime's (tune tries them);
    units: (units, elements of each) of the gradient, for a one-pass kernel over units."""
    block = config["block"] if config else block_size(module, device, dtype)
    grid = -(-numel // block)
    meta = kernel_meta(module, device, numel, block, hint, dtype, numel % block == 0)
    values = {"numel": numel}
    if module.SPEC.one_pass:
        meta.update(units_launch(block, [units], dtype.itemsize))
        grid = -(-units[0] // meta["UNITS"])
        values.update(n_units=units[0], unit_numel=units[1])
    if config:
        meta.update(num_warps=config["num_warps"], num_stages=config["num_stages"])
    values["partial_values"] = module.SPEC.partial_values(grid)
    return bind(module, False, grid, workspace, scalars, values, meta)


def fire(plan: Plan, module, grad: torch.Tensor, param: torch.Tensor, scalars: list[torch.Tensor],
         stats_row: torch.Tensor | None, workspace: Workspace, amp: tuple | None = None) -> None:
    """Apply `plan` to `grad` in place and record its statistics into `stats_row`; no host sync.

    module: the generated kernels (triton), the compiled body (eager: eager.compile_body) or None (reference);
    amp: (scale, found_inf) tensors
    when the hook unscales for a GradScaler. An empty gradient launches no kernel: its statistics
    (count 0, sum 0, mean NaN, ...) are written by the reference backend.
    """
    numel = grad.numel()
    backend = plan.backend
    if backend == "eager" and numel:
        eager.run(plan, module, grad, param, scalars, stats_row, amp, workspace.scratch)
        return
    if module is None or numel == 0:
        reference.run(plan, grad, param, scalars, stats_row, amp)
        return
    uses_param = plan.graph.uses_param
    # the kernels only take the pointer: a contiguous gradient goes as it is (no view to build)
    # (a kernel over units (fusedhooks.dims) indexes the gradient as contiguous: any other layout is copied)
    if grad.is_contiguous() and not uses_param:  # the common case, in fewer calls
        work = span = grad
        pspan = None
        hint = grad.data_ptr() % 16 == 0 and numel * grad.element_size() % 16 == 0
    else:
        span = grad if grad.is_contiguous() else None if plan.units is not None else flat_span(grad)
        work = span
        if span is None or (uses_param and param.stride() != grad.stride()):
            work = grad.contiguous().view(-1)
            pspan = param.contiguous().view(-1) if uses_param else None
        else:
            pspan = (param if param.is_contiguous() else flat_span(param)) if uses_param else None
        hint = aligned(work, pspan)
    units = None
    if module.SPEC.one_pass:
        units = plan.units.unit_sizes
        hint = hint and units_aligned([units], grad.element_size())
    key = (module, numel, hint, units)
    bound = workspace.bound.get(key)
    if bound is None:
        if len(workspace.bound) > 256:  # sizes keep changing: keep the cache small
            workspace.bound.clear()
        bound = workspace.bound[key] = bind_single(module, numel, hint, grad.device, grad.dtype, workspace,
                                                   scalars, units=units)
    bound.run((work, pspan, stats_row) + (_NO_AMP if amp is None else amp))
    if plan.graph.writes or plan.amp:  # (plan.writes of a non-empty gradient)
        if work is not span and work.data_ptr() != grad.data_ptr():
            grad.copy_(work.view(grad.shape))
        else:  # the kernel wrote through a raw pointer: tell autograd, as mul_ would (increment_version)
            _increment_version((grad,))


_increment_version = torch._C._increment_version


def launches_only(plan: Plan, module) -> bool:
    """Does a firing of `plan` on a non-empty gradient through `single_launch` only launch `module`'s kernels (the
    triton backend, kernels not over units, a body that does not read the parameter)? Then it runs no torch op that
    autograd could record (it reads closed-over tensors through pointers), grad mode on or off; a gradient that is
    not contiguous is copied and copied back, neither requiring grad."""
    return plan.backend == "triton" and module is not None and not module.SPEC.one_pass and not plan.graph.uses_param


def single_launch(plan: Plan, module, scalars: list[torch.Tensor], workspace: Workspace):
    """`fire` of `plan` on one gradient at a time into `workspace`, as `launch(grads, params, stats_row, amp)` (see
    `firing.Launch`; grads and params of one each): the common case (the triton backend, a contiguous non-empty
    gradient, a body that does not read the parameter, kernels not over units, a launch bound before) with what does
    not change between firings looked up once; every other case through `fire`."""
    if not launches_only(plan, module):
        def launch_any(grads: list, params: list, stats_row: torch.Tensor | None, amp: tuple | None) -> None:
            fire(plan, module, grads[0], params[0], scalars, stats_row, workspace, amp)
        return launch_any
    writes, bounds, itemsize = plan.graph.writes or plan.amp, workspace.bound, plan.graph.grad_dtype.itemsize
    # the Bound of the last launch and its (numel, aligned): a gradient launches as the last one did, as a rule (a
    # key built and hashed at each launch cost about 0.1 µs); only this thread launches into `workspace`
    last_numel, last_aligned, last_bound = 0, False, None

    def launch_one(grads: list, params: list, stats_row: torch.Tensor | None, amp: tuple | None) -> None:
        nonlocal last_numel, last_aligned, last_bound
        grad = grads[0]  # of the plan's dtype
        numel = grad.numel()
        bound = None
        if numel and grad.is_contiguous():
            aligned = grad.data_ptr() % 16 == 0 and numel * itemsize % 16 == 0
            if numel == last_numel and aligned is last_aligned:
                bound = last_bound
            else:
                bound = bounds.get((module, numel, aligned, None))
                if bound is not None:
                    last_numel, last_aligned, last_bound = numel, aligned, bound
        if bound is None:  # not the common case, or not bound yet: `fire` binds it
            fire(plan, module, grad, params[0], scalars, stats_row, workspace, amp)
            return
        bound.run((grad, None, stats_row, None, None) if amp is None else (grad, None, stats_row, *amp))
        if writes:  # the kernel wrote through a raw pointer: tell autograd, as mul_ would (increment_version)
            _increment_version((grad,))
    return launch_one

#: the AMP tensors (scale, found_inf) of a firing without AMP
_NO_AMP = (None, None)


def traced_launches(plan: Plan, module, grad: torch.Tensor) -> bool:
    """Does `fire_traced` launch `module`'s kernels for `grad` (else it runs the plan as torch ops): a generated
    Triton module, a non-empty CUDA gradient, Triton compiling (not interpreting)."""
    return (plan.backend == "triton" and module is not None and grad.device.type == "cuda"
            and not config.triton_interpret() and grad.numel() != 0)


def bind_traced(plan: Plan, module, grad: torch.Tensor, param: torch.Tensor, scalars: list[torch.Tensor]
                ) -> tuple[Bound, tuple] | None:
    """The launches of a traced firing of `module`'s kernels on `grad` (see `fire_traced`): (the Bound, (the gradient
    and parameter the kernels take)), or None when they cannot be traced (then the plan runs as torch ops).

    The Bound is `bind_single`'s (one launch specification for both paths) with a FreshWorkspace; what `fire`
    decides from addresses is decided without them, tensors being fake or functional here: the ALIGNED hint is
    False (the address is not known when tracing; False is always right, at the cost of the 128-bit vector accesses), a
    non-contiguous gradient (or, with a param-reading body, parameter) goes as a contiguous copy. An integer argument
    equal to 1 (a one-element gradient, a single unit) is refused: inductor specialises it into a constant of the
    compiled user kernel whatever `do_not_specialize` says, where the kernels need a tensor (`.to()`)."""
    numel = int(grad.numel())  # a symbolic size is specialised here: one kernel launch per shape
    work = grad.contiguous()
    pspan = param.contiguous() if plan.graph.uses_param else None
    units = plan.units.unit_sizes if module.SPEC.one_pass else None
    bound = bind_single(module, numel, False, grad.device, grad.dtype, FreshWorkspace(grad.device), scalars,
                        units=units)
    if any(type(a) is int and a == 1 for a in bound.args):
        return None
    return bound, (work, pspan)


def fire_traced(plan: Plan, module, grad: torch.Tensor, param: torch.Tensor, scalars: list[torch.Tensor],
                stats_row: torch.Tensor | None, amp: tuple | None = None) -> None:
    """`fire` as torch.compile traces it (the body of the fusedhooks::firing operator, run on fake or functional
    tensors while tracing): only torch operators, so that the graph holds the whole firing, and no host sync.
    amp: (scale, found_inf) when the hook unscales for a GradScaler.

    On CUDA with Triton kernels (`traced_launches`): the kernels `fire` launches, launched through `launch_traced`
    (`torch.library.wrap_triton`) with their workspace allocated by the call (`bind_traced`); a gradient that is
    not contiguous is processed as a copy, copied back. Otherwise (CPU, the Triton interpreter, the eager and
    reference backends, an empty gradient) the plan as torch ops (`reference.run`: inductor fuses them)."""
    launches = bind_traced(plan, module, grad, param, scalars) if traced_launches(plan, module, grad) \
        else None
    if launches is None:
        reference.run(plan, grad, param, scalars, stats_row, amp)
        return
    bound, (work, pspan) = launches
    bound.run((work, pspan, stats_row) + (_NO_AMP if amp is None else amp), traced=True)
    if plan.writes and work is not grad:
        grad.copy_(work.view(grad.shape))


# --- buckets: many gradients, one launch per pass ------------------------------------------------------------

@dataclass
class BucketTable:
    """The int64 table a `..._multi` kernel reads, for one bucket of gradients (one dtype, one device): the
    parts of launch_spec.TABLE_PARTS (grad addresses, param addresses, numels, blocks per gradient, stats row
    offsets, partials offsets), each n_tensors long, then (gradient, block) of each program.

    Built once per bucket layout (the gradients' sizes and rows) with its launches bound (`bound`, one per
    ALIGNED hint); when the gradients move (a new backward allocates new ones), only the addresses are
    rewritten (`point_to`).
    """

    table: torch.Tensor
    n_tensors: int
    n_programs: int
    partial_values: int  # fp64 partials the bucket needs, all gradients together
    sizes_aligned: bool  # every gradient's size a multiple of 16 bytes
    addresses: tuple = ()  # the grad (then param) addresses the table holds now
    aligned: bool = False  # the ALIGNED hint of the gradients at `addresses` (see `aligned`)
    cpu_values: array.array | None = None  # a CPU table's memory (written in place, without a torch op)
    bound: dict = field(default_factory=dict)  # ALIGNED hint -> Bound
    units_meta: dict = field(default_factory=dict)  # UNITS and ELEMENTS of a one-pass kernel over units

    def point_to(self, addresses: tuple) -> None:
        """Make the table's first two parts hold `addresses` (n_tensors grad addresses, then 0 or n_tensors
        param addresses); stream-ordered after launches already queued."""
        if addresses == self.addresses:
            return
        if self.cpu_values is not None:
            self.cpu_values[:len(addresses)] = array.array("q", addresses)
        else:
            values = torch.frombuffer(array.array("q", addresses), dtype=torch.int64).pin_memory()
            self.table[:len(addresses)].copy_(values, non_blocking=True)  # see host_to_device
        self.addresses = addresses
        self.aligned = self.sizes_aligned and functools.reduce(operator.or_, addresses) % 16 == 0


def bucket_table(spec, numels: tuple[int, ...], rows: tuple[int, ...], block: int, device: torch.device,
                 element_size: int, units: tuple[tuple[int, int], ...] | None = None) -> BucketTable:
    """The table for gradients of `numels` elements (non-empty) of `element_size` bytes with statistics rows `rows`,
    addresses unset (see `BucketTable.point_to`); spec: the kernels' LaunchSpec; units: (units, elements of each)
    per gradient, for a one-pass kernel over units (its programs hold UNITS units, not BLOCK elements)."""
    n = len(numels)
    units_meta = units_launch(block, units, element_size) if spec.one_pass else {}
    if spec.one_pass:
        blocks = [-(-u // units_meta["UNITS"]) for u, _ in units]
    else:
        blocks = [-(-numel // block) for numel in numels]
    offsets, total = [], 0
    for b in blocks:
        offsets.append(total)
        total += spec.partial_values(b)
    parts = {"grad": [0] * n, "param": [0] * n, "numel": list(numels), "blocks": blocks,
             "stats_offset": [r * spec.n_slots for r in rows], "partials_offset": offsets,
             "n_units": [u for u, _ in units] if spec.one_pass else [0] * n,
             "unit_numel": [e for _, e in units] if spec.one_pass else [0] * n}
    programs = [v for t, b in enumerate(blocks) for k in range(b) for v in (t, k)]
    values = [v for part in spec.table_parts for v in parts[part]] + programs
    cpu_values = None
    if device.type == "cuda":
        table = host_to_device(values, torch.int64, device)
    else:
        cpu_values = array.array("q", values)
        table = torch.frombuffer(cpu_values, dtype=torch.int64)
    sizes_aligned = all(numel * element_size % 16 == 0 for numel in numels)
    if spec.one_pass:
        sizes_aligned = sizes_aligned and units_aligned(units, element_size)
    return BucketTable(table, n, sum(blocks), max(total, 1), sizes_aligned, cpu_values=cpu_values,
                       units_meta=units_meta)


def fire_bucket(plan: Plan, module, grads: list[torch.Tensor], params: list[torch.Tensor], rows: list[int],
                scalars: list[torch.Tensor], stats: torch.Tensor | None, workspace: Workspace,
                amp: tuple | None = None, units: tuple[tuple[int, int], ...] | None = None,
                numels: tuple[int, ...] | None = None) -> None:
    """Apply `plan` to every gradient of `grads` (of `params`, with statistics rows `rows`) with one launch per pass;
    no host sync. units: (units, elements of each) per gradient, for a one-pass kernel over units (gradients of
    several shapes may share it); numels: the gradients' numels, when the caller has them.

    Every grad must be non-empty, one flat span of storage (see `layout.flat_span`: its data_ptr and numel
    are those of the span), of plan.dtype on one device; with a param-reading body, each param must be a flat
    span with its grad's strides.
    """
    if numels is None:
        numels = tuple(map(torch.Tensor.numel, grads))
    addresses = tuple(map(torch.Tensor.data_ptr, grads))
    if plan.graph.uses_param:
        addresses += tuple(map(torch.Tensor.data_ptr, params))
    rows = tuple(rows)
    key = (module, numels, rows, units)
    table = workspace.tables.get(key)
    device, dtype = grads[0].device, grads[0].dtype
    if table is None:
        if len(workspace.tables) > 64:  # bucket layouts keep changing: keep the cache small
            workspace.tables.clear()
        table = workspace.tables[key] = bucket_table(module.SPEC, numels, rows, block_size(module, device, dtype),
                                                     device, grads[0].element_size(), units)
    table.point_to(addresses)
    hint = table.aligned
    bound = table.bound.get(hint)
    if bound is None:
        block = block_size(module, device, dtype)
        meta = kernel_meta(module, device, sum(numels), block, hint, dtype,
                           all(numel % block == 0 for numel in numels)) | table.units_meta
        values = {"table": table.table, "n_tensors": table.n_tensors, "partial_values": table.partial_values}
        bound = table.bound[hint] = bind(module, True, table.n_programs, workspace, scalars, values, meta)
    bound.run((None, None, stats) + (_NO_AMP if amp is None else amp))
    if plan.writes:
        increment_version(grads)
