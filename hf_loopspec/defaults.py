"""Defaults and names that the command line shows before anything heavy loads (no heavy imports: `hf-loopspec
--help` builds its parser from these without torch or transformers)."""

import os

DEFAULT_DRAFT_LOOPS = 1  # d: drafts read after the first loop
DEFAULT_NUM_SPECULATIVE_TOKENS = 4  # K: drafts per block round
DTYPE_NAMES = ("bfloat16", "float16", "float32")  # the torch dtypes `--dtype` takes (`loading.DTYPES`)
CPUS = os.cpu_count() or 1  # the most `--threads`: threads past the CPUs never run at once (10**5 ran out of memory)
