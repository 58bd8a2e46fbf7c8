"""`compile_core`: static-shape compiled core and head calls over row buckets (generation/stages.py).

Checked on CPU with the `aot_eager` backend (dynamo tracing and AOT autograd, no C++ toolchain needed) and once
with inductor where a C++ compiler exists: compiled and eager decoding give identical tokens (Ouro and Huginn,
pipeline / block / AR, I1 checker on), each stage compiles exactly one graph per bucket it runs (no
recompilation across cycles) and a second run compiles nothing, padded rows write no KV and leave real rows'
outputs unchanged, and bad options raise.
"""

from __future__ import annotations

import copy
import shutil

import pytest
import torch
from huginn_utils import tiny_huginn
from inputs import left_pad, random_prompts
from speculative_utils import mode_params, paged_cache, plain, speculative, tiny_spec_model
from tolerances import assert_fp32_close, ouro_depth

from hf_loopspec.generation.stages import StaticStages, capacity_for, static_stages_of

VOCAB = 96
NEW = 24


def stages_of(model) -> StaticStages:
    (stages,) = static_stages_of(model)
    return stages


def assert_no_recompilation(stages: StaticStages) -> None:
    for stage in ("core", "head"):
        assert stages.compiles[stage] == len(stages.shapes[stage]), (stage, stages.compiles, stages.shapes)


@pytest.mark.parametrize("mode,d,k", mode_params(keep=lambda mode, d, k: d == 1))
def test_ouro_compiled_equals_eager_and_compiles_once_per_bucket(mode, d, k):
    model = tiny_spec_model(3, 4, vocab=VOCAB, damp=0.1)
    ids, mask = left_pad(random_prompts(3, [6, 2, 9], VOCAB))
    ref = plain(model, ids, mask, NEW)
    out = speculative(model, ids, mask, NEW, mode, d, k, compile_core="aot_eager", speculative_engine="lanes")
    assert out.sequences.tolist() == ref.sequences.tolist()
    assert out.speculation.accepted > 0 and out.speculation.rejected > 0  # calls of many row counts (buckets)
    stages = stages_of(model)
    assert stages.shapes["core"] and stages.shapes["head"]
    assert_no_recompilation(stages)
    before, shapes = dict(stages.compiles), {k_: set(v) for k_, v in stages.shapes.items()}
    again = speculative(model, ids, mask, NEW, mode, d, k, compile_core="aot_eager",
                        speculative_engine="lanes")  # same shapes: no compile
    assert again.sequences.tolist() == ref.sequences.tolist()
    assert stages.shapes == shapes and dict(stages.compiles) == before
    copy.deepcopy(model)  # compiled stages live beside the model, not on it


def test_other_lengths_reuse_the_stages():
    """A later call with another batch size of the same capacity (`capacity_for`: 3 and 4 sequences of 4 loops
    both fit 16 rows), longer prompts and more new tokens (more KV tables, more pages per table) reuses the compiled
    stages: no stages of its own, no recompilation (a bucket it runs first compiles once), and plain's tokens."""
    model = tiny_spec_model(3, 4, vocab=VOCAB, damp=0.1)
    assert capacity_for(3, 4, 1) == capacity_for(4, 4, 1)
    for lengths, new in (([6, 2, 9], NEW), ([30, 4, 17, 11], 3 * NEW)):  # 33 and 102 positions per sequence
        ids, mask = left_pad(random_prompts(3, lengths, VOCAB))
        out = speculative(model, ids, mask, new, "pipeline", 1, 1, compile_core="aot_eager",
                          speculative_engine="lanes")
        assert out.sequences.tolist() == plain(model, ids, mask, new).sequences.tolist()
    assert_no_recompilation(stages_of(model))  # stages_of: exactly one StaticStages for both calls


def test_ar_lane_mode_compiled_equals_plain():
    model = tiny_spec_model(4, 3, vocab=VOCAB)
    ids, mask = left_pad(random_prompts(4, [5, 3], VOCAB))
    ref = plain(model, ids, mask, NEW)
    with torch.no_grad():
        out = model.decode_with_lanes(ids, "ar", cache=paged_cache(model),
                                      compile_core="aot_eager", attention_mask=mask, logits_processor=None,
                                      stopping_criteria=None, pad_token_id=0, max_length=ids.shape[1] + NEW)
    assert out.sequences.tolist() == ref.sequences.tolist()
    assert_no_recompilation(stages_of(model))


