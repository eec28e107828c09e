"""A program's block in tiles (`KernelWriter.tiled`; kernels.stats.stats_first/stats_add/stats_store): the statistics of
a gradient whose later tiles differ from its first (a larger value that rescales the running sums, a first tile whose
mean is far from the rest, a NaN or an Inf in a later tile only, exact zeros) against float64, and one gradient's
statistics the same whatever the tile size, bucketed or not."""

import pytest
import torch

import fusedhooks as fh
from fusedhooks import STAT_NAMES
from fusedhooks.codegen.kernel_writer import NARROW_TILE_ELEMENTS, TILE_ELEMENTS
from fusedhooks.runtime import launcher

from helpers import FLOAT_DTYPES, assert_same_values, check_stats

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


def _tiles(source: str) -> dict[str, int]:
    """kernel name -> the elements of its step over a block (its `TILE: tl.constexpr = min(BLOCK, N)` line)."""
    tiles, kernel = {}, None
    for line in source.splitlines():
        if line.startswith("def "):
            kernel = line[4:line.index("(")]
        elif "TILE: tl.constexpr = min(BLOCK, " in line:
            tiles[kernel] = int(line.split("min(BLOCK, ")[1].split(")")[0])
    return tiles


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_16_bit_kernels_keeping_running_sums_without_a_histogram_step_through_the_wide_tile(dtype):
    """16-bit kernels keeping running sums over their tiles (statistics, whole-tensor reductions) step through 4,096
    elements (two 128-bit accesses a thread: a tile's fixed work spread over twice the elements); those recording a
    histogram (the registers of their per-tile histogram) or keeping no running sums (nothing per tile to spread)
    through 2,048; fp32 and fp64 through their one tile. The generated source says which, kernel by kernel."""
    wide, narrow = TILE_ELEMENTS[dtype], min(TILE_ELEMENTS[dtype], NARROW_TILE_ELEMENTS)
    assert (wide, narrow) == ((4096, 2048) if dtype.itemsize == 2 else (wide, wide))

    def tiles(**kwargs):
        return _tiles(fh.grad_hook(**kwargs).source(dtype))

    assert tiles(stats=("norm",)) == {"fused_hook": wide, "fused_hook_multi": wide}
    assert set(tiles(stats=("norm", "hist")).values()) == {narrow}
    assert set(tiles(fn=lambda g: g.clamp(-1.0, 1.0) * 0.5).values()) == {narrow}
    normalise = tiles(fn=lambda g: g / g.norm())
    assert normalise["reduce_level1"] == normalise["fused_hook_single"] == wide   # the norm's running sums
    assert normalise["fused_hook"] == normalise["fused_hook_multi"] == narrow     # the elementwise pass after it


@pytest.mark.parametrize("with_inf", [False, True], ids=["finite", "inf-in-a-later-tile"])
def test_an_amp_body_without_statistics_over_narrow_tiles_matches_torchs_unscale(with_inf, backend, monkeypatch):
    """A bf16 AMP body without statistics (narrow tiles) over blocks of 4 tiles, the last block partial: the
    gradient is torch's unscale then the body, bit for bit, and an Inf in a later tile of a later block sets
    found_inf."""
    narrow = NARROW_TILE_ELEMENTS
    monkeypatch.setenv("FUSEDHOOKS_BLOCK", str(4 * narrow))
    n = 2 * 4 * narrow + 3 * narrow + 5
    p = torch.zeros(n, dtype=torch.bfloat16, requires_grad=True)
    opt = torch.optim.SGD([p], lr=1.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=3.0 * 2.0 ** 7)
    scaler.scale(torch.ones(()))                                      # creates the scale tensor
    grad = (torch.randn(n, generator=torch.Generator().manual_seed(0)) * 300).to(torch.bfloat16)
    if with_inf:
        grad[4 * narrow + 2 * narrow + 17] = float("inf")               # block 1, tile 2
    expected = grad.clone()
    found_ref = torch.zeros(())
    torch._amp_foreach_non_finite_check_and_unscale_([expected], found_ref, scaler._scale.double().reciprocal().float())
    expected = expected.clamp(-1.0, 1.0) * 0.5
    hook = fh.grad_hook(lambda g: g.clamp(-1.0, 1.0) * 0.5, scaler=scaler, optimizer=opt, backend=backend)
    hook.register(p)
    p.grad = grad
    hook(p)
    assert_same_values(p.grad, expected)
    found = scaler._per_optimizer_states[id(opt)]["found_inf_per_device"][torch.device("cpu")]
    assert found.item() == found_ref.item() == float(with_inf)
