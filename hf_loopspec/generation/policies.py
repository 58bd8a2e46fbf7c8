"""Scheduling policies of the lane decoder: which lanes run in a cycle and when a lane may draft.

Every cycle is ONE core call over the lanes that the policy selects across all sequences; each selected lane
advances one loop. The decoder does everything else (verification at depth U, commits, rollbacks), so the
three decoders differ only here.

* `ARPolicy`: no drafts; every token runs its U loops alone (U calls per token). The baseline.
* `PipelinePolicy` (DESIGN 3): every live lane runs every cycle; the frontier lane drafts as soon as it
  reaches depth d, so with U=4, d=1 the steady state holds lanes at depths 3, 2, 1, 0 and commits one token
  per call when drafts are accepted.
* `BlockPolicy`: draft K tokens one after another at depth d (only lanes below depth d run), then run loops
  d..U-1 once over all K+1 lanes and keep the longest accepted prefix plus one target token. Calls per
  round: (K+1)d + (U-d).
"""

from __future__ import annotations

from .lanes import Lane, SequenceState


class ARPolicy:
    drafts = False

    def __init__(self, num_loops: int):
        self.num_loops = num_loops

    def select(self, seq: SequenceState) -> list[Lane]:
        return [lane for lane in seq.lanes if lane.depth < self.num_loops]

    def may_draft(self, seq: SequenceState) -> bool:
        return False


class PipelinePolicy(ARPolicy):
    drafts = True

    def may_draft(self, seq: SequenceState) -> bool:
        return True


class BlockPolicy(ARPolicy):
    drafts = True

    def __init__(self, num_loops: int, draft_loops: int, num_speculative_tokens: int):
        super().__init__(num_loops)
        self.draft_loops = draft_loops
        self.k = num_speculative_tokens

    def select(self, seq: SequenceState) -> list[Lane]:
        drafting = [lane for lane in seq.lanes if lane.depth < self.draft_loops]
        return drafting or super().select(seq)

    def may_draft(self, seq: SequenceState) -> bool:
        return seq.round_drafts < self.k
