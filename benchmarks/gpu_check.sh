#!/usr/bin/env bash
# The GPU check of the Triton path, sized for a 15-minute device lease: at most 7 minutes on one CUDA GPU
# from a cold start (GPU_CHECK_BUDGET seconds, 420), benchmarks first and the kernel tests after.
#
#   bash benchmarks/gpu_check.sh [OUT_DIR]                  # repository root, a machine with a CUDA GPU
#   GPU_CHECK_DEVICE=cpu bash benchmarks/gpu_check.sh DIR   # the dry run on a CPU: interpreter, tiny sizes
#
# Sections, in order, each under its own time limit (x4 in the dry run), cut to what is left of the budget
# and skipped with less than 15 s left; fail-soft: a failure or a timeout is logged and the next one runs.
# GPU_CHECK_ONLY="env kernel" runs those sections only.
#   env       GPU, driver, versions, the Arch the launcher derives, fits_device; installs the repository
#             (`python -m pip install --no-deps --no-build-isolation -e .`) where vit3 does not import
#   warm      the Triton cache filled in parallel, one process per shape the benchmarks run
#             (benchmarks/warm_cache.py): Triton compiles each specialisation inside the launching process,
#             one after another, which from a cold cache would eat the benchmarks' limits
#   kernel    benchmarks/ttt_kernel.py: the fused op vs torch.compile of the plain formulation and of the
#             official one, the official eager formulation, SDPA; N = 3136 and 196, d = 64 and 32, B*H = 64
#             (inference size) and 1024 (training size), bf16, peak memory, a per-kernel profile
#   models    benchmarks/models.py: ViT³-T vs DeiT-T, ViT³-S vs DeiT-S, H-ViT³-T vs DeiT-T (SDPA), eager, the
#             training step (train()) and inference, bf16 autocast, 224 / 512 / 1024 / 1248 px, peak memory
#   compiled  the same pairs compiled (every block, torch.compile), training step, 224 and 1248 px
#   explain   the backend of every mixer branch and why, the three models (bf16, 224 px, training)
#   tests     the kernel and registry tests on the GPU (compiled kernels; pytest-xdist where installed)
#   backends  benchmarks/backend_check.py: every backend against the float64 reference, fp32 and bf16
#   compile   graph breaks of torch.compile, ViT³-T and H-ViT³-T training (benchmarks/compile_model.py)
# Every section's CSV is written row by row (a section cut short keeps its rows) to the work directory
# (GPU_CHECK_WORK, default a new /tmp/vit3_gpu_check_work.*): ttt_kernel_<dev>.csv, ttt_kernel_profile_<dev>.csv,
# models_<dev>.csv, models_compiled_<dev>.csv, backend_check_<dev>.csv, compile_model_<dev>.csv (<dev>: cuda
# or cpu), with their PNGs and one log per section. After each section OUT_DIR (default $OUT, else
# /tmp/vit3_gpu_check) gets the CSVs, summary.txt (rc and seconds per section) and gpu_check.log (every
# section's output): 8 files. On a GPU the CSVs and PNGs are also copied to benchmarks/results/.
# Triton and Inductor compile into one cache for every section and run (GPU_CHECK_CACHE, default
# ~/.cache/vit3_gpu_check), so a second run on the same machine starts warm.
#
# No network needed; works with an older PyTorch/Triton than the repository's pins (torch 2.11 / Triton 3.6).
# Python packages it needs beyond torch and triton: timm (torchvision, huggingface_hub, safetensors, pyyaml),
# numpy, pillow, tqdm, matplotlib, pytest (pytest-xdist to run the tests in parallel). Not needed: fvcore
# (FLOP counts, skipped: --no-flops), ninja (the C++ CPU kernel, unused on a GPU).
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
BUDGET=${GPU_CHECK_BUDGET:-420}
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
  KERNEL_D=(64 32)
  KERNEL_N=(3136 196)
  KERNEL_BH=(64 1024)
  KERNEL_ARGS=(--repeats 10)
  # Batch per resolution: a training-size batch at 224 px, and enough images at the others that the GPU, not
  # the host, sets the pace (at 8 images both models were host-bound on the H200 of 2026-12-04: DeiT-T's
  # step took 49 ms at 1248 px and 32 ms at 224 px, ViT³-T's 65-80 ms at every size).
  RES=(224 512 1024 1248)
  BATCH=(128 64 32 32)
  PAIRS=(vit3_tiny:deit_tiny_patch16_224 vit3_small:deit_small_patch16_224 h_vit3_tiny:deit_tiny_patch16_224)
  MODEL_ARGS=(--repeats 3)
  COMPILED_RES=(224 1248)
  COMPILED_BATCH=(128 32)
  COMPILE_BACKEND=inductor
  EXPLAIN_MODELS=(vit3_tiny vit3_small h_vit3_tiny)
  EXPLAIN_SIZE=224
  TESTS=(tests/test_triton_program.py tests/test_triton_node.py tests/test_kernels_ttt.py tests/test_kernels_launch.py tests/test_backends_explain.py tests/test_backends_choice.py tests/test_backends_guard.py)
  TESTS_ARGS=()
  BACKEND_ARGS=(--batch 16)
  COMPILE_MODELS=(vit3_tiny h_vit3_tiny)
  COMPILE_ARGS=(--img-size 224 --batch 32 --repeats 5)
