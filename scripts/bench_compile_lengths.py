#!/usr/bin/env python
"""Time compiled speculative `generate` calls of different prompt and output lengths (and batch sizes), one after
the other in one process: what a user who compiles once and then sends other prompts waits for.

For each `PROMPT:NEW` or `PROMPT:NEW:BATCH` item of `--lengths` (batch `--batch-size` unless the item gives one,
fp32, greedy, random prompts as the bench makes them) it runs plain greedy decoding (untimed: the reference), then
the speculative call (`--mode`, `--draft-loops`, `compile_core=--compile`), timed from the call to its return: the
first call of a shape pays its compiles, later calls only what they compile anew. Each output is checked against the
reference.

    python scripts/bench_compile_lengths.py --model ouro-tiny --lengths 32:64,40:50,32:64
    python scripts/bench_compile_lengths.py --lengths 32:64:3,32:64:2,32:64:1,32:64:5     # batch sizes

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


def parse_lengths(text: str) -> list[tuple[int, int, int | None]]:
    """`--lengths`: (prompt, new, batch or None) per comma-separated PROMPT:NEW[:BATCH] item."""
    items = []
    for item in text.split(","):
        fields = item.split(":")
        if not (len(fields) in (2, 3) and all(f.isdigit() for f in fields) and int(fields[0]) > 0
                and int(fields[1]) > 1 and (len(fields) == 2 or int(fields[2]) > 0)):
            raise argparse.ArgumentTypeError(f"--lengths item {item!r} must be PROMPT:NEW or PROMPT:NEW:BATCH with "
                                             "PROMPT >= 1, NEW >= 2 and BATCH >= 1, e.g. 32:64 or 32:64:4")
        items.append((int(fields[0]), int(fields[1]), int(fields[2]) if len(fields) == 3 else None))
    return items


def main() -> None:
    from hf_loopspec.bench.args import positive, threads
    from hf_loopspec.cli import OneLineParser  # errors: one line, exit status 2

    parser = OneLineParser(prog="bench_compile_lengths.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="ouro-tiny", help="a bench shape or model path (hf-loopspec bench --model)")
    parser.add_argument("--lengths", type=parse_lengths, default="32:64,40:50,32:64",
                        help="comma-separated PROMPT:NEW or PROMPT:NEW:BATCH items, run in this order")
    parser.add_argument("--batch-size", type=positive, default=1)
    parser.add_argument("--mode", default="pipeline", choices=["pipeline", "block"])
    parser.add_argument("--draft-loops", type=positive, default=1)
    parser.add_argument("--compile", default="inductor", help="the torch.compile backend (compile_core)")
    parser.add_argument("--threads", type=threads, default=1)
    parser.add_argument("--fresh-cache", action="store_true", help="compile into an empty inductor cache directory")
    args = parser.parse_args()
    try:
        run(args)
    except (ValueError, OSError) as err:  # a model or setting the package refuses, or a model it cannot find
        parser.error(str(err))


def run(args: argparse.Namespace) -> None:
    """Load `--model` and time the `--lengths` items (see the module docstring)."""
    from hf_loopspec.generation.config import compile_backend

    compile_backend(args.compile)  # a ValueError for an unknown backend, before the model loads
    if args.fresh_cache:  # before the first compile, which reads it (torch._inductor.runtime.cache_dir_utils)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-")

    import torch

    from hf_loopspec.bench.prompts import PROMPT_TEXT, make_prompts
    from hf_loopspec.bench.run import bench_generation_config
    from hf_loopspec.loading import load_model

    torch.set_num_threads(args.threads)
    model, tokenizer, name = load_model(args.model, torch.float32, torch.device("cpu"), seed=0)
    vocab = model.get_output_embeddings().weight.shape[0]
    print(f"{name} | {args.mode} d={args.draft_loops} | compile_core={args.compile!r} | "
          f"threads {args.threads} | inductor cache "
          f"{'fresh' if args.fresh_cache else os.environ.get('TORCHINDUCTOR_CACHE_DIR', 'default')}")
    print(f"{'prompt':>6} {'new':>5} {'batch':>5} {'seconds':>8}  equal to plain")
    with bench_generation_config(model, None), torch.inference_mode():
        for prompt, new, batch in args.lengths:
            batch = batch or args.batch_size
            ids = make_prompts(tokenizer, vocab, batch, prompt, 0, PROMPT_TEXT)
            mask = torch.ones_like(ids)
            reference = model.generate(ids, attention_mask=mask, max_new_tokens=new, speculative_mode=None)
            start = time.perf_counter()
            out = model.generate(ids, attention_mask=mask, max_new_tokens=new, speculative_mode=args.mode,
                                 draft_loops=args.draft_loops, compile_core=args.compile)
            seconds = time.perf_counter() - start
            print(f"{prompt:>6} {new:>5} {batch:>5} {seconds:>8.2f}  {torch.equal(out, reference)}", flush=True)


if __name__ == "__main__":
    main()
