"""Checks shared by the families' configurations: the count check, run before anything is derived from the counts (so
that `hidden_size=0` or `num_hidden_layers=2.0` raise a `ValueError` naming the field, not a `ZeroDivisionError` or
`TypeError` from a derived value) and again by `validate_architecture`; and transformers 5's `rope_parameters`, read
into the fields the families' checkpoints use (`rope_theta_of`, `RopeParametersMixin`): the configs never store it,
so that it cannot go stale beside them."""

from __future__ import annotations

from typing import ClassVar

from .layers import is_finite_real, is_integer

ROPE_BASE_NAMES = ("rope_theta", "rope_parameters", "rope_scaling")  # the keywords that can give the RoPE base
FROM_CONFIG = object()  # a value check's default `value`: read the field from the config


def check_counts(config, positive: tuple[str, ...], non_negative: tuple[str, ...] = (),
                 derived: tuple[str, ...] = ()) -> None:
    """`ValueError` naming the field unless every field of `positive` is an integer >= 1 and every field of
    `non_negative` an integer >= 0; a field of `derived` may also be None (the config derives it from others). A
    bool is refused (`True` as a layer count is a mistake), and so is a float such as 2.0 (config.json says 2)."""
    for fields, low in ((positive, 1), (non_negative, 0)):
        for field in fields:
            value = getattr(config, field)
            if value is None and field in derived:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                kind = "a positive integer" if low else "an integer >= 0"
                raise ValueError(f"{type(config).__name__}.{field}={value!r} is invalid: it must be {kind}.")


def check_token_ids(config) -> None:
    """`ValueError` naming the field unless `pad_token_id` and `bos_token_id` are each None or an integer, and
    `eos_token_id` None, an integer or a list of them (a string id such as "3" reached a comparison in transformers'
    generation config as a bare TypeError). Integers of other types (numpy's) are stored as Python's: transformers'
    JSON writer cannot save them."""
    for field in ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = getattr(config, field, None)
        listed = field == "eos_token_id" and isinstance(value, (list, tuple))
        if not (all(is_integer(id_) for id_ in value) if listed else value is None or is_integer(value)):
            allowed = ", an integer or a list of integers" if field == "eos_token_id" else " or an integer"
            raise ValueError(f"{type(config).__name__}.{field}={value!r} is invalid: it must be None{allowed} "
                             "(token ids of the tokenizer's vocabulary).")
        if value is not None:
            setattr(config, field, [int(id_) for id_ in value] if listed else int(value))


def check_dtype(config, kwargs: dict) -> None:
    """`ValueError` naming the field when the config's `dtype` (or, without one, config.json's older `torch_dtype`, in
    `kwargs`: transformers reads it only then) is a string that names no torch dtype (transformers looked it up in
    `torch` and raised an AttributeError)."""
    import torch

    dtype = getattr(config, "dtype", None)
    field, value = ("dtype", dtype) if dtype is not None else ("torch_dtype", kwargs.get("torch_dtype"))
    if isinstance(value, str) and not isinstance(getattr(torch, value, None), torch.dtype):
        raise ValueError(f"{type(config).__name__}.{field}={value!r} is no torch dtype: give one such as "
                         '"bfloat16" or "float32" (config.json), or leave it out.')


def rope_theta_of(config, name: str, given) -> float | None:
    """The RoPE base in `given`, a value of transformers 5's `rope_parameters` (or of `rope_scaling`, which
    transformers turns into it, on a family without that field): its `rope_theta`, or None. `ValueError` naming
    `name` for a value that is no dict, or that scales the rotation: both families use plain RoPE."""
    if given is None:
        return None
    scaling = {key: value for key, value in given.items() if key != "rope_theta"} if isinstance(given, dict) else None
    if scaling is None or scaling.get("rope_type", scaling.get("type", "default")) != "default" \
            or set(scaling) - {"rope_type", "type"}:
        raise ValueError(f"{type(config).__name__}.{name}={given!r} is not supported: the model uses plain RoPE; give "
                         'only its base, e.g. {"rope_type": "default", "rope_theta": 10000.0}.')
    return given.get("rope_theta")


