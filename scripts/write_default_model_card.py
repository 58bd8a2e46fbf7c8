#!/usr/bin/env python
"""Write the model card of the embedded default model from its training report and speculation measurements.

    python scripts/write_default_model_card.py \\
        --model hf_loopspec/assets/default_model \\
        --measurements model_cards/hf-loopspec-default/measurements.json \\
        --bench bench_results/cpu_default_b1.json \\
        --out model_cards/hf-loopspec-default/README.md

Reads `training_report.json` and `config.json` of the model folder, the JSON of
`scripts/measure_default_model.py` and the `hf-loopspec bench --json` result of the model (its speed section);
writes the card with `huggingface_hub.ModelCard` / `ModelCardData`.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(ROOT / "hf_loopspec" / "assets" / "default_model"))
    p.add_argument("--measurements", default=str(ROOT / "model_cards" / "hf-loopspec-default" / "measurements.json"))
    p.add_argument("--bench", default=str(ROOT / "bench_results" / "cpu_default_b1.json"),
                   help="`hf-loopspec bench --model default --json` result (greedy)")
    p.add_argument("--out", default=str(ROOT / "model_cards" / "hf-loopspec-default" / "README.md"))
    args = p.parse_args(argv)
    from hf_loopspec.bench.report import checked_result

    try:  # the speed section quotes a bench result's plain and pipeline rows
        args.bench_result = checked_result(json.loads(Path(args.bench).read_text()), f"--bench {args.bench}")
    except (OSError, ValueError) as error:  # (json's decode error is a ValueError)
        p.error(str(error))
    if missing := {"plain", "pipeline"} - {row["mode"] for row in args.bench_result["rows"]}:
        p.error(f"--bench {args.bench} has no {' and no '.join(sorted(missing))} row: pass a result of "
                "`hf-loopspec bench --model default --modes plain,pipeline --json FILE`.")
    return args


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)


def schedule_text(report: dict) -> str:
    """The learning-rate schedule of the run, in words."""
    args, schedule = report["args"], report.get("schedule") or {"kind": "cosine"}
    final = f"{100 * args['min_lr_ratio']:g}%"
    if schedule["kind"] == "warmup-stable-decay":
        how = (f" (the decay began when training had run {schedule['decay_at_minutes']:g} min)"
               if schedule.get("decay_at_minutes") is not None else "")
        return (f"{schedule['warmup_steps']} steps of linear warmup, constant until step {schedule['decay_start']}"
                f"{how}, then cosine decay to {final} at step {schedule['total_steps']}")
    return f"{100 * args['warmup']:g}% linear warmup and cosine decay to {final}"


def speed_section(bench: dict) -> str:
    """The pipeline / plain speed ratio of an `hf-loopspec bench --json` result, with its command and machine."""
    from hf_loopspec.bench.report import command_line  # (the options that differ from the defaults, engines too)

    a, m = bench["args"], bench["machine"]
    command = command_line(bench)
    rows = {r["mode"]: r for r in bench["rows"]}
    plain = rows["plain"]["tokens_per_s"]
    lines = table(["mode", "tokens/s", "x plain", "draft acceptance", "core calls / token", "output == plain"], [
        [mode, f"{r['tokens_per_s']:.1f}", f"{r['tokens_per_s'] / plain:.2f}",
         "-" if r.get("acceptance_rate") is None else f"{100 * r['acceptance_rate']:.1f}%",
         f"{r['core_calls_per_token']:.2f}",
         "reference" if mode == "plain" else "yes" if r.get("check_passed") else "NO"] for mode, r in rows.items()])
    return f"""Measured with

```
{command}
```

on {m['cpu']} ({m['cpu_count']} cores, {m['torch_threads']} torch threads, 1-minute load average
{m['load_avg_1m_start']:.2f} at the start and {m['load_avg_1m_end']:.2f} at the end; the machine was shared), torch
{m['torch']}, batch 1, fp32, greedy, draft depth {a['draft_loops']}:

{lines}

