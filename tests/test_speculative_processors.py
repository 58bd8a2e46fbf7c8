"""Stopping criteria, logits processors, streamers and per-step scores/logits under speculative decoding.

Every run is compared with plain greedy decoding given the same settings. Each setting is first shown to matter
(plain decoding with it differs from plain decoding without it), so equality is not vacuous. The model's loops
agree often (damped residual branches), so drafts are both accepted and rejected while processors are active.
"""

from __future__ import annotations

import string

import pytest
import torch
from inputs import left_pad, random_prompts
from recorders import RecordingStreamer
from speculative_utils import (
    MODES,
    PAD,
    assert_cache_matches_ar,
    assert_counter_invariants,
    first_new_occurrence,
    generated_counts,
    mode_params,
    plain,
    speculative,
    tiny_spec_model,
)
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from tolerances import assert_fp32_close, ouro_depth
from transformers import PreTrainedTokenizerFast

VOCAB = 64
NEW = 30
# the settings of the matrix that draft from one loop, for the processors whose subject is not the schedule
ONE_DRAFT_LOOP = mode_params(keep=lambda mode, d, k: d == 1)


@pytest.fixture(scope="module")
def setup():
    """(model, ids, mask, plain continuation per row), checked for what the tests rely on: no continuation emits the
    pad id (the stop-string tests decode them as text), and unprocessed drafts are both accepted and rejected."""
    model = tiny_spec_model(43, 4, vocab=VOCAB, damp=0.15)
    ids, mask = left_pad(random_prompts(43, [5, 2, 8], VOCAB))
    free = plain(model, ids, mask, NEW)
    conts = [free.sequences[s, ids.shape[1]:].tolist() for s in range(3)]
    assert all(PAD not in c for c in conts)
    stats = speculative(model, ids, mask, NEW, *MODES[0], debug=False).speculation
    assert stats.accepted > 0 and stats.rejected > 0, stats.to_dict()
    return model, ids, mask, conts


