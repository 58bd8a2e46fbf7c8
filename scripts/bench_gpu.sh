#!/usr/bin/env bash
# GPU benchmark sized for one short run on an H200 (BENCH_LIMIT_S per batch size): the Ouro-1.4B shape with random
# weights in bf16, batch 1 and 8, synthetic acceptance 0.9, plain vs static (transformers' compiled static-cache
# path) vs ar vs block vs pipeline (d=1, K=4) on the wavefront engine, each lane mode also on the reference (the lane
# decoder, a measured baseline: rows MODE/reference), 3 interleaved repeats.
#
#   scripts/bench_gpu.sh                                    # on the GPU machine; JSON + table into $OUT (or .)
#   scripts/bench_gpu.sh --model ouro-tiny --device cpu     # CPU dry run: extra arguments override the defaults
#
# Each batch size runs in its own process under a time limit (BENCH_LIMIT_S, default 220 s), so one slow
# configuration cannot eat the whole budget; the table of every finished run is printed and kept in $OUT.
set -uo pipefail

OUT_DIR="$(mkdir -p "${OUT:-.}" && cd "${OUT:-.}" && pwd)"
cd "$(dirname "$0")/.."
LIMIT="${BENCH_LIMIT_S:-220}"
BATCHES="${BENCH_BATCHES:-1 8}"
PY="${PYTHON:-python3}"

"$PY" - <<'PY' || true
import torch
print(f"torch {torch.__version__}, cuda available: {torch.cuda.is_available()}"
      + (f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""))
PY

status=0
for B in $BATCHES; do
    echo "=== batch $B ==="
    timeout --kill-after=10 "$LIMIT" "$PY" -m hf_loopspec.cli bench \
        --model ouro-1.4b --dtype bfloat16 --device cuda \
        --batch-size "$B" --prompt-len 128 --new-tokens 128 \
        --modes plain,static,ar,block,pipeline --engines wavefront,reference --draft-loops 1 --num-speculative-tokens 4 \
        --synthetic-acceptance 0.9 --repeats 3 --calibration-seconds 5 \
        --json "$OUT_DIR/bench_gpu_b${B}.json" "$@" 2>"$OUT_DIR/bench_gpu_b${B}.log" | tee "$OUT_DIR/bench_gpu_b${B}.txt"
    rc=${PIPESTATUS[0]}
    if [ "$rc" -ne 0 ]; then
        echo "batch $B: exit status $rc (124 = over the ${LIMIT}s limit); last log lines:"
        tail -n 5 "$OUT_DIR/bench_gpu_b${B}.log"
        status=1
    fi
done
exit $status
