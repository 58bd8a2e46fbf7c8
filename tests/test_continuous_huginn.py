"""Continuous batching on Huginn (`generation.continuous.huginn`): the manager's recurrence settings (num_steps,
init_scale) hold for every request, and each request's initial states are those plain `generate` of it alone draws.

The reference of every request is plain greedy `generate` of that request alone (fp32) with the same recurrence
settings and init seed: the manager's tokens must equal it whatever slot the request lands in and whenever it
arrives, from zero initial states (deterministic without a seed) and from seeded ones.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from continuous_utils import alone, batching, collect, generation_config, prompts, starting
from huginn_utils import tiny_huginn
from speculative_utils import named_modes
from transformers import ContinuousBatchingConfig
from transformers.generation.continuous_batching import RequestStatus

from hf_loopspec.generation.continuous.settings import manager_settings
from hf_loopspec.generation.continuous.slots import SlotBatch

SETTINGS = named_modes()  # plain, then one pipeline and one block setting
ZERO = {"init_scale": 0.0}  # zero initial states: no seed, deterministic
SEEDED = {"init_scale": 1.0, "init_seed": 77}
# (decoding setting, recurrence settings of the generation config): each mode once, num_steps off the default once
CASES = {"plain-zero": ("plain", ZERO), "pipeline-seeded-3-steps": ("pipeline-d1", {**SEEDED, "num_steps": 3}),
         "block-seeded": ("block-d2-K2", SEEDED)}


@pytest.fixture(scope="module")
def model():
    """A tiny fp32 Huginn whose recurrence steps agree often enough for drafts to be accepted."""
    return tiny_huginn(seed=5, damp=0.3)[0]


@pytest.fixture
def started(model):
    """A function that starts a manager (stopped at the end of the test)."""
    yield from starting(model, lambda config, cb_config=None: (config, cb_config or batching()))


@pytest.mark.parametrize("case", CASES)
def test_generate_batch_equals_each_request_alone(model, case):
    """More requests than slots, ragged prompts: every request's tokens are plain decoding's of it alone under the
    generation config's recurrence settings, whichever slot it takes."""
    name, recurrence = CASES[case]
    inputs = prompts(1, [5, 1, 9, 3, 12])
    config = generation_config(SETTINGS[name], **recurrence)
    out = model.generate_batch(inputs, generation_config=config, continuous_batching_config=batching())
    expected = [alone(model, p, 8, **recurrence) for p in inputs]
    assert [r.status for r in out.values()] == [RequestStatus.FINISHED] * len(inputs)
    assert [r.generated_tokens for r in out.values()] == expected
    if "num_steps" in recurrence:  # the setting reaches the manager: the default depth decodes otherwise
        assert expected != [alone(model, p, 8, **{**recurrence, "num_steps": None}) for p in inputs]


def test_the_manager_runs_no_entry_stage_on_its_placeholder_prompts(model, monkeypatch):
    """The engine is built with B placeholder prompts of a slot's C positions, reset before any request: running
    Huginn's entry stage over them took a `[B, 1, C, C]` mask (a slot of 65536 positions: an allocation of tens of
    GiB, `transformers serve --continuous-batching` on such a checkpoint). Requests still decode as alone."""
    from hf_loopspec.generation.wavefront import stages

    widths = []
    original = stages.embed_rows
    monkeypatch.setattr(stages, "embed_rows", lambda *args: widths.append(args[3].shape) or original(*args))
    inputs = prompts(3, [4, 9])
    config = generation_config(SETTINGS["pipeline-d1"], **SEEDED)
    out = model.generate_batch(inputs, generation_config=config, continuous_batching_config=batching(positions=256))
    assert widths and all(width <= len(inputs[1]) for _, width in widths), widths  # the requests' own rows only
    assert [r.generated_tokens for r in out.values()] == [alone(model, p, 8, **SEEDED) for p in inputs]


@pytest.mark.parametrize("name", ["pipeline-d1"])
def test_arrivals_with_their_own_seeds_while_a_request_streams(model, started, name):
    """A long streaming request decodes from the manager's seed; others arrive while it streams, more than the free
    slots, some with their own `init_seed`: each equals plain decoding of it alone with its seed."""
    manager = started(generation_config(SETTINGS[name], **SEEDED))
    first, *later = prompts(2, [4, 7, 2, 10])
    long_id = manager.add_request(first, max_new_tokens=20, streaming=True)
    stream = manager.request_id_iter(long_id)
    assert next(stream).status == RequestStatus.DECODING
    seeds = (5, None, 6)
    ids = [manager.add_request(p, max_new_tokens=n, **({} if s is None else {"init_seed": s}))
           for p, n, s in zip(later, (6, 9, 3), seeds)]
    final = list(stream)[-1]
    results = collect(manager, ids)
    expected = [alone(model, p, n, init_scale=1.0, init_seed=s or SEEDED["init_seed"])
                for p, n, s in zip(later, (6, 9, 3), seeds)]
    assert final.generated_tokens == alone(model, first, 20, **SEEDED)
    assert [results[i].generated_tokens for i in ids] == expected
    assert expected[0] != alone(model, later[0], 6, **SEEDED)  # a request's own seed changes its tokens