def char_tokenizer() -> PreTrainedTokenizerFast:
    """One character per token: id 0 is the pad token, ids 1..63 are a-z A-Z 0-9 . _"""
    chars = string.ascii_lowercase + string.ascii_uppercase + string.digits + "._"
    vocab = {"<pad>": PAD, **{chars[i - 1]: i for i in range(1, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>")


def check(model, ids, mask, mode, d, k, max_new=NEW, **kwargs):
    """Speculative == plain under `kwargs`; returns the plain output."""
    ref = plain(model, ids, mask, max_new, **kwargs)
    out = speculative(model, ids, mask, max_new, mode, d, k, **kwargs)
    torch.testing.assert_close(out.sequences, ref.sequences, atol=0, rtol=0)
    return ref, out


def _differs(model, ids, mask, **kwargs) -> bool:
    return not torch.equal(plain(model, ids, mask, NEW, **kwargs).sequences, plain(model, ids, mask, NEW).sequences)


def _stop_string(tok, tokens, start):
    """Two consecutive tokens' text at generated index >= start that does not occur earlier in the text."""
    text = tok.decode(tokens)
    return next(text[i:i + 2] for i in range(start, len(text) - 2) if text[i:i + 2] not in text[:i + 1])


def _never_emitted(conts):
    return next(t for t in range(1, VOCAB) if all(t not in c for c in conts))


@pytest.mark.parametrize("mode,d,k", mode_params())
def test_stop_strings(setup, mode, d, k):
    model, ids, mask, conts = setup
    tok = char_tokenizer()
    stop = _stop_string(tok, conts[0], 6)
    # batch 1: the run ends with the stop string
    row = slice(int((mask[0] == 0).sum()), None)
    ref, _ = check(model, ids[:1, row], mask[:1, row], mode, d, k, stop_strings=[stop], tokenizer=tok)
    assert ref.sequences.shape[1] < ids[:1, row].shape[1] + NEW and tok.decode(ref.sequences[0]).endswith(stop)
    # batch 3 with an eos id (never emitted): plain decoding pads a row once its stop string appeared
    eos = _never_emitted(conts)
    stops = [stop, _stop_string(tok, conts[1], 4)]
    ref, out = check(model, ids, mask, mode, d, k, stop_strings=stops, tokenizer=tok, eos_token_id=eos)
    assert (ref.sequences[0, -3:] == PAD).all() and tok.decode(ref.sequences[0]).replace("<pad>", "").endswith(stop)
    committed = [len(tok.decode(ref.sequences[s, ids.shape[1]:]).replace("<pad>", "")) for s in range(3)]
    assert_counter_invariants(out.speculation, committed)
    assert_cache_matches_ar(out.cache, ref.cache, mask, committed, model.config.num_hidden_layers,
                            model_depth=ouro_depth(model.config))


@pytest.mark.parametrize("mode,d,k", mode_params())
def test_stop_string_in_batch_without_eos(setup, mode, d, k):
    model, ids, mask, conts = setup
    tok = char_tokenizer()
    check(model, ids, mask, mode, d, k, stop_strings=[_stop_string(tok, conts[0], 6)], tokenizer=tok)


@pytest.mark.parametrize("mode,d,k", mode_params())
def test_eos_token_id_list(setup, mode, d, k):
    model, ids, mask, conts = setup
    first = {t: i for i, t in reversed(list(enumerate(conts[1])))}
    eos_a = next(t for t, i in sorted(first.items(), key=lambda x: x[1]) if i >= 5 and t not in conts[0])
    eos_b = _never_emitted(conts)
    ref, out = check(model, ids, mask, mode, d, k, eos_token_id=[eos_b, eos_a])
    committed = generated_counts(ref.sequences, ids.shape[1], NEW, [eos_a, eos_b])
    assert committed[1] == first[eos_a] + 1 and committed[0] == NEW
    assert_counter_invariants(out.speculation, committed)
    assert_cache_matches_ar(out.cache, ref.cache, mask, committed, model.config.num_hidden_layers,
                            model_depth=ouro_depth(model.config))


@pytest.mark.parametrize("mode,d,k", mode_params())
def test_repetition_penalty_batch1(setup, mode, d, k):
    model, ids, mask, _ = setup
    row = slice(int((mask[2] == 0).sum()), None)
    ids, mask = ids[2:, row], mask[2:, row]
    assert _differs(model, ids, mask, repetition_penalty=1.5)
    ref, out = check(model, ids, mask, mode, d, k, repetition_penalty=1.5)
    assert out.speculation.accepted > 0 and out.speculation.rejected > 0
    assert_cache_matches_ar(out.cache, ref.cache, mask, [NEW], model.config.num_hidden_layers,
                            model_depth=ouro_depth(model.config))


@pytest.mark.parametrize("mode,d,k", ONE_DRAFT_LOOP)
def test_repetition_penalty_padded_batch(setup, mode, d, k):
    model, ids, mask, _ = setup
    check(model, ids, mask, mode, d, k, repetition_penalty=1.5)


@pytest.mark.parametrize("mode,d,k", ONE_DRAFT_LOOP)
def test_prefix_allowed_tokens_fn_sees_the_batch_index(setup, mode, d, k):
    model, ids, mask, _ = setup

    def allowed(batch_id, sent):
        return list(range(1 + 10 * batch_id, 30 + 10 * batch_id))

    check(model, ids, mask, mode, d, k, prefix_allowed_tokens_fn=allowed)


@pytest.mark.parametrize("mode", ["plain", "pipeline", "block", "auto"])
def test_prefix_allowed_tokens_fn_sees_the_prompt_index_with_several_samples_per_prompt(setup, mode):
    """Sampling `num_return_sequences=2` per prompt: the function gets the prompt's index (row // 2), as plain
    decoding gives it, and each row keeps its prompt's constraint (the speculative modes raised from inside the
    processor, auto passed the repeated row's index and constrained rows by another prompt's rule)."""
    model, ids, mask, _ = setup
    seen = set()

    def allowed(batch_id, sent):
        seen.add(batch_id)
        return [t for t in range(1, VOCAB) if t % 3 == batch_id]

    settings = {} if mode == "plain" else {"speculative_mode": mode} | ({} if mode == "auto" else {"draft_loops": 1})
    out = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=True, num_return_sequences=2,
                         prefix_allowed_tokens_fn=allowed, pad_token_id=PAD, eos_token_id=None, **settings)
    assert seen == {0, 1, 2}
    assert [sorted({t % 3 for t in row}) for row in out[:, ids.shape[1]:].tolist()] == [[b] for b in (0, 0, 1, 1, 2, 2)]


PROCESSORS = {
    "no_repeat_ngram_size": lambda conts: {"no_repeat_ngram_size": 2},
    "sequence_bias": lambda conts: {"sequence_bias": {(conts[0][2],): -5.0, (conts[1][3], conts[1][4]): -10.0}},
    "suppress_tokens": lambda conts: {"suppress_tokens": [conts[0][1], conts[2][0]]},
    "begin_suppress_tokens": lambda conts: {"begin_suppress_tokens": [conts[0][0], conts[1][0]]},
    "exponential_decay_length_penalty": lambda conts: {"exponential_decay_length_penalty": (3, 1.5),
                                                       "eos_token_id": conts[1][9]},
    "forced_eos_token_id": lambda conts: {"forced_eos_token_id": conts[2][3], "eos_token_id": conts[2][3]},
    "prefix_allowed_tokens_fn_row_independent": lambda conts: {
        "prefix_allowed_tokens_fn": lambda batch_id, sent: [t for t in range(1, VOCAB) if t % 3 != int(sent[-1]) % 3]},
}


@pytest.mark.parametrize("mode,d,k", mode_params())
@pytest.mark.parametrize("name", list(PROCESSORS))
def test_other_processors_padded_batch(setup, name, mode, d, k):
    model, ids, mask, conts = setup
    kwargs = PROCESSORS[name](conts)
    assert _differs(model, ids, mask, **kwargs)
    check(model, ids, mask, mode, d, k, **kwargs)


@pytest.mark.parametrize("mode,d,k", mode_params())
def test_min_new_tokens(setup, mode, d, k):
    model, ids, mask, conts = setup
    eos = conts[0][2]  # row 0 would stop after 3 tokens
    kwargs = {"eos_token_id": eos, "min_new_tokens": 9}
    assert _differs(model, ids, mask, **kwargs) and not torch.equal(
        plain(model, ids, mask, NEW, eos_token_id=eos).sequences, plain(model, ids, mask, NEW, **kwargs).sequences)
    ref, out = check(model, ids, mask, mode, d, k, **kwargs)
    committed = generated_counts(ref.sequences, ids.shape[1], NEW, eos)
    assert min(committed) >= 9
    assert_counter_invariants(out.speculation, committed)


@pytest.mark.parametrize("mode,d,k", mode_params())
def test_bad_words_ids(setup, mode, d, k):
    model, ids, mask, conts = setup
    bad = [[conts[0][3]], conts[1][5:7], conts[2][1:4]]
    assert _differs(model, ids, mask, bad_words_ids=bad)
    ref, out = check(model, ids, mask, mode, d, k, bad_words_ids=bad)
    assert conts[0][3] not in ref.sequences[0, ids.shape[1]:].tolist()
    assert_counter_invariants(out.speculation, [NEW] * 3)


@pytest.mark.parametrize("mode,d,k", mode_params())
@pytest.mark.parametrize("rows", [[2], [0, 1, 2]], ids=["batch1", "batch3_ragged"])
def test_all_processors_together(setup, rows, mode, d, k):
    model, ids, mask, conts = setup
    tok = char_tokenizer()
    kwargs = {"bad_words_ids": [[conts[2][1]]], "min_new_tokens": 4, "no_repeat_ngram_size": 3,
              "eos_token_id": [conts[0][1], conts[1][12]], "stop_strings": [tok.decode(conts[2][15:17])],
              "tokenizer": tok}
    ids, mask = ids[rows], mask[rows]
    if len(rows) == 1:  # repetition_penalty only without padding (see test_repetition_penalty_padded_batch)
        kwargs["repetition_penalty"] = 1.2
        ids, mask = ids[:, int((mask[0] == 0).sum()):], mask[:, int((mask[0] == 0).sum()):]
    assert _differs(model, ids, mask, **kwargs)
    check(model, ids, mask, mode, d, k, **kwargs)


@pytest.mark.parametrize("mode,d,k", mode_params())
@pytest.mark.parametrize("rows", [[0], [0, 1, 2]], ids=["batch1", "batch3_ragged"])
def test_streamer_sees_the_plain_token_sequence(setup, rows, mode, d, k):
    """The streamer receives the same values in the same order as with plain decoding (the prompt, then one column
    per step, finished rows as pad), and end() exactly once, also when a row stops at eos."""
    model, ids, mask, conts = setup
    ids, mask = ids[rows], mask[rows]
    if len(rows) == 1:
        ids, mask = ids[:, mask[0].argmax():], mask[:, mask[0].argmax():]
    eos = conts[0][7]
    streams = []
    for decode in ("plain", "speculative"):
        streamer = RecordingStreamer()
        kwargs = {"streamer": streamer, "eos_token_id": eos}
        if decode == "plain":
            out = plain(model, ids, mask, NEW, **kwargs)
        else:
            out = speculative(model, ids, mask, NEW, mode, d, k, **kwargs)
        assert streamer.ends == 1
        streams.append((out.sequences, streamer.puts))
    (ref_seq, ref_puts), (seq, puts) = streams
    torch.testing.assert_close(seq, ref_seq, atol=0, rtol=0)
    assert len(puts) == len(ref_puts) == 1 + ref_seq.shape[1] - ids.shape[1]
    for i, (a, b) in enumerate(zip(puts, ref_puts)):
        assert a == b, f"put #{i}: {a} != plain {b}"


@pytest.mark.parametrize("mode,d,k", mode_params())
def test_output_scores_and_logits(setup, mode, d, k):
    """Per-step processed scores and raw logits equal plain decoding's (up to fp32 rounding) for every row and step
    before the row finished; one row stops at eos, so later steps of that row are not compared."""
    model, ids, mask, _ = setup
    processed = plain(model, ids, mask, NEW, no_repeat_ngram_size=2).sequences[:, ids.shape[1]:].tolist()
    eos = min((i, t) for t, i in first_new_occurrence(processed[1], 6).items() if t not in processed[0])[1]
    kwargs = {"output_scores": True, "output_logits": True, "no_repeat_ngram_size": 2, "eos_token_id": eos}
    ref, out = check(model, ids, mask, mode, d, k, **kwargs)
    committed = generated_counts(ref.sequences, ids.shape[1], NEW, eos)
    assert min(committed) < max(committed)
    for name in ("scores", "logits"):
        got, want = getattr(out, name), getattr(ref, name)
        assert len(got) == len(want) == max(committed)
        for step, (g, w) in enumerate(zip(got, want)):
            assert g.shape == w.shape == (3, VOCAB)
            for s in range(3):
                if step < committed[s]:
                    where = f"{name}[{step}][{s}]"
                    assert_fp32_close(g[s], w[s], **ouro_depth(model.config),
                                      msg=lambda m, where=where: f"{where}: {m}")
