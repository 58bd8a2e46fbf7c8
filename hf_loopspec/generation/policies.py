"""Scheduling policies of the lane decoder: which lanes run in a cycle and when a lane may draft.

Every cycle is ONE core call over the lanes that the policy selects across all sequences; each selected lane
advances one loop. The decoder does everything else (verification at depth U, commits, rollbacks), so the
three decoders differ only here. A policy owns its parameters (`draft_loops`, K) and any per-sequence state
its schedule needs; the decoder tells it about drafts (`drafted`) and about targets that start a new lane
(`restarted`), and asks it which lanes run (`select`) and whether a frontier lane drafts (`wants_draft`).

* `ARPolicy`: no drafts; every token runs its U loops alone (U calls per token). The baseline.
* `PipelinePolicy` (docs/design.md, "Pipeline"): every live lane runs every cycle; the frontier lane drafts as
  soon as it reaches depth d, so with U=4, d=1 the steady state holds lanes at depths 3, 2, 1, 0 and commits one
  token per call when drafts are accepted.
* `BlockPolicy`: draft K tokens one after another at depth d (only lanes below depth d run), then run loops
  d..U-1 once over all K+1 lanes and keep the longest accepted prefix plus one target token. Calls per
  round: (K+1)d + (U-d). Its round state: drafts proposed per sequence since the round began.
"""

from __future__ import annotations

from .config import SpeculativeConfig
from .lanes import Lane, SequenceState


class ARPolicy:
    """Every live lane runs; nothing is drafted."""

    draft_loops: int | None = None  # the depth drafts come from; None: no drafts
    second_draft_loops: int | None = None  # the depth second proposals come from; None: none

    def __init__(self, num_loops: int):
        self.num_loops = num_loops

    @property
    def draft_depths(self) -> tuple[int, ...]:
        """The depths whose head proposes tokens: d, and d2 with second proposals; () without drafts."""
        return tuple(depth for depth in (self.draft_loops, self.second_draft_loops) if depth is not None)

    @property
    def exit_depths(self) -> tuple[int, ...]:
        """The depths at which lanes run the head: the target depth U and the draft depths."""
        return (self.num_loops, *self.draft_depths)

    def select(self, seq: SequenceState) -> list[Lane]:
        return [lane for lane in seq.live_lanes if lane.depth < self.num_loops]

    def wants_draft(self, seq: SequenceState, lane: Lane) -> bool:
        """Whether `lane`, the frontier lane of `seq` that has just run, proposes the next token now."""
        return False

    def drafted(self, seq: SequenceState) -> None:
        """`seq`'s frontier lane proposed a draft."""

    def restarted(self, seq: SequenceState) -> None:
        """A committed target of `seq` started a new lane (no draft of it survived)."""


class PipelinePolicy(ARPolicy):
    """Every live lane runs; the frontier drafts at depth d."""

    def __init__(self, num_loops: int, draft_loops: int, second_draft_loops: int | None = None):
        super().__init__(num_loops)
        self.draft_loops, self.second_draft_loops = draft_loops, second_draft_loops

    def wants_draft(self, seq: SequenceState, lane: Lane) -> bool:
        return lane.depth == self.draft_loops


class BlockPolicy(PipelinePolicy):
    """Rounds of K drafts at depth d, then one verification pass (see the module docstring)."""

    def __init__(self, num_loops: int, draft_loops: int, num_speculative_tokens: int):
        super().__init__(num_loops, draft_loops)
        self.k = num_speculative_tokens
        self.round_drafts: dict[int, int] = {}  # sequence index -> drafts since its round began

    def select(self, seq: SequenceState) -> list[Lane]:
        drafting = [lane for lane in seq.lanes if lane.depth < self.draft_loops]
        return drafting or super().select(seq)

    def wants_draft(self, seq: SequenceState, lane: Lane) -> bool:
        return super().wants_draft(seq, lane) and self.round_drafts.get(seq.index, 0) < self.k

    def drafted(self, seq: SequenceState) -> None:
        self.round_drafts[seq.index] = self.round_drafts.get(seq.index, 0) + 1

    def restarted(self, seq: SequenceState) -> None:
        self.round_drafts[seq.index] = 0


def policy_for(spec: SpeculativeConfig, num_loops: int) -> ARPolicy:
    """A fresh policy (one per run: it holds per-sequence state) for `spec.mode`."""
    if spec.mode == "ar":
        return ARPolicy(num_loops)
    if spec.mode == "pipeline":
        return PipelinePolicy(num_loops, spec.draft_loops, spec.second_draft_loops)
    return BlockPolicy(num_loops, spec.draft_loops, spec.num_speculative_tokens)
