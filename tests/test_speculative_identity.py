"""fp32 token identity of self-speculative decoding with plain greedy decoding.

What is compared and why: docs/design.md, "Testing principles".

The matrix: 15 seeds x 40 new tokens x U in {2, 3, 4} loops x {three ragged left-padded prompts per seed: every
valid (mode, draft_loops d, num_speculative_tokens K) (pipeline: U % d == 0; block: K in {1, 2, 4, 8}; always
1 <= d < U); one unpadded prompt per seed: every pipeline setting and block at K in {1, 4}}. Padding is what the
unpadded shape leaves out, not a setting: the ragged shape runs every setting with and beside padding, and the
unpadded one runs each mode and depth, one and several drafts per round, with none (block at K = 2 and 8, the
longest calls of the matrix, are left to the ragged shape). Each damping gets 5 seeds, whose ragged prompt lengths
(`BATCHES`) take every combination the shape has for that damping once. The seeds of one damping are decoded
together as one batch
(the decoder keeps sequences apart, so each seed's rows are an independent check); plain greedy (transformers'
loop on a DynamicCache) runs once per batch and every combination is compared with it. Each run also checks the
counter identities and that every KV plane equals the serial AR cache (I4). Literal batch-size-1 calls are
covered by `test_batch_of_one`.

Three residual dampings (see `tiny_spec_model`): undamped random models accept almost no drafts, damped ones
accept many, so the matrix sees both long rejection chains and long accepted runs.

On a mismatch the failure message names the first divergent token with its teacher-forced logit margin and
the first cycle / depth where the traced hidden states leave the teacher-forced serial reference.

The matrix runs with the I1 lineage checker off (it slows every cycle down; every forced-pattern, counter and
processor test runs with it on, and the I4 comparison here would catch stale KV that changed any stored entry).
"""

from __future__ import annotations

import time

import pytest
import torch
from inputs import left_pad, random_prompts
from speculative_utils import (
    BATCHES,
    MODE_PAIR,
    MODES,
    assert_cache_matches_ar,
    assert_counter_invariants,
    block_rounds,
    divergence_report,
    generated_counts,
    mode_params,
    plain,
    spec_case,
    speculative,
    tiny_spec_model,
    trace_divergence,
)
from tolerances import ouro_depth

# prompt seeds per (U, batch shape); every seed is checked against every valid (mode, d, K). Seed s goes to damping
# s % 3, so each damping's 5 seeds have the ragged shape's first length 3 + s % 5 once for each residue mod 5.
SEEDS = 15
NEW = 40
VOCAB = 96
DAMPS = (1.0, 0.2, 0.04)  # one model per damping: acceptance from ~0.05 (undamped, U=4) to ~0.8


def combos(loops: int) -> list[tuple[str, int, int | None]]:
    """Every valid (mode, d, K) for a U-loop model."""
    out = [("pipeline", d, None) for d in (1, 2) if d < loops and loops % d == 0]
    out += [("block", d, k) for d in (1, 2) if d < loops for k in (1, 2, 4, 8)]
    return out


def unpadded_combos(loops: int) -> list[tuple[str, int, int | None]]:
    """The settings of the unpadded shape (module docstring): every pipeline setting, block at K in {1, 4}."""
    return [(mode, d, k) for mode, d, k in combos(loops) if k in (None, 1, 4)]


def test_combos_cover_the_matrix():
    assert combos(2) == [("pipeline", 1, None)] + [("block", 1, k) for k in (1, 2, 4, 8)]
    assert ("pipeline", 2, None) not in combos(3) and len(combos(3)) == 9
    assert len(combos(4)) == 10
    for loops in (2, 3, 4):  # the unpadded shape: every mode and depth, one and several drafts per block round
        assert {(m, d) for m, d, _ in unpadded_combos(loops)} == {(m, d) for m, d, _ in combos(loops)}
        assert {k for m, _, k in unpadded_combos(loops) if m == "block"} == {1, 4}
    for group in range(len(DAMPS)):  # each damping's seeds take every ragged prompt shape of that damping once
        shapes = [tuple(BATCHES["ragged3"](seed, group)) for seed in range(group, SEEDS, len(DAMPS))]
        assert len(set(shapes)) == len(shapes) == 5


