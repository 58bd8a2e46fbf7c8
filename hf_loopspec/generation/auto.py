"""`speculative_mode="auto"`: one `generate` call decoded as segments, each with the setting judged fastest.

`generate_auto` runs the call as a chain of ordinary `generate` calls, each continuing from the cache and the
sequences the previous one returned (the continuation every mode supports, so the chain's greedy tokens equal one
plain call's, token for token). Each segment is plain decoding, block or pipeline with the depth and length
`auto_policy.Chooser` picks from the call costs (`auto_calibration.costs_for`, measured once per model, device,
dtype and batch size, kept for the process and stored on disk for later ones) and the acceptance the earlier
segments observed. Sampling draws every segment as the fixed modes do (each speculative segment seeds its run
generator from torch's global one, plain segments draw from it), so a segment is distribution-preserving given its
prefix and so is the chain; a seeded auto call equals the same chain of fixed-mode calls.

Rows that stopped (EOS) in an earlier segment stay stopped: the remaining segments decode plainly with those rows
forced to the pad token (as plain decoding feeds them), so their tokens and cached KV are plain decoding's; their
scores and logits are zeros from the step after their end, as the fixed modes give them (`auto_rows.zero_ended`; a
call decoded plainly in one stretch returns plain decoding's). A segment that ends early ends the call (every row has
stopped). A call with a `ONE_STRETCH` setting chooses once and decodes in one segment: its own stopping criteria, stop
strings or `max_time` (which rows stopped, or how long the call has run, only they know), or a logits processor that
transformers builds from a call's input length or `max_length` (`forced_eos_token_id`, `begin_suppress_tokens`, ...),
which a later segment would measure anew. The call's settings are transformers' merge of its config over the model's
(`merged_config`), its attention mask the one transformers infers when none is passed, and a sampled call's rows are
repeated `num_return_sequences` times up front. Speculative segments run on a `PagedLoopCache` and plain ones on
transformers' `DynamicCache` (faster for plain decoding): the KV moves between the two when the choice changes
(`cache.convert`), copied, not recomputed. A cache the caller passed stays the call's cache: a `PagedLoopCache` backs
every segment, and a `DynamicCache` is refilled with the call's KV at its end. A call continuing another kind of
cache (e.g. a `StaticCache`) decodes plainly in one segment (reason "cache-type"), and so does the rest of a call on
a fixed-capacity `PagedLoopCache` too small for a speculative segment's up-front reservation (reason "capacity"). A
call with `position_ids` of its own decodes plainly in one segment (reason "position-ids": only plain decoding
follows them). A model that cannot decode speculatively (`model_checks.model_fallback`), a call with a logits
processor not known to be row-pure (`processors.plain_fallback`, on the processors it builds up front: its own,
guidance, watermarking), or one that asks for what only plain decoding does (`config.settings_fallback`:
`synced_gpus`, `prefill_chunk_size`) decodes the whole call plainly in one segment (reason "fallback"), whatever
auto would choose; a speculative segment that decoded plainly for a reason found only then (its `fallback`) makes
the call report it and decode the rest plainly. Beam search, assistants, `inputs_embeds` and per-step hidden states
or attentions are refused, as with the fixed modes.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import torch
from transformers import Cache, DynamicCache, GenerationConfig, LogitsProcessorList, StoppingCriteriaList

from ..cache.convert import to_dynamic, to_paged
from ..cache.paged import PagedLoopCache
from ..defaults import DEFAULT_NUM_SPECULATIVE_TOKENS
from ..looped import check_kv_continues
from .auto_calibration import costs_for
from .auto_costs import PLAIN, Candidate, CostTable, observe
from .auto_policy import (
    AutoChoice,
    AutoStats,
    Chooser,
    acceptance_settings,
    call_setting,
    one_stretch,
    policy_for,
    remember,
    remembered,
)
from .auto_rows import ForcePad, RowEnds, Stopped, account, ended, zero_ended
from .cache_checks import check_cache_implementation
from .call import auto_segment, pass_exit
from .config import (
    AUTO_MODE,
    EXIT_OPTIONS,
    SPECULATIVE_KEYS,
    check_generation_mode,
    merged_config,
    requested_mode,
    resolve_speculative,
    settings_fallback,
    synced_gpus_of,
)
from .inputs import (
    as_integer,
    check_generation_values,
    check_left_padded,
    check_token_settings,
    prompt_or_bos,
)
from .model_checks import execution_device, model_fallback
from .processors import plain_fallback, warn_fallback
from .stats import SequenceStats
from .wavefront.host import compile_problem
from .wavefront.span import reserved_positions


def requested(model, kwargs: dict) -> bool:
    """Whether a `generate` call with `kwargs` asks for auto (`config.requested_mode`)."""
    return requested_mode(model, kwargs) == AUTO_MODE


def candidates(loops: int, draft_loops: int | None, k: int | None) -> list[Candidate]:
    """Plain, pipeline at d = 1 and 2 where U % d == 0 (only `draft_loops` when given) and block at the first of
    those depths (`draft_loops` when given) with K = `k` (default `DEFAULT_NUM_SPECULATIVE_TOKENS`)."""
    if loops < 2:
        return [PLAIN]
    depths = [draft_loops] if draft_loops is not None else [d for d in (1, 2) if d < loops]
    pipelines = [Candidate("pipeline", d) for d in depths if loops % d == 0]
    block = Candidate("block", depths[0], k or DEFAULT_NUM_SPECULATIVE_TOKENS)
    return [PLAIN, *pipelines, block]


def calibrate(model, batch: int, kwargs: dict) -> CostTable:
    """The cost table an auto `generate` call of `batch` rows with `kwargs` uses, measured now unless this or an
    earlier process has it (`auto_calibration.costs_for`): calling it first keeps the measuring out of the call's
    own time. A model with recurrence settings (Huginn) is measured under the call's, as `generate` runs it (its
    steps; a seed drawn for initial states that need one)."""
    config = merged_config(model, kwargs)
    with model.call_block(kwargs.get("generation_config"), **{key: kwargs.get(key) for key in model.generation_keys}):
        options = candidates(model.num_loops, call_setting(kwargs, config, "draft_loops"),
                             call_setting(kwargs, config, "num_speculative_tokens"))
        return costs_for(model, batch, options)


class SegmentStreamer:
    """A streamer seen by each segment: the prompt once, every segment's tokens, `end()` once at the call's end."""

    def __init__(self, inner):
        self.inner, self.skip_prompt = inner, False

    def put(self, value):
        if self.skip_prompt:  # each segment's generate first puts its input ids
            self.skip_prompt = False
            return
        self.inner.put(value)

    def end(self):
        pass


GENERATION_KEYS = frozenset(vars(GenerationConfig()))  # transformers' own settings of a generation config


@dataclass
class _Call:
    """What the segments share: the call's kwargs without the per-segment keys, and its limits."""

    base: dict
    max_new: int
    min_new: int | None  # the call's minimum length as new columns (min_new_tokens, else min_length's)
    min_cleared: dict  # without one: the call's min_new_tokens / min_length (None, 0) that clear a config's minimum
    eos: list[int]
    pad: int
    single: bool  # a setting of `auto_policy.ONE_STRETCH`: one segment
    stop_strings: str | list[str] | None  # the call's (its config's), matched with the call's `tokenizer`
    return_dict: bool
    use_cache: bool
    engine_settings: dict  # compile_core / speculative_engine, for the speculative segments
    plain_reason: str | None  # why the whole call decodes plainly in one segment ("position-ids"), or None
    fallback: str | None  # `model_fallback`: why the model cannot decode speculatively (plain_reason "fallback")


