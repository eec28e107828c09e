"""Command line: `python -m fusedhooks demo` (see `python -m fusedhooks --help`)."""

import argparse
import os
import sys


def _steps(text: str) -> int:
    steps = int(text)
    if steps < 1:
        raise argparse.ArgumentTypeError(f"takes a number of steps >= 1, not {steps}")
    return steps


def _warps(text: str) -> int:
    warps = int(text)
    if warps < 1 or warps & (warps - 1):
        raise argparse.ArgumentTypeError(f"takes a power of two (1, 2, 4, 8, ...), not {warps}")
    return warps


def _writable(text: str) -> str:
    """A file path whose directory exists or can be made (its nearest existing ancestor is a writable directory)."""
    directory = os.path.dirname(os.path.abspath(text))
    while not os.path.exists(directory):
        directory = os.path.dirname(directory)
    if not os.path.isdir(directory) or not os.access(directory, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {directory} is not a writable directory")
    return text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fusedhooks", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a small model with a compiled clip + statistics hook")
    demo.add_argument("--steps", type=_steps, default=20, help="training steps (default 20)")
    demo.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    demo.add_argument("--backend", default="auto", choices=("auto", "triton", "eager", "reference"),
                      help="on CPU, 'auto' runs the Triton kernels in the interpreter (TRITON_INTERPRET=1)")
    tune = sub.add_parser("tune", help="measure launch configurations for a hook's kernels and cache the best")
    tune.add_argument("--hook", help="module:attr of a fusedhooks GradHook (default: clip + scale + all stats)")
    tune.add_argument("--model", help="module:attr of an nn.Module (or a function returning one): tune for "
                                      "its parameters' sizes and dtypes")
    tune.add_argument("--sizes", help="comma-separated gradient sizes, e.g. 4K,1M,16M")
    tune.add_argument("--dtypes", default="fp32,bf16", help="comma-separated: fp32, bf16, fp16, fp64")
    tune.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    tune.add_argument("--quick", action="store_true", help="few sizes and configurations (CI)")
    tune.add_argument("--out", type=_writable, help="the tuning cache file (default: FUSEDHOOKS_TUNE_CACHE or "
                                    "<cache dir>/tuning.json)")
    build = sub.add_parser("build", help="compile every kernel family for GPU targets (no GPU needed) and report "
                                         "registers, spills and load/store widths")
    build.add_argument("--target", default="cuda:90", help="cuda:80, cuda:90, hip:gfx942, a comma-separated list, "
                                                           "or all (default cuda:90)")
    build.add_argument("--dtypes", default="fp32,bf16,fp16,fp64", help="comma-separated: fp32, bf16, fp16, fp64")
    build.add_argument("--json", type=_writable, help="also write the reports to this file (a list of objects)")
    build.add_argument("--num-warps", type=_warps, default=None, help="override the runtime's warps (default: its "
                                                                     "choice per kernel)")
    args = parser.parse_args(argv)
    if args.command == "build":
        from .build import main as build_main
        return build_main(args)
    if args.command == "tune":
        import torch
        if args.out:
            os.environ["FUSEDHOOKS_TUNE_CACHE"] = args.out
        if not torch.cuda.is_available() and (args.device or "cpu") == "cpu":
            os.environ.setdefault("TRITON_INTERPRET", "1")  # the CPU timer and the interpreter (CI)
        from .tune import main as tune_main
        return tune_main(args)
    if args.command == "demo":
        import torch
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        if device not in ("cpu", "cuda") or (device == "cuda" and not torch.cuda.is_available()):
            parser.error(f"demo --device: cpu{', cuda' if torch.cuda.is_available() else ' (no CUDA device here)'}, "
                         f"not {device!r}")
        if device == "cpu" and args.backend not in ("eager", "reference"):
            os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first kernel is compiled
        from .demo import run_demo
        run_demo(steps=args.steps, device=device, backend=args.backend)
    return 0


if __name__ == "__main__":
    sys.exit(main())
