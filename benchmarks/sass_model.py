"""A static throughput model of the fused pass: a hook's kernel compiled for a GPU (no GPU needed), its SASS read,
its instructions counted by pipe, and its time predicted against a copy of the same bytes. A proxy between GPU runs,
never a substitute for one: every figure it prints is a prediction.

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
(its bytes at the copy bandwidth of that GPU); "x copy" is the copy's time over the kernel's, the fraction of a
copy's bandwidth it reaches. Not modelled: latency the warps cannot hide, clocks below boost under load, caches.
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

_SASS_LINE = re.compile(r"/\*[0-9a-f]{4,5}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)")
_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,5})\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)([^;]*);")
_TARGET = re.compile(r"0x([0-9a-f]+)\s*$")


def opcodes(sass: str) -> list[str]:
    """The opcodes (first word, without modifiers) of the instructions in `sass` (cuobjdump -sass output)."""
    return _SASS_LINE.findall(sass)


def executed_opcodes(sass: str, tiles: int) -> list[str]:
    """The opcodes a program of `tiles` tiles executes, each as often as it runs: the instructions outside the loop
    once, the loop's (its backward branch's range) for every tile after the first, over the tiles unrolled into one
    of its runs (its global loads over those outside); inside the loop, blocks that a forward conditional branch skips
    are the rare paths, left out. Without a loop (one tile), every instruction once."""
    code = []
    for address, predicate, opcode, operands in _INSTRUCTION.findall(sass):
        target = _TARGET.search(operands) if opcode == "BRA" else None
        code.append((int(address, 16), opcode, bool(predicate), int(target.group(1), 16) if target else None))
    loops = [(target, address) for address, opcode, _, target in code if target is not None and target < address]
    if not loops or tiles <= 1:
        return [opcode for _, opcode, _, _ in code]
    start, end = max(loops, key=lambda loop: loop[1] - loop[0])
    rare = [(address, target) for address, opcode, predicated, target in code
            if predicated and target is not None and start <= address < target <= end]
    inside = [opcode for address, opcode, _, _ in code
              if start <= address <= end and not any(a < address < t for a, t in rare)]
    outside = [opcode for address, opcode, _, _ in code if not start <= address <= end]
    per_run = max(1, round(inside.count("LDG") / max(1, outside.count("LDG"))))
    runs = (tiles - 1) / per_run
    counts = collections.Counter(outside)
    for opcode, n in collections.Counter(inside).items():
        counts[opcode] += n * runs
    return [opcode for opcode, n in counts.items() for _ in range(round(n))]


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


def predicted_time_over_copy(hook, dtype, gpu: Gpu) -> float:
    """The predicted time of `hook`'s one-pass kernel for `dtype` on `gpu`, over a copy of the same bytes."""
    sass, block, warps = kernel_sass(hook, dtype, gpu.arch)
    ops = executed_opcodes(sass, tiles_per_program(block, dtype))
    return 1 / predict(pipe_counts(ops), gpu, block, warps, bytes_per_element(hook, dtype))["copy_ratio"]


def tiles_per_program(block: int, dtype) -> int:
    """The tiles a program of `block` elements of `dtype` steps through (the generated kernels' TILE)."""
    from fusedhooks.codegen.kernel_writer import TILE_ELEMENTS

    return max(1, block // TILE_ELEMENTS[dtype])


def _without_merge(source: str) -> str:
    """The generated source without the last program's merge (`if done == num_blocks - 1:` and its block)."""
    lines, out, skipping = source.splitlines(), [], None
    for line in lines:
        indent = len(line) - len(line.lstrip())
        if skipping is not None:
            if line.strip() and indent <= skipping:
                skipping = None
            else:
                continue
        if line.strip().startswith("if done == num_blocks - 1:"):
            skipping = indent
            out.append(line.replace("if done == num_blocks - 1:", "if done == -1:  # the merge, left out"))
            out.append(" " * (indent + 4) + "pass")
            continue
        out.append(line)
    return "\n".join(out) + "\n"


def kernel_sass(hook, dtype, arch: int) -> tuple[str, int, int]:
    """(SASS, BLOCK, warps) of `hook`'s single-gradient kernel for `dtype` on sm_`arch`, without the merge."""
    import torch  # noqa: F401  (fusedhooks needs it first)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from fusedhooks.codegen.generate import generate_with_spec
    from fusedhooks.codegen.kernel_cache import load
    from fusedhooks.compiler.plan import make_plan
    from fusedhooks.runtime.launcher import default_block, default_num_warps

    plan = make_plan(hook.graph(dtype), hook.stat_names, hook.input_stat_names, hist_range=hook.hist_range)
    if plan.passes != 1 or plan.units is not None:
        raise ValueError("the model covers one-pass kernels over blocks")
    source, spec = generate_with_spec(plan, "cuda")
    module = load(_without_merge(source), spec)
    signature = module.SIGNATURES["fused_hook"]
    block = default_block(dtype)
    warps = default_num_warps(block, dtype)
    constexprs = {k: v for k, v in {"ALIGNED": True, "BLOCK": block, "RBLOCK": 1024, "FULL_BLOCKS": True}.items()
                  if k in signature}
    attrs = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(signature.values()) if t.startswith("*")}
    options = {"num_warps": warps, "enable_fp_fusion": False}
    compiled = triton.compile(ASTSource(module.fused_hook, signature, constexprs, attrs),
                              target=GPUTarget("cuda", arch, 32), options=options)
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(compiled.asm["cubin"])
        sass = subprocess.run([str(cuobjdump), "-sass", str(path)], capture_output=True, text=True, check=True).stdout
    return sass, block, warps


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
    print("Predicted, not measured: time over a copy of the same bytes (measured: stats_cost.py on an H200, "
          "docs/benchmarks.md). Instructions per element by pipe on sm_90.\n")
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
                    sass, block, warps = kernel_sass(hook, dtype, gpu.arch)
                    ops = executed_opcodes(sass, tiles_per_program(block, dtype))
                    by_arch[gpu.arch] = (pipe_counts(ops), block, warps)
                counts, block, warps = by_arch[gpu.arch]
                prediction = predict(counts, gpu, block, warps, moved)
                row["gpus"][gpu.name] = {"time_over_copy": 1 / prediction["copy_ratio"], **prediction,
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
    print("\nGPUs: " + "; ".join(f"{g.name}: sm_{g.arch}, {g.sms} SMs at {g.clock_hz / 1e9:.2f} GHz, copy "
                                  f"{g.copy_bytes_per_s / 1e12:.2f} TB/s ({g.copy_source})" for g in gpus))
    if args.json:
        args.json.write_text(json.dumps({"gpus": [asdict(g) for g in gpus], "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
