"""Forced rejection patterns (the prototype review's "directed executor-level tests").

docs/design.md, "Testing principles", asks for them.

`draft_hook` replaces every draft proposal: it returns the plain greedy continuation's token for "accept" and a
different token for "reject", so the verification outcome of every draft is fixed in advance. Patterns: all
rejected, all accepted, alternating, consecutive rollbacks, rejections exactly at and just before a page boundary
(page_size 4), EOS and a length stop with lanes in flight, and one sequence of a batch finishing while the others
continue. In every run:

* output == plain greedy decoding with the same settings;
* the I1 lineage checker is on (`PagedLoopCache(debug=True)` raises `LineageError` on a stale read);
* the traced outcome of every draft matches the pattern, so the pattern really was exercised;
* every row of every cycle (rejected drafts and their descendants included) equals a teacher-forced full forward
  of its own path at its position and depth;
* after the run every KV plane equals serial AR's cache for the committed tokens (I4);
* the counters obey their exact identities.
"""

from __future__ import annotations

import pytest
from recorders import StopAtWidth
from speculative_utils import (
    MODES,
    PAGE,
    check_forced_run,
    events,
    first_new_occurrence,
    forcing_hook,
    generated_counts,
    mode_params,
    plain,
    real_tokens,
    spec_case,
    speculative,
)
from transformers import StoppingCriteriaList

VOCAB = 80
NEW = 24
# The shared matrix and block K = 1 (a draft every other position, so page-end rejections start on a new round).
FORCED = mode_params([*MODES, ("block", 1, 1)])

PATTERNS = {
    "all_rejected": lambda pos, i: False,
    "all_accepted": lambda pos, i: True,
    "alternating": lambda pos, i: i % 2 == 1,
    "reject3_then_accept": lambda pos, i: i % 4 == 3,  # consecutive rollbacks
    "reject_at_page_start": lambda pos, i: pos % PAGE != 0,  # the rejected draft opens a new page
    "reject_at_page_end": lambda pos, i: pos % PAGE != PAGE - 1,  # ... fills the last slot of a page
}


def _hook(free, mask, prompts, accept):
    """A forcing hook for `accept(seq, position, i)` (i = generated index); `free` is plain greedy without eos or
    other stops, so it knows the right token of every position a draft can be made for. Returns (hook, calls)."""
    reference = [real_tokens(free.sequences, mask, s) for s in range(len(prompts))]
    calls = []
    hook = forcing_hook(reference, [len(p) for p in prompts],
                        lambda s, i: accept(s, len(prompts[s]) + i, i), VOCAB, calls)
    return hook, calls


@pytest.mark.parametrize("mode,d,k", FORCED)
@pytest.mark.parametrize("pattern", list(PATTERNS))
@pytest.mark.parametrize("lengths", [[4], [4, 7, 1]], ids=["batch1", "batch3_ragged"])
def test_forced_pattern(lengths, pattern, mode, d, k):
    if pattern == "reject_at_page_end":  # block K=1 drafts every other position: start on a rejected one
        lengths = [lengths[0] - 1, *lengths[1:]]
    model, prompts, ids, mask = spec_case(11, lengths, VOCAB)
    rule = PATTERNS[pattern]

    def accept(s, pos, i):
        return rule(pos, i)

    ref = plain(model, ids, mask, NEW)
    hook, calls = _hook(ref, mask, prompts, accept)
    out = speculative(model, ids, mask, NEW, mode, d, k, debug=True, draft_hook=hook, speculative_trace="hidden")
    check_forced_run(model, prompts, ids, mask, out, ref, [NEW] * len(prompts), accept)
    assert len(calls) == out.speculation.drafted  # the hook saw every proposal
    rejected, accepted = events(out, "reject"), events(out, "accept")
    if pattern == "all_rejected":  # every round / every position: one rejection per committed token but the last
        assert not accepted and len(rejected) == len(prompts) * (NEW - 1)
    elif pattern == "all_accepted":
        assert not rejected and out.speculation.discarded == 0
        if mode == "pipeline":  # every generated token but the last (the final target) was a draft
            assert len(accepted) == len(prompts) * (NEW - 1)
    else:
        assert accepted and rejected
    if pattern == "reject_at_page_start":  # the rollback frees a page exactly
        assert all(p % PAGE == 0 for _, p, _ in rejected) and rejected
    if pattern == "reject_at_page_end":
        assert all(p % PAGE == PAGE - 1 for _, p, _ in rejected) and rejected
    if pattern == "reject3_then_accept":  # three consecutive positions rolled back in turn
        by_seq = {s: sorted(p for q, p, _ in rejected if q == s) for s in range(len(prompts))}
        assert any(ps[j + 2] - ps[j] == 2 for ps in by_seq.values() for j in range(len(ps) - 2))


