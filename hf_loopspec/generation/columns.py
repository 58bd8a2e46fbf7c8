"""The output columns of one lane-decoder run: the id buffer and plain decoding's column-by-column semantics.

Sequences commit tokens at their own pace (a row whose drafts are accepted runs ahead), but transformers streams
and checks stopping criteria one column at a time, over the whole batch. `OutputColumns` holds the batch's ids
and replays that order: column c is settled once every unfinished row has committed it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import EosTokenCriteria, MaxLengthCriteria

from .lanes import SequenceState

IDS_CHUNK = 64  # id buffer columns reserved at first for generated tokens; the buffer doubles as they come


class OutputColumns:
    """The batch's ids `[B, prompt width + generated]` (left-padded prompt, then each row's committed tokens, pad
    after a row's end) and the streaming and stopping-criteria checks of plain decoding's loop."""

    def __init__(self, input_ids: torch.Tensor, pad_token_id: int | None, max_length: int, stopping_criteria,
                 streamer, output_scores: bool):
        self.stopping, self.streamer, self.output_scores = stopping_criteria, streamer, output_scores
        self.pad_stopped = pads_stopped_rows(stopping_criteria)
        eos = stopping_eos_ids(stopping_criteria)
        self.eos = torch.tensor(eos) if eos else None  # [E] the ids that end a row (`rules.ends_row`), or None
        batch, width = input_ids.shape
        self.prompt_width = width
        self.pad = pad_token_id if pad_token_id is not None else 0
        self.max_new = max(max_length - width, 0)
        # [B, width + generated so far]: grows with the output (`_reserve`), not sized for max_new up front
        self.ids = input_ids.new_full((batch, width + min(self.max_new, IDS_CHUNK)), self.pad)
        self.ids[:, :width] = input_ids
        self.settled = 0  # columns streamed and checked by the stopping criteria (`settle`)
        self.unfinished = torch.ones(batch, dtype=torch.long)  # the rows no criterion stopped yet (`_stopped`)
        self.score_steps: list[torch.Tensor] = []  # per settled step [B, V], with output_scores

    def prefix(self, seq: int, generated: int) -> torch.Tensor:
        """`[prompt width + generated]` ids of row `seq`: its padded prompt and first `generated` tokens."""
        return self.ids[seq, : self.prompt_width + generated]

    def write(self, seq: int, step: int, token: int) -> None:
        """Put `token` in generated column `step` of row `seq`."""
        self._reserve(self.prompt_width + step + 1)
        self.ids[seq, self.prompt_width + step] = token

    def write_row(self, seq: int, tokens: torch.Tensor) -> None:
        """Put `tokens` `[n]` in the first n generated columns of row `seq`."""
        self._reserve(self.prompt_width + len(tokens))
        self.ids[seq, self.prompt_width: self.prompt_width + len(tokens)] = tokens.to(self.ids)

    def cut_back(self, seq: int, steps: int) -> None:
        """Pad row `seq` after its first `steps` generated tokens."""
        self.ids[seq, self.prompt_width + steps:] = self.pad

    def settle(self, seqs: list[SequenceState], end_at: Callable[[SequenceState, int], None]) -> None:
        """Stream and check the stopping criteria column by column, as plain decoding does: column c (the c-th
        generated token of every row) once every unfinished row has committed it, with the whole batch
        `[B, prompt + c + 1]` and, when scores are returned, every step's `[B, V]` scores so far (else None). A row
        that stops there is ended by `end_at(seq, c + 1)` (which cuts back a row that has run ahead); without an
        EOS criterion, rows end together at the column where the last one stops (`_stopped`)."""
        while True:
            live = [len(s.generated) for s in seqs if not s.finished]
            if self.settled >= (min(live) if live else max(len(s.generated) for s in seqs)):
                return
            c = self.settled
            self.settled += 1
            width = self.prompt_width + c + 1
            scores = None  # what transformers passes: every step's scores so far, when they are returned
            if self.output_scores:
                self.score_steps.append(stack_step(seqs, "scores", c))
                scores = tuple(self.score_steps)
            if self.stopping is not None:  # the criteria, then the streamer, as transformers' loop calls them
                for seq in self._stopped(torch.as_tensor(self.stopping(self.ids[:, :width], scores)), seqs):
                    end_at(seq, c + 1)
            if self.streamer is not None:
                self.streamer.put(self.ids[:, width - 1].cpu())

    def _stopped(self, stop: torch.Tensor, seqs: list[SequenceState]) -> list[SequenceState]:
        """The rows to end at this column, from the criteria's answer `stop`: plain decoding's `unfinished &= ~stop`
        with its arithmetic (a long answer of 2 leaves a row running), then, with an EOS criterion, each row no longer
        unfinished (padded after), else every row once none is. A `[B, 1]` answer broadcasts `unfinished` to
        `[B, B]`, as there: plain decoding then ends once all of it is clear, and with an EOS criterion fails at its
        next step (its padding of the stopped rows), where this raises a `ValueError` naming the shape."""
        self.unfinished = still_unfinished(self.unfinished, stop)
        if int(self.unfinished.max()) == 0:
            return seqs
        if not self.pad_stopped:
            return []
        if self.unfinished.dim() > 1:
            raise ValueError(f"stopping_criteria answered shape {tuple(stop.shape)} for a batch of {len(seqs)}: "
                             "with an EOS id, plain decoding pads the rows that stopped, which needs one flag per row "
                             f"([{len(seqs)}]; a criterion returning a [batch, 1] column, e.g. "
                             "input_ids[:, -1:] == id, makes it [batch, batch]); return input_ids[:, -1] == id "
                             "instead.")
        return [seq for seq, running in zip(seqs, self.unfinished.expand(len(seqs)).tolist()) if not running]

    def _reserve(self, width: int) -> None:
        """Grow the id buffer to hold `width` columns (doubling, up to the prompt plus max_new)."""
        if width <= self.ids.shape[1]:
            return
        grown = self.ids.new_full((len(self.ids), min(self.prompt_width + self.max_new, 2 * self.ids.shape[1])),
                                  self.pad)
        grown[:, : self.ids.shape[1]] = self.ids
        self.ids = grown


def pads_stopped_rows(stopping_criteria) -> bool:
    """Whether transformers' loop pads a row a criterion stopped: only when a criterion of `stopping_criteria` has an
    `eos_token_id` attribute; otherwise the row keeps decoding until every row has stopped, and all rows end where
    the last one stopped."""
    return any(hasattr(c, "eos_token_id") for c in stopping_criteria or ())


def still_unfinished(unfinished: torch.Tensor, stop) -> torch.Tensor:
    """Plain decoding's rows left running (`unfinished`, long `[B]`) after the criteria answered `stop`, with its
    arithmetic `unfinished & ~stop` (a long answer of 2 leaves a row running; a `[B, 1]` answer broadcasts)."""
    return unfinished & ~torch.as_tensor(stop).to(unfinished.device)


def stopping_eos_ids(stopping_criteria) -> list[int]:
    """The ids at which a row ends: those of the `EosTokenCriteria` of `stopping_criteria` (the exact class: a subclass
    may decide otherwise, and is called as any criterion is)."""
    return [int(t) for c in stopping_criteria or () if type(c) is EosTokenCriteria
            for t in torch.as_tensor(c.eos_token_id).reshape(-1).tolist()]


def max_length_of(stopping_criteria, default: int, width: int) -> int:
    """The length at which a run of `width`-column inputs ends: that of the `MaxLengthCriteria` in
    `stopping_criteria` (a caller's replaces the call's own in transformers' merge), else `default`; at least one
    new token, as plain decoding's loop decides on its first step."""
    limits = [int(c.max_length) for c in stopping_criteria or () if type(c) is MaxLengthCriteria]
    return max(min(limits, default=default), width + 1)


def stack_step(seqs: list[SequenceState], name: str, step: int) -> torch.Tensor:
    """`[B, V]` scores or logits (`name`) of one step; rows that had already finished at that step hold zeros."""
    per_seq = [getattr(s, name) for s in seqs]
    like = next(x[0] for x in per_seq if x)
    return torch.stack([x[step] if step < len(x) else torch.zeros_like(like) for x in per_seq])
