"""The KV page pool of continuous batching (`generation.continuous.pool`): a request takes pages for what it can
write when it is admitted and gives them back when it finishes or is cancelled; a request that does not fit in the
free pages waits (first in, first out); one larger than the whole pool fails alone, naming `num_blocks`.

The reference of every request is plain greedy `generate` of it alone (fp32). The pool's pages are 4 positions here
(`pool.PAGE_SIZE` patched), so rollbacks cross page boundaries often, on pages that are not in table order.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from continuous_utils import VOCAB, alone, batching, collect, generation_config, prompts, starting
from speculative_utils import named_modes, tiny_spec_model
from transformers.generation.continuous_batching import RequestStatus

from hf_loopspec.generation.continuous import pool as pool_module
from hf_loopspec.generation.continuous import slots as slots_module
from hf_loopspec.generation.continuous.manager import CANCELLED

SETTINGS = named_modes()
SETTINGS["pipeline-d1-second"] = {**SETTINGS["pipeline-d1"], "second_draft_loops": 3}  # a sibling's KV is promoted
SMALL_PAGE = 4


@pytest.fixture(scope="module")
def model():
    return tiny_spec_model(0, vocab=VOCAB, damp=0.5)


@pytest.fixture
def started(model, monkeypatch):
    """Starts a manager of `slots` slots of 64 positions sharing `blocks` * 16 positions per plane (4-position
    pages)."""
    monkeypatch.setattr(pool_module, "PAGE_SIZE", SMALL_PAGE)

    def configure(settings: dict, slots: int, blocks: int):
        return generation_config(settings), batching(slots, 64, blocks)

    yield from starting(model, configure)


@pytest.fixture
def watched(monkeypatch):
    """Records, per slot, the positions its admitted request may write, and asserts after every engine call that no
    slot's KV length (the engine's own count of what it wrote, every plane) exceeds them: the pages taken at
    admission hold everything speculation writes. Yields the list of (slot, positions) admissions."""
    admitted, allowed = [], {}
    admit, call = slots_module.SlotBatch.admit, slots_module.SlotBatch._call

    def admitting(self, b, prompt, max_new_tokens, *args):
        allowed[b] = pool_module.request_positions(len(prompt), max_new_tokens)
        admitted.append((b, allowed[b]))
        return admit(self, b, prompt, max_new_tokens, *args)

    def calling(self):
        call(self)
        for b, lengths in enumerate(self.state.kv_len.tolist()):
            if self.pool.held[b]:
                assert max(lengths) <= allowed[b], (b, lengths, allowed[b])

    monkeypatch.setattr(slots_module.SlotBatch, "admit", admitting)
    monkeypatch.setattr(slots_module.SlotBatch, "_call", calling)
    return admitted


@pytest.mark.parametrize("name", list(SETTINGS))
def test_requests_wait_for_pages_and_all_equal_plain_decoding(model, started, watched, name):
    """Three slots whose pool holds one long request or two short ones at a time: requests wait for pages, take
    them in arrival order (the long one is not overtaken by the short ones behind it), and every request equals
    plain decoding alone; idle again, every page is free."""
    manager = started(SETTINGS[name], slots=3, blocks=2)  # 32 positions per plane: 8 pages of 4
    pool = manager.settings.pool
    requests = list(zip(prompts(21, [3, 9, 2, 12, 5, 4]), (12, 20, 6, 16, 10, 9)))
    needs = [pool.pages_for(pool_module.request_positions(len(p), n)) for p, n in requests]
    assert pool.pages < 3 * max(needs)  # the slots cannot all run requests at full length
    ids = [manager.add_request(p, max_new_tokens=n) for p, n in requests]
    results = collect(manager, ids)
    assert [results[i].generated_tokens for i in ids] == [alone(model, p, n) for p, n in requests]
    assert [positions for _, positions in watched] == [pool_module.request_positions(len(p), n) for p, n in requests]
    assert manager.batch_processor.pool.free == pool.pages and not any(manager.batch_processor.pool.held)


def test_pages_of_cancelled_requests_are_reused(model, started):
    """A pool that serves one request at a time: a request cancelled while decoding and one cancelled while waiting
    give their pages back (the requests behind them run, equal to plain decoding), and the pool is full again."""
    manager = started(SETTINGS["pipeline-d1"], slots=2, blocks=3)  # 48 positions: one request of 23 or more at once
    a, b, c = prompts(22, [6, 4, 5])
    cancelled = manager.add_request(a, max_new_tokens=40, streaming=True)  # 45 positions
    waiting = manager.add_request(b, max_new_tokens=20)
    after = manager.add_request(c, max_new_tokens=20)
    next(manager.request_id_iter(cancelled))
    manager.cancel_request(waiting)
    manager.cancel_request(cancelled)
    results = collect(manager, [cancelled, waiting, after])
    assert [results[i].error for i in (cancelled, waiting)] == [CANCELLED, CANCELLED]
    assert results[after].generated_tokens == alone(model, c, 20)
    late = manager.add_request(a, max_new_tokens=20)
    assert collect(manager, [late])[late].generated_tokens == alone(model, a, 20)
    assert manager.batch_processor.pool.free == manager.settings.pool.pages


def test_a_request_larger_than_the_pool_fails_alone(model, started):
    """A request that could not fit even in an empty pool fails at once with a message naming `num_blocks`; the
    requests around it finish."""
    manager = started(SETTINGS["pipeline-d1"], slots=2, blocks=1)  # 16 positions per plane
    small, large = prompts(23, [4, 10])
    ids = [manager.add_request(small, max_new_tokens=8), manager.add_request(large, max_new_tokens=10),
           manager.add_request(small, max_new_tokens=6)]
    results = collect(manager, ids)
    assert results[ids[1]].status == RequestStatus.FAILED
    assert re.search(r"needs \d+ KV pages \(19 positions in each of \d+ depth planes\), and this manager's pool "
                     r"holds \d+ \(16 positions per plane\).*ContinuousBatchingConfig\(num_blocks=\.\.\.\)",
                     results[ids[1]].error)
    assert [results[i].generated_tokens for i in (ids[0], ids[2])] == [alone(model, small, 8), alone(model, small, 6)]


def test_pool_settings_are_checked_at_init(model):
    """`num_blocks` and `max_memory_percent` that cannot make a pool raise at `init_continuous_batching`, naming
    them; without `num_blocks` the pool holds every slot at full length when memory allows."""
    config = generation_config(SETTINGS["plain"])
    with pytest.raises(ValueError, match=r"num_blocks=0 in the ContinuousBatchingConfig must be an integer >= 1"):
        model.init_continuous_batching(config, batching(blocks=0))
    with pytest.raises(ValueError, match=r"max_memory_percent=1.5 .* must be a fraction in \(0, 1\]"):
        model.init_continuous_batching(config, batching(max_memory_percent=1.5))
    with pytest.raises(ValueError, match=r"num_blocks=4 of 16 tokens .* more than max_memory_percent=1e-09 of the "
                                         r"free memory: lower num_blocks"):
        model.init_continuous_batching(config, batching(blocks=4, max_memory_percent=1e-9))
    with pytest.raises(ValueError, match=r"the free memory holds no KV page of this model under "
                                         r"max_memory_percent=1e-12: raise max_memory_percent"):
        model.init_continuous_batching(config, batching(max_memory_percent=1e-12))
    pool = model.init_continuous_batching(config, batching(slots=3, positions=64)).settings.pool
    assert pool.positions == 3 * 64 and pool.pages == pool.planes * 3 * 64 // pool.page_size
    # numpy numbers are numbers (num_blocks=np.int64(4) read "must be an integer >= 1", np.float32 "a fraction")
    numpy_sized = batching(blocks=np.int64(4), max_memory_percent=np.float32(0.5))
    assert model.init_continuous_batching(config, numpy_sized).settings.pool == \
        model.init_continuous_batching(config, batching(blocks=4, max_memory_percent=0.5)).settings.pool


def test_page_map_lends_each_slot_its_own_pages(model):
    """After admissions and a release the page map names, per slot and plane, the cache's own pages of that slot
    (position order) and the trash page past them; a free slot's rows are all the trash page; no page is lent
    twice."""
    manager = model.init_continuous_batching(generation_config(SETTINGS["pipeline-d1"]), batching(3, 64, blocks=8))
    slots = manager.batch_processor
    for b, (prompt, new) in enumerate(zip(prompts(24, [5, 17, 3]), (12, 20, 30))):
        slots.admit(b, prompt, new, [], None)
    slots.release(1)
    cache, pages, trash = slots.engine.cache, slots.state.pages, slots.engine.trash_page
    lent = []
    for b in range(3):
        for plane in range(cache.num_planes):
            own = cache.pages_of(b, plane) if b != 1 else []
            row = pages[b * cache.num_planes + plane].tolist()
            assert row == own + [trash] * (len(row) - len(own))
            lent += own
    assert len(lent) == len(set(lent)) and trash not in lent
    assert slots.pool.free == manager.settings.pool.pages - len(lent)
