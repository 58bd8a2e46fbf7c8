"""PagedLoopCache: allocator invariants, row planning (I2, contiguity), the I1 checker, and the plain
`generate` path backed by the paged cache compared with the DynamicCache path."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from helpers import tiny_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from inputs import left_pad, random_prompts
from paged_utils import LAYOUT, LIKE, fill_values, paged_plane, read_values, write
from tolerances import assert_fp32_close, ouro_depth
from transformers import DynamicCache
from transformers.generation import utils as generation_utils

from hf_loopspec import KVLayout, PagedLoopCache
from hf_loopspec.cache.paged import CacheCapacityError, LineageError

DeferredStopCheck = getattr(generation_utils, "DeferredStopCheck", None)


class NoEvent:
    """`torch.Event`'s methods where the device has none to wait for."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args):
        pass

    def synchronize(self):
        pass


def _tags(cache: PagedLoopCache, seq: int, depth: int, n: int) -> torch.Tensor:
    """Debug lineage tags `[layers, n]` of positions 0..n-1 of (seq, depth), read through the block table."""
    pages = torch.tensor(cache._pages[seq * cache.num_planes + depth], dtype=torch.long)
    position = torch.arange(n)
    return cache.tags[:, pages[position // cache.page_size], position % cache.page_size]


class TestAllocator:
    def test_rows_get_distinct_slots_and_grow_the_pool(self):
        cache = PagedLoopCache(LAYOUT, page_size=4)
        rows = cache.plan_rows([0, 0, 1, 1, 0], [0, 0, 0, 2, 1], [0, 1, 0, 0, 0], like=LIKE)
        assert len(set(rows.slot.tolist())) == 5
        assert rows.context_len.tolist() == [1, 2, 1, 1, 1]
        assert rows.table.tolist() == [0, 0, 3, 5, 1]
        rows = write(cache, 0, 0, list(range(2, 40)))
        assert cache.length(0, 0) == 40
        assert cache.pages_in_use == 10 + 3  # 40 positions / 4, plus one page for each other table

    def test_duplicate_write_address_raises(self):
        cache = PagedLoopCache(LAYOUT, page_size=4)
        with pytest.raises(ValueError, match="I2"):
            cache.plan_rows([0, 0], [1, 1], [0, 0], like=LIKE)

    def test_non_contiguous_or_overwriting_writes_raise(self):
        cache = PagedLoopCache(LAYOUT, page_size=4)
        write(cache, 0, 0, [0, 1, 2])
        with pytest.raises(ValueError, match="contiguously"):
            write(cache, 0, 0, [4])  # gap
        with pytest.raises(ValueError, match="truncate"):
            write(cache, 0, 0, [2])  # rewrite without rollback
        cache.truncate(0, 0, 2)
        write(cache, 0, 0, [2])

    def test_capacity_error_names_capacity_and_request(self):
        cache = PagedLoopCache(LAYOUT, page_size=2, max_pages=3)
        write(cache, 0, 0, [0, 1, 2, 3, 4, 5])
        with pytest.raises(CacheCapacityError, match="capacity is 3 pages"):
            write(cache, 0, 0, [6])

    def test_invalid_arguments(self):
        with pytest.raises(ValueError, match="page_size"):
            PagedLoopCache(LAYOUT, page_size=0)
        cache = PagedLoopCache(LAYOUT)
        with pytest.raises(ValueError, match="depth=3"):
            cache.plan_rows([0], [3], [0], like=LIKE)

    def test_fork_shares_full_pages_and_copies_the_partial_page_on_write(self):
        cache = PagedLoopCache(LAYOUT, page_size=4)
        rows = write(cache, 0, 0, list(range(6)))
        fill_values(cache, rows, torch.arange(6, dtype=torch.float32)[:, None, None])
        used = cache.pages_in_use
        branch = cache.fork(0)
        assert cache.pages_in_use == used  # nothing copied yet
        rows = write(cache, branch, 0, [6])
        fill_values(cache, rows, 100.0)
        assert cache.pages_in_use == used + 1  # the partial page was copied, the full one is still shared
        assert cache._pages[branch * 3][0] == cache._pages[0][0]
        assert read_values(cache, 0, 0) == [0, 1, 2, 3, 4, 5]
        assert read_values(cache, branch, 0) == [0, 1, 2, 3, 4, 5, 100]
        cache.commit(branch, into=0)
        assert read_values(cache, 0, 0) == [0, 1, 2, 3, 4, 5, 100]
        assert cache.length(branch, 0) == 0
        assert cache.pages_in_use == 2

    def test_truncate_frees_pages(self):
        cache = PagedLoopCache(LAYOUT, page_size=4)
        write(cache, 0, 1, list(range(9)))
        assert cache.pages_in_use == 3
        cache.truncate(0, 1, 4)
        assert cache.pages_in_use == 1 and cache.length(0, 1) == 4
        cache.free(0)
        assert cache.pages_in_use == 0

    @pytest.mark.parametrize("args", [(0, 1, torch.tensor(2)), (0, 1, 2.5), ("0", 1, 2), (True, 1, 2)])
    def test_truncate_takes_integers_only(self, args):
        """A tensor length was stored in the page tables, True truncated sequence 1, and the others failed with a
        TypeError from inside."""
        cache = PagedLoopCache(LAYOUT, page_size=4)
        write(cache, 0, 1, list(range(9)))
        with pytest.raises(ValueError, match=r"truncate: (seq|length)=.* must be an integer"):
            cache.truncate(*args)
        assert cache.length(0, 1) == 9

    @pytest.mark.parametrize("max_pages", [None, 2 * 3 * 3])
    def test_reserve_in_order_lays_tables_out_contiguously(self, max_pages):
        """`reserve_in_order`: every (sequence, plane) table of the batch gets its positions on consecutive pages,
        table after table from page 0 (block table t = pages t * n .. t * n + n - 1), the same slots a row planned
        at each position gets, and valid lengths as if written; the tables then truncate like written ones. A cache
        that is not empty, or too small, is refused."""
        cache = PagedLoopCache(LAYOUT, page_size=4, max_pages=max_pages)
        cache.reserve_in_order(2, 10, like=LIKE)  # 3 pages per table, 2 sequences x 3 planes
        n = 3
        assert cache.block_tables(torch.device("cpu")).tolist() == [list(range(t * n, t * n + n)) for t in range(6)]
        assert [cache.length(s, d) for s in range(2) for d in range(3)] == [10] * 6
        assert cache.pages_in_use == 6 * n
        planned = PagedLoopCache(LAYOUT, page_size=4)  # a fresh cache written row by row in table order
        slots = [write(planned, s, d, list(range(10))).slot.tolist() for s in range(2) for d in range(3)]
        assert slots == [[t * n * 4 + p for p in range(10)] for t in range(6)]
        cache.truncate(1, 2, 5)
        assert cache.length(1, 2) == 5 and cache.pages_in_use == 6 * n - 1
        with pytest.raises(ValueError, match="empty cache"):
            cache.reserve_in_order(1, 4, like=LIKE)
        with pytest.raises(CacheCapacityError, match="capacity is 2 pages"):
            PagedLoopCache(LAYOUT, page_size=4, max_pages=2).reserve_in_order(1, 4, like=LIKE)

    def test_reserve_takes_free_pages_per_sequence_and_free_returns_them(self):
        """`allocate_pool`, `scratch_page`, `reserve`, `pages_of`, `free` (a continuous manager's pool): a fixed pool
        allocated at once; a sequence reserved in any order gets ceil(positions / page_size) distinct pages per plane,
        none shared with another sequence or the scratch page, with valid lengths as if written; too few free pages
        raise `CacheCapacityError` and take nothing; `free` returns them, and a later reservation reuses them."""
        cache = PagedLoopCache(LAYOUT, page_size=4, max_pages=1 + 2 * 3 * 3)
        cache.allocate_pool(LIKE)
        scratch = cache.scratch_page(LIKE)
        assert cache.num_pages == 19 and cache.free_pages == 18
        cache.reserve(1, 10, LIKE)  # 3 pages per plane
        cache.reserve(0, 5, LIKE)  # 2 pages per plane
        held = {s: [cache.pages_of(s, d) for d in range(3)] for s in (0, 1)}
        assert [len(p) for p in held[0] + held[1]] == [2] * 3 + [3] * 3
        lent = [page for pages in held[0] + held[1] for page in pages]
        assert len(set(lent)) == len(lent) and scratch not in lent
        assert [cache.length(1, d) for d in range(3)] == [10] * 3 and cache.free_pages == 3
        with pytest.raises(CacheCapacityError, match="capacity is 19 pages"):
            cache.reserve(2, 8, LIKE)  # 2 pages per plane: 6 > 3 free
        assert cache.free_pages == 3 and cache.pages_of(2, 0) == []
        with pytest.raises(ValueError, match="sequence 0 holds pages; free it first"):
            cache.reserve(0, 4, LIKE)
        cache.free(1)
        assert cache.free_pages == 12
        cache.reserve(2, 8, LIKE)
        assert {p for d in range(3) for p in cache.pages_of(2, d)} <= set(lent) - set(p for ps in held[0] for p in ps)
        with pytest.raises(ValueError, match="allocate_pool needs an empty cache with a fixed capacity"):
            PagedLoopCache(LAYOUT, page_size=4).allocate_pool(LIKE)

    def test_flat_pools_address_the_reserved_tables_in_order(self):
        """`flat_pools` after `reserve_in_order`: slot `layer * num_pages * page_size + t * W + j` of the flat views is
        position j of table t (= sequence * planes + plane) in that layer, as read back through the block tables;
        the views share the cache's memory (a write through them is what the cache holds). Before any pool it is
        refused."""
        cache = PagedLoopCache(LAYOUT, page_size=4)
        with pytest.raises(ValueError, match="no pool yet; call reserve_in_order"):
            cache.flat_pools()
        cache.reserve_in_order(2, 10, like=LIKE)  # W = 12: 3 pages of 4 per table, 2 sequences x 3 planes
        pools = cache.flat_pools()
        heads, dim = LAYOUT.num_kv_heads, LAYOUT.head_dim
        layer_slots = cache.num_pages * 4
        assert pools.k.shape == pools.v.shape == (LAYOUT.num_layers * layer_slots, heads, dim)
        assert pools.k.dtype == LIKE.dtype
        for layer in range(LAYOUT.num_layers):
            for t in range(6):
                slots = layer * layer_slots + t * 12 + torch.arange(10)
                written = torch.arange(10 * heads * dim, dtype=torch.float32).view(10, heads, dim)
                written = written + 1000 * (layer * 6 + t)  # distinct per layer, table, position and entry
                pools.k[slots], pools.v[slots] = written, -written
                keys, values = paged_plane(cache, *divmod(t, 3), layer, 10)
                assert torch.equal(keys, written) and torch.equal(values, -written)

    @pytest.mark.parametrize("debug", [False, True])
    def test_repack_in_order_keeps_the_stored_history(self, debug):
        """`repack_in_order` on a cache written row by row, tables interleaved on the pages (as decoding leaves
        them): the block tables become `reserve_in_order`'s (table after table from page 0, one more sequence
        included) and every stored position of every table and layer keeps its keys, values and debug tag; lengths
        are the reserved positions. A cache with more sequences, or longer tables, than asked is refused."""
        cache = PagedLoopCache(LAYOUT, page_size=4, debug=debug)
        lengths = {(0, 0): 6, (0, 1): 6, (0, 2): 5, (1, 0): 9, (1, 1): 9, (1, 2): 9}
        for step in range(9):  # one position per table at a time: consecutive pages belong to other tables
            for (s, d), n in lengths.items():
                if step < n:
                    write(cache, s, d, [step])
        generator = torch.Generator().manual_seed(0)  # distinct values per layer, table, position and entry
        cache.k_pool.normal_(generator=generator), cache.v_pool.normal_(generator=generator)
        if debug:
            cache.tags.copy_(torch.arange(cache.tags.numel()).view_as(cache.tags))
        stored = {(s, d, layer): paged_plane(cache, s, d, layer, n)
                  for (s, d), n in lengths.items() for layer in range(LAYOUT.num_layers)}
        tags = {(s, d): _tags(cache, s, d, n) for (s, d), n in lengths.items()} if debug else {}
        cache.repack_in_order(3, 10, like=LIKE)
        n = 3  # pages per table
        assert cache.block_tables(torch.device("cpu")).tolist() == [list(range(t * n, t * n + n)) for t in range(9)]
        assert [cache.length(s, d) for s in range(3) for d in range(3)] == [10] * 9
        for (s, d, layer), (keys, values) in stored.items():
            got = paged_plane(cache, s, d, layer, len(keys))
            assert torch.equal(got[0], keys) and torch.equal(got[1], values), (s, d, layer)
        for (s, d), tag in tags.items():
            assert torch.equal(_tags(cache, s, d, tag.shape[1]), tag)
        with pytest.raises(ValueError, match="holds 3 sequences"):
            cache.repack_in_order(2, 10, like=LIKE)
        with pytest.raises(ValueError, match="up to 10 positions"):
            cache.repack_in_order(3, 9, like=LIKE)

    def test_memory_report(self):
        cache = PagedLoopCache(LAYOUT)
        assert cache.bytes_per_token_per_depth(torch.bfloat16) == 2 * 2 * 2 * 4 * 2
        assert cache.bytes_per_token_per_depth(torch.float32) == 2 * 2 * 2 * 4 * 4
        for dtype in (torch.int8, "float16"):  # (torch's TypeError from finfo before)
            with pytest.raises(ValueError, match=rf"dtype={dtype!r}: pass a floating torch dtype"):
                cache.bytes_per_token_per_depth(dtype)

    def test_lengths_refuses_a_depth_outside_the_planes(self):
        """As `length` does: a negative depth read another plane's entries (another sequence's), one past the
        planes raised IndexError; a float or string depth, or a float sequence, raised a TypeError (on an empty cache
        a float depth returned []), and True read plane 1. A numpy integer is an integer."""
        cache = PagedLoopCache(LAYOUT)
        cache.ensure_sequences(2)
        assert cache.lengths(LAYOUT.num_planes - 1) == cache.lengths(np.int64(LAYOUT.num_planes - 1)) == [0, 0]
        for depth in (-1, LAYOUT.num_planes, 0.5, 1.0, "0", True):
            with pytest.raises(ValueError, match=rf"depth={re.escape(repr(depth))} must be an integer in "
                                                 rf"\[0, {LAYOUT.num_planes - 1}\]"):
                cache.lengths(depth)
        with pytest.raises(ValueError, match=r"seq=0\.5 is not a sequence of this cache \(it has 2\)"):
            cache.length(0.5, 0)
        assert cache.length(np.int64(1), np.int64(0)) == 0


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("write"), st.integers(0, 2), st.integers(0, 2), st.integers(1, 6)),
        st.tuples(st.just("truncate"), st.integers(0, 2), st.integers(0, 2), st.integers(0, 12)),
        st.tuples(st.just("fork"), st.integers(0, 2)),
        st.tuples(st.just("commit"), st.integers(0, 5), st.integers(0, 2)),
        st.tuples(st.just("free"), st.integers(0, 5)),
    ),
    max_size=40,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(OPS)
