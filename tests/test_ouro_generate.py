"""`model.generate` on Ouro: greedy against a greedy loop over the independent reference, and every row of a
left-padded batch equal to its own unpadded run for greedy, beam search and num_return_sequences; sampling is
checked for shapes, validity, seeded reproducibility and top_k=1 == greedy. CPU, fp32, tiny random models."""

from __future__ import annotations

import pytest
import torch
from helpers import VOCAB, reference, tiny_model
from inputs import left_pad, random_ids
from tolerances import assert_fp32_close, ouro_depth
from transformers import CompileConfig
from transformers.cache_utils import DynamicCache, StaticCache

from hf_loopspec.generation.mixin import looped_static_cache

PAD = 1  # explicit pad id, distinct from Ouro's eos id 0
NEW = 12  # max_new_tokens
LENGTHS = (6, 3, 9)


@pytest.fixture(scope="module")
def setup():
    """(model, state_dict, prompts, padded ids, attention mask)."""
    model, sd = tiny_model(seed=201, num_key_value_heads=2)
    prompts = [random_ids(n, VOCAB, seed=210 + i) for i, n in enumerate(LENGTHS)]
    ids, mask = left_pad(prompts, PAD)
    return model, sd, prompts, ids, mask


def reference_greedy(sd, config, prompt, steps, eos):
    """Greedy decoding by re-running the reference on the whole sequence every step; stops after eos."""
    seq, step_logits = prompt.clone(), []
    for _ in range(steps):
        last = reference(sd, seq, config)["loop_logits"][-1, 0, -1]
        step_logits.append(last)
        token = last.argmax()
        seq = torch.cat([seq, token[None]])
        if eos is not None and int(token) == eos:
            break
    return seq, step_logits


def pad_right(seq, width):
    return torch.cat([seq, torch.full((width - len(seq),), PAD, dtype=seq.dtype)])


def assert_row_matches(batched_row, prompt_width, prompt, single):
    """A left-padded batch row equals the unpadded run of its prompt, followed by pad once that run stopped."""
    pad = prompt_width - len(prompt)
    assert (batched_row[:pad] == PAD).all()
    torch.testing.assert_close(batched_row[pad:], pad_right(single, len(batched_row) - pad), atol=0, rtol=0)


def generate(model, ids, mask=None, **kwargs):
    if mask is None:
        mask = torch.ones_like(ids)
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=NEW, pad_token_id=PAD, **kwargs)


# --- greedy -----------------------------------------------------------------------------------------------------


def test_greedy_padded_batch_matches_reference_greedy(setup):
    model, sd, prompts, ids, mask = setup
    out = generate(model, ids, mask, do_sample=False, return_dict_in_generate=True, output_logits=True)
    assert out.sequences.shape[0] == 3
    generated = 0
    for i, prompt in enumerate(prompts):
        expected, step_logits = reference_greedy(sd, model.config, prompt, NEW, eos=0)
        assert_row_matches(out.sequences[i], ids.shape[1], prompt, expected)
        for step, ref_logits in enumerate(step_logits):  # the raw logits of every decoding step
            assert_fp32_close(out.logits[step][i], ref_logits, **ouro_depth(model.config))
        generated = max(generated, len(expected) - len(prompt))
    assert generated >= 10  # the run is long enough to mean something


def test_greedy_each_row_alone_equals_reference(setup):
    model, sd, prompts, _, _ = setup
    for prompt in prompts:
        single = generate(model, prompt[None], do_sample=False)[0]
        expected, _ = reference_greedy(sd, model.config, prompt, NEW, eos=0)
        torch.testing.assert_close(single, expected, atol=0, rtol=0)


def test_greedy_eos_mid_generation_pads_finished_rows(setup):
    model, sd, prompts, ids, mask = setup
    free, _ = reference_greedy(sd, model.config, prompts[0], NEW, eos=None)
    continuation = free[len(prompts[0]):].tolist()
    eos = continuation[4]  # row 0 stops after 5 new tokens
    assert eos not in continuation[:4] and eos != PAD
    out = generate(model, ids, mask, do_sample=False, eos_token_id=eos)
    for i, prompt in enumerate(prompts):
        expected, _ = reference_greedy(sd, model.config, prompt, NEW, eos=eos)
        assert_row_matches(out[i], ids.shape[1], prompt, expected)
    assert (out[0, -(NEW - 5):] == PAD).all()


# --- beam search ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_return_sequences", [1, 2])
def test_beam_search_padded_batch_rows_equal_individual_runs(setup, num_return_sequences):
    model, _, prompts, ids, mask = setup
    kwargs = {"do_sample": False, "num_beams": 3, "num_return_sequences": num_return_sequences}
    batched = generate(model, ids, mask, **kwargs)
    assert batched.shape[0] == 3 * num_return_sequences
    for i, prompt in enumerate(prompts):
        single = generate(model, prompt[None], **kwargs)
        assert single.shape[0] == num_return_sequences
        for r in range(num_return_sequences):
            assert_row_matches(batched[i * num_return_sequences + r], ids.shape[1], prompt, single[r])


