"""Command line: `python -m fusedhooks demo` (see `python -m fusedhooks --help`)."""

import argparse
import os
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fusedhooks", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a small model with a compiled clip + statistics hook")
    demo.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    demo.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    demo.add_argument("--backend", default="auto", choices=("auto", "triton", "reference"),
                      help="on CPU, 'auto' runs the Triton kernels in the interpreter (TRITON_INTERPRET=1)")
    args = parser.parse_args(argv)
    if args.command == "demo":
        import torch
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        if device == "cpu" and args.backend != "reference":
            os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first kernel is compiled
        from .demo import run_demo
        run_demo(steps=args.steps, device=device, backend=args.backend)
    return 0


if __name__ == "__main__":
    sys.exit(main())