**Pipeline / plain: {rows['pipeline']['tokens_per_s'] / plain:.2f}x** on this run (a median of {a['repeats']}
interleaved rounds; on a shared machine such ratios move by several percent between runs)."""


def body(config: dict, report: dict, measured: dict, bench: dict, size_mb: float) -> str:
    args, corpus, val = report["args"], report["corpus"], report["validation"]
    loops = config["total_ut_steps"]
    n_params = report["parameters"]
    minutes = report["wall_time_s"]["total"] / 60
    arch = table(["field", "value"], [
        ["architecture", "`OuroForCausalLM` (`model_type: ouro`, loaded natively by `hf_loopspec`)"],
        ["parameters", f"{n_params:,} ({n_params / 1e6:.2f}M)"],
        ["loops U (`total_ut_steps`)", loops],
        ["layers per loop", config["num_hidden_layers"]],
        ["hidden / intermediate", f"{config['hidden_size']} / {config['intermediate_size']}"],
        ["attention heads / KV heads / head dim",
         f"{config['num_attention_heads']} / {config['num_key_value_heads']} / {config['head_dim']}"],
        ["vocabulary", f"{config['vocab_size']} (byte-level BPE)"],
        ["tied embeddings", config["tie_word_embeddings"]],
        ["RoPE theta", config["rope_theta"]],
        ["stored precision", f"{config.get('dtype') or config.get('torch_dtype')} (`model.safetensors`)"],
        ["size on disk", f"{size_mb:.1f} MB (whole folder)"],
    ])
    loss_rows = []
    for u in range(loops):
        loss_rows.append([u + 1, f"{val['loss'][u]:.3f}", f"{math.exp(val['loss'][u]):.1f}",
                          f"{100 * val['accuracy'][u]:.1f}%", f"{100 * val['agreement_with_last_loop'][u]:.1f}%"])
    losses = table(["loop (depth)", "val loss (nats/token)", "perplexity", "top-1 accuracy",
                    "argmax agrees with loop U"], loss_rows)
    spec_rows = []
    for s in measured["settings"]:
        spec_rows.append([
            s["speculative_mode"], s["draft_loops"], s.get("num_speculative_tokens", "-"),
            f"{100 * s['acceptance_rate']:.1f}%", f"{s['core_calls_per_token']:.2f}",
            "-" if s.get("cost_model_pipeline") is None else f"{s['cost_model_pipeline']:.2f}",
            "yes" if s["identical_to_greedy"] else f"NO ({len(s['mismatches'])} prompts differ)",
        ])
    spec = table(["mode", "draft loops d", "K", "draft acceptance", "core calls / token",
                  "cost model d + (U-d)(1-a)", "output == plain greedy"], spec_rows)
    dec = measured["decoding"]
    lengths = sorted({p["tokens"] for p in measured["prompts"]})
    prompt_tokens = lengths[0] if len(lengths) == 1 else f"{lengths[0]}-{lengths[-1]}"
    history = table(["step", "tokens", "train loss per loop", "val loss per loop (quick check)"], [
        [h["step"], f"{h['tokens']:,}", " / ".join(f"{x:.2f}" for x in h["train_loss_per_loop"]),
         " / ".join(f"{x:.2f}" for x in h["val_loss_per_loop"])] for h in report["history"]
    ]) if report["history"] else "(no intermediate checks)"
    v = report["versions"]
    m = report["machine"]
    return f"""
# hf-loopspec-default: a tiny looped LM for demos and tests

A **{n_params / 1e6:.1f}M-parameter Ouro-architecture looped language model** (U = {loops} loops over one shared
stack of {config['num_hidden_layers']} layers) trained for {minutes:.0f} minutes on one CPU thread on the Python
source of the CPython {corpus['python']} standard library. It ships inside the `hf_loopspec` package
(`hf_loopspec/assets/default_model/`) so that examples, benchmarks and tests have a real looped model whose loops
were trained to be decodable, offline and without a multi-gigabyte download.

**It is not useful for anything but demos and tests.** It writes Python-looking text, not correct programs.

## Use

```python
import hf_loopspec
from hf_loopspec.assets import default_model_path
from transformers import AutoModelForCausalLM, AutoTokenizer

path = default_model_path()
model = AutoModelForCausalLM.from_pretrained(path)   # hf_loopspec.OuroForCausalLM, fp32
tok = AutoTokenizer.from_pretrained(path)
inputs = tok("def fibonacci(n):", return_tensors="pt")
out = model.generate(**inputs, max_new_tokens=64, return_dict_in_generate=True)  # auto speculation (default)
print(tok.decode(out.sequences[0]), out.speculation.acceptance_rate)
```

