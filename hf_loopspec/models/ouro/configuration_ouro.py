"""Configuration of Ouro, ByteDance's looped language model.

The field names, defaults and `model_type` match the `config.json` files of the Hub checkpoints
(`ByteDance/Ouro-1.4B`, `-2.6B` and their `-Thinking` variants), so those files load unchanged.
"""

from __future__ import annotations

from transformers.configuration_utils import PreTrainedConfig

from ...hub.shims import AUTO_MAP
from .. import config_checks as checks
from ..code_pointers import CodePointersMixin
from ..config_checks import RopeParametersMixin, disagree, rope_theta_of

SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
         "num_key_value_heads", "head_dim", "max_position_embeddings")
VALUE_CHECKS = {"rope_theta": checks.check_rope_base, "rms_norm_eps": checks.check_norm_eps,  # also on assignment
                **dict.fromkeys(("tie_word_embeddings", "attention_bias", "use_sliding_window"), checks.check_flag)}


class OuroConfig(RopeParametersMixin, CodePointersMixin, PreTrainedConfig):
    r"""
    Configuration of an Ouro model: a decoder whose whole layer stack runs `total_ut_steps` times with the
    same weights. Every loop reads and writes a KV plane of its own, and every loop's output is decodable
    through the shared `lm_head` (which is what self-speculation drafts from).

    Args:
        vocab_size (`int`): number of token ids.
        hidden_size (`int`): width of the residual stream.
        intermediate_size (`int`): width of the gated SiLU MLP.
        num_hidden_layers (`int`): layers in the shared stack (one loop runs all of them).
        num_attention_heads (`int`): query heads.
        num_key_value_heads (`int`, *optional*): key/value heads (GQA when smaller than the query heads);
            defaults to `num_attention_heads`.
        head_dim (`int`, *optional*): per-head width; defaults to `hidden_size // num_attention_heads`.
        total_ut_steps (`int`): U, the number of loops over the stack; at least 1.
        early_exit_threshold (`float`): the checkpoint's default exit threshold (1.0: always the last loop).
        rope_theta (`float`): RoPE base.
        rms_norm_eps (`float`): epsilon of every RMSNorm.
    """

    model_type = "ouro"
    keys_to_ignore_at_inference = ["cache"]
    shim_references = frozenset(AUTO_MAP.values())  # a save writes the remote-code shims its auto_map names

    vocab_size: int = 49152
    hidden_size: int = 2048
    intermediate_size: int = 5632
    num_hidden_layers: int = 24
    num_attention_heads: int = 16
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 65536
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    use_cache: bool = True
    tie_word_embeddings: bool = False
    rope_theta: float = 1000000.0
    rope_scaling: dict | None = None
    attention_bias: bool = False
    attention_dropout: float = 0.0
    use_sliding_window: bool = False
    sliding_window: int | None = None
    max_window_layers: int | None = None
    layer_types: list[str] | None = None
    total_ut_steps: int = 4
    early_exit_threshold: float = 1.0
    early_exit_step: int | None = None
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 0
    pad_token_id: int | None = 0

    def __post_init__(self, **kwargs):
        checks.check_counts(self, SIZES, derived=("num_key_value_heads", "head_dim"))
        given = rope_theta_of(self, "rope_parameters", kwargs.get("rope_parameters"))
        both = given is not None and self.rope_theta != type(self).rope_theta  # (a rope_theta not the default)
        if both and disagree(given, self.rope_theta):
            raise ValueError(f"OuroConfig: rope_theta={self.rope_theta!r} and rope_parameters="
                             f"{kwargs['rope_parameters']!r} disagree: two names of one setting; give one of them "
                             "(or equal values).")
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"OuroConfig.hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                    f"{self.num_attention_heads}; pass head_dim explicitly or choose a divisible head count."
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.layer_types is None:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        checks.check_dtype(self, kwargs)
        super().__post_init__(**kwargs)
        self.validate_architecture()

    def __setattr__(self, key, value):
        if key == "rope_parameters":  # transformers 5's name (config.json, a keyword, an assignment): its base only
            theta = rope_theta_of(self, key, value)
            key, value = ("rope_theta", theta) if theta is not None else (None, None)
        if key == "total_ut_steps":  # also on a loaded model's config, which the model reads at every call
            check_loop_count(value)
        if getattr(self, "_post_init_done", False) and key in VALUE_CHECKS:  # (a loaded model's too: NaN logits)
            VALUE_CHECKS[key](self, key, value)
        # an assignment (at construction, `validate_architecture` checks it against the final rope_theta)
        if key == "rope_scaling" and getattr(self, "_post_init_done", False):
            check_rope_scaling(value, self.rope_theta)
        if key is not None:
            super().__setattr__(key, value)

    def validate_architecture(self):
        """Raise `ValueError` for a configuration no Ouro model can be built from. An all-full-attention
        `layer_types` is re-derived from `num_hidden_layers` first (a count changed after the config was made)."""
        checks.check_counts(self, SIZES)
        checks.check_token_ids(self)
        check_loop_count(self.total_ut_steps)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"OuroConfig.num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}: every key/value head must serve the same number "
                "of query heads."
            )
        if self.head_dim % 2:
            raise ValueError(f"OuroConfig.head_dim={self.head_dim} must be even for rotary embeddings.")
        for name, check in VALUE_CHECKS.items():
            check(self, name)
        if self.use_sliding_window:
            raise ValueError(
                "OuroConfig.use_sliding_window=True is not supported: the released Ouro checkpoints use full "
                "attention in every layer; set use_sliding_window=False."
            )
        check_rope_scaling(self.rope_scaling, self.rope_theta)
        if self.attention_bias:
            raise ValueError("OuroConfig.attention_bias=True is not supported: the released Ouro checkpoints have no "
                             "q/k/v/o biases (the model builds none); set attention_bias=False.")
        if self.hidden_act != "silu":
            raise ValueError(f"OuroConfig.hidden_act={self.hidden_act!r} is not supported; Ouro uses 'silu'.")
        if set(self.layer_types) == {"full_attention"}:  # follows a layer count changed since the config was made
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        if len(self.layer_types) != self.num_hidden_layers or set(self.layer_types) != {"full_attention"}:
            raise ValueError(
                f"OuroConfig.layer_types={self.layer_types!r} must list 'full_attention' once per layer "
                f"({self.num_hidden_layers} layers)."
            )


def check_rope_scaling(scaling, theta) -> None:
    """`ValueError` unless `scaling` (`rope_scaling`) asks for no scaling: None, {}, or the default named explicitly."""
    plain_rope = isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type")) == "default" \
        and set(scaling) <= {"rope_type", "type", "rope_theta"} \
        and scaling.get("rope_theta", theta) == theta  # no scaling, said explicitly
    if scaling not in (None, {}) and not plain_rope:
        raise ValueError(f"OuroConfig.rope_scaling={scaling!r} is not supported (the released checkpoints use none); "
                         "set rope_scaling=None.")


def check_loop_count(steps) -> None:
    """`ValueError` unless `steps` (`total_ut_steps`) is an integer >= 1."""
    if not isinstance(steps, int) or isinstance(steps, bool):  # (a numpy integer would not save as JSON)
        raise ValueError(f"OuroConfig.total_ut_steps={steps!r} is invalid: it must be a Python integer >= 1 (e.g. "
                         "int(value); the released checkpoints use 4).")
    if steps < 1:
        raise ValueError(f"OuroConfig.total_ut_steps={steps!r} is invalid: the stack must run at least once; set "
                         "total_ut_steps to an integer >= 1 (the released checkpoints use 4).")


__all__ = ["OuroConfig"]
