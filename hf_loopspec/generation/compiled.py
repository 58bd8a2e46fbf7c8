"""Where a model's compiled functions live (`compile_core`): on the model instance itself.

A compiled function closes over its model. Kept in a module-level store weak-keyed by the model, such a value would
keep its own key alive, so a model once compiled would never be freed. Kept in an attribute of the model, the
function and the model only reference each other: dropping the last reference to the model frees both (at the next
garbage collection). The store is never copied with the model (`copy.deepcopy` and pickling give an empty one), so a
copy compiles its own functions and a pickle never meets compiled code.
"""

from __future__ import annotations

STORE_ATTRIBUTE = "_loopspec_compiled"


class CompiledStore(dict):
    """`{kind: {key: compiled function}}` of one model; copies and unpickled copies are empty."""

    def __deepcopy__(self, memo) -> CompiledStore:
        return CompiledStore()

    def __copy__(self) -> CompiledStore:
        return CompiledStore()

    def __reduce__(self):
        return CompiledStore, ()


def compiled_store(model, kind: str) -> dict:
    """The dict of `model`'s compiled functions of one `kind` (the engine's: "wavefront"), created on first use."""
    store = model.__dict__.get(STORE_ATTRIBUTE)
    if store is None:
        store = CompiledStore()
        model.__dict__[STORE_ATTRIBUTE] = store  # a plain attribute: not a submodule, buffer or parameter
    return store.setdefault(kind, {})
