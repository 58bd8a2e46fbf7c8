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


@pytest.mark.slow
def test_a_compiled_model_is_freed_with_its_last_reference_and_a_copy_compiles_its_own_functions():
    """A copy made after the compiled run has none of the model's compiled functions and compiles its own (the same
    keys, plain's tokens); then the model is freed when its last reference goes, while the copy and its compiled
    functions (for the same code) live on, and the copy is freed with its own last reference."""
    model = tiny_spec_model(3, 2, vocab=VOCAB)  # two loops: less to trace, and freeing does not depend on depth
    ids, mask = left_pad(random_prompts(3, [5, 3], VOCAB))
    expected = plain(model, ids, mask, 6).sequences
    out = speculative(model, ids, mask, 6, "pipeline", compile_core="eager", speculative_engine="wavefront")
    assert out.speculation.engine == "wavefront" and out.sequences.tolist() == expected.tolist()
    assert compiled.compiled_store(model, STORE), "the run compiled nothing: the test would prove nothing"
    twin = copy.deepcopy(model)
    assert not compiled.compiled_store(twin, STORE)
    again = speculative(twin, ids, mask, 6, "pipeline", compile_core="eager", speculative_engine="wavefront")
    assert again.sequences.tolist() == expected.tolist()
    assert compiled.compiled_store(twin, STORE).keys() == compiled.compiled_store(model, STORE).keys()
    assert torch.equal(twin.lm_head.weight, model.lm_head.weight)
    alive = weakref.ref(model)
    del model, out
    gc.collect()
    assert alive() is None, "the model outlived its last reference (its copy's compiled functions hold it?)"
    alive = weakref.ref(twin)
    del twin, again
    gc.collect()
    assert alive() is None
