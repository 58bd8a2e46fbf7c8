"""The wavefront engine's keyword arguments for a `dispatch.SpeculativeRequest` (`WavefrontEngine.from_request`):
the request's settings, with its logits processors and EOS criteria in the engine's device form."""

from __future__ import annotations

from transformers import EosTokenCriteria

from .processing import device_processors


def engine_options(model, request) -> dict:
    """`WavefrontEngine`'s keyword arguments (all but the model and the cache) for `request`."""
    spec, ids = request.spec, request.input_ids
    processors, tensors = device_processors(request.logits_processor, ids,
                                            model.get_output_embeddings().weight.shape[0])
    eos = [int(t) for c in request.stopping_criteria or () if isinstance(c, EosTokenCriteria)
           for t in c.eos_token_id.reshape(-1).tolist()]
    return dict(mode=spec.mode, draft_loops=spec.draft_loops, num_speculative_tokens=spec.num_speculative_tokens,
                input_ids=ids, attention_mask=request.attention_mask, pad_token_id=request.pad_token_id,
                max_length=request.max_length, eos_token_id=eos or None, compile_backend=spec.compile_backend,
                streamer=request.streamer, processors=processors, do_sample=bool(request.do_sample),
                complete_cache=bool(request.complete_cache), second_draft_loops=spec.second_draft_loops, **tensors)
