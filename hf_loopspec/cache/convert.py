"""Moving a looped model's KV between a `PagedLoopCache` and transformers' `DynamicCache`, without recomputing it.

Both caches hold the same entries in two layouts. A `DynamicCache` after `C` input columns holds, for cache layer
`plane * num_layers + layer`, keys and values `[B, Hkv, C, D]` with one entry per column, padding included (masked
by the attention mask). A `PagedLoopCache` stores only the real tokens: sequence `b`'s position `j` is its `j`-th
real column, the rotary position plain decoding gives that column (`positions_from_mask`). So a column `c` of row
`b` with `attention_mask[b, c] == 1` is paged position `mask[b, :c].sum()`, and a padding column is not stored
(its dense entry is written as zeros: the mask hides it from every query that plain decoding uses).

Only complete planes move: those that hold all `C` columns. A plane a run did not write (with a head that has KV,
the exit plane of a draft depth under plain decoding; the layers a shorter entry or exit stage leaves unused) is
left out, as a layer that was never written; a speculative run continuing such a history fills a missing draft
plane from the target's (`history.start_rows`), as after any plain run.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache

from ..looped import KVLayout
from ..models.layers import check_mask_values
from ..ops.attention import write_kv
from .paged import PASSED_CACHE, PagedLoopCache


def _real_columns(attention_mask: torch.Tensor, columns: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows, cols, positions) `[N]` of the real tokens among the first `columns` columns of `attention_mask`;
    `ValueError` unless it is a 2-D tensor `[B, >= columns]` of 0 and 1 (`check_mask_values`, as a forward's)."""
    if not torch.is_tensor(attention_mask) or attention_mask.dim() != 2 or attention_mask.shape[1] < columns:
        shape = tuple(attention_mask.shape) if torch.is_tensor(attention_mask) else type(attention_mask).__name__
        raise ValueError(f"attention_mask: {shape}; pass the 2-D [batch, >= {columns}] padding mask of the inputs "
                         f"the cache holds ({columns} columns).")
    check_mask_values(attention_mask)
    real = attention_mask[:, :columns].bool()  # [B, C]
    rows, cols = real.nonzero(as_tuple=True)  # row-major: each row's real columns in order
    positions = real.long().cumsum(-1)[rows, cols] - 1
    return rows, cols, positions


def to_dynamic(cache: PagedLoopCache, attention_mask: torch.Tensor, into: DynamicCache | None = None) -> DynamicCache:
    """A `DynamicCache` holding what `cache` holds for the inputs `attention_mask` `[B, >= C]` marks
    (C = `cache.columns()`), its complete planes only (module docstring); `into` is refilled in place (its old
    entries dropped) when given, once the new entries are all made: a failure (out of memory) leaves it as it was."""
    if not isinstance(cache, PagedLoopCache):
        raise ValueError(f"to_dynamic: cache is a {type(cache).__name__}; it converts a PagedLoopCache (to_paged "
                         "converts the other way).")
    if into is not None and not isinstance(into, DynamicCache):
        raise ValueError(f"to_dynamic: into is a {type(into).__name__}; pass the DynamicCache to refill, or None.")
    layout, columns = cache.kv_layout, cache.columns()
    rows, cols, _ = _real_columns(attention_mask, columns)
    cache.check_stored(attention_mask)
    out = DynamicCache()
    batch, size = attention_mask.shape[0], cache.page_size
    for plane in range(layout.num_planes if columns else 0):
        if cache.columns(plane) != columns or cache.lengths(plane) != cache.lengths(0):
            continue  # not written by the runs that filled the cache
        slots = torch.tensor([page * size + j % size for b in range(batch)
                              for j, page in enumerate(_positions_pages(cache, b, plane, size))],
                             dtype=torch.long).to(cache.k_pool.device)  # [N]: row-major, as `rows`, `cols`
        for layer in range(layout.num_layers):
            dense = []
            for pool in (cache.k_pool, cache.v_pool):
                flat = pool[layer].view(-1, *pool.shape[-2:])  # [pages * page_size, Hkv, D]
                grid = flat.new_zeros(batch, columns, *flat.shape[1:])  # [B, C, Hkv, D]
                grid[rows, cols] = flat[slots]
                dense.append(grid.transpose(1, 2))  # [B, Hkv, C, D]
            out.update(*dense, plane * layout.num_layers + layer)  # creates the skipped planes' layers, unwritten
    return out if into is None else _refill(into, out)


