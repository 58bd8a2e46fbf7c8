"""Argument validation of the speculative keys: a `ValueError` before any work (no core call, nothing written to
the cache) whose message names the argument and its value; the keys also work from a `GenerationConfig` and from
a saved `generation_config.json`, without transformers' "model_kwargs are not used" error."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from huginn_utils import tiny_huginn
from inputs import left_pad, random_prompts
from speculative_utils import PAD, named_modes, paged_cache, plain, tiny_spec_model
from transformers import EosTokenCriteria, GenerationConfig, MaxLengthCriteria, StoppingCriteriaList
from transformers.generation import GenerationMixin

from hf_loopspec import OuroForCausalLM
from hf_loopspec.generation import columns, decoder
from hf_loopspec.generation import config as speculative_config
from hf_loopspec.generation.mixin import looped_static_cache

VOCAB = 64


@pytest.fixture(scope="module")
def model():
    return tiny_spec_model(51, 4, vocab=VOCAB)


@pytest.fixture(scope="module")
def inputs():
    return left_pad(random_prompts(51, [4, 6], VOCAB))


class CountingCore:
    """Counts calls of the model's shared stack (`core`) and of `forward` while installed."""

    def __init__(self, model, monkeypatch):
        self.calls = 0
        for name in ("core", "forward"):
            original = getattr(model, name)

            def counted(*args, _original=original, **kwargs):
                self.calls += 1
                return _original(*args, **kwargs)

            monkeypatch.setattr(model, name, counted)


def own_loop(model, *args, **kwargs) -> torch.Tensor:
    """A `custom_generate` decoding loop: transformers' own greedy/sampling loop, returning the sequences alone (a
    tensor, whatever `return_dict_in_generate` says, as a custom loop may)."""
    out = GenerationMixin._sample(model, *args, **kwargs)
    return out if torch.is_tensor(out) else out.sequences


