"""PagedLoopCache branch slots (`cache.branches`, invariant B of `hf_loopspec.cache.branches`): a branch shares its
parent's common history, copies the partly filled page on its first write, is promoted without copying, releases its
pages when closed, and refuses to outlive a rollback of its common history."""

from __future__ import annotations

import pytest
from paged_utils import LAYOUT, fill_values, read_values, write

from hf_loopspec import PagedLoopCache


def _parent(length: int = 8) -> PagedLoopCache:
    """One sequence holding positions 0..length-1 in planes 0 and 1, value = position (plane 0) or 100 + position."""
    cache = PagedLoopCache(LAYOUT, page_size=4)
    for plane, base in ((0, 0.0), (1, 100.0)):
        for p in range(length):
            fill_values(cache, write(cache, 0, plane, [p]), base + p)
    return cache


def test_branch_shares_the_common_history_and_copies_the_partly_filled_page():
    cache = _parent()
    before = cache.pages_in_use
    slot = cache.branches.open(0, 6)
    assert slot == 1 and cache.length(slot, 0) == 0  # no table until the branch writes the plane
    fill_values(cache, write(cache, slot, 0, [6]), -6.0)
    parent_pages, branch_pages = cache._pages[0], cache._pages[slot * cache.num_planes]
    assert branch_pages[0] == parent_pages[0]  # positions 0..3: the same page
    assert branch_pages[1] != parent_pages[1]  # positions 4..7: copied on the first write
    assert cache.pages_in_use == before + 1
    assert read_values(cache, slot, 0) == [0, 1, 2, 3, 4, 5, -6]
    assert read_values(cache, 0, 0) == list(range(8))  # the parent never sees the branch's write
    fill_values(cache, write(cache, slot, 0, [7, 8]), -7.0)
    assert read_values(cache, 0, 0) == list(range(8)) and cache.length(slot, 0) == 9


def test_promote_moves_the_branch_pages_without_copying():
    cache = _parent()
    slot = cache.branches.open(0, 6)
    fill_values(cache, write(cache, slot, 0, [6, 7, 8]), -1.0)
    pages = list(cache._pages[slot * cache.num_planes])
    cache.branches.promote(slot)
    assert cache._pages[0] == pages and cache.length(0, 0) == 9  # plane 0: the branch's table itself
    assert cache.length(0, 1) == 6 and read_values(cache, 0, 1) == [100 + p for p in range(6)]  # unopened: truncated
    assert cache.num_sequences == 1  # the branch slot is gone
    assert cache.pages_in_use == 3 + 2  # plane 0: 9 positions; plane 1: 6 positions


def test_close_releases_the_branch_pages():
    cache = _parent()
    before = cache.pages_in_use
    slot = cache.branches.open(0, 5)
    fill_values(cache, write(cache, slot, 0, [5, 6, 7, 8, 9]), -1.0)
    fill_values(cache, write(cache, slot, 1, [5]), -1.0)
    assert cache.pages_in_use > before
    cache.branches.close(slot)
    assert cache.pages_in_use == before and cache.num_sequences == 1
    assert read_values(cache, 0, 0) == list(range(8))


def test_common_history_cannot_change_under_an_open_branch():
    cache = _parent()
    slot = cache.branches.open(0, 6)
    write(cache, slot, 0, [6])
    with pytest.raises(ValueError, match="invariant B"):
        cache.truncate(0, 0, 5)  # a rollback below the branch point
    cache.truncate(0, 0, 6)  # the parent's own tokens from the branch point on may go
    short = _parent(4)
    branch = short.branches.open(0, 6)
    with pytest.raises(ValueError, match="invariant B"):  # the common history is not complete yet
        write(short, branch, 0, [6])


def test_promote_refuses_while_a_later_branch_is_open():
    cache = _parent()
    early, late = cache.branches.open(0, 5), cache.branches.open(0, 7)
    with pytest.raises(ValueError, match="close that one first"):
        cache.branches.promote(early)
    cache.branches.close(late)
    cache.branches.promote(early)
    assert cache.num_sequences == 1


