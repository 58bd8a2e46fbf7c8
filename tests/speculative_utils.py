"""Shared helpers of the self-speculative decoding tests (tests/test_speculative_*.py).

Everything here computes expectations independently of the speculative code: plain greedy decoding through
transformers' own loop on a `DynamicCache`, teacher-forced full forwards (`output_hidden_states=True`), and
counts taken from the plain outputs. CPU, fp32, tiny random Ouro models.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import SimpleNamespace

import pytest
import torch
from helpers import tiny_config
from inputs import left_pad, random_prompts
from paged_utils import paged_plane
from tolerances import assert_fp32_close, fp32_tolerance, ouro_depth, rms
from transformers import EosTokenCriteria, MaxLengthCriteria, StoppingCriteriaList
from transformers.cache_utils import DynamicCache

from hf_loopspec import OuroForCausalLM
from hf_loopspec.bench.shapes import random_model
from hf_loopspec.cache.paged import PagedLoopCache

PAD = 0
PAGE = 4  # page size of every PagedLoopCache in these tests: rollbacks cross page boundaries often

# The speculative settings the tests run: (speculative_mode, draft_loops d, num_speculative_tokens K). Pipeline
# drafts from one and from two loops; block rounds with one draft loop and K = PAGE (rounds fill whole pages), and
# with two draft loops and K = 2 (rounds straddle page boundaries).
MODES = [("pipeline", 1, None), ("pipeline", 2, None), ("block", 1, 4), ("block", 2, 2)]


def mode_id(mode: str, d: int, k: int | None = None) -> str:
    """A test id of one (mode, d, K): "pipeline-d1", "block-d2-K2"."""
    return f"{mode}-d{d}" + (f"-K{k}" if k else "")


def mode_params(settings: Sequence[tuple] = MODES, keep: Callable[[str, int, int | None], bool] | None = None) -> list:
    """`settings` (default: `MODES`; a file that varies the matrix passes a map of it) for which `keep(mode, d, K)`
    holds (all without `keep`), as `pytest.param`s named by `mode_id`, for `parametrize("mode,d,k", ...)`."""
    return [pytest.param(*s, id=mode_id(*s)) for s in settings if keep is None or keep(*s)]


# One setting of each mode from the matrix, for tests whose subject is not the schedule (exit options, stopping,
# validation, cache continuation): pipeline drafting from one loop, and block rounds that straddle page boundaries.
MODE_PAIR = [MODES[0], MODES[3]]


def mode_kwargs(mode: str, d: int, k: int | None = None) -> dict:
    """`generate`'s keyword arguments for one (mode, d, K) of `MODES`."""
    return {"speculative_mode": mode, "draft_loops": d} | ({} if k is None else {"num_speculative_tokens": k})


def named_modes(settings: Sequence[tuple] = MODE_PAIR) -> dict[str, dict]:
    """`generate`'s keyword arguments by test id: "plain" (no speculation), then each of `settings`."""
    return {"plain": {"speculative_mode": None}} | {mode_id(*m): mode_kwargs(*m) for m in settings}


# --- models and prompts -------------------------------------------------------------------------------------------


# Prompt lengths of one seed's batch of the identity matrix, by batch shape: `BATCHES[shape](seed, group)`.
BATCHES = {
    # one unpadded prompt per seed, all of one length per call: rows without padding, independent sequences
    "unpadded": lambda seed, group: [2 + group],
    # three ragged prompts per seed: left padding of up to 8 columns
    "ragged3": lambda seed, group: [3 + seed % 5, 1 + seed % 3, 9],
}


