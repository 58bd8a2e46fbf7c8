"""The ragged-workload benchmark (`scripts/bench_workload.py`): static batches through `generate` against continuous
batching, plain against pipeline decoding, for the requests all at once and with Poisson arrivals, in one process.

Every (engine, batching, arrivals) run is warmed up once, then the runs are interleaved (`--rounds` rounds of every
run in the same order) on one torch thread (`--threads`); each row reports the medians over the rounds of its
throughput (the requests' own new tokens, not the padding a static batch runs for, over the wall time from the first
arrival to the last finish) and of its p50 / p95 request latency (finish minus arrival). The static plain burst's
warm-up is the reference: every run's output of every request must equal it in fp32 (`check_passed`), and with
`--synthetic-acceptance A` it is the known greedy token that pipeline drafts are replaced by (`hf_loopspec.bench`
says how). Batching and arrivals are described in `hf_loopspec.bench.workload`.

    python3 scripts/bench_workload.py --model ouro-100m --synthetic-acceptance 0.9 --json ragged.json
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
from dataclasses import replace

from .args import fraction, positive, positive_float, seed, threads
from .report import check_writable
from .shape_table import SHAPES

ENGINES = ("plain", "pipeline")
BATCHING = ("static", "continuous")


def length_range(text: str) -> tuple[int, int]:
    """'LO-HI' (inclusive, 1 <= LO <= HI) or 'N' (LO = HI = N)."""
    parts = text.split("-")
    try:
        low, high = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (0, -1)
    except ValueError:
        low, high = 0, -1
    if not 1 <= low <= high:
        raise argparse.ArgumentTypeError(f"{text!r} is not a range LO-HI of token counts with 1 <= LO <= HI")
    return low, high


def choices(allowed: tuple[str, ...]):
    """An argparse type: a comma-separated subset of `allowed`."""
    def parse(text: str) -> list[str]:
        picked = [p.strip() for p in text.split(",") if p.strip()]
        bad = [p for p in picked if p not in allowed]
        if bad or not picked:
            raise argparse.ArgumentTypeError(f"{text!r}: choose a comma-separated subset of {','.join(allowed)}")
        return list(dict.fromkeys(picked))
    return parse


def build_parser() -> argparse.ArgumentParser:
    from ..cli import OneLineParser  # errors: one line, exit status 2

    parser = OneLineParser(prog="bench_workload.py", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="ouro-100m",
                        help=f"'default', a checkpoint, or a random-weight shape: {', '.join(SHAPES)} "
                             "(default: %(default)s)")
    parser.add_argument("--requests", type=positive, default=64, help="(default: %(default)s)")
    parser.add_argument("--prompt-lens", type=length_range, default=(16, 256), metavar="LO-HI",
                        help="prompt tokens, uniform (default: 16-256)")
    parser.add_argument("--new-tokens", type=length_range, default=(16, 256), metavar="LO-HI",
                        help="new tokens per request, uniform (default: 16-256)")
    parser.add_argument("--slots", type=positive, default=8,
                        help="static batch size = continuous batching's max_requests_per_batch (default: %(default)s)")
    parser.add_argument("--arrival-rate", type=positive_float, default=4.0, metavar="R",
                        help="Poisson arrivals, requests per second (default: %(default)s)")
    parser.add_argument("--arrivals", type=choices(("burst", "poisson")), default=["burst", "poisson"],
                        help="burst (all at 0), poisson, or both (default: burst,poisson)")
    parser.add_argument("--engines", type=choices(ENGINES), default=list(ENGINES), help="(default: plain,pipeline)")
    parser.add_argument("--batching", type=choices(BATCHING), default=list(BATCHING),
                        help="(default: static,continuous)")
    parser.add_argument("--draft-loops", type=positive, default=1, help="pipeline's d (default: %(default)s)")
    parser.add_argument("--synthetic-acceptance", type=fraction, default=None, metavar="A",
                        help="replace each pipeline draft by the known greedy token with probability A")
    parser.add_argument("--rounds", type=positive, default=3, help="interleaved timed rounds (default: %(default)s)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda if available)")
    parser.add_argument("--threads", type=threads, default=1, help="torch threads (default: %(default)s)")
    parser.add_argument("--seed", type=seed, default=0, help="workload, weights and synthetic drafts (default: 0)")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return parser


def check_args(args, model) -> None:
    """`ValueError` naming the option for settings the model cannot run."""
    from ..generation.config import resolve_speculative
    from ..input_checks import check_positions

    check_positions(model.config, args.prompt_lens[1], args.new_tokens[1], prompt_flag="--prompt-lens",
                    new_flag="--new-tokens")
    if "pipeline" in args.engines:
        resolve_speculative("pipeline", args.draft_loops, num_loops=model.num_loops)
    if args.synthetic_acceptance is not None and "pipeline" not in args.engines:
        raise ValueError(f"--synthetic-acceptance {args.synthetic_acceptance} replaces pipeline drafts: include "
                         "pipeline in --engines, or drop it.")


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) of `values`, linearly interpolated."""
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def measure(served, requests) -> dict:
    """Throughput and latency of one run."""
    latency = [served.finished[r.index] - r.arrival for r in requests]
    tokens = sum(r.new_tokens for r in requests)
    return {"seconds": served.seconds, "tokens_per_s": tokens / served.seconds,
            "p50_latency_s": percentile(latency, 0.5), "p95_latency_s": percentile(latency, 0.95)}