def test_allocator_matches_a_model_of_lists(ops):
    """Random allocate/truncate/fork/commit/free sequences against a plain-list model of every table's
    contents: contents, lengths, reference counts and the free list always agree."""
    cache = PagedLoopCache(LAYOUT, page_size=3)
    model: dict[tuple[int, int], list[float]] = {}
    counter = iter(range(1, 10**6))
    cache.ensure_sequences(3)
    for op in ops:
        if op[0] == "write":
            _, s, d, n = op
            if s >= cache.num_sequences:
                continue
            start = cache.length(s, d)
            rows = write(cache, s, d, list(range(start, start + n)))
            values = [float(next(counter)) for _ in range(n)]
            fill_values(cache, rows, torch.tensor(values)[:, None, None])
            model.setdefault((s, d), []).extend(values)
        elif op[0] == "truncate":
            _, s, d, n = op
            if s >= cache.num_sequences:
                continue
            n = min(n, cache.length(s, d))
            cache.truncate(s, d, n)
            model[(s, d)] = model.get((s, d), [])[:n]
        elif op[0] == "fork" and op[1] < cache.num_sequences:
            branch = cache.fork(op[1])
            for d in range(3):
                model[(branch, d)] = list(model.get((op[1], d), []))
        elif op[0] == "commit" and max(op[1], op[2]) < cache.num_sequences and op[1] != op[2]:
            cache.commit(op[1], into=op[2])
            for d in range(3):
                model[(op[2], d)], model[(op[1], d)] = model.get((op[1], d), []), []
        elif op[0] == "free" and op[1] < cache.num_sequences:
            cache.free(op[1])
            for d in range(3):
                model[(op[1], d)] = []
        # invariants after every operation
        for s in range(cache.num_sequences):
            for d in range(3):
                assert read_values(cache, s, d) == model.get((s, d), [])
        refs = [0] * cache.num_pages
        for pages in cache._pages:
            for page in pages:
                refs[page] += 1
        assert refs == cache._refs
        assert sorted(cache._free) == [p for p in range(cache.num_pages) if refs[p] == 0]


