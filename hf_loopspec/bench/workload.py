"""A ragged serving workload (`make_workload`) and its two ways of being served: static batches through `generate`
(`run_static`) and transformers' continuous-batching manager (`run_continuous`). `hf_loopspec.bench.workload_main`
runs them against each other (`scripts/bench_workload.py`).

Requests carry seeded random prompt ids (ids from 3: 0..2 are special), their own number of new tokens, and an
arrival time (seconds after the start): all 0 ("burst"), or the cumulative sum of exponential gaps at a given rate
(Poisson arrivals). EOS is off (the bench's generation config), so every request commits exactly its own number of
tokens, and a request's output is its first `new_tokens` tokens.

* Static: when the engine is free, the requests that have arrived (at most `slots` of them, in arrival order; none
  arrived: wait for the next) form one left-padded batch, decoded in one call (plain: `generate`; pipeline: the
  wavefront engine that `generate` runs, as `hf-loopspec bench` calls it) until its longest request is done; all of
  them finish when the call returns.
* Continuous: one manager (`model.init_continuous_batching`, `max_requests_per_batch=slots`) takes each request
  (`add_request`) at its arrival time; a request finishes when its `GenerationOutput` arrives.

With `acceptance` set, every draft of a speculative request is replaced by the request's known greedy token with
that probability, else by a wrong one (verification stays real). Each request has one such pattern over its own
positions (`request_override`, seeded by the request), the same in both ways of serving it: in a static batch it
is the request's row of the batch's device-side draft override, in the manager the
request's `add_request(..., draft_override=...)`.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass

import torch

from ..defaults import DEFAULT_NUM_SPECULATIVE_TOKENS
from .run import run_mode, synthetic_hook

PAGE = 16  # the continuous batching manager's page size


@dataclass(frozen=True)
class Request:
    """One request of a workload."""

    index: int
    prompt: list[int]
    new_tokens: int
    arrival: float  # seconds after the start of the run


@dataclass
class Served:
    """What one run of a workload produced: per request (by index) its output tokens and its finish time (seconds
    after the start), and the run's wall time (start to the last finish)."""

    outputs: dict[int, list[int]]
    finished: dict[int, float]
    seconds: float
    mode: str | None = None  # what the engine ran: the manager's mode ("ar": plain), or the static mode


def make_workload(count: int, prompt_lens: tuple[int, int], new_tokens: tuple[int, int], vocab: int, seed: int,
                  rate: float | None = None) -> list[Request]:
    """`count` requests with prompt lengths and output lengths drawn uniformly from the inclusive ranges, prompt ids
    uniform in [3, vocab), seeded; arrivals all at 0 (`rate` None) or Poisson at `rate` requests per second. The
    arrivals have a generator of their own: the same seed gives the same requests at either kind of arrivals."""
    rng, gaps = random.Random(seed), random.Random(f"arrivals {seed}")
    requests, clock = [], 0.0
    for index in range(count):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(*prompt_lens))]
        if rate is not None and index > 0:
            clock += gaps.expovariate(rate)
        requests.append(Request(index, prompt, rng.randint(*new_tokens), clock))
    return requests


def vocab_size(model) -> int:
    """The number of token ids the model's head scores."""
    return model.head_width


def request_override(request: Request, reference: dict[int, list[int]] | None, acceptance: float | None,
                     vocab: int, seed: int, new_tokens: int | None = None) -> list[int] | None:
    """The synthetic drafts of `request` over its own positions (-1 over the prompt: no override; then, for its
    i-th new token, i < `new_tokens` (default: the request's own), its greedy token `reference[index][i]` with
    probability `acceptance`, else a wrong one; seeded by `seed` and the request's index: `run.synthetic_hook`;
    past the end of `reference[index]`, the model's own draft), or None without `acceptance`."""
    if acceptance is None or reference is None:
        return None
    known = reference[request.index][: request.new_tokens if new_tokens is None else new_tokens]
    start, hook = len(request.prompt), synthetic_hook([known], len(request.prompt), acceptance, vocab,
                                                      seed + request.index)
    return [-1] * start + [hook(0, position, -1) for position in range(start, start + len(known))]


def _batch_hook(batch: list[Request], reference, acceptance, vocab: int, seed: int):
    """The draft hook of a left-padded static batch: row b's `request_override` over the batch's longest output
    (a shorter request decodes on to it, as `generate` runs every row, and drafts there as a real model would, at
    the same acceptance when `reference` holds that many tokens). Its positions are the request's own: the engines
    count a sequence's positions from its first real token, left padding not included."""
    if acceptance is None or reference is None:
        return None
    longest = max(r.new_tokens for r in batch)
    rows = [request_override(r, reference, acceptance, vocab, seed, longest) for r in batch]

    def hook(seq: int, position: int, proposed: int) -> int:
        forced = rows[seq][position] if position < len(rows[seq]) else -1
        return proposed if forced < 0 else forced

    return hook


