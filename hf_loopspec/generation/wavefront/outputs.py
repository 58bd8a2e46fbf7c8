"""`output_scores` / `output_logits` on the wavefront engine: per committed column, the committing slot's values.

A token is committed by the target slot of the position before it (the lane that reached depth U); its processed
scores (the head's logits after the call's logits processors, what `processing.choose` chose from) and its raw
logits are what plain decoding returns for that step. The step scatters them, with the committed token, into
`WavefrontState.scores_out` / `logits_out` `[B, T + 1, V]` at the token's column (in place: the buffers are large,
and only requested runs have them; other runs carry `[B, 0, 0]` and the step does nothing). Columns a row never
committed hold zeros, as the lane decoder's `columns.stack_step` gives a row that had finished at that step; a row
cut back by a stopping criterion gets its columns past the stop zeroed (`zero_from`).
"""

from __future__ import annotations

import torch

from .state import Plan, WavefrontState


def buffers(plan: Plan, batch: int, columns: int, vocab: int, hidden: int, like: torch.Tensor) -> dict:
    """The state's `scores_out` and `logits_out` (`[B, columns, V]` float32 zeros where requested, else `[B, 0, 0]`)
    and `core_out` (`[0, H]` of `like`'s dtype: the step sets it when tracing hidden states)."""
    def buffer(wanted: bool) -> torch.Tensor:
        return torch.zeros(batch, columns if wanted else 0, vocab if wanted else 0, device=like.device,
                           dtype=torch.float32)

    return {"scores_out": buffer(plan.output_scores), "logits_out": buffer(plan.output_logits),
            "core_out": like.new_zeros(0, hidden)}


def slot_values(plan: Plan, logits: torch.Tensor, scores: torch.Tensor, place) -> tuple:
    """The values a committing slot records, placed at the lane slots (`place`: `[B, R, V]` -> `[B, L, V]`): its
    processed scores and/or raw logits (`[B, R, V]` each, of the head slots), in that order; () when none."""
    wanted = (scores,) * plan.output_scores + (logits,) * plan.output_logits
    return tuple(place(x.float()) for x in wanted)


def record(plan: Plan, s: WavefrontState, columns: torch.Tensor, order: torch.Tensor, values: tuple) -> None:
    """Write `values` (`slot_values`, `[B, L, V]` by slot) into the buffers: the lane of rank r (slot `order[b, r]`)
    at column `columns[b, r]` (`[B, L]`: its committed column, or the trash column T)."""
    targets = [s.scores_out] * plan.output_scores + [s.logits_out] * plan.output_logits
    for buffer, value in zip(targets, values):
        ranked = value.gather(1, order[..., None].expand_as(value))  # [B, L, V] by rank
        buffer.scatter_(1, columns[..., None].expand_as(ranked), ranked)


def zero_from(s: WavefrontState, seq: int, column: int) -> None:
    """Clear the recorded values of row `seq` from `column` on (a row cut back there)."""
    for buffer in (s.scores_out, s.logits_out):
        if buffer.numel():
            buffer[seq, column:] = 0


def steps(s: WavefrontState, count: int) -> dict[str, tuple[torch.Tensor, ...] | None]:
    """`DecodeResult`'s `scores` and `logits` of a run of `count` generated steps: per step `[B, V]`; None when not
    requested."""
    return {name: tuple(buffer[:, i] for i in range(count)) if buffer.shape[1] else None
            for name, buffer in (("scores", s.scores_out), ("logits", s.logits_out))}
