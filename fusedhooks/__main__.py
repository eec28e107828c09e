"""The fusedhooks command line.

  demo   train a small model with a compiled clip + statistics hook; print what it measured and its plan
  tune   time launch configurations of a hook's kernels on this GPU and cache the fastest (CUDA; on CPU,
         where the kernels run in the Triton interpreter, only with --force)
  build  compile every kernel family for GPU targets (no GPU needed); report registers, spills and the widths
         of global loads and stores

`python -m fusedhooks COMMAND --help` lists a command's options.
"""

import argparse
import importlib
import os
import sys


def _whole_number(text: str, takes: str) -> int:
    """`text` as an int, else argparse.ArgumentTypeError saying what the argument `takes` (argparse names the
    argument: "argument --steps: takes ...")."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes {takes}, not {text!r}") from None


def _steps(text: str) -> int:
    takes = "a whole number of steps >= 1"
    steps = _whole_number(text, takes)
    if steps < 1:
        raise argparse.ArgumentTypeError(f"takes {takes}, not {steps}")
    return steps


def _warps(text: str) -> int:
    takes = "a power of two (1, 2, 4, 8, ...)"
    warps = _whole_number(text, takes)
    if warps < 1 or warps & (warps - 1):
        raise argparse.ArgumentTypeError(f"takes {takes}, not {warps}")
    return warps


def _writable(text: str) -> str:
    """A file path whose directory exists or can be made (its nearest existing ancestor is a writable directory)."""
    directory = os.path.dirname(os.path.abspath(text))
    while not os.path.exists(directory):
        directory = os.path.dirname(directory)
    if not os.path.isdir(directory) or not os.access(directory, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {directory} is not a writable directory")
    return text


def _device(parser: argparse.ArgumentParser, option: str, text: str | None) -> str:
    """--device: "cpu", "cuda" or "cuda:N" of a CUDA device torch sees (default: cuda if available, else cpu);
    anything else is a usage error."""
    import torch

    cuda = torch.cuda.is_available()
    if text is None:
        return "cuda" if cuda else "cpu"
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        parser.error(f"{option}: cpu or cuda, not {text!r}")
    if device.type == "cuda" and not cuda:
        why = "this torch is built without CUDA" if torch.version.cuda is None else "torch sees no CUDA device"
        parser.error(f"{option} {text}: {why}; run on a machine with a CUDA GPU, or use --device cpu")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        parser.error(f"{option} {text}: there are {torch.cuda.device_count()} CUDA device(s) here")
    return text


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fusedhooks", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    about = "train a small model with a compiled clip + statistics hook; print what it measured and its plan"
    demo = sub.add_parser("demo", help=about, description=about)
    demo.add_argument("--steps", type=_steps, default=20, help="training steps (default 20)")
    demo.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    demo.add_argument("--backend", default="auto", choices=("auto", "triton", "eager", "reference"),
                      help="on CPU, 'auto' runs the Triton kernels in the interpreter (TRITON_INTERPRET=1)")
    about = "time launch configurations (BLOCK, warps, stages) of a hook's kernels and cache the fastest"
    tune = sub.add_parser("tune", help=about, description=about + ". It prints a line per configuration to stderr "
                          "(a bar with tqdm). On CPU the kernels run in the Triton interpreter, whose timings say "
                          "nothing about a GPU: it tunes there only with --force, in quick mode.")
    tune.add_argument("--hook", help="module:attr of a fusedhooks GradHook (default: clip + scale + all stats)")
    tune.add_argument("--model", help="module:attr of an nn.Module (or a function returning one): tune for "
                                      "its parameters' sizes and dtypes")
    tune.add_argument("--sizes", help="comma-separated gradient sizes, e.g. 4K,1M,16M")
    tune.add_argument("--dtypes", default="fp32,bf16", help="comma-separated: fp32, bf16, fp16, fp64")
    tune.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda if available)")
    tune.add_argument("--quick", action="store_true", help="few sizes and configurations (CI)")
    tune.add_argument("--force", action="store_true", help="tune on CPU anyway: the Triton interpreter's timings, "
                                                           "in quick mode (CI checks the mechanism this way)")
    tune.add_argument("--out", type=_writable, help="the tuning cache file (default: FUSEDHOOKS_TUNE_CACHE or "
                                    "<cache dir>/tuning.json)")
    about = ("compile every kernel family for GPU targets (no GPU needed) and report registers, spills and "
             "load/store widths")
    build = sub.add_parser("build", help=about, description=about + ", a line per kernel (progress on stderr). "
                           "Run it without TRITON_INTERPRET.")
    build.add_argument("--target", default="cuda:90", help="cuda:80, cuda:90, hip:gfx942, a comma-separated list, "
                                                           "or all (default cuda:90)")
    build.add_argument("--dtypes", default="fp32,bf16,fp16,fp64", help="comma-separated: fp32, bf16, fp16, fp64")
    build.add_argument("--json", type=_writable, help="also write the reports to this file (a list of objects)")
    build.add_argument("--num-warps", type=_warps, default=None, help="override the runtime's warps (default: its "
                                                                     "choice per kernel)")
    args = parser.parse_args(argv)
    if args.command == "build":
        from .cli.build import main as build_main
        try:
            return build_main(args)
        except argparse.ArgumentTypeError as e:
            build.error(str(e))
    if args.command == "tune":
        args.device = _device(tune, "tune --device", args.device)
        if args.out:
            os.environ["FUSEDHOOKS_TUNE_CACHE"] = args.out
        if args.device == "cpu":
            os.environ.setdefault("TRITON_INTERPRET", "1")  # the CPU timer and the interpreter (--force)
        from .cli.tune import main as tune_main
        try:
            return tune_main(args)
        except argparse.ArgumentTypeError as e:
            tune.error(str(e))
    if args.command == "demo":
        device = _device(demo, "demo --device", args.device)
        backend = args.backend
        if device == "cpu" and backend not in ("eager", "reference"):
            if not _importable("numpy"):  # Triton's interpreter needs numpy; torch's CPU wheel does not
                if backend == "triton":
                    demo.error("--backend triton on CPU runs Triton's interpreter, which needs numpy: pip install "
                               "'numpy<2.4' (or use --backend eager)")
                print("numpy is not installed, and Triton's interpreter needs it: the demo runs on the eager CPU "
                      "backend (pip install 'numpy<2.4' to run the Triton kernels in the interpreter)")
                backend = "eager"
            else:
                os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first kernel is compiled
        from .cli.demo import run_demo
        run_demo(steps=args.steps, device=device, backend=backend)
    return 0


if __name__ == "__main__":
    sys.exit(main())
