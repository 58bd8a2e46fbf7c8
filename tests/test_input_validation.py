"""Inputs a user can get wrong, tried in every mode (plain decoding, and each speculative mode on both engines): each
either decodes exactly as plain decoding does, or raises the same clear error in every mode (a `ValueError` naming
the argument where plain decoding's own error would be a deep torch one; plain's `RuntimeError` for sampling whose
probabilities are not finite). The reference is always plain `generate` on the same model."""

from __future__ import annotations

import argparse
import copy
import fractions
import re
from fractions import Fraction

import numpy as np
import pytest
import torch
from inputs import left_pad, random_prompts
from speculative_utils import MODE_PAIR, PAD, mode_id, mode_kwargs, paged_cache, plain, tiny_spec_model
from transformers import GenerationConfig

from hf_loopspec import OuroForCausalLM
from hf_loopspec.prompting import generate_kwargs

VOCAB = 96
# every mode: plain decoding, and one setting of each speculative mode (on the engine generate runs)
MODES = {"plain": {"speculative_mode": None}} | {mode_id(*m): mode_kwargs(*m) for m in MODE_PAIR}
SPECULATIVE = {name: kwargs for name, kwargs in MODES.items() if name != "plain"}


@pytest.fixture(scope="module")
def model():
    return tiny_spec_model(7, vocab=VOCAB)


@pytest.fixture(scope="module")
def inputs():
    return left_pad(random_prompts(7, [5, 3], VOCAB))


def generate(model, ids, mask, max_new=6, **kwargs):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=max_new, pad_token_id=PAD,
                              **{"do_sample": False} | kwargs)


BAD_IDS = {  # (ids, mask) from the valid (ids, mask) -> message
    "a Python list": (lambda i, m: (i.tolist(), m), r"input_ids must be a torch tensor .* got a list"),
    "float ids": (lambda i, m: (i.float(), m), r"input_ids has dtype torch\.float32"),
    "int8 ids": (lambda i, m: (i.to(torch.int8), m), r"input_ids has dtype torch\.int8"),
    "meta ids": (lambda i, m: (i.to("meta"), m), r"input_ids is on the meta device"),
    "zero rows": (lambda i, m: (i[:0], m[:0]), r"input_ids has no rows \(shape \(0, 5\)\)"),
    "ids outside the vocabulary": (lambda i, m: (i + VOCAB, m), r"input_ids contains ids outside the vocabulary"),
}


@pytest.mark.parametrize("mode", MODES.values(), ids=list(MODES))
@pytest.mark.parametrize("case", list(BAD_IDS))
def test_malformed_ids_raise_the_same_error_in_every_mode(model, inputs, mode, case):
    make, message = BAD_IDS[case]
    with pytest.raises(ValueError, match=message):
        generate(model, *make(*inputs), **mode)


@pytest.mark.parametrize("mode", {**MODES, "auto": {"speculative_mode": "auto"}}.values(), ids=[*MODES, "auto"])
@pytest.mark.parametrize("on_meta", ["lm_head", "model"])
def test_weights_on_the_meta_device_are_named(model, inputs, mode, on_meta):
    """A model whose head, or whole self, was moved to the meta device with no accelerate hook to load it back: every
    mode names the first such weight (plain decoding of a meta head returned other random tokens at each call, as
    torch multiplies a CPU input by a meta weight into uninitialized memory; the other cases failed deep in torch)."""
    emptied = copy.deepcopy(model)
    (emptied.lm_head if on_meta == "lm_head" else emptied).to("meta")
    named = "lm_head.weight" if on_meta == "lm_head" else "model.embed_tokens.weight"
    with pytest.raises(ValueError, match=rf"^{re.escape(named)} is on the meta device .* load the model's weights"):
        generate(emptied, *inputs, **mode)


