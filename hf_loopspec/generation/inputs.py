"""Up-front checks of `generate`'s inputs, in every mode (plain decoding included).

transformers lets some malformed inputs through to the model, where they fail late with an unrelated message
(an IndexError, "too many values to unpack") or decode silently from nothing (an empty or fully masked prompt,
whose first token would come from no context at all). Each check here raises a `ValueError` that names the
argument, its value and the fix: ids that are no int64 / int32 tensor of values (a list, floats, int8, the meta
device), no rows, ids outside the vocabulary, a bool where generate counts tokens (`top_k=True`), and, in the
speculative modes, right padding (`check_left_padded`), a mask that no longer fits the prompt
(`check_decoding_mask`) and positions of the caller's own (`check_model_kwargs`); and assisted decoding continuing a
filled cache (`check_assisted_continuation`).
"""

from __future__ import annotations

import fractions
import math
import numbers

import torch
from transformers import GenerationConfig
from transformers.cache_utils import Cache

from ..cache.paged import PagedLoopCache
from ..models.layers import check_mask_values, check_token_ids, is_integer, is_real
from .model_checks import check_no_prefix_cache, check_weights_present, virtual_tokens


def as_integer(value, name: str) -> int:
    """`value` as a Python int: a Python or numpy integer or a 0-d integer tensor; anything else, bools included
    (`True` as a count is almost always a mistake), raises a `ValueError` naming `name`."""
    if torch.is_tensor(value) and value.ndim == 0 and not (value.dtype == torch.bool or value.is_floating_point()
                                                            or value.is_complex()):
        return int(value)
    if is_integer(value):
        return int(value)  # Python and numpy integers
    raise ValueError(f"{name}={value!r} must be an integer (a Python or numpy integer, or a 0-d integer tensor).")


ID_DTYPES = (torch.int64, torch.int32)  # what an embedding takes; narrower integers cannot hold a vocabulary
TOKEN_ID_SETTINGS = ("pad_token_id", "bos_token_id", "eos_token_id")  # generate's settings that name tokens
# generate's settings that count tokens: a bool there (`top_k=True`) is a mistake that would read as 1
COUNT_SETTINGS = ("top_k", "max_new_tokens", "min_new_tokens", "max_length", "min_length", "no_repeat_ngram_size")


# `GenerationMixin.generate`'s parameters after `inputs`, in order: what a caller may pass by position
POSITIONAL = ("generation_config", "logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn",
              "synced_gpus", "assistant_model", "streamer", "negative_prompt_ids", "negative_prompt_attention_mask",
              "custom_generate")


UNSET_BY_NONE = ("use_cache", "max_length")  # `generate` arguments whose None means "not given"


