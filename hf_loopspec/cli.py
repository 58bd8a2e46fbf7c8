"""The `hf-loopspec` command line: `generate` (stream a completion), `bench` (see `hf_loopspec.bench`),
`export` (a Hub-ready folder, see `hf_loopspec.hub.export`), `batch` (a JSONL file of prompts, data-parallel under
`accelerate launch`, see `hf_loopspec.batch`), `serve` (transformers' OpenAI-compatible server with the models
registered, see `hf_loopspec.serving`) and `lm-eval` (lm-evaluation-harness with the models registered).

    hf-loopspec generate "The capital of France is" --mode pipeline --draft-loops 1 --max-new-tokens 64
    hf-loopspec generate "def fibonacci(n):" --repetition-penalty 1.4 --compare     # timed against plain decoding
    hf-loopspec generate "Hi" --model ByteDance/Ouro-1.4B-Thinking --chat --mode block --num-speculative-tokens 4
    hf-loopspec generate "def parse(" --mode pipeline --do-sample --temperature 0.8 --top-p 0.95 --seed 0
    hf-loopspec bench --model ouro-100m --batch-size 1 --new-tokens 64 --synthetic-acceptance 0.9 --json out.json
    hf-loopspec bench --model ouro-100m --do-sample --temperature 0.8 --top-k 50
    hf-loopspec export ByteDance/Ouro-1.4B ./Ouro-1.4B-loopspec
    hf-loopspec batch prompts.jsonl --output completions.jsonl --batch-size 16 --max-new-tokens 256
    accelerate launch --num_processes 8 -m hf_loopspec.cli batch prompts.jsonl --output completions.jsonl
    hf-loopspec serve --port 8000 --continuous-batching        # the embedded model; MODEL is a folder or Hub id
    hf-loopspec lm-eval run --model hf --model_args pretrained=ByteDance/Ouro-1.4B --tasks gsm8k \\
        --gen_kwargs speculative_mode=pipeline,draft_loops=1

Sampling (`--do-sample`) works in every mode: the speculative modes use lossless speculative sampling (a draft is
kept with probability min(1, p/q)), and `generate` prints that acceptance rate. `generate` and `batch` run torch on
`--threads` CPU threads (default 1, see the option's help); options that the chosen decoding would ignore
(`--temperature` / `--top-k` / `--top-p` without `--do-sample`, `--draft-loops` / `--num-speculative-tokens` with
`--mode plain`, `--num-speculative-tokens` with `--mode pipeline`) are refused before anything loads.

Every error a user can cause (a bad argument, a missing folder, a zero-byte, truncated or corrupt weights file, a
pickle-only checkpoint, a device the models do not run on, a prompt longer than the model's positions, invalid
speculative settings) ends with ONE line on stderr, `hf-loopspec COMMAND: error: <problem>; <fix>`, and exit status
2. `--debug` (or the environment variable `HF_LOOPSPEC_DEBUG=1`) shows the traceback instead. The handler is
`main`: argument errors come from `OneLineParser`, everything else from the `ValueError` / `OSError` that the
commands raise (see `hf_loopspec.input_checks`).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

from .bench import args as bench_args
from .defaults import DEFAULT_DRAFT_LOOPS, DEFAULT_NUM_SPECULATIVE_TOKENS, DTYPE_NAMES
from .hub import export as hub_export
from .prompting import SpeculativeOnly, check_mode_options, check_text, encode_prompt, generate_kwargs

DEBUG_ENV = "HF_LOOPSPEC_DEBUG"
DEFAULT_THREADS = 1  # see --threads' help
USER_ERRORS = (ValueError, OSError)  # what the commands raise for input a user can fix
# the library's messages name generate's arguments; `generate` and `batch` name the option that sets the same thing
# (a pattern -> its replacement): an argument's name standing as a word of the prose (after a space or a parenthesis;
# not inside a path, a quoted field name or `second_draft_loops`, which no option sets)
ARGUMENT = r"(?<![^\s(])"
OPTION_SPELLINGS = (
    (re.compile(ARGUMENT + r"speculative_mode=None\b"), "--mode plain"),
    (re.compile(ARGUMENT + r"speculative_mode='(\w+)'"), r"--mode \1"),
    (re.compile(ARGUMENT + r"(draft_loops|num_speculative_tokens|max_new_tokens|repetition_penalty|do_sample|top_[kp])"
                r"(?![\w/'-]|\.\w)"), lambda match: "--" + match[1].replace("_", "-")),
)
# `bench` names them as its own options: --modes, and --second-draft-loops, whose absence is its None
BENCH_SPELLINGS = (
    (re.compile(ARGUMENT + r"speculative_mode='(\w+)'"), r"--modes \1"),
    (re.compile(ARGUMENT + r"(second_draft_loops|draft_loops|num_speculative_tokens)(?![\w/'-]|\.\w)"),
     lambda match: "--" + match[1].replace("_", "-")),
    (re.compile(r"(\[[\d, ]*\]) or None\b"), r"\1 or drop --second-draft-loops"),
    (re.compile(r"model\.decode_with_lanes runs the others on the reference"), "--engines reference runs the others"),
    (re.compile(r"compile_core='([^']*)' must be True, False or a torch\.compile backend name"),
     r"--compile \1: pass a torch.compile backend name"),
)
BROKEN_PIPE = 141  # the status of a command that SIGPIPE ended (128 + 13), what a shell reports for `cat` there


class OneLineParser(argparse.ArgumentParser):
    """An `ArgumentParser` whose errors are one line on stderr (the problem and where the usage is), status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {one_line(message)} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="hf-loopspec",
        description="Looped LMs (Ouro) with lossless pipelined self-speculative decoding.",
    )
    commands = parser.add_subparsers(dest="command", required=True,
                                     metavar="{generate,batch,bench,export,serve,lm-eval}")

    gen = commands.add_parser("generate", help="stream a completion of PROMPT",
                              description="Stream a completion of PROMPT as tokens are committed, then print the "
                                          "decoding statistics on stderr.")
    gen.add_argument("prompt", metavar="PROMPT")
    _add_generation_options(gen, chat_help="wrap PROMPT in the tokenizer's chat template")
    gen.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda if available)")
    gen.add_argument("--compare", action="store_true",
                     help="also decode PROMPT plainly (transformers' loop) and print both times, the speed ratio and "
                          "whether the tokens are identical (exit status 1 when greedy float32 tokens differ)")

    batch = commands.add_parser(
        "batch", help="generate for every row of a file of prompts (data-parallel under accelerate launch)",
        description="Generate a completion for every {\"id\": ..., \"prompt\": ...} row of PROMPTS into OUT (JSONL, "
                    "input order), in length-grouped batches. Under `accelerate launch --num_processes N -m "
                    "hf_loopspec.cli batch ...` every process decodes its shard of the batches (without a GPU add "
                    "--multi_gpu, or use torchrun --nproc_per_node N: accelerate's CPU launch starts one process). "
                    "Resumable: rerun the same command after a kill and only the unfinished rows are generated.")
    batch.add_argument("prompts", metavar="PROMPTS",
                       help="JSONL file, one {\"id\": ..., \"prompt\": ...} object a line (or a .json array, "
                            ".csv or .parquet file of such rows)")
    batch.add_argument("--output", required=True, metavar="OUT",
                       help="the JSONL file to write (parts go to OUT.parts/)")
    batch.add_argument("--field", default="prompt", help="the field that holds the text (default: %(default)s)")
    batch.add_argument("--batch-size", type=bench_args.positive, default=8,
                       help="rows per batch (default: %(default)s)")
    _add_generation_options(batch, chat_help="wrap each prompt in the tokenizer's chat template")
    batch.add_argument("--device", default=None,
                       help="one process only: cpu, cuda, cuda:1, ... (default: the device accelerate assigns)")

    bench_parser = commands.add_parser("bench", help="benchmark plain, ar, block and pipeline decoding",
                                       description=bench_args.DESCRIPTION)
    bench_args.add_arguments(bench_parser)
    hub_export.add_subcommand(commands)
    for command in commands.choices.values():  # every subcommand registered above
        command.add_argument("--debug", action="store_true",
                             help=f"show the traceback of an error instead of one line (or set {DEBUG_ENV}=1)")
    # prefix_chars="\0": no option belongs to this parser, so every argument (--model ... too) goes to lm-eval
    lm_eval = commands.add_parser("lm-eval", add_help=False, prefix_chars="\0",
                                  help="run lm-evaluation-harness's CLI with the hf_loopspec models registered")
    lm_eval.add_argument("args", nargs=argparse.REMAINDER, help="arguments of the lm-eval command")
    serve = commands.add_parser("serve", add_help=False, prefix_chars="\0",
                                help="serve MODEL (default: the embedded model) with transformers' OpenAI-compatible "
                                     "server; `hf-loopspec serve --help` lists its options")
    serve.add_argument("args", nargs=argparse.REMAINDER, help="[MODEL] and the options of transformers serve")
    return parser


