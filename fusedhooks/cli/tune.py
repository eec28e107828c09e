"""`python -m fusedhooks tune`: measure launch configurations for a hook's kernels and cache the best.

For each dtype, the hook's kernels are run on gradients of each size with every candidate (BLOCK,
num_warps, num_stages). Before every trial the gradient is restored from a copy (as triton's autotune
`restore_value`) and the statistics are overwritten by the firing itself (the partials and counters the
kernels use are reset by the kernels, as `reset_to_zero` would): no trial corrupts the next. One BLOCK is
chosen for all sizes (the fastest in total), then num_warps/num_stages per size; see `tuning` for the file.
On a GPU trials are timed with CUDA events; under the interpreter with a CPU timer.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import inspect
import itertools
import sys
import time

import torch

from ..api import GradHook, grad_hook
from ..config import tune_cache
from ..runtime import launcher, tuning
from .progress import Progress

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}


def default_hook() -> GradHook:
    """The hook tuned when none is given: clip + scale with every statistic."""
    return grad_hook(lambda grad: grad.clamp(-1.0, 1.0) * 0.5, stats="all")


def candidates(device: torch.device, quick: bool) -> list[dict]:
    """The launch configurations tune tries: BLOCKs of 2 to 32 tiles a program, around the default
    (runtime.launcher.DEFAULT_BLOCK; quick: two small ones, for the interpreter), and warps and stages on CUDA."""
    blocks = (2048, 4096) if quick else (4096, 8192, 16384, 32768, 65536)
    warps = (4,) if quick or device.type != "cuda" else (4, 8, 16)
    stages = (1,) if quick or device.type != "cuda" else (1, 2, 3)
    return [{"block": b, "num_warps": w, "num_stages": s} for b, w, s in itertools.product(blocks, warps, stages)]


def parse_size(text: str) -> int:
    """A gradient size: `4096`, `4K` (x 1024), `1M`, `1G`; ValueError for anything else or a size < 1."""
    number = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(number[-1:], 1)
    try:
        size = int(float(number[:-1] if scale > 1 else number) * scale)
    except ValueError:
        raise ValueError(f"a size is a number of elements, e.g. 4096, 4K or 1M, not {text!r}") from None
    if size < 1:
        raise ValueError(f"a size is a number of elements >= 1, not {text!r}")
    return size


def _timer(device: torch.device):
    if device.type == "cuda":
        def timed(fn) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
    else:
        def timed(fn) -> float:
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
    return timed


def tune(hook: GradHook, sizes: list[int], dtypes: list[torch.dtype], device: torch.device, quick: bool = False,
         reps: int = 3) -> dict:
    """Tune `hook`'s kernels on `device`; returns {digest: entry} and writes them to the tuning cache."""
    if hook.reduces_over_dims:
        raise ValueError(f"{hook.__name__} reduces over dimensions: its kernels are planned per gradient shape, which "
                         "tuning (by size) does not cover yet; its launches use the untuned BLOCK and warps")
    timed = _timer(device)
    configs = candidates(device, quick)
    results = {}
    progress = Progress(len(dtypes) * len(sizes) * len(configs), "fusedhooks tune")
    for dtype in dtypes:
        compiled = hook.compiled(dtype, device)
        if compiled.plan.backend != "triton":
            raise RuntimeError(f"tuning needs the triton backend: CUDA, or TRITON_INTERPRET=1 on CPU ({device})")
        module, plan = compiled.kernel, compiled.plan
        workspace = launcher.Workspace(device)
        stats = torch.zeros(max(len(plan.slots), 1), dtype=torch.float64, device=device)
        tried = []
        for numel in sizes:
            param = torch.zeros(numel, dtype=dtype, device=device)
            saved = (torch.randn(numel, device=device) * 1e-2).to(dtype)
            grad = saved.clone()
            for config in configs:
                trial = _trial(plan, module, grad, param, hook.scalars, stats, workspace, config)
                grad.copy_(saved)
                trial()  # compile and warm up
                times = []
                for _ in range(reps):
                    grad.copy_(saved)  # restore_value: every trial sees the same gradient
                    times.append(timed(trial))
                tried.append({**config, "size": numel, "ms": sorted(times)[len(times) // 2]})
                progress.step(f"{str(dtype).removeprefix('torch.')} size {numel:,} BLOCK={config['block']} "
                              f"warps={config['num_warps']} stages={config['num_stages']}: {tried[-1]['ms']:.3f} ms")
        best_block = min({c["block"] for c in configs},
                         key=lambda b: sum(min(t["ms"] for t in tried if t["block"] == b and t["size"] == n)
                                           for n in sizes))
        per_size = {}
        for numel in sizes:
            best = min((t for t in tried if t["block"] == best_block and t["size"] == numel), key=lambda t: t["ms"])
            per_size[tuning.size_key(numel)] = {"num_warps": best["num_warps"], "num_stages": best["num_stages"]}
        entry = {"block": best_block, "sizes": per_size, "tried": tried, "dtype": str(dtype)}
        tuning.store(device, module.DIGEST, entry)
        results[module.DIGEST] = entry
    progress.close()
    return results


def _trial(plan, module, grad, param, scalars, stats, workspace, config: dict):
    """One firing of the single-gradient kernels with the launch configuration `config`, bound once."""
    param = param if plan.graph.uses_param else None
    bound = launcher.bind_single(module, grad.numel(), launcher.aligned(grad, param), grad.device, grad.dtype,
                                workspace, scalars, config)
    amp = _amp_for_tuning(plan, grad.device) if plan.amp else (None, None)
    return functools.partial(bound.run, (grad, param, stats, *amp))


def _amp_for_tuning(plan, device):
    if not plan.amp:
        return None
    return torch.ones((), device=device), torch.zeros((), device=device)


def load_object(spec: str):
    """`module:attr` -> the object; argparse.ArgumentTypeError with a message when it cannot be found."""
    module_name, _, attr = spec.partition(":")
    try:
        obj = importlib.import_module(module_name)
        for part in attr.split(".") if attr else ():
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise argparse.ArgumentTypeError(f"cannot load {spec!r} (module:attr): {e}") from None
    return obj


def load_model(spec: str) -> torch.nn.Module:
    """`--model module:attr`: an nn.Module, or a function of no arguments returning one (called here)."""
    obj = load_object(spec)
    what = "--model takes an nn.Module or a function of no arguments returning one (its parameters give the sizes " \
           "and dtypes to tune)"
    hook = f"a fusedhooks GradHook: pass it with --hook; {what}"
    if isinstance(obj, GradHook):
        raise argparse.ArgumentTypeError(f"--model {spec} is {hook}")
    if callable(obj) and not isinstance(obj, torch.nn.Module):
        try:
            inspect.signature(obj).bind()
        except TypeError:
            raise argparse.ArgumentTypeError(f"--model {spec} takes arguments: {what}") from None
        except ValueError:  # no signature to check (a builtin): call it
            pass
        obj = obj()
        if isinstance(obj, GradHook):
            raise argparse.ArgumentTypeError(f"--model {spec} returns {hook}")
    if not isinstance(obj, torch.nn.Module):
        raise argparse.ArgumentTypeError(f"--model {spec} gives a {type(obj).__name__}: {what}")
    return obj


#: Said before tuning on CPU (--force): what the numbers are and where they go.
INTERPRETER_LABEL = ("fusedhooks tune: tuning the Triton interpreter on CPU (--force), in quick mode: these timings "
                     "are of the interpreter, not of any GPU; they are written under the key {key!r}, which only runs "
                     "on CPU under TRITON_INTERPRET=1 read")


def main(args) -> int:
    """`python -m fusedhooks tune` with parsed `args` (args.device: "cpu" or a CUDA device, checked by the command
    line). A bad argument raises argparse.ArgumentTypeError, which the command line reports as a usage error."""
    device = torch.device(args.device)
    hook = load_object(args.hook) if args.hook else default_hook()
    if not isinstance(hook, GradHook):
        raise argparse.ArgumentTypeError(f"--hook must name a fusedhooks GradHook, got {type(hook).__name__}")
    unknown = [d for d in args.dtypes.split(",") if d not in DTYPES]
    if unknown:
        raise argparse.ArgumentTypeError(f"--dtypes: unknown {', '.join(unknown)} (known: {', '.join(DTYPES)})")
    dtypes = [DTYPES[d] for d in args.dtypes.split(",")]
    if args.model:
        model = load_model(args.model)
        numels = sorted({p.numel() for p in model.parameters() if p.requires_grad})
        if not numels:
            raise argparse.ArgumentTypeError(f"--model {args.model} has no parameters that require grad: nothing to "
                                             "tune for")
        sizes = sorted({1 << max(n - 1, 1).bit_length() for n in numels})  # one per size bucket
        dtypes = sorted({p.dtype for p in model.parameters()}, key=str)
    elif args.sizes:
        try:
            sizes = [parse_size(s) for s in args.sizes.split(",")]
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"--sizes: {e}") from None
    else:
        sizes = None
    interpreted = device.type != "cuda"
    if interpreted and not args.force:
        raise argparse.ArgumentTypeError(
            "no GPU to tune for: on CPU the kernels run in the Triton interpreter, whose timings say nothing about a "
            "GPU's best launch configuration (and a full run takes hours). Run it where torch sees a CUDA device, or "
            "pass --force to tune the interpreter anyway (quick mode; its cache entries are read only on CPU)")
    quick = args.quick or interpreted
    if interpreted:
        print(INTERPRETER_LABEL.format(key=tuning.device_key(device)), file=sys.stderr, flush=True)
    if sizes is None:
        sizes = [5000, 20000] if quick else [1 << 12, 1 << 16, 1 << 20, 1 << 24]
    results = tune(hook, sizes, dtypes, device, quick=quick)
    print(f"tuned {len(results)} kernel(s) on {tuning.device_key(device)}; cache: {tune_cache()}")
    for digest, entry in results.items():
        print(f"  {digest} ({entry['dtype']}): BLOCK={entry['block']}, {len(entry['tried'])} trials, "
              f"per size: {entry['sizes']}")
    return 0
