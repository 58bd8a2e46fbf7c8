#!/usr/bin/env bash
# Every cell of BENCHMARKS.md's auto-mode table, each in its own process (auto's cost tables are per process and
# thread count), one JSON per cell under ${1:-bench_results/auto_table}. Each cell gets a fresh HF_LOOPSPEC_CACHE
# folder: its warm-up round measures the cost table, and no acceptance stored by an earlier cell (the same model and
# settings at another acceptance or thread count) decides its start.
set -euo pipefail
out=${1:-bench_results/auto_table}
mkdir -p "$out"
here=$(dirname "$0")
cell() {
  local cache
  cache=$(mktemp -d)
  HF_LOOPSPEC_CACHE=$cache python3 "$here/bench_auto_table.py" "$@"
  rm -rf "$cache"
}
for threads in 1 2; do
  for batch in 1 8; do
    cell --model default --batch-size "$batch" --threads "$threads" --rounds 5 \
      --json "$out/default_b${batch}_t${threads}.json"
  done
  for batch in 1 16; do
    for acceptance in 0.9 0.3; do
      cell --model ouro-100m --batch-size "$batch" --synthetic-acceptance "$acceptance" \
        --prompt-len 32 --new-tokens 32 --threads "$threads" --rounds $((batch == 1 ? 5 : 2)) \
        --json "$out/ouro100m_b${batch}_a${acceptance}_t${threads}.json"
    done
  done
done
