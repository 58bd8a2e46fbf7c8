"""The lane decoder's side of `rules`: the same acceptance rules and draws, applied one lane at a time, with the
uniforms laid out as the wavefront engine's (one `[B, L, 2 or 3]` draw per cycle; the lane at position p of sequence
b uses row `[b, p % L]`), so that with the same seed both engines sample the same tokens."""

from __future__ import annotations

import torch

from .lanes import Lane
from .rules import (
    DRAW,
    cycle_uniforms,
    draw,
    greedy,
    non_finite_error,
    proposal_q,
    run_generator,
    second_candidate,
    speculative,
    uniform_columns,
)


class LaneRules:
    """The rules of one lane-decoder run over `batch` sequences of `lanes` (L) lane slots each; `second`: with
    second proposals. Sampling seeds its generator from torch's global one when built (as the engine does)."""

    def __init__(self, do_sample: bool, batch: int, lanes: int, second: bool, device: torch.device):
        self.do_sample = do_sample
        self.generator = run_generator(device) if do_sample else None
        self.shape = (batch, lanes, uniform_columns(second))
        self.device = device
        self.noise = None  # [B, L, 2 or 3] the current cycle's uniforms

    def new_cycle(self) -> None:
        """Draw the uniforms of a cycle (nothing when greedy)."""
        if self.generator is not None:
            self.noise = cycle_uniforms(self.generator, self.shape, self.device)

    def uniforms(self, lane: Lane) -> torch.Tensor:
        """`lane`'s uniforms of this cycle `[2 or 3]`: its slot's row; a lane of a sibling branch (a setting the
        engine has no slot for: second proposals that draft) draws its own."""
        if lane.branch is not None:
            return cycle_uniforms(self.generator, (1, 1, self.shape[-1]), self.device)[0, 0]
        return self.noise[lane.seq, lane.position % self.shape[1]]

    def choose(self, lane: Lane, scores: torch.Tensor, propose: bool = False) -> tuple[int, torch.Tensor | None]:
        """The token `lane`'s processed head `scores` `[V]` give when there is no draft to judge (its draft or a
        second proposal: `propose`; or a target with nothing after it): greedy, their argmax; sampling, a draw from
        their softmax with the lane's `DRAW` uniform. Also returns the distribution it was drawn from `[V]` (None
        when greedy): a proposal's non-finite softmax counts as a point mass on the token (`rules.proposal_q`)."""
        if not self.do_sample:
            return int(scores.argmax()), None
        if not propose:
            probs = self._probabilities(lane, scores)
            return int(draw(probs, self.uniforms(lane)[DRAW])), probs
        probs = torch.softmax(scores, -1)
        token = draw(probs, self.uniforms(lane)[DRAW])
        forced = torch.zeros(1, dtype=torch.bool, device=probs.device)  # [1]: no draft hook forced this token
        return int(token), proposal_q(probs[None], token[None], forced)[0]

    @staticmethod
    def _probabilities(lane: Lane, scores: torch.Tensor) -> torch.Tensor:
        """The softmax of `lane`'s `scores` `[V]`; plain sampling's error when it is not finite."""
        probs = torch.softmax(scores, -1)
        if not bool(probs.isfinite().all()):
            raise non_finite_error([lane.seq])
        return probs

    def judge(self, lane: Lane, nxt: Lane, sibling: Lane | None, scores: torch.Tensor,
              top: int | None) -> tuple[int, int]:
        """Judge the draft `nxt` (and its sibling, or a second candidate equal to it: `nxt.second_q`) against the
        target `scores` `[V]` of `lane`; returns (kept: 1 the draft, 2 the sibling, 0 neither; committed token).
        `top`: the argmax of `scores` when the decoder read it back (greedy without processors)."""
        x = torch.tensor([nxt.token], device=scores.device)
        if not self.do_sample:
            top = int(greedy(scores[None], x)[0]) if top is None else top
            return (1 if nxt.token == top else 2 if sibling is not None and sibling.token == top else 0), top
        u = self.uniforms(lane)[None]  # [1, 2 or 3]
        token, accepted, left = speculative(self._probabilities(lane, scores)[None], nxt.draft_q[None], x,
                                            torch.ones_like(x, dtype=torch.bool), u)
        if bool(accepted):
            return 1, nxt.token
        second, q_second = (nxt.token, nxt.second_q) if sibling is None else (sibling.token, sibling.draft_q)
        if q_second is not None:
            token = second_candidate(left, q_second[None], torch.tensor([second], device=x.device), u)
        token = int(token)
        return (2 if sibling is not None and sibling.token == token else 0), token
