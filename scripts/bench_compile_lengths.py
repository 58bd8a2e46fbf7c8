#!/usr/bin/env python
"""Time compiled speculative `generate` calls of different prompt and output lengths, one after the other in one
process: what a user who compiles once and then sends prompts of other lengths waits for.

For each `PROMPT:NEW` pair of `--lengths` (batch `--batch-size`, fp32, greedy, random prompts as the bench makes
them) it runs plain greedy decoding (untimed: the reference), then the speculative call (`--mode`, `--draft-loops`,
`--engine`, `compile_core=--compile`), timed from the call to its return: the first call of a shape pays its
compiles, later calls only what they compile anew. Each output is checked against the reference.

    python scripts/bench_compile_lengths.py --model ouro-tiny --lengths 32:64,40:50,32:64

`--fresh-cache` points inductor at an empty cache directory (a cold compile, as in a new environment).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def parse_lengths(text: str) -> list[tuple[int, int]]:
    pairs = []
    for item in text.split(","):
        prompt, _, new = item.partition(":")
        if not (prompt.isdigit() and new.isdigit() and int(prompt) > 0 and int(new) > 1):
            raise argparse.ArgumentTypeError(f"--lengths item {item!r} must be PROMPT:NEW with PROMPT >= 1 and "
                                             "NEW >= 2, e.g. 32:64")
        pairs.append((int(prompt), int(new)))
    return pairs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="ouro-tiny", help="a bench shape or model path (hf-loopspec bench --model)")
    parser.add_argument("--lengths", type=parse_lengths, default="32:64,40:50,32:64",
                        help="comma-separated PROMPT:NEW pairs, run in this order")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--mode", default="pipeline", choices=["pipeline", "block"])
    parser.add_argument("--draft-loops", type=int, default=1)
    parser.add_argument("--engine", default="wavefront", choices=["wavefront", "lanes"])
    parser.add_argument("--compile", default="inductor", help="the torch.compile backend (compile_core)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--fresh-cache", action="store_true", help="compile into an empty inductor cache directory")
    args = parser.parse_args()
    if args.fresh_cache:  # before torch is imported: inductor reads it once
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-")

    import torch

    from hf_loopspec.bench.prompts import PROMPT_TEXT, make_prompts
    from hf_loopspec.bench.run import bench_generation_config
    from hf_loopspec.loading import load_model

    torch.set_num_threads(args.threads)
    model, tokenizer, name = load_model(args.model, torch.float32, torch.device("cpu"), seed=0)
    vocab = model.get_output_embeddings().weight.shape[0]
    print(f"{name} | {args.mode} d={args.draft_loops} | engine {args.engine} | compile_core={args.compile!r} | "
          f"batch {args.batch_size} | threads {args.threads} | inductor cache "
          f"{'fresh' if args.fresh_cache else os.environ.get('TORCHINDUCTOR_CACHE_DIR', 'default')}")
    print(f"{'prompt':>6} {'new':>5} {'seconds':>8}  equal to plain")
    with bench_generation_config(model, None), torch.inference_mode():
        for prompt, new in args.lengths:
            ids = make_prompts(tokenizer, vocab, args.batch_size, prompt, 0, PROMPT_TEXT)
            mask = torch.ones_like(ids)
            reference = model.generate(ids, attention_mask=mask, max_new_tokens=new, speculative_mode=None)
            start = time.perf_counter()
            out = model.generate(ids, attention_mask=mask, max_new_tokens=new, speculative_mode=args.mode,
                                 draft_loops=args.draft_loops, speculative_engine=args.engine,
                                 compile_core=args.compile)
            seconds = time.perf_counter() - start
            print(f"{prompt:>6} {new:>5} {seconds:>8.2f}  {torch.equal(out, reference)}", flush=True)


if __name__ == "__main__":
    main()
