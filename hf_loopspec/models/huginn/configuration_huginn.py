"""Configuration of Huginn-family recurrent-depth models (model_type `huginn_raven`).

The field names match the `config.json` of `tomg-group-umd/huginn-0125` (its remote code calls the class
`RavenConfig`), so that file loads unchanged; the transformers names `hidden_size`, `num_attention_heads` and
`num_hidden_layers` are aliases of `n_embd`, `n_heads` and `n_layers`.
"""

from __future__ import annotations

import math
from typing import ClassVar

from transformers.configuration_utils import PreTrainedConfig

from ...logs import get_logger
from ...looped import KVLayout
from ..code_pointers import CodePointersMixin
from ..config_checks import (
    FROM_CONFIG,
    ROPE_BASE_NAMES,
    RopeParametersMixin,
    check_counts,
    check_dtype,
    check_flag,
    check_norm_eps,
    check_rope_base,
    check_token_ids,
    disagree,
    rope_theta_of,
)
from ..layers import is_finite_real, is_integer

logger = get_logger(__name__)

BLOCK_STYLES = {"SandwichBlock": "sandwich", "TransformerPreNormBlock": "pre_norm"}
BLOCK_CLASS_NAMES = {style: name for name, style in BLOCK_STYLES.items()}
ROPE_STYLES = ("interleaved", "rotate_half")
SIZES = ("vocab_size", "n_embd", "n_heads", "num_key_value_heads", "head_dim", "intermediate_size",
         "n_layers_in_recurrent_block", "mean_recurrence", "block_size")
OUTER_STAGES = ("n_layers_in_prelude", "n_layers_in_coda")
STAGES = ("n_layers_in_prelude", "n_layers_in_recurrent_block", "n_layers_in_coda")
DEFAULT_ROPE_BASE = 50000.0  # Huginn-0125's
NAME_PAIRS = (("rope_base", "rope_theta"), ("tie_embeddings", "tie_word_embeddings"))  # two names, one setting
PAIRED = {**dict(NAME_PAIRS), **{other: name for name, other in NAME_PAIRS}}  # each name -> the other


def check_rope_style(config, name: str, value=FROM_CONFIG) -> None:
    """`ValueError` unless the config's `rope_style` (or `value`, about to be assigned) is one of `ROPE_STYLES` (any
    other value assigned on a built model decoded as "rotate_half" without a word)."""
    value = getattr(config, name) if value is FROM_CONFIG else value
    if not isinstance(value, str) or value not in ROPE_STYLES:
        raise ValueError(f"HuginnConfig.{name}={value!r} must be one of {ROPE_STYLES}.")


def check_init_values(config, name: str, value=FROM_CONFIG) -> None:
    """`ValueError` unless the config's `init_values` (or `value`, about to be assigned; a key left out takes its
    default) hold finite numbers `std` > 0 and `embed_scale` > 0: a std of 0 failed in the initial states' draw with
    a ZeroDivisionError, an infinite one with a torch RuntimeError, and an infinite embed_scale gave NaN logits (greedy
    decoding then returned token 0 without a word). Zero initial states are a call's `init_scale=0`."""
    values = getattr(config, name) if value is FROM_CONFIG else config._with_defaults(value)
    numbers_given = isinstance(values, dict) and all(
        is_finite_real(values.get(key)) and values[key] > 0 for key in ("std", "embed_scale"))
    if not numbers_given:
        raise ValueError(f"HuginnConfig.{name}={values!r}: give a dict of finite numbers `std` > 0 and `embed_scale` "
                         "> 0 (either may be left out for its default), or None for both defaults; for zero initial "
                         "states pass init_scale=0 to the call instead.")


VALUE_CHECKS = {"rope_base": check_rope_base, "rope_theta": check_rope_base, "norm_eps": check_norm_eps,
                "rope_style": check_rope_style, "init_values": check_init_values,
                **dict.fromkeys(("qk_bias", "bias", "tie_embeddings", "tie_word_embeddings"), check_flag)}