def by_name(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """`generate`'s arguments as the package's paths read them (auto, the speculative checks): the prompt `inputs`
    as the only positional argument (none when it is None or not given), everything else by name, `UNSET_BY_NONE`
    left out when None (transformers would pass a None `use_cache` to every forward, which then makes a fresh cache
    per step, and add a None `max_length` to the prompt's length); `TypeError` as Python's for too many or repeated
    arguments. `ValueError` for a prompt given twice (`inputs` and `input_ids`), which plain decoding refuses too."""
    if len(args) > 1 + len(POSITIONAL):
        raise TypeError(f"generate() takes at most {1 + len(POSITIONAL)} positional arguments ({len(args)} given)")
    named = dict(zip(("inputs", *POSITIONAL), args))
    repeated = sorted(set(named) & set(kwargs))
    if repeated:
        raise TypeError(f"generate() got multiple values for argument {repeated[0]!r}")
    kwargs = {key: value for key, value in {**kwargs, **named}.items() if value is not None or key not in UNSET_BY_NONE}
    inputs = kwargs.pop("inputs", None)  # None (given or not): the prompt is input_ids, or none
    if inputs is not None and kwargs.get("input_ids") is not None:
        raise ValueError("input_ids: the prompt is given as inputs (the first argument) too; pass it once.")
    return (() if inputs is None else (inputs,)), kwargs


def check_inputs(input_ids, attention_mask, cache, vocab_size: int | None = None) -> None:
    """Raise a `ValueError` for ids that are not an int64 / int32 `[batch, length]` tensor with data (not on the
    meta device), at least one row and one column and every id in `[0, vocab_size)` (when given); a mask of another
    shape or with values other than 0 and 1; or a row without a real token after what `cache` has consumed."""
    if input_ids is None:
        return  # transformers starts from BOS, or an inputs_embeds-only call
    _check_ids_tensor(input_ids)
    if vocab_size is not None:
        check_token_ids(input_ids, vocab_size)
    past = int(cache.get_seq_length()) if isinstance(cache, Cache) else 0
    if past and past >= input_ids.shape[1]:
        raise ValueError(f"input_ids has {input_ids.shape[1]} columns, but the {type(cache).__name__} has already "
                         f"consumed {past}: pass the whole sequence (the ids that filled the cache, then the new "
                         "tokens).")
    if attention_mask is None:
        return
    if not torch.is_tensor(attention_mask):
        raise ValueError(f"attention_mask must be a torch tensor like input_ids, got a "
                         f"{type(attention_mask).__name__}; pass torch.tensor(mask).")
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, but input_ids has shape "
                         f"{tuple(input_ids.shape)}: pass one 0/1 entry per token (1 = real token, 0 = padding).")
    check_mask_values(attention_mask)
    empty = (attention_mask[:, past:] == 0).all(-1).nonzero().flatten().tolist()
    if empty:
        where = "" if not past else f" after the {past} columns the cache has consumed"
        raise ValueError(f"attention_mask marks no real token in rows {empty}{where}: every row needs at least one "
                         "real token (mask 1) to continue from; drop those rows or give them a token.")


def checked_call_inputs(model, ids, kwargs: dict, cache) -> dict:
    """`kwargs` (a `generate` call's arguments by name) after `check_inputs`, `check_weights_present` and
    `check_no_prefix_cache`, in every mode alike; without `ids` (and without inputs_embeds), of the `[B, 1]` BOS
    prompt plain decoding starts from (`prompt_or_bos`): its id must be in the vocabulary, and a mask must be `[B, 1]`
    (a wider one was read by plain decoding and refused by the speculative modes, each in its own way); without a mask
    either, the BOS is given one of ones (transformers would infer the BOS as padding when it is the pad id: plain
    decoding then started from no token, the speculative modes refused it as right padding)."""
    mask, vocab = kwargs.get("attention_mask"), model.config.vocab_size
    check_weights_present(model)
    check_no_prefix_cache(model)
    _check_assisted_prompt(model, kwargs)
    if kwargs.get("inputs_embeds") is not None:
        check_embedded_prompt(kwargs, model.generation_config)
    if ids is not None or kwargs.get("inputs_embeds") is not None:
        check_inputs(ids, mask, cache, vocab_size=vocab)
        return kwargs
    if torch.is_tensor(mask) and (mask.dim() != 2 or mask.shape[1] != 1):
        raise ValueError(f"attention_mask has shape {tuple(mask.shape)}, but without input_ids generate starts from "
                         "the BOS token, one column per row: pass the input_ids the mask belongs to, or a [batch, 1] "
                         "mask.")
    prompt = prompt_or_bos(model, ids, kwargs)
    if not 0 <= int(prompt[0, 0]) < vocab:
        raise ValueError(f"bos_token_id={int(prompt[0, 0])} is outside the vocabulary [0, {vocab}): generate without "
                         "input_ids starts from it; pass input_ids (a prompt), or a bos_token_id of the vocabulary.")
    try:
        check_inputs(prompt, mask, cache, vocab_size=vocab)
    except ValueError as error:  # (its input_ids: the BOS prompt, which the caller did not pass)
        raise ValueError(f"without input_ids, generate starts from a [batch, 1] BOS prompt: {error}") from None
    return kwargs if mask is not None else {**kwargs, "attention_mask": torch.ones_like(prompt)}


