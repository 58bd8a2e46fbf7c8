"""Host-side features on the wavefront engine: stopping criteria judged at read-backs (stop strings, `max_time`, user
criteria), `output_scores` / `output_logits`, and traces.

Every call runs with `speculative_engine="wavefront"` (a fallback to the lane decoder would raise) and is compared
with plain decoding of the same model and settings (tokens exactly, the criteria's calls, the streamer's puts, the
cache's planes, scores and logits up to fp32 rounding), and for traces with the lane decoder, the reference whose
records the engine reproduces.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from recorders import RecordingStreamer, StopAtWidth
from speculative_utils import (
    MODE_PAIR,
    MODES,
    assert_cache_matches_ar,
    assert_counter_invariants,
    mode_params,
    plain,
    spec_case,
    speculative,
)
from tolerances import assert_fp32_close, ouro_depth
from transformers import AutoTokenizer, GenerationConfig, StoppingCriteria, StoppingCriteriaList

import hf_loopspec
from hf_loopspec.generation.wavefront import engine as engine_module
from hf_loopspec.generation.wavefront import options, stopping
from hf_loopspec.trace_plot import plot_schedule, schedule_grid

VOCAB, NEW = 64, 14
WAVEFRONT = {"speculative_engine": "wavefront"}


class StopTokens(StoppingCriteria):
    """Stops a row whose last token is in `tokens` (a rule of the row's content); records every call's ids and how
    many steps of scores it got (None: no scores)."""

    def __init__(self, tokens):
        self.tokens, self.calls = set(tokens), []

    def __call__(self, input_ids, scores, **kwargs):
        self.calls.append((input_ids.tolist(), None if scores is None else len(scores)))
        return torch.tensor([int(t) in self.tokens for t in input_ids[:, -1]])


@pytest.fixture(scope="module")
def setup():
    """A tiny model whose drafts are accepted and rejected (rows commit at different speeds), its batch, and its
    free-running greedy continuation `[B, NEW]`."""
    model, prompts, ids, mask = spec_case(71, [5, 2, 4], VOCAB, damp=0.3)
    free = plain(model, ids, mask, NEW, eos_token_id=None).sequences[:, ids.shape[1]:]
    return model, ids, mask, free


def committed_counts(new: torch.Tensor, stops) -> list[int]:
    """Per row of plain's generated columns `new`, the tokens up to and including its first in `stops`."""
    return [next((i + 1 for i, t in enumerate(row) if t in stops), len(row)) for row in new.tolist()]


@pytest.mark.parametrize("mode,d,k", mode_params(MODES))
@pytest.mark.parametrize("with_eos", [False, True], ids=["no_eos", "eos"])
def test_custom_criterion_matches_plain(setup, mode, d, k, with_eos):
    """A user criterion stopping rows at different columns: the same calls as plain decoding's (ids column by column
    over the whole batch), the same output and padding (with an EOS criterion a stopped row is padded, without one
    rows end together), the same streamed columns, counters and cache planes."""
    model, ids, mask, free = setup
    stops = {int(free[0, 2]), int(free[1, 5]), int(free[2, 8])}
    eos = int(free[1, 6]) if with_eos else None
    runs = []
    for spec in (False, True):
        criterion, streamer = StopTokens(stops), RecordingStreamer()
        kwargs = dict(stopping_criteria=StoppingCriteriaList([criterion]), eos_token_id=eos, streamer=streamer)
        out = speculative(model, ids, mask, NEW, mode, d, k, **kwargs, **WAVEFRONT) if spec else \
            plain(model, ids, mask, NEW, **kwargs)
        runs.append((out, criterion.calls, streamer.puts))
    (want, calls_e, puts_e), (got, calls_g, puts_g) = runs
    assert got.speculation.engine == "wavefront"
    assert got.sequences.tolist() == want.sequences.tolist()
    assert want.sequences.shape[1] - ids.shape[1] < NEW  # the criterion ended the run early
    assert calls_g == calls_e and puts_g == puts_e
    new = want.sequences[:, ids.shape[1]:]
    committed = committed_counts(new, stops | {eos}) if with_eos else [new.shape[1]] * len(new)
    assert_counter_invariants(got.speculation, committed)
    assert_cache_matches_ar(got.cache, want.cache, mask, committed, model.config.num_hidden_layers,
                            model_depth=ouro_depth(model.config))


@pytest.mark.parametrize("mode,d,k", mode_params(MODES))
def test_stop_between_read_backs_is_cut_back(setup, monkeypatch, mode, d, k):
    """Read back every 30 cycles, a criterion that stops every row after its first token is seen only after each row
    has committed more (a commit completes at least every (K + 1) d + U cycles, 8 here, after a prefill of at most
    U + K d = 8): the rows are cut back to one token, with plain's output, counters and cache planes."""
    model, ids, mask, _ = setup
    monkeypatch.setattr(options, "HOST_READ_EVERY", 30)
    cuts = []
    end_row = stopping.end_row
    monkeypatch.setattr(stopping, "end_row", lambda s, b, steps, pad: (cuts.append(int(s.n_out[b]) - steps),
                                                                     end_row(s, b, steps, pad)))
    outs = [call(model, ids, mask, NEW, stopping_criteria=StoppingCriteriaList([StopAtWidth(ids.shape[1] + 1)]))
            for call in (plain, lambda *a, **kw: speculative(*a, mode, d, k, **kw, **WAVEFRONT))]
    want, got = outs
    assert got.speculation.engine == "wavefront"
    assert got.sequences.tolist() == want.sequences.tolist() and want.sequences.shape[1] == ids.shape[1] + 1
    assert len(cuts) == len(ids) and min(cuts) > 0, cuts
    assert_counter_invariants(got.speculation, [1] * len(ids))
    assert_cache_matches_ar(got.cache, want.cache, mask, [1] * len(ids), model.config.num_hidden_layers,
                            model_depth=ouro_depth(model.config))


@pytest.fixture(scope="module")
def text_setup():
    """A tiny model over the embedded model's tokenizer, for stop strings."""
    tokenizer = AutoTokenizer.from_pretrained(hf_loopspec.default_model_path())
    model, prompts, ids, mask = spec_case(72, [6, 3, 5, 2], len(tokenizer), damp=0.3)
    free = plain(model, ids, mask, NEW, eos_token_id=None).sequences[:, ids.shape[1]:]
    return model, tokenizer, ids, mask, free


@pytest.mark.parametrize("mode,d,k", mode_params(MODE_PAIR))
@pytest.mark.parametrize("eos", [False, True])
def test_stop_strings_match_plain(text_setup, mode, d, k, eos):
    """`stop_strings=` with a tokenizer (transformers' `StopStringCriteria`): rows stop at their own strings."""
    model, tokenizer, ids, mask, free = text_setup
    stops = [tokenizer.decode(free[row, i: i + 1]).strip() for row, i in enumerate([2, 4, 7, 5])]
    assert all(stops), "each stop string needs visible text"
    outs = []
    for spec in (False, True):
        streamer = RecordingStreamer()
        kwargs = dict(stop_strings=stops, tokenizer=tokenizer, streamer=streamer,
                      eos_token_id=int(free[0, 9]) if eos else None)
        out = speculative(model, ids, mask, NEW, mode, d, k, **kwargs, **WAVEFRONT) if spec else \
            plain(model, ids, mask, NEW, **kwargs)
        outs.append((out, streamer.puts))
    (want, puts_e), (got, puts_g) = outs
    assert got.speculation.engine == "wavefront"
    assert got.sequences.tolist() == want.sequences.tolist()
    assert want.sequences.shape[1] - ids.shape[1] < NEW and puts_g == puts_e


def test_max_time_matches_plain(setup):
    """`max_time` (transformers' `MaxTimeCriteria`) judged at read-backs: a limit already passed when the first
    column is judged ends every row after it, as in plain decoding."""
    model, ids, mask, _ = setup
    want = plain(model, ids, mask, NEW, max_time=1e-9)
    got = speculative(model, ids, mask, NEW, "pipeline", 1, max_time=1e-9, **WAVEFRONT)
    assert got.speculation.engine == "wavefront"
    assert got.sequences.tolist() == want.sequences.tolist()
    assert want.sequences.shape[1] == ids.shape[1] + 1


@pytest.mark.parametrize("mode,d,k", mode_params(MODES))
@pytest.mark.parametrize("settings", [{}, {"repetition_penalty": 1.3, "do_sample": True, "temperature": 0.7,
                                          "top_k": 20}], ids=["greedy", "sampling"])
def test_scores_and_logits(setup, mode, d, k, settings):
    """`output_scores` / `output_logits`: one `[B, V]` per generated step; the processed scores and raw logits of
    each row's committed steps equal plain decoding's up to fp32 rounding of a forward of the model's depth (the
    speculative calls batch rows differently), and the steps after a row stopped hold zeros (the lane decoder's
    convention: plain decoding keeps computing finished rows). Sampling is compared along the tokens the engine drew
    (`forced_plain`)."""
    model, ids, mask, free = setup
    eos = int(free[1, 6])
    options = dict(output_scores=True, output_logits=True, eos_token_id=eos, **settings)
    got = speculative(model, ids, mask, NEW, mode, d, k, **options, **WAVEFRONT)
    assert got.speculation.engine == "wavefront"
    new = got.sequences[:, ids.shape[1]:]
    committed = committed_counts(new, {eos})
    if settings.get("do_sample"):  # the reference: plain decoding forced onto the engine's draws, one step each
        want = forced_plain(model, ids, mask, new, options)
    else:
        want = plain(model, ids, mask, NEW, **options)
        assert got.sequences.tolist() == want.sequences.tolist()
        assert min(committed) < max(committed), "the case needs a row that stops early"
    for name in ("scores", "logits"):
        steps_g, steps_w = getattr(got, name), getattr(want, name)
        assert len(steps_g) == new.shape[1] and all(g.shape == (len(ids), VOCAB) for g in steps_g)
        for step, (g, w) in enumerate(zip(steps_g, steps_w)):
            for s in range(len(ids)):
                if step < committed[s]:
                    where = f"{name}[{step}][{s}]"
                    assert_fp32_close(g[s], w[s], **ouro_depth(model.config), msg=lambda m, where=where: f"{where} {m}")
                else:
                    assert not g[s].any(), f"{name}[{step}][{s}]: a finished row's step holds zeros"


def forced_plain(model, ids, mask, new: torch.Tensor, options: dict):
    """Plain decoding's per-step scores and logits along the tokens `new` `[B, N]`: each step a plain call of one
    token on the prefix so far (its processed scores and raw logits depend on the prefix only; the sampling warpers
    are deterministic)."""
    scores, logits = [], []
    for step in range(new.shape[1]):
        prefix = torch.cat([ids, new[:, :step]], 1)
        out = plain(model, prefix, torch.cat([mask, torch.ones_like(new[:, :step])], 1), 1, **options)
        scores.append(out.scores[0])
        logits.append(out.logits[0])
    return SimpleNamespace(scores=scores, logits=logits)


@pytest.mark.parametrize("mode,d,k", mode_params(MODES))
@pytest.mark.parametrize("hidden", [False, True], ids=["events", "hidden"])
def test_trace_matches_the_lane_decoder(setup, mode, d, k, hidden):
    """`speculative_trace`: per cycle the same rows (as a set) and the same events, in order, as the lane decoder's
    trace of the same greedy call; with "hidden" the same core outputs up to fp32 rounding; `trace_plot` draws the
    same grid from both."""
    model, ids, mask, free = setup
    trace = "hidden" if hidden else True
    got = speculative(model, ids, mask, NEW, mode, d, k, speculative_trace=trace, **WAVEFRONT)
    want = speculative(model, ids, mask, NEW, mode, d, k, speculative_trace=trace, debug=True)
    assert got.speculation.engine == "wavefront"
    assert got.sequences.tolist() == want.sequences.tolist()
    assert len(got.trace) == len(want.trace)
    kinds = set()
    for c, (g, w) in enumerate(zip(got.trace, want.trace)):
        assert sorted(g.rows, key=repr) == sorted(w.rows, key=repr), f"cycle {c}"
        assert g.events == w.events, f"cycle {c}"
        kinds |= {kind for kind, *_ in g.events}
        if hidden:
            order = sorted(range(len(w.rows)), key=lambda i: repr(w.rows[i]))
            mine = sorted(range(len(g.rows)), key=lambda i: repr(g.rows[i]))
            assert_fp32_close(g.hidden[mine], w.hidden[order], **ouro_depth(model.config))
    assert {"accept", "reject", "commit"} <= kinds
    for seq in range(len(ids)):
        assert schedule_grid(got.trace, seq, model.num_loops) == schedule_grid(want.trace, seq, model.num_loops)


@pytest.mark.slow
def test_compiled_step_with_host_outputs(text_setup, monkeypatch):
    """Compiled (`compile_core`, fullgraph: the recording of scores and logits adds no graph break), a run with stop
    strings and both outputs gives plain's tokens and scores. Two cycles per compiled call (the default unrolls more:
    slower to trace, the same code)."""
    monkeypatch.setattr(engine_module, "CYCLES_PER_CALL", 2)
    model, tokenizer, ids, mask, free = text_setup
    stops = [tokenizer.decode(free[row, i: i + 1]).strip() for row, i in enumerate([3, 6, 2, 8])]
    options = dict(stop_strings=stops, tokenizer=tokenizer, output_scores=True, output_logits=True,
                   eos_token_id=None)
    want = plain(model, ids, mask, NEW, **options)
    got = speculative(model, ids, mask, NEW, "pipeline", 1, compile_core="eager", **options, **WAVEFRONT)
    assert got.speculation.engine == "wavefront"
    assert got.sequences.tolist() == want.sequences.tolist()
    for g, w in zip(got.scores + got.logits, want.scores + want.logits, strict=True):
        assert_fp32_close(g, w, **ouro_depth(model.config))


@pytest.mark.parametrize("d,second", [(1, 3), (2, 3)])
def test_trace_with_second_proposals(setup, d, second):
    """With second proposals (a sibling slot) the traced events equal the lane decoder's, "second" included."""
    model, ids, mask, _ = setup
    options = dict(speculative_trace=True, second_draft_loops=second)
    got = speculative(model, ids, mask, NEW, "pipeline", d, **options, **WAVEFRONT)
    want = speculative(model, ids, mask, NEW, "pipeline", d, **options, debug=True)
    assert got.sequences.tolist() == want.sequences.tolist()
    assert [c.events for c in got.trace] == [c.events for c in want.trace]
    assert [sorted(c.rows, key=repr) for c in got.trace] == [sorted(c.rows, key=repr) for c in want.trace]
    assert any(kind == "second" for c in got.trace for kind, *_ in c.events)


def test_the_schedule_of_something_that_is_no_trace_is_refused():
    """The output itself, not its `.trace`, failed with an AttributeError about `rows`."""
    for bad in ("x", SimpleNamespace(trace=[]), [object()]):
        with pytest.raises(ValueError, match="pass the trace of a generate"):
            schedule_grid(bad)


def test_trace_arguments_that_cannot_be_honoured_are_refused(setup):
    """A trace without `return_dict_in_generate` was dropped with the output object, and `speculative_trace=1.0`
    passed as True; `schedule_grid` of a sequence the trace does not hold, or with fewer loops than it reaches, drew
    an empty or clipped grid, and `plot_schedule(max_cycles=-3)` failed inside matplotlib."""
    model, ids, mask, _ = setup
    unreturned = GenerationConfig(return_dict_in_generate=False, max_new_tokens=2, do_sample=False, pad_token_id=0)
    model.generation_config.return_dict_in_generate = True  # (a call's None or a passed config's False wins)
    try:
        for mode, returned in (("pipeline", {"return_dict_in_generate": False}),
                               ("auto", {"return_dict_in_generate": None}),
                               ("block", {"return_dict_in_generate": None}),
                               ("pipeline", {"generation_config": unreturned}),
                               ("auto", {"generation_config": unreturned})):
            with pytest.raises(ValueError, match="needs return_dict_in_generate=True"):
                model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False, speculative_mode=mode,
                               speculative_trace=True, **returned)
    finally:
        model.generation_config.return_dict_in_generate = False
    for plain_call in ({"speculative_mode": None}, {}):  # the fix that applies, not a step before it
        with pytest.raises(ValueError, match="this call decodes plainly"):
            model.generate(ids, attention_mask=mask, max_new_tokens=2, speculative_trace=True, **plain_call)
    assert speculative(model, ids, mask, 2, "pipeline", 1, speculative_trace=np.True_).trace
    for bad in (1.0, torch.tensor(True), "yes"):
        with pytest.raises(ValueError, match="must be True, False or 'hidden'"):
            speculative(model, ids, mask, 2, "pipeline", 1, speculative_trace=bad)
    trace = speculative(model, ids, mask, NEW, "pipeline", 1, speculative_trace=True).trace
    with pytest.raises(ValueError, match=rf"seq={len(ids)}: the trace holds no rows"):
        schedule_grid(trace, len(ids))
    with pytest.raises(ValueError, match=f"num_loops=2: the trace reaches depth {model.num_loops - 1}"):
        schedule_grid(trace, 0, 2)
    with pytest.raises(ValueError, match=f"num_loops={float(model.num_loops)}: .*pass a whole number of at least"):
        schedule_grid(trace, 0, float(model.num_loops))  # (a count as a float: "at least 4" did not say why)
    with pytest.raises(ValueError, match="max_cycles=-3"):
        plot_schedule(trace, max_cycles=-3)
    assert schedule_grid(trace, np.int64(0), np.int64(model.num_loops)) == schedule_grid(trace, 0, model.num_loops)
    with pytest.raises(ValueError, match="seq=True"):
        schedule_grid(trace, True)