def _add_generation_options(parser: argparse.ArgumentParser, chat_help: str) -> None:
    """The model and decoding options that `generate` and `batch` share."""
    parser.add_argument("--model", default="default", help="checkpoint folder or Hub id; 'default' (the default) "
                                                             "is the model embedded in the package")
    parser.add_argument("--mode", choices=("plain", "block", "pipeline", "auto"), default="auto",
                        help="plain: transformers' loop; block / pipeline: self-speculative decoding; auto: the "
                             "fastest of these, chosen from measured costs and acceptance (default: %(default)s)")
    parser.add_argument("--draft-loops", type=bench_args.positive, default=DEFAULT_DRAFT_LOOPS,
                        action=SpeculativeOnly, help="d: draft from the output of loop d (default: %(default)s)")
    parser.add_argument("--num-speculative-tokens", type=bench_args.positive, default=DEFAULT_NUM_SPECULATIVE_TOKENS,
                        action=SpeculativeOnly, help="K: drafts per block round (default: %(default)s)")
    parser.add_argument("--max-new-tokens", type=bench_args.positive, default=128, help="(default: %(default)s)")
    parser.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    parser.add_argument("--temperature", type=bench_args.positive_float, default=None,
                        help="with --do-sample (> 0: for greedy decoding drop --do-sample)")
    parser.add_argument("--top-k", type=bench_args.non_negative, default=None,
                        help="with --do-sample; 0 keeps every token (unset: the checkpoint's generation config, else "
                             "transformers' default top-k)")
    parser.add_argument("--top-p", type=bench_args.fraction, default=None, help="with --do-sample")
    parser.add_argument("--seed", type=bench_args.seed, default=None,
                        help="torch seed for sampling (reproducible with a fixed --mode, not with auto)")
    parser.add_argument("--repetition-penalty", type=bench_args.positive_float, default=None,
                        help="divide the scores of tokens already in the text by P (> 1 discourages repeats; "
                             "greedy or sampled, lossless under speculation)")
    parser.add_argument("--chat", action="store_true", help=chat_help)
    parser.add_argument("--dtype", choices=("auto", *DTYPE_NAMES), default="auto",
                        help="auto (the default): float32 on CPU, the checkpoint's dtype on CUDA")
    parser.add_argument("--threads", type=bench_args.threads, default=DEFAULT_THREADS,
                        help="CPU threads of torch's operators (torch.set_num_threads; default: %(default)s: the "
                             "embedded model is too small to gain from more, and threads beyond the free cores make "
                             "decoding several times slower)")


