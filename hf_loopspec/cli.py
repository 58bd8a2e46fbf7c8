"""The `hf-loopspec` command line: `generate` (stream a completion), `bench` (see `hf_loopspec.bench`),
`export` (a Hub-ready folder, see `hf_loopspec.hub.export`), `batch` (a JSONL file of prompts, data-parallel under
`accelerate launch`, see `hf_loopspec.batch`) and `lm-eval` (lm-evaluation-harness with the models registered).

    hf-loopspec generate "The capital of France is" --mode pipeline --draft-loops 1 --max-new-tokens 64
    hf-loopspec generate "Hi" --model ByteDance/Ouro-1.4B-Thinking --chat --mode block --num-speculative-tokens 4
    hf-loopspec generate "def parse(" --mode pipeline --do-sample --temperature 0.8 --top-p 0.95 --seed 0
    hf-loopspec bench --model ouro-100m --batch-size 1 --new-tokens 64 --synthetic-acceptance 0.9 --json out.json
    hf-loopspec bench --model ouro-100m --do-sample --temperature 0.8 --top-k 50
    hf-loopspec export ByteDance/Ouro-1.4B ./Ouro-1.4B-loopspec
    hf-loopspec batch prompts.jsonl --output completions.jsonl --batch-size 16 --max-new-tokens 256
    accelerate launch --num_processes 8 -m hf_loopspec.cli batch prompts.jsonl --output completions.jsonl
    hf-loopspec lm-eval run --model hf --model_args pretrained=ByteDance/Ouro-1.4B --tasks gsm8k \\
        --gen_kwargs speculative_mode=pipeline,draft_loops=1

Sampling (`--do-sample`) works in every mode: the speculative modes use lossless speculative sampling (a draft is
kept with probability min(1, p/q)), and `generate` prints that acceptance rate.

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
import sys
import time

from . import loading
from .batch import run_batch
from .bench import args as bench_args
from .bench import main as bench_main
from .evaluation import run_lm_eval
from .generation.config import DEFAULT_DRAFT_LOOPS, DEFAULT_NUM_SPECULATIVE_TOKENS
from .hub import export as hub_export
from .input_checks import check_positions
from .prompting import encode_prompt, generate_kwargs

DEBUG_ENV = "HF_LOOPSPEC_DEBUG"
USER_ERRORS = (ValueError, OSError)  # what the commands raise for input a user can fix


class OneLineParser(argparse.ArgumentParser):
    """An `ArgumentParser` whose errors are one line on stderr (the problem and where the usage is), status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {one_line(message)} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="hf-loopspec",
        description="Looped LMs (Ouro) with lossless pipelined self-speculative decoding.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="{generate,batch,bench,export,lm-eval}")

    gen = commands.add_parser("generate", help="stream a completion of PROMPT",
                              description="Stream a completion of PROMPT as tokens are committed, then print the "
                                          "decoding statistics on stderr.")
    gen.add_argument("prompt", metavar="PROMPT")
    _add_generation_options(gen, chat_help="wrap PROMPT in the tokenizer's chat template")
    gen.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda if available)")

    batch = commands.add_parser(
        "batch", help="generate for every row of a JSONL file (data-parallel under accelerate launch)",
        description="Generate a completion for every {\"id\": ..., \"prompt\": ...} row of PROMPTS into OUT (JSONL, "
                    "input order), in length-grouped batches. Under `accelerate launch --num_processes N -m "
                    "hf_loopspec.cli batch ...` every process decodes its shard of the batches. Resumable: rerun the "
                    "same command after a kill and only the unfinished rows are generated.")
    batch.add_argument("prompts", metavar="PROMPTS",
                       help="JSONL file, one {\"id\": ..., \"prompt\": ...} object a line")
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
    return parser


