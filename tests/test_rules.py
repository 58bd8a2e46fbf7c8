"""The decoding rules (`hf_loopspec.generation.rules`) against hand computations, and the two engines sharing them:
with the same seed, the lane decoder and the wavefront engine sample the same tokens with the same counters.

Rules. Each rule takes explicit uniforms, so its outcome distribution is measured by running it on uniforms laid out
on a grid of midpoints (i + 1/2) / n, whose error is known exactly: the fraction of midpoints below a threshold r
differs from r by at most 1/(2n), and the number of midpoints in an interval of length w from n·w by at most 1 (a
draw's share of a token differs from its weight by at most 1/n). Independent uniforms take the product grid; a
composed rule's error is the sum of its parts' (stated at each test). Where a rule promises a probability
(the acceptance min(1, p/q)), random uniforms estimate it within a 5-sigma binomial bound (false alarm < 1e-6).
"""

from __future__ import annotations

import math

import pytest
import torch
from sampling_utils import random_distribution
from speculative_utils import (
    MODE_PAIR,
    MODES,
    PAD,
    engine_settings,
    generate_dict,
    mode_id,
    mode_kwargs,
    paged_cache,
    spec_case,
    speculative,
)
from transformers import MaxLengthCriteria, StoppingCriteriaList

from hf_loopspec.generation import rules
from hf_loopspec.generation.wavefront import WavefrontEngine


def midpoints(n: int) -> torch.Tensor:
    """`[n]` float64: (i + 1/2) / n."""
    return (torch.arange(n, dtype=torch.float64) + 0.5) / n


