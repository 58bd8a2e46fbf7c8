"""PEFT adapters on a looped model, and inputs the speculative modes never read.

PEFT's prompt learning prepends its virtual tokens through a `prepare_inputs_for_generation` it sets on the model
instance, which the speculative engine never calls: such a call decodes plainly and says why
(`out.speculation.fallback`), in every speculative mode. An adapter that leaves the inputs alone (LoRA) keeps
speculative decoding, with plain decoding's tokens. `inputs_embeds` is refused by every speculative mode (before,
pipeline and block decoded the ids and dropped the embeddings, or crashed on an embeddings-only call).
"""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_model
from peft import LoraConfig, PromptTuningConfig, TaskType, get_peft_model

MODES = ["pipeline", "block", "auto"]
SETTINGS = {"max_new_tokens": 10, "do_sample": False, "eos_token_id": None, "pad_token_id": 0}


def _ids(model) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(1, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(3))
    return ids, torch.ones_like(ids)


@pytest.fixture(scope="module")
def prompt_tuned():
    """(the PEFT model with a random 4-token soft prompt, the base model's own greedy tokens for the same ids)."""
    model = tiny_model()[0]
    ids, mask = _ids(model)
    base = model.generate(input_ids=ids, attention_mask=mask, speculative_mode=None, **SETTINGS)
    tuned = get_peft_model(model, PromptTuningConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=4)).eval()
    with torch.no_grad():
        weight = tuned.prompt_encoder.default.embedding.weight
        weight.copy_(torch.randn(weight.shape, generator=torch.Generator().manual_seed(4)))
    return tuned, base


@pytest.mark.parametrize("mode", MODES)
def test_prompt_tuning_decodes_plainly_with_its_soft_prompt(prompt_tuned, mode):
    tuned, base = prompt_tuned
    ids, mask = _ids(tuned)
    plain = tuned.generate(input_ids=ids, attention_mask=mask, speculative_mode=None, **SETTINGS)
    assert not torch.equal(plain, base)  # the soft prompt changes the tokens: dropping it would show
    out = tuned.generate(input_ids=ids, attention_mask=mask, speculative_mode=mode, return_dict_in_generate=True,
                         **SETTINGS)
    assert torch.equal(out.sequences, plain)
    assert "prepare_inputs_for_generation" in out.speculation.fallback


def test_the_base_model_speculates_again_after_a_prompt_tuned_call(prompt_tuned):
    """PEFT puts the model's own `prepare_inputs_for_generation` back as an instance attribute after a prompt-tuned
    call: that is no override, so the adapter disabled (or the base model alone) decodes speculatively again."""
    tuned, _ = prompt_tuned
    ids, mask = _ids(tuned)
    tuned.generate(input_ids=ids, attention_mask=mask, speculative_mode=None, **SETTINGS)
    base = tuned.get_base_model()
    assert "prepare_inputs_for_generation" in vars(base)  # what PEFT leaves behind
    plain = base.generate(input_ids=ids, attention_mask=mask, speculative_mode=None, **SETTINGS)
    out = base.generate(input_ids=ids, attention_mask=mask, speculative_mode="pipeline", return_dict_in_generate=True,
                        **SETTINGS)
    assert out.speculation.fallback is None and torch.equal(out.sequences, plain)


@pytest.mark.parametrize("mode", ["pipeline", "block"])
def test_lora_keeps_speculative_decoding_and_plain_tokens(mode):
    model = tiny_model()[0]
    ids, mask = _ids(model)
    lora = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                            init_lora_weights=False)).eval()  # random B: the adapter changes tokens
    plain = lora.generate(input_ids=ids, attention_mask=mask, speculative_mode=None, **SETTINGS)
    with lora.disable_adapter():
        assert not torch.equal(plain, model.generate(input_ids=ids, attention_mask=mask, speculative_mode=None,
                                                     **SETTINGS))
    out = lora.generate(input_ids=ids, attention_mask=mask, speculative_mode=mode, return_dict_in_generate=True,
                        **SETTINGS)
    assert out.speculation.fallback is None and out.speculation.engine != "plain"
    assert torch.equal(out.sequences, plain)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("with_ids", [True, False])
def test_inputs_embeds_are_refused_by_every_speculative_mode(mode, with_ids):
    model = tiny_model()[0]
    ids, mask = _ids(model)
    embeds = model.get_input_embeddings()(ids) + 1.0  # not the ids' own: plain decoding would follow these
    given = {"input_ids": ids} if with_ids else {}
    with pytest.raises(ValueError, match="inputs_embeds.*speculative_mode=None"):
        model.generate(**given, inputs_embeds=embeds, attention_mask=mask, speculative_mode=mode, **SETTINGS)
