"""Logits processors with no tensor form and draft hooks on the wavefront engine (`generation.wavefront.host`).

Greedy: the engine's tokens equal plain `generate`'s under each processor (first shown to change plain's output),
and its counters equal the lane decoder's. Draft hooks force rejections: tokens equal plain's, counters the lane
decoder's under the same hook, and the hook saw every draft. Sampling: the joint distribution of two sampled tokens
under `sequence_bias` (before temperature: order matters) and `no_repeat_ngram_size` equals plain sampling's exact
one, and the test rejects the distribution with the processors in the wrong order. Compiled, the engine refuses them
with a `ValueError` naming `compile_core`.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from inputs import left_pad, random_prompts
from sampling_utils import ALPHA, chi_square_p_value, exact_joint, sample_pairs
from speculative_utils import (
    MODES,
    engine_settings,
    forcing_hook,
    mode_params,
    plain,
    real_tokens,
    speculative,
    tiny_spec_model,
)
from transformers import LogitsProcessorList, SequenceBiasLogitsProcessor, TemperatureLogitsWarper
from transformers.generation.logits_process import NoRepeatNGramLogitsProcessor

VOCAB = 64
NEW = 20

PROCESSORS = {
    "no_repeat_ngram_size": lambda c: {"no_repeat_ngram_size": 2},
    "bad_words_ids": lambda c: {"bad_words_ids": [[c[0][3]], c[1][5:7]]},
    "sequence_bias": lambda c: {"sequence_bias": {(c[0][2],): -5.0, (c[1][3], c[1][4]): -10.0}},
    "user_prefix_fn": lambda c: {"prefix_allowed_tokens_fn": lambda b, sent: list(range(1 + 5 * b, 40 + 5 * b))},
    "with_penalty": lambda c: {"no_repeat_ngram_size": 3, "repetition_penalty": 1.3, "suppress_tokens": [c[2][0]]},
}


@pytest.fixture(scope="module")
def setup():
    model = tiny_spec_model(43, 4, vocab=VOCAB, damp=0.15)
    ids, mask = left_pad(random_prompts(43, [5, 2, 8], VOCAB))
    free = plain(model, ids, mask, NEW)
    return model, ids, mask, free, [free.sequences[s, ids.shape[1]:].tolist() for s in range(3)]


def _counts(stats) -> dict:
    return {k: v for k, v in stats.to_dict().items() if k not in ("engine", "cache_fill_calls")}


@pytest.mark.parametrize("mode,d,k", mode_params())
@pytest.mark.parametrize("name", list(PROCESSORS))
def test_host_processors_greedy(setup, name, mode, d, k):
    model, ids, mask, free, conts = setup
    kwargs = PROCESSORS[name](conts)
    ref = plain(model, ids, mask, NEW, **kwargs)
    assert not torch.equal(ref.sequences, free.sequences)  # the processor matters
    out = speculative(model, ids, mask, NEW, mode, d, k, speculative_engine="wavefront", **kwargs)
    lanes = speculative(model, ids, mask, NEW, mode, d, k, debug=True, **kwargs)  # the reference
    assert out.speculation.engine == "wavefront"
    torch.testing.assert_close(out.sequences, ref.sequences, atol=0, rtol=0)
    assert _counts(out.speculation) == _counts(lanes.speculation)


def _plain_rows(free, mask) -> tuple[list[list[int]], list[int]]:
    """Plain decoding's rows without their padding, and the prompt lengths: what `forcing_hook` forces against."""
    return [real_tokens(free.sequences, mask, s) for s in range(len(mask))], [int(n) for n in mask.sum(1)]


PATTERNS = {"all_rejected": lambda s, i: False, "alternating": lambda s, i: i % 2 == 1}


@pytest.mark.parametrize("mode,d,k", mode_params(MODES[:3]))
@pytest.mark.parametrize("pattern", sorted(PATTERNS))
def test_draft_hook_forces_rejections(setup, pattern, mode, d, k):
    model, ids, mask, free, _ = setup
    reference, prompt_lens = _plain_rows(free, mask)
    runs = {}
    for engine in ("wavefront", "lanes"):
        calls = []
        hook = forcing_hook(reference, prompt_lens, PATTERNS[pattern], VOCAB, calls)
        runs[engine] = speculative(model, ids, mask, NEW, mode, d, k, **engine_settings(model, engine), draft_hook=hook)
        assert len(calls) == runs[engine].speculation.drafted  # the hook saw every draft
    out = runs["wavefront"]
    assert out.speculation.engine == "wavefront" and out.speculation.rejected > 0
    assert (out.speculation.accepted > 0) == (pattern != "all_rejected")
    torch.testing.assert_close(out.sequences, free.sequences, atol=0, rtol=0)
    assert _counts(out.speculation) == _counts(runs["lanes"].speculation)