def _refill(into: DynamicCache, staged: DynamicCache) -> DynamicCache:
    """`into` holding `staged`'s layers instead of its own: taken over where the layer classes agree (a growing cache
    makes each layer as it is written; `DynamicCache(config=...)` has fixed ones), else copied into the emptied
    layer."""
    if getattr(into, "layer_class_to_replicate", None) is not None:
        into.layers[:] = staged.layers
        return into
    for index, layer in enumerate(into.layers):  # one per (plane, layer): `check_layer_count`
        new = staged.layers[index] if index < len(staged.layers) else None
        if new is not None and type(new) is type(layer):
            into.layers[index] = new
            continue
        layer.reset()
        if new is not None and new.get_seq_length():
            into.update(new.keys, new.values, index)
    return into


def _positions_pages(cache: PagedLoopCache, seq: int, plane: int, size: int) -> list[int]:
    """The page of each stored position of (`seq`, `plane`), in position order."""
    pages = cache.pages_of(seq, plane)
    return [pages[j // size] for j in range(cache.length(seq, plane))]


def check_dynamic_cache(cache, layout: KVLayout, batch: int) -> None:
    """`ValueError` unless a filled growing cache (a `DynamicCache`) fits a call of `batch` rows writing `layout`: KV
    in no layer past the layout's planes, all its columns in the first layer of every loop depth's plane, the entry
    plane and the last loop's exit plane (every call writes them, plain or speculative: a cache filled at fewer
    loops or recurrence steps lacks one), and entries `[batch, Hkv, C, D]` of the layout's heads. A cache whose
    layers hold no keys yet fits any call; one cropped to no columns still has its rows. Plain and speculative calls
    check it alike, so `speculative_mode="auto"` refuses a cache with one message whichever decoder it picks."""
    needed, columns = layout.num_planes * layout.num_layers, cache.get_seq_length(0)
    written = [*range(layout.num_loops), layout.entry_plane, layout.exit_plane(layout.num_loops)]
    written = [plane for plane in written if plane is not None]
    if any(cache.get_seq_length(layer) for layer in range(needed, len(cache.layers))) or columns and any(
            cache.get_seq_length(plane * layout.num_layers) != columns for plane in written):
        raise ValueError(
            f"{PASSED_CACHE} holds KV in {len(cache.layers)} layers, but this call writes {layout.num_planes} planes "
            f"x {layout.num_layers} layers = {needed} (for Huginn: the planes depend on num_steps): continue a cache "
            "with the settings that filled it (the same number of loops or recurrence steps), or pass a fresh one.")
    check_kv_rows(cache, layout, batch)


def check_kv_rows(cache, layout: KVLayout, batch: int) -> None:
    """`ValueError` unless the keys a transformers cache holds in its first layer (`[B, Hkv, C, D]`; a cache whose
    layers hold none yet fits any call) are `batch` rows of the layout's heads: a growing cache's filled columns, or a
    fixed-size (static) cache's storage, allocated for the rows of the call that first wrote it (its writes would
    fail deep in torch)."""
    keys = cache.layers[0].keys if cache.layers else None  # [B, Hkv, C, D]
    if keys is None or keys.dim() != 4:
        return
    if keys.shape[0] != batch or (keys.shape[1], keys.shape[-1]) != (layout.num_kv_heads, layout.head_dim):
        raise ValueError(
            f"{PASSED_CACHE} holds keys of shape {tuple(keys.shape)} ([batch, kv heads, columns, head dim]), but "
            f"this call has batch size {batch} (beam search and num_return_sequences > 1 expand it) and the model "
            f"{layout.num_kv_heads} KV heads of size {layout.head_dim}: pass the cache that this model filled for "
            "these rows, or a fresh one.")


def to_paged(cache: DynamicCache, layout: KVLayout, attention_mask: torch.Tensor) -> PagedLoopCache:
    """A `PagedLoopCache` for a model with `layout` holding what the `DynamicCache` `cache` holds for the inputs
    `attention_mask` `[B, >= C]` marks (C = `cache.get_seq_length()`): every layer that holds all C columns. A
    `DynamicCache` of fixed layers (`DynamicCache(config=...)`) must have the layout's, as in plain decoding: the
    run's KV goes back into it (`to_dynamic`)."""
    if not isinstance(cache, DynamicCache):
        raise ValueError(f"to_paged: cache is a {type(cache).__name__}; it converts a DynamicCache (to_dynamic "
                         "converts the other way).")
    if not isinstance(layout, KVLayout):
        raise ValueError(f"to_paged: layout is a {type(layout).__name__}; pass the model's KV layout: "
                         "to_paged(cache, model.kv_layout, attention_mask).")
    check_layer_count(cache, layout)
    columns, paged = cache.get_seq_length(), PagedLoopCache(layout)
    rows, cols, positions = _real_columns(attention_mask, columns)
    check_dynamic_cache(cache, layout, attention_mask.shape[0])
    if columns == 0:
        return paged
    paged.ensure_sequences(attention_mask.shape[0])
    like = cache.layers[0].keys
    complete = [[i < len(cache.layers) and cache.layers[i].get_seq_length() == columns
                 for i in range(plane * layout.num_layers, (plane + 1) * layout.num_layers)]
                for plane in range(layout.num_planes)]
    if not all(complete[0]):
        raise ValueError(f"to_paged: loop depth 0 of the DynamicCache does not hold {columns} columns in every layer: "
                         "pass the cache of a plain `generate` call of this model.")
    planes = [plane for plane in range(layout.num_planes) if any(complete[plane])]
    for plane in planes:
        planned = paged.plan_rows(rows, [plane] * len(rows), positions, like=like)
        for layer in range(layout.num_layers):
            if complete[plane][layer]:  # (a plane of fewer layers, a Huginn prelude's or coda's, has no more)
                entry = cache.layers[plane * layout.num_layers + layer]
                k, v = (t.transpose(1, 2)[rows, cols] for t in (entry.keys, entry.values))  # [N, Hkv, D]
                write_kv(k, v, paged.k_pool[layer], paged.v_pool[layer], planned.slot)
    paged.set_columns(columns, planes, attention_mask)
    return paged


def check_layer_count(cache, layout: KVLayout) -> None:
    """`ValueError` unless `cache` (a transformers cache of a list of layers) grows (a `DynamicCache()`) or has one
    layer per (plane, layer) of `layout`."""
    needed = layout.num_planes * layout.num_layers
    if not isinstance(getattr(cache, "layers", None), list):  # (an EncoderDecoderCache: an AttributeError)
        raise ValueError(f"cache is an instance of {type(cache).__name__}, which holds no decoder-only KV layers: "
                         "pass `DynamicCache()`, `hf_loopspec.PagedLoopCache`, or none.")
    grows = getattr(cache, "layer_class_to_replicate", None) is not None
    if not grows and len(cache.layers) != needed:  # a fixed cache is sized for one layout: its settings
        raise ValueError(
            f"cache has {len(cache.layers)} layers, but this call writes one KV per (plane, layer): "
            f"{layout.num_planes} planes x {layout.num_layers} layers = {needed}. A fixed-size cache holds the planes "
            "of the settings it was made for: one sized from the config's num_hidden_layers never fits, and one "
            "filled with another number of loops or recurrence steps (or with per-step outputs on one call only) "
            "does not fit this call. Pass `DynamicCache()` (it grows) or `hf_loopspec.PagedLoopCache`, continue a "
            "cache with the settings that filled it, or for a static cache use "
            "generate(cache_implementation='static'), which sizes it for the looped model and its number of loops "
            "or recurrence steps."
        )
