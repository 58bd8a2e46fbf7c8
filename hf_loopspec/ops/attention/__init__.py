"""Paged attention over one layer's page pool: `write_kv` and `paged_attention`.

Each public function dispatches to the Triton kernel (`triton_paged.py`) when the tensors are on CUDA and
triton imports, or when the kernels were built for Triton's CPU interpreter (`TRITON_INTERPRET=1` set before
this package is imported; bf16 then still takes the PyTorch path, which the interpreter mishandles). Everywhere
else, in particular on CPU, the vectorised PyTorch path (`torch_paged.py`) runs. `naive.py` holds the readable
per-row reference (`naive_paged_attention`, `naive_write_kv`) that both are tested against.

`slots.py` holds the wavefront engine's attention (`SlotAttention`, over tables laid out in order in flat pools,
without block tables), tested against `naive.naive_slot_attention`.

Pool layout: `k_cache` and `v_cache` are `[num_pages, page_size, Hkv, D]`; position `j` of block table `t`
lives at page `block_tables[t, j // page_size]`, offset `j % page_size`, flat slot `page * page_size + offset`.
"""

from __future__ import annotations

import torch

from .naive import naive_paged_attention, naive_slot_attention, naive_write_kv
from .torch_paged import paged_attention_torch, write_kv_torch

try:
    from .triton_paged import INTERPRETED, paged_attention_triton, write_kv_triton
except ImportError:  # triton is optional
    INTERPRETED, paged_attention_triton, write_kv_triton = False, None, None

__all__ = ["naive_paged_attention", "naive_slot_attention", "naive_write_kv", "paged_attention",
           "paged_attention_torch", "write_kv", "write_kv_torch"]


def write_kv(
    k: torch.Tensor,  # [N, Hkv, D]
    v: torch.Tensor,  # [N, Hkv, D]
    k_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D], same dtype as k
    v_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    slots: torch.Tensor,  # [N] int64: page_id * page_size + offset; < 0 means "inactive row: write nothing"
) -> None:
    """Scatter new keys and values (one entry per row) into one layer's page pool."""
    backend = write_kv_triton if _use_triton(k) else write_kv_torch
    backend(k, v, k_cache, v_cache, slots)


def paged_attention(
    q: torch.Tensor,  # [N, Hq, D], Hq % Hkv == 0
    k_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    block_tables: torch.Tensor,  # [T, max_pages] int32; entries past a table's length are arbitrary
    table_ids: torch.Tensor,  # [N] int32/int64: the table row n reads
    context_lens: torch.Tensor,  # [N] int32/int64; 0 means an inactive row
    scale: float,  # usually D ** -0.5
) -> torch.Tensor:
    """Each query row attends to the first `context_lens[n]` positions of its own block table.

    Rows of one call may mix tables, depths and positions: single decode rows, and runs of consecutive
    positions of one table (prefill chunks, block verification) where row `i` of the run has
    `context_lens = start + i + 1` (every row has already written its own KV). Query head `h` reads KV head
    `h // (Hq // Hkv)`. Pool slots past the longest context among a table's rows are never read, so unused
    pool memory may hold garbage or NaN.

    Returns `[N, Hq, D]` in `q.dtype` (zeros for inactive rows); scores and softmax accumulate in fp32.
    """
    backend = paged_attention_triton if _use_triton(q) else paged_attention_torch
    return backend(q, k_cache, v_cache, block_tables, table_ids, context_lens, scale)


def _use_triton(x: torch.Tensor) -> bool:
    if paged_attention_triton is None:
        return False
    return x.is_cuda or (INTERPRETED and x.dtype != torch.bfloat16)
