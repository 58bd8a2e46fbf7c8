"""A conversation continued on the wavefront engine: each turn passes the whole conversation (the last output, then
the new turn's tokens) and the `PagedLoopCache` the earlier turns filled.

Oracles: plain greedy decoding of the whole conversation without a cache (transformers' loop on a fresh
`DynamicCache`) for the tokens, and the lane decoder, the reference, run turn by turn on a cache of its own, for the
counters and for the cache each turn leaves (lengths per plane and the KV of every position, up to the fp32 rounding
of a forward: the two decoders batch their rows differently). A batch of two rows, left-padded, whose first row stops
early at EOS (so the cache stores its stop token and the pads after it), with new turns of unequal lengths (padding
in the middle of the conversation).
"""

from __future__ import annotations

import pytest
import torch
from inputs import extend, left_pad, random_prompts
from paged_utils import paged_plane
from speculative_utils import (
    MODE_PAIR,
    decode_reference,
    engine_settings,
    generate_dict,
    mode_kwargs,
    mode_params,
    paged_cache,
    plain,
    speculative,
    tiny_spec_model,
)
from tolerances import assert_fp32_close, ouro_depth

VOCAB = 64
NEW = 7
PROMPTS = [5, 2]  # the first turn's prompt lengths
TURNS = [[3, 1], [2, 4]]  # the later turns' lengths per row


@pytest.fixture(scope="module")
def chat():
    """(model, first ids, first mask, eos, later turns): `eos` is row 0's third plain token, so row 0 stops early."""
    model = tiny_spec_model(61, 4, vocab=VOCAB, damp=0.3)  # damp < 1: drafts both accepted and rejected
    ids, mask = left_pad(random_prompts(7, PROMPTS, VOCAB))
    eos = int(plain(model, ids, mask, NEW).sequences[0, ids.shape[1] + 2])
    turns = [random_prompts(8 + i, lengths, VOCAB) for i, lengths in enumerate(TURNS)]
    return model, ids, mask, eos, turns


def counters(stats) -> dict:
    """The decoding counters of a run (not which engine ran it)."""
    return {key: value for key, value in stats.to_dict().items() if key != "engine"}


def assert_same_cache(cache, reference, model) -> None:
    """`cache` holds what the lane decoder's `reference` holds: the columns consumed, every plane's valid length
    per sequence, and the keys and values of every stored position (fp32 rounding of one forward)."""
    assert cache.get_seq_length() == reference.get_seq_length()
    assert cache.num_sequences == reference.num_sequences
    for s in range(reference.num_sequences):
        for plane in range(reference.num_planes):
            n = reference.length(s, plane)
            assert cache.length(s, plane) == n, (s, plane)
            for layer in range(model.config.num_hidden_layers):
                got, want = paged_plane(cache, s, plane, layer, n), paged_plane(reference, s, plane, layer, n)
                for x, y in zip(got, want):  # keys, values
                    assert_fp32_close(x, y, **ouro_depth(model.config))


@pytest.mark.parametrize("mode,d,k", mode_params(MODE_PAIR))
def test_three_turns_equal_plain_and_leave_the_lane_decoders_cache(chat, mode, d, k):
    model, ids, mask, eos, turns = chat
    caches = {engine: engine_settings(model, engine) for engine in ("wavefront", "lanes")}
    outs = {}
    for turn in range(3):
        if turn:
            ids, mask = extend(outs["wavefront"].sequences, mask, turns[turn - 1])
        expected = plain(model, ids, mask, NEW, eos_token_id=eos).sequences
        outs = {engine: speculative(model, ids, mask, NEW, mode, d, k, eos_token_id=eos, **settings)
                for engine, settings in caches.items()}
        assert outs["wavefront"].speculation.engine == "wavefront"
        assert outs["wavefront"].sequences.tolist() == expected.tolist(), f"turn {turn}"
        assert counters(outs["wavefront"].speculation) == counters(outs["lanes"].speculation), f"turn {turn}"
        assert_same_cache(caches["wavefront"]["cache"], caches["lanes"]["cache"], model)
    assert outs["wavefront"].speculation.verified > 0  # the last turn ran speculation on the continued cache


