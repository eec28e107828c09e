"""Ahead-of-time builds for GPU targets, without a GPU: `python -m fusedhooks build --target cuda:90`.

Every kernel family the code generator and `kernels/` produce (single gradient, single program, reduction
levels, bucketed, histogram, AMP, the shard partials of FSDP2, a parameter-reading body, the global-clip scale
kernel) is compiled by Triton's whole pipeline for a GPU target (`triton.compile(ASTSource(...),
target=GPUTarget(...))`: TTIR, TTGIR, LLVM, PTX/cubin or AMDGCN/hsaco) at the launch configuration the runtime
picks (BLOCK, warps), with the gradient's pointers marked 16-byte aligned as Triton marks an aligned tensor.
The report gives, per kernel, the registers and spills (ptxas -v for CUDA, the AMDGPU metadata for HIP) and the
widest and narrowest global loads and stores in bits (128: vector accesses).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

import torch

from .. import config

#: The targets `python -m fusedhooks build` knows: (backend, arch, warp size).
TARGETS = {"cuda:80": ("cuda", 80, 32), "cuda:90": ("cuda", 90, 32), "hip:gfx942": ("hip", "gfx942", 64)}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}
#: targets that also build the statistics kernels as launched when every block is full (FULL_BLOCKS): the gated one;
#: elsewhere that variant is the general one less the mask's selects, and building it would cost half the time again
FULL_BLOCKS_TARGETS = ("cuda:90",)


@dataclass
class KernelReport:
    """One compiled kernel: what was built and what the compiler made of it (None: not reported)."""

    family: str
    dtype: str
    kernel: str
    target: str
    num_warps: int
    registers: int | None = None
    spills: int | None = None  # bytes of spill stores (CUDA) / VGPR spill count (HIP)
    load_bits: tuple[int, int] | None = None  # (narrowest, widest) global load
    store_bits: tuple[int, int] | None = None  # (narrowest, widest) global store
    #: global loads/stores one gradient element wide, not vectors (CUDA): for fp16/bf16 gradients only the
    #: gradient's own accesses have that width, so 0 means every gradient access is a vector
    scalar_element_accesses: int | None = None
    error: str | None = None

    @staticmethod
    def header() -> str:
        """The column names over `line()`s, and what the columns hold."""
        return (f"{'target':11} {'family':27} {'dtype':5} {'kernel':20} {'warps':>5} {'regs':>4} {'spills':>6} "
                f"{'load-bits':>9} {'store-bits':>10} {'scalar-elt':>10}\n"
                "# regs: registers (HIP: VGPRs); spills: bytes of spill stores (HIP: spilled VGPRs); load/store-bits: "
                "narrowest..widest global access; scalar-elt: global accesses one element wide (CUDA); -: none")

    def line(self) -> str:
        if self.error:
            return f"{self.target:11} {self.family:27} {self.dtype:5} {self.kernel:20} FAILED: {self.error}"

        def shown(v):
            return "-" if v is None else f"{v[0]}..{v[1]}" if isinstance(v, tuple) else str(v)

        return (f"{self.target:11} {self.family:27} {self.dtype:5} {self.kernel:20} {self.num_warps:>5} "
                f"{shown(self.registers):>4} {shown(self.spills):>6} {shown(self.load_bits):>9} "
                f"{shown(self.store_bits):>10} {shown(self.scalar_element_accesses):>10}")


#: The gradient shape of the families whose bodies reduce over dimensions (planned per shape).
DIMS_SHAPE = (4096, 1024)


def families() -> dict[str, object]:
    """Representative hooks, one per kernel family: name -> GradHook (planned for DIMS_SHAPE when its body reduces
    over dimensions)."""
    from .. import agc, grad_hook

    scale = torch.tensor(0.5)
    return {
        "clip+scale+stats+hist": grad_hook(lambda g: g.clamp(-1.0, 1.0) * 0.5, stats="all",
                                           input_stats=("norm", "hist")),
        "stats-only": grad_hook(stats="all"),
        "clip+moments": grad_hook(lambda g: g.clamp(-1.0, 1.0), stats=("norm", "skew", "kurtosis")),
        "normalise-by-norm": grad_hook(lambda g: g / g.norm(), stats=("norm",)),
        "standardise": grad_hook(lambda g: (g - g.mean()) / (g.std() + 1e-6)),
        "weight-decay(param)": grad_hook(lambda g, p: g + 1e-4 * p),
        "pow+selects": grad_hook(lambda g: torch.maximum(g.clamp(min=-1.0), g.abs() ** 1.7)),
        # CUDA's math library (libdevice) as torch's CUDA kernels call it; torch's CUDA forms of pow and division
        "transcendentals": grad_hook(lambda g: torch.exp(g.clamp(max=20.0)) + torch.log(g.abs() + 1e-3)
                                     + (g.abs() + 1.0).rsqrt()),
        "integer-pow+divide": grad_hook(lambda g: g ** 3 + g ** -2 + g / 7),
        "broadcast-result": grad_hook(lambda g: g.abs().amax() * scale, input_stats=("norm",)),  # a 0-dim result
        "agc(rows, one pass)": agc(0.01, stats=("norm",)),
        "column-norm(two passes)": grad_hook(lambda g: g / (g.norm(dim=0, keepdim=True) + 1e-6)),
        "factored(rows+columns+whole)": grad_hook(lambda g: g * (g * g).mean(dim=1, keepdim=True)
                                                  * (g * g).mean(dim=0, keepdim=True) / (g * g).mean(dim=1).mean()),
    }


def _plans(hook, dtype: torch.dtype):
    """(variant, plan) of a hook: its own, the AMP one (unscaling first) and the FSDP2 shard-partials one."""
    from ..compiler.plan import make_plan
    from ..stats.merge import partial_stats

    graph = hook.graph(dtype, DIMS_SHAPE if hook.reduces_over_dims else None)
    yield "", make_plan(graph, hook.stat_names, hook.input_stat_names, hist_range=hook.hist_range)
    if hook.fn is not None and not graph.uses_param:
        yield "+amp", make_plan(graph, hook.stat_names, hook.input_stat_names, amp=True, hist_range=hook.hist_range)
    if hook.stat_names and not graph.reductions():
        yield "+shard", make_plan(graph, partial_stats(hook.stat_names),
                                  partial_stats(hook.input_stat_names), hist_range=hook.hist_range)


def kernels(dtypes=("fp32", "bf16", "fp16", "fp64"), only: str | None = None, full_blocks: bool = True):
    """(family, dtype name, kernel name, JITFunction, signature, constexprs) of everything the runtime launches (only:
    that family alone, a families() name or "global-clip-scale"). A kernel that takes FULL_BLOCKS comes as launched
    for a gradient with a partial last block (FULL_BLOCKS false) and, when `full_blocks`, as launched without (family
    "...+full")."""
    from ..codegen import generate
    from ..compiler import dims
    from ..runtime import launcher

    for family, hook in families().items():
        if only is not None and family != only:
            continue
        for dname in dtypes:
            dtype = DTYPES[dname]
            for variant, plan in _plans(hook, dtype):
                module = generate.load(*generate.generate_with_spec(plan, "cuda"))
                constexprs = {"ALIGNED": True, "BLOCK": launcher.default_block(dtype), "RBLOCK": launcher.RBLOCK}
                if module.SPEC.one_pass:
                    constexprs.update(dims.units_launch(constexprs["BLOCK"], [plan.units.unit_sizes],
                                                        dtype.itemsize))
                for name, signature in module.SIGNATURES.items():
                    if "FULL_BLOCKS" in signature:
                        yield family + variant, dname, name, getattr(module, name), signature, constexprs | {
                            "FULL_BLOCKS": False}
                        if full_blocks:
                            yield (family + variant + "+full", dname, name, getattr(module, name), signature,
                                   constexprs | {"FULL_BLOCKS": True})
                    else:
                        yield family + variant, dname, name, getattr(module, name), signature, constexprs
    from ..kernels import multi_tensor
    from ..kernels.multi_tensor import TL_DTYPES

    block, chunk = multi_tensor.launch_config([1 << 24], "cuda")
    if only is None or only == "global-clip-scale":
        for dname in dtypes:
            dtype = DTYPES[dname]
            if dtype not in TL_DTYPES:
                continue
            signature = {"table_ptr": "*i64", "coef_ptr": "*" + dname, "n_tensors": "i32", "DTYPE": "constexpr",
                         "ROUND_COEF": "constexpr", "ALIGNED": "constexpr", "CHUNK": "constexpr",
                         "BLOCK": "constexpr"}
            constexprs = {"DTYPE": TL_DTYPES[dtype], "ROUND_COEF": dname in ("fp16", "bf16"), "ALIGNED": True,
                          "CHUNK": chunk, "BLOCK": block}
            yield "global-clip-scale", dname, "scale_kernel", multi_tensor.scale_kernel, signature, constexprs
    if only is None or only == "optimizer-step":
        yield from _optimizer_kernels(dtypes, block, chunk)


def _optimizer_kernels(dtypes, block: int, chunk: int):
    """The optimizer steps of fh.AdamW (with and without amsgrad; bf16 also with stochastic rounding, 16-bit also with
    fp32 master weights) and fh.SGD (Nesterov momentum), each dividing by a grad_scale (a folded clip, GradScaler), as
    `kernels`."""
    from ..kernels import optim
    from ..kernels.multi_tensor import TL_DTYPES

    pointers = {"table_ptr": "*i64", "hyper_ptr": "*fp64", "grad_scale_ptr": "*fp32", "found_inf_ptr": "*fp32",
                "n_tensors": "i32"}
    for dname in dtypes:
        dt = TL_DTYPES[DTYPES[dname]]
        common = {"GRAD_SCALE": True, "ALIGNED": True, "CHUNK": chunk,
                  "BLOCK": min(block, optim.GPU_BLOCK[DTYPES[dname].itemsize])}
        for amsgrad, stochastic, master in ((False, False, False), (True, False, False), (False, True, False),
                                            (False, False, True)):
            if (stochastic and dname != "bf16") or (master and dname not in ("bf16", "fp16")):
                continue
            constexprs = {"DTYPE": dt, "AMSGRAD": amsgrad, "MAXIMIZE": False, "STOCHASTIC": stochastic,
                          "MASTER": master, **common}
            family = ("optimizer-step" + ("+amsgrad" if amsgrad else "") + ("+stochastic" if stochastic else "")
                      + ("+master" if master else ""))
            yield (family, dname, "adamw_kernel", optim.adamw_kernel,
                   pointers | dict.fromkeys(constexprs, "constexpr"), constexprs)
        constexprs = {"DTYPE": dt, "MOMENTUM": True, "NESTEROV": True, "MAXIMIZE": False, "STOCHASTIC": False,
                      "MASTER": False, **common}
        yield ("optimizer-step", dname, "sgd_kernel", optim.sgd_kernel,
               pointers | dict.fromkeys(constexprs, "constexpr"), constexprs)


def build(target: str, dtypes=("fp32", "bf16", "fp16", "fp64"), num_warps: int | None = None,
          bar: bool = True, only: str | None = None) -> list[KernelReport]:
    """Compile every kernel (only: of that family, see `kernels`) for `target` (a TARGETS key) and report on each;
    progress on stderr (bar: see progress.Progress)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ..runtime.launcher import default_num_warps
    from .progress import Progress

    backend, arch, warp = TARGETS[target]
    gpu = GPUTarget(backend, arch, warp)
    reports = []
    everything = list(kernels(dtypes, only, full_blocks=target in FULL_BLOCKS_TARGETS))
    progress = Progress(len(everything), f"fusedhooks build {target}", bar=bar)
    for family, dname, name, fn, signature, constexprs in everything:
        progress.step(f"{family} {dname} {name}")
        warps = num_warps or default_num_warps(constexprs["BLOCK"], DTYPES[dname])
        report = KernelReport(family, dname, name, target, warps)
        # pointers 16-byte aligned, as Triton specialises an aligned tensor at launch
        attrs = {(i,): [["tt.divisibility", 16]] for i, (arg, t) in enumerate(signature.items()) if t.startswith("*")}
        try:
            compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=gpu,
                                      options={"num_warps": warps, "enable_fp_fusion": False})
        except Exception as e:  # noqa: BLE001 - a report, not a crash: every failure is listed
            report.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
            reports.append(report)
            continue
        if backend == "cuda":
            _cuda_report(report, compiled.asm["ptx"], arch)
        else:
            _hip_report(report, compiled.asm["amdgcn"])
        reports.append(report)
    progress.close()
    return reports


