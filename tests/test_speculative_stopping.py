"""Stopping criteria and the streamer see exactly what plain decoding shows them.

Plain decoding (transformers' loop) calls the criteria once per step with the whole batch `[batch, length]` and
that step's scores `[batch, vocab]`, and feeds the streamer one column per step. The lane decoder commits rows at
different speeds; it must call the criteria and the streamer in the same order with the same content, cut a row
that ran past its stop back to it, and give the same output length and padding. Rows run at different speeds
through forced draft patterns (row 0: every draft accepted, row 1: every draft rejected, row 2: alternating).
Expectations come from plain decoding of the same model with the same criteria.
"""

from __future__ import annotations

import pytest
import torch
from speculative_utils import MODE_PAIR, PAD, forcing_hook, mode_params, plain, spec_case, speculative
from tolerances import assert_fp32_close, ouro_depth
from transformers import AutoTokenizer, StoppingCriteria, StoppingCriteriaList

import hf_loopspec

VOCAB, NEW = 64, 14
PATTERNS = [lambda i: True, lambda i: False, lambda i: i % 2 == 0]  # per row: accept draft i?


class Recording(StoppingCriteria):
    """Stops a row whose last token is in `stop_tokens` (a rule of the row's content, not of its batch index), and
    records every call: the ids, how many steps of scores it was given (transformers passes every step's scores so
    far when they are returned, else None) and the last step's scores."""

    def __init__(self, stop_tokens):
        self.stop_tokens, self.calls = set(stop_tokens), []

    def __call__(self, input_ids, scores, **kwargs):
        self.calls.append((input_ids.clone(), None if scores is None else (len(scores), scores[-1].clone())))
        return torch.tensor([int(t) in self.stop_tokens for t in input_ids[:, -1]])


class Streamer:
    def __init__(self):
        self.puts, self.ended = [], 0

    def put(self, value):
        self.puts.append(value.tolist())

    def end(self):
        self.ended += 1


class LmEvalLike(StoppingCriteria):
    """Behaves like lm-eval 0.4.13's `MultiTokenEOSCriteria` (lm_eval.models.utils_hf; importing lm-eval costs seconds,
    so the suite carries this stand-in): it keeps one done flag per *batch position*, decodes the last tokens of every
    row after the prompt, and returns one bool for the whole batch (all rows done). Called with fewer rows than its
    batch size, it raises IndexError, as lm-eval's does."""

    def __init__(self, sequence, tokenizer, prompt_width, batch_size):
        self.sequence, self.tokenizer, self.prompt_width = sequence, tokenizer, prompt_width
        self.done = [False] * batch_size
        self.lookback = len(tokenizer.encode(sequence, add_special_tokens=False)) + 2

    def __call__(self, input_ids, scores, **kwargs):
        texts = self.tokenizer.batch_decode(input_ids[:, self.prompt_width:][:, -self.lookback:])
        for i, done in enumerate(self.done):
            if not done:
                self.done[i] = self.sequence in texts[i]
        return False not in self.done


@pytest.fixture(scope="module")
def setup():
    model, prompts, ids, mask = spec_case(71, [5, 2, 4], VOCAB, damp=0.3)
    free = plain(model, ids, mask, NEW, eos_token_id=None).sequences
    reference = [prompts[s].tolist() + free[s, ids.shape[1]:].tolist() for s in range(len(prompts))]
    return model, prompts, ids, mask, free[:, ids.shape[1]:], reference


def hook_for(prompts, reference):
    return forcing_hook(reference, [len(p) for p in prompts], lambda s, i: PATTERNS[s % 3](i), VOCAB)


def run_both(model, prompts, ids, mask, reference, mode, d, k, make_criteria, **kwargs):
    """(plain, speculative) outputs, each with its own criteria and streamer: (output, criteria, streamer)."""
    runs = []
    for spec in (False, True):
        criteria, streamer = make_criteria(), Streamer()
        options = dict(stopping_criteria=StoppingCriteriaList(criteria), streamer=streamer, output_scores=True,
                       **kwargs)
        if spec:
            out = speculative(model, ids, mask, NEW, mode, d, k, draft_hook=hook_for(prompts, reference), **options)
        else:
            out = plain(model, ids, mask, NEW, **options)
        runs.append((out, criteria, streamer))
    return runs


def assert_same_calls(expected: Recording, got: Recording, finished_before, depth: dict) -> None:
    """Same number of calls, same ids `[batch, length]` in each; the scores of every step so far, the last of which
    equal for rows still running at that step."""
    assert len(got.calls) == len(expected.calls)
    for step, ((ids_e, (n_e, scores_e)), (ids_g, (n_g, scores_g))) in enumerate(zip(expected.calls, got.calls)):
        assert ids_g.tolist() == ids_e.tolist(), f"call {step}"
        assert n_g == n_e == step + 1 and scores_g.shape == scores_e.shape
        live = [s for s in range(len(ids_e)) if finished_before(s) > step]
        assert_fp32_close(scores_g[live], scores_e[live], **depth)  # the lanes' calls batch rows differently


