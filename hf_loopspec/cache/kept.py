"""A caller's cache through a `generate` call that raises: what it held on entry, in every mode.

A call that raises part-way (Ctrl-C, a stopping criterion or streamer that raises, a full fixed-capacity pool) has
written some of its tokens' KV into the cache it was given. The conversation goes on from the cache as it was before
that call, the same whether the call decoded plainly (transformers' loop writes a `DynamicCache` in place) or
speculatively (the engine writes a run's own paged cache and copies it back only when the run ends).
"""

from __future__ import annotations

from contextlib import contextmanager

from transformers.cache_utils import DynamicCache, DynamicLayer

from .paged import PagedLoopCache


@contextmanager
def kept_on_error(cache):
    """A context in which a call may add to `cache`: if it raises, `cache` holds what it held on entry and the
    exception propagates. A `PagedLoopCache` rolls back to its entry checkpoint (`PagedLoopCache.kept_on_error`); a
    `DynamicCache` of full-attention layers has each layer cut back to its entry length (a call only appends, so the
    columns kept are the entry's), layers added since dropped and layers empty on entry made empty again. Any other
    cache (None, a `StaticCache`, layers of other kinds) is left as the call leaves it."""
    if isinstance(cache, PagedLoopCache):
        with cache.kept_on_error():
            yield
        return
    if not isinstance(cache, DynamicCache) or any(type(layer) is not DynamicLayer for layer in cache.layers):
        yield
        return
    count = len(cache.layers)
    entry = [layer.get_seq_length() if layer.is_initialized else dict(vars(layer)) for layer in cache.layers]
    try:
        yield
    except BaseException:
        del cache.layers[count:]
        for layer, held in zip(cache.layers, entry):
            if isinstance(held, dict):  # empty on entry: its state then (no tensors)
                vars(layer).clear()
                vars(layer).update(held)
            elif (added := layer.get_seq_length() - held) > 0:
                layer.crop(-added)
        raise
