"""One timed run of one mode (`run_mode`), the check of its output against the reference (`compare`), and the
draft overrides of `--synthetic-acceptance` (`synthetic_hook`)."""

from __future__ import annotations

import contextlib
import random
import time

import torch
from transformers import GenerationConfig, LogitsProcessorList, MaxLengthCriteria, StoppingCriteriaList
from transformers.cache_utils import DynamicCache

from ..cache.paged import PagedLoopCache
from ..generation.config import LANE_MODES, resolve_speculative
from ..generation.dispatch import SpeculativeRequest
from ..generation.wavefront import WavefrontEngine
from .args import AUTO, PLAIN_MODES


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _paged_cache_bytes(cache: PagedLoopCache) -> int:
    return 0 if cache.k_pool is None else 2 * cache.k_pool.numel() * cache.k_pool.element_size()


def _dynamic_cache_bytes(cache) -> int:
    total = 0
    for layer in getattr(cache, "layers", []):
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if torch.is_tensor(t):
                total += t.numel() * t.element_size()
    return total


def synthetic_hook(reference, prompt_len: int, acceptance: float, vocab: int, seed: int):
    """`draft_hook` that proposes `reference[seq][position - prompt_len]` with probability `acceptance`, else a
    different (wrong) token. `reference`: a `[B, N]` tensor or one list of tokens per sequence (ragged: past the end
    of its row, a sequence keeps its own draft). Each (sequence, position) gets one token, drawn up front from a
    generator seeded with `seed`, sequence by sequence: a position drafted again proposes the same token, and the
    pattern does not depend on the order an engine asks in, so every engine and every run of a mode sees the same
    drafts."""
    rng = random.Random(seed)
    ref = reference.tolist() if torch.is_tensor(reference) else reference
    drafts = []
    for row in ref:
        picks = []
        for right in row:
            if rng.random() < acceptance:
                picks.append(right)
            else:
                wrong = rng.randrange(vocab - 1)
                picks.append(wrong + (wrong >= right))
        drafts.append(picks)

    def hook(seq: int, position: int, proposed: int) -> int:
        offset = position - prompt_len
        return drafts[seq][offset] if 0 <= offset < len(drafts[seq]) else proposed

    return hook


def sampling_settings(args) -> dict | None:
    """`{"temperature", "top_p", "top_k"}` of a `--do-sample` bench, else `None` (greedy)."""
    if not args.do_sample:
        return None
    return {"temperature": float(args.temperature), "top_p": float(args.top_p), "top_k": int(args.top_k)}


@contextlib.contextmanager
def bench_generation_config(model, sampling: dict | None):
    """Within the block, `model.generation_config` is the bench's own: no EOS (every run commits exactly
    `new_tokens` per sequence), pad 0, greedy or `sampling`, and none of a checkpoint's generation defaults (e.g. a
    repetition penalty, which transformers would merge into any config passed to `generate`). The caller's config
    object is put back on exit, untouched."""
    original = model.generation_config
    model.generation_config = GenerationConfig(pad_token_id=0, eos_token_id=None, do_sample=sampling is not None,
                                               **(sampling or {}))
    try:
        yield
    finally:
        model.generation_config = original


def generation_processors(model, prompt_len: int, device: torch.device) -> LogitsProcessorList:
    """The logits processors `generate` builds from `model.generation_config` (inside `bench_generation_config`:
    the sampling warpers, in transformers' order), built by transformers' own code, for the lane modes."""
    config, _ = model._prepare_generation_config(None)
    return model._get_logits_processor(config, input_ids_seq_length=prompt_len, device=device)


