"""Rows of an auto call that ended (EOS) in an earlier segment (`auto`): the later segments decode plainly with them
forced to the pad token (`ForcePad`, as plain decoding feeds them) and counted as done (`Stopped`), and the call's
scores and logits hold zeros for them from the step after their end (`zero_ended`), as the fixed speculative modes
give them.
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessor, StoppingCriteria


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
