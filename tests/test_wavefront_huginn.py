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
from transformers import GenerationConfig

from hf_loopspec.generation.history import run_planes
from hf_loopspec.generation.wavefront import WavefrontEngine
from hf_loopspec.generation.wavefront import engine as engine_module

STEPS = 6
NEW = 16
LENGTHS = [6, 1, 3]  # left padding: rows of different prompt lengths
INITS = {"zero": {"init_scale": 0.0}, "seeded": {"init_scale": 1.0, "init_seed": 1234}}
ONE_LAYER = {"n_layers_in_prelude": 1, "n_layers_in_recurrent_block": 1, "n_layers_in_coda": 1}
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


def _assert_same_planes(model, engine_cache, lanes_cache, *draft_depths: int) -> None:
    """Every plane the run writes (core, prelude, the coda at num_steps and at the `draft_depths`: d, and d2 with second
    proposals) holds the same positions in both caches, with the same KV up to the fp32 rounding of a forward (other
    row batches round differently)."""
    assert engine_cache.get_seq_length() == lanes_cache.get_seq_length()
    depth = huginn_depth(model.config, STEPS)
    for plane in run_planes(engine_cache.kv_layout, STEPS, *draft_depths):
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


def test_step_compiles_whole_and_seeds_are_data(monkeypatch):
    """`torch.compile(step, fullgraph=True)` (a graph break raises) traces the Huginn step with second proposals (the
    sibling's prelude row, a chosen sibling's coda row): it reads no recurrence settings (the layout is
    `Plan.layout`) and draws nothing (the seeded initial states are drawn at set-up: `WavefrontState.init_states`).
    Two graphs (the decode step, and one cycle of the calls that carry the prompt rows); plain's tokens for the seed
    and the eager engine's counters; a call with another seed compiles nothing (the states are data) and gives plain's
    tokens for its seed. One layer per stage and one cycle per compiled call: the same code, faster to trace."""
    monkeypatch.setattr(engine_module, "CYCLES_PER_CALL", 1)
    model, _ = tiny_huginn(seed=5, damp=0.3, **ONE_LAYER)
    _, ids, mask = _case()
    new, second = 8, {"second_draft_loops": 4}
    for seed, graphs in ((1234, 2), (99, 0)):
        settings = {"eos_token_id": None, "init_scale": 1.0, "init_seed": seed}
        ref = plain(model, ids, mask, new, num_steps=STEPS, **settings)
        eager = _speculative(model, ids, mask, new, "pipeline", 2, None, "wavefront", **settings, **second)
        torch._dynamo.utils.counters.clear()
        compiled = _speculative(model, ids, mask, new, "pipeline", 2, None, "wavefront", compile_core="eager",
                                **settings, **second)
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
        assert compiled.speculation.engine == "wavefront"
        assert compiled.sequences.tolist() == ref.sequences.tolist() == eager.sequences.tolist()
        assert compiled.speculation.to_dict() == eager.speculation.to_dict()
        assert compiled.speculation.second_drafts > 0


def test_compiled_steps_are_never_shared_across_recurrence_settings():
    """The compiled step functions kept beside the model are keyed by the plan, which holds the call's recurrence
    settings (`Plan.step_settings`; num_steps also through the loop count and the layout): calls with another
    init_scale or num_steps get functions of their own, calls with another seed share one (it is data of the state)."""
    model, ids, mask = _case()

    def step_function(num_steps=STEPS, **settings):
        with torch.no_grad(), model.recurrence(num_steps=num_steps, **settings):
            engine = WavefrontEngine(model, paged_cache(model, debug=False, num_steps=num_steps), mode="pipeline",
                                     draft_loops=2, num_speculative_tokens=1, input_ids=ids, attention_mask=mask,
                                     pad_token_id=PAD, max_length=ids.shape[1] + 4, compile_backend="eager")
            return engine.build_step(engine.plan, 1, prefill=False)

    first = step_function(init_scale=1.0, init_seed=1)
    assert step_function(init_scale=1.0, init_seed=2) is first
    others = [step_function(init_scale=0.5, init_seed=1), step_function(init_scale=0.0),
              step_function(num_steps=STEPS - 1, init_scale=1.0, init_seed=1)]
    assert all(other is not first for other in others) and len({id(other) for other in others}) == len(others)


SECOND = [(2, 4), (3, 5)]  # (d, d2) on STEPS = 6 steps, U - d2 <= d; (2, 4): a chosen sibling drafts at once


