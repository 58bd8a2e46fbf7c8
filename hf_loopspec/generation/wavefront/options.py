"""The wavefront engine's keyword arguments for a `dispatch.SpeculativeRequest` (`WavefrontEngine.from_request`):
the request's settings, with its logits processors and EOS criteria in the engine's device form."""

from __future__ import annotations

from ..columns import stopping_eos_ids
from .processing import device_processors
from .stopping import HOST_READ_EVERY, host_criteria

DEFAULT_READ_EVERY = 4  # R: cycles between read-backs, without host criteria or traces


def engine_options(model, request) -> dict:
    """`WavefrontEngine`'s keyword arguments (all but the model and the cache) for `request`."""
    spec, ids = request.spec, request.input_ids
    processors, tensors = device_processors(request.logits_processor, ids, model.head_width)
    eos = stopping_eos_ids(request.stopping_criteria)
    return dict(mode=spec.mode, draft_loops=spec.draft_loops, num_speculative_tokens=spec.num_speculative_tokens,
                input_ids=ids, attention_mask=request.attention_mask, pad_token_id=request.pad_token_id,
                max_length=request.max_length, eos_token_id=eos or None, compile_backend=spec.compile_backend,
                streamer=request.streamer, processors=processors, do_sample=bool(request.do_sample),
                complete_cache=bool(request.complete_cache), second_draft_loops=spec.second_draft_loops,
                exit_rule=request.exit_rule, stopping_criteria=request.stopping_criteria,
                output_scores=bool(request.output_scores), output_logits=bool(request.output_logits),
                trace=request.trace or False, read_every=read_every(request),
                logits_processor=request.logits_processor, draft_hook=request.draft_hook,
                second_draft_hook=request.second_draft_hook, **tensors)


def read_every(request) -> int:
    """R for `request`: 1 when traced (`tracing` reads every cycle), `stopping.HOST_READ_EVERY` with criteria the
    host judges, else `DEFAULT_READ_EVERY`."""
    if request.trace:
        return 1
    return HOST_READ_EVERY if host_criteria(request.stopping_criteria, request.max_length) else DEFAULT_READ_EVERY
