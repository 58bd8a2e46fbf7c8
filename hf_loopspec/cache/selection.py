"""The sequence indices that `PagedLoopCache.reorder_cache` and `batch_select_indices` take, read as transformers'
caches read them."""

from __future__ import annotations

from ..models.layers import is_integer


def sequence_indices(indices, name: str, n: int, masks: bool) -> list[int]:
    """`indices` (a 1-D tensor, array, list or tuple) as a list of sequence numbers in `[0, n)` for a cache of `n`
    sequences: integer indices (negative ones from the end) or, where `masks`, a boolean mask over the sequences;
    `ValueError` naming `name` for anything else."""
    dtype = getattr(indices, "dtype", None)
    if dtype is not None and getattr(dtype, "is_floating_point", getattr(dtype, "kind", "") == "f"):
        raise ValueError(f"{name}: {dtype} values; give integer sequence indices (or a boolean mask).")
    if str(dtype) in ("torch.uint8", "uint8"):  # a DynamicCache indexes with it as a (deprecated) mask
        raise ValueError(f"{name}: uint8 values, which transformers' caches read as a mask and a list as "
                         f"indices; give a boolean mask ({name}.bool()) or integer sequence indices.")
    values = indices.tolist() if hasattr(indices, "tolist") else indices
    if not isinstance(values, (list, tuple)):
        raise ValueError(f"{name}={indices!r}: give a 1-D tensor (or list) of sequence indices.")
    if values and all(isinstance(v, bool) for v in values):
        if not masks:
            raise ValueError(f"{name}: a boolean mask; give integer sequence indices (torch.nonzero(mask)).")
        if len(values) != n:
            raise ValueError(f"{name}: a boolean mask of {len(values)} values for a cache of {n} sequences.")
        return [s for s, keep in enumerate(values) if keep]
    bad = [v for v in values if not is_integer(v) or not -n <= v < n]
    if bad:
        raise ValueError(f"{name} holds {bad[:4]}: a cache of {n} sequences takes integer indices in [{-n}, {n}).")
    return [int(v) % n for v in values]
