"""What the wavefront engine cannot run: each function names the setting and why, or returns None. The engine's
constructor, `generation.dispatch` and the argument resolution (`generation.config`) ask the same functions, so
the rule is stated once."""

from __future__ import annotations


def stages_problem(model, second_draft_loops: int | None, compiled: bool) -> str | None:
    """Why the wavefront engine cannot run `model` with second proposals `second_draft_loops` or compiled
    (`compiled`: with a `compile_backend`), or None. Both hold for a model whose entry or exit stage has KV
    (Huginn's prelude and coda, `stages`): a sibling would need private rows of the entry and exit planes, and
    Huginn's stages read the call's recurrence settings (`model.recurrence`) and draw seeded initial states on the
    host, which `torch.compile(fullgraph=True)` cannot trace."""
    layout = model.kv_layout
    if layout.entry_plane is None and layout.first_exit_plane is None:
        return None
    name = type(model).__name__
    if second_draft_loops is not None:
        return f"second_draft_loops={second_draft_loops} on {name} (its entry or exit stage has KV: drop it)"
    if compiled:
        return f"compile_core on {name} (its entry or exit stage has KV: run the engine eager)"
    return None


def cache_problem(cache) -> str | None:
    """Why the wavefront engine cannot run on `cache`, or None: the lineage checks of `PagedLoopCache(debug=True)`
    follow the reference decoder's lanes (each token's ancestry, checked on every read), which the engine's masked
    tensor state does not keep."""
    if cache.debug:
        return ("PagedLoopCache(debug=True) (its lineage checks are a debugging aid of the reference decoder: call "
                "model.decode_with_lanes(...) with that cache, or pass a cache with debug=False)")
    return None


def second_proposals_problem(mode: str, num_loops: int, draft_loops: int, second_draft_loops: int | None) -> str | None:
    """Why the wavefront engine cannot run second proposals `second_draft_loops` (d2) with these settings, or None.
    It keeps one sibling slot per sequence, which holds when a sibling is decided before it could draft or a next
    sibling open: U - d2 <= d (`state`)."""
    if second_draft_loops is None:
        return None
    if mode != "pipeline":
        return f"second_draft_loops={second_draft_loops} needs mode 'pipeline' (got {mode!r})"
    if num_loops - second_draft_loops > draft_loops:
        return (f"second_draft_loops={second_draft_loops} with draft_loops={draft_loops} on a {num_loops}-loop model "
                f"(the wavefront engine keeps one sibling per sequence: it needs second_draft_loops >= "
                f"{num_loops - draft_loops})")
    return None
