"""The settings of one continuous-batching manager, and the checks every request passes before it may take a slot.

A manager's settings are fixed when it starts (they are the shapes and the constants of its step): the decoding mode
and its keys (`speculative_mode`, `draft_loops`, `num_speculative_tokens`, `second_draft_loops`, `compile_core`;
"auto" runs the mode `fixed_mode` names), the sampling processors and Ouro's exit options come from the generation
config, the same for every request; the slot count B and each slot's positions C from the continuous batching config
or the workload hints (`manager_settings`), and the KV page pool the slots share (`pool.pool_size`: `num_blocks`,
`max_memory_percent`); a Huginn-family model's recurrence settings as `huginn.manager_recurrence` reads them. A
request brings its own prompt, `max_new_tokens`, EOS ids, when sampling, `seed` and, for a Huginn-family model,
`init_seed` (`request_problem` says why one cannot run).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch
from transformers import ContinuousBatchingConfig, GenerationConfig, RepetitionPenaltyLogitsProcessor
from transformers.generation import GenerationMode

from ...defaults import DEFAULT_DRAFT_LOOPS
from ...logs import get_logger
from ...models.huginn.recurrence import check_steps_fit, passed_settings
from ...models.layers import is_integer
from ..call import reject_configured_runtime_keys
from ..config import AUTO_MODE, EXIT_OPTIONS, merged_config, reject_recurrence_options, speculative_config
from ..inputs import check_generation_values, token_id_values
from ..model_checks import model_problem
from ..wavefront.processing import WARPERS
from . import huginn
from .pool import PoolSize, pool_size, request_positions

DEFAULT_SLOTS = 8  # B when neither the continuous batching config nor the workload hints give it
DEFAULT_POSITIONS = 1024  # C when nothing gives it (capped by the model's max_position_embeddings)
MAX_EOS_IDS = 16  # E: EOS ids one request may carry
# a bound per slot and position on the engine state that grows with a slot's length (token ids, masks, page tables;
# not the KV, which the pool's own cap bounds): over three times what that state measures on a CPU
SLOT_STATE_BYTES = 1024
DEFAULT_MAX_NEW_TOKENS = 20  # transformers' default when neither the request nor the generation config sets it
REQUEST_KEYS = ("seed",)  # the per-request keyword a request may add (`add_request(**logit_processor_kwargs)`)
MAX_SEED = 2**63  # seeds are torch generator seeds: int64
UNSUPPORTED = {  # generation config settings a manager cannot honour (stop_strings has its own message)
    "max_time": "a manager stops a request at its EOS ids and max_new_tokens only",
    "penalty_alpha": "contrastive search is not a decoding a manager runs (transformers 5 removed it from generate)",
    "assistant_early_exit": "assisted decoding is not a decoding a manager runs (nor, on a looped model, generate)",
    "dola_layers": "DoLa decoding is not a decoding a manager runs (transformers 5 moved it out of generate)",
    "force_words_ids": "constrained beam search is not a decoding a manager runs (transformers 5 moved it out of "
                       "generate)",
    "constraints": "constrained beam search is not a decoding a manager runs (transformers 5 moved it out of "
                   "generate)",
    "token_healing": "a manager decodes the token ids it is given (healing rewrites a prompt's last tokens through a "
                     "tokenizer, which no request carries)",
}  # (prompt_lookup_num_tokens, a lossless speed-up a checkpoint's config may carry, is left unused: same tokens)
OVERRIDE = "draft_override"  # where a request's (test-only) draft override waits for its admission
# the ContinuousBatchingConfig fields a manager reads; `max_queue_size` and `return_logprobs` are refused, and
# `per_request_processors` (which `transformers serve` sets) is what the manager's request checks decide
CB_FIELDS_READ = ("max_requests_per_batch", "max_blocks_per_request", "page_size", "block_size", "num_blocks",
                  "max_memory_percent", "seed")
CB_FIELDS_CHECKED = ("max_queue_size", "return_logprobs", "per_request_processors")

logger = get_logger(__name__)


@dataclass(frozen=True)
class ManagerSettings:
    """What a manager runs with (see the module docstring)."""

    mode: str  # the engine's mode: "ar" (plain decoding) or a speculative mode
    draft_loops: int
    num_speculative_tokens: int  # K, at most C: a slot's new tokens (lanes past them cost lanes x lanes per slot)
    second_draft_loops: int | None
    compile_backend: str | None
    do_sample: bool
    processors: tuple  # transformers' processors the generation config implies (all run on the device)
    slots: int  # B
    positions: int  # C: prompt + max_new_tokens of one request
    pool: PoolSize  # the KV pages the slots share
    pad_token_id: int
    eos_token_id: tuple[int, ...]  # the default EOS ids of a request
    max_new_tokens: int  # the default max_new_tokens of a request
    max_length: int | None  # the generation config's max_length (prompt included) when it sets no max_new_tokens
    default_limit: int | None  # without either: the positions transformers' default length stops at (generate's cap)
    vocab: int
    seed: int | None  # the continuous batching config's seed: a sampled request without its own draws from it
    recurrence: object = None  # the model's recurrence settings for every request (`huginn`), None without them
    passed_recurrence: dict = dataclasses.field(default_factory=dict)  # those the passed config set (`huginn`)
    exit_rule: object = None  # the generation config's exit options (`decoder.ExitRule`), None: the last loop's head


def manager_config(model, generation_config):
    """The generation config a manager runs: `generation_config` (None: none) merged over the model's as `generate`
    merges them (`merged_config`), except that a `max_length` neither sets stays unset: `generate` then decodes
    transformers' default as new tokens (`DEFAULT_MAX_NEW_TOKENS`), not as positions the prompt shares."""
    config = merged_config(model, {"generation_config": generation_config})
    if all(getattr(c, "max_length", None) is None for c in (generation_config, model.generation_config)):
        config.max_length = None
    for key, value in list(vars(config).items()):  # numpy numbers and arrays, 0-d tensors, as Python's: a kept
        setattr(config, key, _python(value))  # manager compares its config with a later call's through JSON
    return config


