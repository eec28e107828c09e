"""One block's partial statistics (`kernels.stats.store_partials`), the kernel-level piece every statistics pass runs:
the full-block path (no mask) against the masked one, and each partial against a float64 reference."""

import pytest
import torch
import triton
import triton.language as tl

import fusedhooks as fh
from fusedhooks import STAT_NAMES
from fusedhooks.kernels.stats import N_PARTIALS, store_partials

from helpers import FLOAT_DTYPES, check_stats
from test_ops import special_values


@triton.jit
def partials_kernel(x_ptr,  # *fp32/fp64 [n]: one block's values
                    out_ptr,  # *fp64 [N_PARTIALS]: its partials
                    n,  # valid lanes (<= BLOCK)
                    FULL: tl.constexpr,  # store_partials' path without the mask (n == BLOCK)
                    BLOCK: tl.constexpr):  # lanes of the block
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    store_partials(x, mask, n.to(tl.int64), out_ptr, True, True, True, True, True, True, FULL)


def partials(x: torch.Tensor, block: int, full: bool) -> torch.Tensor:
    """fp64 [N_PARTIALS]: sum, sumsq, M2, min, max, nan, inf, zeros, M3, M4 (then padding) of `x` in one block."""
    out = torch.zeros(N_PARTIALS.value, dtype=torch.float64)
    partials_kernel[(1,)](x, out, x.numel(), FULL=full, BLOCK=block)
    return out


def blocks(dtype):
    """Blocks of every kind: ordinary, special values, |mean|/std = 1e3, extreme magnitudes, all NaN, all Inf, all
    zeros."""
    gen = torch.Generator().manual_seed(0)
    return {
        "randn": torch.randn(256, generator=gen, dtype=dtype),
        "special": special_values(256, dtype),
        "mean/std=1e3": (1e3 + torch.randn(256, generator=gen, dtype=torch.float64)).to(dtype),
        "tiny": (torch.randn(256, generator=gen, dtype=torch.float64) * 1e-30).to(dtype),
        "huge": (torch.randn(256, generator=gen, dtype=torch.float64) * 1e30).to(dtype),
        "one inf": torch.cat([torch.full((1,), float("inf"), dtype=dtype),
                              torch.randn(255, generator=gen, dtype=dtype)]),
        "all nan": torch.full((256,), float("nan"), dtype=dtype),
        "all inf": torch.full((256,), float("-inf"), dtype=dtype),
        "zeros": torch.zeros(256, dtype=dtype),
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("kind", list(blocks(torch.float32)))
def test_full_block_path_has_the_masked_paths_bits(kind, dtype):
    """Every program but a launch's last takes the path without the mask; a block of valid lanes has the same
    partials, bit for bit, through either (the same operations on the same values)."""
    x = blocks(dtype)[kind]
    full, masked = partials(x, 256, True), partials(x, 256, False)
    assert torch.equal(full.view(torch.int64), masked.view(torch.int64)), (full, masked)


@pytest.mark.parametrize("n", [1, 97, 255, 256])
@pytest.mark.parametrize("kind", list(blocks(torch.float32)))
def test_partials_match_float64(kind, n):
    """Each partial of an fp32 block against float64: counts, min and max exact; sum, M2 and the sum of squares
    (taken from the deviations' sums: within about 26 fp32 ulps, see store_partials) within 64 ulps."""
    x = blocks(torch.float32)[kind][:n].contiguous()
    got = partials(x, 256, n == 256)
    x64 = x.double()
    nan, inf = int(x64.isnan().sum()), int(x64.isinf().sum())
    assert got[5].item() == nan and got[6].item() == inf and got[7].item() == int((x64 == 0).sum())
    if nan:
        assert got[1].isnan()
        return
    assert got[3].item() == x64.min().item() and got[4].item() == x64.max().item()
    sumsq = (x64 * x64).sum()
    if inf:
        assert got[1].item() == float("inf")
        return
    rtol = 64 * 2.0 ** -24
    assert abs(got[0] - x64.sum()) <= rtol * x64.abs().sum()
    assert abs(got[1] - sumsq) <= rtol * sumsq
    m2 = ((x64 - x64.mean()) ** 2).sum()
    assert abs(got[2] - m2) <= rtol * m2 + rtol * 2.0 ** -24 * sumsq


@pytest.mark.parametrize("nan,inf", [(4096, 0), (0, 4096), (2048, 2048), (0, 1), (4095, 1), (1, 4095), (1, 0),
                                     (0, 0)])
def test_nan_and_inf_counts_share_one_sum_exactly(nan, inf):
    """NaNs and Infs are counted in one fp32 sum, BLOCK * inf - nan, exact up to BLOCK = 4096 (2**24): blocks of 4096
    lanes at the ends of the range (all NaN sums to -BLOCK, one Inf alone to +BLOCK), the rest zeros."""
    x = torch.zeros(4096)
    x[:nan] = float("nan")
    x[nan:nan + inf] = float("-inf")
    got = partials(x, 4096, True)
    assert (got[5].item(), got[6].item(), got[7].item()) == (nan, inf, 4096 - nan - inf)


@pytest.mark.parametrize("values", ["finite", "special"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_full_blocks_launch_has_the_masked_launchs_statistics(dtype, values, monkeypatch):
    """A gradient of 3 blocks launches with FULL_BLOCKS (no mask in its statistics) at its own firing, and without it
    in a bucket beside a 5-element gradient: its statistics are the same values both ways (NaN where NaN), and
    DESIGN's against float64."""
    monkeypatch.setenv("FUSEDHOOKS_BLOCK", "128")
    names = [*STAT_NAMES, "skew", "kurtosis"]
    grad = (100.0 + torch.randn(3 * 128, generator=torch.Generator().manual_seed(0))).to(dtype)
    if values == "special":
        grad = special_values(3 * 128, dtype)
    readings = []
    for bucket_mb in (0, 25):
        p = torch.zeros(3 * 128, dtype=dtype, requires_grad=True)
        q = torch.zeros(5, dtype=dtype, requires_grad=True)
        hook = fh.grad_hook(lambda g: g * 1.0, stats=names, input_stats="all", backend="triton")
        with hook.register([p, q], bucket_mb=bucket_mb):
            ((p * grad).sum() + (q * torch.ones(5, dtype=dtype)).sum()).backward()
        readings.append(hook.stats.read()["param0"])
    alone, bucketed = readings
    assert alone.keys() == bucketed.keys()
    assert all(alone[k] == bucketed[k] or (alone[k] != alone[k] and bucketed[k] != bucketed[k]) for k in alone), (
        alone, bucketed)
    check_stats(alone, grad, STAT_NAMES)