def _wait_until(start: float, moment: float) -> None:
    delay = start + moment - time.perf_counter()
    if delay > 0:
        time.sleep(delay)


def run_static(model, requests: list[Request], slots: int, mode: str, draft_loops: int, *, reference=None,
               acceptance: float | None = None, seed: int = 0) -> Served:
    """Serve `requests` in static batches of at most `slots` (see the module docstring), each decoded as the main
    bench decodes (`run.run_mode`: "plain" is `generate`, "pipeline" the wavefront engine `generate` runs, its
    synthetic drafts a device-side override); `reference` (request index -> greedy tokens, as many as the longest
    request of the workload makes: a batch's shorter requests draft on to its longest) feeds the drafts."""
    vocab = vocab_size(model)
    pending = sorted(requests, key=lambda r: r.arrival)
    outputs, finished = {}, {}
    start = time.perf_counter()
    while pending:
        now = time.perf_counter() - start
        if pending[0].arrival > now:
            _wait_until(start, pending[0].arrival)
            continue
        batch = [r for r in pending if r.arrival <= now][:slots]
        pending = [r for r in pending if r not in batch]
        width = max(len(r.prompt) for r in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, r in enumerate(batch):
            ids[row, width - len(r.prompt):] = torch.tensor(r.prompt)
            mask[row, width - len(r.prompt):] = 1
        hook = _batch_hook(batch, reference, acceptance, vocab, seed)
        out = run_mode(model, mode, ids.to(model.device), max(r.new_tokens for r in batch), draft_loops=draft_loops,
                       k=DEFAULT_NUM_SPECULATIVE_TOKENS, draft_hook=hook, attention_mask=mask.to(model.device))
        done = time.perf_counter() - start
        for row, r in enumerate(batch):
            outputs[r.index] = out["generated"][row, :r.new_tokens].tolist()
            finished[r.index] = done
    return Served(outputs, finished, max(finished.values()), mode)


def run_continuous(model, requests: list[Request], slots: int, generation_config, *, reference=None,
                   acceptance: float | None = None, seed: int = 0, timeout: float = 3600.0) -> Served:
    """Serve `requests` through one continuous-batching manager of `model` (transformers' API: `add_request` at
    each arrival, results collected as they finish; see the module docstring). `RuntimeError` naming the request
    when one fails or the run exceeds `timeout` seconds."""
    from transformers import ContinuousBatchingConfig

    # each slot holds the longest request's positions, as a static batch holds its own longest (not the model's C)
    longest = max(len(r.prompt) + r.new_tokens for r in requests)
    manager = model.init_continuous_batching(
        generation_config=generation_config,
        continuous_batching_config=ContinuousBatchingConfig(
            max_requests_per_batch=slots, page_size=PAGE, max_blocks_per_request=-(-longest // PAGE)))
    speculative = manager.settings.mode != "ar"  # a plain manager makes no drafts to override
    names = {f"req-{r.index}": r for r in requests}
    outputs, finished, failures = {}, {}, []

    def collect(start: float) -> None:
        while len(outputs) + len(failures) < len(requests) and time.perf_counter() - start < timeout:
            result = manager.get_result(timeout=0.05)
            if result is None or not result.is_finished():
                continue
            request = names[result.request_id]
            if result.error is not None:
                failures.append(f"{result.request_id}: {result.error}")
                continue
            outputs[request.index] = list(result.generated_tokens)[:request.new_tokens]
            finished[request.index] = time.perf_counter() - start

    manager.start()
    try:
        start = time.perf_counter()
        collector = threading.Thread(target=collect, args=(start,), daemon=True)
        collector.start()
        for request in sorted(requests, key=lambda r: r.arrival):
            _wait_until(start, request.arrival)
            drafts = request_override(request, reference, acceptance, vocab_size(model), seed) if speculative else None
            manager.add_request(request.prompt, request_id=f"req-{request.index}", max_new_tokens=request.new_tokens,
                                draft_override=drafts)
        collector.join()
    finally:
        manager.stop(block=True)
    if failures or len(outputs) < len(requests):
        raise RuntimeError(f"continuous batching: {len(failures)} request(s) failed, {len(requests) - len(outputs)} "
                           f"unfinished after {timeout:.0f} s; first failure: {failures[:1]}")
    return Served(outputs, finished, max(finished.values()), manager.settings.mode)
