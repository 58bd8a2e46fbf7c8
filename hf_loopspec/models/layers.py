"""Building blocks shared by the model families: RMSNorm, the two rotary-embedding conventions, and the
token-id check of every entry stage. Rotary angles are computed in fp32; positions may have any shape `[*rows]`.
"""

from __future__ import annotations

import math
import numbers

import torch
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


def norm_eps(norm: nn.Module, name: str) -> float:
    """The epsilon of the norm `name`, also through an adapter that wraps it (PEFT's LayerNorm tuning keeps it as
    `get_base_layer()`, without an `eps` of its own). `ValueError` for a module without one (read in a property, an
    AttributeError would be reported as the property missing)."""
    base = norm.get_base_layer() if hasattr(norm, "get_base_layer") else norm
    if not is_real(eps := getattr(base, "eps", None)):
        raise ValueError(f"{name} is a {type(base).__name__}, which has no eps: the model's norms must be RMSNorm "
                         "modules (hf_loopspec.models.layers.RMSNorm), or adapters that wrap one.")
    return eps


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


FEW_ROWS = 8  # `project` computes weight @ x.T for 2 to this many rows


def project(linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`linear(x)`, the way every projection and head of both families is applied. Eager on a CPU, with 2 to
    `FEW_ROWS` rows, a plain `nn.Linear` (exactly that class, its `forward` not replaced, no module hooks on it or
    global ones) is computed as `weight @ x.T`: MKL's product in that orientation streams the weight once for all
    rows, where `x @ weight.T` took up to twice as long (the engines' core and head calls have a few rows each;
    BENCHMARKS.md, "One engine"). That result equals `nn.Linear`'s up to fp32 rounding (the reduction order
    differs). Anything else is called as it is: one row, more rows, other devices, compiled code, weights of a
    tensor subclass, and modules that adapters, quantizers, accelerate or hooks replaced or wrap."""
    if torch.compiler.is_compiling() or x.device.type != "cpu" or type(linear) is not nn.Linear:
        return linear(x)  # (compiled first: no guard on the row count, which may be dynamic)
    rows = x.shape[:-1].numel()
    if not 1 < rows <= FEW_ROWS or type(linear.weight) is not nn.Parameter or "forward" in vars(linear) \
            or _hooked(linear):
        return linear(x)  # (a weight of a tensor subclass, e.g. torchao's quantized ones, keeps its own linear)
    out = (linear.weight @ x.reshape(rows, x.shape[-1]).t()).t().reshape(*x.shape[:-1], linear.out_features)
    return out if linear.bias is None else out + linear.bias


def _hooked(module: nn.Module) -> bool:
    """Whether calling `module` would run hooks: its own, or global ones (`torch.nn.modules.module`'s
    `register_module_forward_hook` and relatives)."""
    own = (module._forward_hooks, module._forward_pre_hooks, module._backward_hooks, module._backward_pre_hooks)
    every = (getattr(torch.nn.modules.module, name, None) for name in GLOBAL_HOOKS)
    return any(own) or any(hooks for hooks in every)


GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                "_global_backward_pre_hooks")


def is_integer(value) -> bool:
    """Whether `value` is an integer (Python's or numpy's; not a bool: `True` as a count or id is a mistake)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value) -> bool:
    """Whether `value` is a real number (Python's or numpy's; not a bool)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def is_finite_real(value) -> bool:
    """Whether `value` is a real number (`is_real`) that a float holds finitely: not NaN or infinite, nor an integer
    or fraction too large for a float (10**400, for which `math.isfinite` raises `OverflowError`)."""
    try:
        return is_real(value) and math.isfinite(value)
    except OverflowError:
        return False


def check_built(config, built: dict, attention: nn.Module) -> None:
    """`ValueError` naming a setting of `config` that no longer matches the modules the model was built with (`built`:
    field -> its value in the modules, and the heads and head size of its `attention` modules). Assigned on a loaded
    model's config, a layer count or KV size would lay its KV out for layers or heads it does not have (an IndexError
    deep in the cache, or a cache error naming no setting); the others were ignored by the model and then saved into
    a checkpoint that loaded as another model, or not at all."""
    built = {**built, "num_attention_heads": attention.num_heads, "num_key_value_heads": attention.num_kv_heads,
             "head_dim": attention.head_dim}
    for name, count in built.items():
        if getattr(config, name) != count:
            raise ValueError(f"config.{name}={getattr(config, name)!r}, but the model was built with {count}: a "
                             f"built model's {name} is fixed by its modules and weights; set it back to {count}, or "
                             "build a model from the changed config.")


def check_forward_inputs(input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None,
                         output_attentions: bool | None = None, position_ids: torch.Tensor | None = None,
                         hidden_size: int | None = None, dtypes: tuple[torch.dtype, ...] = ()) -> None:
    """`ValueError` unless exactly one of `input_ids` `[batch, length]` (integers) and `inputs_embeds` `[batch, length,
    hidden_size]` (of one of the model's `dtypes`, its layers' first, then its embedding's) is given, with that shape,
    `position_ids` (if any) hold one position per input token (`[batch, length]`, `[1, length]` or `[length]`,
    integers), and `output_attentions` is not asked for (no attention weights are materialized). Each failed later in
    torch with a message that names no argument."""
    if output_attentions:
        raise ValueError("output_attentions=True is not supported: the looped models' attention (dense or paged, "
                         "over one KV plane per depth) never materializes its weights. Drop output_attentions.")
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("Pass exactly one of `input_ids` and `inputs_embeds`.")
    given, name, dims = (input_ids, "input_ids", 2) if inputs_embeds is None else (inputs_embeds, "inputs_embeds", 3)
    for value, what in ((given, name), (position_ids, "position_ids")):  # (a list or array: an AttributeError)
        if value is not None and not torch.is_tensor(value):
            raise ValueError(f"{what} must be a torch tensor, got a {type(value).__name__}; pass "
                             f"torch.as_tensor({what}) (token ids: tokenizer(..., return_tensors='pt')).")
    if given.is_meta and not torch.compiler.is_compiling():  # (Tensor.item()'s RuntimeError in the id check)
        raise ValueError(f"{name} is on the meta device (shapes only, no values); pass it on the model's device, "
                         "from a real tensor.")
    if given.dim() != dims:
        raise ValueError(f"{name} has shape {tuple(given.shape)}; pass a {dims}-D "
                         f"[batch, length{', hidden' if dims == 3 else ''}] tensor (one row: {name}[None]).")
    if inputs_embeds is None and given.dtype not in (torch.int64, torch.int32):  # (int16: a RuntimeError of torch's)
        raise ValueError(f"input_ids has dtype {given.dtype}; pass token ids as an int64 (or int32) tensor.")
    if inputs_embeds is not None and hidden_size is not None and given.shape[-1] != hidden_size:
        raise ValueError(f"inputs_embeds has shape {tuple(given.shape)}, but the model's hidden size is {hidden_size}: "
                         "pass [batch, length, hidden] embeddings (e.g. model.get_input_embeddings()(input_ids)).")
    if inputs_embeds is not None and dtypes and given.dtype not in dtypes:  # (a matmul's RuntimeError; or, under
        # autocast, a residual stream and KV promoted to another dtype, which the next step's cache check refuses)
        raise ValueError(f"inputs_embeds has dtype {given.dtype}, but the model computes in "
                         f"{' and '.join(map(str, dict.fromkeys(dtypes)))}: pass inputs_embeds.to({dtypes[0]}).")
    batch, length = given.shape[:2]
    if position_ids is not None and tuple(position_ids.shape) not in ((batch, length), (1, length), (length,)):
        raise ValueError(f"position_ids has shape {tuple(position_ids.shape)}, but the input is [{batch}, {length}] "
                         f"tokens: pass one position per token, [{batch}, {length}], [1, {length}] or [{length}].")
    if position_ids is not None and (position_ids.is_floating_point() or position_ids.is_complex()
                                     or position_ids.dtype == torch.bool):  # (Huginn keys states by them: a TypeError)
        raise ValueError(f"position_ids has dtype {position_ids.dtype}; positions are token indices: pass an integer "
                         "tensor (position_ids.long()).")


def kept_positions(logits_to_keep) -> slice | torch.Tensor:
    """Which positions' logits a forward call returns: the last `logits_to_keep` (0: all), or the positions a 1-D
    integer tensor lists (transformers' `int | Tensor` convention); `ValueError` for anything else."""
    if torch.is_tensor(logits_to_keep) and logits_to_keep.dim() == 1 and not logits_to_keep.is_floating_point() \
            and logits_to_keep.dtype != torch.bool:
        return logits_to_keep
    if not is_integer(logits_to_keep) or logits_to_keep < 0:
        raise ValueError(f"logits_to_keep={logits_to_keep!r} must be an integer >= 0 (0: every position) or a 1-D "
                         "tensor of positions.")
    return slice(-int(logits_to_keep), None) if logits_to_keep else slice(None)


def check_mask_values(attention_mask: torch.Tensor) -> None:
    """`ValueError` unless `attention_mask` holds only 0 (padding) and 1 (a real token). Skipped while `torch.compile`
    traces (the check reads the mask on the host), as `check_token_ids` is; a mask that is no tensor, or has no
    values (the meta device) or a complex dtype, is refused too."""
    if torch.compiler.is_compiling():
        return
    if not torch.is_tensor(attention_mask):
        raise ValueError(f"attention_mask must be a torch tensor [batch, length] of 0 and 1, got a "
                         f"{type(attention_mask).__name__}; pass torch.as_tensor(attention_mask).")
    if attention_mask.is_meta:
        raise ValueError("attention_mask is on the meta device (shapes only, no values); pass it on the model's "
                         "device, from a real tensor.")
    if attention_mask.is_complex():  # (torch has no `unique` to name its bad values)
        raise ValueError(f"attention_mask has dtype {attention_mask.dtype}; pass a mask of 0 and 1 in an integer, "
                         "bool or float dtype.")
    binary = (attention_mask == 0) | (attention_mask == 1)
    if not bool(binary.all()):
        bad = attention_mask[~binary].unique()[:5].tolist()
        raise ValueError(f"attention_mask must hold only 0 (padding) and 1 (real token), got values {bad}: "
                         "looped models take a padding mask, not weights or an additive mask.")


def check_token_ids(input_ids: torch.Tensor, vocab_size: int) -> None:
    """Raise `ValueError` naming the offending ids when `input_ids` has ids outside `[0, vocab_size)`. Skipped while
    `torch.compile` traces (the check reads the ids on the host; a compiled decoding step embeds only ids it chose
    itself, from logits over the vocabulary)."""
    if torch.compiler.is_compiling():
        return
    if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab_size):
        ids = input_ids.long()  # (compared in the ids' dtype, the vocabulary size wraps: 4096 is 0 in int8)
        bad = ids[(ids < 0) | (ids >= vocab_size)]
        raise ValueError(
            f"input_ids contains ids outside the vocabulary [0, {vocab_size}): {bad.unique()[:8].tolist()}. "
            "Check that the tokenizer belongs to this model, and that its pad id (pad_token_id) is an id of the "
            "vocabulary: padding positions are embedded too."
        )


def check_labels(labels, positions: tuple[int, int], vocab_size: int, ignore_index: int) -> None:
    """Raise `ValueError` naming `labels` unless it is a `torch.long` tensor of the logits' `positions` `[B, T]` (or
    `[T]` when B is 1, which transformers' loss flattens alike) whose values are ids of `[0, vocab_size)` or
    `ignore_index` (torch's loss raised an IndexError naming a 'target', a dtype RuntimeError, or a batch-size mismatch
    of flattened shapes). Values are skipped while `torch.compile` traces, as `check_token_ids` skips them."""
    if not torch.is_tensor(labels) or labels.dtype != torch.long:
        kind = f"a {labels.dtype} tensor" if torch.is_tensor(labels) else f"a {type(labels).__name__}"
        raise ValueError(f"labels must be a torch.long tensor [batch, length] of token ids, got {kind}; pass "
                         "torch.as_tensor(labels, dtype=torch.long).")
    if tuple(labels.shape) not in (tuple(positions), (positions[1],) if positions[0] == 1 else None):  # ([T]: one row)
        raise ValueError(f"labels has shape {tuple(labels.shape)}, but the logits cover {list(positions)} positions "
                         "([batch, length]): pass one label per input token (ignore_index where none), and no "
                         "logits_to_keep with labels.")
    if torch.compiler.is_compiling() or not labels.numel():
        return
    bad = labels[((labels < 0) | (labels >= vocab_size)) & (labels != ignore_index)]
    if bad.numel():
        raise ValueError(f"labels contains ids outside the vocabulary [0, {vocab_size}): {bad.unique()[:8].tolist()}; "
                         f"mark positions without a label with ignore_index ({ignore_index}).")