def test_a_crop_refused_under_an_open_branch_changes_nothing():
    """`crop` checks every cut before making one: refused (invariant B) it leaves every table and column count as
    they were, so that a retry after closing the branch cuts exactly once (before, the tables it had cut before the
    refusal were cut again)."""
    cache = PagedLoopCache(LAYOUT, page_size=4)
    for seq in (0, 1):
        for plane in range(cache.num_planes):
            fill_values(cache, write(cache, seq, plane, list(range(8))), 10.0 * seq + plane)
    cache.set_columns(8, range(cache.num_planes))
    slot = cache.branches.open(1, 6)
    write(cache, slot, 0, [6])
    with pytest.raises(ValueError, match="invariant B"):
        cache.crop(-4)
    assert [[cache.length(s, d) for d in range(cache.num_planes)] for s in (0, 1)] == [[8] * cache.num_planes] * 2
    assert cache.columns() == 8
    cache.branches.close(slot)
    cache.crop(-4)
    assert [[cache.length(s, d) for d in range(cache.num_planes)] for s in (0, 1)] == [[4] * cache.num_planes] * 2
    assert read_values(cache, 0, 0) == [0.0] * 4 and cache.columns() == 4


def test_a_free_refused_under_an_open_branch_changes_nothing():
    """`free` checks every plane's cut before making one: refused (invariant B, the branch has opened plane 1 only) it
    leaves every plane of the parent as it was (before, plane 0 was freed before plane 1's refusal)."""
    cache = _parent()
    slot = cache.branches.open(0, 6)
    write(cache, slot, 1, [6])
    with pytest.raises(ValueError, match="invariant B"):
        cache.free(0)
    assert [cache.length(0, d) for d in (0, 1)] == [8, 8]
    assert read_values(cache, 0, 0) == [float(p) for p in range(8)]
    cache.branches.close(slot)
    cache.free(0)
    assert [cache.length(0, d) for d in range(cache.num_planes)] == [0] * cache.num_planes
    assert cache.pages_in_use == 0


def test_a_fork_is_refused_while_a_branch_is_open():
    """`fork` adds a slot after the open branch's, and closing the branch drops every slot from its own on: the fork
    was lost and its pages never released. It is refused instead, and works once the branch is closed."""
    cache = _parent()
    slot = cache.branches.open(0, 6)
    write(cache, slot, 0, [6])
    with pytest.raises(ValueError, match="open branch.*before forking a sequence"):
        cache.fork(0)
    assert cache.num_sequences == 2  # the parent and the branch's slot
    cache.branches.close(slot)
    fork = cache.fork(0)
    assert read_values(cache, fork, 0) == read_values(cache, 0, 0)
    cache.free(0)
    cache.free(fork)
    assert cache.pages_in_use == 0


def test_the_branch_slots_own_common_history_cannot_be_cut():
    """`free` (or `truncate` below the branch point) of an open branch's own slot was accepted, and a later `promote`
    handed the parent the cut table: the parent's positions 0..5 were gone. Refused, naming close and promote; a cut
    of the branch's own positions (at or after the point) stays allowed, and promote keeps the parent's history."""
    cache = _parent()
    slot = cache.branches.open(0, 6)
    fill_values(cache, write(cache, slot, 0, [6, 7]), -1.0)
    for cut in (lambda: cache.free(slot), lambda: cache.truncate(slot, 0, 5)):
        with pytest.raises(ValueError, match=rf"sequence {slot} is the slot of an open branch.*close or promote"):
            cut()
    cache.truncate(slot, 0, 7)  # the branch's own position 7
    cache.branches.promote(slot)
    assert read_values(cache, 0, 0) == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, -1.0]


def test_a_roll_back_closes_the_branches_opened_since_its_checkpoint():
    """A call that raises with a branch open (the reference's second proposals, Ctrl-C mid-cycle) rolls the cache
    back: the parent's cut below the branch point raised invariant B's error instead, hiding the call's own."""
    cache = _parent()
    with pytest.raises(KeyboardInterrupt), cache.kept_on_error():
        fill_values(cache, write(cache, 0, 0, [8]), 8.0)
        slot = cache.branches.open(0, 9)
        write(cache, slot, 0, [9])
        raise KeyboardInterrupt
    assert not cache.branches and cache.num_sequences == 1
    assert read_values(cache, 0, 0) == [float(p) for p in range(8)]
    # a branch open before the checkpoint stays open, with its KV (a refused call on such a cache closed it), and
    # loses what it wrote since: a position, and a plane it had not opened (its cut raised the branch's own refusal
    # instead of the call's exception)
    slot = cache.branches.open(0, 6)
    fill_values(cache, write(cache, slot, 0, [6, 7]), -1.0)
    with pytest.raises(KeyboardInterrupt), cache.kept_on_error():
        fill_values(cache, write(cache, slot, 0, [8]), -2.0)
        fill_values(cache, write(cache, slot, 1, [6]), -3.0)
        raise KeyboardInterrupt
    assert slot in cache.branches and read_values(cache, slot, 0) == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, -1.0, -1.0]
    assert cache.length(slot, 1) == 0
    fill_values(cache, write(cache, slot, 1, [6]), -4.0)  # the plane opens again, on the parent's history
    assert read_values(cache, slot, 1) == [100.0, 101.0, 102.0, 103.0, 104.0, 105.0, -4.0]
    # a branch opened since in a slot that an earlier branch held (closed since) is closed too
    with pytest.raises(KeyboardInterrupt), cache.kept_on_error():
        cache.branches.close(slot)
        assert cache.branches.open(0, 3) == slot
        raise KeyboardInterrupt
    assert not cache.branches and [cache.length(0, d) for d in (0, 1)] == [8, 8]


