"""Huginn-family recurrent-depth models (`huginn_raven`), written natively for transformers 5.x.

Read top to bottom: attention, MLP and block (sandwich or pre-norm), the random initial state, the model as the
`LoopedModel` protocol (embed = embedding + prelude + initial state, core = adapter + recurrent block,
head = coda + LM head), and the HF `forward` / `generate`.

A token's lane state is `[state | prelude output]` (`2 * n_embd` wide): the adapter reads both at every step,
and the prelude output rides along unchanged. Module and parameter names equal the Hub checkpoints'
(`transformer.wte`, `transformer.prelude.i`, `transformer.core_block.j`, `transformer.coda.k`,
`transformer.adapter`, `transformer.ln_f`, `lm_head`; fused `attn.Wqkv` and `mlp.fc`).

KV planes (see `KVLayout`): recurrence step r uses plane r, the prelude plane R, and the coda at exit depth k
plane R + k, for R = num_steps. On a `transformers` Cache plane p, layer l is cache layer p * L + l with
L = the largest of the three stages, so a cache must be continued with the `num_steps` that filled it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import Cache
from transformers.modeling_utils import PreTrainedModel
from transformers.utils import can_return_tuple

from ...generation.mixin import LoopSpecGenerationMixin, reject_exit_options
from ...looped import KVAttention, KVLayout
from ..base import LoopedCausalLMMixin, StrictLoadingMixin, one_cache
from ..layers import (
    RMSNorm,
    apply_rotary,
    check_built,
    check_forward_inputs,
    check_token_ids,
    kept_positions,
    norm_eps,
    project,
    rotary_cos_sin,
    rotate_interleaved,
)
from ..loops import forward_rows
from . import recurrence as recurrence_rules
from .configuration_huginn import BLOCK_CLASS_NAMES, STAGES, HuginnConfig
from .outputs import HuginnCausalLMOutput, HuginnModelOutput
from .recurrence import GENERATION_KEYS, OPEN_BLOCKS, Recurrence, beam_rows, check_steps_fit, state_seed, updated
from .shared_config import SharedGenerationConfig

Rope = Callable[[torch.Tensor], torch.Tensor]  # rotates q or k `[*rows, heads, D]` at the call's positions


class HuginnAttention(nn.Module):
    def __init__(self, config: HuginnConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = config.n_heads, config.num_key_value_heads, config.head_dim
        self.sizes = [self.num_heads * self.head_dim] + [self.num_kv_heads * self.head_dim] * 2  # q | k | v
        self.Wqkv = nn.Linear(config.n_embd, sum(self.sizes), bias=False)
        self.qk_bias = nn.Parameter(torch.zeros(2, 1, self.num_heads, self.head_dim)) if config.qk_bias else None
        self.proj = nn.Linear(self.num_heads * self.head_dim, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor, rope: Rope, attention: KVAttention) -> torch.Tensor:
        rows = x.shape[:-1]
        q, k, v = project(self.Wqkv, x).split(self.sizes, dim=-1)
        q = q.view(*rows, self.num_heads, self.head_dim)
        k = k.view(*rows, self.num_kv_heads, self.head_dim)
        v = v.view(*rows, self.num_kv_heads, self.head_dim)
        if self.qk_bias is not None:  # before RoPE
            q, k = q + self.qk_bias[0], k + self.qk_bias[1]
        out = attention(self.layer_idx, rope(q), rope(k), v)  # [*rows, heads, D]
        return project(self.proj, out.reshape(*rows, self.num_heads * self.head_dim))


class HuginnMLP(nn.Module):
    def __init__(self, config: HuginnConfig):
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 2 * config.intermediate_size, bias=False)  # rows: gate | up
        self.proj = nn.Linear(config.intermediate_size, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = project(self.fc, x).chunk(2, dim=-1)
        return project(self.proj, F.silu(gate) * up)


class HuginnBlock(nn.Module):
    """Sandwich block (norm after every residual add) or, for retrofitted checkpoints, a pre-norm block."""

    def __init__(self, config: HuginnConfig, layer_idx: int):
        super().__init__()
        width, eps = config.n_embd, config.norm_eps
        self.pre_norm = config.pre_norm
        self.norm_1 = RMSNorm(width, eps)
        self.attn = HuginnAttention(config, layer_idx)
        self.norm_2 = RMSNorm(width, eps)
        self.mlp = HuginnMLP(config)
        if not self.pre_norm:
            self.norm_3 = RMSNorm(width, eps)
            self.norm_4 = RMSNorm(width, eps)

    def forward(self, x: torch.Tensor, rope: Rope, attention: KVAttention) -> torch.Tensor:
        if self.pre_norm:
            x = x + self.attn(self.norm_1(x), rope, attention)
            return x + self.mlp(self.norm_2(x))
        x = self.norm_2(x + self.attn(self.norm_1(x), rope, attention))
        return self.norm_4(x + self.mlp(self.norm_3(x)))


class HuginnPreTrainedModel(StrictLoadingMixin, PreTrainedModel):
    """Loading rules of the family: strict keys, the checkpoints' `freqs_cis` buffer ignored."""

    config: HuginnConfig
    config_class = HuginnConfig
    base_model_prefix = "transformer"
    _no_split_modules = ["HuginnBlock"]
    _supports_sdpa = True  # attends with F.scaled_dot_product_attention whatever attn_implementation says
    _keys_to_ignore_on_load_unexpected = [r"freqs_cis$"]  # the checkpoints' persistent RoPE table: recomputed
    generation_keys = GENERATION_KEYS  # the recurrence settings a generation config may carry


