"""Huginn on the wavefront engine: the prelude's entry plane and the coda's exit planes in the device state.

Tokens are checked against plain greedy `generate` (transformers' loop on a DynamicCache), the cache `generate`
returns against serial AR (I4, on the planes AR writes) and against the lane decoder's (every plane the run writes,
the draft depth's coda plane included), which is the reference for what the stages must store.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from huginn_utils import PAD, VOCAB, tiny_huginn
from inputs import left_pad, random_ids
from paged_utils import paged_plane
from sampling_utils import ALPHA, PROCESSOR_SETTINGS, chi_square_p_value, exact_joint, sample_pairs
from sampling_utils import VOCAB as SAMPLING_VOCAB
from speculative_utils import (
    MODES,
    assert_cache_matches_ar,
    assert_counter_invariants,
    generate_dict,
    mode_id,
    mode_kwargs,
    paged_cache,
    plain,
)
from tolerances import assert_fp32_close, huginn_depth

from hf_loopspec.generation.history import run_planes
from hf_loopspec.generation.wavefront import WavefrontEngine

STEPS = 6
NEW = 16
LENGTHS = [6, 1, 3]  # left padding: rows of different prompt lengths
INITS = {"zero": {"init_scale": 0.0}, "seeded": {"init_scale": 1.0, "init_seed": 1234}}
MODE_PARAMS = [pytest.param(*m, id=mode_id(*m)) for m in MODES]
# the matrix once with zero initial states, and seeded states (drawn on the host per token: slower) for drafts from
# two steps
GREEDY = [pytest.param(*m, "zero", id=f"{mode_id(*m)}-zero") for m in MODES] + \
    [pytest.param(*m, "seeded", id=f"{mode_id(*m)}-seeded") for m in MODES if m[1] == 2]


def _case(seed: int = 5, damp: float = 0.3):
    model, _ = tiny_huginn(seed=seed, damp=damp)
    ids, mask = left_pad([random_ids(n, VOCAB, seed=40 + i) for i, n in enumerate(LENGTHS)], PAD)
    return model, ids, mask


def _speculative(model, ids, mask, new, mode, d, k, engine, **settings):
    """`generate` on `engine`: "wavefront" or "auto" by name, "lanes" the reference (a debug cache)."""
    cache = paged_cache(model, debug=engine == "lanes", num_steps=STEPS)
    chosen = {} if engine == "lanes" else {"speculative_engine": engine}
    return generate_dict(model, ids, mask, new, cache=cache, num_steps=STEPS, **chosen, **mode_kwargs(mode, d, k),
                         **settings)


def _ar_planes(model) -> list[int]:
    """The planes plain decoding writes: every step's core plane, the prelude plane and the final coda plane."""
    with model.recurrence(num_steps=STEPS):
        layout = model.kv_layout
    return [*range(STEPS), layout.entry_plane, layout.exit_plane(STEPS)]


def _assert_same_planes(model, engine_cache, lanes_cache, d: int) -> None:
    """Every plane the run writes (core, prelude, the coda at d and at num_steps) holds the same positions in both
    caches, with the same KV up to the fp32 rounding of a forward (other row batches round differently)."""
    assert engine_cache.get_seq_length() == lanes_cache.get_seq_length()
    depth = huginn_depth(model.config, STEPS)
    for plane in run_planes(engine_cache.kv_layout, STEPS, d):
        assert engine_cache.lengths(plane) == lanes_cache.lengths(plane), plane
        for s, n in enumerate(lanes_cache.lengths(plane)):
            for layer in range(engine_cache.kv_layout.num_layers):
                for got, want in zip(paged_plane(engine_cache, s, plane, layer, n),
                                     paged_plane(lanes_cache, s, plane, layer, n)):
                    assert_fp32_close(got, want, **depth, msg=lambda m, p=plane, q=s: f"plane {p}, row {q}: {m}")


@pytest.mark.parametrize("mode,d,k,init", GREEDY)
def test_greedy_on_the_engine_equals_plain_and_the_lane_decoders_cache(mode, d, k, init):
    model, ids, mask = _case()
    settings = {"eos_token_id": None, **INITS[init]}
    ref = plain(model, ids, mask, NEW, num_steps=STEPS, **settings)
    out = _speculative(model, ids, mask, NEW, mode, d, k, "wavefront", **settings)
    assert out.speculation.engine == "wavefront"
    assert out.sequences.tolist() == ref.sequences.tolist()
    assert_counter_invariants(out.speculation, [NEW] * len(LENGTHS))
    assert_cache_matches_ar(out.cache, ref.cache, mask, [NEW] * len(LENGTHS), num_layers=2,
                            model_depth=huginn_depth(model.config, STEPS), planes=_ar_planes(model))
    lanes = _speculative(model, ids, mask, NEW, mode, d, k, "lanes", **settings)
    assert lanes.sequences.tolist() == ref.sequences.tolist()
    _assert_same_planes(model, out.cache, lanes.cache, d)


@pytest.mark.parametrize("mode,d,k", [MODE_PARAMS[0], MODE_PARAMS[3]])
def test_eos_with_lanes_in_flight(mode, d, k):
    """An EOS id that the rows generate at different steps: plain's tokens (the finished rows padded), and the cache
    completed as plain decoding's (stop token and pad steps fed) in every plane, as the lane decoder's."""
    model, ids, mask = _case(seed=4, damp=0.1)
    free = plain(model, ids, mask, NEW, num_steps=STEPS, eos_token_id=None, init_scale=0.0)
    eos = int(free.sequences[1, ids.shape[1] + 5])  # a token row 1 generates at its 6th step
    settings = {"eos_token_id": eos, "init_scale": 0.0}
    ref = plain(model, ids, mask, NEW, num_steps=STEPS, **settings)
    assert (ref.sequences[:, ids.shape[1]:] == PAD).any(), "no row stopped early: pick another EOS"
    out = _speculative(model, ids, mask, NEW, mode, d, k, "wavefront", **settings)
    assert out.speculation.engine == "wavefront"
    assert out.sequences.tolist() == ref.sequences.tolist()
    lanes = _speculative(model, ids, mask, NEW, mode, d, k, "lanes", **settings)
    _assert_same_planes(model, out.cache, lanes.cache, d)


