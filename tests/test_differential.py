"""Speculative `generate` against plain greedy decoding over random settings (`differential`), and the regressions
it found.

`test_random_case` runs `CASES` seeded cases of `differential.draw_case` (the whole settings space: family, loops,
mode, d, K, d2, engine, batch and padding, EOS lists, processors, exit options, int32 ids, use_cache=False,
output_scores, cache continuation); each must give plain's tokens, or diverge only at a near-tie that fp32 rounding
can flip (plain's top-1 / top-2 margin below the bound `differential` derives). `scripts/differential_soak.py` runs
many more seeds.
"""

from __future__ import annotations

import pytest
import torch
from differential import REFUSED, NoFollower, draw_case, model_for, run_case
from huginn_utils import VOCAB as HUGINN_VOCAB
from inputs import extend, left_pad, random_prompts
from speculative_utils import MODES, generate_dict, mode_id, mode_kwargs, paged_cache, plain
from transformers import LogitsProcessorList

from hf_loopspec import PagedLoopCache
from hf_loopspec.generation.wavefront import WavefrontEngine

CASES = 96  # seeds 0..CASES-1: 35-60 s on one core (the whole file 45-80 s), by the load of the machine


@pytest.mark.parametrize("seed", range(CASES))
def test_random_case(seed):
    mismatch = run_case(draw_case(seed))
    assert mismatch is None or mismatch.near_tie, str(mismatch)


FAMILIES = {"ouro": (dict(family="ouro", seed=1, loops=4, damp=0.3), {}, 64),
            "huginn": (dict(family="huginn", seed=1, loops=4, damp=0.3),
                       {"num_steps": 4, "init_scale": 1.0, "init_seed": 5}, HUGINN_VOCAB)}


@pytest.mark.parametrize("processor", [False, True], ids=["no-processor", "user-processor"])
@pytest.mark.parametrize("mode,d,k", [pytest.param(*m, id=mode_id(*m)) for m in MODES])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_use_cache_false_gives_plain_tokens(family, mode, d, k, processor):
    """use_cache=False, without a cache passed: plain's tokens in every mode, also with a user logits processor
    (speculative `generate` then decodes plainly, and did so on the PagedLoopCache it had made for speculation:
    a mask / cache length `ValueError`, or other tokens)."""
    spec, settings, vocab = FAMILIES[family]
    model = model_for(**spec)
    ids, mask = left_pad(random_prompts(3, [5, 2, 4], vocab))
    extra = {"logits_processor": LogitsProcessorList([NoFollower(vocab)])} if processor else {}
    ref = plain(model, ids, mask, 12, **settings, **extra)
    out = generate_dict(model, ids, mask, 12, use_cache=False, **mode_kwargs(mode, d, k), **settings, **extra)
    assert out.sequences.tolist() == ref.sequences.tolist()
    assert out.cache is None


@pytest.mark.parametrize("mode", [None, "pipeline", "auto"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_use_cache_none_means_the_default(family, mode):
    """`use_cache=None` and `max_length=None` (as a wrapper passes unset options on) decode as if they were not
    given: plain decoding fed `use_cache` to every forward, where it made a fresh cache per step, and returned other
    tokens (transformers' own models do too); a None `max_length` was added to the prompt's length (a TypeError in
    every mode). Reference: greedy argmax over full forward passes with no cache, one unpadded row."""
    spec, settings, vocab = FAMILIES[family]
    model = model_for(**spec)
    ids = random_prompts(6, [5], vocab)[0][None]
    seq = ids
    with torch.no_grad():
        for _ in range(8):
            logits = model(seq, use_cache=False, **settings).logits[:, -1]
            seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], 1)
    spec_kwargs = {} if mode is None else {"speculative_mode": mode}
    out = model.generate(ids, max_new_tokens=8, do_sample=False, use_cache=None, **spec_kwargs, **settings)
    assert out.tolist() == seq.tolist()
    unset = model.generate(ids, max_length=None, do_sample=False, **spec_kwargs, **settings)  # no length given
    assert unset.shape == model.generate(ids, do_sample=False, **spec_kwargs, **settings).shape
    assert unset[:, : seq.shape[1]].tolist() == seq.tolist()


@pytest.mark.parametrize("mode,d,k", [pytest.param(*m, id=mode_id(*m)) for m in MODES])
def test_huginn_continues_a_filled_cache(mode, d, k):
    """Huginn continuing a cache that a pipeline call filled (reported to crash in the wavefront engine's set-up):
    plain's tokens over the whole sequence, or the engine's documented refusal."""
    spec, settings, vocab = FAMILIES["huginn"]
    model = model_for(**spec)
    ids, mask = left_pad(random_prompts(4, [5, 2, 4], vocab))
    cache = paged_cache(model, debug=False, num_steps=settings["num_steps"])
    first = generate_dict(model, ids, mask, 6, cache=cache, **mode_kwargs("pipeline", 1), **settings)
    full, full_mask = extend(first.sequences, mask, random_prompts(5, [2, 1, 3], vocab))
    ref = plain(model, full, full_mask, 8, **settings)
    try:
        out = generate_dict(model, full, full_mask, 8, cache=cache, **mode_kwargs(mode, d, k), **settings)
    except ValueError as error:
        assert str(error).startswith(REFUSED), error
        return
    assert out.sequences.tolist() == ref.sequences.tolist()


def test_wavefront_engine_sets_up_a_model_with_entry_or_exit_kv():
    """The engine's own set-up (as the bench calls it, without `generate`'s engine choice) runs Huginn, whose lanes
    are twice the embedding width (it crashed in the state's set-up), to plain's tokens, seeded initial states
    included."""
    spec, settings, vocab = FAMILIES["huginn"]
    model = model_for(**spec)
    ids, mask = left_pad(random_prompts(6, [5, 2], vocab))
    ref = plain(model, ids, mask, 6, eos_token_id=None, **settings)
    with torch.no_grad(), model.recurrence(**settings):
        result = WavefrontEngine(model, PagedLoopCache(model.kv_layout), mode="pipeline", draft_loops=1,
                                 num_speculative_tokens=4, input_ids=ids, attention_mask=mask, pad_token_id=0,
                                 max_length=ids.shape[1] + 6).run()
    assert result.sequences.tolist() == ref.sequences.tolist()
