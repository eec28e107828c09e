#!/usr/bin/env bash
# One GPU check, under 8 minutes: install, the AOT build report, GPU tests, a first part of the CPU-tensor tests,
# autotuning, the published global-clip comparison, the cost of each statistic and the benchmark.
# First run 2026-12-04 on an H200 (torch 2.11, triton 3.6): every step's time there is beside its limit below.
#
#   bash benchmarks/gpu_check.sh            # on a machine with a CUDA GPU (H100/H200), torch and triton installed
#
# Everything lands in one folder, $OUT when set, else ./bench_out, as at most 10 files:
#   summary.txt     the machine (GPU, driver, versions, git revision) and every step's exit status and seconds
#                   (124: its time limit was hit)
#   steps.log       every step's output, one section per step (the statistics-cost table among them)
#   build.json      the AOT build report (registers, spills, vector widths) for this GPU with this triton
#   tuning.json     the launch configurations `python -m fusedhooks tune` wrote on this GPU
#   results.json, results.md              the full benchmark (tables in the .md, every figure in the .json)
#   published.json, published.md          clip + fused AdamW step of one 1.54 B element bf16 gradient
#   units.json, units.md                  AGC, centre the columns, normalise: fusedhooks against torch.compile
#
# Written for torch 2.11 / triton 3.6 with no network: nothing is downloaded. Each step has its own time limit
# (SIGINT first, so pytest and the benchmark still report what they did), and a failing step does not stop the
# next one.
set -u
cd "$(dirname "$0")/.."
out="${OUT:-./bench_out}"
mkdir -p "$out"
summary="$out/summary.txt"
log="$out/steps.log"
scratch="$(mktemp -d)"  # what the benchmark writes besides its results (plots): left out of $OUT
: > "$log"
# The python that holds torch (on some GPU machines a plain `python` is missing or another one)
PY=python
"$PY" -c 'import torch' 2>/dev/null || PY=python3
# pytest-xdist spreads the tests over the machine's cores when the machine has it
xdist() { "$PY" -c 'import xdist' 2>/dev/null && echo "-n $1"; }

{
    date -u '+%Y-%m-%dT%H:%M:%SZ'
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv
    git rev-parse HEAD 2>/dev/null && git status --short 2>/dev/null
    "$PY" -c 'import sys, torch, triton; print("python", sys.version.split()[0]); print("torch", torch.__version__, "cuda", torch.version.cuda); print("triton", triton.__version__); print("device", torch.cuda.get_device_name())'
    "$PY" -m pip list 2>/dev/null | grep -i -E '^(torch|triton|numpy|pytest|hypothesis|matplotlib|transformers|lightning) '
    echo
} > "$summary" 2>&1

step() {  # step NAME SECONDS COMMAND...: run with a time limit into steps.log, record status and duration
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    printf '\n===== %s (limit %ss): %s\n' "$name" "$limit" "$*" >> "$log"
    timeout -s INT -k 10 "$limit" "$@" >> "$log" 2>&1
    local status=$?
    printf '%-12s exit %3d  %4ds  (limit %ss)\n' "$name" "$status" $((SECONDS - start)) "$limit" | tee -a "$summary"
}

# Budget (seconds): 30 + 45 + 110 + 50 + 35 + 40 + 50 + 2 x 10 + 2 x 15 + 22 + 53 = 485, and at most 10 s more per step
# that ignores SIGINT. Measured on the H200: install 2 s, build 34 s (its families built in parallel), gpu-tests
# 70-88 s, tune 11 s, published 11 s, stats-cost 18 s; tests and bench use all the time they are given.
# The benchmark gets the most: only this machine can measure it (the CPU runs every test, in the Triton interpreter).
step install   30 "$PY" -m pip install --no-deps --no-build-isolation -e .
"$PY" -c 'import fusedhooks' 2>/dev/null || export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # install failed
# The ahead-of-time build report for this GPU's architecture, with this machine's triton (registers, spills,
# vector widths next to the measured bandwidth).
step build     45 "$PY" -m fusedhooks build --target cuda:90 --dtypes fp32,bf16 --json "$out/build.json"
# Every test marked gpu, among them the compiled and captured firings (tests/firing/test_compile_cuda.py): the wrap_triton
# path of fusedhooks::firing under inductor with compiled autograd, mode="reduce-overhead" with compiled autograd,
# and a torch.cuda.graph capture of an eager step, each against eager over steps with new inputs.
step gpu-tests 110 "$PY" -m pytest -q -m gpu tests/ --durations=15 -rfE --tb=short $(xdist 8)
# The CPU-tensor tests need the interpreter (conftest skips them on a CUDA machine without it): a first part of the
# quick run, for this machine's older torch and triton (CI runs all of it on the newest). The integrations' packages
# (the [test] extra) may be missing on this machine, which installs nothing: their tests are left out then.
missing=()
for package in transformers lightning tensorboard; do
    "$PY" -c "import $package" 2>/dev/null || missing+=("--ignore=tests/integrations/test_$package.py" "--deselect=tests/test_readme.py")