class HuginnModel(HuginnPreTrainedModel):
    """Embedding, prelude, adapter, recurrent block, coda and final norm; the `LoopedModel` parts embed / core,
    and `decode` (the coda)."""

    _keys_to_ignore_on_load_unexpected = [r"freqs_cis$", r"^lm_head\."]

    def __init__(self, config: HuginnConfig):
        super().__init__(config)
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.prelude = nn.ModuleList(HuginnBlock(config, i) for i in range(config.n_layers_in_prelude))
        self.adapter = nn.Linear(2 * config.n_embd, config.n_embd, bias=False)
        self.core_block = nn.ModuleList(HuginnBlock(config, i) for i in range(config.n_layers_in_recurrent_block))
        self.coda = nn.ModuleList(HuginnBlock(config, i) for i in range(config.n_layers_in_coda))
        self.ln_f = RMSNorm(config.n_embd, config.norm_eps)
        self.post_init()

    # --- recurrence settings --------------------------------------------------------------------------------
    @property
    def settings(self) -> Recurrence:
        """The settings of the innermost `recurrence` block open in this thread, else the defaults (`defaults`)."""
        return (OPEN_BLOCKS.get() or {}).get(id(self)) or self.defaults()

    def defaults(self, *given) -> Recurrence:
        """The settings outside any block: those the causal LM's generation config sets (its `generation_config`,
        which this model holds too: e.g. `from_pretrained(..., num_steps=32)`'s), else `mean_recurrence` steps,
        init_scale 1.0 and no seed (each call then draws its own). `given`: the caller's num_steps, init_scale and
        init_seed; a config value is read (and checked: `ValueError` naming the config) only where it gives None."""
        config, mean = getattr(self, "generation_config", None), self.config.mean_recurrence  # (None: a base model)
        read = [getattr(config, key, None) if not given or given[i] is None else None
                for i, key in enumerate(GENERATION_KEYS)]
        try:
            return updated(Recurrence(mean, 1.0, None), *read, mean)
        except ValueError as error:
            raise ValueError(f"the model's generation_config: {error}") from None

    @contextlib.contextmanager
    def recurrence(self, num_steps: int | None = None, init_scale: float | None = None,
                   init_seed: int | None = None) -> Iterator[Recurrence]:
        """Run the block with these settings (None keeps the current value; outside any block: the defaults,
        `defaults`). A positive `init_scale` without a seed draws one from torch's global generator,
        so `torch.manual_seed` makes a run reproducible, and every token's state within the block is keyed by
        (seed, sequence, position): forward calls, cached steps and every decoding mode draw the same states.
        The settings hold for this thread (or asyncio task) only; the model itself is not changed."""
        current = (OPEN_BLOCKS.get() or {}).get(id(self)) or self.defaults(num_steps, init_scale, init_seed)
        settings = updated(current, num_steps, init_scale, init_seed, self.config.mean_recurrence)
        if settings.init_scale > 0 and settings.init_seed is None:
            settings = replace(settings, init_seed=int(torch.randint(2**62, ())))
        token = OPEN_BLOCKS.set({**(OPEN_BLOCKS.get() or {}), id(self): settings})
        try:
            yield settings
        finally:
            OPEN_BLOCKS.reset(token)

    # --- LoopedModel protocol -------------------------------------------------------------------------------
    @property
    def num_loops(self) -> int:
        return self.settings.num_steps

    @property
    def kv_layout(self) -> KVLayout:
        block, (vocab, width) = self.core_block[0], self.wte.weight.shape
        built = {**dict(zip(STAGES, map(len, (self.prelude, self.core_block, self.coda)), strict=True)),
                 "n_embd": width, "vocab_size": vocab, "intermediate_size": block.mlp.proj.in_features,
                 "norm_eps": norm_eps(self.ln_f, "transformer.ln_f"), "qk_bias": block.attn.qk_bias is not None,
                 "block_class_name": BLOCK_CLASS_NAMES["pre_norm" if block.pre_norm else "sandwich"]}
        check_built(self.config, built, block.attn)
        return self.config.kv_layout(self.settings.num_steps)

    @property
    def lane_width(self) -> int:
        """A lane state is [state | prelude output]."""
        return 2 * self.config.n_embd

    @property
    def lane_dtype(self) -> torch.dtype:
        return self.wte.weight.dtype

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        c = self.config
        if c.rope_style == "interleaved":
            return lambda x: rotate_interleaved(x, positions, c.rope_base)
        cos, sin = rotary_cos_sin(positions, c.head_dim, c.rope_base, dtype)
        return lambda x: apply_rotary(x, cos, sin)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor, sequences: torch.Tensor,
              attention: KVAttention | None, initial: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids `[*rows]` -> lane state `[*rows, 2 * n_embd]` = [initial state | prelude output]. `initial`
        `[*rows, n_embd]`: the initial states, drawn before by `initial_state` (a compiled step reads no settings and
        draws nothing); None: drawn now."""
        check_token_ids(input_ids, self.config.vocab_size)
        e = self.wte(input_ids) * self.config.embed_scale
        rope = self.rope(positions, e.dtype)
        for block in self.prelude:
            e = block(e, rope, attention)
        initial = self.initial_state(sequences, positions, e) if initial is None else initial.to(e)
        return torch.cat([initial, e], dim=-1)

    def initial_state(self, sequences: torch.Tensor, positions: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """`[*rows, n_embd]`: zeros for init_scale 0, else per token a normal(0, std * init_scale) cut at 3 std, times
        embed_scale, drawn from a generator keyed by (init_seed, sequence, position) (`beam_rows`: a beam's sequence is
        its prompt's), in fp32 on the CPU whatever torch's default dtype and device, then cast to `like`'s."""
        scale, seed = self.settings.init_scale, self.settings.init_seed
        if scale == 0:
            return like.new_zeros(like.shape)
        if seed is None:
            raise ValueError("init_scale > 0 needs a seed to key the initial states: call forward or generate, or "
                             "run inside `model.recurrence(init_seed=...)`.")
        std = self.config.init_std * scale
        keys = zip((sequences // self.settings.beams).reshape(-1).tolist(), positions.reshape(-1).tolist())
        states = torch.empty(sequences.numel(), self.config.n_embd, dtype=torch.float32, device="cpu")
        for row, (sequence, position) in zip(states, keys):
            generator = torch.Generator("cpu").manual_seed(state_seed(seed, sequence, position))
            nn.init.trunc_normal_(row, 0.0, std, -3 * std, 3 * std, generator=generator)
        return (states * self.config.embed_scale).view(like.shape).to(like)

    def core(self, hidden: torch.Tensor, positions: torch.Tensor, attention: KVAttention) -> torch.Tensor:
        """One recurrence step over lane states `[*rows, 2 * n_embd]`: state <- block(adapter([state | e]))."""
        width = self.config.n_embd
        state = project(self.adapter, hidden)
        rope = self.rope(positions, state.dtype)
        for block in self.core_block:
            state = block(state, rope, attention)
        return torch.cat([state, hidden[..., width:]], dim=-1)

    def decode(self, hidden: torch.Tensor, positions: torch.Tensor | None,
               attention: KVAttention | None) -> torch.Tensor:
        """The coda on a lane state's state half: `ln_f(coda(ln_f(state)))` `[*rows, n_embd]` (the LM head input);
        `positions` and `attention` serve the coda's blocks (a model without a coda takes None for them)."""
        x = self.ln_f(hidden[..., : self.config.n_embd])
        if self.coda:
            rope = self.rope(positions, x.dtype)
            for block in self.coda:
                x = block(x, rope, attention)
        return self.ln_f(x)

    # --- HF API ---------------------------------------------------------------------------------------------
    def get_input_embeddings(self):
        return self.wte

    def set_input_embeddings(self, value):
        self.wte = value

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
        num_steps: int | None = None,
        init_scale: float | None = None,
        init_seed: int | None = None,
        output_step_states: bool = False,
        past_key_values: Cache | None = None,
        **kwargs,
    ) -> HuginnModelOutput:
        if inputs_embeds is not None or input_ids is None:
            raise ValueError(("Huginn models take `input_ids` (the prelude and the embedding scale apply to token "
                              "embeddings); `inputs_embeds` is not supported.") if inputs_embeds is not None else
                             "input_ids: none given; pass the prompt's token ids as input_ids.")
        check_forward_inputs(input_ids, None, kwargs.get("output_attentions"), position_ids)
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if output_hidden_states is None:
            output_hidden_states = self.config.output_hidden_states
        cache = one_cache(cache, past_key_values, use_cache)
        with self.recurrence(num_steps, init_scale, init_seed), forward_rows(
                self.kv_layout, attention_mask, position_ids, cache, shape=input_ids.shape,
                like=self.wte.weight.new_empty(0, device=input_ids.device)) as rows:  # (meta when offloaded)
            layout = self.kv_layout

            def plane(index):
                return None if index is None else rows.attention(index)

            lane = self.embed(rows.gather(input_ids), rows.positions, rows.sequences, plane(layout.entry_plane))
            states = []
            for step in range(self.num_loops):
                lane = self.core(lane, rows.positions, rows.attention(step))
                states.append(lane)
            exits = range(1, self.num_loops + 1) if output_step_states else [self.num_loops]
            decoded = [rows.scatter(self.decode(states[k - 1], rows.positions, plane(layout.exit_plane(k))))
                       for k in exits]
        width = self.config.n_embd
        return HuginnModelOutput(
            last_hidden_state=decoded[-1],
            cache=cache if use_cache else None,
            hidden_states=(rows.scatter(lane[..., width:]), *(rows.scatter(s[..., :width]) for s in states))
            if output_hidden_states else None,
            step_states=tuple(decoded) if output_step_states else None,
        )


class HuginnForCausalLM(SharedGenerationConfig, LoopedCausalLMMixin, HuginnPreTrainedModel, LoopSpecGenerationMixin):
    """Huginn with its LM head: the `LoopedModel` protocol plus HF `forward` / `generate`, both of which take
    `num_steps`, `init_scale` and `init_seed` (see `HuginnModel.recurrence`)."""

    _tied_weights_keys = {"lm_head.weight": "transformer.wte.weight"}

    def __init__(self, config: HuginnConfig):
        super().__init__(config)
        self.transformer = HuginnModel(config)
        self.generation_config = self.generation_config  # (the base model holds it too: `SharedGenerationConfig`)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.post_init()

    # --- LoopedModel protocol (num_loops, kv_layout, embed, core: LoopedCausalLMMixin) ------------------------
    def recurrence(self, num_steps: int | None = None, init_scale: float | None = None,
                   init_seed: int | None = None):
        """See `HuginnModel.recurrence`."""
        return self.transformer.recurrence(num_steps, init_scale, init_seed)

    def recurrence_settings(self) -> Recurrence:
        """The settings in force in this thread: the innermost open `recurrence` block's, else the defaults
        (`HuginnModel.defaults`: the generation config's, else `mean_recurrence` steps, init_scale 1.0, no seed)."""
        return self.transformer.settings

    def step_settings(self) -> Recurrence:
        """The settings of this call that shape a decoding step (`looped`): its recurrence steps and init scale; the
        seed is left out (it keys the states `initial_states` draws, data of the step)."""
        return replace(self.transformer.settings, init_seed=None)

    def initial_states(self, sequences: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The initial states `[*rows, n_embd]` (lane dtype) of the tokens at `positions` of batch rows `sequences`
        under this call's settings, as `embed` would draw them (`HuginnModel.initial_state`)."""
        like = self.transformer.wte.weight.new_empty(*positions.shape, self.config.n_embd, device=positions.device)
        return self.transformer.initial_state(sequences, positions, like)

    def embed(self, input_ids, positions=None, sequences=None, attention=None, initial=None):
        """`HuginnModel.embed`."""
        return self.transformer.embed(input_ids, positions, sequences, attention, initial)

    def head(self, hidden, positions=None, attention=None):
        """Logits (fp32) of lane states at any step; the coda writes and reads the exit plane in `attention` (a model
        without a coda has no exit plane: the engine then passes neither)."""
        return project(self.lm_head, self.transformer.decode(hidden, positions, attention)).float()

    # --- HF API ---------------------------------------------------------------------------------------------
    def resize_token_embeddings(self, *args, **kwargs):
        """transformers' resize, which sets `vocab_size`; a Hub config's `padded_vocab_size` (the model has no padded
        rows: the two are equal) follows it, so that the resized model saves a config that loads."""
        embeddings = super().resize_token_embeddings(*args, **kwargs)
        if self.config.padded_vocab_size is not None:
            self.config.padded_vocab_size = self.config.vocab_size
        return embeddings

    def generate(self, *args, num_steps: int | None = None, init_scale: float | None = None,
                 init_seed: int | None = None, **kwargs):
        """`GenerationMixin.generate` (with hf_loopspec's speculative modes) at `num_steps` recurrence steps, with
        initial states keyed by one seed for the whole call, so plain and speculative decoding see the same
        state for the same token (use `init_scale=0` or a fixed `init_seed` for reproducible outputs). A setting not
        passed here comes from a passed generation config, else an open `recurrence` block, else the model's
        generation config (`call_block`)."""
        config = kwargs.get("generation_config") or (args[1] if len(args) > 1 else None) or self.generation_config
        # num_beams as transformers resolves it: the argument, else a passed config's, else the model's (None: unset)
        beams = next((n for n in (kwargs.get("num_beams"), getattr(config, "num_beams", None),
                                  self.generation_config.num_beams) if n is not None), 1)
        with recurrence_rules.callers_block(self.transformer) as caller, \
                self.call_block(config, num_steps=num_steps, init_scale=init_scale, init_seed=init_seed), \
                beam_rows(self.transformer, int(beams)), recurrence_rules.running_call(self.transformer, caller):
            check_steps_fit(self)
            return super().generate(*args, **kwargs)

    def call_block(self, generation_config, **given):
        """`recurrence` with the call's settings: each one given (not None), else the passed generation config's
        (`passed_settings`), else an open block's, else the model's generation config's (`HuginnModel.defaults`)."""
        passed = recurrence_rules.passed_settings(self, generation_config)
        read = {key: value for key, value in passed.items() if given.get(key) is None}  # (a bad one names the config)
        recurrence_rules.check_passed(read, self.config.mean_recurrence)
        return self.recurrence(**{key: read.get(key, given.get(key)) for key in GENERATION_KEYS})

    def call_settings(self) -> dict:
        """The running call's recurrence settings, resolved (a seed drawn for it included): auto mode passes them to
        each of its segments, which would otherwise resolve them again from the generation config."""
        settings = self.recurrence_settings()
        return {"num_steps": settings.num_steps, "init_scale": settings.init_scale, "init_seed": settings.init_seed}

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
        num_steps: int | None = None,
        init_scale: float | None = None,
        init_seed: int | None = None,
        output_step_logits: bool = False,
        past_key_values: Cache | None = None,
        **kwargs,
    ) -> HuginnCausalLMOutput:
        r"""
        Runs `num_steps` recurrence steps from initial states of scale `init_scale` (0 gives zeros) keyed by
        `init_seed` (drawn from torch's generator when None); a setting not passed is an open `recurrence` block's,
        else the generation config's (e.g. `from_pretrained(..., num_steps=32)`'s: scoring by forward calls, as
        lm-eval's loglikelihood does, runs the model that generates), else `mean_recurrence`, 1.0 and None.
        `output_step_logits=True` also decodes every step's state (each with its own coda KV plane). Logits are
        fp32. Ouro's exit options (`exit_at_step`, ...) raise `ValueError`: this family has none.
        """
        reject_exit_options(type(self).__name__, kwargs)
        out = self.transformer(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
            inputs_embeds=inputs_embeds, use_cache=use_cache, output_hidden_states=output_hidden_states,
            num_steps=num_steps, init_scale=init_scale, init_seed=init_seed, output_step_states=output_step_logits,
            past_key_values=past_key_values, return_dict=True, output_attentions=kwargs.get("output_attentions"),
        )
        keep = kept_positions(logits_to_keep)
        logits = project(self.lm_head, out.last_hidden_state[:, keep]).float()
        loss = self.language_loss(logits, labels, kwargs)
        return HuginnCausalLMOutput(
            loss=loss,
            logits=logits,
            cache=out.cache,
            hidden_states=out.hidden_states,
            step_logits=tuple(project(self.lm_head, x[:, keep]).float() for x in out.step_states)
            if output_step_logits else None,
        )


__all__ = ["HuginnForCausalLM", "HuginnModel", "HuginnPreTrainedModel", "Recurrence"]
