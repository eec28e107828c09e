"""DDP and FSDP2 for real: 2 and 3 CPU processes with gloo and the Triton interpreter (NCCL on 2 GPUs when
present). Every rank checks its own results (tests/dist_workers.py); a rank that fails or hangs fails the test.
"""

import math
import socket
import time

import dist_workers
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")

#: seconds a whole spawned run may take (start-up included) before it counts as hung
TIMEOUT = 150


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(fn, world: int, backend: str = "gloo", timeout: float = TIMEOUT) -> None:
    """Run fn(rank, world, device) on `world` fresh processes; fail on any rank's error or past `timeout`."""
    ctx = mp.start_processes(dist_workers.init_and_run, args=(fn, world, _free_port(), backend, ()), nprocs=world,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                pytest.fail(f"{fn.__name__} on {world} ranks did not finish within {timeout} s (a hang)")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()


@pytest.mark.slow
def test_ddp_two_ranks():
    """register(ddp_model): the averaged gradient, both bucket-view settings, no_sync, several buckets,
    clip_grad_norm_, AGC (a body planned per shape); a hook on the wrapped module: local gradients and one warning;
    refusals."""
    spawn(dist_workers.ddp_all, 2)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3], ids=["2-ranks", "3-ranks-empty-shard"])
def test_fsdp2(world):
    spawn(dist_workers.fsdp, world)


@pytest.mark.slow
def test_zclip_ddp_fsdp2():
    """fh.zclip on DDP and FSDP2 (gloo, 2 ranks): ZClip's rule on the averaged gradients, one state on every rank."""
    spawn(dist_workers.zclip_distributed, 2)


gpus = pytest.mark.skipif(torch.cuda.device_count() < 2 or not dist.is_nccl_available(), reason="needs 2 GPUs")


@pytest.mark.gpu
@gpus
def test_ddp_nccl():
    spawn(dist_workers.ddp_all, 2, backend="nccl")


@pytest.mark.gpu
@gpus
def test_fsdp2_nccl():
    spawn(dist_workers.fsdp, 2, backend="nccl")


@pytest.mark.gpu
@gpus
@pytest.mark.parametrize("worker", ["tensor_parallel", "fsdp_tp_1x2", "fsdp_tp_2x1"])
def test_tensor_parallel_nccl(worker):
    """Tensor parallelism with a SequenceParallel norm, FSDP2 + TP and HSDP on 2 GPUs with NCCL."""
    spawn(getattr(dist_workers, worker), 2, backend="nccl")


# --- the merge of shard partials, in one process: every statistic of the whole from the shards' kernels ------

ALL = ("count", "sum", "mean", "sumsq", "norm", "var", "std", "min", "max", "absmax", "nan", "inf", "zeros")


def _merged_stats(hook, whole: torch.Tensor, ranks: int) -> dict:
    """Process `whole` as `ranks` FSDP2 shards (torch.chunk along dim 0, empty past the last chunk) with the
    shard kernels, then merge their partial rows as the ranks would after their all-gather."""
    from fusedhooks.runtime import launcher as runtime
    from fusedhooks.stats import merge as stats_merge

    compiled = hook.compiled(whole.dtype, whole.device, shard=True)
    partials = hook._shards.partials
    rows = []
    for rank in range(ranks):
        chunks = torch.chunk(whole, ranks, dim=0)
        shard = (chunks[rank] if rank < len(chunks) else whole.new_empty((0,) + whole.shape[1:])).clone()
        row = torch.full((len(partials.slot_names),), float("nan"), dtype=torch.float64)
        runtime.fire(compiled.plan, compiled.kernel, shard, shard, hook.scalars, row, hook.workspace(whole.device))
        rows.append(row)
    parts = torch.stack(rows).view(ranks, 1, -1)
    merged = stats_merge.merge_partials(parts, partials.slot_names, hook.stats.slot_names)[0]
    out = {}
    for name, value in zip(hook.stats.slot_names, merged.tolist()):
        if name.endswith("hist"):
            out.setdefault(name, []).append(int(value))
        else:
            out[name] = value
    return out