@pytest.mark.parametrize("mode", [{"speculative_mode": None}, {"speculative_mode": "auto"}], ids=["plain", "auto"])
def test_adapters_added_to_an_offloaded_model_are_named(model, inputs, mode):
    """PEFT's LoRA weights added to a model accelerate offloaded sit on the meta device in no hook's store (the hook
    above them loads only the weights it offloaded): plain decoding returned other random tokens at each call, as
    the weights check took any weight below a hook as loaded. They are named; the offloaded model alone decodes."""
    import accelerate
    from peft import LoraConfig, get_peft_model

    offloaded = copy.deepcopy(model)
    accelerate.cpu_offload(offloaded, execution_device=torch.device("cpu"))
    ids, mask = inputs
    assert torch.equal(generate(offloaded, ids, mask, **mode), generate(model, ids, mask, speculative_mode=None))
    adapted = get_peft_model(offloaded, LoraConfig(target_modules=["q_proj"], r=2, init_lora_weights=False))
    with pytest.raises(ValueError, match=r"^model\.layers\.0\.self_attn\.q_proj\.lora_A\.default"
                                         r"\.weight is on the meta device .* add adapters \(PEFT\) to a model whose "
                                         r"weights are loaded"):
        generate(adapted, ids, mask, **mode)


@pytest.mark.parametrize("mode", {**MODES, "auto": {"speculative_mode": "auto"}}.values(), ids=[*MODES, "auto"])
def test_a_pad_token_outside_the_vocabulary_is_named_up_front(model, inputs, mode):
    """A batch whose rows can finish apart feeds the pad token to the finished ones: one outside the vocabulary
    (a tokenizer's added [PAD] the embeddings never got) is refused before any work, naming pad_token_id (the
    forward's error named input_ids, once a row had finished). One row, or no EOS, feeds no pad: it decodes."""
    ids, mask = inputs

    def run(rows, pad, eos):
        return model.generate(ids[rows], attention_mask=mask[rows], max_new_tokens=6, do_sample=False,
                              pad_token_id=pad, eos_token_id=eos, **mode)

    for pad in (VOCAB, -1):
        with pytest.raises(ValueError, match=rf"pad_token_id={pad} is outside the vocabulary \[0, {VOCAB}\)"):
            run(slice(None), pad, 3)
    # unset, the pad id is the first EOS id (transformers' choice): one outside the vocabulary was let through
    saved, model.generation_config.pad_token_id = model.generation_config.pad_token_id, None
    try:
        with pytest.raises(ValueError, match=rf"pad_token_id \(unset, so transformers pads with the first EOS id, "
                                             rf"{VOCAB}\) is outside the vocabulary \[0, {VOCAB}\)"):
            model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, eos_token_id=[VOCAB, 3],
                           **mode)
    finally:
        model.generation_config.pad_token_id = saved
    alone = plain(model, ids[:1], mask[:1], 6, eos_token_id=3).sequences
    assert run(slice(0, 1), VOCAB, 3).tolist() == alone.tolist()
    free = plain(model, ids, mask, 6, eos_token_id=None).sequences
    assert run(slice(None), VOCAB, None).tolist() == free.tolist()
    if mode.get("speculative_mode") is None:  # beam search only fills finished hypotheses with it (was refused)
        eos = int(plain(model, ids, mask, 6).sequences[0, ids.shape[1] + 1])  # row 0's beams finish early
        beams = dict(attention_mask=mask, max_new_tokens=6, num_beams=3, num_return_sequences=2, eos_token_id=eos)
        out = model.generate(ids, pad_token_id=VOCAB, **beams)
        fill = 5  # an id inside the vocabulary, and not 0 (which transformers' beam search swaps for the EOS id)
        assert (out == VOCAB).any()
        assert torch.equal(torch.where(out == VOCAB, fill, out), model.generate(ids, pad_token_id=fill, **beams))


