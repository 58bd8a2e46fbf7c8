"""transformers' continuous batching on the package's models: refused at once, in each of its three entry points and
for both families, instead of a manager that marks every request FAILED and returns empty outputs."""

from __future__ import annotations

import pytest
from huginn_utils import tiny_huginn
from speculative_utils import tiny_spec_model
from transformers import GenerationConfig

MODELS = {"ouro": lambda: tiny_spec_model(0), "huginn": lambda: tiny_huginn()[0]}


@pytest.mark.parametrize("family", MODELS)
@pytest.mark.parametrize("entry", ["generate_batch", "init_continuous_batching", "continuous_batching_context_manager"])
def test_continuous_batching_is_refused_loudly(family, entry):
    model = MODELS[family]()
    config = GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0)
    with pytest.raises(NotImplementedError, match=r"continuous batching .* model\.generate"):
        if entry == "generate_batch":
            model.generate_batch(inputs=[[3, 4, 5], [6, 7]], generation_config=config)
        elif entry == "init_continuous_batching":
            model.init_continuous_batching(generation_config=config)
        else:
            with model.continuous_batching_context_manager(generation_config=config):
                pass