@pytest.mark.parametrize("d,d2", SECOND, ids=[f"d{d}-d2{d2}" for d, d2 in SECOND])
def test_second_proposals_equal_plain_and_the_reference(d, d2):
    """Second proposals on the engine: a sibling embeds through the prelude on its private entry row, runs its steps
    on its private core rows, and when chosen has them copied into the main tables (`sibling.promote`). Seeded
    states; the tokens equal plain greedy's, the counters the reference's (the same cycles), every plane AR writes
    equals AR's (I4), and every plane of the run (the coda at d and d2 too) equals the reference's."""
    model, ids, mask = _case(seed=5, damp=1.0)
    settings = {"eos_token_id": None, **INITS["seeded"]}
    ref = plain(model, ids, mask, NEW, num_steps=STEPS, **settings)
    runs = [_speculative(model, ids, mask, NEW, "pipeline", d, None, engine, second_draft_loops=d2, **settings)
            for engine in ("wavefront", "lanes")]
    out, lanes = runs
    assert out.speculation.engine == "wavefront"
    assert out.sequences.tolist() == ref.sequences.tolist() == lanes.sequences.tolist()
    counters = [{k: v for k, v in run.speculation.to_dict().items() if k not in ("engine", "cache_fill_calls")}
                for run in runs]
    assert counters[0] == counters[1]
    stats = out.speculation
    assert stats.second_accepted > 0 and stats.second_drafts > stats.second_accepted and stats.rejected > 0
    assert_counter_invariants(stats, [NEW] * len(LENGTHS))
    assert_cache_matches_ar(out.cache, ref.cache, mask, [NEW] * len(LENGTHS), num_layers=2,
                            model_depth=huginn_depth(model.config, STEPS), planes=_ar_planes(model))
    _assert_same_planes(model, out.cache, lanes.cache, d, d2)


@pytest.mark.parametrize("mode,d,k,second", [(*MODES[1], {}), (*MODES[3], {}), (*MODES[1], {"second_draft_loops": 4})],
                         ids=[mode_id(*MODES[1]), mode_id(*MODES[3]), f"{mode_id(*MODES[1])}-d2-4"])
def test_sampling_on_the_engine(mode, d, k, second):
    """Lossless sampling through the exit planes on the engine (with second proposals too: two candidates, the
    second drawn at depth d2 through its coda plane): top_k=1 sampling equals greedy, and a seeded sampled run
    repeats."""
    model, ids, mask = _case(seed=4, damp=0.1)
    settings = {"eos_token_id": None, **INITS["seeded"]}
    ref = plain(model, ids, mask, 12, num_steps=STEPS, **settings)
    settings |= second
    greedy_like = _speculative(model, ids, mask, 12, mode, d, k, "wavefront", do_sample=True, top_k=1, **settings)
    assert greedy_like.speculation.engine == "wavefront"
    assert greedy_like.sequences.tolist() == ref.sequences.tolist()
    runs = []
    for _ in range(2):
        torch.manual_seed(7)
        runs.append(_speculative(model, ids, mask, 12, mode, d, k, "wavefront", do_sample=True, temperature=1.5,
                                 **settings))
    assert runs[0].sequences.tolist() == runs[1].sequences.tolist()
    assert runs[0].speculation.second_drafts > 0 or not second


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


@pytest.mark.parametrize("stages", [{"n_layers_in_prelude": 0}, {"n_layers_in_coda": 0},
                                    {"n_layers_in_prelude": 0, "n_layers_in_coda": 0}],
                         ids=["no-prelude", "no-coda", "neither"])
@pytest.mark.parametrize("mode,d,k", MODE_PARAMS)
def test_a_model_without_a_prelude_or_a_coda_decodes_as_plain(stages, mode, d, k):
    """A config without a prelude or without a coda (no entry or exit plane) gives plain's tokens in every mode and
    in continuous batching (without a coda, the head was called without the positions and attention it required:
    a TypeError in the speculative modes and in every continuous batching request)."""
    model, _ = tiny_huginn(seed=5, damp=0.3, **stages)
    ids, mask = left_pad([random_ids(n, VOCAB, seed=40 + i) for i, n in enumerate(LENGTHS)], PAD)
    settings = {"num_steps": 4, **INITS["seeded"]}
    ref = plain(model, ids, mask, NEW, **settings)
    out = generate_dict(model, ids, mask, NEW, **mode_kwargs(mode, d, k), **settings)
    assert out.sequences.tolist() == ref.sequences.tolist()
    if (mode, d) != MODES[0][:2]:
        return
    prompt = random_ids(5, VOCAB, seed=44).tolist()
    alone = plain(model, torch.tensor([prompt]), torch.ones(1, 5, dtype=torch.long), NEW, **settings)
    results = model.generate_batch([prompt], generation_config=GenerationConfig(
        max_new_tokens=NEW, do_sample=False, pad_token_id=PAD, speculative_mode=mode, draft_loops=d, **settings))
    [result] = results.values()
    assert result.error is None and list(result.generated_tokens) == alone.sequences[0, 5:].tolist()
