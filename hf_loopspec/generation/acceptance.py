"""Acceptance rules: how a target distribution judges a draft.

Words: `scores` are processed logits `[V]` (fp32, after the logits processors and warpers, so masked tokens
are -inf); `q` is the probability vector the draft was sampled from; `p` the target's.

* Greedy: the target token is `argmax(scores)`; a draft is accepted when it equals it.
* Sampling (lossless speculative sampling): accept draft `x ~ q` with probability `min(1, p(x) / q(x))`;
  on rejection draw the replacement from `normalise(max(p - q, 0))`. The committed token is then distributed
  exactly as `p`, whatever `q` is. A position with no draft samples from `p`.

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
