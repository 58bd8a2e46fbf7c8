"""Entry and exit stages with KV of their own in the wavefront step: a model whose entry stage attends (Huginn's
prelude: `KVLayout.entry_plane`) or whose head attends (Huginn's coda: `KVLayout.exit_plane(depth)`), run as the
lane decoder runs them (`decoder._embed_new_lanes`, its head calls with exit rows).

* Entry: every token is embedded once, through the entry plane (it writes its KV at its position there and reads
  positions 0..position): the prompt at set-up and the tokens completing the cache as rows (`embed_rows`), each
  cycle's spawned lanes as one row per sequence (`spawn_embedder`), a sibling (second proposals) as one row per
  sequence on its private KV rows (`sibling_embedder`: `sibling.promote` copies its entry row with the others).
* Exit: every lane slot and prompt row that has just reached an exit depth in use (`exit_depths`: U, d when
  drafting, d2 with second proposals) runs the head with that depth's exit plane, its logits needed or not, so every
  exit plane holds every position, the prompt's too (`exit_logits`). The step reads its head scores from these
  logits. A sibling never runs the head as a sibling (it is decided by the time it is d loops deep); chosen at depth
  d, it runs it at once as a main lane.

Both are calls of `SlotAttention` over the state's pools (another plane than the core's), so rollbacks truncate the
stage planes with the others (`kv_len`, I4), and nothing here reads the device state on the host. Random loop-0
inputs (Huginn's initial states) come from `WavefrontState.init_states`, drawn at set-up (`initial_states`), and the
layout from `Plan.layout`: the step reads no per-call settings of the model, so it compiles whole.

Ouro-like models (no stage KV) keep the step's plain embedding lookup and head (`has_stage_kv`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...looped import draws_initial_states
from ...ops.attention.slots import SlotAttention, SlotLayout
from .sibling import SiblingRows
from .state import Plan, WavefrontState


def has_stage_kv(model) -> bool:
    """Whether `model`'s entry or exit stage writes KV of its own."""
    layout = model.kv_layout
    return layout.entry_plane is not None or layout.first_exit_plane is not None


def embeds_by_lookup(model) -> bool:
    """Whether a token's loop-0 input is its row of the embedding table (Ouro): no stage KV and no initial states
    of the model's own (Huginn's, joined to the scaled embedding, or its prelude's output, even without stage KV
    when it has no prelude or no coda). Otherwise `model.embed` makes it (`embed_rows`, `spawn_embedder`)."""
    return not has_stage_kv(model) and not draws_initial_states(model)


def exit_depths(plan: Plan) -> tuple[int, ...]:
    """The depths at which lanes and prompt rows run the head: U, d when drafting, d2 with second proposals (the
    lane decoder's `policies.exit_depths`)."""
    drafts = () if plan.mode == "ar" else (plan.draft_loops,)
    return (plan.num_loops, *drafts, *(() if plan.second_loops is None else (plan.second_loops,)))


def step_settings(model):
    """The model's per-call settings that shape a step (`looped`: `step_settings()`; Huginn's recurrence steps and
    init scale), or None: `Plan.step_settings`."""
    settings = getattr(model, "step_settings", None)
    return None if settings is None else settings()


def initial_states(model, batch: int, positions: int, like: torch.Tensor) -> torch.Tensor:
    """`WavefrontState.init_states` `[B, C, W]`: the random loop-0 inputs of every position of every sequence under
    the call's settings, for a model that has them (`looped`: `initial_states`), else `[B, 0, 0]`. Set-up, on the
    host: the step only gathers from them."""
    if not draws_initial_states(model):
        return like.new_zeros(batch, 0, 0)
    grid = torch.arange(batch, device=like.device)[:, None].expand(batch, positions)  # [B, C]
    return model.initial_states(grid, torch.arange(positions, device=like.device).expand(batch, positions)).to(like)


def _embed(model, s: WavefrontState, plan: Plan, token: torch.Tensor, position: torch.Tensor, sequence: torch.Tensor,
           attention) -> torch.Tensor:
    """`model.embed` of `token` at `position` of batch rows `sequence` (each `[*rows]`), with their initial states from
    `s.init_states` when the model has them."""
    if not s.init_states.shape[1]:
        return model.embed(token, position, sequence, attention)
    return model.embed(token, position, sequence, attention,
                       initial=s.init_states[sequence, position.clamp(0, plan.positions - 1)])