# --- sampling -----------------------------------------------------------------------------------------------------


def test_sampling_top_k_1_equals_greedy(setup):
    model, _, _, ids, mask = setup
    greedy = generate(model, ids, mask, do_sample=False)
    torch.manual_seed(0)
    sampled = generate(model, ids, mask, do_sample=True, top_k=1)
    torch.testing.assert_close(sampled, greedy, atol=0, rtol=0)


def test_sampling_shapes_validity_and_seeded_reproducibility(setup):
    model, _, _, ids, mask = setup
    runs = []
    for _ in range(2):
        torch.manual_seed(1234)
        runs.append(generate(model, ids, mask, do_sample=True, temperature=1.5, num_return_sequences=2))
    out = runs[0]
    torch.testing.assert_close(runs[1], out, atol=0, rtol=0)
    assert out.shape[0] == 6 and ids.shape[1] < out.shape[1] <= ids.shape[1] + NEW
    torch.testing.assert_close(out[:, : ids.shape[1]], ids.repeat_interleave(2, dim=0), atol=0, rtol=0)
    assert int(out.min()) >= 0 and int(out.max()) < model.config.vocab_size
    torch.manual_seed(99)
    assert not torch.equal(generate(model, ids, mask, do_sample=True, temperature=1.5, num_return_sequences=2), out)


# --- cache handling -----------------------------------------------------------------------------------------------


def test_generate_with_user_dynamic_cache_equals_default(setup):
    model, _, prompts, _, _ = setup
    prompt = prompts[2][None]
    torch.testing.assert_close(generate(model, prompt, cache=DynamicCache(), do_sample=False),
                               generate(model, prompt, do_sample=False), atol=0, rtol=0)


def test_generate_rejects_cache_sized_from_config(setup):
    model, _, prompts, _, _ = setup
    with pytest.raises(ValueError, match="loop"):
        generate(model, prompts[0][None], cache=DynamicCache(config=model.config), do_sample=False)


@pytest.mark.parametrize("mode", [None, "auto"])
@pytest.mark.parametrize("implementation", ["offloaded", "offloaded_static", "quantized"])
def test_cache_implementations_it_cannot_size_are_refused_by_name(setup, implementation, mode):
    """transformers would size these caches from num_hidden_layers (one plane), which a looped model overruns: a
    ValueError naming the setting and the two that work, not an error about a cache the caller never passed. Auto
    mode refuses it on every call, as any stretch may be plain (its first call, opened by a speculative stretch that
    ignored the setting, decoded; later ones, which auto began plainly, raised)."""
    model, _, prompts, _, _ = setup
    for _ in range(2 if mode else 1):
        with pytest.raises(ValueError, match=f"cache_implementation='{implementation}'.*'dynamic'.*'static'"):
            generate(model, prompts[0][None], do_sample=False, cache_implementation=implementation,
                     speculative_mode=mode)


def test_static_cache_generate_equals_dynamic(setup):
    """`cache_implementation="static"`: a StaticCache with one layer per (loop, layer), the 2-D padding mask kept
    (transformers would build 4-D masks for num_hidden_layers layers), unwritten capacity masked."""
    model, _, _, ids, mask = setup
    expected = generate(model, ids, mask, do_sample=False, eos_token_id=None)
    static = generate(model, ids, mask, do_sample=False, eos_token_id=None, cache_implementation="static")
    torch.testing.assert_close(static, expected, atol=0, rtol=0)
    with torch.no_grad():  # docs/generation.md: max_length - 1 positions (the last new token is never written)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, eos_token_id=None,
                             cache_implementation="static", return_dict_in_generate=True)
    assert {layer.max_cache_len for layer in out.past_key_values.layers} == {ids.shape[1] + 3 - 1}


def test_a_call_without_a_cache_ignores_cache_implementation_in_auto_mode_too(setup):
    """`use_cache=False`: plain decoding builds no cache, so any cache_implementation passes; auto's stretches build
    their own, and the first (plain) one raised on an unsupported one while a speculative first stretch ignored it,
    so the same call decoded or raised from one call to the next."""
    model, _, prompts, _, _ = setup
    ids = prompts[0][None]
    expected = generate(model, ids, do_sample=False, use_cache=False, cache_implementation="offloaded")
    for _ in range(3):
        assert torch.equal(generate(model, ids, do_sample=False, use_cache=False, cache_implementation="offloaded",
                                    speculative_mode="auto"), expected)


