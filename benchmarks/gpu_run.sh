#!/usr/bin/env bash
# One offline command for a GPU run (H100/H200), rehearsed on CPU with --dry-run.
#
#   bash benchmarks/gpu_run.sh [--dry-run] [--tier quick|full] [--part 1|2|3|4]
#                              [--budget SECONDS] [--cap STEP=SECONDS]... OUT_DIR
#
# Steps, each under its own time cap (a capped step keeps what it wrote and the run goes on):
#   env      GPU, driver, CUDA, nvcc, Python, torch, Triton, CuPy, JAX versions
#   build    copy this checkout to a scratch folder and build the extension there, in place, for
#            the local GPU arch with the installed toolchain (no pip, no build isolation)
#   tests    pytest: the GPU-marked tests and the Triton kernel tests on CUDA (full: every test)
#   bench-*  `fastspec bench` one suite at a time, --time-limit = the step's cap (no new case
#            starts after it; SIGTERM 30 s later ends the case in flight; the JSON is rewritten
#            after every case, so even a kill keeps the finished ones)
#   compare  `fastspec compare` (accuracy on hard matrix families)
#   ncu      Nsight Compute on one launch of the eigensolver and of the keys covariance kernel
#            (only when ncu exists)
#
# Tiers: quick = one 9-minute command (headline sizes); full = four, `--part 1|2|3|4` each
# (without --part, all four in a row; part 4 is the compiled training step alone, because
# compiling the 1.5B model twice, with and without the probe, takes minutes). --dry-run: the same steps on CPU at tiny sizes (host twin
# of the solver, Triton interpreter), which is how CI keeps this script from rotting.
#
# OUT_DIR gets a few flat files: gpu_run.log (versions, every step's status and time),
# tests.txt, bench.json (one `fastspec bench --json` document, benchmarks/results schema, all
# suites merged), compare.json (full part 1), ncu.txt. Exit status: 0 when every step passed or
# was capped, 1 if a step failed, 2 on bad arguments.
#
# Never touches the network: no pip, no downloads, PIP_NO_INDEX and the Hugging Face offline
# switches are set, models are built from configs.
set -uo pipefail

usage() { sed -n '3,5p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

ROOT=$(cd "$(dirname "$0")/.." && pwd)
DRY=0 TIER=quick PART="" BUDGET="" OUT="" CAPS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --tier) TIER=${2:-}; shift ;;
    --part) PART=${2:-}; shift ;;
    --budget) BUDGET=${2:-}; shift ;;
    --cap) CAPS+=("${2:-}"); shift ;;
    -h|--help) usage ;;
    -*) echo "gpu_run.sh: unknown option $1" >&2; usage ;;
    *) [ -z "$OUT" ] || { echo "gpu_run.sh: one OUT_DIR expected, got '$OUT' and '$1'" >&2; usage; }
       OUT=$1 ;;
  esac
  shift
done
[ -n "$OUT" ] || { echo "gpu_run.sh: OUT_DIR is required" >&2; usage; }
case "$TIER" in quick|full) ;; *) echo "gpu_run.sh: --tier: expected quick or full, got '$TIER'" >&2; exit 2 ;; esac
case "$PART" in ""|1|2|3|4) ;; *) echo "gpu_run.sh: --part: expected 1, 2, 3 or 4, got '$PART'" >&2; exit 2 ;; esac
if [ -n "$PART" ] && [ "$TIER" != full ]; then echo "gpu_run.sh: --part goes with --tier full" >&2; exit 2; fi
for c in "${CAPS[@]+"${CAPS[@]}"}"; do
  [[ "$c" =~ ^[a-z_-]+=[0-9]+$ ]] || { echo "gpu_run.sh: --cap: expected STEP=SECONDS, got '$c'" >&2; exit 2; }
done
[[ -z "$BUDGET" || "$BUDGET" =~ ^[0-9]+$ ]] || { echo "gpu_run.sh: --budget: expected seconds, got '$BUDGET'" >&2; exit 2; }

mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
LOG=$OUT/gpu_run.log
: > "$LOG"
PY=${PYTHON:-python3}
START=$(date +%s)
# one command: 9 minutes of the 10 it may take, less the build's copy and the last step's grace
# period (a cap bounds when a step stops starting work; SIGTERM comes 30 s after it)
if [ -z "$BUDGET" ]; then
  if [ "$TIER" = full ] && [ -z "$PART" ]; then BUDGET=1920; else BUDGET=480; fi
fi
FAILED=()

# --- offline, and the same interpreter everywhere -----------------------------------------
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
  HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
# JAX (an eigvalsh anchor) must not take 75% of GPU memory next to torch
export XLA_PYTHON_CLIENT_PREALLOCATE=false
if [ "$DRY" = 1 ]; then
  export CUDA_VISIBLE_DEVICES="" TRITON_INTERPRET=1  # CPU even on a GPU machine
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
fi

say() { echo "[gpu_run $(date -u +%H:%M:%S) +$(( $(date +%s) - START ))s] $*" | tee -a "$LOG"; }

cap_of() {  # cap_of STEP DEFAULT: --cap override, else DEFAULT; never past the budget
  local step=$1 cap=$2 c
  for c in "${CAPS[@]+"${CAPS[@]}"}"; do [ "${c%%=*}" = "$step" ] && cap=${c#*=}; done
  local left=$(( BUDGET - ($(date +%s) - START) ))
  [ "$left" -lt 5 ] && left=0  # too little left to start anything useful
  [ "$cap" -gt "$left" ] && cap=$left
  echo "$cap"
}

# step NAME CAP SIGNAL GRACE CMD...: run CMD under `timeout`, SIGNAL at CAP+GRACE, SIGKILL 20 s
# later. Output goes to OUT/tests.txt, OUT/ncu.txt or OUT/steps.txt (few files come back from a
# GPU machine). Status: ok, capped (timeout fired, or the command reported its own time cap),
# FAILED (any other non-zero exit).
step() {
  local name=$1 cap=$2 sig=$3 grace=$4; shift 4
  if [ "$cap" -lt 1 ]; then say "step $name: skipped, no time left in the ${BUDGET}s budget"; return 0; fi
  local dest=$OUT/steps.txt
  case "$name" in tests) dest=$OUT/tests.txt ;; ncu) dest=$OUT/ncu.txt ;; esac
  local own=$WORK/logs/$name.$(date +%s%N).out
  mkdir -p "$WORK/logs"
  say "step $name: start (cap ${cap}s): $*"
  echo "===== $name: $*" >> "$dest"
  local t0 rc
  t0=$(date +%s)
  timeout -s "$sig" -k 20 $(( cap + grace )) "$@" 2>&1 | tee "$own" >> "$dest"
  rc=${PIPESTATUS[0]}
  local dt=$(( $(date +%s) - t0 ))
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    say "step $name: capped after ${dt}s (rc $rc); partial results kept"
  elif [ "$rc" -ne 0 ]; then
    say "step $name: FAILED rc $rc after ${dt}s (last lines below)"
    tail -n 15 "$own" | sed 's/^/    /' | tee -a "$LOG"
    FAILED+=("$name")
  elif grep -q "time cap reached" "$own"; then
    say "step $name: capped after ${dt}s; partial results kept"
  else
    say "step $name: ok in ${dt}s"
  fi
  return 0
}

