"""Native Huginn (`huginn_raven`): logits against the independent reference, caches, padding, loading, errors.

The reference (tests/huginn_reference.py) is written from huginn.md alone; both variants are covered: Huginn-0125
(sandwich blocks, interleaved RoPE, MHA, q/k bias, embedding scale sqrt(E), tied embeddings) and the retrofitted
layout (pre-norm blocks, rotate-half RoPE, GQA, no q/k bias, embedding scale 1, untied head).
"""

from __future__ import annotations

import json
import logging
import math
import re

import numpy as np
import pytest
import torch
from huginn_utils import (
    PAD,
    VARIANTS,
    VOCAB,
    reference,
    tiny_huginn,
    tiny_huginn_config,
    write_hub_folder,
)
from inputs import left_pad, random_ids
from tolerances import assert_fp32_close, huginn_depth
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, GenerationConfig
from transformers.cache_utils import DynamicCache

from hf_loopspec import HuginnConfig, HuginnForCausalLM, HuginnModel, PagedLoopCache
from hf_loopspec.generation.mixin import looped_static_cache


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("num_steps", [1, 3])
def test_step_logits_match_reference_zero_state(variant, num_steps):
    model, sd = tiny_huginn(variant, seed=1)
    ids = random_ids((2, 9), VOCAB, seed=2)
    with torch.no_grad():
        out = model(ids, num_steps=num_steps, init_scale=0.0, output_step_logits=True, use_cache=False)
    ref = reference(sd, ids, model.config, torch.zeros(2, 9, model.config.n_embd), num_steps)
    assert len(out.step_logits) == num_steps
    depth = huginn_depth(model.config, num_steps)
    for step in range(num_steps):
        assert_fp32_close(out.step_logits[step], ref["step_logits"][step], **depth)
    assert_fp32_close(out.logits, ref["step_logits"][-1], **depth)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_and_states_match_reference_random_state(variant):
    """With init_scale 1 the model's own keyed states are fed to the reference (their law is tested below)."""
    model, sd = tiny_huginn(variant, seed=3)
    ids = random_ids((2, 7), VOCAB, seed=4)
    with torch.no_grad(), model.recurrence(num_steps=4, init_scale=1.0, init_seed=11):
        positions = torch.arange(7).expand(2, 7)
        sequences = torch.arange(2)[:, None].expand(2, 7)
        state = model.transformer.initial_state(sequences, positions, torch.zeros(2, 7, model.config.n_embd))
        out = model(ids, output_hidden_states=True, output_step_logits=True, use_cache=False)
    assert state.abs().sum() > 0
    ref = reference(sd, ids, model.config, state, 4)
    depth = huginn_depth(model.config, 4)
    assert_fp32_close(out.logits, ref["step_logits"][-1], **depth)
    for step in range(4):
        assert_fp32_close(out.hidden_states[1 + step], ref["states"][step], **depth)
    model.config.output_hidden_states = True  # the default of a call that passes none (it was ignored)
    with torch.no_grad(), model.recurrence(num_steps=4, init_scale=1.0, init_seed=11):
        by_config = model(ids, use_cache=False)
    assert torch.equal(torch.stack(by_config.hidden_states), torch.stack(out.hidden_states))


def test_step_logits_equal_shallower_runs():
    """Step r's logits are what `num_steps = r + 1` gives (the coda has a KV plane per exit depth)."""
    model, _ = tiny_huginn(seed=5)
    ids = random_ids((1, 6), VOCAB, seed=6)
    with torch.no_grad():
        deep = model(ids, num_steps=5, init_scale=1.0, init_seed=3, output_step_logits=True)
        for steps in (1, 2, 4):
            shallow = model(ids, num_steps=steps, init_scale=1.0, init_seed=3)
            assert_fp32_close(deep.step_logits[steps - 1], shallow.logits, **huginn_depth(model.config, steps))


def test_initial_state_law_and_keys():
    model, _ = tiny_huginn()
    width, n = model.config.n_embd, 4000
    std = math.sqrt(2 / (5 * width))
    like = torch.zeros(n, width)
    with model.recurrence(init_scale=2.0, init_seed=7):
        state = model.transformer.initial_state(torch.zeros(n, dtype=torch.long), torch.arange(n), like)
        again = model.transformer.initial_state(torch.tensor([0, 1]), torch.tensor([5, 5]), like[:2])
    raw = state / math.sqrt(width)  # embed scale sqrt(E)
    assert raw.abs().max() <= 3 * 2 * std + 1e-6  # cut at 3 std of std * init_scale
    assert 0.85 * 2 * std < raw.std() < 2 * std  # a normal truncated at 3 sigma keeps 98.7% of its std
    assert abs(float(raw.mean())) < 0.01 * std
    torch.testing.assert_close(again[0], state[5])  # keyed by (seed, sequence, position) ...
    assert not torch.equal(again[1], state[5])  # ... so another sequence at the same position differs
    with model.recurrence(init_scale=2.0, init_seed=8):
        other_seed = model.transformer.initial_state(torch.tensor([0]), torch.tensor([5]), like[:1])
    assert not torch.equal(other_seed[0], state[5])
    with model.recurrence(init_scale=0.0):
        assert torch.equal(model.transformer.initial_state(torch.tensor([0]), torch.tensor([5]), like[:1]),
                           torch.zeros(1, width))


def test_unseeded_runs_vary_and_torch_seed_reproduces():
    model, _ = tiny_huginn(seed=9)
    ids = random_ids((1, 5), VOCAB, seed=1)
    with torch.no_grad():
        torch.manual_seed(0)
        a = model(ids).logits
        b = model(ids).logits
        torch.manual_seed(0)
        c = model(ids).logits
    assert not torch.allclose(a, b)
    assert torch.equal(a, c)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("cache_kind", ["dynamic", "paged"])
def test_cached_decoding_equals_full_forward(variant, cache_kind):
    model, _ = tiny_huginn(variant, seed=2)
    ids = random_ids((2, 10), VOCAB, seed=3)
    settings = {"num_steps": 3, "init_scale": 1.0, "init_seed": 21}
    with torch.no_grad():
        full = model(ids, use_cache=False, **settings).logits
        with model.recurrence(**settings):
            cache = DynamicCache() if cache_kind == "dynamic" else PagedLoopCache(model.kv_layout, page_size=4,
                                                                                    debug=True)
        out = model(ids[:, :6], cache=cache, **settings)
        steps = [out.logits]
        for t in range(6, 10):
            out = model(ids[:, t : t + 1], cache=out.cache, **settings)
            steps.append(out.logits)
    assert_fp32_close(torch.cat(steps, dim=1), full, **huginn_depth(model.config, 3))


