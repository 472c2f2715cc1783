#!/usr/bin/env bash
# The GPU check of the Triton path, sized for a 15-minute device lease: under 7 minutes on one CUDA GPU.
#
#   bash benchmarks/gpu_check.sh OUT_DIR          # from the repository root, on a machine with a CUDA GPU
#
# Sections (each time-boxed with `timeout` and fail-soft: a failure is logged and the next one runs):
#   env        GPU, driver, torch/Triton versions, the Arch the launcher derives, missing Python modules;
#              installs the repo (`pip install --no-deps --no-build-isolation -e .`) if vit3 does not import
#   tests      the kernel tests on the GPU (compiled kernels, not the interpreter)
#   explain    the backend each mixer branch runs and why, for the six models (bf16, 224 px, training)
#   backends   forward + backward of every backend (VIT3_TTT_BACKEND) against the float64 reference,
#              at training shapes, fp32 and bf16 autocast (benchmarks/backend_check.py)
#   kernel     benchmarks/ttt_kernel.py: fused vs PyTorch vs official (bf16 autocast) vs SDPA, peak memory
#   models     ViT³-T/S and H-ViT³-T against DeiT-T/S (timm, SDPA) at 224/512/1024/1248 px: images/s and
#              peak memory, inference and training step, bf16 autocast (benchmarks/models.py)
#   compile    torch.compile of ViT³-T with graph breaks counted (benchmarks/compile_model.py)
# Writes OUT_DIR/gpu_check.log (everything), OUT_DIR/summary.txt (one line per section: rc, seconds),
# OUT_DIR/<section>.log and the CSVs (backend_check.csv, ttt_kernel_*.csv, models_*.csv, compile_model.csv).
#
# No network needed. Works with an older PyTorch/Triton than the repo's pins (e.g. torch 2.11 / Triton 3.6).
# Python wheels it needs beyond torch + triton (install them offline first; `env` lists what is missing):
#   timm (with torchvision, huggingface_hub, safetensors, pyyaml), numpy, pillow, tqdm, matplotlib
#   (contourpy, cycler, fonttools, kiwisolver, pyparsing, python-dateutil), pytest (iniconfig, pluggy).
#   Not needed here: einops, fvcore (+ iopath, yacs, portalocker, tabulate, termcolor) count FLOPs only
#   (models.py runs with --no-flops); ninja builds the C++ CPU kernel, which a GPU run does not use.
set -u -o pipefail

