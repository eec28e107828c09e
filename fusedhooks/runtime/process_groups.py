"""Process groups and DTensor placements, as a firing needs them: the world size, whether a model is DDP, the group
across which a sharded (FSDP2) parameter's shards are spread, partial (Partial(sum)) gradients reduced before the body,
and the norm of a sharded parameter's whole gradient."""

from __future__ import annotations

import math

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


def shard_group(name: str, t: torch.Tensor):
    """The process group across which `t`'s (a DTensor's) shards are spread: its mesh dimension of Shard
    placement (other dimensions must be Replicate: HSDP keeps whole copies there)."""
    from torch.distributed.tensor import Replicate, Shard

    shard_dims = [i for i, p in enumerate(t.placements) if isinstance(p, Shard)]
    others = [p for p in t.placements if not isinstance(p, (Shard, Replicate))]
    if others or len(shard_dims) > 1:
        raise ValueError(f"{name}: a DTensor placed as {tuple(t.placements)}; fusedhooks merges the statistics "
                         "of parameters sharded along one mesh dimension (FSDP2's Shard, HSDP's Replicate + "
                         "Shard); other placements are not supported")
    if not shard_dims:
        return None
    return t.device_mesh.get_group(shard_dims[0])


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


def shard_dim(t: torch.Tensor) -> int | None:
    """The tensor dim along which a DTensor is sharded (its Shard placement; see shard_group), None if none."""
    from torch.distributed.tensor import Shard

    return next((p.dim % t.ndim for p in t.placements if isinstance(p, Shard)), None)


def whole_norm(name: str, param: torch.Tensor, norm_type: float) -> torch.Tensor:
    """The `norm_type` norm of a sharded parameter's whole gradient (float64, 0-dim): this rank's part (of a partial
    gradient, reduced first: `reduce_partial`), then one all-reduce across the shards (every rank must call it). An
    empty shard contributes nothing."""
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
    group = shard_group(name, param)
    if group is not None:
        dist.all_reduce(value, op=op, group=group)
    return value if norm_type in (math.inf, -math.inf) else value.pow(1.0 / norm_type)