@pytest.mark.parametrize("mode,d,k", mode_params(MODE_PAIR))
def test_custom_criterion_without_eos(setup, mode, d, k):
    """Rows stop at different steps and keep decoding until the last one stops; all end there (no padding)."""
    model, prompts, ids, mask, free, reference = setup
    stops = [int(free[0, 2]), int(free[1, 5]), int(free[2, 8])]  # every row meets one by its own token
    (want, crit_e, stream_e), (got, crit_g, stream_g) = run_both(
        model, prompts, ids, mask, reference, mode, d, k, lambda: [Recording(stops)], eos_token_id=None)
    assert got.sequences.tolist() == want.sequences.tolist()
    assert got.sequences.shape[1] - ids.shape[1] < NEW  # the criterion ended the run early
    assert stream_g.puts == stream_e.puts and stream_g.ended == stream_e.ended == 1
    # no row is padded: every row's scores are real
    assert_same_calls(crit_e[0], crit_g[0], lambda s: NEW, ouro_depth(model.config))


@pytest.mark.parametrize("mode,d,k", mode_params(MODE_PAIR))
def test_custom_criterion_with_eos_pads_rows_that_stop(setup, mode, d, k):
    """With an EOS criterion a row that stops (by EOS or by the custom criterion) is padded from the next step;
    the fast row 0 runs ahead of its stop and is cut back to it."""
    model, prompts, ids, mask, free, reference = setup
    eos, stop = int(free[1, 6]), int(free[0, 3])
    (want, crit_e, stream_e), (got, crit_g, stream_g) = run_both(
        model, prompts, ids, mask, reference, mode, d, k, lambda: [Recording([stop])], eos_token_id=eos)
    assert got.sequences.tolist() == want.sequences.tolist()
    new = want.sequences[:, ids.shape[1]:]
    assert (new == PAD).any(), "the case must pad a row that stopped early"
    assert stream_g.puts == stream_e.puts

    def finished_before(s):  # the step after which plain pads row s
        row = new[s].tolist()
        return next((i + 1 for i, t in enumerate(row) if t in (eos, stop)), NEW)

    assert_same_calls(crit_e[0], crit_g[0], finished_before, ouro_depth(model.config))
    for s, step_scores in enumerate(zip(*got.scores)):
        assert all(float(x.abs().sum()) == 0 for x in step_scores[finished_before(s):])  # documented: zeros


@pytest.fixture(scope="module")
def text_setup():
    """A tiny model over the embedded model's tokenizer (4096 tokens), for criteria that decode text."""
    tokenizer = AutoTokenizer.from_pretrained(hf_loopspec.default_model_path())
    vocab = len(tokenizer)
    model, prompts, ids, mask = spec_case(72, [6, 3, 5, 2], vocab, damp=0.3)
    free = plain(model, ids, mask, NEW, eos_token_id=None).sequences
    reference = [prompts[s].tolist() + free[s, ids.shape[1]:].tolist() for s in range(len(prompts))]
    return model, tokenizer, vocab, prompts, ids, mask, free[:, ids.shape[1]:], reference


def stop_text(tokenizer, free, row, index) -> str:
    """A stop string that row `row` produces at generated index `index` (its token's text, stripped)."""
    text = tokenizer.decode(free[row, index:index + 1]).strip()
    assert text, "pick a token with visible text"
    return text


@pytest.mark.parametrize("mode,d,k", mode_params(MODE_PAIR))
def test_stop_strings_without_eos(text_setup, mode, d, k):
    model, tokenizer, vocab, prompts, ids, mask, free, reference = text_setup
    stops = [stop_text(tokenizer, free, row, index) for row, index in enumerate([2, 4, 7, 5])]  # rows at own speeds
    outs = []
    for spec in (False, True):
        streamer = Streamer()
        options = dict(stop_strings=stops, tokenizer=tokenizer, eos_token_id=None, streamer=streamer)
        if spec:
            hook = forcing_hook(reference, [len(p) for p in prompts], lambda s, i: PATTERNS[s % 3](i), vocab)
            outs.append((speculative(model, ids, mask, NEW, mode, d, k, draft_hook=hook, **options), streamer))
        else:
            outs.append((plain(model, ids, mask, NEW, **options), streamer))
    (want, stream_e), (got, stream_g) = outs
    assert got.sequences.tolist() == want.sequences.tolist()
    assert want.sequences.shape[1] - ids.shape[1] < NEW  # the stop strings ended the run early
    assert stream_g.puts == stream_e.puts


@pytest.mark.parametrize("mode,d,k", mode_params(MODE_PAIR))
def test_lm_eval_stop_sequence_criterion_at_batch_4(text_setup, mode, d, k):
    """lm-eval's criterion indexes rows by batch position and stops when all rows are done: it gets the whole batch
    at every step, and the output equals plain's (it crashed with IndexError when called one row at a time)."""
    model, tokenizer, vocab, prompts, ids, mask, free, reference = text_setup
    stop = stop_text(tokenizer, free, 2, 5)
    outs = []
    for spec in (False, True):
        criterion = LmEvalLike(stop, tokenizer, ids.shape[1], len(prompts))
        options = dict(stopping_criteria=StoppingCriteriaList([criterion]), eos_token_id=int(free[0, 7]))
        if spec:
            hook = forcing_hook(reference, [len(p) for p in prompts], lambda s, i: PATTERNS[s % 3](i), vocab)
            outs.append(speculative(model, ids, mask, NEW, mode, d, k, draft_hook=hook, **options))
        else:
            outs.append(plain(model, ids, mask, NEW, **options))
    assert outs[1].sequences.tolist() == outs[0].sequences.tolist()
