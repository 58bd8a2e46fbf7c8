"""Where accelerate keeps the weights it offloaded (`cpu_offload`, `disk_offload`, a `device_map` with "cpu" or
"disk"): such a parameter or buffer is on the meta device, and an offloading hook (`_hf_hook`, on its module or on a
module above it) loads it at each call from the hook's `weights_map`, keyed by its name below the hooked module.
`offloaded(model, name)` finds that store without reading the value (`check_weights_present` tells a weight the hook
loads from one that nothing loads; auto's weights fingerprint reads the first values of each)."""

from __future__ import annotations

from collections.abc import Mapping


def offloaded(model, name: str) -> tuple[Mapping, str] | None:
    """`(store, key)` with `store[key]` the values of the offloaded tensor `name` (a parameter's or buffer's full
    name in `model`), or None when no offloading hook holds it."""
    parts = name.split(".")
    for cut in range(len(parts) - 1, -1, -1):
        hook = getattr(model.get_submodule(".".join(parts[:cut])), "_hf_hook", None)
        for each in getattr(hook, "hooks", None) or [hook]:  # (a `SequentialHook` holds several)
            store = getattr(each, "weights_map", None)
            if store is None or not getattr(each, "offload", False):
                continue
            key = ".".join(parts[cut:])
            while hasattr(store, "dataset") and hasattr(store, "prefix"):  # accelerate's `PrefixedDataset`
                key, store = store.prefix + key, store.dataset
            if _holds(store, key):
                return store, key
    return None


def _holds(store: Mapping, key: str) -> bool:
    """Whether `store` has `key`, read from its keys (a `Mapping`'s own `in` would load the value from disk); a store
    of a kind that lists none is taken to hold it."""
    keys = getattr(store, "all_keys", None)  # accelerate's `OffloadedWeightsLoader`: a state dict and a disk index
    if keys is not None:
        return key in keys
    return key in store if isinstance(store, dict) else True