def _prepare(model, ids: torch.Tensor | None, kwargs: dict, config: GenerationConfig) -> tuple[_Call, list[Candidate]]:
    """Validate the call (`config`: `merged_config`) and split its kwargs (module docstring); `ValueError` names
    what auto refuses."""
    if ids is None or kwargs.get("inputs_embeds") is not None:
        raise ValueError("speculative_mode='auto' decodes from input_ids alone (got inputs_embeds, or no inputs); "
                         "pass input_ids alone, or speculative_mode=None.")
    loops = model.kv_layout.num_loops  # (model.num_loops, after `check_built`: a size assigned on the config since
    # the model was built raises here, not in calibration's plain run, naming the calibration prompt's ids)
    d, k = call_setting(kwargs, config, "draft_loops"), call_setting(kwargs, config, "num_speculative_tokens")
    spec = resolve_speculative(AUTO_MODE, d, k, call_setting(kwargs, config, "compile_core"),
                               call_setting(kwargs, config, "speculative_engine"), num_loops=loops,
                               second_draft_loops=call_setting(kwargs, config, "second_draft_loops"))
    d, k = (None if x is None else as_integer(x, name) for x, name in ((d, "draft_loops"),
                                                                      (k, "num_speculative_tokens")))
    assistant = kwargs.get("assistant_model")
    check_generation_mode(spec, config.get_generation_mode(assistant), config, assistant)
    check_generation_values(config)
    check_cache_implementation(config, kwargs.get("cache", kwargs.get("past_key_values")))
    max_new = config.max_new_tokens
    if max_new is not None and max_new < 1:
        raise ValueError(f"max_new_tokens={max_new} must be >= 1 (the tokens to generate).")
    if max_new is None and _default_max_length(model, kwargs):  # as transformers: that many new tokens
        limit = getattr(model.config, "max_position_embeddings", None)
        max_new = config.max_length if limit is None else min(config.max_length, limit - ids.shape[1])
        if max_new < 1:  # (plain decoding's own error for a prompt that fills the positions)
            raise ValueError(f"Input length of input_ids is {ids.shape[1]}, but the model has {limit} positions "
                             "(max_position_embeddings): no new token fits; shorten the input.")
    if max_new is None:
        max_new = config.max_length - ids.shape[1]
        if max_new < 1:
            raise ValueError(f"max_length={config.max_length} leaves no new token after the {ids.shape[1]} input "
                             "columns; pass max_new_tokens >= 1, or a larger max_length.")
    eos = config.eos_token_id
    eos = [] if eos is None else [int(e) for e in (torch.as_tensor(eos).reshape(-1).tolist())]
    pad = int(config.pad_token_id) if config.pad_token_id is not None else (eos[0] if eos else 0)
    drop = {*SPECULATIVE_KEYS, "max_new_tokens", "max_length", "min_new_tokens", "min_length", "cache",
            "past_key_values", "return_dict_in_generate", "use_cache", "attention_mask", "inputs", "input_ids",
            "streamer"}
    base = {key: value for key, value in kwargs.items() if key not in drop} | model.call_settings()
    if config.do_sample and config.num_return_sequences > 1:  # the rows are repeated once, up front (`_rows_and_mask`)
        base["num_return_sequences"] = 1
        if (allowed := base.get("prefix_allowed_tokens_fn")) is not None:  # its batch id stays the prompt's
            copies = config.num_return_sequences
            base["prefix_allowed_tokens_fn"] = lambda batch_id, tokens: allowed(batch_id // copies, tokens)
    # the minimum as new columns: min_new_tokens when set (transformers then ignores min_length), else min_length's
    min_new = config.min_new_tokens if config.min_new_tokens is not None else (config.min_length or 0) - ids.shape[1]
    processors = _processors(model, ids, kwargs, config)  # (settings they refuse: refused before any work)
    fallback = model_fallback(model) or plain_fallback(processors) \
        or settings_fallback(config, synced_gpus_of(model, kwargs.get("synced_gpus")))
    if fallback is not None:
        warn_fallback(fallback)
    elif spec.compile_backend is not None and (host := compile_problem(processors, ids.shape[1], None, None)):
        raise ValueError(f"speculative_mode='auto' cannot run {host}.")  # (whichever segments auto would choose)
    call = _Call(base, int(max_new), min_new if min_new > 0 else None,
                 {key: kwargs[key] for key in ("min_new_tokens", "min_length") if key in kwargs}, eos, pad,
                 single=one_stretch(kwargs, config), stop_strings=call_setting(kwargs, config, "stop_strings"),
                 return_dict=bool(config.return_dict_in_generate), use_cache=config.use_cache is not False,
                 engine_settings={key: call_setting(kwargs, config, key)
                                  for key in ("compile_core", "speculative_engine")
                                  if key in kwargs or getattr(config, key, None) is not None},  # (a None clears)
                 plain_reason="position-ids" if kwargs.get("position_ids") is not None else (
                     "fallback" if fallback else None), fallback=fallback)
    return call, candidates(model.num_loops, d, k)


def _processors(model, ids: torch.Tensor, kwargs: dict, config: GenerationConfig) -> LogitsProcessorList:
    """The call's logits processors, built as its segments build them: a setting they refuse (a malformed
    `sequence_bias`, ...) raises transformers' `ValueError` before any work, as in the fixed modes, and so does a
    token id they would index the scores with outside the vocabulary (`check_token_settings`); one not known to
    be row-pure is the call's fallback, named as the fixed modes name it; and a compiled step that could not run them
    is found up front (auto's speculative segments would raise it, and its plain ones, which drop `compile_core`,
    not)."""
    config = copy.deepcopy(config)
    model._prepare_special_tokens(config, device=ids.device)  # (the EOS tensors some processors read)
    check_token_settings(config, ids.shape[0] * (config.num_return_sequences or 1), model.config.vocab_size)
    return model._get_logits_processor(config, input_ids_seq_length=ids.shape[1], encoder_input_ids=ids,
                                       prefix_allowed_tokens_fn=kwargs.get("prefix_allowed_tokens_fn"),
                                       logits_processor=kwargs.get("logits_processor"), device=ids.device)


def _default_max_length(model, kwargs: dict) -> bool:
    """Whether neither the call, its generation config nor the model's sets `max_length`: transformers then decodes
    the default `max_length` as new tokens after the prompt, not as the output's length."""
    return (kwargs.get("max_length") is None and getattr(kwargs.get("generation_config"), "max_length", None) is None
            and model.generation_config.max_length is None)


def _rows_and_mask(model, ids: torch.Tensor, mask: torch.Tensor | None, config: GenerationConfig):
    """The call's rows and attention mask `[B', S]` as plain decoding decodes them: the mask transformers infers from
    the pad token when none is passed, and with sampling each row repeated `num_return_sequences` times."""
    if mask is None:  # `config` is the call's own copy (`merged_config`): transformers' preparation may write it
        model._prepare_special_tokens(config, False, device=ids.device, batch_size=len(ids))  # (1: no warning)
        mask = model._prepare_attention_mask_for_generation(ids, config, {})
    if config.do_sample and config.num_return_sequences > 1:
        ids, mask = (t.repeat_interleave(config.num_return_sequences, 0) for t in (ids, mask))
    return ids, mask


def generate_auto(model, output_cls, args: tuple, kwargs: dict):
    """One auto `generate` call (module docstring): `args` (the prompt, or nothing) and `kwargs` as `generate` got
    them, its other arguments by name (`inputs.by_name`); returns the sequences, or an `output_cls` with the summed
    counters as `speculation` (`AutoStats`)."""
    ids = args[0] if args else kwargs.get("input_ids")
    config = merged_config(model, kwargs)
    # every segment's exit options, merged once (an option passed as None is not given, as in the fixed modes)
    others = {key: value for key, value in kwargs.items() if key not in EXIT_OPTIONS}
    pass_exit(model, {key: kwargs.get(key) for key in EXIT_OPTIONS}, merged_config(model, others))
    ids = prompt_or_bos(model, ids, kwargs, config)  # no prompt: from BOS, as plain decoding starts
    call, options = _prepare(model, ids, kwargs, config)
    ids, mask = _rows_and_mask(model, ids, kwargs.get("attention_mask"), config)
    if call.plain_reason is None:  # whatever the segments would be: a call's fate is not a stored acceptance's
        check_left_padded(mask, AUTO_MODE)
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if cache is not None:  # (before a stretch converts it: the error names the caller's cache)
        check_kv_continues(cache, model.lane_dtype, execution_device(model))
    batch, prompt_width = ids.shape
    policy = policy_for(model)
    settings = acceptance_settings(kwargs, config, model.num_loops)
    options = [] if call.plain_reason else options  # nothing to choose: no costs measured (nor the engine run)
    chooser = Chooser(costs_for(model, batch, options), options, model.num_loops, policy,
                      remembered(model, settings))
    stats = AutoStats(mode=AUTO_MODE, draft_loops=0, engine="plain", fallback=call.fallback,
                      per_sequence=[SequenceStats() for _ in range(batch)])
    streamer = SegmentStreamer(kwargs["streamer"]) if kwargs.get("streamer") is not None else None
    stopped = torch.zeros(batch, dtype=torch.bool, device=ids.device)
    scores, logits, traces, done = [], [], [], 0
    fell_back = False  # a speculative segment decoded plainly (its `fallback` says why): so does the rest
    caller = cache  # a cache the caller holds: kept as the call's cache (see `_cache_for`)
    while done < call.max_new and not bool(stopped.all()):
        if call.plain_reason or fell_back:  # the whole call, or what a fallen-back segment left, decodes plainly
            candidate, tokens, reason, rate, estimates = PLAIN, None, call.plain_reason or "fallback", None, {}
        elif not _can_speculate(cache):
            candidate, tokens, reason, rate, estimates = PLAIN, None, "cache-type", None, {}
        else:
            candidate, tokens, reason, rate, estimates = chooser.next(first=done == 0)
        if bool(stopped.any()):
            candidate, tokens, reason = PLAIN, None, "stopped-rows"
        if call.single or tokens is None:
            tokens = call.max_new - done
        if candidate.mode is not None and not _fits(cache, ids.shape, min(tokens, call.max_new - done), call):
            candidate, tokens, reason = PLAIN, call.max_new - done, "capacity"
        # plain to the end, and no cache yet: plain `generate` exactly as it runs alone (its own DynamicCache)
        dynamic = cache is None and candidate.mode is None and tokens >= call.max_new
        cache = None if dynamic else _cache_for(model, candidate, cache, caller, mask)
        start, asked = time.perf_counter(), min(tokens, call.max_new - done)
        out, row_ends = _segment(model, call, candidate, ids, mask, cache, stopped, asked, done, streamer)
        new, cache = out.sequences[:, ids.shape[1]:], out.cache
        seconds = _observe(model, candidate, out, new, start, dynamic and call.use_cache, continued=done > 0)
        if candidate.mode is not None and getattr(getattr(out, "speculation", None), "fallback", None):
            fell_back, stats.fallback = True, out.speculation.fallback
            candidate, reason = PLAIN, "fallback"
        account(stats, getattr(out, "speculation", None), candidate, new, stopped, call.eos, model.num_loops, chooser,
                row_ends)
        choice = AutoChoice(done, candidate.mode or "plain", candidate.draft_loops, candidate.num_speculative_tokens,
                            new.shape[1], reason, rate, estimates, seconds)
        if stats.choices and _setting_of(stats.choices[-1]) != _setting_of(choice):
            stats.switches.append(done)
        stats.choices.append(choice)
        stopped = stopped | ended(new, call.eos).any(1)
        ids, done = out.sequences, done + new.shape[1]
        mask = torch.cat([mask, torch.ones_like(new, dtype=mask.dtype)], 1)
        scores += list(out.scores or ())
        logits += list(out.logits or ())
        traces += list(getattr(out, "trace", None) or ())
        if new.shape[1] < asked:  # the segment ended early: every row has stopped (EOS or the call's criteria)
            break
    remember(model, chooser.acceptance, settings)
    if isinstance(caller, DynamicCache) and cache is not caller:  # the caller's cache holds the call's KV
        cache = to_dynamic(cache, mask, into=caller)
    if streamer is not None:
        streamer.inner.end()
    if not call.return_dict:
        return ids
    if len(stats.choices) > 1 or stats.choices[0].mode != "plain":  # (one plain stretch: plain decoding's scores)
        scores, logits = (zero_ended(steps, ids[:, prompt_width:], call.eos) for steps in (scores, logits))
    return output_cls(sequences=ids, scores=tuple(scores) or None, logits=tuple(logits) or None,
                      cache=cache if call.use_cache else None,
                      speculation=stats, trace=traces or None)


def _can_speculate(cache: Cache | None) -> bool:
    """Whether a segment continuing `cache` may speculate: on a `PagedLoopCache`, or on a `DynamicCache` whose KV
    moves to one (`cache.convert`); not on another kind of cache (e.g. a `StaticCache`)."""
    return cache is None or isinstance(cache, (PagedLoopCache, DynamicCache))


def _fits(cache: Cache | None, shape: torch.Size, tokens: int, call: _Call) -> bool:
    """Whether a speculative segment of `tokens` new tokens after the `[B, S]` `shape` sequences fits `cache`: the
    engine reserves every position a segment may need up front (`span.reserved_positions`), so a fixed-capacity
    `PagedLoopCache` can be too small for it where plain decoding, which takes pages as it goes, still fits."""
    if not isinstance(cache, PagedLoopCache):  # a cache the segment gets anew grows on demand
        return True
    compiled = call.engine_settings.get("compile_core") not in (None, False)
    return cache.fits_in_order(shape[0], reserved_positions(shape[1] + tokens, compiled))


def _cache_for(model, candidate: Candidate, cache: Cache | None, caller: Cache | None, mask: torch.Tensor):
    """The cache a segment of `candidate` continues: speculation needs a `PagedLoopCache`, and plain decoding is
    faster on transformers' `DynamicCache`, so the KV moves to the cache the segment wants (`cache.convert`). A
    caller's `PagedLoopCache` stays as it is; a caller's `DynamicCache` is the one plain segments refill (`mask`
    `[B, columns + 1]`: the segment's attention mask)."""
    if candidate.mode is not None:
        if isinstance(cache, PagedLoopCache):
            return cache
        return PagedLoopCache(model.kv_layout) if cache is None else to_paged(cache, model.kv_layout, mask)
    if isinstance(cache, PagedLoopCache) and cache is not caller:
        return to_dynamic(cache, mask, into=caller if isinstance(caller, DynamicCache) else None)
    return DynamicCache() if cache is None else cache


def _observe(model, candidate: Candidate, out, new: torch.Tensor, start: float, dynamic: bool,
             continued: bool) -> float:
    """Refine the cost table from a segment that ran since `start` (`time.perf_counter`): plain per step, only on
    the `DynamicCache` plain `generate` uses (its prompt's prefill then scales every cost alike); the engine per core
    call, only for a segment that `continued` the call (a first one's prompt prefill would inflate its cost).
    Returns the segment's seconds."""
    if (device := execution_device(model)).type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    spec = getattr(out, "speculation", None)
    if candidate.mode is not None and spec is not None and spec.fallback is None and continued:
        observe(model, len(new), candidate, seconds, spec.core_calls)
    elif candidate.mode is None and dynamic:
        observe(model, len(new), candidate, seconds, new.shape[1])
    return seconds


def _setting_of(choice: AutoChoice) -> tuple:
    return choice.mode, choice.draft_loops, choice.num_speculative_tokens


def _segment(model, call: _Call, candidate: Candidate, ids, mask, cache, stopped, tokens: int, done: int,
             streamer) -> tuple:
    """One segment: `generate`'s output with `candidate`'s setting for `tokens` columns, continuing `cache`, and the
    `RowEnds` its stopping criteria were judged through when more than EOS could stop its rows plainly (a single
    plain stretch; else None)."""
    alone = cache is None and not candidate.mode and tokens >= call.max_new  # the whole call, as plain runs it alone
    kwargs = {**call.base, **candidate.kwargs(), "max_new_tokens": tokens, "attention_mask": mask,
              "return_dict_in_generate": True, "use_cache": call.use_cache or not alone} | \
        ({} if cache is None else {"cache": cache})
    kwargs.update(call.engine_settings if candidate.mode else {"compile_core": False, "speculative_engine": None})
    if not candidate.mode:  # a plain segment has no cycles to trace (and refuses speculative_trace)
        kwargs.pop("speculative_trace", None)
    if call.min_new is not None:  # what is left of it, at most the stretch (transformers warns of a larger one), as a
        # length (a min_new_tokens the call did not pass makes transformers warn of both if the model sets min_length)
        kwargs.update(min_new_tokens=None, min_length=ids.shape[1] + min(max(call.min_new - done, 0), tokens))
    else:  # none: what cleared a config's minimum clears it in the stretch's call too
        kwargs.update(call.min_cleared)
    if cache is not None or not call.use_cache:  # a later stretch continues the cache the first one made, and a
        kwargs["cache_implementation"] = None  # call without a cache (whose plain decoding builds none) sets none up
    row_ends = RowEnds(call.base, call.stop_strings, ids.shape[1], call.eos) if call.single and not candidate.mode \
        else None
    if row_ends is not None:
        kwargs["stopping_criteria"] = row_ends.criteria()
    if bool(stopped.any()):
        kwargs["logits_processor"] = LogitsProcessorList([*(call.base.get("logits_processor") or ()),
                                                          ForcePad(stopped.clone(), call.pad)])
        kwargs["stopping_criteria"] = StoppingCriteriaList([*(call.base.get("stopping_criteria") or ()),
                                                            Stopped(stopped.clone())])
    if streamer is not None:
        streamer.skip_prompt = done > 0
        kwargs["streamer"] = streamer
    if kwargs.get("generation_config") is not None:  # the segment's settings go into a copy of the call's config:
        config = kwargs["generation_config"] = copy.deepcopy(kwargs["generation_config"])  # transformers warns of both
        # except a None that clears the config's value (the call's own, and the minimum's), which stays a keyword:
        # transformers fills a config's None from the model's generation config (pad_token_id=None of the call padded
        # with the model's pad id), and applies a keyword's last
        clears = {key for key in (*call.base, "min_new_tokens", "min_length") if key in kwargs and kwargs[key] is None}
        for key in [key for key in kwargs if key in GENERATION_KEYS and key not in clears]:
            setattr(config, key, kwargs.pop(key))
    with auto_segment():  # (the exit options the auto call merged)
        return model.generate(ids, **kwargs), row_ends
