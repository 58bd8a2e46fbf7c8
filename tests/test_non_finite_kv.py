"""Non-finite keys and values never reach a position that does not see them (`ops.attention.stored`).

A page pool holds the KV of rejected drafts and a dense cache the KV of padding. The fast attention paths mask a
position with a score of -inf, and a masked weight of 0 times an inf or NaN value is NaN, so one non-finite draft
turned its whole row into token 0 (argmax of NaN logits) in pipeline and block, and a non-finite padding token did
the same to plain decoding of its row, where plain decoding of the unpadded row is finite.

The trigger is a token whose input embedding is NaN (what an fp16 overflow of a draft's activations gives, without
relying on one), chosen among those the rows neither hold nor decode, and a `draft_hook` proposing it at every
draft, so verification rejects every draft. The reference is plain greedy decoding of each row alone, unpadded, by
the model before the poisoning.
"""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_model
from huginn_utils import tiny_huginn
from inputs import random_ids

from hf_loopspec import PagedLoopCache
from hf_loopspec.generation import rules
from hf_loopspec.ops.attention import naive_write_kv, write_kv_torch

NEW = 8
FAMILIES = {"ouro": lambda: tiny_model(seed=0)[0], "huginn": lambda: tiny_huginn(seed=0, damp=0.5)[0]}


def poison(model, token: int) -> None:
    """Make `model`'s input embedding of `token` NaN; tied output embeddings are untied first (kept finite)."""
    embeddings = model.get_input_embeddings().weight
    if model.lm_head.weight is embeddings:
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(embeddings.detach().clone())
    with torch.no_grad():
        embeddings[token] = float("nan")


def settings_of(family: str) -> dict:
    return {"max_new_tokens": NEW, "do_sample": False, "eos_token_id": None} | (
        {"init_scale": 0.0} if family == "huginn" else {})


def alone(model, rows: list[list[int]], settings: dict) -> list[list[int]]:
    """Plain greedy decoding of each row by itself, unpadded: its new tokens."""
    return [model.generate(torch.tensor([row]), speculative_mode=None, pad_token_id=0, **settings)[0, len(row):]
            .tolist() for row in rows]


def left_padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(row)) + row for row in rows])
    return ids, torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in rows])


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", ["pipeline", "block"])
def test_a_rejected_draft_with_a_nan_embedding_leaves_its_row_as_plain_decoding_makes_it(family, mode):
    model, settings = FAMILIES[family](), settings_of(family)
    rows = [random_ids((1, 6), 80, seed=3)[0].tolist(), random_ids((1, 4), 80, seed=4)[0].tolist()]
    expected = alone(model, rows, settings)  # before the poisoning: the reference
    token = min(set(range(1, 80)) - {t for row in rows + expected for t in row})  # in no prompt, never decoded
    poison(model, token)
    ids, mask = left_padded(rows)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, pad_token_id=0, speculative_mode=mode, draft_loops=1,
                             draft_hook=lambda sequence, position, draft: token, **settings)
    assert out[:, ids.shape[1]:].tolist() == expected


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", [None, "pipeline", "block"])
def test_a_padding_token_with_a_nan_embedding_leaves_the_rows_as_decoded_alone(family, mode):
    """Left padding by a token whose embedding is NaN: masked, in plain decoding (a DynamicCache) too."""
    model, settings = FAMILIES[family](), settings_of(family)
    rows = [random_ids((1, 6), 80, seed=5)[0].tolist(), random_ids((1, 3), 80, seed=6)[0].tolist()]
    rows = [[t if t != 0 else 1 for t in row] for row in rows]
    expected = alone(model, rows, settings)
    poison(model, 0)
    ids, mask = left_padded(rows)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, pad_token_id=0, speculative_mode=mode, **settings)
    assert out[:, ids.shape[1]:].tolist() == expected


