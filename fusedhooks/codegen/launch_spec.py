"""How to launch the kernels generated for a plan (`LaunchSpec`), and the layouts it names: the bucket table's parts
(`TABLE_PARTS`), the rows of partial statistics (`PARTIAL_WIDTH`) and the histogram slots (`hist_pad`). The code
generator writes the kernels to them; the runtime, tune, clip and ahead-of-time builds only read them.
"""

from __future__ import annotations

from dataclasses import dataclass

KERNEL_NAME = "fused_hook"
#: fp64 values in a row of partial statistics (kernels.stats.N_PARTIALS): 10 used, padded to a power of two (row
#: offsets are shifts; at 10, ptxas 13.4 spilled a register of a units kernel on sm_90)
PARTIAL_WIDTH = 16
#: The bucket table's per-tensor parts, in order, each n_tensors int64s; then (tensor, block) per program.
TABLE_PARTS = ("grad", "param", "numel", "blocks", "stats_offset", "partials_offset", "n_units", "unit_numel")


@dataclass(frozen=True)
class LaunchSpec:
    """How to launch the kernels generated for a plan; `generate_with_spec` returns it with their source, and
    the runtime, tune and clip only read it.

    args / multi_args: the role of each argument of the single-tensor / bucket (`..._multi`) kernels, in order:
    "grad", "param" (pointers to the spans), "scalar<i>" (closed-over 0-dim tensors), "scale", "found_inf"
    (AMP), "reduced" (fp64 [n_reductions] per tensor), "stats" (the row, or the whole buffer for a bucket),
    "partials" (fp64 [programs, partial_sets, PARTIAL_WIDTH]), "counter" (int32, one per tensor), "hist"
    (int64 [hist_sets, hist_pad] per tensor), "numel", "table" (int64, TABLE_PARTS then programs),
    "n_tensors", then the constexprs "ALIGNED", "BLOCK", "RBLOCK".
    kernels / single_kernels / multi_kernels: the kernels launched, in order, on a grid of several programs,
    on a grid of one program, and for a bucket.
    """

    args: tuple[str, ...]
    multi_args: tuple[str, ...]
    kernels: tuple[str, ...]
    single_kernels: tuple[str, ...]
    multi_kernels: tuple[str, ...]
    n_slots: int
    n_reductions: int
    partial_sets: int
    hist_sets: int
    hist_pad: int
    table_parts: tuple[str, ...] = TABLE_PARTS
    #: (kernel, programs per gradient) of the kernels over the units of one gradient shape (fusedhooks.dims), which
    #: do not run on the grid of blocks; units_values: fp64 per gradient of the units workspace; one_pass: the one
    #: kernel runs over whole units, UNITS per program (the runtime chooses UNITS and ELEMENTS, see units_launch)
    fixed_grids: tuple[tuple[str, int], ...] = ()
    units_values: int = 0
    one_pass: bool = False
    #: fp64 accumulators and int32 counters per gradient of the reduction passes whose programs share blocks of units
    unit_partial_values: int = 0
    unit_counter_values: int = 0

    def kernels_for(self, grid: int) -> tuple[str, ...]:
        """The kernels to launch, in order, for one gradient on a grid of `grid` programs."""
        return self.single_kernels if grid == 1 else self.kernels

    def grid_of(self, kernel: str, blocks: int, n_tensors: int = 1) -> int:
        """Programs of a launch of `kernel` on `n_tensors` gradients (of one shape, for a kernel over units) whose
        blocks number `blocks` in all."""
        return dict(self.fixed_grids).get(kernel, 0) * n_tensors or blocks

    def partial_values(self, programs: int) -> int:
        """fp64 values of partials `programs` programs write."""
        return programs * self.partial_sets * PARTIAL_WIDTH

    @property
    def hist_values(self) -> int:
        """int64 histogram accumulators per tensor."""
        return self.hist_sets * self.hist_pad



def hist_pad(bins: int) -> int:
    """Histogram slots per set: a power of two above `bins` (the extra slots take masked lanes)."""
    return 1 << bins.bit_length() if bins else 1