BAD = [
    ({"speculative_mode": "pipeline", "draft_loops": 0}, r"draft_loops=0"),
    ({"speculative_mode": "block", "draft_loops": 0}, r"draft_loops=0"),
    ({"speculative_mode": "pipeline", "draft_loops": 4}, r"draft_loops=4"),
    ({"speculative_mode": "block", "draft_loops": 4}, r"draft_loops=4"),
    ({"speculative_mode": "block", "draft_loops": -1}, r"draft_loops=-1"),
    ({"speculative_mode": "block", "draft_loops": 1.5}, r"draft_loops=1\.5"),
    ({"speculative_mode": "pipeline", "draft_loops": 3}, r"(?s)(?=.*draft_loops=3)(?=.*multiple)"),
    ({"speculative_mode": "block", "num_speculative_tokens": 0}, r"num_speculative_tokens=0"),
    ({"speculative_mode": "block", "num_speculative_tokens": -2}, r"num_speculative_tokens=-2"),
    ({"speculative_mode": "tree"}, r"speculative_mode='tree'"),
    ({"speculative_mode": "pipeline", "custom_generate": own_loop}, r"callable custom_generate"),
    ({"speculative_mode": "block", "custom_generate": own_loop}, r"speculative_mode='block' .* callable custom_gen"),
    # auto decodes plainly under a loop of one's own: a trace is refused naming that loop (it told to set a mode)
    ({"speculative_mode": "auto", "custom_generate": own_loop, "speculative_trace": True, "return_dict_in_generate":
      True}, r"(?s)(?=.*speculative_trace=True)(?=.*callable custom_generate)(?=.*Drop speculative_trace)"),
    ({"speculative_mode": None, "custom_generate": own_loop, "speculative_trace": "bogus"},
     r"speculative_trace='bogus' must be True, False or 'hidden'"),  # (it was told to drop custom_generate)
    ({"speculative_mode": "pipeline", "num_beams": 2}, r"num_beams=2"),
    ({"speculative_mode": "block", "num_beams": 2}, r"num_beams=2"),
    ({"speculative_mode": "pipeline", "prompt_lookup_num_tokens": 3}, r"prompt_lookup_num_tokens=3"),
    # transformers' layer-skipping self-speculation: refused in every mode before it edits the model's config
    ({"assistant_early_exit": 1}, r"assistant_early_exit=1 drafts from the first layers"),
    ({"speculative_mode": "block", "assistant_early_exit": 1}, r"assistant_early_exit=1"),
    ({"speculative_mode": "pipeline", "cache": "static"}, r"(?s)(?=.*StaticCache)(?=.*DynamicCache, or no cache)"),
    ({"speculative_mode": "pipeline", "draft_loops": True}, r"draft_loops=True"),
    ({"speculative_mode": "block", "num_speculative_tokens": False}, r"num_speculative_tokens=False"),
    ({"speculative_mode": "block", "num_speculative_tokens": torch.tensor([2])}, r"num_speculative_tokens=tensor"),
    # out of range: the values offered are those the engine takes (d2 >= U - d too), not all of d < d2 < U
    ({"speculative_mode": "pipeline", "second_draft_loops": 1}, r"second_draft_loops=1\b.* pass one of \[3\] or None"),
    ({"speculative_mode": "pipeline", "second_draft_loops": 4}, r"second_draft_loops=4 .* pass one of \[3\] or None"),
    ({"speculative_mode": "pipeline", "draft_loops": 2, "second_draft_loops": 2}, r"second_draft_loops=2"),
    ({"speculative_mode": "pipeline", "second_draft_loops": 2.5}, r"second_draft_loops=2\.5"),
    ({"speculative_mode": "pipeline", "second_draft_loops": True}, r"second_draft_loops=True"),
    ({"speculative_mode": "block", "second_draft_loops": 2}, r"(?s)(?=.*second_draft_loops=2)(?=.*'pipeline')"),
    ({"second_draft_loops": 2}, r"second_draft_loops=2"),
    # a malformed sequence_bias: transformers' ValueError in every mode (auto's acceptance key raised a TypeError)
    *[({"speculative_mode": mode, "sequence_bias": bias}, r"`sequence_bias` has to be a dict with tuples as keys|"
       r"Each key in `sequence_bias` has to be a non-empty tuple") for mode in ("auto", "pipeline")
      for bias in ({5: 1.0}, {(5,): 1.0, ("a",): 1.0})],
    # auto: pipeline mode is offered only for a depth it takes (2 is below the engine's least, 3)
    ({"speculative_mode": "auto", "second_draft_loops": 2}, r"drop second_draft_loops \([^)]*\)\.$"),
    ({"speculative_mode": "auto", "second_draft_loops": 3}, r"drop second_draft_loops \(.*\), or pass "
     r"speculative_mode='pipeline'\.$"),
    # the engine keeps one sibling per sequence: d2 >= U - d, named with the smallest allowed value, on every call
    ({"speculative_mode": "pipeline", "second_draft_loops": 2}, r"(?s)(?=.*second_draft_loops=2)(?=.*>= 3)(?=.*\[3\])"),
    ({"speculative_mode": "pipeline", "second_draft_loops": 2, "compile_core": True}, r"second_draft_loops=2"),
    ({"speculative_mode": "pipeline", "second_draft_loops": 2, "speculative_engine": "wavefront"},
     r"second_draft_loops=2"),
    # the lane decoder is no longer an engine: a saved "lanes" gets a message naming what runs it now
    ({"speculative_mode": "pipeline", "speculative_engine": "lanes"},
     r"(?s)(?=.*speculative_engine='lanes')(?=.*decode_with_lanes)(?=.*'auto')"),
    ({"speculative_mode": "pipeline", "speculative_engine": "fast"}, r"speculative_engine='fast'"),
    ({"compile_core": True}, r"compile_core=True compiles the speculative modes' engine"),
    # plain decoding would return no trace: refused, not ignored
    ({"speculative_trace": True}, r"speculative_trace=True records a speculative mode's cycles"),
    ({"speculative_mode": None, "speculative_trace": "hidden"}, r"speculative_trace='hidden'"),
    ({"speculative_mode": "pipeline", "compile_core": "no-such-backend"}, r"torch.compile backend name"),
    ({"speculative_mode": "pipeline", "output_hidden_states": True, "return_dict_in_generate": True},
     r"output_hidden_states=True"),
    ({"speculative_mode": "block", "output_attentions": True, "return_dict_in_generate": True},
     r"output_attentions=True"),
    # strategies the speculative modes do not run, named by their setting (contrastive search asked for
    # trust_remote_code first, then named the strategy alone; prompt lookup of 0 tokens was "assisted generation")
    ({"speculative_mode": "pipeline", "penalty_alpha": 0.6, "top_k": 4}, r"penalty_alpha=0\.6"),
    ({"speculative_mode": "block", "penalty_alpha": 0.6, "top_k": 4, "trust_remote_code": True}, r"penalty_alpha=0\.6"),
    ({"speculative_mode": "pipeline", "dola_layers": "high"}, r"dola_layers='high'"),
    ({"speculative_mode": "pipeline", "prompt_lookup_num_tokens": 0}, r"prompt_lookup_num_tokens=0"),
    ({"speculative_mode": "block", "force_words_ids": [[5, 6]], "num_beams": 1}, r"force_words_ids=\[\[5, 6\]\]"),
]


def test_a_second_draft_on_a_two_loop_model_is_told_to_go():
    """A 2-loop model has no loop between its only draft (loop 1) and the target: the refusal of a second draft said
    "pass one of nothing: use a smaller draft_loops or None" (no smaller draft_loops exists). It names the fixes
    there are (a Huginn call's num_steps sets its loop count)."""
    model = tiny_spec_model(0, 2)
    ids = torch.tensor([[5, 6, 7]])
    for second in (1, 2):
        with pytest.raises(ValueError, match=rf"second_draft_loops={second} must lie strictly between draft_loops=1 "
                                             r"and the loop count 2 .*; this call runs 2 loops, with no loop "
                                             r"between draft_loops=1 and the target: pass second_draft_loops=None, "
                                             r"or give a Huginn model's generate num_steps >= 3\.$"):
            model.generate(ids, max_new_tokens=2, speculative_mode="pipeline", draft_loops=1, second_draft_loops=second)


