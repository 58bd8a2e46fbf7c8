"""One cell of the auto-mode table (`hf_loopspec.bench.auto_table` says what is measured); `bench_auto_table.sh`
runs every cell of BENCHMARKS.md's table.

    python3 scripts/bench_auto_table.py --model default --batch-size 8 --threads 2 --json cell.json
"""

import sys

from hf_loopspec.bench.auto_table import main

if __name__ == "__main__":
    sys.exit(main())
