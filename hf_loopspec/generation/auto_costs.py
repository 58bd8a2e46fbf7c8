"""What a token costs under each setting `speculative_mode="auto"` can choose, on one model, device, dtype and batch.

A `Candidate` is plain decoding or one speculative setting (mode, d, K). A `CostTable` holds the measured seconds
of one plain decoding step (one token for the whole batch) and of one engine cycle (one core call with its head and
embedding work) per speculative candidate. With the acceptance a of drafts from depth d, the cost model is

    pipeline (d):      calls per token = d + (U - d)(1 - a)
    block (d, K):      calls per round = (K + 1) d + (U - d), tokens per round = 1 + a + ... + a^K

and seconds per token = calls per token * seconds per cycle; a candidate's speed-up is plain's seconds per token over
its own. `auto_calibration.costs_for` measures a table once per (model, device, dtype, loop count, batch size) or
reads the one an earlier process stored, and keeps it here for the process; auto's own segments then refine it
(`observe`: the processors, prompts and load of real calls, in this process only); `set_costs` injects a fixed table
(tests: every choice is then deterministic).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass


@dataclass(frozen=True)
class Candidate:
    """Plain decoding (`mode` None) or one speculative setting."""

    mode: str | None
    draft_loops: int | None = None
    num_speculative_tokens: int | None = None

    @property
    def name(self) -> str:
        if self.mode is None:
            return "plain"
        if self.mode == "pipeline":
            return f"pipeline(d={self.draft_loops})"
        return f"block(d={self.draft_loops},K={self.num_speculative_tokens})"

    def kwargs(self) -> dict:
        """The `generate` keyword arguments that run this setting (without second proposals: a config's
        `second_draft_loops` cleared)."""
        if self.mode is None:
            return {"speculative_mode": None}
        return {"speculative_mode": self.mode, "draft_loops": self.draft_loops,
                "num_speculative_tokens": self.num_speculative_tokens, "second_draft_loops": None}


PLAIN = Candidate(None)


@dataclass(frozen=True)
class CostTable:
    """Seconds of one plain step and of one engine cycle per speculative candidate (see the module docstring)."""

    plain_step: float
    cycle: dict[Candidate, float]
    adapt: bool = False  # follow the costs that auto's own segments take (`observe`); measured tables do


def calls_per_token(candidate: Candidate, loops: int, acceptance: float) -> float:
    """Core calls per committed token of one sequence for `candidate` at draft acceptance `acceptance` (plain: U)."""
    a = min(max(acceptance, 0.0), 1.0)
    if candidate.mode is None:
        return float(loops)
    d = candidate.draft_loops
    if candidate.mode == "pipeline":
        return d + (loops - d) * (1 - a)
    k = candidate.num_speculative_tokens
    per_round = sum(a ** i for i in range(k + 1))
    return ((k + 1) * d + (loops - d)) / per_round


def speedup(costs: CostTable, candidate: Candidate, loops: int, acceptance: float) -> float:
    """Estimated speed of `candidate` over plain decoding (1.0 for plain itself)."""
    if candidate.mode is None:
        return 1.0
    seconds = calls_per_token(candidate, loops, acceptance) * costs.cycle[candidate]
    return costs.plain_step / seconds if seconds > 0 else float("inf")


_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {_key: table}


def _key(model, batch: int | None, measured: bool) -> tuple:
    """A table's key: (device, dtype, loops, batch). A measured table (`adapt`) holds for the loop count the model
    runs now (Huginn's `num_steps`: the steps a call costs) and one batch size; an injected one for every loop count
    (`loops` None), and for every batch size when `batch` is None."""
    return str(model.device), str(model.lane_dtype), model.num_loops if measured else None, batch


def set_costs(model, table: CostTable | None, batch: int | None = None) -> None:
    """Use `table` for `model` on its current device and dtype, for batch size `batch` (an injected table replaces the
    tables of every loop count kept for it), or for every batch size (`batch` None: it replaces every table kept for
    the model, measured or injected); `table=None` forgets the tables of that batch size (of every loop count), or
    with `batch` None every table of `model` (the next auto call measures)."""
    tables = _TABLES.setdefault(model, {})
    here = _key(model, batch, measured=False)[:2]  # (device, dtype)
    every_loop_count = table is None or not table.adapt  # forgetting or injecting replaces all of `batch`'s tables
    for key in list(tables):
        if batch is None or key[:2] == here and key[3] == batch and (every_loop_count or key[2] == model.num_loops):
            del tables[key]
    if table is not None:
        tables[_key(model, batch, measured=table.adapt and batch is not None)] = table


def kept_table(model, batch: int) -> CostTable | None:
    """The table this process holds for `model` at batch size `batch`: measured at its loop count now, else injected
    for that batch size, else injected for every batch size."""
    tables = _TABLES.get(model, {})
    keys = (_key(model, batch, measured=True), _key(model, batch, measured=False), _key(model, None, measured=False))
    return next((tables[key] for key in keys if key in tables), None)


def observe(model, batch: int, candidate: Candidate, seconds: float, steps: int) -> None:
    """Fold what one of auto's segments took (`seconds` for `steps` plain steps or engine core calls, set-up,
    processors and the prompt's prefill included, under the machine's current load) into a measured table, half
    old, half new (a short segment's set-up would weigh too much alone). A plain observation scales the
    speculative costs by the same factor (a change of load slows every setting alike, so the ratios, which decide,
    stay those measured). Injected tables (`adapt` False) stay fixed."""
    tables = _TABLES.get(model, {})
    key = _key(model, batch, measured=True)
    table = tables.get(key)
    if table is None or not table.adapt or steps <= 0 or (candidate.mode and candidate not in table.cycle):
        return
    old = table.plain_step if candidate.mode is None else table.cycle[candidate]
    cost = (old + seconds / steps) / 2
    if candidate.mode is None:
        plain, cycle = cost, {c: v * cost / old for c, v in table.cycle.items()}
    else:
        plain, cycle = table.plain_step, {**table.cycle, candidate: cost}
    tables[key] = CostTable(plain, cycle, adapt=True)
