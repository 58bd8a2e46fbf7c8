"""What the wavefront engine cannot run: each function names the setting and why, or returns None. The engine's
constructor, `generation.dispatch` and the argument resolution (`generation.config`) ask the same functions, so
the rule is stated once."""

from __future__ import annotations


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
