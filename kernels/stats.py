"""Statistics: per-program partials and the merge that the last program of a launch performs.

A launch over `num_blocks` programs writes, for each statistics set (output, input), one row of
N_PARTIALS fp64 values per program; the program that finishes last merges the rows in program order
(deterministic) with Chan's parallel variance formula, then applies torch's NaN rules.
"""

import triton
import triton.language as tl

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
def _count(flags, mask, FULL: tl.constexpr):
    """How many valid lanes have `flags` set, as fp64. Summed as fp32 ones (exact below 2**24 lanes): a compare
    that writes 1.0 or 0.0 and an add on the fp32 pipe, where an int32 count takes a compare, a select and an
    integer add on the ALU pipe that the statistics fill."""
    return tl.sum(_valid(flags, mask, False, FULL).to(tl.float32), axis=0).to(tl.float64)


@triton.jit
def store_partials(x, mask, n_valid, out_ptr,
                   SUM: tl.constexpr, M2: tl.constexpr, SUMSQ: tl.constexpr,
                   MINMAX: tl.constexpr, COUNTS: tl.constexpr, M34: tl.constexpr, FULL: tl.constexpr):
    """Reduce one block and store its partials.

    x: fp32/fp64 [BLOCK] values (lanes outside `mask` ignored); n_valid: int64, lanes in `mask`;
    out_ptr: *fp64, N_PARTIALS slots. The flags choose which partials are computed (the rest is 0).
    FULL: every lane is valid (the launch's FULL_BLOCKS: no program's block is partial); the same operations on the
    same values without the per-element selects of the mask, so the same bits either way for a block of valid lanes.
    """
    # the sum of squares of a block with M2 comes from the deviations' sums (below), which needs to know whether
    # the block holds a NaN
    SUMSQ_FROM_M2: tl.constexpr = SUMSQ and M2 and x.dtype != tl.float64
    if COUNTS or SUMSQ_FROM_M2:
        if x.shape[0] * x.shape[0] <= 16777216:
            # NaNs and Infs in one sum, packed = BLOCK * inf - nan: they are disjoint, so nan <= BLOCK - inf and
            # every partial sum lies in [-BLOCK, BLOCK**2], an exact fp32 integer; then inf = ceil(packed / BLOCK)
            # (at least 0: a block of NaNs alone sums to -BLOCK), nan = BLOCK * inf - packed, exact (BLOCK is a
            # power of two)
            packed = tl.sum(_valid(tl.fma((tl.abs(x) == float("inf")).to(tl.float32), x.shape[0],
                                          -(x != x).to(tl.float32)), mask, 0.0, FULL), axis=0)
            infs = tl.maximum(tl.ceil(packed * (1.0 / x.shape[0])), 0.0).to(tl.int32)
            nans = (infs * x.shape[0] - packed.to(tl.int32)).to(tl.float64)
            infs = infs.to(tl.float64)
        else:
            nans = _count(x != x, mask, FULL)
            infs = _count(tl.abs(x) == float("inf"), mask, FULL)
        if COUNTS:
            tl.store(out_ptr + 5, nans)
            tl.store(out_ptr + 6, infs)
            tl.store(out_ptr + 7, _count(x == 0, mask, FULL))
    if MINMAX:
        # NaN is not left out: a block with a NaN counts it (MINMAX comes with COUNTS), and the merge then makes min,
        # max and absmax NaN whatever these partials hold
        mn = tl.min(_valid(x, mask, float("inf"), FULL), axis=0)
        mx = tl.max(_valid(x, mask, float("-inf"), FULL), axis=0)
        tl.store(out_ptr + 3, mn.to(tl.float64))
        tl.store(out_ptr + 4, mx.to(tl.float64))
    if SUMSQ and not (SUM or MINMAX or x.dtype == tl.float64):
        # squares in fp64: no overflow above ~1.8e19 nor underflow below ~1e-19 (CPU torch's double), with no
        # reduction first (the largest |x|, which a power-of-two scaling needs, is not known here)
        x64 = _valid(x, mask, 0.0, FULL).to(tl.float64)
        tl.store(out_ptr + 1, tl.sum(x64 * x64, axis=0))
    elif SUM or SUMSQ:
        if x.dtype == tl.float64:
            unscale = 1.0
            xs = x
        else:
            # fp32 values are summed, and squared, scaled by a power of two that brings the block's largest |x| into
            # [2, 4): exact, so the sums have the same bits as unscaled ones wherever those neither overflow nor
            # underflow; the squares neither overflow (|x| above 1.8e19) nor underflow but where |x| is below 2**-60
            # of the block's largest, too small to change a float32 sum of squares (CPU torch's double: no overflow)
            if MINMAX:
                absmax = tl.maximum(tl.abs(mn), tl.abs(mx))
            else:
                absmax = tl.max(_valid(tl.abs(x), mask, 0.0, FULL), axis=0)
            exponent = ((absmax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
            shift = tl.minimum(tl.maximum(1 - exponent, -126), 127)
            xs = x * ((shift + 127) << 23).to(tl.float32, bitcast=True)
            unscale = ((1023 - shift).to(tl.int64) << 52).to(tl.float64, bitcast=True)  # 2 ** -shift
        xs = _valid(xs, mask, 0.0, FULL)
        if SUMSQ and not SUMSQ_FROM_M2:
            tl.store(out_ptr + 1, tl.sum(xs * xs, axis=0).to(tl.float64) * unscale * unscale)
        if SUM:
            block_sum = tl.sum(xs, axis=0)
            tl.store(out_ptr + 0, block_sum.to(tl.float64) * unscale)
            if M2:
                block_mean = block_sum / n_valid.to(xs.dtype)
                dev = _valid(xs - block_mean, mask, 0.0, FULL)
                # the corrected two-pass sum: less (sum of deviations)^2 / n, which takes out what the block mean's
                # rounding adds (n times its error squared: 1.4e-5 of the variance of 3 values near 5.6e6, unmended);
                # never below 0 (equal deviations can round the difference to -0.0 or a few ulps under)
                dev_sum = tl.sum(dev, axis=0)
                dev2 = dev * dev
                dev2_sum = tl.sum(dev2, axis=0)
                m2 = tl.maximum(dev2_sum - dev_sum * dev_sum / n_valid.to(xs.dtype), 0.0)
                tl.store(out_ptr + 2, m2.to(tl.float64) * unscale * unscale)
                if SUMSQ_FROM_M2:
                    # from the deviations' sums, with no square and sum of its own: sum(xs^2) = sum((dev + mean)^2)
                    # = dev2_sum + mean (2 dev_sum + n mean), in fp64 from fp32 sums: within about 26 fp32 ulps of
                    # the exact sum (|2 mean dev_sum| is at most the other two terms' sum). A block with an Inf has
                    # NaN deviations: its sum of squares is Inf, or NaN with a NaN too (told by the NaN count, not by
                    # a branch: ptxas spilled a register for one).
                    mean64 = block_mean.to(tl.float64)
                    sumsq = tl.maximum(dev2_sum.to(tl.float64) + mean64 * (2.0 * dev_sum.to(tl.float64)
                                                                           + n_valid.to(tl.float64) * mean64),
                                       0.0, propagate_nan=tl.PropagateNan.ALL)
                    sumsq = tl.where(absmax < float("inf"), sumsq, tl.where(nans > 0, float("nan"), float("inf")))
                    tl.store(out_ptr + 1, sumsq * unscale * unscale)
                if M34:
                    # about the block's exact mean, which is the rounded one plus c, the deviations' mean
                    c = dev_sum / n_valid.to(xs.dtype)
                    dev3_sum = tl.sum(dev2 * dev, axis=0)
                    m3 = dev3_sum - 3.0 * c * dev2_sum + 2.0 * dev_sum * c * c
                    m4 = (tl.sum(dev2 * dev2, axis=0) - 4.0 * c * dev3_sum + 6.0 * c * c * dev2_sum
                          - 3.0 * dev_sum * c * c * c)
                    unscale2 = unscale * unscale
                    tl.store(out_ptr + 8, m3.to(tl.float64) * unscale2 * unscale)
                    tl.store(out_ptr + 9, tl.maximum(m4, 0.0).to(tl.float64) * unscale2 * unscale2)


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