class HuginnConfig(RopeParametersMixin, CodePointersMixin, PreTrainedConfig):
    r"""
    A prelude of `n_layers_in_prelude` blocks runs once per token; a recurrent block of
    `n_layers_in_recurrent_block` layers runs `num_steps` times (default `mean_recurrence`) on a state that the
    adapter mixes with the prelude output at every step; a coda of `n_layers_in_coda` blocks and the LM head
    decode the final state.

    Args:
        vocab_size (`int`): token ids (and rows of the embedding and of the LM head).
        n_embd (`int`): width of the residual stream (alias `hidden_size`).
        n_heads (`int`): query heads (alias `num_attention_heads`).
        num_key_value_heads (`int`, *optional*): key/value heads (GQA, retrofitted models); default `n_heads`.
        head_dim (`int`, *optional*): per-head width; default `n_embd // n_heads`.
        intermediate_size (`int`): width of the gated SiLU MLP.
        n_layers_in_prelude, n_layers_in_recurrent_block, n_layers_in_coda (`int`): the three stages.
        n_layers (`int`, *optional*): their sum (alias `num_hidden_layers`); a different value (as some configs
            saved by the upstream code carry) is replaced by the sum, with a warning. Setting a stage count later
            updates it; setting it later to another value raises when a model is built.
        mean_recurrence (`int`): default number of recurrence steps at inference.
        block_size (`int`): maximum positions.
        rope_base (`float`): RoPE base; `rope_theta` is its transformers name (both are kept equal; given both, they
            must agree).
        rope_style (`str`): "interleaved" (Huginn-0125: pairs (x[2i], x[2i+1])) or "rotate_half" (the
            retrofitted Llama-style checkpoints).
        block_class_name (`str`): "SandwichBlock" (norm after every residual add, Huginn-0125) or
            "TransformerPreNormBlock" (Llama-style pre-norm: `x + attn(norm_1(x))`, `x + mlp(norm_2(x))`).
        qk_bias (`bool`): a learned `[2, 1, heads, head_dim]` bias added to q and k before RoPE.
        norm_eps (`float`): RMSNorm epsilon.
        init_values (`dict`): `std` of the initial state's truncated normal (default `sqrt(2 / (5 n_embd))`,
            0.00869 for n_embd 5280) and `embed_scale` (default `sqrt(n_embd)`; 1.0 for retrofitted models),
            which multiplies both the token embeddings and the initial state.
        tie_embeddings / tie_word_embeddings (`bool`): tie the LM head to the embedding (either name; they
            must agree when both are given).
    """

    model_type = "huginn_raven"
    keys_to_ignore_at_inference = ["cache"]
    attribute_map: ClassVar[dict[str, str]] = {
        "hidden_size": "n_embd",
        "num_attention_heads": "n_heads",
        "num_hidden_layers": "n_layers",
        "max_position_embeddings": "block_size",  # where transformers and lm-eval look for the position limit
    }
    KEYWORD_GROUPS: ClassVar[tuple[tuple[str, ...], ...]] = (("rope_base", *ROPE_BASE_NAMES), NAME_PAIRS[1])

    vocab_size: int = 65536
    padded_vocab_size: int | None = None
    n_embd: int = 5280
    n_heads: int = 55
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    intermediate_size: int = 17920
    n_layers: int | None = None
    n_layers_in_prelude: int = 2
    n_layers_in_recurrent_block: int = 4
    n_layers_in_coda: int = 2
    mean_recurrence: int = 32
    block_size: int = 4096
    rope_base: float | None = None  # (with rope_theta None too: DEFAULT_ROPE_BASE)
    rope_theta: float | None = None
    rope_style: str = "interleaved"
    block_class_name: str = "SandwichBlock"
    qk_bias: bool = True
    bias: bool = False
    norm_eps: float = 1e-6
    init_values: dict | None = None
    tie_embeddings: bool | None = None
    tie_word_embeddings: bool | None = None
    use_cache: bool = True
    bos_token_id: int | None = 65504
    eos_token_id: int | list[int] | None = 65505
    pad_token_id: int | None = 65509

    def __post_init__(self, **kwargs):
        for alias in self.attribute_map:  # transformers applies extra kwargs after this method; aliases first
            if alias in kwargs:
                setattr(self, alias, kwargs.pop(alias))
        check_counts(self, SIZES, OUTER_STAGES, derived=("num_key_value_heads", "head_dim"))
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.n_heads
        if self.head_dim is None:
            if self.n_embd % self.n_heads:
                raise ValueError(f"HuginnConfig.n_embd={self.n_embd} is not divisible by n_heads={self.n_heads}; "
                                 "pass head_dim explicitly or choose a divisible head count.")
            self.head_dim = self.n_embd // self.n_heads
        stages = self.n_layers_in_prelude + self.n_layers_in_recurrent_block + self.n_layers_in_coda
        if self.n_layers is not None and self.n_layers != stages:
            logger.warning(
                "HuginnConfig.n_layers=%s (num_hidden_layers) differs from prelude + recurrent block + coda = %s + %s "
                "+ %s = %s; the model is built from the per-stage counts (as the upstream code does), and n_layers is "
                "set to %s.", self.n_layers, self.n_layers_in_prelude, self.n_layers_in_recurrent_block,
                self.n_layers_in_coda, stages, stages)
        self.n_layers = stages
        for name, other in NAME_PAIRS:
            values = getattr(self, name), getattr(self, other)
            if None not in values and disagree(*values):
                raise ValueError(f"HuginnConfig: {name}={getattr(self, name)!r} and {other}={getattr(self, other)!r} "
                                 "disagree: two names of one setting; pass one of them (or equal values).")
        given = rope_theta_of(self, "rope_parameters", kwargs.get("rope_parameters"))  # (set after this method)
        named = next((x for x in (self.rope_theta, self.rope_base) if x is not None), None)
        if None not in (given, named) and disagree(given, named):
            raise ValueError(f"HuginnConfig: rope_base / rope_theta={named!r} and rope_parameters="
                             f"{kwargs['rope_parameters']!r} disagree: two names of one setting; pass one of them (or "
                             "equal values).")
        base = named if named is not None else DEFAULT_ROPE_BASE
        self.rope_theta = self.rope_base = base
        self.tie_embeddings = self.tie_word_embeddings = next(
            (x for x in (self.tie_embeddings, self.tie_word_embeddings) if x is not None), True)
        self.init_values = self._with_defaults(self.init_values)
        check_dtype(self, kwargs)
        super().__post_init__(**kwargs)
        self.validate_architecture()

    def __setattr__(self, key, value):
        """Once the config is made (`from_pretrained`'s keyword overrides and assignments come after), setting one
        name of a setting with two (`PAIRED`) sets both, and a stage count sets `n_layers` to the stages' sum, so that
        the config always says what the model is built from (a different `n_layers` alone is refused when a model
        is built from it: `validate_architecture`); `init_values` gets the default of each key it leaves out, as
        when the config is made. transformers 5's `rope_parameters` (and `rope_scaling`, its older name) set the
        RoPE base and are not stored (`rope_theta_of`). A `mean_recurrence` set then is checked as when the config is
        made (`ValueError`)."""
        if key in ("rope_parameters", "rope_scaling"):  # transformers 5's names (config.json, keywords): the base only
            theta = rope_theta_of(self, key, value)
            if theta is not None:
                if getattr(self, "_post_init_done", False):
                    check_rope_base(self, "rope_base", theta)
                super().__setattr__("rope_theta", theta)
                super().__setattr__("rope_base", theta)
            return
        done = getattr(self, "_post_init_done", False)  # transformers' flag: __post_init__ has run
        if done and key == "mean_recurrence" and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            # (a loaded model reads it at every call: it failed there, in the KV layout, naming no setting)
            raise ValueError(f"HuginnConfig.mean_recurrence={value!r} is invalid: it must be a positive integer (the "
                             "recurrence steps a call runs by default).")
        if done and key in VALUE_CHECKS:  # (a loaded model reads them at every call: NaN logits, a TypeError)
            VALUE_CHECKS[key](self, key, value)
        super().__setattr__(key, self._with_defaults(value) if done and key == "init_values" else value)
        if not done:
            return
        key = self.attribute_map.get(key, key)
        if key in PAIRED:
            super().__setattr__(PAIRED[key], value)
        elif key in STAGES and all(is_integer(getattr(self, stage)) for stage in STAGES):
            super().__setattr__("n_layers", sum(getattr(self, stage) for stage in STAGES))

    def _with_defaults(self, init_values):
        """`init_values` (a dict or None) with the default of each key it leaves out; anything else as it is (for
        `validate_architecture` to name)."""
        if init_values is not None and not isinstance(init_values, dict):
            return init_values
        return {"std": math.sqrt(2 / (5 * self.n_embd)), "embed_scale": math.sqrt(self.n_embd), **(init_values or {})}

    @property
    def embed_scale(self) -> float:
        return float(self.init_values["embed_scale"])

    @property
    def init_std(self) -> float:
        return float(self.init_values["std"])

    @property
    def pre_norm(self) -> bool:
        return BLOCK_STYLES[self.block_class_name] == "pre_norm"

    def kv_layout(self, num_steps: int) -> KVLayout:
        """The KV a Huginn model of this config writes at `num_steps` recurrence steps: a plane per step (the core),
        an entry plane (the prelude, when it has layers) and a plane per exit depth (the coda, when it has layers),
        each of the largest stage's layer count."""
        entry = num_steps if self.n_layers_in_prelude else None
        first_exit = num_steps + (entry is not None) if self.n_layers_in_coda else None
        planes = num_steps + (entry is not None) + (num_steps if first_exit is not None else 0)
        return KVLayout(planes, max(getattr(self, stage) for stage in STAGES), self.num_key_value_heads,
                        self.head_dim, entry_plane=entry, first_exit_plane=first_exit)

    def validate_architecture(self):
        """Raise `ValueError` for a configuration no Huginn model can be built from, or one that misdescribes the
        model built from it: an `n_layers` (`num_hidden_layers`, e.g. a `from_pretrained` override) other than the
        stages' sum, or two names of one setting that disagree."""
        check_counts(self, SIZES, OUTER_STAGES)
        check_token_ids(self)
        stages = tuple(getattr(self, stage) for stage in STAGES)
        if self.n_layers != sum(stages):
            raise ValueError(
                f"HuginnConfig.n_layers (num_hidden_layers)={self.n_layers} differs from prelude + recurrent block + "
                f"coda = {' + '.join(map(str, stages))} = {sum(stages)}: the model is built from the per-stage counts; "
                "set n_layers_in_prelude, n_layers_in_recurrent_block and n_layers_in_coda, and n_layers to their sum."
            )
        for name, other in NAME_PAIRS:
            if disagree(getattr(self, name), getattr(self, other)):  # a guard: __setattr__ keeps the two names equal
                raise ValueError(f"HuginnConfig: {name}={getattr(self, name)} and {other}={getattr(self, other)} "
                                 "disagree: two names of one setting; set both.")
        for name, check in VALUE_CHECKS.items():
            check(self, name)
        if self.padded_vocab_size not in (None, self.vocab_size):
            raise ValueError(
                f"HuginnConfig.padded_vocab_size={self.padded_vocab_size} differs from vocab_size={self.vocab_size}: "
                "the model has one embedding row per id and no padded rows; set both to the number of rows of the "
                "checkpoint's embedding (or drop padded_vocab_size)."
            )
        if self.n_heads % self.num_key_value_heads:
            raise ValueError(
                f"HuginnConfig.n_heads={self.n_heads} is not a multiple of num_key_value_heads="
                f"{self.num_key_value_heads}: every key/value head must serve the same number of query heads."
            )
        if self.qk_bias and self.num_key_value_heads != self.n_heads:
            raise ValueError("HuginnConfig.qk_bias=True needs num_key_value_heads == n_heads (the bias has one row "
                             "per query head for both q and k); set qk_bias=False for GQA checkpoints.")
        if self.head_dim % 2:
            raise ValueError(f"HuginnConfig.head_dim={self.head_dim} must be even for rotary embeddings.")
        if self.block_class_name not in BLOCK_STYLES:
            raise ValueError(f"HuginnConfig.block_class_name={self.block_class_name!r} must be one of "
                             f"{sorted(BLOCK_STYLES)}.")
        if self.bias:
            raise ValueError("HuginnConfig.bias=True (biases on the linear layers) is not supported: the released "
                             "checkpoints have none; set bias=False.")


__all__ = ["HuginnConfig"]