@pytest.mark.parametrize("mode", {**MODES, "auto": {"speculative_mode": "auto"}}.values(), ids=[*MODES, "auto"])
def test_a_forced_token_outside_the_vocabulary_is_named_up_front(model, inputs, mode):
    """forced_bos_token_id and forced_eos_token_id index the scores at the step they force: one outside the
    vocabulary raised torch's IndexError there, in every mode, plain included. Ids inside it decode as plain."""
    ids, mask = inputs
    for key, value in (("forced_eos_token_id", VOCAB), ("forced_eos_token_id", [3, 10**6]),
                       ("forced_bos_token_id", VOCAB + 7), ("forced_eos_token_id", "3")):
        with pytest.raises(ValueError, match=rf"{key}={re.escape(repr(value))} is no token id of the vocabulary "
                                             rf"\[0, {VOCAB}\)"):
            model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, **{key: value}, **mode)
    for key, value in (("forced_eos_token_id", 5), ("forced_bos_token_id", 5),
                       ("forced_eos_token_id", np.array([5, 7])), ("forced_eos_token_id", torch.tensor([]).long())):
        expected = plain(model, ids, mask, 4, **{key: value}).sequences  # (auto met a numpy array with numpy's
        got = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, **{key: value}, **mode)
        assert got.tolist() == expected.tolist(), value  # "truth value of an array is ambiguous"; an empty one forces)


@pytest.mark.parametrize("mode", {**MODES, "auto": {"speculative_mode": "auto"}}.values(), ids=[*MODES, "auto"])
def test_an_exponential_decay_that_is_no_pair_is_named_up_front(model, inputs, mode):
    """`exponential_decay_length_penalty` is (start index, decay factor): a 1-tuple failed in an IndexError inside
    transformers' processor, in every mode, plain included, a `Fraction` factor in a TypeError. A pair, as a tuple or
    a list (a loaded JSON config's), decodes as plain."""
    ids, mask = inputs
    for value in ((2,), (2, "x"), "2", (1.5, 1.1), (2, 1.1, 3), (2, fractions.Fraction(3, 2))):
        with pytest.raises(ValueError, match=rf"exponential_decay_length_penalty={re.escape(repr(value))} is no "
                                             r"\(start_index, decay_factor\) pair"):
            model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, eos_token_id=5,
                           exponential_decay_length_penalty=value, **mode)
    for value in ((1, 3.0), [1, 3]):
        expected = plain(model, ids, mask, 4, eos_token_id=5, exponential_decay_length_penalty=value).sequences
        got = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, eos_token_id=5,
                             exponential_decay_length_penalty=value, **mode)
        assert got.tolist() == expected.tolist(), value


@pytest.mark.parametrize("mode", MODES.values(), ids=list(MODES))
def test_int32_ids_and_numpy_max_new_tokens_decode_as_plain(model, inputs, mode):
    ids, mask = inputs
    expected = plain(model, ids, mask, 6).sequences
    out = generate(model, ids.to(torch.int32), mask, **mode)
    assert out.tolist() == expected.tolist() and out.dtype == torch.int64  # as plain decoding's, whatever the ids'
    assert generate(model, ids, mask, max_new=np.int64(6), **mode).tolist() == expected.tolist()
    # with a repetition penalty the engine marks each prompt's tokens (a scatter that took only int64 ids when no
    # row is padded), padded or not
    for rows in (slice(None), slice(0, 1)):
        penalised = plain(model, ids[rows], mask[rows], 6, repetition_penalty=1.3).sequences
        out = generate(model, ids[rows].to(torch.int32), mask[rows], repetition_penalty=1.3, **mode)
        assert out.tolist() == penalised.tolist()


@pytest.mark.parametrize("mode", {**MODES, "auto": {"speculative_mode": "auto"}}.values(), ids=[*MODES, "auto"])
def test_numpy_counts_decode_as_their_python_ints(model, inputs, mode):
    """Every setting that counts tokens takes a numpy integer, as a keyword or in a passed generation config, and
    decodes as the Python int does in the same mode (transformers' processors refused `min_new_tokens`, `min_length`,
    `top_k` and `no_repeat_ngram_size` as numpy integers, the first blaming a `min_length` of another value)."""
    ids, mask = inputs
    counts = {"min_new_tokens": 3, "min_length": 8, "top_k": 5, "no_repeat_ngram_size": 2}
    def sampled(**settings):
        torch.manual_seed(0)
        return generate(model, ids, mask, eos_token_id=1, **settings, **mode).tolist()

    for key, value in counts.items():
        sampling = {"do_sample": key == "top_k"}  # (top_k is a sampling setting: seeded draws, same in both)
        expected = sampled(**{key: value}, **sampling)
        assert sampled(**{key: np.int64(value)}, **sampling) == expected, key
        configured = sampled(generation_config=GenerationConfig(**{key: value}), **sampling)
        assert sampled(generation_config=GenerationConfig(**{key: np.int64(value)}), **sampling) == configured, key


