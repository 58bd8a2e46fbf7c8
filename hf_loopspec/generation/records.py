"""What a lane-decoder run returns: the output, its statistics and, when asked for, a trace of every core call."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .stats import SpeculationStats


@dataclass(frozen=True)
class RowTrace:
    seq: int
    position: int
    depth: int  # loops completed before this call
    token: int
    is_draft: bool
    branch: int = 0  # 0: the sequence's main path; k > 0: the k-th sibling branch of the run (second proposals)


@dataclass
class CycleTrace:
    """One core call: the rows it ran and what happened after it (events: (kind, seq, position, token); kinds:
    "accept", "reject", "commit", and with second proposals "second" (a sibling spawned) and "accept_second" (a
    verification chose the sibling; "accept" and "reject" then judge the main-path draft alone))."""

    rows: list[RowTrace]
    events: list[tuple[str, int, int, int]] = field(default_factory=list)
    hidden: torch.Tensor | None = None  # [N, H] outputs, when hidden states are traced


@dataclass
class DecodeResult:
    sequences: torch.Tensor  # [B, S + generated]
    scores: tuple[torch.Tensor, ...] | None  # per step [B, V]
    logits: tuple[torch.Tensor, ...] | None
    stats: SpeculationStats
    trace: list[CycleTrace] | None