def tiny_spec_model(seed: int, loops: int = 4, *, vocab: int = 96, hidden: int = 32, damp: float = 1.0,
                    eos: int | list[int] | None = None) -> OuroForCausalLM:
    """A tiny fp32 Ouro (2 layers, 4 heads, 2 kv heads, `loops` loops) in eval mode, with the package's seeded random
    weights (`hf_loopspec.bench.shapes.random_model`, the one recipe the bench and every test model share: O(1)
    activations and well separated argmaxes; a real exit gate, `gate_scale=1`, for the exit options).

    `damp` < 1 makes consecutive loops agree, so that drafts get accepted (see the recipe for how). Tests that need
    accepted and rejected drafts, or long accepted runs, assert that their model gives them.
    """
    config = tiny_config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_key_value_heads=2,
                         total_ut_steps=loops, max_position_embeddings=512, bos_token_id=None, eos_token_id=eos,
                         pad_token_id=PAD, tie_word_embeddings=False)
    return random_model(config, seed=seed, damp=damp, gate_scale=1.0)


def spec_case(seed: int, lengths: Sequence[int], vocab: int, loops: int = 4, damp: float = 1.0):
    """(model, prompts, ids, mask): `tiny_spec_model(seed, loops, vocab=vocab, damp=damp)`, one seeded random prompt
    per length (`inputs.random_prompts(seed, ...)`), and the prompts left-padded into `(ids, mask)`."""
    model = tiny_spec_model(seed, loops, vocab=vocab, damp=damp)
    prompts = random_prompts(seed, lengths, vocab)
    return model, prompts, *left_pad(prompts)


def paged_cache(model, debug: bool = True, num_steps: int | None = None) -> PagedLoopCache:
    """A fresh `PagedLoopCache(page_size=PAGE)` for `model`, with the lineage checker when `debug`; for a Huginn model
    at `num_steps` recurrence steps (its planes depend on them; default: the config's `mean_recurrence`)."""
    if num_steps is None:
        return PagedLoopCache(model.kv_layout, page_size=PAGE, debug=debug)
    with model.recurrence(num_steps=num_steps):
        return PagedLoopCache(model.kv_layout, page_size=PAGE, debug=debug)


# --- the two decoders -----------------------------------------------------------------------------------------------


def generate_dict(model, ids, mask, max_new: int, **kwargs):
    """`model.generate` as the tests call it: without gradients, greedy unless `kwargs` say otherwise, pad id `PAD`;
    returns the dict output. `plain` and `speculative` add their caches and settings."""
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=max_new, pad_token_id=PAD,
                              return_dict_in_generate=True, **{"do_sample": False} | kwargs)


def plain(model, ids, mask, max_new: int, **kwargs):
    """Plain decoding (transformers' loop, `DynamicCache`; greedy unless `kwargs` say otherwise); returns the dict
    output (`.cache` included)."""
    return generate_dict(model, ids, mask, max_new, **{"cache": DynamicCache()} | kwargs)


def speculative(model, ids, mask, max_new: int, mode: str, d: int = 1, k: int | None = None, *, debug: bool = False,
                **kwargs):
    """Speculative decoding (greedy unless `kwargs` say otherwise) on a fresh `paged_cache` (for the call's
    `num_steps`, if given); returns the dict output. The engine is generate's (the wavefront engine); `debug=True`
    (lineage checks) makes it the reference (`generation.dispatch`), as `reference` does."""
    if "cache" not in kwargs:
        kwargs["cache"] = paged_cache(model, debug, kwargs.get("num_steps"))
    return generate_dict(model, ids, mask, max_new, **mode_kwargs(mode, d, k), **kwargs)


def engine_settings(model, engine: str, num_steps: int | None = None) -> dict:
    """`generate` kwargs that run `engine` on a fresh `paged_cache`: "wavefront" (asked for by name, so that nothing
    else can run) or "lanes", the reference (a debug cache sends `generate` there: `generation.dispatch`)."""
    if engine == "lanes":
        return {"cache": paged_cache(model, True, num_steps)}
    return {"cache": paged_cache(model, False, num_steps), "speculative_engine": "wavefront"}