@pytest.mark.parametrize("mode", SPECULATIVE.values(), ids=list(SPECULATIVE))
def test_right_padding_is_refused_in_the_speculative_modes(model, mode):
    """Plain decoding continues a right-padded row after its padding; the speculative modes would continue after
    its last real token: different tokens, so they refuse it, naming the fix."""
    prompts = random_prompts(8, [5, 3], VOCAB)
    right = torch.zeros(2, 5, dtype=torch.long), torch.zeros(2, 5, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        right[0][row, : len(prompt)], right[1][row, : len(prompt)] = prompt, 1
    generate(model, *right)  # plain decoding decodes it (after the padding, with transformers' warning)
    with pytest.raises(ValueError, match=r'(?s)rows \[1\] \(right padding\).*padding_side="left"'):
        generate(model, *right, **mode)
    left = left_pad(prompts)  # the same prompts padded on the left: plain's tokens
    assert generate(model, *left, **mode).tolist() == plain(model, *left, 6).sequences.tolist()


@pytest.mark.parametrize("mode", SPECULATIVE.values(), ids=list(SPECULATIVE))
def test_a_cache_of_another_layout_names_the_cache_argument(model, inputs, mode):
    other = tiny_spec_model(8, vocab=VOCAB, hidden=64)  # head_dim 16 instead of 8
    with pytest.raises(ValueError, match=r"the cache passed \(cache= or past_key_values=\): the PagedLoopCache was "
                                         "made for"):
        generate(model, *inputs, cache=paged_cache(other, debug=False), **mode)


@pytest.mark.parametrize("mode", MODES.values(), ids=list(MODES))
def test_eos_ids_outside_the_vocabulary_hold_nothing_as_in_plain(model, inputs, mode):
    """With `min_new_tokens`, an EOS id outside [0, V) holds no token back in plain decoding (transformers'
    processors match ids, they do not index by them). The negative id -(V - t), t plain's first new token of row 0,
    would wrap to t if used as an index and ban it during the hold: a wrapped id shows as changed tokens."""
    ids, mask = inputs
    first = plain(model, ids, mask, 1).sequences[0, -1].item()
    for eos in ([first - VOCAB], [VOCAB + 5, first - VOCAB]):
        expected = plain(model, ids, mask, 6, eos_token_id=eos, min_new_tokens=4).sequences
        assert expected[0, ids.shape[1]].item() == first  # the wrapped id would have banned this token
        out = generate(model, ids, mask, eos_token_id=eos, min_new_tokens=4, **mode)
        assert out.tolist() == expected.tolist()


@pytest.mark.parametrize("mode", [*SPECULATIVE.values(), "paged"], ids=[*SPECULATIVE, "plain-paged"])
def test_positions_of_the_callers_own_are_refused_where_they_cannot_be_followed(model, inputs, mode):
    """`position_ids` other than the mask's own: plain decoding on a `DynamicCache` feeds them (its tokens change),
    the speculative modes and a `PagedLoopCache` count positions from the mask: a `ValueError` naming position_ids
    (they were ignored, silently), while the mask's own positions on a `PagedLoopCache` decode as plain. (Auto
    decodes such a call plainly: `test_auto.test_positions_of_the_callers_own_decode_plainly`.)"""
    ids, mask = inputs
    custom = torch.arange(ids.shape[1]).expand_as(ids) * 3
    assert not torch.equal(plain(model, ids, mask, 6, position_ids=custom).sequences, plain(model, ids, mask, 6)
                           .sequences)  # plain decoding follows them: ignoring them would change the output
    paged = dict(speculative_mode=None, cache=paged_cache(model))
    with pytest.raises(ValueError, match=r"position_ids: .* cannot follow positions of your own"):
        generate(model, ids, mask, position_ids=custom, **(paged if mode == "paged" else mode))
    if mode == "paged":
        own = (mask.cumsum(-1) - 1).clamp(min=0)  # what generate derives from the mask (real tokens)
        out = generate(model, ids, mask, position_ids=own, **{**paged, "cache": paged_cache(model)})
        assert torch.equal(out, plain(model, ids, mask, 6).sequences)


def test_a_right_padded_row_decoded_plainly_on_a_paged_cache_is_refused_naming_the_padding(model, inputs):
    """generate's positions for a row with padding after its real tokens count on from the padding's: a
    PagedLoopCache (positions counted from real tokens) refused them naming position_ids, which the caller never
    passed. (No cache, or a DynamicCache, decodes it: plain decoding's own positions.)"""
    ids, mask = inputs
    right = mask.clone()
    right[0, -1] = 0  # row 0 ends in padding
    assert plain(model, ids, right, 3).sequences.shape[0] == len(ids)
    with pytest.raises(ValueError, match=r"attention_mask ends in padding in rows \[0\], which decode on \(right "
                                         r"padding\): .* pad on the left"):
        generate(model, ids, right, speculative_mode=None, cache=paged_cache(model))
    cache = paged_cache(model)  # a second turn left-padded after the first: padding inside the row, not at its end
    first = generate(model, ids, mask, 2, speculative_mode=None, cache=cache)
    second = torch.cat([first, torch.tensor([[PAD, 5], [7, 8]])], 1)
    second_mask = torch.cat([mask, torch.tensor([[1, 1, 0, 1], [1, 1, 1, 1]])], 1)
    with pytest.raises(ValueError, match=r"position_ids: .* cannot follow positions of your own"):
        generate(model, second, second_mask, speculative_mode=None, cache=cache,
                 position_ids=torch.arange(second.shape[1]).expand_as(second))


ALL_MODES = {**MODES, "auto": {"speculative_mode": "auto"}}


@pytest.mark.parametrize("mode", ALL_MODES.values(), ids=list(ALL_MODES))
def test_generates_positional_arguments_and_a_prompt_given_twice_are_read_alike_in_every_mode(model, inputs, mode):
    """transformers' signature takes `generation_config` (and the rest) by position: auto refused it ("by name"), and
    a positional config saying auto reached an internal guard; a prompt given as inputs and as input_ids raised in
    plain decoding but was silently half-dropped in auto; `cache_implementation="paged"` (transformers' switch to
    continuous batching, which reads padding as prompt tokens) failed on a refusal of settings nobody passed."""
    ids, mask = inputs
    config = GenerationConfig(max_new_tokens=6, do_sample=False, pad_token_id=PAD, **mode)
    expected = plain(model, ids, mask, 6).sequences
    with torch.no_grad():
        assert torch.equal(model.generate(ids, config, attention_mask=mask), expected)
        assert torch.equal(model.generate(None, config, input_ids=ids, attention_mask=mask), expected)
        for repeated, kwargs in (("generation_config", {"generation_config": config}), ("inputs", {"inputs": ids})):
            with pytest.raises(TypeError, match=f"multiple values for argument '{repeated}'"):
                model.generate(ids, config, attention_mask=mask, **kwargs)
    with pytest.raises(ValueError, match=r"input_ids: the prompt is given as inputs .* too"):
        generate(model, ids, mask, input_ids=ids.flip(0), **mode)
    with pytest.raises(ValueError, match=r"cache_implementation='paged' .* model\.generate_batch"):
        generate(model, ids, mask, cache_implementation="paged", **mode)
    with pytest.raises(ValueError, match="output_attentions=True is not supported: .* never materializes"):
        generate(model, ids, mask, output_attentions=True, return_dict_in_generate=True, **mode)


@pytest.mark.parametrize("mode", MODES.values(), ids=list(MODES))
def test_non_finite_sampling_probabilities_raise_as_in_plain(model, inputs, mode):
    """A temperature that underflows in float32 (scores / 0) and a head whose logits are NaN give non-finite
    probabilities: plain sampling raises torch.multinomial's RuntimeError; so does every mode, instead of emitting
    tokens drawn from nothing."""
    with pytest.raises(RuntimeError, match="probability tensor contains either `inf`"):
        generate(model, *inputs, do_sample=True, temperature=1e-50, **mode)
    broken = tiny_spec_model(7, vocab=VOCAB)
    with torch.no_grad():
        broken.lm_head.weight[5] = float("nan")
    with pytest.raises(RuntimeError, match="probability tensor contains either `inf`"):
        generate(broken, *inputs, do_sample=True, **mode)


AUTO = {"speculative_mode": "auto"}
COUNTS = {  # a setting that counts tokens (or names ids, stop strings) given as something it cannot be -> the message
    "top_k=True": ({"top_k": True, "do_sample": True}, r"top_k=True is a bool"),
    "max_new_tokens=True": ({"max_new_tokens": True}, r"max_new_tokens=True is a bool"),
    "min_new_tokens=True": ({"min_new_tokens": True}, r"min_new_tokens=True is a bool"),
    "max_new_tokens=2.5": ({"max_new_tokens": 2.5}, r"max_new_tokens=2.5 is a float.*max_new_tokens=3"),
    "max_length=9.5": ({"max_new_tokens": None, "max_length": 9.5}, r"max_length=9.5 is a float"),
    "min_new_tokens=1.5": ({"min_new_tokens": 1.5}, r"min_new_tokens=1.5 is a float"),
    "min_new_tokens=tensor": ({"min_new_tokens": torch.tensor(2)}, r"min_new_tokens=tensor\(2\) counts tokens"),
    # strings failed in transformers' merge of the settings with a bare TypeError
    "max_new_tokens='3'": ({"max_new_tokens": "3"}, r"max_new_tokens='3' counts tokens"),
    "eos_token_id='x'": ({"eos_token_id": "x"}, r"eos_token_id='x' must be a token id \(an integer, or a list"),
    "eos_token_id=[1, 'a']": ({"eos_token_id": [1, "a"]}, r"eos_token_id=\[1, 'a'\] must be a token id"),
    "bos_token_id=2.0": ({"bos_token_id": 2.0}, r"bos_token_id=2.0 must be a token id"),
    "prefill_chunk_size=0": ({"prefill_chunk_size": 0}, r"prefill_chunk_size=0 must be a Python integer >= 1"),
    "prefill_chunk_size=np.int64(2)": ({"prefill_chunk_size": np.int64(2)}, r"prefill_chunk_size=np.int64\(2\)"),
    # a bare TypeError where transformers picks the decoding strategy (and in continuous batching's manager)
    "penalty_alpha='0.6'": ({"penalty_alpha": "0.6", "top_k": 4}, r"penalty_alpha='0.6' must be a number"),
    # stop strings transformers failed on with a bare TypeError or AttributeError, or stopped at once for ""
    "stop_strings=5": ({"stop_strings": 5}, r"stop_strings=5 must be a non-empty string or a non-empty list of them"),
    "stop_strings=[5]": ({"stop_strings": [5]}, r"stop_strings=\[5\] must be a non-empty string"),
    "stop_strings=['']": ({"stop_strings": [""]}, r"stop_strings=\[''\] must be .* \(an empty string would stop"),
    "stop_strings=[]": ({"stop_strings": []}, r"stop_strings=\[\] must be .* or None for no stop strings"),
}


@pytest.mark.parametrize("mode", [*MODES.values(), AUTO], ids=[*MODES, "auto"])
@pytest.mark.parametrize("case", COUNTS.values(), ids=list(COUNTS))
def test_a_count_that_is_no_integer_is_rejected_naming_it(model, inputs, mode, case):
    """`top_k=True` would be taken as 1 (or fail in torch.topk), `max_new_tokens=2.5` stop plain decoding after 3
    tokens and the speculative modes after 2, a tensor fail in some settings only: a ValueError naming the
    setting, in every mode, auto included."""
    setting, message = case
    ids, mask = inputs
    with pytest.raises(ValueError, match=message), torch.no_grad():
        model.generate(ids, attention_mask=mask, pad_token_id=PAD, **{"max_new_tokens": 4} | setting | mode)


@pytest.mark.parametrize("mode", [*MODES.values(), AUTO], ids=[*MODES, "auto"])
def test_a_penalty_alpha_of_any_number_type_decodes_as_plain(model, inputs, mode):
    """penalty_alpha 0 (with top_k > 1: greedy, as transformers decides) given as a Python, numpy or tensor number of
    any real dtype decodes plain's tokens; only what is no number is refused (the check first took 0-d floating
    tensors only)."""
    ids, mask = inputs
    want = generate(model, ids, mask)
    for alpha in (0, 0.0, Fraction(0), np.float32(0.0), np.int64(0), np.uint64(0), np.array(0.0), torch.tensor(0),
                  torch.tensor(0.0)):
        assert generate(model, ids, mask, penalty_alpha=alpha, top_k=4, **mode).tolist() == want.tolist()


@pytest.mark.parametrize("mode", [*MODES.values(), AUTO], ids=[*MODES, "auto"])
def test_token_ids_as_tensors_and_lists_still_pass(model, inputs, mode):
    ids, mask = inputs
    want = generate(model, ids, mask, eos_token_id=3)
    for eos in ([3], (3,), torch.tensor([3]), np.int64(3), np.array([3]), np.array(3), [torch.tensor(3)]):
        assert generate(model, ids, mask, eos_token_id=eos, **mode).tolist() == want.tolist()
    with torch.no_grad():
        for pad in (torch.tensor(PAD), np.array(PAD)):
            assert model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, eos_token_id=3,
                                  pad_token_id=pad, **mode).tolist() == want.tolist()
        for bad in ("x", [PAD], (PAD,)):  # (a list or tuple failed in transformers' validation with a TypeError)
            with pytest.raises(ValueError, match=r"pad_token_id=.* must be a token id \(an integer\)"):
                model.generate(ids, attention_mask=mask, max_new_tokens=6, eos_token_id=3, pad_token_id=bad, **mode)


