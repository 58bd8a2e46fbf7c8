"""`hf-loopspec batch PROMPTS --output OUT.jsonl`: generate for every row of a JSONL file, in one process or
data-parallel under `accelerate launch`, resumable after a kill.

Modules: `readers` (the rows of a JSONL, JSON, CSV or Parquet file), `prompts` (checking the rows, the
length-grouped batch plan), `parts` (the per-process part files, resuming, the atomic merge, the checks of links and
settings), `lock` (one run at a time per output), `fingerprint` (what the weights were, so that a resume cannot mix
models), `progress` (the whole run's bar) and `run` (the command: sharding with accelerate, decoding).

Output: one JSON row per input row, in input order: `id`, `completion` (the new text, EOS excluded), `new_tokens`
(EOS included), `stop` (`"eos"`, `"stop_string"`: a saved stop string ended it, or `"length"`) and, in the
speculative modes, `speculation` (that row's counters: committed, drafted, verified, accepted, rejected, discarded).
"""

from .run import run_batch

__all__ = ["run_batch"]