# --- env -----------------------------------------------------------------------------------------
say "fastspec GPU run: tier=$TIER part=${PART:-all} dry_run=$DRY budget=${BUDGET}s out=$OUT"
{
  echo "## versions"
  if command -v nvidia-smi >/dev/null 2>&1 && [ "$DRY" = 0 ]; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv,noheader
  else echo "nvidia-smi: not used (dry run or not found)"; fi
  command -v nvcc >/dev/null 2>&1 && nvcc --version | tail -n 2 || echo "nvcc: not found"
  command -v ncu >/dev/null 2>&1 && ncu --version | tail -n 1 || echo "ncu: not found"
  "$PY" - <<'EOF'
import importlib, platform
print("python", platform.python_version())
for name in ("torch", "triton", "numpy", "transformers", "cupy", "jax", "pybind11", "setuptools"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as e:  # noqa: BLE001 - a version line, whatever went wrong
        print(name, "not importable:", type(e).__name__)
import torch
print("torch CUDA", torch.version.cuda, "| device:",
      torch.cuda.get_device_name() if torch.cuda.is_available() else "none visible")
EOF
} >> "$LOG" 2>&1

if [ "$DRY" = 0 ]; then
  ARCH=$("$PY" -c "import torch; M, m = torch.cuda.get_device_capability(); print(f'{M}{m}')" 2>/dev/null) || {
    say "no CUDA device visible to torch: run with --dry-run on a machine without a GPU"; exit 1; }
else
  ARCH=90  # the arch the kit targets: the CUDA build is checked even without a GPU
fi

# --- build: a private copy of this checkout, extension built in place --------------------------
if [ -n "${FASTSPEC_GPU_RUN_WORK:-}" ]; then
  WORK=$FASTSPEC_GPU_RUN_WORK  # kept: a later call on a still-warm machine reuses the build
else
  WORK=$(mktemp -d "${TMPDIR:-/tmp}/fastspec-gpu-run.XXXXXX")
  trap 'rm -rf "$WORK"' EXIT
fi
SRC=$WORK/src
mkdir -p "$SRC"
# stale extensions of another build must not be picked up: copy sources only
tar -C "$ROOT" --exclude=__pycache__ --exclude='*.so' --exclude='*.pyc' -cf - \
  fastspec csrc tests benchmarks setup.py pyproject.toml README.md | tar -C "$SRC" -xf -
cd "$SRC" || exit 1
export PYTHONPATH=$SRC${PYTHONPATH:+:$PYTHONPATH}  # this copy first, before any installed fastspec
say "sources copied to $SRC; building for sm_$ARCH"
step build "$(cap_of build 150)" TERM 0 env FASTSPEC_CUDA_ARCH_LIST="$ARCH" "$PY" setup.py -q build_ext --inplace
if ! "$PY" -c "import fastspec._eig_ext" >> "$OUT/steps.txt" 2>&1; then
  say "build: fastspec._eig_ext not importable (is pybind11 installed?); solver benchmarks fall back to torch"
  FAILED+=(build-extension)
fi
"$PY" -c "import fastspec, sys; sys.exit(0 if fastspec.__file__.startswith('$SRC') else 1)" || {
  say "build: python imports a fastspec other than $SRC"; exit 1; }
"$PY" -m fastspec info >> "$LOG" 2>&1

# --- the steps of each tier/part -------------------------------------------------------------------
tests_quick() {  # tests_quick gpu|triton
  if [ "$DRY" = 1 ]; then  # CPU: the gpu-marked tests skip; interpreted kernel tests run for real
    [ "$1" = gpu ] && step tests "$(cap_of tests 90)" INT 0 "$PY" -m pytest -q -p no:cacheprovider \
      -o addopts= -rfE -m gpu tests/test_eig_cuda.py tests/test_covariance_triton.py
    [ "$1" = triton ] && step tests "$(cap_of tests 90)" INT 0 "$PY" -m pytest -q -p no:cacheprovider \
      -o addopts= -rfE tests/test_covariance_triton.py -k "hf_keys_layout or head_widths"
  elif [ "$1" = gpu ]; then
    step tests "$(cap_of tests 90)" INT 0 "$PY" -m pytest -q -p no:cacheprovider -o addopts= -rfE -m gpu tests
  else  # the Triton kernel tests, which run on CUDA tensors where CUDA exists
    step tests "$(cap_of tests 90)" INT 0 "$PY" -m pytest -q -p no:cacheprovider -o addopts= -rfE \
      tests/test_covariance_triton.py
  fi
  return 0
}
tests_full() {
  local where="tests benchmarks"
  [ "$DRY" = 1 ] && where="tests/test_bench_cases.py tests/test_eig_dispatch.py"
  # shellcheck disable=SC2086
  # benchmarks/ at quick sizes: its bodies check the claims; the timed runs are the bench steps
  # (and not the CPU rehearsal of this very script: it is what CI runs)
  step tests "$(cap_of tests 300)" INT 0 env FASTSPEC_BENCH_TIER=quick \
    "$PY" -m pytest -q -p no:cacheprovider -rfE -k "not dry_run_end_to_end" $where
}
bench() {  # bench SUITE CAP [FILTER...]
  local suite=$1 cap; cap=$(cap_of "bench-$1" "$2"); shift 2
  local args=(--suite "$suite" --json "$OUT/bench-$suite.json" --time-limit "$cap")
  if [ "$DRY" = 1 ]; then args+=(--quick); else args+=(--tier gpu); fi
  local f; for f in "$@"; do args+=(--filter "$f"); done
  step "bench-$suite" "$cap" TERM 30 "$PY" -m fastspec bench "${args[@]}"
}
compare() {
  local cap; cap=$(cap_of compare "$1")
  local args=(--json "$OUT/compare.json" --time-limit "$cap")
  if [ "$DRY" = 1 ]; then args+=(--quick); else args+=(--tier gpu); fi
  step compare "$cap" TERM 30 "$PY" -m fastspec compare "${args[@]}"
}
ncu_step() {  # one launch of each headline kernel under Nsight Compute, text summary only
  local cap; cap=$(cap_of ncu "$1")
  if [ "$DRY" = 1 ] || ! command -v ncu >/dev/null 2>&1; then
    say "ncu: not found (or dry run): profiling skipped; rehearsing its target script instead"
    step ncu "$cap" TERM 0 "$PY" benchmarks/ncu_target.py all --dry-run
    return 0
  fi
  # the third launch of each kernel (two warm-ups first); stdout is the text report
  local half=$(( cap / 2 ))
  step ncu "$half" TERM 0 ncu --set full --kernel-id ::regex:eigvalsh_batched_kernel:3 -c 1 \
    "$PY" benchmarks/ncu_target.py eig
  step ncu "$(cap_of ncu "$half")" TERM 0 ncu --set full --kernel-id ::regex:_cov_partials_kernel:3 -c 1 \
    "$PY" benchmarks/ncu_target.py cov
}

# headline sizes for the quick tier (size filters apply to the gpu sizes only)
EIG_HEAD=B4096-n128-fp32
[ "$DRY" = 1 ] && EIG_HEAD=fp32
case "$TIER/$PART" in
  quick/)  # most valuable first: the GPU tests, then the two headline kernels
    tests_quick gpu
    bench eigvalsh 90 "$EIG_HEAD"
    bench covariance 45
    tests_quick triton
    bench keyrank 60
    bench train_step 75 "emit_every=100"
    ncu_step 60 ;;
  full/1) tests_full; compare 150 ;;
  full/2) bench eigvalsh 240; bench covariance 90; ncu_step 90 ;;
  full/3) bench keyrank 120; bench train_step 200; bench probe 120 ;;
  full/4) bench train_step_compiled 420 ;;  # compile (untimed) of both sides, then the timed rounds
  full/)
    tests_full; compare 150
    bench eigvalsh 240; bench covariance 90; ncu_step 90
    bench keyrank 120; bench train_step 200; bench probe 120
    bench train_step_compiled 420 ;;
esac

# --- flat result files: one bench.json, the step outputs, a summary on stdout ---------------------
"$PY" benchmarks/gpu_summary.py "$OUT" --tier "$TIER" --part "${PART:-all}" --dry-run "$DRY" \
  --failed "${FAILED[*]+"${FAILED[*]}"}" 2>&1 | tee -a "$LOG"
if [ "${#FAILED[@]}" -gt 0 ]; then
  say "done: FAILED steps: ${FAILED[*]}"
  exit 1
fi
say "done: every step passed or was capped"
exit 0
