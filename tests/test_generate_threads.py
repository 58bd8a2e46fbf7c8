"""Per-call options are scoped to the call, never stored on the model: two threads calling `generate` on one model
with different options (`draft_hook`, `speculative_trace`, speculative settings; Huginn's `num_steps`, `init_scale`,
`init_seed`) get exactly what the same calls give one after another, and the model's defaults are unchanged after.

The calls are made to overlap: each thread's streamer waits, at its first `put` (the prompt, which `generate` feeds
after it has prepared the call's settings and before any decoding), until every thread has got there.
"""

from __future__ import annotations

import threading

import torch
from huginn_utils import VOCAB as HUGINN_VOCAB
from huginn_utils import tiny_huginn
from inputs import left_pad, random_ids, random_prompts
from speculative_utils import PAD, tiny_spec_model
from transformers.generation.streamers import BaseStreamer

from hf_loopspec import PagedLoopCache
from hf_loopspec.generation.call import current_call
from hf_loopspec.models.huginn.modeling_huginn import Recurrence

NEW = 12


class Rendezvous(BaseStreamer):
    """Waits at its first `put` until all parties of `barrier` have arrived; records the columns it is fed."""

    def __init__(self, barrier: threading.Barrier | None):
        self.barrier, self.columns = barrier, []

    def put(self, value):
        if self.barrier is not None and not self.columns:
            self.barrier.wait(timeout=120)
        self.columns.append(value.tolist())

    def end(self):
        pass


def run_together(calls):
    """Run every `call(streamer)` in its own thread, overlapping (see the module docstring); returns the results."""
    barrier = threading.Barrier(len(calls))
    results, errors = [None] * len(calls), []

    def work(i, call):
        try:
            results[i] = call(Rendezvous(barrier))
        except BaseException as error:  # re-raised in the test's thread
            errors.append(error)
            barrier.abort()

    threads = [threading.Thread(target=work, args=(i, call)) for i, call in enumerate(calls)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


def run_one_by_one(calls):
    return [call(Rendezvous(None)) for call in calls]


def recording_hook(calls: list, shift: int, vocab: int):
    """A `draft_hook` that proposes `proposed + shift` (mod vocab) and records every call."""

    def hook(seq, position, proposed):
        calls.append((seq, position))
        return (proposed + shift) % vocab

    return hook


def test_ouro_calls_in_two_threads_keep_their_own_hooks_traces_and_settings():
    vocab = 64
    model = tiny_spec_model(71, 4, vocab=vocab, damp=0.1)
    ids, mask = left_pad(random_prompts(71, [5, 3], vocab))

    def calls(hooked: list, other: list):
        def traced_pipeline(streamer):
            return model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=PAD,
                                  return_dict_in_generate=True, speculative_mode="pipeline", draft_loops=1,
                                  draft_hook=recording_hook(hooked, 1, vocab), speculative_trace=True,
                                  streamer=streamer)

        def block(streamer):
            return model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=PAD,
                                  return_dict_in_generate=True, speculative_mode="block", draft_loops=2,
                                  num_speculative_tokens=3, draft_hook=recording_hook(other, 0, vocab),
                                  streamer=streamer)

        return [traced_pipeline, block]

    with torch.no_grad():
        serial_hooked, serial_other = [], []
        serial = run_one_by_one(calls(serial_hooked, serial_other))
        hooked, other = [], []
        together = run_together(calls(hooked, other))
        plain = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=PAD)
    for alone, overlapped in zip(serial, together):
        assert overlapped.sequences.tolist() == alone.sequences.tolist() == plain.tolist()
        assert overlapped.speculation.to_dict() == alone.speculation.to_dict()
    (pipe, block), (pipe_alone, _) = together, serial
    assert pipe.speculation.mode == "pipeline" and block.speculation.mode == "block"
    assert block.speculation.draft_loops == 2
    assert sorted(hooked) == sorted(serial_hooked) and len(hooked) == pipe.speculation.drafted
    assert sorted(other) == sorted(serial_other) and len(other) == block.speculation.drafted
    assert block.trace is None and len(pipe.trace) == len(pipe_alone.trace) == pipe.speculation.core_calls
    assert current_call() is None


def test_huginn_calls_in_two_threads_keep_their_recurrence_settings():
    model, _ = tiny_huginn(seed=3, damp=0.1)
    defaults = Recurrence(model.config.mean_recurrence, 1.0, None)
    ids, mask = left_pad([random_ids(n, HUGINN_VOCAB, seed=70 + n) for n in (5, 2)], PAD)

    def plain_4_steps(streamer):
        return model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=PAD,
                              eos_token_id=None, num_steps=4, init_scale=0.0, streamer=streamer)

    def pipeline_8_steps(streamer):
        with model.recurrence(num_steps=8):
            cache = PagedLoopCache(model.kv_layout)
        return model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=PAD,
                              eos_token_id=None, num_steps=8, init_scale=1.0, init_seed=9, cache=cache,
                              speculative_mode="pipeline", draft_loops=2, streamer=streamer)

    calls = [plain_4_steps, pipeline_8_steps]
    with torch.no_grad():
        serial = run_one_by_one(calls)
        together = run_together(calls)
        plain_8 = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=PAD,
                                 eos_token_id=None, num_steps=8, init_scale=1.0, init_seed=9)
    for alone, overlapped in zip(serial, together):
        assert overlapped.tolist() == alone.tolist()
    assert together[1].tolist() == plain_8.tolist()
    assert together[0].tolist() != together[1].tolist()  # the two settings do give different outputs
    assert model.transformer.settings == defaults and model.num_loops == model.config.mean_recurrence
