"""The cost table of `speculative_mode="auto"` (`auto_costs.CostTable`): read from the process, from disk, or measured.

`costs_for` looks for a table in the process (`auto_costs.kept_table`), then for the one an earlier process stored
under the same key (`auto_cache`: model, device, dtype, threads, batch size, versions), and only then measures
(`measure_costs`), storing what it measured. Measuring is one short run of plain decoding and one engine run (one
candidate's, see below), each timed step by step:

* plain: `PROBE_TOKENS` greedy tokens of a random prompt through transformers' `generate`, a timestamp taken at
  every step (a stopping criterion that never stops); its tokens are also the engine runs' reference;
* engine: a run over the same tokens whose drafts are forced (a device-side override with plain decoding's tokens,
  one in `CALIBRATION_PERIOD` wrong), so that its cycles carry the rows of a typical acceptance rather than the
  near-empty lanes of random prompts' rejections, a timestamp taken after every cycle; the cycles that still carry
  prompt rows (the prefill) and the idle ones at the end are left out.
A plain step's cost is the mean of its timed intervals without those over twice their median (another process's
time slice, not the decoder's); the first plain step (the prompt's prefill) is left out. An engine cycle's cost is
the mean of its intervals without one over twice the next longest (`cycle_mean`): the engine's host work comes in
periods (a read-back every few cycles), so its long intervals are its own and come several to a run, and leaving
them out made speculation look several times cheaper than it is; a lone longer one is another process's.
Set-up and prefill need no warm-up to cancel out, since only steps in the middle of a run are timed. The runs are
repeated in `ROUNDS` interleaved rounds (plain, then each timed candidate, again), and each cost is its fastest
round's: the runs are short, another process that held the CPU through one whole run made its cost, stored for every
later process, several times what it is, and the choice followed it (on a busy 2-core machine, pipeline decoding was
chosen for every call of a model it slows down). On a CUDA device each timed cycle waits for the device, so the
engine's overlap of host and device work is not credited (auto's own segments, `auto_costs.observe`, then measure it).

Only the shallowest pipeline depth is timed; the other candidates take its cycle cost:
* a deeper pipeline's cycle is one core call with the same head and embedding work over at most as many rows (at
  most U/d lanes a sequence), so the timed cost is an upper bound for it, exact where a call's cost does not depend
  on its rows (weight reads or per-call overhead dominate: small batches);
* block at a depth at least as deep: its calls per token, ((K + 1) d + U - d) / (1 + a + ... + a^K), are never
  fewer than pipeline's at that depth, d + (U - d)(1 - a), so block wins only if its cycle is cheaper than the
  pipeline's by more than 7% (a factor 0.92, the worst case over a, K and U <= 8; 18%, 0.82, at U = 4, d = 1).
  Its cycles carry about as many rows on average (one a sequence while drafting, K + 1 while verifying: 2.5 at
  U = 4, d = 1, K = 4, against up to 4 for pipeline), and per-call overhead and weight reads make their cost
  nearly independent of the rows at small batches, so the choice is the one timing block would give there.
Without such a pipeline (only block given, or U % d != 0), the shallowest block is timed and the others of its K
take its cost likewise. A stored or kept table's costs are reused the same way, without timing again.
"""

from __future__ import annotations

import math
import statistics
import time

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from ..cache.paged import PagedLoopCache
from . import auto_cache
from .auto_costs import Candidate, CostTable, kept_table, set_costs
from .config import resolve_speculative
from .model_checks import execution_device

PROBE_PROMPT = 8  # prompt tokens of a calibration run
PROBE_TOKENS = 8  # new tokens of the calibration runs
CALIBRATION_PERIOD = 4  # the calibration's drafts: right but one in this many (acceptance 3/4: typical lane counts)
SPIKE = 2.0  # intervals over this many times their median are left out (module docstring)
ROUNDS = 3  # interleaved timing rounds of a calibration; each cost is its fastest round's (module docstring)