def _python(value):
    """`value` with numpy numbers and arrays and 0-d tensors (also inside lists and tuples) as Python numbers and
    lists."""
    if isinstance(value, np.generic | np.ndarray) or torch.is_tensor(value) and value.dim() == 0:
        return value.tolist()
    return type(value)(map(_python, value)) if isinstance(value, list | tuple) else value


def model_signature(model, recurrence=None) -> tuple:
    """What of `model` a manager with the recurrence settings `recurrence` (`ManagerSettings.recurrence`) has its
    slots built for: its loop count and KV layout under those settings, vocabulary, dtype, device and, last, the
    caller's autocast (enabled, dtype) for that device, which the loop thread decodes under (autocast is per thread);
    a kept manager serves the model only while this holds."""
    device = model.device.type
    with huginn.manager_block(model, recurrence):
        return (model.num_loops, model.kv_layout, model.head_width, model.config.vocab_size, model.lane_dtype,
                str(model.device), (True, torch.get_autocast_dtype(device)) if torch.is_autocast_enabled(device)
                else (False, None))


def model_refusal(model) -> str | None:
    """Why no manager can decode `model` as it is now (hooks, quantized layers, offloaded weights), or None."""
    problem = model_problem(model)
    if problem is not None:
        return (f"continuous batching: {problem}. A manager always calls the stages (it has no plain path to fall "
                "back to, as generate does): remove that from the model, or decode with model.generate.")
    if any(p.device.type == "meta" for p in model.parameters()):
        return ("continuous batching: the model has weights on the meta device (offloaded by accelerate: cpu_offload, "
                "disk_offload, a device_map with 'disk'), and a manager keeps its weights and KV pool on one device; "
                "load it onto one device, or decode with model.generate.")
    return None