def test_a_backend_whose_package_is_missing_is_refused_up_front(model, inputs, monkeypatch):
    """torch registers backends such as tvm and openxla whether or not their package is installed: one whose package
    is missing is refused naming compile_core and the backends that run (it failed inside dynamo at the first call:
    BackendCompilerFailed, a traceback from the command line)."""
    monkeypatch.setitem(speculative_config.BACKEND_PACKAGES, "cudagraphs", "no_such_package_for_this_test")
    ids, mask = inputs
    with pytest.raises(ValueError, match=r"compile_core='cudagraphs' must be True, False or a torch.compile backend "
                                         r"name usable here \(one of .* package is missing\), e.g. inductor"):
        model.generate(ids, attention_mask=mask, max_new_tokens=2, speculative_mode="pipeline",
                       compile_core="cudagraphs")
    for name in ("aot_eager_decomp_partition", "eager", "inductor"):  # torch's debugging backends are still taken
        assert speculative_config.compile_backend(name) == name


@pytest.mark.parametrize("kwargs,message", BAD, ids=[str(i) for i in range(len(BAD))])
def test_invalid_arguments_raise_before_any_work(model, inputs, monkeypatch, kwargs, message):
    ids, mask = inputs
    kwargs = dict(kwargs)
    if kwargs.get("cache") == "static":
        kwargs["cache"] = looped_static_cache(model.config, model.kv_layout, 32)
    counter = CountingCore(model, monkeypatch)
    with pytest.raises(ValueError, match=message):
        model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=PAD, **kwargs)
    assert counter.calls == 0


@pytest.mark.parametrize("return_dict", [False, True])
def test_auto_with_a_decoding_loop_of_ones_own_runs_that_loop(model, inputs, return_dict):
    """A callable `custom_generate` replaces generate's loop: pipeline and block raise (above; they ran the custom
    loop without a word), auto decodes plainly through it (it crashed on a loop returning a tensor) and returns
    what it returns, as `speculative_mode=None` does."""
    ids, mask = inputs
    settings = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=PAD,
                    custom_generate=own_loop, return_dict_in_generate=return_dict)
    out = model.generate(ids, speculative_mode="auto", **settings)
    assert torch.is_tensor(out) and torch.equal(out, model.generate(ids, speculative_mode=None, **settings))
    assert torch.equal(out, plain(model, ids, mask, 6).sequences)


@pytest.mark.parametrize("given", ["argument", "passed config", "model config"])
def test_a_decoding_loop_reached_past_the_models_generate_refuses_a_speculative_mode(model, inputs, given):
    """A repo's generate.py (transformers-community's DoLa, contrastive search) runs its loop as
    `GenerationMixin.generate(model, ..., custom_generate=loop)`, past the model's `generate`: pipeline and block
    decoded plainly there without a word, however the mode was given. They raise as through `model.generate`; auto
    decodes plainly through the loop."""
    ids, mask = inputs
    settings = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=PAD, custom_generate=own_loop)

    def run(mode):
        if given == "argument":
            return GenerationMixin.generate(model, ids, speculative_mode=mode, **settings)
        if given == "passed config":
            return GenerationMixin.generate(model, ids, GenerationConfig(speculative_mode=mode), **settings)
        model.generation_config.speculative_mode = mode
        try:
            return GenerationMixin.generate(model, ids, **settings)
        finally:
            model.generation_config.speculative_mode = None

    for mode in ("pipeline", "block"):
        with pytest.raises(ValueError, match=f"speculative_mode='{mode}' cannot be combined with a callable"):
            run(mode)
    assert torch.equal(run("auto"), plain(model, ids, mask, 6).sequences)
    # auto decodes plainly through the loop, its engine settings with it (they were refused as plain decoding's:
    # "set speculative_mode too")
    engine = {"speculative_engine": "wavefront", "compile_core": "eager", "second_draft_loops": 3}
    out = GenerationMixin.generate(model, ids, speculative_mode="auto", **engine, **settings)
    assert torch.equal(out, plain(model, ids, mask, 6).sequences)
    assert torch.equal(model.generate(ids, speculative_mode="auto", **engine, **settings), out)


REPO_GENERATE = """
import torch


def generate(model, inputs=None, generation_config=None, **kwargs):
    ids = inputs
    for _ in range(kwargs["max_new_tokens"]):
        ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
    return ids
"""


def test_auto_hands_a_repos_generate_the_whole_call(model, inputs, tmp_path):
    """`custom_generate="<repo or folder>"` replaces the whole `generate` call (the repo's function gets every
    argument): auto ran it for each segment of its own and crashed on the tensor it returned. It runs the call,
    and its output is returned."""
    (tmp_path / "custom_generate").mkdir()
    (tmp_path / "custom_generate" / "generate.py").write_text(REPO_GENERATE)
    ids = inputs[0][:1, -4:]  # (one unpadded row: the function above knows no mask)
    out = model.generate(ids, max_new_tokens=6, custom_generate=str(tmp_path), trust_remote_code=True,
                         speculative_mode="auto", return_dict_in_generate=True)
    assert torch.is_tensor(out) and torch.equal(out, plain(model, ids, None, 6).sequences)


