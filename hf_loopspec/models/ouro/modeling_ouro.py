"""Ouro, written natively for transformers 5.x.

Read top to bottom (RMSNorm and RoPE live in `models/layers.py`): the attention and MLP of one layer, the decoder layer
(a "sandwich": every branch output is normed before it joins the residual stream), the shared stack as the
three parts of the `LoopedModel` protocol (embed / core / head), and the HF `forward` that runs all loops.

State-dict keys and shapes equal the Hub checkpoints' (see `OuroConfig`). Loop `u` of layer `l` keeps its own
KV; on a standard `transformers` Cache that is cache layer `u * num_hidden_layers + l`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import Cache
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import PreTrainedModel
from transformers.utils import can_return_tuple

from ...generation.call import call_exits
from ...generation.config import EXIT_OPTIONS, asks, merged_exit, reject_recurrence_options
from ...generation.mixin import LoopSpecGenerationMixin
from ...logs import get_logger
from ...looped import KVAttention, KVLayout
from ..base import LoopedCausalLMMixin, StrictLoadingMixin, one_cache
from ..layers import (
    RMSNorm,
    apply_rotary,
    check_built,
    check_forward_inputs,
    check_token_ids,
    is_integer,
    is_real,
    kept_positions,
    norm_eps,
    project,
    rotary_cos_sin,
)
from ..loops import forward_rows
from .configuration_ouro import OuroConfig

logger = get_logger(__name__)


class OuroAttention(nn.Module):
    def __init__(self, config: OuroConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: KVAttention):
        rows = x.shape[:-1]
        q = project(self.q_proj, x).view(*rows, self.num_heads, self.head_dim)
        k = project(self.k_proj, x).view(*rows, self.num_kv_heads, self.head_dim)
        v = project(self.v_proj, x).view(*rows, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = attention(self.layer_idx, q, k, v)  # [*rows, heads, D]
        return project(self.o_proj, out.reshape(*rows, self.num_heads * self.head_dim))


class OuroMLP(nn.Module):
    def __init__(self, config: OuroConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return project(self.down_proj, F.silu(project(self.gate_proj, x)) * project(self.up_proj, x))


class OuroDecoderLayer(nn.Module):
    def __init__(self, config: OuroConfig, layer_idx: int):
        super().__init__()
        eps = config.rms_norm_eps
        self.self_attn = OuroAttention(config, layer_idx)
        self.mlp = OuroMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps)  # before attention
        self.input_layernorm_2 = RMSNorm(config.hidden_size, eps)  # on the attention output
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)  # before the MLP
        self.post_attention_layernorm_2 = RMSNorm(config.hidden_size, eps)  # on the MLP output

    def forward(self, h, cos, sin, attention: KVAttention):
        h = h + self.input_layernorm_2(self.self_attn(self.input_layernorm(h), cos, sin, attention))
        h = h + self.post_attention_layernorm_2(self.mlp(self.post_attention_layernorm(h)))
        return h


class OuroPreTrainedModel(StrictLoadingMixin, PreTrainedModel):
    config: OuroConfig
    config_class = OuroConfig
    base_model_prefix = "model"
    _no_split_modules = ["OuroDecoderLayer"]
    _supports_sdpa = True  # attends with F.scaled_dot_product_attention whatever attn_implementation says
    generation_keys = EXIT_OPTIONS  # a generation config's exit options: forward's defaults, kept through save/load



@dataclass
class OuroModelOutput(BaseModelOutputWithPast):
    """`hidden_states`, when requested, holds the embeddings followed by the output of every loop."""


@dataclass
class OuroCausalLMOutput(CausalLMOutputWithPast):
    r"""
    exit_gate_logits (`torch.FloatTensor` of shape `(batch, seq, total_ut_steps)`, *optional*):
        The early-exit gate's logit after every loop (returned with `output_hidden_states` or an exit option).
    loop_logits (`tuple(torch.FloatTensor)`, *optional*):
        Logits of every loop's hidden state, returned with `output_loop_logits=True`.
    """

    exit_gate_logits: torch.FloatTensor | None = None
    loop_logits: tuple[torch.FloatTensor, ...] | None = None


class OuroModel(OuroPreTrainedModel):
    """The shared stack. Besides HF `forward`, it exposes the `LoopedModel` parts `embed` and `core`."""

    _keys_to_ignore_on_load_unexpected = [r"^lm_head\."]

    def __init__(self, config: OuroConfig):
        super().__init__(config)
        if config.attention_dropout:
            logger.warning("OuroConfig.attention_dropout=%s is not applied: the looped attention has no dropout, in "
                           "training as in inference (the released checkpoints use 0.0).", config.attention_dropout)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(OuroDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.early_exit_gate = nn.Linear(config.hidden_size, 1)
        self.post_init()

    @property
    def num_loops(self) -> int:
        return self.config.total_ut_steps

    @property
    def kv_layout(self) -> KVLayout:
        c = self.config
        vocab, width = self.embed_tokens.weight.shape  # (the lanes are hidden_size wide; ids index the rows)
        built = {"num_hidden_layers": len(self.layers), "hidden_size": width, "vocab_size": vocab, "rms_norm_eps":
                 norm_eps(self.norm, "model.norm"), "intermediate_size": self.layers[0].mlp.down_proj.in_features}
        check_built(c, built, self.layers[0].self_attn)
        return KVLayout(c.total_ut_steps, c.num_hidden_layers, c.num_key_value_heads, c.head_dim)

    @property
    def lane_width(self) -> int:
        return self.config.hidden_size

    @property
    def lane_dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def embed(self, input_ids: torch.Tensor, positions=None, sequences=None, attention=None) -> torch.Tensor:
        """Token ids `[*rows]` -> loop-0 input `[*rows, hidden]`; raises `ValueError` on ids outside the vocab.
        Ouro's entry stage is a plain lookup: positions, sequences and attention are not used."""
        check_token_ids(input_ids, self.config.vocab_size)
        return self.embed_tokens(input_ids)

    def core(self, hidden: torch.Tensor, positions: torch.Tensor, attention: KVAttention) -> torch.Tensor:
        """One loop of the stack over rows `[*rows, hidden]` at rotary `positions` `[*rows]`, then the shared
        final norm (applied after every loop; its output is the next loop's input and the head's input)."""
        cos, sin = rotary_cos_sin(positions, self.config.head_dim, self.config.rope_theta, hidden.dtype)
        for layer in self.layers:
            hidden = layer(hidden, cos, sin, attention)
        return self.norm(hidden)

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        past_key_values: Cache | None = None,
        **kwargs,
    ) -> OuroModelOutput:
        layers_dtype = next((p.dtype for p in self.layers.parameters() if p.is_floating_point()), self.lane_dtype)
        check_forward_inputs(input_ids, inputs_embeds, kwargs.get("output_attentions"), position_ids,
                             self.config.hidden_size, (layers_dtype, self.lane_dtype))
        layout = self.kv_layout  # (its `check_built` first: an assigned vocab_size is named, not an IndexError)
        embeddings = self.embed(input_ids) if inputs_embeds is None else inputs_embeds  # [B, T, H]
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if output_hidden_states is None:
            output_hidden_states = self.config.output_hidden_states
        cache = one_cache(cache, past_key_values, use_cache)
        with forward_rows(layout, attention_mask, position_ids, cache, shape=embeddings.shape[:2],
                          like=embeddings) as rows:
            hidden, states = rows.gather(embeddings), []
            for depth in range(self.num_loops):
                hidden = self.core(hidden, rows.positions, rows.attention(depth))
                states.append(rows.scatter(hidden))
        hidden = states[-1]
        return OuroModelOutput(
            last_hidden_state=hidden,
            cache=cache if use_cache else None,
            hidden_states=(embeddings, *states) if output_hidden_states else None,
        )