else
  export TRITON_INTERPRET=1
  SLOW=4
  KERNEL_D=(16)
  KERNEL_N=(16)
  KERNEL_BH=(2 4)
  KERNEL_ARGS=(--heads 2 --repeats 1)
  RES=(32)
  BATCH=(1)
  PAIRS=(test_vit3_ttt:deit_tiny_patch16_224)
  MODEL_ARGS=(--repeats 1)
  COMPILED_RES=(32)
  COMPILED_BATCH=(1)
  COMPILE_BACKEND=aot_eager
  EXPLAIN_MODELS=(test_vit3_ttt test_h_vit3)
  EXPLAIN_SIZE=64
  TESTS=(tests/test_kernels_ttt.py tests/test_backends_explain.py tests/test_backends_choice.py tests/test_backends_guard.py)
  TESTS_ARGS=(-k "N1 or deterministic or token_major or strict")
  BACKEND_ARGS=(--batch 1 --quick --models vit3_tiny)
  COMPILE_MODELS=(test_vit3_ttt)
  COMPILE_ARGS=(--img-size 64 --batch 1 --repeats 1)
fi
# explain runs a forward at the first resolution of the models section.
export RES_LIST="${RES[*]}" BATCH_LIST="${BATCH[*]}" EXPLAIN_LIST="${EXPLAIN_MODELS[*]}" EXPLAIN_SIZE
export KERNEL_LIST="${KERNEL_D[*]};${KERNEL_N[*]};${KERNEL_BH[*]}"
export EXPLAIN_BATCH=$((BATCH[0] < 8 ? BATCH[0] : 8)) # explain does not depend on the batch: a small one runs faster
export COMPILE_BACKEND

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

warm_all() {
  local items=() d n bh i name res batch ds ns bhs
  IFS=';' read -r ds ns bhs <<<"$KERNEL_LIST"
  for d in $ds; do
    for n in $ns; do
      for bh in $bhs; do
        items+=("kernel:$d:$n:$bh")
      done
    done
  done
  read -ra res <<<"$RES_LIST"
  read -ra batch <<<"$BATCH_LIST"
  for name in $WARM_MODELS; do
    for i in "${!res[@]}"; do
      items+=("model:$name:${res[$i]}:${batch[$i]}")
    done
  done
  "$PY" benchmarks/warm_cache.py --device "$DEVICE" --jobs "$JOBS" --timeout "$1" "${items[@]}"
}

explain_all() {
  local rc=0 model
  for model in $EXPLAIN_LIST; do
    echo "--- $model"
    "$PY" -m vit3.scripts.explain "$model" --img-size "$EXPLAIN_SIZE" --batch "$EXPLAIN_BATCH" --device "$DEVICE" \
      --dtype bf16 --train || rc=1
  done
  return $rc
}

# -v names every test as it ends: a section cut short by its limit still says which tests failed (the -q
# dots of 2026-12-04's run said only that some did).
kernel_tests() {
  local parallel=()
  "$PY" -c "import xdist" 2>/dev/null && parallel=(-n "$((JOBS < 8 ? JOBS : 8))")
  "$PY" -m pytest -v -p no:cacheprovider -o addopts="-ra" "${parallel[@]}" "$@"
}

# The vit3 models of the pairs, each warmed at every resolution of the models section.
WARM_MODELS=$(printf '%s\n' "${PAIRS[@]}" | tr ':' '\n' | grep -v '^deit' | sort -u | tr '\n' ' ')
export WARM_MODELS
export -f env_report warm_all explain_all kernel_tests

section env 60 env_report
section warm 90 warm_all $((80 * SLOW))
section kernel 120 "$PY" benchmarks/ttt_kernel.py --device "$DEVICE" --out-dir "$WORK" --tag "$DEVICE" --profile \
  --compile-backend "$COMPILE_BACKEND" --d "${KERNEL_D[@]}" --n "${KERNEL_N[@]}" --bh "${KERNEL_BH[@]}" "${KERNEL_ARGS[@]}"
section models 90 "$PY" benchmarks/models.py --device "$DEVICE" --no-flops --out "$WORK/models_$DEVICE.csv" \
  --pairs "${PAIRS[@]}" --res "${RES[@]}" --batch "${BATCH[@]}" "${MODEL_ARGS[@]}"
section compiled 90 "$PY" benchmarks/models.py --device "$DEVICE" --no-flops --variants compiled --modes train \
  --compile-backend "$COMPILE_BACKEND" --out "$WORK/models_compiled_$DEVICE.csv" --pairs "${PAIRS[@]}" \
  --res "${COMPILED_RES[@]}" --batch "${COMPILED_BATCH[@]}" "${MODEL_ARGS[@]}"
section explain 45 explain_all
section tests 120 kernel_tests "${TESTS[@]}" "${TESTS_ARGS[@]}"
section backends 60 "$PY" benchmarks/backend_check.py --device "$DEVICE" --timeout $((45 * SLOW)) --out-dir "$WORK" \
  --tag "_$DEVICE" "${BACKEND_ARGS[@]}"
section compile 40 "$PY" benchmarks/compile_model.py --device "$DEVICE" --mode train --backend "$COMPILE_BACKEND" \
  --out-dir "$WORK" --tag "_$DEVICE" --models "${COMPILE_MODELS[@]}" "${COMPILE_ARGS[@]}"
echo "total $(($(date +%s) - T0))s" | tee -a "$LOG" "$OUT_DIR/summary.txt"
publish
