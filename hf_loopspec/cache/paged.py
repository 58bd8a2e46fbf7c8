"""`PagedLoopCache`: per-depth paged KV storage for looped models, as a `transformers` Cache.

Storage model: see `cache.pages` (page pool, block tables, reference counting, copy on write, rollback).

The transformers view (`get_seq_length`)
----------------------------------------
transformers counts input *columns* (padding included); the cache stores real tokens only. Every plane records the
columns it has consumed (`columns`, and which of them are padding: `cache.columns`); `get_seq_length(layer_idx)` reports
those of the plane holding cache layer `layer_idx` (plane * num_layers + layer). After any run (plain or
speculative) a plane that the run wrote holds, for every sequence, exactly the real tokens of its consumed columns,
as plain decoding stores them: every column but the last generated one, the stop token and padding after an early
stop included. A plane that the run did not use (e.g. Huginn's draft-depth coda plane under plain decoding) keeps
its older count.

Invariants enforced on every write (`plan_rows`)
------------------------------------------------
* I2: no two rows of one call write the same (sequence, depth, position).
* Each table is written contiguously: the rows of a call that write table t cover exactly
  `length(t) .. length(t) + n - 1`. Writing an already valid position raises (truncate first, I4), and so does
  leaving a gap.
* I3 follows from `PagedKVAttention`: rows write before they attend, and a row reads only its own table up to
  its own position.

Debug mode (I1)
---------------
With `debug=True`, every written slot is tagged with the *lineage id* of the row that wrote it. A strategy
gives every token it computes an id and links it to its parent (the id of the token before it on the same
path) with `link_lineage`. Before attending, each row's read set is checked: position j of its table must carry
the id of its own ancestor at j. The first violation raises `LineageError` naming (sequence, depth, position,
layer). In debug mode memory the pool grows by is filled with NaN until written (pages freed and reused keep
the KV they held). Branch slots are tables like any other, so the check covers every read of every branch.

Branches (I5, `branches`: `cache.branches`)
-------------------------------------------
Competing proposals for one position (a sibling lane and its descendants) write to a *branch slot*: its plane-k
table is created on its first write to plane k and then shares the parent's pages for positions below the branch
point, which must all be written and are never rewritten while the branch is open (a truncation below the point
raises); the partly filled page is copied on the first write of either side. So each side reads only the common
history and its own writes (invariant B). Promoting a branch moves its page lists into the parent's tables without
copying; closing it releases its pages.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache

from ..looped import KVLayout, check_kv_continues
from ..models.layers import is_integer
from ..ops import attention as attention_ops
from . import lineage as lineage_checks
from .attention_layers import AttentionLayers
from .branches import BranchSlots
from .columns import ConsumedColumns
from .lineage import LineageError
from .pages import CacheCapacityError, PageTables
from .row_checks import RowChecks
from .rows import RowBatch
from .selection import sequence_indices

__all__ = ["CacheCapacityError", "FlatPools", "LineageError", "PagedKVAttention", "PagedLoopCache"]


PASSED_CACHE = "the cache passed (cache= or past_key_values=)"  # as errors about a call's cache name it


@dataclass(frozen=True)
class Checkpoint:
    """A `PagedLoopCache`'s state for `roll_back`: what its tables hold and the columns its planes consumed."""

    lengths: tuple[int, ...]  # [num_sequences * num_planes] stored positions per table
    columns: ConsumedColumns
    branches: tuple  # the open branches then (`BranchSlots.state`)
    reorders: int  # the selections that had changed the sequences' order or count (`PageTables.check_roll_back`)
    cuts: int  # the cuts made before it
    batch: int  # the batch's sequences (not branch slots)


@dataclass(frozen=True)
class FlatPools:
    """The KV pools of a `PagedLoopCache` as flat views (`PagedLoopCache.flat_pools`): slot
    `(layer * num_pages + page) * page_size + offset` holds the entry of `layer` at `page`, `offset`."""

    k: torch.Tensor  # [layers * num_pages * page_size, Hkv, D], a view of the cache's key pool: writes land in it
    v: torch.Tensor  # [layers * num_pages * page_size, Hkv, D], the values