@pytest.mark.parametrize("name", ["cache", "past_key_values"])
def test_a_cache_that_is_no_cache_is_refused_naming_it(model, inputs, name):
    """A string or a legacy tuple failed plain decoding and forward with an AttributeError deep inside."""
    ids, mask = inputs
    for mode in [*MODES.values(), AUTO]:
        with pytest.raises(ValueError, match=f"{name}: a str is no transformers Cache"):
            generate(model, ids, mask, **{name: "x"}, **mode)
    with pytest.raises(ValueError, match=f"{name}: a tuple is no transformers Cache"), torch.no_grad():
        model(ids, attention_mask=mask, **{name: ((ids, ids),)})


# --- speculative_mode=None over a checkpoint's speculative defaults -------------------------------------------------

SAVED_KEYS = {"speculative_mode": "pipeline", "draft_loops": 1, "second_draft_loops": 3,
              "speculative_engine": "wavefront", "compile_core": "eager", "num_speculative_tokens": 2}


@pytest.fixture(scope="module")
def speculative_checkpoint(tmp_path_factory):
    """A saved and reloaded model whose generation_config.json carries every speculative key."""
    folder = tmp_path_factory.mktemp("speculative_checkpoint")
    model = tiny_spec_model(7, vocab=VOCAB)
    model.generation_config = GenerationConfig(pad_token_id=PAD, do_sample=False, **SAVED_KEYS)
    model.save_pretrained(folder)
    loaded = OuroForCausalLM.from_pretrained(folder).eval()
    assert {key: getattr(loaded.generation_config, key) for key in SAVED_KEYS} == SAVED_KEYS
    return loaded


