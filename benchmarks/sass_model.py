"""A static throughput model of the fused pass: a hook's kernel compiled for a GPU (no GPU needed), its SASS read,
its instructions counted by pipe, and its time predicted against a copy of the gradient (a read and a write). A proxy
between GPU runs, never a substitute for one: every figure it prints is a prediction.

    python benchmarks/sass_model.py                    # the rows of stats_cost.py on an H200, an H100 and an A100
    python benchmarks/sass_model.py --gpus H200 --json model.json

Run it without TRITON_INTERPRET (Triton then compiles for GPU targets; `cuobjdump` ships with Triton).

The model. A program of the single-gradient kernel (`fused_hook`) handles BLOCK elements with W warps, in tiles of
TILE: the first tile in straight-line code, the others in a loop (the SASS's backward branch) that runs
BLOCK / TILE - 1 times (divided by how many tiles ptxas unrolled into it, told by its global loads); each instruction
is issued once per warp (the last program's merge of the partials, once per gradient, is left out: the source is
compiled without it; the statistics are those of a full block, FULL_BLOCKS, what every program but a gradient's last
runs). Inside the loop, a block that a forward conditional branch skips is left out: these are the rare paths (the
running sums rescaled when a tile holds a larger value than the tiles before, a tile's NaN and Inf counted when it
holds one, AMP's found_inf store). Outside the loop every instruction counts, as if it ran. On pipe p an SM spends
W x 32 x N_p / R_p clocks per
program, N_p the program's instructions on p and R_p the pipe's results per clock per SM (CUDA C++ Programming Guide,
"Arithmetic Instructions", throughput table, compute capabilities 8.0 and 9.0); its four schedulers issue at most 4
warp-instructions per clock. The kernel's time is the largest of the pipes' times, the issue time and the memory time
(its bytes at the copy bandwidth of that GPU). The tables print the kernel's time over a copy's of the gradient (a
read and a write, as stats_cost.py measures): 1.00 for a read-and-write pass at the copy's bandwidth, 0.50 for a
read-only one. A plan of several kernels (a reduction pass, then the elementwise one) takes the sum of their times;
a reduction pass over units has no tile before its loop (its loop runs once per tile). Not modelled: latency the
warps cannot hide, clocks below boost under load, caches.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


@dataclass(frozen=True)
class Gpu:
    """What the model needs of a GPU: its architecture, SMs, boost clock and the bandwidth of a device-to-device copy
    (read + write, bytes/s), and where each figure comes from."""

    name: str
    arch: int
    sms: int
    clock_hz: float
    copy_bytes_per_s: float
    copy_source: str


GPUS = {
    "H200": Gpu("H200", 90, 132, 1.98e9, 4.16e12,
                "measured: dst.copy_(src) of 256M bf16 elements, 2026-12-04 (docs/benchmarks.md)"),
    "H100": Gpu("H100", 90, 132, 1.98e9, 2.96e12,
                "assumed: HBM3's 3.35 TB/s x the H200's measured copy over its peak (4.16 / 4.8)"),
    "A100": Gpu("A100", 80, 108, 1.41e9, 1.80e12,
                "assumed: the 80 GB A100's 2.04 TB/s x the H200's measured copy over its peak"),
}

#: Results per clock per SM of each pipe (CUDA C++ Programming Guide, throughput of native arithmetic instructions),
#: by compute capability; a warp-instruction is 32 results.
RATES = {
    80: {"fp32": 64, "fp64": 32, "alu": 64, "half2": 128, "conversion": 16, "shuffle": 32, "mufu": 16},
    90: {"fp32": 128, "fp64": 64, "alu": 64, "half2": 128, "conversion": 16, "shuffle": 32, "mufu": 16},
}

#: SASS opcodes (their first word) by pipe; opcodes in no pipe (memory, control, uniform datapath) only take issue
#: slots. Conversions: F2F, F2I, I2F and the packing F2FP ("all other type conversions" in the guide).
PIPES = {
    "fp32": {"FADD", "FMUL", "FFMA", "FSWZADD"},
    "fp64": {"DADD", "DMUL", "DFMA", "DSETP", "DMNMX"},
    "alu": {"IADD3", "IMAD", "IMNMX", "ISETP", "LOP3", "SHF", "SGXT", "SEL", "FSEL", "FSETP", "FSET", "FMNMX", "LEA",
            "PRMT",
            "VIADD", "IABS", "BMSK", "MOV", "IDP", "VIMNMX", "PLOP3", "P2R", "R2P", "FCHK"},
    "half2": {"HADD2", "HMUL2", "HFMA2", "HSETP2", "HMNMX2"},
    "conversion": {"F2F", "F2I", "I2F", "F2FP", "I2FP", "F2IP", "POPC", "FLO", "BREV"},
    "shuffle": {"SHFL"},
    "mufu": {"MUFU"},
}
_PIPE_OF = {op: pipe for pipe, ops in PIPES.items() for op in ops}
_NOT_ISSUED = {"NOP"}

#: stats_cost.py's rows measured on the H200 at 201b840 (docs/benchmarks.md): the kernel's time over the copy's
MEASURED_TIME_OVER_COPY = {
    "fp32": {"clip + scale, no statistics": 1.06, "+ sum": 1.13, "+ sumsq": 1.12,
             "+ mean, var": 1.27, "+ min, max": 1.26, "+ nan, inf, zeros counts": 1.20,
             "+ all 13 statistics": 1.70, "+ all, and input statistics": 4.42,
             "no body, all statistics (read only)": 1.56},
    "bf16": {"clip + scale, no statistics": 1.47, "+ sum": 1.95, "+ sumsq": 1.83,
             "+ mean, var": 2.46, "+ min, max": 3.33, "+ nan, inf, zeros counts": 2.48,
             "+ all 13 statistics": 4.08, "+ all, and input statistics": 9.10,
             "no body, all statistics (read only)": 2.84},
}

#: The first GPU run's other workloads (H200, one gradient of 256M elements, 201b840; docs/benchmarks.md): median µs
#: of fusedhooks and of torch.compile of the same hook, and of the copy of the same gradient (read + write at the
#: measured 4.25 TB/s fp32, 4.16 TB/s bf16)
MEASURED_WORKLOAD_US = {
    "fp32": {"copy": 505.3, "normalize": (867, 833), "agc": (743, 744), "center_columns": (1186, 775)},
    "bf16": {"copy": 258.1, "normalize": (509, 734), "agc": (633, 373), "center_columns": (1024, 552)},
}

_SASS_LINE = re.compile(r"/\*[0-9a-f]{4,5}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)")
_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,5})\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)([^;]*);")
_TARGET = re.compile(r"0x([0-9a-f]+)\s*$")


def opcodes(sass: str) -> list[str]:
    """The opcodes (first word, without modifiers) of the instructions in `sass` (cuobjdump -sass output)."""
    return _SASS_LINE.findall(sass)


def executed_opcodes(sass: str, tiles: int, tile_load_bytes: float | None = None) -> list[str]:
    """The opcodes a program of `tiles` tiles executes, each as often as it runs: the instructions outside the loop
    once, the loop's (its backward branch's range) for every tile after the first, over the tiles unrolled into one
    of its runs (its global loads over those outside); inside the loop, blocks that a forward conditional branch skips
    are the rare paths, left out. Without a loop (one tile), every instruction once.

    tile_load_bytes: for a loop over every tile (none before it: the reduction passes over units), the bytes a thread
    loads per tile; the loop then runs `tiles` times over the tiles unrolled into one run (its loads' bytes over
    these)."""
    code = []
    for address, predicate, opcode, operands in _INSTRUCTION.findall(sass):
        target = _TARGET.search(operands) if opcode == "BRA" else None
        code.append((int(address, 16), opcode, bool(predicate), int(target.group(1), 16) if target else None,
                     _load_bytes(opcode, operands)))
    loops = [(target, address) for address, opcode, _, target, _ in code if target is not None and target < address]
    if not loops or (tiles <= 1 and tile_load_bytes is None):
        return [opcode for _, opcode, _, _, _ in code]
    start, end = max(loops, key=lambda loop: loop[1] - loop[0])
    rare = [(address, target) for address, opcode, predicated, target, _ in code
            if predicated and target is not None and start <= address < target <= end]
    kept = [(opcode, loaded) for address, opcode, _, _, loaded in code
            if start <= address <= end and not any(a < address < t for a, t in rare)]
    inside = [opcode for opcode, _ in kept]
    outside = [opcode for address, opcode, _, _, _ in code if not start <= address <= end]
    if tile_load_bytes is None:
        per_run = max(1, round(inside.count("LDG") / max(1, outside.count("LDG"))))
        runs = (tiles - 1) / per_run
    else:
        per_run = max(1, round(sum(loaded for _, loaded in kept) / tile_load_bytes))
        runs = tiles / per_run
    counts = collections.Counter(outside)
    for opcode, n in collections.Counter(inside).items():
        counts[opcode] += n * runs
    return [opcode for opcode, n in counts.items() for _ in range(round(n))]


def _load_bytes(opcode: str, operands: str) -> int:
    """Bytes one thread's global load `opcode` (its modifiers lead `operands`: LDG.E.128 ...) reads."""
    if opcode != "LDG":
        return 0
    modifiers = set(operands.split()[0].split(".")) if operands.strip() else set()
    sizes = {"128": 16, "64": 8, "U16": 2, "S16": 2, "U8": 1, "S8": 1}
    return next((size for m, size in sizes.items() if m in modifiers), 4)