def manager_settings(model, generation_config, cb_config, hints=None) -> ManagerSettings:
    """The `ManagerSettings` of a manager for `model` built with `generation_config` (the one passed: None for none;
    merged here, `manager_config`) (`ValueError` naming a setting it cannot run)."""
    refusal = model_refusal(model)
    if refusal is not None:
        raise ValueError(refusal)
    config = manager_config(model, generation_config)
    passed = passed_settings(model, generation_config)
    recurrence = huginn.manager_recurrence(model, passed)
    with huginn.manager_block(model, recurrence):  # num_loops: the manager's recurrence steps
        if recurrence is not None:  # (a num_steps whose KV outgrows the memory: a ValueError, as generate's)
            check_steps_fit(model)
        if getattr(config, "speculative_mode", None) == AUTO_MODE:
            speculative_config(config, model.num_loops)  # auto's own checks, with auto named in its errors
            config.speculative_mode = fixed_mode(config, model.num_loops)
        spec = speculative_config(config, model.num_loops)
    if (getattr(config, "num_return_sequences", None) or 1) != 1 or (getattr(config, "num_beams", None) or 1) != 1:
        raise ValueError(f"num_return_sequences={config.num_return_sequences!r}, num_beams={config.num_beams!r}: "
                         "continuous batching on a looped model decodes one sequence per request; set both to 1.")
    if getattr(config, "stop_strings", None):
        raise ValueError(f"stop_strings={config.stop_strings!r} in continuous batching: a manager stops a request at "
                         "its EOS ids and max_new_tokens only; drop stop_strings, or decode with model.generate.")
    if recurrence is None:  # a family without recurrence settings (Ouro): refused, as `generate` refuses them
        reject_recurrence_options(type(model).__name__, vars(config))
    reject_configured_runtime_keys(config)  # (a hook or trace in a config: as `generate` refuses it)
    # the config's exit options select every request's target logits, as they do generate's (checked as it checks
    # them; a family without exit options refuses them)
    exit_rule = model.exit_rule(**{key: getattr(config, key) for key in EXIT_OPTIONS
                                   if getattr(config, key, None) is not None})
    key = unsupported_setting(config)
    if key is not None:
        raise ValueError(f"{key}={getattr(config, key)!r} in continuous batching: {UNSUPPORTED[key]}; drop {key}, or "
                         "decode with model.generate.")
    if getattr(cb_config, "max_queue_size", 0):
        raise ValueError(f"max_queue_size={cb_config.max_queue_size!r} in the ContinuousBatchingConfig: the package's "
                         "manager queues every request it is given (add_request never blocks); drop it, and bound "
                         "what you add yourself.")
    if getattr(cb_config, "return_logprobs", False):
        raise ValueError("return_logprobs=True in the ContinuousBatchingConfig: the package's manager does not "
                         "record log-probabilities (GenerationOutput.logprobs stays empty); drop it.")
    unread = unread_cb_fields(cb_config)
    if unread:
        logger.warning("ContinuousBatchingConfig(%s): not used by the package's manager, which reads %s only.",
                       ", ".join(unread), ", ".join(CB_FIELDS_READ))
    model._prepare_special_tokens(config, device=model.device)  # the EOS tensor the EOS-holding processors read
    prompt = torch.zeros(1, 1, dtype=torch.long, device=model.device)  # any prompt: the processors are row-pure
    processors = tuple(model._get_logits_processor(config, input_ids_seq_length=1, encoder_input_ids=prompt))
    for processor in processors:
        if type(processor) not in WARPERS and not (type(processor) is RepetitionPenaltyLogitsProcessor
                                                   and processor.prompt_ignore_length is None):
            raise ValueError(f"{type(processor).__name__} (from the generation config) in continuous batching: a "
                             "manager runs temperature, top_k, top_p, min_p and repetition_penalty (on the device) "
                             "only; "
                             "drop that setting from the generation config, or decode with model.generate.")
    for key in ("block_size", "page_size"):
        _positive(getattr(cb_config, key, None), key)
    slots = _positive(getattr(cb_config, "max_requests_per_batch", None), "max_requests_per_batch") \
        or min(DEFAULT_SLOTS, getattr(hints, "num_requests", None) or DEFAULT_SLOTS)
    positions, source = _positions(model, config, cb_config, hints)
    _check_slot_state(model.device, slots, positions, source)
    with huginn.manager_block(model, recurrence):  # the planes of the manager's recurrence steps
        pool = pool_size(model.kv_layout, model.lane_dtype, model.device, cb_config, slots, positions)
    return ManagerSettings(
        mode="ar" if spec is None else spec.mode, draft_loops=0 if spec is None else spec.draft_loops,
        num_speculative_tokens=1 if spec is None else min(spec.num_speculative_tokens, positions),
        second_draft_loops=None if spec is None else spec.second_draft_loops,
        compile_backend=None if spec is None else spec.compile_backend, do_sample=bool(config.do_sample),
        processors=processors, slots=slots, positions=positions, pool=pool,
        pad_token_id=int(config.pad_token_id if config.pad_token_id is not None else 0),
        eos_token_id=tuple(eos_ids(config.eos_token_id)),  # (none: as generate, no fallback to model.config's)
        max_new_tokens=int(config.max_new_tokens or DEFAULT_MAX_NEW_TOKENS),
        max_length=None if config.max_new_tokens is not None or config.max_length is None else int(config.max_length),
        default_limit=None if config.max_new_tokens is not None or config.max_length is not None  # (0 is set)
        else getattr(model.config, "max_position_embeddings", None),
        vocab=model.head_width, seed=_seed(getattr(cb_config, "seed", None)),
        recurrence=recurrence, passed_recurrence=passed, exit_rule=exit_rule)


