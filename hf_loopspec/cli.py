"""The `hf-loopspec` command line: `generate` (stream a completion), `bench` (see `hf_loopspec.bench`) and
`export` (a Hub-ready folder, see `hf_loopspec.hub.export`).

    hf-loopspec generate "The capital of France is" --mode pipeline --draft-loops 1 --max-new-tokens 64
    hf-loopspec generate "Hi" --model ByteDance/Ouro-1.4B-Thinking --chat --mode block --num-speculative-tokens 4
    hf-loopspec generate "def parse(" --mode pipeline --do-sample --temperature 0.8 --top-p 0.95 --seed 0
    hf-loopspec bench --model ouro-100m --batch-size 1 --new-tokens 64 --synthetic-acceptance 0.9 --json out.json
    hf-loopspec bench --model ouro-100m --do-sample --temperature 0.8 --top-k 50
    hf-loopspec export ByteDance/Ouro-1.4B ./Ouro-1.4B-loopspec

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
from .bench import args as bench_args
from .bench import main as bench_main
from .hub import export as hub_export
from .input_checks import check_positions

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
    commands = parser.add_subparsers(dest="command", required=True, metavar="{generate,bench,export}")

    gen = commands.add_parser("generate", help="stream a completion of PROMPT",
                              description="Stream a completion of PROMPT as tokens are committed, then print the "
                                          "decoding statistics on stderr.")
    gen.add_argument("prompt", metavar="PROMPT")
    gen.add_argument("--model", default="default",
                     help="checkpoint folder or Hub id; 'default' (the default) is the model embedded in the package")
    gen.add_argument("--mode", choices=("plain", "block", "pipeline"), default="pipeline",
                     help="plain: transformers' loop; block / pipeline: self-speculative decoding "
                          "(default: %(default)s)")
    gen.add_argument("--draft-loops", type=bench_args.positive, default=1,
                     help="d: draft from the output of loop d (default: %(default)s)")
    gen.add_argument("--num-speculative-tokens", type=bench_args.positive, default=4,
                     help="K: drafts per block round (default: %(default)s)")
    gen.add_argument("--max-new-tokens", type=bench_args.positive, default=128, help="(default: %(default)s)")
    gen.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    gen.add_argument("--temperature", type=bench_args.non_negative_float, default=None)
    gen.add_argument("--top-k", type=bench_args.positive, default=None)
    gen.add_argument("--top-p", type=bench_args.fraction, default=None)
    gen.add_argument("--seed", type=int, default=None, help="torch seed (for sampling)")
    gen.add_argument("--chat", action="store_true", help="wrap PROMPT in the tokenizer's chat template")
    gen.add_argument("--dtype", choices=("auto", *sorted(loading.DTYPES)), default="auto",
                     help="auto (the default): float32 on CPU, the checkpoint's dtype on CUDA")
    gen.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda if available)")

    bench_parser = commands.add_parser("bench", help="benchmark plain, ar, block and pipeline decoding",
                                       description=bench_args.DESCRIPTION)
    bench_args.add_arguments(bench_parser)
    hub_export.add_subcommand(commands)
    for command in commands.choices.values():
        command.add_argument("--debug", action="store_true",
                             help=f"show the traceback of an error instead of one line (or set {DEBUG_ENV}=1)")
    return parser


def generate(args: argparse.Namespace) -> int:
    import torch
    from transformers import TextStreamer

    device = loading.resolve_device(args.device)
    dtype = "auto" if args.dtype == "auto" else loading.DTYPES[args.dtype]
    model, tokenizer, name = loading.load_model(args.model, dtype, device, need_tokenizer=True)
    if args.chat:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"--chat: the tokenizer of {name} has no chat template; drop --chat.")
        enc = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)
    else:
        enc = tokenizer(args.prompt, return_tensors="pt")
    if enc["input_ids"].shape[-1] == 0:
        raise ValueError("the prompt is empty after tokenization; pass some text.")
    prompt_len = enc["input_ids"].shape[-1]
    check_positions(model.config, prompt_len, args.max_new_tokens, prompt_flag="PROMPT", new_flag="--max-new-tokens")
    enc = {k: v.to(device) for k, v in enc.items()}

    kwargs = {"max_new_tokens": args.max_new_tokens, "do_sample": args.do_sample, "return_dict_in_generate": True,
              "streamer": TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)}
    for key in ("temperature", "top_k", "top_p"):
        if getattr(args, key) is not None:
            kwargs[key] = getattr(args, key)
    if args.mode != "plain":
        kwargs.update(speculative_mode=args.mode, draft_loops=args.draft_loops,
                      num_speculative_tokens=args.num_speculative_tokens)
    if model.generation_config.pad_token_id is None:
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        kwargs["pad_token_id"] = pad if pad is not None else 0
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
        return bench_main.main_from_args(args)
    except USER_ERRORS as err:
        if args.debug or debug_requested():
            raise
        print(f"hf-loopspec {args.command}: error: {one_line(err)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if args.debug or debug_requested():
            raise
        print(f"hf-loopspec {args.command}: interrupted", file=sys.stderr)
        return 130


def one_line(message) -> str:
    """`message` (text or an exception) on a single line: whitespace runs, newlines included, become one space."""
    text = " ".join(str(message).split())
    return text or type(message).__name__


def debug_requested() -> bool:
    """Whether the environment asks for tracebacks (`HF_LOOPSPEC_DEBUG` set to anything but '', 0, false, no)."""
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no")


if __name__ == "__main__":
    sys.exit(main())
