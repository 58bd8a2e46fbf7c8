"""`hf-loopspec bench`: plain vs AR vs block vs pipeline decoding in one process, with the limit it is judged by.

What runs
---------
Four modes over the same greedy prompts (`--batch-size` sequences of `--prompt-len` tokens, `--new-tokens`
new tokens each; EOS is ignored in every mode, so every run commits exactly `batch * new_tokens` tokens). The
prompts are seeded random ids for random weights, else slices of a built-in text (`PROMPT_CODE`, Python source,
for the embedded model, which was trained on Python; `PROMPT_TEXT`, English, for other checkpoints) or of
`--prompt-file`.

* `plain`: `model.generate(..., speculative_mode=None)`, transformers' own loop on a `DynamicCache`.
* `static` (only when asked for in `--modes`): the same with `cache_implementation="static"`, which transformers
  compiles on CUDA (its own fast path, the honest plain baseline on a GPU); its `compile_seconds` is its warm-up
  minus its median timed run.
* `ar`: `model.decode_with_lanes(ids, "ar")` on a `PagedLoopCache`: the lane engine without drafting, U core calls
  per token. The baseline of the speculative modes (same engine, same cache, same entry point).
* `block`, `pipeline`: `model.decode_with_lanes(ids, mode, draft_loops=d, num_speculative_tokens=K)`.

`plain` is also run once, untimed, first: its greedy output is the reference. Every mode is then warmed up
once, and the timed runs are interleaved (`plain ar block pipeline plain ar ...`, `--repeats` rounds); a
mode's time is the median of its rounds and includes prefill. Every output of every run is compared with the
reference: in fp32 it must be equal (`check_passed`), in bf16/fp16 the agreement rate (common-prefix fraction)
is reported with the first divergent token and the reference's top-1/top-2 logit margin there.

Random-weight shapes (`SHAPES`) cover both families: `ouro-tiny`, `ouro-100m`, `ouro-1.4b`, and `huginn-tiny`,
`huginn-small` (Huginn-0125's 2 + 4 + 2 stage layout at width 512, 32 recurrence steps), `huginn-3.5b` (the real
shape, for a GPU). Huginn-family models run every mode from zero initial states (init_scale 0) at
`mean_recurrence` steps; `draft_loops` then counts recurrence steps. Their prelude and coda have KV of their own,
so the call-cost model below (which times core and head calls alone) is not computed for them: the ideal
columns stay empty, and the comparison is measured time and core calls per token.

`--compile [BACKEND]` runs the lane modes with `compile_core` (static-shape compiled core and head calls,
`generation/stages.py`); each row reports `compile_seconds`, its warm-up run minus its median timed run.

`--synthetic-acceptance A` (for random weights, whose drafts are almost never right): every draft proposal is
replaced through `draft_hook` by the known greedy token with probability A (seeded), otherwise by a wrong token.
Verification stays real, so outputs must still equal the reference. The known token comes from the mode's own
warm-up output: in fp32 that equals the reference (the timed runs' checks confirm it); in bf16 it keeps the
acceptance at A after a rounding divergence from plain decoding.

The limit it is judged against
------------------------------
In every round, before its runs (so that both see the same machine load), one core call (`model.core` over a
`PagedLoopCache` `RowBatch` at context `prompt_len`) is timed for the row counts the strategies use: t(R) for
R = 1, B, 2B, ..., max(U/d, K+1)*B, and the causal prefill call t_pre over P*B rows (B = batch, P = prompt
length); the head over M rows likewise, h(M); each is the median over the rounds. During every lane run the
row count of each core call (from `plan_rows`) and each head call (a forward hook on the output embeddings) is
recorded. If nothing but these calls cost time, a run would take

    T_hat(mode) = sum_i t(R_i) + sum_j h(M_j)          (t, h interpolated piecewise-linearly between grid points)

For `ar` with N new tokens that is U prefill calls, (N-1)*U calls of B rows and N head calls of B rows:

    T_hat(ar) = U*t_pre + (N-1)*U*t(B) + N*h(B)

and the reported limit is

    ideal_speedup_vs_ar = T_hat(ar) / T_hat(mode)
    fraction_of_ideal   = speedup_vs_ar / ideal_speedup_vs_ar      (speedup_vs_ar = T(ar) / T(mode), measured)
    overhead_fraction   = 1 - T_hat(mode) / T(mode)               (time outside core and head calls: Python,
                                                                    cache bookkeeping, row planning)

In steady state (N large, prefill negligible, c = decode core calls per token of one sequence) this is the
per-token form: for the pipeline (every call runs ceil(U/d) lanes per sequence, one head call per d calls with
a target and a draft row per sequence)

    (U*t(B) + h(B)) / (c*t(ceil(U/d)*B) + (c/d)*h(2B)),      c = d + (U-d)(1-a)   (DESIGN 3)

and for block (a round = (K+1)d draft calls of B rows, K draft heads of B rows, U-d verify calls and one verify
head of (K+1)B rows; r = c / ((K+1)d + U - d) rounds per token)

    (U*t(B) + h(B)) / (r * [(K+1)d*t(B) + (U-d)*t((K+1)B) + K*h(B) + h((K+1)B)]).

On a GPU at small batch t(R) is nearly flat in R, so the pipeline's limit approaches U/c; on a CPU t(R) grows
with R and the limit is lower. The measured call costs are in the JSON (`call_costs`).

Memory (`peak_mem_bytes`): on CUDA `torch.cuda.max_memory_allocated` over the run (weights included); on CPU
the parameter bytes plus the KV cache's allocated bytes (the `PagedLoopCache` pool, which grows by doubling, or
the `DynamicCache` tensors) at the end of the run (`peak_mem_kind` says which).

Sampling (`--do-sample`)
------------------------
With `--do-sample` (and `--temperature`, default 1.0, `--top-p`, default 1.0, `--top-k`, default 0 = off) every
mode samples: `plain` through `model.generate(do_sample=True, temperature=..., top_p=..., top_k=...)`, the lane
modes through `decode_with_lanes(do_sample=True, logits_processor=...)` with the same warpers that generate
builds (`sampling_processors`: temperature, top-k, top-p, in generate's order). Drafts are judged by lossless
speculative sampling (accept with min(1, p/q), else draw from the residual), so `acceptance_rate` is that real
acceptance, not a greedy match. Every run is seeded with `torch.manual_seed(seed + round)` (warm-ups with
`seed`), so a bench repeats. The outputs are random draws: they are not compared token by token with plain
(`check: {"exact": null, "note": ...}`, `check_passed: null`; the exit status stays 0); that the speculative
modes sample the same distribution as plain is tested in `tests/test_speculative_sampling.py`. Sampled runs
differ from round to round, so the counters, calls/token and the ideal speed-up are the first timed round's (as
with greedy decoding) and `acceptance_rate_all` / `core_calls_per_token_all` list every round's. The untimed
first plain run is then only a warm-up. `--synthetic-acceptance` is refused with `--do-sample`: it replaces drafts
by *the known greedy token*, and sampling has no known token to replace them by.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import GenerationConfig, LogitsProcessorList, MaxLengthCriteria, StoppingCriteriaList
from transformers.cache_utils import DynamicCache
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from .cache.paged import PagedLoopCache
from .generation.config import compile_backend, speculative_config
from .models.huginn import HuginnConfig, HuginnForCausalLM
from .models.ouro import OuroConfig, OuroForCausalLM

MODES = ("plain", "ar", "block", "pipeline")  # the default set
PLAIN_MODES = ("plain", "static")  # transformers' own loop: DynamicCache, or cache_implementation="static"
LANE_MODES = ("ar", "block", "pipeline")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Random-weight shapes (`--model NAME`): (family, config fields). Prompt ids start at 3 (0..2 are special).
FAMILIES = {"ouro": (OuroConfig, OuroForCausalLM), "huginn": (HuginnConfig, HuginnForCausalLM)}
SHAPES = {
    "ouro-tiny": ("ouro", {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                           "num_attention_heads": 4, "total_ut_steps": 4}),
    "ouro-100m": ("ouro", {"vocab_size": 8192, "hidden_size": 768, "intermediate_size": 2048,
                           "num_hidden_layers": 12, "num_attention_heads": 12, "total_ut_steps": 4}),
    "ouro-1.4b": ("ouro", {"vocab_size": 49152, "hidden_size": 2048, "intermediate_size": 5632,
                           "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16,
                           "head_dim": 128, "total_ut_steps": 4}),
    "huginn-tiny": ("huginn", {"vocab_size": 256, "n_embd": 64, "n_heads": 4, "intermediate_size": 128,
                               "n_layers_in_prelude": 1, "n_layers_in_recurrent_block": 2, "n_layers_in_coda": 1,
                               "mean_recurrence": 8}),
    # Huginn-0125's stage layout (2 + 4 + 2 sandwich blocks, 32 steps) at a CPU-sized width, and the real shape.
    "huginn-small": ("huginn", {"vocab_size": 8192, "n_embd": 512, "n_heads": 8, "intermediate_size": 1536,
                                "n_layers_in_prelude": 2, "n_layers_in_recurrent_block": 4, "n_layers_in_coda": 2,
                                "mean_recurrence": 32}),
    "huginn-3.5b": ("huginn", {"vocab_size": 65536, "n_embd": 5280, "n_heads": 55, "intermediate_size": 17920,
                               "n_layers_in_prelude": 2, "n_layers_in_recurrent_block": 4, "n_layers_in_coda": 2,
                               "mean_recurrence": 32}),
}

# Prompt texts for models with a tokenizer (repeated and cut to --prompt-len tokens; row b starts further in):
# Python source for the embedded default model (trained on Python code), English prose for other checkpoints.
# Both are written for this benchmark, so no model has seen them verbatim.
PROMPT_TEXT = (
    "The river town woke slowly. Fishermen checked their nets by lantern light while the baker pulled the "
    "first loaves from the oven, and the smell of bread drifted over the water. A schoolteacher walked along "
    "the quay, counting the boats as she always did, and noticed that one was missing. She asked the harbour "
    "master, who looked at his ledger and frowned: the boat had left before dawn with two passengers and no "
    "cargo. Question: if twelve boats left at six and three of them came back by nine, how many were still "
    "out? Answer: nine boats were still out, because twelve minus three is nine. The teacher wrote the number "
    "on her slate, thanked him, and went on to the school, where the children were already arguing about "
    "whether a boat without cargo could still be called a trading boat. "
)
PROMPT_CODE = '''
class Ledger:
    """Keep a running balance of named accounts and a log of every transfer."""

    def __init__(self, accounts=None):
        self._balances = dict(accounts or {})
        self._log = []

    def balance(self, name):
        """Return the balance of account *name*, or 0 if it has never been used."""
        return self._balances.get(name, 0)

    def transfer(self, source, target, amount):
        if amount <= 0:
            raise ValueError(f"amount must be positive, not {amount!r}")
        if self.balance(source) < amount:
            raise ValueError(f"insufficient funds in {source!r}")
        self._balances[source] = self.balance(source) - amount
        self._balances[target] = self.balance(target) + amount
        self._log.append((source, target, amount))

    def history(self, name=None):
        """Return the transfers that touch account *name* (all of them when *name* is None)."""
        if name is None:
            return list(self._log)
        return [entry for entry in self._log if name in entry[:2]]


def parse_line(line):
    """Split a line of the form 'source -> target: amount' into its three parts."""
    left, _, amount = line.partition(":")
    source, _, target = left.partition("->")
    return source.strip(), target.strip(), int(amount)
'''


class ModelNotAvailable(ValueError):
    """The requested model cannot be loaded (missing embedded model, path or tokenizer)."""


# --- arguments ----------------------------------------------------------------------------------------------------
def _modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in (*MODES, "static")]
    if bad or not modes:
        raise argparse.ArgumentTypeError(f"unknown mode(s) {bad or text!r}; choose a comma-separated subset of "
                                         f"{','.join(MODES)},static")
    return list(dict.fromkeys(modes))


def checked(kind: type, ok, requirement: str):
    """An argparse `type` that parses `kind` (int or float) and refuses values for which `ok` is false."""
    noun = "an integer" if kind is int else "a number"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {noun}") from None
        if not ok(value):  # comparisons with nan are false, so nan is refused too
            raise argparse.ArgumentTypeError(f"{value} {requirement}")
        return value

    return parse


_fraction = checked(float, lambda v: 0.0 <= v <= 1.0, "is outside [0, 1]")
_positive = checked(int, lambda v: v >= 1, "must be >= 1")
_positive_float = checked(float, lambda v: v > 0, "must be > 0")
_non_negative = checked(int, lambda v: v >= 0, "must be >= 0")
_non_negative_float = checked(float, lambda v: v >= 0, "must be >= 0")


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
    parser.add_argument("--batch-size", type=_positive, default=1, help="sequences (default: %(default)s)")
    parser.add_argument("--prompt-len", type=_positive, default=64,
                        help="prompt tokens per sequence (default: %(default)s)")
    parser.add_argument("--new-tokens", type=_positive, default=64,
                        help="new tokens per sequence (default: %(default)s)")
    parser.add_argument("--prompt-file", default=None, metavar="PATH",
                        help="text to cut the prompts from (models with a tokenizer; default: a built-in text)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="(default: %(default)s)")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda if available)")
    parser.add_argument("--modes", type=_modes, default=list(MODES),
                        help=f"comma-separated subset of {','.join(MODES)},static (default: {','.join(MODES)}); "
                             "static: plain generate with cache_implementation='static' (compiled by transformers "
                             "on CUDA)")
    parser.add_argument("--draft-loops", type=_positive, default=1,
                        help="d: draft from the output of loop d (default: %(default)s)")
    parser.add_argument("--num-speculative-tokens", type=_positive, default=4,
                        help="K: drafts per block round (default: %(default)s)")
    parser.add_argument("--repeats", type=_positive, default=3,
                        help="timed rounds; the median is reported (default: %(default)s)")
    parser.add_argument("--synthetic-acceptance", type=_fraction, default=None, metavar="A",
                        action=_SyntheticAcceptance,
                        help="replace each draft by the known greedy token with probability A (random weights; "
                             "greedy decoding only)")
    parser.add_argument("--do-sample", action=_DoSample,
                        help="every mode samples (lossless speculative sampling; seeded with --seed + round); "
                             "outputs are then not compared with plain")
    parser.add_argument("--temperature", type=_positive_float, default=1.0,
                        help="sampling temperature, with --do-sample (default: %(default)s)")
    parser.add_argument("--top-p", type=_fraction, default=1.0,
                        help="nucleus sampling mass, with --do-sample; 1 = off (default: %(default)s)")
    parser.add_argument("--top-k", type=_non_negative, default=0,
                        help="keep the K most likely tokens, with --do-sample; 0 = off (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the random weights, prompts, synthetic drafts and sampled runs "
                             "(default: %(default)s)")
    parser.add_argument("--threads", type=_positive, default=None, help="torch.set_num_threads")
    parser.add_argument("--compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
                        help="run the lane modes' core and head calls compiled (generate's compile_core) with this "
                             "torch.compile backend (default when given: inductor); plain is transformers' loop")
    parser.add_argument("--calibration-seconds", type=float, default=3.0,
                        help="time budget of the core/head call-cost measurements (default: %(default)s)")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON")
    parser.add_argument("--plot", default=None, metavar="PATH", help="write a PNG bar chart (needs matplotlib)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-loopspec bench", description=__doc__.split("\n\n")[0])
    return add_arguments(parser)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


# --- models ---------------------------------------------------------------------------------------------------------
def resolve_device(name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name!r} is not a torch device (use cpu, cuda or cuda:N).") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name} was requested but CUDA is not available here; use --device cpu.")
    return device


def default_model_path() -> Path:
    """The embedded default model's folder, or `ModelNotAvailable` with what to do instead."""
    hint = ("pass --model PATH (a checkpoint folder or Hub id such as ByteDance/Ouro-1.4B) or, for benchmarks, a "
            f"random-weight shape ({', '.join(SHAPES)}).")
    try:
        from . import assets
    except ImportError as err:
        raise ModelNotAvailable(f"this install has no embedded default model ({err}); {hint}") from None
    try:
        return Path(assets.default_model_path())
    except OSError as err:
        raise ModelNotAvailable(f"{err} Alternatively, {hint}") from None


