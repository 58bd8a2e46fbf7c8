"""The call-cost model: what a run would take if nothing but its stage calls (embed, core, head) cost time.

Calibration (`measure_call_costs`): for each stage of the `LoopedModel` protocol, one call over a `PagedLoopCache`
`RowBatch` at context `prompt_len` is timed for the row counts the strategies use (`call_grids`): the core for
R = 1, B, 2B, ..., max(U/d, K+1)*B rows, embed and head for 1, B, ..., max(2, K+1)*B rows (B = batch); and each
stage's causal prefill call over P*B rows (P = prompt length). A stage with KV of its own (Huginn's prelude in
`embed`, its coda in `head`) is timed on its own plane, filled to `prompt_len` like the core's; a stateless one
(Ouro's embedding lookup and head) without attention. The benchmark measures every round and takes each point's
median over the rounds (`median_costs`).

The model (`predicted_seconds`): with the row counts of a run's calls per stage (`SpeculationStats.call_rows`),

    T_hat(mode) = sum over stages s, over calls i of s: c_s(R_i)     (c_s interpolated piecewise-linearly between
                                                                       grid points, the prefill point included)

For `ar` with N new tokens (`ar_call_rows`) that is U core prefill calls and (N-1)*U core calls of B rows, one
embed call of P*B rows and N-1 of B rows, and N head calls of B rows (a head with KV: one of P*B rows, as every
prompt token writes its exit plane, and N-1 of B rows): T_hat(ar) = U*t_pre + (N-1)*U*t(B) + ....
"""

from __future__ import annotations

import math
import statistics
import time

import torch

from ..cache.paged import PagedLoopCache
from .run import synchronize

STAGES = ("embed", "core", "head")


def call_grids(batch: int, loops: int, draft_loops: int, k: int) -> dict[str, list[int]]:
    """The row counts timed per stage: every multiple of the batch a decode call of that stage can have."""
    core = sorted({1, *(batch * r for r in range(1, max(math.ceil(loops / draft_loops), k + 1) + 1))})
    lanes = sorted({1, *(batch * r for r in range(1, max(2, k + 1) + 1))})
    return {"embed": lanes, "core": core, "head": lanes}


def _time_calls(prepare, call, cleanup, device, budget_s: float, min_reps: int = 3, max_reps: int = 200) -> float:
    """Median seconds of `call(prepare())` (prepare/cleanup untimed), after one warm-up call."""
    state = prepare()
    call(state)
    cleanup(state)
    times: list[float] = []
    begin = time.perf_counter()
    while len(times) < min_reps or (len(times) < max_reps and time.perf_counter() - begin < budget_s):
        state = prepare()
        synchronize(device)
        start = time.perf_counter()
        call(state)
        synchronize(device)
        times.append(time.perf_counter() - start)
        cleanup(state)
    return statistics.median(times)