def test_a_commit_is_refused_while_a_branch_is_open_or_into_its_own_sequence():
    """`commit` under an open branch could move the branch API's slots (it has `promote` for that), and a sequence
    committed into itself was emptied: both are refused, the cache unchanged; a commit into another sequence moves
    the pages."""
    cache = _parent()
    fork = cache.fork(0)
    slot = cache.branches.open(0, 6)
    with pytest.raises(ValueError, match="open branch.*before committing a sequence"):
        cache.commit(fork, into=0)
    cache.branches.close(slot)
    with pytest.raises(ValueError, match="commit: branch=0 and into=0 are one sequence"):
        cache.commit(0, into=0)
    for bad, named in (((fork, 1.0), r"into=1\.0"), ((True, 0), "branch=True"), ((fork, 2), "into=2")):
        with pytest.raises(ValueError, match=rf"commit: {named} is not a sequence of this cache \(it has 2\)"):
            cache.commit(*bad)
    assert read_values(cache, 0, 0) == read_values(cache, fork, 0) == [float(p) for p in range(8)]
    cache.commit(fork, into=0)
    assert read_values(cache, 0, 0) == [float(p) for p in range(8)] and cache.length(fork, 0) == 0


def test_a_slot_that_is_no_integer_closes_and_promotes_nothing():
    """True and 1.0 find slot 1 as dict keys: `promote(True)` took the branch off the open list and cut its parent
    before refusing it (two tokens lost, the slot's pages left behind), `close(1.0)` dropped it and kept its pages.
    Refused before any change, and `in` agrees (it answered True); the branch then closes as usual."""
    cache = _parent()
    slot = cache.branches.open(0, 6)
    write(cache, slot, 0, [6, 7, 8])
    before = (cache.lengths(0), cache.lengths(1), cache.pages_in_use)
    assert slot in cache.branches and True not in cache.branches and 1.0 not in cache.branches
    for bad in (True, 1.0):
        for act in (cache.branches.promote, cache.branches.close):
            with pytest.raises(ValueError, match=rf"slot={bad!r} is not an open branch of this cache \(open: \[1\]\)"):
                act(bad)
            assert (cache.lengths(0), cache.lengths(1), cache.pages_in_use) == before and len(cache.branches) == 1
    cache.branches.close(slot)
    assert cache.lengths(0) == [8] and read_values(cache, 0, 0) == [float(p) for p in range(8)]


def test_fork_checks_its_sequence_before_adding_a_slot():
    """`fork(5)` on a one-sequence cache said "it has 2" and left an empty second sequence behind; `fork(1)` forked
    that fresh empty slot; `fork(0.0)` raised a bare TypeError. Each is a `ValueError` now, and the cache unchanged."""
    cache = _parent()
    for bad, message in ((5, r"seq=5 is not a sequence of this cache \(it has 1\)"), (1, r"seq=1 is not a sequence"),
                         (-1, r"seq=-1 is not a sequence"), (0.0, r"fork: seq=0\.0 must be an integer"),
                         ("x", r"fork: seq='x' must be an integer")):
        with pytest.raises(ValueError, match=message):
            cache.fork(bad)
        assert cache.num_sequences == 1


@pytest.mark.parametrize("select", [lambda c: c.batch_select_indices([1]), lambda c: c.reorder_cache([1, 0]),
                                    lambda c: c.batch_repeat_interleave(2)])
def test_sequences_cannot_be_selected_while_a_branch_is_open(select):
    """A branch's slot is no sequence of the batch: selecting, reordering or repeating sequences with one open is
    refused, leaving the branch usable (before, the branch's table was dropped but the branch stayed registered,
    and closing it raised)."""
    cache = PagedLoopCache(LAYOUT, page_size=4)
    for seq in (0, 1):
        fill_values(cache, write(cache, seq, 0, list(range(8))), float(seq))
    slot = cache.branches.open(1, 6)
    write(cache, slot, 0, [6])
    with pytest.raises(ValueError, match="open branch"):
        select(cache)
    cache.branches.close(slot)
    select(cache)


