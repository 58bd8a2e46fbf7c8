"""Second proposals (`second_draft_loops=d2`, pipeline): sibling lanes with branch-private KV.

The invariant they rest on: docs/design.md, "I5 (branches)".

The prototype review's demands, on the real lane decoder and paged cache:

* The B/C interleavings forced deterministically: `draft_hook` sets the main-path draft B of every position and
  `second_draft_hook` the sibling C, so each verification's outcome is fixed in advance: "q1" (B right, C a
  different wrong token: B accepted, C's branch dropped), "q2" (B wrong, C right: the sibling is chosen and its
  branch becomes the main path) or "none" (both wrong: rollback and restart). Patterns mix them, with sibling
  branches that open a new page or share a partly filled one, consecutive rollbacks, EOS and length stops while
  both branches hold live descendants.
* Every run: tokens == plain greedy; the lineage checker on (`PagedLoopCache(debug=True)`: every read of every
  row, on either branch, checked against its own ancestry); every traced row equal to a teacher-forced forward of
  its own path; every KV plane equal to serial AR's after the run (I4); no page or branch slot left behind; the
  counter identities, and the closed forms of core calls for the pure patterns.
* A mutation (siblings writing one shared slot, the prototype's bug) is caught by the lineage checker.
"""

from __future__ import annotations

import pytest
import torch
from inputs import left_pad, random_prompts
from recorders import StopAtWidth
from sampling_utils import (
    ALPHA,
    PROCESSOR_SETTINGS,
    SAMPLES,
    chi_square_p_value,
    exact_joint,
    pair_counts,
)
from sampling_utils import PROMPT as SAMPLING_PROMPT
from speculative_utils import (
    BATCHES,
    PAGE,
    assert_cache_matches_ar,
    assert_counter_invariants,
    check_forced_run,
    decode_reference,
    events,
    first_new_occurrence,
    paged_cache,
    pipeline_calls,
    plain,
    real_tokens,
    spec_case,
    tiny_spec_model,
)
from tolerances import ouro_depth
from transformers import GenerationConfig, StoppingCriteriaList

from hf_loopspec.cache.paged import LineageError, PagedLoopCache
from hf_loopspec.trace_plot import schedule_grid

VOCAB = 80
NEW = 20
CONFIGS = [(1, 2), (1, 3), (2, 3)]  # (draft_loops d, second_draft_loops d2) of a 4-loop model
CONFIG_IDS = [f"d{d}-d2{d2}" for d, d2 in CONFIGS]

# outcome of the verification of generated token i at position pos: "q1", "q2" or "none"
PATTERNS = {
    "q1": lambda pos, i: "q1",
    "q2": lambda pos, i: "q2",
    "none": lambda pos, i: "none",
    "rotating": lambda pos, i: ("q1", "q2", "none")[i % 3],
    "rollbacks_then_q2": lambda pos, i: "q2" if i % 4 == 3 else "none",  # consecutive rollbacks
    "q2_opens_page": lambda pos, i: "q2" if pos % PAGE == 0 else "q1",  # the chosen branch starts a new page
    "q2_mid_page": lambda pos, i: "q2" if pos % PAGE == 2 else "none",  # ... shares a partly filled one
}


def second_calls(n: int, loops: int, d: int, d2: int, rejected: int, chosen: int) -> int:
    """Core calls of a batch-1 pipeline run of n tokens with second proposals (2 d2 >= U): U + (n - 1) d when every
    main draft is accepted (`pipeline_calls`); each verification that rejects both candidates restarts its position
    at depth 0, U - d calls later than an accepted draft would have gone on; each that chooses the sibling goes on
    from a lane spawned d2 - d calls after the draft (the sibling drafted further, so nothing else is late)."""
    return loops + (n - 1) * d + (loops - d) * rejected + (d2 - d) * chosen


def _hooks(free, mask, prompts, outcome):
    """`draft_hook` and `second_draft_hook` forcing `outcome(seq, position, i)`; `free` is plain greedy without stops,
    so it knows the right token of every position a draft can be made for. Wrong tokens differ from the right one
    and from each other."""
    reference = [real_tokens(free.sequences, mask, s) for s in range(len(prompts))]

    def which(s, pos):
        return outcome(s, pos, pos - len(prompts[s]))

    def first(s, pos, proposed):
        right = reference[s][pos]
        return right if which(s, pos) == "q1" else (right + 1) % VOCAB

    def second(s, pos, first_token, proposed):
        right = reference[s][pos]
        return right if which(s, pos) == "q2" else (right + 2) % VOCAB

    return {"draft_hook": first, "second_draft_hook": second}


