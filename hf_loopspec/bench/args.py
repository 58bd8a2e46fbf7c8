"""`hf-loopspec bench` arguments: the parser (`add_arguments`, `parse_args`), checked argument types (also used by
`hf-loopspec generate` and `batch`), and the checks that need more than one argument (`check_sampling_args`, also
run for `generate` and `batch`)."""

from __future__ import annotations

import argparse
import math
import numbers
import os
import sys

from ..defaults import CPUS, DEFAULT_DRAFT_LOOPS, DEFAULT_NUM_SPECULATIVE_TOKENS, DTYPE_NAMES
from ..prompting import SAMPLING_OFF, SpeculativeOnly
from .shape_table import SHAPES

MODES = ("plain", "ar", "block", "pipeline")  # the default set
AUTO = "auto"  # speculative_mode="auto" through generate (not in the default set)
PLAIN_MODES = ("plain", "static")  # transformers' own loop: DynamicCache, or cache_implementation="static"
LANE_MODES = ("ar", "block", "pipeline")
DRAFTING = ("block", "pipeline")  # the modes that need at least 2 new tokens (nothing to draft otherwise)
ENGINES = ("wavefront", "reference")  # what runs a lane mode: the engine, or the lane decoder as a measured baseline
DESCRIPTION = "plain vs AR vs block vs pipeline decoding in one process, with the limit it is judged by."


def parse_modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in (*MODES, "static", AUTO)]
    if bad or not modes:
        raise argparse.ArgumentTypeError(f"unknown mode(s) {bad or text!r}; choose a comma-separated subset of "
                                         f"{','.join(MODES)},static,{AUTO}")
    return list(dict.fromkeys(modes))


def parse_engines(text: str) -> list[str]:
    engines = [e.strip() for e in text.split(",") if e.strip()]
    if "lanes" in engines:
        raise argparse.ArgumentTypeError("'lanes' is now 'reference' (the lane decoder, the readable reference: "
                                         "model.decode_with_lanes); pass --engines wavefront,reference")
    bad = [e for e in engines if e not in ENGINES]
    if bad or not engines:
        raise argparse.ArgumentTypeError(f"unknown engine(s) {bad or text!r}; choose a comma-separated subset of "
                                         f"{','.join(ENGINES)}")
    return list(dict.fromkeys(engines))


def checked(kind: type, ok, requirement: str):
    """An argparse `type` that parses `kind` (int or float) and refuses values for which `ok` is false."""
    noun = "an integer" if kind is int else "a number"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {noun}") from None
        if kind is float and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{value} is not a finite number")
        if not ok(value):
            raise argparse.ArgumentTypeError(f"{value} {requirement}")
        return value

    return parse


fraction = checked(float, lambda v: 0.0 <= v <= 1.0, "is outside [0, 1]")
positive = checked(int, lambda v: v >= 1, "must be >= 1")
threads = checked(int, lambda v: 1 <= v <= CPUS, f"is outside [1, {CPUS}] (this machine's CPUs)")
positive_float = checked(float, lambda v: v > 0, "must be > 0")
non_negative = checked(int, lambda v: v >= 0, "must be >= 0")
seed = checked(int, lambda v: 0 <= v < 2**63, "is outside [0, 2**63) (torch's seeds are 64-bit integers)")


SYNTHETIC_WITH_SAMPLING = ("--synthetic-acceptance cannot be combined with --do-sample: it replaces each draft by the "
                           "known greedy token, and sampled decoding has no known token (its acceptance is the real "
                           "min(1, p/q)); drop one of the two.")


class _SyntheticAcceptance(argparse.Action):
    """Stores `--synthetic-acceptance A`; an argparse error when `--do-sample` came first."""

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, "do_sample", False):
            raise argparse.ArgumentError(self, SYNTHETIC_WITH_SAMPLING)
        setattr(namespace, self.dest, values)