def check_embedded_prompt(kwargs: dict, model_config) -> None:
    """`ValueError` for a `generate` call (`kwargs`) with `inputs_embeds` that transformers' loop decodes wrongly or
    not at all, on its own models too: assisted decoding (`_assisted`: an assistant model or prompt lookup returned
    other tokens than plain decoding, without a word) or a chunked prefill (`merged_setting`'s `prefill_chunk_size`:
    it failed on the position ids)."""
    chunk = merged_setting(kwargs, model_config, "prefill_chunk_size")
    what = _assisted(kwargs, model_config) or (None if chunk is None else f"prefill_chunk_size={chunk!r}")
    if what is not None:
        raise ValueError(f"inputs_embeds cannot be decoded with {what}: transformers' loop for it does not decode an "
                         "embedded prompt (it returned other tokens than plain decoding, or failed). Pass input_ids "
                         f"instead of inputs_embeds, or drop {what.split('=')[0]}.")


def _assisted(kwargs: dict, model_config) -> str | None:
    """The setting that makes a `generate` call (`kwargs`) decode assisted, as the message names it
    ("assistant_model", "prompt_lookup_num_tokens=3"), or None: an assistant model, or prompt lookup
    (`merged_setting`)."""
    if kwargs.get("assistant_model") is not None:
        return "assistant_model"
    lookup = merged_setting(kwargs, model_config, "prompt_lookup_num_tokens")
    return f"prompt_lookup_num_tokens={lookup}" if lookup else None


def _check_assisted_prompt(model, kwargs: dict) -> None:
    """`ValueError` for assisted decoding (`_assisted`) of a model whose prompt PEFT's prompt learning extends with
    virtual tokens (`virtual_tokens`): its `prepare_inputs_for_generation` feeds them as embeddings, which
    transformers' assisted loop cannot take (it failed on mismatched tensor sizes inside, any cache or none)."""
    if virtual_tokens(model) and (what := _assisted(kwargs, model.generation_config)) is not None:
        raise ValueError(f"{what}: PEFT's prompt learning puts {virtual_tokens(model)} virtual tokens before the "
                         "prompt as embeddings, which transformers' assisted decoding cannot take; drop "
                         f"{what} for this model.")


def merged_setting(kwargs: dict, model_config, name: str):
    """Generation setting `name` of a `generate` call (`kwargs`) as transformers merges it: the call's argument when
    given, None included (it overrides the configs'); else its passed generation config's, else `model_config`'s,
    unless None."""
    if name in kwargs:
        return kwargs[name]
    given = (getattr(kwargs.get("generation_config"), name, None), getattr(model_config, name, None))
    return next((value for value in given if value is not None), None)


def prompt_or_bos(model, ids, kwargs: dict, config=None):
    """`ids`, or without them (and without inputs_embeds) the `[B, 1]` BOS prompt plain decoding starts from
    (`bos_prompt`; B: the rows of the call's attention mask, else 1); `config`: the call's merged generation config
    (None: merged here)."""
    if ids is not None or kwargs.get("inputs_embeds") is not None:
        return ids
    from .config import merged_config  # (here: config imports this module)
    from .model_checks import execution_device

    mask = kwargs.get("attention_mask")
    config = merged_config(model, kwargs) if config is None else config
    return bos_prompt(config, execution_device(model), 1 if mask is None else len(mask))


def bos_prompt(generation_config, device, batch: int = 1) -> torch.Tensor:
    """`[batch, 1]`: the BOS id that plain decoding starts a call without a prompt from (one row, or one per row of
    the call's attention mask); `ValueError` without one."""
    if generation_config.bos_token_id is None:
        raise ValueError("generate without input_ids starts from the BOS token, and neither the generation config "
                         "nor the model's sets bos_token_id: pass input_ids (a prompt), or bos_token_id=...")
    bos = torch.as_tensor(generation_config.bos_token_id).reshape(-1)[:1]
    return bos.to(device=device, dtype=torch.long)[None].expand(batch, 1)