def test_a_block_k_past_the_new_tokens_drafts_only_those(model, inputs, monkeypatch):
    """K + 1 lanes a call: K=4096 for 5 new tokens made every call time grow with K for drafts never verified. The
    request drafts at most the new tokens there are, the same run as K = 5, greedy and sampled (seed for seed)."""
    from hf_loopspec.generation import dispatch

    ids, mask = inputs
    seen = []
    monkeypatch.setattr(dispatch, "unsupported", lambda model, request: seen.append(request.spec) or [])
    runs = []
    for k in (4096, 5):
        for sampling in ({"do_sample": False}, {"do_sample": True, "temperature": 1.5}):
            torch.manual_seed(3)
            out = model.generate(ids, attention_mask=mask, max_new_tokens=5, pad_token_id=PAD, speculative_mode="block",
                                 num_speculative_tokens=k, return_dict_in_generate=True, **sampling)
            runs.append((out.sequences.tolist(), out.speculation.drafted, out.speculation.accepted))
    assert runs[:2] == runs[2:] and [spec.num_speculative_tokens for spec in seen] == [5] * 4


def test_pipeline_with_u_not_multiple_of_d_names_the_loop_count(model, inputs):
    ids, mask = inputs
    with pytest.raises(ValueError, match=r"\(4\)") as info:
        model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=PAD,
                       speculative_mode="pipeline", draft_loops=3)
    assert "draft_loops=3" in str(info.value)
    # the same draft depth is valid in block mode
    out = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=PAD,
                         speculative_mode="block", draft_loops=3, cache=paged_cache(model))
    torch.testing.assert_close(out, plain(model, ids, mask, 5).sequences, atol=0, rtol=0)


def test_assistant_model_rejected(model, inputs, monkeypatch):
    ids, mask = inputs
    assistant = tiny_spec_model(52, 4, vocab=VOCAB)
    counter = CountingCore(model, monkeypatch)
    with pytest.raises(ValueError, match=r"assistant"):
        model.generate(ids[:1], attention_mask=mask[:1], max_new_tokens=5, do_sample=False, pad_token_id=PAD,
                       speculative_mode="pipeline", assistant_model=assistant)
    assert counter.calls == 0


@pytest.mark.parametrize("mode", [None, "pipeline"])
def test_cache_of_other_inputs_rejected(model, inputs, mode):
    """A filled PagedLoopCache continues only the sequence that filled it: the ids must extend what it consumed and
    the mask must mark as many real tokens there as it stores per row."""
    ids, mask = inputs
    cache = paged_cache(model)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=PAD,
                         speculative_mode="pipeline", cache=cache, return_dict_in_generate=True)
    width = out.sequences.shape[1]
    with pytest.raises(ValueError, match=f"input_ids has {ids.shape[1]} columns, but the PagedLoopCache has already "
                                         f"consumed {width - 1}"):
        model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=PAD,
                       speculative_mode=mode, cache=cache)
    longer = torch.cat([out.sequences, out.sequences[:, -1:]], dim=1)
    shifted = torch.ones_like(longer)  # claims the left padding was real
    with pytest.raises(ValueError, match=r"attention_mask marks \[[0-9, ]+\] real tokens"):
        model.generate(longer, attention_mask=shifted, max_new_tokens=3, do_sample=False, pad_token_id=PAD,
                       speculative_mode=mode, cache=cache)


def test_non_callable_draft_hook_rejected(model, inputs, monkeypatch):
    ids, mask = inputs
    counter = CountingCore(model, monkeypatch)
    with pytest.raises(ValueError, match="draft_hook=3"):
        model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=PAD,
                       speculative_mode="pipeline", draft_hook=3)
    assert counter.calls == 0


@pytest.mark.parametrize("mode", ["block", "pipeline", "auto"])
def test_one_loop_model_cannot_self_speculate(inputs, mode):
    """A model that runs one loop (an Ouro of one loop, Huginn at num_steps=1) has no shallower loop to draft from:
    the message says so and names num_steps (it said "draft_loops=1 is outside [1, 0]")."""
    ids, mask = inputs
    model = tiny_spec_model(53, 1, vocab=VOCAB)
    message = r"this call runs 1 loop \(a Huginn model with num_steps=1, or a 1-loop model\): decode plainly"
    with pytest.raises(ValueError, match=message):
        model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=PAD,
                       speculative_mode=mode)
    huginn = tiny_huginn()[0]
    with pytest.raises(ValueError, match=message):
        huginn.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3, do_sample=False, pad_token_id=0, init_seed=0,
                        num_steps=1, speculative_mode=mode)


def test_keys_as_generate_kwargs_are_consumed(model, inputs):
    """The three keys are generation settings, not model kwargs: no "model_kwargs are not used" error, and
    speculative_mode=None is plain decoding (no speculation stats)."""
    ids, mask = inputs
    ref = plain(model, ids, mask, 8)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=PAD,
                         speculative_mode="block", draft_loops=2, num_speculative_tokens=3,
                         return_dict_in_generate=True)
    torch.testing.assert_close(out.sequences, ref.sequences, atol=0, rtol=0)
    assert out.speculation.mode == "block" and out.speculation.draft_loops == 2
    out = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=PAD,
                         speculative_mode=None, draft_loops=2, return_dict_in_generate=True)
    torch.testing.assert_close(out.sequences, ref.sequences, atol=0, rtol=0)
    assert getattr(out, "speculation", None) is None