def test_speculative_mode_none_decodes_plainly_over_saved_speculative_keys(speculative_checkpoint, model, inputs):
    ids, mask = inputs
    expected = plain(model, ids, mask, 6).sequences  # the same weights without speculative keys
    with torch.no_grad():
        out = speculative_checkpoint.generate(ids, attention_mask=mask, max_new_tokens=6, speculative_mode=None,
                                              return_dict_in_generate=True)
    assert getattr(out, "speculation", None) is None
    assert out.sequences.tolist() == expected.tolist()


def test_plain_cli_mode_decodes_plainly_over_saved_speculative_keys(speculative_checkpoint, model, inputs):
    """`hf-loopspec generate --mode plain` passes what `prompting.generate_kwargs` gives."""
    ids, mask = inputs
    args = argparse.Namespace(max_new_tokens=6, do_sample=False, temperature=None, top_k=None, top_p=None,
                              repetition_penalty=None, mode="plain")
    kwargs = generate_kwargs(args, speculative_checkpoint, tokenizer=None)
    with torch.no_grad():
        out = speculative_checkpoint.generate(ids, attention_mask=mask, **kwargs)
    assert out.tolist() == plain(model, ids, mask, 6).sequences.tolist()


@pytest.mark.parametrize("key", ["second_draft_loops", "speculative_engine", "compile_core"])
def test_a_speculative_key_passed_with_speculative_mode_none_still_conflicts(speculative_checkpoint, inputs, key):
    ids, mask = inputs
    with pytest.raises(ValueError, match=rf"{key}={SAVED_KEYS[key]!r}"), torch.no_grad():
        speculative_checkpoint.generate(ids, attention_mask=mask, max_new_tokens=4, speculative_mode=None,
                                        **{key: SAVED_KEYS[key]})