@pytest.mark.slow
@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("loops", [2, 3, 4])
def test_token_identity_matrix(loops, batch):
    """15 seeds x 40 new tokens x the shape's settings (module docstring), for one U and one batch shape.

    The lane decoder keeps every sequence of a batch apart (own lanes, own block tables; rows share only the core
    call), so the seeds of one damping are decoded as the sequences of one batch: each seed's rows are an
    independent check, at a fraction of the cost of one call per seed. `test_batch_of_one` covers literal
    batch-size-1 calls.
    """
    start, cpu = time.perf_counter(), time.process_time()
    failures, accepted, verified, runs = [], 0, 0, 0
    for group, damp in enumerate(DAMPS):
        model = tiny_spec_model(1000 * loops + group, loops, vocab=VOCAB, damp=damp)
        seeds = range(group, SEEDS, len(DAMPS))
        prompts = [p for seed in seeds for p in random_prompts(seed, BATCHES[batch](seed, group), VOCAB)]
        ids, mask = left_pad(prompts)
        ref = plain(model, ids, mask, NEW)
        committed = generated_counts(ref.sequences, ids.shape[1], NEW, eos=None)
        assert committed == [NEW] * ids.shape[0]
        for mode, d, k in combos(loops) if batch == "ragged3" else unpadded_combos(loops):
            out = speculative(model, ids, mask, NEW, mode, d, k, debug=False)
            runs += len(seeds)
            label = f"(U={loops}, {batch}, damp={damp}, seeds={list(seeds)}, mode={mode}, d={d}, K={k})"
            if not torch.equal(out.sequences, ref.sequences):
                traced = speculative(model, ids, mask, NEW, mode, d, k, speculative_trace="hidden")
                failures.append(divergence_report(model, ids, mask, ref.sequences, traced, label))
                continue
            assert_counter_invariants(out.speculation, committed)
            assert_cache_matches_ar(out.cache, ref.cache, mask, committed, model.config.num_hidden_layers,
                                    model_depth=ouro_depth(model.config))
            accepted += out.speculation.accepted
            verified += out.speculation.verified
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    print(f"\n[identity U={loops} {batch}] {runs} seed runs in {elapsed:.1f}s wall, {cpu:.1f}s cpu, acceptance "
          f"{accepted}/{verified}")
    assert not failures, "\n".join(failures[:5]) + f"\n({len(failures)} mismatching calls)"
    assert accepted > 0.3 * verified  # the damped models really exercise accepted runs


@pytest.mark.parametrize("loops", [2, 3, 4])
def test_batch_of_one(loops):
    """Literal batch-size-1 calls: every valid (mode, d, K) once on the engine, on one seed per damping in turn (the
    i-th setting on seed i % 3), so every damping and every setting is seen at batch size 1; on seed 0 (undamped: long
    rejection chains) the reference runs its settings too, with its lineage checks."""
    settings = combos(loops)
    for seed in range(len(DAMPS)):
        model = tiny_spec_model(500 * loops + seed, loops, vocab=VOCAB, damp=DAMPS[seed])
        ids, mask = left_pad(random_prompts(seed, [2 + seed % 7], VOCAB))
        ref = plain(model, ids, mask, NEW)
        runs = [(*setting, debug) for setting in settings[seed:: len(DAMPS)] for debug in {False, seed == 0}]
        for mode, d, k, debug in runs:
            out = speculative(model, ids, mask, NEW, mode, d, k, debug=debug)
            label = f"(U={loops}, batch 1, seed={seed}, mode={mode}, d={d}, K={k}, engine={out.speculation.engine})"
            if not torch.equal(out.sequences, ref.sequences):
                traced = speculative(model, ids, mask, NEW, mode, d, k, speculative_trace="hidden")
                pytest.fail(divergence_report(model, ids, mask, ref.sequences, traced, label))
            assert out.speculation.engine == ("lanes" if debug else "wavefront")
            assert_counter_invariants(out.speculation, [NEW])


