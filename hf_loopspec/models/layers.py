"""Building blocks shared by the model families: RMSNorm, the two rotary-embedding conventions, and the
token-id check of every entry stage. Rotary angles are computed in fp32; positions may have any shape `[*rows]`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32, cast back to the input dtype, then scaled by the weight."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rotary_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos and sin `[*positions.shape, head_dim]` for rotate-half RoPE, computed in fp32 then cast."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    angles = positions.float()[..., None] * inv_freq  # [..., D/2]
    angles = torch.cat([angles, angles], dim=-1)  # [..., D]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` `[..., heads, D]` by angles `[..., D]` (rotate-half convention)."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def rotate_interleaved(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE on interleaved pairs: (x[2i], x[2i+1]) of `x` `[*rows, heads, D]` rotated by `position * theta_i`,
    `theta_i = theta^(-2i/D)`; computed in fp32, returned in the dtype of `x`."""
    dim = x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, dim, 2, device=x.device, dtype=torch.float32) / dim)  # [D/2]
    angles = positions.float()[..., None, None] * inv_freq  # [*rows, 1, D/2]
    cos, sin = angles.cos(), angles.sin()
    pairs = x.float().unflatten(-1, (dim // 2, 2))  # [*rows, heads, D/2, 2]
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1)
    return rotated.flatten(-2).to(x.dtype)


FEW_ROWS = 8  # `Linear` computes weight @ x.T for 2 to this many rows


class Linear(nn.Linear):
    """`nn.Linear` (the same parameters, names and checkpoint layout) whose product with a few rows is computed as
    `weight @ x.T` when eager on a CPU: with 2 to `FEW_ROWS` rows MKL's product in that orientation streams the
    weight once for all rows, where `x @ weight.T` took up to twice as long (the engines' core and head calls have
    a few rows each; BENCHMARKS.md, "One engine"). The result equals `nn.Linear`'s up to fp32 rounding (the
    reduction order differs). One row, more rows, other devices and compiled code take `F.linear`. Hooks,
    adapters and quantizers that work on an `nn.Linear` work on it (it is one)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[:-1].numel()
        if x.device.type != "cpu" or torch.compiler.is_compiling() or not 1 < rows <= FEW_ROWS:
            return F.linear(x, self.weight, self.bias)
        out = (self.weight @ x.reshape(rows, x.shape[-1]).t()).t().reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias


def check_token_ids(input_ids: torch.Tensor, vocab_size: int) -> None:
    """Raise `ValueError` naming the offending ids when `input_ids` has ids outside `[0, vocab_size)`. Skipped while
    `torch.compile` traces (the check reads the ids on the host; a compiled decoding step embeds only ids it chose
    itself, from logits over the vocabulary)."""
    if torch.compiler.is_compiling():
        return
    if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab_size):
        bad = input_ids[(input_ids < 0) | (input_ids >= vocab_size)]
        raise ValueError(
            f"input_ids contains ids outside the vocabulary [0, {vocab_size}): {bad.unique()[:8].tolist()}. "
            "Check that the tokenizer belongs to this model."
        )
