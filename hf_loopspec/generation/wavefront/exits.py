"""Exit options in the wavefront step (`Plan.exit_rule`: the call's `decoder.ExitRule`, e.g. Ouro's `exit_at_step`,
`exit_threshold`, `use_weighted_exit`), as the lane decoder has them: a target's logits come from the rule over its
lane's outputs after every loop; drafts (depth d, and depth d2 with second proposals) keep the head's logits.

With a rule, the state keeps every lane slot's output after each loop it ran (`WavefrontState.loop_states`
`[B, L, U, H]`: entry k after loop k + 1), written in the core call (`record`), so a lane that reaches depth U has
its U outputs in its slot (a spawned lane overwrites its slot's entries loop by loop before it is read). The sibling
slot keeps its own (`sib_states` `[B, U, H]`), which a chosen sibling carries into the slot it takes (`promote`).
Without a rule both have U = 0 entries and nothing here runs.
"""

from __future__ import annotations

import torch

from .state import Plan, WavefrontState


def empty_records(plan: Plan, batch: int, hidden: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroed `loop_states` `[B, L, U, H]` and `sib_states` `[B, U, H]` (H = `hidden`; U = 0 without an exit rule)
    in the dtype and on the device of `like`."""
    loops = plan.num_loops if plan.exit_rule is not None else 0
    return like.new_zeros(batch, plan.lanes, loops, hidden), like.new_zeros(batch, loops, hidden)


def record(s: WavefrontState, ran: torch.Tensor, out: torch.Tensor, sib_ran: torch.Tensor | None,
           sib_out: torch.Tensor | None) -> None:
    """Keep the outputs `out` `[B, L, H]` of the lane slots that `ran` `[B, L]` at entry `depth` (their depth before
    this loop) of `loop_states`; likewise the sibling's `sib_out` `[B, H]` where `sib_ran` `[B]` (None: no sibling
    rows)."""
    loops = torch.arange(s.loop_states.shape[2], device=ran.device)  # [U]
    entry = ran[..., None] & (s.depth[..., None] == loops)  # [B, L, U]
    s.loop_states = torch.where(entry[..., None], out[:, :, None], s.loop_states)
    if sib_out is not None:
        entry = sib_ran[:, None] & (s.sib_depth[:, None] == loops)  # [B, U]
        s.sib_states = torch.where(entry[..., None], sib_out[:, None], s.sib_states)


def promote(s: WavefrontState, taken: torch.Tensor) -> None:
    """A chosen sibling's outputs follow it into the lane slot it took (`taken` `[B, L]`, `sibling.promote`)."""
    s.loop_states = torch.where(taken[..., None, None], s.sib_states[:, None], s.loop_states)


def target_scores(plan: Plan, s: WavefrontState, slots: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """The head's logits `scores` `[B, R, V]` of the lane slots `slots` `[B, R]` (`step.head_slots`), with the exit
    rule's logits in place of those of every slot at depth U (a target). When every slot is a column (block mode,
    and pipeline modes with as many lanes as head columns, U / d = 2 or 3 with second proposals), the columns are the
    slots in order and the rule runs on each; otherwise `head_slots` puts the one running slot per sequence at
    depth U in column 0 (the others are at depth d or d2, or another column's slot again), so the rule runs on
    column 0 only and its logits serve every column at depth U."""
    targets = slots if slots.shape[1] == plan.lanes else slots[:, :1]  # [B, T]
    batch, count = targets.shape
    records = s.loop_states.gather(1, targets[..., None, None].expand(-1, -1, *s.loop_states.shape[2:]))  # [B, T, U, H]
    flat = records.flatten(0, 1)  # [B * T, U, H]
    logits = plan.exit_rule([flat[:, k] for k in range(plan.num_loops)]).float().view(batch, count, -1)  # [B, T, V]
    at_target = s.depth.gather(1, slots) == plan.num_loops  # [B, R]
    return torch.where(at_target[..., None], logits, scores)
