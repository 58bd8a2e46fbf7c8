"""Pipeline and block speculation for Huginn: fp32 token identity with plain greedy, I1 on, I4 on every plane AR
writes, forced rejection patterns, and call counts at 32 recurrence steps.

Huginn's lanes carry [state | prelude output]; the prelude writes its own KV plane once per token, and the coda a
plane per exit depth (the draft depth and num_steps). Random initial states are keyed by (seed, sequence,
position), so the speculative and plain runs draw the same state for the same token: identity is checked with
init_scale 0 and with seeded init_scale 1. Expectations come from transformers' own loop on a DynamicCache.
"""

from __future__ import annotations

import pytest
import torch
from huginn_utils import PAD, VOCAB, tiny_huginn
from inputs import left_pad, random_ids
from speculative_utils import (
    MODES,
    assert_cache_matches_ar,
    assert_counter_invariants,
    block_calls,
    decode_reference,
    forcing_hook,
    mode_params,
    paged_cache,
    pipeline_calls,
    plain,
    real_tokens,
    speculative,
)
from tolerances import huginn_depth
from transformers import GenerationConfig

from hf_loopspec import PagedLoopCache

STEPS = 6
NEW = 40
# Acceptance of pipeline d=2 drafts of the seed-5 model on the ragged prompts: about 0.15 undamped, 0.7 (seeded
# states) to 1.0 (zero states) at 0.03: long rejection chains / long runs.
DAMPS = (1.0, 0.03)
# Every run: STEPS recurrence steps, no eos (every row generates all its tokens), one of two initial-state draws.
RUN = {"num_steps": STEPS, "eos_token_id": None}
INITS = {"zero": RUN | {"init_scale": 0.0}, "seeded": RUN | {"init_scale": 1.0, "init_seed": 1234}}
# The matrix's settings that draft from two steps, for the tests whose subject is the coda's exit planes.
TWO_STEP_DRAFTS = mode_params(keep=lambda mode, d, k: d == 2)


def prompts_for(batch: str, seed: int) -> list[torch.Tensor]:
    lengths = {"unpadded": [5, 5, 5], "ragged": [6, 1, 3]}[batch]
    return [random_ids(n, VOCAB, seed=100 * seed + i) for i, n in enumerate(lengths)]


def ar_planes(model, num_steps=STEPS) -> list[int]:
    """The planes plain decoding writes: every step's core plane, the prelude plane and the final coda plane."""
    with model.recurrence(num_steps=num_steps):
        layout = model.kv_layout
    return [*range(num_steps), layout.entry_plane, layout.exit_plane(num_steps)]


@pytest.mark.parametrize("init", list(INITS))
@pytest.mark.parametrize("batch", ["unpadded", "ragged"])
@pytest.mark.parametrize("damp", DAMPS)
def test_token_identity_with_plain_greedy(damp, batch, init):
    model, _ = tiny_huginn(seed=5, damp=damp)
    prompts = prompts_for(batch, seed=int(damp * 100))
    ids, mask = left_pad(prompts, PAD)
    ref = plain(model, ids, mask, NEW, **INITS[init])
    for mode, d, k in MODES:
        out = speculative(model, ids, mask, NEW, mode, d, k, debug=True, **INITS[init])
        label = f"{mode} d={d} K={k}"
        assert out.sequences.tolist() == ref.sequences.tolist(), label
        assert_counter_invariants(out.speculation, [NEW] * len(prompts))
        assert_cache_matches_ar(out.cache, ref.cache, mask, [NEW] * len(prompts), num_layers=2,
                                model_depth=huginn_depth(model.config, STEPS), planes=ar_planes(model))


@pytest.fixture(scope="module")
def forced_case():
    """(model, prompts, ids, mask, plain output) of the forced-pattern tests: ragged prompts, seeded states; plain
    greedy decoding runs once for all of them (each only reads it)."""
    model, _ = tiny_huginn(seed=5, damp=0.1)
    prompts = prompts_for("ragged", seed=7)
    ids, mask = left_pad(prompts, PAD)
    return model, prompts, ids, mask, plain(model, ids, mask, NEW, **INITS["seeded"])


@pytest.mark.parametrize("mode,d,k", TWO_STEP_DRAFTS)
@pytest.mark.parametrize("pattern", ["all_rejected", "alternating", "two_rejections_in_a_row"])
def test_forced_rejections_keep_tokens_and_kv(mode, d, k, pattern, forced_case):
    """Forced rejection patterns roll back every plane (core, prelude, both coda depths) with I1 checked on every
    read; tokens and the planes AR writes equal serial AR."""
    accept = {"all_rejected": lambda s, i: False, "alternating": lambda s, i: i % 2 == 0,
              "two_rejections_in_a_row": lambda s, i: i % 4 < 2}[pattern]
    model, prompts, ids, mask, ref = forced_case
    settings = INITS["seeded"]
    reference = [real_tokens(ref.sequences, mask, s) for s in range(len(prompts))]
    hook = forcing_hook(reference, [len(p) for p in prompts], accept, model.config.vocab_size)
    out = speculative(model, ids, mask, NEW, mode, d, k, debug=True, draft_hook=hook, **settings)
    assert out.sequences.tolist() == ref.sequences.tolist()
    assert out.speculation.rejected > 0
    assert_cache_matches_ar(out.cache, ref.cache, mask, [NEW] * len(prompts), num_layers=2,
                            model_depth=huginn_depth(model.config, STEPS), planes=ar_planes(model))
    draft_plane = out.cache.kv_layout.exit_plane(d)
    for s, prompt in enumerate(prompts):  # the draft-depth coda plane holds every position AR feeds back
        assert out.cache.length(s, draft_plane) == len(prompt) + NEW - 1