def test_second_draft_hook_runs_on_the_engine(setup):
    """A second hook that proposes the plain token where the first proposal is forced wrong: every forced rejection
    is rescued by the sibling, as in the lane decoder."""
    model, ids, mask, free, _ = setup
    reference, prompt_lens = _plain_rows(free, mask)
    runs = {}
    for engine in ("wavefront", "lanes"):
        calls = []
        first = forcing_hook(reference, prompt_lens, PATTERNS["alternating"], VOCAB)
        second = lambda s, p, f, t, calls=calls: calls.append(s) or reference[s][p]  # noqa: E731
        runs[engine] = speculative(model, ids, mask, NEW, "pipeline", 1, second_draft_loops=3,
                                   **engine_settings(model, engine), draft_hook=first, second_draft_hook=second)
        assert calls
    out = runs["wavefront"]
    assert out.speculation.engine == "wavefront" and out.speculation.second_accepted > 0
    torch.testing.assert_close(out.sequences, free.sequences, atol=0, rtol=0)
    assert _counts(out.speculation) == _counts(runs["lanes"].speculation)


SAMPLED = {"sequence_bias": {(3,): 2.0, (1, 4): 3.0}, "temperature": 0.5, "no_repeat_ngram_size": 2}


def _procs(order):
    bias = SequenceBiasLogitsProcessor({(3,): 2.0, (1, 4): 3.0})
    return LogitsProcessorList({"right": [bias, NoRepeatNGramLogitsProcessor(2), TemperatureLogitsWarper(0.5)],
                                "wrong": [TemperatureLogitsWarper(0.5), bias, NoRepeatNGramLogitsProcessor(2)]}[order])


@pytest.mark.parametrize("mode", [MODES[0], MODES[2]], ids=["pipeline-d1", "block-d1-K4"])
def test_host_processors_sampling_distribution(sampling_model, mode):
    mode_name, d, k = mode
    spec = {"speculative_mode": mode_name, "draft_loops": d, **({"num_speculative_tokens": k} if k else {})}
    counts = sample_pairs(sampling_model, SAMPLED, seed=1, speculative_engine="wavefront", **spec)
    assert chi_square_p_value(counts, exact_joint(sampling_model, {}, _procs("right"))) > ALPHA
    assert chi_square_p_value(counts, exact_joint(sampling_model, {}, _procs("wrong"))) < ALPHA  # order matters


def test_compiled_step_refuses_host_work(setup):
    model, ids, mask, _, _ = setup
    with pytest.raises(ValueError, match=r"NoRepeatNGramLogitsProcessor with compile_core.*drop compile_core"):
        speculative(model, ids, mask, 4, "pipeline", 1, speculative_engine="wavefront", compile_core="eager",
                    no_repeat_ngram_size=2)
    with pytest.raises(ValueError, match=r"draft_hook with compile_core"):
        speculative(model, ids, mask, 4, "pipeline", 1, speculative_engine="wavefront", compile_core="eager",
                    draft_hook=lambda s, p, t: t)
    # a second_draft_hook without second proposals is never called (ignored, as in plain decoding): it was refused
    # as host work of every cycle, and made every cycle run the host hooks
    compiled = speculative(model, ids, mask, 4, "pipeline", 1, speculative_engine="wavefront", compile_core="eager",
                           second_draft_hook=lambda s, p, first, t: t)
    assert torch.equal(compiled.sequences, plain(model, ids, mask, 4).sequences)


BAD_HOOK_RESULTS = {"negative": -1, "past_vocab": VOCAB, "float": 3.0, "two_tokens": torch.tensor([1, 2])}


@pytest.mark.parametrize("engine", ["wavefront", "lanes"])
@pytest.mark.parametrize("bad", sorted(BAD_HOOK_RESULTS))
@pytest.mark.parametrize("which", ["draft_hook", "second_draft_hook"])
def test_hook_returning_no_token_id_is_refused(setup, engine, bad, which):
    """A hook that returns no token id of the vocabulary is named in a `ValueError` by both engines (a -1 read as
    'not forced' by the engine, one past the vocabulary failed in the embedding); a one-element tensor or array is a
    token id."""
    model, ids, mask, _, _ = setup
    hooks = {"draft_hook": lambda s, p, t: t, "second_draft_hook": lambda s, p, f, t: t}
    run = dict(second_draft_loops=3, **engine_settings(model, engine))
    ok = speculative(model, ids, mask, 6, "pipeline", 1, **run, draft_hook=lambda s, p, t: torch.tensor(t),
                     second_draft_hook=lambda s, p, f, t: np.asarray(t))  # (a 0-d array: refused at first)
    assert ok.speculation.drafted > 0 and ok.speculation.second_drafts > 0
    hooks[which] = lambda *args: BAD_HOOK_RESULTS[bad]
    with pytest.raises(ValueError, match=rf"{which} returned .* token id in \[0, {VOCAB}\)"):
        speculative(model, ids, mask, 6, "pipeline", 1, **dict(run, cache=engine_settings(model, engine)["cache"]),
                    **hooks)