def _add_generation_options(parser: argparse.ArgumentParser, chat_help: str) -> None:
    """The model and decoding options that `generate` and `batch` share."""
    parser.add_argument("--model", default="default", help="checkpoint folder or Hub id; 'default' (the default) "
                                                             "is the model embedded in the package")
    parser.add_argument("--mode", choices=("plain", "block", "pipeline"), default="pipeline",
                        help="plain: transformers' loop; block / pipeline: self-speculative decoding "
                             "(default: %(default)s)")
    parser.add_argument("--draft-loops", type=bench_args.positive, default=DEFAULT_DRAFT_LOOPS,
                        help="d: draft from the output of loop d (default: %(default)s)")
    parser.add_argument("--num-speculative-tokens", type=bench_args.positive, default=DEFAULT_NUM_SPECULATIVE_TOKENS,
                        help="K: drafts per block round (default: %(default)s)")
    parser.add_argument("--max-new-tokens", type=bench_args.positive, default=128, help="(default: %(default)s)")
    parser.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    parser.add_argument("--temperature", type=bench_args.non_negative_float, default=None)
    parser.add_argument("--top-k", type=bench_args.positive, default=None)
    parser.add_argument("--top-p", type=bench_args.fraction, default=None)
    parser.add_argument("--seed", type=int, default=None, help="torch seed (for sampling)")
    parser.add_argument("--repetition-penalty", type=bench_args.positive_float, default=None,
                        help="divide the scores of tokens already in the text by P (> 1 discourages repeats; "
                             "greedy or sampled, lossless under speculation)")
    parser.add_argument("--chat", action="store_true", help=chat_help)
    parser.add_argument("--dtype", choices=("auto", *sorted(loading.DTYPES)), default="auto",
                        help="auto (the default): float32 on CPU, the checkpoint's dtype on CUDA")


def generate(args: argparse.Namespace) -> int:
    import torch
    from transformers import TextStreamer

    device = loading.resolve_device(args.device)
    dtype = "auto" if args.dtype == "auto" else loading.DTYPES[args.dtype]
    model, tokenizer, _ = loading.load_model(args.model, dtype, device, need_tokenizer=True)
    enc = {"input_ids": torch.tensor([encode_prompt(tokenizer, args.prompt, args.chat)], device=device)}
    prompt_len = enc["input_ids"].shape[-1]
    check_positions(model.config, prompt_len, args.max_new_tokens, prompt_flag="PROMPT", new_flag="--max-new-tokens")
    kwargs = {**generate_kwargs(args, model, tokenizer), "return_dict_in_generate": True,
              "streamer": TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)}
    if args.seed is not None:
        torch.manual_seed(args.seed)

    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(**enc, **kwargs)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    print(flush=True)
    new = out.sequences.shape[-1] - prompt_len
    line = f"[{args.mode}] {new} new tokens in {seconds:.2f} s ({new / seconds:.1f} tok/s, prefill included)"
    stats = getattr(out, "speculation", None)
    if stats is not None:
        line += (f"; draft_loops={stats.draft_loops}: {stats.core_calls} core calls ({stats.core_calls_per_token:.2f} "
                 f"per token, plain decoding needs {model.num_loops}); drafts accepted {stats.accepted}/"
                 f"{stats.verified} verified ({stats.acceptance_rate:.1%})")
        if args.mode == "block":
            line += f", K={args.num_speculative_tokens}"
        if args.do_sample:
            line += ("; sampling: each draft kept with probability min(1, p/q), so the output is distributed as "
                     "plain sampling's")
    print(line, file=sys.stderr, flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    """`hf-loopspec COMMAND ...`; returns the exit status: 0, 1 for a failed bench check, 2 for input a user can fix
    (one line on stderr unless --debug / HF_LOOPSPEC_DEBUG), 130 when interrupted."""
    args = build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            return generate(args)
        if args.command == "export":
            return hub_export.main_from_args(args)
        if args.command == "batch":
            return run_batch(args)
        if args.command == "lm-eval":
            return run_lm_eval(args.args)
        return bench_main.main_from_args(args)
    except USER_ERRORS as err:
        if debug_requested(args):
            raise
        print(f"hf-loopspec {args.command}: error: {one_line(err)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if debug_requested(args):
            raise
        print(f"hf-loopspec {args.command}: interrupted", file=sys.stderr)
        return 130


def one_line(message) -> str:
    """`message` (text or an exception) on a single line: whitespace runs, newlines included, become one space."""
    text = " ".join(str(message).split())
    return text or type(message).__name__


def debug_requested(args: argparse.Namespace) -> bool:
    """Whether tracebacks are asked for: `--debug`, or `HF_LOOPSPEC_DEBUG` set to anything but '', 0, false, no."""
    if getattr(args, "debug", False):
        return True
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no")


if __name__ == "__main__":
    sys.exit(main())