class TestLineageChecker:
    def make(self):
        cache = PagedLoopCache(KVLayout(2, 1, 1, 4), page_size=2, debug=True)
        for child, parent in [(10, -1), (11, 10), (12, 11), (21, 10), (22, 21)]:
            cache.link_lineage(child, parent)
        return cache

    def attend(self, cache, rows):
        q = torch.randn(rows.num_rows, 1, 4)
        return cache.attention(rows)(0, q, torch.randn(rows.num_rows, 1, 4), torch.randn(rows.num_rows, 1, 4))

    def test_own_history_passes(self):
        cache = self.make()
        out = self.attend(cache, write(cache, 0, 0, [0, 1, 2], lineage=[10, 11, 12]))
        assert torch.isfinite(out).all()

    def test_reading_another_branch_is_reported_with_its_address(self):
        cache = self.make()
        self.attend(cache, write(cache, 0, 0, [0, 1], lineage=[10, 11]))
        # lineage 22 descends from 21 (not 11) at position 1: position 1 holds branch 11's KV
        with pytest.raises(LineageError, match="sequence 0, depth 0, position 2 reads position 1 at layer 0"):
            self.attend(cache, write(cache, 0, 0, [2], lineage=[22]))

    def test_rewritten_position_after_rollback_passes(self):
        cache = self.make()
        self.attend(cache, write(cache, 0, 0, [0, 1], lineage=[10, 11]))
        cache.truncate(0, 0, 1)
        self.attend(cache, write(cache, 0, 0, [1, 2], lineage=[21, 22]))

    def test_pool_is_poisoned_with_nan_in_debug_mode(self):
        cache = self.make()
        write(cache, 0, 0, [0], lineage=[10])
        assert torch.isnan(cache.k_pool).any()


