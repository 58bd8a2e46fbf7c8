"""Draw a speculative run's schedule from its trace: cycles across, depths (loops) down.

    out = model.generate(**inputs, max_new_tokens=12, speculative_mode="pipeline", draft_loops=1,
                         return_dict_in_generate=True, speculative_trace=True)
    fig = plot_schedule(out.trace, tokenizer=tok, num_loops=model.num_loops)

Each cell is one row of one core call: the token whose next loop that call computes. Loops are counted from 1 as in
prose ("drafts from loop 1"): a row at depth k (k loops done) runs loop k + 1, and the drawing labels it so;
`Cell.depth` keeps the 0-based depth of the traces and the cache. Colours tell the fate of the token's lane: the
prompt, a token started from a verified target (the first token, a correction or a bonus), a draft that was later
accepted, a draft that was rejected, and a draft that was discarded without a verification (a descendant of a rejected
draft, or in flight when the sequence stopped). With second proposals (`second_draft_loops`), a sibling lane is drawn
as a second proposal, chosen or dropped, and the lanes drafted on its branch like any draft. The numbers above the
columns count the tokens committed after each call. `schedule_grid` returns the same information as data (no
matplotlib needed).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .models.layers import is_integer

KINDS = ("prompt", "target", "accepted", "rejected", "discarded", "second_accepted", "second")
COLORS = {
    "prompt": "#d9d9d9",
    "target": "#9ecae1",  # started from a verified target token
    "accepted": "#a1d99b",
    "rejected": "#fc9272",
    "discarded": "#fdd0a2",
    "second_accepted": "#31a354",
    "second": "#bcbddc",
}
LABELS = {
    "prompt": "prompt",
    "target": "verified token (restart)",
    "accepted": "draft, accepted",
    "rejected": "draft, rejected",
    "discarded": "draft, discarded unverified",
    "second_accepted": "second proposal (sibling), chosen",
    "second": "second proposal (sibling), dropped",
}


@dataclass
class _Lane:
    position: int
    token: int
    is_draft: bool
    prompt: bool
    fate: str | None = None  # "accepted" / "rejected" / "second_accepted" once verified
    second: bool = False  # a sibling lane (second proposal)


@dataclass
class Cell:
    """One (cycle, depth) of the grid: the tokens computed there for the traced sequence."""

    cycle: int
    depth: int  # loops completed before this call (0-based); the call runs loop depth + 1
    tokens: list[int]
    positions: list[int]
    kind: str  # one of KINDS (for several rows: the most telling of their kinds)


@dataclass
class ScheduleGrid:
    cells: list[Cell]
    num_cycles: int
    num_loops: int
    commits: list[int] = field(default_factory=list)  # tokens committed after each cycle
    prompt_len: int = 0


def schedule_grid(trace: Sequence, seq: int = 0, num_loops: int | None = None) -> ScheduleGrid:
    """The cells of sequence `seq` in a `generate(..., speculative_trace=True)` trace (a list of `CycleTrace`);
    `ValueError` for anything else (e.g. the output itself: pass `out.trace`)."""
    if isinstance(trace, (str, bytes)) or not isinstance(trace, Sequence) \
            or not all(hasattr(cycle, "rows") for cycle in trace):
        raise ValueError(f"trace: a {type(trace).__name__}; pass the trace of a generate(..., speculative_trace=True, "
                         "return_dict_in_generate=True) call, out.trace (a list of cycles).")
    if not trace:
        raise ValueError("the trace is empty: pass generate(..., speculative_trace=True, return_dict_in_generate=True) "
                         "and a speculative_mode.")
    if not is_integer(seq):
        raise ValueError(f"seq={seq!r}: pass the row of the batch to draw (a whole number).")
    first = [row for row in trace[0].rows if row.seq == seq]
    prompt_positions = {row.position for row in first if row.depth == 0}
    current: dict[tuple[int, int, int], _Lane] = {}  # (position, token, branch) -> its newest lane
    rows_at: list[tuple[int, int, _Lane]] = []
    commits = []
    deepest = 0
    branches: set[int] = set()  # sibling branches seen (the first row of one is its sibling lane)
    for c, cycle in enumerate(trace):
        for row in cycle.rows:
            if row.seq != seq:
                continue
            branch = getattr(row, "branch", 0)
            key = (row.position, row.token, branch)
            lane = current.get(key)
            if row.depth == 0 or lane is None:
                lane = _Lane(row.position, row.token, row.is_draft, row.position in prompt_positions,
                             second=bool(branch) and branch not in branches)
                current[key] = lane
                branches.add(branch)
            rows_at.append((c, row.depth, lane))
            deepest = max(deepest, row.depth)
        commits.append(_read_events(cycle.events, seq, current))
    if not rows_at:
        held = sorted({row.seq for cycle in trace for row in cycle.rows})
        raise ValueError(f"seq={seq}: the trace holds no rows of that sequence; pass one of {held}.")
    if num_loops is not None and (not is_integer(num_loops) or num_loops <= deepest):
        raise ValueError(f"num_loops={num_loops!r}: the trace reaches depth {deepest}; pass a whole number of at "
                         f"least {deepest + 1} (the model's loop count), or None to read it from the trace.")
    loops = num_loops if num_loops is not None else deepest + 1

    def kind_of(lane: _Lane) -> str:
        if lane.prompt:
            return "prompt"
        if lane.fate is not None:
            return lane.fate
        if lane.second:
            return "second"
        return "discarded" if lane.is_draft else "target"

    grouped: dict[tuple[int, int], list[_Lane]] = {}
    for c, depth, lane in rows_at:
        grouped.setdefault((c, depth), []).append(lane)
    order = ("second_accepted", "rejected", "second", "discarded", "accepted", "target", "prompt")
    priority = {k: i for i, k in enumerate(order)}
    cells = []
    for (c, depth), lanes in sorted(grouped.items()):
        kinds = [kind_of(lane) for lane in lanes]
        cells.append(Cell(c, depth, [lane.token for lane in lanes], [lane.position for lane in lanes],
                          min(kinds, key=priority.__getitem__)))
    return ScheduleGrid(cells, len(trace), loops, commits, len(prompt_positions))


def _read_events(events, seq: int, current: dict) -> int:
    """Record the fates that one cycle's events give the lanes of `seq` in `current`; returns its commits. A chosen
    sibling's branch joins the main path (its lanes are keyed as branch 0 from then on)."""
    committed = 0
    for kind, s, position, token in events:
        if s != seq:
            continue
        if kind in ("accept", "reject"):
            lane = current.get((position, token, 0))
            if lane is not None:
                lane.fate = "accepted" if kind == "accept" else "rejected"
        elif kind == "accept_second":
            branch = next(k[2] for k in current if k[:2] == (position, token) and k[2] and current[k].second)
            current[(position, token, branch)].fate = "second_accepted"
            for key in [k for k in current if k[2] == branch]:
                current[key[:2] + (0,)] = current.pop(key)
        elif kind == "commit":
            committed += 1
    return committed


