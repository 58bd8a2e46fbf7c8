"""The KV page pool of a continuous-batching manager: its size, and the pages each request holds while it runs.

The pool is one `PagedLoopCache` of fixed capacity, allocated when the manager is built. Its size is the
ContinuousBatchingConfig's `num_blocks` blocks of `page_size` tokens, each token with its KV at every depth plane
of the model; without `num_blocks`, room for every slot at its full C positions, shrunk to what fits in
`max_memory_percent` (default `DEFAULT_MEMORY_FRACTION`) of the free memory. An explicit `num_blocks` larger than
that share is refused. The cache stores it in pages of `PAGE_SIZE` positions.

A request holds pages for exactly the positions it can write (`request_positions`: its prompt and new tokens but
the last, which is never fed back; speculation writes no further, since no lane is spawned past that position) in
every plane, taken at admission (`KVPool.take`: `PagedLoopCache.reserve`) and given back when it finishes, is
cancelled or fails (`KVPool.give_back`: `PagedLoopCache.free`). The engine finds a slot's pages through the
state's page map (`WavefrontState.pages`, `[B * planes, W / page_size]`: data written in place, so a compiled step
never recompiles when its owners change); the entries past a request's pages, and all of a free slot's, name the
trash page (a page of no request, which masked rows write), so a read past the request's positions (masked) reads
memory of no other request. A request that needs more pages than the pool has in all fails when it is added
(`request_problem`, naming `num_blocks`); one that needs more than are free waits, first in, first out
(`LoopBatchingManager`: no later request is admitted before it, so a large request is never starved by small ones).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...cache.paged import PagedLoopCache
from ...models.layers import is_integer, is_real
from ..dispatch import free_memory
from ..wavefront.engine import WavefrontEngine

PAGE_SIZE = 16  # positions per page of a manager's pool
DEFAULT_MEMORY_FRACTION = 0.5  # the share of free memory a pool takes at most without max_memory_percent


@dataclass(frozen=True)
class PoolSize:
    """A manager's pool: `pages` pages of `page_size` positions that the requests share (the trash page apart), for
    a model of `planes` KV planes."""

    pages: int
    page_size: int
    planes: int

    def pages_for(self, positions: int) -> int:
        """The pages a request that writes `positions` positions holds (every plane)."""
        return self.planes * -(-positions // self.page_size)

    @property
    def positions(self) -> int:
        """The positions of every plane the pool holds."""
        return self.pages // self.planes * self.page_size


def request_positions(prompt_length: int, max_new_tokens: int) -> int:
    """The positions a request writes in each plane (module docstring)."""
    return prompt_length + max_new_tokens - 1


def pool_size(layout, dtype: torch.dtype, device: torch.device, cb_config, slots: int, positions: int) -> PoolSize:
    """The `PoolSize` of a manager of `slots` slots of `positions` positions on `device`, for a model of KV
    `layout` in `dtype`, from the ContinuousBatchingConfig `cb_config` (module docstring; `ValueError` naming the
    setting when it is too large or not a valid value)."""
    per_page = PAGE_SIZE * PagedLoopCache(layout).bytes_per_token_per_depth(dtype)  # bytes (one plane)
    fraction = getattr(cb_config, "max_memory_percent", None)
    if fraction is None:
        fraction = DEFAULT_MEMORY_FRACTION
    elif not is_real(fraction) or not 0 < fraction <= 1:
        raise ValueError(f"max_memory_percent={fraction!r} in the ContinuousBatchingConfig must be a fraction in "
                         "(0, 1] of the free memory.")
    budget = int(fraction * free_memory(device)) // per_page  # pages
    blocks = getattr(cb_config, "num_blocks", None)
    if blocks is None:
        wanted = slots * -(-positions // PAGE_SIZE)  # every slot at full length
        per_plane = min(wanted, (budget - 1) // layout.num_planes)
    else:
        if not is_integer(blocks) or blocks < 1:
            raise ValueError(f"num_blocks={blocks!r} in the ContinuousBatchingConfig must be an integer >= 1.")
        size = getattr(cb_config, "page_size", None) or PAGE_SIZE
        per_plane = -(-int(blocks) * size // PAGE_SIZE)
        if layout.num_planes * per_plane + 1 > budget:
            raise ValueError(f"num_blocks={blocks} of {size} tokens in the ContinuousBatchingConfig need "
                             f"{(layout.num_planes * per_plane + 1) * per_page / 2**30:.2f} GiB of KV pages (every "
                             f"depth plane), more than max_memory_percent={fraction} of "
                             "the free memory: lower num_blocks, or raise max_memory_percent.")
    if per_plane < 1:
        raise ValueError(f"the free memory holds no KV page of this model under max_memory_percent="
                         f"{fraction}: raise max_memory_percent or free memory.")
    return PoolSize(pages=layout.num_planes * per_plane, page_size=PAGE_SIZE, planes=layout.num_planes)


def pool_cache(layout, size: PoolSize) -> PagedLoopCache:
    """The empty cache of a pool of `size` (and its trash page)."""
    return PagedLoopCache(layout, page_size=size.page_size, max_pages=size.pages + 1)


class PooledEngine(WavefrontEngine):
    """The wavefront engine over a pool: set-up allocates the whole pool and takes its trash page instead of reserving
    every table in order (`WavefrontEngine._reserve`); the page map starts with every entry on the trash page."""

    def _reserve(self, batch: int, like: torch.Tensor) -> torch.Tensor:
        self.cache.allocate_pool(like)
        self.trash_page = self.cache.scratch_page(like)
        return torch.tensor(self.trash_page * self.cache.page_size, device=like.device)

    def _run_generator(self, device: torch.device) -> None:
        """None: each slot samples from a generator of its own, seeded at admission (`SlotBatch`), so building the
        pool's engine draws nothing from torch's global generator (a manager with a seed left it as it was)."""
        return None

    def _page_map(self, batch: int, device: torch.device) -> torch.Tensor:
        width = self.plan.table_width // self.cache.page_size
        return torch.full((batch * self.cache.num_planes, width), self.trash_page, dtype=torch.long, device=device)

    def _embed_staged(self, state, start) -> torch.Tensor:
        """`[B, F, H]` zeros for the placeholder prompts the engine is built with: the slots start empty (`SlotBatch`
        resets them) and each admission embeds its own request. Computing them ran the entry stage over B x C
        placeholder tokens, with a `[B, 1, C, C]` attention mask, quadratic in a slot's length."""
        width = max((len(tokens) for tokens in start.tokens), default=0)
        return state.hidden.new_zeros(len(start.tokens), width, state.hidden.shape[-1])