`generation_config.json` makes greedy auto self-speculation from depth 1 the default
(`speculative_mode: "auto"`, `draft_loops: 1`, `num_speculative_tokens: 4`: each call decodes plainly, in block or
in pipeline mode, whichever the device's measured costs and the observed draft acceptance make fastest); pass
`speculative_mode=None` for plain decoding. It sets no length limit, so the `max_new_tokens` or `max_length` a
caller passes always wins (without either, transformers' default applies: 20 new tokens). `eos_token_id` =
`pad_token_id` = `bos_token_id` = 0 (`<|endoftext|>`).

## Architecture

{arch}

Same tensor names and forward as ByteDance's Ouro (sandwich RMSNorms, the final norm after every loop, one KV
plane per loop, untied `lm_head`), only smaller. The early-exit gate (`model.early_exit_gate`) exists for
checkpoint compatibility but was **not trained** (it keeps its random initialisation): do not use
`exit_threshold` / `use_weighted_exit` with this model.

## Training data

The `*.py` files of the CPython {corpus['python']} standard library of the training interpreter (sorted by path),
without test directories ({', '.join(f'`{d}/`' for d in corpus['excluded_dirs'])}) and without the generated
charmap tables of `encodings/` (files made by `gencodec.py`). Split by file: a file is held out when the SHA-1
of its relative path falls in the lowest {args['val_percent']:g}%.

| split | files | bytes | tokens |
|---|---|---|---|
| train | {corpus['train_files']} | {corpus['train_bytes']:,} | {corpus['train_tokens']:,} |
| validation | {corpus['validation_files']} | {corpus['validation_bytes']:,} | {corpus['validation_tokens']:,} |

Tokenizer: byte-level BPE trained with `tokenizers` on the training files, {config['vocab_size']} ids;
`<|endoftext|>` = 0, `<|im_start|>` = 1, `<|im_end|>` = 2 as in Ouro. Every file is preceded by
`<|endoftext|>` in the training stream.

## Training

```
{report.get('reproduce_command', report['command'])}
```

(stopped by: {report['stopped_by']}; the full report is `training_report.json` next to the weights).

- Objective: {report['loss']} (so every depth is decodable; this is what self-speculation drafts from).
- {report['steps']} AdamW steps (betas 0.9/0.95, weight decay {args['weight_decay']} on matrices), batch
  {args['batch_size']} x {args['seq_len']} tokens (random windows, seed {args['seed']}),
  {report['tokens_seen']:,} tokens seen (about {report['tokens_seen'] / corpus['train_tokens']:.2f} epochs),
  peak LR {args['lr']:g} with
  {schedule_text(report)}, gradient clipping
  {args['clip']}, bf16 autocast with fp32 master weights; stored in fp32.
- Initialisation for the sandwich norms: token embeddings N(0, {args.get('embed_init_std', 0.02):g}) and the
  attention/MLP output-norm weights set to {args.get('branch_gain_init', 1.0):g}, so the current token is not
  drowned by unit-RMS branch outputs and every loop starts close to the identity (with the library's default
  init the loss stalled near the unigram level in a first attempt).
- Wall time: {report['wall_time_s']['total'] / 60:.1f} min in all ({report['wall_time_s']['training'] / 60:.1f} min
  of optimisation) on {m['cpu']} with {m['torch_threads']} torch thread(s), a machine shared with other jobs.
- Versions: torch {v['torch']}, transformers {v['transformers']}, tokenizers {v['tokenizers']}, Python
  {m['python']}.

The script is deterministic (fixed seeds, a schedule fixed by step counts, one thread): rerunning the command
above (the report's `reproduce_command`, which states as step counts what the run fixed by wall time) with the
same interpreter and library versions on the same kind of CPU reproduces the run. The command as it was run:
`{report['command']}`.

Intermediate checks (8 validation windows):

{history}

## Per-loop validation loss

Teacher-forced next-token loss of every loop's logits on {val['tokens']:,} validation tokens, fp32.
A uniform guess scores ln {config['vocab_size']} = {val['uniform_loss']:.3f}.

{losses}

## Self-speculation: draft acceptance per draft depth

{measured['decoding']['batch_size']} prompt per batch, {len(measured['prompts'])} held-out prompts of
{prompt_tokens} tokens (one per validation file), {dec['max_new_tokens']} new tokens each, greedy
without a repetition penalty (the command's `--repetition-penalty` sets only the samples' decoding), fp32.
"Core calls / token" counts every pass of the shared layer stack, prompt prefill included, per committed
token; plain decoding needs U = {loops}.

{spec}

Measured with

```
{measured['command']}
```

(`scripts/measure_default_model.py`; the raw numbers, per prompt, are in
`model_cards/hf-loopspec-default/measurements.json` of the hf-loopspec repository).

**Read these numbers with care.** They are measured on the model's own greedy continuations, and text a
small model writes (including any repetition in it) is easier for the shallow loops to predict than real code:
teacher-forced on validation code, loop 1 agrees with loop U on
{100 * val['agreement_with_last_loop'][0]:.0f}% of the tokens. Every speculative output was checked token for token
against plain greedy decoding (last column).

## Speed

{speed_section(bench)}

## Samples

{showcase_section(measured['showcase'])}

## Limitations

- A toy: {n_params / 1e6:.1f}M parameters and {report['tokens_seen'] / 1e6:.1f}M training tokens. Its code is
  syntactically plausible at best and never trustworthy; it knows nothing but the style of the CPython stdlib.
- The acceptance numbers describe this model only. Larger, better-trained looped models (e.g. Ouro-1.4B) have
  different agreement between loops; do not read speedups for them off this card.
- Not a chat model, although the ChatML special tokens exist in the vocabulary.
- The early-exit gate is untrained (see Architecture).
- Trained on Python {corpus['python']}'s stdlib; the measurement script needs that interpreter's stdlib to
  rebuild its held-out prompts.

License: Apache-2.0 (the training data is the CPython standard library, under the PSF License).
"""


def showcase_section(showcase: dict) -> str:
    """The greedy continuations of the showcase prompts (the README's first), with their repetition check."""
    settings = ", ".join(f"{k}={v}" for k, v in showcase["settings"].items())
    samples = showcase["samples"]
    looping = [f"`{s['prompt']!r}`" for s in samples if s["repeated_block"] is not None]
    parts = [f"Plain decoding with `{settings}` (the settings of the README's main command), the README's prompt "
             "first. Pipelined self-speculation printed the same tokens for "
             f"{'every prompt' if all(s['pipeline_identical'] for s in samples) else 'NOT every prompt'}. "
             "Degenerate repetition, as `scripts/measure_default_model.py` (`repeated_block`) defines it: a block of "
             "two or more tokens three times back to back. "
             + ("None of these continuations has it." if not looping else
                f"Found in {', '.join(looping)}; none in the others.")
             + " Without the repetition penalty, greedy decoding of this model loops on most prompts. "
             "`tests/test_default_model.py` checks all of these prompts with the README's settings."]
    for sample in samples:
        parts.append(f"Prompt `{sample['prompt']!r}`:\n\n```python\n{sample['prompt']}{sample['continuation']}\n```")
    return "\n\n".join(parts)


def main(argv=None) -> None:
    args = parse_args(argv)
    from huggingface_hub import ModelCard, ModelCardData

    folder = Path(args.model)
    config = json.loads((folder / "config.json").read_text())
    report = json.loads((folder / "training_report.json").read_text())
    measured = json.loads(Path(args.measurements).read_text())
    bench = args.bench_result
    size_mb = sum(f.stat().st_size for f in folder.iterdir() if f.is_file()) / 1e6
    data = ModelCardData(
        license="apache-2.0", library_name="transformers", pipeline_tag="text-generation", language=["code"],
        tags=["looped-language-model", "speculative-decoding", "ouro", "hf-loopspec"],
        model_name="hf-loopspec-default",
    )
    card = ModelCard(f"---\n{data.to_yaml()}\n---\n{body(config, report, measured, bench, size_mb)}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    card.save(out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
