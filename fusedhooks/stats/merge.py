"""Statistics of whole parameters merged from their shards' partials (FSDP2): which partials a shard records for
each statistic, and the merge of the ranks' partials (stable for the variance, scaled for the norm)."""

from __future__ import annotations

import math

import torch

from ..compiler.ir import ALL_STAT_NAMES

#: The partials each statistic of a whole parameter is merged from.
_PARTIALS = {
    "count": ("count",), "sum": ("sum",), "mean": ("count", "sum"), "sumsq": ("sumsq",), "norm": ("norm",),
    "var": ("count", "sum", "var"), "std": ("count", "sum", "var"), "min": ("count", "min"),
    "max": ("count", "max"), "absmax": ("count", "absmax"), "nan": ("nan",), "inf": ("inf",),
    "zeros": ("zeros",), "hist": ("hist",),
    "skew": ("count", "sum", "var", "skew", "kurtosis"), "kurtosis": ("count", "sum", "var", "skew", "kurtosis"),
}
_SUMMED = frozenset({"count", "sum", "sumsq", "nan", "inf", "zeros"})


def partial_stats(names: tuple[str, ...]) -> tuple[str, ...]:
    """The statistics a shard records so that `names` of the whole parameter can be merged from the ranks'."""
    needed = {p for n in names for p in _PARTIALS[n]}
    return tuple(n for n in ALL_STAT_NAMES + ("hist",) if n in needed)


def merge_partials(parts: torch.Tensor, partial_slots: tuple[str, ...], slots: tuple[str, ...]) -> torch.Tensor:
    """The statistics `slots` of whole parameters from their ranks' partials.

    parts: float64 [ranks, parameters, len(partial_slots)], rank order; returns float64 [parameters, len(slots)].
    Counts and sums add, min/max/absmax over the ranks whose shard is not empty (NaN propagates), variance by
    the stable pairwise merge (Chan et al.) of each shard's count, mean and M2, skew and kurtosis by Pebay's update of
    each shard's central moments (from its count, mean, variance, skew and kurtosis) to the whole's mean.
    """
    first = {}
    for j, s in enumerate(partial_slots):
        first.setdefault(s, j)
    out, j = [], 0
    while j < len(slots):
        s = slots[j]
        prefix = "input." if s.startswith("input.") else ""
        name = s[len(prefix):]
        if name == "hist":
            k, bins = first[s], slots.count(s)
            out.extend(parts[:, :, k:k + bins].sum(0).unbind(-1))
            j += bins
            continue
        out.append(_merge_one(name, lambda stat, prefix=prefix: parts[:, :, first[prefix + stat]]))
        j += 1
    return torch.stack(out, dim=-1)


def _merge_one(name: str, col) -> torch.Tensor:
    if name in _SUMMED:
        return col(name).sum(0)
    if name == "norm":
        norms = col("norm")  # scaled by the largest, so that squares of fp64 norms cannot overflow
        scale = norms.abs().amax(0).clamp_min(torch.finfo(torch.float64).tiny)
        merged = (norms / scale).square().sum(0).sqrt() * scale
        infinite = norms.isinf().any(0) & ~norms.isnan().any(0)
        return torch.where(infinite, math.inf, merged)
    count = col("count")
    total = count.sum(0)
    nan = torch.tensor(math.nan, dtype=torch.float64, device=count.device)
    if name == "mean":
        return torch.where(total > 0, col("sum").sum(0) / total, nan)
    if name in ("skew", "kurtosis"):
        return _merge_moment(name, count, total, col)
    if name in ("var", "std"):
        m2, shift = _rank_deviations(count, total, col)
        var = torch.where(total > 1, (m2.sum(0) + (count * shift.square()).sum(0)) / (total - 1), nan)
        return var if name == "var" else var.sqrt()
    fill = math.inf if name == "min" else -math.inf
    values = torch.where(count > 0, col(name), fill)
    merged = values.amin(0) if name == "min" else values.amax(0)
    return torch.where(total > 0, merged, nan)


def _rank_deviations(count: torch.Tensor, total: torch.Tensor, col) -> tuple[torch.Tensor, torch.Tensor]:
    """Each rank's M2 (its sum of squared deviations from its mean, from its var of correction 1; 0 for fewer than 2
    elements) and its mean less the whole's (0 for an empty shard), [ranks, parameters] each."""
    sums = col("sum")
    m2 = torch.where(count > 1, col("var") * (count - 1), 0.0)
    return m2, torch.where(count > 0, sums / count - sums.sum(0) / total, 0.0)


def _merge_moment(name: str, count: torch.Tensor, total: torch.Tensor, col) -> torch.Tensor:
    """skew or kurtosis of the whole from each rank's count, sum, var (correction 1), skew and kurtosis ([ranks,
    parameters] each): each rank's central moments M2, M3, M4 (sums of the deviations' powers; 0 for a shard of one
    element or of equal values, NaN where the shard held a NaN) moved to the whole's mean and added."""
    m2, shift = _rank_deviations(count, total, col)
    spread = torch.where(count > 0, m2 / count, 0.0)  # the shard's population variance
    m3 = torch.where(m2 == 0, 0.0, col("skew") * count * spread * spread.sqrt())
    m4 = torch.where(m2 == 0, 0.0, (col("kurtosis") + 3.0) * count * spread * spread)
    whole_m2 = (m2 + count * shift.square()).sum(0) / total
    if name == "skew":
        whole_m3 = (m3 + 3.0 * shift * m2 + count * shift.pow(3)).sum(0) / total
        return whole_m3 / (whole_m2 * whole_m2.sqrt())
    whole_m4 = (m4 + 4.0 * shift * m3 + 6.0 * shift.square() * m2 + count * shift.pow(4)).sum(0) / total
    return whole_m4 / whole_m2.square() - 3.0
