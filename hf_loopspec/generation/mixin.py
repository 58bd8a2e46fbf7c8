"""The `GenerationMixin` subclass that every hf_loopspec model inherits.

It adds `speculative_mode`, `draft_loops`, `num_speculative_tokens`, `compile_core`, `speculative_engine` and
`second_draft_loops` to `generate` (as kwargs or on the `GenerationConfig`), resolves and validates them once per call
before any work (`generation.call`), and routes greedy decoding and sampling to the wavefront engine
(`generation.dispatch`) when a speculative mode is set, unless a logits processor is not known to be row-pure
(`generation.processors`: the call then decodes plainly, and says so). Plain decoding (`speculative_mode=None`) is
transformers' own loop, on a growing `DynamicCache` by default or, with `cache_implementation="static"`, on a
`StaticCache` sized for one layer per (plane, layer) (`looped_static_cache`). `speculative_mode="auto"` runs the call as
a chain of such calls (`generation.auto`). `speculative_mode=None` passed to a call means plain decoding whatever the
model's generation config holds: its other speculative keys are then ignored (the call's own still conflict). The
speculative modes refuse right-padded rows (`inputs.check_left_padded`). transformers' continuous batching entry points
(`init_continuous_batching`, `continuous_batching_context_manager`, `generate_batch`) run the package's manager on the
same engine (`generation.continuous`).
"""

from __future__ import annotations

import copy
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, DynamicCache, StaticCache
from transformers.generation import GenerationMixin
from transformers.generation.utils import GenerateDecoderOnlyOutput

from ..cache.convert import to_dynamic, to_paged
from ..cache.kept import kept_on_error
from ..cache.paged import PagedLoopCache
from ..logs import get_logger
from ..looped import check_kv_continues
from . import auto
from .cache_checks import check_cache_implementation, check_cache_use
from .call import current_call, pass_exit, reject_configured_runtime_keys, runtime_options, scoped
from .columns import max_length_of
from .config import (
    AUTO_MODE,
    EXIT_OPTIONS,
    LANE_MODES,
    SPECULATIVE_KEYS,
    SpeculativeConfig,
    asks,
    check_generation_mode,
    custom_loop_settings,
    keep_passed_exit,
    reject_assistant_early_exit,
    reject_recurrence_options,
    requested_mode,
    resolve_speculative,
    settings_fallback,
    speculative_config,
)
from .decoder import ExitRule, LaneDecoder
from .dispatch import SpeculativeRequest, run_speculative
from .inputs import (
    by_name,
    check_assisted_continuation,
    check_decoding_mask,
    check_generation_values,
    check_healed_mask,
    check_model_kwargs,
    check_reference_inputs,
    check_token_settings,
    checked_call_inputs,
    count_settings_as_ints,
)
from .model_checks import dense_cache_reason, execution_device, model_fallback, virtual_tokens
from .processors import plain_fallback, warn_fallback
from .stats import SpeculationStats

logger = get_logger(__name__)
CUSTOM_LOOP = "_hf_loopspec_custom_loop"  # marks a call with a callable custom_generate (`_validate_generation_mode`)


def reject_exit_options(model_name: str, kwargs: dict) -> None:
    """`ValueError` when `kwargs` set one of `EXIT_OPTIONS`, for a family whose forward has no exit selection: such
    an option would otherwise pass through `**kwargs` unread and silently change nothing."""
    given = [f"{name}={kwargs[name]!r}" for name in EXIT_OPTIONS if asks(kwargs.get(name))]  # (0 is an exit)
    if given:
        raise ValueError(f"{', '.join(given)}: {model_name} has no exit options (they select one of Ouro's loops); "
                         "drop them (Huginn models choose their depth with num_steps).")


@dataclass
class SpeculativeDecoderOnlyOutput(GenerateDecoderOnlyOutput):
    """`GenerateDecoderOnlyOutput` plus the speculative run's counters and, on request, its cycle trace."""

    speculation: SpeculationStats | None = None
    trace: list | None = None


