"""Where each sequence of a wavefront run starts: at position 0 on an empty `PagedLoopCache`, or after the history
an earlier call stored (a continued conversation), by the lane decoder's rules (`generation.history.start_rows`:
the ids are the whole sequence, the real tokens after the columns the cache has consumed are new).

The engine reads and writes each (sequence, plane) table as one contiguous run of the pool, laid out in table order
from page 0 (`PagedLoopCache.reserve_in_order`); a filled cache has its own page order, so set-up moves the stored
history into that layout, one device copy per pool (`PagedLoopCache.repack_in_order`). The new tokens then run as
the run's prompt rows from position `stored` on (`WavefrontState.prompt_start`), their last one as a lane, and the
run leaves the cache as the lane decoder does: every plane holds the whole sequence but its last column.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...cache.paged import PagedLoopCache
from ..history import run_planes, start_rows


@dataclass(frozen=True)
class Start:
    """The start of every sequence of one run."""

    stored: torch.Tensor  # [B] int64: positions the cache holds for the sequence before the run
    held: torch.Tensor  # [B, planes] int64: positions each KV plane holds before the run (`stored` in the run's
    # planes; a plane the run does not write keeps what it holds)
    tokens: list[torch.Tensor]  # per sequence, its tokens to run `[n_b]` (n_b >= 1, or 0 for an all-padding prompt)

    @property
    def new(self) -> torch.Tensor:
        """`[B]` int64: the tokens each sequence runs."""
        return torch.tensor([len(t) for t in self.tokens], dtype=torch.long, device=self.stored.device)

    @property
    def rows(self) -> int:
        """P: prompt rows per sequence (every token to run but a sequence's last, which is a lane)."""
        return max([len(t) - 1 for t in self.tokens], default=0)


def start_of(cache: PagedLoopCache, model, input_ids: torch.Tensor, mask: torch.Tensor, draft_loops: int,
             second_loops: int | None = None) -> Start:
    """The `Start` of a run of `model` over `input_ids` `[B, S]` with padding `mask` `[B, S]` bool on `cache`,
    drafting from depth `draft_loops` (0: no drafts) and `second_loops` (second proposals; None: none): on an empty
    cache every real token runs; on a filled one
    `start_rows` validates that the cache holds the start of the ids (the `ValueError`s of the lane decoder), fills
    a draft exit plane that a history decoded without drafts lacks (a head with KV, Huginn's), and says which tokens
    are new."""
    device = input_ids.device
    if not cache.num_sequences:
        return Start(torch.zeros(len(input_ids), dtype=torch.long, device=device),
                     torch.zeros(len(input_ids), cache.num_planes, dtype=torch.long, device=device),
                     [row[keep] for row, keep in zip(input_ids, mask)])
    depths = tuple(depth for depth in (draft_loops or None, second_loops) if depth is not None)
    rows = start_rows(cache, model.kv_layout, model.num_loops, depths, input_ids, mask)
    planes = run_planes(model.kv_layout, model.num_loops, *depths)
    for s, row in enumerate(rows):  # the run reads every plane it writes up to `stored`
        held = sorted({cache.length(s, plane) for plane in planes})
        if held != [row.stored]:
            raise ValueError(f"sequence {s} of the PagedLoopCache holds {held} positions in its KV planes, not "
                             f"{row.stored} in each: continue a cache that a generate call filled, or a fresh one.")
    held = [[cache.length(s, plane) for plane in range(cache.num_planes)] for s in range(len(rows))]
    return Start(torch.tensor([r.stored for r in rows], dtype=torch.long, device=device),
                 torch.tensor(held, dtype=torch.long, device=device),
                 [torch.tensor(r.tokens, dtype=input_ids.dtype, device=device) for r in rows])
