"""Statistics of whole parameters merged from their shards' partials (FSDP2): which partials a shard records for
each statistic, and the merge of the ranks' partials (stable for the variance, scaled for the norm)."""

from __future__ import annotations

import math

import torch

from ..compiler.ir import STAT_NAMES

#: The partials each statistic of a whole parameter is merged from.
_PARTIALS = {
    "count": ("count",), "sum": ("sum",), "mean": ("count", "sum"), "sumsq": ("sumsq",), "norm": ("norm",),
    "var": ("count", "sum", "var"), "std": ("count", "sum", "var"), "min": ("count", "min"),
    "max": ("count", "max"), "absmax": ("count", "absmax"), "nan": ("nan",), "inf": ("inf",),
    "zeros": ("zeros",), "hist": ("hist",),
}
_SUMMED = frozenset({"count", "sum", "sumsq", "nan", "inf", "zeros"})


def partial_stats(names: tuple[str, ...]) -> tuple[str, ...]:
    """The statistics a shard records so that `names` of the whole parameter can be merged from the ranks'."""
    needed = {p for n in names for p in _PARTIALS[n]}
    return tuple(n for n in STAT_NAMES + ("hist",) if n in needed)


def merge_partials(parts: torch.Tensor, partial_slots: tuple[str, ...], slots: tuple[str, ...]) -> torch.Tensor:
    """The statistics `slots` of whole parameters from their ranks' partials.

    parts: float64 [ranks, parameters, len(partial_slots)], rank order; returns float64 [parameters, len(slots)].
    Counts and sums add, min/max/absmax over the ranks whose shard is not empty (NaN propagates), variance by
    the stable pairwise merge (Chan et al.) of each shard's count, mean and M2.
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
    if name in ("var", "std"):
        sums = col("sum")
        mean = sums.sum(0) / total
        m2 = torch.where(count > 1, col("var") * (count - 1), 0.0).sum(0)
        spread = torch.where(count > 0, count * (sums / count - mean).square(), 0.0).sum(0)
        var = torch.where(total > 1, (m2 + spread) / (total - 1), nan)
        return var if name == "var" else var.sqrt()
    fill = math.inf if name == "min" else -math.inf
    values = torch.where(count > 0, col(name), fill)
    merged = values.amin(0) if name == "min" else values.amax(0)
    return torch.where(total > 0, merged, nan)