def raise_lengths(s: WavefrontState, plan: Plan, planes: torch.Tensor, ends: torch.Tensor) -> None:
    """Raise `s.kv_len` `[B, planes]` to the rows' ends: row (b, i) wrote plane `planes[b, i]` up to position
    `ends[b, i]` - 1 (`ends` 0: it wrote nothing). `planes`, `ends`: `[B, M]`."""
    hit = planes.clamp(max=plan.planes - 1)[..., None] == torch.arange(plan.planes, device=planes.device)
    s.kv_len = torch.maximum(s.kv_len, torch.where(hit, ends[..., None], 0).amax(1))  # hit: [B, M, planes]


def _attention(model, s: WavefrontState, plan: Plan, lanes: tuple, prompts: tuple, span: int,
               extra: SiblingRows | None = None) -> SlotAttention:
    """A `SlotAttention` over the state's pools for one stage call of `model` (`lanes`, `prompts`, `extra` as it takes
    them, reading `span` positions)."""
    layout = SlotLayout(plan.layout.num_layers, plan.planes, plan.table_width, plan.positions, span,
                        cells=plan.lanes if plan.mode == "block" and lanes[1].shape[1] == plan.lanes else 1)
    return SlotAttention(s.k_pool, s.v_pool, s.trash_slot, layout, lanes, prompts, extra, pages=s.pages)


def _no_lanes(batch: int, device: torch.device) -> tuple:
    """One inactive lane row per sequence (the stage calls of prompt-like rows have no lane rows)."""
    zero = torch.zeros(batch, 1, dtype=torch.long, device=device)
    return zero, zero, zero.bool()


def embed_rows(model, plan: Plan, s: WavefrontState, tokens: torch.Tensor, start: torch.Tensor,
               real: torch.Tensor) -> torch.Tensor:
    """The loop-0 inputs `[B, F, H]` of `tokens` `[B, F]` at positions `start[b] + i` (`start` `[B]`); the `real`
    `[B, F]` rows (a prefix of each sequence's) write their entry-plane KV, and raise its `kv_len`. Set-up and
    cache completion: not part of the compiled step."""
    batch, width = tokens.shape
    device = tokens.device
    positions = start[:, None] + torch.arange(width, device=device)  # [B, F]
    entry = plan.layout.entry_plane
    attention = None
    if entry is not None:
        plane = torch.full((batch,), entry, dtype=torch.long, device=device)
        attention = _attention(model, s, plan, _no_lanes(batch, device), (plane, positions, real), plan.positions)
        raise_lengths(s, plan, plane[:, None], torch.where(real, positions + 1, 0).amax(1, keepdim=True))
    sequences = torch.arange(batch, device=device)
    rows = _embed(model, s, plan, torch.cat([tokens[:, :1].flatten() * 0, tokens.flatten()]),
                  torch.cat([start, positions.flatten()]), torch.cat([sequences, sequences.repeat_interleave(width)]),
                  attention)  # [B + B*F, H]
    return rows[batch:].view(batch, width, -1)


def _lookup(model) -> Callable | None:
    """`embed(s, token, position, spawn) -> [B, H]` as the embedding lookup, for a model whose loop-0 inputs are
    embedding rows (`embeds_by_lookup`); None for any other. The table is the model's at each call, not at the
    step's making: a compiled step kept beside the model (`compiling`) must see a replaced embedding (dynamo guards
    the module it reads, and compiles again for another)."""
    if not embeds_by_lookup(model):
        return None
    return lambda s, token, position, spawn: model.get_input_embeddings()(token)


def spawn_embedder(model, plan: Plan) -> Callable:
    """`embed(s, token, position, spawn) -> [B, H]`: the loop-0 inputs of the lanes spawned in a cycle (`token`,
    `position`, `spawn`: `[B]`, one candidate row per sequence). The embedding lookup where that is the loop-0
    input (`embeds_by_lookup`), else `model.embed`, through the entry plane when it has one (only the `spawn` rows
    write it)."""
    lookup = _lookup(model)
    if lookup is not None:
        return lookup
    entry = plan.layout.entry_plane

    def embed(s: WavefrontState, token: torch.Tensor, position: torch.Tensor, spawn: torch.Tensor) -> torch.Tensor:
        batch, device = len(token), token.device
        attention = None
        if entry is not None:  # a spawned lane sits one past the newest lane: the span of the cycle plus one
            plane = torch.full((batch, 1), entry, dtype=torch.long, device=device)
            none = torch.zeros(batch, 0, dtype=torch.long, device=device)
            attention = _attention(model, s, plan, (plane, position[:, None], spawn[:, None]), (plane[:, 0], none,
                                   none.bool()), min(plan.read_span + 1, plan.positions))
            raise_lengths(s, plan, plane, torch.where(spawn, position + 1, 0)[:, None])
        return _embed(model, s, plan, token, position, torch.arange(batch, device=device), attention)

    return embed


