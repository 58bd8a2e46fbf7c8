"""The benchmark's orchestration (`run_bench`: reference run, warm-ups, interleaved timed rounds with the call-cost
calibration, then the result document) and its entry points (`main_from_args` for `hf-loopspec bench`, `main` for
`python -m hf_loopspec.bench`). See `hf_loopspec.bench` for what is measured."""

from __future__ import annotations

import contextlib
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from ..generation.config import compile_backend, resolve_speculative
from ..input_checks import check_positions
from ..loading import DTYPES, load_model, resolve_device
from .args import AUTO, DRAFTING, LANE_MODES, check_sampling_args, check_unused_options, with_defaults
from .costs import ar_call_rows, call_grids, measure_call_costs, median_costs, predicted_seconds
from .plot import check_plot_path, plot
from .prompts import PROMPT_CODE, PROMPT_TEXT, make_prompts
from .report import (
    SAMPLING_CHECK_NOTE,
    build_result,
    check_writable,
    format_table,
    machine_info,
    mode_row,
    write_result,
)
from .run import bench_generation_config, compare, generation_processors, run_mode, sampling_settings, synthetic_hook
from .shape_table import SHAPES

STATIC_COMPILED = ("cuda", "xpu", "neuron", "tpu", "mps")  # devices where transformers compiles the static loop


@dataclass
class _Bench:
    """What every run of one benchmark shares."""

    args: object
    model: object
    ids: torch.Tensor  # [B, P] prompts
    vocab: int
    run_kwargs: dict  # run_mode's draft_loops, k, processors, compile_core
    sampled: bool

    def seed(self, offset: int) -> int | None:
        """The torch seed of a sampled run (`--seed` + round; warm-ups: `--seed`), None when greedy."""
        return self.args.seed + offset if self.sampled else None

    def runs(self) -> dict[str, tuple[str, str | None, int | None]]:
        """Run name -> (mode, engine, second_draft_loops): each lane mode once per `--engines` engine (named
        MODE/reference for the reference), plain modes once (engine None), and with `--second-draft-loops`
        pipeline once more per engine with second proposals (named pipeline+second, pipeline+second/reference)."""
        named = {}
        for mode in self.args.modes:
            engines = self.args.engines if mode in LANE_MODES else [None]
            for engine in engines:
                named[mode if engine in (None, "wavefront") else f"{mode}/{engine}"] = (mode, engine, None)
            if mode == "pipeline" and self.args.second_draft_loops is not None:
                for engine in engines:
                    name = "pipeline+second" if engine == "wavefront" else f"pipeline+second/{engine}"
                    named[name] = (mode, engine, self.args.second_draft_loops)
        return named

    def hook(self, mode: str, reference: torch.Tensor | None):
        """The `--synthetic-acceptance` draft hook of a speculative mode (None otherwise)."""
        if self.args.synthetic_acceptance is None or mode not in ("block", "pipeline", AUTO) or reference is None:
            return None
        return synthetic_hook(reference, self.args.prompt_len, self.args.synthetic_acceptance, self.vocab,
                              self.args.seed)


def read_prompt_file(path: str) -> str:
    """The text of `--prompt-file`; `ValueError` naming the flag for a missing file or one that is not UTF-8."""
    if not Path(path).is_file():
        raise ValueError(f"--prompt-file {path}: no such file; pass a text file to cut prompts from.")
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"--prompt-file {path} is not UTF-8 text (byte {err.object[err.start]:#04x} at byte "
                         f"{err.start}); save it as UTF-8.") from None


def run_bench(args) -> dict:
    """Run the benchmark (see `hf_loopspec.bench`); returns the result document (also written by `--json`).

    `args` is an `argparse.Namespace` from `parse_args`, or one built in code (missing attributes take their
    defaults; each value is checked as its option's text would be, and a name that is no option raises a
    `ValueError`: `args.with_defaults`). The model's `generation_config` is left as it was.
    """
    args = with_defaults(args)
    check_sampling_args(args)
    check_unused_options(args)
    compile_backend(args.compile)  # a ValueError for an unknown backend, before the model loads
    for flag, path in (("--json", args.json), ("--plot", args.plot), ("--prompt-file", args.prompt_file)):
        if path is not None and not str(path):  # (`--json=` wrote nothing, and said nothing)
            raise ValueError(f"{flag} is empty: pass a file path, or leave {flag} out.")
    if args.plot:
        check_plot_path(args.plot)  # fail before the runs, not after them
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path:
            check_writable(path, flag)
    if args.prompt_file:
        read_prompt_file(args.prompt_file)  # a missing or undecodable file fails before the model loads
    _check_option_pairs(args)
    if args.new_tokens < 2 and (drafting := [m for m in args.modes if m in DRAFTING]):
        raise ValueError(f"--new-tokens {args.new_tokens}: the speculative modes ({', '.join(drafting)}) need at "
                         "least 2 new tokens (nothing to draft otherwise); pass --new-tokens 2 or more, or drop them "
                         "from --modes.")
    device = resolve_device(args.device)
    with quiet_loading(args.quiet):
        model, tokenizer, model_name = load_model(args.model, DTYPES[args.dtype], device, seed=args.seed)
    sampling = sampling_settings(args)
    with fixed_recurrence(model), bench_generation_config(model, sampling):
        result = _run_bench(args, device, model, tokenizer, model_name, sampling)
    if args.json:
        write_result(result, args.json)
    if args.plot:
        plot(result, args.plot)
    return result