def shares(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """The fraction of `tokens` (any shape) equal to each id `[V]`, float64."""
    return torch.bincount(tokens.flatten(), minlength=vocab).double() / tokens.numel()


def case(seed: int, vocab: int = 6):
    """Target p and draft q `[V]` float64 with some zero entries, from `seed` (every fifth q a point mass, every
    fifth q equal to p: no residual mass)."""
    gen = torch.Generator().manual_seed(seed)
    p = random_distribution(vocab, gen, zeros=seed % 3)
    q = random_distribution(vocab, gen, zeros=(seed + 1) % 3)
    if seed % 5 == 0:
        q = p.clone()
    if seed % 5 == 1:
        q = torch.nn.functional.one_hot(torch.tensor(seed % vocab), vocab).double()
    return p, q


def hand_residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """normalise(max(p - q, 0)), or p without residual mass: written out here, not taken from the package."""
    mass = torch.tensor([max(float(a) - float(b), 0.0) for a, b in zip(p, q)], dtype=torch.float64)
    return mass / mass.sum() if mass.sum() > 0 else p


# --- draws and the greedy rule ------------------------------------------------------------------------------------


def test_draw_follows_the_weights():
    """Inverse-CDF draws at midpoint uniforms give every index its share of the weight to within one draw, never an
    index of zero weight (also for the largest uniform below 1)."""
    weights = torch.tensor([[0.0, 3.0, 0.0, 1.0, 4.0, 0.0], [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]])  # [2, 6]
    n = 800
    u = midpoints(n).float()
    for row in weights:
        counts = torch.bincount(rules.draw(row.expand(n, -1), u), minlength=6).double()
        assert ((counts - n * row / row.sum()).abs() <= 1).all(), counts
    top = torch.tensor([1 - 2**-24])
    assert int(rules.draw(torch.tensor([[0.3, 0.7, 0.0, 0.0]]), top)) == 1


def test_greedy_rule_is_the_argmax_and_equality():
    scores = torch.tensor([[0.1, 2.0, -1.0], [5.0, 5.0, 0.0], [-float("inf"), -3.0, -2.0]])
    token, accept = rules.greedy(scores, torch.tensor([1, 1, 2]))
    assert token.tolist() == [1, 0, 2]  # a tie goes to the first index, as torch.argmax and plain greedy decoding
    assert accept.tolist() == [True, False, True]


def test_row_ends_at_eos_or_at_the_length_limit():
    tokens, generated = torch.tensor([3, 7, 3, 9]), torch.tensor([1, 2, 5, 5])
    assert rules.ends_row(tokens, generated, 5, torch.tensor([7])).tolist() == [False, True, True, True]
    assert rules.ends_row(tokens, generated, 5, None).tolist() == [False, False, True, True]
    assert rules.ends_row(tokens, generated, 9, torch.tensor([], dtype=torch.long)).tolist() == [False] * 4


# --- lossless speculative sampling -----------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
def test_acceptance_probability_is_min_one_p_over_q(seed):
    """Over M random uniforms the draft is accepted at rate min(1, p(x)/q(x)) (hand computed), for every drafted x,
    within 5 binomial standard deviations (plus 1/M for a rate of exactly 0 or 1)."""
    p, q = case(seed)
    m = 20000
    gen = torch.Generator().manual_seed(100 + seed)
    for x in (q > 0).nonzero().flatten().tolist():
        u = torch.rand(m, 2, generator=gen, dtype=torch.float64)
        xs = torch.full((m,), x)
        _, accept, _ = rules.speculative(p.expand(m, -1), q.expand(m, -1), xs, torch.ones(m, dtype=torch.bool), u)
        exact = min(1.0, float(p[x]) / float(q[x]))
        bound = 5 * math.sqrt(exact * (1 - exact) / m) + 1 / m
        assert abs(float(accept.double().mean()) - exact) <= bound, (x, exact)


@pytest.mark.parametrize("seed", range(10))
def test_rejections_draw_from_the_residual(seed):
    """The replacement's weights are max(p - q, 0) (p when that has no mass, and for a position with no draft),
    and a rejected draft's replacement, over midpoint uniforms, takes each token's residual share to within 1/n."""
    p, q = case(seed)
    n = 1000
    u = torch.stack([torch.full((n,), 1 - 1e-12, dtype=torch.float64), midpoints(n)], 1)  # u0 ~ 1: reject if p < q
    for judged in (True, False):
        x = torch.full((n,), int(q.argmax()))
        token, accept, left = rules.speculative(p.expand(n, -1), q.expand(n, -1), x, torch.full((n,), judged), u)
        expected = hand_residual(p, q) if judged else p
        torch.testing.assert_close(left[0] / left[0].sum(), expected, atol=1e-12, rtol=0)
        if not judged or not accept.any():
            assert (shares(token, len(p)) - expected).abs().max() <= 1 / n


def one_candidate_committed(p: torch.Tensor, q: torch.Tensor, n: int, replacement=None) -> torch.Tensor:
    """The committed token's distribution under `rules.speculative`: every draft x weighted by q(x), the uniforms on
    the n x n midpoint grid. Error at most 1/(2n) (acceptance) + 1/n (the draw). `replacement(p, q)`: other draw
    weights (a deliberately wrong rule)."""
    u0, u1 = torch.meshgrid(midpoints(n), midpoints(n), indexing="ij")
    u = torch.stack([u0.flatten(), u1.flatten()], 1)  # [n * n, 2]
    rows = len(u)
    out = torch.zeros_like(p)
    for x in (q > 0).nonzero().flatten().tolist():
        xs = torch.full((rows,), x)
        token, accept, left = rules.speculative(p.expand(rows, -1), q.expand(rows, -1), xs,
                                                torch.ones(rows, dtype=torch.bool), u)
        if replacement is not None:
            token = torch.where(accept, xs, rules.draw(replacement(p, q).expand(rows, -1), u[:, 1]))
        out += q[x] * shares(token, len(p))
    return out


@pytest.mark.parametrize("seed", range(10))
def test_speculative_sampling_commits_the_target_distribution(seed):
    p, q = case(seed)
    n = 300
    bound = 1.5 / n + 1e-12
    assert (one_candidate_committed(p, q, n) - p).abs().max() <= bound
    if seed % 5 > 1:  # power: drawing a rejection's replacement from p instead of the residual is caught
        assert (one_candidate_committed(p, q, n, replacement=lambda p, q: p) - p).abs().max() > bound


# --- two candidates (second proposals) ----------------------------------------------------------------------------


def two_candidate_committed(p, q1, q2, n: int, first_residual: bool = False) -> torch.Tensor:
    """The committed token's distribution under `rules.speculative` then `rules.second_candidate`: every draft x ~ q1
    and independent second candidate c ~ q2 weighted by q1(x) q2(c); the judging uniform on an n0-point grid and the
    other two on the n x n grid. Error at most 1/(2 n0) + 1/(2n) + 1/n. `first_residual`: a deliberately wrong
    rule (the final replacement drawn from the first residual)."""
    n0 = 20 * n
    vocab = len(p)
    u1, u2 = torch.meshgrid(midpoints(n), midpoints(n), indexing="ij")
    rows = n * n
    u = torch.stack([torch.zeros(rows, dtype=torch.float64), u1.flatten(), u2.flatten()], 1)  # [n * n, 3]
    out = torch.zeros_like(p)
    for x in (q1 > 0).nonzero().flatten().tolist():
        judge = torch.stack([midpoints(n0), torch.zeros(n0, dtype=torch.float64)], 1)
        _, accept, left = rules.speculative(p.expand(n0, -1), q1.expand(n0, -1), torch.full((n0,), x),
                                            torch.ones(n0, dtype=torch.bool), judge)
        kept = accept.double().mean()
        for c in (q2 > 0).nonzero().flatten().tolist():
            cs = torch.full((rows,), c)
            token = rules.second_candidate(left[:1].expand(rows, -1), q2.expand(rows, -1), cs, u)
            if first_residual:
                keep_c = token == c
                token = torch.where(keep_c, cs, rules.draw(left[:1].expand(rows, -1), u[:, 1]))
            committed = kept * torch.nn.functional.one_hot(torch.tensor(x), vocab) + (1 - kept) * shares(token, vocab)
            out += q1[x] * q2[c] * committed
    return out


@pytest.mark.parametrize("seed", range(8))
def test_two_candidate_rule_commits_the_target_distribution(seed):
    gen = torch.Generator().manual_seed(seed)
    vocab = 5
    p, q1, q2 = (random_distribution(vocab, gen, zeros=(seed + i) % 3) for i in range(3))
    if seed % 4 == 1:
        q2 = torch.nn.functional.one_hot(torch.tensor(seed % vocab), vocab).double()  # a forced second proposal
    if seed % 4 == 2:
        q2 = q1.clone()  # the second candidate often equals the draft
    n = 200
    bound = 1 / (40 * n) + 1.5 / n + 1e-12
    assert (two_candidate_committed(p, q1, q2, n) - p).abs().max() <= bound


def test_two_candidate_check_has_power():
    """The same measurement catches a final replacement drawn from the first residual instead of the second."""
    p = torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=torch.float64)
    q1 = torch.tensor([0.1, 0.1, 0.4, 0.4], dtype=torch.float64)  # first residual: [0.6, 0.4, 0, 0]
    q2 = torch.tensor([0.5, 0.1, 0.2, 0.2], dtype=torch.float64)  # second residual: [0.25, 0.75, 0, 0]
    n = 200
    bound = 1 / (40 * n) + 1.5 / n + 1e-12
    assert (two_candidate_committed(p, q1, q2, n) - p).abs().max() <= bound
    assert (two_candidate_committed(p, q1, q2, n, first_residual=True) - p).abs().max() > 4 * bound