@pytest.mark.parametrize("compact", [True, False], ids=["active-rows", "fixed-rows"])
def test_forced_rejections_roll_back_every_plane(compact):
    """Every draft rejected (the override proposes a token the target never picks): the prelude and coda planes
    are rolled back with the core's (I4), so the run's KV equals serial AR's; the engine alone, without
    `complete_cache` (rows hold their committed tokens), with the stages on the active rows (eager on a CPU) and
    on the fixed rows (compiled or CUDA: `Plan.compact`)."""
    model, ids, mask = _case(seed=5, damp=0.1)
    settings = {"num_steps": STEPS, "eos_token_id": None, "init_scale": 0.0}
    ref = plain(model, ids, mask, NEW, **settings)
    generated = ref.sequences[:, ids.shape[1]:]
    override = torch.full((len(ids), ids.shape[1] + NEW), -1)
    for s in range(len(ids)):
        start = int(mask[s].sum())
        override[s, start: start + NEW] = (generated[s] + 1) % VOCAB  # never the target's token
    cache = paged_cache(model, debug=False, num_steps=STEPS)
    with torch.no_grad(), model.recurrence(num_steps=STEPS, init_scale=0.0):
        engine = WavefrontEngine(model, cache, mode="pipeline", draft_loops=2, num_speculative_tokens=1,
                                 input_ids=ids, attention_mask=mask, pad_token_id=PAD, max_length=ids.shape[1] + NEW,
                                 draft_override=override)
        engine.plan = replace(engine.plan, compact=compact)
        result = engine.run()
    assert result.sequences.tolist() == ref.sequences.tolist()
    assert result.stats.rejected > 0 and result.stats.accepted == 0
    assert_cache_matches_ar(cache, ref.cache, mask, [NEW] * len(ids), num_layers=2, completed=False,
                            model_depth=huginn_depth(model.config, STEPS), planes=_ar_planes(model))


def test_compiled_engine_and_second_proposals_are_refused_by_name():
    """Compiling the step and second proposals are not run with stage KV (`limits.stages_problem`): the engine's own
    set-up and `generate` raise a `ValueError` naming the setting (the reference, a debug cache, still runs them)."""
    model, ids, mask = _case()
    with torch.no_grad(), model.recurrence(num_steps=STEPS, init_scale=0.0), \
            pytest.raises(ValueError, match="compile_core on HuginnForCausalLM"):
        WavefrontEngine(model, paged_cache(model, debug=False, num_steps=STEPS), mode="pipeline", draft_loops=1,
                        num_speculative_tokens=1, input_ids=ids, attention_mask=mask, pad_token_id=PAD,
                        max_length=ids.shape[1] + 4, compile_backend="eager")
    for engine in ("wavefront", "auto"):
        with pytest.raises(ValueError, match=f"second_draft_loops={STEPS - 1} on HuginnForCausalLM"):
            _speculative(model, ids, mask, 4, "pipeline", 1, None, engine, second_draft_loops=STEPS - 1, init_scale=0.0)
    out = _speculative(model, ids, mask, 4, "pipeline", 1, None, "lanes", second_draft_loops=STEPS - 1, init_scale=0.0)
    assert out.speculation.engine == "lanes"


@pytest.mark.parametrize("mode,d,k", [MODE_PARAMS[1], MODE_PARAMS[3]])
def test_sampling_on_the_engine(mode, d, k):
    """Lossless sampling through the exit planes on the engine: top_k=1 sampling equals greedy, and a seeded
    sampled run repeats."""
    model, ids, mask = _case(seed=4, damp=0.1)
    settings = {"eos_token_id": None, **INITS["seeded"]}
    ref = plain(model, ids, mask, 12, num_steps=STEPS, **settings)
    greedy_like = _speculative(model, ids, mask, 12, mode, d, k, "wavefront", do_sample=True, top_k=1, **settings)
    assert greedy_like.speculation.engine == "wavefront"
    assert greedy_like.sequences.tolist() == ref.sequences.tolist()
    runs = []
    for _ in range(2):
        torch.manual_seed(7)
        runs.append(_speculative(model, ids, mask, 12, mode, d, k, "wavefront", do_sample=True, temperature=1.5,
                                 **settings).sequences.tolist())
    assert runs[0] == runs[1]


@pytest.mark.parametrize("mode,d,k,settings", [("pipeline", 2, None, "warped")])
def test_joint_distribution_of_two_tokens_equals_plain_sampling(mode, d, k, settings):
    """Speculative sampling on the engine draws two tokens from plain sampling's joint distribution (computed
    exactly from forwards, zero initial states), by a chi-square test (`sampling_utils`)."""
    model, _ = tiny_huginn(seed=3, damp=0.3, vocab_size=SAMPLING_VOCAB, eos_token_id=None)
    with model.recurrence(init_scale=0.0):
        joint = exact_joint(model, PROCESSOR_SETTINGS[settings])
        counts = sample_pairs(model, PROCESSOR_SETTINGS[settings], seed=1, speculative_engine="wavefront",
                              **mode_kwargs(mode, d, k))
    assert chi_square_p_value(counts, joint) > ALPHA
