"""`cache.convert`: a looped model's KV moved between transformers' `DynamicCache` and a `PagedLoopCache`.

References: plain decoding's own `DynamicCache` (the moved entries must be its entries, bit for bit, since
they are copied), and plain greedy decoding of the whole output (a continuation from a moved cache must give its
tokens, as any continuation does).
"""

from __future__ import annotations

import pytest
import torch
from huginn_utils import tiny_huginn
from inputs import left_pad, random_prompts
from speculative_utils import generate_dict, plain, tiny_spec_model
from transformers import DynamicCache

from hf_loopspec import PagedLoopCache
from hf_loopspec.cache.convert import convertible, to_dynamic, to_paged

VOCAB, NEW = 64, 12


CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                       reason="needs a CUDA device")])


@pytest.fixture(scope="module", params=["cpu", CUDA])
def case(request):
    """On the CPU and, with the `gpu` marker, on CUDA (where the paged writes take the Triton kernel)."""
    model = tiny_spec_model(7, vocab=VOCAB).to(request.param)
    ids, mask = (t.to(request.param) for t in left_pad(random_prompts(7, [6, 2, 4], VOCAB)))
    return model, ids, mask, plain(model, ids, mask, 2 * NEW)


def _grown(mask: torch.Tensor, columns: int) -> torch.Tensor:
    return torch.cat([mask, mask.new_ones(len(mask), columns)], 1)


def test_round_trip_keeps_plain_decodings_entries(case):
    """Dynamic -> paged -> dynamic gives back plain decoding's cache exactly at real columns, and zeros (masked)
    at padding columns; the paged cache reports the same columns."""
    model, ids, mask, ref = case
    full = _grown(mask, 2 * NEW)
    paged = to_paged(ref.cache, model.kv_layout, full)
    assert paged.get_seq_length() == ref.cache.get_seq_length()
    back = to_dynamic(paged, full)
    assert len(back.layers) == len(ref.cache.layers)
    real = full[:, : ref.cache.get_seq_length()].bool()[:, None, :, None]  # [B, 1, C, 1]
    for mine, theirs in zip(back.layers, ref.cache.layers):
        for a, b in ((mine.keys, theirs.keys), (mine.values, theirs.values)):
            assert torch.equal(a, torch.where(real, b, torch.zeros_like(b)))


@pytest.mark.parametrize("direction", ["to_paged", "to_dynamic"])
def test_continuing_a_moved_cache_gives_plain_tokens(case, direction):
    """Half the output plainly (then moved to a `PagedLoopCache` and continued by pipeline decoding), or by
    pipeline decoding (then moved to a `DynamicCache` and continued plainly): the tokens equal plain decoding's."""
    model, ids, mask, ref = case
    if direction == "to_paged":
        first = plain(model, ids, mask, NEW)
        cache = to_paged(first.cache, model.kv_layout, _grown(mask, NEW))
        kwargs = {"speculative_mode": "pipeline", "draft_loops": 1}
    else:
        first = generate_dict(model, ids, mask, NEW, speculative_mode="pipeline", draft_loops=1,
                              cache=PagedLoopCache(model.kv_layout))
        cache = to_dynamic(first.cache, _grown(mask, NEW))
        kwargs = {"speculative_mode": None}
    second = generate_dict(model, first.sequences, _grown(mask, NEW), NEW, cache=cache, **kwargs)
    assert torch.equal(second.sequences, ref.sequences)


def test_refill_in_place_and_refusals(case):
    """`into` refills the given `DynamicCache` object; a cache that does not belong to the mask, a model with entry
    and exit planes, and a `DynamicCache` with too few layers are refused with a `ValueError`."""
    model, ids, mask, ref = case
    full = _grown(mask, 2 * NEW)
    paged = to_paged(ref.cache, model.kv_layout, full)
    target = DynamicCache()
    assert to_dynamic(paged, full, into=target) is target and target.get_seq_length() == ref.cache.get_seq_length()
    with pytest.raises(ValueError, match="attention_mask marks"):
        to_dynamic(paged, _grown(torch.ones_like(mask), 2 * NEW))
    short = DynamicCache()
    short.update(ref.cache.layers[0].keys, ref.cache.layers[0].values, 0)
    with pytest.raises(ValueError, match="must hold"):
        to_paged(short, model.kv_layout, full)
    huginn, _ = tiny_huginn()
    assert convertible(model.kv_layout) and not convertible(huginn.kv_layout)
    with pytest.raises(ValueError, match="entry or exit planes"):
        to_paged(ref.cache, huginn.kv_layout, full)