def reference(model, ids, mask, max_new: int, mode: str, d: int = 1, k: int | None = None, **kwargs):
    """The same call as `speculative`, run by the reference (the lane decoder, with its lineage checks: a debug
    cache sends `generate` there), the oracle of the engine's counters; returns the dict output."""
    out = speculative(model, ids, mask, max_new, mode, d, k, debug=True, **kwargs)
    assert out.speculation.engine == "lanes"
    return out


def decode_reference(model, ids, mask, max_new: int, mode: str, d: int = 1, *, second_draft_loops: int | None = None,
                     eos_token_id=None, stopping_criteria=(), speculative_trace: bool | str = False, cache=None,
                     **options):
    """Greedy decoding by the reference directly (`model.decode_with_lanes`, on a fresh debug `paged_cache`), for
    settings `generate` refuses (second proposals with d2 < U - d): stops after `max_new` tokens, at `eos_token_id`
    and at `stopping_criteria`, as `generate` would; `options`: other fields of the request (`draft_hook`, ...).
    `cache`: the `PagedLoopCache` to fill (default: a fresh debug one). Returns what `speculative` returns that the
    checks read: sequences, speculation, trace, cache."""
    cache, max_length = paged_cache(model) if cache is None else cache, ids.shape[1] + max_new
    stop = StoppingCriteriaList([MaxLengthCriteria(max_length), *stopping_criteria])
    if eos_token_id is not None:
        stop.append(EosTokenCriteria(eos_token_id))
    with torch.no_grad():
        result = model.decode_with_lanes(ids, mode, draft_loops=d, second_draft_loops=second_draft_loops, cache=cache,
                                         attention_mask=mask, stopping_criteria=stop, pad_token_id=PAD,
                                         max_length=max_length, trace=speculative_trace, complete_cache=True, **options)
    return SimpleNamespace(sequences=result.sequences, speculation=result.stats, trace=result.trace, cache=cache)


# --- facts read off plain outputs -----------------------------------------------------------------------------------


def real_tokens(sequences: torch.Tensor, mask: torch.Tensor, s: int) -> list[int]:
    """Row `s` of a generate output without its left padding (prompt + continuation, trailing pads included)."""
    pads = int((mask[s] == 0).sum())
    return sequences[s, pads:].tolist()


def generated_counts(sequences: torch.Tensor, width: int, max_new: int, eos: int | Sequence[int] | None) -> list[int]:
    """Tokens each row generated: up to and including its first eos, else all columns after the prompt."""
    eos_set = set() if eos is None else {eos} if isinstance(eos, int) else set(eos)
    counts = []
    for row in sequences[:, width:].tolist():
        n = len(row)
        for i, t in enumerate(row):
            if t in eos_set:
                n = i + 1
                break
        counts.append(min(n, max_new))
    return counts


def first_new_occurrence(tokens: Sequence[int], start: int = 0) -> dict[int, int]:
    """token -> index of its first occurrence in `tokens`, for tokens first seen at index >= start."""
    first: dict[int, int] = {}
    for i, t in enumerate(tokens):
        first.setdefault(t, i)
    return {t: i for t, i in first.items() if i >= start}


# --- counters -------------------------------------------------------------------------------------------------------


def assert_counter_invariants(stats, committed_per_seq: Sequence[int]) -> None:
    """The exact identities of `SpeculationStats`, with committed counts taken from the plain output."""
    assert [s.committed for s in stats.per_sequence] == list(committed_per_seq)
    assert stats.committed_tokens == sum(committed_per_seq)
    for s in stats.per_sequence:
        assert s.accepted + s.rejected == s.verified, s
        assert s.drafted == s.verified + s.discarded, s
        assert min(s.drafted, s.verified, s.accepted, s.rejected, s.discarded) >= 0, s
    assert stats.accepted + stats.rejected == stats.verified
    assert stats.drafted == stats.verified + stats.discarded
    if stats.committed_tokens:
        # calls per token of one sequence: every row of a batch shares each call
        assert stats.core_calls_per_token == stats.core_calls * len(committed_per_seq) / stats.committed_tokens
        expected_rate = stats.accepted / stats.verified if stats.verified else 0.0
        assert stats.acceptance_rate == expected_rate