_PTX_ACCESS = re.compile(r"\b(ld|st)\.global(?:\.[a-z0-9_]+)*?(?:\.v(\d))?\.[bfsu](\d+)\b")


def _cuda_report(report: KernelReport, ptx: str, arch: int) -> None:
    loads, stores = [], []
    element_bits = 8 * torch.tensor([], dtype=DTYPES[report.dtype]).element_size()
    report.scalar_element_accesses = 0
    for op, vec, width in _PTX_ACCESS.findall(ptx):
        (loads if op == "ld" else stores).append(int(vec or 1) * int(width))
        report.scalar_element_accesses += not vec and int(width) == element_bits
    report.load_bits = (min(loads), max(loads)) if loads else None
    report.store_bits = (min(stores), max(stores)) if stores else None
    ptxas = _ptxas()
    if ptxas is None:
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        arch_flag = f"-arch=sm_{arch}a" if arch >= 90 else f"-arch=sm_{arch}"
        out = subprocess.run([ptxas, arch_flag, "-v", path, "-o", os.devnull], capture_output=True, text=True)
    regs = re.findall(r"Used (\d+) registers", out.stderr)
    spills = re.findall(r"(\d+) bytes spill stores", out.stderr)
    report.registers = int(regs[0]) if regs else None
    report.spills = int(spills[0]) if spills else None


