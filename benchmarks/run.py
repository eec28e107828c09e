"""fusedhooks benchmarks: every workload, every provider, one harness.

    python benchmarks/run.py                          # CUDA when present: full sweep + GPT-2 small step
    python benchmarks/run.py --device cpu --quick     # a smoke run on CPU (timings not representative)
    python benchmarks/run.py --dtype bf16 --sizes 1M,16M --workloads clip_stats,model --out bench_out

Prints markdown tables (also written to DIR/results.md) and writes DIR/results.json, and PNG plots when
matplotlib is importable.
What each provider, workload and figure means: benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import overhead
import torch
from harness import (
    HostClock,
    Report,
    Timer,
    cuda_kernels,
    environment,
    fusedhooks_launch_counter,
    human,
    new_result,
    parse_size,
    synchronize,
)
from workloads import MODEL_WORK, PROVIDERS, WORKLOADS, Env, Impl, NotApplicable

from fusedhooks.cli.progress import Progress
from fusedhooks.testing import GPT2Config, gpt2, synthetic_batch, train_step

SIZE_PRESETS = {
    "quick": "1K,64K",
    "cpu": "1K,64K,1M",
    "gpu": "1K,64K,1M,16M,256M",
    "sweep": "1K,4K,16K,64K,256K,1M,4M,16M,64M,256M",
    # one 1.54 B-element gradient: the published norm + clip comparison (NeMo Automodel's Triton kernel, Transformer
    # Engine, bf16 on an H100); a GPU's: with clip_step's AdamW state it takes 4 x 3.1 GB in bf16
    "published": "1540000000",
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
#: The workloads, in run order: the model step first (a headline figure), then the one-gradient sweeps, then
#: fusedhooks' own host time per firing (benchmarks/overhead.py).
ALL_WORKLOADS = ("model", *WORKLOADS, "overhead")
#: Calls before timing: compiles Triton kernels and torch.compile graphs, allocates workspaces.
WARMUP_CALLS = 3
#: The model's batch: (batch, seq) for the tiny and the full-size config.
MODEL_BATCH = {"tiny": (8, 32), "full": (4, 1024)}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=("fp32", "bf16", "both"), default="both")
    ap.add_argument("--sizes", default=None,
                    help=f"comma list of gradient sizes (1K = 1024, 1M = 2**20) or a preset: "
                         f"{', '.join(f'{k} ({v})' for k, v in SIZE_PRESETS.items())}; "
                         "default: quick with --quick, else gpu on CUDA and cpu on CPU")
    ap.add_argument("--workloads", default=",".join(ALL_WORKLOADS), help="comma list from: " + ", ".join(ALL_WORKLOADS))
    ap.add_argument("--providers", default=None,
                    help="comma list from: " + ", ".join(PROVIDERS) + " (default: all; with --quick on CPU, all but "
                         "torch.compile, whose C++ compiles take tens of seconds there)")
    ap.add_argument("--model", choices=("tiny", "full"), default=None,
                    help="GPT-2 config of the model step (default: full on CUDA, tiny on CPU or with --quick)")
    ap.add_argument("--quick", action="store_true", help="small sizes and short timings (a smoke run)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="stop starting new measurements after this many seconds (the rest is marked skipped)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (default on CPU: 1, so that other processes on the machine do not stall "
                         "torch's parallel regions)")
    ap.add_argument("--out", type=Path, default=Path("bench_out"), help="folder for results.json and plots")
    args = ap.parse_args(argv)
    args.skipped_providers = {}
    if args.providers is None:
        args.providers = ",".join(PROVIDERS)
        if args.quick and args.device == "cpu":
            args.skipped_providers["torch.compile"] = (
                "not run by --quick on CPU: inductor compiles C++ for every graph, tens of seconds on a small machine; "
                "name it in --providers to include it")
    for name, known in (("workloads", ALL_WORKLOADS), ("providers", tuple(PROVIDERS))):
        chosen = [x.strip() for x in getattr(args, name).split(",") if x.strip()]
        unknown = [x for x in chosen if x not in known]
        if unknown:
            ap.error(f"unknown {name}: {', '.join(unknown)} (known: {', '.join(known)})")
        if not chosen:
            ap.error(f"--{name} names none: pick from {', '.join(known)}")
        setattr(args, name, chosen)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here")
    preset = args.sizes or ("quick" if args.quick else "gpu" if args.device == "cuda" else "cpu")
    try:
        args.sizes = [parse_size(s) for s in SIZE_PRESETS.get(preset, preset).split(",")]
    except ValueError as e:
        ap.error(f"--sizes: {e}")
    if args.budget_s is not None and not args.budget_s > 0:
        ap.error(f"--budget-s takes a number of seconds > 0, not {args.budget_s}")
    args.dtypes = list(DTYPES.values()) if args.dtype == "both" else [DTYPES[args.dtype]]
    args.model = args.model or ("full" if args.device == "cuda" and not args.quick else "tiny")
    return args


def dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in DTYPES.items()}[dtype]


class Bench:
    """Runs cases: builds a provider's Impl, times it, measures host time and launches, records the result."""

    def __init__(self, args: argparse.Namespace, device: torch.device, report: Report):
        self.args, self.device, self.report = args, device, report
        cuda = device.type == "cuda"
        self.timer = Timer(device, warmup_ms=5 if args.quick else 10, rep_ms=20 if args.quick else 60,
                           cpu_budget_s=0.05 if args.quick else 0.3)
        self.host_reps = 20 if cuda else 3 if args.quick else 10
        self.deadline = time.monotonic() + (args.budget_s if args.budget_s is not None else float("inf"))
        self.baseline_kernels: dict[torch.dtype, int] = {}
        providers = len(args.providers) + ("no hook" not in args.providers)  # the model step's baseline
        cases = {"model": len(args.dtypes) * providers, "overhead": 1}
        self.progress = Progress(sum(cases.get(w, len(args.dtypes) * len(args.sizes) * len(args.providers))
                                     for w in args.workloads), "benchmarks")

    # --- one case

    def case(self, result: dict, build, kind, scale: float = 1.0) -> None:
        """Measure one (workload, provider, dtype, size): `kind` (SweepCall or ModelStep) gives the call to time;
        a progress line says what came of it."""
        self._case(result, build, kind, scale)
        size = "" if result["numel"] is None else f" {human(result['numel'])}"
        outcome = f"{result['median_us']:.1f} us" if result["status"] == "ok" else \
            f"{result['status']}: {result.get('reason', '')}"
        self.progress.step(f"{result['workload']} {result['provider']} {result['dtype']}{size}: {outcome}")

    def _case(self, result: dict, build, kind, scale: float) -> None:
        self.report.results.append(result)
        if time.monotonic() > self.deadline:
            result.update(status="skipped", reason="time budget (--budget-s) spent")
            return
        if result["provider"] in self.args.skipped_providers:
            result.update(status="n/a", reason=self.args.skipped_providers[result["provider"]])
            return
        try:
            impl = build()
            if impl.does_nothing and result["numel"] is not None:
                raise NotApplicable("nothing to time on its own: the baseline of the model step")
        except NotApplicable as e:
            result.update(status="n/a", reason=str(e))
            return
        impl.attach(kind.env)
        try:
            self.measure(result, impl, kind, scale)
            result["status"] = "ok"
        except Exception as e:  # one failing case must not lose the run: record it and go on
            compile_failed = result["provider"] == "torch.compile"
            message = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]
            result.update(status="n/a" if compile_failed else "error",
                          reason=("torch.compile failed: " if compile_failed else "") + message)
            traceback.print_exc(file=sys.stderr)
        finally:
            impl.detach()

    def measure(self, result: dict, impl: Impl, kind, scale: float) -> None:
        step, setup = kind.step(impl), kind.setup(impl)
        for _ in range(WARMUP_CALLS):
            setup()
            step()
        synchronize(self.device)
        result["median_us"], result["p20_us"], result["p80_us"] = self.timer(step, scale, setup=kind.untimed(impl))

        result["gradients"] = len(kind.env.params)
        if not impl.does_nothing:  # host time per firing: a few synchronised calls with the clock running
            clock = HostClock()
            reps = min(self.host_reps, kind.max_host_reps or self.host_reps)
            with kind.timed(impl, clock) as timed:
                for _ in range(reps):
                    setup()
                    synchronize(self.device)
                    timed()
                synchronize(self.device)
            result["host_us_per_firing"] = clock.seconds * 1e6 / (reps * len(kind.env.params))

        result["launches"], result["launches_how"] = self.launches(impl, step, kind.env.dtype, result["numel"] is None,
                                                                   setup)
        if self.device.type == "cuda" and result["numel"] is None:  # the model: what a step adds at its peak
            setup()
            synchronize(self.device)
            start = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            step()
            synchronize(self.device)
            result["step_peak_mb"] = (torch.cuda.max_memory_allocated(self.device) - start) / 2**20
        if impl.fh_structure is not None:
            result["fusedhooks_plan"] = impl.fh_structure
        if result["numel"] is not None:  # bandwidth: one gradient, bytes as the provider moves them
            result["bytes_per_element"] = impl.bytes_per_element
            if impl.bytes_per_element:
                result["gbps"] = impl.bytes_per_element * result["numel"] / (result["median_us"] * 1e3)
                result["copy_ratio"] = result["gbps"] / result["copy_gbps"]

    def launches(self, impl: Impl, step, dtype: torch.dtype, model: bool, setup) -> tuple[int | None, str]:
        """Kernel launches per call (for the model: added to the no-hook step; `setup` run before each call, not
        counted), and how they were counted."""
        counted = None
        if impl.fh_hook is not None and impl.fh_hook.plan(shape=(1,), device=self.device).backend == "triton":
            setup()
            with fusedhooks_launch_counter() as count:
                step()
                synchronize(self.device)
            counted = count[0]
        if self.device.type == "cuda":
            setup()
            kernels = cuda_kernels(step)
            how = "torch.profiler: CUDA kernels per call"
            if model:
                if impl.does_nothing:
                    self.baseline_kernels[dtype] = kernels
                    return 0, how + " (the baseline)"
                if dtype in self.baseline_kernels:
                    kernels -= self.baseline_kernels[dtype]
                    how += ", minus the no-hook step's"
                else:
                    how += " (the whole step: the no-hook baseline was not measured)"
            through = f"; {counted} through fusedhooks.runtime.launcher.launch" if counted is not None else ""
            return kernels, how + through
        if counted is not None:
            return counted, ("counted: fusedhooks.runtime.launcher.launch and the multi-tensor scale (Triton "
                             "interpreter)")
        if impl.fh_hook is not None:
            return impl.fh_structure["launches"], (f"structural: {impl.fh_structure['launches_from']} (the reference "
                                                   "backend launches no kernel)")
        if impl.does_nothing:
            return 0, "nothing launched: no hook"
        return None, "n/a: torch kernel launches are counted with the CUDA profiler (CPU run)"

    # --- the sweep over one gradient

    def sweep(self, name: str) -> None:
        workload = WORKLOADS[name]
        self.report.titles[name] = workload.title
        for dtype in self.args.dtypes:
            for numel in self.args.sizes:
                param = torch.zeros(workload.param_shape(numel), dtype=dtype, device=self.device, requires_grad=True)
                param.grad = torch.empty_like(param)
                env = Env(self.device, dtype, [(f"grad{human(numel)}", param)], torch.optim.SGD([param], lr=0.0))
                kind = AfterBackwardCall(env) if workload.after_backward_only else SweepCall(env)
                copy = self.copy_baseline(param.grad)
                for provider in self.args.providers:
                    torch.manual_seed(0)
                    param.grad.normal_()  # every provider starts from the same gradient
                    result = new_result(workload=name, provider=provider, dtype=dtype_name(dtype), numel=numel,
                                        copy_gbps=copy)
                    self.case(result, functools.partial(PROVIDERS[provider], workload, env), kind)

    def copy_baseline(self, src: torch.Tensor) -> float:
        """GB/s of dst.copy_(src) (read + write), measured once per (size, dtype) in this run."""
        dtype, numel = dtype_name(src.dtype), src.numel()
        for c in self.report.copy:
            if (c["dtype"], c["numel"]) == (dtype, numel):
                return c["gbps"]
        dst = torch.empty_like(src)
        dst.copy_(src)
        median, p20, p80 = self.timer(lambda: dst.copy_(src))
        gbps = 2 * src.element_size() * numel / (median * 1e3)
        self.report.copy.append({"dtype": dtype, "numel": numel, "median_us": median, "p20_us": p20, "p80_us": p80,
                                 "gbps": gbps})
        return gbps

    # --- the model step

    def model(self) -> None:
        config = GPT2Config() if self.args.model == "full" else GPT2Config.tiny()
        batch_size, seq = MODEL_BATCH[self.args.model]
        self.report.titles["model"] = (f"GPT-2 ({self.args.model}, {config.n_layer} layers, d_model {config.d_model}) "
                                      f"training step, batch {batch_size}x{seq}, per-parameter {MODEL_WORK.title}")
        if self.device.type == "cuda":
            torch.set_float32_matmul_precision("high")  # TF32 matmuls, as fp32 training runs
        providers = ["no hook"] + [p for p in self.args.providers if p != "no hook"]  # the baseline first
        for dtype in self.args.dtypes:
            torch.manual_seed(0)
            model = gpt2(config, device=self.device, dtype=dtype)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
            batch = synthetic_batch(config, batch_size, seq, torch.Generator().manual_seed(0), device=self.device)
            env = Env(self.device, dtype, list(model.named_parameters()), optimizer)
            kind = ModelStep(env, functools.partial(train_step, model, batch))
            for provider in providers:
                result = new_result(workload="model", provider=provider, dtype=dtype_name(dtype))
                self.case(result, functools.partial(PROVIDERS[provider], MODEL_WORK, env), kind, scale=10.0)