def run_mode(model, mode: str, ids: torch.Tensor, new_tokens: int, *, draft_loops: int, k: int, draft_hook=None,
             output_logits: bool = False, processors: LogitsProcessorList | None = None, seed: int | None = None,
             compile_core: str | None = None, engine: str = "wavefront", second_draft_loops: int | None = None,
             attention_mask: torch.Tensor | None = None) -> dict:
    """Run one mode once, inside `bench_generation_config` (greedy or sampled as `model.generation_config` says);
    returns seconds, generated ids `[B, N]`, and for the lane modes the stats and the row counts of every call.

    `processors`: the lane modes' logits processors (`generation_processors`); `seed`: call `torch.manual_seed(seed)`
    first (untimed); `compile_core`: a torch.compile backend for the wavefront engine; `engine`: what runs a lane
    mode, "wavefront" (`draft_hook` then becomes its device-side `draft_override`) or "reference" (the lane decoder,
    eager); `second_draft_loops`: pipeline with second proposals; `attention_mask`: the left padding of `ids`
    (plain, auto and wavefront runs; None: no padding).
    """
    device = ids.device
    if seed is not None:
        torch.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    if mode in PLAIN_MODES:
        result, out = _run_plain(model, mode, ids, new_tokens, output_logits, attention_mask)
    elif mode == AUTO:
        result, out = _run_auto(model, ids, new_tokens, draft_hook=draft_hook, compile_core=compile_core,
                                attention_mask=attention_mask)
    else:
        if engine == "wavefront":
            result, out = _run_wavefront(model, mode, ids, new_tokens, draft_loops=draft_loops, k=k,
                                         draft_hook=draft_hook, processors=processors, compile_core=compile_core,
                                         second=second_draft_loops, attention_mask=attention_mask)
        else:
            result, out = _run_reference(model, mode, ids, new_tokens, draft_loops=draft_loops, k=k,
                                         draft_hook=draft_hook, processors=processors, second=second_draft_loops)
    result["generated"] = out.sequences[:, ids.shape[1]:].cpu()
    if device.type == "cuda":
        result["peak_mem_bytes"] = torch.cuda.max_memory_allocated(device)
    else:
        result["peak_mem_bytes"] = _param_bytes(model) + result["kv_bytes"]
    return result


def _run_plain(model, mode: str, ids: torch.Tensor, new_tokens: int, output_logits: bool, attention_mask=None):
    cache_kwargs = {"plain": {"cache": DynamicCache()}, "static": {"cache_implementation": "static"}}[mode]
    synchronize(ids.device)
    start = time.perf_counter()
    mask = torch.ones_like(ids) if attention_mask is None else attention_mask
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, speculative_mode=None,
                         **cache_kwargs, return_dict_in_generate=True, output_logits=output_logits)
    synchronize(ids.device)
    seconds = time.perf_counter() - start
    return {"mode": mode, "seconds": seconds, "stats": None, "kv_bytes": _dynamic_cache_bytes(out.cache),
            "logits": out.logits if output_logits else None}, out


def _run_auto(model, ids: torch.Tensor, new_tokens: int, *, draft_hook, compile_core, attention_mask=None):
    """`generate(speculative_mode="auto")` (its own choice of mode, d and K; the synthetic-acceptance hook, if any,
    as a host-side `draft_hook`, which costs it host time per cycle that the fixed modes' device override does
    not). Its first run in the process also measures the call costs, or reads them from the disk cache
    (`generation.auto_calibration`). It makes its own cache, as a user's call does: a plain call keeps transformers'
    `DynamicCache`."""
    synchronize(ids.device)
    start = time.perf_counter()
    mask = torch.ones_like(ids) if attention_mask is None else attention_mask
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, speculative_mode=AUTO,
                         return_dict_in_generate=True, draft_hook=draft_hook,
                         **({"compile_core": compile_core} if compile_core else {}))
    synchronize(ids.device)
    seconds = time.perf_counter() - start
    kv_bytes = _paged_cache_bytes(out.cache) if isinstance(out.cache, PagedLoopCache) else _dynamic_cache_bytes(
        out.cache)
    return {"mode": AUTO, "seconds": seconds, "stats": out.speculation, "call_rows": out.speculation.call_rows,
            "kv_bytes": kv_bytes}, out


