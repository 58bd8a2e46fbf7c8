"""The tokens of one HF `forward` call as rows of the `LoopedModel` stages, over either kind of cache.

A model's `forward` gathers its `[batch, time]` input into rows, runs its stages on them with the attention
of the right KV plane, and scatters the results back:

* with a standard `transformers` Cache (e.g. `DynamicCache()`) or none, rows are the `[B, T]` grid itself;
  plane `k`, layer `l` is cache layer `k * num_layers + l`; padding is masked (`padded_causal_mask`);
* with a `PagedLoopCache`, padding tokens are not stored at all: rows are the real tokens `[N]`
  (sequence-major), at position = the number of real tokens before them in their sequence, which equals the
  `position_ids` that `generate` derives from the attention mask; other `position_ids` raise a `ValueError`.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from ..cache.convert import check_dynamic_cache, check_kv_rows, check_layer_count
from ..cache.paged import PagedLoopCache
from ..looped import KVAttention, KVLayout
from ..ops.attention.dense import DenseKVAttention, padded_causal_mask
from .layers import check_mask_values


class ForwardRows:
    """Rows of one forward call: `positions` and `sequences` (batch row) `[*rows]`, and per plane an attention.

    Every plane's `attention` may be requested once per call (on a paged cache it allocates that plane's slots).
    Use it as a context around the call's stages: on leaving, the cache records the call's columns as consumed, or,
    if a stage raised (a full fixed-capacity pool, a plane of other settings, Ctrl-C), forgets what the call wrote.
    """

    positions: torch.Tensor
    sequences: torch.Tensor

    def gather(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, ...] -> [*rows, ...]
        raise NotImplementedError

    def scatter(self, x: torch.Tensor) -> torch.Tensor:  # [*rows, ...] -> [B, T, ...]
        raise NotImplementedError

    def attention(self, plane: int) -> KVAttention:
        raise NotImplementedError

    def close(self) -> None:
        """Tell the cache the call's columns are consumed."""

    def roll_back(self) -> None:
        """Cut the cache back to what it held before the call."""

    def __enter__(self) -> ForwardRows:
        return self

    def __exit__(self, error_type, error, traceback) -> None:
        if error_type is None:
            self.close()
        else:
            self.roll_back()


def forward_rows(layout: KVLayout, attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None,
                 cache: Cache | None, *, shape: tuple[int, int], like: torch.Tensor) -> ForwardRows:
    """The rows of a forward call over `shape` = (batch, new tokens); `like` is any tensor on the compute device
    in the KV dtype. See the module docstring."""
    batch, length = shape
    if isinstance(cache, PagedLoopCache):
        return _PagedRows(layout, attention_mask, position_ids, cache, like, batch, length)
    return _DenseRows(layout, attention_mask, position_ids, cache, batch, length, like.device)


def check_mask(attention_mask: torch.Tensor | None, batch: int, past: int | None, length: int) -> None:
    """`ValueError` naming `attention_mask` unless it is None or a `[batch, past + length]` padding mask (`past` None:
    a count that cannot be read without a device sync, so `[batch, any]`); its values (0 and 1) are checked on a call
    without history only, as a generate call's prefill (a later step's would cost a device sync each)."""
    if attention_mask is None:
        return
    if not torch.is_tensor(attention_mask) or attention_mask.is_meta:  # (a list or an array: an AttributeError;
        check_mask_values(attention_mask)  # names it, as a mask without values)
    if past is None:
        if attention_mask.dim() != 2 or attention_mask.shape[0] != batch:
            raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, expected a 2-D [{batch}, "
                             "cached + new columns] padding mask.")
        return
    if attention_mask.dim() != 2 or tuple(attention_mask.shape) != (batch, past + length):
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, expected a 2-D [batch, "
                         f"{past + length}] padding mask (the cache holds {past} columns, this call adds {length}).")
    if past == 0:
        check_mask_values(attention_mask)


def positions_from_mask(attention_mask, past: int | torch.Tensor, length: int, device) -> torch.Tensor:
    """Rotary positions `[B or 1, T]` of the new tokens: with a padding mask each row counts its real tokens. `past`
    may be a static cache's 0-d length tensor: it is added to the new tokens' offsets (as an `arange` bound it would
    be read on the host, which a fullgraph trace cannot)."""
    if attention_mask is None:
        return (torch.arange(length, device=device) + past)[None]
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.clamp(min=0)[:, -length:].to(device)