def unsupported_setting(config) -> str | None:
    """The first setting of `config` in `UNSUPPORTED` that plain decoding would act on: the strategy settings when
    they select the decoding strategy (`penalty_alpha=0`, or `top_k=1`, decodes greedily), `token_healing` when on,
    the others when set."""
    strategy = config.get_generation_mode()
    constrained = strategy == GenerationMode.CONSTRAINED_BEAM_SEARCH
    active = {"penalty_alpha": strategy == GenerationMode.CONTRASTIVE_SEARCH,
              "dola_layers": strategy == GenerationMode.DOLA_GENERATION, "token_healing": bool(config.token_healing),
              "force_words_ids": constrained and config.force_words_ids is not None,
              "constraints": constrained and config.constraints is not None}
    return next((key for key in UNSUPPORTED if active.get(key, getattr(config, key, None) is not None)), None)


def unread_cb_fields(cb_config) -> list[str]:
    """`name=value` of each field of `cb_config` (a `ContinuousBatchingConfig`, or None) set to something other than
    its default that a manager does not read (e.g. `max_batch_tokens`, `use_cuda_graph`: transformers' manager's)."""
    if cb_config is None or not dataclasses.is_dataclass(cb_config):
        return []
    default = type(cb_config)()
    return [f"{field.name}={getattr(cb_config, field.name)!r}" for field in dataclasses.fields(cb_config)
            if field.name not in CB_FIELDS_READ + CB_FIELDS_CHECKED
            and getattr(cb_config, field.name) != getattr(default, field.name)]


def fixed_mode(config, num_loops: int) -> str:
    """The mode a manager runs for a generation config saying `speculative_mode="auto"` (checked by
    `speculative_config` first, which refuses it on a 1-loop model, as `generate` does): pipeline at the config's
    `draft_loops` (default 1) when the loop count is a multiple of it, else block at that depth. A manager's mode is
    the shape of its step, fixed for its life, so it cannot follow the acceptance as auto's segments do; of the
    speculative settings at one depth, pipeline needs the fewest core calls per token at every acceptance
    (`auto_costs.calls_per_token`)."""
    draft_loops = getattr(config, "draft_loops", None) or DEFAULT_DRAFT_LOOPS
    return "pipeline" if num_loops % draft_loops == 0 else "block"