def _special(n: int, dtype) -> torch.Tensor:
    x = torch.randn(n, 3, generator=torch.Generator().manual_seed(n)) * 5
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("rows", [0, 1, 2, 7, 1500], ids=lambda r: f"rows{r}")
@pytest.mark.parametrize("ranks", [1, 2, 3, 8], ids=lambda r: f"ranks{r}")
def test_merged_shard_stats_equal_whole(backend, dtype, rows, ranks):
    """Stats of the whole parameter from shard partials (uneven and empty shards): counts, min/max/absmax and
    hist exact, sums, norms and var/std within the fp64-merge tolerance of a float64 reference."""
    from fusedhooks.runtime.reference import histogram

    from helpers import check_stats

    hook = __import__("fusedhooks").grad_hook(stats=ALL + ("hist",), backend=backend)
    whole = _special(rows, dtype)
    got = _merged_stats(hook, whole, ranks)
    check_stats(got | {k: int(got[k]) for k in ("count", "nan", "inf", "zeros") if got[k] == got[k]}, whole, ALL)
    assert got["hist"] == [int(v) for v in histogram(whole, hook.hist_range).tolist()]


@pytest.mark.parametrize("special", ["nan", "inf", "-inf", "inf-and-ninf"])
def test_merged_shard_stats_non_finite(backend, special):
    """A NaN or Inf in one shard gives the whole parameter's torch semantics (NaN min/max/var, Inf norm...)."""
    from helpers import check_stats

    hook = __import__("fusedhooks").grad_hook(stats=ALL, backend=backend)
    whole = _special(9, torch.float32)
    values = {"nan": [math.nan], "inf": [math.inf], "-inf": [-math.inf], "inf-and-ninf": [math.inf, -math.inf]}
    for k, v in enumerate(values[special]):
        whole[4 * k + 1, 2] = v
    got = _merged_stats(hook, whole, 3)
    check_stats(got | {k: int(got[k]) for k in ("count", "nan", "inf", "zeros")}, whole, ALL)


@pytest.mark.slow
def test_nested_backwards_under_ddp_and_fsdp2():
    """Reentrant activation checkpointing whose nested backward fires first, under DDP (the averaged gradient; the
    local one with static_graph=True and accumulation_steps=2) and FSDP2: eager's gradients, whole-parameter
    statistics, no stale row (gloo, 2 ranks)."""
    spawn(dist_workers.nested_backwards, 2)


@pytest.mark.slow
def test_tensor_parallel_with_a_sequence_parallel_norm():
    """parallelize_module as torchtitan lays it out (SequenceParallel norm, Colwise, Rowwise) on 2 gloo ranks: the
    norm's Partial(sum) gradients are reduced before the body; gradients, statistics and fh.clip_grad_norm_ equal the
    unsharded eager oracle on every rank."""
    spawn(dist_workers.tensor_parallel, 2)


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["1x2", "2x1"])
def test_fsdp2_with_tensor_parallel(mesh):
    """torchtitan's FSDP2 + TP (parallelize_module on tp, then fully_shard on dp; a SequenceParallel norm) on a 2-rank
    (dp, tp) mesh, and HSDP on the same mesh: gradients, statistics (one collective per backward) and
    fh.clip_grad_norm_ equal the unsharded eager oracle on every rank."""
    spawn(getattr(dist_workers, f"fsdp_tp_{mesh}"), 2)


@pytest.mark.slow
def test_fsdp2_with_tensor_parallel_on_four_ranks():
    """The same on a (2, 2) mesh of 4 gloo ranks: weights sharded along both mesh dimensions."""
    spawn(dist_workers.fsdp_tp_2x2, 4, timeout=240)