class SweepCall:
    """The call timed for one gradient: each per-parameter hook called directly, as torch calls it (under no_grad),
    then `after`. Host time: the hook calls (and `after`), each wrapped by the clock."""

    max_host_reps = None  # the harness's setting

    def __init__(self, env: Env):
        self.env = env

    def step(self, impl: Impl, clock: HostClock | None = None):
        hooks, after = impl.hooks, impl.after
        if clock is not None:
            hooks = [clock.timed(h) for h in hooks]
            after = after and clock.timed(after)
        pairs = list(zip(self.env.tensors, hooks))

        def call():
            with torch.no_grad():
                for p, hook in pairs:
                    hook(p)
                if after is not None:
                    after()
        return call

    def setup(self, impl: Impl) -> Callable[[], None]:
        """What runs before each timed call (nothing here)."""
        return lambda: None

    def untimed(self, impl: Impl) -> Callable[[], None] | None:
        """The timer's `setup`: None when nothing runs between timed calls."""
        return None

    @contextlib.contextmanager
    def timed(self, impl: Impl, clock: HostClock):
        yield self.step(impl, clock)


class AfterBackwardCall(SweepCall):
    """The work after backward alone (`after`: a global clip and the optimizer step): the per-parameter hooks run
    before each call, untimed, as backward runs them (fusedhooks' records the norms the clip reads)."""

    def step(self, impl: Impl, clock: HostClock | None = None):
        after = impl.after if clock is None else clock.timed(impl.after)

        def call():
            with torch.no_grad():
                after()
        return call

    def setup(self, impl: Impl) -> Callable[[], None]:
        pairs = list(zip(self.env.tensors, impl.hooks))

        def hooks():
            with torch.no_grad():
                for p, hook in pairs:
                    hook(p)
        return hooks

    def untimed(self, impl: Impl) -> Callable[[], None] | None:
        return self.setup(impl) if impl.hooks else None


