"""A hook's compilation cache: its body lowered, planned and compiled for each gradient dtype, device (and shape, for a
body that reduces over dimensions), kept for later firings (`HookCompilation`), and the per-thread scratch its
kernels write on each device (`Workspaces`).

Handed what it needs by the hook (`api.GradHook`): the traced body (through `body_for`), its options and statistic
names; it knows nothing of the hook itself."""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import config
from ..codegen import generate
from ..compiler import dims
from ..compiler.ir import Graph
from ..compiler.plan import Plan, make_plan
from ..compiler.trace import CompileError, TracedBody, lower
from . import eager, launcher


@dataclass
class Compiled:
    """A hook's plan for one (dtype, device) and what runs it: the generated Triton kernels (a module), the eager
    backend's body function (eager.compile_body), or None (the reference backend)."""

    plan: Plan
    kernel: object


@dataclass
class BackwardPlan:
    """What one backward costs for a hook's registered tensors (see GradHook.explain)."""

    launches_per_backward: int
    text: str

    def __str__(self) -> str:
        return self.text


class HookCompilation:
    """The plans and kernels of one hook's body, compiled on first use and then cached.

    body_for: the traced body for gradients of a shape (`body_for(shape)`, shape None: any shape), scalars: the
    0-dim tensors the body closes over; reduces_over_dims: the body is lowered and planned for each gradient shape;
    stats / input_stats: the statistic names measured after / before the body, shard_stats: those a shard of an
    FSDP2 gradient records instead (`stats.merge.partial_stats` of each); hist_range: the "hist" bins; backend:
    the hook's backend option (None: config's); amp: the plans unscale (scaler=); name: the hook's, for messages."""

    def __init__(self, body_for: Callable[[tuple | None], TracedBody], scalars: list[torch.Tensor], *,
                 reduces_over_dims: bool, stats: tuple[tuple[str, ...], tuple[str, ...]],
                 shard_stats: tuple[tuple[str, ...], tuple[str, ...]], hist_range: tuple[int, int],
                 backend: str | None, amp: bool, name: str):
        self.body_for, self.scalars = body_for, scalars
        self.reduces_over_dims = reduces_over_dims
        self.stats, self.shard_stats, self.hist_range = stats, shard_stats, hist_range
        self.backend, self.amp, self.name = backend, amp, name
        self._graphs: dict[object, Graph] = {}
        self._compiled: dict[tuple, Compiled] = {}
        self._compiled_by_index: dict[tuple, Compiled] = {}  # (dtype, is_cuda, device index) -> the unsharded one
        self._dims_warned = False

    def plan(self, numel: int | None, dtype: torch.dtype, device: torch.device, shape: tuple | None, amp: bool
             ) -> Plan:
        """The plan for a gradient of `numel` elements (or of `shape`), `dtype` and `device`, with the block size it
        would be launched with (a tuned one where the tuning cache has it); amp: the plan unscales (scaler=)."""
        graph = self.graph(dtype, shape)
        backend = self.backend_for(device, graph, warn=False)
        module = None
        if backend == "triton" and numel and config.tune_cache().exists():  # a tuned BLOCK applies
            module = self.compiled(dtype, device, shape=shape).kernel
        block = launcher.launch_config(numel, device.type, module, device, dtype)[0] if numel else None
        torch_ops = eager.compile_body(graph).shown if backend == "eager" and graph.writes else None
        return make_plan(graph, *self.stats, numel, backend, amp=amp, hist_range=self.hist_range, block=block,
                         torch_ops=torch_ops)

    def explain(self, registered: list[tuple[torch.Tensor, int, bool]], amp: bool) -> BackwardPlan:
        """Launches per backward (an upper bound) for the `registered` (tensor, bucket bytes (0: each at its own
        firing), averaged in DDP's buckets) of a hook; amp: its plans unscale."""
        groups: dict[tuple, list] = {}
        for t, bucket_bytes, averaged in registered:
            groups.setdefault((t.device, t.dtype, bucket_bytes, averaged), []).append(t)
        lines, total = [], 0
        for (device, dtype, bucket_bytes, averaged), tensors in groups.items():
            nbytes = sum(t.numel() * t.element_size() for t in tensors)
            backend = self.plan(None, dtype, device, tuple(tensors[0].shape), amp).backend
            torch_ops = "" if backend == "triton" else (f"; backend {backend}: eager torch ops, no kernel is "
                                                         "launched (the count is the Triton backend's)")
            if self.reduces_over_dims:  # planned per shape: a bucket launches each of its kernel sets' passes
                launches, how = self._explain_per_shape(device, dtype, tensors, bucket_bytes, averaged, nbytes, amp)
            else:
                launches, how = self._explain_one_plan(device, dtype, tensors, bucket_bytes, averaged, nbytes, amp)
            total += launches
            lines.append(f"  {device} {str(dtype).removeprefix('torch.')}: {len(tensors)} tensors, "
                         f"{nbytes / 2**20:.2f} MB of gradients, {how}: <= {launches} launches{torch_ops}")
        return BackwardPlan(total, "\n".join([f"fusedhooks backward plan: <= {total} launches per backward"]
                                             + lines))

    def _explain_one_plan(self, device, dtype, tensors, bucket_bytes, averaged, nbytes, amp) -> tuple[int, str]:
        """`explain` of tensors of a body planned once for every shape: (launches, how)."""
        passes = self.plan(1 << 30, dtype, device, None, amp).levels + 1
        if averaged:
            return len(tensors) * passes, (f"in DDP's buckets (averaged), {passes} launch(es) per bucket: at most one "
                                           "per tensor")
        if bucket_bytes:
            buckets = nbytes // bucket_bytes + 1
            return buckets * passes, (f"at most {buckets} end-of-backward bucket(s) of {bucket_bytes / 2**20:g} MB x "
                                      f"{passes} pass(es)")
        launches = sum(self.plan(t.numel(), dtype, device, None, amp).launches for t in tensors)
        return launches, "each processed at its own firing"

    def _explain_per_shape(self, device, dtype, tensors, bucket_bytes, averaged, nbytes, amp) -> tuple[int, str]:
        """`explain` of tensors of a body planned per shape: (launches, how)."""
        plans = [self.plan(None, dtype, device, tuple(t.shape), amp) for t in tensors]
        if averaged or not bucket_bytes:
            where = "in DDP's buckets (averaged), each tensor's passes" if averaged else "each at its own firing"
            return sum(p.launches for p in plans), where
        sets: dict[object, int] = {}  # the kernels a bucket shares (see buckets.process_together) -> their launches
        for t, p in zip(tensors, plans):
            compiled = self.compiled(dtype, device, shape=tuple(t.shape)) if p.backend == "triton" else None
            sets[compiled.kernel if compiled is not None else tuple(t.shape)] = p.launches
        buckets = nbytes // bucket_bytes + 1
        return buckets * sum(sets.values()), (f"at most {buckets} end-of-backward bucket(s) of "
                                              f"{bucket_bytes / 2**20:g} MB x {sum(sets.values())} launch(es) of "
                                              f"{len(sets)} kernel set(s) (planned per shape)")

    def keys(self) -> list[tuple]:
        """What is compiled so far: (dtype, device, shard, shape) of each, (dtype, "autograd", shape) of the
        reference plans that autograd records."""
        return list(self._compiled)

    def graph(self, dtype: torch.dtype, shape: tuple | None = None) -> Graph:
        """The body lowered for gradients of `dtype` (and `shape`, for a body that reduces over dimensions)."""
        if not self.reduces_over_dims:
            shape = None
        elif shape is None:
            raise ValueError(f"{self.name} reduces over dimensions: its plan depends on the gradient's shape; "
                             "pass shape=")
        key = dtype if shape is None else (dtype, tuple(shape))
        graph = self._graphs.get(key)
        if graph is None:
            body = self.body_for(shape)
            graph, _ = lower(body, dtype) if shape is None else lower(body, dtype, tuple(shape))
            self._graphs[key] = graph
        return graph

    def compiled(self, dtype: torch.dtype, device: torch.device, shard: bool = False,
                 shape: tuple | None = None) -> Compiled:
        """The plan and kernels for gradients of `dtype` on `device` (compiled on first use, then cached).

        shard: for one rank's shard of an FSDP2 gradient: the statistics recorded are the partials the ranks'
        rows are merged from (`shard_stats`), not the hook's own. shape: the gradient's, for a body that reduces
        over dimensions (ignored otherwise)."""
        key = (dtype, device, shard, tuple(shape) if self.reduces_over_dims and shape is not None else None)
        compiled = self._compiled.get(key)
        if compiled is not None:
            return compiled
        compiled = self._compile(dtype, device, shard, key[3])
        self._compiled[key] = compiled
        return compiled

    def compiled_for(self, grad: torch.Tensor) -> Compiled:
        """`compiled` for a (plain, unsharded) gradient, found by its dtype and device index: the per-firing
        lookup (building the gradient's torch.device is dearer than the rest of it)."""
        key = (grad.dtype, grad.is_cuda, grad.get_device())
        if self.reduces_over_dims:
            key += (grad.shape,)
        compiled = self._compiled_by_index.get(key)
        if compiled is None:
            compiled = self._compiled_by_index[key] = self.compiled(grad.dtype, grad.device, shape=grad.shape)
        return compiled

    def _compile(self, dtype: torch.dtype, device: torch.device, shard: bool, shape: tuple | None) -> Compiled:
        for i, s in enumerate(self.scalars):
            if s.device != device and not (device.type == "cpu" and s.device.type == "cpu"):
                raise ValueError(f"{self.name}: closed-over tensor {i} is on {s.device} but the gradient is on "
                                 f"{device}; move it to {device} (the kernel reads it there, with no copy)")
        if self.amp and dtype == torch.float16:
            raise ValueError(f"{self.name}: scaler= unscales the gradients as GradScaler.unscale_ does, which refuses "
                             "float16 gradients (torch: \"Attempting to unscale FP16 gradients.\"): keep the "
                             "parameters in float32 and run the forward under torch.autocast, as the AMP recipe does")
        graph = self.graph(dtype, shape)
        backend = self.backend_for(device, graph)
        stats, input_stats = self.shard_stats if shard else self.stats
        plan = make_plan(graph, stats, input_stats, backend=backend, amp=self.amp and not shard,
                         hist_range=self.hist_range)
        if backend == "triton":
            return Compiled(plan, generate.load(*generate.generate_with_spec(plan, device.type)))
        return Compiled(plan, eager.compile_body(plan.graph) if backend == "eager" else None)

    def backend_for(self, device: torch.device, graph: Graph, warn: bool = True) -> str:
        """launcher.choose_backend, except for a body reducing over dimensions that the Triton kernels do not compile
        (see dims.analyse): with backend "auto" it runs as eager torch ops (the reference backend; warned once),
        "triton" is refused."""
        backend = launcher.choose_backend(device, self.backend)
        if backend != "triton" or not graph.reduces_over_dims:
            return backend
        try:
            dims.analyse(graph)
            return backend
        except dims.Unsupported as e:
            reason = str(e)
        if (self.backend or config.backend()) == "triton":
            raise CompileError(f"{self.name} has {reason}, which the Triton backend does not compile; use "
                               "backend='reference' (eager torch ops, on any device) or, on CPU, backend='eager'")
        if warn and not self._dims_warned:
            self._dims_warned = True
            warnings.warn(f"fusedhooks: {self.name} has {reason}, which is not compiled into Triton kernels: it "
                          "runs as eager torch ops (backend='reference'), with the same results; pass "
                          "backend='reference' to silence this warning", stacklevel=7)  # at register()'s caller
        return "reference"

    def compiled_for_autograd(self, dtype: torch.dtype, shape: tuple | None = None) -> Compiled:
        """The reference plan: eager torch ops, recorded by autograd when `.grad` requires grad."""
        key = (dtype, "autograd", tuple(shape) if self.reduces_over_dims else None)
        compiled = self._compiled.get(key)
        if compiled is None:
            plan = make_plan(self.graph(dtype, shape), *self.stats, backend="reference", amp=self.amp,
                             hist_range=self.hist_range)
            compiled = self._compiled[key] = Compiled(plan, None)
        return compiled

    def check_shape(self, name: str, t: torch.Tensor) -> None:
        """Refuse a gradient `t` (of the tensor `name`) the body does not fit: a reduction over dimensions it lacks,
        a result of another shape than the gradient's (CompileError): torch refuses a gradient hook that changes the
        size ("hook ... has changed the size of value"), and writing it into `.grad` would broadcast it silently."""
        try:
            _, result_shape = lower(self.body_for(t.shape), t.dtype, tuple(t.shape))
        except CompileError as e:
            if not self.reduces_over_dims:
                raise
            raise CompileError(f"{self.name} does not fit {name} (shape {tuple(t.shape)}): {e}") from None
        if tuple(result_shape) != tuple(t.shape):
            try:
                broadcasts = torch.broadcast_shapes(result_shape, t.shape) == t.shape
            except RuntimeError:
                broadcasts = False
            how = "would be broadcast into it, silently" if broadcasts else "does not broadcast to it either"
            raise CompileError(f"{self.name}: the body's result has shape {tuple(result_shape)}, the gradient of "
                               f"{name} has shape {tuple(t.shape)}: a gradient hook returns a tensor of the "
                               f"gradient's shape, as torch's hooks must (the result {how}). To write a reduced "
                               "value into every element on purpose, return it on the gradient's shape "
                               "(`torch.zeros_like(grad) + value`)")


class Workspaces:
    """The scratch a hook's kernels write, one per device and thread (concurrent backwards in other threads use
    their own)."""

    def __init__(self):
        self._workspaces: dict[tuple, launcher.Workspace] = {}
        self._workspaces_by_index: dict[tuple, launcher.Workspace] = {}  # (is_cuda, device index, thread) -> one

    def for_grad(self, grad: torch.Tensor) -> launcher.Workspace:
        """`workspace(grad.device)`, found by the device index (the per-firing lookup)."""
        key = (grad.is_cuda, grad.get_device(), threading.get_ident())
        ws = self._workspaces_by_index.get(key)
        if ws is None:
            if len(self._workspaces_by_index) > 64:
                self._workspaces_by_index.clear()
            ws = self._workspaces_by_index[key] = self.workspace(grad.device)
        return ws

    def workspace(self, device: torch.device) -> launcher.Workspace:
        """This thread's scratch on `device`."""
        key = (device, threading.get_ident())
        ws = self._workspaces.get(key)
        if ws is None:
            if len(self._workspaces) > 64:  # threads come and go: keep the cache small
                self._workspaces.clear()
            ws = self._workspaces[key] = launcher.Workspace(device)
        return ws
