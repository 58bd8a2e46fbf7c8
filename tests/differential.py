"""Randomized differential comparison of speculative `generate` with plain greedy decoding (fp32, tiny models).

A case (`draw_case`) is one seeded draw from the space of settings speculative `generate` accepts: the family
(tiny Ouro, tiny Huginn), its loops U (Huginn: `num_steps`) and damping, the mode (pipeline / block), draft_loops d,
num_speculative_tokens K, second_draft_loops d2, speculative_engine, batch size and prompt lengths (left padding),
max_new_tokens, EOS lists (random ids, and tokens plain decoding emits, so that stops and EOS holds happen), logits
processors (`PROCESSORS`: no_repeat_ngram_size, min_new_tokens, min_length, repetition_penalty, bad_words_ids,
suppress_tokens, begin_suppress_tokens, forced_eos_token_id, exponential_decay_length_penalty, and a user's
processor, with which `generate` decodes plainly), Ouro's exit options (`EXITS`), int32 `input_ids`, use_cache=False,
output_scores, `speculative_mode="auto"` (with a
cost table under which it speculates, or one under which it decodes plainly, and short segments, so that it switches
within a call), and continuing a cache that a first call (in any mode, plain included; a plain call's own
`DynamicCache` too) filled. The
wavefront engine's documented refusal (`REFUSED`) of a setting it does not run is a legal outcome, and so is the
refusal of use_cache=False continuing a cache (`CACHE_REFUSED`). `run_case` decodes it
speculatively and plainly (transformers' loop on a `DynamicCache`, the same settings) and returns None when the
tokens are identical, else a `Mismatch` with plain's logit margin at the first divergent token.

Margins separate bugs from rounding. Two fp32 evaluations of the same logits that differ only in the order of their
operations (batched vs alone, paged vs dynamic cache) agree to `tolerances.fp32_tolerance(depth)`'s atol each way (the
derivation is in `tolerances`), so they can pick different argmaxes only where plain's top-1 / top-2 margin of the
processed scores is below twice that atol: for tiny Ouro with 4 loops, 9 layers of width 64 give rtol 2 * 9 * 64 *
1.2e-7 = 1.4e-4, and logits of RMS about 3 a bound of about 8e-4; Huginn at 6 steps about 3e-3. A divergence with a
larger margin is a bug (`Mismatch.near_tie` is False); one below it is a near-tie that fp32 rounding can flip.

`tests/test_differential.py` runs a fixed number of seeded cases in the suite; `scripts/differential_soak.py` runs
many more for developers.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass, field

import torch
from huginn_utils import tiny_huginn
from inputs import extend, left_pad, random_prompts
from speculative_utils import generate_dict, paged_cache, plain, tiny_spec_model
from tolerances import fp32_tolerance, huginn_depth, ouro_depth, rms
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.cache_utils import DynamicCache

from hf_loopspec.generation.auto_costs import Candidate, CostTable, set_costs
from hf_loopspec.generation.auto_policy import AutoPolicy, forget, set_policy

VOCAB = 64  # the Ouro models' vocabulary (Huginn's tiny config has its own, `huginn_utils.VOCAB`)
REFUSED = "speculative decoding (the wavefront engine) does not support"  # its documented refusal: a legal outcome
CACHE_REFUSED = "cache: a cache given to a call with use_cache=False"  # continuing a cache without one: refused


class NoFollower(LogitsProcessor):
    """A user's processor (not one of transformers' classes, so speculative `generate` decodes plainly with it):
    bans the token after each row's last one, (last + 1) mod V."""

    def __init__(self, vocab: int):
        self.vocab = vocab

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        banned = (input_ids[:, -1:] + 1) % self.vocab
        return scores.scatter(1, banned, float("-inf"))

    def __repr__(self) -> str:
        return f"NoFollower({self.vocab})"


@functools.lru_cache(maxsize=32)
def model_for(family: str, seed: int, loops: int, damp: float):
    """A tiny fp32 model, built once per (family, seed, loops, damp): Ouro with `loops` loops; Huginn (whose loops
    are a per-call `num_steps`, so `loops` is not part of the model)."""
    if family == "ouro":
        return tiny_spec_model(seed, loops, vocab=VOCAB, damp=damp)
    return tiny_huginn(seed=seed, damp=damp)[0]