def sibling_embedder(model, plan: Plan) -> Callable:
    """`embed(s, token, position, spawn) -> [B, H]`: the loop-0 inputs of the siblings spawned in a cycle (`token`,
    `position`, `spawn`: `[B]`, one row per sequence). With stage KV, `model.embed` through the entry plane on the
    sibling's private rows (`sibling.SiblingRows`: only the `spawn` rows write them; the main entry table is read
    below `position`), else the embedding lookup."""
    lookup = _lookup(model)
    if lookup is not None:
        return lookup
    entry = plan.layout.entry_plane

    def embed(s: WavefrontState, token: torch.Tensor, position: torch.Tensor, spawn: torch.Tensor) -> torch.Tensor:
        batch, device = len(token), token.device
        sequences = torch.arange(batch, device=device)
        if entry is None:
            return _embed(model, s, plan, token, position, sequences, None)
        plane = torch.full((batch,), entry, dtype=torch.long, device=device)
        none = torch.zeros(batch, 0, dtype=torch.long, device=device)
        # a sibling sits at a live lane's position: inside the cycle's span. Its B rows follow B masked lane rows
        attention = _attention(model, s, plan, _no_lanes(batch, device), (plane, none, none.bool()), plan.read_span,
                               SiblingRows(s, plan, plane, position, spawn))
        rows = _embed(model, s, plan, token.repeat(2), position.repeat(2), sequences.repeat(2), attention)
        return rows[batch:]  # [B, H]

    return embed


def exit_logits(model, plan: Plan, s: WavefrontState, ran: torch.Tensor, prompt_rows: torch.Tensor) -> torch.Tensor:
    """The head's fp32 logits `[B, L, V]` of every lane slot, after a core call in which the lanes `ran` `[B, L]`
    and the prompt rows `prompt_rows` `[B, P]` ran (`s.depth`, `s.prompt_depth`: already advanced). The lanes and
    prompt rows that have just reached an exit depth write and read its exit plane; the other rows are masked (their
    logits are unused)."""
    layout = plan.layout
    batch, lanes = s.token.shape
    device = s.token.device
    depths = torch.tensor(exit_depths(plan), device=device)
    lane_exit = ran & torch.isin(s.depth, depths)  # [B, L]
    prompt_exit = prompt_rows & torch.isin(s.prompt_depth, depths)[:, None]  # [B, P]
    plane = layout.first_exit_plane - 1 + s.depth.clamp(min=1)  # [B, L]
    prompt_plane = layout.first_exit_plane - 1 + s.prompt_depth.clamp(min=1)  # [B]
    prompt_position = s.prompt_start[:, None] + torch.arange(prompt_rows.shape[1], device=device)  # [B, P]
    attention = _attention(model, s, plan, (plane, s.position, lane_exit), (prompt_plane, prompt_position, prompt_exit),
                           plan.read_span)
    raise_lengths(s, plan, torch.cat([plane, prompt_plane[:, None].expand_as(prompt_position)], 1),
                  torch.cat([torch.where(lane_exit, s.position + 1, 0), torch.where(prompt_exit, prompt_position + 1,
                                                                                      0)], 1))
    hidden = torch.cat([s.hidden.flatten(0, 1), s.prompt_hidden.flatten(0, 1)])  # [B*L + B*P, H]
    position = torch.cat([s.position.flatten(), prompt_position.flatten()])
    if plan.compact:  # the exiting rows only (CPU eager, as the core call: `step`)
        rows = attention.compact()  # [n]
        exiting = model.head(hidden[rows], position[rows], attention)  # [n, V]
        s.head_rows = s.head_rows + len(rows)
        logits = exiting.new_zeros(len(hidden), exiting.shape[-1]).index_copy(0, rows, exiting)
    else:
        logits = model.head(hidden, position, attention)  # [B*L + B*P, V]
    return logits[: batch * lanes].view(batch, lanes, -1)
