"""Second proposals (pipeline mode, `second_draft_loops=d2`): a sibling lane from a deeper draft, with private KV.

This is the lane decoder's version (any d2, branches of several lanes); the wavefront engine's, for d2 >= U - d with
one single-lane sibling per sequence, is `wavefront.sibling`.

A main-path lane X at position p drafted B for p + 1 when it reached depth d. When X reaches depth d2 it re-reads
its proposal: if the depth-d2 proposal C (the argmax of the processed depth-d2 logits, or a sample from them when
sampling) differs from B, a *sibling* lane for C starts at position p + 1 (depth 0) in a new branch, at most one per
position. When X reaches depth U the target judges both (`rules.second_candidate`: greedy, the target token T picks
B, C or neither; sampling, recursive rejection, lossless) and commits T:

* B kept: as without siblings; C's branch is closed (its lanes dropped, its pages released).
* C kept: the sibling is chosen (`second_accepted`): B and everything after it on the main path (its lanes and
  branches) are killed, and C's branch becomes the main path: its lanes keep running (C is U - d2 loops deep), and
  the cache promotes its KV into the sequence's tables without copying (`PagedLoopCache.branches.promote`).
* neither: both are killed, the cache rolls back, and a lane restarts from T, as without siblings.

The sibling drafts further like any frontier lane (docs/design.md, "Second proposals"): a leaf sibling
that is chosen has no draft in flight and no way to draft any more (it is past depth d), so the pipeline would stall
until its target; a drafting sibling hands over a full wavefront, so choosing it costs only the d2 - d cycles by
which it started later than B. Only main-path lanes make second proposals, so every branch is a chain of lanes
hanging off the main path (a lane of a promoted branch is main-path and proposes again once it reaches d2).

KV (docs/design.md, "I5 (branches)"): a branch's lanes write and read the branch's slot of the cache, which shares
the main path's pages below p + 1 and copies the partially filled page on first write (invariant B in
`cache.branches`). The common history is complete in every plane before the branch writes that plane, because X and
the lanes before it are deeper than any lane of the branch (wavefront order). Every lane's lineage id links to its
parent, so `PagedLoopCache(debug=True)` checks every read of both branches against the reader's own ancestry (I1).

Sampling: every draft whose parent reaches d2 gets a second candidate C drawn from the depth-d2 distribution q2,
independently of B; when C == B no sibling is spawned but B records q2, since a rejection's replacement must then
come from the second residual (`rules.second_candidate`).
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import count

import torch

from ..cache.paged import PagedLoopCache
from .lanes import Branch, Lane, SequenceState

SecondHook = Callable[[int, int, int, int], int]
"""`second_draft_hook(sequence, position, first_token, proposed) -> token`: test-only override of a second proposal
(returning `first_token` makes none)."""


class SecondProposals:
    """Second proposals at depth `depth` (d2) for one run: who re-reads, spawning siblings, and their fate."""

    def __init__(self, cache: PagedLoopCache, depth: int, hook: SecondHook | None = None):
        self.cache, self.depth, self.hook = cache, depth, hook
        self._idents = count(1)

    def candidate(self, seq: SequenceState, lane: Lane) -> bool:
        """Whether `lane`, which has just run, may re-read its draft in this cycle: it reached depth d2 and the next
        lane on its path is an unverified draft. A branch lane qualifies too: the cycle's verifications (which run
        first) may promote its branch, and its head row must be in the cycle's head call."""
        nxt = next_on_path(seq, lane)
        return lane.depth == self.depth and not lane.next_known and nxt is not None and nxt.is_draft

    def wants(self, seq: SequenceState, lane: Lane) -> bool:
        """Whether `lane` re-reads its draft now (after the cycle's verifications): it is a live main-path candidate
        whose next position has no sibling yet."""
        return (not seq.finished and lane.branch is None and self.candidate(seq, lane)
                and lane.position + 1 not in seq.branches)

    def propose(self, seq: SequenceState, lane: Lane, token: int, q: torch.Tensor | None,
                spawn: Callable[..., Lane]) -> Lane | None:
        """Re-read `lane`'s draft: `token` is the depth-d2 proposal (argmax, or a sample from `q` `[V]` when
        sampling); returns the sibling it spawns (via `spawn(seq, parent, token, is_draft)`, which links its
        lineage), or None when the proposal equals the draft (when sampling, the draft then records `q`: its
        verification draws a rejection's replacement from the second residual, `rules.second_candidate`)."""
        first = next_on_path(seq, lane)
        if self.hook is not None:
            hooked = int(self.hook(seq.index, first.position, first.token, token))
            if q is not None and hooked != token:  # a forced proposal is a point mass: still lossless
                q = torch.nn.functional.one_hot(torch.tensor(hooked), q.shape[-1]).to(q)
            token = hooked
        if token == first.token:
            first.second_q = q
            return None
        branch = Branch(self.cache.branches.open(seq.index, first.position), next(self._idents))
        sibling = spawn(seq, lane, token, is_draft=True)
        sibling.branch, sibling.draft_q = branch, q
        branch.lanes.append(sibling)
        seq.branches[first.position] = branch
        seq.stats.second_drafts += 1
        return sibling


def next_on_path(seq: SequenceState, lane: Lane) -> Lane | None:
    """The live lane after `lane` on its path (main or branch); None when there is none or `lane` is dead."""
    path = path_of(seq, lane)
    index = next((i for i, x in enumerate(path) if x is lane), None)
    return path[index + 1] if index is not None and index + 1 < len(path) else None


def path_of(seq: SequenceState, lane: Lane) -> list[Lane]:
    """The list that holds `lane`: the main path or its branch's lanes."""
    return seq.lanes if lane.branch is None else lane.branch.lanes


def close_branches(cache: PagedLoopCache, seq: SequenceState, start: int, stop: int | None = None) -> int:
    """Kill every branch of `seq` at a position in [start, stop) (stop None: no end) and release its KV; returns how
    many first-proposal drafts died with them (a branch's first lane is a second proposal, counted by
    `second_drafts`)."""
    discarded = 0
    for position in [p for p in seq.branches if start <= p and (stop is None or p < stop)]:
        branch = seq.branches.pop(position)
        discarded += sum(lane.is_draft for lane in branch.lanes[1:])
        branch.lanes.clear()
        cache.branches.close(branch.slot)
    return discarded


def promote(cache: PagedLoopCache, seq: SequenceState, branch: Branch) -> None:
    """Make `branch` the main path after the lanes before its position (the caller has killed the main lanes from
    there and every later branch): its lanes join the main path and its KV becomes the sequence's."""
    del seq.branches[branch.position]
    cache.branches.promote(branch.slot)
    for lane in branch.lanes:
        lane.branch = None
    seq.lanes.extend(branch.lanes)