@pytest.mark.parametrize("mode,d,k", FORCED)
def test_per_sequence_patterns_in_one_batch(mode, d, k):
    """Different histories side by side in one call: one sequence accepts everything, one rejects everything, one
    rejects every third draft; rows of all three share core calls."""
    model, prompts, ids, mask = spec_case(12, [6, 2, 4], VOCAB)

    def accept(s, pos, i):
        return (True, False, i % 3 != 0)[s]

    ref = plain(model, ids, mask, NEW)
    hook, _ = _hook(ref, mask, prompts, accept)
    out = speculative(model, ids, mask, NEW, mode, d, k, debug=True, draft_hook=hook, speculative_trace="hidden")
    check_forced_run(model, prompts, ids, mask, out, ref, [NEW] * 3, accept)
    per = out.speculation.per_sequence
    assert per[0].rejected == 0 and per[1].accepted == 0 and per[2].accepted and per[2].rejected
    assert any(len({r.seq for r in cycle.rows}) == 3 for cycle in out.trace)


def _eos_case(min_index: int, batch_lengths, others_free: bool):
    """A seed whose sequence 0 emits a token for the first time at generated index >= min_index, which (if
    `others_free`) the other sequences never emit; returns (model, prompts, ids, mask, free, eos, index), `free`
    being plain greedy without eos."""
    for seed in range(20, 80):
        model, prompts, ids, mask = spec_case(seed, batch_lengths, VOCAB)
        free = plain(model, ids, mask, NEW)
        conts = [free.sequences[s, ids.shape[1]:].tolist() for s in range(len(prompts))]
        taken = set().union(*conts[1:]) if others_free and len(conts) > 1 else set()
        options = [(i, t) for t, i in first_new_occurrence(conts[0], min_index).items()
                   if t not in taken and i < NEW - 4]
        if options:
            index, eos = min(options)
            return model, prompts, ids, mask, free, eos, index
    raise AssertionError("no seed with a suitable eos token")


@pytest.mark.parametrize("mode,d,k", FORCED)
@pytest.mark.parametrize("pattern", ["all_accepted", "alternating"])
def test_eos_with_lanes_in_flight(pattern, mode, d, k):
    """EOS is committed while drafts beyond it are in flight: they are discarded, the run stops exactly where plain
    greedy stops, and the planes hold exactly the tokens before the eos."""
    model, prompts, ids, mask, free, eos, index = _eos_case(6, [5], others_free=False)
    rule = PATTERNS[pattern]

    def accept(s, pos, i):
        return rule(pos, i)

    hook, _ = _hook(free, mask, prompts, accept)
    ref = plain(model, ids, mask, NEW, eos_token_id=eos)
    assert ref.sequences.shape[1] == ids.shape[1] + index + 1 and int(ref.sequences[0, -1]) == eos
    out = speculative(model, ids, mask, NEW, mode, d, k, debug=True, draft_hook=hook, eos_token_id=eos,
                      speculative_trace="hidden")
    check_forced_run(model, prompts, ids, mask, out, ref, [index + 1], accept)
    if pattern == "all_accepted" and mode == "pipeline":  # lanes at and past the eos were in flight
        eos_position = len(prompts[0]) + index
        assert any(r.position >= eos_position for cycle in out.trace for r in cycle.rows)
        if d == 1:
            assert out.speculation.discarded > 0  # unverified drafts past the eos were dropped


