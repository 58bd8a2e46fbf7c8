"""Second proposals in the wavefront engine (`generation.wavefront.sibling`: one sibling slot per sequence, private
KV) against two independent oracles: plain greedy decoding and the lane decoder with the same second proposals.

Every run must give plain greedy's tokens, the lane decoder's counters (core calls, verified, accepted, rejected,
discarded, second_drafts, second_accepted: the same cycles), and KV planes equal to serial AR's (I4: a chosen
sibling's private KV was copied into the main tables, a dropped one's never reached them). Forced outcomes go
through the engine's device-side `draft_override` / `second_override` and the lane decoder's `draft_hook` /
`second_draft_hook`, built from one outcome rule: "q1" (the main draft right, the sibling wrong), "q2" (the sibling
right: it is chosen) or "none" (both wrong).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from inputs import left_pad, random_prompts
from speculative_utils import (
    PAD,
    assert_cache_matches_ar,
    assert_counter_invariants,
    decode_reference,
    generated_counts,
    paged_cache,
    plain,
    real_tokens,
    speculative,
    tiny_spec_model,
)
from tolerances import ouro_depth
from transformers import EosTokenCriteria, MaxLengthCriteria, StoppingCriteriaList

from hf_loopspec.generation.wavefront import WavefrontEngine, sibling
from hf_loopspec.generation.wavefront import engine as engine_module

VOCAB = 80
NEW = 16
# (U, d, d2) with U - d2 <= d (one sibling per sequence); U - d2 == d: a chosen sibling drafts in the same cycle
CONFIGS = [(4, 1, 3), (4, 2, 3), (6, 2, 4), (6, 3, 5)]
CONFIG_IDS = [f"U{u}-d{d}-d2{d2}" for u, d, d2 in CONFIGS]
PATTERNS = {  # outcome of the verification of generated token i
    "q1": lambda i: "q1",
    "q2": lambda i: "q2",
    "none": lambda i: "none",
    "rotating": lambda i: ("q1", "q2", "none")[i % 3],
}


def _case(seed: int, loops: int, lengths):
    model = tiny_spec_model(seed, loops, vocab=VOCAB, damp=0.5)  # damp < 1: drafts accepted as well as rejected
    ids, mask = left_pad(random_prompts(seed, lengths, VOCAB))
    return model, ids, mask


def _forcing(free, mask, outcome):
    """The lane decoder's hooks and the engine's override tensors `[B, C]` forcing `outcome(i)` for generated token
    i; `free` is plain greedy without stops (it knows the right token of every position a draft can be made for).
    Wrong tokens differ from the right one and from each other."""
    reference = [real_tokens(free.sequences, mask, s) for s in range(len(mask))]
    lengths = [int(n) for n in mask.sum(1)]

    def first(s, pos, proposed):
        right = reference[s][pos]
        return right if outcome(pos - lengths[s]) == "q1" else (right + 1) % VOCAB

    def second(s, pos, first_token, proposed):
        right = reference[s][pos]
        return right if outcome(pos - lengths[s]) == "q2" else (right + 2) % VOCAB

    def table(hook):
        return torch.tensor([[hook(s, p) if lengths[s] <= p < len(reference[s]) else -1
                              for p in range(mask.shape[1] + NEW)] for s in range(len(mask))])

    hooks = {"draft_hook": first, "second_draft_hook": second}
    overrides = {"draft_override": table(lambda s, p: first(s, p, 0)),
                 "second_override": table(lambda s, p: second(s, p, 0, 0))}
    return hooks, overrides


def _runs(model, ids, mask, d, d2, *, eos=None, hooks=None, overrides=None):
    """(wavefront result, its cache, lane decoder result) of one greedy pipeline run with second proposals."""
    max_length = ids.shape[1] + NEW
    cache = paged_cache(model, debug=False)
    engine = WavefrontEngine(model, cache, mode="pipeline", draft_loops=d, num_speculative_tokens=1, input_ids=ids,
                             attention_mask=mask, pad_token_id=PAD, max_length=max_length, eos_token_id=eos,
                             second_draft_loops=d2, **(overrides or {}))
    stopping = StoppingCriteriaList([MaxLengthCriteria(max_length)])
    if eos is not None:
        stopping.append(EosTokenCriteria(eos))
    with torch.no_grad():
        lanes = model.decode_with_lanes(ids, "pipeline", draft_loops=d, second_draft_loops=d2,
                                        cache=paged_cache(model, debug=False), attention_mask=mask,
                                        logits_processor=None, stopping_criteria=stopping, pad_token_id=PAD,
                                        max_length=max_length, **(hooks or {}))
    return engine.run(), cache, lanes


def _check(model, mask, result, cache, lanes, ref, eos=None):
    """Plain's tokens, the lane decoder's tokens and counters, the counter identities, I4."""
    torch.testing.assert_close(result.sequences, ref.sequences, atol=0, rtol=0)
    torch.testing.assert_close(lanes.sequences, ref.sequences, atol=0, rtol=0)
    counters = [{k: v for k, v in stats.to_dict().items() if k not in ("engine", "cache_fill_calls")}
                for stats in (result.stats, lanes.stats)]
    assert counters[0] == counters[1]
    committed = generated_counts(ref.sequences, mask.shape[1], NEW, eos)
    assert_counter_invariants(result.stats, committed)
    assert result.stats.second_accepted <= min(result.stats.accepted, result.stats.second_drafts)
    assert_cache_matches_ar(cache, ref.cache, mask, committed, model.config.num_hidden_layers,
                            model_depth=ouro_depth(model.config), completed=False)


@pytest.mark.parametrize(("loops", "d", "d2"), CONFIGS, ids=CONFIG_IDS)
def test_identity_with_plain_and_lanes(loops, d, d2):
    """The model's own proposals on a padded batch with an EOS that stops sequence 0 early while the others go on to
    max_new_tokens."""
    model, ids, mask = _case(5, loops, (5, 2, 7))
    eos = int(plain(model, ids, mask, NEW).sequences[0, ids.shape[1] + 5])  # sequence 0 stops at its 6th token
    ref = plain(model, ids, mask, NEW, eos_token_id=eos)
    result, cache, lanes = _runs(model, ids, mask, d, d2, eos=eos)
    _check(model, mask, result, cache, lanes, ref, eos)
    assert result.stats.second_drafts > 0


@pytest.mark.parametrize("pattern", sorted(PATTERNS))
@pytest.mark.parametrize(("loops", "d", "d2"), [CONFIGS[0], CONFIGS[2]], ids=[CONFIG_IDS[0], CONFIG_IDS[2]])
def test_forced_patterns(loops, d, d2, pattern):
    """Every outcome forced on a padded batch: sequence 0 stops at an EOS (its verification decides a live sibling:
    the EOS is the main draft's, the sibling's or neither's token, by the pattern), sequence 1 at max_new_tokens."""
    model, ids, mask = _case(6, loops, (4, 6))
    free = plain(model, ids, mask, NEW)
    eos = int(free.sequences[0, ids.shape[1] + 7])
    ref = plain(model, ids, mask, NEW, eos_token_id=eos)
    hooks, overrides = _forcing(free, mask, PATTERNS[pattern])
    result, cache, lanes = _runs(model, ids, mask, d, d2, eos=eos, hooks=hooks, overrides=overrides)
    _check(model, mask, result, cache, lanes, ref, eos)
    stats = result.stats
    assert stats.second_drafts > 0
    if pattern == "q1":
        assert stats.second_accepted == 0 and stats.rejected == 0 and stats.accepted > 0
    elif pattern == "q2":
        assert stats.second_accepted == stats.accepted == stats.verified > 0
    elif pattern == "none":
        assert stats.second_accepted == stats.accepted == 0 and stats.rejected > 0
    else:
        assert stats.second_accepted > 0 and stats.rejected > 0 and stats.accepted > stats.second_accepted


@pytest.mark.slow
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_step_compiles_whole(sampled, monkeypatch):
    """`generate(compile_core=...)` runs second proposals on the wavefront engine, whose step (sibling rows, private KV,
    promotion, re-reading; sampled: the two-candidate rule and the draws) compiles with `torch.compile(fullgraph=True)`
    (a graph break raises): the decode step and the one-cycle step of the calls that carry the prompt rows (two graphs),
    with the same tokens and counters as the eager step (sampled: seeded alike, the uniforms come from outside the
    step). Two cycles per compiled call (the default unrolls more: slower to trace, the same code)."""
    monkeypatch.setattr(engine_module, "CYCLES_PER_CALL", 2)
    model, ids, mask = _case(7, 6, (3, 5))
    settings = {"speculative_engine": "wavefront", "second_draft_loops": 4, "eos_token_id": [7, 11]}
    settings |= {"do_sample": True, "temperature": 0.8, "top_k": 20} if sampled else {}
    torch.manual_seed(0)
    eager = speculative(model, ids, mask, 8, "pipeline", 2, **settings)
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    compiled = speculative(model, ids, mask, 8, "pipeline", 2, compile_core="eager", **settings)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2
    assert compiled.speculation.engine == "wavefront"
    torch.testing.assert_close(compiled.sequences, eager.sequences, atol=0, rtol=0)
    assert compiled.speculation.to_dict() == eager.speculation.to_dict()
    assert eager.speculation.second_drafts > 0


def test_unsupported_depth():
    """With U - d2 > d (two siblings could be open at once) `generate` raises a ValueError naming the setting and the
    smallest value it allows, whatever `speculative_engine` says; the reference (`decode_with_lanes`) still runs it,
    with plain's tokens; with U - d2 <= d the wavefront engine runs."""
    model, ids, mask = _case(8, 4, (4, 6))
    for engine in ("wavefront", "auto"):
        with pytest.raises(ValueError, match=r"second_draft_loops=2 .*second_draft_loops >= 3"):
            speculative(model, ids, mask, 6, "pipeline", 1, speculative_engine=engine, second_draft_loops=2)
    out = decode_reference(model, ids, mask, 6, "pipeline", 1, second_draft_loops=2)
    assert out.sequences.tolist() == plain(model, ids, mask, 6).sequences.tolist()
    supported = speculative(model, ids, mask, 6, "pipeline", 1, second_draft_loops=3)
    assert supported.speculation.engine == "wavefront"


@pytest.mark.parametrize(("loops", "d", "d2"), [CONFIGS[0], CONFIGS[2]], ids=[CONFIG_IDS[0], CONFIG_IDS[2]])
def test_generate_with_processors(loops, d, d2):
    """Through `generate`, with the processors the engine applies on the device: the re-reading lane and a chosen
    sibling that drafts at once are processed with their own paths (the penalty's prefix), as plain decoding
    processes each position."""
    model, ids, mask = _case(9, loops, (4, 6))
    settings = {"repetition_penalty": 1.3, "min_new_tokens": 4, "eos_token_id": [3, 5]}
    ref = plain(model, ids, mask, NEW, **settings)
    out = speculative(model, ids, mask, NEW, "pipeline", d, second_draft_loops=d2, speculative_engine="wavefront",
                      **settings)
    assert out.sequences.tolist() == ref.sequences.tolist()
    assert out.speculation.engine == "wavefront" and out.speculation.second_accepted > 0


def test_sibling_writing_the_main_table_is_caught(monkeypatch):
    """The prototype's bug as a mutation: the sibling also writes its KV into the main table's slot of its position,
    where the main draft's KV lives. With the main draft kept ("q1" everywhere), its descendants then read the
    sibling's KV and the main tables keep it: the checks above must fail."""
    original = sibling.SiblingRows.attend

    def shared_slot(self, layer_idx, q, k, v, keys, values, attend):
        position = self.visible[:, 0, 0, :-1].sum(1).clamp(max=keys.shape[1] - 1)  # [B] (it sees those before it)
        active = (self.write_row < self.k_rows.shape[1] - 1)[:, None, None]  # [B, 1, 1] (the last row: masked)
        for table, new in ((keys, k), (values, v)):  # views of the pool: the writes land in the main tables
            table[self.table, position] = torch.where(active, new.to(table.dtype), table[self.table, position])
        return original(self, layer_idx, q, k, v, keys, values, attend)

    model, ids, mask = _case(6, 4, (4, 6))
    free = plain(model, ids, mask, NEW)
    hooks, overrides = _forcing(free, mask, PATTERNS["q1"])
    monkeypatch.setattr(sibling.SiblingRows, "attend", shared_slot)
    result, cache, lanes = _runs(model, ids, mask, 1, 3, hooks=hooks, overrides=overrides)
    with pytest.raises(AssertionError):
        _check(model, mask, result, cache, lanes, free)


@pytest.mark.parametrize(("loops", "d", "d2"), [CONFIGS[0], CONFIGS[1]], ids=[CONFIG_IDS[0], CONFIG_IDS[1]])
def test_compact_rows_equal_fixed_rows(loops, d, d2):
    """Eager on a CPU (`Plan.compact`) the step skips the sibling's attention in a cycle with no live sibling and the
    chosen sibling's head call in a cycle where none was chosen: the same tokens, counters and KV lengths as the fixed
    rows a compiled or CUDA step runs, over a pattern in which siblings are kept, chosen and rejected, with fewer core
    and head rows."""
    model, ids, mask = _case(6, loops, (4, 6))
    free = plain(model, ids, mask, NEW)
    _, overrides = _forcing(free, mask, PATTERNS["rotating"])
    runs = {}
    for compact in (True, False):
        cache = paged_cache(model, debug=False)
        engine = WavefrontEngine(model, cache, mode="pipeline", draft_loops=d, num_speculative_tokens=1,
                                 input_ids=ids, attention_mask=mask, pad_token_id=PAD,
                                 max_length=ids.shape[1] + NEW, second_draft_loops=d2, **overrides)
        assert engine.plan.compact
        engine.plan = replace(engine.plan, compact=compact)
        runs[compact] = (engine.run(), cache)
    (fast, fast_cache), (fixed, fixed_cache) = runs[True], runs[False]
    torch.testing.assert_close(fast.sequences, free.sequences, atol=0, rtol=0)
    torch.testing.assert_close(fixed.sequences, free.sequences, atol=0, rtol=0)
    assert fast.stats.to_dict() == fixed.stats.to_dict()
    assert fast.stats.second_accepted > 0 and fast.stats.second_drafts > fast.stats.second_accepted
    for kind in ("core", "head"):
        assert sum(fast.stats.call_rows[kind]) < sum(fixed.stats.call_rows[kind])
    for plane in range(fast_cache.num_planes):
        assert fast_cache.lengths(plane) == fixed_cache.lengths(plane)