FIRST = {"plain": {"speculative_mode": None}, "lanes": None,  # the reference, directly (`decode_reference`)
         "wavefront": mode_kwargs("block", 1, 4) | {"speculative_engine": "wavefront"}}


@pytest.mark.parametrize("first", list(FIRST))
@pytest.mark.parametrize("mode,d,k", mode_params(MODE_PAIR))
def test_continue_a_cache_any_decoder_filled(chat, first, mode, d, k):
    """The first turn fills the cache with plain decoding (a `PagedLoopCache` passed to `generate`), the lane
    decoder or the engine; the second turn, on the engine, equals plain decoding of the whole conversation."""
    model, ids, mask, eos, turns = chat
    cache = paged_cache(model, debug=False)
    if first == "lanes":
        out = decode_reference(model, ids, mask, NEW, "pipeline", 2, eos_token_id=eos, cache=cache)
    else:
        out = generate_dict(model, ids, mask, NEW, eos_token_id=eos, cache=cache, **FIRST[first])
    full, full_mask = extend(out.sequences, mask, turns[0])
    expected = plain(model, full, full_mask, NEW, eos_token_id=eos).sequences
    got = speculative(model, full, full_mask, NEW, mode, d, k, eos_token_id=eos, cache=cache,
                      speculative_engine="wavefront")
    assert got.speculation.engine == "wavefront"
    assert got.sequences.tolist() == expected.tolist()


@pytest.mark.parametrize("mode,d,k", mode_params(MODE_PAIR))
def test_continue_a_plain_calls_dynamic_cache(chat, mode, d, k):
    """A chat's first turn decoded plainly returns transformers' `DynamicCache`; the next turn, speculative, continues
    it (its KV copied into a `PagedLoopCache` and back): plain decoding's tokens, and the same cache object back,
    holding what a plain second turn leaves in its own (fp32 rounding of a forward)."""
    model, ids, mask, eos, turns = chat
    first = plain(model, ids, mask, NEW, eos_token_id=eos)
    full, full_mask = extend(first.sequences, mask, turns[0])
    again = plain(model, ids, mask, NEW, eos_token_id=eos).cache  # a second copy of the first turn's cache
    expected = plain(model, full, full_mask, NEW, eos_token_id=eos, cache=again)
    got = speculative(model, full, full_mask, NEW, mode, d, k, eos_token_id=eos, cache=first.cache)
    assert got.speculation.engine == "wavefront" and got.speculation.verified > 0
    assert got.sequences.tolist() == expected.sequences.tolist()
    assert got.cache is first.cache and got.cache.get_seq_length() == expected.cache.get_seq_length()
    real = torch.cat([full_mask, torch.ones_like(got.sequences[:, full.shape[1]:])], 1)[:, :-1].bool()  # [B, C]
    for ours, theirs in zip(got.cache.layers, expected.cache.layers):
        for x, y in ((ours.keys, theirs.keys), (ours.values, theirs.values)):  # [B, Hkv, C, D]
            assert_fp32_close(x.transpose(1, 2)[real], y.transpose(1, 2)[real], **ouro_depth(model.config))


