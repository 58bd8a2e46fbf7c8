"""Direct access to a `PagedLoopCache` for the cache tests and the I4 checks: a small layout, rows planned without a
model, values written into and read back through the block tables."""

from __future__ import annotations

import torch

from hf_loopspec import KVLayout
from hf_loopspec.cache.paged import PagedLoopCache

LAYOUT = KVLayout(num_planes=3, num_layers=2, num_kv_heads=2, head_dim=4)
LIKE = torch.zeros(1, dtype=torch.float32)


def write(cache, seq, depth, positions, lineage=None):
    """Plan rows of one (seq, depth) at `positions` (the allocator's work, no model call)."""
    return cache.plan_rows([seq] * len(positions), [depth] * len(positions), positions, like=LIKE, lineage=lineage)


def fill_values(cache, rows, value):
    """Write a recognisable value into every layer of the rows' slots."""
    for layer in range(cache.kv_layout.num_layers):
        flat = cache.k_pool[layer].view(-1, *cache.k_pool.shape[3:])
        flat[rows.slot] = value


def read_values(cache, seq, depth):
    """Keys of (seq, depth) at every valid position, read through the block table, layer 0, head 0, entry 0: [len]."""
    length = cache.length(seq, depth)
    return paged_plane(cache, seq, depth, 0, length)[0][:, 0, 0].tolist() if length else []  # no pool before a write


def paged_plane(cache: PagedLoopCache, seq: int, depth: int, layer: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values `[n, Hkv, D]` of positions 0..n-1 of (seq, depth), gathered through the block table."""
    pages = cache._pages[seq * cache.num_planes + depth]
    pos = torch.arange(n)
    page = torch.tensor(pages, dtype=torch.long)[pos // cache.page_size] if n else pos
    off = pos % cache.page_size
    return cache.k_pool[layer][page, off], cache.v_pool[layer][page, off]
