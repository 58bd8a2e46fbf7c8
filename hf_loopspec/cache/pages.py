"""`PageTables`: the page pool and block tables under `PagedLoopCache` (allocation, sharing, rollback).

Storage model
-------------
One page pool `[num_layers, num_pages, page_size, kv_heads, head_dim]` (keys and values). A KV address is
(sequence, depth, position, layer): every (sequence, depth) pair owns a *block table*, the list of pages
holding its positions in order, and a *valid length*. Table id = `seq * num_planes + depth`.

"Depth" here is a *plane* index (`KVLayout`): planes `0 .. U-1` are loop depths; a model whose entry or exit
stage has KV (Huginn's prelude and coda) adds planes for them, which the cache stores like any other (it knows
no model). A stage with fewer layers than `num_layers` leaves the pool's other layers unused on its pages.

Pages are reference counted, so a sequence can be forked (beam search, tree speculation) without copying:
the fork shares every page, and the first write into a shared page copies it (copy on write). `truncate`
rolls back a suffix of one (sequence, depth) and frees pages it no longer needs.
"""

from __future__ import annotations

import numbers

import torch

from ..looped import KVLayout
from ..models.layers import is_integer


class CacheCapacityError(RuntimeError):
    """The page pool is full and the cache was created with a fixed capacity."""