# --- one seed, one output: the two engines ---------------------------------------------------------------------

SETTINGS = {
    "plain": dict(),
    "warped": dict(temperature=0.7, top_k=20, top_p=0.9),
    "penalised": dict(repetition_penalty=1.3, min_new_tokens=4),
}


def _counters(stats) -> dict:
    return {k: v for k, v in stats.to_dict().items() if k not in ("engine", "cache_fill_calls")}


def _both_engines(model, ids, mask, seed, **kwargs):
    outs = []
    for engine in ("lanes", "wavefront"):
        torch.manual_seed(seed)
        outs.append(generate_dict(model, ids, mask, 20, do_sample=True, **engine_settings(model, engine), **kwargs))
    assert [o.speculation.engine for o in outs] == ["lanes", "wavefront"]
    return outs


# every mode of the matrix unprocessed, and the processors on one setting of each mode
ENGINE_CASES = [pytest.param(*m, "plain", id=mode_id(*m) + "-plain") for m in MODES] + \
    [pytest.param(*m, name, id=f"{mode_id(*m)}-{name}") for m in MODE_PAIR for name in ("warped", "penalised")]


@pytest.mark.parametrize("mode,d,k,settings", ENGINE_CASES)
def test_same_seed_same_tokens_on_both_engines(mode, d, k, settings):
    """Several seeds: identical sampled tokens and counters; the seeds give different outputs, and drafts are both
    accepted and rejected (so residual draws are exercised)."""
    model, _, ids, mask = spec_case(3, [5, 2, 7], 96, damp=0.2)
    outputs = []
    for seed in (1, 2):
        lanes, wavefront = _both_engines(model, ids, mask, seed, **mode_kwargs(mode, d, k), **SETTINGS[settings])
        torch.testing.assert_close(lanes.sequences, wavefront.sequences, atol=0, rtol=0)
        assert _counters(lanes.speculation) == _counters(wavefront.speculation)
        assert lanes.speculation.accepted > 0 and lanes.speculation.rejected > 0
        outputs.append(lanes.sequences)
    assert not torch.equal(*outputs)


