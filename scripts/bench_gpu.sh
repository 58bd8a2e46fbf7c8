#!/usr/bin/env bash
# GPU benchmark sized for one short run on an H200 (BENCH_LIMIT_S per batch size): the Ouro-1.4B shape with random
# weights in bf16, batch 1 and 8, synthetic acceptance 0.9, plain vs static (transformers' compiled static-cache
# path) vs ar vs block vs pipeline (d=1, K=4) on the wavefront engine, each lane mode also on the reference (the lane
# decoder, a measured baseline: rows MODE/reference), 3 interleaved repeats.
#
#   scripts/bench_gpu.sh                                    # on the GPU machine; tables on stdout, JSON into $OUT
#   scripts/bench_gpu.sh --model ouro-tiny --device cpu     # CPU dry run: extra arguments override the defaults
#     (of the bench runs; the workload run takes BENCH_WORKLOAD_ARGS: for a CPU dry run add
#     BENCH_WORKLOAD_ARGS="--model ouro-tiny --dtype float32 --device cpu", or BENCH_WORKLOAD=0 to skip it)
#
# Each batch size runs in its own process under a time limit (BENCH_LIMIT_S, default 220 s), so one slow
# configuration cannot eat the whole budget; the table of every finished run is printed, its JSON and progress log
# (each timed run's seconds, so a run stopped at the limit still reports what it measured) kept in $OUT.
#
# Then the ragged serving workload (scripts/bench_workload.py: 64 requests, prompts and outputs of 16-256 tokens,
# all at once and Poisson arrivals at 8/s; static batches of 8 through generate against continuous batching with 8
# slots, plain against pipeline, synthetic acceptance 0.9), in its own process under BENCH_WORKLOAD_LIMIT_S
# (default 300 s); BENCH_WORKLOAD=0 skips it, BENCH_WORKLOAD_ARGS adds or overrides its options.
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
        --json "$OUT_DIR/bench_gpu_b${B}.json" "$@" 2>"$OUT_DIR/bench_gpu_b${B}.log"
    rc=$?
    if [ "$rc" -ne 0 ]; then
        echo "batch $B: exit status $rc (124 = over the ${LIMIT}s limit); last log lines:"
        tail -n 5 "$OUT_DIR/bench_gpu_b${B}.log"
        status=1
    fi
done

if [ "${BENCH_WORKLOAD:-1}" != "0" ]; then
    echo "=== ragged workload ==="
    # shellcheck disable=SC2086  # BENCH_WORKLOAD_ARGS is a list of options
    timeout --kill-after=10 "${BENCH_WORKLOAD_LIMIT_S:-300}" "$PY" scripts/bench_workload.py \
        --model ouro-1.4b --dtype bfloat16 --device cuda --requests 64 --prompt-lens 16-256 --new-tokens 16-256 \
        --slots 8 --arrival-rate 8 --synthetic-acceptance 0.9 --rounds 2 \
        --json "$OUT_DIR/bench_workload.json" ${BENCH_WORKLOAD_ARGS:-} 2>"$OUT_DIR/bench_workload.log"
    rc=$?
    if [ "$rc" -ne 0 ]; then
        echo "ragged workload: exit status $rc (124 = over the limit); last log lines:"
        tail -n 5 "$OUT_DIR/bench_workload.log"
        status=1
    fi
fi
exit $status
