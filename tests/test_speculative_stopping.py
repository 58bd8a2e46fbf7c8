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
from transformers import AutoTokenizer, EosTokenCriteria, MaxLengthCriteria, StoppingCriteria, StoppingCriteriaList

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


class ColumnRecording(Recording):
    """Recording's answer as a `[B, 1]` column (written `input_ids[:, -1:] == id`), which transformers' criteria list
    broadcasts against its `[B]` flags to `[B, B]`: plain decoding without EOS still decodes (the engines raised)."""

    def __call__(self, input_ids, scores, **kwargs):
        return super().__call__(input_ids, scores, **kwargs)[:, None]


class DoubledRecording(Recording):
    """Recording's answer as a long tensor, 2 for a stop: plain decoding's `unfinished & ~2` leaves the row running
    (its arithmetic, whatever was meant), where the engines read 2 as a stop and padded the row."""

    def __call__(self, input_ids, scores, **kwargs):
        return super().__call__(input_ids, scores, **kwargs).long() * 2


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


@pytest.mark.parametrize("criterion", [Recording, ColumnRecording], ids=["rows", "column"])
@pytest.mark.parametrize("mode,d,k", mode_params(MODE_PAIR))
def test_custom_criterion_without_eos(setup, mode, d, k, criterion):
    """Rows stop at different steps and keep decoding until the last one stops; all end there (no padding)."""
    model, prompts, ids, mask, free, reference = setup
    stops = [int(free[0, 2]), int(free[1, 5]), int(free[2, 8])]  # every row meets one by its own token
    (want, crit_e, stream_e), (got, crit_g, stream_g) = run_both(
        model, prompts, ids, mask, reference, mode, d, k, lambda: [criterion(stops)], eos_token_id=None)
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


@pytest.mark.parametrize("debug", [False, True], ids=["engine", "reference"])
@pytest.mark.parametrize("mode,d,k", mode_params(MODE_PAIR))
def test_criteria_answers_are_read_with_plain_decodings_arithmetic_with_eos(setup, mode, d, k, debug):
    """With an EOS criterion: a long answer of 2 leaves the rows running, as in plain decoding. A [B, 1] column
    (the flags broadcast to [B, B]) decodes as plain decoding where the run ends at that step, and otherwise raises a
    ValueError naming the shape, where plain decoding's next step raises torch's RuntimeError (the engines raised an
    expand RuntimeError in both cases)."""
    model, prompts, ids, mask, free, reference = setup
    eos, stop = int(free[1, 6]), int(free[0, 3])
    for criterion, new in ((DoubledRecording, NEW), (ColumnRecording, 1)):
        want = plain(model, ids, mask, new, stopping_criteria=StoppingCriteriaList([criterion([stop])]),
                     eos_token_id=eos).sequences
        got = speculative(model, ids, mask, new, mode, d, k, debug=debug,
                          stopping_criteria=StoppingCriteriaList([criterion([stop])]), eos_token_id=eos).sequences
        assert got.tolist() == want.tolist()
    columns = StoppingCriteriaList([ColumnRecording([stop])])
    with pytest.raises(RuntimeError):  # (plain decoding's own failure, from its padding of the stopped rows)
        plain(model, ids, mask, NEW, stopping_criteria=columns, eos_token_id=eos)
    with pytest.raises(ValueError, match=r"stopping_criteria answered shape \(3, 3\) for a batch of 3: .* "
                                         r"input_ids\[:, -1\] == id instead"):
        speculative(model, ids, mask, NEW, mode, d, k, debug=debug, stopping_criteria=columns, eos_token_id=eos)


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


class Logged(Streamer):
    """A streamer that writes its calls into a log it shares with `LoggedCriterion`."""

    def __init__(self, log):
        super().__init__()
        self.log = log

    def put(self, value):
        super().put(value)
        self.log.append(("put", value.tolist()))


class LoggedCriterion(StoppingCriteria):
    """Stops every row once the streamer has been given `count` generated tokens: a criterion that reads what was
    streamed, so it sees one token fewer if the streamer is fed after it than before."""

    def __init__(self, streamer: Logged, count: int):
        self.streamer, self.count = streamer, count

    def __call__(self, input_ids, scores, **kwargs):
        self.streamer.log.append(("criterion", input_ids.shape[1]))
        return torch.full((len(input_ids),), len(self.streamer.puts) - 1 >= self.count)