def check_generation_args(args: argparse.Namespace) -> None:
    """The checks of `generate` and `batch` before anything loads: sampling options without `--do-sample` (the rule
    `bench` applies), speculative-only options with `--mode plain`, `--compare` with `--mode plain`, a PROMPT that is
    not UTF-8; `ValueError` naming the flag."""
    bench_args.check_sampling_args(args)
    check_mode_options(args)
    if args.command == "generate":
        check_text(args.prompt, "PROMPT")
    if getattr(args, "compare", False) and args.mode == "plain":
        raise ValueError("--compare decodes PROMPT plainly next to a speculative mode, and --mode plain is that "
                         "plain run already; pass --mode pipeline or --mode block, or drop --compare.")


def warn_seeded_auto(args: argparse.Namespace) -> None:
    """One line on stderr when `--seed` cannot make samples reproducible: with `--do-sample` in auto mode, which
    decodes each stretch plainly or speculatively as measured costs and stored acceptance (earlier runs') suggest,
    and each draws its own random numbers."""
    if args.do_sample and args.seed is not None and args.mode == "auto":
        print("warning: --seed does not make --mode auto's samples reproducible: auto picks plain or speculative "
              "decoding from timings and the acceptance earlier runs stored, and they draw different random "
              "numbers; pass --mode plain, pipeline or block for reproducible samples.", file=sys.stderr, flush=True)


