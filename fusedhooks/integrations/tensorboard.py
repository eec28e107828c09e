"""A hook's statistics to TensorBoard: scalars and the "hist" histograms, from one read of the statistics buffer.

Works with `torch.utils.tensorboard.SummaryWriter` (needs the `tensorboard` package: `pip install
fusedhooks[tensorboard]`) and any writer with `add_scalar` and `add_histogram_raw` (tensorboardX's too).
"""

from __future__ import annotations

import math

from ..api import GradHook
from ..stats.buffer import scalars_of


def log_to_tensorboard(writer, hook: GradHook, step: int, prefix: str = "grad/", histograms: bool = True) -> dict:
    """Write `hook`'s current statistics to `writer` at `global_step=step`; one device sync; returns the scalars.

    Scalars: `hook.stats.to_scalars(prefix)` (`grad/fc.weight/norm`, ...). Histograms: each "hist" statistic as
    `f"{prefix}{name}/hist"` (`.../input.hist` for input_stats) over the gradient's magnitudes |g|, one TensorBoard
    bucket per power-of-two bin: upper limits 2^(k+1) for k = lo .. hi-1 (see docs/statistics.md: the first bin
    also holds zeros and smaller values, the last larger values and Inf). min and max are the bounds of the
    non-empty bins (0 when the first bin is not empty); sum and sum_squares, which TensorBoard's histogram
    dashboard does not draw, are estimated from the bins' geometric centres, since the hook does not record
    them for |g|. Rows not written by the last backward (`read().stale`) are left out.
    """
    if not isinstance(hook, GradHook):
        raise TypeError(f"log_to_tensorboard(writer, hook, step) takes a fusedhooks hook, not {type(hook).__name__}")
    if not all(callable(getattr(writer, method, None)) for method in ("add_scalar", "add_histogram_raw")):
        raise TypeError("log_to_tensorboard(writer, hook, step) takes a torch.utils.tensorboard.SummaryWriter "
                        f"(anything with add_scalar and add_histogram_raw), not {type(writer).__name__}")
    reading = hook.stats.read()
    lo, hi = hook.stats.hist_range
    limits = [2.0 ** (k + 1) for k in range(lo, hi)]
    for name, row in reading.items():
        for stat, value in row.items():
            if histograms and row.fresh and stat.endswith("hist"):
                _add_histogram(writer, f"{prefix}{name}/{stat}", value, lo, limits, step)
    scalars = scalars_of(reading, prefix)
    for tag, value in scalars.items():
        writer.add_scalar(tag, value, global_step=step)
    return scalars


def _add_histogram(writer, tag: str, counts: list[int], lo: int, limits: list[float], step: int) -> None:
    total = sum(counts)
    if total == 0:  # an empty gradient, or only NaN: TensorBoard has no empty histogram
        return
    used = [k for k, c in enumerate(counts) if c]
    low = 0.0 if counts[0] else 2.0 ** (lo + used[0])
    centres = [2.0 ** (lo + k + 0.5) for k in range(len(counts))]
    estimate = sum(c * x for c, x in zip(counts, centres))
    estimate_sq = sum(c * x * x for c, x in zip(counts, centres))
    if not math.isfinite(estimate_sq):
        estimate_sq = math.inf
    writer.add_histogram_raw(tag, min=low, max=limits[used[-1]], num=total, sum=estimate, sum_squares=estimate_sq,
                             bucket_limits=limits, bucket_counts=counts, global_step=step)