def test_a_passed_config_naming_a_mode_decodes_plainly_under_speculative_mode_none(speculative_checkpoint, model,
                                                                                  inputs):
    """The checkpoint's own config passed as `generation_config=` (`GenerationConfig.from_pretrained`, or a copy of
    `model.generation_config`), with `speculative_mode=None`: its speculative keys go with the mode it names, as the
    model's own do. Its `second_draft_loops` was taken as passed by the call and raised "set that too" (the config
    set it), while its `draft_loops` was ignored."""
    ids, mask = inputs
    named = GenerationConfig(pad_token_id=PAD, do_sample=False, max_new_tokens=6, **SAVED_KEYS)
    cleared = copy.deepcopy(named)
    cleared.speculative_mode = None  # unset: the model's config fills it (a copy edited for plain decoding)
    for config in (named, cleared):
        with torch.no_grad():
            out = speculative_checkpoint.generate(ids, attention_mask=mask, generation_config=config,
                                                  speculative_mode=None, return_dict_in_generate=True)
        assert getattr(out, "speculation", None) is None
        assert out.sequences.tolist() == plain(model, ids, mask, 6).sequences.tolist()


def test_a_passed_config_without_a_mode_still_conflicts_with_plain_decoding(model, inputs):
    """A config that sets `second_draft_loops` but no mode, on a model without one: the key is that config's own."""
    ids, mask = inputs
    config = GenerationConfig(pad_token_id=PAD, do_sample=False, max_new_tokens=4, second_draft_loops=3)
    with pytest.raises(ValueError, match="second_draft_loops=3 is a setting of speculative_mode='pipeline'"), \
            torch.no_grad():
        model.generate(ids, attention_mask=mask, generation_config=config)


