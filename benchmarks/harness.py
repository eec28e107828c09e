"""The benchmark harness: timing, host time, launch counting, the environment, and the report (JSON, markdown,
plots). Every workload and provider is measured by the same code (benchmarks/run.py drives it).
"""

from __future__ import annotations

import contextlib
import json
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from fusedhooks.cli.tune import parse_size  # noqa: F401  (one parser of sizes: run.py imports it here)

QUANTILES = (0.5, 0.2, 0.8)
REPO = Path(__file__).resolve().parent.parent


# --- device time --------------------------------------------------------------------------------------------------

class Timer:
    """Device time of one call of `fn`: (median, 20%, 80%) in µs.

    CUDA: `triton.testing.do_bench` (CUDA events around each call, L2 flushed in between). CPU: a
    `time.perf_counter` loop, one sample per call, for about `cpu_budget_s` (at least `min_reps` samples).
    """

    def __init__(self, device: torch.device, *, warmup_ms: int, rep_ms: int, cpu_budget_s: float, min_reps: int = 3):
        self.device = device
        self.warmup_ms, self.rep_ms = warmup_ms, rep_ms
        self.cpu_budget_s, self.min_reps = cpu_budget_s, min_reps

    @property
    def how(self) -> str:
        if self.device.type == "cuda":
            return (f"triton.testing.do_bench (CUDA events, L2 flushed; warmup {self.warmup_ms} ms, "
                    f"rep {self.rep_ms} ms; x10 for the model step)")
        return (f"time.perf_counter per call, about {self.cpu_budget_s} s of calls per figure (x10 for the model "
                f"step), at least {self.min_reps}")

    def __call__(self, fn: Callable[[], object], scale: float = 1.0,
                 setup: Callable[[], object] | None = None) -> tuple[float, float, float]:
        """scale: multiplies the time spent (the model step gets longer runs than one gradient). setup: run before
        each call, not timed (CUDA: then the L2 flush, CUDA events around the call alone)."""
        if self.device.type == "cuda" and setup is not None:
            return self._cuda_with_setup(fn, setup, scale)
        if self.device.type == "cuda":
            from triton.testing import do_bench
            ms = do_bench(fn, warmup=int(self.warmup_ms * scale), rep=int(self.rep_ms * scale),
                          quantiles=list(QUANTILES))
            return tuple(x * 1e3 for x in ms)
        samples = []
        deadline = time.perf_counter() + self.cpu_budget_s * scale
        while len(samples) < self.min_reps or time.perf_counter() < deadline:
            if setup is not None:
                setup()
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
        return quantiles_us(samples)

    def _cuda_with_setup(self, fn, setup, scale: float) -> tuple[float, float, float]:
        """do_bench's measurement with `setup` before each call: setup, L2 flush (256 MB zeroed), CUDA events
        around `fn`, for about warmup + rep ms."""
        flush = torch.empty(256 << 20, dtype=torch.int8, device=self.device)
        samples = []
        deadline = time.perf_counter() + (self.warmup_ms + self.rep_ms) * scale / 1e3
        while len(samples) < self.min_reps or time.perf_counter() < deadline:
            setup()
            flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        return quantiles_us(samples)


def quantiles_us(samples: list[float]) -> tuple[float, ...]:
    """QUANTILES of samples in seconds, in µs (linear interpolation, as torch.quantile)."""
    q = torch.tensor(samples, dtype=torch.float64).quantile(torch.tensor(QUANTILES, dtype=torch.float64))
    return tuple(v * 1e6 for v in q.tolist())


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --- host time ----------------------------------------------------------------------------------------------------

class HostClock:
    """Host (wall) time spent in a provider's hooks: from the call to its return, so a `.item()` wait counts.

    `timed(fn)` wraps a callable (hooks called directly). In a backward, `tic` and `toc` are post-accumulate-grad
    hooks registered just before and after the provider's, and the end-of-backward callbacks the provider queues
    (fusedhooks flushes its buckets there) are bracketed by callbacks: the first `tic` of a backward queues
    `_callbacks_start`, which queues `_callbacks_stop`; callbacks run first-in-first-out, and one queued from a
    callback runs after those already queued, so the provider's callbacks run between the two.
    """

    def __init__(self):
        self.seconds = 0.0
        self._start = 0.0
        self._queued = False

    def timed(self, fn: Callable) -> Callable:
        def wrapper(*args):
            start = time.perf_counter()
            fn(*args)
            self.seconds += time.perf_counter() - start
        return wrapper

    def tic(self, _param) -> None:
        if not self._queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._callbacks_start)
            self._queued = True
        self._start = time.perf_counter()

    def toc(self, _param) -> None:
        self.seconds += time.perf_counter() - self._start

    def _callbacks_start(self) -> None:
        self._queued = False
        torch.autograd.Variable._execution_engine.queue_callback(self._callbacks_stop)
        self._start = time.perf_counter()

    def _callbacks_stop(self) -> None:
        self.seconds += time.perf_counter() - self._start