def _run(model, ids, mask, max_new, d, d2, hooks, **kwargs):
    return decode_reference(model, ids, mask, max_new, "pipeline", d, second_draft_loops=d2,
                            speculative_trace="hidden", **hooks, **kwargs)


def check_second_run(model, prompts, ids, mask, out, ref, committed, outcome=None):
    """`check_forced_run`'s checks (with a forced `outcome`: the main-path draft B is accepted exactly for "q1", the
    sibling chosen exactly for "q2"), and no page or branch slot outlives the run."""
    accept = None if outcome is None else (lambda s, p, i: outcome(s, p, i) == "q1")
    check_forced_run(model, prompts, ids, mask, out, ref, committed, accept)
    if outcome is not None:
        chosen = events(out, "accept_second")
        assert all(outcome(s, p, p - len(prompts[s])) == "q2" for s, p, _ in chosen)
        assert len(chosen) == out.speculation.second_accepted
    assert_released(out, len(prompts))


def assert_released(out, batch: int) -> None:
    """Nothing of a branch outlives the run, and the second-proposal counters are consistent."""
    stats = out.speculation
    assert stats.second_accepted <= min(stats.accepted, stats.second_drafts)
    cache = out.cache
    assert cache.num_sequences == batch  # branch slots are gone
    held = sum(-(-cache.length(s, p) // PAGE) for s in range(batch) for p in range(cache.num_planes))
    assert cache.pages_in_use == held  # the losing branches' pages were released


def _both_branches_live(out) -> bool:
    """Whether some cycle ran descendants on both branches of one position: a sibling branch's row past its sibling's
    position next to a main-path row at the same position."""
    for cycle in out.trace:
        sibling_at = {}  # branch -> its sibling's position (the sibling runs as long as its branch lives)
        for r in cycle.rows:
            if r.branch:
                sibling_at[r.branch] = min(sibling_at.get(r.branch, r.position), r.position)
        deep = {(r.seq, r.position) for r in cycle.rows if r.branch and r.position > sibling_at[r.branch]}
        if any(not r.branch and (r.seq, r.position) in deep for r in cycle.rows):
            return True
    return False


# every pattern with d = 1, d2 = 2 (branches live two calls beside the main path); the pure ones and the mix for
# the other depths (suite time)
FORCED = [(p, 1, 2) for p in PATTERNS] + [(p, d, d2) for d, d2 in CONFIGS[1:] for p in ("q2", "none", "rotating")]


@pytest.mark.parametrize("pattern,d,d2", FORCED, ids=[f"{p}-d{d}-d2{d2}" for p, d, d2 in FORCED])
def test_forced_second_pattern(pattern, d, d2):
    lengths = [5, 2] if pattern in ("rotating", "q2_mid_page") else [5]
    model, prompts, ids, mask = spec_case(31, lengths, VOCAB)
    rule = PATTERNS[pattern]

    def outcome(s, pos, i):
        return rule(pos, i)

    ref = plain(model, ids, mask, NEW)
    out = _run(model, ids, mask, NEW, d, d2, _hooks(ref, mask, prompts, outcome))
    check_second_run(model, prompts, ids, mask, out, ref, [NEW] * len(prompts), outcome)
    stats, b = out.speculation, len(prompts)
    if pattern == "q1":  # siblings spawned and always dropped; the schedule is plain pipeline's
        assert stats.second_drafts >= b * (NEW - 1) and stats.second_accepted == 0 and stats.rejected == 0
        assert stats.core_calls == pipeline_calls(NEW, 4, d, accept=True)
    elif pattern == "q2":  # every position's sibling is chosen: the next token's lane starts d2 - d calls late
        assert stats.second_accepted == stats.accepted == stats.verified == b * (NEW - 1)
        assert stats.core_calls == (NEW - 1) * d2 + 4
    elif pattern == "none":  # both rejected everywhere: U calls per token, as without speculation
        assert stats.rejected == stats.verified == b * (NEW - 1) and stats.second_accepted == 0
        assert stats.core_calls == pipeline_calls(NEW, 4, d, accept=False)
    else:
        assert stats.second_accepted and bool(stats.rejected) == (pattern != "q2_opens_page")
    if b == 1:
        assert stats.core_calls == second_calls(NEW, 4, d, d2, stats.rejected, stats.second_accepted)
    if pattern in ("q2", "rotating") and (d, d2) == (1, 2):  # a branch lives U - d2 = 2 calls: long enough
        assert _both_branches_live(out)


def _eos_case(min_index: int):
    """A seed whose plain continuation of one prompt emits a token first at index >= min_index (taken as eos)."""
    for seed in range(40, 90):
        model, prompts, ids, mask = spec_case(seed, [5], VOCAB)
        free = plain(model, ids, mask, NEW)
        options = [(i, t) for t, i in first_new_occurrence(free.sequences[0, ids.shape[1]:].tolist(),
                                                           min_index).items() if i < NEW - 4]
        if options:
            index, eos = min(options)
            return model, prompts, ids, mask, free, eos, index
    raise AssertionError("no seed with a suitable eos token")


@pytest.mark.parametrize("chosen", ["q1", "q2", "none"])
def test_eos_with_descendants_on_both_branches(chosen):
    """The eos token is committed by a verification whose position holds both candidates, each with live
    descendants (d=1, d2=2); every position before it chooses the sibling. The run stops where plain greedy stops,
    and both branches' lanes and pages are dropped."""
    model, prompts, ids, mask, free, eos, index = _eos_case(6)
    eos_position = len(prompts[0]) + index

    def outcome(s, pos, i):
        return chosen if pos == eos_position else "q2"

    ref = plain(model, ids, mask, NEW, eos_token_id=eos)
    assert int(ref.sequences[0, -1]) == eos
    out = _run(model, ids, mask, NEW, 1, 2, _hooks(free, mask, prompts, outcome), eos_token_id=eos)
    check_second_run(model, prompts, ids, mask, out, ref, [index + 1], outcome)
    commit_cycle = next(c for c, cycle in enumerate(out.trace) if ("commit", 0, eos_position, eos) in cycle.events) \
        if chosen != "none" else len(out.trace) - 1
    rows = out.trace[commit_cycle].rows  # the last call: descendants past the eos on both branches
    assert any(r.branch and r.position > eos_position for r in rows)
    assert any(not r.branch and r.position > eos_position for r in rows)


@pytest.mark.parametrize("stop_after", [2, 7])
def test_length_stop_with_descendants_on_both_branches(stop_after):
    """A stopping criterion the decoder cannot foresee ends the run while siblings and their drafts are in flight."""
    model, prompts, ids, mask = spec_case(33, [5, 3], VOCAB)

    def outcome(s, pos, i):
        return ("q2", "q1")[i % 2]

    free = plain(model, ids, mask, NEW)
    stop = StoppingCriteriaList([StopAtWidth(ids.shape[1] + stop_after)])
    ref = plain(model, ids, mask, NEW, stopping_criteria=stop)
    out = _run(model, ids, mask, NEW, 1, 2, _hooks(free, mask, prompts, outcome), stopping_criteria=stop)
    check_second_run(model, prompts, ids, mask, out, ref, [stop_after] * 2, outcome)
    last = out.trace[-1].rows
    assert any(r.branch for r in last) and any(not r.branch and r.position > len(prompts[r.seq]) + stop_after - 1
                                                 for r in last)


IDENTITY = [(4, d, d2) for d, d2 in CONFIGS] + [(3, 1, 2)]  # (U, d, d2): every valid pair for U = 3 and 4


@pytest.mark.parametrize("loops,d,d2", IDENTITY, ids=[f"U{u}-d{d}-d2{d2}" for u, d, d2 in IDENTITY])
@pytest.mark.parametrize("damp", [1.0, 0.1])
def test_identity_with_real_second_proposals(damp, loops, d, d2):
    """No hooks: the model's own depth-d and depth-d2 proposals, on an undamped random model (drafts mostly wrong,
    siblings often spawned and sometimes chosen) and a damped one (whose loops agree: drafts mostly right), for
    two seeds' ragged batches of the identity matrix (`speculative_utils.BATCHES`) decoded together, 40
    new tokens. Tokens equal plain greedy, the counters keep their identities, every plane equals serial AR's,
    nothing of a branch is left behind. (Lineage checker off, as in the identity matrix: every other test here runs
    with it on.)"""
    model = tiny_spec_model(60 + loops, loops, vocab=VOCAB, damp=damp)
    prompts = [p for seed in range(2) for p in random_prompts(seed, BATCHES["ragged3"](seed, 0), VOCAB)]
    ids, mask = left_pad(prompts)
    ref = plain(model, ids, mask, 40)
    out = decode_reference(model, ids, mask, 40, "pipeline", d, second_draft_loops=d2)  # the engine's identity:
    # test_wavefront_second.py
    assert out.sequences.tolist() == ref.sequences.tolist()
    assert_counter_invariants(out.speculation, [40] * len(prompts))
    assert_cache_matches_ar(out.cache, ref.cache, mask, [40] * len(prompts), model.config.num_hidden_layers,
                            model_depth=ouro_depth(model.config))
    assert_released(out, len(prompts))
    assert out.speculation.second_drafts > 0


def test_siblings_sharing_one_slot_is_caught(monkeypatch):
    """The prototype's bug as a mutation: copy on write is switched off, so a sibling's first write into the page it
    shares with the main path lands in the slot the main path's lanes read. The lineage checker must raise."""
    model, prompts, ids, mask = spec_case(31, [5], VOCAB)
    ref = plain(model, ids, mask, NEW)
    hooks = _hooks(ref, mask, prompts, lambda s, p, i: "q1")  # siblings everywhere, most inside a page
    original = PagedLoopCache._writable_page

    def shared_page(self, table, index, like):
        pages = self._pages[table]
        if index < len(pages) and self._refs[pages[index]] > 1:
            return pages[index]  # the mutation: write into the shared page instead of a copy
        return original(self, table, index, like)

    monkeypatch.setattr(PagedLoopCache, "_writable_page", shared_page)
    with pytest.raises(LineageError, match="I1 violated"):
        _run(model, ids, mask, NEW, 1, 2, hooks)


def test_schedule_shows_siblings():
    model, prompts, ids, mask = spec_case(31, [5], VOCAB)
    ref = plain(model, ids, mask, NEW)
    out = decode_reference(model, ids, mask, NEW, "pipeline", 1, second_draft_loops=2, speculative_trace=True,
                           **_hooks(ref, mask, prompts, lambda s, p, i: PATTERNS["rotating"](p, i)))
    grid = schedule_grid(out.trace, num_loops=4)
    chosen = [c for c in grid.cells if c.kind == "second_accepted"]
    assert len([c for c in chosen if c.depth == 0]) == out.speculation.second_accepted > 0
    assert any(c.kind == "second" for c in grid.cells)  # dropped siblings
    assert sum(grid.commits) == NEW


def test_generation_config_key():
    model, prompts, ids, mask = spec_case(32, [4, 6], VOCAB)
    ref = plain(model, ids, mask, 12)
    config = GenerationConfig(speculative_mode="pipeline", draft_loops=1, second_draft_loops=3, max_new_tokens=12,
                              do_sample=False, pad_token_id=0, return_dict_in_generate=True)
    out = model.generate(ids, attention_mask=mask, generation_config=config, cache=paged_cache(model))
    assert out.sequences.tolist() == ref.sequences.tolist() and out.speculation.second_drafts > 0


# --- sampling: recursive rejection over the two candidates --------------------------------------------------------


@pytest.mark.parametrize(("d", "d2", "settings"), [(1, 3, "warped")])
def test_sampled_joint_distribution_with_second_proposals(sampling_model, d, d2, settings):
    """Two sampled tokens per row, 3000 rows: their joint distribution equals plain sampling's (exact, from full
    forwards, after temperature, top-k and repetition penalty), with siblings spawned and chosen along the way, on
    the engine (`rules.second_candidate`).
    Power: with the replacement drawn from the first residual instead of the second, this test's p-value was 4e-31
    (and 3e-11 with d2 = 2 and no processors), measured once by patching the lane decoder's `rules.second_candidate`."""
    torch.manual_seed(3)
    ids = torch.tensor([SAMPLING_PROMPT] * SAMPLES)
    out = sampling_model.generate(ids, max_new_tokens=2, do_sample=True, top_p=1.0, speculative_mode="pipeline",
                                  draft_loops=d, second_draft_loops=d2, return_dict_in_generate=True,
                                  speculative_engine="wavefront", **PROCESSOR_SETTINGS[settings])
    counts = pair_counts(out.sequences)
    assert chi_square_p_value(counts, exact_joint(sampling_model, PROCESSOR_SETTINGS[settings])) > ALPHA
    stats = out.speculation
    assert stats.second_drafts > 100 and stats.second_accepted > 10 and stats.rejected > 10
    assert out.cache.num_sequences == SAMPLES