# --- closed forms of core calls under forced patterns (docs/design.md, "Cost model") ------------------------


def pipeline_calls(n: int, loops: int, d: int, accept: bool) -> int:
    """Core calls of a pipeline run of n tokens when every draft is accepted / rejected.

    All accepted: the last prompt token reaches depth d after d calls and drafts token 1; every draft reaches
    depth d d calls after it was spawned and drafts the next, so the draft of token n-1 (the last one ever
    needed: the last token is never fed back) is spawned after (n-1)d calls and yields token n U calls later:
    (n-1)d + U. Per token this tends to d, the cost model's d + (U-d)(1-a) at a = 1.

    All rejected: every target kills the draft in flight and restarts its position at depth 0 with the target
    token, which takes U calls to produce the next target: nU, i.e. U per token (a = 0), as plain AR.
    """
    return (n - 1) * d + loops if accept else n * loops


def block_rounds(n: int, k: int, accept: bool) -> list[int]:
    """Drafts per round: a round that starts with c tokens committed drafts min(K, n - c - 1) tokens (the last token
    is never fed back, so no draft is made beyond position n - 1 of the continuation) and commits all of them
    plus the bonus token (all accepted) or one target token (all rejected)."""
    rounds, c = [], 0
    while c < n:
        drafts = min(k, n - c - 1)
        rounds.append(drafts)
        c += drafts + 1 if accept else 1
    return rounds


def block_calls(n: int, loops: int, d: int, k: int, accept: bool) -> int:
    """Core calls of a block run: a round with k drafts runs the round's first token (the prompt's last token or
    the previous round's committed target) and each of the k drafts through loops 0..d-1 one after another,
    (k+1)d calls, then loops d..U-1 once over all k+1 lanes, U-d calls: the cost model's (K+1)d + (U-d) per round."""
    return sum((drafts + 1) * d + loops - d for drafts in block_rounds(n, k, accept))


# --- KV cache (I4) --------------------------------------------------------------------------------------------------


def assert_cache_matches_ar(paged: PagedLoopCache, ar: DynamicCache, mask: torch.Tensor,
                            generated: Sequence[int], num_layers: int, *, model_depth: dict[str, int],
                            planes: Sequence[int] | None = None, completed: bool = True) -> None:
    """I4: every plane (or the given `planes`) of every sequence equals what serial AR wrote for the committed tokens,
    up to the fp32 rounding of a forward of `model_depth` (the model's `ouro_depth` / `huginn_depth`: a bound for
    every plane).

    The AR `DynamicCache` is `[B, Hkv, S, D]` per cache layer (depth * num_layers + layer), with pad columns on the
    left; it holds every column except the last generated one, for rows that finished early the stop token and the
    pad steps after it included (plain decoding feeds them with mask 1), and so does the cache `generate` returns
    (`LaneDecoder._complete_cache`, `WavefrontEngine._complete_cache`); with `completed=False` (a `WavefrontEngine`
    run without `complete_cache`) rows hold only their committed tokens. The paged cache stores real tokens only,
    position p at column p + pads.
    """
    steps = max(generated)
    if completed:
        assert paged.get_seq_length() == mask.shape[1] + steps - 1 == ar.get_seq_length()
    for s, gen in enumerate(generated):
        pads = int((mask[s] == 0).sum())
        n = int(mask[s].sum()) + (steps if completed else gen) - 1
        for depth in range(paged.num_planes) if planes is None else planes:
            assert paged.length(s, depth) == n, (
                f"sequence {s}, depth {depth}: valid length {paged.length(s, depth)}, serial AR holds {n} tokens")
            for layer in range(num_layers):
                ar_layer = ar.layers[depth * num_layers + layer]
                k_ar = ar_layer.keys[s, :, pads:pads + n].transpose(0, 1)  # [n, Hkv, D]
                v_ar = ar_layer.values[s, :, pads:pads + n].transpose(0, 1)
                k, v = paged_plane(paged, s, depth, layer, n)
                where = f"sequence {s}, depth {depth}, layer {layer}"
                assert_fp32_close(k, k_ar, **model_depth, msg=lambda m, w=where: f"keys of {w}: {m}")
                assert_fp32_close(v, v_ar, **model_depth, msg=lambda m, w=where: f"values of {w}: {m}")


