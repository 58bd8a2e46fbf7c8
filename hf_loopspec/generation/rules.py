"""The decoding rules both engines apply: acceptance, draws, row ends and the uniforms of a sampled run.

Written once, as tensor functions over rows `[..., V]` (any leading dimensions, N rows in all) with explicit
uniforms, and called by the wavefront engine (`wavefront.processing.choose`, `wavefront.step`)
on all its slots at once and by the lane decoder (`lane_rules`) on one lane at a time, so that a seed gives the same
tokens on both. Words: `scores` are processed logits (after the logits processors and warpers: a masked token is
-inf); `q` the probabilities a draft was drawn from; `p` the target's (the softmax of its scores).

* Greedy (`greedy`): the token is the argmax of the scores; a draft is accepted when it equals it.
* Lossless speculative sampling (`speculative`): a draft x ~ q is accepted when u < p(x) / q(x) (probability
  min(1, p(x) / q(x))); else the token is drawn from normalise(max(p - q, 0)), or from p when that has no mass (p
  equals q to rounding). The committed token is then distributed exactly as p, whatever q is. A position with no
  draft draws from p.
* Two candidates (`second_candidate`, second proposals: a draft x ~ q1 and a second candidate c ~ q2 drawn
  independently for the same position): x is judged as above; if it is rejected, c is judged against the residual
  r1 = normalise(max(p - q1, 0)) the same way (u' < r1(c) / q2(c)), and if it is rejected too the replacement is
  drawn from normalise(max(r1 - q2, 0)), or from r1 when that has no mass. Recursive rejection: the committed token
  is distributed exactly as p. A candidate equal to a rejected draft has r1(c) = 0, so it is always rejected.
* A draw from weights w with a uniform u (`draw`): the first index whose cumulative weight exceeds u * sum(w)
  (inverse CDF), so a zero weight is never drawn.
* A row ends (`ends_row`) at a token of its EOS list or when it has generated `max_new_tokens`.

Uniforms. A sampled run draws, before each cycle, `[B, L, 2]` uniforms (`[B, L, 3]` with second proposals) from
one generator on the run's device, seeded once from torch's global generator (`run_generator`), so
`torch.manual_seed` repeats a run. The lane at position p of sequence b uses row `[b, p % L]` (L: `lanes_for`):
column `JUDGE` judges the draft after it, `DRAW` draws (its draft, a replacement, a target with no draft, a second
proposal), `SECOND` judges a second candidate. Greedy runs draw nothing.
"""

from __future__ import annotations

import torch

JUDGE, DRAW, SECOND = 0, 1, 2  # the columns of a lane's uniforms


