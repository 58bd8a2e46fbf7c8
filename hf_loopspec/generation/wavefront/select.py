"""Which engine runs a speculative `generate` call (`speculative_engine`), and the wavefront engine's entry point.

The wavefront engine covers: Ouro-like models (no KV in the entry or exit stage), greedy decoding and sampling
with the logits processors it runs on the device (`processing.on_device`: `repetition_penalty`, `min_new_tokens`,
`min_length`, temperature, top-k, top-p, min-p) and, eager, the other (row-pure) processors and the draft hooks
as host work in each cycle (`host`), EOS and length stops (`max_new_tokens` / `max_length`), padded
batches, streamers, `compile_core` (the step is compiled whole with that backend), and second proposals with
second_draft_loops >= U - draft_loops (`limits.second_proposals_problem`). Everything else of a call is named
by `unsupported` or `second_proposals_problem`:

* `speculative_engine="lanes"` runs the lane decoder;
* `"wavefront"` runs the wavefront engine, or raises `ValueError` naming every unsupported setting of the call;
* `"auto"` (the default) runs the wavefront engine when it supports every setting of the call and is the faster
  engine where the call runs (`wavefront_preferred`), else the lane decoder (`out.speculation.engine` says which
  ran).
"""

from __future__ import annotations

import os

import torch
from transformers import EosTokenCriteria, MaxLengthCriteria

from ...cache.paged import PagedLoopCache
from ..config import SpeculativeConfig
from ..decoder import DecodeResult
from .engine import WavefrontEngine
from .host import compile_problem
from .limits import model_problem, second_proposals_problem
from .processing import device_processors
from .span import reserved_positions


def unsupported(model, cache: PagedLoopCache, options: dict, compiled: bool = False) -> list[str]:
    """The settings of a call (its cache and the lane decoder's `options`; `compiled`: with `compile_core`) that
    the wavefront engine does not support."""
    problems = [problem] if (problem := model_problem(model)) else []
    if cache.num_sequences:
        problems.append(f"a cache that already holds {cache.num_sequences} sequences (continuing from it)")
    if cache.debug:
        problems.append("PagedLoopCache(debug=True) (its lineage checks follow the lane decoder's lanes)")
    ids = options["input_ids"]
    positions = reserved_positions(options["max_length"], compiled)
    reserved = len(ids) * cache.num_planes * positions * cache.bytes_per_token_per_depth(model.lane_dtype)
    if reserved > free_memory(ids.device) / 2:
        problems.append(f"max_length={options['max_length']} (KV pages for {positions} positions of {len(ids)} "
                        f"sequences in {cache.num_planes} planes, reserved up front, need {reserved / 2**30:.1f} GiB: "
                        "more than half the free memory)")
    width = options["input_ids"].shape[1]
    if compiled and (host := compile_problem(options.get("logits_processor"), width, options.get("draft_hook"),
                                             options.get("second_draft_hook"))):
        problems.append(host)
    problems += [f"stopping criterion {type(c).__name__}" for c in options.get("stopping_criteria") or ()
                 if not (type(c) is EosTokenCriteria or type(c) is MaxLengthCriteria
                         and c.max_length == options["max_length"])]
    for name, label in (("trace", "speculative_trace"),
                        ("output_scores", "output_scores"), ("output_logits", "output_logits"),
                        ("exit_rule", "exit options (exit_at_step, exit_threshold, use_weighted_exit)")):
        if options.get(name):
            problems.append(label)
    return problems


def free_memory(device: torch.device) -> int:
    """Bytes of memory free on `device` (CUDA: the driver's count; otherwise the host's available memory)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def wavefront_preferred(device: torch.device, compile_backend: str | None) -> bool:
    """Whether "auto" prefers the wavefront engine for a call on `device` compiled with `compile_backend` (None:
    eager). On a CPU, eager, the two engines are about equally fast (BENCHMARKS.md), so the lane decoder runs, which
    does not reserve the KV pages of the whole budget up front; compiled, the wavefront engine is faster (its whole
    cycle is one graph). On CUDA the wavefront engine is the design's fast path (no host work per cycle, CUDA-graph
    replay), not measured yet."""
    return device.type == "cuda" or compile_backend is not None


def choose_engine(model, spec: SpeculativeConfig, cache: PagedLoopCache, options: dict) -> str:
    """"lanes" or "wavefront" for `spec.engine` (see the module docstring)."""
    if spec.engine == "lanes" or spec.engine == "auto" and not wavefront_preferred(options["input_ids"].device,
                                                                                   spec.compile_backend):
        return "lanes"
    problems = unsupported(model, cache, options, compiled=spec.compile_backend is not None)
    second = second_proposals_problem(spec.mode, model.num_loops, spec.draft_loops, spec.second_draft_loops)
    problems += [second] if second else []
    if not problems:
        return "wavefront"
    if spec.engine == "wavefront":
        raise ValueError(f"speculative_engine='wavefront' does not support {'; '.join(problems)}. Drop "
                         f"{'it' if len(problems) == 1 else 'them'}, or pass speculative_engine='lanes' (or 'auto').")
    return "lanes"


def run_engine(model, input_ids, spec: SpeculativeConfig, *, cache: PagedLoopCache, **options) -> DecodeResult:
    """One speculative run of `generate` on the engine `choose_engine` picks (`options`: the lane decoder's)."""
    if choose_engine(model, spec, cache, {**options, "input_ids": input_ids}) == "lanes":
        return model._run_lanes(input_ids, spec, cache=cache, **options)
    processors, tensors = device_processors(options.get("logits_processor"), input_ids,
                                            model.get_output_embeddings().weight.shape[0])
    eos = [int(t) for c in options.get("stopping_criteria") or () if isinstance(c, EosTokenCriteria)
           for t in c.eos_token_id.reshape(-1).tolist()]
    engine = WavefrontEngine(
        model, cache, mode=spec.mode, draft_loops=spec.draft_loops,
        num_speculative_tokens=spec.num_speculative_tokens, input_ids=input_ids,
        attention_mask=options.get("attention_mask"), pad_token_id=options.get("pad_token_id"),
        max_length=options["max_length"], eos_token_id=eos or None, compile_backend=spec.compile_backend,
        streamer=options.get("streamer"),
        processors=processors, do_sample=bool(options.get("do_sample")), **tensors,
        complete_cache=bool(options.get("complete_cache")), second_draft_loops=spec.second_draft_loops,
        logits_processor=options.get("logits_processor"), draft_hook=options.get("draft_hook"),
        second_draft_hook=options.get("second_draft_hook"),
    )
    return engine.run()
