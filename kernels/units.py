"""Units of a tile: UNITS units side by side, ELEMENTS lanes of each, as one 1-D block.

ROWS: a unit's lanes are adjacent (lane = unit * ELEMENTS + element), else the units are (lane = element * UNITS +
unit); see fusedhooks.dims.Tile. The generated kernels reduce a unit's lanes with tl.sum / tl.max / tl.min of
`as_units` along axis 1 (ROWS) or 0.
"""

import triton
import triton.language as tl


@triton.jit
def as_units(x, UNITS: tl.constexpr, ELEMENTS: tl.constexpr, ROWS: tl.constexpr):
    """x: [UNITS * ELEMENTS] -> [UNITS, ELEMENTS] (ROWS) or [ELEMENTS, UNITS]: a unit's lanes along one axis."""
    if ROWS:
        return tl.reshape(x, [UNITS, ELEMENTS])
    else:
        return tl.reshape(x, [ELEMENTS, UNITS])


@triton.jit
def to_lanes(r, UNITS: tl.constexpr, ELEMENTS: tl.constexpr, ROWS: tl.constexpr):
    """r: [UNITS] -> [UNITS * ELEMENTS], each unit's value on every lane of that unit."""
    if ROWS:
        return tl.reshape(tl.broadcast_to(tl.expand_dims(r, 1), [UNITS, ELEMENTS]), [UNITS * ELEMENTS])
    else:
        return tl.reshape(tl.broadcast_to(tl.expand_dims(r, 0), [ELEMENTS, UNITS]), [UNITS * ELEMENTS])
