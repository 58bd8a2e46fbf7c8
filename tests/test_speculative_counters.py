"""`out.speculation` counters: exact identities in every run, and exact core-call counts under forced patterns.

The closed forms (`speculative_utils.pipeline_calls`, `block_calls`) are derived from docs/design.md, "Cost model",
not read off the decoder; they count every call of the shared stack, prefill included (the prompt enters as lanes at
depth 0, so prefill is part of the first cycles). N = max_new_tokens, U = loops, d = draft_loops,
K = num_speculative_tokens.
"""

from __future__ import annotations

import pytest
import torch
from inputs import left_pad, random_prompts
from speculative_utils import (
    assert_counter_invariants,
    block_calls,
    block_rounds,
    events,
    forcing_hook,
    generated_counts,
    mode_params,
    pipeline_calls,
    plain,
    real_tokens,
    speculative,
    tiny_spec_model,
)

VOCAB = 64


def test_closed_forms_by_hand():
    assert pipeline_calls(40, 4, 1, True) == 43 and pipeline_calls(40, 4, 2, False) == 160
    assert block_rounds(10, 4, True) == [4, 4] and block_rounds(11, 4, True) == [4, 4, 0]
    assert block_rounds(3, 4, False) == [2, 1, 0]
    assert block_calls(11, 4, 1, 4, True) == 8 + 8 + 4  # (4+1)*1+3 twice, then one plain U-call round
    assert block_calls(1, 4, 2, 8, True) == 4  # a single token: prefill's U calls, nothing to draft


CASES = [(u, "pipeline", d, None) for u in (2, 3, 4) for d in (1, 2) if d < u and u % d == 0]
CASES += [(u, "block", d, k) for u in (2, 3, 4) for d in (1, 2) if d < u for k in (1, 3, 8)]


@pytest.mark.parametrize("n", [1, 2, 7, 30])
@pytest.mark.parametrize("accept", [True, False], ids=["all_accepted", "all_rejected"])
@pytest.mark.parametrize("loops,mode,d,k", CASES)
@pytest.mark.parametrize("lengths", [[5], [5, 2, 8]], ids=["batch1", "batch3_ragged"])
def test_core_calls_closed_form(lengths, loops, mode, d, k, accept, n):
    """Exact core calls under forced all-accept / all-reject. With a batch (no eos) every sequence goes through the
    same schedule in lockstep and the rows of all sequences share each call, so the count is the batch-1 count."""
    model = tiny_spec_model(21 + loops, loops, vocab=VOCAB)
    prompts = random_prompts(21, lengths, VOCAB)
    ids, mask = left_pad(prompts)
    ref = plain(model, ids, mask, n)
    reference = [real_tokens(ref.sequences, mask, s) for s in range(len(prompts))]
    hook = forcing_hook(reference, [len(p) for p in prompts], lambda s, i: accept, VOCAB)
    out = speculative(model, ids, mask, n, mode, d, k, draft_hook=hook, debug=False)
    torch.testing.assert_close(out.sequences, ref.sequences, atol=0, rtol=0)
    stats = out.speculation
    assert_counter_invariants(stats, [n] * len(prompts))
    expected = pipeline_calls(n, loops, d, accept) if mode == "pipeline" else block_calls(n, loops, d, k, accept)
    assert stats.core_calls == expected
    assert stats.core_calls_per_token == expected / n  # per token of one sequence
    for s in stats.per_sequence:
        if mode == "pipeline":  # one draft per position n-1 positions: verified all; accepted or rejected all
            assert s.verified == n - 1
        else:
            rounds = block_rounds(n, k, accept)
            assert s.verified == (sum(rounds) if accept else sum(r > 0 for r in rounds))
        assert (s.accepted, s.rejected) == ((s.verified, 0) if accept else (0, s.verified))
        if accept:
            assert s.discarded == 0 and s.drafted == s.verified