def runs(args) -> list[tuple[str, str, str]]:
    """(engine, batching, arrivals) of every row, in the order each round runs them."""
    return [(e, b, a) for a in args.arrivals for b in args.batching for e in args.engines]


def run_one(model, args, workloads, run, reference):
    """One run: the `Served` of (engine, batching, arrivals)."""
    from .workload import run_continuous, run_static

    engine, batching, arrivals = run
    hooks = {"reference": reference, "acceptance": args.synthetic_acceptance if engine == "pipeline" else None,
             "seed": args.seed}
    if batching == "static":
        return run_static(model, workloads[arrivals], args.slots, engine, args.draft_loops, **hooks)
    return run_continuous(model, workloads[arrivals], args.slots, manager_config(model, engine, args.draft_loops),
                          **hooks)


def manager_config(model, engine: str, draft_loops: int):
    """The generation config of a continuous row: the model's, decoding plain or pipeline at `draft_loops`. The
    keys are set as attributes: `GenerationConfig.update` skips keys the class does not define, as ours."""
    config = copy.deepcopy(model.generation_config)
    config.speculative_mode = None if engine == "plain" else "pipeline"
    config.draft_loops = None if engine == "plain" else draft_loops
    return config


def run_workload(args) -> dict:
    """Run every row (see the module docstring); returns the result document."""
    import torch

    from ..loading import DTYPES, load_model, resolve_device
    from .main import fixed_recurrence, quiet_loading
    from .report import machine_info
    from .run import bench_generation_config
    from .workload import make_workload, vocab_size

    torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    with quiet_loading(args.quiet):
        model, _, model_name = load_model(args.model, DTYPES[args.dtype], device, seed=args.seed)
    check_args(args, model)
    vocab = vocab_size(model)
    workloads = {a: make_workload(args.requests, args.prompt_lens, args.new_tokens, vocab, args.seed,
                                  None if a == "burst" else args.arrival_rate) for a in args.arrivals}
    order = runs(args)
    timed = {run: [] for run in order}
    checks = {run: True for run in order}
    # (Huginn-family models from zero initial states: a deterministic reference, as in `hf-loopspec bench`)
    with torch.inference_mode(), bench_generation_config(model, None), fixed_recurrence(model):
        _log(args, f"[workload] {model_name}: reference (static plain burst)")
        burst = make_workload(args.requests, args.prompt_lens, args.new_tokens, vocab, args.seed)
        reference_run = ("plain", "static", "burst")
        # greedy tokens as far as the longest request goes, for every request: the drafts of a static batch's
        # shorter requests run on to its longest (`workload._batch_hook`); each request's reference is its own part
        longest = max(r.new_tokens for r in burst)
        known = run_one(model, args, {"burst": [replace(r, new_tokens=longest) for r in burst]}, reference_run,
                        None).outputs
        reference = {r.index: known[r.index][:r.new_tokens] for r in burst}
        for round_index in range(-1, args.rounds):  # -1: the warm-up round (the reference run warmed up its row)
            for run in order:
                if round_index < 0 and run == reference_run:
                    continue
                _log(args, f"[workload] {'warm-up' if round_index < 0 else f'round {round_index + 1}'}: "
                           f"{' '.join(run)}")
                served = run_one(model, args, workloads, run, known)
                checks[run] &= served.outputs == reference
                if round_index >= 0:
                    timed[run].append(measure(served, workloads[run[2]]))
                    # in the log too: a run stopped at a time limit still leaves what it measured
                    _log(args, f"[workload] round {round_index + 1} {' '.join(run)}: "
                               f"{timed[run][-1]['tokens_per_s']:.1f} tok/s")
    rows = [{"engine": e, "batching": b, "arrivals": a, "rounds": timed[(e, b, a)], "check_passed": checks[(e, b, a)],
             **{key: statistics.median(m[key] for m in timed[(e, b, a)]) for key in timed[(e, b, a)][0]}}
            for (e, b, a) in order]
    return {"args": {k: v for k, v in vars(args).items() if k != "json"}, "model": model_name,
            "machine": machine_info(device), "rows": rows,
            "all_checks_passed": all(checks.values()) if args.dtype == "float32" else None}


def format_table(result: dict) -> str:
    lines = [f"{'engine':9} {'batching':11} {'arrivals':9} {'tok/s':>9} {'p50 s':>8} {'p95 s':>8}  check"]
    for row in result["rows"]:
        check = "exact" if row["check_passed"] else "DIFFERS"
        lines.append(f"{row['engine']:9} {row['batching']:11} {row['arrivals']:9} {row['tokens_per_s']:9.1f} "
                     f"{row['p50_latency_s']:8.2f} {row['p95_latency_s']:8.2f}  {check}")
    return "\n".join(lines)


def _log(args, message: str) -> None:
    if not args.quiet:
        print(message, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    """Run, print the table (and write `--json`); 1 when an fp32 output differs from plain, 2 for a bad argument
    (one line)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.json:
            check_writable(args.json, "--json")  # before the run, so that a long run is not lost at its end
        result = run_workload(args)
    except (ValueError, OSError) as err:
        parser.exit(2, f"{parser.prog}: error: {' '.join(str(err).split())}\n")
    print(format_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if result["all_checks_passed"] is not False else 1
