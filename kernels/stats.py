"""Statistics: per-program partials and the merge that the last program of a launch performs.

A launch over `num_blocks` programs writes, for each statistics set (output, input), one row of
N_PARTIALS fp64 values per program; the program that finishes last merges the rows in program order
(deterministic) with Chan's parallel variance formula, then applies torch's NaN rules.
"""

import triton
import triton.language as tl

from .elementwise import HARDWARE_CASTS

#: slots of a partials row: sum, sum of squares, M2 (sum of squared deviations from the block mean),
#: min, max, counts of NaN, +-Inf and zeros, M3 and M4 (sums of the deviations' cubes and fourth powers); the rest of
#: the row is padding
N_PARTIALS = tl.constexpr(16)  # fusedhooks.launch_spec.PARTIAL_WIDTH


@triton.jit
def _valid(x, mask, other, FULL: tl.constexpr):
    """x where the lane is valid, else `other` (every lane is valid in a FULL block)."""
    if FULL:
        return x
    else:
        return tl.where(mask, x, other)


@triton.jit
def _rows(v, V: tl.constexpr):
    """The sums of each V adjacent lanes of v [TILE] ([TILE // V]): the V elements of one vector access, which one
    thread holds, added in its registers (no exchange between threads)."""
    return tl.sum(tl.reshape(v, [v.shape[0] // V, V]), axis=1)


@triton.jit
def _fma_rows(x, y, acc, V: tl.constexpr):
    """acc [TILE // V] plus the sums of x * y over each V adjacent lanes of x, y [TILE], as one fused multiply-add a
    lane (lanes split off in pairs, in the thread's registers): half the instructions of a product then a sum."""
    if V == 1:
        return tl.fma(x, y, acc)
    else:
        xa, xb = tl.split(tl.reshape(x, [x.shape[0] // 2, 2]))
        ya, yb = tl.split(tl.reshape(y, [y.shape[0] // 2, 2]))
        return _fma_rows(xb, yb, _fma_rows(xa, ya, acc, V // 2), V // 2)


@triton.jit
def _min_nan(a, b):
    return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _row_extremes(x, mask, FULL: tl.constexpr, VEC: tl.constexpr):
    """(least, largest) value of each VEC adjacent valid lanes of x [TILE] ([TILE // VEC] each; +Inf, -Inf for none;
    NaN for both where one lane is NaN). On a GPU the row's minimum and maximum propagate the NaN (FMNMX.NAN, as
    cheap as the plain one); the interpreter, whose custom reductions run lane by lane, marks the rows with a NaN."""
    if HARDWARE_CASTS:
        mn = tl.reduce(tl.reshape(_valid(x, mask, float("inf"), FULL), [x.shape[0] // VEC, VEC]), 1, _min_nan)
        mx = tl.reduce(tl.reshape(_valid(x, mask, float("-inf"), FULL), [x.shape[0] // VEC, VEC]), 1, _max_nan)
    else:
        mn = tl.min(tl.reshape(_valid(x, mask, float("inf"), FULL), [x.shape[0] // VEC, VEC]), axis=1)
        mx = tl.max(tl.reshape(_valid(x, mask, float("-inf"), FULL), [x.shape[0] // VEC, VEC]), axis=1)
        nan = tl.max(tl.reshape(_valid(x != x, mask, False, FULL).to(tl.int32), [x.shape[0] // VEC, VEC]), axis=1)
        mn = tl.where(nan > 0, float("nan"), mn)
        mx = tl.where(nan > 0, float("nan"), mx)
    return mn, mx


@triton.jit
def _extremes_bits(mn, mx, FULL: tl.constexpr):
    """What `_abs_bits` gives for a tile, from its rows' least and largest values (`_row_extremes`: a row holding a
    NaN has NaN for both): the bits of the largest |x| as int32, a NaN's above an Inf's; a row without valid lanes
    (mn > mx: +Inf, -Inf) counts 0. One operation per row, where `_abs_bits` takes two per element."""
    bits = tl.maximum(mn.to(tl.int32, bitcast=True) & 0x7FFFFFFF, mx.to(tl.int32, bitcast=True) & 0x7FFFFFFF)
    if not FULL:
        bits = tl.where(mn > mx, 0, bits)
    return tl.max(bits, axis=0)


@triton.jit
def _magnitude_bits(x, mask, mn, mx, MINMAX: tl.constexpr, FULL: tl.constexpr):
    """The bits of a tile's largest |x| (`_abs_bits`): from its rows' extremes `mn`, `mx` where the statistics keep
    them (MINMAX: nothing more per element), else from every lane."""
    if MINMAX:
        return _extremes_bits(mn, mx, FULL)
    else:
        return _abs_bits(x, mask, FULL)


@triton.jit
def _count_rows(flags, mask, FULL: tl.constexpr, VEC: tl.constexpr):
    """How many valid lanes of each VEC adjacent ones have `flags` set, as fp32 ([TILE // VEC])."""
    return _rows(_valid(flags, mask, False, FULL).to(tl.float32), VEC)


@triton.jit
def _zero_flags(x, finite):
    """x == 0, compared with `finite` * 0 (a zero, for any finite fp32 `finite`) rather than a constant: with a
    constant the compiler narrows the compare of a widened 16-bit value to a packed 16-bit one whose flags then take
    a select and a conversion each (3.5 instructions an element with the count's add, against 2: one FSET and the
    add)."""
    return x == finite * 0.0


@triton.jit
def _scaled(x, mask, shift, FULL: tl.constexpr):
    """x times 2 ** shift (fp32; fp64 x as it is), 0 in the lanes outside `mask`."""
    if x.dtype != tl.float64:
        return _valid(x * _pow2(shift), mask, 0.0, FULL)
    else:
        return _valid(x, mask, 0.0, FULL)


@triton.jit
def _add_deviations(xs, ks, mask, sd, sd2, sd3, sd4, M34: tl.constexpr, FULL: tl.constexpr, VEC: tl.constexpr):
    """sd, sd2 (sd3, sd4 with M34) plus, per row of VEC lanes, the sums of the deviations d = xs - ks and of d^2
    (d^3, d^4)."""
    d = _valid(xs - ks, mask, 0.0, FULL)
    if M34:
        d2 = d * d
        sd3 += _rows(d2 * d, VEC)
        sd4 += _rows(d2 * d2, VEC)
    return sd + _rows(d, VEC), _fma_rows(d, d, sd2, VEC), sd3, sd4


@triton.jit
def _pow2(e):
    """2.0 ** e as fp32, for int32 e in [-126, 127] (exact)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _abs_bits(x, mask, FULL: tl.constexpr):
    """The bits of the largest |x| of the valid lanes of fp32 `x`, as int32 (0 without any): one int32 maximum over
    the bits of |x|, ordered as the magnitudes are (a NaN's above an Inf's, at 0x7F800000), which the GPU reduces
    with its integer REDUX."""
    return tl.max(_valid(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, mask, 0, FULL), axis=0)


@triton.jit
def _shift_of(bits):
    """The int32 exponent e for which |x| (its bits, `_abs_bits`) times 2 ** e lies in [2, 4), clamped to
    [-126, 127] (127 for zeros; -126 for Inf and NaN, whose sums are not finite anyway)."""
    return tl.minimum(tl.maximum(128 - (bits >> 23), -126), 127)


@triton.jit
def stats_first(x, mask, n_tile,
                SUM: tl.constexpr, M2: tl.constexpr, SUMSQ: tl.constexpr,
                MINMAX: tl.constexpr, COUNTS: tl.constexpr, M34: tl.constexpr, FULL: tl.constexpr,
                VEC: tl.constexpr = 1):
    """The statistics of a program's first tile, as the running state that `stats_add` carries over the program's
    other tiles and `stats_store` reduces once: (shift, ks, mn, mx, sx, sx2, sd, sd2, sd3, sd4, nan, inf, zeros).

    x: fp32/fp64 [TILE] values (lanes outside `mask` ignored); n_tile: int64, lanes in `mask` (> 0). The flags are
    store_partials'; FULL: every lane is valid (the same operations without the mask's selects: the same bits); VEC:
    the elements of one vector access (16 bytes of the gradient), which one thread holds: each of the running values
    below is kept per row of VEC lanes ([TILE // VEC]), the row's lanes added first in the thread's registers (a
    register per row, not per element).

    Per row (fp32; fp64 for fp64 values), summed over the program's tiles: sx, sx2 the values and their squares,
    scaled by 2 ** shift, a power of two that keeps the largest |x| so far in [2, 4) (exact: the sums have the
    bits of unscaled ones wherever those neither overflow nor underflow; when a later tile holds a larger value, the
    sums are rescaled, `stats_add`); sd, sd2 (sd3, sd4 with M34) the scaled deviations from ks, the first tile's
    scaled mean (a shift: M2 = sum(d^2) - sum(d)^2 / n for any shift; from the first tile's mean, whose squared distance
    from the program's mean is at most n / n_tile times the program's variance, so the subtraction cancels at most
    1 + n / n_tile of sum(d^2)); mn, mx the least and largest value; nan, inf, zeros counts (fp32, exact below 2**24
    per lane). A statistic whose flag is off is an fp32 zero. Scaled, the squares neither overflow nor underflow but
    where |x| is below 2**-60 of the largest so far, too small to change an fp32 sum of squares (CPU torch's double:
    no overflow)."""
    zero = n_tile.to(tl.float32) * 0.0
    shift = n_tile.to(tl.int32) * 0
    ks = zero
    mn = zero
    mx = zero
    sx = zero
    sx2 = zero
    sd = zero
    sd2 = zero
    sd3 = zero
    sd4 = zero
    nan = zero
    inf = zero
    zeros = zero
    if MINMAX:
        mn, mx = _row_extremes(x, mask, FULL, VEC)
    if (SUM or SUMSQ) and x.dtype != tl.float64:
        shift = _shift_of(_magnitude_bits(x, mask, mn, mx, MINMAX, FULL))
    if SUM or SUMSQ:
        xs = _scaled(x, mask, shift, FULL)
    if SUM:
        sx = _rows(xs, VEC)
        if M2:
            ks = tl.sum(sx, axis=0) / n_tile.to(xs.dtype)
            ks = tl.where(tl.abs(ks) < float("inf"), ks, 0.0)  # an Inf or NaN makes the moments NaN anyway
            sd, sd2, sd3, sd4 = _add_deviations(xs, ks, mask, sd, sd2, sd3, sd4, M34, FULL, VEC)
    if SUMSQ:
        sx2 = _fma_rows(xs, xs, sx2, VEC)
    if COUNTS:
        nan = _count_rows(x != x, mask, FULL, VEC)
        inf = _count_rows(tl.abs(x) == float("inf"), mask, FULL, VEC)
        zeros = _count_rows(_zero_flags(x, ks), mask, FULL, VEC)
    return shift, ks, mn, mx, sx, sx2, sd, sd2, sd3, sd4, nan, inf, zeros


@triton.jit
def stats_add(x, mask, shift, ks, mn, mx, sx, sx2, sd, sd2, sd3, sd4, nan, inf, zeros,
              SUM: tl.constexpr, M2: tl.constexpr, SUMSQ: tl.constexpr,
              MINMAX: tl.constexpr, COUNTS: tl.constexpr, M34: tl.constexpr, FULL: tl.constexpr,
              VEC: tl.constexpr = 1):
    """Add the tile `x` (fp32/fp64 [TILE], lanes outside `mask` ignored) to the running state of `stats_first`, and
    return it. Per element the sums take an add or a fused multiply-add each (the squares), the zeros a compare and an
    add; per tile one int32 maximum of |x| (the scale, and whether the tile holds a NaN or an Inf at all); rare: when
    it finds a larger value than the tiles before, the running sums rescaled by a power of two, and a tile's NaN and
    Inf counted."""
    tile_mn = mn
    tile_mx = mx
    if MINMAX:
        tile_mn, tile_mx = _row_extremes(x, mask, FULL, VEC)
    if x.dtype != tl.float64 and (SUM or SUMSQ or COUNTS):
        bits = _magnitude_bits(x, mask, tile_mn, tile_mx, MINMAX, FULL)
    if SUM or SUMSQ:
        if x.dtype != tl.float64:
            tile_shift = _shift_of(bits)
            if tile_shift < shift:
                delta = tile_shift - shift  # < 0: below -126 the sums so far are negligible against this tile's
                r = _pow2(tl.maximum(delta, -126))
                r2 = _pow2(tl.maximum(2 * delta, -126))
                sx = sx * r
                sx2 = sx2 * r2
                ks = ks * r
                sd = sd * r
                sd2 = sd2 * r2
                if M34:
                    sd3 = sd3 * _pow2(tl.maximum(3 * delta, -126))
                    sd4 = sd4 * _pow2(tl.maximum(4 * delta, -126))
                shift = tile_shift
        xs = _scaled(x, mask, shift, FULL)
    if SUM:
        sx += _rows(xs, VEC)
        if M2:
            sd, sd2, sd3, sd4 = _add_deviations(xs, ks, mask, sd, sd2, sd3, sd4, M34, FULL, VEC)
    if SUMSQ:
        sx2 = _fma_rows(xs, xs, sx2, VEC)
    if MINMAX:
        mn = tl.minimum(mn, tile_mn)
        mx = tl.maximum(mx, tile_mx)
    if COUNTS:
        zeros += _count_rows(_zero_flags(x, ks), mask, FULL, VEC)
        if x.dtype == tl.float64:
            nan += _count_rows(x != x, mask, FULL, VEC)
            inf += _count_rows(tl.abs(x) == float("inf"), mask, FULL, VEC)
        elif bits >= 0x7F800000:  # the tile holds a NaN or an Inf
            nan += _count_rows(x != x, mask, FULL, VEC)
            inf += _count_rows(tl.abs(x) == float("inf"), mask, FULL, VEC)
    return shift, ks, mn, mx, sx, sx2, sd, sd2, sd3, sd4, nan, inf, zeros


@triton.jit
def stats_store(out_ptr, n_valid, shift, ks, mn, mx, sx, sx2, sd, sd2, sd3, sd4, nan, inf, zeros,
                SUM: tl.constexpr, M2: tl.constexpr, SUMSQ: tl.constexpr,
                MINMAX: tl.constexpr, COUNTS: tl.constexpr, M34: tl.constexpr):
    """Reduce the running state of a program's tiles (`stats_first`, `stats_add`) once and store its partials.

    out_ptr: *fp64, N_PARTIALS slots; n_valid: int64, the program's valid lanes (all tiles). The flags choose which
    partials are computed (the rest is 0). M2 (M3, M4) are about the program's mean: from the deviations' sums d about
    the shift, M2 = sum(d^2) - sum(d)^2 / n, and M3, M4 corrected for c = sum(d) / n, in fp64."""
    if SUM or SUMSQ:
        unscale = ((1023 - shift).to(tl.int64) << 52).to(tl.float64, bitcast=True)  # 2 ** -shift
    if SUM:
        tl.store(out_ptr + 0, tl.sum(sx, axis=0).to(tl.float64) * unscale)
    if SUMSQ:
        tl.store(out_ptr + 1, tl.sum(sx2, axis=0).to(tl.float64) * unscale * unscale)
    if M2:
        n = n_valid.to(tl.float64)
        d1 = tl.sum(sd, axis=0).to(tl.float64)
        d2 = tl.sum(sd2, axis=0).to(tl.float64)
        # never below 0 (equal deviations can round the difference to -0.0 or a few ulps under)
        m2 = tl.maximum(d2 - d1 * d1 / n, 0.0)
        unscale2 = unscale * unscale
        tl.store(out_ptr + 2, m2 * unscale2)
        if M34:
            c = d1 / n  # the program's mean is the shift plus c
            d3 = tl.sum(sd3, axis=0).to(tl.float64)
            m3 = d3 - 3.0 * c * d2 + 2.0 * d1 * c * c
            m4 = tl.sum(sd4, axis=0).to(tl.float64) - 4.0 * c * d3 + 6.0 * c * c * d2 - 3.0 * d1 * c * c * c
            tl.store(out_ptr + 8, m3 * unscale2 * unscale)
            tl.store(out_ptr + 9, tl.maximum(m4, 0.0) * unscale2 * unscale2)
    if MINMAX:
        # NaN is not left out: a block with a NaN counts it (MINMAX comes with COUNTS), and the merge then makes min,
        # max and absmax NaN whatever these partials hold
        tl.store(out_ptr + 3, tl.min(mn, axis=0).to(tl.float64))
        tl.store(out_ptr + 4, tl.max(mx, axis=0).to(tl.float64))
    if COUNTS:
        tl.store(out_ptr + 5, tl.sum(nan, axis=0).to(tl.float64))
        tl.store(out_ptr + 6, tl.sum(inf, axis=0).to(tl.float64))
        tl.store(out_ptr + 7, tl.sum(zeros, axis=0).to(tl.float64))


@triton.jit
def store_partials(x, mask, n_valid, out_ptr,
                   SUM: tl.constexpr, M2: tl.constexpr, SUMSQ: tl.constexpr,
                   MINMAX: tl.constexpr, COUNTS: tl.constexpr, M34: tl.constexpr, FULL: tl.constexpr):
    """Reduce one block (a program of one tile: a kernel over units) and store its partials: `stats_first`, then
    `stats_store`, for the counts, the extremes and the sums one after the other (each group's lanes reduced before
    the next group's are made: fewer registers live at once).

    x: fp32/fp64 [BLOCK] values (lanes outside `mask` ignored); n_valid: int64, lanes in `mask` (> 0); out_ptr:
    *fp64, N_PARTIALS slots."""
    if COUNTS:
        (shift, ks, mn, mx, sx, sx2, sd, sd2, sd3, sd4, nan, inf,
         zeros) = stats_first(x, mask, n_valid, False, False, False, False, True, False, FULL)
        stats_store(out_ptr, n_valid, shift, ks, mn, mx, sx, sx2, sd, sd2, sd3, sd4, nan, inf, zeros,
                    False, False, False, False, True, False)
    if MINMAX:
        (shift, ks, mn, mx, sx, sx2, sd, sd2, sd3, sd4, nan, inf,
         zeros) = stats_first(x, mask, n_valid, False, False, False, True, False, False, FULL)
        stats_store(out_ptr, n_valid, shift, ks, mn, mx, sx, sx2, sd, sd2, sd3, sd4, nan, inf, zeros,
                    False, False, False, True, False, False)
    if SUM or SUMSQ:
        (shift, ks, mn, mx, sx, sx2, sd, sd2, sd3, sd4, nan, inf,
         zeros) = stats_first(x, mask, n_valid, SUM, M2, SUMSQ, False, False, M34, FULL)
        stats_store(out_ptr, n_valid, shift, ks, mn, mx, sx, sx2, sd, sd2, sd3, sd4, nan, inf, zeros,
                    SUM, M2, SUMSQ, False, False, M34)


@triton.jit
def finalize_stats(partials_ptr, SET: tl.constexpr, N_SETS: tl.constexpr, numel, num_blocks,
                   BLOCK, RBLOCK: tl.constexpr, CORRECTION: tl.constexpr,
                   SUM: tl.constexpr, M2: tl.constexpr, SUMSQ: tl.constexpr,
                   MINMAX: tl.constexpr, COUNTS: tl.constexpr, M34: tl.constexpr):
    """Merge the partials of statistics set SET over `num_blocks` programs, in fp64.

    partials_ptr: *fp64 [num_blocks, N_SETS, N_PARTIALS]; numel: elements covered (> 0); BLOCK: elements of each
    program but the last;
    CORRECTION: var = M2 / max(numel - CORRECTION, 0), as torch.var.
    Returns fp64 scalars (count, sum, mean, sumsq, norm, var, std, min, max, absmax, nan, inf, zeros, skew, kurtosis):
    skew = m3 / m2**1.5 and kurtosis = m4 / m2**2 - 3 of the central moments m_k = mean((x - mean)**k) (population,
    as scipy.stats' defaults; NaN when m2 is 0); those whose flag is off are 0.
    """
    rows = tl.arange(0, RBLOCK)
    acc_sum = tl.zeros([RBLOCK], dtype=tl.float64)
    acc_sumsq = tl.zeros([RBLOCK], dtype=tl.float64)
    acc_min = tl.full([RBLOCK], float("inf"), dtype=tl.float64)
    acc_max = tl.full([RBLOCK], float("-inf"), dtype=tl.float64)
    acc_nan = tl.zeros([RBLOCK], dtype=tl.float64)
    acc_inf = tl.zeros([RBLOCK], dtype=tl.float64)
    acc_zeros = tl.zeros([RBLOCK], dtype=tl.float64)
    for start in range(0, num_blocks, RBLOCK):
        block = start + rows
        valid = block < num_blocks
        row_ptr = partials_ptr + (block.to(tl.int64) * N_SETS + SET) * N_PARTIALS
        if SUM:
            acc_sum += tl.load(row_ptr + 0, mask=valid, other=0.0, cache_modifier=".cg")
        if SUMSQ:
            acc_sumsq += tl.load(row_ptr + 1, mask=valid, other=0.0, cache_modifier=".cg")
        if MINMAX:
            acc_min = tl.minimum(acc_min, tl.load(row_ptr + 3, mask=valid, other=float("inf"), cache_modifier=".cg"))
            acc_max = tl.maximum(acc_max, tl.load(row_ptr + 4, mask=valid, other=float("-inf"), cache_modifier=".cg"))
        if COUNTS:
            acc_nan += tl.load(row_ptr + 5, mask=valid, other=0.0, cache_modifier=".cg")
            acc_inf += tl.load(row_ptr + 6, mask=valid, other=0.0, cache_modifier=".cg")
            acc_zeros += tl.load(row_ptr + 7, mask=valid, other=0.0, cache_modifier=".cg")
    n = numel.to(tl.float64)
    total = tl.sum(acc_sum, axis=0)
    mean = total / n
    var = total * 0.0
    skew = var
    kurtosis = var
    if M2:
        acc_m2 = tl.zeros([RBLOCK], dtype=tl.float64)
        acc_m3 = tl.zeros([RBLOCK], dtype=tl.float64)
        acc_m4 = tl.zeros([RBLOCK], dtype=tl.float64)
        for start in range(0, num_blocks, RBLOCK):
            block = start + rows
            valid = block < num_blocks
            row_ptr = partials_ptr + (block.to(tl.int64) * N_SETS + SET) * N_PARTIALS
            n_block = tl.minimum(numel - block.to(tl.int64) * BLOCK, BLOCK).to(tl.float64)
            n_block = tl.where(valid, n_block, 1.0)
            block_sum = tl.load(row_ptr + 0, mask=valid, other=0.0, cache_modifier=".cg")
            block_m2 = tl.load(row_ptr + 2, mask=valid, other=0.0, cache_modifier=".cg")
            shift = block_sum / n_block - mean
            acc_m2 += tl.where(valid, block_m2 + n_block * shift * shift, 0.0)
            if M34:  # each block's moments moved from its mean to the whole's (Pebay's update)
                block_m3 = tl.load(row_ptr + 8, mask=valid, other=0.0, cache_modifier=".cg")
                block_m4 = tl.load(row_ptr + 9, mask=valid, other=0.0, cache_modifier=".cg")
                shift2 = shift * shift
                acc_m3 += tl.where(valid, block_m3 + 3.0 * shift * block_m2 + n_block * shift2 * shift, 0.0)
                acc_m4 += tl.where(valid, block_m4 + 4.0 * shift * block_m3 + 6.0 * shift2 * block_m2
                                   + n_block * shift2 * shift2, 0.0)
        m2 = tl.sum(acc_m2, axis=0)
        var = m2 / tl.maximum(n - CORRECTION, 0.0)
        if M34:
            m2_n = m2 / n
            skew = tl.sum(acc_m3, axis=0) / n / (m2_n * tl.sqrt(m2_n))
            kurtosis = tl.sum(acc_m4, axis=0) / n / (m2_n * m2_n) - 3.0
    sumsq = tl.sum(acc_sumsq, axis=0)
    nan = tl.sum(acc_nan, axis=0)
    mn = tl.min(acc_min, axis=0)
    mx = tl.max(acc_max, axis=0)
    absmax = tl.maximum(tl.abs(mn), tl.abs(mx))
    if MINMAX:
        mn = tl.where(nan > 0, float("nan"), mn)
        mx = tl.where(nan > 0, float("nan"), mx)
        absmax = tl.where(nan > 0, float("nan"), absmax)
    else:
        mn = total * 0.0
        mx = mn
        absmax = mn
    return (n, total, mean, sumsq, tl.sqrt(sumsq), var, tl.sqrt(var), mn, mx, absmax,
            nan, tl.sum(acc_inf, axis=0), tl.sum(acc_zeros, axis=0), skew, kurtosis)


@triton.jit
def hist_accumulate(x, mask, hist_ptr, LO: tl.constexpr, BINS: tl.constexpr, PAD: tl.constexpr):
    """Add this block's power-of-two histogram of |x| into hist_ptr (*int64 [PAD], atomically: a bin of one
    gradient may count 2**31 elements or more).

    Bin k counts floor(log2|x|) == LO + k; zeros and smaller values go to bin 0, larger values and
    +-Inf to bin BINS-1; NaN and masked lanes to the spare bin BINS (not flushed). The exponent is
    read from the bits (exact). x: fp32 or fp64 [BLOCK].
    """
    if x.dtype == tl.float64:
        exponent = ((x.to(tl.int64, bitcast=True) >> 52) & 0x7FF).to(tl.int32) - 1023
    else:
        exponent = ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    bins = tl.minimum(tl.maximum(exponent - LO, 0), BINS - 1)
    bins = tl.where(mask & (x == x), bins, BINS)
    counts = tl.histogram(bins, PAD)
    slots = tl.arange(0, PAD)
    tl.atomic_add(hist_ptr + slots, counts.to(tl.int64), mask=slots < BINS)


@triton.jit
def hist_flush(hist_ptr, out_ptr, BINS: tl.constexpr, PAD: tl.constexpr):
    """Copy the accumulated histogram (*int64 [PAD]) into out_ptr (*fp64 [BINS]) and zero it."""
    slots = tl.arange(0, PAD)
    counts = tl.load(hist_ptr + slots, mask=slots < BINS, other=0, cache_modifier=".cg")
    tl.store(out_ptr + slots, counts.to(tl.float64), mask=slots < BINS)
    tl.store(hist_ptr + slots, tl.zeros([PAD], dtype=tl.int64), mask=slots < BINS)