@pytest.mark.parametrize("beams_from", ["argument", "the model's generation config"])
def test_beam_search_with_random_states_equals_full_recomputation(beams_from):
    """Beam search reorders the beams between steps: states keyed by the batch row made a beam's cached tokens carry
    another row's states, so the cached search chose other beams than the same search recomputed in full. A beam's
    tokens now draw their prompt's states, the same wherever the beam moves, also when `num_beams` comes from the
    model's generation config under a passed one (which transformers fills from it)."""
    model, _ = tiny_huginn(seed=2, damp=0.5)
    ids, mask = left_pad([random_ids((6,), VOCAB, seed=4), random_ids((4,), VOCAB, seed=5)])
    settings = dict(attention_mask=mask, max_new_tokens=10, num_return_sequences=2, init_scale=1.0, init_seed=123,
                    speculative_mode=None, return_dict_in_generate=True, output_scores=True)
    if beams_from == "argument":
        settings["num_beams"] = 3
    else:
        model.generation_config.num_beams = 3
        settings["generation_config"] = GenerationConfig(pad_token_id=model.generation_config.pad_token_id)
    cached, full = (model.generate(ids, use_cache=use_cache, **settings) for use_cache in (True, False))
    assert torch.equal(cached.sequences, full.sequences)
    # a beam's score is its per-token log-probabilities over its length: each within a forward's bound
    assert_fp32_close(cached.sequences_scores, full.sequences_scores,
                      **huginn_depth(model.config, model.config.mean_recurrence))


@pytest.mark.parametrize("given_in", ["argument", "passed config"])
def test_num_beams_1_passed_over_a_beam_search_config_keys_states_by_row(given_in):
    """`num_beams=1` given to `generate`, or set in a passed `GenerationConfig` (whose default is unset), wins over
    the model's generation config's 3 (as in transformers): the call decodes greedily, with each row's own states,
    as on a model whose config has no beams. A passed config's 1 was taken as unset: rows drew other rows' states."""
    model, _ = tiny_huginn(seed=2, damp=0.5)
    ids = random_ids((3, 5), VOCAB, seed=6)
    settings = dict(max_new_tokens=6, init_scale=1.0, init_seed=7, speculative_mode=None)
    given = ({"num_beams": 1} if given_in == "argument"
             else {"generation_config": GenerationConfig(num_beams=1, do_sample=False,
                                                         pad_token_id=model.generation_config.pad_token_id)})
    model.generation_config.num_beams = 3
    over = model.generate(ids, **given, **settings)
    model.generation_config.num_beams = 1
    assert torch.equal(over, model.generate(ids, **settings))


@pytest.mark.parametrize("mode", [None, "pipeline", "auto"])
def test_num_steps_whose_kv_cannot_fit_raise_before_allocating(mode):
    """`num_steps=10**9` (e.g. in a served request's generation config): the cache filled its per-plane records
    before any check (MemoryError, or the server's model process killed); plain decoding raised a SystemError. One
    token's KV over 2 * 10**9 + 1 planes exceeds any machine's memory: a `ValueError` names the setting first."""
    model, _ = tiny_huginn()
    with pytest.raises(ValueError, match=r"num_steps=1000000000: one token's KV over its 2000000001 planes"):
        model.generate(random_ids((1, 3), VOCAB), num_steps=10**9, max_new_tokens=3, speculative_mode=mode)
    # without a prelude (no entry plane) the layout's plane check scanned every plane: refused at once too
    model = HuginnForCausalLM(tiny_huginn_config(n_layers_in_prelude=0))
    with pytest.raises(ValueError, match=r"num_steps=1000000000: one token's KV over its 2000000000 planes"):
        model.generate(random_ids((1, 3), VOCAB), num_steps=10**9, max_new_tokens=3, speculative_mode=mode)


def test_static_cache_generate_equals_dynamic():
    model, _ = tiny_huginn("retrofitted", seed=8)
    ids, mask = left_pad([random_ids(n, VOCAB, seed=n) for n in (5, 2)], PAD)
    settings = {"num_steps": 3, "init_scale": 1.0, "init_seed": 4, "max_new_tokens": 6, "do_sample": False,
                "pad_token_id": PAD, "eos_token_id": None}
    with torch.no_grad():
        expected = model.generate(ids, attention_mask=mask, **settings)
        static = model.generate(ids, attention_mask=mask, cache_implementation="static", **settings)
    assert static.tolist() == expected.tolist()


def test_continuing_a_cache_with_other_settings_raises():
    model, _ = tiny_huginn()
    ids = random_ids((1, 4), VOCAB)
    with torch.no_grad():
        out = model(ids, num_steps=3, init_scale=0.0)
        with pytest.raises(ValueError, match="continue a cache with the settings that filled it"):
            model(ids[:, :1], cache=out.cache, num_steps=2, init_scale=0.0)
        with pytest.raises(ValueError, match="per-step outputs"):
            model(ids[:, :1], cache=out.cache, num_steps=3, init_scale=0.0, output_step_logits=True)


def test_a_refused_continuation_leaves_the_cache_as_it_was():
    """More steps than filled the cache: refused at the first plane the cache lacks, after the planes before it were
    written; those writes are rolled back, so the retry with the right settings equals one forward over the whole
    sequence (the token landed one position late, silently)."""
    model, _ = tiny_huginn()
    ids = random_ids((1, 7), VOCAB, seed=21)
    settings = {"num_steps": 2, "init_scale": 0.0}
    with torch.no_grad():
        cache = model(ids[:, :6], **settings).cache
        lengths = [cache.get_seq_length(layer) for layer in range(len(cache.layers))]
        with pytest.raises(ValueError, match="continue a cache with the settings that filled it"):
            model(ids[:, 6:], cache=cache, num_steps=4, init_scale=0.0)
        assert [cache.get_seq_length(layer) for layer in range(len(cache.layers))] == lengths
        continued = model(ids[:, 6:], cache=cache, **settings).logits[:, -1]
        whole = model(ids, **settings).logits[:, -1]
    assert_fp32_close(continued, whole, **huginn_depth(model.config, 2))


def test_a_static_cache_sized_for_other_steps_is_refused():
    """A static cache holds the planes of the steps it was made for: another number of steps is refused (fewer
    decoded on it silently, with other planes' KV)."""
    model, _ = tiny_huginn()
    ids = random_ids((1, 6), VOCAB, seed=22)
    with model.recurrence(num_steps=4):
        cache = looped_static_cache(model.config, model.kv_layout, 16)
    with torch.no_grad(), pytest.raises(ValueError, match=r"cache has \d+ layers.*filled with another number of "
                                                          "loops or recurrence steps"):
        model(ids, cache=cache, num_steps=3, init_scale=0.0)


def test_padded_batch_equals_rows_alone():
    """Upstream ignores the attention mask; here a left-padded row gives what it gives alone (forward and generate)."""
    model, _ = tiny_huginn(seed=4)
    rows = [random_ids(n, VOCAB, seed=10 + n) for n in (7, 3, 5)]
    ids, mask = left_pad(rows, PAD)
    settings = {"num_steps": 3, "init_scale": 0.0}
    with torch.no_grad():
        batched = model(ids, attention_mask=mask, **settings).logits
        generated = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=PAD,
                                   eos_token_id=None, **settings)
        for i, row in enumerate(rows):
            alone = model(row[None], **settings).logits
            assert_fp32_close(batched[i, -len(row):], alone[0], **huginn_depth(model.config, 3))
            alone_gen = model.generate(row[None], max_new_tokens=6, do_sample=False, pad_token_id=PAD,
                                       eos_token_id=None, **settings)
            assert generated[i, -6:].tolist() == alone_gen[0, -6:].tolist()