def model_and_batch(seed: int = 0):
    """A tiny GQA Ouro with U = 3 (three planes) and a left-padded batch of three prompts (9, 5 and 8 tokens)."""
    model, _ = tiny_model(seed, num_key_value_heads=2, total_ut_steps=3, eos_token_id=None)
    return model, *left_pad(random_prompts(seed, [9, 5, 8], model.config.vocab_size))


class TestPlainGenerateOnPagedCache:
    @pytest.mark.skipif(DeferredStopCheck is None, reason="transformers < 5.25 has no deferred stop check")
    def test_plain_generate_defers_its_stop_check_as_on_mps(self, monkeypatch):
        """On mps, transformers' plain loop checks for a stop one step late and undoes the extra step by `crop(-1)`,
        first asking the cache how many recurrent states to record: taken over `Cache.layers`, which a
        PagedLoopCache leaves empty (`max()` of nothing, a ValueError). Run here on a CPU by taking mps' branch."""
        on_mps = DeferredStopCheck.is_supported
        monkeypatch.setattr(DeferredStopCheck, "is_supported", staticmethod(
            lambda device, *args, **kwargs: on_mps(torch.device("mps"), *args, **kwargs)))
        monkeypatch.setattr(torch, "Event", NoEvent)  # (a CPU has no events: its copies are done when issued)
        model, ids, mask = model_and_batch()
        settings = {"attention_mask": mask, "max_new_tokens": 5, "do_sample": False, "speculative_mode": None}
        dense = model.generate(ids, cache=DynamicCache(), **settings)
        paged = PagedLoopCache(model.kv_layout, debug=True)
        assert torch.equal(model.generate(ids, cache=paged, **settings), dense)
        assert paged.get_seq_length() == dense.shape[1] - 1  # the extra step undone

    def test_forward_logits_match_dynamic_cache_with_padding_and_chunks(self):
        model, ids, mask = model_and_batch()
        paged, dense = PagedLoopCache(model.kv_layout, page_size=4, debug=True), DynamicCache()
        for a, b in [(0, 5), (5, 8), (8, 9)]:
            out_p = model(ids[:, a:b], attention_mask=mask[:, :b], cache=paged).logits
            out_d = model(ids[:, a:b], attention_mask=mask[:, :b], cache=dense).logits
            real = mask[:, a:b].bool()
            assert_fp32_close(out_p[real], out_d[real], **ouro_depth(model.config))
        assert paged.get_seq_length() == 9
        assert [paged.length(s, 2) for s in range(3)] == mask.sum(-1).tolist()
        layers = model.config.num_hidden_layers
        assert [paged.get_seq_length(p * layers + 1) for p in range(paged.num_planes)] == [9] * paged.num_planes
        # layer indices as a DynamicCache reads them: negative ones from the last, past the last 0 (a negative index
        # was taken for a plane and refused naming `plane`)
        dense_layers = len(dense.layers)
        for layer in (-1, -layers - 1, -dense_layers, dense_layers - 1, dense_layers, 10 * dense_layers):
            assert paged.get_seq_length(layer) == dense.get_seq_length(layer), layer
            assert paged.get_mask_sizes(2, layer) == dense.get_mask_sizes(2, layer), layer
        for bad in (-dense_layers - 1, 1.5, True):
            with pytest.raises(ValueError, match=rf"layer_idx={bad!r}: pass a cache layer index, an integer in "):
                paged.get_seq_length(bad)
        paged.crop(-2)  # transformers' convention: a negative count of columns to forget
        assert paged.get_seq_length() == 7
        assert [paged.length(s, paged.num_planes - 1) for s in range(3)] == (mask.sum(-1) - 2).tolist()
        with pytest.raises(ValueError, match="negative"):
            paged.crop(2)

    @pytest.mark.parametrize("options", [
        dict(do_sample=False),
        dict(do_sample=False, num_return_sequences=2, num_beams=2),
        dict(num_beams=3, do_sample=False),
        dict(do_sample=False, repetition_penalty=1.3),
    ])
    def test_generate_equals_dynamic_cache_path(self, options):
        model, ids, mask = model_and_batch(1)
        reference = model.generate(ids, attention_mask=mask, max_new_tokens=12, **options)
        paged = model.generate(ids, attention_mask=mask, max_new_tokens=12,
                               cache=PagedLoopCache(model.kv_layout, page_size=4, debug=True), **options)
        assert torch.equal(paged, reference)

    def test_sampling_with_seed_equals_dynamic_cache_path(self):
        model, ids, mask = model_and_batch(2)
        torch.manual_seed(7)
        reference = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=True,
                                   num_return_sequences=2)
        torch.manual_seed(7)
        paged = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=True, num_return_sequences=2,
                               cache=PagedLoopCache(model.kv_layout, page_size=4))
        assert torch.equal(paged, reference)

    def test_continuing_from_a_returned_cache(self):
        model, ids, mask = model_and_batch(3)
        full = model.generate(ids, attention_mask=mask, max_new_tokens=14, do_sample=False)
        first = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                               return_dict_in_generate=True, cache=PagedLoopCache(model.kv_layout, page_size=4))
        mask2 = torch.cat([mask, torch.ones(3, 6, dtype=mask.dtype)], dim=1)
        second = model.generate(first.sequences, attention_mask=mask2, max_new_tokens=8, do_sample=False,
                                cache=first.cache)
        assert torch.equal(second, full)

    def test_a_cache_for_another_model_shape_is_rejected(self):
        model, ids, mask = model_and_batch()
        with pytest.raises(ValueError, match="PagedLoopCache was made for"):
            model(ids, attention_mask=mask, cache=PagedLoopCache(LAYOUT))