def _check_ids_tensor(input_ids) -> None:
    """The form of `input_ids` (see `check_inputs`)."""
    if not torch.is_tensor(input_ids):
        raise ValueError(f"input_ids must be a torch tensor of token ids [batch, length], got a "
                         f"{type(input_ids).__name__}; pass torch.tensor(ids) or tokenizer(..., return_tensors='pt').")
    if input_ids.dtype not in ID_DTYPES:
        raise ValueError(f"input_ids has dtype {input_ids.dtype}, but token ids must be torch.int64 (or torch.int32); "
                         "pass input_ids.long(), or the tokenizer's ids unchanged.")
    if input_ids.is_meta:
        raise ValueError("input_ids is on the meta device (shapes only, no values); pass the token ids on the "
                         "model's device, e.g. input_ids.to(model.device) from a real tensor.")
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be a 2-D [batch, length] tensor of token ids, got shape "
                         f"{tuple(input_ids.shape)}; for one prompt pass ids[None] (or tokenizer(..., "
                         "return_tensors='pt')).")
    if input_ids.shape[0] == 0:
        raise ValueError(f"input_ids has no rows (shape {tuple(input_ids.shape)}): pass at least one prompt.")
    if input_ids.shape[1] == 0:
        raise ValueError(f"input_ids has no tokens (shape {tuple(input_ids.shape)}): every row needs at least one "
                         "(e.g. the BOS token), as the first generated token needs a context.")


def check_generation_values(settings) -> None:
    """`ValueError` for anything but a Python or numpy integer (or None) among the settings that count tokens
    (`COUNT_SETTINGS`), in every mode: transformers would take `True` as 1 (or fail deep in torch), stop a
    `max_new_tokens=2.5` call after 3 tokens (it compares lengths with the float) where the speculative modes' integer
    counts would stop after 2, and refuse a tensor in some settings only; and for token ids (`TOKEN_ID_SETTINGS`) that
    are no integers or one-element integer tensors (EOS: or a list or tensor of them), and a `prefill_chunk_size` below
    1, a `penalty_alpha` that is no number, a passed `generation_config` that is none, and `stop_strings` that are not a
    non-empty string or a non-empty list of them (transformers failed on `5` with a bare TypeError, and stopped after
    one token at `""`). `settings`: a generation config, or a call's keyword arguments, checked before transformers
    reads them (it fails on `max_new_tokens="3"` or `eos_token_id="x"` with a bare TypeError)."""
    get = settings.get if isinstance(settings, dict) else lambda key: getattr(settings, key, None)
    passed = get("generation_config")  # (a call's: a dict's or string's keys were an AttributeError, per mode)
    if passed is not None and not isinstance(passed, GenerationConfig):
        raise ValueError(f"generation_config: a {type(passed).__name__}; pass a transformers.GenerationConfig "
                         "(GenerationConfig(**settings)), or the settings as keyword arguments.")
    for key in COUNT_SETTINGS:
        value = get(key)
        if isinstance(value, bool):
            raise ValueError(f"{key}={value!r} is a bool, but {key} counts tokens; pass an integer (or None to leave "
                             "it unset).")
        if isinstance(value, float):
            raise ValueError(f"{key}={value!r} is a float, but {key} counts tokens; pass an integer (e.g. "
                             f"{key}={math.ceil(value)}), or None to leave it unset.")
        if value is not None and not isinstance(value, numbers.Integral):
            raise ValueError(f"{key}={value!r} counts tokens: pass a Python or numpy integer (e.g. int(...) of a "
                             "0-d tensor), or None to leave it unset.")
    alpha = get("penalty_alpha")  # (text: a bare TypeError where transformers picks the decoding strategy)
    if alpha is not None and not is_real_number(alpha):
        raise ValueError(f"penalty_alpha={alpha!r} must be a number (contrastive search's degeneration penalty), or "
                         "None to leave it unset.")
    chunk = get("prefill_chunk_size")  # (0 or less, or a numpy integer, failed in torch's split)
    if chunk is not None and (not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1):
        raise ValueError(f"prefill_chunk_size={chunk!r} must be a Python integer >= 1 (the prompt's tokens per prefill "
                         "call), or None to prefill in one call.")
    stops = get("stop_strings")
    if stops is not None and not stop_strings_given(stops):
        raise ValueError(f"stop_strings={stops!r} must be a non-empty string or a non-empty list of them (an empty "
                         "string would stop at once); pass e.g. stop_strings=['\\n\\n'] with tokenizer=..., or None "
                         "for no stop strings.")
    for key in TOKEN_ID_SETTINGS:
        value = get(key)
        ids = None if value is None else token_id_values(value)
        one = key != "eos_token_id"  # (transformers fails on a list or tuple there; a one-element array passes)
        if value is not None and (ids is None or one and (len(ids) != 1 or isinstance(value, (list, tuple)))):
            also = ", or a list of them" if key == "eos_token_id" else ""
            raise ValueError(f"{key}={value!r} must be a token id (an integer{also}), or None to leave it unset.")