CALLS_NEW = 6
CALLS_SETTINGS = {"num_steps": 32, "eos_token_id": None, "init_scale": 0.0}


@pytest.fixture(scope="module")
def calls_case():
    """(model, prompts, ids, mask, plain output) of the call-count tests: one prompt at 32 steps; plain greedy
    decoding runs once for all of them (each only reads it)."""
    model, _ = tiny_huginn(seed=2, damp=0.1)
    prompts = prompts_for("unpadded", seed=1)[:1]
    ids, mask = left_pad(prompts, PAD)
    return model, prompts, ids, mask, plain(model, ids, mask, CALLS_NEW, **CALLS_SETTINGS)


@pytest.mark.parametrize("accept", [True, False], ids=["all_accepted", "all_rejected"])
@pytest.mark.parametrize("mode,d,k", mode_params([(mode, 4 * d, k) for mode, d, k in MODES]))  # depths x 4
def test_core_calls_at_32_steps(mode, d, k, accept, calls_case):
    """draft_loops counts recurrence steps: at 32 steps the core-call counts follow the closed forms of
    docs/design.md, "Cost model", with U = 32 (AR: 32 calls per token)."""
    model, prompts, ids, mask, ref = calls_case
    n, settings = CALLS_NEW, CALLS_SETTINGS
    reference = [real_tokens(ref.sequences, mask, 0)]
    hook = forcing_hook(reference, [len(prompts[0])], lambda s, i: accept, model.config.vocab_size)
    out = speculative(model, ids, mask, n, mode, d, k, draft_hook=hook, **settings)
    assert out.sequences.tolist() == ref.sequences.tolist()
    expected = pipeline_calls(n, 32, d, accept) if mode == "pipeline" else block_calls(n, 32, d, k, accept)
    assert out.speculation.core_calls == expected


@pytest.mark.parametrize("d", [0, 6, 7])
def test_draft_loops_must_be_below_num_steps(d):
    model, _ = tiny_huginn()
    ids = random_ids((1, 3), VOCAB)
    with pytest.raises(ValueError, match="draft_loops"):
        model.generate(ids, max_new_tokens=2, speculative_mode="block", draft_loops=d, num_steps=6)


def test_pipeline_needs_draft_loops_dividing_num_steps():
    model, _ = tiny_huginn()
    with pytest.raises(ValueError, match="draft_loops"):
        model.generate(random_ids((1, 3), VOCAB), max_new_tokens=2, speculative_mode="pipeline", draft_loops=4,
                       num_steps=6)


def test_cache_made_for_other_num_steps_raises():
    model, _ = tiny_huginn()
    ids = random_ids((1, 3), VOCAB)
    cache = PagedLoopCache(model.kv_layout)  # made for mean_recurrence = 4 steps
    with pytest.raises(ValueError, match="num_steps"):
        model.generate(ids, max_new_tokens=2, speculative_mode="pipeline", draft_loops=1, num_steps=6, cache=cache)


@pytest.mark.parametrize("mode,d,k", TWO_STEP_DRAFTS)
def test_sampling_paths_with_coda_kv(mode, d, k):
    """Lossless speculative sampling through the exit planes: top_k=1 sampling equals greedy, and a seeded sampled
    run repeats (the distribution itself is tested model-independently in test_speculative_sampling.py)."""
    model, _ = tiny_huginn(seed=4, damp=0.1)
    ids, mask = left_pad(prompts_for("ragged", seed=3), PAD)
    settings = INITS["seeded"]
    ref = plain(model, ids, mask, 12, **settings)
    greedy_like = speculative(model, ids, mask, 12, mode, d, k, debug=True, do_sample=True, top_k=1, **settings)
    assert greedy_like.sequences.tolist() == ref.sequences.tolist()
    runs = []
    for _ in range(2):
        torch.manual_seed(7)
        runs.append(speculative(model, ids, mask, 12, mode, d, k, debug=True, do_sample=True, temperature=1.5,
                                **settings).sequences.tolist())
    assert runs[0] == runs[1]