@pytest.mark.parametrize("call, named", [
    (lambda c: c.branches.open(7, 0), "parent=7"),
    (lambda c: c.branches.open(0, -1), "point=-1"),
    (lambda c: c.branches.open(True, 2), "parent=True"),
    (lambda c: c.branches.close(99), "slot=99"),
    (lambda c: c.branches.promote(99), "slot=99"),
])
def test_branch_arguments_are_checked(call, named):
    """A parent that is no sequence, a negative branch point or a slot that is no open branch raise a ValueError
    naming it (they were accepted, giving a table of length -1, or raised IndexError / KeyError)."""
    cache = _parent()
    with pytest.raises(ValueError, match=named):
        call(cache)
    assert cache.num_sequences == 1 and len(cache.branches) == 0


def test_batch_size_counts_the_batchs_sequences_not_branch_slots():
    """transformers' `Cache.batch_size` (-1 before: no `layers`): the batch's sequences, an open branch's slot not
    among them; offloading, which a one-pool cache cannot do, is refused with a message (not a raw TypeError)."""
    assert PagedLoopCache(LAYOUT).batch_size == 0
    cache = PagedLoopCache(LAYOUT, page_size=4)
    for seq in (0, 1):
        fill_values(cache, write(cache, seq, 0, list(range(8))), float(seq))
    slot = cache.branches.open(1, 6)
    write(cache, slot, 0, [6])
    assert cache.batch_size == 2 and cache.num_sequences == 3
    cache.branches.close(slot)
    assert cache.batch_size == 2
    for move in (cache.offload, cache.prefetch):
        with pytest.raises(NotImplementedError, match="does not offload"):
            move(0)


CHANGES = {  # a change that a roll back cannot undo, made on the cache of `_two_sequences`
    "truncate": lambda cache: cache.truncate(0, 1, 5),
    "regrown": lambda cache: (cache.truncate(0, 0, 4), write(cache, 0, 0, list(range(4, 10)))),  # as long again
    "reorder": lambda cache: cache.reorder_cache([1, 0]),
    "free": lambda cache: cache.free(1),
    "commit": lambda cache: cache.commit(cache.fork(1), 0),
    "reset": lambda cache: cache.reset(),
}


def _two_sequences() -> PagedLoopCache:
    cache = _parent()
    write(cache, 0, 0, [8, 9])  # sequence 0: 10 positions in plane 0, 8 in plane 1
    write(cache, 1, 0, [0, 1, 2])  # sequence 1: 3 positions in plane 0
    return cache


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_roll_back_refuses_a_checkpoint_whose_tokens_were_cut_or_reordered_since(change):
    """A roll back drops what was added since its checkpoint; a cut below the checkpoint's lengths (even one grown
    back over since), a reorder of its sequences or a reset it cannot undo. It kept the shorter tables (or the
    reordered rows, cut to the other row's length; or the regrown KV) and restored the checkpoint's consumed columns,
    so that the cache claimed tokens it no longer held, or other ones. It is refused now, the cache left as the
    change left it; `kept_on_error` then leaves the cache so and says it on the exception."""
    cache = _two_sequences()
    checkpoint = cache.checkpoint()
    CHANGES[change](cache)
    held = [cache.lengths(0), cache.lengths(1)]
    with pytest.raises(ValueError, match="roll_back: since the checkpoint the cache (cut|selected, reordered or re)"):
        cache.roll_back(checkpoint)
    assert [cache.lengths(0), cache.lengths(1)] == held
    cache = _two_sequences()
    with pytest.raises(KeyboardInterrupt) as raised, cache.kept_on_error():
        write(cache, 0, 1, [8])
        CHANGES[change](cache)
        held = [cache.lengths(0), cache.lengths(1)]
        raise KeyboardInterrupt
    assert "the cache was not rolled back: roll_back: since the checkpoint" in raised.value.__notes__[0]
    assert [cache.lengths(0), cache.lengths(1)] == held  # what the context did stays: nothing half undone


def test_a_roll_back_undoes_cuts_above_the_checkpoint_and_restores_an_empty_cache():
    """What a roll back can undo it still does: cuts of positions added since the checkpoint (a call's own
    rejected drafts), and anything done to a cache that was empty at the checkpoint (beam search reorders the rows
    of a call on a fresh cache)."""
    cache = _two_sequences()
    checkpoint = cache.checkpoint()
    write(cache, 0, 0, [10, 11, 12])
    cache.truncate(0, 0, 11)
    write(cache, 1, 1, [0])
    cache.roll_back(checkpoint)
    assert cache.lengths(0) == [10, 3] and cache.lengths(1) == [8, 0]
    assert read_values(cache, 0, 0)[:8] == [float(p) for p in range(8)]
    empty = PagedLoopCache(LAYOUT, page_size=4)
    checkpoint = empty.checkpoint()
    write(empty, 0, 0, [0])
    write(empty, 1, 0, [0, 1])
    empty.reorder_cache([1, 0])
    empty.roll_back(checkpoint)
    assert empty.num_sequences == 0 and empty.pages_in_use == 0