# --- kernel launches ----------------------------------------------------------------------------------------------

@contextlib.contextmanager
def fusedhooks_launch_counter():
    """Counts fusedhooks' kernel launches: every one (hook kernels, the multi-tensor scale of
    `fh.clip_grad_norm_`) goes through `fusedhooks.runtime.launcher.launch`. Yields a one-element list."""
    from fusedhooks.runtime import launcher as runtime

    count = [0]
    launch = runtime.launch

    def counting_launch(*args, **kwargs):
        count[0] += 1
        return launch(*args, **kwargs)

    runtime.launch = counting_launch
    try:
        yield count
    finally:
        runtime.launch = launch


def cuda_kernels(fn: Callable[[], object]) -> int:
    """CUDA kernels one call of `fn` launches (Triton kernels included), counted with torch.profiler: device
    events, less memory copies and sets and the GPU-side ranges of `record_function` annotations."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events()
               if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
               and not e.name.startswith(("Memcpy", "Memset")))


# --- environment --------------------------------------------------------------------------------------------------

def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def git_revision() -> dict:
    """{"revision": HEAD or None, "dirty": uncommitted changes (None when unknown)}; no git is fine."""
    def git(*args):
        try:
            out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    status = git("status", "--porcelain")
    return {"revision": git("rev-parse", "HEAD"), "dirty": None if status is None else bool(status)}


def tuning_info(device: torch.device) -> dict:
    """Where fusedhooks' tuning cache (`python -m fusedhooks tune`) is, and how many kernels it has tuned for
    this device: launch configurations change the figures."""
    try:
        from fusedhooks import config
        from fusedhooks.runtime import tuning
        return {"cache": str(config.tune_cache()),
                "kernels_tuned_for_this_device": len(tuning.load().get(tuning.device_key(device), {}))}
    except Exception as e:  # optional: a library without the cache, or an unreadable file
        return {"unavailable": f"{type(e).__name__}: {e}"}


def environment(device: torch.device) -> dict:
    import triton

    import fusedhooks as fh

    backend = fh.grad_hook().plan(numel=1, device=device).backend
    if backend == "triton" and device.type == "cpu":
        backend = "triton (interpreter, TRITON_INTERPRET=1)"
    cpu = device.type == "cpu"
    return {
        "device": {
            "type": device.type,
            "name": device_name(device),
            "representative": not cpu,
            "note": ("CPU timings are NOT representative of GPUs: fusedhooks runs its eager CPU backend there (what a "
                     "CPU user gets: compare it with eager), or the Triton interpreter; of the kernels only structural "
                     "figures (passes, bytes per element, launches) carry over"
                     if cpu else "GPU run"),
            "cpu_threads": torch.get_num_threads(),
        },
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "triton": triton.__version__,
            "fusedhooks": fh.__version__,
            "cuda": torch.version.cuda,
        },
        "fusedhooks_backend": backend,
        "fusedhooks_tuning": tuning_info(device),
        "git": git_revision(),
        "command": shlex.join(["python", *sys.argv]),
    }


# --- results and the report ---------------------------------------------------------------------------------------

#: Every result carries these fields (None where a figure does not apply; `reason` says why for n/a).
RESULT_FIELDS = ("workload", "provider", "dtype", "numel", "status", "reason", "median_us", "p20_us", "p80_us",
                 "bytes_per_element", "gbps", "copy_gbps", "copy_ratio", "host_us_per_firing", "gradients",
                 "launches", "launches_how", "fusedhooks_plan", "vs_fusedhooks", "added_pct", "step_peak_mb")


def new_result(**fields) -> dict:
    result = dict.fromkeys(RESULT_FIELDS)
    result.update(fields)
    return result


class Report:
    """All figures of a run: written as JSON (after every workload, so a run cut short keeps what it measured),
    printed as markdown, and plotted when matplotlib is importable."""

    def __init__(self, info: dict, settings: dict):
        self.info, self.settings = info, settings
        self.copy: list[dict] = []
        self.results: list[dict] = []
        self.overhead: list[dict] = []  # benchmarks/overhead.py
        self.titles: dict[str, str] = {}
        self.started = time.time()

    def derive(self) -> None:
        """Figures relative to other results: time vs fusedhooks, and the model's added % of step time."""
        def key(r):
            return (r["workload"], r["dtype"], r["numel"])
        fused = {key(r): r["median_us"] for r in self.results if r["provider"] == "fusedhooks" and r["median_us"]}
        base = {key(r): r["median_us"] for r in self.results if r["provider"] == "no hook" and r["median_us"]}
        for r in self.results:
            if r["median_us"] is None:
                continue
            if key(r) in fused:
                r["vs_fusedhooks"] = r["median_us"] / fused[key(r)]
            if key(r) in base:
                r["added_pct"] = 100.0 * (r["median_us"] - base[key(r)]) / base[key(r)]

    def to_json(self) -> dict:
        self.derive()
        return {"schema": 1, **self.info, "settings": self.settings, "elapsed_s": round(time.time() - self.started, 1),
                "copy": self.copy, "results": self.results, "overhead": self.overhead}

    def write_json(self, out: Path) -> Path:
        out.mkdir(parents=True, exist_ok=True)
        path = out / "results.json"
        path.write_text(json.dumps(self.to_json(), indent=1, default=str) + "\n")
        return path

    # --- markdown

    def markdown(self) -> str:
        self.derive()
        dev, v = self.info["device"], self.info["versions"]
        lines = [f"# fusedhooks benchmarks: {dev['name']} ({dev['type']})", "",
                 f"torch {v['torch']}, triton {v['triton']}, python {v['python']}, fusedhooks backend "
                 f"{self.info['fusedhooks_backend']}, git {self.info['git']['revision'] or 'unknown'}"
                 f"{' (uncommitted changes)' if self.info['git']['dirty'] else ''}", ""]
        if not dev["representative"]:
            lines += [f"**{dev['note']}.**", ""]
        if self.copy:
            lines += ["## Device-to-device copy (`dst.copy_(src)`, read + write)", "",
                      "| size | dtype | median µs | GB/s |", "| ---: | --- | ---: | ---: |"]
            lines += [f"| {human(c['numel'])} | {c['dtype']} | {c['median_us']:.1f} | {c['gbps']:.1f} |"
                      for c in self.copy]
            lines.append("")
        for workload, title in self.titles.items():
            rows = [r for r in self.results if r["workload"] == workload]
            lines += [f"## {title} (`{workload}`)", ""] + self._table(rows) + [""]
        if self.overhead:
            lines += ["## fusedhooks' own host time per firing, launches excluded (`overhead`)", "",
                      "| case | dtype | µs | target µs | fusedhooks' Python calls per parameter |",
                      "| --- | --- | ---: | ---: | ---: |"]
            lines += [f"| {r['case']} | {r['dtype']} | {r['us']:.1f} | {fmt(r['target_us'], '≤ {:.0f}')} | "
                      f"{fmt(r.get('python_calls'), '{:.1f}')} |" for r in self.overhead]
            lines.append("")
        return "\n".join(lines)

    def _table(self, rows: list[dict]) -> list[str]:
        model = rows[0]["numel"] is None
        if model:
            head = ("| dtype | provider | step ms | p20–p80 ms | added % of step | host µs/firing | launches added "
                    "| step's peak MB |")
        else:
            head = ("| size | dtype | provider | median µs | p20–p80 µs | GB/s | × copy | host µs/firing | launches "
                    "| time ÷ fusedhooks | bytes/element |")
        lines = [head, "|" + "---|" * (head.count("|") - 1)]
        notes = {}
        for r in rows:
            if r["status"] in ("n/a", "skipped"):
                notes.setdefault((r["provider"], r["status"], r["reason"]), 0)
                continue
            if r["status"] != "ok":
                cells = [r["provider"], f"**{r['status']}**: {r['reason']}"]
            elif model:
                cells = [r["provider"], f"{r['median_us'] / 1e3:.2f}",
                         f"{r['p20_us'] / 1e3:.2f}–{r['p80_us'] / 1e3:.2f}", fmt(r["added_pct"], "{:+.1f}"),
                         fmt(r["host_us_per_firing"], "{:.1f}"), fmt(r["launches"], "{}"),
                         fmt(r["step_peak_mb"], "{:.0f}")]
            else:
                cells = [r["provider"], f"{r['median_us']:.1f}", f"{r['p20_us']:.1f}–{r['p80_us']:.1f}",
                         fmt(r["gbps"], "{:.1f}"), fmt(r["copy_ratio"], "{:.2f}"),
                         fmt(r["host_us_per_firing"], "{:.1f}"), fmt(r["launches"], "{}"),
                         fmt(r["vs_fusedhooks"], "{:.2f}"), fmt(r["bytes_per_element"], "{:g}")]
            lead = [r["dtype"]] if model else [human(r["numel"]), r["dtype"]]
            lines.append("| " + " | ".join(lead + cells) + " |")
        lines += [f"- {provider}: {status} ({reason})" for provider, status, reason in notes]
        return lines

    # --- plots

    def plot(self, out: Path) -> list[str]:
        """One PNG per workload, a column per dtype: for the sweeps, the median time against size per provider
        (log-log) above the speedup over the eager hook (eager time ÷ the provider's, the eager hook at 1); for
        the model, the added % of step time per provider. Nothing without matplotlib."""
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return []
        self.derive()
        paths = []
        for workload in self.titles:
            rows = [r for r in self.results if r["workload"] == workload and r["status"] == "ok"]
            dtypes = sorted({r["dtype"] for r in rows})
            if not dtypes:
                continue
            panels = 1 if workload == "model" else 2
            fig, axes = plt.subplots(panels, len(dtypes), figsize=(6 * len(dtypes), 4 * panels), squeeze=False)
            for column, dtype in enumerate(dtypes):
                same = [r for r in rows if r["dtype"] == dtype]
                if workload == "model":
                    self._plot_model(axes[0][column], same)
                else:
                    self._plot_sweep(axes[0][column], axes[1][column], same)
                axes[0][column].set_title(f"{workload}, {dtype}", fontsize=10)
            fig.suptitle(f"fusedhooks benchmarks, {self.info['device']['name']}", fontsize=10)
            fig.tight_layout()
            path = out / f"{workload}.png"
            fig.savefig(path, dpi=100)
            plt.close(fig)
            paths.append(str(path))
        return paths

    @staticmethod
    def _plot_sweep(time_ax, speedup_ax, rows: list[dict]) -> None:
        """Median µs per provider against size, and `speedup_over_eager` (the speedup panel empty without the
        eager provider)."""
        speedups = speedup_over_eager(rows)
        for provider in dict.fromkeys(r["provider"] for r in rows):
            points = [r for r in rows if r["provider"] == provider]
            time_ax.plot([r["numel"] for r in points], [r["median_us"] for r in points], marker="o", label=provider)
            faster = [(numel, x) for (name, numel), x in speedups.items() if name == provider]
            if faster:
                speedup_ax.plot(*zip(*faster), marker="o", label=provider)
        for ax, label in ((time_ax, "median µs per call (lower is faster)"),
                          (speedup_ax, "speedup over the eager hook (×, higher is faster)")):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("gradient elements")
            ax.set_ylabel(label)
            ax.legend(fontsize=8)

    @staticmethod
    def _plot_model(ax, rows: list[dict]) -> None:
        ax.bar([r["provider"] for r in rows], [r["added_pct"] or 0.0 for r in rows])
        ax.set_ylabel("added % of step time")
        ax.tick_params(axis="x", labelrotation=30)


def speedup_over_eager(rows: list[dict]) -> dict[tuple[str, int], float]:
    """{(provider, numel): the eager hook's median ÷ the provider's} for the sizes where both were measured
    (`rows`: the ok results of one workload and dtype)."""
    eager = {r["numel"]: r["median_us"] for r in rows if r["provider"] == "eager"}
    return {(r["provider"], r["numel"]): eager[r["numel"]] / r["median_us"] for r in rows if r["numel"] in eager}


def fmt(value, spec: str) -> str:
    return "n/a" if value is None else spec.format(value)


def human(n: int) -> str:
    """1024 -> '1K', 1 << 20 -> '1M' (powers of 1024 where exact)."""
    for unit, size in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)