def test_second_proposals():
    """Second proposals on the reference (pipeline d=1, d2=2): the coda writes a third exit plane (depth d2) and
    sibling branches own private prelude, core and coda tables; tokens equal plain greedy with I1 on, and every plane
    AR writes equals AR's (I4)."""
    model, _ = tiny_huginn(seed=5, damp=1.0)
    ids, mask = left_pad(prompts_for("ragged", seed=100), PAD)
    ref = plain(model, ids, mask, 24, **INITS["seeded"])
    # INITS["seeded"], on the reference: the engine runs d2 >= U - d only (test_wavefront_huginn.py runs those)
    with model.recurrence(num_steps=STEPS, init_scale=1.0, init_seed=1234):
        out = decode_reference(model, ids, mask, 24, "pipeline", 1, second_draft_loops=2,
                               cache=paged_cache(model, True, STEPS))
    assert out.sequences.tolist() == ref.sequences.tolist()
    assert out.speculation.second_drafts > 0 and out.speculation.second_accepted > 0
    assert_counter_invariants(out.speculation, [24] * 3)
    assert_cache_matches_ar(out.cache, ref.cache, mask, [24] * 3, num_layers=2,
                            model_depth=huginn_depth(model.config, STEPS), planes=ar_planes(model))
    assert out.cache.num_sequences == 3


@pytest.mark.parametrize("spec", [{}, {"speculative_mode": "pipeline", "draft_loops": 1}], ids=["plain", "pipeline"])
def test_recurrence_settings_in_a_generation_config_hold(spec):
    """num_steps, init_scale and init_seed in a GenerationConfig (passed, or the model's own, as a checkpoint's
    generation_config.json sets them) decode as the same keyword arguments, and a keyword argument wins over the
    config (they were ignored: the default steps and a fresh random seed decoded)."""
    model, _ = tiny_huginn(seed=5, damp=0.3)
    ids = random_ids(5, VOCAB, seed=9)[None]
    call = {"max_new_tokens": 8, "do_sample": False, "eos_token_id": [model.config.eos_token_id], "pad_token_id": PAD}
    settings = {"num_steps": 3, "init_scale": 1.0, "init_seed": 11}
    expected = model.generate(ids, **call, **settings)
    assert not torch.equal(expected, model.generate(ids, **call, **{**settings, "init_seed": 12}))  # seeds matter
    assert not torch.equal(expected, model.generate(ids, **call, **{**settings, "num_steps": 2}))  # and steps
    config = GenerationConfig(**call, **settings, **spec)
    assert torch.equal(model.generate(ids, generation_config=config), expected)
    assert torch.equal(model.generate(ids, config), expected)  # given positionally
    assert torch.equal(model.generate(ids, generation_config=config, num_steps=2),
                       model.generate(ids, **call, **{**settings, "num_steps": 2}))
    for key, value in {**settings, **spec}.items():  # as from_pretrained reads a generation_config.json with them
        setattr(model.generation_config, key, value)
    assert torch.equal(model.generate(ids, **call), expected)


@pytest.mark.parametrize("variant, overrides", [("retrofitted", {}), ("huginn", {"n_layers_in_recurrent_block": 4})])
@pytest.mark.parametrize("mode", ["pipeline", "block"])
def test_a_plain_turns_cache_continues_when_prelude_or_coda_have_fewer_layers(variant, overrides, mode):
    """A prelude or coda with fewer layers than the recurrent block (the retrofitted models; huginn-0125's 2/4/2)
    leaves a plain call's DynamicCache with fewer layers than planes x layers: a speculative next turn continues it
    and equals one plain call (`to_paged` read past its layers: IndexError)."""
    model, _ = tiny_huginn(variant, seed=0, **overrides)
    settings = {"do_sample": False, "eos_token_id": None, "pad_token_id": PAD, "init_seed": 1}
    ids = random_ids((1, 5), VOCAB, seed=41)
    first = model.generate(ids, max_new_tokens=4, speculative_mode=None, return_dict_in_generate=True, **settings)
    turn = torch.cat([first.sequences, random_ids((1, 2), VOCAB, seed=42)], 1)
    expected = model.generate(turn, max_new_tokens=4, speculative_mode=None, **settings)
    out = model.generate(turn, cache=first.past_key_values, max_new_tokens=4, speculative_mode=mode, **settings)
    assert torch.equal(out, expected)


def test_auto_calibrates_under_the_calls_recurrence_settings(tmp_path, monkeypatch):
    """`auto.calibrate` (the command line measures auto's costs before its timed run) on a model whose initial
    states need a seed: it runs under the call's recurrence settings, as `generate` does (it raised "init_scale > 0
    needs a seed", so `hf-loopspec generate` failed on every Huginn checkpoint on a machine's first auto run)."""
    from hf_loopspec.generation import auto, auto_cache
    from hf_loopspec.generation.auto_costs import set_costs

    monkeypatch.setenv(auto_cache.CACHE_ENV, str(tmp_path))
    model, _ = tiny_huginn(seed=0)
    set_costs(model, None)
    table = auto.calibrate(model, 1, {"num_steps": 6})
    assert table.plain_step > 0 and all(cost > 0 for cost in table.cycle.values())
    assert {candidate.draft_loops for candidate in table.cycle} <= {1, 2, 3, 4, 5}  # the candidates of 6 steps