def random_model(shape: str, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """A model of a named shape (`SHAPES`) with seeded random weights, built directly on `device` in `dtype`.

    Matrices get std 1/sqrt(fan_in) and norm weights 1 + noise (so activations and logits are O(1) and greedy
    choices are well separated), unlike `post_init`'s tiny-std init that makes near-uniform logits; token
    embeddings are O(1) after the family's embedding scale.
    """
    family, fields = SHAPES[shape]
    config_class, model_class = FAMILIES[family]
    positions = {"ouro": {"max_position_embeddings": 65536}, "huginn": {"block_size": 65536}}[family]
    config = config_class(**fields, **positions, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    with torch.device("meta"):
        model = model_class(config)
    model = model.to(dtype).to_empty(device=device)
    model.tie_weights()
    gen = torch.Generator(device=device).manual_seed(seed)
    embed_scale = getattr(config, "embed_scale", 1.0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("embed_tokens.weight", "wte.weight")):
                param.normal_(0.0, 1.0 / embed_scale, generator=gen)
            elif "norm" in name:
                param.normal_(1.0, 0.1, generator=gen)
            elif "early_exit_gate" in name:
                param.zero_()
            else:
                param.normal_(0.0, param.shape[-1] ** -0.5, generator=gen)
    model.eval()
    model.generation_config.pad_token_id = 0
    return model


def load_model(spec: str, dtype: torch.dtype | str, device: torch.device, *, need_tokenizer: bool = False,
               seed: int = 0):
    """`(model, tokenizer or None, description)` for a shape name, 'default', or a checkpoint path / Hub id."""
    if spec in SHAPES:
        if need_tokenizer:
            raise ModelNotAvailable(f"--model {spec} is a random-weight shape for benchmarks and has no tokenizer; "
                                    "pass a checkpoint path or Hub id (or 'default').")
        dtype = torch.float32 if dtype == "auto" else dtype
        return random_model(spec, dtype, device, seed), None, f"{spec} (random weights, seed {seed})"
    path = default_model_path() if spec == "default" else spec
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hf_loopspec  # noqa: F401  (registers the Auto classes)

    if dtype == "auto":
        dtype = torch.float32 if device.type == "cpu" else "auto"
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(device).eval()
    if not hasattr(model, "decode_with_lanes"):
        raise ModelNotAvailable(f"{path} loads as {type(model).__name__}, which is not an hf_loopspec looped model.")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as err:
        if need_tokenizer:
            raise ModelNotAvailable(f"no tokenizer could be loaded from {path} ({err}).") from None
        tokenizer = None
    name = "embedded default model" if spec == "default" else str(path)
    return model, tokenizer, name


def make_prompts(tokenizer, vocab: int, batch: int, length: int, seed: int, text: str = PROMPT_TEXT) -> torch.Tensor:
    """`[batch, length]` prompt ids: slices of `text` with a tokenizer, else seeded random ids in [3, vocab)."""
    if tokenizer is None:
        gen = torch.Generator().manual_seed(seed)
        return torch.randint(3, vocab, (batch, length), generator=gen)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if not ids:
        raise ValueError("the prompt text tokenizes to no tokens; pass a longer --prompt-file.")
    stride = 7
    need = length + stride * batch
    ids = (ids * (need // len(ids) + 1))[:need]
    return torch.tensor([ids[b * stride : b * stride + length] for b in range(batch)])


# --- one run --------------------------------------------------------------------------------------------------------
class _RecordingCache(PagedLoopCache):
    """A `PagedLoopCache` that records the row count of every core call (one `plan_rows` per call; the calls of
    entry and exit stages with KV, which write other planes, are not core calls)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.call_rows: list[int] = []

    def plan_rows(self, seq, depth, position, like, lineage=None):
        rows = super().plan_rows(seq, depth, position, like, lineage=lineage)
        if int(rows.depth.max()) < self.kv_layout.depth_planes:  # not an entry or exit stage's call
            self.call_rows.append(rows.num_rows)
        return rows

    def allocated_bytes(self) -> int:
        return 0 if self.k_pool is None else 2 * self.k_pool.numel() * self.k_pool.element_size()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _dynamic_cache_bytes(cache) -> int:
    total = 0
    for layer in getattr(cache, "layers", []):
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if torch.is_tensor(t):
                total += t.numel() * t.element_size()
    return total


def synthetic_hook(reference: torch.Tensor, prompt_len: int, acceptance: float, vocab: int, seed: int):
    """`draft_hook` that proposes `reference[seq, position - prompt_len]` with probability `acceptance`, else a
    different (wrong) token; seeded, so every run of a mode sees the same pattern."""
    rng = random.Random(seed)
    ref = reference.tolist()

    def hook(seq: int, position: int, proposed: int) -> int:
        right = ref[seq][position - prompt_len]
        if rng.random() < acceptance:
            return right
        wrong = rng.randrange(vocab - 1)
        return wrong + (wrong >= right)

    return hook


def sampling_settings(args) -> dict | None:
    """`{"temperature", "top_p", "top_k"}` of a `--do-sample` bench, else `None` (greedy)."""
    if not args.do_sample:
        return None
    return {"temperature": float(args.temperature), "top_p": float(args.top_p), "top_k": int(args.top_k)}


def sampling_processors(sampling: dict | None) -> LogitsProcessorList | None:
    """The warpers `generate(do_sample=True, **sampling)` builds, in its order (temperature, top-k, top-p; each
    only where it changes something), for the lane modes' `logits_processor`. `None` for greedy."""
    if sampling is None:
        return None
    processors = LogitsProcessorList()
    if sampling["temperature"] != 1.0:
        processors.append(TemperatureLogitsWarper(sampling["temperature"]))
    if sampling["top_k"] != 0:
        processors.append(TopKLogitsWarper(top_k=sampling["top_k"], min_tokens_to_keep=1))
    if sampling["top_p"] < 1.0:
        processors.append(TopPLogitsWarper(top_p=sampling["top_p"], min_tokens_to_keep=1))
    return processors


def run_mode(model, mode: str, ids: torch.Tensor, new_tokens: int, *, draft_loops: int, k: int, draft_hook=None,
             output_logits: bool = False, sampling: dict | None = None, seed: int | None = None,
             compile_core: str | None = None) -> dict:
    """Run one mode once; returns seconds, generated ids `[B, N]`, stats and the recorded call shapes.

    `sampling` (from `sampling_settings`): sample with these settings instead of greedy decoding; `seed`: call
    `torch.manual_seed(seed)` first (untimed); `compile_core`: a torch.compile backend for the lane modes.
    """
    device = ids.device
    if seed is not None:
        torch.manual_seed(seed)
    prompt_width = ids.shape[1]
    result = {"mode": mode}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    if mode in PLAIN_MODES:
        cache_kwargs = {"plain": {"cache": DynamicCache()}, "static": {"cache_implementation": "static"}}[mode]
        _synchronize(device)
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             do_sample=sampling is not None, **(sampling or {}), speculative_mode=None,
                             pad_token_id=0, **cache_kwargs, return_dict_in_generate=True,
                             output_logits=output_logits)
        _synchronize(device)
        result["seconds"] = time.perf_counter() - start
        result["stats"] = None
        result["kv_bytes"] = _dynamic_cache_bytes(out.cache)
        result["logits"] = out.logits if output_logits else None
    else:
        cache = _RecordingCache(model.kv_layout)
        processors = sampling_processors(sampling)
        head_rows: list[int] = []
        handle = model.get_output_embeddings().register_forward_hook(
            lambda module, args, output: head_rows.append(args[0].shape[:-1].numel()))
        try:
            _synchronize(device)
            start = time.perf_counter()
            out = model.decode_with_lanes(
                ids, mode, draft_loops=draft_loops, num_speculative_tokens=k, cache=cache, attention_mask=None,
                logits_processor=processors, stopping_criteria=StoppingCriteriaList([MaxLengthCriteria(
                    prompt_width + new_tokens)]), pad_token_id=0, max_length=prompt_width + new_tokens,
                draft_hook=draft_hook, do_sample=sampling is not None, compile_core=compile_core or False)
            _synchronize(device)
            result["seconds"] = time.perf_counter() - start
        finally:
            handle.remove()
        result["stats"] = out.stats
        result["core_rows"] = cache.call_rows
        result["head_rows"] = head_rows
        result["kv_bytes"] = cache.allocated_bytes()
    result["generated"] = out.sequences[:, prompt_width:].cpu()
    if device.type == "cuda":
        result["peak_mem_bytes"] = torch.cuda.max_memory_allocated(device)
    else:
        result["peak_mem_bytes"] = _param_bytes(model) + result["kv_bytes"]
    return result


def compare(generated: torch.Tensor, reference: torch.Tensor, reference_logits=None) -> dict:
    """Agreement of `generated` `[B, N]` with `reference` `[B, N]`: exact, common-prefix fraction, first divergence."""
    batch, n = reference.shape
    if generated.shape != reference.shape:
        return {"exact": False, "agreement_rate": 0.0, "first_divergence": None,
                "error": f"shape {tuple(generated.shape)} != reference {tuple(reference.shape)}"}
    differs = generated != reference
    prefixes = [int(differs[b].int().argmax()) if differs[b].any() else n for b in range(batch)]
    check = {"exact": not bool(differs.any()), "agreement_rate": sum(prefixes) / (batch * n),
             "first_divergence": None}
    if not check["exact"]:
        seq = min(range(batch), key=lambda b: prefixes[b])
        index = prefixes[seq]
        check["first_divergence"] = {"seq": seq, "token_index": index, "reference_token": int(reference[seq, index]),
                                     "token": int(generated[seq, index])}
        if reference_logits is not None:
            top2 = reference_logits[index][seq].float().topk(2).values
            check["first_divergence"]["reference_top1_top2_margin"] = float(top2[0] - top2[1])
    return check


# --- call costs -----------------------------------------------------------------------------------------------------
def _time_calls(prepare, call, cleanup, device, budget_s: float, min_reps: int = 3, max_reps: int = 200) -> float:
    """Median seconds of `call(prepare())` (prepare/cleanup untimed), after one warm-up call."""
    for _ in range(1):
        state = prepare()
        call(state)
        cleanup(state)
    times: list[float] = []
    begin = time.perf_counter()
    while len(times) < min_reps or (len(times) < max_reps and time.perf_counter() - begin < budget_s):
        state = prepare()
        _synchronize(device)
        start = time.perf_counter()
        call(state)
        _synchronize(device)
        times.append(time.perf_counter() - start)
        cleanup(state)
    return statistics.median(times)


def measure_call_costs(model, batch: int, prompt_len: int, core_rows: list[int], head_rows: list[int],
                       device: torch.device, dtype: torch.dtype, budget_s: float, seed: int = 0) -> dict:
    """Seconds of one core call per row count (context `prompt_len`), of the causal prefill call over
    `batch * prompt_len` rows, and of one head call per row count. See the module docstring."""
    loops = model.num_loops
    hidden_size = model.get_input_embeddings().weight.shape[-1]
    gen = torch.Generator(device=device).manual_seed(seed)
    points = len(core_rows) + len(head_rows) + 1
    per_point = budget_s / points
    cache = PagedLoopCache(model.kv_layout)
    cache.ensure_sequences(batch)
    like = torch.empty(1, dtype=dtype, device=device)

    def random_hidden(n: int) -> torch.Tensor:
        return torch.randn(n, hidden_size, generator=gen, device=device, dtype=torch.float32).to(dtype)

    # The causal prefill: every sequence's positions 0..P-1 at depth 0, on an empty table.
    seqs = [s for s in range(batch) for _ in range(prompt_len)]
    positions = [p for _ in range(batch) for p in range(prompt_len)]
    prefill_hidden = random_hidden(len(seqs))
    prefill_positions = torch.tensor(positions, device=device)

    def prepare_prefill():
        return cache.plan_rows(seqs, [0] * len(seqs), positions, like=like)

    def cleanup_prefill(_rows):
        for s in range(batch):
            cache.truncate(s, 0, 0)

    with torch.inference_mode():
        prefill = _time_calls(prepare_prefill, lambda rows: model.core(prefill_hidden, prefill_positions,
                                                                        cache.attention(rows)),
                              cleanup_prefill, device, per_point)
        # Fill every (sequence, depth) plane to prompt_len (the values do not change the cost).
        for depth in range(loops):
            cache.plan_rows(seqs, [depth] * len(seqs), positions, like=like)

        core = {}
        for r in core_rows:
            # Row i: sequence i % B; its j-th row (j = i // B) at depth j % U, position P + j // U, so every
            # (sequence, depth) table is extended contiguously from prompt_len.
            row_seq = [i % batch for i in range(r)]
            row_j = [i // batch for i in range(r)]
            row_depth = [j % loops for j in row_j]
            row_pos = [prompt_len + j // loops for j in row_j]
            hidden = random_hidden(r)
            pos = torch.tensor(row_pos, device=device)
            touched = sorted(set(zip(row_seq, row_depth)))

            def prepare(row_seq=row_seq, row_depth=row_depth, row_pos=row_pos):
                return cache.plan_rows(row_seq, row_depth, row_pos, like=like)

            def cleanup(_rows, touched=touched):
                for s, d in touched:
                    cache.truncate(s, d, prompt_len)

            core[r] = _time_calls(prepare, lambda rows, hidden=hidden, pos=pos: model.core(hidden, pos,
                                                                                          cache.attention(rows)),
                                  cleanup, device, per_point)
        head = {}
        for m in head_rows:
            hidden = random_hidden(m)
            head[m] = _time_calls(lambda: None, lambda _s, hidden=hidden: model.head(hidden).float(), lambda _s: None,
                                  device, per_point)
    return {"core": core, "prefill": prefill, "prefill_rows": batch * prompt_len, "head": head,
            "context": prompt_len}


def median_costs(rounds: list[dict]) -> dict:
    """Per-point median of several `measure_call_costs` results."""
    first = rounds[0]
    return {**first,
            "core": {r: statistics.median(c["core"][r] for c in rounds) for r in first["core"]},
            "head": {m: statistics.median(c["head"][m] for c in rounds) for m in first["head"]},
            "prefill": statistics.median(c["prefill"] for c in rounds)}


def interpolate(table: dict[int, float], x: float) -> float:
    """Piecewise-linear through the points of `table`; linear extrapolation past either end."""
    xs = sorted(table)
    if len(xs) == 1:
        return table[xs[0]] * x / xs[0]
    if x <= xs[0]:
        lo, hi = xs[0], xs[1]
    elif x >= xs[-1]:
        lo, hi = xs[-2], xs[-1]
    else:
        hi = next(v for v in xs if v >= x)
        lo = xs[xs.index(hi) - 1]
    slope = (table[hi] - table[lo]) / (hi - lo)
    return max(table[lo] + slope * (x - lo), 0.0)


def predicted_seconds(costs: dict, core_rows: list[int], head_rows: list[int]) -> float:
    """T_hat: the run's time if only its core and head calls cost time (module docstring)."""
    core_table = dict(costs["core"])
    core_table.setdefault(costs["prefill_rows"], costs["prefill"])
    return sum(interpolate(core_table, r) for r in core_rows) + sum(interpolate(costs["head"], m) for m in head_rows)


def ar_call_shapes(loops: int, batch: int, prompt_len: int, new_tokens: int) -> tuple[list[int], list[int]]:
    """Core and head row counts of an `ar` run: U prefill calls, (N-1)U calls of B rows, N heads of B rows."""
    return [batch * prompt_len] * loops + [batch] * ((new_tokens - 1) * loops), [batch] * new_tokens


# --- the benchmark --------------------------------------------------------------------------------------------------
SAMPLING_CHECK_NOTE = ("sampling: not comparable: outputs are random draws, so plain is no token-by-token reference; "
                       "speculative sampling is lossless (accept with min(1, p/q), residual on rejection), tested "
                       "distributionally in tests/test_speculative_sampling.py")


def _with_defaults(args) -> argparse.Namespace:
    merged = vars(parse_args([])).copy()
    merged.update({k: v for k, v in vars(args).items()})
    if isinstance(merged["modes"], str):
        merged["modes"] = _modes(merged["modes"])
    return argparse.Namespace(**merged)


def check_sampling_args(args) -> None:
    """`ValueError` for sampling options that cannot mean what they say (see the module docstring)."""
    if args.do_sample and args.synthetic_acceptance is not None:
        raise ValueError(SYNTHETIC_WITH_SAMPLING)
    if not args.do_sample:
        unused = [f"--{name.replace('_', '-')} {getattr(args, name)}" for name, off in
                  (("temperature", 1.0), ("top_p", 1.0), ("top_k", 0)) if getattr(args, name) != off]
        if unused:
            raise ValueError(f"{', '.join(unused)} only apply with --do-sample (greedy decoding ignores them); "
                             "add --do-sample or drop them.")


def _validate(args, loops: int) -> None:
    for mode in ("block", "pipeline"):
        if mode in args.modes:
            cfg = GenerationConfig(do_sample=False)
            cfg.speculative_mode, cfg.draft_loops, cfg.num_speculative_tokens = (
                mode, args.draft_loops, args.num_speculative_tokens)
            speculative_config(cfg, loops)  # raises ValueError with the same message generate() would


def machine_info(device: torch.device) -> dict:
    import transformers

    from . import __version__

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    info = {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "cpus_available": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_avg_1m_start": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "hf_loopspec": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu,
    }
    return info


def _log(args, message: str) -> None:
    if not args.quiet:
        print(message, file=sys.stderr, flush=True)


def run_bench(args) -> dict:
    """Run the benchmark described in the module docstring; returns the result dict (also written by `--json`).

    `args` is an `argparse.Namespace` from `parse_args` (missing attributes take their defaults).
    """
    args = _with_defaults(args)
    compile_backend(args.compile)  # a ValueError for an unknown backend, before the model loads
    device = resolve_device(args.device)
    model, tokenizer, model_name = load_model(args.model, DTYPES[args.dtype], device, seed=args.seed)
    with _fixed_recurrence(model):
        return _run_bench(args, device, model, tokenizer, model_name)


def _fixed_recurrence(model):
    """Huginn-family models: every mode runs `mean_recurrence` steps from zero initial states (init_scale 0), so
    that plain decoding is a deterministic reference."""
    recurrence = getattr(model, "recurrence", None)
    return recurrence(init_scale=0.0) if recurrence is not None else contextlib.nullcontext()


def _run_bench(args, device, model, tokenizer, model_name) -> dict:
    check_sampling_args(args)
    sampling = sampling_settings(args)
    if args.plot:
        _pyplot()  # fail before the runs, not after them
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.new_tokens < 2 and any(m in args.modes for m in ("block", "pipeline")):
        raise ValueError("--new-tokens must be >= 2 for the speculative modes (nothing to draft otherwise).")
    dtype = DTYPES[args.dtype]
    # A clean greedy config: no EOS (every run commits exactly new_tokens per sequence) and none of a checkpoint's
    # generation defaults (e.g. a repetition penalty) that plain generate() would apply and the lane runs would not.
    model.generation_config = GenerationConfig(pad_token_id=0, eos_token_id=None, do_sample=False)
    loops = model.num_loops
    _validate(args, loops)
    vocab = model.get_output_embeddings().weight.shape[0]
    batch, prompt_len, n = args.batch_size, args.prompt_len, args.new_tokens
    d, k = args.draft_loops, args.num_speculative_tokens
    text = PROMPT_CODE if args.model == "default" else PROMPT_TEXT
    if args.prompt_file:
        text = Path(args.prompt_file).read_text()
    ids = make_prompts(tokenizer, vocab, batch, prompt_len, args.seed, text).to(device)
    exact_dtype = dtype == torch.float32
    kw = {"draft_loops": d, "k": k, "sampling": sampling, "compile_core": args.compile}
    info = machine_info(device)

    with torch.inference_mode():
        if sampling is None:
            _log(args, f"[bench] {model_name} on {device} {args.dtype}: plain reference run")
        else:
            _log(args, f"[bench] {model_name} on {device} {args.dtype}: SAMPLING {sampling}; plain warm-up run")
        reference_run = run_mode(model, "plain", ids, n, output_logits=not exact_dtype and sampling is None,
                                 seed=None if sampling is None else args.seed, **kw)
        reference = reference_run["generated"]
        reference_logits = reference_run["logits"]

        core_grid = sorted({1, *(batch * r for r in range(1, max(math.ceil(loops / d), k + 1) + 1))})
        head_grid = sorted({1, *(batch * r for r in range(1, max(2, k + 1) + 1))})

        hooks_ref: dict[str, torch.Tensor] = {}
        warmup_seconds: dict[str, float] = {}
        for mode in args.modes:  # warm-up (and, with synthetic acceptance, each mode's own greedy continuation)
            if mode == "plain":
                continue
            _log(args, f"[bench] warm-up {mode}")
            hook = None
            if args.synthetic_acceptance is not None and mode != "ar":
                hook = synthetic_hook(reference, prompt_len, args.synthetic_acceptance, vocab, args.seed)
            warmup = run_mode(model, mode, ids, n, draft_hook=hook, seed=None if sampling is None else args.seed, **kw)
            hooks_ref[mode], warmup_seconds[mode] = warmup["generated"], warmup["seconds"]

        # Each round times the call costs too, so that they see the same machine load as the runs (a shared
        # machine drifts); the cost of a call is its median over the rounds.
        runs: dict[str, list[dict]] = {mode: [] for mode in args.modes}
        cost_rounds = []
        layout = model.kv_layout
        calibrate = layout.entry_plane is None and layout.first_exit_plane is None
        for r in range(args.repeats):
            _log(args, f"[bench] round {r + 1}/{args.repeats}: "
                       + (f"call costs over {core_grid} rows and the {batch * prompt_len}-row prefill, then "
                          if calibrate else "") + " ".join(args.modes))
            if calibrate:
                cost_rounds.append(measure_call_costs(model, batch, prompt_len, core_grid, head_grid, device,
                                                      dtype, args.calibration_seconds / args.repeats,
                                                      seed=args.seed + r))
            for mode in args.modes:
                hook = None
                if args.synthetic_acceptance is not None and mode in ("block", "pipeline"):
                    hook = synthetic_hook(hooks_ref[mode], prompt_len, args.synthetic_acceptance, vocab, args.seed)
                runs[mode].append(run_mode(model, mode, ids, n, draft_hook=hook,
                                           seed=None if sampling is None else args.seed + r, **kw))

    costs = median_costs(cost_rounds) if cost_rounds else None
    ar_core, ar_head = ar_call_shapes(loops, batch, prompt_len, n)
    if "ar" in runs:
        ar_core, ar_head = runs["ar"][0]["core_rows"], runs["ar"][0]["head_rows"]
    ar_predicted = predicted_seconds(costs, ar_core, ar_head) if costs else None
    seconds = {mode: statistics.median(x["seconds"] for x in rs) for mode, rs in runs.items()}
    tokens = batch * n
    rows = []
    for mode, rs in runs.items():
        first = rs[0]
        if sampling is None:
            checks = [compare(x["generated"], reference, reference_logits) for x in rs]
            check = "reference" if mode == "plain" else min(checks, key=lambda c: c["agreement_rate"])
        else:
            check = {"exact": None, "note": SAMPLING_CHECK_NOTE}
        row = {
            "mode": mode,
            "tokens": tokens,
            "seconds": seconds[mode],
            "seconds_all": [x["seconds"] for x in rs],
            "tokens_per_s": tokens / seconds[mode],
            "ratio_vs_plain": seconds["plain"] / seconds[mode] if "plain" in seconds else None,
            "speedup_vs_ar": seconds["ar"] / seconds[mode] if "ar" in seconds else None,
            "core_calls": None,
            "core_calls_per_token": float(loops) if mode in PLAIN_MODES else None,
            "acceptance_rate": None,
            "drafted": None, "verified": None, "accepted": None, "rejected": None, "discarded": None,
            "acceptance_rate_all": None, "core_calls_per_token_all": None,
            "ideal_speedup_vs_ar": None,
            "fraction_of_ideal": None,
            "predicted_seconds": None,
            "overhead_fraction": None,
            "warmup_seconds": warmup_seconds.get(mode),
            "compile_seconds": warmup_seconds[mode] - seconds[mode]
            if (args.compile and mode in LANE_MODES) or mode == "static" else None,
            "peak_mem_bytes": max(x["peak_mem_bytes"] for x in rs),
            "kv_cache_bytes": max(x["kv_bytes"] for x in rs),
            "check": check,
            "check_passed": None,
        }
        if mode not in PLAIN_MODES:
            stats = first["stats"]
            predicted = predicted_seconds(costs, first["core_rows"], first["head_rows"]) if costs else None
            row.update(
                core_calls=stats.core_calls,
                core_calls_per_token=stats.core_calls * batch / stats.committed_tokens,
                acceptance_rate=stats.acceptance_rate if stats.drafted else None,
                drafted=stats.drafted, verified=stats.verified, accepted=stats.accepted, rejected=stats.rejected,
                discarded=stats.discarded,
                acceptance_rate_all=[x["stats"].acceptance_rate if x["stats"].drafted else None for x in rs],
                core_calls_per_token_all=[x["stats"].core_calls * batch / x["stats"].committed_tokens for x in rs],
                ideal_speedup_vs_ar=ar_predicted / predicted if costs else None,
                predicted_seconds=predicted,
                overhead_fraction=1.0 - predicted / seconds[mode] if costs else None,
            )
            if row["speedup_vs_ar"] is not None and costs:
                row["fraction_of_ideal"] = row["speedup_vs_ar"] / row["ideal_speedup_vs_ar"]
        if mode != "plain":
            row["check_passed"] = all(c["exact"] for c in checks) if exact_dtype and sampling is None else None
        rows.append(row)

    info["load_avg_1m_end"] = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    params = sum(p.numel() for p in model.parameters())
    result = {
        "rows": rows,
        "machine": info,
        "args": {k_: v for k_, v in vars(args).items()},
        "model": {"name": model_name, "parameters": params, "num_loops": loops,
                  "config": {k_: getattr(model.config, k_, None) for k_ in (
                      "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                      "num_attention_heads", "num_key_value_heads", "head_dim", "total_ut_steps",
                      "n_layers_in_prelude", "n_layers_in_recurrent_block", "n_layers_in_coda",
                      "mean_recurrence")},
                  "initial_states": "zeros (init_scale 0)" if hasattr(model, "recurrence") else None},
        "synthetic_acceptance": args.synthetic_acceptance,
        "sampling": None if sampling is None else {
            **sampling, "warpers": [type(w).__name__ for w in sampling_processors(sampling)],
            "seed": args.seed, "seeding": "torch.manual_seed(seed + round) before each timed run of a round, "
                                          "torch.manual_seed(seed) before each warm-up run"},
        "call_costs": None if costs is None else {
            "context": costs["context"], "core_seconds_by_rows": costs["core"], "prefill_rows": costs["prefill_rows"],
            "prefill_seconds": costs["prefill"], "head_seconds_by_rows": costs["head"],
            "ar_predicted_seconds": ar_predicted},
        "notes": {
            "timing": "median wall time of --repeats interleaved rounds after one warm-up per mode; prefill "
                      "included; EOS ignored so every run commits batch * new_tokens tokens",
            "core_calls_per_token": "core calls of the run (prefill included) per committed token of one "
                                    "sequence: core_calls * batch / committed tokens; plain: U by construction",
            "ideal_speedup_vs_ar": "T_hat(ar) / T_hat(mode), T_hat = sum of the measured costs of the run's core "
                                   "and head calls by row count (see hf_loopspec.bench docstring)",
            "overhead_fraction": "1 - T_hat(mode) / measured time: the share of time outside core and head calls",
            "compile_seconds": "with --compile: the mode's warm-up run (which compiles every bucket it meets) minus "
                               "its median timed run; buckets met only in timed runs would compile there",
            "peak_mem_kind": "cuda_max_memory_allocated" if device.type == "cuda"
                             else "params_plus_kv_cache_allocated_bytes (CPU: torch allocations are not traced)",
            "check": SAMPLING_CHECK_NOTE if sampling is not None else
                     "fp32: every output of every run equals plain greedy (check_passed); other dtypes: "
                     "agreement_rate = mean common-prefix fraction with plain greedy (worst run)",
            "rounds": "counters, core_calls_per_token and ideal_speedup_vs_ar are the first timed round's; "
                      "acceptance_rate_all / core_calls_per_token_all list every round's (they differ only when "
                      "sampling)",
        },
        "all_checks_passed": all(r["check_passed"] is not False for r in rows),
    }
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))
    if args.plot:
        plot(result, args.plot)
    return result


# --- output ---------------------------------------------------------------------------------------------------------
def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.0f}MiB"


def _num(x, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def sampling_title(sampling: dict) -> str:
    """`SAMPLING (temperature T, top_p P, top_k K)` for the table header and the plot title."""
    return f"SAMPLING (temperature {sampling['temperature']}, top_p {sampling['top_p']}, top_k {sampling['top_k']})"


def format_table(result: dict) -> str:
    """The human-readable table: header with the run's settings, the call costs, one line per mode."""
    a, m = result["args"], result["machine"]
    lines = [(
        f"hf-loopspec bench | {result['model']['name']} ({result['model']['parameters'] / 1e6:.1f}M params) | "
        f"{m['device_name']} {a['dtype']} | threads {m['torch_threads']} | batch {a['batch_size']} | "
        f"prompt {a['prompt_len']} | new {a['new_tokens']} | d={a['draft_loops']} K={a['num_speculative_tokens']} "
        f"| repeats {a['repeats']} | load avg {_num(m.get('load_avg_1m_start'))}->{_num(m.get('load_avg_1m_end'))}"
    )]
    if result.get("sampling") is not None:
        off = [name for name, value, no_op in (("top_p", result["sampling"]["top_p"], 1.0),
                                                ("top_k", result["sampling"]["top_k"], 0)) if value == no_op]
        lines.append(f"*** {sampling_title(result['sampling'])}{' (' + ', '.join(off) + ' off)' if off else ''}: "
                     "every mode samples, seeded with --seed + round; acceptance is the real min(1, p/q); outputs "
                     "are not comparable with plain token by token ***")
    compile_s = ", ".join(f"{r['mode']} {r['compile_seconds']:.1f}s" for r in result["rows"]
                          if r.get("compile_seconds") is not None)
    if compile_s:
        lanes = f"lane modes compiled (compile_core, backend {a['compile']}); " if a.get("compile") else ""
        lines.append(f"{lanes}warm-up minus timed run (compile time where compiled): {compile_s}")
    if result["synthetic_acceptance"] is not None:
        lines.append(f"*** SYNTHETIC ACCEPTANCE {result['synthetic_acceptance']}: each draft is replaced by the known "
                     "greedy token with this probability, else by a wrong one; verification is real ***")
    c = result["call_costs"]
    if c is None:
        lines.append("no call-cost model (ideal, %ideal, overhd): the model's entry/exit stages have KV of their own")
    else:
        core = " ".join(f"t({r})={_ms(s)}" for r, s in sorted(c["core_seconds_by_rows"].items()))
        head = " ".join(f"h({r})={_ms(s)}" for r, s in sorted(c["head_seconds_by_rows"].items()))
        lines.append(f"core call ms by rows (context {c['context']}): {core} | prefill t({c['prefill_rows']})="
                     f"{_ms(c['prefill_seconds'])} | head ms: {head}")
    header = (f"{'mode':<9}{'tok/s':>9}{'x plain':>9}{'x ar':>7}{'ideal':>7}{'%ideal':>8}{'overhd':>8}"
              f"{'calls/tok':>10}{'accept':>8}{'peak mem':>10}  check")
    lines += [header, "-" * len(header)]
    for r in result["rows"]:
        if r["check"] == "reference":
            check = "reference"
        elif r["check"].get("exact", False) is None:
            check = "sampling: not comparable"
        elif r["check_passed"] is not None:
            check = "equal" if r["check_passed"] else f"MISMATCH {r['check'].get('first_divergence')}"
        else:
            check = f"agree {r['check']['agreement_rate']:.3f}"
        lines.append(
            f"{r['mode']:<9}{r['tokens_per_s']:>9.1f}{_num(r['ratio_vs_plain']):>9}{_num(r['speedup_vs_ar']):>7}"
            f"{_num(r['ideal_speedup_vs_ar']):>7}{_num(r['fraction_of_ideal'], '{:.0%}'):>8}"
            f"{_num(r['overhead_fraction'], '{:.0%}'):>8}{_num(r['core_calls_per_token']):>10}"
            f"{_num(r['acceptance_rate'], '{:.3f}'):>8}{_mib(r['peak_mem_bytes']):>10}  {check}"
        )
    lines.append("x ar: measured speed-up over ar; ideal: the speed-up the run's core/head call counts and measured "
                 "call costs imply; overhd: share of the time outside core/head calls.")
    return "\n".join(lines)


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'hf-loopspec[bench]' (or pip install matplotlib)."
                         ) from None
    return plt


def plot(result: dict, path: str) -> None:
    """PNG bar chart: tokens/s and core calls per token by mode."""
    plt = _pyplot()
    rows = result["rows"]
    modes = [r["mode"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    left.bar(modes, [r["tokens_per_s"] for r in rows], color="tab:blue")
    left.set_ylabel("tokens / s")
    right.bar(modes, [r["core_calls_per_token"] or 0 for r in rows], color="tab:orange")
    right.set_ylabel("core calls / token")
    a = result["args"]
    title = f"{result['model']['name']} | {a['dtype']} | batch {a['batch_size']} | {a['new_tokens']} new tokens"
    if result["synthetic_acceptance"] is not None:
        title += f" | SYNTHETIC ACCEPTANCE {result['synthetic_acceptance']}"
    if result.get("sampling") is not None:
        title += f" | {sampling_title(result['sampling'])}"
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


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
    """`python -m hf_loopspec.bench ...`: the same as `hf-loopspec bench ...`."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return main_from_args(args)
    except (ValueError, OSError) as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")


if __name__ == "__main__":
    sys.exit(main())
