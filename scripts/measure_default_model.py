#!/usr/bin/env python
"""Measure self-speculation on the embedded default model (the numbers of its model card).

Prompts: `--num-prompts` held-out snippets, one from each of that many validation files of the training run
(spread evenly over `training_report.json`'s validation file list, read from the running interpreter's stdlib):
the text from the first `def`/`class` line after the first fifth of the file, cut to `--prompt-tokens` tokens.

For every prompt (batch 1, fp32, greedy, `--max-new-tokens` new tokens) it runs plain greedy decoding
(`speculative_mode=None`, the reference) and every speculative setting in `SETTINGS`, checks that each output
equals the reference token for token, and sums the counters of `out.speculation` over the prompts:

* `acceptance_rate` = accepted / verified drafts;
* `core_calls_per_token` = calls of the shared layer stack / committed tokens, prompt prefill included (plain
  decoding needs U = 4 per token).

Showcase: the greedy continuations (`--showcase-tokens` new tokens, plain decoding, `--repetition-penalty` if
given) of `SHOWCASE_PROMPTS`, the README's prompt first, each checked to equal pipeline decoding with the same
settings and checked for degenerate repetition (`repeated_block`); `tests/test_default_model.py` checks the
README's command.

Writes JSON to `--out` (default: stdout). Threads: `--threads`, default 1 (shared machine).

    python scripts/measure_default_model.py --out model_cards/hf-loopspec-default/measurements.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import shlex
import sys
import sysconfig
import time
from pathlib import Path

from hf_loopspec.bench.args import positive, positive_float, threads

SETTINGS = [
    {"speculative_mode": "pipeline", "draft_loops": 1},
    {"speculative_mode": "pipeline", "draft_loops": 2},
    {"speculative_mode": "block", "draft_loops": 1, "num_speculative_tokens": 4},
    {"speculative_mode": "block", "draft_loops": 2, "num_speculative_tokens": 4},
]
# Each prompt ends with the text of a line, not with its newline: the BPE merges a newline with the next line's
# indentation, so a prompt ending in a bare "\n" starts the model at a token boundary it rarely saw in training.
SHOWCASE_PROMPTS = [
    "def fibonacci(n):",  # the README's main command
    "import os\nimport sys\n\n\ndef main():",
    'class Stack:\n    """A last-in, first-out stack."""\n\n    def __init__(self):',
    'def read_config(path):\n    """Read a configuration file and return a dict."""',
    "for i, line in enumerate(lines):",
]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model folder (default: the embedded default model)")
    p.add_argument("--out", default=None, help="JSON output file (default: stdout)")
    p.add_argument("--num-prompts", type=positive, default=8)
    p.add_argument("--prompt-tokens", type=positive, default=48)
    p.add_argument("--max-new-tokens", type=positive, default=64)
    p.add_argument("--threads", type=threads, default=1)
    p.add_argument("--showcase-tokens", type=positive, default=64)
    p.add_argument("--repetition-penalty", type=positive_float, default=None,
                   help="for the showcase (as in the README)")
    args = p.parse_args(argv)
    if args.model is not None and not Path(args.model).is_dir():
        p.error(f"--model {args.model}: not a folder (pass a model folder, or leave --model out for the embedded "
                "model)")
    return args


def held_out_prompts(tokenizer, report: dict, count: int, length: int) -> list[dict]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = report["corpus"]["validation_file_list"]
    if len(files) < count:
        raise SystemExit(f"the training report lists {len(files)} validation files; need {count}")
    picks = [files[round(i * (len(files) - 1) / max(1, count - 1))] for i in range(count)]
    prompts = []
    for rel in picks:
        path = root / rel
        if not path.is_file():
            raise SystemExit(f"validation file {rel} is not in this interpreter's stdlib ({root}); run with the "
                             f"Python the model was trained on ({report['corpus']['python']}).")
        text = path.read_text(encoding="utf-8", errors="replace")
        start = len(text) // 5
        hits = [i for i in (text.find("\ndef ", start), text.find("\n    def ", start), text.find("\nclass ", start))
                if i >= 0]
        start = min(hits) + 1 if hits else start
        ids = tokenizer(text[start:start + 40 * length], add_special_tokens=False).input_ids[:length]
        prompts.append({"file": rel, "char_offset": start, "tokens": len(ids), "ids": ids,
                        "text": tokenizer.decode(ids)})
    return prompts


def repeated_block(tokens: list[int], copies: int = 3) -> tuple[int, int] | None:
    """Degenerate repetition: a block of n >= 2 tokens that occurs `copies` times back to back (so one token six
    times in a row counts too). The first such (start, n), or None."""
    for n in range(2, len(tokens) // copies + 1):
        for start in range(len(tokens) - copies * n + 1):
            block = tokens[start:start + n]
            if all(tokens[start + k * n:start + (k + 1) * n] == block for k in range(1, copies)):
                return start, n
    return None



def showcase_samples(model, tokenizer, args) -> dict:
    """Greedy plain continuations of `SHOWCASE_PROMPTS`, each compared with pipeline decoding (same settings)."""
    import torch

    settings = {"max_new_tokens": args.showcase_tokens, "do_sample": False}
    if args.repetition_penalty is not None:
        settings["repetition_penalty"] = args.repetition_penalty
    samples = []
    with torch.no_grad():
        for prompt in SHOWCASE_PROMPTS:
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            plain = model.generate(input_ids=ids, speculative_mode=None, **settings)
            spec = model.generate(input_ids=ids, speculative_mode="pipeline", draft_loops=1, **settings)
            new = plain[0, ids.shape[1]:].tolist()
            samples.append({"prompt": prompt, "continuation": tokenizer.decode(new),
                            "repeated_block": repeated_block(new),
                            "pipeline_identical": spec.tolist() == plain.tolist()})
    return {"settings": settings, "samples": samples}


def main(argv=None) -> None:
    args = parse_args(argv)
    import torch
    import transformers

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_loopspec.assets import default_model_path

    torch.set_num_threads(args.threads)
    folder = Path(args.model or default_model_path())
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    report = json.loads((folder / "training_report.json").read_text())
    prompts = held_out_prompts(tokenizer, report, args.num_prompts, args.prompt_tokens)
    loops = model.config.total_ut_steps

    t0 = time.time()
    common = {"max_new_tokens": args.max_new_tokens, "do_sample": False}
    references = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt["ids"]])
            ref = model.generate(input_ids=ids, speculative_mode=None, **common)
            references.append(ref[0].tolist())
            prompt["greedy_continuation"] = tokenizer.decode(ref[0, ids.shape[1]:])
        results = []
        for setting in SETTINGS:
            totals = {"accepted": 0, "verified": 0, "core_calls": 0, "committed_tokens": 0, "discarded": 0}
            mismatches, per_prompt = [], []
            for prompt, ref in zip(prompts, references):
                ids = torch.tensor([prompt["ids"]])
                out = model.generate(input_ids=ids, return_dict_in_generate=True, **setting, **common)
                stats = out.speculation
                for key in totals:
                    totals[key] += getattr(stats, key)
                per_prompt.append({"file": prompt["file"], "acceptance_rate": round(stats.acceptance_rate, 4),
                                   "core_calls_per_token": round(stats.core_calls_per_token, 4)})
                got = out.sequences[0].tolist()
                if got != ref:
                    first = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
                    mismatches.append({"file": prompt["file"], "first_divergent_index": first,
                                       "greedy": ref[first:first + 8], "speculative": got[first:first + 8]})
            acc = totals["accepted"] / totals["verified"] if totals["verified"] else 0.0
            d = setting["draft_loops"]
            results.append({
                **setting,
                "acceptance_rate": round(acc, 4),
                "core_calls_per_token": round(totals["core_calls"] / totals["committed_tokens"], 4),
                "cost_model_pipeline": round(d + (loops - d) * (1 - acc), 4)
                if setting["speculative_mode"] == "pipeline" else None,
                **totals,
                "identical_to_greedy": not mismatches,
                "mismatches": mismatches,
                "per_prompt": per_prompt,
            })
            print(f"{setting}: acceptance {acc:.3f}, core calls/token "
                  f"{totals['core_calls'] / totals['committed_tokens']:.3f}, identical {not mismatches}",
                  file=sys.stderr, flush=True)

    showcase = showcase_samples(model, tokenizer, args)
    weights = folder / "model.safetensors"
    result = {
        "command": "python " + shlex.join([Path(sys.argv[0]).as_posix(), *(sys.argv[1:] if argv is None else argv)]),
        "model": str(folder),
        "model_sha256": hashlib.sha256(weights.read_bytes()).hexdigest(),
        "total_ut_steps": loops,
        "precision": "float32",
        "decoding": {"greedy": True, "batch_size": 1, **common},
        "plain_greedy_core_calls_per_token": float(loops),
        "settings": results,
        "prompts": [{k: v for k, v in p.items() if k != "ids"} for p in prompts],
        "showcase": showcase,
        "wall_time_s": round(time.time() - t0, 1),
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__},
    }
    text = json.dumps(result, indent=2) + "\n"
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main()