def test_padded_batch_keys_random_states_by_real_position():
    """With random states, row i of a padded batch equals row i of a batch in which only row i is real: states
    are keyed by (sequence, position of the real token), not by the padded column."""
    model, _ = tiny_huginn(seed=4)
    rows = [random_ids(n, VOCAB, seed=10 + n) for n in (7, 3, 5)]
    ids, mask = left_pad(rows, PAD)
    settings = {"num_steps": 3, "init_scale": 1.0, "init_seed": 5}
    with torch.no_grad():
        batched = model(ids, attention_mask=mask, **settings).logits
        for i, row in enumerate(rows):
            only = torch.full((len(rows), len(row)), PAD, dtype=torch.long)
            only_mask = torch.zeros_like(only)
            only[i], only_mask[i] = row, 1
            alone = model(only, attention_mask=only_mask, **settings).logits
            assert_fp32_close(batched[i, -len(row):], alone[i], **huginn_depth(model.config, 3))


def test_save_and_load_round_trip(tmp_path):
    model, _ = tiny_huginn("retrofitted", seed=6)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is HuginnForCausalLM
    ids = random_ids((1, 5), VOCAB)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids, init_scale=0.0).logits, model(ids, init_scale=0.0).logits)


@pytest.mark.parametrize("marked", [False, True])
def test_recurrence_settings_of_the_generation_config_survive_save_and_load(tmp_path, marked):
    """`num_steps`, `init_scale` and `init_seed` set on the generation config are saved and loaded back, also from a
    file marked `_from_model_config` (which transformers strips of non-standard keys: before, the saved file was so
    marked, and a reloaded model drew random initial states on every greedy call)."""
    model, _ = tiny_huginn(seed=6)
    settings = {"num_steps": 2, "init_scale": 0.5, "init_seed": 11}
    for key, value in settings.items():
        setattr(model.generation_config, key, value)
    model.save_pretrained(tmp_path)
    path = tmp_path / "generation_config.json"
    if marked:  # as transformers or an older version may write it
        path.write_text(json.dumps({**json.loads(path.read_text()), "_from_model_config": True}))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert {key: getattr(loaded.generation_config, key, None) for key in settings} == settings
    ids = random_ids((1, 5), VOCAB)
    greedy = {"max_new_tokens": 6, "do_sample": False, "eos_token_id": None, "pad_token_id": 0}
    expected = model.generate(ids, speculative_mode=None, **greedy, **settings)
    assert torch.equal(loaded.generate(ids, speculative_mode=None, **greedy), expected)


@pytest.mark.parametrize("marked", [False, True])
def test_exit_options_in_a_saved_generation_config_are_refused_by_name(tmp_path, marked):
    """Huginn has no exit options: a generation_config.json asking for one fails each generate with the package's
    ValueError naming it (transformers' "model_kwargs are not used" before), also when the file is marked
    `_from_model_config` (transformers drops such keys: the option vanished without a word); one that asks for nothing
    decodes."""
    model, _ = tiny_huginn(seed=6)
    model.save_pretrained(tmp_path)
    path = tmp_path / "generation_config.json"
    saved = json.loads(path.read_text())
    ids, greedy = random_ids((1, 5), VOCAB), {"max_new_tokens": 4, "do_sample": False, "init_scale": 0.0}
    expected = model.generate(ids, **greedy)
    for extra, asks in (({"exit_threshold": 1.0}, True), ({"use_weighted_exit": False}, False)):
        path.write_text(json.dumps({**saved, "_from_model_config": marked, **extra}))
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
        if asks:
            with pytest.raises(ValueError, match="exit_threshold=1.0: HuginnForCausalLM has no exit options"):
                loaded.generate(ids, **greedy)
        else:
            assert torch.equal(loaded.generate(ids, **greedy), expected)


@pytest.mark.parametrize("trust_remote_code", [False, True])
def test_hub_layout_folder_loads(tmp_path, trust_remote_code, caplog):
    """config.json with the upstream auto_map and `tie_embeddings`, safetensors with `freqs_cis` and a second copy of
    the tied embedding, no Python files: loads natively through the Auto classes, weights intact."""
    config = tiny_huginn_config()
    model, sd = tiny_huginn(seed=7)
    folder = write_hub_folder(tmp_path / "huginn", config, sd, dtype=torch.float32)
    loaded = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=trust_remote_code).eval()
    assert type(loaded) is HuginnForCausalLM and loaded.config.tie_word_embeddings
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()
    ids = random_ids((1, 6), VOCAB, seed=8)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids, init_scale=0.0).logits, model(ids, init_scale=0.0).logits)
    assert type(AutoModel.from_pretrained(folder)) is HuginnModel
    cfg = AutoConfig.from_pretrained(folder)
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_hidden_layers) == (32, 4, 6)
    # saved, it names no upstream code it does not write (raven_config_minimal.py: a folder that failed to load)
    with caplog.at_level(logging.WARNING, logger="hf_loopspec"):
        loaded.save_pretrained(tmp_path / "saved")
    assert any("raven_config_minimal.RavenConfig" in r.getMessage() for r in caplog.records)
    assert "auto_map" not in json.loads((tmp_path / "saved" / "config.json").read_text())
    assert type(AutoModelForCausalLM.from_pretrained(tmp_path / "saved")) is HuginnForCausalLM


def test_upstream_config_with_another_n_layers_loads_with_a_warning(tmp_path, caplog):
    """The upstream code builds the model from the per-stage layer counts, whatever `n_layers` says: such a
    config.json loads (weights intact) with a warning that names both numbers, and `n_layers` becomes the sum."""
    config = tiny_huginn_config()
    model, sd = tiny_huginn(seed=7)
    folder = write_hub_folder(tmp_path / "huginn", config, sd, dtype=torch.float32)
    config_json = json.loads((folder / "config.json").read_text())
    config_json["n_layers"] = 9  # prelude 2 + recurrent block 2 + coda 2 = 6
    (folder / "config.json").write_text(json.dumps(config_json))
    with caplog.at_level(logging.WARNING, logger="hf_loopspec"):
        loaded = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert any("n_layers=9" in r.getMessage() and "= 6" in r.getMessage() for r in caplog.records)
    assert loaded.config.n_layers == loaded.config.num_hidden_layers == 6
    ids = random_ids((1, 6), VOCAB, seed=8)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids, init_scale=0.0).logits, model(ids, init_scale=0.0).logits)


@pytest.mark.parametrize("bad", [0, None, 2.5, True])
def test_a_bad_mean_recurrence_set_on_a_loaded_model_is_refused_at_once(bad):
    """A loaded model reads `mean_recurrence` at every call: a bad one set after load was taken, and every call then
    failed in the KV layout (`first_exit_plane=1`, a TypeError for None), naming no setting. It is refused on
    assignment, as when the config is made, and the model keeps decoding at its steps."""
    model, _ = tiny_huginn(seed=4)
    ids = random_ids((1, 4), VOCAB, seed=5)
    settings = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0, "init_scale": 0.0}
    expected = model.generate(ids, **settings)
    with pytest.raises(ValueError, match=rf"HuginnConfig.mean_recurrence={bad!r} is invalid: it must be a positive"):
        model.config.mean_recurrence = bad
    assert torch.equal(model.generate(ids, **settings), expected)
    model.config.mean_recurrence = 2  # (a good one applies)
    assert torch.equal(model.generate(ids, **settings), model.generate(ids, **settings, num_steps=2))