def test_prompt_lookup_on_a_static_cache_equals_plain_decoding(setup):
    """Prompt lookup verifies drafts that run past max_length (its output is cut there afterwards), so a static cache
    sized for max_length alone overflowed with an IndexError from index_copy_; it is sized for those drafts too."""
    model, _, _, _, _ = setup
    for seed in range(6):
        ids = random_ids((1, 8), VOCAB, seed=seed)
        expected = generate(model, ids, do_sample=False, eos_token_id=None)
        for lookup in (1, 4):
            out = generate(model, ids, do_sample=False, eos_token_id=None, prompt_lookup_num_tokens=lookup,
                           cache_implementation="static")
            assert torch.equal(out, expected), (seed, lookup)
    ids = random_ids((1, 8), VOCAB, seed=0)  # a static cache of the call's own size has no room for the drafts
    cache = looped_static_cache(model.config, model.kv_layout, ids.shape[1] + NEW - 1)
    with pytest.raises(ValueError, match=r"plus the 4 prompt lookup drafts .* or prompt lookup drafts"):
        generate(model, ids, do_sample=False, prompt_lookup_num_tokens=4, cache=cache)


def test_a_static_cache_continues_within_its_size_and_refuses_beyond_it(setup):
    """A static cache made with `max_cache_len` continues like a DynamicCache (a second turn after a first: one plain
    call's tokens); a call that would write past a static cache's positions raises a ValueError naming its size (an
    IndexError from index_copy_ before)."""
    model, _, prompts, _, _ = setup
    prompt, extra = prompts[1][None], random_ids((1, 3), VOCAB, seed=9)
    with torch.no_grad():
        first = model.generate(prompt, max_new_tokens=NEW, eos_token_id=None, cache_implementation="static",
                               max_cache_len=64, return_dict_in_generate=True)
        turn = torch.cat([first.sequences, extra], 1)
        second = model.generate(turn, cache=first.past_key_values, max_new_tokens=NEW, eos_token_id=None)
        expected = model.generate(turn, max_new_tokens=NEW, eos_token_id=None)
        torch.testing.assert_close(second, expected, atol=0, rtol=0)
        full = model.generate(prompt, max_new_tokens=NEW, eos_token_id=None, cache_implementation="static",
                              return_dict_in_generate=True)
        capacity = prompt.shape[1] + NEW - 1
        with pytest.raises(ValueError, match=f"holds {capacity} positions"):
            model.generate(torch.cat([full.sequences, extra], 1), cache=full.past_key_values, max_new_tokens=NEW)


@pytest.mark.parametrize("expand", [{"num_beams": 2}, {"do_sample": True, "num_return_sequences": 2}, {"rows": 2}],
                         ids=["beams", "return-sequences", "batch-2"])
def test_a_static_cache_of_other_rows_is_refused(setup, expand):
    """A filled static cache holds storage for the rows of the call that filled it: a call of more rows (beam search
    and num_return_sequences expand them) raises the ValueError naming the cache that a DynamicCache of other rows
    gets (torch's index_copy_ RuntimeError before), and leaves the cache as it was."""
    model, _, prompts, _, _ = setup
    rows = expand.pop("rows", 1)
    with torch.no_grad():
        first = model.generate(prompts[1][None], max_new_tokens=NEW, eos_token_id=None, return_dict_in_generate=True,
                               cache_implementation="static", max_cache_len=64)
        cache, turn = first.past_key_values, torch.cat([first.sequences, random_ids((1, 3), VOCAB, seed=9)], 1)
        kept = [layer.keys.clone() for layer in cache.layers]
        with pytest.raises(ValueError, match=r"holds keys of shape \(1, 2, 64, 16\) .* this call has batch size 2"):
            model.generate(turn.repeat(rows, 1), cache=cache, max_new_tokens=NEW, pad_token_id=PAD, **expand)
    assert all(torch.equal(layer.keys, keys) for layer, keys in zip(cache.layers, kept, strict=True))