# --- forced draft patterns ------------------------------------------------------------------------------------------


def forcing_hook(reference: Sequence[Sequence[int]], prompt_lens: Sequence[int], accept: Callable[[int, int], bool],
                 vocab: int, calls: list | None = None):
    """A `draft_hook` that proposes the reference token at a position when `accept(seq, i)` (i = index of the
    generated token, position - prompt_len) and a different token otherwise. `reference[s]` is row s's real tokens
    (prompt + plain greedy continuation without eos). Every call is appended to `calls` when given."""

    def hook(seq: int, position: int, proposed: int) -> int:
        i = position - prompt_lens[seq]
        right = reference[seq][position]
        token = right if accept(seq, i) else (right + 1 + seq) % vocab
        if calls is not None:
            calls.append((seq, position, proposed, token))
        return token

    return hook


def events(out, kind: str) -> list[tuple[int, int, int]]:
    """(seq, position, token) of every traced event of one kind ("accept", "reject", "commit")."""
    return [(s, p, t) for cycle in out.trace for (k, s, p, t) in cycle.events if k == kind]


def check_forced_run(model, prompts, ids, mask, out, ref, committed, accept=None):
    """Everything every run with forced draft outcomes must satisfy (test_speculative_forced.py's docstring): tokens
    equal plain decoding's `ref`, every read was checked against its lineage (I1), the counter identities, every
    plane equals serial AR's (I4), the traced outcome of every draft follows `accept(seq, position, i)` when given,
    and traced hidden states equal the teacher-forced reference when traced."""
    torch.testing.assert_close(out.sequences, ref.sequences, atol=0, rtol=0)
    assert out.cache.debug and out.cache.tags is not None  # every read was checked against its lineage (I1)
    assert_counter_invariants(out.speculation, committed)
    assert_cache_matches_ar(out.cache, ref.cache, mask, committed, model.config.num_hidden_layers,
                            model_depth=ouro_depth(model.config))
    if accept is not None:
        for s, p, _ in events(out, "accept"):
            assert accept(s, p, p - len(prompts[s])), f"draft at sequence {s}, position {p} should be rejected"
        for s, p, _ in events(out, "reject"):
            assert not accept(s, p, p - len(prompts[s])), f"draft at sequence {s}, position {p} should be accepted"
    if out.trace and out.trace[0].hidden is not None:
        found = trace_divergence(model, out, [p.tolist() for p in prompts])
        assert found is None, f"traced hidden state differs from the teacher-forced reference: {found}"


# --- teacher-forced comparison of traced hidden states --------------------------------------------------------------


def _row_paths(trace, prompts: Sequence[Sequence[int]]):
    """For every traced row, the tokens of its own path (its ancestry) at positions 0..position.

    A sequence's main-path lanes form one path and a lane's ancestors all ran after they were spawned, so the token
    of the latest row seen at each position (this cycle's rows included) is the row's ancestor there. A sibling
    branch (`row.branch` > 0, second proposals) is a path of its own that starts at its first row's position and
    continues the main path before it; a promoted branch's lanes run as main-path rows from the next cycle on.
    """
    latest = {(s, 0): dict(enumerate(int(t) for t in p)) for s, p in enumerate(prompts)}
    paths = []
    for cycle in trace:
        for r in cycle.rows:
            key = (r.seq, r.branch)
            if key not in latest:  # a new branch: its first row is its sibling lane
                latest[key] = {j: t for j, t in latest[(r.seq, 0)].items() if j < r.position}
            latest[key][r.position] = r.token
        paths.append([tuple(latest[(r.seq, r.branch)][j] for j in range(r.position + 1)) for r in cycle.rows])
    return paths