@pytest.mark.parametrize("mode,d,k", mode_params())
def test_counters_with_free_drafts_and_eos(mode, d, k):
    """Unforced drafts (a model whose loops agree often, so runs mix acceptances and rejections) and a batch in
    which one sequence stops at eos: the identities hold per sequence, committed counts equal the plain output's
    generated lengths, and the traced accept / reject events agree with the per-sequence counters."""
    model = tiny_spec_model(31, 4, vocab=VOCAB, damp=0.15)
    ids, mask = left_pad(random_prompts(31, [6, 3, 9], VOCAB))
    free = plain(model, ids, mask, 30)
    cont = free.sequences[0, ids.shape[1]:].tolist()
    eos = cont[10]
    ref = plain(model, ids, mask, 30, eos_token_id=eos)
    committed = generated_counts(ref.sequences, ids.shape[1], 30, eos)
    assert committed[0] == cont.index(eos) + 1 and min(committed) < 30
    out = speculative(model, ids, mask, 30, mode, d, k, eos_token_id=eos, speculative_trace=True)
    torch.testing.assert_close(out.sequences, ref.sequences, atol=0, rtol=0)
    assert_counter_invariants(out.speculation, committed)
    stats = out.speculation
    assert stats.accepted > 0 and stats.rejected > 0
    for s, per in enumerate(stats.per_sequence):
        assert per.accepted == sum(1 for q, _, _ in events(out, "accept") if q == s)
        assert per.rejected == sum(1 for q, _, _ in events(out, "reject") if q == s)
        commits = [(p, t) for q, p, t in events(out, "commit") if q == s]
        assert [t for _, t in commits] == ref.sequences[s, ids.shape[1]:ids.shape[1] + committed[s]].tolist()
        assert [p for p, _ in commits] == list(range(int(mask[s].sum()), int(mask[s].sum()) + committed[s]))
    assert stats.core_calls == len(out.trace)
    assert stats.to_dict()["committed_tokens"] == sum(committed)


@pytest.mark.parametrize("mode,d,k", [("pipeline", 1, None), ("block", 1, 3)])
def test_bench_rows_and_out_speculation_agree_on_calls_per_token(mode, d, k):
    """`core_calls_per_token` means the same in `out.speculation` and in `hf-loopspec bench`'s rows: calls per token
    of one sequence. Both are run at batch 3 under full acceptance (a forced draft hook here, the bench's synthetic
    acceptance there), where the schedule, and so the count, is the batch-1 closed form whatever the model."""
    from hf_loopspec.bench import args as bench_args
    from hf_loopspec.bench import run_bench

    n, lengths = 8, [5, 2, 8]
    model = tiny_spec_model(23, 4, vocab=VOCAB)
    prompts = random_prompts(23, lengths, VOCAB)
    ids, mask = left_pad(prompts)
    ref = plain(model, ids, mask, n)
    reference = [real_tokens(ref.sequences, mask, s) for s in range(len(prompts))]
    hook = forcing_hook(reference, lengths, lambda s, i: True, VOCAB)
    stats = speculative(model, ids, mask, n, mode, d, k, draft_hook=hook, debug=False).speculation
    options = ["--num-speculative-tokens", str(k)] if k else []
    result = run_bench(bench_args.parse_args([
        "--model", "ouro-tiny", "--device", "cpu", "--prompt-len", "8", "--new-tokens", str(n), "--repeats", "1",
        "--calibration-seconds", "0.05", "--quiet", "--modes", f"plain,{mode}", "--batch-size", str(len(lengths)),
        "--synthetic-acceptance", "1.0", "--draft-loops", str(d), *options]))
    row = next(r for r in result["rows"] if r["mode"] == mode)
    closed = pipeline_calls(n, 4, d, True) if mode == "pipeline" else block_calls(n, 4, d, k, True)
    assert stats.core_calls_per_token == row["core_calls_per_token"] == pytest.approx(closed / n)