class LoopSpecGenerationMixin(GenerationMixin):
    """Generation for looped models (see the module docstring)."""

    def generate(self, *args, **kwargs):
        """`GenerationMixin.generate` inside a `GenerateCall` (`generation.call`) that holds this call's
        `draft_hook` and `speculative_trace` and, once resolved, its speculative settings. A call that raises on a
        caller's cache (any mode: a full pool, a criterion or streamer that raises, Ctrl-C) leaves it as it was."""
        args, kwargs = by_name(args, kwargs)
        if kwargs.get("cache_implementation") == "paged":  # transformers' switch to continuous batching
            raise ValueError("cache_implementation='paged' asks generate to switch to continuous batching, which "
                             "takes unpadded prompts: call model.generate_batch([ids, ...], generation_config=..., "
                             "max_new_tokens=...) (transformers' switch passes generate's own arguments on as "
                             "per-request settings, and reads padding as prompt tokens).")
        check_generation_values(kwargs)  # (a string failed in transformers' merge with a bare TypeError)
        ids = args[0] if args else kwargs.get("input_ids")
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        kwargs = checked_call_inputs(self, ids, kwargs, cache)  # (without ids: the BOS prompt, and its mask)
        check_cache_use(kwargs, self.generation_config)
        if isinstance(kwargs.get("custom_generate"), str):  # a repo's generate replaces the whole call: transformers
            return super().generate(*args, **kwargs)  # hands it every argument, speculative_mode included
        if callable(kwargs.get("custom_generate")):
            kwargs = {**kwargs, **custom_loop_settings(requested_mode(self, kwargs), kwargs.get("speculative_trace"))}
        if isinstance(cache, Cache) and cache.get_seq_length():
            check_assisted_continuation(kwargs, self.generation_config, cache.get_seq_length())
        with kept_on_error(cache):
            if auto.requested(self, kwargs):  # segments of plain / block / pipeline calls (`generation.auto`)
                with scoped(runtime_options(dict(kwargs), self.generation_config)):  # (checked up front: plain
                    return auto.generate_auto(self, SpeculativeDecoderOnlyOutput, args, kwargs)  # stretches drop them)
            with scoped(runtime_options(kwargs)):
                return super().generate(*args, **kwargs)

    def init_continuous_batching(self, generation_config=None, continuous_batching_config=None,
                                 workload_hints=None):
        """transformers' entry point of continuous batching (and of `continuous_batching_context_manager` and
        `generate_batch`), on the wavefront engine: a `continuous.LoopBatchingManager` with transformers' manager API,
        decoding every request as the generation config says (plain, or a speculative mode). A manager kept with
        `stop(keep_for_next_session=True)` is returned again, unless the call gives other settings than it runs
        (`ValueError`: a manager's settings are fixed for its life): a generation config merged over
        `model.generation_config` as it is now, or none for a manager built from `model.generation_config` alone
        (which may have been edited since); for a model with recurrence settings (Huginn), also those in force now."""
        from ..models.huginn.recurrence import passed_settings
        from .continuous.huginn import kept_recurrence_problem
        from .continuous.manager import LoopBatchingManager
        from .continuous.settings import check_config_types, manager_config, model_refusal, model_signature

        check_config_types(generation_config, continuous_batching_config)
        cached = getattr(self, "_cached_continuous_batching_manager", None)
        if isinstance(cached, LoopBatchingManager) and not cached.destroyed:  # (configs compared merged)
            compare = generation_config is not None or cached.from_model_config
            resolved = manager_config(self, generation_config) if compare else None
            for name, given, kept in (("generation_config", resolved, cached.generation_config),
                                      ("continuous_batching_config", continuous_batching_config,
                                       cached.continuous_batching_config)):
                if given is not None and given != kept:
                    merged = " (merged over model.generation_config as it is now)" * (name == "generation_config")
                    raise ValueError(f"{name}: this model keeps a continuous batching manager (persistent_manager="
                                     f"True, or stop(keep_for_next_session=True)) built with another {name}{merged}, "
                                     "and a manager's settings are fixed for its life; call "
                                     "model.destroy_cached_continuous_batching_manager() first, or pass the same "
                                     f"{name} (or none).")
            passed = cached.settings.passed_recurrence if generation_config is None else \
                passed_settings(self, generation_config)
            problem = kept_recurrence_problem(self, passed, cached.settings.recurrence)
            if problem is None and cached.model_signature != model_signature(self, cached.settings.recurrence):
                problem = ("this model keeps a continuous batching manager built before the model changed (its loop "
                           "count, vocabulary, dtype or device) or under another torch.autocast; call "
                           "model.destroy_cached_continuous_batching_manager() first.")
            if (problem := problem or model_refusal(self)) is not None:
                raise ValueError(problem)
            return cached
        return LoopBatchingManager(self, generation_config, continuous_batching_config, workload_hints)

    @contextmanager
    @torch.no_grad()  # (as transformers': around the manager's start and stop, not the caller's block)
    def continuous_batching_context_manager(self, generation_config=None, block: bool = True,
                                            timeout: float | None = None, continuous_batching_config=None,
                                            persistent_manager: bool = False, warmup: bool = True,
                                            workload_hints=None):
        """transformers' context manager (a manager from `init_continuous_batching`, running inside the block), safe
        for threads sharing a kept manager: the loop stops when the last of their blocks ends
        (`LoopBatchingManager.session`)."""
        manager = self.init_continuous_batching(generation_config, continuous_batching_config, workload_hints)
        with manager.session(warmup, block, timeout, persistent_manager):
            yield manager

    def destroy_cached_continuous_batching_manager(self) -> None:
        """Destroy the manager kept by `stop(keep_for_next_session=True)`, if any."""
        cached = self.__dict__.pop("_cached_continuous_batching_manager", None)
        if cached is not None:
            cached.destroy()

    def generate_batch(self, inputs, generation_config=None, continuous_batching_config=None, record_timestamps=False,
                       progress_bar=False, persistent_manager=False, warmup=True, **kwargs):
        """transformers' `generate_batch` on the package's manager; raises when the manager's loop fails instead of
        returning empty outputs (`continuous.batch`)."""
        from .continuous.batch import generate_batch
        from .continuous.settings import check_arguments

        check_arguments(persistent_manager=persistent_manager, warmup=warmup, record_timestamps=record_timestamps,
                        progress_bar=progress_bar)
        return generate_batch(self, inputs, generation_config, continuous_batching_config, record_timestamps,
                              progress_bar, persistent_manager, warmup, **kwargs)

    def _speculative(self, generation_config) -> SpeculativeConfig | None:
        """This call's speculative settings: resolved once per `generate` call (`_prepare_generation_config`);
        resolved from `generation_config` when a hook is reached outside `LoopSpecGenerationMixin.generate`."""
        call = current_call()
        if call is None or not call.resolved:
            return speculative_config(generation_config, self.num_loops)
        return call.speculative

    def _prepare_generation_config(self, generation_config, **kwargs):
        """transformers' merge of the call's config and kwargs over the model's, then the speculative kwargs. When the
        call decodes plainly (`speculative_mode` None), the speculative keys it did not pass itself (the model's own,
        e.g. a checkpoint's `generation_config.json`, and those of a passed config when it or the model's names a mode)
        are dropped: only the call's own keys can conflict. Exit options (`EXIT_OPTIONS`) set in a config reach the
        model's forward as the arguments do; recurrence settings (`RECURRENCE_OPTIONS`) in a config are refused by a
        family without them."""
        ours = {key: kwargs.pop(key) for key in SPECULATIVE_KEYS if key in kwargs}
        exits = {key: kwargs.pop(key, None) for key in EXIT_OPTIONS}  # (out of transformers' merge: None there would
        # unset the model's option for the config only, where forward reads None as not given)
        passed = generation_config
        generation_config, model_kwargs = super()._prepare_generation_config(generation_config, **kwargs)
        # a passed config's keys conflict with plain decoding only when no mode is set (by it or by the model's): else
        # the call's `speculative_mode=None` drops them with that mode, as it drops the model's own
        given = set(ours) | ({key for key in SPECULATIVE_KEYS if getattr(passed, key, None) is not None}
                             if getattr(generation_config, "speculative_mode", None) is None else set())
        keep_passed_exit(passed, generation_config)
        # exit options are the forward's, merged as forward merges them (transformers keeps a key a config has, e.g.
        # a checkpoint's `exit_at_step`, in the config)
        model_kwargs.update(pass_exit(self, exits, generation_config))
        if type(self).exit_rule is LoopSpecGenerationMixin.exit_rule:  # a family without exit options refuses them
            reject_exit_options(type(self).__name__, model_kwargs)  # (a config's: transformers' "not used" before)
            model_kwargs = {key: value for key, value in model_kwargs.items() if key not in EXIT_OPTIONS}
        if not hasattr(self, "recurrence_settings"):  # (a family with them reads them: Huginn's `call_block`)
            reject_recurrence_options(type(self).__name__, {**vars(generation_config), **model_kwargs})
        check_generation_values(generation_config)
        count_settings_as_ints(generation_config)
        reject_configured_runtime_keys(generation_config)
        for key, value in ours.items():
            setattr(generation_config, key, value)
        if getattr(generation_config, "speculative_mode", None) is None:
            for key in set(SPECULATIVE_KEYS) - given:
                setattr(generation_config, key, None)
        call = current_call()
        if call is not None:
            call.speculative, call.resolved = speculative_config(generation_config, self.num_loops), True
            if (spec := call.speculative) is not None:  # (a strategy refused here: transformers' checks come next)
                check_generation_mode(spec, generation_config.get_generation_mode(), generation_config, None)
                check_model_kwargs(spec.mode, model_kwargs)
            if (problem := call.problem(generation_config)) is not None:
                raise ValueError(problem)
        return generation_config, model_kwargs

    def _extract_generation_mode_kwargs(self, custom_generate, kwargs, *args):
        """transformers' split of a call's kwargs, with a callable `custom_generate` marked (`CUSTOM_LOOP`) for
        `_validate_generation_mode`, which sees the resolved config: a loop reached without this class's `generate`
        (a repo's generate.py calling `GenerationMixin.generate`) must not drop a speculative mode silently."""
        extracted = super()._extract_generation_mode_kwargs(custom_generate, kwargs, *args)
        return {**extracted, CUSTOM_LOOP: True} if callable(custom_generate) else extracted

    def _validate_generation_mode(self, generation_mode, generation_config, generation_mode_kwargs):
        if generation_mode_kwargs.pop(CUSTOM_LOOP, False):  # (popped: the loop receives these kwargs)
            for key, value in custom_loop_settings(getattr(generation_config, "speculative_mode", None)).items():
                setattr(generation_config, key, value)
        reject_assistant_early_exit(generation_config)
        spec = self._speculative(generation_config)
        if spec is not None:
            check_generation_mode(spec, generation_mode, generation_config,
                                  generation_mode_kwargs.get("assistant_model"))
        super()._validate_generation_mode(generation_mode, generation_config, generation_mode_kwargs)

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, generation_mode, batch_size,
                                      max_cache_length):
        """Looped models write one KV per (loop, layer): the default cache is a growing `DynamicCache()` for
        plain decoding and a `PagedLoopCache` for speculative decoding, which needs per-depth planes. (The first hook
        that sees both the resolved config and the batch size: token ids are checked here, for every strategy.)"""
        check_token_settings(generation_config, batch_size * (generation_config.num_return_sequences or 1),
                             self.config.vocab_size)
        user_cache, call = model_kwargs.get("cache"), current_call()
        if isinstance(user_cache, PagedLoopCache) and (dense := dense_cache_reason(self)):
            raise ValueError(f"cache: {dense}; pass a DynamicCache or no cache.")
        # a model that decodes plainly in every mode (`model_fallback`) keeps the cache plain decoding would use
        if self._speculative(generation_config) is not None and model_fallback(self) is None:
            if user_cache is None and generation_config.cache_implementation is not None:
                logger.warning_once("hf_loopspec: cache_implementation=%r does not apply to speculative decoding, "
                                    "which keeps its KV in a PagedLoopCache (pass speculative_mode=None for that "
                                    "cache).", generation_config.cache_implementation)
            if user_cache is None:
                model_kwargs["cache"] = PagedLoopCache(self.kv_layout)
            elif isinstance(user_cache, DynamicCache) and call is not None:  # a plain call's, e.g. a chat's last turn
                device = execution_device(self)  # (an offloaded model's weights are on meta)
                check_kv_continues(user_cache, self.lane_dtype, device)
                mask = model_kwargs.get("attention_mask")  # None: no padding, every cached column is real
                mask = torch.ones(batch_size, user_cache.get_seq_length(), dtype=torch.long,
                                  device=device) if mask is None else mask
                model_kwargs["cache"] = to_paged(user_cache, self.kv_layout, mask)
                call.dynamic_cache = user_cache  # refilled with the run's KV at its end (`_continued_cache`)
            elif not isinstance(user_cache, PagedLoopCache):
                raise ValueError(
                    f"speculative_mode needs a cache with per-depth planes, got {type(user_cache).__name__}; pass "
                    "cache=hf_loopspec.PagedLoopCache(model.kv_layout), a DynamicCache, or no cache."
                )
            return
        default = user_cache is None and generation_config.use_cache is not False \
            and generation_config.cache_implementation in (None, "dynamic")
        if default:
            model_kwargs["cache"] = DynamicCache()
            return
        check_cache_implementation(generation_config, user_cache)
        # prompt lookup verifies drafts past max_length (the output is cut there after), PEFT's prompt comes first
        max_cache_length += (generation_config.prompt_lookup_num_tokens or 0) + virtual_tokens(self)
        if user_cache is None and generation_config.use_cache is not False \
                and generation_config.cache_implementation == "static":
            ceiling = getattr(generation_config, "max_cache_len", None)  # sized for later, longer calls too
            model_kwargs["cache"] = looped_static_cache(self.config, self.kv_layout,
                                                        max(max_cache_length, ceiling or 0))
            return
        if user_cache is not None and getattr(user_cache, "is_compileable", False) and user_cache.layers \
                and max_cache_length > user_cache.layers[0].max_cache_len:  # a fixed size (static) cache
            drafts, prompt = generation_config.prompt_lookup_num_tokens or 0, virtual_tokens(self)
            lookup = (f", plus the {drafts} prompt lookup drafts verified past them" if drafts else "") + \
                (f", plus PEFT's {prompt} virtual tokens before them" if prompt else "")
            fewer = " or prompt lookup drafts (prompt_lookup_num_tokens)" if drafts else ""
            raise ValueError(
                f"cache: the {type(user_cache).__name__} holds {user_cache.layers[0].max_cache_len} positions, but "
                f"this call writes up to {max_cache_length} (its input's positions and its new tokens but the last, "
                f"which is never written{lookup}); pass fewer new tokens{fewer}, a larger static cache "
                "(max_cache_len), or a DynamicCache (it grows).")
        super()._prepare_cache_for_generation(generation_config, model_kwargs, generation_mode, batch_size,
                                              max_cache_length)

    def prepare_inputs_for_generation(self, input_ids, cache=None, attention_mask=None, inputs_embeds=None, **kwargs):
        """transformers' inputs, except that the attention mask stays the 2-D padding mask: with a static cache
        transformers would replace it by 4-D masks built for one KV per layer, and looped models build their own
        (`ops.attention.dense.padded_causal_mask`). `cache` and `attention_mask` stay named parameters: transformers
        reads this signature to decide which generate kwargs the model accepts."""
        inputs = super().prepare_inputs_for_generation(input_ids, cache=cache, attention_mask=attention_mask,
                                                       inputs_embeds=inputs_embeds, **kwargs)
        if isinstance(inputs.get("attention_mask"), dict) or getattr(inputs.get("attention_mask"), "ndim", 2) != 2:
            inputs["attention_mask"] = attention_mask
        return inputs

    def _sample(self, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
                streamer=None, **model_kwargs):
        spec = self._speculative(generation_config)
        if spec is None:
            if generation_config.token_healing and input_ids.shape[1]:  # (empty: inputs_embeds, which are not healed)
                check_healed_mask(model_kwargs.get("attention_mask"), input_ids)
            return super()._sample(input_ids, logits_processor, stopping_criteria, generation_config,
                                   synced_gpus=synced_gpus, streamer=streamer, **model_kwargs)
        if spec.mode == AUTO_MODE:  # `generate` runs auto itself (`generation.auto`); a hook reached another way
            raise ValueError("speculative_mode='auto' is decoded by the model's own generate, which this call bypassed "
                             "(GenerationMixin.generate(model, ...)): call model.generate(...), or pass 'pipeline'.")
        check_decoding_mask(model_kwargs.get("attention_mask"), input_ids, spec.mode)
        fallback = model_fallback(self) or plain_fallback(logits_processor) \
            or settings_fallback(generation_config, synced_gpus)
        if fallback is not None:
            warn_fallback(fallback)
            if generation_config.use_cache is False:  # plain decoding without a cache, as transformers' own
                model_kwargs.pop("cache", None)  # (the PagedLoopCache made or passed for the speculative run)
            result = super()._sample(input_ids, logits_processor, stopping_criteria, generation_config,
                                     synced_gpus=synced_gpus, streamer=streamer, **model_kwargs)
            if not generation_config.return_dict_in_generate:
                self._continued_cache(model_kwargs, result, generation_config)
                return result
            stats = SpeculationStats(spec.mode, spec.draft_loops, engine="plain", fallback=fallback)
            return SpeculativeDecoderOnlyOutput(**{**result, "cache": self._continued_cache(
                model_kwargs, result.sequences, generation_config)}, speculation=stats)
        call = current_call()
        max_length = max_length_of(stopping_criteria, int(generation_config.max_length), input_ids.shape[1])
        result = run_speculative(self, SpeculativeRequest(
            spec, model_kwargs["cache"], input_ids, attention_mask=model_kwargs.get("attention_mask"),
            logits_processor=logits_processor, stopping_criteria=stopping_criteria,
            pad_token_id=_as_int(generation_config._pad_token_tensor), max_length=max_length,
            streamer=streamer, draft_hook=call.draft_hook if call else None,
            second_draft_hook=call.second_draft_hook if call else None, do_sample=generation_config.do_sample,
            output_scores=generation_config.return_dict_in_generate and generation_config.output_scores,
            output_logits=generation_config.return_dict_in_generate and generation_config.output_logits,
            trace=call.trace if call else False, exit_rule=self.exit_rule(**model_kwargs),
            complete_cache=generation_config.use_cache is not False,
        ))
        if streamer is not None:
            streamer.end()
        cache = self._continued_cache(model_kwargs, result.sequences, generation_config)
        if not generation_config.return_dict_in_generate:
            return result.sequences
        return SpeculativeDecoderOnlyOutput(
            sequences=result.sequences, scores=result.scores, logits=result.logits, cache=cache,
            speculation=result.stats, trace=result.trace,
        )

    def _continued_cache(self, model_kwargs: dict, sequences: torch.Tensor, generation_config):
        """The cache a speculative call returns: its `PagedLoopCache`, or the caller's `DynamicCache` it continued,
        refilled with the call's KV (`cache.convert.to_dynamic`: copied, every complete plane); None without a
        cache (`use_cache=False`)."""
        cache, call = model_kwargs.get("cache"), current_call()
        if generation_config.use_cache is False:
            return None
        if call is None or call.dynamic_cache is None:
            return cache
        mask = model_kwargs.get("attention_mask")
        mask = torch.ones_like(sequences) if mask is None else torch.cat(
            [mask, mask.new_ones(len(mask), sequences.shape[1] - mask.shape[1])], 1)  # [B, sequences' columns]
        return to_dynamic(cache, mask, into=call.dynamic_cache)

    def call_block(self, generation_config, **given):
        """The block a `generate` call with the passed `generation_config` (None or the model's: none passed) and the
        family's own keyword arguments `given` runs in (a setting None in `given` comes from the passed config, else
        as the family resolves it). Nothing for Ouro; Huginn opens `recurrence` with the call's settings, so
        `num_loops` inside is the call's."""
        return nullcontext()

    def call_settings(self) -> dict:
        """The family's own `generate` keyword arguments in force for the running call, resolved; auto mode passes
        them to each of its segments (each a `generate` call of its own). Empty for Ouro; Huginn has its recurrence
        settings."""
        return {}

    def exit_rule(self, **model_kwargs) -> ExitRule | None:
        """How the lane decoder computes a target's logits for a call's model kwargs (`decoder.ExitRule`); None: the
        head on the last loop's output. A family whose `forward` takes exit options (Ouro's `exit_at_step`, ...)
        overrides this with the same selection, so that speculative decoding honours them as plain decoding does,
        and raises the same `ValueError` for invalid ones. A family without exit options refuses them."""
        reject_exit_options(type(self).__name__, model_kwargs)
        return None

    def decode_with_lanes(self, input_ids, mode: str, *, draft_loops: int | None = None,
                          num_speculative_tokens: int | None = None, second_draft_loops: int | None = None,
                          cache: PagedLoopCache, **options):
        """Run the reference, the lane decoder (`generation.decoder`), directly: `mode` "ar", "block" or
        "pipeline"; the settings are validated by `generation.config.resolve_speculative`, as `generate`'s are (None:
        the default), except that every `second_draft_loops` between `draft_loops` and the loop count runs.

        `options` are the fields of `dispatch.SpeculativeRequest` (`max_length`, `attention_mask`, ...). The tests
        compare the engine with it; it runs eagerly (no `compile_core`). Its inputs are checked as `generate` checks
        them (`ValueError` naming the argument)."""
        if mode not in LANE_MODES:
            raise ValueError(f"mode={mode!r}: the lane decoder runs one of {LANE_MODES} ('ar': without drafts).")
        options["max_length"] = check_reference_inputs(input_ids, options.get("attention_mask"), cache,
                                                       options.get("max_length"), mode, self.config.vocab_size)
        spec = resolve_speculative(mode, draft_loops, num_speculative_tokens, num_loops=self.num_loops,
                                   modes=LANE_MODES, second_draft_loops=second_draft_loops, reference=True)
        return LaneDecoder.from_request(self, SpeculativeRequest(spec, cache, input_ids, **options)).run()


def looped_static_cache(config, layout, max_cache_len: int) -> StaticCache:
    """A `StaticCache` of `max_cache_len` positions with one layer per (plane, layer) of `layout`: the static cache
    of `cache_implementation="static"`, which transformers would size from `num_hidden_layers`."""
    layers = layout.num_planes * layout.num_layers
    sized = copy.deepcopy(config)
    sized.num_hidden_layers = layers
    sized.layer_types = ["full_attention"] * layers
    return StaticCache(config=sized, max_cache_len=max_cache_len)


def _as_int(tensor) -> int | None:
    return None if tensor is None else int(tensor.reshape(-1)[0])