@pytest.mark.parametrize(("fields", "message"), [
    ((-1, 1, 1, 4), r"KVLayout.num_planes=-1 must be an integer >= 1"),
    ((2, 0, 1, 4), r"KVLayout.num_layers=0 must be"),
    ((2, 1, "a", 4), r"KVLayout.num_kv_heads='a' must be"),
    ((2, 1, 1, 1.5), r"KVLayout.head_dim=1.5 must be"),
    ((2, 1, 1, 4, 2), r"KVLayout.entry_plane=2 must be None or a plane in \[0, 2\)"),
    ((2, 1, 1, 4, None, -1), r"KVLayout.first_exit_plane=-1 must be"),
    # planes that are each in range but overlap, or exit planes past the last (they shared or lost KV)
    ((4, 1, 1, 4, None, 3), r"the loop planes \[0, 2\), entry_plane=None and the exit planes from "
                            r"first_exit_plane=3 on \(one per loop\) must be distinct planes in \[0, 4\)"),
    ((4, 1, 1, 4, None, 0), r"exit planes from first_exit_plane=0 on .* must be distinct"),
    ((5, 1, 1, 4, 4, 4), r"entry_plane=4 and the exit planes from first_exit_plane=4 on .* must be distinct"),
    ((3, 1, 1, 4, 1), r"the loop planes \[0, 2\), entry_plane=1 .* must be distinct"),
    ((1, 1, 1, 4, 0), r"the loop planes \[0, 0\), entry_plane=0"),  # (no loop plane at all)
])
def test_a_layout_that_names_no_kv_is_refused(fields, message):
    """A layout of negative or fractional counts was taken, and a cache built on it failed only when a model wrote."""
    from hf_loopspec import KVLayout

    with pytest.raises(ValueError, match=message):
        KVLayout(*fields)


