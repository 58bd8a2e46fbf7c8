"""Second proposals in the wavefront step: the sibling slot of each sequence (`Plan.second_loops` = d2).

See `state` for the slot and its KV invariant. Per cycle (`step`):

* the sibling runs in the core call as one more row per sequence (`SiblingRows`): it writes its KV into the
  sequence's private branch row `sib_k[layer, b * planes + plane]` and attends to the main table of its plane at
  positions below its own (the common history) plus that private row;
* verification (`step._verify`) judges a target whose next position has a sibling against both candidates
  (`chosen`: the committed token is the sibling's and the main draft was not kept; greedy, the target's argmax;
  sampling, `rules.second_candidate`, as the lane decoder); the sibling leaves its slot when its
  parent's target is committed or its sequence finishes, and when chosen it is `promote`d;
* after verification a main-path lane that has just reached d2 re-reads its draft (`reread`): its depth-d2 argmax,
  or a draw from its depth-d2 distribution (or `state.second_override`), is the position's second candidate, and
  starts a sibling when it differs from the draft after it (embedded through an entry stage with KV, Huginn's
  prelude, on the private row of the entry plane: `stages.sibling_embedder`).

As in the lane decoder (`generation.siblings`), a sibling counts in `second_drafts`, a verification that chooses it
in `accepted` and `second_accepted`, and a chosen sibling becomes a main-path lane that is not a draft.
"""

from __future__ import annotations

import torch

from ...ops.attention.slots import table_slot
from ...ops.attention.stored import stored
from .. import rules
from .state import Plan, WavefrontState, counts


class SiblingRows:
    """The sibling rows of one core call (the last B rows): the extra rows of its `SlotAttention`
    (`ops.attention.slots`); `plane`, `position`, `active`, each `[B]`."""

    def __init__(self, state: WavefrontState, plan: Plan, plane: torch.Tensor, position: torch.Tensor,
                 active: torch.Tensor):
        batch = len(position)
        self.active = active
        self.k_rows, self.v_rows = state.sib_k, state.sib_v
        self.table = torch.arange(batch, device=position.device) * plan.planes + plane.clamp(max=plan.planes - 1)
        self.write_row = torch.where(active, self.table, batch * plan.planes)  # [B]; the last row: masked
        span = torch.arange(plan.read_span, device=position.device)  # [S]
        below = span < position[:, None]  # [B, S] the common history: main-table positions before the sibling's
        self.visible = torch.cat([below, torch.ones_like(below[:, :1])], 1)[:, None, None]  # [B, 1, 1, S + 1]

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor,
               values: torch.Tensor, attend) -> torch.Tensor:
        """Write the rows' KV `k`, `v` `[B, Hkv, D]` into the private rows and attend with queries `q` `[B, Hq, D]`
        over the main tables `keys`, `values` `[B * planes, S, Hkv, D]` and the private rows: `[B, Hq, D]`."""
        k_rows, v_rows = self.k_rows[layer_idx], self.v_rows[layer_idx]  # [B * planes + 1, Hkv, D]
        k_rows.index_copy_(0, self.write_row, stored(k, k_rows.dtype))
        v_rows.index_copy_(0, self.write_row, stored(v, v_rows.dtype))
        own_keys = torch.cat([keys[self.table], k_rows[self.table][:, None]], 1)  # [B, S + 1, Hkv, D]
        own_values = torch.cat([values[self.table], v_rows[self.table][:, None]], 1)
        return attend(q.float()[:, :, None], own_keys, own_values, self.visible)[:, :, 0]  # [B, Hq, D]


def chosen(s: WavefrontState, order: torch.Tensor, top_r: torch.Tensor) -> torch.Tensor:
    """`[B, L]` by rank (`order` `[B, L]`: slot of rank r): the sibling sits at the position after rank r and holds
    rank r's chosen token `top_r`."""
    position_r = s.position.gather(1, order)  # [B, L]
    return s.sib_alive[:, None] & (s.sib_position[:, None] == position_r + 1) & (s.sib_token[:, None] == top_r)


