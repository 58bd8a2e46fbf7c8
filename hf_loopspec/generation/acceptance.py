"""Acceptance rules: how a target distribution judges a draft.

Words: `scores` are processed logits `[V]` (fp32, after the logits processors and warpers, so masked tokens
are -inf); `q` is the probability vector the draft was sampled from; `p` the target's.

* Greedy: the target token is `argmax(scores)`; a draft is accepted when it equals it.
* Sampling (lossless speculative sampling): accept draft `x ~ q` with probability `min(1, p(x) / q(x))`;
  on rejection draw the replacement from `normalise(max(p - q, 0))`. The committed token is then distributed
  exactly as `p`, whatever `q` is. A position with no draft samples from `p`.

* Two candidates (second proposals: a draft x ~ q1 and a second candidate c ~ q2 drawn independently for the same
  position): x is judged as above; if it is rejected, c is judged against the residual r1 = normalise(max(p - q1,
  0)) in the same way (accept with probability min(1, r1(c) / q2(c))), and if it is rejected too the replacement is
  drawn from normalise(max(r1 - q2, 0)). Recursive rejection: the committed token is distributed exactly as p
  (tests enumerate it). A candidate c equal to a rejected x has r1(c) = 0, so it is always rejected: the decoder
  spawns no sibling for it but still draws the replacement from the second residual.

Random numbers come from torch's global generator, consumed in a fixed order, so a seeded run repeats.
"""

from __future__ import annotations

import torch


def draft_distribution(scores: torch.Tensor, do_sample: bool) -> torch.Tensor | None:
    """`q` `[V]` for sampling, `None` for greedy (the draft is the argmax)."""
    return torch.softmax(scores, dim=-1) if do_sample else None


def propose(scores: torch.Tensor, q: torch.Tensor | None) -> int:
    """A draft token: sampled from `q`, or the argmax of `scores` when greedy."""
    return int(torch.multinomial(q, 1)) if q is not None else int(scores.argmax())


def target_token(scores: torch.Tensor, do_sample: bool) -> int:
    """The token for a position that has no draft to judge."""
    return int(torch.multinomial(torch.softmax(scores, dim=-1), 1)) if do_sample else int(scores.argmax())


def acceptance_probability(draft: int, q: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """`min(1, p(draft) / q(draft))`: the chance that a draft drawn from `q` is kept."""
    return (p[draft] / q[draft]).clamp(max=1.0)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """`normalise(max(p - q, 0))`: where a rejected draft's replacement is drawn from."""
    mass = (p - q).clamp(min=0)
    return mass / mass.sum()


def judge(draft: int, q: torch.Tensor | None, scores: torch.Tensor, do_sample: bool) -> tuple[bool, int]:
    """Judge one draft against the target `scores`; returns (accepted, committed token)."""
    if not do_sample:
        target = int(scores.argmax())
        return draft == target, target
    if q is None:
        raise ValueError("a sampled draft must carry the distribution it was drawn from")
    p = torch.softmax(scores, dim=-1)
    if torch.rand((), device=p.device) < acceptance_probability(draft, q, p):
        return True, draft
    return False, int(torch.multinomial(residual(p, q), 1))


def judge_two(draft: int, q: torch.Tensor | None, second: int, q_second: torch.Tensor | None, scores: torch.Tensor,
              do_sample: bool) -> tuple[int, int]:
    """Judge a draft and a second candidate for one position; returns (which was kept: 1 the draft, 2 the second
    candidate, 0 neither; committed token)."""
    if not do_sample:
        target = int(scores.argmax())
        return (1 if draft == target else 2 if second == target else 0), target
    if q is None or q_second is None:
        raise ValueError("sampled candidates must carry the distributions they were drawn from")
    p = torch.softmax(scores, dim=-1)
    if torch.rand((), device=p.device) < acceptance_probability(draft, q, p):
        return 1, draft
    left = residual(p, q)
    if torch.rand((), device=p.device) < acceptance_probability(second, q_second, left):
        return 2, second
    return 0, int(torch.multinomial(residual(left, q_second), 1))