def test_a_refused_plan_rows_leaves_the_cache_as_it_was():
    """A `plan_rows` call refused for a gap, a float sequence or a missing `like` added the sequences it named (and
    with `like=None` grew the table before an AttributeError), so the next correct call was refused or the batch
    size changed."""
    cache = PagedLoopCache(LAYOUT)
    cache.plan_rows([0], [0], [0], LIKE)
    for rows, like, message in ((([3], [0], [1]), LIKE, r"positions \[1\] of sequence 3, depth 0, whose valid "
                                                         r"length is 0"),
                                (([0], [0], [5]), LIKE, r"positions \[5\] of sequence 0"),
                                (([0.5], [0], [1]), LIKE, r"seq holds 0\.5: every seq must be an integer >= 0"),
                                (([0], [0], [-1]), LIKE, r"position holds -1: every position must be"),
                                (([0], [0], [1]), None, r"like=None must be a tensor")):
        with pytest.raises(ValueError, match=message):
            cache.plan_rows(*rows, like)
        assert (cache.num_sequences, cache.length(0, 0), cache.pages_in_use) == (1, 1, 1)
    cache.plan_rows([0, 1], [0, 0], [1, 0], LIKE)  # the next positions: taken
    assert (cache.num_sequences, cache.length(0, 0), cache.length(1, 0)) == (2, 2, 1)
    with pytest.raises(ValueError, match="like=None"):  # an empty cache: refused before anything is allocated
        PagedLoopCache(LAYOUT).plan_rows([0], [0], [0], None)
    # a review of the above found three more: a refused first call allocated the pool in its `like`'s dtype
    fresh = PagedLoopCache(LAYOUT)
    with pytest.raises(ValueError, match="positions"):
        fresh.plan_rows([0], [0], [1], LIKE.half())
    assert fresh.k_pool is None
    # a branch's table opened before another table's write was refused: its shared pages then barred a truncate
    cache = PagedLoopCache(LAYOUT, page_size=2)
    cache.plan_rows([0] * 4, [0] * 4, [0, 1, 2, 3], LIKE)
    branch = cache.branches.open(0, 2)
    with pytest.raises(ValueError, match=r"positions \[7\] of sequence 0, depth 0, whose valid length is 4"):
        cache.plan_rows([branch, 0], [0, 0], [2, 7], LIKE)
    assert cache.length(branch, 0) == 0
    cache.truncate(0, 0, 1)  # (refused while the branch shared the history it cuts)
    # a write past a fixed capacity kept the pages it took before it ran out
    cache = PagedLoopCache(LAYOUT, page_size=1, max_pages=4)
    cache.plan_rows([0], [0], [0], LIKE)
    with pytest.raises(CacheCapacityError, match="1 are in use and 5 more were requested"):
        cache.plan_rows([0] * 5, [0] * 5, [1, 2, 3, 4, 5], LIKE)
    assert (cache.pages_in_use, cache.length(0, 0)) == (1, 1)
    cache.plan_rows([0, 0, 0], [0, 0, 0], [1, 2, 3], LIKE)  # the 3 pages left: taken
    assert cache.pages_in_use == 4
    # a table's positions in another order: taken (they failed in an IndexError with a page added to the table)
    unordered = PagedLoopCache(LAYOUT, page_size=1)
    unordered.plan_rows([0], [0], [0], LIKE)
    rows = unordered.plan_rows([0, 0, 0], [0, 0, 0], [1, 3, 2], LIKE)
    ordered = PagedLoopCache(LAYOUT, page_size=1)
    ordered.plan_rows([0], [0], [0], LIKE)
    in_order = ordered.plan_rows([0, 0, 0], [0, 0, 0], [1, 2, 3], LIKE)
    assert rows.slot.tolist() == in_order.slot[[0, 2, 1]].tolist() and unordered.length(0, 0) == 4
    assert unordered.block_tables(torch.device("cpu")).tolist() == ordered.block_tables(torch.device("cpu")).tolist()
    fixed = PagedLoopCache(LAYOUT, page_size=1, max_pages=4)  # (a first call: no pool is allocated for it)
    with pytest.raises(CacheCapacityError, match="0 are in use and 5 more were requested"):
        fixed.plan_rows([0] * 5, [0] * 5, range(5), LIKE.half())
    assert fixed.k_pool is None


def test_a_layout_of_numpy_integers_is_the_layout_of_python_ones():
    """Counts and planes read from an array (numpy integers) were refused as "must be an integer"; they are taken,
    as Python ints, so the layout equals (and hashes as) one made of Python ints."""
    layout = KVLayout(*np.array([3, 2, 1, 4]), np.int64(2), None)
    assert layout == KVLayout(3, 2, 1, 4, 2) and hash(layout) == hash(KVLayout(3, 2, 1, 4, 2))
    assert all(type(getattr(layout, name)) is int for name in ("num_planes", "num_layers", "head_dim", "entry_plane"))
