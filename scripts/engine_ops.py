"""Tensor ops dispatched per core call by the wavefront engine and by the reference (the lane decoder), eager, on the
embedded model: pipeline decoding (d = 1, optionally with second proposals), batch 1, a 64-token prompt, 64 new
tokens. Eager on a CPU every op costs its dispatch whatever its size, so on a small model the op count, not the
layers, separates the two (BENCHMARKS.md, "One engine"); `--top N` lists the source lines that dispatch the most.

    python3 scripts/engine_ops.py [--second-draft-loops 3] [--top 15]
"""

from __future__ import annotations

import argparse
import collections
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, MaxLengthCriteria, StoppingCriteriaList

import hf_loopspec
from hf_loopspec import PagedLoopCache
from hf_loopspec.generation.config import resolve_speculative
from hf_loopspec.generation.dispatch import SpeculativeRequest
from hf_loopspec.generation.wavefront.engine import WavefrontEngine

PROMPT, NEW = 64, 64


class OpCounter(TorchDispatchMode):
    """Counts every dispatched aten op by the package source line that issued it."""

    def __init__(self):
        super().__init__()
        self.lines = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        ours = [f for f in traceback.extract_stack() if "hf_loopspec" in f.filename]
        where = f"{ours[-1].filename.split('hf_loopspec/')[-1]}:{ours[-1].lineno}" if ours else "(outside)"
        self.lines[where] += 1
        return func(*args, **(kwargs or {}))


def run(model, ids: torch.Tensor, engine: str, second: int | None):
    """One pipeline run on `engine` ("wavefront" or "reference"); returns its `DecodeResult`."""
    cache, max_length = PagedLoopCache(model.kv_layout), ids.shape[1] + NEW
    if engine == "reference":
        return model.decode_with_lanes(
            ids, "pipeline", draft_loops=1, second_draft_loops=second, cache=cache, max_length=max_length,
            attention_mask=None, logits_processor=None, pad_token_id=0,
            stopping_criteria=StoppingCriteriaList([MaxLengthCriteria(max_length)]))
    spec = resolve_speculative("pipeline", 1, None, num_loops=model.num_loops, second_draft_loops=second)
    return WavefrontEngine.from_request(model, SpeculativeRequest(spec, cache, ids, max_length, pad_token_id=0)).run()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--second-draft-loops", type=int, default=None, help="d2 of second proposals (default: off)")
    parser.add_argument("--top", type=int, default=10, help="source lines to list per engine (default: 10)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(hf_loopspec.default_model_path(), dtype=torch.float32).eval()
    ids = torch.randint(5, model.config.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        for engine in ("wavefront", "reference"):
            run(model, ids, engine, args.second_draft_loops)  # warm-up
            with OpCounter() as counter:
                result = run(model, ids, engine, args.second_draft_loops)
            calls = result.stats.core_calls
            print(f"{engine}: {sum(counter.lines.values()) / calls:.0f} ops per core call ({calls} calls)")
            for where, n in counter.lines.most_common(args.top):
                print(f"  {n / calls:6.1f}  {where}")


if __name__ == "__main__":
    main()