@pytest.mark.parametrize(("key", "value", "named"), [
    ("rope_style", "foo", "rope_style='foo' must be one of"), ("rope_style", None, "rope_style=None must be one of"),
    ("init_values", {"std": -1.0}, r"init_values=\{'std': -1\.0, .*: give a dict of finite numbers"),
    ("init_values", {"embed_scale": "x"}, r"init_values=.*'embed_scale': 'x'\}: give a dict of finite numbers"),
    ("init_values", {"std": 10**400}, r"init_values=\{'std': 10{400}, .*: give a dict of finite numbers"),
    ("qk_bias", "false", "qk_bias='false' is invalid")])
def test_a_bad_rope_style_init_values_or_switch_set_on_a_loaded_model_is_refused_at_once(key, value, named):
    """Set on a loaded model's config, they were taken: another rope_style decoded as "rotate_half" without a word,
    init_values failed in the initial states' draw (torch's RuntimeError, or a float() ValueError naming no setting).
    Refused on assignment, as when the config is made; the model keeps decoding as before."""
    model, _ = tiny_huginn(seed=4)
    ids = random_ids((1, 4), VOCAB, seed=5)
    settings = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0, "init_scale": 1.0, "init_seed": 3}
    expected = model.generate(ids, **settings)
    with pytest.raises(ValueError, match=rf"HuginnConfig.{named}"):
        setattr(model.config, key, value)
    assert torch.equal(model.generate(ids, **settings), expected)


@pytest.mark.parametrize(("key", "value", "named"), [
    ("rope_base", 0.0, "rope_base=0.0"), ("rope_theta", "x", "rope_theta='x'"), ("norm_eps", -1.0, "norm_eps=-1.0"),
    ("rope_parameters", {"rope_theta": float("nan")}, "rope_base=nan"),
    pytest.param("rope_base", 10**400, f"rope_base={10**400}", id="rope_base-no-float"),  # (an OverflowError before)
    pytest.param("norm_eps", 10**400, f"norm_eps={10**400}", id="norm_eps-no-float")])
def test_a_bad_rope_base_or_norm_eps_set_on_a_loaded_model_is_refused_at_once(key, value, named):
    """Checked as when the config is made: a loaded model reads them at every call, and they were taken (NaN
    logits, a TypeError naming no setting)."""
    model, _ = tiny_huginn(seed=4)
    before = (model.config.rope_base, model.config.rope_theta, model.config.norm_eps)
    with pytest.raises(ValueError, match=rf"HuginnConfig.{re.escape(named)} is invalid"):
        setattr(model.config, key, value)
    assert (model.config.rope_base, model.config.rope_theta, model.config.norm_eps) == before


@pytest.mark.parametrize(("key", "value", "named", "built"), [
    ("vocab_size", 200, "vocab_size=200", VOCAB), ("n_heads", 8, "num_attention_heads=8", 4),
    ("intermediate_size", 64, "intermediate_size=64", 48), ("norm_eps", 0.5, "norm_eps=0.5", 1e-06),
    ("qk_bias", False, "qk_bias=False", True),
    ("block_class_name", "TransformerPreNormBlock", "block_class_name='TransformerPreNormBlock'", "SandwichBlock")])
def test_a_setting_the_modules_fix_assigned_after_building_is_refused_by_calls_and_by_save(key, value, named, built,
                                                                                         tmp_path):
    """The model ignored these (the modules keep what they were built with: a larger vocab_size let ids past the
    embedding through to an IndexError), and save_pretrained wrote them into a checkpoint that did not load, or
    loaded as another model (norm_eps). Refused naming the setting, as the layer counts and KV sizes are; set back,
    the model decodes and saves."""
    model, _ = tiny_huginn(seed=4)
    assert getattr(model.config, key) != value
    ids = random_ids((1, 4), VOCAB, seed=5)
    setattr(model.config, key, value)
    message = rf"config.{re.escape(named)}, but the model was built with {re.escape(str(built))}: .* set it back"
    for mode in (None, "pipeline"):
        with pytest.raises(ValueError, match=message):
            model.generate(ids, max_new_tokens=2, do_sample=False, init_scale=0.0, speculative_mode=mode)
    with pytest.raises(ValueError, match=message):
        model.save_pretrained(tmp_path / "edited")
    setattr(model.config, key, built)
    model.save_pretrained(tmp_path / "restored")
    assert getattr(AutoModelForCausalLM.from_pretrained(tmp_path / "restored").config, key) == built


def test_a_tied_model_set_untied_is_refused_by_save(tmp_path):
    """Huginn ties its head by default: `tie_embeddings=False` assigned after building was saved into a checkpoint
    without lm_head.weight, which from_pretrained refused."""
    model, _ = tiny_huginn(seed=4)
    model.config.tie_embeddings = False
    with pytest.raises(ValueError, match=r"config.tie_word_embeddings=False, but this model's LM head shares"):
        model.save_pretrained(tmp_path / "edited")
    model.config.tie_embeddings = True
    model.save_pretrained(tmp_path / "restored")
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "restored").config.tie_word_embeddings


def test_a_setting_changed_after_the_config_is_made_changes_what_the_model_is_built_from(tmp_path):
    """`from_pretrained`'s keyword overrides and assignments come after the config is made: one name of a setting
    with two sets both, and the model follows (an untied head; another rotary base), and its save reloads as it was;
    a stage count sets n_layers to the new sum. `num_hidden_layers` alone (the model is built from the stage counts)
    raises. Before, `tie_embeddings=False` and `rope_theta=` were ignored by the model (its save did not load, or
    loaded with the other base), and `num_hidden_layers=9` built 6 layers under a config saying 9."""
    model, sd = tiny_huginn(seed=7)
    folder = write_hub_folder(tmp_path / "huginn", tiny_huginn_config(), sd, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"n_layers \(num_hidden_layers\)=9 differs .* = 6"):
        AutoModelForCausalLM.from_pretrained(folder, num_hidden_layers=9)

    untied = AutoModelForCausalLM.from_pretrained(folder, tie_embeddings=False)
    assert untied.config.tie_word_embeddings is False
    assert untied.lm_head.weight.data_ptr() != untied.transformer.wte.weight.data_ptr()
    rotated = AutoModelForCausalLM.from_pretrained(folder, rope_theta=1000.0)
    assert rotated.config.rope_base == 1000.0
    # transformers 5's name for it (`rope_parameters`; before: stored and never read), a scaling refused
    given = AutoModelForCausalLM.from_pretrained(folder, rope_parameters={"rope_type": "default", "rope_theta": 1000.0})
    assert given.config.rope_base == given.config.rope_theta == 1000.0
    assert "rope_parameters" not in given.config.to_dict()
    with pytest.raises(ValueError, match=r"rope_parameters=\{'rope_type': 'yarn'.* uses plain RoPE"):
        tiny_huginn_config(rope_parameters={"rope_type": "yarn", "factor": 2.0})
    scaled = json.loads((folder / "config.json").read_text())  # the older name, which transformers turns into it
    (tmp_path / "scaled").mkdir()
    (tmp_path / "scaled" / "config.json").write_text(json.dumps({**scaled, "rope_scaling": {"rope_type": "linear",
                                                                                            "factor": 4.0}}))
    with pytest.raises(ValueError, match=r"rope_scaling=\{'rope_type': 'linear'.* uses plain RoPE"):
        AutoConfig.from_pretrained(tmp_path / "scaled")  # (before: loaded unscaled, saved a config that did not load)
    with pytest.raises(ValueError, match=r"rope_scaling=\{'rope_type': 'linear'.* uses plain RoPE"):
        AutoModelForCausalLM.from_pretrained(folder, rope_scaling={"rope_type": "linear", "factor": 4.0})  # (TypeError)
    set_later = AutoModelForCausalLM.from_pretrained(folder)
    set_later.config.rope_parameters = {"rope_type": "default", "rope_theta": 1000.0}  # applies at once
    ids = random_ids((1, 6), VOCAB, seed=8)
    with torch.no_grad():
        reference = model(ids, init_scale=0.0).logits
        assert not torch.allclose(rotated(ids, init_scale=0.0).logits, reference)  # the model rotates by the override
        assert torch.equal(given(ids, init_scale=0.0).logits, rotated(ids, init_scale=0.0).logits)
        assert torch.equal(set_later(ids, init_scale=0.0).logits, rotated(ids, init_scale=0.0).logits)
        for changed in (untied, rotated, set_later):
            changed.save_pretrained(tmp_path / "saved")
            reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
            torch.testing.assert_close(reloaded(ids, init_scale=0.0).logits, changed(ids, init_scale=0.0).logits)

    config = tiny_huginn_config()
    config.n_layers_in_recurrent_block = 3
    assert config.num_hidden_layers == config.n_layers_in_prelude + 3 + config.n_layers_in_coda
    assert len(HuginnForCausalLM(config).transformer.core_block) == 3

    # init_values given later gets the defaults of the keys it leaves out, as the constructor fills them (a bare
    # KeyError before); a value that is no dict of numbers is named
    width = tiny_huginn_config().n_embd
    defaults = {"std": math.sqrt(2 / (5 * width)), "embed_scale": math.sqrt(width)}
    for given in ({"embed_scale": 1.0}, {"std": 0.02}, None):
        loaded = AutoModelForCausalLM.from_pretrained(folder, init_values=given)
        assert loaded.config.init_values == {**defaults, **(given or {})}
    with pytest.raises(ValueError, match=r"init_values='x': give a dict"):
        AutoModelForCausalLM.from_pretrained(folder, init_values="x")


