"""Where a speculative run starts in a `PagedLoopCache`: empty, or after what earlier calls stored.

A cache returned by any run (plain or speculative) has consumed some input columns (`PagedLoopCache.columns`,
padding included) and stores, per sequence, the real tokens of those columns. A new call passes the whole
sequence (the earlier ids, then the new suffix) and its mask; the real tokens after the consumed columns enter
the lane decoder as prompt lanes, at positions after each sequence's stored ones (so prefix lengths per row may
differ). The result equals one uninterrupted plain call over the whole sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache.paged import PagedLoopCache
from ..looped import KVLayout


@dataclass(frozen=True)
class RowStart:
    stored: int  # positions the cache already holds for this sequence
    tokens: list[int]  # real tokens after the consumed columns: they enter as lanes at stored, stored + 1, ...


def run_planes(layout: KVLayout, num_loops: int, *draft_depths: int | None) -> list[int]:
    """Planes a run writes: every depth, the entry plane, and the exit planes of the target depth and of the depths
    drafts come from (`draft_depths`: d, and d2 with second proposals; None entries are ignored)."""
    planes = list(range(num_loops))
    if layout.entry_plane is not None:
        planes.append(layout.entry_plane)
    if layout.first_exit_plane is not None:
        planes += [layout.exit_plane(depth) for depth in sorted({num_loops, *draft_depths} - {None})]
    return planes


def start_rows(cache: PagedLoopCache, layout: KVLayout, num_loops: int, draft_depths: tuple[int, ...],
               input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[RowStart]:
    """Validate that `cache` holds the start of `input_ids` `[B, S]` and say where each sequence continues.

    `draft_depths` (empty without drafting): with a head that has KV, a history decoded without drafts from such a
    depth lacks its exit plane; it is filled from the target's (`PagedLoopCache.extend_plane_from`).
    """
    batch, width = input_ids.shape
    cache.check_layout(layout)
    cache.check_batch(batch, "input_ids")
    past = cache.columns()
    if past >= width:
        raise ValueError(f"input_ids has {width} columns, but the PagedLoopCache has already consumed {past}: pass "
                         "the whole sequence (the ids that filled the cache, then the new tokens).")
    for plane in run_planes(layout, num_loops, None):
        if cache.columns(plane) != past:
            raise ValueError(f"KV plane {plane} of the PagedLoopCache holds {cache.columns(plane)} columns, not "
                             f"{past}: continue a cache with the settings that filled it.")
    mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    cache.check_stored(mask)
    cache.ensure_sequences(batch)
    draft_planes = [layout.exit_plane(depth) for depth in draft_depths] if layout.first_exit_plane is not None else []
    for plane in draft_planes:
        if cache.columns(plane) < past:
            for s in range(batch):
                cache.extend_plane_from(s, plane, layout.exit_plane(num_loops))
            cache.set_columns(past, [plane])
    starts = [RowStart(cache.length(s, 0), input_ids[s, past:][mask[s, past:]].tolist()) for s in range(batch)]
    empty = [s for s, start in enumerate(starts) if not start.tokens]
    if empty:
        raise ValueError(f"rows {empty} have no real token (attention_mask 1) after the {past} columns the cache "
                         "has consumed: every row needs at least one new token to continue from.")
    return starts