done
# triton 3.6's interpreter fails on numpy >= 2.4: a numpy<2.4 wheel carried in .whl/ (benchmarks/README.md, GPU
# check) is put first on the path for this step alone
interpreter_path="${PYTHONPATH:-}"
if ! "$PY" -c 'import numpy, sys; sys.exit(tuple(map(int, numpy.__version__.split(".")[:2])) >= (2, 4))' 2>/dev/null \
        && ls .whl/numpy-*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$scratch/numpy" .whl/numpy-*.whl >> "$log" 2>&1 \
        && interpreter_path="$scratch/numpy${interpreter_path:+:$interpreter_path}"
fi
step tests     50 env TRITON_INTERPRET=1 PYTHONPATH="$interpreter_path" "$PY" -m pytest -q -m "not gpu and not slow" \
    tests/ --maxfail=20 -rfE --tb=short $(xdist 12) ${missing[@]+"${missing[@]}"}
# Autotuning on this GPU: the cache written here; a later process's runtime reads it (tests/cli/test_tune.py).
step tune      35 "$PY" -m fusedhooks tune --quick --out "$out/tuning.json"
# The published global-clip comparison (NeMo Automodel's Triton kernel 7.32 ms, Transformer Engine 7.89 ms for norm
# + clip on an H100): torch's clip + fused AdamW, fh.clip_grad_norm_'s scale pass + fused AdamW, the folded clip,
# fh.AdamW's step folded and inside the backward, torch's step alone.
step published 40 "$PY" benchmarks/run.py --device cuda --workloads clip_step --dtype bf16 --sizes published \
    --out "$scratch/published" --budget-s 30
# The benchmark starts no new measurement after --budget-s; the time limit is the backstop. results.json is
# written after every workload, so even a cut-short run leaves figures. The figures asked for first: the fused pass
# against a copy, the eager hook, torch.compile and clip_grad_norm_; the GPT-2-small step; host time per firing.
# Where the fused pass's time goes: one statistics subset per kernel, against a copy, beside the time
# benchmarks/sass_model.py predicts from each kernel's SASS (compiled here: about 1 s a kernel); the table lands in
# steps.log, and checks the kernels and the model at once.
step stats-cost 50 "$PY" benchmarks/stats_cost.py --size 256M
# The default BLOCK is 32768 elements a program in tiles of 4096 (16-bit): the same table at 8192 (2 tiles a program,
# four times the programs), to see whether more programs in flight beat fewer reductions, and at 65536 (the model
# predicts bf16 with input statistics at 1.07 of a copy's time there, 1.17 at 32768 and 1.74 at 8192)
step stats-8192 10 env FUSEDHOOKS_BLOCK=8192 "$PY" benchmarks/stats_cost.py --size 256M --dtypes bf16 --no-predict
step stats-65536 10 env FUSEDHOOKS_BLOCK=65536 "$PY" benchmarks/stats_cost.py --size 256M --dtypes bf16 --no-predict
# Host time per firing through Triton's dispatch and through fusedhooks' direct launch of the compiled kernel
# (fastlaunch): the GPT-2 step measured 40-75 us per firing where fusedhooks' own Python is about 8 (tables in steps.log)
for fast in 0 1; do
    step "launch-fast=$fast" 15 env FUSEDHOOKS_FAST_LAUNCH=$fast "$PY" benchmarks/run.py --device cuda --dtype fp32 \
        --sizes 64K --workloads clip_scale --providers fusedhooks,eager --out "$scratch/launch$fast"
done
# The workloads whose bodies reduce (issue 34 §5): one 256M-element gradient, fusedhooks against torch.compile of the
# same hook, fp32 and bf16; sass_model.py's second table (docs/benchmarks.md) predicted each
step units     22 "$PY" benchmarks/run.py --device cuda --out "$scratch/units" --budget-s 16 --sizes 256M \
    --workloads agc,center_columns,normalize --providers fusedhooks,torch.compile
step bench     53 "$PY" benchmarks/run.py --device cuda --out "$scratch/bench" --budget-s 41 --sizes 16M,256M \
    --workloads clip_stats,model,overhead,clip_scale,amp_clip
for name in results.json results.md; do
    [ -f "$scratch/bench/$name" ] && cp "$scratch/bench/$name" "$out/$name"
    [ -f "$scratch/units/$name" ] && cp "$scratch/units/$name" "$out/units.${name#results.}"
    [ -f "$scratch/published/$name" ] && cp "$scratch/published/$name" "$out/published.${name#results.}"
done
rm -rf "$scratch"
exit 0