def test_bf16_hub_folder_loads_in_bf16(tmp_path):
    config = tiny_huginn_config("retrofitted")
    _, sd = tiny_huginn("retrofitted")
    folder = write_hub_folder(tmp_path / "bf16", config, sd)
    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype="auto")
    assert loaded.dtype == torch.bfloat16
    with torch.no_grad():
        assert loaded(random_ids((1, 4), VOCAB), init_scale=0.0).logits.dtype == torch.float32


def test_mismatched_checkpoint_raises(tmp_path):
    config = tiny_huginn_config()
    _, sd = tiny_huginn()
    del sd["transformer.adapter.weight"]
    folder = write_hub_folder(tmp_path / "broken", config, sd, dtype=torch.float32)
    with pytest.raises(ValueError, match="adapter"):
        AutoModelForCausalLM.from_pretrained(folder)


@pytest.mark.parametrize("overrides, match", [
    ({"n_heads": 5}, "not divisible by n_heads"),
    ({"n_heads": 8, "num_key_value_heads": 3, "qk_bias": False}, "num_key_value_heads"),
    ({"num_key_value_heads": 2}, "qk_bias"),
    ({"rope_style": "complex"}, "rope_style"),
    # a string switch read as True: the model built the biases, then every call refused them (qk_bias), or tied
    ({"qk_bias": "false"}, r"HuginnConfig.qk_bias='false' is invalid: pass True or False"),
    ({"qk_bias": None}, r"HuginnConfig.qk_bias=None is invalid"),
    # a TypeError in transformers' generation config when the model was built
    ({"pad_token_id": "3"}, r"HuginnConfig.pad_token_id='3' is invalid: it must be None or an integer"),
    ({"tie_embeddings": "false"}, r"HuginnConfig.tie_embeddings='false' is invalid"),
    # a std of 0 or inf failed in the initial states' draw (ZeroDivisionError, a torch RuntimeError), an infinite
    # embed_scale gave NaN logits and greedy token 0
    ({"init_values": {"std": 0.0}}, r"init_values=\{'std': 0\.0, .*finite numbers `std` > 0.*init_scale=0"),
    ({"init_values": {"std": float("inf")}}, r"init_values=\{'std': inf"),
    ({"init_values": {"embed_scale": float("inf")}}, r"'embed_scale': inf\}: give a dict of finite numbers"),
    ({"block_class_name": "Other"}, "block_class_name"),
    ({"tie_embeddings": True, "tie_word_embeddings": False}, "disagree"),
    ({"mean_recurrence": 0}, "mean_recurrence"),
    ({"padded_vocab_size": 128}, "padded_vocab_size"),
    # Checked before the head width, init std or stage sum are derived from them (bare ZeroDivisionError,
    # "math domain error" and TypeError before):
    ({"n_embd": 0}, "n_embd=0"),
    ({"n_embd": -8}, "n_embd=-8"),
    ({"n_layers_in_prelude": None}, "n_layers_in_prelude=None"),
    ({"n_layers_in_coda": True}, "n_layers_in_coda=True"),
    ({"rope_base": 0.0}, "rope_base=0.0 is invalid"),  # (NaN logits before)
    ({"rope_theta": -5.0, "rope_base": None}, "rope_base=-5.0 is invalid"),
    ({"norm_eps": -1e-6}, "norm_eps=-1e-06 is invalid"),  # (NaN logits before)
    ({"torch_dtype": "float13"}, "HuginnConfig.torch_dtype='float13' is no torch dtype"),  # (torch's AttributeError)
    ({"rope_theta": 2.0, "rope_base": 3.0}, "rope_base=3.0 and rope_theta=2.0 disagree"),
    # rope_parameters' base won without a word
    ({"rope_base": 3.0, "rope_parameters": {"rope_theta": 2.0}}, r"rope_theta=3\.0 and rope_parameters=.* disagree"),
    # a NaN base given once (or under both names) was said to disagree with itself
    ({"rope_theta": math.nan, "rope_base": None}, "rope_base=nan is invalid"),
    ({"rope_base": math.nan, "rope_theta": float("nan")}, "rope_base=nan is invalid"),
    ({"rope_base": math.nan, "rope_parameters": {"rope_theta": math.nan}}, "rope_base=nan is invalid"),
])
def test_bad_configs_raise(overrides, match):
    with pytest.raises(ValueError, match=match):
        tiny_huginn_config(**overrides)


