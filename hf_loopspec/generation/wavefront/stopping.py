"""Stopping criteria the wavefront step cannot judge (stop strings, `max_time`, user criteria), judged by the host at
each read-back on the committed tokens, with plain decoding's semantics.

The step stops a row at EOS and at `max_new_tokens` itself; any other criterion of the call is a Python callback.
At each read-back `HostStops` mirrors every row's committed tokens (and, with `output_scores`, its recorded scores)
into the lane decoder's host records (`lanes.SequenceState`, `columns.OutputColumns`) and lets
`OutputColumns.settle` call the criteria column by column over the whole batch, exactly as for the lane decoder:
same calls, same `[B, prompt + c + 1]` ids, same padding rule. A row that stops is ended in the device state at
once (`end_at`): committed tokens past its stop, decoded in the cycles since, are cut back (`n_out`, the token and
score buffers, the `committed` counter), its lanes die (`finished`) and its KV planes are rolled back as serial AR
leaves them. So the output is plain decoding's; the cost is at most the cycles run between a stop and the read-back
that sees it.
"""

from __future__ import annotations

import torch
from transformers import EosTokenCriteria, MaxLengthCriteria

from ..columns import OutputColumns
from ..lanes import SequenceState
from . import outputs
from .state import COUNTERS, WavefrontState

# R with host criteria. They are called once per settled column whatever R is, so R only trades the read-back's own
# cost (copying `[B]` counts and the `[B, T + 1]` token buffer to the host) against the cycles the batch runs past a
# stop before the host sees it: up to R (one more read-back's worth on CUDA, where the host reads one late). Two
# keeps that waste to a token or two per stop while still pairing cycles into one call of a compiled step.
HOST_READ_EVERY = 2


def host_criteria(stopping_criteria, max_length: int) -> list:
    """The criteria of `stopping_criteria` the step does not judge itself: all but EOS and the call's own
    `max_length` (exact classes: a subclass may change what they do)."""
    return [c for c in stopping_criteria or ()
            if not (type(c) is EosTokenCriteria or type(c) is MaxLengthCriteria and c.max_length == max_length)]


def host_stops(input_ids: torch.Tensor, pad_token_id: int | None, max_length: int, stopping_criteria, streamer,
               output_scores: bool) -> HostStops | None:
    """The `HostStops` of a run (which then feeds the streamer), or None when it has no `host_criteria`."""
    if not host_criteria(stopping_criteria, max_length):
        return None
    return HostStops(input_ids, pad_token_id, max_length, stopping_criteria, streamer, output_scores)


class HostStops:
    """The host's side of a run with host criteria: the rows' mirrors and the column-by-column judgement.

    `stopping_criteria`: the call's whole list (as the lane decoder gets it); `streamer`: fed by `settle`, column by
    column, in place of the engine's own streaming."""

    def __init__(self, input_ids: torch.Tensor, pad_token_id: int | None, max_length: int, stopping_criteria,
                 streamer, output_scores: bool):
        self.columns = OutputColumns(input_ids, pad_token_id, max_length, stopping_criteria, streamer, output_scores)
        # the rows' mirrors: `settle` reads their committed tokens, scores and flags only (not prompt_len)
        self.seqs = [SequenceState(index=b, prompt_len=0, max_new=self.columns.max_new) for b in range(len(input_ids))]
        self.state: WavefrontState | None = None

    def observe(self, state: WavefrontState, counts: list[int], finished: list[bool], tokens: torch.Tensor) -> bool:
        """One read-back (`counts`, `finished`, the token buffer `tokens` `[B, T + 1]` on the host): mirror the rows
        the host has not ended, settle every column all unfinished rows have, end the rows that stop there. Returns
        whether every row has ended."""
        self.state = state
        for seq, n, done in zip(self.seqs, counts, finished):
            if seq.finished:  # ended here: a read-back taken before the end may still report it running
                continue
            seq.generated = tokens[seq.index, :n].tolist()
            seq.finished = done
            self.columns.write_row(seq.index, tokens[seq.index, :n])
            if self.columns.output_scores:
                seq.scores = list(state.scores_out[seq.index, :n])
        self.columns.settle(self.seqs, self.end_at)
        return all(seq.finished for seq in self.seqs)

    def end_at(self, seq: SequenceState, steps: int) -> None:
        """End row `seq` after `steps` generated tokens, here and in the device state (`OutputColumns.settle`'s
        callback, as the lane decoder's `_end_at`)."""
        extra = len(seq.generated) > steps
        if extra:
            del seq.generated[steps:], seq.scores[steps:]
            self.columns.cut_back(seq.index, steps)
        if extra or not seq.finished:
            end_row(self.state, seq.index, steps, self.columns.pad)
        seq.finished = True


def end_row(s: WavefrontState, b: int, steps: int, pad: int) -> None:
    """Finish row `b` of the device state after `steps` committed tokens (device ops only: no host read): cut the
    tokens and recorded outputs past them, count them out of `committed` and the row's unverified drafts as
    discarded, kill its lanes and sibling, and roll its KV planes back to prompt + steps - 1 positions (as serial AR
    leaves a finished row)."""
    committed, discarded = COUNTERS.index("committed"), COUNTERS.index("discarded")
    s.counters[b, committed] -= (s.n_out[b] - steps).clamp(min=0)
    s.counters[b, discarded] += (s.alive[b] & s.draft[b] & ~s.finished[b]).sum()
    s.out[b, steps:] = pad
    outputs.zero_from(s, b, steps)
    s.n_out[b] = steps  # at least `steps`: the host saw that many
    s.finished[b] = True
    s.alive[b] = False
    s.sib_alive[b] = False
    s.sib_read[b] = False
    s.kv_len[b] = torch.minimum(s.kv_len[b], s.prompt_len[b] + steps - 1)