@dataclass(frozen=True)
class Case:
    """One draw of settings (see the module docstring); `speculative` and `shared` are generate's keyword arguments
    of the speculative call alone and of both calls."""

    seed: int
    family: str
    loops: int
    damp: float
    lengths: tuple[int, ...]
    max_new: int
    speculative: dict = field(hash=False)
    shared: dict = field(hash=False)
    first: dict | None = field(default=None, hash=False)  # generate's mode arguments of a first call, or None
    suffixes: tuple[int, ...] = ()  # lengths of the suffixes appended after the first call
    # generated indices whose tokens in plain decoding without EOS (row index % batch) join the EOS list: stops,
    # and EOS holds (min_new_tokens, min_length), that actually happen
    eos_at: tuple[int, ...] = ()
    auto_costs: str | None = None  # with speculative_mode="auto": the `AUTO_COSTS` table it decides by
    dynamic_first: bool = False  # the first call is plain decoding on its own DynamicCache (else a PagedLoopCache)
    int32_ids: bool = False  # the speculative call gets its ids as int32 (plain decoding's as int64)

    def describe(self) -> str:
        return (f"Case(seed={self.seed}, {self.family}, U={self.loops}, damp={self.damp}, lengths={self.lengths}, "
                f"max_new={self.max_new}, speculative={self.speculative}, shared={self.shared}, first={self.first}, "
                f"suffixes={self.suffixes}, eos_at={self.eos_at}, auto_costs={self.auto_costs}, "
                f"dynamic_first={self.dynamic_first}, int32_ids={self.int32_ids})")


# generate's logits-processor settings a case may draw, each with one value drawn from (rng, vocab)
PROCESSORS = {
    "no_repeat_ngram_size": lambda rng, vocab: rng.choice([1, 2, 3]),
    "min_new_tokens": lambda rng, vocab: rng.randint(1, 6),
    "min_length": lambda rng, vocab: rng.randint(2, 16),
    "repetition_penalty": lambda rng, vocab: rng.choice([0.7, 1.3, 2.0]),
    "bad_words_ids": lambda rng, vocab: [rng.sample(range(1, vocab), rng.choice([1, 2])) for _ in range(3)],
    "suppress_tokens": lambda rng, vocab: rng.sample(range(1, vocab), 3),
    "begin_suppress_tokens": lambda rng, vocab: rng.sample(range(1, vocab), 2),
    "logits_processor": lambda rng, vocab: LogitsProcessorList([NoFollower(vocab)]),
    "forced_eos_token_id": lambda rng, vocab: rng.randint(1, vocab - 1),
    "exponential_decay_length_penalty": lambda rng, vocab: (rng.randint(0, 8), rng.choice([1.2, 2.0])),
}
# Ouro's exit options a case may draw (the target's logits from another loop, or from the gate's exit distribution)
EXITS = (
    lambda rng, loops: {"exit_at_step": rng.randrange(loops)},
    lambda rng, loops: {"exit_threshold": rng.choice([0.5, 0.9])},
    lambda rng, loops: {"use_weighted_exit": True},
)
# auto's cost tables (`auto_costs.CostTable`: seconds of a plain step, of an engine cycle per candidate) and a policy
# of short segments: "speculative", every candidate wins at high acceptance; "plain", none ever does
_CANDIDATES = [Candidate("pipeline", d) for d in range(1, 8)] + [Candidate("block", d, 4) for d in range(1, 8)]
AUTO_COSTS = {"speculative": CostTable(4.0, dict.fromkeys(_CANDIDATES, 2.0)),
              "plain": CostTable(1.0, dict.fromkeys(_CANDIDATES, 5.0))}
AUTO_POLICY = AutoPolicy(interval=4, max_interval=8, probe_tokens=3, reprobe_after=1, min_verified=2)


def _mode(rng: random.Random, loops: int) -> dict:
    """A random speculative mode for a `loops`-loop model: pipeline (d | U, sometimes with d2 >= U - d: smaller ones
    are refused at resolution) or block."""
    if rng.random() < 0.55:
        d = rng.choice([d for d in range(1, loops) if loops % d == 0])
        mode = {"speculative_mode": "pipeline", "draft_loops": d}
        if d + 1 < loops and rng.random() < 0.35:
            mode["second_draft_loops"] = rng.randint(max(d + 1, loops - d), loops - 1)
        return mode
    return {"speculative_mode": "block", "draft_loops": rng.randint(1, loops - 1),
            "num_speculative_tokens": rng.randint(1, 5)}