def test_keywords_naming_one_setting_twice_must_agree(tmp_path):
    """`from_pretrained` / `AutoConfig.from_pretrained` keywords that give one setting two values (its two names, or
    a `rope_parameters` base): transformers sets them one after the other, so the last won without a word; they are
    refused as the constructor (config.json) refuses them. Equal values load; "sdpa" (all the model runs) loads."""
    model, _ = tiny_huginn()
    model.save_pretrained(tmp_path)
    for keywords, named in (({"rope_theta": 10.0, "rope_base": 20.0}, "rope_base=20.0 and rope_theta=10.0"),
                            ({"rope_base": 20.0, "rope_parameters": {"rope_theta": 10.0}}, "rope_base=20.0 and rope_p"),
                            ({"tie_embeddings": False, "tie_word_embeddings": True}, "tie_embeddings=False and tie_w")):
        for load in (AutoModelForCausalLM.from_pretrained, AutoConfig.from_pretrained):
            with pytest.raises(ValueError, match=f"{re.escape(named)}.* disagree"):
                load(tmp_path, **keywords)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, rope_theta=10.0, rope_base=10.0, attn_implementation="sdpa")
    assert loaded.config.rope_base == loaded.config.rope_theta == 10.0
    with pytest.raises(ValueError, match="rope_base=0.0 is invalid"):
        AutoModelForCausalLM.from_pretrained(tmp_path, rope_base=0.0)
    # a saved config.json holds both names: one edited alone was ignored (rope_theta won, silently)
    saved = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**saved, "rope_base": 10000.0}))
    with pytest.raises(ValueError, match=r"rope_base=10000\.0 and rope_theta=.* disagree"):
        AutoConfig.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**saved, "rope_parameters": {"rope_theta": 777.0}}))
    with pytest.raises(ValueError, match=r"\(config.json\): rope_base=50000\.0 and .*rope_parameters=.* disagree"):
        AutoConfig.from_pretrained(tmp_path)  # (rope_parameters won, silently)
    one_name = tiny_huginn_config(rope_theta=10000.0, rope_base=None), tiny_huginn_config(rope_base=10000.0)
    assert [(c.rope_base, c.rope_theta) for c in one_name] == [(1e4, 1e4)] * 2


def test_resized_hub_checkpoint_saves_a_config_that_loads(tmp_path):
    """A Hub config.json carries `padded_vocab_size` (equal to `vocab_size`): resizing the embeddings moves both, so
    the saved folder loads back (before, it raised that padded_vocab_size differs from vocab_size)."""
    config = tiny_huginn_config()
    _, sd = tiny_huginn(seed=7)
    folder = write_hub_folder(tmp_path / "hub", config, sd, dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert model.config.padded_vocab_size == VOCAB
    model.resize_token_embeddings(VOCAB + 23)
    model.save_pretrained(tmp_path / "resized")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "resized").eval()
    assert loaded.config.vocab_size == loaded.config.padded_vocab_size == VOCAB + 23
    ids = random_ids((1, 5), VOCAB + 23, seed=3)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids, init_scale=0.0).logits, model.eval()(ids, init_scale=0.0).logits)


def test_overrides_given_to_from_pretrained_are_checked(tmp_path):
    """transformers sets `from_pretrained`'s keyword overrides after the config checked itself; the model checks
    them before building (`mean_recurrence=0` loaded and the forward raised a bare IndexError)."""
    config = tiny_huginn_config()
    _, sd = tiny_huginn(seed=7)
    folder = write_hub_folder(tmp_path / "hub", config, sd, dtype=torch.float32)
    with pytest.raises(ValueError, match="mean_recurrence=0"):
        AutoModelForCausalLM.from_pretrained(folder, mean_recurrence=0)


def test_output_attentions_raises_instead_of_returning_none():
    model, _ = tiny_huginn()
    ids = random_ids((1, 4), VOCAB)
    for module in (model, model.transformer):
        with pytest.raises(ValueError, match="output_attentions=True"):
            module(ids, output_attentions=True, init_scale=0.0)


def test_aliases_and_tie_names():
    config = HuginnConfig(hidden_size=16, num_attention_heads=2, num_hidden_layers=4, vocab_size=10,
                          intermediate_size=8, n_layers_in_prelude=1, n_layers_in_recurrent_block=2,
                          n_layers_in_coda=1, tie_embeddings=False)
    assert (config.n_embd, config.n_heads, config.n_layers, config.head_dim) == (16, 2, 4, 8)
    assert config.tie_word_embeddings is False
    assert HuginnConfig(tie_word_embeddings=False).tie_embeddings is False


@pytest.mark.parametrize("kwargs, match", [
    ({"num_steps": 0}, "num_steps"),
    ({"num_steps": 2.5}, "num_steps"),
    ({"init_scale": -1.0}, "init_scale"),
    ({"init_seed": -3}, "init_seed"),
    ({"init_scale": math.inf}, r"init_scale=inf must be a finite number"),  # trunc_normal_'s bare RuntimeError
    ({"init_scale": 10**400}, r"init_scale=10{400} must be a finite number"),  # (an OverflowError before)
    ({"init_seed": 2**64 + 5}, r"in \[0, 2\*\*64\)"),  # would have acted as seed 5
    ({"num_steps": True}, "num_steps"),
])
def test_bad_recurrence_arguments_raise(kwargs, match):
    model, _ = tiny_huginn()
    ids = random_ids((1, 3), VOCAB)
    with pytest.raises(ValueError, match=match):
        model(ids, **kwargs)
    with pytest.raises(ValueError, match=match):
        model.generate(ids, max_new_tokens=2, **kwargs)


def test_numpy_recurrence_settings_are_their_values():
    """numpy scalars (a config read with numpy, a swept grid) are taken as the Python numbers they hold."""
    model, _ = tiny_huginn()
    ids = random_ids((1, 3), VOCAB)
    settings = {"num_steps": 3, "init_scale": 0.5, "init_seed": 9}
    with torch.no_grad():
        expected = model(ids, **settings).logits
        actual = model(ids, num_steps=np.int64(3), init_scale=np.float32(0.5), init_seed=np.uint32(9)).logits
    torch.testing.assert_close(actual, expected, atol=0, rtol=0)


def test_a_passed_generation_config_takes_unset_recurrence_settings_from_the_models():
    """transformers fills a passed generation config's unset keys from the model's: so do the recurrence settings
    (`generate(generation_config=GenerationConfig(...))` decoded at mean_recurrence steps while auto's calibration and
    continuous batching, which merge the configs, used the model's num_steps)."""
    model, _ = tiny_huginn(seed=4)
    ids = random_ids((1, 4), VOCAB, seed=5)
    settings = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0, "init_scale": 0.0}
    at = {steps: model.generate(ids, num_steps=steps, **settings) for steps in (3, model.config.mean_recurrence)}
    assert not torch.equal(*at.values())
    model.generation_config.num_steps = 3
    try:
        assert torch.equal(model.generate(ids, generation_config=GenerationConfig(**settings)), at[3])
        passed = GenerationConfig(**settings, num_steps=model.config.mean_recurrence)  # the passed config's first
        assert torch.equal(model.generate(ids, generation_config=passed), at[model.config.mean_recurrence])
    finally:
        model.generation_config.num_steps = None


