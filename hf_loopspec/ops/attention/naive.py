"""Paged attention, written to be read: one query row at a time, each gathering its own positions from the pages.
The reference that the vectorised PyTorch path (`torch_paged.py`) and the Triton kernels (`triton_paged.py`) are
tested against; too slow to decode with.

Pool layout: `k_cache` and `v_cache` are `[num_pages, page_size, Hkv, D]`; position `j` of block table `t` lives
at page `block_tables[t, j // page_size]`, offset `j % page_size` (flat slot `page * page_size + offset`).
"""

from __future__ import annotations

import torch


def naive_write_kv(
    k: torch.Tensor,  # [N, Hkv, D]
    v: torch.Tensor,  # [N, Hkv, D]
    k_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    slots: torch.Tensor,  # [N] flat slots; < 0 marks an inactive row
) -> None:
    """Store row `n`'s key and value at flat slot `slots[n]`; rows with a negative slot write nothing."""
    page_size = k_cache.shape[1]
    for n, slot in enumerate(slots.tolist()):
        if slot >= 0:
            k_cache[slot // page_size, slot % page_size] = k[n]
            v_cache[slot // page_size, slot % page_size] = v[n]


def naive_paged_attention(
    q: torch.Tensor,  # [N, Hq, D]
    k_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    block_tables: torch.Tensor,  # [T, max_pages]
    table_ids: torch.Tensor,  # [N]
    context_lens: torch.Tensor,  # [N]; 0 marks an inactive row
    scale: float,
) -> torch.Tensor:
    """Row `n` attends to positions `0 .. context_lens[n] - 1` of block table `table_ids[n]`; query head `h`
    reads KV head `h // (Hq // Hkv)`. Computed in the dtype of `q` (pass float64 tensors for an oracle);
    returns `[N, Hq, D]` in `q.dtype`, zeros for inactive rows. Reads no slot past a row's context."""
    page_size, group = k_cache.shape[1], q.shape[1] // k_cache.shape[2]
    out = torch.zeros_like(q)
    for n, (table, context) in enumerate(zip(table_ids.tolist(), context_lens.tolist())):
        if context == 0:
            continue
        positions = torch.arange(context)  # [C]
        pages = block_tables[table, positions // page_size].long()  # [C]
        keys = k_cache[pages, positions % page_size].to(q.dtype)  # [C, Hkv, D]
        values = v_cache[pages, positions % page_size].to(q.dtype)
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)  # [C, Hq, D]
        scores = torch.einsum("hd,chd->hc", q[n], keys) * scale  # [Hq, C]
        out[n] = torch.einsum("hc,chd->hd", scores.softmax(-1), values)  # [Hq, D]
    return out