def test_a_roll_back_checks_the_branches_still_open_and_drops_slots_reused_since():
    """A branch open at the checkpoint and still open is restored as a sequence is: a cut of its own positions
    since (regrown or not) is refused (its table was not checked: the roll back kept other KV). A slot whose branch
    closed since and that a `fork` took as a new sequence is dropped with the other sequences added since (it was
    cut to nothing but kept, and the next turn of the batch's one row was refused for a cache of two sequences)."""
    for regrow in (False, True):
        cache = _parent()
        slot = cache.branches.open(0, 6)
        fill_values(cache, write(cache, slot, 0, [6, 7]), -1.0)
        checkpoint = cache.checkpoint()
        cache.truncate(slot, 0, 7)
        if regrow:
            fill_values(cache, write(cache, slot, 0, [7]), -5.0)
        with pytest.raises(ValueError, match=rf"roll_back: since the checkpoint the cache cut \(sequence, depth\) "
                                             rf"\[\({slot}, 0\)\]"):
            cache.roll_back(checkpoint)
        assert cache.length(slot, 0) == 7 + regrow
    cache = _parent()
    slot = cache.branches.open(0, 6)
    write(cache, slot, 0, [6])
    checkpoint = cache.checkpoint()
    cache.branches.close(slot)
    assert cache.fork(0) == slot
    cache.roll_back(checkpoint)
    assert cache.num_sequences == 1 and cache.batch_size == 1 and not cache.branches
    assert read_values(cache, 0, 0) == [float(p) for p in range(8)]


def test_a_roll_back_refuses_a_commit_out_of_a_sequence_and_restores_empty_sequences():
    """The sequence a commit empties is cut too (only the one committed into was logged: grown back over, the roll
    back kept other KV); a selection since a checkpoint whose sequences held nothing is refused like any other; and
    an empty sequence of the checkpoint that a roll back to an older checkpoint dropped is there again (the batch
    came back a sequence short)."""
    cache = PagedLoopCache(LAYOUT, page_size=4)
    fill_values(cache, write(cache, 0, 0, [0, 1]), 1.0)
    checkpoint = cache.checkpoint()
    write(cache, 1, 0, [0])
    cache.commit(0, 1)
    fill_values(cache, write(cache, 0, 0, [0, 1]), 2.0)
    with pytest.raises(ValueError, match=r"roll_back: since the checkpoint the cache cut \(sequence, depth\) \[\(0, 0"):
        cache.roll_back(checkpoint)
    assert read_values(cache, 0, 0) == [2.0, 2.0]
    empty = PagedLoopCache(LAYOUT, page_size=4)
    empty.ensure_sequences(2)
    checkpoint = empty.checkpoint()
    empty.batch_select_indices([0])
    with pytest.raises(ValueError, match="selected, reordered or reset its sequences"):
        empty.roll_back(checkpoint)
    cache = PagedLoopCache(LAYOUT, page_size=4)
    fill_values(cache, write(cache, 0, 0, [0, 1]), 1.0)
    older = cache.checkpoint()
    cache.ensure_sequences(2)
    newer = cache.checkpoint()
    cache.roll_back(older)
    assert cache.batch_size == 1
    cache.roll_back(newer)
    assert cache.batch_size == 2 and cache.lengths(0) == [2, 0] and read_values(cache, 0, 0) == [1.0, 1.0]


def test_no_sequence_is_added_while_a_branch_is_open():
    """A write to a new sequence, or to the slot of a branch closed since, while a branch is open put it among the
    branch slots, where closing the last branch dropped it without releasing its pages; refused, as `fork` is."""
    cache = _parent()
    closed, slot = cache.branches.open(0, 6), cache.branches.open(0, 7)
    write(cache, slot, 0, [7])
    cache.branches.close(closed)
    for stray in (closed, 3):
        with pytest.raises(ValueError, match=f"sequence {stray} is no sequence of the batch and no open branch"):
            write(cache, stray, 0, [0])
    assert cache.num_sequences == 3 and cache.length(slot, 0) == 8 and cache.length(closed, 0) == 0
    cache.branches.close(slot)
    assert cache.pages_in_use == 2 + 2  # the parent's 8 positions in planes 0 and 1
