"""Paged attention in vectorised PyTorch: the production path on CPU (and wherever the Triton kernels do not run).
The readable per-row reference is `naive.py`; both follow the contracts of `hf_loopspec.ops.attention`.

Layout of one layer's page pool: `k_cache` and `v_cache` are `[num_pages, page_size, Hkv, D]`. Position `j` of
block table `t` lives at page `block_tables[t, j // page_size]`, offset `j % page_size`; its flat slot is
`page * page_size + offset`.

`paged_attention_torch` is vectorised over rows rather than looping over them. Rows that read the same table
(a prefill chunk, a verification block) share one gather of that table's keys and values:

1. group the active rows by table id into a `[tables, rows per table]` grid (`_TableGrid`);
2. gather each table's keys and values once, up to the longest context among its rows;
3. run one batched attention over the grid in fp32, masking every position at or past a row's context;
4. read each row's output back out of the grid.

Steps 2-3 run per chunk of tables with similar row counts (`_table_chunks`), so that a prefill chunk does not
pad the single decode rows of other tables to its length, and one gather stays bounded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .stored import stored

_GATHER_BYTES = 16 * 2**20  # budget for the keys gathered for one chunk of tables (counted in fp32)


def write_kv_torch(
    k: torch.Tensor,  # [N, Hkv, D]
    v: torch.Tensor,  # [N, Hkv, D]
    k_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    slots: torch.Tensor,  # [N] int64; < 0 marks an inactive row
) -> None:
    """Scatter row `n`'s key and value (`stored`) into flat slot `slots[n]` of the pools, skipping rows with a negative
    slot."""
    active = slots >= 0  # [N]
    slots = slots[active]  # [n_active]
    page_size = k_cache.shape[1]
    k_cache[slots // page_size, slots % page_size] = stored(k[active], k_cache.dtype)
    v_cache[slots // page_size, slots % page_size] = stored(v[active], v_cache.dtype)


def paged_attention_torch(
    q: torch.Tensor,  # [N, Hq, D]
    k_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    block_tables: torch.Tensor,  # [T, max_pages] int32
    table_ids: torch.Tensor,  # [N] int
    context_lens: torch.Tensor,  # [N] int; 0 marks an inactive row
    scale: float,
) -> torch.Tensor:
    """Row `n` attends to positions `0 .. context_lens[n] - 1` of block table `table_ids[n]`.

    Query head `h` reads KV head `h // (Hq // Hkv)`. Scores and softmax are computed in fp32; the result is
    `[N, Hq, D]` in `q.dtype`, zeros for inactive rows. Inactive rows touch no block table.

    Only slots below the longest context among a table's rows in this call are read. Those hold real KV (the
    longest row attends to all of them), finite as every write stores it (`stored`: a shorter row of the table masks
    the later ones, and a masked inf or NaN would still reach its output), so garbage or NaN anywhere else in the
    pool cannot reach an output.
    """
    if len(q) == 0 or not bool(context_lens.all()):
        return _attend_active_rows(q, k_cache, v_cache, block_tables, table_ids, context_lens, scale)

    grid = _TableGrid.of(table_ids)
    queries = grid.scatter(q.float())  # [T_used, R, Hq, D]
    grid_lens = grid.scatter(context_lens)  # [T_used, R]; 0 where no row sits
    table_lens = grid_lens.amax(1)  # [T_used] longest context among each table's rows
    out = torch.empty_like(queries)  # [T_used, R, Hq, D]; cells without a row stay unwritten
    for chunk in _table_chunks(grid.table_rows, table_lens.tolist(), k_cache.shape[2] * k_cache.shape[3]):
        rows = grid.table_rows[chunk.start]  # the chunk's tables have at most this many rows
        lens = grid_lens[chunk, :rows]  # [T_chunk, rows]
        keys, values = _gather_tables(k_cache, v_cache, block_tables, grid.tables[chunk], table_lens[chunk])
        out[chunk, :rows] = _grid_attention(queries[chunk, :rows], keys, values, lens, scale)
    return grid.gather(out).to(q.dtype)


def _attend_active_rows(q, k_cache, v_cache, block_tables, table_ids, context_lens, scale) -> torch.Tensor:
    """`paged_attention_torch` over the rows with a context; inactive rows get zeros and read no table."""
    out = torch.zeros_like(q)  # [N, Hq, D]
    active = context_lens.nonzero().squeeze(1)  # [n_active]
    if len(active):
        out[active] = paged_attention_torch(
            q[active], k_cache, v_cache, block_tables, table_ids[active], context_lens[active], scale
        )
    return out


@dataclass
class _TableGrid:
    """Rows laid out in a `[T_used, R]` grid: one grid row per distinct table, `R` = most rows of one table.

    Grid rows are ordered by their table's row count, most first. Row `n` sits at `(row_table[n], row_slot[n])`,
    where `row_slot[n]` counts the earlier rows of the call that read the same table. When every row reads its
    own table (a decode call) the placement is the identity (row `n` at `(n, 0)`) and `row_table`, `row_slot`
    are None.
    """

    tables: torch.Tensor  # [T_used] table id of each grid row
    row_table: torch.Tensor | None  # [N]
    row_slot: torch.Tensor | None  # [N]
    table_rows: list[int]  # [T_used] rows of each grid row's table, non-increasing

    @classmethod
    def of(cls, table_ids: torch.Tensor) -> _TableGrid:  # table_ids: [N]
        tables, row_table, counts = torch.unique(table_ids, return_inverse=True, return_counts=True)
        if len(tables) == len(table_ids):
            return cls(table_ids, None, None, [1] * len(table_ids))
        by_rows = torch.argsort(counts, descending=True, stable=True)  # [T_used] grid row -> distinct table
        grid_row = torch.empty_like(by_rows)  # [T_used] distinct table -> grid row
        grid_row[by_rows] = torch.arange(len(by_rows), device=by_rows.device)
        tables, row_table, counts = tables[by_rows], grid_row[row_table], counts[by_rows]

        order = torch.argsort(row_table, stable=True)  # [N] rows sorted by grid row, call order kept within one
        first = counts.cumsum(0) - counts  # [T_used] where each grid row's rows start in `order`
        row_slot = torch.empty_like(row_table)
        row_slot[order] = torch.arange(len(order), device=order.device) - first[row_table[order]]
        return cls(tables, row_table, row_slot, counts.tolist())

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        """`[N, ...]` -> `[T_used, R, ...]`, zeros in the cells where no row sits."""
        if self.row_table is None:
            return values[:, None]
        grid = values.new_zeros(len(self.tables), self.table_rows[0], *values.shape[1:])
        grid[self.row_table, self.row_slot] = values
        return grid

    def gather(self, grid: torch.Tensor) -> torch.Tensor:
        """`[T_used, R, ...]` -> `[N, ...]`."""
        if self.row_table is None:
            return grid[:, 0]
        return grid[self.row_table, self.row_slot]


def _table_chunks(table_rows: list[int], table_lens: list[int], kv_width: int) -> list[slice]:
    """Split the grid rows (ordered by row count, most first) into runs that are attended together.

    A run holds tables whose row counts round up to the same power of two, so that few grid cells are padding,
    and whose gathered keys (`tables * longest context * kv_width` fp32 values) fit in `_GATHER_BYTES`. The
    bound keeps a call over many long tables from gathering them all at once: one huge gather costs more per
    byte (it is served by fresh memory pages) than a few moderate ones.
    """
    chunks, start, longest = [], 0, 0
    for t, (rows, length) in enumerate(zip(table_rows, table_lens)):
        longest = max(longest, length)
        new_bucket = (rows - 1).bit_length() != (table_rows[start] - 1).bit_length()
        if t > start and (new_bucket or (t - start + 1) * longest * kv_width * 4 > _GATHER_BYTES):
            chunks.append(slice(start, t))
            start, longest = t, length
    chunks.append(slice(start, len(table_rows)))
    return chunks


def _gather_tables(
    k_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    block_tables: torch.Tensor,  # [T, max_pages]
    tables: torch.Tensor,  # [T_chunk] ids of the tables to gather
    table_lens: torch.Tensor,  # [T_chunk] >= 1: how many positions of each table are read
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of positions `0 .. C - 1` of each table, `C = max(table_lens)`: two `[T_chunk, C, Hkv, D]`.

    Positions at or past a table's own length repeat its last position, so only written slots are read (the
    attention mask hides the copies).
    """
    page_size = k_cache.shape[1]
    positions = torch.arange(int(table_lens.max()), device=tables.device)  # [C]
    positions = torch.minimum(positions, table_lens[:, None] - 1)  # [T_chunk, C]
    pages = block_tables[tables[:, None], positions // page_size]  # [T_chunk, C]
    slots = (pages * page_size + positions % page_size).flatten()  # [T_chunk * C] int64
    shape = (*positions.shape, *k_cache.shape[2:])
    keys = k_cache.flatten(0, 1).index_select(0, slots).view(shape)
    values = v_cache.flatten(0, 1).index_select(0, slots).view(shape)
    return keys, values


def _grid_attention(
    queries: torch.Tensor,  # [T, R, Hq, D] fp32
    keys: torch.Tensor,  # [T, C, Hkv, D]
    values: torch.Tensor,  # [T, C, Hkv, D]
    grid_lens: torch.Tensor,  # [T, R] context length of each grid cell; 0 for cells without a row
    scale: float,
) -> torch.Tensor:
    """Masked fp32 attention of every grid cell over its table's first `grid_lens` positions: `[T, R, Hq, D]`.

    Cells without a row are fully masked; their output is never read.
    """
    visible = torch.arange(keys.shape[1], device=keys.device) < grid_lens[..., None]  # [T, R, C]
    out = F.scaled_dot_product_attention(
        queries.transpose(1, 2),  # [T, Hq, R, D]
        keys.transpose(1, 2).float(),  # [T, Hkv, C, D]
        values.transpose(1, 2).float(),
        attn_mask=visible[:, None],  # [T, 1, R, C]
        scale=scale,
        enable_gqa=True,
    )  # [T, Hq, R, D]
    return out.transpose(1, 2)