def generate(args: argparse.Namespace) -> int:
    """`hf-loopspec generate`: stream the completion on stdout, the statistics on stderr (with `--compare`, the plain
    run's too); exit status 0, or 1 when `--compare` finds greedy float32 tokens that differ from plain decoding."""
    import torch
    from transformers import TextStreamer

    from . import loading
    from .generation import auto
    from .input_checks import check_positions

    device = loading.resolve_device(args.device)
    dtype = "auto" if args.dtype == "auto" else loading.DTYPES[args.dtype]
    model, tokenizer, _ = loading.load_model(args.model, dtype, device, need_tokenizer=True)
    ids = encode_prompt(tokenizer, args.prompt, args.chat, where="PROMPT")
    enc = {"input_ids": torch.tensor([ids], device=device)}
    enc["attention_mask"] = torch.ones_like(enc["input_ids"])  # one unpadded row (else transformers warns)
    check_positions(model.config, len(ids), args.max_new_tokens, prompt_flag="PROMPT", new_flag="--max-new-tokens")
    kwargs = {**generate_kwargs(args, model, tokenizer), "return_dict_in_generate": True}
    if auto.requested(model, kwargs):
        _calibrate(model, kwargs)
    if args.compare:
        _warm_up(model, enc, kwargs)
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    out, seconds = _timed_generate(model, enc, {**kwargs, "streamer": streamer}, args.seed)  # (its end: a newline)
    new = out.sequences.shape[-1] - len(ids)
    print(f"[{args.mode}] {_speed(new, seconds)}{_speculation_summary(args, model, out)}", file=sys.stderr, flush=True)
    if not args.compare:
        return 0
    plain, plain_seconds = _timed_generate(model, enc, {**kwargs, "speculative_mode": None}, args.seed)
    plain_new = plain.sequences.shape[-1] - len(ids)
    print(f"[plain] {_speed(plain_new, plain_seconds)}", file=sys.stderr)
    ratio = (new / seconds) / (plain_new / plain_seconds)
    print(f"speed {args.mode} / plain: {ratio:.2f}x", file=sys.stderr)
    return _print_identity(args, model, out.sequences[0, len(ids):], plain.sequences[0, len(ids):])


def _calibrate(model, kwargs: dict) -> None:
    """Measure (or read) auto's cost table before the timed runs, so that their times are decoding's alone; print
    how long that took on its own line."""
    from .generation import auto, auto_cache

    start = time.perf_counter()
    auto.calibrate(model, 1, kwargs)
    where = (f"not stored: {auto_cache.cache_dir()} cannot be written" if auto_cache.unwritable()
             else f"then read from {auto_cache.cache_dir()}")
    print(f"[auto] cost table ready in {time.perf_counter() - start:.2f} s (measured once per model, device and "
          f"batch size, {where})", file=sys.stderr, flush=True)