@pytest.mark.parametrize("seed", [4, 5])
def test_same_seed_same_tokens_with_second_proposals(seed):
    model, _, ids, mask = spec_case(3, [5, 2, 7], 96, damp=0.2)
    lanes, wavefront = _both_engines(model, ids, mask, seed, **mode_kwargs("pipeline", 1), second_draft_loops=3,
                                     temperature=0.8)
    torch.testing.assert_close(lanes.sequences, wavefront.sequences, atol=0, rtol=0)
    assert _counters(lanes.speculation) == _counters(wavefront.speculation)
    assert lanes.speculation.second_drafts > 0 and lanes.speculation.second_accepted > 0


@pytest.mark.parametrize("seed", [6, 7])
def test_same_seed_same_tokens_in_ar_mode(seed):
    """Mode "ar" (the lane decoder's `decode_with_lanes`, the engine directly): every token a draw from p."""
    model, _, ids, mask = spec_case(3, [5, 2, 7], 96)
    new = 20
    torch.manual_seed(seed)
    with torch.no_grad():
        lanes = model.decode_with_lanes(ids, "ar", cache=paged_cache(model, debug=False), attention_mask=mask,
                                        logits_processor=None, pad_token_id=PAD, max_length=ids.shape[1] + new,
                                        stopping_criteria=StoppingCriteriaList([MaxLengthCriteria(ids.shape[1] + new)]),
                                        do_sample=True)
    torch.manual_seed(seed)
    with torch.no_grad():
        wavefront = WavefrontEngine(model, paged_cache(model, debug=False), mode="ar", draft_loops=1,
                                    num_speculative_tokens=1, input_ids=ids, attention_mask=mask, pad_token_id=PAD,
                                    max_length=ids.shape[1] + new, do_sample=True).run()
    torch.testing.assert_close(lanes.sequences, wavefront.sequences, atol=0, rtol=0)
    greedy = speculative(model, ids, mask, new, "pipeline")
    assert not torch.equal(lanes.sequences, greedy.sequences)  # it did sample


@pytest.mark.parametrize("engine", ["lanes", "wavefront"])
def test_non_finite_probabilities_raise_on_both_engines(engine):
    """A draw from weights that are not finite has no meaning (`rules.draw` would return some index): both engines
    raise plain sampling's error instead."""
    model, _, ids, mask = spec_case(3, [5, 2], 96)
    with pytest.raises(RuntimeError, match="probability tensor contains either `inf` or `nan`"):
        speculative(model, ids, mask, 8, "pipeline", do_sample=True, temperature=1e-50,
                    **engine_settings(model, engine))
