"""The wavefront engine on a CUDA device (`gpu` marker: skipped without one; `scripts/gpu_check.sh` runs them).

What only a GPU exercises: the step replayed as a CUDA graph (`device.GraphStep`, `compile_core=True` on CUDA), the
read-backs copied into pinned host memory on a side stream (`device.ReadBack`), and the outputs a replay overwrites
(`device.owned`). The reference is plain greedy `generate` of the same fp32 model on the same device: greedy
speculation must reproduce its tokens exactly, as it does on a CPU; the graph-replayed step must also give the eager
step's counters, since both run the same cycles.
"""

from __future__ import annotations

import logging

import pytest
import torch
from inputs import left_pad, random_prompts
from recorders import RecordingStreamer
from speculative_utils import PAD, engine_settings, mode_kwargs, tiny_spec_model

from hf_loopspec.generation.wavefront import device as wavefront_device

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

MODES = [("pipeline", 1, None), ("block", 1, 4)]
GRAPH_FALLBACK = "could not run as a CUDA graph"  # device.GraphStep's warning when it falls back to eager


def cuda_case(seed: int = 0, lengths=(5, 3, 9), vocab: int = 96):
    """A tiny fp32 model with accepted and rejected drafts (damp 0.2) on the GPU, and a left-padded ragged batch."""
    model = tiny_spec_model(seed, vocab=vocab, damp=0.2).to("cuda")
    ids, mask = left_pad(random_prompts(seed, lengths, vocab))
    return model, ids.to("cuda"), mask.to("cuda")


def run(model, ids, mask, max_new: int = 40, **kwargs):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=max_new, pad_token_id=PAD, do_sample=False,
                              return_dict_in_generate=True, **kwargs)


@pytest.mark.parametrize("compile_core", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize(("mode", "d", "k"), MODES, ids=["pipeline-d1", "block-d1-k4"])
def test_engine_on_cuda_equals_plain(mode, d, k, compile_core, caplog):
    model, ids, mask = cuda_case()
    expected = run(model, ids, mask).sequences
    with caplog.at_level(logging.WARNING, logger=wavefront_device.__name__):
        out = run(model, ids, mask, speculative_engine="wavefront", compile_core=compile_core,
                  **mode_kwargs(mode, d, k))
    assert torch.equal(out.sequences, expected)
    assert out.speculation.accepted > 0 and out.speculation.rejected > 0  # both branches of the rule ran
    assert GRAPH_FALLBACK not in caplog.text  # the graphs ran: no silent eager fallback


@pytest.mark.parametrize(("mode", "d", "k"), MODES, ids=["pipeline-d1", "block-d1-k4"])
def test_graph_step_has_the_eager_step_counters(mode, d, k):
    """Graph replay and eager run the same cycles: equal counters, and a second graph call (replays of the captured
    graphs, new prompts) still equals plain decoding."""
    model, ids, mask = cuda_case(seed=1)
    settings = dict(speculative_engine="wavefront", **mode_kwargs(mode, d, k))
    eager = run(model, ids, mask, **settings).speculation.to_dict()
    graphs = run(model, ids, mask, compile_core=True, **settings).speculation.to_dict()
    for key in ("core_calls", "committed_tokens", "accepted", "rejected"):
        assert graphs[key] == eager[key], key
    other_ids, other_mask = left_pad(random_prompts(7, (4, 8, 2), 96))
    other_ids, other_mask = other_ids.to("cuda"), other_mask.to("cuda")
    assert torch.equal(run(model, other_ids, other_mask, compile_core=True, **settings).sequences,
                       run(model, other_ids, other_mask).sequences)


def test_read_backs_are_pinned_and_stream_plain_tokens(monkeypatch):
    """Read-backs land in pinned host memory, and what a streamer receives from them is plain decoding's tokens."""
    pinned = []
    original = wavefront_device.ReadBack.__init__

    def recording(self, state, tokens):
        original(self, state, tokens)
        pinned.extend(x.is_pinned() for x in self.host)

    monkeypatch.setattr(wavefront_device.ReadBack, "__init__", recording)
    model, ids, mask = cuda_case(seed=2, lengths=(6,))
    expected = run(model, ids, mask).sequences[0, ids.shape[1]:].tolist()
    streamer = RecordingStreamer()
    run(model, ids, mask, streamer=streamer, speculative_engine="wavefront", compile_core=True,
        **mode_kwargs("pipeline", 1))
    assert pinned and all(pinned)
    assert streamer.puts[0] == ids.tolist() and streamer.ends == 1
    assert [token for put in streamer.puts[1:] for token in put] == expected


@pytest.mark.parametrize("second", [None, 3], ids=["pipeline", "second-proposals"])
def test_sampling_on_cuda_draws_the_same_tokens_on_the_engine_and_the_reference(second):
    """Sampled pipeline decoding on CUDA: the engine and the reference (a debug cache sends `generate` there) draw
    the same tokens from the same seed, as on a CPU (the reference made a sampled draft's point-mass mask on the
    host: a device error at its first draft)."""
    model, ids, mask = cuda_case(seed=3)
    outs = []
    for engine in ("lanes", "wavefront"):
        torch.manual_seed(5)
        with torch.no_grad():
            outs.append(model.generate(ids, attention_mask=mask, max_new_tokens=20, pad_token_id=PAD, do_sample=True,
                                       temperature=0.8, second_draft_loops=second, return_dict_in_generate=True,
                                       **engine_settings(model, engine), **mode_kwargs("pipeline", 1)))
    assert [out.speculation.engine for out in outs] == ["lanes", "wavefront"]
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    assert outs[0].speculation.accepted > 0 and outs[0].speculation.rejected > 0
