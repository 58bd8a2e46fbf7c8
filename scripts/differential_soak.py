"""Soak run of the randomized differential comparison (`tests/differential.py`): many more seeded cases than the
suite's `tests/test_differential.py`, for developers.

    PYTHONPATH=$PWD python3 scripts/differential_soak.py --cases 2000 [--start 0] [--show-ties]

Prints one line per mismatch (a crash, or a divergent token with plain's top-1 / top-2 margin there), a summary, and
exits 1 when a case is a bug (a crash, or a divergence above the near-tie bound), else 0.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import torch  # noqa: E402
from differential import draw_case, run_case  # noqa: E402
from tqdm import tqdm  # noqa: E402

from hf_loopspec.bench.args import non_negative, positive  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--start", type=non_negative, default=0, help="first case seed (default 0)")
    parser.add_argument("--cases", type=positive, default=1000, help="number of consecutive seeds (default 1000)")
    parser.add_argument("--show-ties", action="store_true", help="also print divergences within fp32 rounding")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)  # the plain-fallback notice of every case with a user processor
    bugs = ties = 0
    started = time.monotonic()
    for seed in tqdm(range(args.start, args.start + args.cases), unit="case"):
        mismatch = run_case(draw_case(seed))
        if mismatch is None:
            continue
        if mismatch.near_tie:
            ties += 1
            if not args.show_ties:
                continue
        else:
            bugs += 1
        tqdm.write(("near-tie " if mismatch.near_tie else "BUG ") + str(mismatch))
    print(f"{args.cases} cases in {time.monotonic() - started:.0f} s: {bugs} bugs, {ties} near-ties")
    return 1 if bugs else 0


if __name__ == "__main__":
    sys.exit(main())