def count_settings_as_ints(generation_config) -> None:
    """Set the numpy integers among the counting settings (`COUNT_SETTINGS`) of `generation_config` (a call's merged
    copy, after `check_generation_values`) to Python ints: transformers' processors refuse numpy integers
    (`min_new_tokens=np.int64(3)` was blamed on a `min_length` of another value, `top_k` and `no_repeat_ngram_size`
    "have to be integers"), where its length criteria take them."""
    for key in COUNT_SETTINGS:
        value = getattr(generation_config, key, None)
        if isinstance(value, numbers.Integral) and type(value) is not int:
            setattr(generation_config, key, int(value))


def is_real_number(value) -> bool:
    """Whether `value` is one real number: a Python or numpy number, or a 0-d tensor or array of one (not a bool)."""
    if isinstance(value, numbers.Real):
        return is_real(value)
    if hasattr(value, "ndim") and hasattr(value, "dtype"):  # a tensor or array
        try:
            value = torch.as_tensor(value)
        except (TypeError, ValueError, RuntimeError):
            return False
        return value.ndim == 0 and value.dtype != torch.bool and not value.is_complex()
    return False


def stop_strings_given(stops) -> bool:
    """Whether `stops` is what `stop_strings` takes: a non-empty string, or a non-empty list or tuple of them."""
    return isinstance(stops, str) and bool(stops) or isinstance(stops, (list, tuple)) and bool(stops) and all(
        isinstance(stop, str) and stop for stop in stops)


def token_id_values(value) -> list[int] | None:
    """The ids a token-id setting holds (an integer, or a list, tuple, tensor or array of them, as transformers turns
    it into a tensor) as Python ints, or None when it holds anything else (text, floats, bools)."""
    if isinstance(value, (bool, str, bytes)) or isinstance(value, (list, tuple)) and any(
            isinstance(v, (list, tuple)) or getattr(v, "ndim", 0) for v in value):  # (a list holds single ids)
        return None
    try:
        flat = torch.as_tensor(value).reshape(-1)
    except (TypeError, ValueError, RuntimeError):
        return None
    if flat.numel() and (flat.dtype == torch.bool or flat.is_floating_point() or flat.is_complex()):
        return None
    return [int(i) for i in flat.tolist()]


FORCED_TOKENS = ("forced_bos_token_id", "forced_eos_token_id")  # ids a logits processor indexes the scores with


