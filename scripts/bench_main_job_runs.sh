#!/usr/bin/env bash
# The README's main job as a user runs it: one `hf-loopspec generate --mode auto --compare` process per run.
# First runs (each in a fresh HF_LOOPSPEC_CACHE: the cost table is measured, the acceptance probed), interleaved
# with the same first runs of another checkout when one is given; then later runs sharing one folder (the stored
# acceptance). Prints each run's statistics lines (stderr of the CLI).
#   scripts/bench_main_job_runs.sh [OTHER_CHECKOUT] [ROUNDS]
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
other="${1:-}"
rounds="${2:-8}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
run() {  # run ROOT FOLDER: one CLI process of checkout ROOT with cache folder FOLDER
  (cd "$1" && HF_LOOPSPEC_CACHE="$2" PYTHONPATH="$1" python3 -m hf_loopspec.cli generate "def fibonacci(n):" \
    --mode auto --repetition-penalty 1.4 --compare 2>&1 >/dev/null | grep -E "^\[|speed|identical")
}
for i in $(seq "$rounds"); do
  if [ -n "$other" ]; then
    echo "=== first run, other checkout ($other), round $i"
    run "$other" "$work/other_$i"
  fi
  echo "=== first run, this checkout, round $i"
  run "$here" "$work/this_$i"
done
for i in 1 2 3 4 5; do
  echo "=== this checkout, run $i in one folder"
  run "$here" "$work/later"
done