@pytest.mark.parametrize("debug", [False, True], ids=["engine", "reference"])
@pytest.mark.parametrize("mode,d,k", mode_params(MODE_PAIR))
def test_the_criteria_are_called_before_the_streamer_as_in_plain_decoding(setup, mode, d, k, debug):
    """transformers' loop calls the stopping criteria on a step's ids, then streams that step's token; the
    speculative modes streamed first, so a criterion reading the streamer stopped a token early."""
    model, prompts, ids, mask, free, reference = setup
    runs = []
    for spec in (False, True):
        log = []
        streamer = Logged(log)
        options = dict(stopping_criteria=StoppingCriteriaList([LoggedCriterion(streamer, 4)]), streamer=streamer,
                       eos_token_id=None)
        out = (speculative(model, ids, mask, NEW, mode, d, k, debug=debug, draft_hook=hook_for(prompts, reference),
                           **options) if spec else plain(model, ids, mask, NEW, **options))
        runs.append((out.sequences.tolist(), log))
    assert runs[1] == runs[0]
    assert runs[0][1][1] == ("criterion", ids.shape[1] + 1)  # (the prompt is streamed first, then the criterion)


class EosAfter(EosTokenCriteria):
    """An EOS criterion that ends a row at its EOS id only once the sequence is `length` long: a subclass deciding
    otherwise than its class, which plain decoding calls as any criterion."""

    def __init__(self, eos_token_id, length):
        super().__init__(eos_token_id)
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return super().__call__(input_ids, scores) & (input_ids.shape[1] >= self.length)


class NamedEos(Recording):
    """A criterion with an `eos_token_id` attribute of its own (None, or an id it does not stop at): plain decoding
    only pads the rows that stop, and never stops a row at that id."""

    def __init__(self, stop_tokens, eos_token_id):
        super().__init__(stop_tokens)
        self.eos_token_id = eos_token_id


@pytest.mark.parametrize("debug", [False, True], ids=["engine", "reference"])
@pytest.mark.parametrize("mode,d,k", mode_params(MODE_PAIR))
@pytest.mark.parametrize("criterion", ["eos subclass", "eos attribute", "eos attribute None", "max length above",
                                       "max length below"])
def test_criteria_that_look_like_built_in_ones_act_as_in_plain_decoding(setup, mode, d, k, criterion, debug):
    """Each gives plain decoding's tokens and streamed ids: an `EosTokenCriteria` subclass (the speculative modes
    stopped at its id as if it were the class), a criterion carrying an `eos_token_id` it does not stop at (the
    reference stopped there) or None (a crash), a `MaxLengthCriteria` replacing the call's above it (the run
    stopped at the call's) or below it; on the engine and on the reference (a debug cache)."""
    model, prompts, ids, mask, free, reference = setup
    eos, stop, width = int(free[1, 1]), int(free[0, 3]), ids.shape[1]
    make = {"eos subclass": lambda: [EosAfter(eos, width + 6)],
            "eos attribute": lambda: [NamedEos([stop], eos)],
            "eos attribute None": lambda: [NamedEos([stop], None)],
            "max length above": lambda: [MaxLengthCriteria(width + NEW)],
            "max length below": lambda: [MaxLengthCriteria(width + 3)]}[criterion]
    new = NEW - 4 if criterion.startswith("max length") else NEW  # (the call's own length, which a criterion replaces)
    runs = []
    for spec in (False, True):
        streamer = Streamer()
        options = dict(stopping_criteria=StoppingCriteriaList(make()), streamer=streamer, eos_token_id=None)
        out = (speculative(model, ids, mask, new, mode, d, k, debug=debug, draft_hook=hook_for(prompts, reference),
                           **options) if spec else plain(model, ids, mask, new, **options))
        runs.append((out.sequences.tolist(), streamer.puts))
    assert runs[1] == runs[0]


@pytest.mark.parametrize(("mode", "d", "k"), mode_params(MODE_PAIR))
@pytest.mark.parametrize("debug", [False, True], ids=["engine", "reference"])
def test_decoding_past_the_positions_warns_as_plain_decoding(monkeypatch, mode, d, k, debug):
    """Plain decoding's `MaxLengthCriteria` warns once a step's length passes `max_position_embeddings` short of
    `max_length`; the engines judge max_length themselves and never called it, so speculative calls past the
    positions decoded without the warning. Runs within the positions (or ending at them) warn in neither."""
    from transformers.generation import stopping_criteria

    model, _, ids, mask = spec_case(7, [5, 3], VOCAB)
    warned = []
    monkeypatch.setattr(stopping_criteria.logger, "warning_once", lambda message, *args: warned.append(message))
    for limit, expect in ((ids.shape[1] + 2, True), (ids.shape[1] + 4, False), (ids.shape[1] + 8, False)):
        monkeypatch.setattr(model.config, "max_position_embeddings", limit)
        for run in (lambda: plain(model, ids, mask, 4), lambda: speculative(model, ids, mask, 4, mode, d, k,
                                                                              debug=debug)):
            warned.clear()
            run()
            assert bool(warned) == expect and all(str(limit) in message for message in warned), (limit, warned)