def test_keys_from_generation_config(model, inputs):
    ids, mask = inputs
    ref = plain(model, ids, mask, 8)
    config = GenerationConfig(speculative_mode="pipeline", draft_loops=2, max_new_tokens=8, do_sample=False,
                              pad_token_id=PAD, return_dict_in_generate=True)
    out = model.generate(ids, attention_mask=mask, generation_config=config)
    torch.testing.assert_close(out.sequences, ref.sequences, atol=0, rtol=0)
    assert out.speculation.mode == "pipeline" and out.speculation.draft_loops == 2
    # a kwarg overrides the config
    out = model.generate(ids, attention_mask=mask, generation_config=config, speculative_mode="block",
                         num_speculative_tokens=2)
    assert out.speculation.mode == "block"
    torch.testing.assert_close(out.sequences, ref.sequences, atol=0, rtol=0)
    # an invalid value on the config is validated like a kwarg
    with pytest.raises(ValueError, match="draft_loops=3"):
        model.generate(ids, attention_mask=mask, generation_config=GenerationConfig(
            speculative_mode="pipeline", draft_loops=3, max_new_tokens=4, do_sample=False, pad_token_id=PAD))
    with pytest.raises(ValueError, match="num_speculative_tokens=0"):
        model.generate(ids, attention_mask=mask, generation_config=GenerationConfig(
            speculative_mode="block", num_speculative_tokens=0, max_new_tokens=4, do_sample=False, pad_token_id=PAD))


def _save_and_reload(model, folder):
    model.save_pretrained(folder)
    return OuroForCausalLM.from_pretrained(folder).eval()


def test_keys_from_saved_generation_config_json(model, inputs, tmp_path):
    ids, mask = inputs
    ref = plain(model, ids, mask, 8)
    original = model.generation_config
    model.generation_config = GenerationConfig(speculative_mode="block", draft_loops=1, num_speculative_tokens=3,
                                               do_sample=False, pad_token_id=PAD)
    try:
        loaded = _save_and_reload(model, tmp_path)
    finally:
        model.generation_config = original
    assert '"speculative_mode": "block"' in (tmp_path / "generation_config.json").read_text()
    assert loaded.generation_config.speculative_mode == "block"
    with torch.no_grad():
        out = loaded.generate(ids, attention_mask=mask, max_new_tokens=8, return_dict_in_generate=True)
        assert out.speculation.mode == "block" and out.speculation.draft_loops == 1
        torch.testing.assert_close(out.sequences, ref.sequences, atol=0, rtol=0)
        # speculative_mode=None as a kwarg turns it off for one call
        out = loaded.generate(ids, attention_mask=mask, max_new_tokens=8, speculative_mode=None,
                              return_dict_in_generate=True)
        assert getattr(out, "speculation", None) is None
        torch.testing.assert_close(out.sequences, ref.sequences, atol=0, rtol=0)
        # an invalid saved value fails on use, naming the key
        loaded.generation_config.draft_loops = 4
        with pytest.raises(ValueError, match="draft_loops=4"):
            loaded.generate(ids, attention_mask=mask, max_new_tokens=8)


def test_saved_lanes_engine_names_the_reference_and_the_fix(model, inputs, tmp_path):
    """A `generation_config.json` saved with the retired `speculative_engine="lanes"` loads, and `generate` then
    raises a `ValueError` naming the value, where the lane decoder went and what to pass instead."""
    ids, mask = inputs
    model.save_pretrained(tmp_path)
    saved = {"pad_token_id": PAD, "speculative_mode": "pipeline", "speculative_engine": "lanes"}
    (tmp_path / "generation_config.json").write_text(json.dumps(saved))
    loaded = OuroForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.generation_config.speculative_engine == "lanes"
    with pytest.raises(ValueError, match=r"(?s)speculative_engine='lanes'.*decode_with_lanes.*generation_config"):
        loaded.generate(ids, attention_mask=mask, max_new_tokens=4)


def test_keys_set_on_the_default_generation_config_survive_save_and_reload(inputs, tmp_path):
    model = tiny_spec_model(54, 4, vocab=VOCAB)
    model.generation_config.speculative_mode = "pipeline"
    model.generation_config.draft_loops = 2
    loaded = _save_and_reload(model, tmp_path)
    assert '"speculative_mode": "pipeline"' in (tmp_path / "generation_config.json").read_text()
    assert getattr(loaded.generation_config, "speculative_mode", None) == "pipeline"


SAVE_REFUSALS = [  # (family, generation config settings, the refusal's words): what the saved model's generate refuses
    ("ouro", {"speculative_mode": "pipelin"}, "speculative_mode='pipelin' is not supported"),
    ("ouro", {"speculative_mode": "pipeline", "draft_loops": 9}, r"draft_loops=9 is outside \[1, 3\]"),
    ("ouro", {"speculative_mode": "pipeline", "draft_loops": 3}, "multiple of draft_loops=3"),
    ("ouro", {"speculative_mode": "block", "num_speculative_tokens": 0}, "num_speculative_tokens=0"),
    ("ouro", {"speculative_mode": "block", "draft_loops": "x"}, "draft_loops='x' must be an integer"),
    ("ouro", {"speculative_mode": "block", "num_beams": 2}, "cannot be combined with beam search"),
    ("ouro", {"speculative_mode": "auto", "prompt_lookup_num_tokens": 2}, "cannot be combined with prompt lookup"),
    ("ouro", {"speculative_trace": True}, "speculative_trace=True in a generation config is not read"),
    ("ouro", {"num_steps": 4}, "num_steps=4: OuroForCausalLM has no recurrence settings"),
    ("ouro", {"forced_eos_token_id": [5, 99]}, r"forced_eos_token_id=\[5, 99\] is no token id of the vocabulary"),
    ("ouro", {"exponential_decay_length_penalty": [5]}, r"exponential_decay_length_penalty=\[5\] is no"),
    ("huginn", {"exit_threshold": 0.5}, "exit_threshold=0.5: HuginnForCausalLM has no exit options"),
    ("huginn", {"speculative_mode": "pipeline", "num_steps": 1}, "runs 1 loop"),
]


