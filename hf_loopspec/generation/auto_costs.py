"""What a token costs under each setting `speculative_mode="auto"` can choose, on one model, device, dtype and batch.

A `Candidate` is plain decoding or one speculative setting (mode, d, K). A `CostTable` holds the measured seconds
of one plain decoding step (one token for the whole batch) and of one engine cycle (one core call with its head and
embedding work) per speculative candidate. With the acceptance a of drafts from depth d, the cost model is

    pipeline (d):      calls per token = d + (U - d)(1 - a)
    block (d, K):      calls per round = (K + 1) d + (U - d), tokens per round = 1 + a + ... + a^K

and seconds per token = calls per token * seconds per cycle; a candidate's speed-up is plain's seconds per token
over its own. `measure_costs` times short greedy runs of each candidate on random prompts (the engine's and
transformers' own overheads included, which dominate small models on a CPU): per setting one warm-up, then the
difference between a short and a longer run, divided by the difference in steps (plain) or core calls (engine), so
set-up and prefill cancel out. `costs_for` measures once per (model, device, dtype, batch size) and keeps the table
for the process; `set_costs` injects a table (tests: a fixed table makes every choice deterministic).
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass

import torch
from transformers import GenerationConfig

from ..cache.paged import PagedLoopCache

PROBE_PROMPT = 8  # prompt tokens of a calibration run
PROBE_TOKENS = (4, 16)  # new tokens of the short and the long calibration run
PROBE_REPEATS = 2  # timed pairs per candidate (the cheapest pair is kept: other load only adds time)


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
        """The `generate` keyword arguments that run this setting."""
        if self.mode is None:
            return {"speculative_mode": None}
        return {"speculative_mode": self.mode, "draft_loops": self.draft_loops,
                "num_speculative_tokens": self.num_speculative_tokens}


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


_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {(device, dtype, batch|None): table}


def _key(model, batch: int | None) -> tuple:
    return (str(model.device), str(model.lane_dtype), batch)


def set_costs(model, table: CostTable | None, batch: int | None = None) -> None:
    """Use `table` for `model` on its current device and dtype, for batch size `batch` (None: every batch size
    without a table of its own); `table=None` forgets that table, or with `batch` None every table of `model`
    (the next auto call measures)."""
    tables = _TABLES.setdefault(model, {})
    if table is None and batch is None:
        tables.clear()
    elif table is None:
        tables.pop(_key(model, batch), None)
    else:
        tables[_key(model, batch)] = table


def costs_for(model, batch: int, candidates: list[Candidate]) -> CostTable:
    """The cost table of `model` at batch size `batch`: injected or measured earlier in this process, else measured
    now (`measure_costs`) and kept. A kept table lacking a candidate is completed by measuring that one."""
    tables = _TABLES.setdefault(model, {})
    table = tables.get(_key(model, batch)) or tables.get(_key(model, None))
    missing = [c for c in candidates if c.mode is not None and (table is None or c not in table.cycle)]
    if table is None or missing:
        measured = measure_costs(model, batch, missing if table is not None else candidates)
        table = measured if table is None else CostTable(table.plain_step, {**table.cycle, **measured.cycle},
                                                         adapt=table.adapt)
        tables[_key(model, batch)] = table
    return table


def measure_costs(model, batch: int, candidates: list[Candidate]) -> CostTable:
    """Time plain decoding and every speculative candidate on random prompts of `batch` rows (module docstring)."""
    vocab = model.get_output_embeddings().weight.shape[0]
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(min(3, vocab - 1), vocab, (batch, PROBE_PROMPT), generator=generator).to(model.device)
    plain = _per_step(model, ids, PLAIN)
    return CostTable(plain, {c: _per_step(model, ids, c) for c in candidates if c.mode is not None}, adapt=True)


def observe(model, batch: int, candidate: Candidate, seconds: float, steps: int) -> None:
    """Fold what one of auto's segments took (`seconds` for `steps` plain steps or engine core calls, set-up and
    processors included, under the machine's current load) into a measured table, half old, half new; injected
    tables (`adapt` False) stay fixed."""
    tables = _TABLES.get(model, {})
    key = _key(model, batch)
    table = tables.get(key)
    if table is None or not table.adapt or steps <= 0:
        return
    per_step = seconds / steps
    if candidate.mode is None:
        tables[key] = CostTable((table.plain_step + per_step) / 2, table.cycle, adapt=True)
    elif candidate in table.cycle:
        tables[key] = CostTable(table.plain_step, {**table.cycle, candidate: (table.cycle[candidate] + per_step) / 2},
                                adapt=True)


def _per_step(model, ids: torch.Tensor, candidate: Candidate) -> float:
    """Seconds per plain step (plain) or per engine core call (speculative), from runs of `PROBE_TOKENS`."""
    short, long = PROBE_TOKENS
    _timed(model, ids, candidate, short)
    best = float("inf")
    for _ in range(PROBE_REPEATS):
        t_short, steps_short = _timed(model, ids, candidate, short)
        t_long, steps_long = _timed(model, ids, candidate, long)
        if steps_long > steps_short:
            best = min(best, max(t_long - t_short, 1e-9) / (steps_long - steps_short))
    return best


def _timed(model, ids: torch.Tensor, candidate: Candidate, new_tokens: int) -> tuple[float, int]:
    """(wall seconds, steps) of one greedy run without EOS: steps are core calls (engine) or new tokens (plain)."""
    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None,
                              return_dict_in_generate=True)
    extra = {} if candidate.mode is None else {"cache": PagedLoopCache(model.kv_layout)}
    _synchronize(model.device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config,
                             **candidate.kwargs(), **extra)
    _synchronize(model.device)
    seconds = time.perf_counter() - start
    return seconds, new_tokens if candidate.mode is None else out.speculation.core_calls


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
