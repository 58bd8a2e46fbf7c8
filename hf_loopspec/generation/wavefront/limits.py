"""What the wavefront engine cannot run: each function names the setting and why, or returns None. The engine's
constructor and `select` (the engine choice) ask the same functions, so the rule is stated once."""

from __future__ import annotations


def stages_problem(model, second_draft_loops: int | None) -> str | None:
    """Why the wavefront engine cannot run second proposals on `model`, or None: a sibling's entry and exit stages
    would need private rows of the entry and exit planes (Huginn's prelude and coda write KV of their own)."""
    layout = model.kv_layout
    if second_draft_loops is not None and (layout.entry_plane is not None or layout.first_exit_plane is not None):
        return (f"second_draft_loops={second_draft_loops} on {type(model).__name__} (its entry or exit stage has KV, "
                "e.g. Huginn: drop second_draft_loops)")
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
