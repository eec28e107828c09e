"""A program's block in tiles (`KernelWriter.tiled`; kernels.stats.stats_first/stats_add/stats_store): the statistics of
a gradient whose later tiles differ from its first (a larger value that rescales the running sums, a first tile whose
mean is far from the rest, a NaN or an Inf in a later tile only, exact zeros) against float64, and one gradient's
statistics the same whatever the tile size, bucketed or not."""

import pytest
import torch

import fusedhooks as fh
from fusedhooks import STAT_NAMES
from fusedhooks.codegen.kernel_writer import HISTOGRAM_TILE_ELEMENTS, TILE_ELEMENTS
from fusedhooks.runtime import launcher

from helpers import FLOAT_DTYPES, check_stats

NAMES = [*STAT_NAMES, "skew", "kurtosis"]
#: tiles of the default BLOCK (fp32): the cases below put their changes past the first tile
TILE = TILE_ELEMENTS[torch.float32]


def _gradients(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Gradients of 3 blocks of 4 tiles each (FUSEDHOOKS_BLOCK = 4 tiles), each block built so that its later tiles
    differ from its first."""
    gen = torch.Generator().manual_seed(0)
    tile = TILE_ELEMENTS[dtype]
    n = 12 * tile

    def randn(k=n):
        return torch.randn(k, generator=gen, dtype=torch.float64)

    big = torch.finfo(dtype).max / 4 ** 0.5 / n if dtype != torch.float64 else 1e150
    small = torch.finfo(dtype).tiny * 2 ** 10 if dtype != torch.float64 else 1e-150
    later_larger = randn() * small  # the running sums rescaled at the second tile of each block...
    later_larger[tile::4 * tile] = big  # ...by far
    first_apart = randn() + 1e3  # |mean| / std = 1e3, but the first tile of each block 10 std away
    first_apart.view(3, 4 * tile)[:, :tile] += 10.0
    late_nan_inf = randn()
    late_nan_inf[3 * tile + 5] = float("nan")
    late_nan_inf[7 * tile + 1] = float("inf")
    late_nan_inf[11 * tile - 1] = float("-inf")
    zeros = randn()
    zeros[::3] = 0.0
    cases = {"later tile larger": later_larger, "first tile apart": first_apart, "nan and inf in a later tile":
             late_nan_inf, "zeros": zeros}
    return {k: v.to(dtype) for k, v in cases.items()}


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("case", list(_gradients(torch.float32)))
def test_statistics_over_tiles_match_float64(case, dtype, monkeypatch):
    """Every statistic of a gradient whose blocks' later tiles differ from their first, within DESIGN's tolerances
    of float64 (std within 1e-3 where |mean| / std = 1e3), output and input statistics alike, on the default tile."""
    monkeypatch.setenv("FUSEDHOOKS_BLOCK", str(4 * TILE_ELEMENTS[dtype]))
    grad = _gradients(dtype)[case]
    hook = fh.grad_hook(lambda g: g * 1.0, stats=NAMES, input_stats="all", backend="triton")
    p = torch.zeros(grad.numel(), dtype=dtype, requires_grad=True)
    with hook.register(p):
        (p * grad).sum().backward()
    got = hook.stats.read()["param0"]
    names = STAT_NAMES if case != "first tile apart" else [n for n in STAT_NAMES if n not in ("var", "std")]
    check_stats(got, grad, names)
    check_stats(got, grad, names, prefix="input.")
    if case == "first tile apart":
        expected = grad.double().std().item()
        assert abs(got["std"] - expected) <= 1e-3 * expected, (got["std"], expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d).removeprefix("torch."))
def test_statistics_do_not_depend_on_bucketing(dtype, monkeypatch):
    """One BLOCK, tiled the same way at its own firing and in a bucket beside another gradient: the same bits."""
    monkeypatch.setenv("FUSEDHOOKS_BLOCK", str(4 * TILE_ELEMENTS[dtype]))
    grad = _gradients(dtype)["first tile apart"][: 9 * TILE_ELEMENTS[dtype] + 7]
    readings = []
    for bucket_mb in (0, 25):
        p = torch.zeros(grad.numel(), dtype=dtype, requires_grad=True)
        q = torch.zeros(5, dtype=dtype, requires_grad=True)
        hook = fh.grad_hook(lambda g: g * 1.0, stats=NAMES, backend="triton")
        with hook.register([p, q], bucket_mb=bucket_mb):
            ((p * grad).sum() + q.sum()).backward()
        readings.append(hook.stats.read()["param0"])
    assert readings[0] == readings[1] or all(
        a == b or (a != a and b != b) for a, b in zip(readings[0].values(), readings[1].values())), readings


def test_default_block_steps_through_several_tiles():
    """The default BLOCK holds several tiles of every dtype (the statistics are reduced once per block, not per
    tile), and a whole number of them."""
    for dtype, tile in TILE_ELEMENTS.items():
        block = launcher.default_block(dtype)
        assert block % tile == 0 and block // tile >= 8, (dtype, block, tile)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_a_kernel_recording_a_histogram_steps_through_at_most_the_histogram_tile(dtype):
    """16-bit kernels step through 4,096 elements (two 128-bit accesses a thread), but those recording a histogram
    through 2,048 (the registers of their per-tile histogram); the generated source says which."""
    plain = fh.grad_hook(stats=("norm",)).source(dtype)
    histogram = fh.grad_hook(stats=("norm", "hist")).source(dtype)
    tile = TILE_ELEMENTS[dtype]
    assert f"TILE: tl.constexpr = min(BLOCK, {tile})" in plain
    assert f"TILE: tl.constexpr = min(BLOCK, {min(tile, HISTOGRAM_TILE_ELEMENTS)})" in histogram
    assert (tile, min(tile, HISTOGRAM_TILE_ELEMENTS)) == ((4096, 2048) if dtype.itemsize == 2 else (tile, tile))