def _ptxas() -> str | None:
    """The ptxas bundled with Triton that knows the newest architectures (None: not found)."""
    import triton

    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    for name in ("ptxas-blackwell", "ptxas"):
        path = os.path.join(bin_dir, name)
        if os.path.exists(path):
            return path
    return None


_GCN_ACCESS = re.compile(r"\b(global|buffer)_(load|store)_(dwordx(\d)|dword|short|ushort|b(\d+)|ubyte|byte)\b")


def _hip_report(report: KernelReport, asm: str) -> None:
    loads, stores = [], []
    for _, op, kind, x, b in _GCN_ACCESS.findall(asm):
        if kind.startswith("dwordx"):
            bits = 32 * int(x)
        elif kind == "dword":
            bits = 32
        elif kind.startswith("b") and b:
            bits = int(b)
        else:
            bits = 16 if "short" in kind else 8
        (loads if op == "load" else stores).append(bits)
    report.load_bits = (min(loads), max(loads)) if loads else None
    report.store_bits = (min(stores), max(stores)) if stores else None
    vgprs = re.findall(r"\.vgpr_count:\s+(\d+)", asm)
    spills = re.findall(r"\.vgpr_spill_count:\s+(\d+)", asm)
    report.registers = int(vgprs[0]) if vgprs else None
    report.spills = int(spills[0]) if spills else None