def draw_case(seed: int) -> Case:
    """The case of `seed` (one `random.Random(seed)` draws every setting)."""
    rng = random.Random(seed)
    family = rng.choice(["ouro", "ouro", "huginn"])
    loops = rng.choice([2, 3, 4, 4, 6])
    damp = rng.choice([1.0, 0.3, 0.05])
    batch = rng.choice([1, 1, 2, 3])
    lengths = tuple(rng.randint(1, 10) for _ in range(batch))
    vocab = VOCAB if family == "ouro" else model_for(family, seed % 4, loops, damp).config.vocab_size
    max_new = rng.randint(4, 24)
    shared: dict = {"eos_token_id": None}
    if rng.random() < 0.25:
        shared["eos_token_id"] = rng.sample(range(1, vocab), rng.choice([1, 2, 3]))
    eos_at = tuple(rng.sample(range(max_new), rng.choice([1, 2]))) if rng.random() < 0.4 else ()
    for name, draw in PROCESSORS.items():
        if rng.random() < 0.2:
            shared[name] = draw(rng, vocab)
    if "exponential_decay_length_penalty" in shared and not shared["eos_token_id"]:  # it raises the EOS score
        shared["eos_token_id"] = [rng.randint(1, vocab - 1)]
    if family == "huginn":
        shared |= {"num_steps": loops, "init_scale": rng.choice([0.0, 1.0]), "init_seed": 1000 + seed}
    speculative = _mode(rng, loops) | {"speculative_engine": rng.choice(["auto", "wavefront"])}
    if rng.random() < 0.15:
        speculative["use_cache"] = False
    if rng.random() < 0.1:
        speculative["output_scores"] = True
    first, suffixes = None, ()
    if rng.random() < 0.25:
        first = rng.choice([{"speculative_mode": None}, _mode(rng, loops)])
        suffixes = tuple(rng.randint(1, 3) for _ in range(batch))
    auto_costs = None
    if rng.random() < 0.2:  # auto instead of the fixed mode
        auto_costs = rng.choice(list(AUTO_COSTS))
        speculative = {key: value for key, value in speculative.items() if key in ("use_cache", "output_scores")}
        speculative["speculative_mode"] = "auto"
    dynamic_first = first is not None and first["speculative_mode"] is None and rng.random() < 0.5
    if family == "ouro" and rng.random() < 0.2:  # (drawn last: the settings above stay those of each seed before)
        shared |= rng.choice(EXITS)(rng, loops)
    int32_ids = rng.random() < 0.15
    return Case(seed, family, loops, damp, lengths, max_new, speculative, shared, first, suffixes, eos_at,
                auto_costs, dynamic_first, int32_ids)


@dataclass
class Mismatch:
    """How a case's speculative run left plain decoding: an exception, or the first divergent token of a row with
    plain's top-1 / top-2 margin of the processed scores there and the near-tie bound of the model."""

    case: Case
    error: BaseException | None = None
    row: int | None = None
    index: int | None = None  # generated index of the first divergent token
    plain_token: int | None = None
    speculative_token: int | None = None
    margin: float | None = None
    bound: float | None = None

    @property
    def near_tie(self) -> bool:
        return self.error is None and self.margin is not None and self.margin <= self.bound

    def __str__(self) -> str:
        if self.error is not None:
            return f"{self.case.describe()}: {type(self.error).__name__}: {self.error}"
        return (f"{self.case.describe()}: row {self.row}, generated index {self.index}: plain {self.plain_token}, "
                f"speculative {self.speculative_token}; plain's top-1/top-2 margin {self.margin:.3g} "
                f"(near-tie bound {self.bound:.3g})")


def _depth(model, case: Case) -> dict[str, int]:
    if case.family == "ouro":
        return ouro_depth(model.config)
    return huginn_depth(model.config, case.loops)