def costs_for(model, batch: int, candidates: list[Candidate]) -> CostTable:
    """The cost table of `model` at batch size `batch` covering `candidates`: kept in this process (injected or
    measured earlier), else stored on disk by an earlier process, else measured now (`measure_costs`) and stored;
    a table lacking a candidate is completed the same way. The table is kept for the process."""
    table = kept_table(model, batch)
    needed = candidates if table is None else _missing(table, candidates)
    if not needed:
        return table
    key = auto_cache.cost_key(model, batch)
    stored = decode(auto_cache.load(key))
    if stored is None or _missing(stored, needed):
        measured = measure_costs(model, batch, needed, stored)
        # stored under the file's lock with the costs another process stored meanwhile (of other candidates)
        stored = decode(auto_cache.update(key, lambda current: encode(_merged(decode(current), measured)))) or measured
    if table is not None:  # complete the kept table with the stored costs it lacks
        stored = CostTable(table.plain_step, {**stored.cycle, **table.cycle}, adapt=table.adapt)
    set_costs(model, stored, batch)
    return stored


def _merged(other: CostTable | None, measured: CostTable) -> CostTable:
    """`measured`, plus the candidates' costs of `other` it lacks."""
    return measured if other is None else CostTable(measured.plain_step, {**other.cycle, **measured.cycle},
                                                    adapt=measured.adapt)


def _missing(table: CostTable, candidates: list[Candidate]) -> list[Candidate]:
    return [c for c in candidates if c.mode is not None and c not in table.cycle]


def encode(table: CostTable) -> dict:
    """`table` as JSON-serialisable data (`decode` reverses it)."""
    return {"plain_step": table.plain_step,
            "cycle": [[c.mode, c.draft_loops, c.num_speculative_tokens, seconds] for c, seconds in table.cycle.items()]}


def decode(data) -> CostTable | None:
    """The measured table `encode` wrote, or None for anything else, a cost that is not a positive finite number of
    seconds included (a zero would divide `auto_costs.observe`'s rescaling)."""
    try:
        cycle = {Candidate(str(mode), int(d), None if k is None else int(k)): float(seconds)
                 for mode, d, k, seconds in data["cycle"]}
        plain = float(data["plain_step"])
    except (KeyError, TypeError, ValueError, OverflowError):  # (OverflowError: an Infinity depth, a 400-digit cost)
        return None
    if not all(math.isfinite(seconds) and seconds > 0 for seconds in (plain, *cycle.values())):
        return None
    return CostTable(plain, cycle, adapt=True)


def measure_costs(model, batch: int, candidates: list[Candidate], known: CostTable | None = None) -> CostTable:
    """Time plain decoding and the candidates no other one covers (`_covers`) on random prompts of `batch` rows, in
    `ROUNDS` interleaved rounds, each cost its fastest round's (module docstring), and derive the rest; with `known`,
    its costs stay, only what it lacks is added, and nothing is timed when the added candidates are covered by its
    own."""
    cycle = dict(known.cycle) if known is not None else {}
    missing = sorted(_missing(known or CostTable(0.0, {}), candidates), key=_order)
    timed: list[Candidate] = []  # the candidates that no earlier one covers, in `_order`
    for candidate in missing:
        if not any(_covers(c, candidate) for c in (*cycle, *timed)):
            timed.append(candidate)
    plain = math.inf if known is None else known.plain_step
    if timed or known is None:
        vocab = model.head_width
        ids = torch.randint(min(3, vocab - 1), vocab, (batch, PROBE_PROMPT), generator=torch.Generator().manual_seed(0))
        ids = ids.to(execution_device(model))
        seconds = dict.fromkeys(timed, math.inf)
        for _ in range(ROUNDS):  # plain, then each timed candidate, again and again
            reference, step = _plain_run(model, ids)
            plain = min(plain, step) if known is None else plain
            for candidate in timed:
                seconds[candidate] = min(seconds[candidate], _cycle_seconds(model, ids, candidate, reference))
        cycle.update(seconds)
    for candidate in missing:
        if candidate not in cycle:
            cycle[candidate] = cycle[min((c for c in cycle if _covers(c, candidate)), key=_order)]
    return CostTable(plain, cycle, adapt=True)


