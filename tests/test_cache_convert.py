"""`cache.convert`: a looped model's KV moved between transformers' `DynamicCache` and a `PagedLoopCache`.

References: plain decoding's own `DynamicCache` (the moved entries must be its entries, bit for bit, since
they are copied), and plain greedy decoding of the whole output (a continuation from a moved cache must give its
tokens, as any continuation does). Ouro (every plane a loop depth) and Huginn (entry and exit planes, some of which
plain decoding leaves unwritten), on the CPU and, with the `gpu` marker, on CUDA.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from huginn_utils import tiny_huginn
from inputs import left_pad, random_prompts
from speculative_utils import generate_dict, plain, tiny_spec_model
from transformers import DynamicCache

from hf_loopspec import PagedLoopCache
from hf_loopspec.cache.convert import to_dynamic, to_paged

NEW = 12
CUDA = pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _ouro():
    return tiny_spec_model(7, vocab=64), {}


def _huginn():  # seeded initial states: plain and speculative decoding draw the same state per token
    return tiny_huginn(seed=3, damp=0.3)[0], {"num_steps": 4, "init_scale": 1.0, "init_seed": 77}


@pytest.fixture(scope="module", params=[
    pytest.param(("ouro", "cpu"), id="ouro"), pytest.param(("huginn", "cpu"), id="huginn"),
    pytest.param(("ouro", "cuda"), id="ouro-cuda", marks=CUDA),
    pytest.param(("huginn", "cuda"), id="huginn-cuda", marks=CUDA)])
def case(request):
    """(model, ids, mask, settings, layout, plain output of 2 * NEW tokens); on CUDA the paged writes take the
    Triton kernel."""
    family, device = request.param
    model, settings = {"ouro": _ouro, "huginn": _huginn}[family]()
    model = model.to(device)
    ids, mask = (t.to(device) for t in left_pad(random_prompts(7, [6, 2, 4], model.config.vocab_size)))
    with model.recurrence(num_steps=settings["num_steps"]) if settings else contextlib.nullcontext():
        layout = model.kv_layout  # Huginn's planes depend on num_steps
    return model, ids, mask, settings, layout, plain(model, ids, mask, 2 * NEW, **settings)


def _grown(mask: torch.Tensor, columns: int) -> torch.Tensor:
    return torch.cat([mask, mask.new_ones(len(mask), columns)], 1)


def test_round_trip_keeps_plain_decodings_entries(case):
    """Dynamic -> paged -> dynamic gives back plain decoding's cache exactly at real columns, zeros (masked) at
    padding columns, and the layers plain decoding never wrote (Huginn's draft-depth exit planes) still unwritten."""
    model, ids, mask, settings, layout, ref = case
    full = _grown(mask, 2 * NEW)
    paged = to_paged(ref.cache, layout, full)
    assert paged.get_seq_length() == ref.cache.get_seq_length()
    back = to_dynamic(paged, full)
    assert len(back.layers) == len(ref.cache.layers)
    real = full[:, : ref.cache.get_seq_length()].bool()[:, None, :, None]  # [B, 1, C, 1]
    for mine, theirs in zip(back.layers, ref.cache.layers):
        assert mine.is_initialized == theirs.is_initialized
        for a, b in ((mine.keys, theirs.keys), (mine.values, theirs.values)) if theirs.is_initialized else ():
            assert torch.equal(a, torch.where(real, b, torch.zeros_like(b)))


@pytest.mark.parametrize("direction", ["to_paged", "to_dynamic"])
def test_continuing_a_moved_cache_gives_plain_tokens(case, direction):
    """Half the output plainly (then moved to a `PagedLoopCache` and continued by pipeline decoding), or by
    pipeline decoding (then moved to a `DynamicCache` and continued plainly): the tokens equal plain decoding's."""
    model, ids, mask, settings, layout, ref = case
    if direction == "to_paged":
        first = plain(model, ids, mask, NEW, **settings)
        cache = to_paged(first.cache, layout, _grown(mask, NEW))
        kwargs = {"speculative_mode": "pipeline", "draft_loops": 1}
    else:
        first = generate_dict(model, ids, mask, NEW, speculative_mode="pipeline", draft_loops=1,
                              cache=PagedLoopCache(layout), **settings)
        cache = to_dynamic(first.cache, _grown(mask, NEW))
        kwargs = {"speculative_mode": None}
    second = generate_dict(model, first.sequences, _grown(mask, NEW), NEW, cache=cache, **kwargs, **settings)
    assert torch.equal(second.sequences, ref.sequences)


def test_refill_in_place_and_refusals(case):
    """`into` refills the given `DynamicCache` object; a cache that does not belong to the mask (or to fewer rows
    than it holds), one of another model (more layers than the layout has), one without the planes every call writes
    and one whose first loop depth is incomplete, and masks of other values than 0 and 1 are refused with a
    `ValueError`."""
    model, ids, mask, settings, layout, ref = case
    full = _grown(mask, 2 * NEW)
    paged = to_paged(ref.cache, layout, full)
    target = DynamicCache()
    assert to_dynamic(paged, full, into=target) is target and target.get_seq_length() == ref.cache.get_seq_length()
    with pytest.raises(ValueError, match="attention_mask marks"):
        to_dynamic(paged, _grown(torch.ones_like(mask), 2 * NEW))
    assert len(mask) > 1
    with pytest.raises(ValueError, match=rf"holds {len(mask)} sequences, but attention_mask has 1 rows"):
        to_dynamic(paged, full[:1])  # (the first rows alone used to give a smaller cache, the others dropped)
    larger = DynamicCache()
    for i in range(layout.num_planes * layout.num_layers + 1):
        larger.update(ref.cache.layers[0].keys, ref.cache.layers[0].values, i)
    with pytest.raises(ValueError, match=r"the cache passed \(cache= or past_key_values=\) holds KV in .* layers, "
                                         "but this call writes"):
        to_paged(larger, layout, full)
    partial = DynamicCache()  # every layer full but the second of loop depth 0
    for i in range(layout.num_planes * layout.num_layers):
        keep = -1 if i == 1 else None
        partial.update(ref.cache.layers[0].keys[:, :, :keep], ref.cache.layers[0].values[:, :, :keep], i)
    with pytest.raises(ValueError, match="loop depth 0"):
        to_paged(partial, layout, full)
    loop_depth_0 = DynamicCache()  # the other planes missing: refused for them first
    for i in range(2):
        loop_depth_0.update(ref.cache.layers[0].keys, ref.cache.layers[0].values, i)
    with pytest.raises(ValueError, match="holds KV in 2 layers, but this call writes"):
        to_paged(loop_depth_0, layout, full)
    # a mask narrower than the cache, or not 2-D: a ValueError naming it (to_paged made a cache claiming columns it
    # did not store; to_dynamic raised IndexError / TypeError)
    columns = ref.cache.get_seq_length()
    for bad in (full[:, : columns - 1], full[0], full.tolist()):
        with pytest.raises(ValueError, match=rf"attention_mask: .* >= {columns}\] padding mask"):
            to_paged(ref.cache, layout, bad)
        with pytest.raises(ValueError, match=rf"attention_mask: .* >= {columns}\] padding mask"):
            to_dynamic(paged, bad)
    for bad in (full * 2, full * 0.5):  # values a forward refuses (they were read as real tokens where not 0)
        with pytest.raises(ValueError, match="attention_mask must hold only 0 .padding. and 1 .real token."):
            to_paged(ref.cache, layout, bad)
        with pytest.raises(ValueError, match="attention_mask must hold only 0 .padding. and 1 .real token."):
            to_dynamic(paged, bad)
    # the wrong object in a slot: a ValueError naming the argument (AttributeErrors before)
    with pytest.raises(ValueError, match="to_dynamic: cache is a DynamicCache; it converts a PagedLoopCache"):
        to_dynamic(ref.cache, full)
    with pytest.raises(ValueError, match="to_dynamic: into is a str; pass the DynamicCache to refill"):
        to_dynamic(paged, full, into="x")
    with pytest.raises(ValueError, match=r"to_paged: layout is a .*ForCausalLM; pass the model's KV layout"):
        to_paged(ref.cache, model, full)
    with pytest.raises(ValueError, match="to_paged: cache is a PagedLoopCache; it converts a DynamicCache"):
        to_paged(paged, layout, full)
    # a plane the layout lacks: a ValueError (99 was an IndexError, -1 the last plane's count)
    for plane in (layout.num_planes, -1, 0.0):
        with pytest.raises(ValueError, match=rf"plane={plane!r} is no loop depth .*\[0, {layout.num_planes - 1}\]"):
            paged.columns(plane)


@pytest.mark.parametrize("fixed", [False, True], ids=["growing", "fixed layers"])
def test_a_refill_that_fails_leaves_the_cache_as_it_was(case, monkeypatch, fixed):
    """Copying a run's KV back into the caller's `DynamicCache` runs out of memory part-way (the third layer it
    writes): the caller's cache still holds what it held (it was emptied first, then half refilled, and the
    conversation's KV was lost); refilled without the fault, it holds the run's entries, in the same layer
    objects' places."""
    model, ids, mask, settings, layout, ref = case
    full = _grown(mask, 2 * NEW)
    paged = to_paged(ref.cache, layout, full)
    half = plain(model, ids, mask, NEW, **settings).cache
    target = DynamicCache(config=model.config) if fixed else DynamicCache()
    if fixed:  # one fixed layer per (plane, layer)
        target.layers[:] = [type(target.layers[0])() for _ in range(layout.num_planes * layout.num_layers)]
    for index, layer in enumerate(half.layers):
        if layer.is_initialized:
            target.update(layer.keys, layer.values, index)
    before = [(layer.keys.clone(), layer.values.clone()) if layer.is_initialized else None for layer in target.layers]
    calls, update = [], DynamicCache.update

    def failing(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise torch.OutOfMemoryError("injected")
        return update(self, *args, **kwargs)

    monkeypatch.setattr(DynamicCache, "update", failing)
    with pytest.raises(torch.OutOfMemoryError):
        to_dynamic(paged, full, into=target)
    monkeypatch.setattr(DynamicCache, "update", update)
    after = [(layer.keys, layer.values) if layer.is_initialized else None for layer in target.layers]
    assert len(after) == len(before) and all(
        (a is None) == (b is None) and (a is None or (torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])))
        for a, b in zip(after, before))
    assert to_dynamic(paged, full, into=target) is target
    assert target.get_seq_length() == ref.cache.get_seq_length()


@pytest.mark.parametrize("mode", [{"speculative_mode": None}, {"speculative_mode": "pipeline", "draft_loops": 1}],
                         ids=["plain", "pipeline"])
def test_a_dynamic_cache_that_does_not_fit_is_refused(mode):
    """A `DynamicCache` filled for another batch size, or by a model with other heads, raises a `ValueError` naming
    past_key_values in plain and speculative decoding (they raised torch's shape errors)."""
    model, other = tiny_spec_model(61, 4, vocab=64), tiny_spec_model(5, 4, vocab=64, hidden=64)
    ids = torch.randint(1, 64, (1, 6), generator=torch.Generator().manual_seed(0))
    for filler, batch in ((model, 3), (other, 1)):
        cache = DynamicCache()
        first = filler.generate(ids, cache=cache, max_new_tokens=3, do_sample=False, pad_token_id=0,
                                speculative_mode=None)
        again = torch.cat([first] * batch)
        with pytest.raises(ValueError, match=r"the cache passed \(cache= or past_key_values=\) holds keys of shape "
                                             r"\(1, 2, 8, (8|16)\)"):
            model.generate(again, attention_mask=torch.ones_like(again), cache=cache, max_new_tokens=3,
                           do_sample=False, pad_token_id=0, **mode)