def _shared(model, case: Case, ids, mask) -> dict:
    """`case.shared` with the tokens of `case.eos_at` added to the EOS list (see `Case`)."""
    if not case.eos_at:
        return case.shared
    holds = ("eos_token_id", "min_new_tokens", "min_length", "exponential_decay_length_penalty")  # need, or hold, EOS
    free = plain(model, ids, mask, case.max_new, speculative_mode=None,
                 **{k: v for k, v in case.shared.items() if k not in holds})
    width = ids.shape[1]
    eos = [int(free.sequences[i % len(ids), width + i]) for i in case.eos_at if width + i < free.sequences.shape[1]]
    return case.shared | {"eos_token_id": sorted(set(eos) | set(case.shared["eos_token_id"] or ()))}


def _inputs(model, case: Case, vocab: int):
    """(ids, mask, cache, shared) of the compared calls: the case's prompts, or, when it continues a cache, the
    first call's output extended by the suffixes and the cache that call filled; and both calls' settings."""
    ids, mask = left_pad(random_prompts(case.seed, case.lengths, vocab))
    shared = _shared(model, case, ids, mask)
    if case.first is None:
        return ids, mask, None, shared
    cache = DynamicCache() if case.dynamic_first else paged_cache(model, debug=False, num_steps=shared.get("num_steps"))
    out = generate_dict(model, ids, mask, case.max_new, cache=cache, **case.first, **shared)
    full, full_mask = extend(out.sequences, mask, random_prompts(case.seed + 1, case.suffixes, vocab))
    return full, full_mask, cache, shared


def _plain_error(model, case: Case, vocab: int) -> str | None:
    """The `ValueError` message plain decoding of `case` raises (its prompts, the shared settings), or None."""
    try:
        ids, mask, _, shared = _inputs(model, case, vocab)
        plain(model, ids, mask, case.max_new, speculative_mode=None, **shared)
    except ValueError as error:
        return str(error)
    return None


def run_case(case: Case) -> Mismatch | None:
    """Decode `case` speculatively and plainly; None when the tokens are identical (or the speculative call raised
    the wavefront engine's documented refusal, or the `ValueError` plain decoding raises too), else the
    `Mismatch`."""
    model = model_for(case.family, case.seed % 4, case.loops, case.damp)
    vocab = model.config.vocab_size
    try:
        ids, mask, cache, shared = _inputs(model, case, vocab)
        if case.auto_costs is not None:  # auto decides by the case's table alone: nothing timed, nothing remembered
            set_costs(model, AUTO_COSTS[case.auto_costs])
            set_policy(model, AUTO_POLICY)
            forget(model)
        elif cache is None and case.speculative.get("use_cache") is not False:
            cache = paged_cache(model, debug=False, num_steps=shared.get("num_steps"))
        given = {} if cache is None else {"cache": cache}
        got = generate_dict(model, ids.int() if case.int32_ids else ids, mask, case.max_new, **given,
                            **case.speculative, **shared)
    except ValueError as error:
        if str(error).startswith(REFUSED) or _plain_error(model, case, vocab) == str(error):
            return None  # the documented refusal, or the error plain decoding raises for these settings too
        if str(error).startswith(CACHE_REFUSED) and case.first is not None:
            return None  # use_cache=False continuing the first call's cache: refused in every mode
        return Mismatch(case, error=error)
    except Exception as error:  # noqa: BLE001 - every crash is a finding, reported with its case
        return Mismatch(case, error=error)
    ref = plain(model, ids, mask, case.max_new, cache=DynamicCache(), output_scores=True, speculative_mode=None,
                **shared)
    if got.sequences.tolist() == ref.sequences.tolist():
        return None
    width = ids.shape[1]
    for s in range(len(ids)):
        want, have = ref.sequences[s, width:].tolist(), got.sequences[s, width:].tolist()
        if want == have:
            continue
        index = next((i for i, (a, b) in enumerate(zip(want, have)) if a != b), min(len(want), len(have)))
        if index >= len(want) or index >= len(have):  # one run stopped early: no margin decides that
            return Mismatch(case, row=s, index=index, margin=float("inf"), bound=0.0)
        scores = ref.scores[index][s]
        top = scores.topk(2).values
        bound = 2 * fp32_tolerance(**_depth(model, case), scale=rms(scores))["atol"]
        return Mismatch(case, row=s, index=index, plain_token=want[index], speculative_token=have[index],
                        margin=float(top[0] - top[1]), bound=bound)
    return Mismatch(case, margin=float("inf"), bound=0.0)  # the prompt columns differ: a bug