def promote(plan: Plan, s: WavefrontState, promoted: torch.Tensor) -> torch.Tensor:
    """Make the sibling of each `promoted` `[B]` sequence its main lane at its position: it takes its slot (whose
    lane the caller has killed, with the main tables rolled back to the sibling's position), not a draft, and its
    private KV is copied into that position of the main tables of the planes it wrote (the other sequences' copies
    go to the trash slot). Returns the slots it took `[B, L]`."""
    batch, lanes = s.token.shape
    device = s.token.device
    slot = (torch.arange(lanes, device=device) == (s.sib_position % lanes)[:, None]) & promoted[:, None]  # [B, L]
    s.token = torch.where(slot, s.sib_token[:, None], s.token)
    s.position = torch.where(slot, s.sib_position[:, None], s.position)
    s.depth = torch.where(slot, s.sib_depth[:, None], s.depth)
    s.alive = s.alive | slot
    s.draft = s.draft & ~slot
    s.hidden = torch.where(slot[..., None], s.sib_hidden[:, None], s.hidden)
    planes = torch.arange(plan.planes, device=device)  # [planes]
    written = planes < s.sib_depth[:, None]  # [B, planes]: its core planes, and its entry plane (`stages`)
    if plan.layout.entry_plane is not None:
        written = written | (planes == plan.layout.entry_plane)
    written = promoted[:, None] & written
    table = torch.arange(batch, device=device)[:, None] * plan.planes + planes  # [B, planes]
    position = s.sib_position.clamp(0, plan.positions - 1)[:, None]
    pages = s.pages if s.pages.numel() else None
    dest = torch.where(written, table_slot(pages, plan.table_width, table, position), s.trash_slot).flatten()
    layers = s.sib_k.shape[0]
    dest = (torch.arange(layers, device=device)[:, None] * (s.k_pool.shape[0] // layers) + dest).flatten()  # per layer
    for pool, rows in ((s.k_pool, s.sib_k), (s.v_pool, s.sib_v)):
        pool.index_copy_(0, dest, rows[:, :-1].flatten(0, 1))  # pool: the flat [layers * pages * page_size, Hkv, D]
    s.kv_len = torch.where(written, s.sib_position[:, None] + 1, s.kv_len)
    return slot


def reread(plan: Plan, s: WavefrontState, rereader: torch.Tensor, top: torch.Tensor, probs: torch.Tensor | None,
           embed) -> None:
    """Second proposals: each `rereader` `[B, L]` (a lane that reached d2 in this cycle) still alive on the main path
    with a live unverified draft after it re-reads that draft: its depth-d2 proposal `top` `[B, L]` (the argmax, or a
    draw from `probs` `[B, L, V]` when sampling; or `state.second_override`, then a point mass) is the second
    candidate of the draft's position (`sib_read`, `sib_q`), and starts a sibling there when it differs from the
    draft's token, embedded by `embed(s, token, position, spawn)` (`stages.sibling_embedder`)."""
    lanes = s.token.shape[1]
    after = (s.position + 1) % lanes  # [B, L] the slot of the lane after each
    draft_after = (s.alive & s.draft).gather(1, after) & (s.position.gather(1, after) == s.position + 1)
    rereader = rereader & s.alive & ~s.finished[:, None] & draft_after & ~s.sib_read[:, None]  # [B, L]
    has = rereader.any(1)  # [B]
    position = torch.where(rereader, s.position, 0).amax(1) + 1  # [B]
    first = s.token.gather(1, (position % lanes)[:, None])[:, 0]  # [B] the draft's token
    forced = s.second_override.gather(1, position.clamp(max=plan.positions - 1)[:, None])[:, 0]
    proposed = torch.where(rereader, top, 0).amax(1)  # [B]
    if plan.host is not None:  # `second_draft_hook`, on the host (eager)
        forced = plan.host.second(has, position, first, torch.where(forced >= 0, forced, proposed), forced)
    token = torch.where(forced >= 0, forced, proposed)
    spawn = has & (token != first)  # [B]
    s.sib_token = torch.where(has, token, s.sib_token)
    s.sib_position = torch.where(has, position, s.sib_position)
    s.sib_read = s.sib_read | has
    if probs is not None:
        q = torch.where(rereader[..., None], probs, 0.0).sum(1)  # [B, V] (at most one re-reader per sequence)
        q = rules.proposal_q(q, token, forced >= 0)
        s.sib_q = torch.where(has[:, None], q, s.sib_q)
    s.sib_depth = torch.where(spawn, 0, s.sib_depth)
    s.sib_alive = s.sib_alive | spawn
    s.sib_hidden = torch.where(spawn[:, None], embed(s, token, position, spawn), s.sib_hidden)
    s.counters = s.counters + counts(s, second_drafts=spawn)