def pipe_counts(ops: list[str]) -> dict[str, int]:
    """Instructions by pipe (PIPES), and "issued": every instruction that takes an issue slot."""
    counts = collections.Counter(_PIPE_OF.get(op, "other") for op in ops if op not in _NOT_ISSUED)
    counts["issued"] = sum(1 for op in ops if op not in _NOT_ISSUED)
    return dict(counts)


def predict(counts: dict[str, int], gpu: Gpu, block: int, warps: int, bytes_per_element: int) -> dict:
    """Seconds per element on `gpu` of a kernel whose program (`block` elements, `warps` warps) issues `counts`
    instructions, moving `bytes_per_element`: each pipe's, the issue's and the memory's, the largest (the prediction)
    and which bound it, and the copy's time over it ("copy_ratio")."""
    rates = RATES[gpu.arch]
    per_program = {pipe: warps * 32 * counts.get(pipe, 0) / rate for pipe, rate in rates.items()}
    per_program["issue"] = warps * counts.get("issued", 0) / 4
    seconds = {k: v / block / (gpu.sms * gpu.clock_hz) for k, v in per_program.items()}
    seconds["memory"] = bytes_per_element / gpu.copy_bytes_per_s
    bound = max(seconds, key=seconds.get)
    return {"seconds_per_element": seconds[bound], "bound": bound, "copy_ratio": seconds["memory"] / seconds[bound],
            "by": seconds}


