"""Both families satisfy the `LoopedModel` protocol as the strategies use it: lane states are `[lane_width]` in
`lane_dtype` through `embed` and `core`, and `head` returns fp32 logits whatever the model's dtype."""

from __future__ import annotations

import contextlib

import pytest
import torch

from hf_loopspec.bench.shapes import random_model
from hf_loopspec.cache.paged import PagedLoopCache
from hf_loopspec.looped import LoopedModel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", ["ouro-tiny", "huginn-tiny"])
def test_stages_keep_the_lane_width_and_dtype_and_the_head_returns_fp32(shape, dtype):
    model = random_model(shape, dtype)
    assert isinstance(model, LoopedModel) and model.lane_dtype == dtype
    layout, n = model.kv_layout, 5
    cache = PagedLoopCache(layout)
    cache.ensure_sequences(1)
    like = torch.empty(0, dtype=model.lane_dtype)
    seqs, positions = [0] * n, list(range(n))

    def attention(plane):  # the stage's own plane, or None for a stateless stage
        return None if plane is None else cache.attention(cache.plan_rows(seqs, [plane] * n, positions, like=like))

    recurrence = model.recurrence(init_scale=0.0) if hasattr(model, "recurrence") else contextlib.nullcontext()
    pos = torch.tensor(positions)
    with torch.no_grad(), recurrence:
        hidden = model.embed(torch.arange(3, 3 + n), pos, torch.tensor(seqs), attention(layout.entry_plane))
        assert hidden.shape == (n, model.lane_width) and hidden.dtype == dtype
        hidden = model.core(hidden, pos, attention(0))
        assert hidden.shape == (n, model.lane_width) and hidden.dtype == dtype
        logits = model.head(hidden, pos, attention(layout.exit_plane(1)))
    assert logits.shape == (n, model.config.vocab_size) and logits.dtype == torch.float32