@pytest.mark.parametrize(("family", "settings", "words"), SAVE_REFUSALS)
def test_save_pretrained_refuses_a_generation_config_its_generate_would_refuse(tmp_path, family, settings, words):
    """`save_pretrained` raises the `ValueError` that the saved model's first `generate` would raise on its loaded
    generation config, naming `model.generation_config`, and writes nothing (before, the checkpoint was written and
    each speculative call of it failed); the same model with the setting set back saves and loads."""
    model = tiny_spec_model(54, 4, vocab=VOCAB) if family == "ouro" else tiny_huginn(seed=6)[0]
    for key, value in settings.items():
        setattr(model.generation_config, key, value)
    with pytest.raises(ValueError, match=f"^model.generation_config: .*{words}.*before saving"):
        model.save_pretrained(tmp_path / "refused")
    assert not (tmp_path / "refused").exists()
    for key in settings:
        setattr(model.generation_config, key, None)
    model.save_pretrained(tmp_path / "saved")
    assert getattr(type(model).from_pretrained(tmp_path / "saved").generation_config, "speculative_mode", None) is None


def test_save_pretrained_keeps_speculative_keys_that_a_call_without_a_mode_ignores(inputs, tmp_path):
    """Without a speculative_mode, generate decodes plainly and ignores the other speculative keys ("plain means
    plain"), so save keeps them (a config set to plain by default was refused); a call that names a mode uses them."""
    model = tiny_spec_model(54, 4, vocab=VOCAB)
    ids, mask = inputs
    for key, value in {"draft_loops": 2, "second_draft_loops": 3, "compile_core": False,
                       "speculative_engine": "wavefront"}.items():
        setattr(model.generation_config, key, value)
    expected = plain(model, ids, mask, 6).sequences
    assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False), expected)
    loaded = _save_and_reload(model, tmp_path)
    saved = loaded.generation_config
    assert getattr(saved, "speculative_mode", None) is None
    assert (saved.second_draft_loops, saved.speculative_engine) == (3, "wavefront")
    out = loaded.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, speculative_mode="pipeline",
                          return_dict_in_generate=True)
    assert out.speculation.draft_loops == 2 and torch.equal(out.sequences, expected)


@pytest.mark.parametrize("how", ["file", "argument"])
def test_keys_in_a_generation_config_marked_from_model_config_are_honoured(inputs, tmp_path, how):
    """Older transformers versions save `"_from_model_config": true`, and transformers then drops every non-standard
    key when it builds the config; the speculative keys of such a file (or of such a config passed to
    `from_pretrained`) are restored, so the model decodes speculatively, with plain's tokens."""
    model = tiny_spec_model(55, 4, vocab=VOCAB)
    ids, mask = inputs
    ref = plain(model, ids, mask, 8)
    model.save_pretrained(tmp_path)
    saved = {"_from_model_config": True, "pad_token_id": PAD, "speculative_mode": "block", "draft_loops": 2,
             "num_speculative_tokens": 3}
    if how == "file":
        (tmp_path / "generation_config.json").write_text(json.dumps(saved))
        assert getattr(GenerationConfig.from_pretrained(tmp_path), "speculative_mode", None) is None  # transformers
        loaded = OuroForCausalLM.from_pretrained(tmp_path).eval()
    else:
        config = GenerationConfig(pad_token_id=PAD)
        for key in ("speculative_mode", "draft_loops", "num_speculative_tokens"):
            setattr(config, key, saved[key])
        config._from_model_config = True
        loaded = OuroForCausalLM.from_pretrained(tmp_path, generation_config=config).eval()
    assert (loaded.generation_config.speculative_mode, loaded.generation_config.draft_loops,
            loaded.generation_config.num_speculative_tokens) == ("block", 2, 3)
    with torch.no_grad():
        out = loaded.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                              return_dict_in_generate=True)
    assert out.speculation.mode == "block" and out.speculation.draft_loops == 2
    assert out.sequences.tolist() == ref.sequences.tolist()


@pytest.mark.parametrize("key", ["speculative_trace", "draft_hook"])
def test_a_runtime_key_in_a_file_marked_from_model_config_is_refused_not_dropped(inputs, tmp_path, key):
    """A trace or hook saved in a `generation_config.json` is refused by `generate` whatever the file's
    `_from_model_config` mark (transformers drops such a marked file's non-standard keys; before, the call then ran
    without a word and returned no trace)."""
    model = tiny_spec_model(55, 4, vocab=VOCAB)
    ids, mask = inputs
    model.save_pretrained(tmp_path)
    saved = {"_from_model_config": True, "pad_token_id": PAD, "speculative_mode": "pipeline", key: True}
    (tmp_path / "generation_config.json").write_text(json.dumps(saved))
    loaded = OuroForCausalLM.from_pretrained(tmp_path).eval()
    with pytest.raises(ValueError, match=f"{key}=True in a generation config is not read: pass it to generate"):
        loaded.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)