def _positive(value, name: str) -> int | None:
    if value is None:
        return None
    if not is_integer(value) or value < 1:
        raise ValueError(f"{name}={value!r} in the ContinuousBatchingConfig must be an integer >= 1.")
    return int(value)


def _seed(value) -> int | None:
    if value is not None and (not is_integer(value) or not 0 <= value < MAX_SEED):
        raise ValueError(f"seed={value!r} in the ContinuousBatchingConfig must be an integer in [0, 2**63) or None.")
    return None if value is None else int(value)


def _positions(model, config, cb_config, hints) -> tuple[int, str]:
    """`(C, what sets it)`: `max_blocks_per_request * block_size` (or `page_size`) of the continuous batching config;
    else the workload hints' longest prompt plus output; else `DEFAULT_POSITIONS` or the model's
    `max_position_embeddings`. What sets it is the phrase `_check_slot_state` names, with its fix."""
    blocks = _positive(getattr(cb_config, "max_blocks_per_request", None), "max_blocks_per_request")
    if blocks:
        size = _positive(getattr(cb_config, "block_size", None), "block_size") \
            or _positive(getattr(cb_config, "page_size", None), "page_size") or 1
        return max(2, blocks * size), ("max_blocks_per_request x block or page size: pass a smaller "
                                       "max_blocks_per_request (a slot holds a request's prompt and new tokens)")
    if hints is not None and getattr(hints, "max_prompt_length", None):
        wanted = hints.max_prompt_length + (hints.max_generated_length or config.max_new_tokens or config.max_length
                                            or DEFAULT_MAX_NEW_TOKENS)
        return max(2, wanted), ("the longest prompt plus max_new_tokens: lower max_new_tokens (or max_length), or "
                                "pass a ContinuousBatchingConfig with max_blocks_per_request")
    limit = getattr(model.config, "max_position_embeddings", None) or DEFAULT_POSITIONS
    return max(2, min(DEFAULT_POSITIONS, limit)), "the default slot length: pass a smaller max_blocks_per_request"


def _check_slot_state(device, slots: int, positions: int, source: str) -> None:
    """`ValueError` when B slots of C positions would keep an engine state (`SLOT_STATE_BYTES` per slot and
    position) of more than half the free memory of `device`: a slot sized far past any request failed in the
    allocator, or ran the machine out of memory, instead of naming the setting (`source`: what set C, and its fix)."""
    from ..dispatch import free_memory  # (here: dispatch imports the engine, which this module's users import first)

    need = slots * positions * SLOT_STATE_BYTES
    if need > free_memory(device) / 2:
        raise ValueError(f"{slots} slots of {positions} positions keep an engine state of up to {need / 2**30:.1f} "
                         f"GiB, more than half the free memory. The positions come from {source}; or pass a "
                         "smaller max_requests_per_batch.")


def check_config_types(generation_config, cb_config) -> None:
    """`ValueError` for a generation config or a `ContinuousBatchingConfig` of another type (a dict's keys were
    read as unset: every one of them ignored without a word); None for either is fine."""
    for name, value, kind in (("generation_config", generation_config, GenerationConfig),
                              ("continuous_batching_config", cb_config, ContinuousBatchingConfig)):
        if value is not None and not isinstance(value, kind):
            raise ValueError(f"{name}: a {type(value).__name__}; give a transformers.{kind.__name__} "
                             f"({kind.__name__}(**settings)) or None.")
    if generation_config is not None:
        check_generation_values(generation_config)  # (as generate checks them: a string id failed in transformers)


def check_arguments(request_id=None, **switches) -> None:
    """`ValueError` for a request id that is not a string (None: one is made) or a switch (name=value) that is not
    True, False (numpy's included) or None: "no" would read as true."""
    if request_id is not None and not isinstance(request_id, str):
        raise ValueError(f"request_id={request_id!r} must be a string (or None for a new one): pass str(request_id).")
    for name, value in switches.items():
        if value is not None and not isinstance(value, (bool, np.bool_)):
            raise ValueError(f"{name}={value!r} must be True or False.")