def _run_reference(model, mode: str, ids: torch.Tensor, new_tokens: int, *, draft_loops: int, k: int, draft_hook,
                   processors, second: int | None = None):
    cache = PagedLoopCache(model.kv_layout)
    max_length = ids.shape[1] + new_tokens
    synchronize(ids.device)
    start = time.perf_counter()
    out = model.decode_with_lanes(
        ids, mode, draft_loops=draft_loops, num_speculative_tokens=k, cache=cache, attention_mask=None,
        logits_processor=processors, stopping_criteria=StoppingCriteriaList([MaxLengthCriteria(max_length)]),
        pad_token_id=0, max_length=max_length, draft_hook=draft_hook,
        do_sample=model.generation_config.do_sample, second_draft_loops=second)
    synchronize(ids.device)
    seconds = time.perf_counter() - start
    # The row counts of every stage call come with the stats (counted on the host: no device sync in the run).
    return {"mode": mode, "seconds": seconds, "stats": out.stats, "call_rows": out.stats.call_rows,
            "kv_bytes": _paged_cache_bytes(cache)}, out


def _run_wavefront(model, mode: str, ids: torch.Tensor, new_tokens: int, *, draft_loops: int, k: int, draft_hook,
                   processors, compile_core, second: int | None = None, attention_mask=None):
    cache = PagedLoopCache(model.kv_layout)
    max_length = ids.shape[1] + new_tokens
    override = None
    if draft_hook is not None:  # a sequence's positions count from its first real token: a shorter (left-padded)
        override = torch.full((len(ids), max_length), -1, dtype=torch.long)  # prompt drafts from an earlier one
        for seq in range(len(ids)):
            for position in range(max_length):
                override[seq, position] = draft_hook(seq, position, -1)
        override = override.to(ids.device)
    spec = resolve_speculative(mode, draft_loops, k, compile_core, num_loops=model.num_loops, modes=LANE_MODES,
                               second_draft_loops=second)
    request = SpeculativeRequest(spec, cache, ids, max_length, attention_mask, logits_processor=processors,
                                 pad_token_id=0, do_sample=model.generation_config.do_sample)
    synchronize(ids.device)
    start = time.perf_counter()  # set-up (page reservation, prompt embedding) is timed, as in the reference's run
    out = WavefrontEngine.from_request(model, request, draft_override=override).run()
    synchronize(ids.device)
    seconds = time.perf_counter() - start
    return {"mode": mode, "seconds": seconds, "stats": out.stats, "call_rows": out.stats.call_rows,
            "kv_bytes": _paged_cache_bytes(cache)}, out


def compare(generated: torch.Tensor, reference: torch.Tensor, reference_logits=None) -> dict:
    """Agreement of `generated` `[B, N]` with `reference` `[B, N]`: exact, common-prefix fraction, first divergence."""
    batch, n = reference.shape
    if generated.shape != reference.shape:
        return {"exact": False, "agreement_rate": 0.0, "first_divergence": None,
                "error": f"shape {tuple(generated.shape)} != reference {tuple(reference.shape)}"}
    differs = generated != reference
    prefixes = [int(differs[b].int().argmax()) if differs[b].any() else n for b in range(batch)]
    check = {"exact": not bool(differs.any()), "agreement_rate": sum(prefixes) / (batch * n),
             "first_divergence": None}
    if not check["exact"]:
        seq = min(range(batch), key=lambda b: prefixes[b])
        index = prefixes[seq]
        check["first_divergence"] = {"seq": seq, "token_index": index, "reference_token": int(reference[seq, index]),
                                     "token": int(generated[seq, index])}
        if reference_logits is not None:
            top2 = reference_logits[index][seq].float().topk(2).values
            check["first_divergence"]["reference_top1_top2_margin"] = float(top2[0] - top2[1])
    return check