def _warm_up(model, enc: dict, kwargs: dict) -> None:
    """An untimed two-token plain call: the process's first `generate` pays one-time set-up, which neither timed
    run of `--compare` should carry."""
    import torch

    with torch.inference_mode():
        model.generate(**enc, **{**kwargs, "speculative_mode": None, "max_new_tokens": 2, "min_new_tokens": None})


def _timed_generate(model, enc: dict, kwargs: dict, seed: int | None):
    """`(model.generate(**enc, **kwargs), wall seconds)`, seeded with `seed` when given, the device synchronised."""
    import torch

    if seed is not None:
        torch.manual_seed(seed)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(**enc, **kwargs)
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    return out, time.perf_counter() - start


def _speed(new: int, seconds: float) -> str:
    return f"{new} new tokens in {seconds:.2f} s ({new / seconds:.1f} tok/s, prefill included)"


def _speculation_summary(args: argparse.Namespace, model, out) -> str:
    """The counters of a speculative run for the statistics line ('' for plain decoding)."""
    stats = getattr(out, "speculation", None)
    if stats is None:
        return ""
    if stats.fallback is not None and args.mode != "auto":  # (auto counts its plain stretches)
        return f"; decoded plainly ({stats.fallback})"
    line = (f"; draft_loops={stats.draft_loops}: {stats.core_calls} core calls ({stats.core_calls_per_token:.2f} "
            f"per token, plain decoding needs {model.num_loops}); drafts accepted {stats.accepted}/"
            f"{stats.verified} verified ({stats.acceptance_rate:.1%})")
    if args.mode == "block":
        line += f", K={args.num_speculative_tokens}"
    if args.mode == "auto":
        ran = ", ".join(f"{c.mode}{f'(d={c.draft_loops})' if c.draft_loops else ''}x{c.tokens}" for c in stats.choices)
        line = (f"; auto ran {ran or 'nothing'}; {stats.core_calls} core calls; drafts accepted {stats.accepted}/"
                f"{stats.verified} verified")
    if args.do_sample:
        line += ("; sampling: each draft kept with probability min(1, p/q), so the output is distributed as "
                 "plain sampling's")
    return line


def _print_identity(args: argparse.Namespace, model, tokens, plain_tokens) -> int:
    """Print whether the speculative run's new tokens equal plain decoding's; 1 when greedy float32 ones differ
    (the guarantee is broken), else 0. Sampled runs are not compared token by token: only their distribution is
    plain sampling's."""
    if args.do_sample:
        print("tokens: not compared (sampled runs differ by design; each is distributed as plain sampling)",
              file=sys.stderr)
        return 0
    import torch

    tokens, plain_tokens = tokens.tolist(), plain_tokens.tolist()
    if tokens == plain_tokens:
        print(f"tokens identical to plain decoding: yes ({len(tokens)} new tokens)", file=sys.stderr)
        return 0
    shorter = min(len(tokens), len(plain_tokens))
    first = next((i for i in range(shorter) if tokens[i] != plain_tokens[i]), shorter)
    exact = model.dtype == torch.float32
    note = "" if exact else " (possible in reduced precision, where different batch shapes round differently)"
    print(f"tokens identical to plain decoding: no, they differ from new token {first} on{note}", file=sys.stderr)
    return 1 if exact else 0