@pytest.mark.parametrize("empty", [torch.tensor([], dtype=torch.long), np.array([], dtype=np.int64)],
                         ids=["tensor", "array"])
def test_an_empty_forced_eos_collection_keeps_auto_in_one_stretch(empty):
    """transformers' forced-EOS processor still forces the last step for an empty id collection (every score -inf,
    token 0): auto decodes such a call in one stretch, as plain decodes it (read as unset, it split the call into
    segments that each forced their own last step; the array met numpy's "truth value is ambiguous" before that)."""
    from hf_loopspec.generation.auto_costs import Candidate, CostTable, set_costs
    from hf_loopspec.generation.auto_policy import AutoPolicy, set_policy

    model = tiny_spec_model(71, 4, vocab=VOCAB, damp=0.1)
    ids, mask = left_pad(random_prompts(2, [5, 2, 8], VOCAB))
    set_costs(model, CostTable(4.0, {Candidate("pipeline", 1): 2.0, Candidate("block", 1, 4): 2.0}))
    set_policy(model, AutoPolicy(interval=6, max_interval=12, probe_tokens=4, reprobe_after=1, min_verified=2))
    settings = dict(attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=PAD,
                    forced_eos_token_id=empty)
    expected = plain(model, ids, mask, 24, forced_eos_token_id=empty).sequences
    out = model.generate(ids, speculative_mode="auto", return_dict_in_generate=True, **settings)
    assert len(out.speculation.choices) == 1 and out.sequences.tolist() == expected.tolist()
