"""Logits processors that the lane decoder cannot run losslessly: `generate` decodes plainly, warns once naming the
processor (through transformers' logging, so its verbosity applies), and reports the fallback in
`out.speculation.fallback`; the output is plain decoding's.

The cases are a stateful processor that runs the model on its own context (classifier-free guidance through
`guidance_scale`), watermarking (`SynthIDTextWatermarkingConfig`, under seeded sampling) and a user's processor
that treats batch rows differently. Each is first shown to change plain decoding's output, so equality is not
vacuous; the expectation is plain decoding with the same settings.
"""

from __future__ import annotations

import logging

import pytest
import torch
from inputs import left_pad, random_prompts
from speculative_utils import generate_dict, paged_cache, tiny_spec_model
from transformers import LogitsProcessor, LogitsProcessorList, SynthIDTextWatermarkingConfig
from transformers.utils import logging as transformers_logging

VOCAB = 64
NEW = 10


class RowBias(LogitsProcessor):
    """Favours token 10 + batch row: called one row at a time, every row would favour token 10."""

    def __call__(self, input_ids, scores):
        rows = torch.arange(len(scores))
        scores = scores.clone()
        scores[rows, 10 + rows] += 50.0
        return scores


CASES = {
    "guidance_scale": ({"guidance_scale": 1.5}, "UnbatchedClassifierFreeGuidanceLogitsProcessor"),
    "synthid": ({"do_sample": True, "watermarking_config": SynthIDTextWatermarkingConfig(
        keys=[654, 400, 836, 123, 340], ngram_len=3)}, "SynthIDTextWatermarkLogitsProcessor"),
    "row_bias": ({"logits_processor": LogitsProcessorList([RowBias()])}, "RowBias"),
}


@pytest.fixture(scope="module")
def setup():
    model = tiny_spec_model(81, 4, vocab=VOCAB, damp=0.15)
    return model, *left_pad(random_prompts(81, [5, 3], VOCAB))


def run(model, ids, mask, seed=0, **kwargs):
    """A seeded greedy (or, with do_sample, sampled) call; returns the dict output."""
    torch.manual_seed(seed)
    return generate_dict(model, ids, mask, NEW, **kwargs)


def fallback_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "plain decoding instead" in r.getMessage()]


@pytest.mark.parametrize("mode", ["pipeline", "block"])
@pytest.mark.parametrize("case", list(CASES))
def test_unsupported_processor_falls_back_to_plain_with_one_warning(setup, case, mode, caplog):
    model, ids, mask = setup
    settings, name = CASES[case]
    ref = run(model, ids, mask, **settings)
    without = {k: v for k, v in settings.items() if k == "do_sample"}
    assert ref.sequences.tolist() != run(model, ids, mask, **without).sequences.tolist()
    transformers_logging.warning_once.cache_clear()  # "once per process": forget the other cases' warnings
    with caplog.at_level(logging.WARNING, logger="hf_loopspec"):
        outs = [run(model, ids, mask, speculative_mode=mode, cache=paged_cache(model), **settings) for _ in range(2)]
    warnings = fallback_warnings(caplog)
    assert len(warnings) == 1 and name in warnings[0]
    for out in outs:
        assert out.sequences.tolist() == ref.sequences.tolist()
        assert name in out.speculation.fallback and out.speculation.mode == mode
        assert out.speculation.core_calls == out.speculation.committed_tokens == 0


def test_transformers_verbosity_silences_the_fallback_warning(setup, caplog):
    """`transformers.logging.set_verbosity_error()` silences hf_loopspec's warning as it silences transformers'
    own; back at transformers' default verbosity the same warning is logged."""
    model, ids, mask = setup
    settings = CASES["row_bias"][0]
    before = transformers_logging.get_verbosity()
    try:
        transformers_logging.set_verbosity_error()
        transformers_logging.warning_once.cache_clear()
        with caplog.at_level(logging.WARNING, logger="hf_loopspec"):
            out = run(model, ids, mask, speculative_mode="pipeline", **settings)
        assert out.speculation.fallback is not None and fallback_warnings(caplog) == []
        transformers_logging.set_verbosity_warning()
        transformers_logging.warning_once.cache_clear()
        with caplog.at_level(logging.WARNING, logger="hf_loopspec"):
            run(model, ids, mask, speculative_mode="pipeline", **settings)
        assert len(fallback_warnings(caplog)) == 1
    finally:
        transformers_logging.set_verbosity(before)


def test_row_pure_processors_still_run_speculatively(setup):
    model, ids, mask = setup
    settings = {"repetition_penalty": 1.3, "no_repeat_ngram_size": 2, "suppress_tokens": [3, 4]}
    out = run(model, ids, mask, speculative_mode="pipeline", **settings)
    assert out.speculation.fallback is None and out.speculation.committed_tokens > 0
    assert out.sequences.tolist() == run(model, ids, mask, **settings).sequences.tolist()