@pytest.mark.parametrize("marked", [False, True])
def test_another_familys_key_in_a_saved_generation_config_is_refused(inputs, tmp_path, marked):
    """Huginn's `num_steps` in an Ouro checkpoint's generation_config.json is refused by `generate`, also in a file
    marked `_from_model_config` (transformers drops such a file's non-standard keys: it vanished without a word)."""
    model = tiny_spec_model(55, 4, vocab=VOCAB)
    ids, mask = inputs
    model.save_pretrained(tmp_path)
    saved = {"_from_model_config": marked, "pad_token_id": PAD, "num_steps": 4}
    (tmp_path / "generation_config.json").write_text(json.dumps(saved))
    loaded = OuroForCausalLM.from_pretrained(tmp_path).eval()
    for mode in (None, "pipeline"):
        with pytest.raises(ValueError, match="num_steps=4: OuroForCausalLM has no recurrence settings"):
            loaded.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, speculative_mode=mode)


@pytest.mark.parametrize("value", [np.int64(2), np.int32(2), torch.tensor(2), 2])
def test_integer_arguments_accept_numpy_and_tensor_integers(model, inputs, value):
    ids, mask = inputs
    expected = plain(model, ids, mask, 5).sequences
    out = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=PAD,
                         speculative_mode="block", draft_loops=value, num_speculative_tokens=value)
    assert out.tolist() == expected.tolist()


# plain decoding and one setting of each speculative mode from the shared matrix
MODES = named_modes()
MALFORMED = {  # (ids, mask) from the valid (ids, mask) -> message
    "3-D ids": (lambda i, m: (i[None], m[None]), r"input_ids must be a 2-D \[batch, length\] tensor"),
    "empty prompt": (lambda i, m: (i[:, :0], m[:, :0]), r"input_ids has no tokens"),
    "fully masked row": (lambda i, m: (i, torch.cat([m[:1] * 0, m[1:]])),
                         r"attention_mask marks no real token in rows \[0\]"),
    "mask of another shape": (lambda i, m: (i, m[:, 1:]), r"attention_mask has shape \(2, 5\)"),
    "mask as a list": (lambda i, m: (i, m.tolist()), r"attention_mask must be a torch tensor like input_ids, got a "
                       r"list; pass torch.tensor\(mask\)"),  # (it read "has shape list")
    "1-D mask": (lambda i, m: (i[0], m[0]), r"input_ids must be a 2-D"),
    "non-binary mask": (lambda i, m: (i, m.float() * 0.5), r"attention_mask must hold only 0 .* \[0\.5\]"),
    # (torch's NotImplementedError for `unique` of a complex tensor, naming the mask's values)
    "complex mask": (lambda i, m: (i, m.to(torch.complex64) * (1 + 1j)), r"attention_mask has dtype torch\.complex64"),
}


@pytest.mark.parametrize("mode", MODES.values(), ids=list(MODES))
@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_inputs_raise_in_every_mode(model, inputs, monkeypatch, mode, case):
    make, message = MALFORMED[case]
    ids, mask = make(*inputs)
    counter = CountingCore(model, monkeypatch)
    with pytest.raises(ValueError, match=message):
        model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=PAD, **mode)
    assert counter.calls == 0


@pytest.mark.parametrize("mode", [*MODES.values(), {"speculative_mode": "auto"}], ids=[*MODES, "auto"])
def test_a_generation_config_of_another_type_is_named(model, inputs, mode):
    """A dict or a string as generation_config: one ValueError naming it in every mode (an AttributeError naming
    whichever of its attributes each mode read first)."""
    ids, mask = inputs
    for config, kind in (({"max_new_tokens": 3}, "dict"), ("greedy", "str")):
        with pytest.raises(ValueError, match=f"generation_config: a {kind}; pass a transformers.GenerationConfig"):
            model.generate(ids, attention_mask=mask, generation_config=config, **mode)


@pytest.mark.parametrize("mode", [*MODES.values(), {"speculative_mode": "auto"}], ids=[*MODES, "auto"])
def test_a_call_without_input_ids_is_checked_as_its_bos_prompt(model, mode):
    """Without input_ids generate starts from BOS, one column per row: a wider mask, a row without a real token and a
    BOS outside the vocabulary raise one ValueError in every mode (plain decoding read some of them, the speculative
    modes raised torch's IndexError or other messages); a [B, 1] mask decodes as plain decoding does."""
    settings = {"max_new_tokens": 3, "do_sample": False, "pad_token_id": PAD, "bos_token_id": 1}
    for kwargs, message in (
            ({"attention_mask": torch.ones(2, 3, dtype=torch.long)}, r"attention_mask has shape \(2, 3\), but without "
                                                                     r"input_ids generate starts from the BOS token"),
            ({"attention_mask": torch.tensor(1)}, r"attention_mask has shape \(\), but without input_ids"),
            ({"attention_mask": torch.tensor([[1], [0]])}, r"without input_ids, generate starts from a \[batch, 1\] "
                                                           r"BOS prompt: attention_mask marks no real token in rows"),
            ({"bos_token_id": VOCAB + 5}, f"bos_token_id={VOCAB + 5} is outside the vocabulary")):
        with pytest.raises(ValueError, match=message):
            model.generate(**{**settings, **kwargs}, **mode)
    mask = torch.ones(2, 1, dtype=torch.long)
    want = model.generate(**settings, attention_mask=mask, speculative_mode=None)
    assert torch.equal(model.generate(**settings, attention_mask=mask, **mode), want)
    # a BOS that is the pad id, without a mask, is a real token (transformers inferred it as padding: plain decoding
    # started from no token, the speculative modes refused it as right padding)
    settings |= {"bos_token_id": PAD, "eos_token_id": PAD + 1}
    want = model.generate(**settings, attention_mask=mask[:1], speculative_mode=None)
    assert torch.equal(model.generate(**settings, **mode), want)


