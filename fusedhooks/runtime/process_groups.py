"""Process groups and DTensor placements, as a firing needs them: the world size, whether a model is DDP, the ranks
across which a sharded (FSDP2, tensor parallel, both) parameter's shards are spread, partial (Partial(sum)) gradients
reduced before the body, and the norm of a sharded parameter's whole gradient."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch


class LocalGradientWarning(UserWarning):
    """A hook in a process group of several ranks processes each rank's own (under DDP: un-averaged) gradient."""


def dist_module():
    """torch.distributed, or None where this build of torch has none."""
    return torch.distributed if torch.distributed.is_available() else None


def all_gather_single(dist):
    """torch.distributed's all-gather into one tensor: `all_gather_single` (torch >= 2.13, which deprecates
    `all_gather_into_tensor` with a FutureWarning on every call), else `all_gather_into_tensor`."""
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def world_size() -> int | None:
    """The default process group's size, or None when there is none (yet)."""
    dist = dist_module()
    if dist is None or not dist.is_initialized():
        return None
    return dist.get_world_size()


def is_ddp(target) -> bool:
    dist = dist_module()
    return dist is not None and isinstance(target, torch.nn.parallel.DistributedDataParallel)


class ShardSpread(NamedTuple):
    """The ranks over which a DTensor parameter's shards are spread: the mesh dimensions `dims` of `mesh` with a Shard
    placement (FSDP2's, tensor parallelism's, both: FSDP2 + TP; `_StridedShard` too). Along the mesh's other
    dimensions (Replicate: HSDP's replicas, a Replicate parameter under TP) the ranks hold copies."""

    mesh: object
    dims: tuple[int, ...]


def _shards() -> tuple[type, ...]:
    """The placements that shard a tensor dim `.dim`: Shard, and FSDP2 + TP's _StridedShard (not a Shard in torch
    2.13) where torch has it."""
    from torch.distributed.tensor import Shard

    try:
        from torch.distributed.tensor.placement_types import _StridedShard
    except ImportError:
        return (Shard,)
    return (Shard, _StridedShard)


def shard_spread(name: str, t: torch.Tensor) -> ShardSpread | None:
    """Where the shards of `t` (a DTensor parameter) are spread (None: every rank holds it whole); refuses placements
    other than Shard, _StridedShard and Replicate."""
    from torch.distributed.tensor import Replicate

    shards = _shards()
    others = [p for p in t.placements if not isinstance(p, (*shards, Replicate))]
    if others:
        raise ValueError(f"{name}: a DTensor placed as {tuple(t.placements)}; fusedhooks merges the statistics "
                         "of parameters sharded along mesh dimensions (Shard, _StridedShard: FSDP2, tensor "
                         "parallelism, both) and copied along the others (Replicate); other placements are not "
                         "supported")
    dims = tuple(i for i, p in enumerate(t.placements) if isinstance(p, shards))
    return ShardSpread(t.device_mesh, dims) if dims else None


def spread_ranks(spread: ShardSpread) -> list[int]:
    """The global ranks holding the shards of one copy of a parameter spread as `spread`, this rank's among them: the
    ranks of the mesh at this rank's coordinates along its other dimensions, in mesh order."""
    coordinate = spread.mesh.get_coordinate()
    index = tuple(slice(None) if d in spread.dims else coordinate[d] for d in range(spread.mesh.ndim))
    return spread.mesh.mesh[index].reshape(-1).tolist()


def covers_world(mesh) -> bool:
    """Is every rank of the default process group in `mesh` (one all-gather over it reaches every mesh rank)?"""
    return mesh.size() == world_size()


def partial_dims(name: str, param: torch.Tensor, grad: torch.Tensor) -> list[int]:
    """The mesh dimensions along which the DTensor `grad` (of `param`) is a partial sum: each rank holds a part of
    the gradient whose sum over those ranks is the gradient (a norm layer under tensor parallelism's
    SequenceParallel: the parameter is Replicate, its gradient Partial(sum) until torch reduces it, later). Refuses
    partial reductions other than a sum, and a partial dimension along which the parameter is not replicated."""
    from torch.distributed.tensor import Partial, Replicate

    dims = [i for i, p in enumerate(grad.placements) if isinstance(p, Partial)]
    for i in dims:
        op = grad.placements[i].reduce_op
        if op != "sum" or not isinstance(param.placements[i], Replicate):
            raise ValueError(f"{name}: its gradient is placed as {tuple(grad.placements)} and the parameter as "
                             f"{tuple(param.placements)}; fusedhooks processes partial gradients that are a sum "
                             "over ranks holding the whole parameter (Partial(sum) where the parameter is Replicate: "
                             "it reduces them first). Register the hook on the other parameters, or make this "
                             "gradient whole before the hook fires")
    return dims


def reduce_partial(local: torch.Tensor, mesh, dims: list[int]) -> torch.Tensor:
    """The sum over the ranks of mesh dimensions `dims` of `mesh` of a Partial(sum) DTensor's local tensors `local` (a
    new plain tensor, the same on every rank): one all-reduce per dimension, which torch would otherwise run later
    (when the optimizer or clip_grad_norm_ reads the gradient). Every rank of those dimensions must call it."""
    dist = dist_module()
    whole = local.clone()
    for i in dims:
        dist.all_reduce(whole, group=mesh.get_group(i))
    return whole


def holds_reduced(mesh, dims: list[int]) -> bool:
    """Does this rank hold the reduced gradient of a Partial(sum) DTensor on `mesh` (the first rank along every
    partial dimension `dims`), the other ranks holding zeros: the sum over the ranks is then the value, exactly?"""
    coordinate = mesh.get_coordinate()
    return all(coordinate[i] == 0 for i in dims)


def sharded_dims(t: torch.Tensor) -> list[int]:
    """The tensor dims along which a DTensor is sharded (its Shard placements' dims, in order, without repeats)."""
    shards = _shards()
    return sorted({p.dim % t.ndim for p in t.placements if isinstance(p, shards)})


def whole_norm(name: str, param: torch.Tensor, norm_type: float) -> torch.Tensor:
    """The `norm_type` norm of a sharded parameter's whole gradient (float64, 0-dim): this rank's part (of a partial
    gradient, reduced first: `reduce_partial`), then one all-reduce across the shards per sharded mesh dimension
    (every rank must call it). An empty shard contributes nothing."""
    dist = dist_module()
    grad = param.grad
    partial = partial_dims(name, param, grad)
    local = (reduce_partial(grad._local_tensor, grad.device_mesh, partial) if partial else grad._local_tensor)
    local = local.detach().reshape(-1).double()
    zero = torch.zeros((), dtype=torch.float64, device=local.device)
    if norm_type == math.inf:
        value, op = (local.abs().amax() if local.numel() else zero), dist.ReduceOp.MAX
    elif norm_type == -math.inf:
        value = local.abs().amin() if local.numel() else zero + math.inf
        op = dist.ReduceOp.MIN
    else:
        value, op = local.abs().pow(norm_type).sum(), dist.ReduceOp.SUM
    spread = shard_spread(name, param)
    for d in spread.dims if spread is not None else ():  # over the shards of every sharded mesh dimension
        dist.all_reduce(value, op=op, group=spread.mesh.get_group(d))
    return value if norm_type in (math.inf, -math.inf) else value.pow(1.0 / norm_type)
