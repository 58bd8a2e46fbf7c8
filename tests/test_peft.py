"""PEFT adapters on a looped model, and inputs the speculative modes never read.

PEFT's prompt learning prepends its virtual tokens through a `prepare_inputs_for_generation` it sets on the model
instance, which the speculative engine never calls: such a call decodes plainly and says why
(`out.speculation.fallback`), in every speculative mode. An adapter that leaves the inputs alone (LoRA) keeps
speculative decoding, with plain decoding's tokens; one adapter per row (`adapter_names`, Poly's `task_ids`) decodes
plainly. Prefix tuning is refused in every mode (its prefix is a KV cache of one loop's layers).
`inputs_embeds` is refused by every speculative mode (before,
pipeline and block decoded the ids and dropped the embeddings, or crashed on an embeddings-only call).
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from helpers import tiny_model
from peft import LNTuningConfig, LoraConfig, PromptTuningConfig, TaskType, get_peft_model
from transformers import DynamicCache, StaticCache

from hf_loopspec import OuroForCausalLM, PagedLoopCache

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


def test_lora_on_a_huginn_embedding_decodes():
    """A LoRA wrapper on Huginn's embedding (`wte`) has no `embedding_dim`: the KV layout's width check read it and
    every call raised AttributeError. With a random B the adapter changes tokens; pipeline gives plain's."""
    from huginn_utils import tiny_huginn

    model = tiny_huginn(seed=4)[0]
    ids, mask = _ids(model)
    settings = {**SETTINGS, "init_scale": 0.0}
    lora = get_peft_model(model, LoraConfig(r=2, target_modules=["wte"], init_lora_weights=False)).eval()
    plain = lora.generate(input_ids=ids, attention_mask=mask, speculative_mode=None, **settings)
    with lora.disable_adapter():
        assert not torch.equal(plain, model.generate(input_ids=ids, attention_mask=mask, speculative_mode=None,
                                                     **settings))
    assert torch.equal(lora.generate(input_ids=ids, attention_mask=mask, speculative_mode="pipeline", **settings),
                       plain)


@pytest.mark.parametrize("family", ["ouro", "huginn"])
def test_layernorm_tuning_of_the_final_norm_decodes_with_the_tuned_norm(family):
    """PEFT's LayerNorm tuning wraps the final norm in a layer without `eps`: the KV layout's build check read
    `norm.eps`, and every call, `forward` included, raised "object has no attribute 'kv_layout'". The tuned norm
    (scaled here, so the tokens change) decodes as the same model with that norm weight written in, in every mode."""
    from huginn_utils import tiny_huginn

    model = tiny_model()[0] if family == "ouro" else tiny_huginn(seed=4)[0]
    name, settings = ("norm", SETTINGS) if family == "ouro" else ("ln_f", {**SETTINGS, "init_scale": 0.0})
    ids, mask = _ids(model)
    reference = copy.deepcopy(model)
    tuned = get_peft_model(model, LNTuningConfig(task_type=TaskType.CAUSAL_LM, target_modules=[name])).eval()
    scale = torch.rand(getattr(reference.base_model, name).weight.shape[0],
                       generator=torch.Generator().manual_seed(5)) * 2
    with torch.no_grad():
        getattr(tuned.get_base_model().base_model, name).ln_tuning_layers["default"].weight.mul_(scale)
        getattr(reference.base_model, name).weight.mul_(scale)
    plain = tuned.generate(input_ids=ids, attention_mask=mask, speculative_mode=None, **settings)
    assert torch.equal(plain, reference.generate(input_ids=ids, attention_mask=mask, speculative_mode=None,
                                                 **settings))
    with tuned.disable_adapter():
        assert not torch.equal(plain, model.generate(input_ids=ids, attention_mask=mask, speculative_mode=None,
                                                     **settings))
    for mode in MODES:
        assert torch.equal(tuned.generate(input_ids=ids, attention_mask=mask, speculative_mode=mode, **settings),
                           plain), mode


