"""The call-cost model: what a run would take if nothing but its core and head calls cost time.

Calibration (`measure_call_costs`): one core call (`model.core` over a `PagedLoopCache` `RowBatch` at context
`prompt_len`) is timed for the row counts the strategies use, t(R) for R = 1, B, 2B, ..., max(U/d, K+1)*B, and
the causal prefill call t_pre over P*B rows (B = batch, P = prompt length); the head over M rows likewise, h(M).
The benchmark measures them in every round and takes each point's median over the rounds (`median_costs`).

The model (`predicted_seconds`): with the row counts R_i of a run's core calls and M_j of its head calls,

    T_hat(mode) = sum_i t(R_i) + sum_j h(M_j)          (t, h interpolated piecewise-linearly between grid points)

For `ar` with N new tokens that is U prefill calls, (N-1)*U calls of B rows and N head calls of B rows
(`ar_call_shapes`): T_hat(ar) = U*t_pre + (N-1)*U*t(B) + N*h(B).
"""

from __future__ import annotations

import statistics
import time

import torch

from ..cache.paged import PagedLoopCache
from .run import synchronize


def _time_calls(prepare, call, cleanup, device, budget_s: float, min_reps: int = 3, max_reps: int = 200) -> float:
    """Median seconds of `call(prepare())` (prepare/cleanup untimed), after one warm-up call."""
    for _ in range(1):
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


def measure_call_costs(model, batch: int, prompt_len: int, core_rows: list[int], head_rows: list[int],
                       device: torch.device, dtype: torch.dtype, budget_s: float, seed: int = 0) -> dict:
    """Seconds of one core call per row count (context `prompt_len`), of the causal prefill call over
    `batch * prompt_len` rows, and of one head call per row count. See the module docstring."""
    loops = model.num_loops
    hidden_size = model.get_input_embeddings().weight.shape[-1]
    gen = torch.Generator(device=device).manual_seed(seed)
    points = len(core_rows) + len(head_rows) + 1
    per_point = budget_s / points
    cache = PagedLoopCache(model.kv_layout)
    cache.ensure_sequences(batch)
    like = torch.empty(1, dtype=dtype, device=device)

    def random_hidden(n: int) -> torch.Tensor:
        return torch.randn(n, hidden_size, generator=gen, device=device, dtype=torch.float32).to(dtype)

    # The causal prefill: every sequence's positions 0..P-1 at depth 0, on an empty table.
    seqs = [s for s in range(batch) for _ in range(prompt_len)]
    positions = [p for _ in range(batch) for p in range(prompt_len)]
    prefill_hidden = random_hidden(len(seqs))
    prefill_positions = torch.tensor(positions, device=device)

    def prepare_prefill():
        return cache.plan_rows(seqs, [0] * len(seqs), positions, like=like)

    def cleanup_prefill(_rows):
        for s in range(batch):
            cache.truncate(s, 0, 0)

    with torch.inference_mode():
        prefill = _time_calls(prepare_prefill, lambda rows: model.core(prefill_hidden, prefill_positions,
                                                                        cache.attention(rows)),
                              cleanup_prefill, device, per_point)
        # Fill every (sequence, depth) plane to prompt_len (the values do not change the cost).
        for depth in range(loops):
            cache.plan_rows(seqs, [depth] * len(seqs), positions, like=like)

        core = {}
        for r in core_rows:
            # Row i: sequence i % B; its j-th row (j = i // B) at depth j % U, position P + j // U, so every
            # (sequence, depth) table is extended contiguously from prompt_len.
            row_seq = [i % batch for i in range(r)]
            row_j = [i // batch for i in range(r)]
            row_depth = [j % loops for j in row_j]
            row_pos = [prompt_len + j // loops for j in row_j]
            hidden = random_hidden(r)
            pos = torch.tensor(row_pos, device=device)
            touched = sorted(set(zip(row_seq, row_depth)))

            def prepare(row_seq=row_seq, row_depth=row_depth, row_pos=row_pos):
                return cache.plan_rows(row_seq, row_depth, row_pos, like=like)

            def cleanup(_rows, touched=touched):
                for s, d in touched:
                    cache.truncate(s, d, prompt_len)

            core[r] = _time_calls(prepare, lambda rows, hidden=hidden, pos=pos: model.core(hidden, pos,
                                                                                          cache.attention(rows)),
                                  cleanup, device, per_point)
        head = {}
        for m in head_rows:
            hidden = random_hidden(m)
            head[m] = _time_calls(lambda: None, lambda _s, hidden=hidden: model.head(hidden).float(), lambda _s: None,
                                  device, per_point)
    return {"core": core, "prefill": prefill, "prefill_rows": batch * prompt_len, "head": head,
            "context": prompt_len}


def median_costs(rounds: list[dict]) -> dict:
    """Per-point median of several `measure_call_costs` results."""
    first = rounds[0]
    return {**first,
            "core": {r: statistics.median(c["core"][r] for c in rounds) for r in first["core"]},
            "head": {m: statistics.median(c["head"][m] for c in rounds) for m in first["head"]},
            "prefill": statistics.median(c["prefill"] for c in rounds)}


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


def predicted_seconds(costs: dict, core_rows: list[int], head_rows: list[int]) -> float:
    """T_hat: the run's time if only its core and head calls cost time (module docstring)."""
    core_table = dict(costs["core"])
    core_table.setdefault(costs["prefill_rows"], costs["prefill"])
    return sum(interpolate(core_table, r) for r in core_rows) + sum(interpolate(costs["head"], m) for m in head_rows)


def ar_call_shapes(loops: int, batch: int, prompt_len: int, new_tokens: int) -> tuple[list[int], list[int]]:
    """Core and head row counts of an `ar` run: U prefill calls, (N-1)U calls of B rows, N heads of B rows."""
    return [batch * prompt_len] * loops + [batch] * ((new_tokens - 1) * loops), [batch] * new_tokens
