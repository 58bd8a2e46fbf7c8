"""Rows of an auto call (`auto`): those that ended (EOS) in an earlier segment are forced to the pad token in the
later segments, which decode plainly (`ForcePad`, as plain decoding feeds them), and counted as done (`Stopped`); the
call's scores and logits hold zeros for them from the step after their end (`zero_ended`), as the fixed speculative
modes give them; and each segment's counters are added to the call's (`account`), a plain stretch's rows counted to
where they stopped (`RowEnds`: transformers' loop pads a stopped row and does not say where it stopped).
"""

from __future__ import annotations

import torch
from transformers import (
    EosTokenCriteria,
    LogitsProcessor,
    MaxLengthCriteria,
    MaxTimeCriteria,
    StoppingCriteria,
    StoppingCriteriaList,
    StopStringCriteria,
)

from .auto_costs import Candidate
from .auto_policy import Chooser
from .columns import pads_stopped_rows, still_unfinished
from .stats import SpeculationStats

# the kinds `generate` builds from its settings: one the call passes (of exactly that class: a subclass is the call's
# own) replaces the one built, so it is left in the list transformers merges and judged again to record where it
# stopped a row (these keep no state; the length and time limits stop every row at once, which ends the stretch)
BUILT_KINDS = (MaxLengthCriteria, MaxTimeCriteria, StopStringCriteria, EosTokenCriteria)
JUDGED_AGAIN = (StopStringCriteria, EosTokenCriteria)


class ForcePad(LogitsProcessor):
    """Rows already stopped choose the pad token (plain decoding's input for them)."""

    def __init__(self, stopped: torch.Tensor, pad: int):
        self.stopped, self.pad = stopped, pad

    def __call__(self, input_ids, scores):
        forced = torch.full_like(scores, -float("inf"))
        forced[:, self.pad] = 0.0
        return torch.where(self.stopped.to(scores.device)[:, None], forced, scores)


class Stopped(StoppingCriteria):
    """Rows already stopped count as done, so a segment ends once the other rows stop."""

    def __init__(self, stopped: torch.Tensor):
        self.stopped = stopped

    def __call__(self, input_ids, scores, **kwargs):
        return self.stopped.to(input_ids.device)


def ended(new: torch.Tensor, eos: list[int]) -> torch.Tensor:
    """`[B, n]` bool: whether row b's new tokens `[B, n]` hold an EOS id at column j or before."""
    return torch.isin(new, torch.tensor(eos, dtype=new.dtype, device=new.device)).cummax(1).values


def zero_ended(steps: list[torch.Tensor], new: torch.Tensor, eos: list[int]) -> list[torch.Tensor]:
    """The call's per-step scores (or logits) `[B, V]` with zeros for the rows that had ended (EOS) before the step,
    as the speculative modes give them (a plain stretch gives a row it forces to the pad token 0 / -inf scores)."""
    before = torch.cat([torch.zeros_like(new[:, :1], dtype=torch.bool), ended(new, eos)[:, :-1]], 1)  # [B, n]
    return [torch.where(before[:, j, None], 0.0, step) for j, step in enumerate(steps)]


class RowEnds(StoppingCriteria):
    """Records where the criteria of a plain stretch stopped each row: `ends` `[B]`, the new columns up to and with the
    one a criterion judged done (-1: none did, or nothing pads a stopped row: the call has no EOS). The call's own
    criteria run through it, once per step as before (`criteria()`: the list `generate` is passed), except those of
    a kind `generate` builds, which stay in that list and are judged again here; the call's stop strings
    (`stop_strings`, with its `tokenizer`), which `generate` matches with a criterion of its own, are judged here
    too unless the call passed a `StopStringCriteria`."""

    def __init__(self, kwargs: dict, stop_strings: str | list[str] | None, start: int, eos: list[int]):
        given = list(kwargs.get("stopping_criteria") or ())
        # a stopped row is padded only with a criterion of EOS (`generate` builds one for `eos`); else it decodes on
        # to the stretch's end, and all its tokens are the output: nothing to record
        self.pads = bool(eos) or pads_stopped_rows(given)
        self.built = [c for c in given if type(c) in BUILT_KINDS]
        self.own = [c for c in given if type(c) not in BUILT_KINDS]  # run here alone
        self.again = [c for c in self.built if type(c) in JUDGED_AGAIN]
        if stop_strings and kwargs.get("tokenizer") is not None and StopStringCriteria not in map(type, self.built):
            self.again.append(StopStringCriteria(kwargs["tokenizer"], stop_strings))
        self.start, self.ends, self.unfinished = start, None, None

    def criteria(self) -> StoppingCriteriaList:
        return StoppingCriteriaList([*self.built, self])

    def __call__(self, input_ids, scores, **kwargs):
        batch = input_ids.shape[0]
        stop = torch.zeros(batch, dtype=torch.bool, device=input_ids.device)
        for criterion in self.own:  # (the call's: whatever they answer, OR-ed as `StoppingCriteriaList` does)
            stop = stop | criterion(input_ids, scores, **kwargs)
        seen = stop
        for criterion in self.again:
            seen = seen | criterion(input_ids, scores, **kwargs)
        if self.ends is None:
            self.ends, self.unfinished = torch.full((batch,), -1), torch.ones(batch, dtype=torch.long)
        if self.pads and seen.shape == (batch,):  # (an answer of another shape, a [B, 1] column, names no row)
            self.unfinished = still_unfinished(self.unfinished, seen.cpu())  # (read as plain decoding reads it)
            self.ends[(self.unfinished == 0) & (self.ends < 0)] = input_ids.shape[1] - self.start
        return stop


def account(stats, segment: SpeculationStats | None, candidate: Candidate, new: torch.Tensor, stopped: torch.Tensor,
            eos: list[int], loops: int, chooser: Chooser, row_ends: RowEnds | None) -> None:
    """Add one segment's counters to the call's `stats` (an `AutoStats`) and its acceptance to `chooser` (plain: the
    tokens of each row not `stopped` before it, up to its first EOS or where `row_ends` says it stopped; U core calls
    per column)."""
    if candidate.mode is not None and segment is not None and segment.fallback is None:
        for total, part in zip(stats.per_sequence, segment.per_sequence):
            for name, value in vars(part).items():
                setattr(total, name, getattr(total, name) + value)
        stats.core_calls += segment.core_calls
        stats.engine = segment.engine
        stats.cache_fill_calls += segment.cache_fill_calls
        for stage, rows in segment.call_rows.items():
            stats.call_rows[stage] += rows
        chooser.acceptance.add(candidate.draft_loops, segment.accepted, segment.verified, chooser.policy.keep)
        return
    ends = None if row_ends is None else row_ends.ends
    for b, row in enumerate(new.tolist()):
        if not bool(stopped[b]):
            hits = [i + 1 for i, t in enumerate(row) if t in eos][:1]
            stops = [int(ends[b])] if ends is not None and ends[b] > 0 else []
            stats.per_sequence[b].committed += min(hits + stops + [len(row)])
    columns, batch = new.shape[1], len(new)
    stats.core_calls += loops * columns
    stats.plain_tokens += columns
    for stage, count in (("embed", columns), ("core", loops * columns), ("head", columns)):
        stats.call_rows[stage] += [batch] * count