@pytest.mark.parametrize("mode", [None, "pipeline", "auto"])
def test_an_open_block_decides_over_the_models_generation_config_in_generate_as_in_forward(mode):
    """One order for a recurrence setting everywhere: the call's argument, else a passed generation config's, else an
    open `model.recurrence(...)` block's, else the model's generation config's. `generate` read the model's config
    before the block (a model loaded with `num_steps=3` decoded 3 steps inside `recurrence(num_steps=2)`, where
    forward ran 2). The reference is `generate` given the settings as arguments, which no block or config overrides."""
    model, _ = tiny_huginn(seed=4)
    ids = random_ids((2, 4), VOCAB, seed=5)
    settings = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0, "speculative_mode": mode}
    at = {steps: model.generate(ids, **settings, num_steps=steps, init_scale=0.0) for steps in (2, 3)}
    assert not torch.equal(at[2], at[3])
    model.generation_config.num_steps, model.generation_config.init_scale = 3, 0.0
    try:
        assert torch.equal(model.generate(ids, **settings), at[3])
        with model.recurrence(num_steps=2):
            assert torch.equal(model.generate(ids, **settings), at[2])
            assert torch.equal(model.generate(ids, **settings, num_steps=3), at[3])
            passed = GenerationConfig(**settings, num_steps=3)
            assert torch.equal(model.generate(ids, generation_config=passed), at[3])
            assert torch.equal(model.generate(ids, generation_config=GenerationConfig(**settings)), at[2])
    finally:
        model.generation_config.num_steps = model.generation_config.init_scale = None


@pytest.mark.parametrize("mode", [None, "pipeline"])
def test_a_generate_inside_another_calls_streamer_takes_its_callers_settings(mode):
    """A `generate` made from another call's streamer (a web app's side request) read that call's num_steps and
    init_scale, left out of its own arguments, from the call's open block: its tokens were another model's. It
    resolves them from its caller's blocks (none, or one opened in the streamer), as it would outside the call; so does
    a continuous batching manager built there."""
    model, _ = tiny_huginn(seed=4)
    ids = random_ids((1, 4), VOCAB, seed=5)
    settings = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0, "speculative_mode": None}
    batched = GenerationConfig(**settings, init_seed=3)  # (a continuous batching manager's, built there)
    run = lambda: next(iter(model.generate_batch([ids[0].tolist()], generation_config=batched).values()))  # noqa: E731
    alone, batch_alone = model.generate(ids, **settings, init_seed=3), run().generated_tokens
    with model.recurrence(num_steps=2, init_scale=1.0):
        in_block = model.generate(ids, **settings, init_seed=3)
    assert not torch.equal(alone, in_block)
    inner = []

    class Streamer:
        def put(self, value):
            if not inner:
                inner.extend([model.generate(ids, **settings, init_seed=3), run().generated_tokens])
                with model.recurrence(num_steps=2, init_scale=1.0):  # (a block opened there holds; it starts
                    # from the running call's settings, as a forward there runs at them)
                    inner.append(model.generate(ids, **settings, init_seed=3))

        def end(self):
            pass

    model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0, speculative_mode=mode, num_steps=3,
                   init_scale=0.0, streamer=Streamer())
    assert torch.equal(inner[0], alone) and inner[1] == batch_alone and torch.equal(inner[2], in_block)
    assert batch_alone == alone[0, ids.shape[1]:].tolist()


def test_from_pretrained_takes_recurrence_settings_and_the_position_limit_has_its_usual_name(tmp_path):
    """`from_pretrained(path, num_steps=..., init_scale=...)` (lm-eval's `--model_args`) puts them in the generation
    config, checked as `generate` checks them; `block_size` answers as `max_position_embeddings` too, where
    transformers and lm-eval look for a model's position limit."""
    model, _ = tiny_huginn(seed=2)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, num_steps=3, init_scale=0.0)
    assert (loaded.generation_config.num_steps, loaded.generation_config.init_scale) == (3, 0.0)
    state = torch.random.get_rng_state()
    AutoModelForCausalLM.from_pretrained(tmp_path, num_steps=3)  # checked in a block that draws a seed: none kept
    assert torch.equal(torch.random.get_rng_state(), state)
    ids = random_ids((1, 4), VOCAB, seed=3)
    expected = model.generate(ids, max_new_tokens=5, do_sample=False, num_steps=3, init_scale=0.0)
    assert torch.equal(loaded.generate(ids, max_new_tokens=5, do_sample=False), expected)
    with pytest.raises(ValueError, match="num_steps=0 must be an integer >= 1"):
        AutoModelForCausalLM.from_pretrained(tmp_path, num_steps=0)
    with pytest.raises(ValueError, match="num_steps=3: generation settings, but HuginnModel does not generate"):
        AutoModel.from_pretrained(tmp_path, num_steps=3)  # (transformers' TypeError for an unknown keyword before)
    assert loaded.config.max_position_embeddings == loaded.config.block_size
    assert HuginnConfig(**{**loaded.config.to_dict(), "max_position_embeddings": 64}).block_size == 64


def test_forward_outside_a_block_runs_the_generation_configs_recurrence_settings(tmp_path):
    """A model loaded with `num_steps=3, init_scale=0` (lm-eval's `--model_args`, also from Python) scores with them
    as it generates with them: forward used to run mean_recurrence steps from random states, so lm-eval's `HFLM`
    scored another model than the one it generated with. The generation config's settings are the model's defaults
    (`num_loops`, `kv_layout`, a block that sets only some settings); an argument of forward, or a block's setting
    (`generate` runs forward in one), still decides over them."""
    model, _ = tiny_huginn(seed=2)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, num_steps=3, init_scale=0.0).eval()
    ids = random_ids((2, 5), VOCAB, seed=4)
    with torch.no_grad():
        at = {steps: model(ids, num_steps=steps, init_scale=0.0).logits for steps in (2, 3)}
        assert not torch.equal(at[2], at[3])
        torch.testing.assert_close(loaded(ids).logits, at[3], atol=0, rtol=0)  # the same computation
        torch.testing.assert_close(loaded(ids, num_steps=2).logits, at[2], atol=0, rtol=0)
        with loaded.recurrence(num_steps=2, init_scale=0.0):
            torch.testing.assert_close(loaded(ids).logits, at[2], atol=0, rtol=0)
        with loaded.recurrence(init_seed=5):  # the other two stay the generation config's
            torch.testing.assert_close(loaded(ids).logits, at[3], atol=0, rtol=0)
        seeded = model(ids, num_steps=3, init_scale=1.0, init_seed=7).logits
        loaded.generation_config.init_scale, loaded.generation_config.init_seed = 1.0, 7
        torch.testing.assert_close(loaded(ids).logits, seeded, atol=0, rtol=0)
    with model.recurrence(num_steps=3):
        three = model.kv_layout
    assert loaded.num_loops == 3 and loaded.kv_layout == three != model.kv_layout  # (a cache built for it fits)



def test_a_bad_generation_config_setting_fails_only_the_calls_that_read_it():
    """A config value is read, and checked, only where the call gives none (a bad `init_seed` in a checkpoint's
    generation_config.json failed calls that passed all three settings), and its error names the config."""
    model, _ = tiny_huginn(seed=2)
    ids = random_ids((1, 4), VOCAB, seed=3)
    model.generation_config.init_seed = -1
    with torch.no_grad():
        explicit = model(ids, num_steps=3, init_scale=0.0, init_seed=3).logits
        model.generation_config.init_seed = None
        assert torch.equal(model(ids, num_steps=3, init_scale=0.0, init_seed=3).logits, explicit)
        model.generation_config.init_seed = -1
        with pytest.raises(ValueError, match=r"the model's generation_config: init_seed=-1 must be an integer"):
            model(ids, num_steps=3, init_scale=0.0)
        settings = {"num_steps": 3, "init_scale": 0.0, "init_seed": 3, "max_new_tokens": 3, "do_sample": False}
        plain = model.generate(ids, **settings, speculative_mode=None)  # auto's calibration read the config's
        assert torch.equal(model.generate(ids, **settings, speculative_mode="auto"), plain)
    # a passed config's bad value is named as the config's (it read as an argument's), where the call reads it
    model.generation_config.init_seed = None
    passed = GenerationConfig(num_steps=0, max_new_tokens=3, do_sample=False)
    with pytest.raises(ValueError, match=r"^generation_config: num_steps=0 must be an integer >= 1"):
        model.generate(ids, generation_config=passed)
    with pytest.raises(ValueError, match=r"^generation_config: num_steps=0 must be an integer >= 1"):
        model.generate_batch([ids[0].tolist()], generation_config=passed)
    assert torch.equal(model.generate(ids, generation_config=passed, num_steps=3, init_scale=0.0, init_seed=3),
                       model.generate(ids, max_new_tokens=3, do_sample=False, num_steps=3, init_scale=0.0, init_seed=3))


