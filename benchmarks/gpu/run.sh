#!/usr/bin/env bash
# The GPU benchmark in one call: build this project with CUDA for one architecture (llama.cpp's
# llama-server and llama-batched-bench in the same tree, so they share its libraries), write a
# 1B-class random-weight model with SmolLM2's tokenizer while it builds, quantize it to Q4_K_M,
# and run benchmarks/gpu/bench.py. Seen on an H200 (16 cores): build about 4 minutes, the rest 2-3.
#
#   bash benchmarks/gpu/run.sh                      # from the repository root
#
# Environment: LLAMA_CPP_DIR (llama.cpp's source; default ./llama.cpp, fetched when empty),
# BUILD (build folder, default /tmp/aiollama-gpu), CUDA_ARCH (default 90), JOBS, OUT (where the
# logs and results go, default /tmp/aiollama-gpu-out), TOKENIZER (a GGUF file whose tokenizer the
# model takes; default: the default model), SHAPE ("layers width heads kv_heads ffn"),
# BENCH_ARGS (for bench.py), WHEELS (a folder of wheels to install first, for a machine without a
# package registry), NOBENCH=1 (stop once the model is ready), and CPU=1: the same steps without
# CUDA and on a tiny shape, to try it anywhere.
set -u
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=${BUILD:-/tmp/aiollama-gpu}; OUT=${OUT:-/tmp/aiollama-gpu-out}; JOBS=${JOBS:-$(nproc)}
PY=${PYTHON:-python3}; T0=$(date +%s); mkdir -p "$OUT" "$BUILD"
say() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
export PYTHONUNBUFFERED=1 PATH=$PATH:/usr/local/cuda/bin
if [ -n "${WHEELS:-}" ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --target "$BUILD/site" "$WHEELS"/*.whl || exit 1
  export PYTHONPATH="$BUILD/site${PYTHONPATH:+:$PYTHONPATH}"
fi
if [ -z "${CPU:-}" ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nvcc --version | tail -1
  GPU_FLAGS="-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCH:-90}"; SHAPE=${SHAPE:-16 2048 32 8 8192}
else
  GPU_FLAGS=""; SHAPE=${SHAPE:-2 256 4 2 768}
fi
SRC=${LLAMA_CPP_DIR:-$ROOT/llama.cpp}
[ -f "$SRC/CMakeLists.txt" ] || $PY "$ROOT/cmake/fetch_llama_cpp.py" "$SRC" || exit 1
say "configure"
cmake -S "$ROOT" -B "$BUILD/tree" -G Ninja -DCMAKE_BUILD_TYPE=Release -DLLAMA_CPP_DIR="$SRC" $GPU_FLAGS \
  -DAIOLLAMA_TOOLS=ON -DLLAMA_BUILD_UI=OFF \
  -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DPython_EXECUTABLE="$(command -v $PY)" \
  > "$OUT/cmake.log" 2>&1 || { tail -40 "$OUT/cmake.log"; exit 1; }
TOK=${TOKENIZER:-$($PY -c 'import sys; sys.path.insert(0, "'"$ROOT"'"); from aiollama.models import pull; print(pull())' 2>/dev/null)}
( $PY "$ROOT/benchmarks/gpu/model.py" "$TOK" "$BUILD/model-f16.gguf" $SHAPE > "$OUT/model.log" 2>&1 ) &
MODEL_PID=$!
say "build"
cmake --build "$BUILD/tree" -j "$JOBS" --target _llama_cffi llama-server llama-batched-bench > "$OUT/build.log" 2>&1 \
  || { grep -m5 -B2 -A8 'error' "$OUT/build.log"; tail -30 "$OUT/build.log"; exit 1; }
say "built"
# the package as installed: the sources beside the extension and llama.cpp's libraries
PKG="$BUILD/pkg"; rm -rf "$PKG"; mkdir -p "$PKG"; cp -r "$ROOT/aiollama" "$PKG/"
cp "$BUILD"/tree/_llama_cffi*.so "$BUILD"/tree/bin/lib*.so "$PKG/aiollama/"
export PYTHONPATH="$PKG${PYTHONPATH:+:$PYTHONPATH}"
wait $MODEL_PID; cat "$OUT/model.log"
MODEL=$BUILD/model-f16.gguf
if [ -z "${CPU:-}" ]; then
  say "quantize"
  $PY -c "from aiollama.native.model import quantize; quantize('$MODEL', '$BUILD/model-q4km.gguf', 'q4_k_m')" && MODEL=$BUILD/model-q4km.gguf
fi
[ -n "${NOBENCH:-}" ] && { say "ready: $MODEL"; exit 0; }
say "bench $MODEL"
EXTRA=""; [ -n "${CPU:-}" ] && EXTRA="--cpu --levels 1,4 --tokens 16 --rounds 2 --threads $(nproc)"
$PY "$ROOT/benchmarks/gpu/bench.py" "$MODEL" --bin "$BUILD/tree/bin" --json "$OUT/gpu_bench.json" $EXTRA ${BENCH_ARGS:-} \
  2>&1 | tee "$OUT/bench.log"
say "done"
