"""The README's main job as a benchmark: the embedded default model, "def fibonacci(n):", repetition penalty 1.4,
64 new greedy tokens, one torch thread; plain `generate` against pipeline decoding (eager, and compiled with
`--compile BACKEND`) and, with `--modes`, the other fixed settings and `speculative_mode="auto"`, in one process,
interleaved rounds, medians. Every speculative output is checked equal to plain decoding's. Auto's first call (the
warm-up) measures its call costs; the rounds reuse them, as any later call of a process does.

    python3 scripts/bench_main_job.py --rounds 7 [--compile inductor] [--modes plain,pipeline,pipeline-d2,block,auto]
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_loopspec
from hf_loopspec.bench.auto_table import interleaved
from hf_loopspec.generation.config import compile_backend

PROMPT = "def fibonacci(n):"
SETTINGS = dict(max_new_tokens=64, do_sample=False, repetition_penalty=1.4)
RUNS = {"plain": {"speculative_mode": None}, "pipeline": {"speculative_mode": "pipeline", "draft_loops": 1},
        "pipeline-d2": {"speculative_mode": "pipeline", "draft_loops": 2},
        "block": {"speculative_mode": "block", "draft_loops": 1, "num_speculative_tokens": 4},
        "auto": {"speculative_mode": "auto"}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7, help="interleaved timed rounds (default: 7)")
    parser.add_argument("--compile", metavar="BACKEND", help="also time pipeline with compile_core=BACKEND")
    parser.add_argument("--modes", default="plain,pipeline", help=f"comma-separated runs among {','.join(RUNS)} "
                                                                  "(default: plain,pipeline)")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: give at least 1")
    names = [m for m in args.modes.split(",") if m]
    if "plain" not in names or any(m not in RUNS for m in names):
        parser.error(f"--modes {args.modes}: name plain and any of {','.join(RUNS)}")
    if args.compile:
        try:
            compile_backend(args.compile)
        except ValueError as error:
            parser.error(f"--compile {args.compile}: {error}")
    torch.set_num_threads(1)
    path = hf_loopspec.default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    inputs = tokenizer(PROMPT, return_tensors="pt")
    runs = {"plain": RUNS["plain"], **{name: RUNS[name] for name in names if name != "plain"}}
    if args.compile:
        runs["pipeline compiled"] = RUNS["pipeline"] | {"compile_core": args.compile}
    plain = {}

    def check(name: str, out) -> None:
        if name == "plain":
            plain["sequences"] = out.sequences
        elif not torch.equal(out.sequences, plain["sequences"]):
            raise SystemExit(f"{name}: tokens differ from plain decoding")

    with torch.inference_mode():  # one warm-up round (and compile), then the timed rounds
        times, outputs = interleaved(lambda **options: model.generate(**inputs, **SETTINGS, **options,
                                                                      return_dict_in_generate=True),
                                     runs, args.rounds, check)
    reference = plain["sequences"]
    stats = {name: out.speculation for name, out in outputs.items() if name != "plain"}
    new = reference.shape[1] - inputs["input_ids"].shape[1]
    base = statistics.median(times["plain"])
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}; {new} new tokens, "
          f"{args.rounds} rounds")
    for name in runs:
        median = statistics.median(times[name])
        line = f"{name:18s} median {median * 1e3:7.1f} ms  {new / median:6.1f} tok/s  {base / median:.2f}x plain"
        if name in stats:
            s = stats[name]
            line += f"  engine {s.engine}, core calls/token {s.core_calls / new:.2f}, accepted {s.accepted}/{s.drafted}"
            if hasattr(s, "choices"):
                line += "  ran " + ", ".join(f"{c.mode}(d={c.draft_loops})x{c.tokens}" if c.draft_loops
                                             else f"{c.mode}x{c.tokens}" for c in s.choices)
        print(line)


if __name__ == "__main__":
    main()
