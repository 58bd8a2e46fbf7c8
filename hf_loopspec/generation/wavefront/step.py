"""One decoding cycle of the wavefront engine as a pure tensor function `step(state) -> state`.

The cycle is the lane decoder's (see `generation.decoder`), over every sequence at once and without host
synchronisation (no `.item()`, `.tolist()`, host-built tensors or Python branches on tensor values), so that
`torch.compile(step, fullgraph=True)` traces it whole:

1. Selection: every live lane and prompt row runs, except in block mode, where a sequence with a lane (or prompt
   rows) below depth d runs only those.
2. One core call over all B*L lane slots and B*P prompt rows. Rows that do not run are masked: they write their KV
   into a reserved trash slot, read nothing that reaches an output, and keep their hidden state. With
   `Plan.compact` (eager on a CPU, where nothing waits on a device) the core's layers run the active rows only,
   selected by a boolean index: the one data-dependent shape of the step, and the reason it is off wherever the
   step is compiled or runs on CUDA; attention puts them back on the fixed rows (and skips the sibling rows'
   attention when none runs). The head then runs each slot it needs once, and a chosen sibling's head call only
   in a cycle that chose one.
3. The head on the lane slots whose output the cycle uses (`head_slots`: the targets at depth U and, in pipeline
   mode, the lane at depth d), the call's logits processors, and each such slot's choice (`processing.choose`):
   its token (the target at depth U, the draft proposal at depth d) and whether the lane after it is accepted
   (greedy: its token equals the argmax; sampling: the lossless rule).
4. Verification, per sequence, in position order over the lanes that reached depth U: a target is committed;
   when the next lane is accepted it goes on, else it and its descendants die and every KV plane is rolled back
   (a `kv_len` update, I4). Processing stops at a rejection, at EOS, at `max_new_tokens`, or at the last target;
   a target with no accepted lane after it spawns a new lane at depth 0 (a restart).
5. Drafting: the frontier lane that has just reached depth d proposes the next token (or
   `state.draft_override`) as a new lane at depth 0, while that position can still matter.
6. Lanes at depth U retire; spawned lanes are embedded into their slot (position % L).

A model whose entry or exit stage has KV (Huginn's prelude and coda, `stages`) embeds spawned lanes (and siblings, on
their private rows) through its entry plane, and in step 3 runs the head on every lane and prompt row that has just
reached an exit depth, each with that depth's exit plane (a sibling chosen at depth d runs it when it drafts). The
step reads the model's layout from `Plan.layout` and random loop-0 inputs from `WavefrontState.init_states`: nothing
of the call's settings is read from the model inside the step.

Second proposals (`Plan.second_loops` = d2, `sibling`): the sequence's sibling runs in step 2 as one more row on
its private KV; in step 3 the lane at depth d2 is a head slot too; in step 4 a target whose next position has a
sibling keeps the main draft, chooses the sibling (which then takes the main draft's slot: `sibling.promote`;
when it is d loops deep it drafts at once, from a second head call on its slot) or rejects both; after step 5 the
lane that has just reached d2 re-reads its draft (`sibling.reread`).

Exit options (`Plan.exit_rule`, `exits`): in step 2 every running slot keeps its output of the loop, and in step 3
the targets' logits come from the rule over their U outputs.

Invariants: a sequence's live lanes hold consecutive positions (so slot = position % L is unique); at most one
lane is spawned per sequence per cycle (a restart needs the frontier at depth U, a draft needs it at depth d), plus
at most one sibling, in its own slot, at a position that has a live lane (so below the frontier);
in modes "ar" and "pipeline" every live lane runs every cycle, so a sequence's live lanes have distinct depths
(`ops.attention.slots.SlotAttention`'s grid and `head_slots` rely on it); after a cycle, an unfinished sequence's
oldest live lane sits at position prompt_len + n_out - 1 (its last committed token, or its last prompt token:
`span.SpanBound` relies on it); a finished sequence has no live lane or prompt row, so further steps leave it unchanged.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...ops.attention.slots import SlotAttention, SlotLayout
from .. import rules
from . import exits, outputs, sibling, stages
from .processing import choose, score_ops
from .state import Plan, WavefrontState, counts


def make_step(model, plan: Plan) -> Callable[[WavefrontState], WavefrontState]:
    """The cycle of `plan` for `model` (entry and exit stages with KV of their own, e.g. Huginn's: `stages`)."""
    embed_spawned, embed_sibling = stages.spawn_embedder(model, plan), stages.sibling_embedder(model, plan)
    staged_exit = plan.layout.first_exit_plane is not None
    ops = score_ops(plan)

    second = plan.second_loops is not None
    promoted_drafts = second and plan.num_loops - plan.second_loops == plan.draft_loops  # a chosen sibling is d deep

    def step(state: WavefrontState) -> WavefrontState:
        ran, prompt_ran = _run_core(model, plan, state)
        slots = head_slots(plan, state, ran)  # [B, R]
        staged = stages.exit_logits(model, plan, state, ran, prompt_ran[:, None] & state.prompt_real) \
            if staged_exit else None  # [B, L, V]: every exiting row runs the head, which writes its exit plane
        logits, scores = _head(model, ops, state, slots, plan, raw=True, logits=staged)  # [B, R, V] each
        place = lambda x: _to_slots(x, slots, lanes=state.token.shape[1])  # noqa: E731  [B, R, ...] -> [B, L, ...]
        token, accept, probs = (None if x is None else place(x)
                                for x in choose(plan, state, scores, slots))  # [B, L], [B, L], [B, L, V] or None
        kept = outputs.slot_values(plan, logits, scores, place)  # output_scores / output_logits: [B, L, V] each
        drafter = _drafters(plan, state, ran)  # [B, L], chosen before verification
        rereader = ran & (state.depth == plan.second_loops) if second else None  # [B, L]
        spawn_tok, spawn_pos, restart, taken = _verify(plan, state, ran, token, accept, kept, probs)
        drafter = drafter & ~taken  # a chosen sibling took a killed lane's slot, which may have been the drafter's
        if plan.exit_rule is not None and second:
            exits.promote(state, taken)
        if promoted_drafts:  # a sibling chosen at depth d is the frontier: it drafts now, from its own head row
            drafter, token, probs = _promoted_draft(model, ops, plan, state, taken, drafter, token, probs)
        _draft(plan, state, drafter, token, probs, spawn_tok, spawn_pos, restart, embed_spawned)
        if second:
            # [B, L] a fresh draw when sampling
            proposal = token if probs is None else rules.draw(probs, state.noise[..., rules.DRAW])
            sibling.reread(plan, state, rereader & ~taken, proposal, probs, embed_sibling)
        return state

    return step


def make_cycles(model, plan: Plan, cycles: int) -> Callable[[WavefrontState, torch.Tensor | None], WavefrontState]:
    """`cycles` cycles of `plan`'s step as one function `(state, noise) -> state`, cycle i sampling with the uniforms
    `noise[i]` (`noise`: `[cycles, B, L, 2 or 3]`, None when greedy). Compiled, the cycles are one graph (unrolled:
    compile time grows with `cycles`)."""
    step = make_step(model, plan)

    def run(state: WavefrontState, noise: torch.Tensor | None) -> WavefrontState:
        for cycle in range(cycles):
            if noise is not None:
                state.noise = noise[cycle]
            state = step(state)
        return state

    return run


def _head(model, ops, s: WavefrontState, slots: torch.Tensor, plan: Plan, raw: bool = False,
          logits: torch.Tensor | None = None, exit_rule: bool = True):
    """The processed head scores `[B, R, V]` of the lane slots `slots` `[B, R]` (with `raw`: the raw logits and
    them), from the head's logits of every slot `logits` `[B, L, V]` when given (`stages.exit_logits`), else from
    a head call on those slots (with `Plan.compact`, on each distinct slot once: `head_slots` repeats a slot for an
    absent column); with `plan`'s exit rule (and `exit_rule`), those of the targets come from it
    (`exits.target_scores`)."""
    if logits is not None:
        logits = logits.gather(1, slots[..., None].expand(-1, -1, logits.shape[-1]))
    elif plan.compact:  # a data-dependent shape, as the compacted core call (module docstring)
        lanes = s.hidden.shape[1]
        flat = (torch.arange(len(slots), device=slots.device)[:, None] * lanes + slots).flatten()  # [B * R]
        rows, column = flat.unique(return_inverse=True)  # [n], [B * R]
        s.head_rows = s.head_rows + len(rows)
        logits = model.head(s.hidden.flatten(0, 1)[rows])[column].view(*slots.shape, -1)
    else:
        logits = model.head(s.hidden.gather(1, slots[..., None].expand(-1, -1, s.hidden.shape[-1])))
    if exit_rule and plan.exit_rule is not None:
        logits = exits.target_scores(plan, s, slots, logits)
    scores = logits
    for op in ops:
        scores = op(s, scores, slots)
    return (logits, scores) if raw else scores


def _promoted_draft(model, ops, plan: Plan, s: WavefrontState, taken: torch.Tensor, drafter: torch.Tensor,
                    token: torch.Tensor, probs: torch.Tensor | None):
    """A sibling chosen at depth d (`taken` `[B, L]`: the slot it took) is its sequence's frontier and drafts in this
    cycle, from a head call on its slot (its draw uses its slot's uniforms, unused by the killed lane it replaced;
    with an exit stage that has KV, the call writes the depth-d exit plane at its position: `stages.exit_logits`).
    Returns `drafter`, `token` `[B, L]` and `probs` `[B, L, V]` (None when greedy) with its draft added."""
    if plan.compact and not taken.any():  # eager on a CPU: no sibling was chosen, no head call
        return drafter, token, probs
    ready = taken & (s.depth == plan.draft_loops) & (s.position < _last_draft(s))  # [B, L]
    slot = taken.long().argmax(1, keepdim=True)  # [B, 1]
    staged = stages.exit_logits(model, plan, s, taken, torch.zeros_like(s.prompt_real)) \
        if plan.layout.first_exit_plane is not None else None  # [B, L, V]
    scores = _head(model, ops, s, slot, plan, logits=staged, exit_rule=False)  # [B, 1, V]
    if probs is None:
        top = scores.argmax(-1)  # [B, 1]
    else:
        own = torch.softmax(scores.float(), -1)  # [B, 1, V]
        top = rules.draw(own, s.noise.gather(1, slot[..., None].expand(-1, -1, s.noise.shape[-1]))[..., rules.DRAW])
        probs = torch.where(ready[..., None], own, probs)
    return drafter | ready, torch.where(ready, top, token), probs


def head_columns(plan: Plan) -> int:
    """R: the lane slots per sequence whose head output a cycle uses (`head_slots`)."""
    pipeline = min(2, plan.lanes) if plan.second_loops is None else 3
    return {"ar": 1, "pipeline": pipeline, "block": plan.lanes}[plan.mode]


def head_slots(plan: Plan, s: WavefrontState, ran: torch.Tensor) -> torch.Tensor:
    """The lane slots whose head output the cycle uses, `[B, R]` (`head_columns`): in block mode every slot (a
    round's K + 1 targets); else the slot that has reached depth U (the target) and, in pipeline mode, the one at
    depth d (the drafter) and, with second proposals, the one at depth d2 (it re-reads its draft). A sequence's
    running lanes have distinct depths there, so there is at most one of each; an absent one repeats the first
    present one of its sequence (slot 0 when none is): its result is that slot's again, and unused unless that slot
    is needed."""
    batch, lanes = s.token.shape
    if head_columns(plan) == lanes:
        return torch.arange(lanes, device=s.token.device).expand(batch, lanes)
    depths = (plan.num_loops,) if plan.mode == "ar" else (plan.num_loops, plan.draft_loops)
    depths += () if plan.second_loops is None else (plan.second_loops,)
    at = torch.stack([ran & (s.depth == depth) for depth in depths], 1)  # [B, R, L]
    slots, present = at.long().argmax(2), at.any(2)  # [B, R] each
    first = slots.gather(1, present.long().argmax(1, keepdim=True))  # [B, 1]
    return torch.where(present, slots, first)


def _to_slots(x: torch.Tensor, slots: torch.Tensor, lanes: int) -> torch.Tensor:
    """`x` `[B, R, ...]` of the slots `slots` `[B, R]` placed at those slots of `[B, L, ...]` (zeros elsewhere;
    a slot listed twice gets the same value twice)."""
    index = slots.view(*slots.shape, *[1] * (x.dim() - 2)).expand_as(x)
    return x.new_zeros(x.shape[0], lanes, *x.shape[2:]).scatter(1, index, x)


def select_rows(plan: Plan, s: WavefrontState) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 1: the lane slots `[B, L]` and the sequences whose prompt rows `[B]` run in this cycle (the sibling of
    an unfinished sequence runs whenever it is alive)."""
    live = ~s.finished  # [B]
    alive = s.alive & live[:, None]  # [B, L]
    prompt_live = live & (s.prompt_depth < plan.num_loops) & s.prompt_real.any(1)  # [B]
    if plan.mode != "block":
        return alive, prompt_live
    lane_below = alive & (s.depth < plan.draft_loops)  # [B, L]
    prompt_below = prompt_live & (s.prompt_depth < plan.draft_loops)  # [B]
    drafting = lane_below.any(1) | prompt_below  # [B]
    return alive & (lane_below | ~drafting[:, None]), prompt_live & (prompt_below | ~drafting)


def _run_core(model, plan: Plan, s: WavefrontState) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 1 and 2: one core call (with the sibling rows, second proposals); returns which lane slots `[B, L]` and
    prompt rows `[B]` ran."""
    batch, lanes = s.token.shape
    prompts = s.prompt_real.shape[1]
    live = ~s.finished  # [B]
    ran, prompt_ran = select_rows(plan, s)
    prompt_rows = prompt_ran[:, None] & s.prompt_real  # [B, P]
    device = s.token.device
    second = plan.second_loops is not None
    sib_ran = s.sib_alive & live  # [B]
    hidden = torch.cat([s.hidden.flatten(0, 1), s.prompt_hidden.flatten(0, 1),
                        *([s.sib_hidden] if second else ())])  # [N, H]: N = B*L + B*P (+ B)
    prompt_position = torch.arange(prompts, device=device) + s.prompt_start[:, None]  # [B, P]
    position = torch.cat([s.position.flatten(), prompt_position.flatten(), *([s.sib_position] if second else ())])
    layout = SlotLayout(plan.layout.num_layers, plan.planes, plan.table_width, plan.positions, plan.read_span,
                        cells=plan.lanes if plan.mode == "block" else 1)  # block: a lane's grid cell is its slot
    attention = SlotAttention(s.k_pool, s.v_pool, s.trash_slot, layout, (s.depth, s.position, ran),
                              (s.prompt_depth, prompt_position, prompt_rows),
                              sibling.SiblingRows(s, plan, s.sib_depth, s.sib_position, sib_ran) if second else None,
                              pages=s.pages)
    if plan.compact:  # the active rows only (a data-dependent shape: CPU eager, see the module docstring)
        rows = attention.compact()  # [n]
        out = hidden.index_copy(0, rows, model.core(hidden[rows], position[rows], attention))  # [N, H]
        s.core_rows, s.head_rows = torch.tensor(len(rows)), torch.tensor(0)
    else:
        out = model.core(hidden, position, attention)  # [N, H]
    s.core_calls = s.core_calls + live.any().long()
    if plan.trace_hidden:
        s.core_out = out
    n = batch * lanes
    s.hidden = torch.where(ran[..., None], out[:n].view_as(s.hidden), s.hidden)
    m = n + batch * prompts
    if plan.exit_rule is not None:  # before the depths move on: an output is kept at the depth its loop started
        exits.record(s, ran, out[:n].view_as(s.hidden), sib_ran if second else None, out[m:] if second else None)
    s.prompt_hidden = torch.where(prompt_rows[..., None], out[n:m].view_as(s.prompt_hidden), s.prompt_hidden)
    if second:  # the sibling's KV went to its private rows: the main tables' lengths do not change
        s.sib_hidden = torch.where(sib_ran[:, None], out[m:], s.sib_hidden)
        s.sib_depth = s.sib_depth + sib_ran.long()
    ends = torch.cat([torch.where(ran, s.position + 1, 0), torch.where(prompt_rows, prompt_position + 1, 0)], 1)
    planes = torch.cat([s.depth, s.prompt_depth[:, None].expand(-1, prompts)], 1)  # [B, L + P] each row's plane
    stages.raise_lengths(s, plan, planes, ends)
    s.depth = s.depth + ran.long()
    s.prompt_depth = s.prompt_depth + prompt_ran.long()
    return ran, prompt_ran


def _drafters(plan: Plan, s: WavefrontState, ran: torch.Tensor) -> torch.Tensor:
    """The lane of each sequence that proposes a draft this cycle, if any: `[B, L]` bool."""
    if plan.mode == "ar":
        return torch.zeros_like(ran)
    frontier = torch.where(s.alive, s.position, -1).amax(1, keepdim=True)  # [B, 1]
    drafter = ran & (s.depth == plan.draft_loops) & (s.position == frontier) & (s.position < _last_draft(s))
    if plan.mode == "block":
        drafter = drafter & (s.round_drafts < plan.num_speculative_tokens)[:, None]
    return drafter


def _last_draft(s: WavefrontState) -> torch.Tensor:
    """`[B, 1]`: lanes at positions below it may draft (no lane beyond it is needed: the last token is not fed
    back)."""
    return (s.prompt_len + s.max_new - 2)[:, None]


def _shift_left(x: torch.Tensor, fill) -> torch.Tensor:
    """`x[:, r + 1]` at column r, `fill` in the last column: `[B, L]`."""
    return torch.cat([x[:, 1:], torch.full_like(x[:, :1], fill)], 1)


def _verify(plan: Plan, s: WavefrontState, ran: torch.Tensor, top: torch.Tensor, accept: torch.Tensor,
            kept: tuple = (), probs: torch.Tensor | None = None):
    """Step 4, with each slot's chosen token `top` `[B, L]` and whether the lane after it is accepted `accept`
    `[B, L]` (`processing.choose`); a committed target's `kept` values (`outputs.slot_values`) are recorded.
    Sampling, a sequence whose committing targets' probabilities `probs` `[B, L, V]` are not all finite (settings
    that overflow in float32, non-finite logits: plain sampling's error) commits nothing and is marked `invalid` and
    finished (`WavefrontEngine.run` raises); other lanes' probabilities do not count (a lane after a rejected draft
    dies with it, whatever the draft's activations were).
    Returns each sequence's restart lane: token `[B]`, position `[B]`, and whether there is one `[B]`; and the lane
    slots `[B, L]` that chosen siblings took (`sibling.promote`)."""
    lanes = s.token.shape[1]
    rank = torch.arange(lanes, device=s.token.device)  # [L]
    oldest = torch.where(s.alive, s.position, s.position.new_tensor(2**62)).amin(1)  # [B]
    order = (oldest[:, None] + rank) % lanes  # [B, L]: slot of the lane at rank r (position oldest + r)
    by_rank = lambda x: x.gather(1, order)  # noqa: E731
    alive, top_r = by_rank(s.alive & ~s.finished[:, None]), by_rank(top)
    target = by_rank(ran & (s.depth == plan.num_loops))  # [B, L] a prefix of the ranks
    has_next = _shift_left(alive, False)
    match = by_rank(accept)
    chosen = has_next & (sibling.chosen(s, order, top_r) if plan.second_loops is not None else torch.zeros_like(match))
    # [B, L] committing rank r ends the row: an EOS token, or max_new_tokens reached
    stop = rules.ends_row(top_r, s.n_out[:, None] + rank + 1, s.max_new.reshape(-1, 1), s.eos if plan.has_eos else None)
    go_on = has_next & match & ~stop
    first_stop = torch.where(go_on.all(1), lanes, (~go_on).long().argmax(1))  # [B] rank of the first lane not going on
    reached = rank <= first_stop[:, None]  # [B, L] every lane below the rank goes on (no cumprod: a fused compare)
    commit = target & reached  # [B, L]
    if probs is not None:
        bad = (commit & ~by_rank(probs.isfinite().all(-1))).any(1)  # [B]
        s.invalid, s.finished = s.invalid | bad, s.finished | bad
        commit = commit & ~bad[:, None]
    n_commit = commit.sum(1)  # [B]
    verified = commit & has_next
    accepted, rejected, second = verified & (match | chosen), verified & ~match & ~chosen, verified & ~match & chosen
    finished_now = (commit & stop).any(1)  # [B]
    last = (n_commit - 1).clamp(min=0)[:, None]  # [B, 1] rank of the last committed target
    position_r = by_rank(s.position)  # [B, L]
    last_pos = position_r.gather(1, last)[:, 0]  # [B]
    last_top = top_r.gather(1, last)[:, 0]
    was_rejected = (verified & ~match).any(1)  # the main draft was not kept (the sibling may have been)
    restart = (n_commit > 0) & ~finished_now & ~(has_next & (match | chosen)).gather(1, last)[:, 0]

    # lanes that die: descendants of a rejected draft, and every lane of a finished sequence
    killed = (alive & was_rejected[:, None] & (rank > last)) | (alive & finished_now[:, None])
    draft = by_rank(s.draft) & ~torch.cat([torch.zeros_like(verified[:, :1]), verified[:, :-1]], 1)
    s.counters = s.counters + counts(s, committed=n_commit, verified=verified.sum(1), accepted=accepted.sum(1),
                                     rejected=rejected.sum(1), discarded=(killed & draft).sum(1),
                                     second_accepted=second.sum(1))
    to_slots = lambda x: torch.empty_like(x).scatter(1, order, x)  # noqa: E731
    s.draft = to_slots(draft)
    s.alive = s.alive & ~to_slots(killed) & (s.depth < plan.num_loops) & ~s.finished[:, None]

    columns = torch.where(commit, s.n_out[:, None] + rank, s.out.shape[1] - 1)  # [B, L]
    s.out = s.out.scatter(1, columns, top_r)
    outputs.record(plan, s, columns, order, kept)
    if plan.penalised:
        s.seen = s.seen.long().scatter_reduce(1, top_r, commit.long(), "amax").bool()  # the committed tokens
    s.n_out = s.n_out + n_commit
    s.finished = s.finished | finished_now
    big = s.kv_len.new_tensor(2**62)
    keep = torch.where(was_rejected, last_pos + 1, big)  # [B] rollback to the verified prefix (I4)
    keep = torch.minimum(keep, torch.where(finished_now, s.prompt_len + s.n_out - 1, big))  # as serial AR leaves it
    s.kv_len = torch.minimum(s.kv_len, keep[:, None])
    s.round_drafts = torch.where(restart, 0, s.round_drafts)
    taken = torch.zeros_like(s.alive)
    if plan.second_loops is not None:  # the sibling leaves its slot once its parent's target is committed
        decided = s.finished | (commit & (position_r + 1 == s.sib_position[:, None])).any(1)  # [B]
        s.sib_alive, s.sib_read = s.sib_alive & ~decided, s.sib_read & ~decided
        taken = sibling.promote(plan, s, second.any(1) & ~finished_now)
    return last_top, last_pos + 1, restart, taken


def _draft(plan: Plan, s: WavefrontState, drafter, top, probs, restart_tok, restart_pos, restart,
           embed_spawned) -> None:
    """Steps 5 and 6: propose drafts (`top` `[B, L]`, drawn from `probs` `[B, L, V]` when sampling), and embed each
    sequence's spawned lane (a draft or a restart) into its slot (`stages.spawn_embedder`)."""
    drafter = drafter & s.alive & ~s.finished[:, None]  # still the frontier after verification
    has_draft = drafter.any(1)  # [B]
    draft_pos = torch.where(drafter, s.position, 0).amax(1) + 1  # [B]
    proposed = torch.where(drafter, top, 0).amax(1)  # [B]
    forced = s.draft_override.gather(1, draft_pos.clamp(max=plan.positions - 1)[:, None])[:, 0]
    if plan.host is not None:  # `draft_hook`, on the host (eager)
        forced = plan.host.draft(has_draft, draft_pos, torch.where(forced >= 0, forced, proposed), forced)
    draft_tok = torch.where(forced >= 0, forced, proposed)
    s.counters = s.counters + counts(s, drafted=has_draft)
    s.round_drafts = s.round_drafts + has_draft.long()

    spawn = restart | has_draft  # [B]
    token = torch.where(restart, restart_tok, draft_tok)
    position = torch.where(restart, restart_pos, draft_pos)
    slot = (torch.arange(s.token.shape[1], device=s.token.device) == (position % s.token.shape[1])[:, None]) \
        & spawn[:, None]  # [B, L]
    s.token = torch.where(slot, token[:, None], s.token)
    s.position = torch.where(slot, position[:, None], s.position)
    s.depth = torch.where(slot, 0, s.depth)
    s.alive = s.alive | slot
    s.draft = torch.where(slot, has_draft[:, None], s.draft)
    if plan.do_sample:  # the draft's q: the drafter's probabilities, or a point mass on a forced token (lossless)
        q = torch.where(drafter[..., None], probs, 0.0).sum(1)  # [B, V] (at most one drafter per sequence)
        q = rules.proposal_q(q, draft_tok, forced >= 0)
        s.draft_q = torch.where(slot[..., None], q[:, None], s.draft_q)
    s.hidden = torch.where(slot[..., None], embed_spawned(s, token, position, spawn)[:, None], s.hidden)