@pytest.mark.parametrize("mode,d,k", FORCED)
@pytest.mark.parametrize("pattern", ["all_accepted", "alternating", "all_rejected"])
def test_one_sequence_finishes_while_others_continue(pattern, mode, d, k):
    """Sequence 0 emits eos early; sequences 1 and 2 never do and run to max_new_tokens. Plain decoding pads the
    finished row; so must speculation. The finished sequence's planes hold exactly its tokens before the eos."""
    model, prompts, ids, mask, free, eos, index = _eos_case(3, [4, 7, 2], others_free=True)
    rule = PATTERNS[pattern]

    def accept(s, pos, i):
        return rule(pos, i)

    hook, _ = _hook(free, mask, prompts, accept)
    ref = plain(model, ids, mask, NEW, eos_token_id=eos)
    committed = generated_counts(ref.sequences, ids.shape[1], NEW, eos)
    assert committed == [index + 1, NEW, NEW]
    out = speculative(model, ids, mask, NEW, mode, d, k, debug=True, draft_hook=hook, eos_token_id=eos,
                      speculative_trace="hidden")
    check_forced_run(model, prompts, ids, mask, out, ref, committed, accept)
    assert (out.sequences[0, ids.shape[1] + index + 1:] == 0).all()


@pytest.mark.parametrize("mode,d,k", FORCED)
@pytest.mark.parametrize("stop_after", [1, 2, 5, 13])
def test_length_stop_mid_wavefront(stop_after, mode, d, k):
    """A stopping criterion ends the run after `stop_after` tokens, with the pipeline full of accepted drafts."""
    model, prompts, ids, mask = spec_case(13, [5, 3], VOCAB)

    def accept(s, pos, i):
        return True

    hook, _ = _hook(plain(model, ids, mask, NEW), mask, prompts, accept)
    stop = StoppingCriteriaList([StopAtWidth(ids.shape[1] + stop_after)])
    ref = plain(model, ids, mask, NEW, stopping_criteria=stop)
    assert ref.sequences.shape[1] == ids.shape[1] + stop_after
    out = speculative(model, ids, mask, NEW, mode, d, k, debug=True, draft_hook=hook, stopping_criteria=stop,
                      speculative_trace="hidden")
    check_forced_run(model, prompts, ids, mask, out, ref, [stop_after] * 2, accept)
    if mode == "pipeline" and d == 1:
        assert out.speculation.discarded > 0  # drafts were still in flight at the stop


@pytest.mark.parametrize("mode,d,k", FORCED)
@pytest.mark.parametrize("max_new", [1, 2, 3, 6, 7])
@pytest.mark.parametrize("pattern", ["all_accepted", "alternating"])
def test_max_new_tokens_edges(pattern, max_new, mode, d, k):
    """max_new_tokens cuts a block round short (K=4, 7 tokens: 5 + 2) or ends the pipeline in its ramp-up."""
    model, prompts, ids, mask = spec_case(14, [4, 6], VOCAB)
    rule = PATTERNS[pattern]

    def accept(s, pos, i):
        return rule(pos, i)

    ref = plain(model, ids, mask, max_new)
    hook, _ = _hook(ref, mask, prompts, accept)
    out = speculative(model, ids, mask, max_new, mode, d, k, debug=True, draft_hook=hook, speculative_trace="hidden")
    check_forced_run(model, prompts, ids, mask, out, ref, [max_new] * 2, accept)
    # no draft is ever made for a position whose token is never fed back
    assert all(r.position <= len(prompts[r.seq]) + max_new - 2 for cycle in out.trace for r in cycle.rows)