def eos_ids(value) -> list[int]:
    """The non-negative EOS ids of `value` (an id, a list or 1-D tensor of ids, None; -1: none), as transformers
    reads them; `ValueError` naming `eos_token_id` for anything else."""
    if value is None:
        return []
    values = token_id_values(value)  # (as `generate` reads them)
    if values is None:
        raise ValueError(f"eos_token_id={value!r}: give a token id or a list of token ids (integers), or None.")
    return [v for v in values if v >= 0]


def token_ids(value):
    """A request's prompt as a list (a tensor's or array's values, a list's items, 0-d tensors and arrays among them
    read as their value, ints where they are integers); any other value as it is, for `request_problem` to name."""
    if hasattr(value, "tolist") and not isinstance(value, (list, tuple)) and not getattr(value, "is_meta", False):
        value = value.tolist()
    if not isinstance(value, (list, tuple)):
        return value
    value = [t.item() if getattr(t, "ndim", None) == 0 and hasattr(t, "item") and not getattr(t, "is_meta", False)
             else t for t in value]
    return [int(t) if is_integer(t) else t for t in value]


def request_max_new(settings: ManagerSettings, input_ids, max_new_tokens):
    """A request's max_new_tokens: its own, else what the generation config's max_length leaves after its prompt (as
    `generate` reads max_length: prompt included), else the config's max_new_tokens (or transformers' default, which
    `generate` caps at the model's positions)."""
    if max_new_tokens is not None:
        return max_new_tokens
    if settings.max_length is not None and isinstance(input_ids, list):
        return settings.max_length - len(input_ids)
    if settings.default_limit is not None and isinstance(input_ids, list):  # (transformers' default length: at most
        return min(settings.max_new_tokens, settings.default_limit - len(input_ids))  # the model's positions)
    return settings.max_new_tokens


# how to replace a manager the model keeps (generate_batch(..., persistent_manager=True)) by a larger one
REPLACING = ("; a manager kept by persistent_manager=True is sized by its first call: "
             "call model.destroy_cached_continuous_batching_manager() before starting the larger one")


def past_positions(model, length: int) -> str | None:
    """The warning for a request of `length` positions (prompt + max_new_tokens) past the model's: unless it stops at
    an EOS id first, it decodes past the positions the model was trained for (`generate` warns once it does)."""
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit and length > limit:
        return (f"continuous batching: a request of {length} positions (prompt + max_new_tokens) is longer than the "
                f"model's max_position_embeddings={limit}; unless it stops at an EOS id first, it decodes past the "
                "positions the model was trained for.")
    return None


def nested(input_ids) -> bool:
    """Whether a prompt given as a list holds lists, or tensors or arrays of one or more dimensions (a list of
    prompts where one prompt is due)."""
    return any(isinstance(t, (list, tuple)) or getattr(t, "ndim", 0) for t in input_ids)