def test_a_recurrence_block_open_at_init_holds_for_every_request(model, started):
    """Settings of a `model.recurrence` block open where the manager is built hold for its life (in its own
    thread), its seed included, as for every `generate` call inside that block."""
    with model.recurrence(num_steps=3, init_scale=1.0) as block:
        manager = started(generation_config(SETTINGS["plain"]))
    inputs = prompts(3, [6, 2, 4])
    ids = [manager.add_request(p, max_new_tokens=6) for p in inputs]
    results = collect(manager, ids)
    assert [results[i].generated_tokens for i in ids] == [
        alone(model, p, 6, num_steps=3, init_scale=1.0, init_seed=block.init_seed) for p in inputs]


def test_a_kept_manager_serves_only_the_recurrence_it_was_built_with(model):
    """`persistent_manager=True`: a later call under the same `model.recurrence` block reuses the kept manager (plain
    decoding's tokens); under another block, or none, it raises instead of decoding the old settings' tokens."""
    inputs = prompts(6, [5, 3])
    config = generation_config(SETTINGS["pipeline-d1"])
    run = lambda: [r.generated_tokens for r in model.generate_batch(  # noqa: E731
        inputs, generation_config=config, continuous_batching_config=batching(), persistent_manager=True).values()]
    try:
        with model.recurrence(num_steps=3, init_scale=0.0):
            first = run()
            assert run() == first == [alone(model, p, 8, num_steps=3, **ZERO) for p in inputs]
        with model.recurrence(num_steps=4, init_scale=0.0), pytest.raises(ValueError, match="num_steps=4"):
            run()
        with model.recurrence(num_steps=3, init_scale=0.0, init_seed=9):  # zero states use no seed: reused
            assert run() == first
        with pytest.raises(ValueError, match="init_scale=1.0"):
            run()
    finally:
        model.destroy_cached_continuous_batching_manager()
    try:  # blocks that draw their own seeds: the message says to give one
        with model.recurrence(num_steps=3):
            run()
        with model.recurrence(num_steps=3), pytest.raises(ValueError, match="Only the seed differs"):
            run()
    finally:
        model.destroy_cached_continuous_batching_manager()


def test_a_kept_manager_built_from_the_config_serves_inside_an_equal_block():
    """A manager whose generation config fixes the recurrence (num_steps 3, a seed) is the same manager inside a
    block of those settings and after an edit of the default it never reads (`mean_recurrence`): its kept-manager
    check took the loop count of whatever block was open, and refused, saying the model had changed."""
    model = tiny_huginn(seed=5, damp=0.3)[0]
    inputs = prompts(6, [5, 3])
    config = generation_config(SETTINGS["pipeline-d1"], num_steps=3, **SEEDED)
    run = lambda: [r.generated_tokens for r in model.generate_batch(  # noqa: E731
        inputs, generation_config=config, continuous_batching_config=batching(), persistent_manager=True).values()]
    try:
        first = run()
        assert first == [alone(model, p, 8, num_steps=3, **SEEDED) for p in inputs]
        with model.recurrence(num_steps=3, init_seed=77):
            assert run() == first
        model.config.mean_recurrence += 2
        assert run() == first
    finally:
        model.destroy_cached_continuous_batching_manager()


def test_an_open_block_decides_over_the_models_generation_config_as_in_generate():
    """A manager's recurrence settings follow `generate`'s order: a passed config's, else the block open where it is
    built, else the model's generation config's (the model's config came before the block, so a model loaded with
    `num_steps=3` decoded 3 steps inside `recurrence(num_steps=2)`)."""
    model = tiny_huginn(seed=5, damp=0.3)[0]
    model.generation_config.num_steps, model.generation_config.init_scale = 3, 0.0
    inputs = prompts(6, [5, 3])
    expected = {steps: [alone(model, p, 8, num_steps=steps, init_scale=0.0) for p in inputs] for steps in (2, 3)}
    assert expected[2] != expected[3]
    run = lambda config: [r.generated_tokens for r in model.generate_batch(  # noqa: E731
        inputs, generation_config=config, continuous_batching_config=batching(), max_new_tokens=8).values()]
    with model.recurrence(num_steps=2):
        assert run(None) == expected[2]
        assert run(generation_config(SETTINGS["plain"])) == expected[2]
        assert run(generation_config(SETTINGS["pipeline-d1"], num_steps=3)) == expected[3]
    assert run(None) == expected[3]