class _DenseRows(ForwardRows):
    def __init__(self, layout, attention_mask, position_ids, cache, batch, length, device):
        if cache is not None:
            check_layer_count(cache, layout)
            if getattr(cache, "layer_class_to_replicate", None) is not None:  # a DynamicCache: it grows
                check_dynamic_cache(cache, layout, batch)
            else:  # a fixed-size cache: its storage has the rows of the call that first wrote it
                check_kv_rows(cache, layout, batch)
        past = cache.get_seq_length() if cache is not None else 0
        if torch.is_tensor(past):  # a static cache counts in a tensor that its own writes advance in place
            past = past.clone()  # (read on a CPU only: elsewhere, or compiling, reading it costs a sync or a break)
            readable = past.device.type == "cpu" and not torch.compiler.is_compiling()
            check_mask(attention_mask, batch, int(past) if readable else None, length)
        else:
            check_mask(attention_mask, batch, past, length)
        if position_ids is None:
            position_ids = positions_from_mask(attention_mask, past, length, device)
        self.positions = position_ids.to(device).expand(batch, length)  # [B, T]
        self.sequences = torch.arange(batch, device=device)[:, None].expand(batch, length)  # [B, T]
        self.cache, self.layout, self.past = cache, layout, past
        self.written = []  # the planes this call has written, in order
        capacity = cache.layers[0].max_cache_len if cache is not None and cache.is_compileable else None
        self.mask = padded_causal_mask(attention_mask, past, length, device, key_length=capacity)

    def gather(self, x):
        return x

    def scatter(self, x):
        return x

    def attention(self, plane):
        grows = self.cache is not None and not torch.is_tensor(self.past)  # (checked on growing caches only)
        self.written.append(plane)
        return DenseKVAttention(self.cache, self.mask, plane, self.layout.num_layers, self.layout.head_dim**-0.5,
                                past=self.past if grows else None)

    def roll_back(self) -> None:
        """Crop every layer of the planes this call has written back to the `past` columns it started from (a static
        cache's length counter too); a layer the call started empties anew, so a retry may bring another batch size."""
        if self.cache is None:
            return
        past = int(self.past)
        for plane in self.written:
            for layer in range(plane * self.layout.num_layers, (plane + 1) * self.layout.num_layers):
                extra = int(self.cache.get_seq_length(layer)) - past
                if extra > 0 and past == 0:
                    self.cache.layers[layer].reset()
                elif extra > 0:
                    self.cache.layers[layer].crop(-extra)


class _PagedRows(ForwardRows):
    def __init__(self, layout, attention_mask, position_ids, cache: PagedLoopCache, like, batch, length):
        device = like.device
        cache.check_layout(layout)
        cache.check_pool(like.dtype, device)
        cache.check_batch(batch, "the input")
        self.past = cache.columns()
        if attention_mask is None:  # every column real (transformers also drops an all-ones mask)
            attention_mask = torch.ones(batch, self.past + length, dtype=torch.bool, device=device)
        if attention_mask.shape[-1] != self.past + length:
            raise ValueError(f"attention_mask has {attention_mask.shape[-1]} columns, but the PagedLoopCache holds "
                             f"{self.past} and this call adds {length}: pass the whole sequence's mask.")
        cache.check_stored(attention_mask)
        real = attention_mask[:, -length:].to(device=device, dtype=torch.bool)
        self.seq, self.col = real.nonzero(as_tuple=True)  # [N] each, sequence-major
        stored = [cache.length(s, 0) if s < cache.num_sequences else 0 for s in range(batch)]
        start = torch.tensor(stored, device=device)  # [B] real tokens already stored
        self.positions = start[self.seq] + real.long().cumsum(-1)[self.seq, self.col] - 1  # [N]
        given = None if position_ids is None else position_ids.to(device).expand(batch, length)[self.seq, self.col]
        if given is not None and not torch.equal(given, self.positions):
            rows = self.seq[given != self.positions].unique().tolist()
            ended = [b for b in rows if self.past and not attention_mask[b, self.past - 1]]  # its last column padding
            if ended:  # (generate's positions for such a row count on from its padding's)
                raise ValueError(f"attention_mask ends in padding in rows {ended[:8]}, which decode on (right "
                                 "padding): a PagedLoopCache stores each token at its count of real tokens, which "
                                 "transformers' positions for such rows do not follow; pad on the left "
                                 "(tokenizer.padding_side = \"left\"), or decode on a DynamicCache.")
            raise ValueError("position_ids: a PagedLoopCache stores each token at its count of real tokens in its "
                             "row (the positions generate derives from the attention mask) and cannot follow "
                             "positions of your own; drop position_ids, or decode on a DynamicCache.")
        self.checkpoint = cache.checkpoint()
        cache.ensure_sequences(batch)  # after the checks: a refused call adds no sequence
        self.sequences = self.seq
        self.cache, self.shape, self.like, self.planes = cache, (batch, length), like, []
        self.attention_mask = attention_mask  # [B, past + length]

    def gather(self, x):
        return x[self.seq, self.col]

    def scatter(self, x):
        out = x.new_zeros(*self.shape, *x.shape[1:])
        out[self.seq, self.col] = x
        return out

    def attention(self, plane):
        if self.cache.columns(plane) != self.past:
            raise ValueError(
                f"KV plane {plane} of the PagedLoopCache holds {self.cache.columns(plane)} columns, but this call "
                f"continues from {self.past}: continue a cache with the settings that filled it (the same number "
                "of loops or recurrence steps, and per-step outputs requested on every call or on none).")
        self.planes.append(plane)
        rows = self.cache.plan_rows(self.seq, [plane] * len(self.seq), self.positions, like=self.like)
        return self.cache.attention(rows)

    def close(self):
        self.cache.set_columns(self.past + self.shape[1], self.planes, self.attention_mask)

    def roll_back(self):
        self.cache.roll_back(self.checkpoint)