def main(argv: list[str] | None = None) -> int:
    """`hf-loopspec COMMAND ...`; returns the exit status: 0, 1 for a failed bench check, 2 for input a user can fix
    (one line on stderr unless --debug / HF_LOOPSPEC_DEBUG), 130 when interrupted, 141 (nothing printed) when the
    reader of stdout closed it."""
    args = build_parser().parse_args(argv)
    try:
        if args.command in ("generate", "batch"):
            check_generation_args(args)  # before torch loads: a refused option answers at once
            warn_seeded_auto(args)
        from . import register

        register()  # deferred when the console script imported the package (`hf_loopspec_cli`)
        if args.command in ("generate", "batch"):
            import torch

            torch.set_num_threads(args.threads)
        if args.command == "generate":
            return generate(args)
        if args.command == "export":
            return hub_export.main_from_args(args)
        if args.command == "batch":
            from .batch import run_batch

            return run_batch(args)
        if args.command == "serve":
            from .serving import main as serve_main

            args.debug = "--debug" in args.args
            return serve_main(args.args)
        if args.command == "lm-eval":
            from .evaluation import run_lm_eval

            args.debug = "--debug" in args.args  # (ours, not lm-eval's: its parser refuses it)
            return run_lm_eval([arg for arg in args.args if arg != "--debug"])
        from .bench import main as bench_main

        return bench_main.main_from_args(args)
    except BrokenPipeError:  # the reader of stdout left (`generate ... | head`): stop quietly, as `cat` does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's flush has nowhere to fail
        return BROKEN_PIPE
    except USER_ERRORS as err:
        if debug_requested(args):
            raise
        message = one_line(err)
        if isinstance(err, UnicodeEncodeError):  # (printing the generated text)
            message += f"; stdout's encoding ({sys.stdout.encoding}) cannot hold the text: set PYTHONIOENCODING=utf-8"
        if args.command in ("generate", "batch"):
            message = option_spelled(message, getattr(err, "keys", ()))
        elif args.command == "bench":
            message = option_spelled(message, spellings=BENCH_SPELLINGS)
        close_progress_bars()
        print(f"hf-loopspec {args.command}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if debug_requested(args):
            raise
        print(f"hf-loopspec {args.command}: interrupted", file=sys.stderr)
        return 130


def close_progress_bars() -> None:
    """Close the tqdm bars an error left open (lm-eval's request loop, `batch`'s), so that the error starts a line
    of its own and stays the last one: an open bar's line had no newline (the error was glued to it), and the bar
    was drawn again after the error when it was collected at exit."""
    tqdm = sys.modules.get("tqdm")
    for bar in list(getattr(getattr(tqdm, "tqdm", None), "_instances", ())):
        bar.close()


def option_spelled(message: str, saved=(), spellings=OPTION_SPELLINGS) -> str:
    """`message` with the arguments it names spelled as the options that set them (`spellings`: generate's and
    batch's, or bench's), except the `saved` keys (a `SavedSettingError`'s: the checkpoint's generation config set
    them, no option the user gave)."""
    def spelled(match, option) -> str:
        if saved and match[0].startswith(tuple(saved)):
            return match[0]
        return option(match) if callable(option) else match.expand(option)

    for pattern, option in spellings:
        message = pattern.sub(lambda match, option=option: spelled(match, option), message)
    return message


def one_line(message) -> str:
    """`message` (text or an exception) on a single line: whitespace runs, newlines included, become one space. An
    `OSError` about a path reads "PATH: reason" (not "[Errno N] reason: 'PATH'")."""
    if isinstance(message, OSError) and message.strerror and message.filename is not None:
        message = f"{os.fsdecode(message.filename)}: {message.strerror}" + (
            f" (with {os.fsdecode(message.filename2)})" if message.filename2 is not None else "")
    text = " ".join(str(message).split())
    return text or type(message).__name__


def debug_requested(args: argparse.Namespace) -> bool:
    """Whether tracebacks are asked for: `--debug`, or `HF_LOOPSPEC_DEBUG` set to anything but '', 0, false, no."""
    if getattr(args, "debug", False):
        return True
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no")


if __name__ == "__main__":
    sys.exit(main())