def _loop_states(model, path: tuple[int, ...]) -> torch.Tensor:
    """Teacher-forced serial reference: every loop's output `[U, T, H]` of one unpadded sequence."""
    with torch.no_grad():
        out = model(input_ids=torch.tensor([path]), output_hidden_states=True, use_cache=False)
    return torch.stack([h[0] for h in out.hidden_states[1:]])


def trace_divergence(model, out, prompts: Sequence[Sequence[int]]):
    """Compare every traced row's output (`speculative_trace="hidden"`) with a teacher-forced full forward of the
    row's own path, up to the fp32 rounding of a full forward; returns None when all agree, else a dict describing
    the first divergent (cycle, row)."""
    trace = out.trace
    assert trace and trace[0].hidden is not None, "run with speculative_trace='hidden'"
    paths = _row_paths(trace, prompts)
    by_seq: dict[int, set] = {}
    for cycle, cycle_paths in zip(trace, paths):
        for r, path in zip(cycle.rows, cycle_paths):
            by_seq.setdefault(r.seq, set()).add(path)
    maximal: dict[int, list] = {}
    for s, ps in by_seq.items():
        chosen = []
        for p in sorted(ps, key=len, reverse=True):
            if not any(c[: len(p)] == p for c in chosen):
                chosen.append(p)
        maximal[s] = [(c, _loop_states(model, c)) for c in chosen]
    for c, (cycle, cycle_paths) in enumerate(zip(trace, paths)):
        for n, (r, path) in enumerate(zip(cycle.rows, cycle_paths)):
            ref = next(h for full, h in maximal[r.seq] if full[: len(path)] == path)[r.depth, r.position]
            diff = float((cycle.hidden[n] - ref).abs().max())
            if not torch.allclose(cycle.hidden[n], ref, **fp32_tolerance(**ouro_depth(model.config), scale=rms(ref))):
                return {"cycle": c, "seq": r.seq, "position": r.position, "depth": r.depth, "token": r.token,
                        "is_draft": r.is_draft, "max_abs_diff": diff, "rows": len(cycle.rows)}
    return None


def logit_margin(model, tokens: Sequence[int], position: int) -> dict:
    """Top-1 / top-2 of the teacher-forced last-loop logits that choose the token at `position` of `tokens`."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([list(tokens[:position])])).logits[0, -1]
    top = logits.topk(2)
    return {"top1": int(top.indices[0]), "top2": int(top.indices[1]),
            "margin": float(top.values[0] - top.values[1])}


def divergence_report(model, ids, mask, expected: torch.Tensor, traced_out, label: str = "") -> str:
    """Failure message for a token mismatch: the first divergent token per sequence with the logit margin there,
    and the first cycle / depth where the traced hidden states leave the teacher-forced serial reference."""
    prompts = [ids[s][mask[s].bool()].tolist() for s in range(ids.shape[0])]
    lines = [f"speculative output differs from plain greedy {label}"]
    for s in range(ids.shape[0]):
        want, got = real_tokens(expected, mask, s), real_tokens(traced_out.sequences, mask, s)
        j = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), None)
        if j is None and len(want) == len(got):
            continue
        j = min(len(want), len(got)) if j is None else j
        m = logit_margin(model, want, j) if j < len(want) else {}
        lines.append(f"  seq {s}: first divergent token at position {j} (generated index {j - len(prompts[s])}): "
                     f"plain {want[j] if j < len(want) else None} vs speculative {got[j] if j < len(got) else None}; "
                     f"teacher-forced top1/top2 logit margin there: {m}")
    first = trace_divergence(model, traced_out, prompts)
    lines.append(f"  first traced row whose hidden state leaves the teacher-forced reference: {first}")
    return "\n".join(lines)
