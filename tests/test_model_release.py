"""A model compiled by `generate(compile_core=...)` is freed when its last reference goes: no cache of the package
(nor a torch cache the package feeds, such as dynamo's store of every backend it was given) keeps it alive. Its
compiled functions (the wavefront engine's steps) live on the model itself, so copies of the model get none of them.

Checked with the `eager` backend (as the engine's compile tests): dynamo's tracing and caches, without inductor's
code generation, which takes minutes on a small CPU; the references the package creates are the same for every
backend. One cycle per compiled call (`one_cycle_per_call`): the references do not depend on how many cycles a
compiled function unrolls, the tracing time does."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from inputs import left_pad, random_prompts
from speculative_utils import plain, speculative, tiny_spec_model

from hf_loopspec.generation import compiled
from hf_loopspec.generation.wavefront import compiling
from hf_loopspec.generation.wavefront import engine as engine_module

VOCAB = 96
STORE = compiling.STORE  # where the engine keeps its compiled functions


@pytest.fixture(autouse=True)
def one_cycle_per_call(monkeypatch):
    """Compiled runs of this module unroll one cycle per call of the step function."""
    monkeypatch.setattr(engine_module, "CYCLES_PER_CALL", 1)


def compiled_run(backend: str, seed: int = 3):
    """(model, its output, the expected tokens): a tiny model decoded with `compile_core=backend`."""
    model = tiny_spec_model(seed, vocab=VOCAB)
    ids, mask = left_pad(random_prompts(seed, [5, 3], VOCAB))
    out = speculative(model, ids, mask, 6, "pipeline", compile_core=backend, speculative_engine="wavefront")
    return model, out, plain(model, ids, mask, 6).sequences


def test_a_compiled_model_is_freed_with_its_last_reference():
    model, out, expected = compiled_run("eager")
    assert out.speculation.engine == "wavefront" and out.sequences.tolist() == expected.tolist()
    assert compiled.compiled_store(model, STORE), "the run compiled nothing: the test would prove nothing"
    alive = weakref.ref(model)
    del model, out
    gc.collect()
    assert alive() is None


def test_a_copy_of_a_compiled_model_compiles_its_own_functions():
    model, _, expected = compiled_run("eager", seed=4)
    twin = copy.deepcopy(model)
    assert not compiled.compiled_store(twin, STORE)
    ids, mask = left_pad(random_prompts(4, [5, 3], VOCAB))
    again = speculative(twin, ids, mask, 6, "pipeline", compile_core="eager", speculative_engine="wavefront")
    assert again.sequences.tolist() == expected.tolist()
    assert compiled.compiled_store(twin, STORE).keys() == compiled.compiled_store(model, STORE).keys()
    assert torch.equal(twin.lm_head.weight, model.lm_head.weight)