def request_problem(settings: ManagerSettings, input_ids, max_new_tokens, eos, extra: dict) -> str | None:
    """Why a request cannot run on a manager with `settings`, or None (each message names the value and the fix)."""
    items = input_ids if isinstance(input_ids, (list, tuple)) else [input_ids]
    meta = any(getattr(t, "is_meta", False) for t in items)
    if meta or not isinstance(input_ids, (list, tuple)) or not input_ids:  # (a meta tensor has no values)
        where = " (on the meta device: no values)" if meta else ""
        return f"input_ids={input_ids!r:.200}{where}: give a non-empty list of token ids."
    if nested(input_ids):
        return f"input_ids={input_ids!r:.80}: a list of lists; give one flat list of token ids per request."
    bad = [t for t in input_ids if not is_integer(t) or not 0 <= t < settings.vocab]
    if bad:
        return f"input_ids hold {bad[:4]}: token ids must be integers in [0, {settings.vocab})."
    if not is_integer(max_new_tokens) or max_new_tokens < 1:
        return f"max_new_tokens={max_new_tokens!r}: give an integer >= 1."
    if len(input_ids) + max_new_tokens > settings.positions:
        return (f"a prompt of {len(input_ids)} tokens with max_new_tokens={max_new_tokens} needs "
                f"{len(input_ids) + max_new_tokens} positions, and a slot of this manager holds {settings.positions}: "
                "shorten the request, or start a manager with a larger ContinuousBatchingConfig("
                f"max_blocks_per_request=..., page_size=...){REPLACING}.")
    needed = settings.pool.pages_for(request_positions(len(input_ids), max_new_tokens))
    if needed > settings.pool.pages:
        return (f"a prompt of {len(input_ids)} tokens with max_new_tokens={max_new_tokens} needs {needed} KV pages "
                f"({request_positions(len(input_ids), max_new_tokens)} positions in each of {settings.pool.planes} "
                f"depth planes), and this manager's pool holds {settings.pool.pages} "
                f"({settings.pool.positions} positions per plane): shorten the request, or start a manager with a "
                "larger ContinuousBatchingConfig(num_blocks=...) (with max_memory_percent=... when memory caps the "
                f"pool){REPLACING}.")
    if not all(is_integer(t) for t in eos) or len(eos) > MAX_EOS_IDS:
        return f"eos_token_id={list(eos)!r}: give at most {MAX_EOS_IDS} integer ids."
    return extra_problem(settings, extra)


def extra_problem(settings: ManagerSettings, extra: dict) -> str | None:
    """Why a request's own settings `extra` (`add_request(**logit_processor_kwargs)`) cannot run on a manager with
    `settings`, or None."""
    allowed = (*REQUEST_KEYS, huginn.REQUEST_KEY) if settings.recurrence is not None else REQUEST_KEYS
    unknown = sorted(set(extra) - set(allowed))
    if unknown:
        return (f"per-request settings {unknown} are not supported: a manager decodes every request with its "
                "generation config's settings (sampling included); a request may add only "
                f"{', '.join(allowed)}. Start a manager with the settings you need.")
    problem = huginn.request_problem(extra)
    if problem:
        return problem
    seed = extra.get("seed")
    if seed is not None and (not is_integer(seed) or not 0 <= seed < MAX_SEED):
        return f"seed={seed!r}: give an integer in [0, 2**63)."
    if seed is not None and not settings.do_sample:
        return f"seed={seed!r} on a greedy manager: a seed takes effect with do_sample=True in the generation config."
    return None


def override_tokens(settings: ManagerSettings, override, positions: int) -> list[int]:
    """A request's test-only `draft_override` (a list or 1-D integer tensor over its own positions) as a list of ids,
    checked: a speculative manager, at most `positions` (prompt + max_new_tokens) entries, each -1 (no override) or
    a token id. `ValueError` naming what is wrong."""
    if settings.mode == "ar":
        raise ValueError("draft_override on a manager that decodes plain (no speculative_mode in its generation "
                         "config) has no drafts to replace: drop it, or start a speculative manager.")
    if torch.is_tensor(override):
        if override.dim() != 1 or override.dtype.is_floating_point or override.dtype == torch.bool:
            raise ValueError(f"draft_override: a {override.dtype} tensor of shape {tuple(override.shape)}; give a "
                             "1-D integer tensor (or a list) over the request's positions.")
        override = override.tolist()
    if not isinstance(override, (list, tuple)):
        raise ValueError(f"draft_override={override!r}: give a list or 1-D integer tensor over the request's "
                         "positions.")
    if len(override) > positions:
        raise ValueError(f"draft_override has {len(override)} entries, and the request reaches {positions} positions "
                         "(prompt + max_new_tokens): give at most that many.")
    bad = [t for t in override if not isinstance(t, int) or isinstance(t, bool) or not -1 <= t < settings.vocab]
    if bad:
        raise ValueError(f"draft_override holds {bad[:4]}: give token ids in [0, {settings.vocab}), or -1 for the "
                         "model's own draft.")
    return list(override)