def fixed_recurrence(model):
    """Huginn-family models: every mode runs the checkpoint's steps (its generation config's `num_steps`, else
    `mean_recurrence`, read as the block opens) from zero initial states (init_scale 0), so that plain decoding is a
    deterministic reference."""
    recurrence = getattr(model, "recurrence", None)
    return recurrence(init_scale=0.0) if recurrence is not None else contextlib.nullcontext()


@contextlib.contextmanager
def quiet_loading(quiet: bool):
    """transformers' progress bars (a checkpoint's "Loading weights") off while the block runs, under `--quiet`."""
    from transformers.utils import logging as transformers_logging

    was_on = transformers_logging.is_progress_bar_enabled()
    if quiet:
        transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        if quiet and was_on:
            transformers_logging.enable_progress_bar()


def _check_option_pairs(args) -> None:
    """`ValueError` for options that cannot go together, before the model loads."""
    if args.compile and "reference" in args.engines:
        raise ValueError(f"--compile {args.compile} compiles the wavefront engine; the reference runs eagerly: drop "
                         "reference from --engines, or --compile.")
    if args.second_draft_loops is not None and "pipeline" not in args.modes:
        raise ValueError(f"--second-draft-loops {args.second_draft_loops} adds a pipeline run: include pipeline "
                         "in --modes.")
    if args.prompt_file and args.model in SHAPES:
        raise ValueError(f"--prompt-file {args.prompt_file}: {args.model} is a random-weight shape and has no "
                         "tokenizer, so its prompts are random ids; drop --prompt-file, or pass a checkpoint with a "
                         "tokenizer as --model.")


def _validate(args, loops: int) -> None:
    for mode in ("block", "pipeline"):
        if mode in args.modes:  # raises ValueError with the same message generate() would
            resolve_speculative(mode, args.draft_loops, args.num_speculative_tokens, num_loops=loops,
                                second_draft_loops=args.second_draft_loops if mode == "pipeline" else None,
                                reference="wavefront" not in args.engines)


def _run_bench(args, device, model, tokenizer, model_name, sampling) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    loops = model.num_loops
    _validate(args, loops)
    check_positions(model.config, args.prompt_len, args.new_tokens, prompt_flag="--prompt-len",
                    new_flag="--new-tokens", least_new=2 if set(args.modes) & set(DRAFTING) else 1)
    vocab = model.head_width
    if args.prompt_file and tokenizer is None:
        raise ValueError(f"--prompt-file {args.prompt_file}: {model_name} has no tokenizer, so its prompts are random "
                         "ids; drop --prompt-file, or pass a checkpoint with a tokenizer as --model.")
    text = read_prompt_file(args.prompt_file) if args.prompt_file else (
        PROMPT_CODE if args.model == "default" else PROMPT_TEXT)
    ids = make_prompts(tokenizer, vocab, args.batch_size, args.prompt_len, args.seed, text).to(device)
    processors = generation_processors(model, args.prompt_len, device)
    bench = _Bench(args, model, ids, vocab, {"draft_loops": args.draft_loops, "k": args.num_speculative_tokens,
                                             "processors": processors, "compile_core": args.compile},
                   sampled=sampling is not None)
    machine = machine_info(device)
    with torch.inference_mode():
        runs, warmup_seconds, cost_rounds, reference, reference_logits = _measure(bench, model_name, device)
    costs = median_costs(cost_rounds)
    ar_rows = runs["ar"][0]["call_rows"] if "ar" in runs else ar_call_rows(
        loops, args.batch_size, args.prompt_len, args.new_tokens, model.kv_layout.first_exit_plane is not None)
    ar_predicted = predicted_seconds(costs, ar_rows)
    seconds = {mode: statistics.median(x["seconds"] for x in rs) for mode, rs in runs.items()}
    exact_dtype = DTYPES[args.dtype] == torch.float32
    rows = []
    for name, rs in runs.items():
        mode, engine, _ = bench.runs()[name]
        if sampling is None:
            checks = [compare(x["generated"], reference, reference_logits) for x in rs]
            exact = all(c["exact"] for c in checks) if exact_dtype else None
            # plain's timed runs are checked against its reference run too (the baseline of every "x plain")
            check = "reference" if name == "plain" and exact is not False else min(
                checks, key=lambda c: c["agreement_rate"])
        else:
            check, exact = {"exact": None, "note": SAMPLING_CHECK_NOTE}, None
        compiled = bool(args.compile) and (mode in LANE_MODES or mode == AUTO)  # the engine, compiled
        compiled = compiled or mode == "static" and device.type in STATIC_COMPILED  # (transformers compiles it there)
        rows.append(mode_row(name, rs, seconds, batch=args.batch_size, new_tokens=args.new_tokens, loops=loops,
                             check=check, exact=exact, costs=costs, ar_predicted=ar_predicted,
                             warmup_seconds=warmup_seconds.get(name), compiled=bool(compiled), engine=engine))
    warpers = [type(w).__name__ for w in processors] if sampling is not None else None
    return build_result(rows, args=args, machine=machine, model=model, model_name=model_name, sampling=sampling,
                        warpers=warpers, costs=costs, ar_predicted=ar_predicted)


