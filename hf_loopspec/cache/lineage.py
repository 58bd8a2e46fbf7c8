"""Debug checks of invariant I1 (own history) for `PagedLoopCache(debug=True)`; see that module's docstring.

The cache keeps `tags` (`[layers, pages, page_size]`, the lineage id that wrote each slot, -1 = never written) and
`_parents` (lineage id -> the id of the token before it on the same path, -1 for a first token).
"""

from __future__ import annotations

import torch

from .rows import RowBatch


class LineageError(AssertionError):
    """A row read a KV entry that its own ancestry did not write (invariant I1)."""


def ancestry(parents: dict[int, int], lineage_id: int, position: int) -> list[int]:
    """Lineage ids of the reader's own path at positions 0..position."""
    chain = [lineage_id]
    while len(chain) <= position:
        parent = parents.get(chain[-1])
        if parent is None or parent < 0:
            raise LineageError(f"lineage id {chain[-1]} at position {position - len(chain) + 1} has no "
                               "recorded parent; call link_lineage for every token")
        chain.append(parent)
    return chain[::-1]


def tag_and_check(cache, layer: int, rows: RowBatch) -> None:
    """Tag the slots `rows` write at `layer` with their lineage, then check every row's read set against its
    ancestry; the first violation raises `LineageError` naming (sequence, depth, position, layer)."""
    if rows.lineage is None:
        return
    flat_tags = cache.tags[layer].view(-1)
    for slot, lid in zip(rows.slot.tolist(), rows.lineage):
        flat_tags[slot] = lid
    tables = rows.block_tables.cpu()
    for n, lid in enumerate(rows.lineage):
        t, p = int(rows.table[n]), int(rows.position[n])
        expected = torch.tensor(ancestry(cache._parents, lid, p))
        pos = torch.arange(p + 1)
        pages = tables[t, pos // cache.page_size].long()
        found = flat_tags[pages * cache.page_size + pos % cache.page_size]
        bad = (found != expected).nonzero()
        if len(bad):
            j = int(bad[0])
            s, d = divmod(t, cache.num_planes)
            raise LineageError(
                f"I1 violated: row of lineage {lid} at sequence {s}, depth {d}, position {p} reads position "
                f"{j} at layer {layer}, written by lineage {int(found[j])}, but its own ancestor there is "
                f"{int(expected[j])}."
            )


def adopt(cache, seq: int, lineage: list[int]) -> None:
    """Link `lineage` as a chain and tag every stored position p of `seq`, in every plane, with `lineage[p]`. A page
    `seq` shares with another sequence (a fork, `batch_repeat_interleave`) is copied first, as a write would copy
    it: each sequence's tags are its own."""
    for child, parent in zip(lineage, [-1, *lineage[:-1]]):
        cache._parents[child] = parent
    for plane in range(cache.num_planes):
        table = cache._table(seq, plane)
        for p in range(cache._lengths[table]):
            page = cache._writable_page(table, p // cache.page_size, cache.k_pool)
            cache.tags[:, page, p % cache.page_size] = lineage[p]
