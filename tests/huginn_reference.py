"""A deliberately plain Huginn forward pass, written from `shared/reference/huginn.md` only.

It shares no code with `hf_loopspec` (do not import the package here): the Huginn tests compare against it.
No cache: full causal attention over one unpadded batch, explicit loops over stages, steps and blocks.
Interleaved RoPE is written with complex numbers (a different formulation from the package's real pairs),
rotate-half RoPE with cos/sin tables; RMSNorm in fp32 cast back then times the weight; GQA by repeating the
key/value heads. The initial state is an input, so the caller decides how it is drawn.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x, weight, eps):
    x32 = x.float()
    return weight * (x32 / torch.sqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rope_interleaved(x, theta):
    """`x` `[B, heads, T, D]`; pairs (x[2i], x[2i+1]) as complex numbers times exp(i * t * theta^(-2i/D))."""
    seq_len, dim = x.shape[-2], x.shape[-1]
    freqs = theta ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = torch.arange(seq_len, dtype=torch.float64)[:, None] * freqs[None]  # [T, D/2]
    rotation = torch.polar(torch.ones_like(angles), angles).to(torch.complex64)
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], dim // 2, 2).contiguous())
    return torch.view_as_real(pairs * rotation).reshape(x.shape).to(x.dtype)


def rope_rotate_half(x, theta):
    seq_len, dim = x.shape[-2], x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    angles = torch.arange(seq_len, dtype=torch.float32)[:, None] * inv_freq[None]
    angles = torch.cat([angles, angles], -1)
    x1, x2 = x[..., : dim // 2], x[..., dim // 2 :]
    return x * angles.cos() + torch.cat([-x2, x1], -1) * angles.sin()


def attention(x, sd, p, cfg):
    batch, seq_len, _ = x.shape
    heads, kv_heads, dim = cfg["n_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    qkv = x @ sd[p + "attn.Wqkv.weight"].T
    q = qkv[..., : heads * dim].view(batch, seq_len, heads, dim)
    k = qkv[..., heads * dim : (heads + kv_heads) * dim].view(batch, seq_len, kv_heads, dim)
    v = qkv[..., (heads + kv_heads) * dim :].view(batch, seq_len, kv_heads, dim)
    if cfg["qk_bias"]:
        q = q + sd[p + "attn.qk_bias"][0]
        k = k + sd[p + "attn.qk_bias"][1]
    rope = rope_interleaved if cfg["rope_style"] == "interleaved" else rope_rotate_half
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    q, k = rope(q, cfg["rope_base"]), rope(k, cfg["rope_base"])
    k = k.repeat_interleave(heads // kv_heads, dim=1)
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    scores = (q @ k.transpose(-1, -2)) * dim**-0.5
    scores = scores.masked_fill(~torch.ones(seq_len, seq_len, dtype=torch.bool).tril(), float("-inf"))
    out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(batch, seq_len, heads * dim)
    return out @ sd[p + "attn.proj.weight"].T


def mlp(x, sd, p):
    gate, up = (x @ sd[p + "mlp.fc.weight"].T).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ sd[p + "mlp.proj.weight"].T


def block(x, sd, p, cfg):
    eps = cfg["norm_eps"]
    if cfg["block_class_name"] == "TransformerPreNormBlock":
        x = x + attention(rms_norm(x, sd[p + "norm_1.weight"], eps), sd, p, cfg)
        return x + mlp(rms_norm(x, sd[p + "norm_2.weight"], eps), sd, p)
    x = rms_norm(x + attention(rms_norm(x, sd[p + "norm_1.weight"], eps), sd, p, cfg), sd[p + "norm_2.weight"], eps)
    return rms_norm(x + mlp(rms_norm(x, sd[p + "norm_3.weight"], eps), sd, p), sd[p + "norm_4.weight"], eps)


@torch.no_grad()
def huginn_reference(sd: dict, input_ids: torch.Tensor, cfg: dict, state: torch.Tensor, num_steps: int) -> dict:
    """Run a Huginn model on `input_ids` `[B, T]` from the initial `state` `[B, T, E]`.

    Returns `step_logits` `[num_steps, B, T, V]` (the coda and head applied to the state after each step) and
    `states` `[num_steps, B, T, E]`. `cfg` holds the config fields (with `embed_scale` resolved).
    """
    t = "transformer."
    eps = cfg["norm_eps"]
    head = sd.get("lm_head.weight", sd[t + "wte.weight"])
    e = sd[t + "wte.weight"][input_ids] * cfg["embed_scale"]
    for i in range(cfg["n_layers_in_prelude"]):
        e = block(e, sd, f"{t}prelude.{i}.", cfg)
    s, states, logits = state, [], []
    for _ in range(num_steps):
        s = torch.cat([s, e], dim=-1) @ sd[t + "adapter.weight"].T  # state first, then the prelude output
        for j in range(cfg["n_layers_in_recurrent_block"]):
            s = block(s, sd, f"{t}core_block.{j}.", cfg)
        states.append(s)
        x = rms_norm(s, sd[t + "ln_f.weight"], eps)
        for k in range(cfg["n_layers_in_coda"]):
            x = block(x, sd, f"{t}coda.{k}.", cfg)
        logits.append(rms_norm(x, sd[t + "ln_f.weight"], eps) @ head.T)  # ln_f applied twice
    return {"step_logits": torch.stack(logits), "states": torch.stack(states)}
