#!/usr/bin/env python
"""Train hf_loopspec's embedded default model: a tiny Ouro-architecture looped LM on the CPython stdlib.

Everything is built offline and reproducibly from the running interpreter:

1. Corpus: the `*.py` files of `sysconfig.get_paths()["stdlib"]`, sorted by relative path, without test
   directories (`test/`, `tests/`, `idlelib/idle_test/`, ...), `site-packages/`, the generated `pydoc_data/`
   text and the generated charmap tables of `encodings/` (`gencodec.py` output). A file goes to validation when
   the SHA-1 of its relative path falls in the lowest `--val-percent` percent (a split by file, stable across
   machines and Python versions for the files they share).
2. Tokenizer: byte-level BPE (`tokenizers`, ByteLevel pre-tokenizer and decoder) with `--vocab-size` ids;
   `<|endoftext|>` = 0, `<|im_start|>` = 1, `<|im_end|>` = 2 as in Ouro. Saved as a
   `transformers.PreTrainedTokenizerFast` (bos = eos = pad = `<|endoftext|>`), so `AutoTokenizer` loads it.
3. Model: `hf_loopspec.OuroForCausalLM` with U = `--loops` (4) loops over a small shared stack. The objective
   is the mean over loops of the LM cross-entropy of every loop's logits, so every depth is decodable (the
   drafts of self-speculation come from the shallow depths). AdamW, linear warmup then cosine decay (or, with
   `--decay-fraction`, warmup-stable-decay), gradient clipping, bf16 autocast on CPU (fp32 master weights),
   random windows of `--seq-len` + 1 tokens from the concatenated training files (each file preceded by
   `<|endoftext|>`).
4. Output (`--out`): `config.json`, `model.safetensors` (fp32), `generation_config.json` (greedy, pipeline
   speculation from depth 1 by default), tokenizer files and `training_report.json` (per-loop validation loss,
   steps, tokens, wall time, command, versions, machine).

Threads: `torch.set_num_threads(--threads)`, default 1, and the tokenizer trainer's thread pool is capped to
the same number, because the machine this was written on is shared with other people's work.

Reproducibility: with `--steps N` the learning-rate schedule depends on the step count only, so the same
command on the same machine, interpreter and library versions gives the same weights. `--minutes M` alone
schedules by elapsed wall time (not bit-reproducible: the step count depends on the machine's load); with
both, `--minutes` is only a safety stop (the schedule stays that of `--steps`), and a run it cut short after
N steps is reproduced by the same command with `--stop-at-step N` instead of `--minutes` (the report's
`reproduce_command`). On a machine of unknown load, `--decay-fraction F --decay-at-minutes D` fits the run to
a time budget and stays reproducible: the LR stays constant after the warmup until D minutes of training, the
step S reached then fixes the run's length, S / (1 - F) steps, and the cosine decay takes the rest; the report
records both, and `--steps S/(1-F) --decay-start-step S` in place of `--decay-at-minutes` repeats the run step
for step (the report's `reproduce_command` writes it out).

Example: a run fitted to about 80 minutes on one thread (the shipped model's command is in its
`training_report.json`, `command` and `reproduce_command`):

    python scripts/train_default_model.py --out hf_loopspec/assets/default_model --hidden-size 320 \
        --intermediate-size 960 --num-heads 10 --num-kv-heads 5 --decay-fraction 0.25 --warmup-steps 100 \
        --decay-at-minutes 60 --minutes 84 --threads 1
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import shlex
import shutil
import sys
import sysconfig
import time
from pathlib import Path

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "pydoc_data"}
GENERATED_CODEC_MARKER = "gencodec.py"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True, help="output folder (created; files of a previous run are replaced)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (reproducible schedule)")
    p.add_argument("--minutes", type=float, default=None, help="wall-clock training budget in minutes")
    p.add_argument("--stop-at-step", type=int, default=None,
                   help="end after this many steps, keeping the LR schedule of --steps (reproduces a run that "
                        "--minutes cut short)")
    p.add_argument("--threads", type=int, default=1, help="torch / tokenizer threads (default 1: shared machine)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--val-percent", type=float, default=4.0, help="percent of files held out for validation")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--num-heads", type=int, default=8)
    p.add_argument("--num-kv-heads", type=int, default=4)
    p.add_argument("--intermediate-size", type=int, default=768)
    p.add_argument("--loops", type=int, default=4, help="total_ut_steps (U)")
    p.add_argument("--max-positions", type=int, default=2048, help="max_position_embeddings of the config")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="final LR as a fraction of --lr")
    p.add_argument("--warmup", type=float, default=0.05, help="warmup as a fraction of training")
    p.add_argument("--warmup-steps", type=int, default=None, help="warmup in steps (for --decay-fraction)")
    p.add_argument("--decay-fraction", type=float, default=None,
                   help="warmup-stable-decay schedule instead of cosine: constant LR after the warmup, then a "
                        "cosine decay to the final LR over the last DECAY_FRACTION of the steps")
    p.add_argument("--decay-at-minutes", type=float, default=None,
                   help="with --decay-fraction: start the decay when training has run this long; the run then "
                        "lasts decay_start / (1 - DECAY_FRACTION) steps (a schedule that fits a time budget on a "
                        "machine of unknown load and stays reproducible: the report records the steps)")
    p.add_argument("--decay-start-step", type=int, default=None,
                   help="with --decay-fraction and --steps: start the decay at this step (reproduces a run that "
                        "used --decay-at-minutes)")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0, help="gradient-norm clipping")
    p.add_argument("--loop-weights", type=str, default=None,
                   help="comma-separated per-loop loss weights (default: equal, i.e. the mean over loops)")
    p.add_argument("--embed-init-std", type=float, default=1.0,
                   help="std of the token-embedding init (see init_for_sandwich_norms)")
    p.add_argument("--branch-gain-init", type=float, default=0.1,
                   help="initial weight of the attention/MLP output norms (see init_for_sandwich_norms)")
    p.add_argument("--no-bf16", action="store_true", help="train in fp32 instead of bf16 autocast")
    p.add_argument("--eval-every", type=int, default=100, help="steps between quick validation checks")
    p.add_argument("--eval-tokens", type=int, default=32768, help="validation tokens for the final evaluation")
    args = p.parse_args(argv)
    if not 0 < args.val_percent < 100:  # (the final evaluation needs validation files, training needs the rest)
        p.error(f"--val-percent must be in (0, 100), got {args.val_percent}")
    if args.decay_fraction is None:
        if args.steps is None and args.minutes is None:
            p.error("pass --steps and/or --minutes")
        if any(x is not None for x in (args.decay_at_minutes, args.decay_start_step, args.warmup_steps)):
            p.error("--decay-at-minutes, --decay-start-step and --warmup-steps need --decay-fraction")
    else:
        if not 0 < args.decay_fraction < 1:
            p.error(f"--decay-fraction must be in (0, 1), got {args.decay_fraction}")
        if args.warmup_steps is None:
            p.error("--decay-fraction needs --warmup-steps (the step count is not known in advance)")
        if (args.decay_at_minutes is None) == (args.decay_start_step is None):
            p.error("--decay-fraction needs exactly one of --decay-at-minutes and --decay-start-step")
        if args.decay_start_step is not None and args.steps is None:
            p.error("--decay-start-step needs --steps")
        if args.decay_at_minutes is not None and args.steps is not None:
            p.error("--decay-at-minutes sets the step count: drop --steps")
    return args


# ----------------------------------------------------------------------------------------------------- corpus
def stdlib_files(root: Path) -> list[Path]:
    """The stdlib's `*.py` files, sorted by relative path, without tests, site-packages and generated data."""
    files = []
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        rel = path.relative_to(root)
        if any(part in EXCLUDED_DIRS for part in rel.parts[:-1]):
            continue
        if rel.parts[0] == "encodings" and GENERATED_CODEC_MARKER in read_text(path)[:1000]:
            continue
        files.append(path)
    return files


