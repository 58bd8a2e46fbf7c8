"""hf-loopspec quickstart: one prompt decoded plainly, with block self-speculation and with pipelined self-speculation.

    python examples/quickstart.py                                   # the embedded tiny model, on CPU, in seconds
    python examples/quickstart.py --model ByteDance/Ouro-1.4B       # a Hub checkpoint (CUDA + bf16 when available)
    python examples/quickstart.py --model ByteDance/Ouro-1.4B-Thinking --chat --prompt "What is 17 * 23?"

Every mode streams its tokens as they are committed and prints how many calls of the shared stack it needed; in
fp32 the greedy outputs of all three modes are identical (the script checks it). Then the speed, measured as
`hf-loopspec bench` measures it: every mode timed in interleaved rounds after a warm-up, prefill included, the median
round per mode, side by side with plain decoding and its ratio to plain. Decoding is greedy with
`repetition_penalty=1.4` (the README's main command's setting: without it a small model loops on its own text),
and torch runs on the thread count it prints (default 1: on a small model more threads only add overhead, and on a
shared machine they slow every mode down).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TextStreamer

import hf_loopspec.assets

MODES = {
    "plain": {"speculative_mode": None},
    "block": {"speculative_mode": "block", "draft_loops": 1, "num_speculative_tokens": 4},
    "pipeline": {"speculative_mode": "pipeline", "draft_loops": 1},
}


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default",
                        help="'default' (the model embedded in hf-loopspec) or a checkpoint folder / Hub id")
    parser.add_argument("--prompt", default="def fibonacci(n):\n")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    parser.add_argument("--max-new-tokens", type=positive, default=48)
    parser.add_argument("--repetition-penalty", type=float, default=1.4, help="1.0: none (default: %(default)s)")
    parser.add_argument("--threads", type=positive, default=1, help="torch threads (default: %(default)s)")
    parser.add_argument("--repeats", type=positive, default=3, help="timed rounds per mode (default: %(default)s)")
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                        help="auto: float32 on CPU; on CUDA bfloat16 from compute capability 8.0, else float16")
    return parser.parse_args(argv)


def pick_dtype(device: torch.device, name: str) -> torch.dtype:
    if name != "auto":
        return getattr(torch, name)
    if device.type != "cuda":
        return torch.float32
    major, _ = torch.cuda.get_device_capability(device)
    return torch.bfloat16 if major >= 8 else torch.float16  # Triton has no bf16 before sm80 (e.g. Colab's T4)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = pick_dtype(device, args.dtype)
    path = hf_loopspec.assets.default_model_path() if args.model == "default" else args.model
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    print(f"{args.model}: {type(model).__name__}, {model.num_loops} loops, {dtype}, {device}, "
          f"{torch.get_num_threads()} torch thread(s)", flush=True)

    if args.chat and not getattr(tok, "chat_template", None):
        sys.exit(f"quickstart.py: error: --chat: the tokenizer of {args.model} has no chat template; drop --chat.")
    if args.chat:
        enc = tok.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)
    else:
        enc = tok(args.prompt, return_tensors="pt")
    enc = {k: v.to(device) for k, v in enc.items()}
    prompt_len = enc["input_ids"].shape[-1]

    settings = {"max_new_tokens": args.max_new_tokens, "do_sample": False,
                "repetition_penalty": args.repetition_penalty, "return_dict_in_generate": True}
    outputs, stats = {}, {}
    for mode, options in MODES.items():  # streamed once (this is also each mode's warm-up)
        print(f"\n--- {mode} ---", flush=True)
        streamer = TextStreamer(tok, skip_prompt=True, skip_special_tokens=True)
        out = model.generate(**enc, streamer=streamer, **settings, **options)
        outputs[mode] = out.sequences[0, prompt_len:].tolist()
        stats[mode] = getattr(out, "speculation", None)
        line = f"[{mode}] {len(outputs[mode])} tokens"
        if stats[mode] is not None:
            line += (f"; {stats[mode].core_calls_per_token:.2f} calls of the stack per token (plain: "
                     f"{model.num_loops}), drafts accepted {stats[mode].accepted}/{stats[mode].verified}")
        print(line, flush=True)

    print_speed(model, enc, settings, outputs, stats, args.repeats, device)

    same = all(seq == outputs["plain"] for seq in outputs.values())
    if dtype == torch.float32:
        print("\nall modes gave the same tokens" if same else "\nMISMATCH between modes (fp32 should be exact)")
        return 0 if same else 1
    print(f"\nmodes agree: {same} (in {dtype} near-tied logits may flip; fp32 is exact)")
    return 0


def print_speed(model, enc, settings, outputs, stats, repeats, device) -> None:
    """Time every mode in `repeats` interleaved rounds (the median round counts) and print them beside plain."""
    seconds = {mode: [] for mode in MODES}
    for _ in range(repeats):
        for mode, options in MODES.items():
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            model.generate(**enc, **settings, **options)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds[mode].append(time.perf_counter() - start)
    median = {mode: statistics.median(times) for mode, times in seconds.items()}
    print(f"\nspeed (median of {repeats} interleaved rounds, prefill included, {torch.get_num_threads()} torch "
          "thread(s)):")
    print(f"{'mode':<10}{'tok/s':>8}{'x plain':>9}{'calls/token':>13}{'acceptance':>12}")
    for mode in MODES:
        s = stats[mode]
        calls = f"{s.core_calls_per_token:.2f}" if s is not None else f"{model.num_loops:.2f}"
        accept = f"{s.acceptance_rate:.1%}" if s is not None and s.verified else "-"
        print(f"{mode:<10}{len(outputs[mode]) / median[mode]:>8.1f}{median['plain'] / median[mode]:>9.2f}"
              f"{calls:>13}{accept:>12}")


if __name__ == "__main__":
    sys.exit(main())