def check_token_settings(generation_config, rows: int, vocab_size: int) -> None:
    """`ValueError` naming a forced token id (`FORCED_TOKENS`) outside the vocabulary, which transformers' processor
    met as an IndexError of the scores at the forced step in every mode, an `exponential_decay_length_penalty` that is
    no (start index, decay factor) pair (an IndexError or TypeError inside transformers' processor), or a pad id the
    call could feed the model (`check_pad_token`)."""
    decay = getattr(generation_config, "exponential_decay_length_penalty", None)
    if decay is not None and not (isinstance(decay, (tuple, list)) and len(decay) == 2 and is_integer(decay[0])
                                  and is_real(decay[1]) and not isinstance(decay[1], fractions.Fraction)):
        raise ValueError(f"exponential_decay_length_penalty={decay!r} is no (start_index, decay_factor) pair: pass "
                         "a tuple of the number of new tokens after which the penalty starts (an integer) and its "
                         "growth factor per token (a number), e.g. (10, 1.05), or None.")
    for key in FORCED_TOKENS:
        ids = token_id_values(value := getattr(generation_config, key, None))
        if value is not None and (ids is None or not all(0 <= i < vocab_size for i in ids)):
            raise ValueError(f"{key}={value!r} is no token id of the vocabulary [0, {vocab_size}): the step it forces "
                             f"sets that id's score; pass ids inside the vocabulary, or None.")
    check_pad_token(generation_config, rows, vocab_size)


def check_pad_token(generation_config, rows: int, vocab_size: int) -> None:
    """`ValueError` naming `pad_token_id` when it lies outside the vocabulary and a call of `rows` rows could feed
    it: a row that finishes (EOS, stop strings) before the others is fed the pad token, which the model cannot embed
    (the error came from `forward`, mid-call, naming input_ids). One row, nothing that finishes a row, or beam search
    (which only fills finished hypotheses with it) feeds none. An unset `pad_token_id` is the one transformers
    derived (its first EOS id), as the message says."""
    pad, eos = generation_config.pad_token_id, generation_config.eos_token_id
    given = f"pad_token_id={pad}"
    if pad is None and getattr(generation_config, "_pad_token_tensor", None) is not None:
        pad = int(generation_config._pad_token_tensor)
        given = f"pad_token_id (unset, so transformers pads with the first EOS id, {pad})"
    finishes = eos is not None or bool(generation_config.stop_strings)
    beams = (generation_config.num_beams or 1) > 1
    if rows > 1 and finishes and not beams and pad is not None and not 0 <= int(pad) < vocab_size:
        raise ValueError(f"{given} is outside the vocabulary [0, {vocab_size}): a row that finishes before the "
                         "others is fed the pad token, which the model cannot embed. Pass a pad_token_id inside the "
                         "vocabulary (an EOS id inside it is a common choice).")


def check_model_kwargs(mode: str, model_kwargs: dict) -> None:
    """`ValueError` for a model input of the call that speculative mode `mode` would not honour: `inputs_embeds`
    (the speculative modes embed the input ids themselves) and `position_ids` (plain decoding feeds a caller's
    positions; the speculative modes count each token's position from the attention mask, as plain decoding does
    when none are given)."""
    if model_kwargs.get("inputs_embeds") is not None:
        raise ValueError(f"inputs_embeds: speculative_mode={mode!r} embeds the input ids itself and cannot start "
                         "from embeddings of your own; pass input_ids alone, or speculative_mode=None.")
    if model_kwargs.get("position_ids") is not None:
        raise ValueError(f"position_ids: speculative_mode={mode!r} counts each token's position from the attention "
                         "mask and cannot follow positions of your own; drop position_ids (plain decoding without "
                         "them derives the same positions from the mask), or pass speculative_mode=None. (An "
                         "assistant model gets position_ids from transformers' assisted decoding: set its "
                         "generation_config.speculative_mode to None or 'auto', which assists plainly.)")


