"""The small protocol that decoding strategies and caches see of a looped language model.

A looped LM is `embed -> core x U -> head`, where `core` is one pass of a shared layer stack. The strategies
in `hf_loopspec.generation` drive a model only through this protocol, so a new looped family plugs in by
implementing it:

* `embed(input_ids)` maps token ids `[*rows]` to the loop-0 input `[*rows, hidden]`.
* `core(hidden, positions, attention)` runs ONE loop of the stack over a batch of rows `[*rows, hidden]`.
  Rows are independent apart from attention: each row may belong to a different sequence, sit at a different
  position and at a different loop depth, because every loop uses the same weights. `positions` `[*rows]`
  are the rotary positions; everything about KV addressing (which plane a row writes, which history it reads)
  lives in the `attention` object, never in the model.
* `head(hidden)` maps any depth's output to logits: the depth-d draft and the depth-U target use one head.

`KVLayout` tells a cache how much KV storage one token needs per depth, so the cache needs no model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class KVAttention(Protocol):
    """Attention over some KV store, called by every attention layer of one core pass.

    Contract: `q` is `[*rows, num_heads, head_dim]`, `k` and `v` are `[*rows, num_kv_heads, head_dim]`, all with
    rotary embeddings applied. The implementation stores `k` and `v` for every row *before* any row attends
    (so a row sees itself and earlier rows of its own history written in the same call) and returns the
    attention output `[*rows, num_heads, head_dim]` in the dtype of `q`.
    """

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class KVLayout:
    """Shape of the KV a model writes: `num_planes` planes (one per loop depth) of `num_layers` layers each."""

    num_planes: int
    num_layers: int
    num_kv_heads: int
    head_dim: int


@runtime_checkable
class LoopedModel(Protocol):
    """What a strategy needs from a looped causal LM (see the module docstring for the contract)."""

    @property
    def num_loops(self) -> int: ...

    @property
    def kv_layout(self) -> KVLayout: ...

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor: ...

    def core(self, hidden: torch.Tensor, positions: torch.Tensor, attention: KVAttention) -> torch.Tensor: ...

    def head(self, hidden: torch.Tensor) -> torch.Tensor: ...