def test_an_adapter_folder_loads_only_onto_a_base_of_the_family(tmp_path):
    """`from_pretrained(adapter_folder)` loads the base model that adapter_config.json names, then the adapter: the
    family check reads the base's config.json (an adapter folder has none), so an adapter over a base of another
    model_type is refused before any weight loads, naming both folders; over an Ouro base it loads."""
    tiny_model()[0].save_pretrained(tmp_path / "base")
    model = OuroForCausalLM.from_pretrained(tmp_path / "base")  # (the adapter's config names the folder it came from)
    lora = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False))
    lora.save_pretrained(tmp_path / "adapter")
    assert type(OuroForCausalLM.from_pretrained(tmp_path / "adapter")) is OuroForCausalLM
    config = json.loads((tmp_path / "base" / "config.json").read_text())
    (tmp_path / "base" / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(ValueError, match=r"base\b.* \(the base model of the adapter .*adapter\) holds a "
                                         r"model_type='gpt2' checkpoint"):
        OuroForCausalLM.from_pretrained(tmp_path / "adapter")


def test_export_refuses_an_adapter_beside_the_checkpoint_and_the_cli_names_an_adapter_folder(tmp_path):
    """A checkpoint folder that also holds a saved adapter loads base plus adapter, whose `save_pretrained` writes the
    adapter alone: the export failed on its own staging folder ("No such file ... config.json"). It is refused before
    any weight loads, nothing written; an adapter-only folder given to the command line is named as an adapter."""
    from hf_loopspec.hub.export import export_checkpoint
    from hf_loopspec.input_checks import check_source

    tiny_model()[0].save_pretrained(tmp_path / "src")
    lora = get_peft_model(OuroForCausalLM.from_pretrained(tmp_path / "src"),
                          LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False))
    lora.save_pretrained(tmp_path / "src")
    lora.save_pretrained(tmp_path / "adapter")
    with pytest.raises(ValueError, match=r"src holds a PEFT adapter \(adapter_config.json\) beside its checkpoint.*"
                                         r"merge the adapter first"):
        export_checkpoint(str(tmp_path / "src"), str(tmp_path / "out"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter", "src"]
    with pytest.raises(FileNotFoundError, match=r"adapter has no config.json but a PEFT adapter \(adapter_config.json"
                                                r"\), and a whole checkpoint is needed; merge the adapter"):
        check_source(str(tmp_path / "adapter"))


def test_auto_policy_functions_act_on_the_model_a_peft_model_wraps():
    """`set_policy` and `forget` given the PEFT wrapper (as a user holding one passes it) act on the looped model
    it wraps, which auto decodes with and keys what it observes by (they stored a policy auto never read, and
    forgot nothing)."""
    from hf_loopspec.generation import auto_policy

    lora = get_peft_model(tiny_model()[0], LoraConfig(r=4, target_modules=["q_proj"])).eval()
    base = lora.get_base_model()
    auto_policy.set_policy(lora, auto_policy.AutoPolicy(margin=2.5))
    try:
        assert auto_policy.policy_for(base).margin == 2.5
        ids, mask = _ids(base)
        lora.generate(input_ids=ids, attention_mask=mask, speculative_mode="auto", **SETTINGS)
        assert auto_policy._MEMORY[base][1]  # (what the call observed, by settings)
        auto_policy.forget(lora)
        assert auto_policy._MEMORY[base][1] == {}
    finally:
        auto_policy.set_policy(lora, None)


@pytest.fixture(scope="module")
def two_adapters():
    """A PEFT model with two random LoRA adapters on the attention projections ("default" and "other")."""
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    torch.manual_seed(5)
    lora = get_peft_model(tiny_model()[0], config)
    lora.add_adapter("other", config)
    return lora.eval()


@pytest.mark.parametrize("mode", MODES)
def test_an_adapter_per_row_decodes_plainly_with_each_rows_adapter(two_adapters, mode):
    """`generate(adapter_names=[...])` (PEFT's mixed batch: one adapter per row) crashed in every speculative mode
    inside PEFT (its layers split their input by batch row). It decodes plainly now, saying why, and each row gets
    the tokens of its adapter alone (the reference: a batch-1 plain call with that adapter set)."""
    ids, mask = _ids(two_adapters)
    names = ["other", "default"]
    out = two_adapters.generate(input_ids=ids, attention_mask=mask, speculative_mode=mode, adapter_names=names,
                                return_dict_in_generate=True, **SETTINGS)
    assert "adapter_names" in out.speculation.fallback
    for row, name in enumerate(names):
        two_adapters.set_adapter(name)
        alone = two_adapters.generate(input_ids=ids[row:row + 1], attention_mask=mask[row:row + 1],
                                      speculative_mode=None, **SETTINGS)
        assert torch.equal(out.sequences[row:row + 1], alone)
    two_adapters.set_adapter("default")
    assert not torch.equal(out.sequences[0], two_adapters.generate(  # the adapters differ: a mix-up would show
        input_ids=ids[:1], attention_mask=mask[:1], speculative_mode=None, **SETTINGS)[0])


def test_an_adapter_per_row_refuses_a_paged_cache_and_continues_a_dynamic_one(two_adapters):
    """A `PagedLoopCache` lays the rows out flat, which PEFT's per-row split cannot read: refused up front, naming the
    fix. A `DynamicCache` of a first call is continued plainly, with the tokens of one call over both turns."""
    ids, mask = _ids(two_adapters)
    names, settings = ["other", "default"], {**SETTINGS, "max_new_tokens": 4}
    with pytest.raises(ValueError, match="pass a DynamicCache or no cache"):
        two_adapters.generate(input_ids=ids, attention_mask=mask, adapter_names=names, speculative_mode=None,
                              cache=PagedLoopCache(two_adapters.get_base_model().kv_layout), **settings)
    first = two_adapters.generate(input_ids=ids, attention_mask=mask, adapter_names=names, speculative_mode=None,
                                  return_dict_in_generate=True, **settings)
    sequences = first.sequences
    second = two_adapters.generate(input_ids=sequences, attention_mask=torch.ones_like(sequences), cache=first.cache,
                                   adapter_names=names, speculative_mode="pipeline", **settings)
    whole = two_adapters.generate(input_ids=ids, attention_mask=mask, adapter_names=names, speculative_mode=None,
                                  **{**SETTINGS, "max_new_tokens": 8})
    assert torch.equal(second, whole)


@pytest.mark.parametrize("mode", [None, *MODES])
def test_prefix_tuning_is_refused_in_every_mode_naming_the_adapter(mode):
    """PEFT's prefix tuning passes its prefix as a KV cache of one KV per layer: plain decoding failed on it with a
    message about the cache's layers, pipeline and block in an AttributeError (`max_cache_len`) from inside PEFT."""
    from peft import PrefixTuningConfig

    tuned = get_peft_model(tiny_model()[0], PrefixTuningConfig(task_type=TaskType.CAUSAL_LM,
                                                               num_virtual_tokens=3)).eval()
    ids, mask = _ids(tuned)
    for cache in ({}, {"cache": PagedLoopCache(tuned.get_base_model().kv_layout)}):
        with pytest.raises(ValueError, match=r"peft_type=PREFIX_TUNING, which passes its trained prefix as a KV "
                                             r"cache.*use prompt tuning \(PromptTuningConfig\) or a weight adapter"):
            tuned.generate(input_ids=ids, attention_mask=mask, speculative_mode=mode, **cache, **SETTINGS)


@pytest.mark.parametrize("mode", MODES)
def test_a_prompt_tuned_call_continuing_a_dynamic_cache_fills_it_as_plain_decoding(prompt_tuned, mode):
    """A prompt-tuned call falls back to plain decoding; given a `DynamicCache`, it converted the cache to a paged one
    and back at its end, where the virtual tokens in the cache but not in the mask failed it in a `ValueError` about
    the caller's `attention_mask`. It keeps plain decoding's cache now: the same tokens, the same KV."""
    tuned, _ = prompt_tuned
    ids, mask = _ids(tuned)
    plain_cache, cache = DynamicCache(), DynamicCache()
    plain = tuned.generate(input_ids=ids, attention_mask=mask, speculative_mode=None, cache=plain_cache, **SETTINGS)
    out = tuned.generate(input_ids=ids, attention_mask=mask, speculative_mode=mode, cache=cache,
                         return_dict_in_generate=True, **SETTINGS)
    assert torch.equal(out.sequences, plain) and out.speculation.fallback is not None
    assert cache.get_seq_length() == plain_cache.get_seq_length() == plain.shape[1] - 1 + 4  # (+ 4 virtual tokens)
    for ours, theirs in zip(cache.layers, plain_cache.layers, strict=True):
        assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)


@pytest.mark.parametrize("mode", [None, *MODES])
def test_a_prompt_tuned_call_on_a_static_cache_sizes_it_for_the_virtual_tokens(prompt_tuned, mode):
    """`cache_implementation="static"` sized the cache for the prompt and the new tokens, not PEFT's virtual tokens
    before them: every mode (plain too) failed in torch's `index_copy_`. They are counted now: plain's tokens."""
    tuned, _ = prompt_tuned
    ids, mask = _ids(tuned)
    plain = tuned.generate(input_ids=ids, attention_mask=mask, speculative_mode=None, **SETTINGS)
    static = tuned.generate(input_ids=ids, attention_mask=mask, speculative_mode=mode, cache_implementation="static",
                            **SETTINGS)
    assert torch.equal(static, plain)
    need = ids.shape[1] + SETTINGS["max_new_tokens"] - 1 + 4  # (the last new token is never written; 4 virtual)
    small = StaticCache(tuned.get_base_model().config, max_cache_len=need - 1)
    with pytest.raises(ValueError, match=rf"holds {need - 1} positions, but this call writes up to {need} .*plus "
                                         r"PEFT's 4 virtual tokens before them"):
        tuned.generate(input_ids=ids, attention_mask=mask, speculative_mode=mode, cache=small, **SETTINGS)


@pytest.mark.parametrize("assisted", ["prompt_lookup_num_tokens", "assistant_model"])
def test_assisted_decoding_of_a_prompt_tuned_model_is_refused_naming_it(prompt_tuned, assisted):
    """PEFT feeds its virtual tokens as embeddings, which transformers' assisted loop cannot take: a RuntimeError of
    mismatched tensor sizes inside it, with any cache or none. Refused up front, naming the setting."""
    tuned, _ = prompt_tuned
    ids, mask = _ids(tuned)
    value = 3 if assisted == "prompt_lookup_num_tokens" else tiny_model()[0]
    with pytest.raises(ValueError, match=rf"^{assisted}(=3)?: PEFT's prompt learning puts 4 virtual tokens before the "
                                         "prompt as embeddings"):
        tuned.generate(input_ids=ids[:1], attention_mask=mask[:1], speculative_mode=None, **{assisted: value},
                       **SETTINGS)


def test_poly_task_ids_decode_plainly_per_row_and_continuous_batching_refuses_them():
    """PEFT's Poly layers mix their skills per row by `task_ids`, which reach them by a pre-hook, as
    `adapter_names` do: every speculative mode failed in torch's `bmm` ("batch1 must be a 3D tensor"), and
    `generate_batch` in its loop thread ("task_ids should not be None"). Each speculative mode decodes plainly now,
    each row with its task's tokens (the reference: that row alone, plain), and continuous batching refuses the model
    up front."""
    from peft import PolyConfig

    torch.manual_seed(6)
    poly = get_peft_model(tiny_model()[0], PolyConfig(task_type=TaskType.CAUSAL_LM, r=4, n_tasks=2, n_skills=2,
                                                      n_splits=1, target_modules=["q_proj", "v_proj"])).eval()
    with torch.no_grad():
        for name, weight in poly.named_parameters():
            if "poly_lora_B" in name or "module_logits" in name:  # (zero or near it at init: tasks would not differ)
                weight.copy_(torch.randn(weight.shape, generator=torch.Generator().manual_seed(7)) * 4)
    ids, mask = _ids(poly)
    tasks = torch.tensor([1, 0])
    alone = [poly.generate(input_ids=ids[row:row + 1], attention_mask=mask[row:row + 1], task_ids=tasks[row:row + 1],
                           speculative_mode=None, **SETTINGS) for row in range(2)]
    other = poly.generate(input_ids=ids[:1], attention_mask=mask[:1], task_ids=tasks[1:], speculative_mode=None,
                          **SETTINGS)
    assert not torch.equal(other, alone[0])  # the tasks differ: a row given the other's would show
    for mode in MODES:
        out = poly.generate(input_ids=ids, attention_mask=mask, task_ids=tasks, speculative_mode=mode,
                            return_dict_in_generate=True, **SETTINGS)
        assert "task_ids" in out.speculation.fallback
        assert torch.equal(out.sequences, torch.cat(alone)), mode
    with pytest.raises(ValueError, match=r"continuous batching: PEFT's task_ids \(per batch row\)"):
        poly.generate_batch([ids[0].tolist()], max_new_tokens=2)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("with_ids", [True, False])
def test_inputs_embeds_are_refused_by_every_speculative_mode(mode, with_ids):
    model = tiny_model()[0]
    ids, mask = _ids(model)
    embeds = model.get_input_embeddings()(ids) + 1.0  # not the ids' own: plain decoding would follow these
    given = {"input_ids": ids} if with_ids else {}
    with pytest.raises(ValueError, match="inputs_embeds.*speculative_mode=None"):
        model.generate(**given, inputs_embeds=embeds, attention_mask=mask, speculative_mode=mode, **SETTINGS)
