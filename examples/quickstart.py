"""hf-loopspec quickstart: one prompt decoded plainly, with block self-speculation and with pipelined self-speculation.

    python examples/quickstart.py                                   # the embedded tiny model, on CPU, in seconds
    python examples/quickstart.py --model ByteDance/Ouro-1.4B       # a Hub checkpoint (CUDA + bf16 when available)
    python examples/quickstart.py --model ByteDance/Ouro-1.4B-Thinking --chat --prompt "What is 17 * 23?"

Every mode streams its tokens as they are committed and prints how many calls of the shared stack it needed; in
fp32 the greedy outputs of all three modes are identical (the script checks it).
"""

from __future__ import annotations

import argparse
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


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default",
                        help="'default' (the model embedded in hf-loopspec) or a checkpoint folder / Hub id")
    parser.add_argument("--prompt", default="def fibonacci(n):\n")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    parser.add_argument("--max-new-tokens", type=int, default=48)
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
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = pick_dtype(device, args.dtype)
    path = hf_loopspec.assets.default_model_path() if args.model == "default" else args.model
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    print(f"{args.model}: {type(model).__name__}, {model.num_loops} loops, {dtype}, {device}", flush=True)

    if args.chat:
        enc = tok.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)
    else:
        enc = tok(args.prompt, return_tensors="pt")
    enc = {k: v.to(device) for k, v in enc.items()}
    prompt_len = enc["input_ids"].shape[-1]

    model.generate(**enc, max_new_tokens=2, do_sample=False, speculative_mode=None)  # warm-up, not timed
    outputs = {}
    for mode, options in MODES.items():
        print(f"\n--- {mode} ---", flush=True)
        streamer = TextStreamer(tok, skip_prompt=True, skip_special_tokens=True)
        start = time.perf_counter()
        out = model.generate(**enc, max_new_tokens=args.max_new_tokens, do_sample=False, streamer=streamer,
                             return_dict_in_generate=True, **options)
        seconds = time.perf_counter() - start
        new = out.sequences.shape[-1] - prompt_len
        line = f"[{mode}] {new} tokens in {seconds:.2f} s"
        stats = getattr(out, "speculation", None)
        if stats is not None:
            line += (f"; {stats.core_calls_per_token:.2f} calls of the stack per token (plain: {model.num_loops}), "
                     f"drafts accepted {stats.accepted}/{stats.verified}")
        print(line, flush=True)
        outputs[mode] = out.sequences[0, prompt_len:].tolist()

    same = all(seq == outputs["plain"] for seq in outputs.values())
    if dtype == torch.float32:
        print("\nall modes gave the same tokens" if same else "\nMISMATCH between modes (fp32 should be exact)")
        return 0 if same else 1
    print(f"\nmodes agree: {same} (in {dtype} near-tied logits may flip; fp32 is exact)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
