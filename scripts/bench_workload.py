"""The ragged-workload benchmark: static batches through `generate` against continuous batching, plain against
pipeline, all at once and with Poisson arrivals (`hf_loopspec.bench.workload_main` says what is measured).

    python3 scripts/bench_workload.py --model ouro-100m --synthetic-acceptance 0.9 --json ragged.json
    python3 scripts/bench_workload.py --model ouro-tiny --requests 8 --batching static     # a quick look
"""

import sys

from hf_loopspec.bench.workload_main import main

if __name__ == "__main__":
    sys.exit(main())