def read_text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def is_validation(rel: str, percent: float) -> bool:
    digest = int(hashlib.sha1(rel.encode()).hexdigest()[:8], 16)
    return digest % 10000 < percent * 100


def build_corpus(val_percent: float):
    root = Path(sysconfig.get_paths()["stdlib"])
    train, val = [], []
    for path in stdlib_files(root):
        rel = path.relative_to(root).as_posix()
        (val if is_validation(rel, val_percent) else train).append((rel, read_text(path)))
    return root, train, val


# -------------------------------------------------------------------------------------------------- tokenizer
def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    for i, s in enumerate(SPECIALS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    return tok


def wrap_tokenizer(tok, max_length: int):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=SPECIALS[0], eos_token=SPECIALS[0], pad_token=SPECIALS[0],
        model_max_length=max_length, clean_up_tokenization_spaces=False,
    )


def token_stream(tokenizer, texts: list[str]):
    """All texts as one id stream, each text preceded by `<|endoftext|>` (id 0)."""
    import torch

    ids = []
    for enc in tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False):
        ids.append(0)
        ids.extend(enc.ids)
    return torch.tensor(ids, dtype=torch.long)


# ------------------------------------------------------------------------------------------------------ model
def init_for_sandwich_norms(model, embed_std: float, branch_gain: float) -> None:
    """Re-initialise for training from scratch with Ouro's sandwich norms.

    Every attention / MLP output passes an RMSNorm before joining the residual stream, so with the default
    init (norm weights 1, embeddings N(0, 0.02)) each branch adds a unit-RMS vector to a token embedding 50x
    smaller: the current token's identity drowns in the first layer's context average and training stalls
    near the unigram loss. Larger embeddings and small initial output-norm weights (a LayerScale-style
    start) keep the token in the stream and make every loop start close to the identity, so the deeper
    loops begin as refinements of the shallower ones.
    """
    import torch

    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0.0, embed_std)
        for layer in model.model.layers:
            layer.input_layernorm_2.weight.fill_(branch_gain)
            layer.post_attention_layernorm_2.weight.fill_(branch_gain)