# the matrix, with d = 2 block rounds of K = 8 drafts (two pages) in place of K = 2: long accepted runs need long rounds
@pytest.mark.parametrize("mode,d,k", mode_params([(m, d, 8 if (m, d) == ("block", 2) else k) for m, d, k in MODES]))
def test_agreeing_model_long_accepted_runs(mode, d, k):
    """A model whose loops agree (damped residual branches): most drafts are accepted (long accepted runs, many
    lanes in flight at once) and the output is unchanged."""
    model = tiny_spec_model(11, 4, vocab=VOCAB, damp=0.03)
    ids, mask = left_pad(random_prompts(11, [6, 2, 4], VOCAB))
    ref = plain(model, ids, mask, 60)
    out = speculative(model, ids, mask, 60, mode, d, k)
    torch.testing.assert_close(out.sequences, ref.sequences, atol=0, rtol=0)
    stats = out.speculation
    assert stats.acceptance_rate > 0.8, stats.to_dict()
    # at least 80% of the drafts a run that accepts everything verifies (pipeline: one per token but the last)
    most = 3 * (59 if mode == "pipeline" else sum(block_rounds(60, k, accept=True)))
    assert stats.accepted >= 0.8 * most, (stats.accepted, most)
    assert_counter_invariants(stats, [60, 60, 60])
    assert_cache_matches_ar(out.cache, ref.cache, mask, [60, 60, 60], model.config.num_hidden_layers,
                            model_depth=ouro_depth(model.config))


@pytest.mark.parametrize("mode,d,k", mode_params(MODE_PAIR))
def test_traced_hidden_states_equal_teacher_forced_reference(mode, d, k):
    """Every row of every cycle (drafts, rejected drafts and their descendants included) outputs what a
    teacher-forced full forward of its own path gives at its position and depth (docs/design.md, "Testing
    principles": compare at the first affected cycle, not only final tokens)."""
    model, prompts, ids, mask = spec_case(3, [5, 2, 7], VOCAB, damp=0.15)
    ref = plain(model, ids, mask, NEW)
    out = speculative(model, ids, mask, NEW, mode, d, k, speculative_trace="hidden")
    torch.testing.assert_close(out.sequences, ref.sequences, atol=0, rtol=0)
    assert out.speculation.rejected > 0 and out.speculation.accepted > 0  # both kinds of history are traced
    assert trace_divergence(model, out, [p.tolist() for p in prompts]) is None


def test_divergence_diagnostic_points_at_the_first_bad_row():
    """The diagnostic itself: a perturbed traced hidden state is reported at its cycle, position and depth, and a
    perturbed output token is reported with its teacher-forced logit margin."""
    model, prompts, ids, mask = spec_case(5, [4, 6], VOCAB, damp=0.15)
    ref = plain(model, ids, mask, 12)
    out = speculative(model, ids, mask, 12, "pipeline", 1, speculative_trace="hidden")
    assert trace_divergence(model, out, [p.tolist() for p in prompts]) is None
    c, n = len(out.trace) // 2, 1
    row = out.trace[c].rows[n]
    out.trace[c].hidden[n, 0] += 1e-2
    found = trace_divergence(model, out, [p.tolist() for p in prompts])
    assert found is not None
    assert (found["cycle"], found["seq"], found["position"], found["depth"]) == (c, row.seq, row.position, row.depth)
    out.trace[c].hidden[n, 0] -= 1e-2
    out.sequences = out.sequences.clone()
    out.sequences[1, -3] = (out.sequences[1, -3] + 1) % VOCAB
    report = divergence_report(model, ids, mask, ref.sequences, out)
    position = ids.shape[1] - 3 + 12 - int((mask[1] == 0).sum())
    assert f"seq 1: first divergent token at position {position}" in report and "margin" in report
    assert "seq 0" not in report