def test_a_whole_model_pickled_before_the_config_was_shared_loads_with_it():
    """`torch.save(model)` by an earlier version kept the generation config under `generation_config` in the
    model's `__dict__`, which the property hides: loading must move it there (it came back None, and generate
    failed), shared with the base model again."""
    model, _ = tiny_huginn(seed=2)
    model.generation_config.num_steps = 3
    state = model.__getstate__()
    state["generation_config"] = state.pop("_generation_config")  # the layout of the earlier version
    state["_modules"]["transformer"].__dict__.pop("generation_config")
    old = HuginnForCausalLM.__new__(HuginnForCausalLM)
    old.__setstate__(state)
    assert old.generation_config.num_steps == old.num_loops == 3
    assert old.transformer.generation_config is old.generation_config


def test_bad_inputs_raise():
    model, _ = tiny_huginn()
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model(torch.tensor([[3, 500]]))
    with pytest.raises(ValueError, match="inputs_embeds` is not supported"):
        model(inputs_embeds=torch.zeros(1, 2, 32))
    with pytest.raises(ValueError, match="input_ids: none given"):  # (it blamed inputs_embeds, never passed)
        model(attention_mask=torch.ones(1, 2, dtype=torch.long))
    for bad in (torch.arange(2.0), torch.ones(2, dtype=torch.bool)):  # (float: a TypeError keying the states)
        with pytest.raises(ValueError, match=f"position_ids has dtype {bad.dtype}; .* integer tensor"):
            model(torch.tensor([[3, 5]]), position_ids=bad, init_scale=1.0)


@pytest.mark.parametrize(("filled", "continued"), [(4, 2), (6, 3)])
def test_a_dynamic_cache_of_more_steps_is_refused(filled, continued):
    """A `DynamicCache` that `generate` filled at more recurrence steps holds planes this call would misread (its
    core planes as entry and exit planes): refused, where it decoded meaningless tokens."""
    model, _ = tiny_huginn()
    ids = random_ids((2, 5), VOCAB)
    settings = {"init_scale": 0.0, "do_sample": False, "pad_token_id": PAD, "eos_token_id": None}
    cache = DynamicCache()
    with torch.no_grad():
        first = model.generate(ids, cache=cache, max_new_tokens=3, num_steps=filled, **settings)
        with pytest.raises(ValueError, match=f"this call writes {2 * continued + 1} planes .* settings that filled it"):
            model.generate(first, cache=cache, max_new_tokens=2, num_steps=continued, **settings)


def test_a_layer_count_assigned_after_building_is_refused_naming_it():
    """The KV layout read the config's stage sizes at every call: a count assigned on a built model's config laid
    the KV out for layers it does not have (an IndexError in the engine, a cache error naming no setting)."""
    model, _ = tiny_huginn(seed=3)
    ids = random_ids((1, 4), VOCAB)
    model.config.n_layers_in_recurrent_block = 1
    message = r"config.n_layers_in_recurrent_block=1, but the model was built with 2: .* set it back to 2"
    for mode in (None, "pipeline"):
        with pytest.raises(ValueError, match=message):
            model.generate(ids, max_new_tokens=2, do_sample=False, speculative_mode=mode)
    model.config.n_layers_in_recurrent_block = 2
    assert model.generate(ids, max_new_tokens=2, do_sample=False).shape == (1, 6)
    for name in ("num_key_value_heads", "head_dim", "n_embd"):  # (the KV sizes too: an index_copy_ RuntimeError;
        value = getattr(model.config, name)  # the width: a view's RuntimeError drawing the initial states)
        setattr(model.config, name, value // 2)
        for mode in (None, "pipeline"):
            with pytest.raises(ValueError, match=rf"config.{name}={value // 2}, but the model was built with {value}"):
                model.generate(ids, max_new_tokens=2, do_sample=False, speculative_mode=mode)
        setattr(model.config, name, value)


@pytest.mark.parametrize(("filled", "continued"), [(2, 4), (3, 6)])
def test_a_dynamic_cache_of_fewer_steps_is_refused_and_left_as_it_was(filled, continued):
    """Continued at more recurrence steps, a `DynamicCache` has its planes where this call reads others (its entry
    plane as a core plane, with fewer layers): refused up front naming the fix (the entry and exit planes every call
    writes are not where this call's are), where plain decoding raised a RuntimeError of mismatched sizes inside
    attention; the cache still continues at the steps that filled it. (Entry and exit stages of one layer, fewer
    than the core's two: the plane's first layer alone reads as filled.)"""
    model, _ = tiny_huginn(n_layers_in_prelude=1, n_layers_in_coda=1)
    ids = random_ids((2, 5), VOCAB)
    settings = {"init_scale": 0.0, "do_sample": False, "pad_token_id": PAD, "eos_token_id": None, "max_new_tokens": 3}
    cache = DynamicCache()
    with torch.no_grad():
        first = model.generate(ids, cache=cache, num_steps=filled, **settings)
        held = [None if layer.keys is None else layer.keys.clone() for layer in cache.layers]  # (unused: None)
        longer = torch.cat([first, first[:, -1:]], 1)  # (two columns to feed: the last token, and one more)
        with pytest.raises(ValueError, match=rf"holds KV in \d+ layers, but this call writes "
                                             rf"{2 * continued + 1} planes x 2 layers .* continue a cache with the "
                                             "settings that filled"):
            model.generate(longer, cache=cache, num_steps=continued, speculative_mode=None, **settings)
        assert all(keys is layer.keys is None or torch.equal(layer.keys, keys)
                   for layer, keys in zip(cache.layers, held, strict=True))
        again = model.generate(longer, cache=cache, num_steps=filled, **settings)
        assert torch.equal(again, model.generate(longer, num_steps=filled, **settings))


def test_seeded_initial_states_do_not_depend_on_torchs_default_dtype():
    """The keyed initial states were drawn into a tensor of torch's default dtype: under
    `torch.set_default_dtype(torch.float64)` the same fp32 model and `init_seed` gave other logits and tokens."""
    model, _ = tiny_huginn(seed=6)
    ids = random_ids((2, 5), VOCAB)
    settings = {"num_steps": 3, "init_scale": 1.0, "init_seed": 4}
    with torch.no_grad():
        want = model(ids, **settings).logits
        before = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        try:
            got = model(ids, **settings).logits
        finally:
            torch.set_default_dtype(before)
    assert torch.equal(got, want)