def test_a_kept_manager_built_with_numpy_recurrence_settings_serves_again():
    """numpy recurrence settings are read as Python numbers (the kept manager's settings held np.int64 steps, and its
    config failed transformers' JSON comparison on the next call)."""
    model = tiny_huginn(seed=5, damp=0.3)[0]
    inputs = prompts(6, [5, 3])
    config = generation_config(SETTINGS["pipeline-d1"], num_steps=np.int64(3), init_scale=np.float64(0.0))
    expected = [alone(model, p, 8, num_steps=3, init_scale=0.0) for p in inputs]
    try:
        for _ in range(2):
            out = model.generate_batch(inputs, generation_config=config, continuous_batching_config=batching(),
                                       persistent_manager=True)
            assert [r.generated_tokens for r in out.values()] == expected
        recurrence = model._cached_continuous_batching_manager.settings.recurrence
        assert type(recurrence.num_steps) is int and type(recurrence.init_scale) is float
    finally:
        model.destroy_cached_continuous_batching_manager()


def test_num_steps_whose_kv_cannot_fit_are_refused_by_name():
    """As `generate` refuses them: a manager built for 10**12 steps raised a bare MemoryError from filling its cache's
    per-plane records (or, at 10**9, tried to build lists of billions of entries)."""
    model = tiny_huginn(seed=5, damp=0.3)[0]
    with pytest.raises(ValueError, match=r"num_steps=1000000000000: one token's KV over its 2000000000001 planes"):
        model.generate_batch(prompts(6, [5]), generation_config=generation_config(SETTINGS["plain"], num_steps=10**12),
                             continuous_batching_config=batching())


def test_unseeded_requests_draw_their_own_seed(model, started):
    """init_scale > 0 and no seed: each request draws one at admission, as each `generate` call does, here from the
    continuous batching config's seed (its draws in admission order), so the same prompt twice decodes two ways."""
    cb_config = ContinuousBatchingConfig(max_requests_per_batch=1, max_blocks_per_request=4, page_size=16, seed=3)
    manager = started(generation_config(SETTINGS["pipeline-d1"], init_scale=1.0), cb_config)
    prompt = prompts(4, [5])[0]
    ids = [manager.add_request(prompt, max_new_tokens=8) for _ in range(2)]
    results = collect(manager, ids)
    draws = torch.Generator().manual_seed(3)
    expected = [alone(model, prompt, 8, init_scale=1.0, init_seed=int(torch.randint(2**62, (), generator=draws)))
                for _ in ids]
    assert [results[i].generated_tokens for i in ids] == expected
    assert expected[0] != expected[1]


def test_bad_recurrence_settings_fail_loudly(model, started):
    """A bad recurrence setting of the generation config raises at init; a bad `init_seed` (negative, or past a
    generator's 64 bits) fails its request alone, and `init_seed=None` is the manager's seed, as no key."""
    with pytest.raises(ValueError, match=r"num_steps=0 must be an integer >= 1"):
        model.init_continuous_batching(generation_config(SETTINGS["plain"], num_steps=0), batching())
    manager = started(generation_config(SETTINGS["plain"], **ZERO))
    good = prompts(5, [4])[0]
    ids = [manager.add_request(good, init_seed=-1), manager.add_request(good, init_seed=2**64),
           manager.add_request(good, max_new_tokens=5), manager.add_request(good, max_new_tokens=5, init_seed=None)]
    results = collect(manager, ids)
    assert [results[i].status for i in ids[:2]] == [RequestStatus.FAILED] * 2
    assert "init_seed=-1: give an integer in [0, 2**64), or None" in results[ids[0]].error
    assert "init_seed=18446744073709551616: give an integer" in results[ids[1]].error
    assert results[ids[2]].generated_tokens == results[ids[3]].generated_tokens == alone(model, good, 5, **ZERO)


def test_a_new_owner_starts_from_empty_planes(model):
    """A slot that changes owner starts from KV length 0 on every plane, the prelude's entry plane and the coda's
    exit planes included: after admission only the new prompt's entry-plane KV is held."""
    slots = SlotBatch(model, manager_settings(model, generation_config(SETTINGS["plain"], **ZERO), batching(1)))
    long, short = prompts(6, [12, 3])
    slots.admit(0, long, 6, [], None)
    while not slots.read_back()[1][0]:
        slots.run(slots.engine.read_every)
    plan = slots.engine.plan
    layout, held = plan.layout, slots.state.kv_len[0].tolist()
    assert min(held[layout.entry_plane], held[layout.exit_plane(plan.num_loops)]) > len(short)  # the first owner's
    slots.admit(0, short, 4, [], None)
    expected = [0] * layout.num_planes
    expected[layout.entry_plane] = len(short)
    assert slots.state.kv_len[0].tolist() == expected
