"""One cell of the auto-mode table: `speculative_mode="auto"` beside plain decoding and the fixed settings it
chooses among, on one model, batch, acceptance and thread count, in one process, interleaved rounds, medians.

Runs, each a `generate` call of the whole batch: `plain` (transformers' loop), `block` (d = 1, K = 4),
`pipeline` (d = 1), `pipeline-d2` (d = 2) and `auto`. The first round is a warm-up: it is where auto measures
its call costs when no table is cached (`generation.auto_calibration`), as the first auto call of a process does.
Every speculative output is checked against plain greedy decoding (fp32: equal, or the cell fails with exit 1).

* The embedded model (`--model default`): real drafts, the README main job's settings (repetition penalty 1.4,
  greedy), its prompt "def fibonacci(n):" and, at batch > 1, lines cut from Python source (`prompts.PROMPT_CODE`),
  left-padded.
* A random-weight shape (`--model ouro-100m`): random prompts, no EOS, and `--synthetic-acceptance A`: every
  speculative run (auto included) gets the same host-side `draft_hook` (`run.synthetic_hook`, fed with plain
  decoding's tokens), so their drafts are right with probability A.

    python3 scripts/bench_auto_table.py --model default --batch-size 8 --threads 2 --json cell.json
    python3 scripts/bench_auto_table.py --model ouro-100m --synthetic-acceptance 0.3 --new-tokens 32
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time

import torch

from .args import fraction, positive
from .report import check_writable
from .shape_table import SHAPES

RUNS = {"plain": {"speculative_mode": None},
        "block": {"speculative_mode": "block", "draft_loops": 1, "num_speculative_tokens": 4},
        "pipeline": {"speculative_mode": "pipeline", "draft_loops": 1},
        "pipeline-d2": {"speculative_mode": "pipeline", "draft_loops": 2},
        "auto": {"speculative_mode": "auto"}}
MAIN_JOB_PROMPT = "def fibonacci(n):"
EMBEDDED_SETTINGS = {"do_sample": False, "repetition_penalty": 1.4}  # the README main job's


def interleaved(generate, runs: dict[str, dict], rounds: int, check) -> tuple[dict, dict]:
    """Time `generate(**options)` for every run in `runs`, round after round (one warm-up round first, untimed, in
    `runs`' order). Timed round r runs them in that order rotated by r, so that no run always follows the same one
    (on a machine whose threads share its cores, what ran just before moves a run's time). `check(name, out)` sees
    every output. Returns (name -> list of seconds, name -> the output of its median-time round: the faster of the
    two middle ones for an even count, as `report.median_run`), so that what a row reports of a run (auto's choices,
    counters) is the round its median time comes from."""
    names = list(runs)
    times, outputs = {name: [] for name in names}, {name: [] for name in names}
    for r in range(rounds + 1):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            start = time.perf_counter()
            out = generate(**runs[name])
            if r:
                times[name].append(time.perf_counter() - start)
                outputs[name].append(out)
            check(name, out)
    median_round = {name: sorted(range(rounds), key=times[name].__getitem__)[(rounds - 1) // 2] for name in names}
    return times, {name: outputs[name][median_round[name]] for name in names}


def _inputs(args, model, tokenizer) -> dict:
    from .prompts import PROMPT_CODE, make_prompts

    if tokenizer is None:
        ids = make_prompts(None, model.config.vocab_size, args.batch_size, args.prompt_len, args.seed)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    lines = [line for line in PROMPT_CODE.splitlines() if line.strip()]
    texts = [MAIN_JOB_PROMPT] + ["\n".join(lines[b: b + 3]) for b in range(args.batch_size - 1)]
    tokenizer.padding_side = "left"
    return dict(tokenizer(texts, return_tensors="pt", padding=True))


def run_cell(args) -> dict:
    """Run the cell `args` describes; returns its result document (see `main`)."""
    from ..loading import load_model
    from .run import bench_generation_config, synthetic_hook

    torch.set_num_threads(args.threads)
    model, tokenizer, name = load_model(args.model, torch.float32, torch.device("cpu"), seed=args.seed)
    inputs = _inputs(args, model, tokenizer)
    settings = {"max_new_tokens": args.new_tokens, "return_dict_in_generate": True,
                **(EMBEDDED_SETTINGS if tokenizer is not None else {"do_sample": False})}
    width = inputs["input_ids"].shape[1]
    plain = {}
    hook = None
    segments = []  # per round (the warm-up first): the seconds of auto's segments, summed

    def check(run: str, out) -> None:
        nonlocal hook
        if run == "auto":
            segments.append(sum(c.seconds for c in out.speculation.choices))
        if run == "plain":
            plain["sequences"] = out.sequences
            if args.synthetic_acceptance is not None and hook is None:
                hook = synthetic_hook(out.sequences[:, width:], width, args.synthetic_acceptance,
                                      model.head_width, args.seed)
        elif not torch.equal(out.sequences, plain["sequences"]):
            raise SystemExit(f"{run}: tokens differ from plain decoding")

    def generate(**options):
        extra = {"draft_hook": hook} if hook is not None and options["speculative_mode"] else {}
        return model.generate(**inputs, **settings, **options, **extra)

    names = ["plain", *(m for m in args.modes if m != "plain")]
    config = bench_generation_config(model, None) if tokenizer is None else contextlib.nullcontext()
    with torch.inference_mode(), config:
        times, outputs = interleaved(generate, {n: RUNS[n] for n in names}, args.rounds, check)
    base = statistics.median(times["plain"])
    rows = {}
    for run in names:
        median = statistics.median(times[run])
        rows[run] = {"median_s": median, "x_plain": base / median, "rounds_s": times[run]}
        stats = outputs[run].speculation if run != "plain" else None
        if stats is not None and hasattr(stats, "choices"):
            rows[run]["choices"] = [f"{c.mode}(d={c.draft_loops})x{c.tokens}" if c.draft_loops
                                    else f"{c.mode}x{c.tokens}" for c in stats.choices]
    if "auto" in rows:  # auto's own work: each round's time outside its segments' generate calls
        own = [total - inside for total, inside in zip(times["auto"], segments[1:])]
        rows["auto"] |= {"segments_s": segments[1:], "own_median_s": statistics.median(own)}
    fixed = [r for r in names if r != "auto"]
    best = max(fixed, key=lambda r: rows[r]["x_plain"])
    summary = {"best_fixed": best}
    if "auto" in rows:
        summary["auto_x_best"] = rows["auto"]["x_plain"] / rows[best]["x_plain"]
        summary["auto_x_plain"] = rows["auto"]["x_plain"]
    return {"model": name, "batch_size": args.batch_size, "new_tokens": args.new_tokens,
            "synthetic_acceptance": args.synthetic_acceptance, "threads": args.threads, "rounds": args.rounds,
            "load_average": os.getloadavg(), "rows": rows, **summary}


def parser() -> argparse.ArgumentParser:
    from ..cli import OneLineParser  # errors: one line, exit status 2

    p = OneLineParser(prog="bench_auto_table.py", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="'default' (the embedded model) or a shape such as ouro-100m")
    p.add_argument("--batch-size", type=positive, default=1)
    p.add_argument("--prompt-len", type=positive, default=32, help="random-weight shapes (default: %(default)s)")
    p.add_argument("--new-tokens", type=positive, default=64)
    p.add_argument("--synthetic-acceptance", type=fraction, default=None, metavar="A")
    p.add_argument("--threads", type=positive, default=1)
    p.add_argument("--rounds", type=positive, default=5, help="timed rounds after the warm-up (default: 5)")
    p.add_argument("--modes", type=lambda text: text.split(","), default=list(RUNS),
                   help=f"comma-separated among {','.join(RUNS)} (default: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="also write the result document here")
    return p


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if bad := [m for m in args.modes if m not in RUNS]:
        p.error(f"--modes: {','.join(bad)}: choose among {','.join(RUNS)}")
    if (args.model in SHAPES) != (args.synthetic_acceptance is not None):
        p.error(f"--model {args.model}: give --synthetic-acceptance with a random-weight shape and only with one "
                "(a checkpoint drafts for real).")
    try:
        if args.json is not None:  # before the run, so that a long run is not lost at its end
            if not args.json:
                raise ValueError("--json is empty: pass a file path, or leave --json out.")
            check_writable(args.json, "--json")
        result = run_cell(args)
    except (ValueError, OSError) as err:  # (OSError: a --model that is no folder, and no Hub id reachable offline)
        p.error(str(err))
    acceptance = "real" if args.synthetic_acceptance is None else args.synthetic_acceptance
    print(f"{result['model']} | batch {args.batch_size} | acceptance {acceptance} | "
          f"threads {args.threads} | {args.new_tokens} new tokens | {args.rounds} rounds | load "
          f"{result['load_average'][0]:.2f}")
    for run, row in result["rows"].items():
        print(f"{run:12s} {row['median_s'] * 1e3:9.1f} ms  {row['x_plain']:.2f}x plain  "
              f"{' '.join(row.get('choices', []))}")
    if "auto_x_best" in result:
        own = result["rows"]["auto"]["own_median_s"]
        print(f"auto: {result['auto_x_best']:.2f}x the best fixed ({result['best_fixed']}), "
              f"{result['auto_x_plain']:.2f}x plain; its own work outside its segments: {own * 1e3:.1f} ms (median)")
    if args.json is not None:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=1)
    return 0