def per_loop_losses(model, batch):
    """Cross-entropy of every loop's next-token prediction on `batch` `[B, T+1]`; a list of U scalars."""
    import torch.nn.functional as F

    inputs, targets = batch[:, :-1], batch[:, 1:]
    out = model(input_ids=inputs, use_cache=False, output_loop_logits=True)
    vocab = out.loop_logits[0].shape[-1]
    return [F.cross_entropy(lg.float().reshape(-1, vocab), targets.reshape(-1)) for lg in out.loop_logits]


def evaluate(model, stream, seq_len: int, max_tokens: int, batch_size: int = 8, bf16: bool = False):
    """Per-loop mean loss, top-1 accuracy and agreement of every loop's argmax with the last loop's, over
    non-overlapping windows of the validation stream (teacher forcing)."""
    import torch

    windows = min((len(stream) - 1) // seq_len, max(1, max_tokens // seq_len))
    starts = torch.arange(windows) * seq_len
    loops = model.config.total_ut_steps
    loss_sum, correct, agree, count = torch.zeros(loops), torch.zeros(loops), torch.zeros(loops), 0
    was_training = model.training
    model.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        for i in range(0, windows, batch_size):
            batch = torch.stack([stream[s:s + seq_len + 1] for s in starts[i:i + batch_size].tolist()])
            out = model(input_ids=batch[:, :-1], use_cache=False, output_loop_logits=True)
            targets = batch[:, 1:].reshape(-1)
            final = out.loop_logits[-1].reshape(-1, out.loop_logits[-1].shape[-1]).argmax(-1)
            for u, lg in enumerate(out.loop_logits):
                lg = lg.float().reshape(-1, lg.shape[-1])
                loss_sum[u] += torch.nn.functional.cross_entropy(lg, targets, reduction="sum")
                pred = lg.argmax(-1)
                correct[u] += (pred == targets).sum()
                agree[u] += (pred == final).sum()
            count += targets.numel()
    model.train(was_training)
    return {
        "tokens": count,
        "loss": [round(x, 4) for x in (loss_sum / count).tolist()],
        "accuracy": [round(x, 4) for x in (correct / count).tolist()],
        "agreement_with_last_loop": [round(x, 4) for x in (agree / count).tolist()],
    }


def cosine_between(t: float, args) -> float:
    """The LR a fraction `t` in [0, 1] into a cosine decay from `--lr` to `--lr * --min-lr-ratio`."""
    t = min(1.0, max(0.0, t))
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def lr_at(progress: float, args) -> float:
    """Cosine schedule: linear warmup over `--warmup` of training (`progress` in [0, 1]), then cosine decay."""
    if progress < args.warmup:
        return args.lr * max(progress, 1e-3) / args.warmup
    return cosine_between((progress - args.warmup) / max(1e-9, 1 - args.warmup), args)


def wsd_lr_at(step: int, decay_start: int | None, total: int | None, args) -> float:
    """Warmup-stable-decay: linear warmup over `--warmup-steps`, `--lr` until `decay_start` (None: not known
    yet), then cosine decay to the final LR at step `total`."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    if decay_start is None or step < decay_start:
        return args.lr
    return cosine_between((step - decay_start) / max(1, total - decay_start), args)


def reproduce_command(argv: list[str], stopped_by: str, steps: int, schedule: dict | None = None) -> str:
    """The command that reproduces this run step for step: a `--minutes` stop becomes `--stop-at-step`, and a
    warmup-stable-decay run whose decay `--decay-at-minutes` started (`schedule`: its `decay_start` and
    `total_steps`) gets them as `--decay-start-step` and `--steps`."""
    drop = {"--minutes"} if stopped_by == "minutes" else set()
    if schedule is not None and schedule.get("decay_at_minutes") is not None:
        drop |= {"--decay-at-minutes", "--steps"}
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg.split("=", 1)[0] in drop:
            skip = "=" not in arg
            continue
        kept.append(arg)
    if schedule is not None and schedule.get("decay_at_minutes") is not None:
        kept += ["--steps", str(schedule["total_steps"]), "--decay-start-step", str(schedule["decay_start"])]
    if stopped_by == "minutes":
        kept += ["--stop-at-step", str(steps)]
    return "python " + shlex.join([Path(sys.argv[0]).as_posix(), *kept])


def machine_info(threads: int) -> dict:
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cpu_count": os.cpu_count(), "torch_threads": threads, "platform": platform.platform(),
            "python": platform.python_version()}


# ------------------------------------------------------------------------------------------------------- main
def main(argv=None) -> None:
    args = parse_args(argv)
    os.environ["RAYON_NUM_THREADS"] = str(args.threads)  # the tokenizer trainer's pool (created lazily)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false" if args.threads == 1 else "true")

    import tokenizers
    import torch
    import transformers
    from tqdm import tqdm
    from transformers import GenerationConfig

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
    from hf_loopspec import OuroConfig, OuroForCausalLM

    t_start = time.time()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out_dir = Path(args.out)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)

    # corpus and tokenizer
    root, train_docs, val_docs = build_corpus(args.val_percent)
    if not val_docs or not train_docs:  # (before training: the final evaluation needs held-out files)
        raise SystemExit(f"--val-percent {args.val_percent} leaves {len(val_docs)} validation and {len(train_docs)} "
                         "training files; choose a percentage that leaves some of both.")
    print(f"corpus: {len(train_docs)} train / {len(val_docs)} validation files from {root}", flush=True)
    backend = train_tokenizer([text for _, text in train_docs], args.vocab_size)
    tokenizer = wrap_tokenizer(backend, args.max_positions)
    train_ids = token_stream(tokenizer, [text for _, text in train_docs])
    val_ids = token_stream(tokenizer, [text for _, text in val_docs])
    t_data = time.time() - t_start
    print(f"tokens: {len(train_ids)} train / {len(val_ids)} validation ({t_data:.0f} s)", flush=True)

    # model
    config = OuroConfig(
        vocab_size=len(tokenizer), hidden_size=args.hidden_size, intermediate_size=args.intermediate_size,
        num_hidden_layers=args.num_layers, num_attention_heads=args.num_heads,
        num_key_value_heads=args.num_kv_heads, total_ut_steps=args.loops, max_position_embeddings=args.max_positions,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )
    config.architectures = ["OuroForCausalLM"]
    model = OuroForCausalLM(config)
    init_for_sandwich_norms(model, args.embed_init_std, args.branch_gain_init)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters, U={args.loops}", flush=True)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed_tokens" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2 or "embed_tokens" in n]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    weights = [1.0] * args.loops if args.loop_weights is None else [float(w) for w in args.loop_weights.split(",")]
    if len(weights) != args.loops:
        raise SystemExit(f"--loop-weights needs {args.loops} values, got {len(weights)}")
    weights = [w / sum(weights) for w in weights]

    gen = torch.Generator().manual_seed(args.seed)
    quick_val = val_ids[: 8 * args.seq_len + 1]
    history = []
    budget = None if args.minutes is None else args.minutes * 60
    step, tokens_seen, t_train = 0, 0, time.time()
    bar = tqdm(total=args.steps, desc="train", unit="step", dynamic_ncols=True, mininterval=5)
    stopped_by = "steps"
    wsd = args.decay_fraction is not None
    total_steps, decay_start = args.steps, args.decay_start_step
    while True:
        elapsed = time.time() - t_train
        if wsd and decay_start is None and elapsed >= args.decay_at_minutes * 60:
            decay_start, total_steps = step, round(step / (1 - args.decay_fraction))
            bar.write(f"decay starts at step {step} ({elapsed / 60:.1f} min); the run ends at step {total_steps}")
        if total_steps is not None and step >= total_steps:
            break
        if args.stop_at_step is not None and step >= args.stop_at_step:
            stopped_by = "stop_at_step"
            break
        if budget is not None and elapsed >= budget:
            stopped_by = "minutes"
            break
        if wsd:
            lr = wsd_lr_at(step, decay_start, total_steps, args)
        else:
            lr = lr_at(step / args.steps if args.steps is not None else elapsed / budget, args)
        for group in opt.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, len(train_ids) - args.seq_len - 1, (args.batch_size,), generator=gen)
        batch = torch.stack([train_ids[s:s + args.seq_len + 1] for s in starts.tolist()])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not args.no_bf16):
            losses = per_loop_losses(model, batch)
        loss = sum(w * x for w, x in zip(weights, losses))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        step += 1
        tokens_seen += batch[:, 1:].numel()
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}", first=f"{losses[0].item():.3f}", last=f"{losses[-1].item():.3f}",
                        lr=f"{lr:.2e}", refresh=False)
        if step % args.eval_every == 0:
            quick = evaluate(model, quick_val, args.seq_len, 8 * args.seq_len, bf16=not args.no_bf16)
            history.append({"step": step, "tokens": tokens_seen, "elapsed_s": round(time.time() - t_train, 1),
                            "lr": lr, "grad_norm": round(float(grad_norm), 3),
                            "train_loss_per_loop": [round(x.item(), 4) for x in losses],
                            "val_loss_per_loop": quick["loss"]})
            bar.write(f"step {step}: train {[round(x.item(), 3) for x in losses]} val {quick['loss']}")
    bar.close()
    train_wall = time.time() - t_train
    schedule = None
    if wsd:  # a run stopped before its decay began is reproduced with the decay starting at its last step
        schedule = {"kind": "warmup-stable-decay", "warmup_steps": args.warmup_steps,
                    "decay_fraction": args.decay_fraction, "decay_at_minutes": args.decay_at_minutes,
                    "decay_start": step if decay_start is None else decay_start,
                    "total_steps": step if total_steps is None else total_steps}

    # final evaluation in fp32 (the stored precision)
    model.eval()
    final = evaluate(model, val_ids, args.seq_len, args.eval_tokens)
    print(f"validation per loop: {final}", flush=True)

    # save
    model.config.dtype = torch.float32
    model.generation_config = GenerationConfig(
        bos_token_id=0, eos_token_id=0, pad_token_id=0, do_sample=False,
        speculative_mode="pipeline", draft_loops=1, num_speculative_tokens=4,
    )
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    # transformers 5 writes the stored precision as "dtype"; 4.x readers (and the Hub's Ouro files) use "torch_dtype".
    config_json = json.loads((out_dir / "config.json").read_text())
    config_json["torch_dtype"] = config_json["dtype"]
    (out_dir / "config.json").write_text(json.dumps(config_json, indent=2, sort_keys=True) + "\n")
    reloaded = GenerationConfig.from_pretrained(out_dir)
    assert (reloaded.speculative_mode, reloaded.draft_loops, reloaded.num_speculative_tokens) == ("pipeline", 1, 4)

    prompt = "def fibonacci(n):"
    ids = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        sample = model.generate(**ids, max_new_tokens=64, do_sample=False, speculative_mode=None)
    sample_text = tokenizer.decode(sample[0], skip_special_tokens=False)
    print(f"sample:\n{sample_text}", flush=True)

    report = {
        "command": "python " + shlex.join([Path(sys.argv[0]).as_posix(), *(sys.argv[1:] if argv is None else argv)]),
        "args": vars(args),
        "stopped_by": stopped_by,
        "reproduce_command": reproduce_command(argv if argv is not None else sys.argv[1:], stopped_by, step,
                                               schedule),
        "schedule": schedule or {"kind": "cosine", "warmup": args.warmup},
        "steps": step,
        "tokens_seen": tokens_seen,
        "wall_time_s": {"data_and_tokenizer": round(t_data, 1), "training": round(train_wall, 1),
                        "total": round(time.time() - t_start, 1)},
        "parameters": n_params,
        "corpus": {
            "stdlib": str(root), "python": platform.python_version(),
            "train_files": len(train_docs), "validation_files": len(val_docs),
            "train_bytes": sum(len(t.encode()) for _, t in train_docs),
            "validation_bytes": sum(len(t.encode()) for _, t in val_docs),
            "train_tokens": len(train_ids), "validation_tokens": len(val_ids),
            "validation_file_list": [rel for rel, _ in val_docs],
            "excluded_dirs": sorted(EXCLUDED_DIRS), "excluded_generated": "encodings/* made by gencodec.py",
        },
        "loss": "mean over loops of the per-loop next-token cross-entropy" if args.loop_weights is None
        else f"per-loop cross-entropy weighted {weights}",
        "validation": {**final, "uniform_loss": round(math.log(len(tokenizer)), 4), "precision": "float32"},
        "history": history,
        "sample": {"prompt": prompt, "greedy_64": sample_text},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "tokenizers": tokenizers.__version__},
        "machine": machine_info(args.threads),
    }
    (out_dir / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    size = sum(f.stat().st_size for f in out_dir.iterdir())
    print(f"wrote {out_dir} ({size / 1e6:.2f} MB) in {time.time() - t_start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