def plot_schedule(trace: Sequence, *, seq: int = 0, tokenizer=None, num_loops: int | None = None,
                  max_cycles: int | None = None, ax=None, title: str | None = None):
    """Draw the schedule of sequence `seq` with matplotlib; returns the figure. See the module docstring.

    `tokenizer` (optional) decodes the token ids in the cells; `max_cycles` cuts long runs; `ax` draws into an
    existing axes.
    """
    import matplotlib.pyplot as plt
    from matplotlib.axes import Axes
    from matplotlib.patches import Patch, Rectangle

    if max_cycles is not None and (not is_integer(max_cycles) or max_cycles < 1):
        raise ValueError(f"max_cycles={max_cycles!r}: pass a whole number >= 1 of cycles to draw, or None for all.")
    if ax is not None and not isinstance(ax, Axes):
        raise ValueError(f"ax is a {type(ax).__name__}; pass a matplotlib Axes to draw into (plt.subplots()[1]), or "
                         "None for a new figure.")
    if tokenizer is not None and not callable(getattr(tokenizer, "decode", None)):
        raise ValueError(f"tokenizer is a {type(tokenizer).__name__}, which has no decode method; pass the model's "
                         "tokenizer (AutoTokenizer.from_pretrained(...)), or None to show token ids.")
    grid = schedule_grid(trace, seq=seq, num_loops=num_loops)
    cycles = grid.num_cycles if max_cycles is None else min(max_cycles, grid.num_cycles)
    if ax is None:
        fig, ax = plt.subplots(figsize=(min(0.75 * cycles + 1.8, 24), 0.75 * grid.num_loops + 1.6))
    else:
        fig = ax.figure
    used = set()
    for cell in grid.cells:
        if cell.cycle >= cycles:
            continue
        used.add(cell.kind)
        ax.add_patch(Rectangle((cell.cycle, cell.depth), 1, 1, facecolor=COLORS[cell.kind], edgecolor="white",
                               linewidth=1.5))
        ax.text(cell.cycle + 0.5, cell.depth + 0.5, _label(cell, tokenizer), ha="center",
                va="center", fontsize=7, clip_on=True)
    for c in range(cycles):
        if grid.commits[c]:
            ax.text(c + 0.5, -0.15, f"+{grid.commits[c]}", ha="center", va="bottom", fontsize=7, color="#31a354")
    ax.set_xlim(0, cycles)
    ax.set_ylim(grid.num_loops, -0.6)  # loop 1 at the top
    ax.set_xticks([c + 0.5 for c in range(cycles)], [str(c + 1) for c in range(cycles)], fontsize=7)
    ax.set_yticks([d + 0.5 for d in range(grid.num_loops)], [f"loop {d + 1}" for d in range(grid.num_loops)],
                  fontsize=8)
    ax.set_xlabel("core call (cycle); +n: tokens committed after it")
    ax.tick_params(length=0)
    for spine in ax.spines.values():
        spine.set_visible(False)
    ax.legend(handles=[Patch(facecolor=COLORS[k], label=LABELS[k]) for k in KINDS if k in used],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7, frameon=False)
    ax.set_title(title or "speculative schedule: one column per call of the shared stack", fontsize=9)
    fig.tight_layout()
    return fig


def _label(cell: Cell, tokenizer) -> str:
    if cell.kind == "prompt" and len(cell.tokens) > 1:
        return f"prompt\n×{len(cell.tokens)}"
    words = [_token_text(t, tokenizer) for t in cell.tokens[:3]]
    return "\n".join(words) + ("\n…" if len(cell.tokens) > 3 else "")


def _token_text(token: int, tokenizer) -> str:
    if tokenizer is None:
        return str(token)
    text = tokenizer.decode([token])
    text = text.replace("\n", "\\n").replace("\t", "\\t")
    if text.strip() == "":
        text = repr(text)[1:-1] or "∅"
        text = text.replace(" ", "␣")
    return text if len(text) <= 7 else text[:6] + "…"


__all__ = ["COLORS", "KINDS", "Cell", "ScheduleGrid", "plot_schedule", "schedule_grid"]