def disagree(value, other) -> bool:
    """Whether two names of one setting were given different values (two NaNs agree: the value's own check then
    names it as invalid, where "nan and nan disagree" misled)."""
    return value != other and not (value != value and other != other)


def check_rope_base(config, name: str, value=FROM_CONFIG) -> None:
    """`ValueError` naming `name` unless the config's RoPE base there (or `value`, about to be assigned there) is a
    finite number > 0 (0 gave NaN logits and a string a `TypeError` at the first forward)."""
    value = getattr(config, name) if value is FROM_CONFIG else value
    if not is_finite_real(value) or value <= 0:
        raise ValueError(f"{type(config).__name__}.{name}={value!r} is invalid: the RoPE base must be a finite number "
                         "> 0 (the checkpoints use 10000.0 to 1000000.0).")


def check_norm_eps(config, name: str, value=FROM_CONFIG) -> None:
    """`ValueError` naming `name` unless the config's RMSNorm epsilon there (or `value`, about to be assigned there) is
    a finite number >= 0 (a negative or NaN one gave NaN logits, and greedy decoding then returned token 0 without a
    word)."""
    value = getattr(config, name) if value is FROM_CONFIG else value
    if not is_finite_real(value) or value < 0:
        raise ValueError(f"{type(config).__name__}.{name}={value!r} is invalid: the RMSNorm epsilon must be a finite "
                         "number >= 0 (the checkpoints use 1e-6).")


def check_flag(config, name: str, value=FROM_CONFIG) -> None:
    """`ValueError` naming `name` unless the config's switch there (or `value`, about to be assigned there) is True or
    False: a string such as "false" read as True (a model built with biases it then refused, or with tied weights)."""
    value = getattr(config, name) if value is FROM_CONFIG else value
    if not isinstance(value, bool):
        raise ValueError(f"{type(config).__name__}.{name}={value!r} is invalid: pass True or False.")


class RopeParametersMixin:
    """`rope_parameters` and `rope_scaling` given as keywords of `from_pretrained` / `from_dict` reach the config as
    config.json keys do (transformers sets only keywords the config has as attributes: it would drop them, or hand
    them to the model's `__init__`). A config.json, or keywords, giving one setting two values (`KEYWORD_GROUPS`:
    names of one setting; a rope dict counts with its `rope_theta`) raise a `ValueError`: transformers sets them one
    after the other, so the last would win without a word. (A keyword overrides config.json, as in transformers.)"""

    KEYWORD_GROUPS: ClassVar[tuple[tuple[str, ...], ...]] = (ROPE_BASE_NAMES,)

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs):
        for where, given in (("config.json", config_dict), ("keywords", kwargs)):
            for group in cls.KEYWORD_GROUPS:
                values = {name: given[name].get("rope_theta") if isinstance(given[name], dict) else given[name]
                          for name in group if name in given}
                values = [(name, value) for name, value in values.items() if value is not None]
                if any(disagree(value, values[0][1]) for _, value in values):  # (unhashed: a list is check_rope_base's)
                    named = " and ".join(f"{name}={given[name]!r}" for name, _ in values)
                    raise ValueError(f"{cls.__name__} ({where}): {named} disagree: two names of one setting; give one "
                                     "of them (or equal values).")
        rope = {key: kwargs.pop(key) for key in ("rope_parameters", "rope_scaling") if key in kwargs}
        given = {**kwargs, **rope}  # a keyword giving the setting (a rope dict: with its base) replaces config.json's
        given = {name for name, value in given.items()
                 if value is not None and (not isinstance(value, dict) or value.get("rope_theta") is not None)}
        overridden = {name for group in cls.KEYWORD_GROUPS if set(group) & given for name in group}
        kept = {key: value for key, value in config_dict.items() if key not in overridden}  # (the keyword's stands)
        return super().from_dict({**kept, **rope}, **kwargs)
