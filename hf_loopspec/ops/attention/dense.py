"""Attention over a standard `transformers` Cache: the path that plain `forward` and `generate` take.

A looped model writes one KV entry per (plane, layer), so the Cache must hold `num_planes * num_layers` layers;
plane `p`, layer `l` uses cache layer `p * num_layers + l`. A `StaticCache` returns its whole capacity from
`update`; the mask then covers the capacity (`padded_causal_mask(..., key_length=)`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache

from ...looped import check_kv_continues
from .stored import stored


def padded_causal_mask(
    attention_mask: torch.Tensor | None,  # [B, S] 1 = real token, 0 = padding; or None (no padding)
    past_length: int | torch.Tensor,
    query_length: int,
    device: torch.device,
    key_length: int | None = None,
) -> torch.Tensor | None:
    """Boolean mask `[B or 1, 1, T, S]` (True = may attend) for `T` new tokens after `past_length` cached ones.

    A query at absolute position `i` sees key `j` when `j <= i` and key `j` is not padding. Every query also
    sees itself, so the rows of padding tokens stay finite (their outputs are never used). Returns `None` when
    nothing needs masking (one query and no padding).

    `key_length` (a static cache's capacity, whose `past_length` is a device tensor): the mask always exists and
    is `key_length` wide, keys at or past `past_length + T` (not written yet) are masked, and nothing is read back
    to the host, so the mask compiles into a graph.
    """
    if key_length is None:
        total = past_length + query_length
        if attention_mask is not None and (attention_mask.dim() != 2 or attention_mask.shape[-1] != total):
            raise ValueError(
                f"attention_mask has shape {tuple(attention_mask.shape)}, expected a 2-D [batch, {total}] mask "
                f"covering the {past_length} cached and {query_length} new tokens."
            )
        if attention_mask is not None and not torch.compiler.is_compiling() and bool(attention_mask.all()):
            attention_mask = None  # (traced, the mask stays: the test reads it on the host)
        if attention_mask is None and query_length == 1:
            return None
    width = total if key_length is None else key_length
    q_pos = (torch.arange(query_length, device=device) + past_length)[:, None]  # [T, 1]
    k_pos = torch.arange(width, device=device)[None, :]  # [1, S]
    mask = (k_pos <= q_pos)[None, None]  # [1, 1, T, S]
    if attention_mask is not None:
        real = attention_mask.to(device=device, dtype=torch.bool)  # [B, total]
        real = F.pad(real, (0, width - real.shape[1]))  # [B, S]: keys not written yet are not real
        mask = (mask & real[:, None, None, :]) | (k_pos == q_pos)[None, None]
    return mask


class DenseKVAttention:
    """`KVAttention` for rows laid out as `[B, T]` at one loop depth, backed by a `transformers` Cache.

    `cache` may be `None` (no caching: keys are the current tokens only). With `past` (a growing cache's count of
    columns before this call), each layer must hold exactly that many before it takes the new ones: a cache filled
    under other settings (Huginn's planes move with `num_steps`) is refused naming the fix, where attention over
    mismatched columns failed in torch.
    """

    def __init__(self, cache: Cache | None, mask: torch.Tensor | None, depth: int, num_layers: int, scale: float,
                 past: int | None = None):
        self.cache = cache
        self.mask = mask
        self.depth = depth
        self.num_layers = num_layers
        self.scale = scale
        self.past = past

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [B, T, Hq, D]   k, v: [B, T, Hkv, D]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, D]
        k, v = stored(k, k.dtype), stored(v, v.dtype)  # as every path stores them (a padding token's inf: masked)
        if self.cache is not None:
            index = self.depth * self.num_layers + layer_idx
            if self.past is not None and (held := self.cache.get_seq_length(index)) != self.past:
                raise ValueError(
                    f"layer {layer_idx} of KV plane {self.depth} of the cache holds {held} positions, but this call "
                    f"continues from {self.past}: continue a cache with the settings that filled it (the same number "
                    "of loops or recurrence steps, and per-step outputs requested on every call or on none).")
            if layer_idx == 0 and index < len(self.cache.layers):  # (once per plane and call: its first layer)
                check_kv_continues(self.cache, k.dtype, k.device, held=getattr(self.cache.layers[index], "keys", None))
            k, v = self.cache.update(k, v, index)  # [B, Hkv, S, D]
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=self.mask, scale=self.scale, enable_gqa=bool(q.size(1) != k.size(1))
        )  # [B, Hq, T, D]
        return out.transpose(1, 2)
