"""A deliberately plain Ouro forward pass, written from `shared/reference/ouro.md` only.

It shares no code with `hf_loopspec` (do not import the package here): the model's tests compare against it.
Everything is recomputed from scratch on every call: full causal attention, no cache, explicit loops over
depths and layers, rotate-half RoPE with fp32 cos/sin, RMSNorm in fp32 cast back then times the weight, and
GQA by repeating the key/value heads. Input is one sequence `[T]` or a batch `[B, T]` without padding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    normed = x32 / torch.sqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE on `x` `[B, heads, T, D]`; token t sits at position t."""
    seq_len, dim = x.shape[-2], x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))  # [D/2]
    angles = torch.arange(seq_len, dtype=torch.float32)[:, None] * inv_freq[None, :]  # [T, D/2]
    angles = torch.cat([angles, angles], dim=-1)  # [T, D]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., : dim // 2], x[..., dim // 2 :]
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos + rotated * sin


def attention(x, sd, prefix, heads, kv_heads, head_dim, theta):
    batch, seq_len, _ = x.shape
    q = (x @ sd[prefix + "q_proj.weight"].T).view(batch, seq_len, heads, head_dim).transpose(1, 2)
    k = (x @ sd[prefix + "k_proj.weight"].T).view(batch, seq_len, kv_heads, head_dim).transpose(1, 2)
    v = (x @ sd[prefix + "v_proj.weight"].T).view(batch, seq_len, kv_heads, head_dim).transpose(1, 2)
    q, k = rope(q, theta), rope(k, theta)
    k = k.repeat_interleave(heads // kv_heads, dim=1)  # GQA: query head i uses kv head i // (heads / kv_heads)
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    scores = (q @ k.transpose(-1, -2)) * head_dim**-0.5  # [B, heads, T, T]
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    out = scores.softmax(dim=-1) @ v  # [B, heads, T, D]
    out = out.transpose(1, 2).reshape(batch, seq_len, heads * head_dim)
    return out @ sd[prefix + "o_proj.weight"].T


def mlp(x, sd, prefix):
    gate = x @ sd[prefix + "gate_proj.weight"].T
    up = x @ sd[prefix + "up_proj.weight"].T
    return (F.silu(gate) * up) @ sd[prefix + "down_proj.weight"].T


@torch.no_grad()
def ouro_reference(sd: dict, input_ids: torch.Tensor, cfg: dict) -> dict:
    """Run Ouro on `input_ids` with the Hub-named state dict `sd`.

    `cfg` needs `num_hidden_layers`, `num_attention_heads`, `num_key_value_heads`, `head_dim`,
    `total_ut_steps`, `rope_theta`, `rms_norm_eps`. Returns `loop_logits` `[U, B, T, V]`, `gate_logits`
    `[B, T, U]` and `loop_hidden` `[U, B, T, H]` (the output of the shared norm after each loop).
    """
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    heads, kv_heads, head_dim = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    theta, eps = cfg["rope_theta"], cfg["rms_norm_eps"]
    h = sd["model.embed_tokens.weight"][input_ids]  # no embedding scale
    hidden, gates, logits = [], [], []
    for _ in range(cfg["total_ut_steps"]):
        for layer in range(cfg["num_hidden_layers"]):
            p = f"model.layers.{layer}."
            a = attention(rms_norm(h, sd[p + "input_layernorm.weight"], eps), sd, p + "self_attn.",
                          heads, kv_heads, head_dim, theta)
            h = h + rms_norm(a, sd[p + "input_layernorm_2.weight"], eps)
            m = mlp(rms_norm(h, sd[p + "post_attention_layernorm.weight"], eps), sd, p + "mlp.")
            h = h + rms_norm(m, sd[p + "post_attention_layernorm_2.weight"], eps)
        h = rms_norm(h, sd["model.norm.weight"], eps)  # shared final norm after every loop
        hidden.append(h)
        gates.append(h @ sd["model.early_exit_gate.weight"].T + sd["model.early_exit_gate.bias"])  # [B, T, 1]
        logits.append(h @ sd["lm_head.weight"].T)
    return {
        "loop_logits": torch.stack(logits),
        "gate_logits": torch.cat(gates, dim=-1),
        "loop_hidden": torch.stack(hidden),
    }


def exit_distribution(gate_logits: torch.Tensor) -> torch.Tensor:
    """Per-loop exit probabilities `[..., U]` from ouro.md, written as an explicit loop over depths:
    p_t = lambda_t * prod_{s<t}(1 - lambda_s) for t < U-1; p_{U-1} is the remaining mass."""
    lam = torch.sigmoid(gate_logits.double())
    loops = lam.shape[-1]
    probs = []
    remaining = torch.ones_like(lam[..., 0])
    for t in range(loops):
        if t < loops - 1:
            probs.append(lam[..., t] * remaining)
            remaining = remaining * (1 - lam[..., t])
        else:
            probs.append(remaining)
    return torch.stack(probs, dim=-1)