def gpu_of(device, copy_bytes_per_s: float) -> Gpu:
    """The Gpu of the CUDA `device` this process runs on, with the copy bandwidth measured there: the SMs and
    architecture from torch, the boost clock of the GPU of GPUS its name names (else the H200's)."""
    import torch

    props = torch.cuda.get_device_properties(device)
    known = next((g for name, g in GPUS.items() if name in props.name), GPUS["H200"])
    return Gpu(props.name, 10 * props.major, props.multi_processor_count, known.clock_hz, copy_bytes_per_s,
               "measured in this run")


def bytes_per_element(hook, dtype) -> int:
    """What `hook`'s one-pass kernel moves per element of a `dtype` gradient: a read, and a write when the body
    writes."""
    return (2 if hook.graph(dtype).writes else 1) * dtype.itemsize


@dataclass(frozen=True)
class Pass:
    """One kernel of a hook's plan as the model counts it: its SASS, a program's `elements` in `tiles` steps (the
    first before the loop; with `tile_load_bytes`, every one in it, a thread loading that many bytes per step), its
    warps, and the bytes it moves per element of the gradient."""

    name: str
    sass: str
    elements: int
    tiles: int
    tile_load_bytes: float | None
    warps: int
    bytes_per_element: int

    def counts(self) -> dict[str, int]:
        """Instructions a program executes, by pipe (executed_opcodes, pipe_counts)."""
        return pipe_counts(executed_opcodes(self.sass, self.tiles, self.tile_load_bytes))


