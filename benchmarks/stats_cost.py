"""Where the fused pass's time goes: the same body (clamp, times -1) with one statistics subset at a time, on one large
gradient, beside a device-to-device copy of the same bytes. Each row is one kernel; the differences between rows
are the cost of each statistic (the first GPU run measured clip + all stats far below the copy's bandwidth).

    python benchmarks/stats_cost.py --size 256M --out stats_cost.json     # on a CUDA machine

On a CUDA machine each row also shows the time benchmarks/sass_model.py predicts from the kernel's SASS, on this GPU
with the copy bandwidth measured here (`--no-predict`: measure only).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sass_model  # noqa: E402
from harness import Timer, device_name, environment, human, synchronize  # noqa: E402

import fusedhooks as fh  # noqa: E402
from fusedhooks.cli.build import DTYPES  # noqa: E402
from fusedhooks.cli.tune import parse_size  # noqa: E402

#: (row name, body or None for no body, stats)
SUBSETS = (
    ("clip + scale, no statistics", True, ()),
    ("+ sum", True, ("sum",)),
    ("+ sumsq", True, ("sumsq",)),
    ("+ mean, var", True, ("mean", "var")),
    ("+ min, max", True, ("min", "max")),
    ("+ nan, inf, zeros counts", True, ("nan", "inf", "zeros")),
    ("+ all 13 statistics", True, "all"),
    ("+ all, and input statistics", True, "all+input"),
    ("no body, all statistics (read only)", False, "all"),
)


def subset_hook(with_body: bool, stats) -> fh.GradHook:
    """The hook of a SUBSETS row: clamp then times -1 (repeated calls keep the values), or no body; its statistics
    ("all+input": every statistic of the output and of the input)."""
    body = (lambda g: g.clamp(-1.0, 1.0) * -1.0) if with_body else None
    if stats == "all+input":
        return fh.grad_hook(body, stats="all", input_stats="all")
    return fh.grad_hook(body, stats=stats)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="256M", help="gradient elements (1M = 2**20)")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--out", type=Path, default=None, help="write the rows to this JSON file")
    ap.add_argument("--no-predict", action="store_true", help="leave out the prediction from the SASS")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: a smoke run of this script (interpreter timings say nothing about a GPU)")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here")
    device = torch.device(args.device)
    numel = parse_size(args.size)
    timer = Timer(device, warmup_ms=10, rep_ms=50, cpu_budget_s=0.0)
    rows = []
    print(f"# {device_name(device)}, {human(numel)} elements\n")
    predict = device.type == "cuda" and not args.no_predict
    print("| dtype | kernel | median µs | × copy time | predicted × copy time | GB/s |\n|---|---|---:|---:|---:|---:|")
    for dname in args.dtypes.split(","):
        dtype = DTYPES[dname]
        grad = torch.randn(numel, device=device).to(dtype)
        dst = torch.empty_like(grad)
        copy_us = timer(lambda: dst.copy_(grad))[0]  # noqa: B023 - called at once
        rows.append({"dtype": dname, "kernel": "copy", "us": copy_us})
        print(f"| {dname} | device-to-device copy | {copy_us:.1f} | 1.00 | 1.00 | "
              f"{2 * grad.element_size() * numel / copy_us / 1e3:.0f} |")
        gpu = sass_model.gpu_of(device, 2 * grad.element_size() * numel / copy_us * 1e6) if predict else None
        param = torch.zeros(numel, device=device, dtype=dtype, requires_grad=True)
        param.grad = grad
        for name, with_body, stats in SUBSETS:
            hook = subset_hook(with_body, stats)
            hook(param)  # compile
            synchronize(device)
            us = timer(lambda: hook(param))[0]  # noqa: B023 - called at once
            moved = sass_model.bytes_per_element(hook, dtype) * numel
            predicted = sass_model.predicted_time_over_copy(hook, dtype, gpu) if predict else None
            rows.append({"dtype": dname, "kernel": name, "us": us, "copy_ratio": copy_us / us,
                         "predicted_time_over_copy": predicted})
            shown = "-" if predicted is None else f"{predicted:.2f}"
            print(f"| {dname} | {name} | {us:.1f} | {us / copy_us:.2f} | {shown} | {moved / us / 1e3:.0f} |")
    if args.out:
        args.out.write_text(json.dumps({"environment": environment(device), "numel": numel, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
