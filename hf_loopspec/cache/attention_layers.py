"""What transformers asks of a cache's layers, answered for `PagedLoopCache`, whose every layer (one per plane and
layer of the looped model) is full attention over one shared page pool and which has no per-layer objects
(`Cache.layers` stays empty: transformers' own answers iterate over it). Nothing here touches the KV."""

from __future__ import annotations


def linear_only(method: str):
    raise ValueError(f"{method} applies to linear-attention cache layers; every layer of a PagedLoopCache is "
                     "attention (is_linear is all False).")


class AttentionLayers:
    """The per-layer answers of a cache of `len(self)` full-attention layers, written through its own rows (not
    `update`), kept on one device, and rolled back by `crop` alone."""

    def offload(self, layer_idx: int, only_non_sliding: bool = True):
        raise NotImplementedError("PagedLoopCache keeps every layer's KV in one pool on one device; it does not "
                                  "offload or prefetch layers.")

    def prefetch(self, layer_idx: int, only_non_sliding: bool = True):
        self.offload(layer_idx, only_non_sliding)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        raise NotImplementedError(
            "PagedLoopCache is written through RowBatch by hf_loopspec's looped models; it cannot back a model "
            "that calls Cache.update()."
        )

    def early_initialization(self, *args, **kwargs):
        raise NotImplementedError("PagedLoopCache allocates its page pool at its first write (or allocate_pool) "
                                  "and is written through rows; it has no layers to initialize early.")

    # the states of linear-attention layers, which no layer here holds (transformers' own methods index `layers`,
    # which stays empty: an IndexError)
    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        linear_only("has_previous_state")

    def get_conv_state(self, layer_idx: int, state_idx: int = 0):
        linear_only("get_conv_state")

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0):
        linear_only("get_recurrent_state")

    def update_conv_state(self, conv_states, layer_idx: int, state_idx: int = 0, **kwargs):
        linear_only("update_conv_state")

    def update_recurrent_state(self, recurrent_states, layer_idx: int, state_idx: int = 0, **kwargs):
        linear_only("update_recurrent_state")

    def update_indexer(self, indexer_key_states, layer_idx: int):
        raise ValueError("update_indexer applies to indexed attention layers (an indexer key cache); every layer of "
                         "a PagedLoopCache is full attention.")

    def get_recurrent_states_to_keep(self, layer_idx: int | None = None) -> int:
        """0: no layer keeps recurrent states (each is attention), so there is no past to record before a step that
        may be undone (transformers' deferred stop check, on mps, undoes its last step by `crop(-1)`); transformers'
        own method took the max over `layers`, which a PagedLoopCache leaves empty (a ValueError)."""
        return 0

    def activate_past_recording(self, **kwargs) -> None:
        """Nothing to record (`get_recurrent_states_to_keep`): `crop` rolls every plane's KV back exactly."""

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    @property
    def is_croppable(self) -> bool:
        return True

    @property
    def is_linear(self) -> list[bool]:  # one flag per cache layer (`len(self)`)
        return [False] * len(self)

    @property
    def is_sliding(self) -> list[bool]:
        return self.is_linear

    @property
    def is_dummy(self) -> list[bool]:
        return self.is_linear
