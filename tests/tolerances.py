"""fp32 tolerances derived from the computation, for comparing two evaluations of the same function that differ only
in the order of their floating-point operations: cached vs full forward, batched vs alone, paged vs dynamic cache,
compiled vs eager, speculative vs plain decoding, the package vs an independent fp32 reference.

Such evaluations agree up to rounding, and rounding depends on the machine (SIMD blocking differs between Intel and
AMD CPUs, and between a 1-token and a 10-token matmul), so the bound is derived, never fitted to one CPU:

1. A length-n fp32 sum of products rounds to within about sqrt(n)·eps·Σ|a_i·b_i| (roundings have random signs:
   Higham & Mary's probabilistic bound; the worst case n·eps needs every rounding to err the same way). With the
   tests' random weights (std 1/sqrt(fan_in)) the terms are incoherent, so Σ|a_i·b_i| ≈ sqrt(n)·|Σ a_i·b_i|: a
   reduction errs by about n·eps of its output's scale. `width` is the widest reduction of a layer (its other
   reductions are narrower; attention's sums over positions are convex combinations of the values).
2. A layer is a residual block with normalised branches: it passes its input's relative error on with gain about
   1 and adds its own, so the errors of `layers` sequential layer applications add up.
3. Both evaluations round: a factor 2.

So rtol = 2·layers·width·eps and atol = rtol·scale, where scale is the RMS of the compared values (an entry near
zero carries the absolute error of its layer's output scale). Example: tiny Huginn, 3 recurrence steps, cached vs
full forward: 14 layers of width 64 give rtol 2.1e-4, and with logits of RMS 4.6 atol 9.8e-4, against a largest
difference of 1.0e-5 on an Intel CPU and 2.5e-5 on an AMD EPYC.
"""

from __future__ import annotations

import torch

FP32_EPS = torch.finfo(torch.float32).eps  # 2**-23, about 1.19e-7


def fp32_tolerance(layers: int, width: int, scale: float = 1.0) -> dict[str, float]:
    """`{"atol", "rtol"}` for two fp32 evaluations of `layers` sequential layers whose widest reduction has length
    `width`, on values of typical magnitude `scale` (the derivation is in this module's docstring)."""
    if layers < 1 or width < 1 or not scale >= 0:
        raise ValueError(f"layers ({layers}) and width ({width}) must be >= 1 and scale ({scale}) >= 0")
    rtol = 2 * layers * width * FP32_EPS
    return {"atol": rtol * scale, "rtol": rtol}


def rms(values: torch.Tensor) -> float:
    """Root mean square of the finite entries (scores carry -inf for banned tokens, unwritten cache pages NaN)."""
    finite = values.detach()[torch.isfinite(values)].double()
    return float(finite.pow(2).mean().sqrt()) if finite.numel() else 0.0


def assert_fp32_close(actual: torch.Tensor, expected: torch.Tensor, *, layers: int, width: int, **kwargs) -> None:
    """`torch.testing.assert_close` with `fp32_tolerance(layers, width, rms(expected))`; `kwargs` (msg,
    equal_nan, ...) are passed on."""
    torch.testing.assert_close(actual, expected, **fp32_tolerance(layers, width, rms(expected)), **kwargs)


def ouro_depth(config, loops: int | None = None) -> dict[str, int]:
    """`{"layers", "width"}` of an Ouro forward through `loops` loops (default: all `total_ut_steps`): every loop
    applies every decoder layer, then the head; the widest reduction is over the hidden size, the attention output
    (heads x head_dim) or the MLP's intermediate size."""
    loops = config.total_ut_steps if loops is None else loops
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    width = max(config.hidden_size, config.num_attention_heads * head_dim, config.intermediate_size)
    return {"layers": loops * config.num_hidden_layers + 1, "width": width}


def huginn_depth(config, num_steps: int) -> dict[str, int]:
    """`{"layers", "width"}` of a Huginn forward with `num_steps` recurrence steps: the prelude, per step the adapter
    and the core block, the coda, the head; the widest reduction is the adapter's (2 x n_embd) or the MLP's."""
    layers = (config.n_layers_in_prelude + num_steps * (1 + config.n_layers_in_recurrent_block)
              + config.n_layers_in_coda + 1)
    width = max(2 * config.n_embd, config.n_heads * config.head_dim, config.intermediate_size)
    return {"layers": layers, "width": width}
