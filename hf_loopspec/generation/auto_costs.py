"""What a token costs under each setting `speculative_mode="auto"` can choose, on one model, device, dtype and batch.

A `Candidate` is plain decoding or one speculative setting (mode, d, K). A `CostTable` holds the measured seconds
of one plain decoding step (one token for the whole batch) and of one engine cycle (one core call with its head and
embedding work) per speculative candidate. With the acceptance a of drafts from depth d, the cost model is

    pipeline (d):      calls per token = d + (U - d)(1 - a)
    block (d, K):      calls per round = (K + 1) d + (U - d), tokens per round = 1 + a + ... + a^K

and seconds per token = calls per token * seconds per cycle; a candidate's speed-up is plain's seconds per token
over its own. `measure_costs` times short greedy runs of each candidate on random prompts, the engine's and
transformers' own overheads included (they dominate small models on a CPU), the engine with forced drafts, three in
four right (its cycles then carry the rows of a typical acceptance): per setting one warm-up, then the difference
between a short and a longer run, divided by the difference in steps (plain) or core calls (engine), so set-up and
prefill cancel out.
`costs_for` measures once per (model, device, dtype, batch size) and keeps the table for the process; auto's own
segments then refine it (`observe`: the processors, prompts and load of real calls); `set_costs`
injects a fixed table (tests: every choice is then deterministic).
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass

import torch
from transformers import GenerationConfig

from ..cache.paged import PagedLoopCache
from .config import resolve_speculative

PROBE_PROMPT = 8  # prompt tokens of a calibration run
PROBE_TOKENS = (4, 16)  # new tokens of the short and the long calibration run
PROBE_REPEATS = 2  # timed pairs per candidate (the cheapest pair is kept: other load only adds time)
CALIBRATION_PERIOD = 4  # the calibration's drafts: right but one in this many (acceptance 3/4: typical lane counts)


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
    """Time plain decoding and every speculative candidate on random prompts of `batch` rows (module docstring).
    The engine's drafts are forced (a device-side override with plain decoding's tokens, one in
    `CALIBRATION_PERIOD` wrong), so its cycles carry the rows of a typical acceptance, not the near-empty lanes
    that random prompts' rejections leave."""
    vocab = vocab_of(model)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(min(3, vocab - 1), vocab, (batch, PROBE_PROMPT), generator=generator).to(model.device)
    with torch.inference_mode():
        reference = _plain(model, ids, PROBE_TOKENS[1])  # [B, S + N]
    plain = _per_step(lambda n: _plain_seconds(model, ids, n))
    return CostTable(plain, {c: _per_step(lambda n, c=c: _engine_seconds(model, ids, c, n, reference))
                             for c in candidates if c.mode is not None}, adapt=True)


def observe(model, batch: int, candidate: Candidate, seconds: float, steps: int) -> None:
    """Fold what one of auto's segments took (`seconds` for `steps` plain steps or engine core calls, set-up,
    processors and the prompt's prefill included, under the machine's current load) into a measured table, half
    old, half new (a short segment's set-up would weigh too much alone). A plain observation scales the
    speculative costs by the same factor (a change of load slows every setting alike, so the ratios, which decide,
    stay those measured). Injected tables (`adapt` False) stay fixed."""
    tables = _TABLES.get(model, {})
    key = _key(model, batch)
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


def vocab_of(model) -> int:
    return model.get_output_embeddings().weight.shape[0]


def _per_step(run) -> float:
    """Seconds per step from `run(new_tokens) -> (seconds, steps)` at the two lengths of `PROBE_TOKENS`."""
    short, long = PROBE_TOKENS
    run(short)  # warm-up
    best = float("inf")
    for _ in range(PROBE_REPEATS):
        t_short, steps_short = run(short)
        t_long, steps_long = run(long)
        if steps_long > steps_short:
            best = min(best, max(t_long - t_short, 1e-9) / (steps_long - steps_short))
    return best


def _plain(model, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Plain greedy decoding without EOS: the sequences `[B, S + new_tokens]`."""
    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None)
    return model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config, speculative_mode=None)


def _plain_seconds(model, ids: torch.Tensor, new_tokens: int) -> tuple[float, int]:
    start = _now(model.device)
    with torch.inference_mode():
        _plain(model, ids, new_tokens)
    return _now(model.device) - start, new_tokens


def _engine_seconds(model, ids: torch.Tensor, candidate: Candidate, new_tokens: int, reference: torch.Tensor):
    """(seconds, core calls) of one engine run of `candidate` whose drafts are right (`reference`'s tokens) but
    for every `CALIBRATION_PERIOD`-th, which is wrong."""
    from .dispatch import SpeculativeRequest  # here: dispatch imports the engine, which imports this package
    from .wavefront.engine import WavefrontEngine

    width = ids.shape[1] + new_tokens
    override = torch.full((len(ids), width), -1, dtype=torch.long, device=ids.device)
    right = reference[:, ids.shape[1]:width]
    wrong = (torch.arange(new_tokens, device=ids.device) % CALIBRATION_PERIOD) == CALIBRATION_PERIOD - 1
    override[:, ids.shape[1]:] = torch.where(wrong, (right + 1) % vocab_of(model), right)
    spec = resolve_speculative(candidate.mode, candidate.draft_loops, candidate.num_speculative_tokens,
                               num_loops=model.num_loops)
    request = SpeculativeRequest(spec, PagedLoopCache(model.kv_layout), ids, width, pad_token_id=0)
    start = _now(model.device)
    with torch.inference_mode():
        out = WavefrontEngine.from_request(model, request, draft_override=override).run()
    return _now(model.device) - start, out.stats.core_calls


def _now(device: torch.device) -> float:
    """`time.perf_counter()` once `device` has finished its work."""
    _synchronize(device)
    return time.perf_counter()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
