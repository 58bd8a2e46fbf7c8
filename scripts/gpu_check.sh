#!/usr/bin/env bash
# Everything the project needs to learn from a lent GPU, in one prepared run of at most about 8 minutes.
#
#   scripts/gpu_check.sh prepare    # HERE, before the run: the wheels the GPU machine lacks into .whl/
#   scripts/gpu_check.sh            # THERE (device tool: carry .whl, timeout_s 600): results into $OUT
#
# The GPU image has torch, triton and the Hub client but an older transformers than the package needs, so
# `prepare` downloads that one wheel (pure Python) and the run installs it into /tmp/site first: 5.24, the oldest
# release the package supports, because 5.25 needs huggingface_hub >= 2.4 and `kernels`, which the image lacks
# (it has huggingface_hub 1.33; device/KINDS.md). Then:
#   1. gpu_check.log: the machine (nvidia-smi, torch, CUDA, triton), then `pytest -m gpu`: the Triton paged
#      kernels against the naive reference in fp32/fp16/bf16 (tests/test_attention_ops.py) and the wavefront
#      engine on CUDA (tests/test_gpu_engine.py: the CUDA-graph step against eager and plain, pinned read-backs),
#      and the KV moved between DynamicCache and PagedLoopCache on CUDA (tests/test_cache_convert.py);
#   2. scripts/bench_gpu.sh: the ouro-1.4b shape in bf16, batch 1 and 8, ar, block and pipeline on both engines
#      beside plain, with the bf16 agreement report (agreement rate, first divergent token, top-1/top-2 margin
#      there) in each row: bench_gpu_b{1,8}.{json,log}. Not `static`: transformers compiles its static-cache loop
#      over the model's unrolled loops, a compile time nobody has measured that could eat a stage's limit; run it
#      with a longer lease (`scripts/bench_gpu.sh`: its own default modes include it).
#   3. the ragged serving workload (bench_gpu.sh's last stage, one round): bench_workload.{json,log}.
# The tables go into gpu_check.log; the seven files in $OUT stay under the device tool's eight. The progress logs
# hold each timed run's figure (bench: seconds; workload: tokens/s), so a stage stopped at its limit still reports. Each stage runs
# under its own time limit, so one that hangs cannot eat the rest of the lease: pytest PYTEST_LIMIT_S (140 s, and
# 60 s a test where pytest-timeout is installed), each batch size BENCH_LIMIT_S (100 s), the workload
# BENCH_WORKLOAD_LIMIT_S (90 s), each plus 10 s to be killed: at most 140 + 2 x 100 + 90 + 4 x 10 = 470 s, about
# 8 minutes with the install and the machine report, under the device tool's 600 s per command.
set -uo pipefail
cd "$(dirname "$0")/.."
TRANSFORMERS_WHEEL="transformers==5.24.0"

if [ "${1:-}" = "prepare" ]; then
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
    exec python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        -d .whl "$TRANSFORMERS_WHEEL"
fi

OUT_DIR="$(mkdir -p "${OUT:-gpu_check_out}" && cd "${OUT:-gpu_check_out}" && pwd)"
LOG="$OUT_DIR/gpu_check.log"
PY="${PYTHON:-python3}"
if ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "installing .whl/ failed" | tee "$LOG"; exit 1; }
    export PYTHONPATH="/tmp/site:$PWD"
else
    export PYTHONPATH="$PWD"
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

{
    echo "=== machine ==="
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
    "$PY" - <<'PY'
import torch, transformers
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), transformers {transformers.__version__}, "
      f"cuda available: {torch.cuda.is_available()}")
try:
    import triton
    print(f"triton {triton.__version__}")
except ImportError:
    print("triton: not installed")
PY
    echo "=== pytest -m gpu ==="
    timeout --kill-after=10 "${PYTEST_LIMIT_S:-140}" "$PY" -m pytest -q -m gpu -p no:cacheprovider -rs --tb=short \
        -o timeout=60 \
        tests/test_attention_ops.py tests/test_gpu_engine.py tests/test_cache_convert.py
    echo "pytest exit status: $? (124 = over its time limit)"
} 2>&1 | tee "$LOG"

echo "=== bench ===" | tee -a "$LOG"
BENCH_LIMIT_S="${BENCH_LIMIT_S:-100}" BENCH_WORKLOAD_LIMIT_S="${BENCH_WORKLOAD_LIMIT_S:-90}" \
    BENCH_WORKLOAD_ARGS="--rounds 1 ${BENCH_WORKLOAD_ARGS:-}" OUT="$OUT_DIR" \
    scripts/bench_gpu.sh --repeats 2 --modes plain,ar,block,pipeline "$@" 2>&1 | tee -a "$LOG"