def lanes_for(mode: str, num_loops: int, draft_loops: int, num_speculative_tokens: int) -> int:
    """L: the most lanes a sequence holds at once (pipeline: one per d depths; block: the round's K + 1), the lane
    slots of the wavefront engine and the rows of a cycle's uniforms per sequence."""
    return {"ar": 1, "pipeline": num_loops // max(draft_loops, 1), "block": num_speculative_tokens + 1}[mode]


def uniform_columns(second_proposals: bool) -> int:
    """The uniforms per lane and cycle: `JUDGE` and `DRAW`, and `SECOND` with second proposals."""
    return 3 if second_proposals else 2


def run_generator(device: torch.device) -> torch.Generator:
    """A sampled run's generator on `device`, seeded from one draw of torch's global generator."""
    return torch.Generator(device).manual_seed(int(torch.randint(2**62, ())))


def cycle_uniforms(generator: torch.Generator, shape: tuple[int, int, int], device: torch.device) -> torch.Tensor:
    """One cycle's uniforms `[B, L, 2 or 3]` in [0, 1), float32 whatever torch's default dtype (a bfloat16 default
    left a few hundred values, which some tokens' cumulative weights fall between: never drawn)."""
    return torch.rand(shape, generator=generator, device=device, dtype=torch.float32)


def draw(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One index per row of `weights` `[..., V]` (non-negative, not all zero) with probability proportional to
    the weight, from uniforms `u` `[...]` in [0, 1): the first index whose cumulative weight exceeds u * total. The
    point is kept below the total (u * total may round up to it), and the index below V (rounding in the sum)."""
    cumulative = weights.cumsum(-1)  # [..., V] non-decreasing: its last entry is the largest
    total = cumulative[..., -1:]
    point = torch.minimum(u[..., None] * total, torch.nextafter(total, torch.zeros_like(total)))  # below the total
    return (cumulative <= point).sum(-1).clamp(max=weights.shape[-1] - 1)


def proposal_q(q: torch.Tensor, token: torch.Tensor, forced: torch.Tensor) -> torch.Tensor:
    """The distribution `[B, V]` a proposal `token` `[B]` counts as drawn from: its drafter's probabilities `q`, or a
    point mass on `token` where it was forced (`forced` `[B]`) or where `q` is not finite (a drafter whose activations
    overflowed). A point mass keeps speculative sampling exact (the draft is kept with probability p(token)); a
    non-finite q would spoil the target's draw."""
    point = forced | ~q.isfinite().all(-1)  # [B]
    return torch.where(point[:, None], torch.nn.functional.one_hot(token, q.shape[-1]).to(q.dtype), q)


def greedy(scores: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The greedy rule on `scores` `[..., V]` with drafts `x` `[...]`: (the argmax `[...]`, whether x equals it)."""
    top = scores.argmax(-1)
    return top, x == top


def speculative(p: torch.Tensor, q: torch.Tensor, x: torch.Tensor, judged: torch.Tensor,
                u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lossless speculative sampling: the target `p` `[..., V]` judges drafts `x` `[...]` drawn from `q` `[..., V]`
    where `judged` `[...]` (elsewhere there is no draft: the token is a draw from p), with the uniforms `u`
    `[..., 2 or 3]` (columns `JUDGE`, `DRAW`). Returns the committed token `[...]`, whether the draft is accepted
    `[...]` (meaningful where judged) and the weights a rejection's replacement is drawn from `[..., V]`
    (unnormalised: max(p - q, 0), or p where that has no mass or nothing is judged)."""
    p_x, q_x = p.gather(-1, x[..., None])[..., 0], q.gather(-1, x[..., None])[..., 0]
    accept = u[..., JUDGE] * q_x < p_x  # u < p(x) / q(x), with q(x) > 0 for a drafted x
    residual = (p - q).clamp(min=0)
    left = torch.where((judged & (residual.sum(-1) > 0))[..., None], residual, p)
    token = torch.where(judged & accept, x, draw(left, u[..., DRAW]))
    return token, accept, left


def second_candidate(left: torch.Tensor, q2: torch.Tensor, c: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The replacement of a rejected draft when its position also has a second candidate `c` `[...]` drawn from `q2`
    `[..., V]`: c with probability min(1, r1(c) / q2(c)), r1 = normalise(`left`) (`speculative`'s residual weights),
    judged with `u[..., SECOND]`, else a draw (`u[..., DRAW]`) from normalise(max(r1 - q2, 0)), or r1 where that has
    no mass. `u`: `[..., 3]`; returns `[...]`."""
    r1 = left / left.sum(-1, keepdim=True)
    keep = u[..., SECOND] * q2.gather(-1, c[..., None])[..., 0] < r1.gather(-1, c[..., None])[..., 0]
    rest = (r1 - q2).clamp(min=0)
    return torch.where(keep, c, draw(torch.where((rest.sum(-1) > 0)[..., None], rest, r1), u[..., DRAW]))


def non_finite_error(sequences: list[int]) -> RuntimeError:
    """The error of a sampled run whose probabilities are not finite (for `sequences`): plain sampling's
    (`torch.multinomial`'s) message, with the likely causes and the fix."""
    return RuntimeError(f"probability tensor contains either `inf` or `nan` (sampling, sequences {sequences[:8]}): "
                        "the sampling settings overflow in float32 (e.g. a temperature too close to 0) or the "
                        "model's logits are not finite; use a larger temperature, or greedy decoding.")


def ends_row(token: torch.Tensor, generated: torch.Tensor, max_new: torch.Tensor | int,
             eos: torch.Tensor | None) -> torch.Tensor:
    """Whether committing `token` `[...]` as a row's `generated`-th new token (`[...]`, counted from 1) ends the row:
    the row has reached `max_new` tokens, or `token` is in the EOS list `eos` `[E]`, or with one list per row
    (`eos` `[B, E]`, -1 padded; `token` `[B, ...]`) in its row's (None: no EOS stop)."""
    full = generated >= max_new
    if eos is None:
        return full
    if eos.dim() == 1:
        return full | torch.isin(token, eos)
    return full | (token[..., None] == eos.view(len(eos), *[1] * (token.dim() - 1), -1)).any(-1)
