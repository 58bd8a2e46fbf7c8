"""Lanes: the unit of work of the lane decoder.

A lane is one token of one sequence on its way through the loops: it sits at a position, has completed
`depth` loops, and carries the hidden state that is the input of its next loop. A sequence's live lanes hold
consecutive positions, the oldest (deepest) first; every lane's history is the sequence's committed tokens
plus the lanes before it, so all live lanes of a sequence lie on one path, the *main path* (docs/design.md,
"I1 (own history)").

With second proposals (`generation.siblings`) a sequence also holds *sibling branches*: a sibling lane competing
with the main lane of its position, and the lanes drafted after it. A branch lane's history is the main path
before the branch's position plus the branch's lanes before it; its KV lives in a branch slot of the cache (I5).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .stats import SequenceStats


@dataclass(eq=False)
class Lane:
    seq: int
    position: int
    token: int
    depth: int  # loops completed
    hidden: torch.Tensor | None  # [H] input of loop `depth`; None until the lane is embedded
    lineage: int  # unique id; its parent is the lane of position - 1 on the same path
    is_draft: bool = False  # proposed from depth d and not verified yet
    next_known: bool = False  # a prompt token that is not the last: the next token is given, nothing to verify
    draft_q: torch.Tensor | None = None  # sampling: [V] the distribution the draft was drawn from
    second_q: torch.Tensor | None = None  # sampling: [V] a second candidate equal to the draft was drawn from it
    states: list[torch.Tensor] = field(default_factory=list)  # [H] after every loop so far (only for an exit rule)
    branch: Branch | None = None  # the sibling branch the lane belongs to; None: the main path

    @property
    def slot(self) -> int:
        """The cache sequence slot the lane's KV rows write and read: its branch's, or its sequence's."""
        return self.seq if self.branch is None else self.branch.slot


@dataclass(eq=False)
class Branch:
    """A sibling branch: `lanes[0]` is a second proposal for `position`, competing with the main lane there; the
    others were drafted after it. `slot` is its branch slot in the cache; `ident` names it in traces (> 0)."""

    slot: int
    ident: int
    lanes: list[Lane] = field(default_factory=list)  # by position

    @property
    def position(self) -> int:
        return self.lanes[0].position


@dataclass(eq=False)
class SequenceState:
    index: int
    prompt_len: int  # real (unpadded) tokens before the first generated one, a cached history included
    max_new: int  # generation budget (max_length minus the padded prompt width)
    lanes: list[Lane] = field(default_factory=list)  # live, ordered by position
    generated: list[int] = field(default_factory=list)
    scores: list[torch.Tensor] = field(default_factory=list)  # processed target scores per committed token
    raw_logits: list[torch.Tensor] = field(default_factory=list)
    finished: bool = False
    stats: SequenceStats = field(default_factory=SequenceStats)
    branches: dict[int, Branch] = field(default_factory=dict)  # position -> its sibling branch (at most one)

    @property
    def live_lanes(self) -> list[Lane]:
        """The main path's lanes, then every branch's."""
        return self.lanes + [lane for b in self.branches.values() for lane in b.lanes]

    @property
    def last_draft_position(self) -> int:
        """No lane beyond this position is ever needed: the last generated token is never fed back."""
        return self.prompt_len + self.max_new - 2

    def kill_from(self, index: int) -> int:
        """Drop lanes `index..`; returns how many of them were unverified drafts."""
        killed, self.lanes = self.lanes[index:], self.lanes[:index]
        return sum(lane.is_draft for lane in killed)