class ModelStep:
    """The call timed for the model: one training step, hooks fired by autograd. Host time: a hook registered just
    before the provider's and an AccumulateGrad node hook (run after all of them) start and stop the clock (torch's
    dispatch of the hook included), and callbacks bracket the provider's end-of-backward work (see HostClock)."""

    max_host_reps = 5  # whole training steps

    def __init__(self, env: Env, train):
        self.env, self.train = env, train  # train(optimizer): one step

    def step(self, impl: Impl):
        assert impl.after is None, "the model step runs per-parameter hooks only"
        return functools.partial(self.train, impl.optimizer or self.env.optimizer)

    def setup(self, impl: Impl) -> Callable[[], None]:
        return lambda: None

    def untimed(self, impl: Impl) -> None:
        return None

    @contextlib.contextmanager
    def timed(self, impl: Impl, clock: HostClock):
        tensors = self.env.tensors
        impl.detach()
        handles = [p.register_post_accumulate_grad_hook(clock.tic) for p in tensors]
        impl.attach(self.env)
        # the stop: an AccumulateGrad node hook, which runs after the post-accumulate hooks; a post-accumulate hook
        # registered after fusedhooks' would make explicit buckets process each gradient at its firing
        nodes = [p.view_as(p).grad_fn.next_functions[0][0] for p in tensors]  # kept alive while timing
        handles += [node.register_hook(lambda grad_in, grad_out: clock.toc(None)) for node in nodes]
        try:
            yield self.step(impl)
        finally:
            for handle in handles:
                handle.remove()


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if args.threads or device.type == "cpu":
        torch.set_num_threads(args.threads or 1)
    if "torch.compile" in args.providers and "torch.compile" not in args.skipped_providers:
        from torch._dynamo import config as dynamo_config
        for option in ("recompile_limit", "cache_size_limit"):  # one compiled graph per gradient shape and dtype
            if hasattr(dynamo_config, option):
                setattr(dynamo_config, option, 64)
    report = Report(environment(device), settings={
        "quick": args.quick, "dtypes": [dtype_name(d) for d in args.dtypes], "sizes": args.sizes,
        "workloads": args.workloads, "providers": args.providers, "model": args.model, "budget_s": args.budget_s})
    bench = Bench(args, device, report)
    report.settings.update(timer=bench.timer.how, host_reps=bench.host_reps, warmup_calls=WARMUP_CALLS)
    try:
        for name in args.workloads:
            if name == "model":
                bench.model()
            elif name == "overhead":
                report.overhead = overhead.measure(device, args.dtypes, args.quick)
                bench.progress.step("overhead: host time per firing")
            else:
                bench.sweep(name)
            report.write_json(args.out)
    except KeyboardInterrupt:  # e.g. `timeout -s INT`: report what was measured
        report.info["interrupted"] = True
        print("interrupted: reporting what was measured so far", file=sys.stderr)
    bench.progress.close()
    report.settings["float32_matmul_precision"] = torch.get_float32_matmul_precision()
    markdown = report.markdown()
    print(markdown)
    (args.out / "results.md").write_text(markdown + "\n")
    with contextlib.suppress(Exception):  # plots are optional: never fail the run for them
        report.info["plots"] = report.plot(args.out)
    path = report.write_json(args.out)
    print(f"\nresults: {path} ({report.to_json()['elapsed_s']} s)")
    return 1 if any(r["status"] == "error" for r in report.results) else 0


if __name__ == "__main__":
    sys.exit(main())
