"""Reductions per unit: a tile of UNITS units side by side, ELEMENTS lanes of each, as one 1-D block.

ROWS: a unit's lanes are adjacent (lane = unit * ELEMENTS + element), else the units are (lane = element * UNITS +
unit); see fusedhooks.dims.Tile. A unit's lanes are reduced in one tl.sum/max/min (exact for max/min; fp64 for sums
in fusedhooks' generated kernels).
"""

import triton
import triton.language as tl


@triton.jit
def per_unit_sum(x, UNITS: tl.constexpr, ELEMENTS: tl.constexpr, ROWS: tl.constexpr):
    """x: [UNITS * ELEMENTS] -> [UNITS], the sum of each unit's lanes (zero the masked lanes first)."""
    if ROWS:
        return tl.sum(tl.reshape(x, [UNITS, ELEMENTS]), axis=1)
    else:
        return tl.sum(tl.reshape(x, [ELEMENTS, UNITS]), axis=0)


@triton.jit
def per_unit_max(x, UNITS: tl.constexpr, ELEMENTS: tl.constexpr, ROWS: tl.constexpr):
    """x: [UNITS * ELEMENTS] -> [UNITS], the largest of each unit's lanes (NaN-free: replace NaN and masked lanes)."""
    if ROWS:
        return tl.max(tl.reshape(x, [UNITS, ELEMENTS]), axis=1)
    else:
        return tl.max(tl.reshape(x, [ELEMENTS, UNITS]), axis=0)


@triton.jit
def per_unit_min(x, UNITS: tl.constexpr, ELEMENTS: tl.constexpr, ROWS: tl.constexpr):
    """x: [UNITS * ELEMENTS] -> [UNITS], the smallest of each unit's lanes (NaN-free, as per_unit_max)."""
    if ROWS:
        return tl.min(tl.reshape(x, [UNITS, ELEMENTS]), axis=1)
    else:
        return tl.min(tl.reshape(x, [ELEMENTS, UNITS]), axis=0)


@triton.jit
def to_lanes(r, UNITS: tl.constexpr, ELEMENTS: tl.constexpr, ROWS: tl.constexpr):
    """r: [UNITS] -> [UNITS * ELEMENTS], each unit's value on every lane of that unit."""
    if ROWS:
        return tl.reshape(tl.broadcast_to(tl.expand_dims(r, 1), [UNITS, ELEMENTS]), [UNITS * ELEMENTS])
    else:
        return tl.reshape(tl.broadcast_to(tl.expand_dims(r, 0), [ELEMENTS, UNITS]), [UNITS * ELEMENTS])
