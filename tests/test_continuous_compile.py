"""Continuous batching with a compiled step (`compile_core`): requests of every length coming and going compile
nothing after the manager's warm-up (the slots' shapes are fixed: one graph with prompt rows, one without; a request's
KV pages are data, written into the state's page map), and the tokens stay plain decoding's.
The `eager` backend: dynamo's graphs without inductor's code generation; two
cycles per compiled call (the default unrolls more: slower to compile, the same code)."""

from __future__ import annotations

import torch
from continuous_utils import VOCAB, alone, batching, collect, generation_config, prompts
from speculative_utils import tiny_spec_model
from torch._dynamo.utils import counters

from hf_loopspec.generation.wavefront import engine as engine_module


def test_requests_coming_and_going_compile_nothing_after_warmup(monkeypatch):
    monkeypatch.setattr(engine_module, "CYCLES_PER_CALL", 2)
    model = tiny_spec_model(0, vocab=VOCAB, damp=0.5)
    config = generation_config({"speculative_mode": "pipeline", "draft_loops": 1, "compile_core": "eager"})
    # a pool of 48 positions per plane: two slots of 48 cannot both run at full length, so requests wait for pages and
    # take pages others gave back
    manager = model.init_continuous_batching(config, batching(slots=2, positions=48, blocks=3))
    manager.warmup()
    graphs = counters["stats"]["unique_graphs"]
    manager.start()
    try:
        requests = list(zip(prompts(8, [3, 1, 20, 6]), (10, 20, 5, 12)))
        ids = [manager.add_request(p, max_new_tokens=n) for p, n in requests]
        results = collect(manager, ids)
    finally:
        manager.stop(block=True)
    assert counters["stats"]["unique_graphs"] == graphs
    assert manager.settings.pool.positions == 48
    assert [results[i].generated_tokens for i in ids] == [alone(model, p, n) for p, n in requests]
    torch._dynamo.reset()