def main(args) -> int:
    """`python -m fusedhooks build`: print the report for each target (each family for each target built in a pool of
    processes, one per core); --json writes the reports; exit 1 if any kernel failed to build. A bad argument raises
    argparse.ArgumentTypeError, which the command line reports as a usage error."""
    import concurrent.futures
    import dataclasses
    import json
    import multiprocessing

    if config.triton_interpret():
        raise argparse.ArgumentTypeError("python -m fusedhooks build compiles for GPU targets: unset TRITON_INTERPRET "
                                         "(with it, triton.jit makes interpreter functions, which compile for no "
                                         "target)")
    targets = list(TARGETS) if args.target == "all" else args.target.split(",")
    unknown = [t for t in targets if t not in TARGETS]
    if unknown:
        raise argparse.ArgumentTypeError(f"--target: unknown {unknown[0]!r}; known: {', '.join(TARGETS)}, all")
    dtypes = tuple(args.dtypes.split(","))
    bad = [d for d in dtypes if d not in DTYPES]
    if bad:
        raise argparse.ArgumentTypeError(f"--dtypes: unknown {bad[0]!r}; known: {', '.join(DTYPES)}")
    tasks = [(target, family) for target in targets
             for family in (*families(), "global-clip-scale", "optimizer-step")]
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=min(len(tasks), os.cpu_count() or 1),
                                                mp_context=context) as pool:
        built = list(pool.map(build, *zip(*[(target, dtypes, args.num_warps, False, family)
                                             for target, family in tasks])))  # progress: lines from every process
    results = [[r for (t, _), reports in zip(tasks, built) if t == target for r in reports] for target in targets]
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump([dataclasses.asdict(r) for reports in results for r in reports], f, indent=1)
    failed = 0
    print(KernelReport.header())
    for target, reports in zip(targets, results):
        for r in reports:
            print(r.line())
        failed += sum(r.error is not None for r in reports)
        worst = max((r.registers or 0 for r in reports), default=0)
        spilling = sum(bool(r.spills) for r in reports)
        print(f"# {target}: {len(reports)} kernels, {sum(r.error is None for r in reports)} built, "
              f"most registers {worst}, {spilling} spilling")
    return 1 if failed else 0
