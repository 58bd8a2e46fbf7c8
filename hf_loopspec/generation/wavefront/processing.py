"""Logits processing and token choice of the wavefront step, as device tensor ops over the lane slots whose head
output the cycle uses (`slots` `[B, R]`: `step.head_slots`), all at once.

Processing. The engine runs a call's logits processors in the call's own order (`Plan.processors`, built by
`device_processors` from the `LogitsProcessorList` transformers made): the repetition penalty and the
`min_length` / `min_new_tokens` EOS hold, each slot with its own path as the prefix (the prompt row, the committed
tokens and the lanes up to the slot, which lie on one path); the sampling warpers (temperature, top-k, top-p, min-p)
on the `[B * R, V]` slot scores, with transformers' semantics: the same ops in the same order, so the same scores
(`test_sampling_warpers_are_transformers` compares them bit for bit). A plan item holds a processor's kind and its
structural settings only; its value (the penalty, the temperature, k, 1 - top_p, min_p) is `state.settings[i]`, a
tensor, so a compiled step serves every value of a setting without compiling again.

Choice (`choose`), per slot, from its processed scores:

* greedy (`rules.greedy`): the slot's token is the argmax; the lane after it is accepted when its token equals
  that argmax;
* sampling: `rules.speculative` on those slots at once: the lane x after the slot, drafted from q, is accepted
  with probability min(1, p(x) / q(x)); the slot's token is then x, else a draw from normalise(max(p - q, 0)) (a
  slot with no draft after it draws from p). With second proposals the position may also hold a second candidate,
  judged by recursive rejection (`rules.second_candidate`). The uniforms are `state.noise` `[B, L, 2 or 3]`: each
  slot's for the cycle, laid out as `rules` says (drawn by the host from the run's generator before the cycle).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import (
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from .. import rules
from .state import HOLD, HOST, MIN_P, PENALTY, TEMPERATURE, TOP_K, TOP_P, Plan, WavefrontState

WARPERS = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper)

ScoreOp = Callable[[WavefrontState, torch.Tensor, torch.Tensor], torch.Tensor]  # (state, scores [B, R, V], slots
# [B, R]) -> scores [B, R, V]


def on_device(processor, width: int) -> bool:
    """Whether the engine applies `processor` itself, for a prompt of `width` columns (exact classes: a subclass
    may change what they do)."""
    if type(processor) is RepetitionPenaltyLogitsProcessor:
        ignore = processor.prompt_ignore_length  # None, an int or a [B] tensor of prompt columns not counted
        return ignore is None or bool((torch.as_tensor(ignore) <= width).all())
    return type(processor) in (MinLengthLogitsProcessor, MinNewTokensLengthLogitsProcessor, *WARPERS)


def device_processors(processors, input_ids: torch.Tensor, vocab: int) -> tuple[tuple, dict]:
    """`Plan.processors` for `processors` (runs of those not `on_device`: `(HOST, start, stop)` items), and the
    engine's tensors they need: `settings`
    `[n]` float32 (item i's value, see the module docstring; 0 for the EOS hold), `penalty_ignore` `[B]` (prompt
    columns the penalty skips) and `eos_hold` `[V]` (id v is held back while fewer than `eos_hold[v]` tokens are
    generated)."""
    items, values, tensors, width = [], [], {}, input_ids.shape[1]
    hold = torch.zeros(vocab, dtype=torch.long)
    for i, p in enumerate(processors or ()):
        if not on_device(p, width):  # a run of host processors is one item (`host.HostHooks.process`)
            if items and items[-1][0] == HOST and items[-1][2] == i:
                items[-1] = (HOST, items[-1][1], i + 1)
            else:
                items.append((HOST, i, i + 1))
                values.append(0.0)
        elif isinstance(p, RepetitionPenaltyLogitsProcessor):
            items.append((PENALTY,))
            values.append(p.penalty)
            if p.prompt_ignore_length is not None:
                tensors["penalty_ignore"] = torch.as_tensor(p.prompt_ignore_length).expand(len(input_ids))
        elif isinstance(p, (MinLengthLogitsProcessor, MinNewTokensLengthLogitsProcessor)):
            # MinLength: held while width + i < min_length; MinNewTokens: while width + i - skip < min_new_tokens
            until = p.min_length - width if isinstance(p, MinLengthLogitsProcessor) \
                else p.min_new_tokens + p.prompt_length_to_skip - width
            ids = torch.as_tensor(p.eos_token_id).reshape(-1).cpu()
            ids = ids[(ids >= 0) & (ids < vocab)]  # as transformers' processors: an id outside [0, V) holds nothing
            hold[ids] = torch.maximum(hold[ids], torch.tensor(until))
            tensors["eos_hold"] = hold
            if (HOLD,) not in items:
                items.append((HOLD,))
                values.append(0.0)
        elif isinstance(p, TemperatureLogitsWarper):
            items.append((TEMPERATURE,))
            values.append(p.temperature)
        elif isinstance(p, TopKLogitsWarper):  # its top_k already counts min_tokens_to_keep
            items.append((TOP_K, p.filter_value))
            values.append(min(p.top_k, vocab))
        elif isinstance(p, TopPLogitsWarper):  # the cumulative probability a sorted score must pass: 1 - top_p
            items.append((TOP_P, p.filter_value, min(p.min_tokens_to_keep, vocab)))
            values.append(1 - p.top_p)
        else:  # MinPLogitsWarper, the last class `on_device` admits
            items.append((MIN_P, p.filter_value, min(p.min_tokens_to_keep, vocab)))
            values.append(p.min_p)
    if items:
        tensors["settings"] = torch.tensor(values, dtype=torch.float32)
    return tuple(items), tensors


def score_ops(plan: Plan) -> list[ScoreOp]:
    """The step's processing of `plan`, in order (see the module docstring): item i reads its value from
    `state.settings[i]`."""
    ops = []
    for i, (kind, *static) in enumerate(plan.processors):
        if kind == HOST:
            ops.append(lambda s, scores, slots, span=tuple(static): plan.host.process(*span, s, scores, slots))
        elif kind in _SLOT_OPS:
            ops.append(lambda s, scores, slots, op=_SLOT_OPS[kind], i=i: op(s, scores, slots, s.settings[i]))
        else:
            ops.append(lambda s, scores, slots, op=_WARPS[kind], i=i, static=tuple(static):
                       op(scores.flatten(0, 1), s.settings[i], *static).view_as(scores))
    return ops


def _penalise(s: WavefrontState, scores: torch.Tensor, slots: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """transformers' repetition penalty (`penalty` `[]`) with each slot's own path as the prefix."""
    rows = slots.shape[1]
    position = s.position.gather(1, slots)  # [B, R]
    on_path = s.alive[:, None, :] & (s.position[:, None, :] <= position[:, :, None])  # [B, R, L]
    seen = s.seen[:, None].expand(-1, rows, -1).long().scatter_reduce(
        2, s.token[:, None, :].expand(-1, rows, -1), on_path.long(), "amax").bool()  # [B, R, V]
    return torch.where(seen, torch.where(scores < 0, scores * penalty, scores / penalty), scores)


def _hold(s: WavefrontState, scores: torch.Tensor, slots: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
    """`min_length` / `min_new_tokens`: the held ids are -inf for the tokens generated too early."""
    generated = s.position.gather(1, slots) + 1 - s.prompt_len[:, None]  # [B, R] index of the token each chooses
    return scores.masked_fill(generated[..., None] < s.eos_hold, float("-inf"))


# The warpers, each on scores `[N, V]` with its value `[]` (a tensor) and its static settings: transformers'
# semantics (see the module docstring).

def _temperature(scores: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    return scores / temperature


def _top_k(scores: torch.Tensor, k: torch.Tensor, filter_value: float) -> torch.Tensor:
    """Every score below the k-th largest of its row is filtered (ties with it stay)."""
    kth = scores.sort(-1, descending=True).values.gather(-1, (k.long() - 1).expand(len(scores), 1))  # [N, 1]
    return scores.masked_fill(scores < kth, filter_value)


def _top_p(scores: torch.Tensor, cutoff: torch.Tensor, filter_value: float, keep: int) -> torch.Tensor:
    """With the scores sorted ascending, the ones whose cumulative probability is at most `cutoff` (1 - top_p) are
    filtered, except the `keep` largest."""
    ascending, order = scores.sort(-1)
    vocab = scores.shape[-1]
    drop = (ascending.softmax(-1).cumsum(-1) <= cutoff) & (torch.arange(vocab, device=scores.device) < vocab - keep)
    return scores.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), filter_value)


def _min_p(scores: torch.Tensor, min_p: torch.Tensor, filter_value: float, keep: int) -> torch.Tensor:
    """Tokens whose probability is below min_p times their row's largest are filtered, except the `keep` most
    probable."""
    probs = scores.softmax(-1)
    drop = (probs < min_p * probs.amax(-1, keepdim=True)).scatter(-1, probs.topk(keep, -1).indices, False)
    return scores.masked_fill(drop, filter_value)


_SLOT_OPS = {PENALTY: _penalise, HOLD: _hold}  # (state, scores [B, R, V], slots [B, R], value) -> [B, R, V]
_WARPS = {TEMPERATURE: _temperature, TOP_K: _top_k, TOP_P: _top_p, MIN_P: _min_p}


def choose(plan: Plan, s: WavefrontState, scores: torch.Tensor, slots: torch.Tensor):
    """Per slot of `slots` `[B, R]`, from its scores `[B, R, V]`: its token `[B, R]`, whether the lane at its
    position + 1 is accepted `[B, R]` (meaningful where that lane is a live draft), and its probabilities
    `[B, R, V]` (None when greedy). See the module docstring."""
    lanes = s.token.shape[1]
    position = s.position.gather(1, slots)  # [B, R]
    after = (position + 1) % lanes  # [B, R] the slot of the lane at position + 1, if it lives
    x = s.token.gather(1, after)  # [B, R]
    if not plan.do_sample:
        top, accept = rules.greedy(scores, x)
        return top, accept, None
    p = torch.softmax(scores.float(), -1)  # [B, R, V]
    q = s.draft_q.gather(1, after[..., None].expand_as(p))  # [B, R, V] the draft distribution of the next lane
    judged = (s.alive & s.draft).gather(1, after) & (s.position.gather(1, after) == position + 1)  # [B, R]
    noise = s.noise.gather(1, slots[..., None].expand(-1, -1, s.noise.shape[-1]))  # [B, R, 2 or 3]
    token, accept, left = rules.speculative(p, q, x, judged, noise)
    if plan.second_loops is not None:  # a second candidate (`state.sib_read`) replaces a rejected draft's draw
        two = judged & ~accept & (s.sib_position[:, None] == position + 1) & s.sib_read[:, None]  # [B, R]
        c = s.sib_token[:, None].expand_as(two)  # [B, R]
        token = torch.where(two, rules.second_candidate(left, s.sib_q[:, None].expand_as(p), c, noise), token)
    return token, accept, p