class PageTables:
    """Paged KV storage of `layout.num_planes` tables per sequence (see the module docstring).

    Args:
        layout: planes, layers, kv heads and head size of the model (`model.kv_layout`).
        page_size: positions per page.
        max_pages: fixed capacity in pages; `None` grows the pool on demand (doubling).
        debug: keep a lineage tag per written slot (checked by `cache.lineage`) and fill newly grown memory with NaN.
    """

    def __init__(self, layout: KVLayout, page_size: int, max_pages: int | None, debug: bool):
        if not is_integer(page_size) or page_size < 1:
            raise ValueError(f"page_size={page_size!r} must be an integer >= 1.")
        if max_pages is not None and (not is_integer(max_pages) or max_pages < 1):
            raise ValueError(f"max_pages={max_pages!r} must be an integer >= 1, or None (grow on demand).")
        if not isinstance(debug, bool):
            raise ValueError(f"debug={debug!r} must be True or False.")
        self.kv_layout = layout
        self.page_size = int(page_size)
        self.max_pages = None if max_pages is None else int(max_pages)
        self.debug = debug
        self.k_pool: torch.Tensor | None = None  # [layers, pages, page_size, kv_heads, head_dim]
        self.v_pool: torch.Tensor | None = None
        self.tags: torch.Tensor | None = None  # debug: [layers, pages, page_size] lineage id, -1 = never written
        self._refs: list[int] = []  # per page
        self._free: list[int] = []  # free page ids (a stack)
        self._pages: list[list[int]] = []  # per table
        self._lengths: list[int] = []  # per table: valid positions
        self._block_tables: torch.Tensor | None = None  # device copy, rebuilt when stale
        self._reorders = 0  # selections (and resets) that changed the sequences' order or count (`check_roll_back`)
        self._cuts = 0  # cuts so far: a cut shortens a table (`check_roll_back`)
        self._cut_log: dict[int, list[tuple[int, int]]] = {}  # table -> (cut, length) kept, both increasing

    # --- sizes and reports ------------------------------------------------------------------------------------
    @property
    def num_planes(self) -> int:
        return self.kv_layout.num_planes

    @property
    def num_sequences(self) -> int:
        return len(self._pages) // self.num_planes

    @property
    def num_pages(self) -> int:
        return len(self._refs)

    @property
    def pages_in_use(self) -> int:
        return self.num_pages - len(self._free)

    def bytes_per_token_per_depth(self, dtype: torch.dtype | None = None) -> int:
        """KV bytes one token takes in one depth plane (keys and values, all layers) stored in `dtype` (a floating
        torch dtype; None: the pool's, else float32)."""
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"dtype={dtype!r}: pass a floating torch dtype (torch.bfloat16, torch.float32, ...), or "
                             "None for the pool's.")
        dtype = dtype or (self.k_pool.dtype if self.k_pool is not None else torch.float32)
        lay = self.kv_layout
        return 2 * lay.num_layers * lay.num_kv_heads * lay.head_dim * torch.finfo(dtype).bits // 8

    def length(self, seq: int, depth: int) -> int:
        """Valid positions of (seq, depth)."""
        return self._lengths[self._table(seq, depth)]

    def lengths(self, depth: int) -> list[int]:
        """Valid positions of every sequence at `depth`."""
        self._check_depth(depth)
        return [self._lengths[s * self.num_planes + int(depth)] for s in range(self.num_sequences)]

    def _check_depth(self, depth: int) -> None:
        if not is_integer(depth) or not 0 <= depth < self.num_planes:
            raise ValueError(f"depth={depth!r} must be an integer in [0, {self.num_planes - 1}] for this cache.")

    def _table(self, seq: int, depth: int) -> int:
        self._check_depth(depth)
        if not is_integer(seq) or not 0 <= seq < self.num_sequences:
            raise ValueError(f"seq={seq!r} is not a sequence of this cache (it has {self.num_sequences}).")
        return int(seq) * self.num_planes + int(depth)

    # --- page allocation --------------------------------------------------------------------------------------
    def ensure_sequences(self, count: int) -> None:
        """Make sequence slots `0 .. count-1` exist (new ones empty)."""
        while self.num_sequences < count:
            self._pages.extend([] for _ in range(self.num_planes))
            self._lengths.extend(0 for _ in range(self.num_planes))
        self._block_tables = None

    def _drop_sequences(self, count: int) -> None:
        """Remove the sequence slots from `count` on, empty ones that `ensure_sequences` made for a call refused
        since."""
        del self._pages[count * self.num_planes:], self._lengths[count * self.num_planes:]
        self._block_tables = None

    def _grow(self, needed: int, like: torch.Tensor) -> None:
        """Enlarge the pool to hold `needed` pages more than the free ones (`CacheCapacityError` past `max_pages`)."""
        lay = self.kv_layout
        old = self.num_pages
        new = max(2 * old, old + needed, 4)
        if self.max_pages is not None:
            if old + needed > self.max_pages:
                raise CacheCapacityError(
                    f"PagedLoopCache capacity is {self.max_pages} pages of {self.page_size} positions; "
                    f"{self.pages_in_use} are in use and {len(self._free) + needed} more were requested. Raise "
                    "max_pages, lower the batch size or the number of new tokens, or pass max_pages=None to grow on "
                    "demand."
                )
            new = min(new, self.max_pages)
        shape = (lay.num_layers, new, self.page_size, lay.num_kv_heads, lay.head_dim)
        fill = float("nan") if self.debug else 0.0
        with torch.inference_mode(False):  # normal tensors, which take writes in and outside inference_mode alike
            k_pool = torch.full(shape, fill, dtype=like.dtype, device=like.device)
            v_pool = torch.full(shape, fill, dtype=like.dtype, device=like.device)
            tags = torch.full((lay.num_layers, new, self.page_size), -1, dtype=torch.long) if self.debug else None
        if old:
            k_pool[:, :old] = self.k_pool
            v_pool[:, :old] = self.v_pool
            if self.debug:
                tags[:, :old] = self.tags
        self.k_pool, self.v_pool, self.tags = k_pool, v_pool, tags
        self._refs.extend(0 for _ in range(new - old))
        self._free.extend(range(new - 1, old - 1, -1))

    def reserve_in_order(self, sequences: int, positions: int, like: torch.Tensor) -> None:
        """Give sequences 0 .. `sequences` - 1 of an empty cache `positions` valid positions in every plane, on pages
        0, 1, 2, ... taken table after table: table t holds its positions on pages t * n .. t * n + n - 1
        (n = ceil(positions / page_size)), one contiguous run of the pool (the wavefront engine reads each table as a
        view). Nothing is written: the positions hold what the pool holds until the caller writes them, and the
        caller truncates each table to what it wrote. `like`: a tensor in the KV dtype on the pool's device."""
        if self.num_sequences or self.pages_in_use:
            raise ValueError(f"reserve_in_order needs an empty cache (this one holds {self.num_sequences} sequences "
                             f"on {self.pages_in_use} pages); use a fresh PagedLoopCache.")
        per_table = -(-positions // self.page_size)
        tables = sequences * self.num_planes
        self.ensure_sequences(sequences)
        if self.k_pool is None or tables * per_table > self.num_pages:
            self._grow(max(tables * per_table - self.num_pages, 0), like)
        self._free = list(range(self.num_pages - 1, -1, -1))  # popped from the end: pages 0, 1, 2, ...
        for t in range(tables):
            self._pages[t] = [self._alloc(like) for _ in range(per_table)]
            self._lengths[t] = positions

    def fits_in_order(self, sequences: int, positions: int) -> bool:
        """Whether `reserve_in_order` / `repack_in_order` of `sequences` sequences of `positions` positions fits the
        capacity (always, without `max_pages`)."""
        return self.max_pages is None or sequences * self.num_planes * -(-positions // self.page_size) <= self.max_pages

    def repack_in_order(self, sequences: int, positions: int, like: torch.Tensor) -> None:
        """`reserve_in_order` for a cache that may hold histories: sequences 0 .. `sequences` - 1 (those it holds
        and new empty ones; it may hold no other, and no table more than `positions` positions) keep their stored
        positions, each table's moved by one device copy per pool (debug tags included) to where `reserve_in_order`
        puts them. Their valid lengths become `positions`, as there; the caller truncates each table to what it
        holds after its run. A fixed capacity too small for the layout raises `CacheCapacityError` before anything
        moves."""
        if self.num_sequences > sequences or max(self._lengths, default=0) > positions:
            raise ValueError(f"repack_in_order({sequences}, {positions}): the cache holds {self.num_sequences} "
                             f"sequences of up to {max(self._lengths, default=0)} positions.")
        if not self.fits_in_order(sequences, positions):  # checked before a page moves: the history stays
            raise CacheCapacityError(
                f"PagedLoopCache capacity is {self.max_pages} pages of {self.page_size} positions; this run reserves "
                f"{positions} positions in each of {self.num_planes} planes of {sequences} sequences up front. Raise "
                "max_pages, lower the batch size or the number of new tokens, or pass max_pages=None to grow on "
                "demand."
            )
        self.ensure_sequences(sequences)
        stored = list(self._lengths)  # per table
        pools = lambda: [pool.flatten(1, 2)  # noqa: E731  [layers, pages * page_size, ...] views
                         for pool in (self.k_pool, self.v_pool, self.tags) if pool is not None]
        kept = []  # [layers, stored positions, ...] per pool: copies
        if sum(stored):
            source = [self._pages[t][j // self.page_size] * self.page_size + j % self.page_size
                      for t, n in enumerate(stored) for j in range(n)]
            index = torch.tensor(source, device=self.k_pool.device)
            kept = [pool[:, index.to(pool.device)] for pool in pools()]
        for pages in self._pages:
            for page in pages:
                self._release(page)
        self._pages, self._lengths, self._block_tables = [], [], None
        self.reserve_in_order(sequences, positions, like)
        width = -(-positions // self.page_size) * self.page_size  # pool slots per table
        if kept:
            index = torch.tensor([t * width + j for t, n in enumerate(stored) for j in range(n)], device=like.device)
            for pool, rows in zip(pools(), kept):  # views of the (possibly grown) pools: the writes land in them
                pool[:, index.to(pool.device)] = rows.to(pool.dtype)

    def allocate_pool(self, like: torch.Tensor) -> None:
        """Allocate the whole fixed pool (`max_pages` pages) of an empty cache now, so that it never grows (and views
        of it, `PagedLoopCache.flat_pools`, stay valid). `like`: a tensor in the KV dtype on the pool's device."""
        if self.max_pages is None or self.k_pool is not None:
            raise ValueError("allocate_pool needs an empty cache with a fixed capacity (max_pages).")
        self._grow(self.max_pages, like)

    def scratch_page(self, like: torch.Tensor) -> int:
        """A page outside every table, in use for the cache's life: a caller's scratch space (the continuous
        manager's trash page, which masked rows write)."""
        return self._alloc(like)

    def reserve(self, seq: int, positions: int, like: torch.Tensor) -> None:
        """Give every plane of `seq` (created if new; it must hold no page) pages for `positions` positions, taken
        from the free pages, and make them its valid positions (as `reserve_in_order`: the caller writes them and
        tracks what it wrote; `free` returns them). With a fixed capacity and too few free pages,
        `CacheCapacityError`, and nothing is taken."""
        self.ensure_sequences(seq + 1)
        tables = range(seq * self.num_planes, (seq + 1) * self.num_planes)
        if any(self._pages[t] for t in tables):
            raise ValueError(f"reserve: sequence {seq} holds pages; free it first.")
        per_table = -(-positions // self.page_size)
        if per_table * len(tables) > len(self._free):
            self._grow(per_table * len(tables) - len(self._free), like)
        for t in tables:
            self._pages[t] = [self._alloc(like) for _ in range(per_table)]
            self._lengths[t] = positions
        self._block_tables = None

    def pages_of(self, seq: int, depth: int) -> list[int]:
        """The page ids of (seq, depth)'s table, in position order (a copy)."""
        return list(self._pages[self._table(seq, depth)])

    @property
    def free_pages(self) -> int:
        """Pages free without growing the pool."""
        return len(self._free)

    def _alloc(self, like: torch.Tensor) -> int:
        if not self._free:
            self._grow(1, like)
        page = self._free.pop()
        self._refs[page] = 1
        return page

    def _release(self, page: int) -> None:
        self._refs[page] -= 1
        if self._refs[page] == 0:
            self._free.append(page)

    def _writable_page(self, table: int, index: int, like: torch.Tensor) -> int:
        """Page `index` of `table`, allocated if missing and copied first if it is shared."""
        pages = self._pages[table]
        if index == len(pages):
            pages.append(self._alloc(like))
            self._block_tables = None
        page = pages[index]
        if self._refs[page] > 1:  # copy on write
            fresh = self._alloc(like)
            self.k_pool[:, fresh] = self.k_pool[:, page]
            self.v_pool[:, fresh] = self.v_pool[:, page]
            if self.debug:
                self.tags[:, fresh] = self.tags[:, page]
            self._release(page)
            pages[index] = fresh
            self._block_tables = None
            page = fresh
        return page

    def block_tables(self, device: torch.device) -> torch.Tensor:
        """`[num_tables, max_pages]` int32 page ids on `device` (entries past a table's pages are -1)."""
        if self._block_tables is None or self._block_tables.device != device:
            width = max([len(p) for p in self._pages] + [1])
            host = torch.full((len(self._pages), width), -1, dtype=torch.int32)
            for t, pages in enumerate(self._pages):
                host[t, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
            self._block_tables = host.to(device)
        return self._block_tables

    # --- rollback, forks ----------------------------------------------------------------------------------------
    def check_truncate(self, seq: int, depth: int, length: int) -> tuple[int, int, int]:
        """(seq, depth, length) as ints, after a `ValueError` for a cut `truncate` cannot make."""
        for name, value in (("seq", seq), ("depth", depth), ("length", length)):
            if not isinstance(value, numbers.Integral) or isinstance(value, bool):  # (a tensor would be stored)
                raise ValueError(f"truncate: {name}={value!r} must be an integer.")
        seq, depth, length = int(seq), int(depth), int(length)
        t = self._table(seq, depth)
        if not 0 <= length <= self._lengths[t]:
            raise ValueError(f"cannot truncate sequence {seq}, depth {depth} of length {self._lengths[t]} to "
                             f"{length}.")
        return seq, depth, length

    def check_roll_back(self, lengths: tuple[int, ...], reorders: int, cuts: int, tables: list[int]) -> None:
        """`ValueError` unless cutting `tables` back to `lengths` (a checkpoint's, taken after `reorders` selections and
        `cuts` cuts) restores what they held then: a roll back undoes additions, not a cut below those lengths
        (`crop`, `truncate`, `free`, `commit`, a promotion) even if the table grew back since, nor a selection
        (`reorder_cache`, `batch_select_indices`, `batch_repeat_interleave`) or a `reset`."""
        now = self._lengths + [0] * max(len(lengths) - len(self._lengths), 0)
        cut = [divmod(t, self.num_planes) for t in tables if lengths[t] and (now[t] < lengths[t] or next(
            (kept for at, kept in self._cut_log.get(t, ()) if at > cuts), lengths[t]) < lengths[t])]
        if lengths and (cut or reorders != self._reorders):
            what = f"cut (sequence, depth) {cut[:3]}" if cut else "selected, reordered or reset its sequences"
            raise ValueError(f"roll_back: since the checkpoint the cache {what}, which a roll back cannot undo (it "
                             "only drops what was added); take the checkpoint after such a change.")

    def _note_cut(self, table: int, length: int) -> None:
        """Log that `table` was cut to `length`: a later, shorter cut supersedes the earlier ones that kept as much or
        more, so each table's log holds cuts whose lengths increase with time (the first after a checkpoint's count
        is the shortest since then)."""
        self._cuts += 1
        log = self._cut_log.setdefault(table, [])
        while log and log[-1][1] >= length:
            log.pop()
        log.append((self._cuts, length))

    def truncate(self, seq: int, depth: int, length: int) -> None:
        """Keep only positions `0 .. length-1` of (seq, depth); pages no longer needed are freed."""
        seq, depth, length = self.check_truncate(seq, depth, length)
        t = self._table(seq, depth)
        if length < self._lengths[t]:
            self._note_cut(t, length)
        keep = -(-length // self.page_size)
        for page in self._pages[t][keep:]:
            self._release(page)
        del self._pages[t][keep:]
        self._lengths[t] = length
        self._block_tables = None

    def free(self, seq: int) -> None:
        """Release every page of `seq` (its slot stays, empty). Every plane's cut is checked before any is made: a
        refused free leaves the cache as it was."""
        for d in range(self.num_planes):
            self.check_truncate(seq, d, 0)
        for d in range(self.num_planes):
            self.truncate(seq, d, 0)

    def fork(self, seq: int) -> int:
        """A new sequence slot sharing all of `seq`'s pages (copy on write); returns its index. `seq` is checked
        before the slot is added."""
        if not isinstance(seq, numbers.Integral) or isinstance(seq, bool):
            raise ValueError(f"fork: seq={seq!r} must be an integer.")
        seq = int(seq)
        self._table(seq, 0)  # (a ValueError naming seq when it is no sequence of this cache)
        branch = self.num_sequences
        self.ensure_sequences(branch + 1)
        for d in range(self.num_planes):
            src, dst = self._table(seq, d), self._table(branch, d)
            self._pages[dst] = list(self._pages[src])
            self._lengths[dst] = self._lengths[src]
            for page in self._pages[dst]:
                self._refs[page] += 1
        return branch

    def commit(self, branch: int, into: int) -> None:
        """Make `into` hold what `branch` holds and leave `branch` empty (`into` another sequence: one committed into
        itself would be emptied)."""
        for name, seq in (("branch", branch), ("into", into)):
            if not is_integer(seq) or not 0 <= seq < self.num_sequences:
                raise ValueError(f"commit: {name}={seq!r} is not a sequence of this cache (it has "
                                 f"{self.num_sequences}).")
        if branch == into:
            raise ValueError(f"commit: branch={branch} and into={into} are one sequence; pass another to commit into.")
        for d in range(self.num_planes):
            src, dst = self._table(branch, d), self._table(into, d)
            self._note_cut(dst, 0)  # (its history replaced)
            self._note_cut(src, 0)  # (emptied)
            for page in self._pages[dst]:
                self._release(page)
            self._pages[dst], self._pages[src] = self._pages[src], []
            self._lengths[dst], self._lengths[src] = self._lengths[src], 0
        self._block_tables = None

    def _select(self, order: list[int]) -> None:
        """Sequence i becomes a (page-sharing) copy of old sequence order[i]."""
        if list(order) != list(range(self.num_sequences)):
            self._reorders, self._cut_log = self._reorders + 1, {}  # (the logs: of tables that are no more)
        old_pages, old_lengths = self._pages, self._lengths
        self._pages = [list(old_pages[s * self.num_planes + d]) for s in order for d in range(self.num_planes)]
        self._lengths = [old_lengths[s * self.num_planes + d] for s in order for d in range(self.num_planes)]
        for pages in self._pages:
            for page in pages:
                self._refs[page] += 1
        for pages in old_pages:
            for page in pages:
                self._release(page)
        self._block_tables = None
