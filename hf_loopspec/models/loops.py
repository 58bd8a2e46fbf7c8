"""Running all loops of a looped model over a `[batch, time]` input: the HF `forward` path of every family.

Two caches can back it:

* a standard `transformers` Cache (e.g. `DynamicCache()`): loop `u`, layer `l` is cache layer
  `u * num_layers + l`; padding is masked (`padded_causal_mask`);
* a `PagedLoopCache`: padding tokens are not stored at all. Every real token becomes one row per loop, at
  position = the number of real tokens before it in its sequence, which equals the `position_ids` that
  `generate` derives from the attention mask. `position_ids` are therefore ignored on this path.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from ..cache.paged import PagedLoopCache
from ..ops.attention.dense import DenseKVAttention, padded_causal_mask


def loop_states(
    model,
    hidden: torch.Tensor,  # [B, T, H] loop-0 input
    attention_mask: torch.Tensor | None,  # [B, past + T] or None
    position_ids: torch.Tensor | None,  # [B or 1, T] or None
    cache: Cache | None,
) -> list[torch.Tensor]:
    """Run `model.core` for every loop; returns the `num_loops` outputs, each `[B, T, H]`.

    `model` provides `core(hidden, positions, attention)` and `kv_layout` (see `hf_loopspec.looped`).
    """
    if isinstance(cache, PagedLoopCache):
        return _paged_loop_states(model, hidden, attention_mask, cache)
    layout = model.kv_layout
    if cache is not None:
        _check_layer_count(cache, layout)
    batch, length = hidden.shape[:2]
    past = cache.get_seq_length() if cache is not None else 0
    if position_ids is None:
        position_ids = positions_from_mask(attention_mask, past, length, hidden.device)
    mask = padded_causal_mask(attention_mask, past, length, hidden.device)
    states = []
    for depth in range(layout.num_planes):
        attention = DenseKVAttention(cache, mask, depth, layout.num_layers, layout.head_dim**-0.5)
        hidden = model.core(hidden, position_ids, attention)
        states.append(hidden)
    return states


def positions_from_mask(attention_mask, past: int, length: int, device) -> torch.Tensor:
    """Rotary positions `[B or 1, T]` of the new tokens: with a padding mask each row counts its real tokens."""
    if attention_mask is None:
        return torch.arange(past, past + length, device=device)[None]
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.clamp(min=0)[:, -length:].to(device)


def _check_layer_count(cache: Cache, layout) -> None:
    needed = layout.num_planes * layout.num_layers
    grows = getattr(cache, "layer_class_to_replicate", None) is not None
    if not grows and len(cache.layers) < needed:
        raise ValueError(
            f"cache has {len(cache.layers)} layers, but a looped model writes one KV per (loop, layer): "
            f"{layout.num_planes} loops x {layout.num_layers} layers = {needed}. Pass `DynamicCache()` (it grows) "
            "or `hf_loopspec.PagedLoopCache`, not a cache sized from the config's num_hidden_layers."
        )


def _paged_loop_states(model, hidden, attention_mask, cache: PagedLoopCache) -> list[torch.Tensor]:
    if cache.kv_layout != model.kv_layout:
        raise ValueError(f"the PagedLoopCache was made for {cache.kv_layout}, but the model writes "
                         f"{model.kv_layout}; create it with PagedLoopCache(model.kv_layout).")
    batch, length, width = hidden.shape
    if cache.num_sequences > batch:
        raise ValueError(f"the PagedLoopCache holds {cache.num_sequences} sequences but the input has batch "
                         f"size {batch}; pass a cache made for this batch.")
    cache.ensure_sequences(batch)
    if attention_mask is None:
        real = torch.ones(batch, length, dtype=torch.bool, device=hidden.device)
    else:
        real = attention_mask[:, -length:].to(device=hidden.device, dtype=torch.bool)
    seq, col = real.nonzero(as_tuple=True)  # [N] each, sequence-major
    start = torch.tensor(cache.lengths(0), device=hidden.device)  # [B] real tokens already stored
    position = start[seq] + real.long().cumsum(-1)[seq, col] - 1  # [N]
    rows_hidden = hidden[seq, col]  # [N, H]
    states = []
    for depth in range(model.kv_layout.num_planes):
        rows = cache.plan_rows(seq, [depth] * len(seq), position, like=rows_hidden)
        rows_hidden = model.core(rows_hidden, position, cache.attention(rows))
        out = hidden.new_zeros(batch, length, width)
        out[seq, col] = rows_hidden
        states.append(out)
    cache.advance_columns(length)
    return states
