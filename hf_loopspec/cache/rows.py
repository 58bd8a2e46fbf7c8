"""Flat metadata of one core call: one entry per row, built once and shared by every layer of the call."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RowBatch:
    """The rows of one core call and where each reads and writes KV.

    A row is one token at one loop depth: it writes the KV of (sequence, depth, position) into `slot` and then
    attends to positions `0 .. context_len - 1` of the block table `table` (its own sequence, its own depth),
    which includes itself. All tensors live on the compute device.
    """

    seq: torch.Tensor  # [N] int64   sequence slot in the cache
    depth: torch.Tensor  # [N] int64   loop depth = KV plane the row writes and reads
    position: torch.Tensor  # [N] int64   token position (also the rotary position)
    table: torch.Tensor  # [N] int32   block-table row of (seq, depth)
    slot: torch.Tensor  # [N] int64   flat write slot: page * page_size + offset
    context_len: torch.Tensor  # [N] int32   position + 1
    block_tables: torch.Tensor  # [num_tables, max_pages] int32  page ids of every table
    lineage: tuple[int, ...] | None = None  # debug only: the lane id of each row (see PagedLoopCache)

    @property
    def num_rows(self) -> int:
        return self.seq.shape[0]