OUT=${1:?usage: bash benchmarks/gpu_check.sh OUT_DIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
LOG="$OUT/gpu_check.log"
: >"$LOG"
: >"$OUT/summary.txt"
PY=${PYTHON:-python}
export PYTHONUNBUFFERED=1
# GPU_CHECK_DEVICE=cpu: a dry run of the plumbing on a CPU (the interpreter, tiny sizes, a few tests).
DEVICE=${GPU_CHECK_DEVICE:-cuda}
export PY DEVICE
SLOW=1 # time limits x SLOW (the CPU dry run is slower)
if [ "$DEVICE" = cuda ]; then
  unset TRITON_INTERPRET # the GPU's compiled kernels, never the interpreter
  TESTS_ARGS=()
  BACKEND_ARGS=(--batch 16)
  KERNEL_ARGS=(--n 784 3136 12544 --d 32 64 --repeats 10)
  MODEL_ARGS=(--pairs vit3_tiny:h_vit3_tiny:deit_tiny_patch16_224 vit3_small:deit_small_patch16_224
    --res 224 512 1024 1248 --batch 64 16 4 2)
  COMPILE_ARGS=(--models vit3_tiny --img-size 224 --batch 16)
else
  export TRITON_INTERPRET=1
  SLOW=4
  TESTS_ARGS=(-k "N1 or deterministic or token_major")
  BACKEND_ARGS=(--batch 1 --quick --models vit3_tiny)
  KERNEL_ARGS=(--n 64 --d 16 --bh 2 --heads 2 --repeats 1)
  MODEL_ARGS=(--pairs test_vit3_ttt:deit_tiny_patch16_224 --res 32 --batch 1)
  COMPILE_ARGS=(--models test_vit3_ttt --img-size 64 --batch 1 --backend aot_eager)
fi

# section NAME SECONDS CMD...: runs CMD (a command or one of the functions below) under `timeout`, logs to
# OUT/NAME.log and the main log, never exits.
section() {
  local name=$1 limit=$(($2 * SLOW)) start rc
  shift 2
  start=$(date +%s)
  echo "=== $name (limit ${limit}s): $*" | tee -a "$LOG"
  timeout --kill-after=10 "$limit" bash -c '"$@"' _ "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  cat "$OUT/$name.log" >>"$LOG"
  [ "$rc" -eq 124 ] && echo "!!! $name timed out after ${limit}s" | tee -a "$LOG"
  echo "$name rc=$rc $(($(date +%s) - start))s" | tee -a "$LOG" "$OUT/summary.txt"
}

env_report() {
  nvidia-smi || true
  "$PY" -c "import vit3" 2>/dev/null || pip install --no-deps --no-build-isolation -e . || true
  "$PY" - "$DEVICE" <<'EOF'
import importlib, sys, torch
device = torch.device(sys.argv[1])
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
missing = []
for mod in ("triton", "timm", "torchvision", "huggingface_hub", "safetensors", "yaml", "numpy", "PIL", "tqdm",
            "matplotlib", "pytest", "einops", "fvcore"):
    try:
        m = importlib.import_module(mod)
        print(f"{mod} {getattr(m, '__version__', '?')}")
    except ImportError as e:
        missing.append(mod)
        print(f"{mod} MISSING ({e})")
from vit3.kernels import triton_op
if device.type == "cuda":
    print("arch", triton_op.Arch.of(device))
print("fp32 uses TF32:", triton_op.fp32_uses_tf32())
for name in ("swiglu", "linear", "dwconv"):
    for d in (16, 32, 64, 128):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            print("fits_device", name, d, dtype, triton_op.fits_device(name, d, dtype, device))
print("missing modules:", missing or "none")
EOF
}

explain_all() {
  local rc=0 model
  for model in vit3_tiny vit3_small vit3_base h_vit3_tiny h_vit3_small h_vit3_base; do
    echo "--- $model"
    "$PY" -m vit3.layers.backends "$model" --img-size 224 --device "$DEVICE" --dtype bf16 --train || rc=1
  done
  return $rc
}

kernel_tests() {
  local files="tests/test_kernels_ttt.py tests/test_kernels_launch.py"
  files="$files $(ls tests/test_*backend*.py 2>/dev/null | tr '\n' ' ')"
  # shellcheck disable=SC2086
  "$PY" -m pytest -q -p no:cacheprovider -o addopts="-ra" $files "$@"
}

export -f env_report explain_all kernel_tests

T0=$(date +%s)
section env 30 env_report
section tests 100 kernel_tests "${TESTS_ARGS[@]}"
section explain 30 explain_all
section backends 60 "$PY" benchmarks/backend_check.py --device "$DEVICE" --timeout $((50 * SLOW)) --out-dir "$OUT" \
  "${BACKEND_ARGS[@]}"
section kernel 60 "$PY" benchmarks/ttt_kernel.py --device "$DEVICE" --out-dir "$OUT" "${KERNEL_ARGS[@]}"
section models 90 "$PY" benchmarks/models.py --device "$DEVICE" --repeats 3 --no-flops --out "$OUT/models_${DEVICE}.csv" \
  "${MODEL_ARGS[@]}"
section compile 40 "$PY" benchmarks/compile_model.py --device "$DEVICE" --repeats 5 --out-dir "$OUT" \
  "${COMPILE_ARGS[@]}"
echo "total $(($(date +%s) - T0))s" | tee -a "$LOG" "$OUT/summary.txt"