def check_reference_inputs(input_ids, attention_mask, cache, max_length, mode: str, vocab_size: int) -> int:
    """`max_length` as an int, after a `ValueError` naming what the reference (`decode_with_lanes`) cannot take: ids
    and a mask that `generate` refuses (`check_inputs`; right padding, `check_left_padded`), a cache that is no
    `PagedLoopCache`, or a `max_length` (columns of the output) that leaves no room after the input's columns."""
    if not isinstance(cache, PagedLoopCache):
        raise ValueError(f"cache: a {type(cache).__name__}; the lane decoder keeps its KV in a PagedLoopCache: pass "
                         "PagedLoopCache(model.kv_layout), or one an earlier call filled.")
    if input_ids is None:  # (which `check_inputs` lets through: transformers' generate starts from BOS)
        raise ValueError("input_ids=None: the reference decodes from a prompt; pass a [batch, length] tensor of ids.")
    check_inputs(input_ids, attention_mask, cache, vocab_size)
    check_left_padded(attention_mask, mode, setting="mode")
    max_length = as_integer(max_length, "max_length")
    if max_length <= input_ids.shape[1]:
        raise ValueError(f"max_length={max_length} leaves no room after the {input_ids.shape[1]} input columns: pass "
                         "a larger max_length (columns of the output).")
    return max_length


def check_assisted_continuation(kwargs: dict, model_config, past: int) -> None:
    """`ValueError` for a `generate` call (`kwargs`) that decodes assisted (`_assisted`) continuing a cache that holds
    `past` columns: transformers' assisted loop feeds the whole input again on its first step, so the cache would
    hold the history twice and the tokens would be wrong (on any cache, transformers' own models too)."""
    what = _assisted(kwargs, model_config)
    if what is None:
        return
    raise ValueError(f"{what} cannot continue a cache that already holds {past} columns: transformers' assisted "
                     "decoding feeds the whole input again, which would store the history twice. Pass the whole "
                     f"sequence with a fresh cache (or none), or drop {what} for this turn.")


def check_decoding_mask(attention_mask, input_ids: torch.Tensor, mode: str) -> None:
    """`check_healed_mask`, then `check_left_padded`: the mask a speculative call in `mode` starts from."""
    check_healed_mask(attention_mask, input_ids)
    check_left_padded(attention_mask, mode)


def check_healed_mask(attention_mask, input_ids: torch.Tensor) -> None:
    """`ValueError` for a mask that no longer fits the prompt decoding starts from: transformers' `token_healing`
    rewrites the prompt (a padded batch's width can change) and leaves the mask as it was, which the model's forward
    refuses without naming token_healing and the engines read row by row (an IndexError). Plain decoding checks it
    too, so a call's error does not depend on the decoder auto picks for it."""
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, but the prompt decoding starts from "
                         f"has shape {tuple(input_ids.shape)} (token_healing rewrote it, leaving the mask as it was): "
                         "heal one prompt per call (no padding), or drop token_healing.")


def check_left_padded(attention_mask, mode: str, setting: str = "speculative_mode") -> None:
    """`ValueError` for rows whose last column is padding, in speculative mode `mode` (`setting`: the argument that
    chose it, generate's `speculative_mode` or the reference's `mode`): plain decoding continues such a row after its
    padding, the speculative engines after its last real token, so the tokens would differ."""
    if attention_mask is None:
        return
    rows = (attention_mask[:, -1] == 0).nonzero().flatten().tolist()
    if not rows:
        return
    generate_note = (", or pass speculative_mode=None. (Without an attention_mask, transformers infers one from "
                     "pad_token_id when it differs from the EOS: a prompt that ends in the pad id reads as padded; "
                     "pass attention_mask=torch.ones_like(input_ids) then.)")
    raise ValueError(f"attention_mask ends in padding in rows {rows[:8]} (right padding), which {setting}={mode!r} "
                     "does not decode as plain decoding does; pad on the left (tokenizer.padding_side = \"left\", or "
                     'AutoTokenizer.from_pretrained(..., padding_side="left"))'
                     + (generate_note if setting == "speculative_mode" else "."))