class PagedLoopCache(AttentionLayers, RowChecks, PageTables, Cache):
    """Per-depth paged KV cache for looped models (storage: `PageTables`; HF view and invariants: module docstring).

    Args:
        layout: planes, layers, kv heads and head size of the model (`model.kv_layout`).
        page_size: positions per page.
        max_pages: fixed capacity in pages; `None` grows the pool on demand (doubling).
        debug: tag every written slot and check every read against the reader's lineage (I1).
    """

    is_compileable = False

    def __init__(self, layout: KVLayout, page_size: int = 16, max_pages: int | None = None, debug: bool = False):
        if not isinstance(layout, KVLayout):
            raise ValueError(f"layout: a {type(layout).__name__}; pass the model's KV layout: "
                             "PagedLoopCache(model.kv_layout).")
        PageTables.__init__(self, layout, page_size, max_pages, debug)  # (which checks the other arguments)
        Cache.__init__(self, layers=[])
        self._parents: dict[int, int] = {}  # debug: lineage id -> parent id (-1 for a first token)
        # HF view: the input columns (padding included) each plane has consumed, and which are padding
        self._columns = ConsumedColumns(layout.num_planes)
        self.branches = BranchSlots(self)  # branch-private slots of competing proposals (`cache.branches`, I5)

    # --- rows -------------------------------------------------------------------------------------------------
    def plan_rows(self, seq, depth, position, like: torch.Tensor, lineage=None) -> RowBatch:
        """Allocate the KV slots of one core call and return its `RowBatch`.

        `seq`, `depth`, `position` are equal-length int sequences (lists or 1-D tensors); `like` is any tensor on
        the compute device in the KV dtype; `lineage` (debug) gives each row's lineage id.
        """
        seq, depth, position = (x.tolist() if torch.is_tensor(x) else list(x) for x in (seq, depth, position))
        self._check_rows(seq, depth, position, like)
        stray = [s for s in set(seq) if s >= self.batch_size and s not in self.branches] if self.branches else []
        if stray:  # (a new sequence, or the slot of a branch closed since: closing the last branch drops them)
            raise ValueError(f"sequence {max(stray)} is no sequence of the batch and no open branch, but a branch is "
                             "open (competing proposals): close it (cache.branches.close_all()) before adding "
                             "sequences.")
        count = self.num_sequences
        self.ensure_sequences(max(seq, default=-1) + 1)
        try:  # (a refused call adds no sequence)
            tables, written = self._written(seq, depth, position, like)
        except (ValueError, CacheCapacityError):
            self._drop_sequences(count)
            raise
        for t, ps in written.items():  # each table's pages in order (its rows may come in any order)
            for index in sorted({p // self.page_size for p in ps}):
                self._writable_page(t, index, like)
        slots = [self._pages[t][p // self.page_size] * self.page_size + p % self.page_size
                 for t, p in zip(tables, position)]
        for t, ps in written.items():
            self._lengths[t] += len(ps)
        device = like.device
        as_long = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
        if lineage is not None:
            lineage = tuple(int(x) for x in (lineage.tolist() if torch.is_tensor(lineage) else lineage))
        return RowBatch(
            seq=as_long(seq),
            depth=as_long(depth),
            position=as_long(position),
            table=torch.tensor(tables, dtype=torch.int32, device=device),
            slot=as_long(slots),
            context_len=torch.tensor([p + 1 for p in position], dtype=torch.int32, device=device),
            block_tables=self.block_tables(device),
            lineage=lineage if self.debug else None,
        )

    def flat_pools(self) -> FlatPools:
        """The pools as flat views for a caller that addresses slots itself (the wavefront engine, after
        `reserve_in_order`: table t's position j is page-slot t * ceil(C / page_size) * page_size + j). The views
        share the cache's memory until the pool grows (a later `plan_rows` or reservation may replace it), so take
        them after reserving and do not keep them across a growth."""
        if self.k_pool is None:
            raise ValueError("flat_pools: this PagedLoopCache has no pool yet; call reserve_in_order (or write rows) "
                             "first.")
        flat = lambda pool: pool.view(-1, *pool.shape[-2:])  # noqa: E731
        return FlatPools(k=flat(self.k_pool), v=flat(self.v_pool))

    def attention(self, rows: RowBatch) -> PagedKVAttention:
        """The `KVAttention` that a model's core call over `rows` uses."""
        return PagedKVAttention(self, rows)

    # --- debug lineage ------------------------------------------------------------------------------------------
    def link_lineage(self, child: int, parent: int) -> None:
        """Debug: record that token id `child` follows token id `parent` (-1 for the first token)."""
        if self.debug:
            self._parents[child] = parent

    # --- history from an earlier call -------------------------------------------------------------------------
    def columns(self, plane: int = 0) -> int:
        """HF view: input columns (padding included) that `plane` has consumed; `ValueError` for a plane the layout
        lacks (a negative index would count from the end)."""
        if not is_integer(plane) or not 0 <= plane < self.kv_layout.num_planes:
            raise ValueError(f"plane={plane!r} is no loop depth of this cache: pass an integer in "
                             f"[0, {self.kv_layout.num_planes - 1}].")
        return self._columns.counts[plane]

    def set_columns(self, count: int, planes, attention_mask: torch.Tensor | None = None) -> None:
        """HF view: `planes` now hold every real token of the first `count` input columns, which `attention_mask`
        `[B, C]` marks (None, or a column past C: every token real; `cache.columns`). `ValueError` for a negative
        count or a plane the layout lacks."""
        planes = list(planes)
        if not is_integer(count) or count < 0:
            raise ValueError(f"count={count!r} must be an integer >= 0 (input columns consumed).")
        for plane in planes:
            self.columns(plane)  # (its check of the plane)
        self._columns.consume(count, planes, attention_mask)

    def check_layout(self, layout: KVLayout) -> None:
        """`ValueError` naming the cache (`PASSED_CACHE`) unless it was made for `layout`, the KV the call writes
        (another model's or other settings' cache: for Huginn the planes depend on num_steps)."""
        if self.kv_layout != layout:
            raise ValueError(f"{PASSED_CACHE}: the PagedLoopCache was made for {self.kv_layout}, but this call "
                             f"writes {layout} (for Huginn: the planes depend on num_steps); create it with "
                             "PagedLoopCache(model.kv_layout) under the same settings (inside model.recurrence("
                             "num_steps=...) for a Huginn call's num_steps), or pass none.")

    def check_pool(self, dtype: torch.dtype, device) -> None:
        """`ValueError` naming the cache when the pool holds another dtype or device than the model's activations
        (`dtype`, `device`): a cache continues on the model, dtype and device that filled it (`check_kv_continues`)."""
        check_kv_continues(self, dtype, device)

    def check_stored(self, attention_mask: torch.Tensor) -> None:
        """Raise unless every sequence stores exactly the real tokens that `attention_mask` `[B, >= columns]`
        marks in the columns the cache has consumed (the cache belongs to these inputs)."""
        past = self.columns()
        if past and self.num_sequences > len(attention_mask):
            raise ValueError(f"the PagedLoopCache holds {self.num_sequences} sequences, but attention_mask has "
                             f"{len(attention_mask)} rows: pass the mask of every sequence it holds (to keep some, "
                             "select them first: cache.batch_select_indices(indices)).")
        stored = [self.length(s, 0) if s < self.num_sequences else 0 for s in range(len(attention_mask))]
        marked = attention_mask[:, :past].bool().sum(-1).tolist()
        if stored != marked:
            raise ValueError(
                f"the PagedLoopCache stores {stored} tokens per sequence, but attention_mask marks {marked} real "
                f"tokens in the {past} columns the cache has consumed: pass the ids and mask that filled the cache "
                "with the new tokens appended, or a fresh cache"
                + (f" (it holds {self.num_sequences} sequences, the input has batch size {len(attention_mask)}: "
                   "beam search and num_return_sequences > 1 expand the batch)." if past and self.num_sequences
                   < len(attention_mask) else "."))

    def extend_plane_from(self, seq: int, plane: int, source: int) -> None:
        """Extend `plane` of `seq` to the length of plane `source` with copies of `source`'s KV (and debug tags).

        For a plane that only steers drafts: a history decoded without drafting lacks the draft-depth plane of
        a head with KV, and borrowing the target plane's entries there changes which tokens are proposed, never
        which are committed.
        """
        dst, src = self._table(seq, plane), self._table(seq, source)
        start, end = self._lengths[dst], self._lengths[src]
        if end <= start:
            return
        positions = range(start, end)
        pages = [self._writable_page(dst, p // self.page_size, self.k_pool) for p in positions]
        to_slots = [page * self.page_size + p % self.page_size for page, p in zip(pages, positions)]
        from_slots = [self._pages[src][p // self.page_size] * self.page_size + p % self.page_size for p in positions]
        for pool in (self.k_pool, self.v_pool) + ((self.tags,) if self.debug else ()):
            flat = pool.view(pool.shape[0], -1, *pool.shape[3:])  # [layers, pages * page_size, ...]
            flat[:, to_slots] = flat[:, from_slots]
        self._lengths[dst] = end
        self._block_tables = None

    def adopt_history(self, seq: int, lineage: list[int]) -> None:
        """Debug: make the stored positions of `seq` the path `lineage` (one id per position, a chain), so that
        tokens of a new call that descend from `lineage[-1]` read them as their own history (I1)."""
        if self.debug:
            lineage_checks.adopt(self, seq, lineage)

    @contextmanager
    def kept_on_error(self):
        """A context in which a call may add to the cache: if it raises (a full fixed-capacity pool, a stopping
        criterion or streamer that raises, Ctrl-C), it is rolled back to its entry `checkpoint` and the exception
        propagates, so the conversation goes on from what the cache held before. Where the context cut or reordered
        what the cache held, it cannot (`roll_back`): the cache stays as the error left it, which a note on the
        exception says."""
        checkpoint = self.checkpoint()
        try:
            yield self
        except BaseException as error:
            try:
                self.roll_back(checkpoint)
            except ValueError as refused:
                error.add_note(f"hf_loopspec: the cache was not rolled back: {refused}")
            raise

    def checkpoint(self) -> Checkpoint:  # what `roll_back` returns the cache to
        return Checkpoint(tuple(self._lengths), self._columns.copy(), self.branches.state(), self._reorders,
                          self._cuts, self.batch_size)

    def roll_back(self, checkpoint: Checkpoint) -> None:
        """Undo the additions since `checkpoint`: branches as then (`BranchSlots.restore`), each table of the batch's
        sequences and of the branches still open cut back to its length then, sequences added since dropped, the
        consumed columns restored. `ValueError`, the cache unchanged, where a cut or a selection since took tokens
        that the checkpoint held (`PageTables.check_roll_back`)."""
        planes, lengths = self.num_planes, checkpoint.lengths
        kept = self.branches.kept(checkpoint.branches)
        self.check_roll_back(lengths, checkpoint.reorders, checkpoint.cuts,
                             [s * planes + d for s in (*range(checkpoint.batch), *kept) for d in range(planes)])
        self.branches.restore(checkpoint.branches)
        keep = min(max([checkpoint.batch, *(s + 1 for s in kept)]) * planes, len(lengths))
        for t in range(len(self._lengths)):
            seq, plane = divmod(t, planes)
            self.truncate(seq, plane, min(self._lengths[t], lengths[t] if t < keep else 0))
        del self._pages[keep:], self._lengths[keep:]
        self.ensure_sequences(keep // planes)  # (sequences empty then, which a roll back to an older one dropped)
        self._columns = checkpoint.columns.copy()
        self._block_tables = None

    # --- transformers Cache API ---------------------------------------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        """The columns consumed by the plane of cache layer `layer_idx` (negative: from the last, as a list index,
        which is how a `DynamicCache` reads it; past the last layer: 0)."""
        if not is_integer(layer_idx) or layer_idx < -len(self):
            raise ValueError(f"layer_idx={layer_idx!r}: pass a cache layer index, an integer in [{-len(self)}, "
                             f"{len(self)}) (plane * {self.kv_layout.num_layers} + layer).")
        plane = (layer_idx + len(self) if layer_idx < 0 else layer_idx) // self.kv_layout.num_layers
        return self.columns(plane) if plane < self.num_planes else 0

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        """`(kv_length, kv_offset)` as a `DynamicCache` answers: the columns consumed plus `query_length`, offset 0."""
        return self.get_seq_length(layer_idx) + query_length, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        """-1: no fixed length per layer (the tables take pages from one pool, shared by every table)."""
        return -1

    def __len__(self) -> int:
        """The cache layers transformers indexes: one per (plane, layer), `plane * num_layers + layer`."""
        return self.num_planes * self.kv_layout.num_layers

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(sequences={self.num_sequences}, columns={self._columns}, "
                f"pages_in_use={self.pages_in_use}, page_size={self.page_size}, max_pages={self.max_pages})")

    @property
    def batch_size(self) -> int:
        """The batch's sequences (an open branch's slot is none of them); 0 before the first call."""
        return self.branches.batch_sequences

    def check_batch(self, batch: int, name: str) -> None:
        """`ValueError` unless a call of `batch` rows (its input `name`) can continue this cache: no open branch, and
        at most `batch` sequences (a fresh cache adds the missing ones)."""
        self._refuse_open_branches("continuing it")
        if self.num_sequences > batch:
            raise ValueError(f"the PagedLoopCache holds {self.num_sequences} sequences but {name} has batch size "
                             f"{batch}; pass a cache filled for this batch, or a fresh one.")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Sequence i becomes a copy of old sequence `beam_idx[i]` (integer indices, negative ones from the end)."""
        self._select(sequence_indices(beam_idx, "beam_idx", self.num_sequences, masks=False))

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Each sequence, `repeats` times in a row (0 empties the cache)."""
        if not is_integer(repeats) or repeats < 0:
            raise ValueError(f"repeats={repeats!r} must be an integer >= 0.")
        self._select([s for s in range(self.num_sequences) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the sequences `indices` names, in its order: integer indices (negative ones from the end), or a
        boolean mask over the sequences, as transformers' caches take them."""
        self._select(sequence_indices(indices, "indices", self.num_sequences, masks=True))

    def _select(self, order: list[int]) -> None:
        """`PageTables._select`, refused while a branch is open (its slot is no sequence of the batch)."""
        self._refuse_open_branches("selecting, reordering or repeating its sequences")
        super()._select(order)
        self._columns.select(order)
        if not order:  # an empty cache consumed no columns: the next call starts afresh, at any batch size
            self.reset()

    def _refuse_open_branches(self, doing: str) -> None:
        """`ValueError` while a branch is open: its slot is no sequence of the batch."""
        if self.branches:
            raise ValueError(f"the PagedLoopCache has {len(self.branches)} open branch(es) (competing proposals); "
                             f"close them (cache.branches.close_all()) before {doing}.")

    def crop(self, tokens_to_remove: int) -> None:
        """HF view (transformers 5 convention): a negative `tokens_to_remove` forgets that many of the last input
        columns of every plane; each sequence keeps the tokens of the columns that remain (`cache.columns`)."""
        if torch.is_tensor(tokens_to_remove) and tokens_to_remove.ndim == 0:
            tokens_to_remove = tokens_to_remove.item()
        if not is_integer(tokens_to_remove) or tokens_to_remove > 0:
            raise ValueError(f"crop({tokens_to_remove!r}): pass a negative number of columns to remove (an "
                             "integer), as for transformers' caches.")
        keep = max(self.columns() + int(tokens_to_remove), 0)
        planes = [d for d in range(self.num_planes) if self.columns(d) > keep]
        cuts = [(s, d, min(length, self._columns.real(s, keep))) for d in planes
                for s, length in enumerate(self.lengths(d))]
        for cut in cuts:  # every cut is checked before any is made: a refused crop leaves the cache as it was
            self.check_truncate(*cut)
        for cut in cuts:
            self.truncate(*cut)
        self._columns.crop(keep)

    def check_truncate(self, seq: int, depth: int, length: int) -> tuple[int, int, int]:
        """`PageTables.check_truncate`; a `ValueError` for a cut of an open branch's common history (invariant B)."""
        checked = super().check_truncate(seq, depth, length)
        self.branches.check_truncate(*checked)
        return checked

    def fork(self, seq: int) -> int:
        """`PageTables.fork`, the new slot with `seq`'s padding; refused under an open branch (its close drops it)."""
        self._refuse_open_branches("forking a sequence")
        self._columns.fork(branch := super().fork(seq), int(seq))  # (seq checked first, by PageTables.fork)
        return branch

    def commit(self, branch: int, into: int) -> None:
        """`PageTables.commit`, `into` taking `branch`'s padding too (`crop` keeps its real tokens); refused under an
        open branch (its slots are the branch API's: `cache.branches.promote`)."""
        self._refuse_open_branches("committing a sequence")
        super().commit(branch, into)
        self._columns.move(branch, into)

    def reset(self) -> None:
        """Empty the cache, its page pool too (as transformers' caches: `is_initialized` is False again), so that the
        next call may write KV of another dtype or device."""
        self.branches.close_all()
        self._pages, self._lengths, self._columns = [], [], ConsumedColumns(self.num_planes)
        self._reorders, self._cut_log = self._reorders + 1, {}  # (`roll_back` refuses a checkpoint from before)
        self._parents.clear()
        self._block_tables = None
        self.k_pool = self.v_pool = self.tags = None
        self._refs, self._free = [], []

    @property
    def is_initialized(self) -> bool:
        return self.k_pool is not None


class PagedKVAttention:
    """`KVAttention` over a `PagedLoopCache` for one `RowBatch`: rows write their KV, then attend (I3)."""

    def __init__(self, cache: PagedLoopCache, rows: RowBatch):
        self.cache = cache
        self.rows = rows
        self.scale = cache.kv_layout.head_dim**-0.5

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [N, Hq, D]   k, v: [N, Hkv, D]
        cache, rows = self.cache, self.rows
        k_pool, v_pool = cache.k_pool[layer_idx], cache.v_pool[layer_idx]  # [pages, page_size, Hkv, D]
        attention_ops.write_kv(k, v, k_pool, v_pool, rows.slot)
        if cache.debug:
            lineage_checks.tag_and_check(cache, layer_idx, rows)
        return attention_ops.paged_attention(
            q, k_pool, v_pool, rows.block_tables, rows.table, rows.context_len, self.scale
        )