class KVPool:
    """The pages of an engine's pool lent to its slots (module docstring)."""

    def __init__(self, engine: PooledEngine, size: PoolSize):
        self.engine, self.size = engine, size
        self.held = [0] * (engine.state.pages.shape[0] // size.planes)  # per slot: pages it holds

    @property
    def free(self) -> int:
        """Pages free for admissions."""
        return self.engine.cache.free_pages

    def fits(self, positions: int) -> bool:
        """Whether a request that writes `positions` positions can take its pages now."""
        return self.size.pages_for(positions) <= self.free

    def take(self, b: int, positions: int) -> None:
        """Slot `b` (holding none) takes pages for `positions` positions of every plane, written into its rows of the
        page map (the caller checked `fits`)."""
        cache, pages = self.engine.cache, self.engine.state.pages
        like = self.engine.state.k_pool
        cache.reserve(b, positions, like)
        for plane in range(cache.num_planes):
            own = cache.pages_of(b, plane)
            pages[b * cache.num_planes + plane, : len(own)] = torch.tensor(own, dtype=torch.long, device=pages.device)
        self.held[b] = self.size.pages_for(positions)

    def give_back(self, b: int) -> None:
        """Slot `b`'s pages return to the free list (none held: nothing happens); its page map rows name the trash
        page again."""
        if not self.held[b]:
            return
        cache, planes = self.engine.cache, self.engine.cache.num_planes
        cache.free(b)
        self.engine.state.pages[b * planes: (b + 1) * planes] = self.engine.trash_page
        self.held[b] = 0