@pytest.mark.parametrize("mode", MODES.values(), ids=list(MODES))
def test_use_cache_false_returns_no_cache(model, inputs, mode):
    ids, mask = inputs
    out = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=PAD,
                         use_cache=False, return_dict_in_generate=True, **mode)
    assert out.cache is None
    assert out.sequences.tolist() == plain(model, ids, mask, 3).sequences.tolist()


def test_id_buffer_grows_with_the_output(model, inputs, monkeypatch):
    """The reference's output buffer: a huge max_new_tokens allocates nothing up front (the buffer starts at IDS_CHUNK
    columns past the prompt), and a buffer that must grow many times (IDS_CHUNK = 1) still gives plain's tokens."""
    ids, mask = inputs
    widths = []
    run = decoder.LaneDecoder.run

    def recording_run(self):
        result = run(self)
        widths.append(self.columns.ids.shape[1])
        return result

    monkeypatch.setattr(decoder.LaneDecoder, "run", recording_run)
    eos = int(plain(model, ids, mask, 1).sequences[0, -1])  # row 0 stops after one token
    huge = ids.shape[1] + 50_000_000
    out = model.decode_with_lanes(ids[:1], "pipeline", cache=paged_cache(model), attention_mask=mask[:1],
                                  max_length=huge, pad_token_id=PAD, stopping_criteria=StoppingCriteriaList(
                                      [MaxLengthCriteria(huge), EosTokenCriteria(eos)]))
    assert out.sequences.shape[1] == ids.shape[1] + 1 and widths == [ids.shape[1] + columns.IDS_CHUNK]
    monkeypatch.setattr(columns, "IDS_CHUNK", 1)
    for mode in ("pipeline", "block"):
        got = model.decode_with_lanes(ids, mode, cache=paged_cache(model), attention_mask=mask, pad_token_id=PAD,
                                      max_length=ids.shape[1] + 12)
        assert got.sequences.tolist() == plain(model, ids, mask, 12, eos_token_id=None).sequences.tolist()


def test_the_reference_refuses_bad_inputs_naming_them(model, inputs):
    """`decode_with_lanes` (the reference that the `speculative_engine='lanes'` message points to) said "None is not
    supported; use ... or None", failed with AttributeErrors on list ids or no cache and a TypeError on a string
    `max_length`, and returned the prompt for a `max_length` shorter than it. Its attention mask and batch are checked
    as `generate` checks them: a mask of the wrong shape read out of range (an IndexError), a list mask failed with an
    AttributeError, a mask holding 2 or a right-padded one decoded without a word (the latter other tokens than plain
    decoding), and an empty batch raised "max() arg is an empty sequence"."""
    ids, mask = inputs
    assert mask[:, 0].eq(0).any()  # a left-padded batch: flipped, some row ends in padding
    settings = {"pad_token_id": PAD}
    cases = [({"mode": None}, r"mode=None: the lane decoder runs one of \('ar', 'pipeline', 'block'\)"),
             ({"input_ids": ids.tolist()}, "input_ids must be a torch tensor of token ids .* got a list"),
             ({"input_ids": ids.float()}, "input_ids has dtype torch.float32"),
             ({"input_ids": None}, "input_ids=None: the reference decodes from a prompt"),
             ({"input_ids": ids[:0], "attention_mask": mask[:0]}, r"input_ids has no rows \(shape \(0, "),
             ({"attention_mask": mask[:, 1:]}, r"attention_mask has shape \(\d+, \d+\), but input_ids has shape"),
             ({"attention_mask": mask[:1]}, r"attention_mask has shape \(1, \d+\), but input_ids has shape"),
             ({"attention_mask": mask.tolist()}, "attention_mask must be a torch tensor like input_ids, got a list"),
             ({"attention_mask": mask * 2}, r"attention_mask must hold only 0 \(padding\) and 1"),
             ({"attention_mask": mask.flip(1)}, r"ends in padding in rows .* which mode='pipeline' does not decode"),
             ({"cache": None}, "cache: a NoneType; the lane decoder keeps its KV in a PagedLoopCache"),
             ({"max_length": "12"}, r"max_length='12' must be an integer"),
             ({"max_length": 3}, f"max_length=3 leaves no room after the {ids.shape[1]} input columns")]
    for bad, message in cases:
        call = {"input_ids": ids, "mode": "pipeline", "cache": paged_cache(model), "max_length": ids.shape[1] + 4,
                "attention_mask": mask}
        call |= bad
        with pytest.raises(ValueError, match=message):
            model.decode_with_lanes(call.pop("input_ids"), call.pop("mode"), **call, **settings)
