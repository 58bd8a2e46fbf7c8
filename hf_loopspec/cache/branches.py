"""Branch slots: branch-private KV for competing proposals of one position (docs/design.md, "I5 (branches)").

A *branch* holds the KV of a sibling proposal for position `point` of a sequence (its *parent*) and of the tokens
after it on the same branch: tokens that compete with the parent's own tokens at positions >= `point`. It lives in
a sequence slot of the cache after the batch's sequences (`open` returns it), with one block table per plane like
any sequence, so its rows are planned, written and attended like any other (`plan_rows`, the attention ops and the
debug lineage check need nothing new).

Invariant B (branch-private storage), for every plane k:

* The branch's plane-k table is created when the branch first writes plane k (lazily, per plane, in `plan_rows`):
  it then shares the parent's pages for positions 0 .. point-1 and nothing else. The page that holds position
  point-1 and has room for `point` is shared too, and the first write into it from either side copies it
  (copy on write), so no write of one side ever lands in a slot the other side reads.
* Positions 0 .. point-1 of the parent's plane k are the common history: they must all be written before the
  branch first writes plane k (checked when the table is created), and they are never rewritten while the branch
  is open (a truncation of the parent's plane below `point` raises): rolling back the common history means the
  branch is no longer a continuation of it, so it must be closed first.

Hence a branch row reads, at positions < point, exactly the common ancestry, and at positions >= point only what
its own branch wrote, and the parent's rows never see the branch's entries. With `debug=True` the lineage check
(I1) verifies this on every read of both sides.

`promote` makes a branch the parent's history without copying: the parent's planes are truncated to `point`, each
plane the branch opened replaces the parent's table (its page list moves over), and planes it never wrote keep the
parent's truncated table. `close` releases a losing branch's pages. When no branch is open the branch slots are
dropped, so `num_sequences` is the batch's again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..models.layers import is_integer


@dataclass
class _Branch:
    parent: int  # sequence slot whose history the branch continues
    point: int  # the first position the branch owns
    opened: set[int] = field(default_factory=set)  # planes whose table the branch has created


class BranchSlots:
    """The open branches of one `PagedLoopCache` (see the module docstring); `cache.branches`."""

    def __init__(self, cache):
        self.cache = cache
        self._open: dict[int, _Branch] = {}  # branch slot -> its branch
        self._base: int | None = None  # the first branch slot (the batch's sequence count when the first opened)

    def __contains__(self, slot: int) -> bool:
        return is_integer(slot) and slot in self._open  # (True and 1.0 hash as slot 1 but name no slot)

    def __len__(self) -> int:
        """The number of open branches."""
        return len(self._open)

    @property
    def batch_sequences(self) -> int:
        """The batch's sequence count: the cache's slots before the first branch slot."""
        return self.cache.num_sequences if self._base is None else self._base

    def open(self, parent: int, point: int) -> int:
        """A new branch of sequence `parent` owning positions >= `point`; returns its slot (no pages yet)."""
        cache = self.cache
        sequences = self.batch_sequences
        if not (is_integer(parent) and 0 <= parent < sequences):
            raise ValueError(f"parent={parent!r} is not a sequence of this cache (it has {sequences}); branch one "
                             "of its sequences.")
        if not is_integer(point) or point < 0:
            raise ValueError(f"point={point!r}: the first position the branch owns, an integer >= 0.")
        if self._base is None:
            self._base = cache.num_sequences
        slot = next((s for s in range(self._base, cache.num_sequences) if s not in self._open), cache.num_sequences)
        cache.ensure_sequences(slot + 1)
        self._open[slot] = _Branch(parent, point)
        return slot

    def opening(self, slot: int, plane: int) -> tuple[int, list[int]] | None:
        """The length and pages that `before_write` gives table (`slot`, `plane`) on its first write, a branch's
        share of its parent's common history (`ValueError` when that history is shorter than the branch point), or
        None when the write opens nothing; changes nothing."""
        branch = self._open.get(slot)
        if branch is None or plane in branch.opened:
            return None
        cache = self.cache
        src = cache._table(branch.parent, plane)
        if cache._lengths[src] < branch.point:
            raise ValueError(f"branch of sequence {branch.parent} at position {branch.point} writes plane {plane}, "
                             f"whose common history holds only {cache._lengths[src]} positions (invariant B).")
        return branch.point, cache._pages[src][: -(-branch.point // cache.page_size)]

    def before_write(self, slot: int, plane: int) -> None:
        """Called by `plan_rows` for every table a call writes: create a branch's plane-`plane` table on its first
        write, sharing the parent's common history (invariant B; `opening`)."""
        opening = self.opening(slot, plane)
        if opening is None:
            return
        cache = self.cache
        point, shared = opening
        for page in shared:
            cache._refs[page] += 1
        dst = cache._table(slot, plane)
        cache._pages[dst], cache._lengths[dst] = list(shared), point
        cache._block_tables = None
        self._open[slot].opened.add(plane)

    def check_truncate(self, seq: int, plane: int, length: int) -> None:
        """Raise when truncating (seq, plane) to `length` would rewrite an open branch's common history: the parent's,
        or the branch slot's own (a later `promote` would hand the parent the cut table)."""
        own = self._open.get(seq)
        if own is not None and length < own.point and plane in own.opened:
            raise ValueError(f"sequence {seq} is the slot of an open branch, whose positions before {own.point} are "
                             f"its parent's history: close or promote the branch (cache.branches.close({seq}) or "
                             f"promote({seq})) rather than cutting plane {plane} to {length} positions.")
        for branch in self._open.values():
            if branch.parent == seq and length < branch.point and plane in branch.opened:
                raise ValueError(f"truncating sequence {seq}, plane {plane} to {length} positions rolls back the "
                                 f"common history of its open branch at position {branch.point}: close the branch "
                                 "first (invariant B).")

    def _branch(self, slot: int) -> _Branch:
        """The open branch of `slot`; `ValueError` naming it when there is none (True or 1.0, equal to slot 1 as dict
        keys, name none: refused before `close` or `promote` changes anything)."""
        if not is_integer(slot) or slot not in self._open:
            raise ValueError(f"slot={slot!r} is not an open branch of this cache (open: {sorted(self._open)}).")
        return self._open[slot]

    def close(self, slot: int) -> None:
        """Release a branch's pages and its slot."""
        branch = self._branch(slot)
        del self._open[slot]
        for plane in branch.opened:
            self.cache.truncate(slot, plane, 0)
        self._drop_slots()

    def promote(self, slot: int) -> None:
        """Make the branch the parent's history from `point` on (see the module docstring) and close its slot."""
        cache = self.cache
        branch = self._branch(slot)
        for other_slot, other in self._open.items():
            if other_slot != slot and other.parent == branch.parent and other.point >= branch.point:
                raise ValueError(f"cannot promote the branch of sequence {branch.parent} at position {branch.point} "
                                 f"while its branch at position {other.point} is open: close that one first.")
        del self._open[slot]
        for plane in range(cache.num_planes):
            cache.truncate(branch.parent, plane, min(branch.point, cache.length(branch.parent, plane)))
            if plane in branch.opened:
                src, dst = cache._table(slot, plane), cache._table(branch.parent, plane)
                for page in cache._pages[dst]:
                    cache._release(page)
                cache._pages[dst], cache._pages[src] = cache._pages[src], []
                cache._lengths[dst], cache._lengths[src] = cache._lengths[src], 0
        cache._block_tables = None
        self._drop_slots()

    def state(self) -> tuple[tuple[int, _Branch, frozenset[int]], ...]:
        """(slot, branch, the planes it has opened) of every open branch: what `restore` returns them to."""
        return tuple((slot, branch, frozenset(branch.opened)) for slot, branch in self._open.items())

    def kept(self, state: tuple[tuple[int, _Branch, frozenset[int]], ...]) -> list[int]:
        """The slots of the branches of `state` still open: those `restore` keeps."""
        return [slot for slot, branch, _ in state if self._open.get(slot) is branch]

    def restore(self, state: tuple[tuple[int, _Branch, frozenset[int]], ...]) -> None:
        """Close every branch opened since `state` (one in a slot that a branch of `state` held too), and give those of
        `state` still open the planes they had opened then: the tables of planes opened since are then the cache's
        to cut (`PagedLoopCache.roll_back`). A branch of `state` closed or promoted since stays so."""
        then = {slot: (branch, opened) for slot, branch, opened in state}
        for slot in [slot for slot, branch in self._open.items() if then.get(slot, (None,))[0] is not branch]:
            self.close(slot)
        for slot, branch in self._open.items():
            branch.opened = set(then[slot][1])

    def close_all(self) -> None:
        for slot in list(self._open):
            self.close(slot)

    def _drop_slots(self) -> None:
        """With no branch open, remove the (empty) branch slots."""
        if self._open or self._base is None:
            return
        cache, cut = self.cache, self._base * self.cache.num_planes
        del cache._pages[cut:], cache._lengths[cut:]
        cache._block_tables = None
        self._base = None