@pytest.mark.parametrize("mode", [None, "auto", "pipeline", "block"])
@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_a_cache_with_sliding_window_layers_is_refused_in_every_mode(setup, kind, mode):
    """Sliding-window layers keep only their last columns, but every loop of a looped model attends to its whole
    history: a cache built from a config whose layer_types slide (sized one layer per plane and layer) is refused
    by name in every mode. Plain decoding returned other tokens than a DynamicCache() gives, or failed in a sliding
    layer's crop; a static cache with a full-attention first layer failed in the attention, one with a sliding first
    layer was told to grow its max_cache_len."""
    model, _, prompts, _, _ = setup
    config = model.config.__class__(**model.config.to_dict())
    config.num_hidden_layers = model.kv_layout.num_planes * model.kv_layout.num_layers
    config.sliding_window = 3
    config.layer_types = ["full_attention", "sliding_attention"] * (config.num_hidden_layers // 2)
    cache = DynamicCache(config=config) if kind == "dynamic" else StaticCache(config=config, max_cache_len=64)
    with pytest.raises(ValueError, match=r"past_key_values: a (Dynamic|Static)Cache with sliding-window layers "
                                         r"\(\[1, 3, 5, 7\]"):
        generate(model, prompts[0][None], past_key_values=cache, do_sample=False, speculative_mode=mode)
    assert cache.get_seq_length() == 0


@pytest.mark.parametrize("mode", [None, "auto", "pipeline", "block"])
def test_a_call_given_both_cache_and_past_key_values_is_refused(setup, mode):
    """transformers decoded into `cache` and left `past_key_values` unfilled without a word (nor checked it: a sliding
    cache there passed); refused in every mode, as a forward call refuses them."""
    model, _, prompts, _, _ = setup
    unused = DynamicCache()
    with pytest.raises(ValueError, match="Pass the KV cache as `cache` or as `past_key_values`, not both"):
        generate(model, prompts[0][None], cache=DynamicCache(), past_key_values=unused, do_sample=False,
                 speculative_mode=mode)
    assert unused.get_seq_length() == 0


@pytest.mark.parametrize("mode", [None, "auto", "pipeline", "block"])
def test_a_dynamic_cache_cropped_to_no_columns_keeps_its_rows(setup, mode):
    """A DynamicCache cropped to no columns still holds its rows' (empty) keys, which transformers appends to: a call
    of another batch size is refused in every mode, naming the cache (plain decoding failed in torch's cat, the
    speculative modes took it); of the same rows it decodes as a fresh cache does."""
    model, _, prompts, ids, mask = setup
    cache = DynamicCache()
    generate(model, ids, mask, cache=cache, do_sample=False)
    cache.crop(-cache.get_seq_length())
    with pytest.raises(ValueError, match=r"holds keys of shape \(3, 2, 0, 16\) .* this call has batch size 1"):
        generate(model, prompts[0][None], cache=cache, do_sample=False, speculative_mode=mode)
    torch.testing.assert_close(generate(model, ids, mask, cache=cache, do_sample=False, speculative_mode=mode),
                               generate(model, ids, mask, do_sample=False), atol=0, rtol=0)


@pytest.mark.parametrize("exit_at_step", [None, 1])
def test_forward_compiles_whole_with_a_padding_mask(setup, exit_at_step):
    """`torch.compile(model.forward, fullgraph=True)` of a padded batch (a graph break raises): the mask's checks read
    it on the host (whether it holds only 0 and 1, whether it masks anything), which a trace cannot; traced, they are
    skipped, as the token ids' check is, and the mask is always applied. Compiled logits equal eager ones to fp32
    rounding over the forward's depth (aot_eager may decompose ops another way)."""
    model, _, _, ids, mask = setup
    torch._dynamo.reset()
    compiled = torch.compile(model.forward, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        for use_cache in (False, True):
            expected = model(ids, attention_mask=mask, use_cache=use_cache, exit_at_step=exit_at_step).logits
            actual = compiled(ids, attention_mask=mask, use_cache=use_cache, exit_at_step=exit_at_step).logits
            assert_fp32_close(actual, expected, **ouro_depth(model.config))


def test_a_step_on_a_static_cache_without_a_mask_compiles_whole(setup):
    """A decode step through `torch.compile(model.forward, fullgraph=True)` on a filled static cache and no attention
    mask: its positions start at the cache's length, a tensor, which they once took as an `arange` bound (dynamo's
    internal error on an unbacked symbol). Compiled logits equal an eager step's on a twin cache to fp32 rounding."""
    model, _, prompts, _, _ = setup
    prompt, step = prompts[1][None], random_ids((1, 1), VOCAB, seed=3)
    eager_cache, traced_cache = (looped_static_cache(model.config, model.kv_layout, 32) for _ in range(2))
    torch._dynamo.reset()
    compiled = torch.compile(model.forward, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        model(prompt, cache=eager_cache)
        model(prompt, cache=traced_cache)
        expected = model(step, cache=eager_cache).logits
        actual = compiled(step, cache=traced_cache).logits
    assert_fp32_close(actual, expected, **ouro_depth(model.config))


def test_transformers_compiled_static_path_equals_dynamic(setup):
    """transformers' own compiled decoding (static cache + `compile_config`; forced on CPU, aot_eager backend)."""
    model, _, _, ids, mask = setup
    config = CompileConfig(backend="aot_eager", mode=None)
    config._compile_all_devices = True
    expected = generate(model, ids, mask, do_sample=False, eos_token_id=None)
    compiled = generate(model, ids, mask, do_sample=False, eos_token_id=None, cache_implementation="static",
                        compile_config=config)
    torch.testing.assert_close(compiled, expected, atol=0, rtol=0)
