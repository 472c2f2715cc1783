#!/usr/bin/env bash
# The GPU check, sized for a 15-minute device lease: at most 6 minutes on one CUDA GPU from a cold start
# (GPU_CHECK_BUDGET seconds, 360; the sections' caps sum to 350), what earlier leases have not answered yet.
#
#   bash benchmarks/gpu_check.sh [OUT_DIR]                  # repository root, a machine with a CUDA GPU
#   GPU_CHECK_DEVICE=cpu bash benchmarks/gpu_check.sh DIR   # the dry run on a CPU: interpreter, tiny sizes
#
# Sections, in order, each under its own time limit (x4 in the dry run), cut to what is left of the budget
# and skipped with less than 15 s left; fail-soft: a failure or a timeout is logged and the next one runs.
# GPU_CHECK_ONLY="env step" runs those sections only.
#   env       GPU, driver, versions, the Arch the launcher derives; installs the repository
#             (`python -m pip install --no-deps --no-build-isolation -e .`) where vit3 does not import
#   warm      the Triton and Inductor caches filled in parallel: one process per kernel shape and model
#             (benchmarks/warm_cache.py) beside the whole-model compiles of the step section
#   step      benchmarks/step_profile.py: a bf16 training step of ViT³-T vs DeiT-T at 224 px (batch 128) and
#             1248 px (batch 32) and H-ViT³-T vs DeiT-T at 224 px (batch 128), eager and compiled whole with
#             CUDA graphs (reduce-overhead: host-free replay), side by side; kernel count, device time by
#             category (cuBLAS, flash, vit3's Triton kernels, Inductor, copies/casts, cuDNN), peak memory
#   kernel    benchmarks/ttt_kernel.py at the models' own shapes: d 32, N 196 (ViT³-T at 224 px: B*H 768) and
#             N 6084 (1248 px: B*H 192), and d 64, N 3136, B*H 1024 (the reference point); per-kernel profile
#   tests     the float64 kernel tests on the GPU (compiled kernels; pytest-xdist where installed)
# Every section's CSV is written row by row (a section cut short keeps its rows) to the work directory
# (GPU_CHECK_WORK, default a new /tmp/vit3_gpu_check_work.*): step_profile_<dev>.csv, ttt_kernel_<dev>.csv,
# ttt_kernel_profile_<dev>.csv (<dev>: cuda or cpu). After each section OUT_DIR (default $OUT, else
# /tmp/vit3_gpu_check) gets the CSVs, summary.txt (rc and seconds per section) and gpu_check.log (every
# section's output). On a GPU the CSVs and PNGs are also copied to benchmarks/results/.
# Triton and Inductor compile into one cache for every section and run (GPU_CHECK_CACHE, default
# ~/.cache/vit3_gpu_check), so a second run on the same machine starts warm.
#
# No network needed; works with an older PyTorch/Triton than the repository's pins (torch 2.11 / Triton 3.6).
# Python packages it needs beyond torch and triton: timm (torchvision, huggingface_hub, safetensors, pyyaml),
# numpy, pillow, tqdm, matplotlib, pytest (pytest-xdist to run the tests in parallel). Not needed: fvcore,
# ninja (the C++ CPU kernel, unused on a GPU).
set -u -o pipefail

OUT_DIR=${1:-${OUT:-/tmp/vit3_gpu_check}}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
# Outside OUT_DIR: the device tool brings back 8 files of $OUT, at most.
WORK=${GPU_CHECK_WORK:-$(mktemp -d /tmp/vit3_gpu_check_work.XXXXXX)}
mkdir -p "$WORK"
WORK=$(cd "$WORK" && pwd)
LOG="$OUT_DIR/gpu_check.log"
: >"$LOG"
: >"$OUT_DIR/summary.txt"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
DEVICE=${GPU_CHECK_DEVICE:-cuda}
BUDGET=${GPU_CHECK_BUDGET:-360}
ONLY=${GPU_CHECK_ONLY:-}
CACHE=${GPU_CHECK_CACHE:-$HOME/.cache/vit3_gpu_check}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$CACHE/triton}
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$CACHE/inductor}
mkdir -p "$TRITON_CACHE_DIR" "$TORCHINDUCTOR_CACHE_DIR"
JOBS=$(nproc 2>/dev/null || echo 4)
export PY DEVICE WORK JOBS
SLOW=1 # time limits x SLOW (the CPU dry run is slower)
if [ "$DEVICE" = cuda ]; then
  unset TRITON_INTERPRET # the GPU's compiled kernels, never the interpreter
  # kernel shapes "D N BH...": the models' own (ViT³-T and H-ViT³-T heads of 32), and ViT³-S's 64 at the reference
  KERNEL_SHAPES=("32 196 768" "32 6084 192" "64 3136 1024")
  KERNEL_ARGS=(--repeats 10 --compile-backend inductor)
  # step groups "MODELS RES BATCH"
  STEPS=("vit3_tiny:deit_tiny_patch16_224 224 128" "vit3_tiny:deit_tiny_patch16_224 1248 32"
    "h_vit3_tiny:deit_tiny_patch16_224 224 128")
  STEP_ARGS=(--repeats 5)
  TESTS=(tests/kernels/test_kernels_ttt.py tests/kernels/test_op_dwconv.py tests/kernels/test_triton_program.py tests/kernels/test_kernels_launch.py)
  TESTS_ARGS=(-k "fp64 or float64")