class OuroForCausalLM(LoopedCausalLMMixin, OuroPreTrainedModel, LoopSpecGenerationMixin):
    """Ouro with its LM head: the `LoopedModel` protocol plus HF `forward` / `generate`."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: OuroConfig):
        super().__init__(config)
        self.model = OuroModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    # --- LoopedModel protocol (num_loops, kv_layout, embed, core: LoopedCausalLMMixin) ------------------------
    def head(self, hidden: torch.Tensor, positions=None, attention=None) -> torch.Tensor:
        """fp32 logits of any depth's output; Ouro's head is stateless (positions and attention are not used)."""
        return project(self.lm_head, hidden).float()

    # --- HF API ---------------------------------------------------------------------------------------------
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        logits_to_keep: int = 0,
        exit_at_step: int | None = None,
        exit_threshold: float | None = None,
        use_weighted_exit: bool | None = None,
        output_loop_logits: bool = False,
        past_key_values: Cache | None = None,
        **kwargs,
    ) -> OuroCausalLMOutput:
        r"""
        Runs all `total_ut_steps` loops. The logits come from the last loop unless an exit option says
        otherwise (upstream semantics; all loops always run, the option only selects what feeds `lm_head`):

        - `exit_at_step` (`int`): use loop `exit_at_step` (0-based) for every token.
        - `exit_threshold` (`float`): per token, the first loop `t` at which the cumulative exit probability
          reaches the threshold (else the last loop). With gate `lambda_t = sigmoid(gate_t)`, the exit
          probability is `p_t = lambda_t * prod_{s<t}(1 - lambda_s)` for `t < U-1` and the remaining mass at
          `U-1`. Computed in fp32 here, so a threshold of 1.0 always selects the last loop.
        - `use_weighted_exit` (`bool`): the expectation of the per-loop logits under `p`.

        A call that chooses none of the three takes the generation config's (a checkpoint's `generation_config.json`,
        `from_pretrained(..., exit_at_step=k)`), merged as `generate` merges a call's (`merged_exit`), so that scoring
        by forward calls (lm-eval's loglikelihood) and training see the model that `generate` decodes;
        `exit_threshold=1.0` selects the last loop whatever the config says. Inside `generate`, which merges the
        config's once, a forward of this model takes the call's in place of the config's (`generation.call.pass_exit`):
        an edit of the config while the call runs reaches the next call.

        `output_hidden_states=True` (default: the config's) returns the embeddings and every loop's output, plus
        `exit_gate_logits`, which also come with any exit option in effect (the config's included);
        `output_loop_logits=True` returns every loop's logits.
        """
        in_call = None if torch.compiler.is_compiling() else call_exits(self)  # (a call's: merged once)
        chosen = merged_exit(dict(zip(EXIT_OPTIONS, (exit_at_step, exit_threshold, use_weighted_exit))),
                             self.generation_config if in_call is None else in_call)
        exit_at_step, exit_threshold, use_weighted_exit = (chosen.get(key) for key in EXIT_OPTIONS)
        check_exit_options(self.num_loops, exit_at_step, exit_threshold, use_weighted_exit)
        reject_recurrence_options(type(self).__name__, kwargs)
        if output_hidden_states is None:
            output_hidden_states = self.config.output_hidden_states
        needs_loops = output_hidden_states or output_loop_logits or exit_at_step is not None \
            or exit_threshold is not None or use_weighted_exit
        out = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
            inputs_embeds=inputs_embeds, use_cache=use_cache, output_hidden_states=needs_loops,
            past_key_values=past_key_values, return_dict=True, output_attentions=kwargs.get("output_attentions"),
        )
        keep = kept_positions(logits_to_keep)
        if not needs_loops:
            logits = project(self.lm_head, out.last_hidden_state[:, keep])
            gate_logits = loop_logits = None
        else:
            loop_states = [h[:, keep] for h in out.hidden_states[1:]]
            gate_logits = torch.cat([self.model.early_exit_gate(h) for h in loop_states], dim=-1)  # [B, T, U]
            loop_logits = tuple(project(self.lm_head, h) for h in loop_states)
            logits = self._select_exit(loop_logits, gate_logits, exit_at_step, exit_threshold, use_weighted_exit)
        loss = self.language_loss(logits, labels, kwargs)
        return OuroCausalLMOutput(
            loss=loss,
            logits=logits,
            cache=out.cache,
            hidden_states=out.hidden_states if output_hidden_states else None,
            exit_gate_logits=gate_logits,
            loop_logits=loop_logits if output_loop_logits else None,
        )

    def exit_rule(self, exit_at_step: int | None = None, exit_threshold: float | None = None,
                  use_weighted_exit: bool = False, **model_kwargs):
        """The lane decoder's target logits for a `generate` call with an exit option (see `forward`): the same
        selection as `forward`, from a lane's outputs after every loop; None without an exit option."""
        check_exit_options(self.num_loops, exit_at_step, exit_threshold, use_weighted_exit)
        if exit_at_step is None and exit_threshold is None and not use_weighted_exit:
            return None
        return ExitSelection(self, exit_at_step, exit_threshold, use_weighted_exit)

    @staticmethod
    def _select_exit(loop_logits, gate_logits, exit_at_step, exit_threshold, use_weighted_exit):
        if exit_at_step is not None:
            return loop_logits[exit_at_step]
        if exit_threshold is None and not use_weighted_exit:
            return loop_logits[-1]
        probs = exit_probabilities(gate_logits)  # [B, T, U] fp32
        stacked = torch.stack(loop_logits, dim=-2)  # [B, T, U, V]
        if use_weighted_exit:
            return (probs[..., None] * stacked.float()).sum(-2).to(stacked.dtype)
        reached = probs.cumsum(-1) >= exit_threshold
        reached[..., -1] = True
        step = reached.int().argmax(-1)  # first loop that reaches the threshold
        return stacked.gather(-2, step[..., None, None].expand(*step.shape, 1, stacked.shape[-1])).squeeze(-2)


@dataclass(frozen=True)
class ExitSelection:
    """`OuroForCausalLM.exit_rule`'s rule (a `generation.decoder.ExitRule`): `forward`'s exit selection, from a
    lane's outputs after every loop. Rules of equal options on one model are equal, so the wavefront engine's compiled
    steps, kept per rule (`wavefront.state.Plan`), serve every call with those options."""

    model: OuroForCausalLM
    exit_at_step: int | None
    exit_threshold: float | None
    use_weighted_exit: bool

    def __call__(self, states: list[torch.Tensor]) -> torch.Tensor:  # U x [N, H] -> [N, V]
        model = self.model
        if self.exit_at_step is not None:
            return model.lm_head(states[self.exit_at_step])
        gate_logits = torch.cat([model.model.early_exit_gate(h) for h in states], dim=-1)  # [N, U]
        loop_logits = tuple(model.lm_head(h) for h in states)
        return model._select_exit(loop_logits, gate_logits, None, self.exit_threshold, self.use_weighted_exit)


def check_exit_options(loops: int, exit_at_step, exit_threshold, use_weighted_exit) -> None:
    """`ValueError` for exit options that select no loop of a `loops`-loop model, or more than one rule."""
    if exit_at_step is not None and (not is_integer(exit_at_step) or not 0 <= exit_at_step < loops):
        raise ValueError(f"exit_at_step={exit_at_step!r} must be an integer in [0, {loops - 1}] for a {loops}-loop "
                         "model.")
    if exit_threshold is not None and (not is_real(exit_threshold) or not 0.0 <= exit_threshold <= 1.0):
        raise ValueError(f"exit_threshold={exit_threshold!r} must be a number in [0, 1].")
    if use_weighted_exit is not None and not isinstance(use_weighted_exit, bool):
        raise ValueError(f"use_weighted_exit={use_weighted_exit!r} must be True or False.")
    if sum(map(asks, (exit_at_step, exit_threshold, use_weighted_exit))) > 1:
        raise ValueError("Pass at most one of exit_at_step, exit_threshold and use_weighted_exit.")


def exit_probabilities(gate_logits: torch.Tensor) -> torch.Tensor:
    """Per-loop exit distribution `[..., U]` (fp32) from the gate logits `[..., U]`: loop `t < U-1` exits with
    `lambda_t * prod_{s<t}(1 - lambda_s)`, the last loop takes the remaining mass."""
    lam = torch.sigmoid(gate_logits.float())
    survive = torch.cumprod(1 - lam, dim=-1)  # prod_{s<=t}(1 - lambda_s)
    before = torch.cat([torch.ones_like(survive[..., :1]), survive[..., :-1]], dim=-1)  # prod_{s<t}
    probs = lam * before
    return torch.cat([probs[..., :-1], before[..., -1:]], dim=-1)


__all__ = ["OuroForCausalLM", "OuroModel", "OuroPreTrainedModel", "exit_probabilities"]
