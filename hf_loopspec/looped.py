"""The small protocol that decoding strategies and caches see of a looped language model.

A looped LM is `embed -> core x U -> head`, where `core` is one pass of a shared layer stack. The strategies
in `hf_loopspec.generation` drive a model only through this protocol, so a new looped family plugs in by
implementing it:

* `lane_width` and `lane_dtype`: a lane state (what a token carries through the loops) is `[lane_width]` in
  `lane_dtype`, which is also the dtype of the KV the stages write (Ouro: the hidden size; Huginn: twice its
  width, `[state | prelude output]`). Strategies and caches size and type their buffers from these, never from
  the embedding matrix or `model.dtype`.
* `embed(input_ids, positions, sequences, attention)` maps token ids `[*rows]` to the loop-0 input
  `[*rows, lane_width]`.
* `core(hidden, positions, attention)` runs ONE loop of the stack over a batch of rows `[*rows, lane_width]`.
  Rows are independent apart from attention: each row may belong to a different sequence, sit at a different
  position and at a different loop depth, because every loop uses the same weights. `positions` `[*rows]`
  are the rotary positions; everything about KV addressing (which plane a row writes, which history it reads)
  lives in the `attention` object, never in the model.
* `head(hidden, positions, attention)` maps any depth's output to **fp32** logits `[*rows, vocab]` (whatever
  `lane_dtype` is, so that drafts and targets are judged in one precision): the depth-d draft and the depth-U
  target use one head.

Entry and exit stages with their own KV. Ouro's `embed` and `head` are stateless and get `attention=None`.
A family whose per-token entry stage attends (Huginn's prelude) declares an *entry plane* in its `KVLayout`,
and one whose head attends (Huginn's coda) declares *exit planes*: one per exit depth, so a depth-d draft row
and a depth-U target row never read each other's KV. The caller then passes an attention over that plane
(every token's `embed` runs once, and every token runs `head` at every exit depth in use, even when its logits
are not needed, so the exit plane of that depth holds every position). `sequences` `[*rows]` (the batch row
of each token) is for models whose loop-0 input is random per token: Huginn keys it by (seed, sequence,
position), so every decoding mode draws the same state for the same token.

Per-call settings and random loop-0 inputs (optional members, read only by the wavefront engine: its compiled step
may read no per-call settings and draw nothing). A family whose stages depend on per-call settings gives the ones
that shape a step as `step_settings()` (hashable: a compiled step is never shared across them); one whose loop-0
input has a random part gives it as `initial_states(sequences, positions) -> [*rows, width]` and takes it back as
`embed(..., initial=...)`. Huginn has both (its recurrence settings; its keyed initial states).

`KVLayout` tells a cache how much KV storage one token needs, so the cache needs no model.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
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
    """Shape of the KV a model writes: `num_planes` planes of `num_layers` layers each.

    Plane `k < num_loops` is loop depth `k` (the core's KV). A model with an attending entry stage adds the
    plane `entry_plane`; one with an attending head adds a plane per exit depth, `exit_plane(depth)` for
    depth 1..num_loops. A stage with fewer layers than `num_layers` leaves the other layers of its planes unused.
    Every count is an integer >= 1 and every plane one of the `num_planes` (`ValueError` naming the field).
    """

    num_planes: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    entry_plane: int | None = None
    first_exit_plane: int | None = None  # the plane of exit depth 1; exit depth k uses first_exit_plane + k - 1

    def __post_init__(self):
        counts = {"num_planes": self.num_planes, "num_layers": self.num_layers, "num_kv_heads": self.num_kv_heads,
                  "head_dim": self.head_dim}
        planes = {"entry_plane": self.entry_plane, "first_exit_plane": self.first_exit_plane}
        for name, value in counts.items():
            if not isinstance(value, numbers.Integral) or isinstance(value, (bool, np.bool_)) or value < 1:
                raise ValueError(f"KVLayout.{name}={value!r} must be an integer >= 1.")
            object.__setattr__(self, name, int(value))  # (a numpy integer, as Python's)
        for name, value in planes.items():
            if value is not None and (not isinstance(value, numbers.Integral) or isinstance(value, (bool, np.bool_))
                                      or not 0 <= value < self.num_planes):
                raise ValueError(f"KVLayout.{name}={value!r} must be None or a plane in [0, {self.num_planes}).")
            object.__setattr__(self, name, None if value is None else int(value))
        loops = range(self.num_loops)  # (ranges, never lists: a layout may have 10**9 planes)
        exits = range(self.first_exit_plane, self.first_exit_plane + self.num_loops) \
            if self.first_exit_plane is not None else range(0)
        entry = self.entry_plane
        shared = entry is not None and (entry in loops or entry in exits)  # (`None in range(n)` scans it all)
        if not loops or shared or (exits and (exits[0] < len(loops) or exits[-1] >= self.num_planes)):
            raise ValueError(f"KVLayout: the loop planes [0, {len(loops)}), entry_plane={entry} and the exit "
                             f"planes from first_exit_plane={self.first_exit_plane} on (one per loop) must be distinct "
                             f"planes in [0, {self.num_planes}); give the entry and exit planes the planes after the "
                             "loops'.")

    @property
    def num_loops(self) -> int:
        """The loop depths: the planes besides the entry plane and the exit depths' (one per loop depth)."""
        return (self.num_planes - (self.entry_plane is not None)) // (1 if self.first_exit_plane is None else 2)

    def exit_plane(self, depth: int) -> int | None:
        """The plane the head writes for rows of exit depth `depth` (1-based), or None for a stateless head."""
        return None if self.first_exit_plane is None else self.first_exit_plane + depth - 1


@runtime_checkable
class LoopedModel(Protocol):
    """What a strategy needs from a looped causal LM (see the module docstring for the contract)."""

    @property
    def num_loops(self) -> int: ...

    @property
    def kv_layout(self) -> KVLayout: ...

    @property
    def lane_width(self) -> int: ...

    @property
    def lane_dtype(self) -> torch.dtype: ...

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor, sequences: torch.Tensor,
              attention: KVAttention | None) -> torch.Tensor: ...

    def core(self, hidden: torch.Tensor, positions: torch.Tensor, attention: KVAttention) -> torch.Tensor: ...

    def head(self, hidden: torch.Tensor, positions: torch.Tensor, attention: KVAttention | None) -> torch.Tensor: ...


