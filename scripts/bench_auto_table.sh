#!/usr/bin/env bash
# Every cell of BENCHMARKS.md's auto-mode table, each in its own process (auto's cost tables are per process and
# thread count), one JSON per cell under ${1:-bench_results/auto_table}.
set -euo pipefail
out=${1:-bench_results/auto_table}
mkdir -p "$out"
here=$(dirname "$0")
for threads in 1 2; do
  for batch in 1 8; do
    python3 "$here/bench_auto_table.py" --model default --batch-size "$batch" --threads "$threads" --rounds 5 \
      --json "$out/default_b${batch}_t${threads}.json"
  done
  for batch in 1 16; do
    for acceptance in 0.9 0.3; do
      python3 "$here/bench_auto_table.py" --model ouro-100m --batch-size "$batch" --synthetic-acceptance "$acceptance" \
        --prompt-len 32 --new-tokens 32 --threads "$threads" --rounds 2 \
        --json "$out/ouro100m_b${batch}_a${acceptance}_t${threads}.json"
    done
  done
done