@pytest.mark.parametrize("mode,d,k", mode_params(keep=lambda mode, d, k: (mode, d) == ("pipeline", 2)))
def test_huginn_compiled_equals_plain(mode, d, k):
    """Huginn's head has KV (the coda), so its compiled head call goes through the exit plane's static rows."""
    model, _ = tiny_huginn(seed=3, damp=0.1)
    ids, mask = left_pad(random_prompts(5, [4, 7], VOCAB))
    settings = {"num_steps": 6, "init_scale": 1.0, "init_seed": 9, "eos_token_id": None}
    ref = plain(model, ids, mask, NEW, **settings)
    out = speculative(model, ids, mask, NEW, mode, d, k, debug=True, compile_core="aot_eager", **settings)
    assert out.sequences.tolist() == ref.sequences.tolist()
    assert_no_recompilation(stages_of(model))


def test_padded_rows_write_nothing_and_change_no_output():
    """One core call through a bucket (rows padded with inactive rows) against the same call made eagerly on an
    identical cache: equal outputs for the real rows, and identical page pools (NaN-poisoned where unwritten)."""
    model = tiny_spec_model(6, 4, vocab=VOCAB)
    caches = [paged_cache(model) for _ in range(2)]
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randn(5, 32, generator=gen)
    for cache in caches:  # the same history at depth 0 for two sequences
        rows = cache.plan_rows([0] * 5 + [1] * 5, [0] * 10, list(range(5)) * 2, like=prompt)
        with torch.no_grad():
            model.core(torch.cat([prompt, prompt]), rows.position, cache.attention(rows))
    hidden = torch.randn(3, 32, generator=gen)  # three decode rows: seq 0 at pos 5, seq 1 at pos 5 and depth 1
    seq, depth, position = [0, 1, 1], [0, 0, 1], [5, 5, 0]
    stages = StaticStages(model, "aot_eager", capacity=8, tables=2 * 4, pages_per_table=4, device=torch.device("cpu"))
    stages.cache = caches[1]
    with torch.no_grad():
        eager_rows = caches[0].plan_rows(seq, depth, position, like=hidden)
        eager = model.core(hidden, eager_rows.position, caches[0].attention(eager_rows))
        static_rows = caches[1].plan_rows(seq, depth, position, like=hidden)
        static = stages.core(hidden, static_rows.position, static_rows)
    assert stages.shapes["core"] == {4}  # three rows ran in the 4-row bucket: one padded row
    depth = ouro_depth(model.config, loops=1)  # one core call: every layer once (the head's term is spare)
    assert_fp32_close(static, eager, **depth)
    assert_fp32_close(caches[1].k_pool, caches[0].k_pool, equal_nan=True, **depth)
    assert_fp32_close(caches[1].v_pool, caches[0].v_pool, equal_nan=True, **depth)


def test_capacity_and_buckets():
    assert capacity_for(1, 4, 4) == 8 and capacity_for(3, 4, 1) == 16 and capacity_for(1, 2, 1) == 4
    model = tiny_spec_model(0, 4, vocab=VOCAB)
    stages = StaticStages(model, "aot_eager", capacity=32, tables=4, pages_per_table=2, device=torch.device("cpu"))
    assert stages.buckets == (1, 2, 4, 8, 16, 32)
    assert [stages.bucket(n) for n in (1, 3, 4, 5, 32, 33)] == [1, 4, 4, 8, 32, None]  # above the largest: eager
    wide = StaticStages(model, "aot_eager", capacity=4096, tables=4, pages_per_table=2, device=torch.device("cpu"))
    assert wide.buckets == tuple(32 << i for i in range(8))  # at most 8 entries per compiled function


def test_bad_compile_options_raise():
    model = tiny_spec_model(0, 4, vocab=VOCAB)
    ids, mask = left_pad(random_prompts(0, [3], VOCAB))
    with pytest.raises(ValueError, match="compile_core=True applies to the speculative modes"):
        model.generate(ids, attention_mask=mask, max_new_tokens=2, compile_core=True)
    with pytest.raises(ValueError, match="torch.compile backend name"):
        speculative(model, ids, mask, 2, "pipeline", compile_core="no-such-backend")


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="inductor's CPU code generation needs a C++ compiler")
def test_inductor_compiled_equals_plain():
    model = tiny_spec_model(7, 4, vocab=VOCAB, damp=0.1)
    ids, mask = left_pad(random_prompts(7, [5, 8], VOCAB))
    ref = plain(model, ids, mask, NEW)
    out = speculative(model, ids, mask, NEW, "pipeline", 1, compile_core=True, speculative_engine="lanes")
    assert out.sequences.tolist() == ref.sequences.tolist()
    assert_no_recompilation(stages_of(model))