def draws_initial_states(model) -> bool:
    """Whether `model`'s loop-0 input has a random part (`initial_states`, module docstring: Huginn's)."""
    return getattr(model, "initial_states", None) is not None


def check_kv_continues(cache, dtype: torch.dtype, device, held: torch.Tensor | None = None) -> None:
    """`ValueError` naming `cache` (a caller's `PagedLoopCache`, or a transformers Cache) when the KV it holds (`held`,
    else found: none yet, nothing to check) has another dtype or device than the KV the model writes now (`dtype`,
    `device`): a cache continues with the model, dtype and device that filled it (attention would fail on the mixed
    dtypes with a bare RuntimeError)."""
    held = getattr(cache, "k_pool", None) if held is None else held  # a PagedLoopCache's pool, else a layer's keys
    if held is None:
        held = next((layer.keys for layer in getattr(cache, "layers", ()) if getattr(layer, "keys", None) is not None
                     and layer.keys.numel()), None)
    if held is None or not held.numel():
        return
    device = torch.device(device)
    if held.dtype != dtype or held.device.type != device.type or device.index not in (None, held.device.index):
        raise ValueError(f"cache: the {type(cache).__name__} holds {held.dtype} KV on {held.device}, but the model "
                         f"computes in {dtype} on {device}: continue it with the model (dtype and device) that filled "
                         "it, or pass a fresh cache.")