@pytest.mark.parametrize("write", [naive_write_kv, write_kv_torch], ids=["naive", "torch"])
def test_a_pool_stores_non_finite_keys_and_values_as_zero_and_finite_ones_unchanged(write):
    k = torch.randn(3, 2, 4)
    v = torch.randn(3, 2, 4)
    k[0, 1, 2], v[1, 0, 0], v[2, 1, 3] = float("nan"), float("inf"), -float("inf")
    k_cache, v_cache = torch.full((2, 4, 2, 4), 5.0), torch.full((2, 4, 2, 4), 5.0)
    write(k, v, k_cache, v_cache, torch.tensor([1, 6, -1]))
    finite_k, finite_v = k.nan_to_num(0.0, 0.0, 0.0), v.nan_to_num(0.0, 0.0, 0.0)
    assert torch.equal(k_cache[0, 1], finite_k[0]) and torch.equal(v_cache[0, 1], finite_v[0])
    assert torch.equal(k_cache[1, 2], finite_k[1]) and torch.equal(v_cache[1, 2], finite_v[1])
    assert k_cache.isfinite().all() and v_cache.isfinite().all()
    assert int((k_cache == 5.0).all(-1).all(-1).sum()) == 6  # the inactive row wrote nothing


def test_a_cache_continued_after_a_nan_draft_equals_plain_decoding():
    """The rejected drafts' KV stays in the caller's PagedLoopCache: a second call continuing it decodes as plain."""
    model, settings = FAMILIES["ouro"](), settings_of("ouro")
    prompt = random_ids((1, 5), 80, seed=7)
    expected = model.generate(prompt, speculative_mode=None, pad_token_id=0, **(settings | {"max_new_tokens": 2 * NEW}))
    token = min(set(range(1, 80)) - set(expected[0].tolist()))
    poison(model, token)
    cache = PagedLoopCache(model.kv_layout)
    with torch.no_grad():
        first = model.generate(prompt, cache=cache, pad_token_id=0, speculative_mode="pipeline", draft_loops=1,
                               draft_hook=lambda sequence, position, draft: token, **settings)
        second = model.generate(first, cache=cache, pad_token_id=0, speculative_mode="pipeline", **settings)
    assert torch.equal(second, expected)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", ["pipeline", "block"])
def test_sampling_past_a_rejected_nan_draft_draws_as_the_unpoisoned_model(family, mode):
    """Sampling: the lanes after a rejected NaN draft have NaN probabilities, and the run raised plain sampling's
    "probability tensor contains inf or nan" error, which plain sampling of the same call never raises. Only
    committing targets' probabilities count now, and a drafter's non-finite ones count as a point mass on its draft
    (`rules.proposal_q`). The random numbers depend on cycles and lanes, not on tokens, so the poisoned model draws
    exactly what the unpoisoned one draws with the same seed and drafts (the poisoned token is suppressed: p = 0)."""
    model = FAMILIES[family]()
    ids = random_ids((2, 5), 80, seed=8)
    token = min(set(range(1, 80)) - set(ids.flatten().tolist()))
    settings = settings_of(family) | {"do_sample": True, "suppress_tokens": [token], "pad_token_id": 0}
    first = ids.shape[1]  # the poisoned token is forced as each sequence's first draft only: later drafts are the
    hook = lambda sequence, position, draft: token if position == first else draft  # noqa: E731  model's own

    def run():
        torch.manual_seed(11)
        with torch.no_grad():
            return model.generate(ids, speculative_mode=mode, draft_loops=1, draft_hook=hook, **settings)

    expected = run()
    poison(model, token)
    out = run()
    assert torch.equal(out, expected) and token not in out[:, first:]


def test_a_proposals_non_finite_distribution_counts_as_a_point_mass():
    q = torch.tensor([[0.5, 0.5, 0.0], [float("nan")] * 3, [0.2, 0.3, 0.5]])
    token, forced = torch.tensor([1, 2, 0]), torch.tensor([False, False, True])
    expected = torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    assert torch.equal(rules.proposal_q(q, token, forced), expected)
