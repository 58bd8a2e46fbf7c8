"""A model compiled by `generate(compile_core=...)` is freed when its last reference goes: no cache of the package
(nor a torch cache the package feeds, such as dynamo's store of every backend it was given) keeps it alive, on both
engines. Its compiled functions live on the model itself, so copies of the model get none of them.

Checked with the `aot_eager` (lane decoder, as its compile tests) and `eager` (wavefront engine, as its compile tests)
backends: dynamo's tracing and caches, without inductor's code generation, which takes minutes on a small CPU; the
references the package creates are the same for every backend."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from inputs import left_pad, random_prompts
from speculative_utils import plain, speculative, tiny_spec_model

from hf_loopspec.generation import compiled, stages
from hf_loopspec.generation.wavefront import engine as wavefront_engine

VOCAB = 96
STORES = {"lanes": stages.STORE, "wavefront": wavefront_engine.STORE}  # where each engine keeps its functions


def compiled_run(engine: str, backend: str, seed: int = 3):
    """(model, its output, the expected tokens): a tiny model decoded with `compile_core=backend` on `engine`."""
    model = tiny_spec_model(seed, vocab=VOCAB)
    ids, mask = left_pad(random_prompts(seed, [5, 3], VOCAB))
    out = speculative(model, ids, mask, 6, "pipeline", compile_core=backend, speculative_engine=engine)
    return model, out, plain(model, ids, mask, 6).sequences


@pytest.mark.parametrize("engine,backend", [("lanes", "aot_eager"), ("wavefront", "eager")])
def test_a_compiled_model_is_freed_with_its_last_reference(engine, backend):
    model, out, expected = compiled_run(engine, backend)
    assert out.speculation.engine == engine and out.sequences.tolist() == expected.tolist()
    assert compiled.compiled_store(model, STORES[engine]), "the run compiled nothing: the test would prove nothing"
    alive = weakref.ref(model)
    del model, out
    gc.collect()
    assert alive() is None


def test_a_copy_of_a_compiled_model_compiles_its_own_functions():
    model, _, expected = compiled_run("lanes", "eager", seed=4)
    twin = copy.deepcopy(model)
    assert not compiled.compiled_store(twin, stages.STORE)
    ids, mask = left_pad(random_prompts(4, [5, 3], VOCAB))
    again = speculative(twin, ids, mask, 6, "pipeline", compile_core="eager", speculative_engine="lanes")
    assert again.sequences.tolist() == expected.tolist()
    assert compiled.compiled_store(twin, stages.STORE).keys() == compiled.compiled_store(model, stages.STORE).keys()
    assert torch.equal(twin.lm_head.weight, model.lm_head.weight)