def test_continue_a_dynamic_cache_without_masks(chat):
    """One unpadded row, no attention mask in either turn: the plain turn's `DynamicCache` continued by pipeline."""
    model, ids, mask, _, turns = chat
    row = ids[:1, -PROMPTS[0]:]  # row 0 is the longest prompt: no padding
    with torch.no_grad():
        first = model.generate(row, max_new_tokens=NEW, do_sample=False, pad_token_id=0, return_dict_in_generate=True)
        full = torch.cat([first.sequences, torch.as_tensor(turns[0][0])[None]], 1)
        want = model.generate(full, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
        got = model.generate(full, max_new_tokens=NEW, do_sample=False, pad_token_id=0, cache=first.cache,
                             speculative_mode="pipeline")
    assert got.tolist() == want.tolist()


def test_a_filled_cache_of_another_layout_names_past_key_values(chat):
    """A cache filled by another model (head_dim 16 instead of 8) gets plain decoding's `ValueError`, naming
    `past_key_values`, before any work."""
    model, ids, mask, _, turns = chat
    other = tiny_spec_model(8, vocab=VOCAB, hidden=64)
    cache = paged_cache(other, debug=False)
    out = speculative(other, ids, mask, 3, "pipeline", 1, cache=cache, speculative_engine="wavefront")
    full, full_mask = extend(out.sequences, mask, turns[0])
    for settings in ({"speculative_mode": None}, mode_kwargs("pipeline", 1) | {"speculative_engine": "wavefront"}):
        with pytest.raises(ValueError, match=r"the cache passed \(cache= or past_key_values=\): the PagedLoopCache "
                                             "was made for"):
            generate_dict(model, full, full_mask, 3, cache=cache, **settings)


def _no_new_token(ids, mask, out):
    return out.sequences[:, :-1], torch.cat([mask, torch.ones_like(out.sequences[:, mask.shape[1]:-1])], 1)


def _stored_mismatch(ids, mask, out):
    longer = torch.cat([out.sequences, out.sequences[:, -1:]], 1)
    return longer, torch.ones_like(longer)  # claims the left padding was real


def _no_new_token_in_a_row(ids, mask, out):
    longer = torch.cat([out.sequences, out.sequences[:, -1:]], 1)
    full_mask = torch.cat([mask, torch.ones_like(longer[:, mask.shape[1]:])], 1)
    full_mask[1, -2:] = 0  # row 1: neither its last output nor the new column is real
    return longer, full_mask


REFUSED = {  # inputs that do not continue the cache: the lane decoder's refusals
    "consumed": (_no_new_token, "has already consumed"),
    "stored": (_stored_mismatch, "attention_mask marks"),
    "empty row": (_no_new_token_in_a_row, r"no real token in rows \[1\]"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_inputs_that_do_not_continue_the_cache_raise_the_lane_decoders_error(chat, case):
    model, ids, mask, _, _ = chat
    errors = {}
    for engine in ("wavefront", "lanes"):
        settings = engine_settings(model, engine)
        out = speculative(model, ids, mask, 3, "pipeline", 1, **settings)
        full, full_mask = REFUSED[case][0](ids, mask, out)
        with pytest.raises(ValueError, match=REFUSED[case][1]) as error:
            speculative(model, full, full_mask, 3, "pipeline", 1, **settings)
        errors[engine] = str(error.value)
    assert errors["wavefront"] == errors["lanes"]


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("mode", [None, "pipeline", "auto"])
def test_only_the_new_ids_after_a_plain_turn_name_the_whole_sequence(chat, mode, masked):
    """Turn 2 passes only its new ids with the `DynamicCache` of a plain turn 1 (a common mistake): the same
    `ValueError` as after a speculative turn, in every mode. It was an error naming `position_ids` (not passed) or
    a mask row without a real token, whose suggested fix was wrong."""
    model, ids, mask, _, turns = chat
    first = plain(model, ids[:1, -PROMPTS[0]:], None, NEW)  # row 0: no padding
    new = torch.as_tensor(turns[0][0])[None]  # [1, 3]
    masks = {"attention_mask": torch.ones_like(new)} if masked else {}
    consumed = first.sequences.shape[1] - 1  # every token but the last output
    with pytest.raises(ValueError, match=f"DynamicCache has already consumed {consumed}: pass the whole sequence"):
        model.generate(new, max_new_tokens=3, do_sample=False, pad_token_id=0, cache=first.cache,
                       speculative_mode=mode, **masks)


def test_a_debug_cache_is_refused_naming_the_reference_decoder(chat):
    """`PagedLoopCache(debug=True)`'s lineage checks are a debugging aid of the reference decoder: the engine refuses
    it, naming the setting and `decode_with_lanes`; "auto" runs the reference for it (and says so)."""
    model, ids, mask, _, _ = chat
    with pytest.raises(ValueError, match=r"PagedLoopCache\(debug=True\).*model\.decode_with_lanes"):
        speculative(model, ids, mask, 3, "pipeline", 1, cache=paged_cache(model, debug=True),
                    speculative_engine="wavefront")
    out = speculative(model, ids, mask, 3, "pipeline", 1, cache=paged_cache(model, debug=True))
    assert out.speculation.engine == "lanes"
    assert out.sequences.tolist() == plain(model, ids, mask, 3).sequences.tolist()
