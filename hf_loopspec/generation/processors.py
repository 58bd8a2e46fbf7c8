"""Which logits processors the lane decoder may run, and how it runs them one batch row at a time.

The lane decoder calls the processors once per draft and once per target, on one row (`[1, len]`), in an order
that differs from plain decoding's one call per step over the whole batch. That gives plain's scores only for a
processor that is a pure function of (that row's ids, that row's scores): no state kept between calls, nothing
read from other rows, no randomness of its own. `ROW_PURE` lists transformers' built-in processors and warpers
known to be such (two of them after narrowing to the row, see `row_processors`); matched by exact class, since a
subclass may add state. Any other processor (classifier-free guidance, which runs the model on its own context;
watermarking; a user's own class) makes `generate` decode plainly instead, with a warning logged once per reason
(`plain_fallback`).
"""

from __future__ import annotations

import copy

import torch
from transformers import LogitsProcessorList
from transformers.generation import logits_process as lp

from ..logs import get_logger

FALLBACK_LOG = get_logger(__name__)  # one logger for every mode: its `warning_once` counts


def warn_fallback(reason: str) -> None:
    """Log `reason`, why a speculative call decodes plainly, once per process whichever mode found it (the fixed
    modes and auto logged it on loggers of their own, each once)."""
    FALLBACK_LOG.warning_once("hf_loopspec: %s.", reason)


ROW_PURE = frozenset({
    lp.EpsilonLogitsWarper, lp.EtaLogitsWarper, lp.ExponentialDecayLengthPenalty, lp.ForcedBOSTokenLogitsProcessor,
    lp.ForcedEOSTokenLogitsProcessor, lp.InfNanRemoveLogitsProcessor, lp.LogitNormalization,
    lp.MinLengthLogitsProcessor, lp.MinNewTokensLengthLogitsProcessor, lp.MinPLogitsWarper,
    lp.NoBadWordsLogitsProcessor,
    lp.NoRepeatNGramLogitsProcessor, lp.SequenceBiasLogitsProcessor, lp.SuppressTokensAtBeginLogitsProcessor,
    lp.SuppressTokensLogitsProcessor, lp.TemperatureLogitsWarper, lp.TopHLogitsWarper, lp.TopKLogitsWarper,
    lp.TopPLogitsWarper, lp.TypicalLogitsWarper,
    lp.RepetitionPenaltyLogitsProcessor,  # narrowed: its per-row `prompt_ignore_length`
    lp.PrefixConstrainedLogitsProcessor,  # narrowed: the batch index its function receives
})

def plain_fallback(processors) -> str | None:
    """Why these processors cannot run speculatively (naming them), or None when they all can."""
    others = sorted({type(p).__name__ for p in processors or () if type(p) not in ROW_PURE})
    if not others:
        return None
    return (f"logits processor {', '.join(others)} is not known to be a pure function of one row's ids and scores "
            "(it may keep state across calls or read other rows), so speculative decoding could change its output; "
            "decoded with plain decoding instead")


def row_processors(processors: LogitsProcessorList, row: int) -> LogitsProcessorList:
    """The processors as they apply to batch row `row` alone (the decoder calls them one row at a time).

    Processors that hold per-row state are narrowed to that row: a repetition penalty's per-row
    `prompt_ignore_length`, and the batch index that `prefix_allowed_tokens_fn` receives (the row's prompt, as in
    plain decoding, where rows are grouped `num_return_sequences` to a prompt).
    """
    narrowed = LogitsProcessorList()
    for processor in processors:
        if isinstance(processor, lp.RepetitionPenaltyLogitsProcessor) \
                and torch.is_tensor(processor.prompt_ignore_length):
            processor = copy.copy(processor)
            processor.prompt_ignore_length = processor.prompt_ignore_length[row : row + 1]
        elif isinstance(processor, lp.PrefixConstrainedLogitsProcessor):
            # its batch id is the prompt's: rows are grouped by num_beams (= num_return_sequences when sampling)
            allowed, prompt = processor._prefix_allowed_tokens_fn, row // processor._num_beams
            processor = copy.copy(processor)
            processor._num_beams = 1
            processor._prefix_allowed_tokens_fn = lambda _, tokens, fn=allowed, b=prompt: fn(b, tokens)
        narrowed.append(processor)
    return narrowed