def _order(candidate: Candidate) -> tuple:
    """Pipelines first, shallow before deep: the order in which candidates are timed or derived."""
    return candidate.mode != "pipeline", candidate.draft_loops or 0


def _covers(timed: Candidate, other: Candidate) -> bool:
    """Whether `other` takes `timed`'s cycle cost (module docstring)."""
    if timed.draft_loops > other.draft_loops:
        return False
    if timed.mode == "pipeline":
        return True
    return other.mode == "block" and other.num_speculative_tokens == timed.num_speculative_tokens


def cycle_mean(intervals: list[float]) -> float:
    """The mean of `intervals` without those over `SPIKE` times the second longest (module docstring)."""
    ceiling = SPIKE * sorted(intervals)[-2] if len(intervals) > 2 else math.inf
    return statistics.mean(t for t in intervals if t <= ceiling)


def typical(intervals: list[float]) -> float:
    """The mean of `intervals` without those over `SPIKE` times their median."""
    median = statistics.median(intervals)
    return statistics.mean(t for t in intervals if t <= SPIKE * median)


class _Stamps(StoppingCriteria):
    """Never stops; records when each step of plain decoding ended."""

    def __init__(self, device: torch.device):
        self.device, self.times = device, []

    def __call__(self, input_ids, scores, **kwargs):
        self.times.append(_now(self.device))
        return torch.zeros(len(input_ids), dtype=torch.bool, device=input_ids.device)


def _plain_run(model, ids: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Plain greedy decoding of `PROBE_TOKENS` tokens without EOS nor stop strings: the sequences `[B, S + N]` and
    the seconds of one step (its intervals after the first, `typical`). The settings are keywords: transformers fills
    a passed config's None from the model's generation config (its EOS, or stop strings that need a tokenizer)."""
    stamps = _Stamps(ids.device)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=PROBE_TOKENS, do_sample=False,
                             pad_token_id=0, eos_token_id=None, stop_strings=None, speculative_mode=None,
                             stopping_criteria=StoppingCriteriaList([stamps]),
                             **model.call_settings())  # (Huginn: the running call's recurrence settings)
    return out, typical([b - a for a, b in zip(stamps.times, stamps.times[1:])])


def _cycle_seconds(model, ids: torch.Tensor, candidate: Candidate, reference: torch.Tensor) -> float:
    """Seconds of one engine cycle of `candidate` (module docstring) in a run whose drafts are right
    (`reference`'s tokens) but for every `CALIBRATION_PERIOD`-th, which is wrong."""
    from .dispatch import SpeculativeRequest  # here: dispatch imports the engine, which imports this package
    from .wavefront.engine import WavefrontEngine

    class Timed(WavefrontEngine):
        def _advance(self, cycles: int) -> None:
            super()._advance(cycles)
            self.ended.append(_now(ids.device))

    width, new_tokens = reference.shape[1], reference.shape[1] - ids.shape[1]
    override = torch.full((len(ids), width), -1, dtype=torch.long, device=ids.device)
    right = reference[:, ids.shape[1]:]
    wrong = (torch.arange(new_tokens, device=ids.device) % CALIBRATION_PERIOD) == CALIBRATION_PERIOD - 1
    override[:, ids.shape[1]:] = torch.where(wrong, (right + 1) % model.head_width, right)
    spec = resolve_speculative(candidate.mode, candidate.draft_loops, candidate.num_speculative_tokens,
                               num_loops=model.num_loops)
    request = SpeculativeRequest(spec, PagedLoopCache(model.kv_layout), ids, width, pad_token_id=0)
    with torch.inference_mode():
        engine = Timed.from_request(model, request, draft_override=override)
        engine.ended = [_now(ids.device)]
        engine.run()
    rows = engine.stats.call_rows["core"]  # per cycle, in order
    return cycle_mean([engine.ended[i + 1] - engine.ended[i] for i in range(engine.prefill_cycles, len(rows))
                       if rows[i] > 0])


def _now(device: torch.device) -> float:
    """`time.perf_counter()` once `device` has finished its work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