def _measure(bench: _Bench, model_name: str, device: torch.device):
    """The reference run, one warm-up per mode, then `--repeats` interleaved rounds, each with its call costs.

    Each round times the call costs too, so that they see the same machine load as the runs (a shared machine
    drifts); the cost of a call is its median over the rounds.
    """
    args, model, ids, n = bench.args, bench.model, bench.ids, bench.args.new_tokens
    what = "plain reference run" if not bench.sampled else f"SAMPLING {sampling_settings(args)}; plain warm-up run"
    _log(args, f"[bench] {model_name} on {device} {args.dtype}: {what}")
    exact_dtype = DTYPES[args.dtype] == torch.float32
    reference_run = run_mode(model, "plain", ids, n, output_logits=not exact_dtype and not bench.sampled,
                             seed=bench.seed(0), **bench.run_kwargs)
    reference = reference_run["generated"]
    _log(args, f"[bench] plain reference run: {reference_run['seconds']:.2f}s")

    own_reference: dict[str, torch.Tensor] = {}
    warmup_seconds: dict[str, float] = {}
    named = bench.runs()
    for name, (mode, engine, second) in named.items():  # warm-up (synthetic acceptance: each run's own continuation)
        if mode == "plain":
            continue
        _log(args, f"[bench] warm-up {name}")
        warmup = run_mode(model, mode, ids, n, draft_hook=bench.hook(mode, reference), seed=bench.seed(0),
                          **bench.run_kwargs, **_engine(engine, second))
        own_reference[name], warmup_seconds[name] = warmup["generated"], warmup["seconds"]
        _log(args, f"[bench] warm-up {name}: {warmup['seconds']:.2f}s")

    batch = args.batch_size
    grids = call_grids(batch, model.num_loops, args.draft_loops, args.num_speculative_tokens)
    runs: dict[str, list[dict]] = {name: [] for name in named}
    cost_rounds = []
    for r in range(args.repeats):
        _log(args, f"[bench] round {r + 1}/{args.repeats}: call costs over {grids['core']} core rows and the "
                   f"{batch * args.prompt_len}-row prefill, then " + " ".join(named))
        cost_rounds.append(measure_call_costs(model, batch, args.prompt_len, grids, device,
                                              args.calibration_seconds / args.repeats, seed=args.seed + r))
        for name, (mode, engine, second) in named.items():
            runs[name].append(run_mode(model, mode, ids, n, draft_hook=bench.hook(mode, own_reference.get(name)),
                                       seed=bench.seed(r), **bench.run_kwargs, **_engine(engine, second)))
            # each timed run in the log too: a run stopped at a time limit still leaves what it measured
            _log(args, f"[bench] round {r + 1} {name}: {runs[name][-1]['seconds']:.2f}s")
    return runs, warmup_seconds, cost_rounds, reference, reference_run["logits"]


def _engine(engine: str | None, second: int | None = None) -> dict:
    """`run_mode`'s engine (plain modes have none) and second_draft_loops arguments of a run."""
    return ({} if engine is None else {"engine": engine}) | ({} if second is None else {"second_draft_loops": second})


def _log(args, message: str) -> None:
    if not args.quiet:
        print(message, file=sys.stderr, flush=True)


def main_from_args(args) -> int:
    """Run, print the table; exit status 1 when an fp32 greedy output differs from plain greedy (sampled outputs
    are not compared: exit status 0)."""
    result = run_bench(args)
    print(format_table(result))
    if not result["all_checks_passed"]:
        print("hf-loopspec bench: MISMATCH: a speculative output differs from plain greedy decoding in fp32.",
              file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m hf_loopspec.bench ...`: the same as `hf-loopspec bench ...`, error handling included."""
    from ..cli import main as cli_main

    return cli_main(["bench", *(sys.argv[1:] if argv is None else argv)])