class _Calibration:
    """Random inputs and planned rows for timing one stage call; the cache holds every plane at `prompt_len`."""

    def __init__(self, model, batch: int, prompt_len: int, device: torch.device, seed: int):
        self.model, self.batch, self.prompt_len, self.device = model, batch, prompt_len, device
        self.layout = model.kv_layout
        self.gen = torch.Generator(device=device).manual_seed(seed)
        self.cache = PagedLoopCache(self.layout)
        self.cache.ensure_sequences(batch)
        self.like = torch.empty(1, dtype=model.lane_dtype, device=device)
        self.vocab = model.head_width

    def plane(self, stage: str, j: int) -> int | None:
        """The KV plane of a stage's j-th row of a sequence (None: the stage is stateless)."""
        if stage == "core":
            return j % self.model.num_loops
        return self.layout.entry_plane if stage == "embed" else self.layout.exit_plane(self.model.num_loops)

    def rows(self, stage: str, count: int, prefill: bool):
        """(seq, plane, position) lists of `count` rows: row i is sequence i % B, its j-th row (j = i // B); at
        prefill positions 0..P-1 of plane(0), else positions extending each (sequence, plane) table from P."""
        seqs = [i % self.batch for i in range(count)]
        js = [i // self.batch for i in range(count)]
        if prefill:
            return seqs, [self.plane(stage, 0)] * count, js
        per_plane = self.model.num_loops if stage == "core" else 1
        return seqs, [self.plane(stage, j) for j in js], [self.prompt_len + j // per_plane for j in js]

    def call(self, stage: str, count: int, prefill: bool):
        """(prepare, call, cleanup) for `_time_calls`."""
        seqs, planes, positions = self.rows(stage, count, prefill)
        pos = torch.tensor(positions, device=self.device)
        if stage == "embed":
            inputs = torch.randint(3, self.vocab, (count,), generator=self.gen, device=self.device)
        else:
            inputs = torch.randn(count, self.model.lane_width, generator=self.gen, device=self.device).to(
                self.model.lane_dtype)  # [count, lane_width]
        stateless = planes[0] is None
        keep = 0 if prefill else self.prompt_len

        def prepare():
            return None if stateless else self.cache.plan_rows(seqs, planes, positions, like=self.like)

        def run(rows):
            attention = None if rows is None else self.cache.attention(rows)
            if stage == "embed":
                return self.model.embed(inputs, pos, torch.tensor(seqs, device=self.device), attention)
            return getattr(self.model, stage)(inputs, pos, attention)

        def cleanup(rows):
            if rows is not None:
                for s, p in set(zip(seqs, planes)):
                    self.cache.truncate(s, p, keep)

        return prepare, run, cleanup

    def fill(self) -> None:
        """Extend every plane a timed call reads to `prompt_len` (the values do not change the cost)."""
        seqs = [s for s in range(self.batch) for _ in range(self.prompt_len)]
        positions = [p for _ in range(self.batch) for p in range(self.prompt_len)]
        planes = {*range(self.model.num_loops), self.plane("embed", 0), self.plane("head", 0)} - {None}
        for plane in sorted(planes):
            self.cache.plan_rows(seqs, [plane] * len(seqs), positions, like=self.like)


def measure_call_costs(model, batch: int, prompt_len: int, grids: dict[str, list[int]], device: torch.device,
                       budget_s: float, seed: int = 0) -> dict:
    """Seconds of one call of each stage per row count of `grids` (context `prompt_len`) and of each stage's
    causal prefill call over `batch * prompt_len` rows. See the module docstring."""
    calibration = _Calibration(model, batch, prompt_len, device, seed)
    per_point = budget_s / (sum(len(g) for g in grids.values()) + len(STAGES))
    costs = {"context": prompt_len, "prefill_rows": batch * prompt_len, "prefill": {}, "by_rows": {}}
    with torch.inference_mode():
        for stage in STAGES:  # on empty planes
            costs["prefill"][stage] = _time_calls(*calibration.call(stage, batch * prompt_len, prefill=True),
                                                  device, per_point)
        calibration.fill()
        for stage in STAGES:
            costs["by_rows"][stage] = {rows: _time_calls(*calibration.call(stage, rows, prefill=False), device,
                                                         per_point) for rows in grids[stage]}
    return costs


def median_costs(rounds: list[dict]) -> dict:
    """Per-point median of several `measure_call_costs` results."""
    first = rounds[0]
    return {**first,
            "prefill": {s: statistics.median(c["prefill"][s] for c in rounds) for s in STAGES},
            "by_rows": {s: {r: statistics.median(c["by_rows"][s][r] for c in rounds) for r in first["by_rows"][s]}
                        for s in STAGES}}


def interpolate(table: dict[int, float], x: float) -> float:
    """Piecewise-linear through the points of `table`; linear extrapolation past either end."""
    xs = sorted(table)
    if len(xs) == 1:
        return table[xs[0]] * x / xs[0]
    if x <= xs[0]:
        lo, hi = xs[0], xs[1]
    elif x >= xs[-1]:
        lo, hi = xs[-2], xs[-1]
    else:
        hi = next(v for v in xs if v >= x)
        lo = xs[xs.index(hi) - 1]
    slope = (table[hi] - table[lo]) / (hi - lo)
    return max(table[lo] + slope * (x - lo), 0.0)


def predicted_seconds(costs: dict, call_rows: dict[str, list[int]]) -> float:
    """T_hat: the run's time if only its stage calls cost time (module docstring)."""
    total = 0.0
    for stage in STAGES:
        table = dict(costs["by_rows"][stage])
        table.setdefault(costs["prefill_rows"], costs["prefill"][stage])
        total += sum(interpolate(table, r) for r in call_rows[stage])
    return total


def ar_call_rows(loops: int, batch: int, prompt_len: int, new_tokens: int, head_has_kv: bool) -> dict[str, list[int]]:
    """The row counts of an `ar` run's calls per stage (module docstring)."""
    prefill, decode = batch * prompt_len, new_tokens - 1
    head = [prefill] + [batch] * decode if head_has_kv else [batch] * new_tokens
    return {"embed": [prefill] + [batch] * decode, "core": [prefill] * loops + [batch] * (decode * loops),
            "head": head}