else
  export TRITON_INTERPRET=1
  SLOW=4
  KERNEL_SHAPES=("16 16 2 4")
  KERNEL_ARGS=(--heads 2 --repeats 1 --compile-backend aot_eager)
  STEPS=("test_vit3_ttt:deit_tiny_patch16_224 32 2" "test_h_vit3:deit_tiny_patch16_224 32 2")
  STEP_ARGS=(--repeats 1 --variants eager)
  TESTS=(tests/kernels/test_kernels_ttt.py)
  TESTS_ARGS=(-k "fp64_matches_reference_to_rounding and dwconv-norm")
fi
export KERNEL_LIST="${KERNEL_SHAPES[*]/%/;}" STEP_LIST="${STEPS[*]/%/;}" STEP_ARGS_LIST="${STEP_ARGS[*]}"
export KERNEL_ARGS_LIST="${KERNEL_ARGS[*]}"

T0=$(date +%s)
echo "device $DEVICE, budget ${BUDGET}s, work directory $WORK, caches $TRITON_CACHE_DIR $TORCHINDUCTOR_CACHE_DIR" |
  tee -a "$LOG"

# publish: the CSVs, summary and log into OUT_DIR (and benchmarks/results/ on a GPU), after every section.
publish() {
  local f
  for f in "$WORK"/*_"$DEVICE".csv; do
    [ -e "$f" ] || continue
    [ "$WORK" = "$OUT_DIR" ] || cp "$f" "$OUT_DIR/"
    [ "$DEVICE" = cuda ] && cp "$f" benchmarks/results/
  done
  if [ "$DEVICE" = cuda ]; then
    for f in "$WORK"/*_"$DEVICE"*.png; do
      [ -e "$f" ] && cp "$f" benchmarks/results/
    done
  fi
  return 0
}

# section NAME SECONDS CMD...: runs CMD (a command or one of the functions below) under `timeout`, at most
# SECONDS x SLOW and what is left of the budget; logs to WORK/NAME.log and the main log; never exits.
section() {
  local name=$1 cap=$(($2 * SLOW)) start rc left limit
  shift 2
  if [ -n "$ONLY" ] && [[ " $ONLY " != *" $name "* ]]; then
    return 0
  fi
  left=$((BUDGET * SLOW - ($(date +%s) - T0)))
  limit=$((cap < left ? cap : left))
  if [ "$limit" -lt 15 ]; then
    echo "$name skipped: ${left}s of the budget left" | tee -a "$LOG" "$OUT_DIR/summary.txt"
    return 0
  fi
  start=$(date +%s)
  echo "=== $name (limit ${limit}s): $*" | tee -a "$LOG"
  timeout --kill-after=10 "$limit" bash -c '"$@"' _ "$@" >"$WORK/$name.log" 2>&1
  rc=$?
  cat "$WORK/$name.log" >>"$LOG"
  [ "$rc" -eq 124 ] && echo "!!! $name timed out after ${limit}s" | tee -a "$LOG"
  echo "$name rc=$rc $(($(date +%s) - start))s" | tee -a "$LOG" "$OUT_DIR/summary.txt"
  publish
}

env_report() {
  nvidia-smi || true
  "$PY" -c "import vit3" 2>/dev/null || "$PY" -m pip install --no-deps --no-build-isolation -e . || true
  "$PY" - "$DEVICE" <<'EOF'
import importlib, os, sys, torch
device = torch.device(sys.argv[1])
print("torch", torch.__version__, "cuda", torch.version.cuda, "hip", torch.version.hip,
      "available", torch.cuda.is_available())
print("TRITON_CACHE_DIR", os.environ.get("TRITON_CACHE_DIR"), "entries", len(os.listdir(os.environ["TRITON_CACHE_DIR"])))
missing = []
for mod in ("triton", "timm", "torchvision", "huggingface_hub", "safetensors", "yaml", "numpy", "PIL", "tqdm",
            "matplotlib", "pytest", "xdist", "einops", "fvcore"):
    try:
        m = importlib.import_module(mod)
        print(f"{mod} {getattr(m, '__version__', '?')}")
    except ImportError as e:
        missing.append(mod)
        print(f"{mod} MISSING ({e})")
from vit3.kernels.triton import device as tdev, tiles
if device.type == "cuda":
    print("arch", tdev.Arch.of(device))
print("fp32 uses TF32:", tdev.fp32_uses_tf32())
for name in ("swiglu", "linear", "dwconv"):
    for d in (16, 32, 64, 128):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            print("fits_device", name, d, dtype, tiles.fits_device(name, d, dtype, device))
print("missing modules:", missing or "none")
EOF
}

# each_shape LIST FN: calls FN with the words of each ';'-separated item of LIST.
each_shape() {
  local item rc=0 items
  IFS=';' read -ra items <<<"$1"
  for item in "${items[@]}"; do
    [ -n "${item// /}" ] || continue
    # shellcheck disable=SC2086
    "$2" $item || rc=1
  done
  return $rc
}

warm_kernel_item() { WARM_ITEMS+=("kernel:$1:$2:$3"); }
warm_step_item() {
  local name
  for name in ${1//:/ }; do
    [[ $name == deit* ]] || WARM_ITEMS+=("model:$name:$2:$3")
  done
}

# warm: the kernels' and the eager models' Triton specialisations (warm_cache.py), while the step section's
# whole-model compiles fill the Inductor cache in a process of their own.
warm_all() {
  WARM_ITEMS=()
  each_shape "$KERNEL_LIST" warm_kernel_item
  each_shape "$STEP_LIST" warm_step_item
  local compile=""
  if [[ " $STEP_ARGS_LIST " != *" --variants eager "* ]]; then
    STEP_ARGS_LIST="$STEP_ARGS_LIST --repeats 1" step_all graphs >/dev/null 2>&1 &
    compile=$!
  fi
  "$PY" benchmarks/warm_cache.py --device "$DEVICE" --jobs "$JOBS" --timeout "$1" "${WARM_ITEMS[@]}"
  [ -z "$compile" ] || wait "$compile" || true
}

step_group() {
  # shellcheck disable=SC2086
  "$PY" benchmarks/step_profile.py --device "$DEVICE" --models "$1" --res "$2" --batch "$3" $STEP_ARGS_LIST \
    ${STEP_VARIANTS:+--variants $STEP_VARIANTS} --out "$WORK/parts/step_profile_${DEVICE}_$1_$2.csv"
}

# join_csv KIND: the parts' rows of KIND into WORK/KIND_<dev>.csv.
join_csv() {
  "$PY" - "$WORK" "$DEVICE" "$1" <<'EOF'
import csv, glob, sys
work, dev, kind = sys.argv[1:]
rows = [r for f in sorted(glob.glob(f"{work}/parts/{kind}_{dev}*.csv")) for r in csv.DictReader(open(f))]
if rows:
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with open(f"{work}/{kind}_{dev}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, keys)
        w.writeheader()
        w.writerows(rows)
EOF
}

# step_all [VARIANT]: every step group, one CSV each, joined into step_profile_<dev>.csv.
step_all() {
  mkdir -p "$WORK/parts"
  STEP_VARIANTS=${1:-} each_shape "$STEP_LIST" step_group
  local rc=$?
  [ -n "${1:-}" ] || join_csv step_profile
  return $rc
}

kernel_shape() {
  # shellcheck disable=SC2086
  "$PY" benchmarks/ttt_kernel.py --device "$DEVICE" --out-dir "$WORK/parts" --tag "${DEVICE}_d$1_n$2" --profile \
    --d "$1" --n "$2" --bh "${@:3}" $KERNEL_ARGS_LIST
}

kernel_all() {
  mkdir -p "$WORK/parts"
  each_shape "$KERNEL_LIST" kernel_shape
  local rc=$?
  join_csv ttt_kernel
  join_csv ttt_kernel_profile
  return $rc
}

# -v names every test as it ends: a section cut short by its limit still says which tests failed (the -q
# dots of 2026-12-04's run said only that some did).
kernel_tests() {
  local parallel=()
  "$PY" -c "import xdist" 2>/dev/null && parallel=(-n "$((JOBS < 8 ? JOBS : 8))")
  "$PY" -m pytest -v -p no:cacheprovider -o addopts="-ra" "${parallel[@]}" "$@"
}

export -f env_report each_shape warm_kernel_item warm_step_item warm_all step_group join_csv step_all \
  kernel_shape kernel_all kernel_tests

section env 60 env_report
section warm 50 warm_all $((40 * SLOW))
section step 130 step_all
section kernel 60 kernel_all
section tests 50 kernel_tests "${TESTS[@]}" "${TESTS_ARGS[@]}"
echo "total $(($(date +%s) - T0))s" | tee -a "$LOG" "$OUT_DIR/summary.txt"
publish
