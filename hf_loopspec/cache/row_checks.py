"""`RowChecks`: what `PagedLoopCache.plan_rows` checks and counts before it changes anything, so that a refused call
(bad rows, a write that does not extend its tables, a fixed pool too small) leaves the cache as it was."""

from __future__ import annotations

import torch

from ..models.layers import is_integer


class RowChecks:
    """Mixed into `PagedLoopCache` (it reads the `PageTables` bookkeeping and the cache's `branches`)."""

    def _check_rows(self, seq: list, depth: list, position: list, like) -> None:
        """`ValueError` for rows of a `plan_rows` call that no cache takes (checked before the call changes
        anything): lists of other lengths, a sequence or position that is no integer >= 0, a depth past the planes,
        or a `like` that is no tensor."""
        if not len(seq) == len(depth) == len(position):
            raise ValueError("seq, depth and position must have the same length.")
        for name, values in (("seq", seq), ("position", position)):
            if bad := [x for x in values if not is_integer(x) or x < 0]:
                raise ValueError(f"{name} holds {bad[0]!r}: every {name} must be an integer >= 0.")
        for d in depth:
            self._check_depth(d)
        if not torch.is_tensor(like):
            raise ValueError(f"like={like!r} must be a tensor on the compute device in the KV dtype (the call's "
                             "hidden states, say).")

    def _written(self, seq: list, depth: list, position: list, like) -> tuple[list[int], dict[int, list[int]]]:
        """The table of each row and the positions each table gets. First a `ValueError` unless every table's
        positions extend it contiguously, or a `CacheCapacityError` when a fixed pool cannot hold the pages the write
        takes (`_pages_taken`): a refused call changes nothing. Then a fresh cache's pool is allocated and the
        branches' tables the write opens are opened (the cache's `branches.before_write`)."""
        tables = [self._table(s, d) for s, d in zip(seq, depth)]
        written: dict[int, list[int]] = {}
        for t, p in zip(tables, position):
            written.setdefault(t, []).append(p)
        openings = {t: self.branches.opening(*divmod(t, self.num_planes)) for t in written}
        for t, ps in written.items():
            start = self._lengths[t] if openings[t] is None else openings[t][0]
            if sorted(ps) != list(range(start, start + len(ps))):
                s, d = divmod(t, self.num_planes)
                if len(set(ps)) != len(ps):
                    raise ValueError(f"duplicate KV write address in one call: sequence {s}, depth {d}, "
                                     f"positions {sorted(ps)} (invariant I2).")
                raise ValueError(
                    f"rows write positions {sorted(ps)} of sequence {s}, depth {d}, whose valid length is "
                    f"{start}: writes must extend the table contiguously (truncate before rewriting)."
                )
        short = self._pages_taken(written, {t: o[1] for t, o in openings.items() if o is not None}) - len(self._free)
        if self.max_pages is not None and self.num_pages + short > self.max_pages:
            self._grow(short, like)  # (which raises: a fixed pool cannot hold the write)
        if self.k_pool is None:
            self._grow(0, like)
        for t in written:
            self.branches.before_write(*divmod(t, self.num_planes))
        return tables, written

    def _pages_taken(self, written: dict[int, list[int]], opened: dict[int, list[int]]) -> int:
        """The free pages a write of `written` (table -> positions) takes: a page per new page index of a table, and
        a copy of each page it writes that another table shares (`opened`: the shared pages a branch's table starts
        with)."""
        refs: dict[int, int] = {}
        for pages in opened.values():
            for page in pages:
                refs[page] = refs.get(page, self._refs[page]) + 1
        taken = 0
        for t, ps in written.items():
            pages = opened.get(t, self._pages[t])
            for index in sorted({p // self.page_size for p in ps}):
                if index >= len(pages):
                    taken += 1
                    continue
                page = pages[index]
                count = refs.get(page, self._refs[page])
                if count > 1:  # copied on write
                    refs[page] = count - 1
                    taken += 1
        return taken