def over_copy(seconds_per_element: float, dtype, gpu: Gpu) -> float:
    """A time per element of a `dtype` gradient over a copy's of it on `gpu` (a read and a write, as stats_cost.py
    measures)."""
    return seconds_per_element / (2 * dtype.itemsize / gpu.copy_bytes_per_s)


def predicted_time_over_copy(hook, dtype, gpu: Gpu, shape: tuple[int, ...] | None = None) -> float:
    """The predicted time of `hook`'s kernels for one `dtype` gradient (of `shape` when its body reduces over
    dimensions, else of many blocks) on `gpu`, over a copy of the gradient: the sum of its passes' times."""
    return over_copy(sum(predict(p.counts(), gpu, p.elements, p.warps, p.bytes_per_element)["seconds_per_element"]
                         for p in plan_passes(hook, dtype, gpu.arch, shape)), dtype, gpu)


def tiles_per_program(block: int, source: str) -> int:
    """The tiles a program of `block` elements steps through, the tile read from the kernel's `source` (its
    `TILE: tl.constexpr = min(BLOCK, N)` line: codegen.kernel_writer.tile_elements)."""
    tile = re.search(r"TILE: tl\.constexpr = min\(BLOCK, (\d+)\)", source)
    if tile is None:  # a kernel over blocks without its tile's line: the model would count one tile, silently
        raise ValueError("sass_model: no `TILE: tl.constexpr = min(BLOCK, N)` line in a kernel over blocks")
    return max(1, block // int(tile.group(1)))


def _without_merge(source: str) -> str:
    """The generated source without the last program's merge (`if done == ...:` and its block: the statistics' or
    the reduction passes' over units)."""
    lines, out, skipping = source.splitlines(), [], None
    for line in lines:
        indent = len(line) - len(line.lstrip())
        if skipping is not None:
            if line.strip() and indent <= skipping:
                skipping = None
            else:
                continue
        if line.strip().startswith("if done == "):
            skipping = indent
            out.append(" " * indent + "if done == -1:  # the merge, left out")
            out.append(" " * (indent + 4) + "pass")
            continue
        out.append(line)
    return "\n".join(out) + "\n"


def plan_passes(hook, dtype, arch: int, shape: tuple[int, ...] | None = None) -> list[Pass]:
    """The kernels `hook` launches for one `dtype` gradient (of `shape` when its body reduces over dimensions, else
    of 256M elements), compiled for sm_`arch` without their last program's merge. Left out: a whole-tensor reduction
    of values reduced over dimensions (one program over one value per unit)."""
    import math

    import torch  # noqa: F401  (fusedhooks needs it first)

    from fusedhooks.codegen.generate import generate_with_spec
    from fusedhooks.codegen.kernel_cache import load
    from fusedhooks.compiler import dims
    from fusedhooks.compiler.plan import make_plan
    from fusedhooks.runtime.launcher import RBLOCK, default_block, default_num_warps

    block = default_block(dtype)
    numel = math.prod(shape) if shape else 1 << 28
    graph = hook.graph(dtype, shape if hook.reduces_over_dims else None)
    plan = make_plan(graph, hook.stat_names, hook.input_stat_names, numel=numel, hist_range=hook.hist_range,
                     block=block)
    source, spec = generate_with_spec(plan, "cuda")
    module = load(_without_merge(source), spec)
    units_reductions = {}
    if plan.units is not None and not spec.one_pass:
        for launch in plan.units.schedule(graph):
            if launch[0] == "units":
                _, level, k, group = launch
                units_reductions[f"reduce_units{level}_{k}"] = group[0]
    passes = []
    for name in spec.kernels:
        if name.startswith("reduce_whole"):
            continue
        fn = getattr(module, name)
        signature = module.SIGNATURES[name]
        constexprs = {"ALIGNED": True, "BLOCK": block, "RBLOCK": RBLOCK, "FULL_BLOCKS": True}
        if spec.one_pass:
            constexprs.update(dims.units_launch(block, [plan.units.unit_sizes], dtype.itemsize))
        constexprs = {k: v for k, v in constexprs.items() if k in signature}
        warps = default_num_warps(block, dtype)
        reads = sum(f"tl.load({ptr} + offs" in fn.src for ptr in ("grad_ptr", "param_ptr"))
        moved = (reads + ("tl.store(grad_ptr + offs" in fn.src)) * dtype.itemsize
        if name in units_reductions:
            r = units_reductions[name]
            tile = plan.units.reduce_tile(r)
            _, span = plan.units.reduce_splits(r)
            tiles = -(-span // tile.elements)
            passes.append(Pass(name, _sass(fn, signature, constexprs, warps, arch), tile.units * span, tiles,
                               tile.size * reads * dtype.itemsize / (warps * 32), warps, moved))
        elif spec.one_pass:
            passes.append(Pass(name, _sass(fn, signature, constexprs, warps, arch),
                               constexprs["UNITS"] * constexprs["ELEMENTS"], 1, None, warps, moved))
        else:
            passes.append(Pass(name, _sass(fn, signature, constexprs, warps, arch), block,
                               tiles_per_program(block, fn.src), None, warps,
                               moved))
    return passes


def _sass(fn, signature: dict, constexprs: dict, warps: int, arch: int) -> str:
    """The SASS of Triton kernel `fn` compiled for sm_`arch` (pointers 16-byte aligned, as at an aligned launch)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    attrs = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(signature.values()) if t.startswith("*")}
    compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": warps, "enable_fp_fusion": False})
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(compiled.asm["cubin"])
        return subprocess.run([str(cuobjdump), "-sass", str(path)], capture_output=True, text=True,
                              check=True).stdout


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", default="H200,H100,A100", help=f"comma-separated, of {', '.join(GPUS)}")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows to this JSON file")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        ap.error("unset TRITON_INTERPRET: the model compiles for GPU targets")
    gpus = [GPUS[g] for g in args.gpus.split(",")]
    from stats_cost import SUBSETS, subset_hook

    from fusedhooks.cli.build import DTYPES

    rows = []
    print("Predicted, not measured: time over a copy of the gradient, read + write (measured: stats_cost.py on an "
          "H200, docs/benchmarks.md). Instructions per element by pipe on sm_90.\n")
    print("| dtype | kernel | " + " | ".join(f"{g.name} predicted" for g in gpus)
          + " | H200 measured | bound (sm_90) | per element: fp32 / fp64 / alu / conv / shfl |")
    print("|---|---|" + "---:|" * (len(gpus) + 1) + "---|---|")
    for dname in args.dtypes.split(","):
        dtype = DTYPES[dname]
        for name, with_body, stats in SUBSETS:
            hook = subset_hook(with_body, stats)
            moved = bytes_per_element(hook, dtype)
            row = {"dtype": dname, "kernel": name, "bytes_per_element": moved, "gpus": {}}
            by_arch = {}
            for gpu in gpus:
                if gpu.arch not in by_arch:
                    (kernel,) = plan_passes(hook, dtype, gpu.arch)
                    by_arch[gpu.arch] = (kernel.counts(), kernel.elements, kernel.warps)
                counts, block, warps = by_arch[gpu.arch]
                prediction = predict(counts, gpu, block, warps, moved)
                # over a copy of the gradient, for the read-only row too
                row["gpus"][gpu.name] = {"time_over_copy": over_copy(prediction["seconds_per_element"], dtype, gpu),
                                         **prediction,
                                         "counts": counts, "block": block, "warps": warps}
            measured = MEASURED_TIME_OVER_COPY.get(dname, {}).get(name)
            row["h200_measured_time_over_copy"] = measured
            rows.append(row)
            sm90 = next((v for g, v in row["gpus"].items() if GPUS[g].arch == 90), None)
            per_element = "-"
            if sm90 is not None:
                threads = sm90["warps"] * 32
                per_element = " / ".join(f"{sm90['counts'].get(p, 0) * threads / sm90['block']:.1f}"
                                         for p in ("fp32", "fp64", "alu", "conversion", "shuffle"))
            print(f"| {dname} | {name} | "
                  + " | ".join(f"{v['time_over_copy']:.2f}" for v in row["gpus"].values())
                  + f" | {'-' if measured is None else f'{measured:.2f}'} | {sm90['bound'] if sm90 else '-'} | "
                  + f"{per_element} |")
    workloads = _workload_rows(gpus, args.dtypes.split(","))
    print("\nGPUs: " + "; ".join(f"{g.name}: sm_{g.arch}, {g.sms} SMs at {g.clock_hz / 1e9:.2f} GHz, copy "
                                  f"{g.copy_bytes_per_s / 1e12:.2f} TB/s ({g.copy_source})" for g in gpus))
    if args.json:
        args.json.write_text(json.dumps({"gpus": [asdict(g) for g in gpus], "rows": rows, "workloads": workloads},
                                        indent=1))
    return 0


def _workload_rows(gpus: list[Gpu], dtypes: list[str]) -> list[dict]:
    """The other workloads of the benchmark (workloads.py: normalise by the norm, AGC, centre the columns) on one
    gradient of 256M elements: each kernel of the plan predicted, their sum over the copy's time, printed beside the
    first GPU run's fusedhooks and torch.compile (MEASURED_WORKLOAD_US)."""
    from workloads import WORKLOADS

    from fusedhooks.cli.build import DTYPES

    print("\nOther workloads, one gradient of 256M elements: predicted time over the copy's (sum of the plan's "
          "kernels), beside the first run's (H200, 201b840) fusedhooks and torch.compile of the same hook.\n")
    print("| dtype | workload | kernels | " + " | ".join(f"{g.name} predicted" for g in gpus)
          + " | H200 measured | torch.compile measured | bound per kernel (sm_90) |")
    print("|---|---|---|" + "---:|" * (len(gpus) + 2) + "---|")
    rows = []
    for dname in dtypes:
        dtype = DTYPES[dname]
        measured = MEASURED_WORKLOAD_US.get(dname, {})
        for name in ("normalize", "agc", "center_columns"):
            w = WORKLOADS[name]
            hook, shape = w.fusedhooks_hook(None), w.param_shape(1 << 28)
            row = {"dtype": dname, "workload": name, "shape": list(shape), "gpus": {}}
            by_arch = {}
            for gpu in gpus:
                if gpu.arch not in by_arch:
                    by_arch[gpu.arch] = [(k.name, k.counts(), k.elements, k.warps, k.bytes_per_element)
                                         for k in plan_passes(hook, dtype, gpu.arch, shape)]
                kernels = [(name_, predict(counts, gpu, elements, warps, moved))
                           for name_, counts, elements, warps, moved in by_arch[gpu.arch]]
                seconds = sum(p["seconds_per_element"] for _, p in kernels)
                row["gpus"][gpu.name] = {"time_over_copy": over_copy(seconds, dtype, gpu),
                                         "kernels": {k: {"bound": p["bound"], "seconds_per_element":
                                                         p["seconds_per_element"]} for k, p in kernels}}
            fh_us, compiled_us = measured.get(name, (None, None))
            row["h200_measured_time_over_copy"] = fh_us / measured["copy"] if fh_us else None
            row["h200_torch_compile_time_over_copy"] = compiled_us / measured["copy"] if compiled_us else None
            rows.append(row)
            sm90 = next((v for g, v in row["gpus"].items() if GPUS[g].arch == 90), None)
            shown = [row["h200_measured_time_over_copy"], row["h200_torch_compile_time_over_copy"]]
            print(f"| {dname} | {w.title} | {', '.join(row['gpus'][gpus[0].name]['kernels'])} | "
                  + " | ".join(f"{v['time_over_copy']:.2f}" for v in row["gpus"].values()) + " | "
                  + " | ".join("-" if v is None else f"{v:.2f}" for v in shown) + " | "
                  + (", ".join(k["bound"] for k in sm90["kernels"].values()) if sm90 else "-") + " |")
    return rows


if __name__ == "__main__":
    sys.exit(main())