class _DoSample(argparse.Action):
    """`--do-sample` (store true); an argparse error when `--synthetic-acceptance` came first."""

    def __init__(self, option_strings, dest, default=False, help=None):
        super().__init__(option_strings, dest, nargs=0, default=default, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, "synthetic_acceptance", None) is not None:
            raise argparse.ArgumentError(self, SYNTHETIC_WITH_SAMPLING)
        setattr(namespace, self.dest, True)


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the `bench` options to `parser` (used by `hf-loopspec bench` and `python -m hf_loopspec.bench`)."""
    parser.add_argument("--model", default="default",
                        help="'default' (the embedded model), a checkpoint path or Hub id, or a random-weight shape: "
                             f"{', '.join(SHAPES)} (default: %(default)s)")
    parser.add_argument("--batch-size", type=positive, default=1, help="sequences (default: %(default)s)")
    parser.add_argument("--prompt-len", type=positive, default=64,
                        help="prompt tokens per sequence (default: %(default)s)")
    parser.add_argument("--new-tokens", type=positive, default=64,
                        help="new tokens per sequence (default: %(default)s)")
    parser.add_argument("--prompt-file", default=None, metavar="PATH",
                        help="text to cut the prompts from (models with a tokenizer; default: a built-in text)")
    parser.add_argument("--dtype", choices=DTYPE_NAMES, default="float32", help="(default: %(default)s)")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda if available)")
    parser.add_argument("--modes", type=parse_modes, default=list(MODES),
                        help=f"comma-separated subset of {','.join(MODES)},static,{AUTO} (default: "
                             f"{','.join(MODES)}); static: plain generate with cache_implementation='static' "
                             "(compiled by transformers on CUDA); auto: generate(speculative_mode='auto'), which "
                             "chooses its own mode, d and K")
    parser.add_argument("--engines", type=parse_engines, default=["wavefront"],
                        help=f"comma-separated subset of {','.join(ENGINES)}: what runs each lane mode (ar, block, "
                             "pipeline): the wavefront engine (generate's), and the reference (the lane decoder, "
                             "eager only) as a measured baseline, in rows named MODE/reference (default: wavefront)")
    parser.add_argument("--draft-loops", type=positive, default=DEFAULT_DRAFT_LOOPS, action=SpeculativeOnly,
                        help="d: draft from the output of loop d (default: %(default)s)")
    parser.add_argument("--second-draft-loops", type=positive, default=None, metavar="D2",
                        help="also run pipeline with second proposals from loop D2 (second_draft_loops) on each "
                             "engine, as the rows 'pipeline+second' and 'pipeline+second/reference' (default: off)")
    parser.add_argument("--num-speculative-tokens", type=positive, default=DEFAULT_NUM_SPECULATIVE_TOKENS,
                        action=SpeculativeOnly,
                        help="K: drafts per block round (default: %(default)s)")
    parser.add_argument("--repeats", type=positive, default=3,
                        help="timed rounds; the median is reported (default: %(default)s)")
    parser.add_argument("--synthetic-acceptance", type=fraction, default=None, metavar="A",
                        action=_SyntheticAcceptance,
                        help="replace each draft by the known greedy token with probability A (for random weights, "
                             "whose own drafts are noise; any model; greedy decoding only)")
    parser.add_argument("--do-sample", action=_DoSample,
                        help="every mode samples (lossless speculative sampling; seeded with --seed + round); "
                             "outputs are then not compared with plain")
    parser.add_argument("--temperature", type=positive_float, default=1.0,
                        help="sampling temperature, with --do-sample (default: %(default)s)")
    parser.add_argument("--top-p", type=fraction, default=1.0,
                        help="nucleus sampling mass, with --do-sample; 1 = off (default: %(default)s)")
    parser.add_argument("--top-k", type=non_negative, default=0,
                        help="keep the K most likely tokens, with --do-sample; 0 = off (default: %(default)s)")
    parser.add_argument("--seed", type=seed, default=0,
                        help="seed of the random weights, prompts, synthetic drafts and sampled runs "
                             "(default: %(default)s)")
    parser.add_argument("--threads", type=threads, default=1,
                        help="CPU threads of torch's operators (torch.set_num_threads; default: %(default)s, as "
                             "hf-loopspec generate: threads beyond the free cores make small calls much slower)")
    parser.add_argument("--compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
                        help="run the wavefront engine's step compiled (generate's compile_core) with this "
                             "torch.compile backend (default when given: inductor); plain is transformers' loop")
    parser.add_argument("--calibration-seconds", type=positive_float, default=3.0,
                        help="time budget of the embed/core/head call-cost measurements (default: %(default)s)")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON")
    parser.add_argument("--plot", default=None, metavar="PATH", help="write a PNG bar chart (needs matplotlib)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-loopspec bench", description=DESCRIPTION)
    return add_arguments(parser)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


CLI_ONLY = ("command", "debug", "speculative_given")  # set by `hf-loopspec`'s parser and its actions, not options


def with_defaults(args) -> argparse.Namespace:
    """`args` (from `parse_args`, or an `argparse.Namespace` built in code, as the notebook builds it) over the options'
    defaults, each value checked as the command line checks it: `ValueError` naming an attribute that is no option (a
    misspelling changed nothing) or a value that the option's type or choices refuse (`modes` and `engines` may be lists
    of names, `device` a `torch.device`; None: the option's default). A speculative-only option set in code to another
    value than its default counts as given (`check_unused_options`), as on the command line."""
    parser = build_parser()
    options = {action.dest: action for action in parser._actions if action.dest != "help"}
    merged = vars(parser.parse_args([]))
    given = dict(getattr(args, "speculative_given", {}))
    for name, value in vars(args).items():
        if name in CLI_ONLY:
            merged[name] = value
        elif name not in options:
            raise ValueError(f"bench argument {name}={value!r} is not an option of the bench; use one of "
                             f"{', '.join(sorted(options))}.")
        else:
            action = options[name]
            merged[name] = checked_value(action, value)
            if isinstance(action, SpeculativeOnly) and merged[name] != action.default:
                given.setdefault(action.option_strings[0], merged[name])
    return argparse.Namespace(**{**merged, "speculative_given": given} if given else merged)


def checked_value(action: argparse.Action, value):
    """`value` of the option `action` as its command-line text would parse (a list of modes or engines joined by
    commas first), or a `ValueError` naming the option; None is the option's default (as not given: `seed=None`
    crashed in torch, `threads=None` was recorded as None)."""
    if value is None:
        return action.default
    if value is action.default:
        return value
    if action.type is None:  # a flag, or free text (a path, a device, a backend)
        torch = sys.modules.get("torch")  # (a torch.device given in code: torch is loaded)
        kind = bool if action.nargs == 0 else (str, os.PathLike, *((torch.device,) if torch and action.dest ==
                                                                   "device" else ()))
        if isinstance(value, bool) != (kind is bool) or not isinstance(value, kind):
            raise ValueError(f"bench argument {action.dest}={value!r}: expected "
                             f"{'True or False' if kind is bool else 'text'}.")
        return checked_choice(action, value)
    listed = action.type in (parse_modes, parse_engines) and isinstance(value, (list, tuple)) \
        and all(isinstance(item, str) for item in value)
    if not listed and (isinstance(value, bool) or not isinstance(value, (str, numbers.Real))):
        raise ValueError(f"bench argument {action.dest}={value!r}: expected what {action.option_strings[0]} takes "
                         "on the command line (modes and engines: a comma-separated text or a list of names).")
    try:
        value = action.type(",".join(value) if listed else str(value))
    except argparse.ArgumentTypeError as err:
        raise ValueError(f"bench argument {action.dest}={value!r}: {err}") from None
    return checked_choice(action, value)


def checked_choice(action: argparse.Action, value):
    """`value`, after a `ValueError` when the option `action` has choices and it is none of them."""
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"bench argument {action.dest}={value!r}: choose one of {', '.join(action.choices)}.")
    return value


def check_unused_options(args) -> None:
    """`ValueError` naming an option that none of `--modes` reads (it would be printed in the header and change
    nothing): `--draft-loops` (block, pipeline), `--num-speculative-tokens` (block), `--synthetic-acceptance`
    (block, pipeline, auto), `--engines reference` (the lane modes) and `--compile` (the lane modes and auto).
    `--draft-loops` and `--num-speculative-tokens` count only when given on the command line."""
    modes = set(args.modes)
    given = dict(getattr(args, "speculative_given", {}))
    if args.synthetic_acceptance is not None:
        given["--synthetic-acceptance"] = args.synthetic_acceptance
    if args.compile:
        given["--compile"] = args.compile
    if "reference" in args.engines:
        given["--engines"] = ",".join(args.engines)
    readers = {"--draft-loops": ("block", "pipeline"), "--num-speculative-tokens": ("block",),
               "--synthetic-acceptance": ("block", "pipeline", AUTO), "--engines": LANE_MODES,
               "--compile": (*LANE_MODES, AUTO)}
    for flag, value in given.items():
        if not modes & set(readers[flag]):
            raise ValueError(f"{flag} {value}: none of --modes {','.join(args.modes)} reads it (only "
                             f"{', '.join(readers[flag])}); add one of those to --modes, or drop {flag}.")


def check_sampling_args(args) -> None:
    """`ValueError` for sampling options that cannot mean what they say: `--synthetic-acceptance` with
    `--do-sample`, or `--temperature` / `--top-p` / `--top-k` without `--do-sample` (greedy decoding ignores them).
    The rule of `bench`, `generate` and `batch`: an option counts as given unless it is None (not passed) or its
    off value."""
    if args.do_sample and getattr(args, "synthetic_acceptance", None) is not None:
        raise ValueError(SYNTHETIC_WITH_SAMPLING)
    if not args.do_sample:
        unused = [f"--{name.replace('_', '-')} {getattr(args, name)}" for name, off in SAMPLING_OFF
                  if getattr(args, name) not in (None, off)]
        if unused:
            raise ValueError(f"sampling options given without --do-sample, which greedy decoding ignores: "
                             f"{', '.join(unused)}; add --do-sample or drop them.")
