"""Ouro's exit options (`exit_at_step`, `exit_threshold`, `use_weighted_exit`) passed to `generate`: both speculative
modes give plain decoding's tokens on the wavefront engine, and plain's `ValueError` for invalid values before any
work.

Plain decoding runs every loop and feeds the selected loop's logits (or their gate-weighted mean) to the token
choice; each option is first shown to change plain decoding's output, so equality is not vacuous. Drafts still
come from depth d, so they are both accepted and rejected. With second proposals (a chosen sibling carries its
loop outputs into the main lane's slot) the engine's counters equal the lane decoder's, the reference.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from inputs import left_pad, random_prompts
from speculative_utils import (
    MODE_PAIR,
    PAD,
    assert_cache_matches_ar,
    assert_counter_invariants,
    engine_settings,
    mode_params,
    paged_cache,
    plain,
    speculative,
    tiny_spec_model,
)
from tolerances import ouro_depth
from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig
from transformers.generation.streamers import BaseStreamer

from hf_loopspec.generation.auto_costs import Candidate, CostTable, set_costs
from hf_loopspec.generation.auto_policy import AutoPolicy, set_policy

VOCAB = 64
NEW = 16
EXIT_NAMES = ("exit_at_step", "exit_threshold", "use_weighted_exit")
OPTIONS = {"exit_at_step=1": {"exit_at_step": 1}, "exit_threshold=0.9": {"exit_threshold": 0.9},
           "use_weighted_exit": {"use_weighted_exit": True}}


@pytest.fixture(scope="module")
def setup():
    model = tiny_spec_model(91, 4, vocab=VOCAB, damp=0.15)
    ids, mask = left_pad(random_prompts(91, [6, 3], VOCAB))
    return model, ids, mask, plain(model, ids, mask, NEW).sequences


@pytest.mark.parametrize("mode,d,k", mode_params(MODE_PAIR))
@pytest.mark.parametrize("name", list(OPTIONS))
def test_exit_options_give_plain_tokens(setup, name, mode, d, k):
    model, ids, mask, last_loop = setup
    ref = plain(model, ids, mask, NEW, **OPTIONS[name])
    assert ref.sequences.tolist() != last_loop.tolist()
    out = speculative(model, ids, mask, NEW, mode, d, k, speculative_engine="wavefront", **OPTIONS[name])
    assert out.speculation.engine == "wavefront"
    assert out.sequences.tolist() == ref.sequences.tolist()
    assert_counter_invariants(out.speculation, [NEW, NEW])
    assert_cache_matches_ar(out.cache, ref.cache, mask, [NEW, NEW], model.config.num_hidden_layers,
                            model_depth=ouro_depth(model.config))


@pytest.mark.parametrize("loops,d", [(2, 1), (4, 2)])
@pytest.mark.parametrize("name", list(OPTIONS))
def test_exit_options_when_every_lane_slot_is_a_head_column(loops, d, name):
    """Pipeline with U / d = 2 lanes: both slots are head columns, in slot order, so the target is column 0 only
    every other cycle. The exit rule's logits went to whichever slot was in column 0, and tokens left plain's with
    margins of 0.1-0.9 (a differential probe found it)."""
    model = tiny_spec_model(93, loops, vocab=VOCAB, damp=0.15)
    ids, mask = left_pad(random_prompts(93, [6, 3], VOCAB))
    ref = plain(model, ids, mask, NEW, **OPTIONS[name])
    out = speculative(model, ids, mask, NEW, "pipeline", d, **OPTIONS[name])
    assert out.sequences.tolist() == ref.sequences.tolist()
    assert_counter_invariants(out.speculation, [NEW, NEW])


@pytest.mark.parametrize("name", list(OPTIONS))
def test_exit_options_with_second_proposals_count_as_the_lane_decoder(setup, name):
    """Pipeline with second proposals from depth 3 (siblings chosen by the exit's targets): plain's tokens, and the
    lane decoder's counters, on the engine."""
    model, ids, mask, _ = setup
    ref = plain(model, ids, mask, NEW, **OPTIONS[name])
    runs = {engine: speculative(model, ids, mask, NEW, "pipeline", 1, second_draft_loops=3,
                                **engine_settings(model, engine), **OPTIONS[name]) for engine in ("wavefront", "lanes")}
    assert runs["wavefront"].speculation.engine == "wavefront"
    assert runs["wavefront"].sequences.tolist() == ref.sequences.tolist()
    counts = {engine: {k: v for k, v in out.speculation.to_dict().items() if k != "engine"}
              for engine, out in runs.items()}
    assert counts["wavefront"] == counts["lanes"]
    assert runs["wavefront"].speculation.second_accepted > 0  # some targets chose a sibling


@pytest.mark.parametrize("options,message", [({"exit_at_step": 4}, "exit_at_step=4"),
                                             ({"exit_threshold": 1.5}, "exit_threshold=1.5"),
                                             ({"exit_at_step": 1, "use_weighted_exit": True}, "at most one")])
def test_invalid_exit_options_raise_before_any_work(setup, options, message):
    model, ids, mask, _ = setup
    cache = paged_cache(model)
    with pytest.raises(ValueError, match=message), torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=PAD,
                       speculative_mode="pipeline", cache=cache, **options)
    assert cache.num_sequences == 0


@pytest.mark.parametrize("mode,d,k", mode_params(MODE_PAIR))
def test_config_early_exit_settings_mean_the_same_in_every_mode(mode, d, k):
    """The config's `early_exit_threshold` / `early_exit_step` (checkpoint metadata; `generate` applies them in no
    mode) leave speculative decoding equal to plain decoding."""
    model = tiny_spec_model(91, 4, vocab=VOCAB, damp=0.15)
    model.config.early_exit_threshold, model.config.early_exit_step = 0.9, 1
    ids, mask = left_pad(random_prompts(92, [5, 2], VOCAB))
    ref = plain(model, ids, mask, NEW)
    assert speculative(model, ids, mask, NEW, mode, d, k).sequences.tolist() == ref.sequences.tolist()


@pytest.mark.parametrize("name", list(OPTIONS))
def test_exit_options_set_in_a_generation_config_decode_as_the_arguments(setup, name):
    """An exit option in a passed generation config, or in the model's (a checkpoint's generation_config.json), is
    the argument's: transformers kept such a key in the config, where forward never saw it, so every mode decoded
    from the last loop without a word. Continuous batching decodes from it too."""
    model, ids, mask, last_loop = setup
    want = plain(model, ids, mask, NEW, **OPTIONS[name]).sequences.tolist()
    assert want != last_loop.tolist()
    for mode in (None, "pipeline", "block", "auto"):
        spec = {} if mode is None else {"speculative_mode": mode}
        config = GenerationConfig(max_new_tokens=NEW, do_sample=False, pad_token_id=PAD, **OPTIONS[name])
        out = model.generate(ids, attention_mask=mask, generation_config=config, **spec)
        assert out.tolist() == want, mode
    saved = model.generation_config
    model.generation_config = copy.deepcopy(saved)
    for key, value in OPTIONS[name].items():  # (`update` would set only the keys the config already has)
        setattr(model.generation_config, key, value)
    try:
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=PAD)
        assert out.tolist() == want
        # use_weighted_exit=False chooses no exit: the config's stays (it was dropped: the last loop decoded)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=PAD,
                             use_weighted_exit=False)
        assert out.tolist() == (want if name != "use_weighted_exit" else last_loop.tolist())
        batch = model.generate_batch([ids[0, -6:].tolist()], max_new_tokens=NEW)  # (row 0 has no padding)
        assert [r.generated_tokens for r in batch.values()] == [want[0][ids.shape[1]:]]
        # the call's own exit option replaces the config's (two set were refused: "Pass at most one of ...")
        other = {"exit_at_step": 0} if name != "exit_at_step=1" else {"exit_threshold": 0.9}
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=PAD, **other)
        assert out.tolist() == plain(model, ids, mask, NEW, **other).sequences.tolist()
    finally:
        model.generation_config = saved


@pytest.mark.parametrize("setting", [{"num_steps": 2}, {"init_scale": 0.0}, {"init_seed": 3}])
def test_ouro_refuses_huginns_recurrence_settings(setup, setting):
    """Ouro's loop count is its config's: a Huginn recurrence setting passed to forward, or set in a generation
    config (passed or the model's; generate and continuous batching), is refused (forward and a config's key were
    silently unread: the model ran all its loops)."""
    model, ids, mask, _ = setup
    name = next(iter(setting))
    with pytest.raises(ValueError, match=f"{name}=.*: OuroForCausalLM has no recurrence settings"):
        model(ids, attention_mask=mask, **setting)
    for mode in (None, "pipeline", "auto"):
        config = GenerationConfig(max_new_tokens=2, do_sample=False, pad_token_id=PAD, **setting)
        with pytest.raises(ValueError, match=f"{name}=.*: OuroForCausalLM has no recurrence settings"):
            model.generate(ids, attention_mask=mask, generation_config=config, speculative_mode=mode)
        with pytest.raises(ValueError, match=f"{name}=.*: OuroForCausalLM has no recurrence settings"):
            model.generate(ids, attention_mask=mask, max_new_tokens=2, speculative_mode=mode, **setting)
    saved = model.generation_config
    model.generation_config = copy.deepcopy(saved)
    setattr(model.generation_config, name, setting[name])
    try:
        with pytest.raises(ValueError, match=f"{name}=.*: OuroForCausalLM has no recurrence settings"):
            model.generate_batch([[5, 6, 7]], max_new_tokens=2)
    finally:
        model.generation_config = saved


def test_generate_only_options_are_checked_in_auto_and_refused_in_a_config(setup):
    """`speculative_trace` / `draft_hook` are `generate` arguments: auto checks them up front (a plain stretch
    dropped a bad one unread), and a generation config holding them is refused (the trace silently never came)."""
    model, ids, mask, _ = setup
    with pytest.raises(ValueError, match="speculative_trace='yes' must be True, False or 'hidden'"):
        model.generate(ids, attention_mask=mask, max_new_tokens=2, speculative_mode="auto", speculative_trace="yes")
    with pytest.raises(ValueError, match="draft_hook=42 must be callable"):
        model.generate(ids, attention_mask=mask, max_new_tokens=2, speculative_mode="auto", draft_hook=42)
    config = GenerationConfig(max_new_tokens=2, pad_token_id=PAD, speculative_mode="pipeline", speculative_trace=True)
    with pytest.raises(ValueError, match="speculative_trace=True in a generation config is not read: pass it to"):
        model.generate(ids, attention_mask=mask, generation_config=config)
    with pytest.raises(ValueError, match="speculative_trace=True in a generation config is not read"):
        model.generate_batch([[5, 6, 7]], generation_config=config)  # (continuous batching dropped it too)
    asks_nothing = GenerationConfig(max_new_tokens=2, pad_token_id=PAD, speculative_trace=False, draft_hook=None)
    out = model.generate(ids, attention_mask=mask, generation_config=asks_nothing, return_dict_in_generate=True)
    assert out.sequences.shape[1] == ids.shape[1] + 2  # (False and None ask for nothing: a saved false still loads)


@pytest.mark.parametrize("mode", [None, "pipeline", "block"])
@pytest.mark.parametrize("name", list(OPTIONS))
def test_huginn_refuses_exit_options_in_every_mode(name, mode):
    """Huginn has no exit selection: an exit option would pass through `forward`'s `**kwargs` unread, so it is refused
    in plain decoding, both speculative modes and `forward`, instead of silently decoding at full depth."""
    from huginn_utils import tiny_huginn

    model, _ = tiny_huginn(seed=1)
    ids = torch.tensor([[5, 6, 7]])
    spec = {} if mode is None else {"speculative_mode": mode, "draft_loops": 2}
    with pytest.raises(ValueError, match=name.split("=")[0]):  # transformers' unused-kwargs check or ours
        model.generate(ids, max_new_tokens=2, do_sample=False, num_steps=4, init_scale=0.0, **spec, **OPTIONS[name])
    with pytest.raises(ValueError, match="has no exit options"):
        model(ids, num_steps=2, **OPTIONS[name])
    for zero in ({"exit_at_step": 0}, {"exit_threshold": 0.0}):  # (0 == False: they passed unread)
        with pytest.raises(ValueError, match="has no exit options"):
            model(ids, num_steps=2, **zero)


@pytest.mark.parametrize("mode", [None, "pipeline", "block", "auto"])
@pytest.mark.parametrize("name", list(OPTIONS) + ["exit_at_step=0"])
def test_continuous_batching_decodes_from_the_configured_exit(setup, name, mode):
    """A manager whose generation config sets an exit option gives each request plain `generate`'s tokens with that
    option, alone (continuous batching refused exit options: a checkpoint whose generation config sets one could
    not be served with --continuous-batching). Three requests of different lengths share two slots, so a slot is
    reused by a request whose own loop outputs must replace its previous owner's."""
    model = setup[0]
    options = OPTIONS.get(name, {"exit_at_step": 0})
    requests = [p.tolist() for p in random_prompts(93, [6, 3, 9], VOCAB)]
    want = [plain(model, torch.tensor([p]), None, NEW, **options).sequences[0, len(p):].tolist() for p in requests]
    assert want != [plain(model, torch.tensor([p]), None, NEW).sequences[0, len(p):].tolist() for p in requests]
    spec = {} if mode is None else {"speculative_mode": mode, "draft_loops": 1}
    config = GenerationConfig(max_new_tokens=NEW, do_sample=False, pad_token_id=PAD, eos_token_id=None, **spec,
                              **options)
    out = model.generate_batch(requests, generation_config=config,
                               continuous_batching_config=ContinuousBatchingConfig(max_requests_per_batch=2))
    assert [r.generated_tokens for r in out.values()] == want


def test_continuous_batching_checks_exit_options_as_generate_does(setup):
    model = setup[0]
    for options, message in (({"exit_at_step": 4}, "exit_at_step=4 must be"),
                             ({"exit_at_step": 1, "exit_threshold": 0.5}, "at most one")):
        with pytest.raises(ValueError, match=message):
            model.generate_batch([[5, 6, 7]], max_new_tokens=2, generation_config=GenerationConfig(**options))


@pytest.mark.parametrize("name", list(OPTIONS))
def test_exit_options_of_the_generation_config_survive_save_and_load(setup, name, tmp_path):
    """An exit option set on a model's generation config derived from its config.json (marked `_from_model_config`)
    is kept by `save_pretrained` and `from_pretrained`, as in a marked file an older save wrote: transformers drops
    non-standard keys of a marked config, so the reloaded model decoded from the last loop without a word."""
    model, ids, mask, last_loop = setup
    want = plain(model, ids, mask, NEW, **OPTIONS[name]).sequences.tolist()
    saved = model.generation_config
    model.generation_config = copy.deepcopy(saved)
    model.generation_config._from_model_config = True
    for key, value in OPTIONS[name].items():
        setattr(model.generation_config, key, value)
    try:
        model.save_pretrained(tmp_path / "saved")
    finally:
        model.generation_config = saved
    marked = json.loads((tmp_path / "saved" / "generation_config.json").read_text())
    (tmp_path / "saved" / "generation_config.json").write_text(json.dumps({**marked, "_from_model_config": True}))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    assert {key: getattr(loaded.generation_config, key) for key in OPTIONS[name]} == OPTIONS[name]
    for mode in (None, "pipeline"):
        out = loaded.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=PAD,
                              speculative_mode=mode)
        assert out.tolist() == want != last_loop.tolist()


@pytest.mark.parametrize("name", list(OPTIONS))
def test_forward_takes_the_generation_configs_exit_option(setup, name):
    """A forward call without exit options scores at the generation config's, as `generate` decodes (lm-eval's
    loglikelihood and generate_until of one run used to see two models); `exit_threshold=1.0` still reaches the last
    loop. The references are forward calls that pass the option, and the last loop's logits."""
    model, ids, mask, _ = setup
    with torch.no_grad():
        chosen = model(ids, attention_mask=mask, **OPTIONS[name]).logits
        last = model(ids, attention_mask=mask, output_loop_logits=True).loop_logits[-1]
        assert not torch.equal(chosen, last)
        saved = model.generation_config
        model.generation_config = copy.deepcopy(saved)
        for key, value in OPTIONS[name].items():
            setattr(model.generation_config, key, value)
        try:
            assert torch.equal(model(ids, attention_mask=mask).logits, chosen)
            assert torch.equal(model(ids, attention_mask=mask, exit_threshold=1.0).logits, last)
            inside = []  # a criterion (or processor, or custom loop) that scores inside generate sees the same model
            model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=PAD,
                           stopping_criteria=[lambda *_: inside.append(model(ids, attention_mask=mask).logits)
                                              or torch.zeros(len(ids), dtype=torch.bool)])
            assert inside and all(torch.equal(logits, chosen) for logits in inside)
        finally:
            model.generation_config = saved


def test_from_pretrained_takes_exit_options(setup, tmp_path):
    """`from_pretrained(..., exit_at_step=k)` (lm-eval's `--model_args`) sets the generation config that forward and
    generate read; it replaces a saved alternative, and a bad value raises the forward's `ValueError` at load (it was
    refused as an unknown argument of the model's constructor)."""
    model, ids, mask, _ = setup
    saved = model.generation_config
    model.generation_config = copy.deepcopy(saved)
    model.generation_config.exit_threshold = 0.9
    try:
        model.save_pretrained(tmp_path / "saved")
    finally:
        model.generation_config = saved
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved", exit_at_step=1)
    assert (loaded.generation_config.exit_at_step, loaded.generation_config.exit_threshold) == (1, None)
    with torch.no_grad():
        assert torch.equal(loaded(ids, attention_mask=mask).logits, model(ids, attention_mask=mask,
                                                                          exit_at_step=1).logits)
    want = plain(model, ids, mask, NEW, exit_at_step=1).sequences.tolist()
    out = loaded.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=PAD)
    assert out.tolist() == want
    with pytest.raises(ValueError, match="exit_at_step=9 must be"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "saved", exit_at_step=9)


def test_a_call_or_a_passed_config_decides_the_exit_in_every_mode(setup):
    """With the model's config at exit 1: an option passed as None (a wrapper passing an unset option on) counts as
    not given, in every mode (plain decoding's forward read the model's exit while transformers' merge had unset it
    for the speculative modes, which decoded the last loop); a passed config that chooses another exit replaces the
    model's, in `generate` and continuous batching alike (both used to meet: "Pass at most one")."""
    model, ids, mask, last_loop = setup
    want = {name: plain(model, ids, mask, NEW, **OPTIONS[name]).sequences.tolist() for name in OPTIONS}
    saved = model.generation_config
    model.generation_config = copy.deepcopy(saved)
    model.generation_config.exit_at_step = 1
    try:
        for mode in (None, "pipeline", "block", "auto"):
            for unset in EXIT_NAMES:
                out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=PAD,
                                     speculative_mode=mode, **{unset: None})
                assert out.tolist() == want["exit_at_step=1"], (mode, unset)
            for name in ("exit_threshold=0.9", "use_weighted_exit"):
                config = GenerationConfig(max_new_tokens=NEW, do_sample=False, pad_token_id=PAD, **OPTIONS[name])
                out = model.generate(ids, attention_mask=mask, generation_config=config, speculative_mode=mode)
                assert out.tolist() == want[name], (mode, name)
        config = GenerationConfig(max_new_tokens=NEW, do_sample=False, exit_threshold=1.0)  # (the last loop)
        batch = model.generate_batch([ids[0, -6:].tolist()], generation_config=config)  # (row 0 has no padding)
        assert [r.generated_tokens for r in batch.values()] == [last_loop[0, ids.shape[1]:].tolist()]
    finally:
        model.generation_config = saved


def test_from_pretrained_refuses_another_familys_settings(tmp_path):
    """Huginn's causal LM given an exit option, Ouro's given a recurrence setting, and Ouro's base model given an exit
    option (it does not generate) raise a `ValueError` naming them (a TypeError from the constructor before)."""
    from huginn_utils import tiny_huginn
    from transformers import AutoModel

    tiny_huginn()[0].save_pretrained(tmp_path / "huginn")
    tiny_spec_model(91, 4, vocab=VOCAB).save_pretrained(tmp_path / "ouro")
    with pytest.raises(ValueError, match=r"exit_at_step=1: generation settings of another model family .* "
                                         "HuginnForCausalLM takes num_steps, init_scale, init_seed"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "huginn", exit_at_step=1)
    with pytest.raises(ValueError, match=r"num_steps=4: generation settings of another model family .* "
                                         "OuroForCausalLM takes exit_at_step"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "ouro", num_steps=4)
    with pytest.raises(ValueError, match="exit_at_step=1: generation settings, but OuroModel does not generate"):
        AutoModel.from_pretrained(tmp_path / "ouro", exit_at_step=1)


class EditsTheExitMidCall(BaseStreamer):
    """A streamer that sets `model.generation_config.<key> = value` once the call has made two tokens: another
    thread of an app editing the shared model's generation config while a call runs."""

    def __init__(self, model, key, value):
        self.model, self.key, self.value, self.puts = model, key, value, 0

    def put(self, value):
        self.puts += 1
        if self.puts == 3:  # (the prompt, then two new tokens)
            setattr(self.model.generation_config, self.key, self.value)

    def end(self):
        pass


@pytest.mark.parametrize("key, value", [("exit_at_step", 1), ("use_weighted_exit", True)])
def test_an_exit_set_on_the_models_config_during_a_call_takes_effect_at_the_next_call(key, value):
    """The model's forward read the exit options of the model's generation config at every step, so a plain call
    mixed two exits from the step it was set on (the speculative modes resolve them once); every mode now keeps the
    exit it started with, the next call and forward outside generate take the new one."""
    model = tiny_spec_model(71, 4, vocab=VOCAB, damp=0.1)
    ids, mask = left_pad(random_prompts(2, [5, 2, 8], VOCAB))
    settings = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=PAD)
    without, exiting = model.generate(ids, **settings), model.generate(ids, **settings, **{key: value})
    assert not torch.equal(without, exiting)  # (the edit would show)
    for mode in (None, "pipeline", "block", "auto"):
        setattr(model.generation_config, key, None)
        edited = model.generate(ids, speculative_mode=mode, streamer=EditsTheExitMidCall(model, key, value), **settings)
        assert getattr(model.generation_config, key) == value and torch.equal(edited, without), mode
        assert torch.equal(model.generate(ids, speculative_mode=mode, **settings), exiting), mode
    torch.testing.assert_close(model(ids, attention_mask=mask).logits,
                               model(ids, attention_mask=mask, **{key: value}).logits, atol=0, rtol=0)
    # an auto call of several segments (each a generate call of its own) keeps the exit it started with too
    set_costs(model, CostTable(4.0, {Candidate("pipeline", 1): 2.0, Candidate("block", 1, 4): 2.0}))
    set_policy(model, AutoPolicy(interval=6, max_interval=12, probe_tokens=4, reprobe_after=1, min_verified=2))
    settings["max_new_tokens"] = 24
    setattr(model.generation_config, key, None)
    without = model.generate(ids, speculative_mode=None, **settings)
    out = model.generate(ids, speculative_mode="auto", streamer=EditsTheExitMidCall(model, key, value),
                         return_dict_in_generate=True, **settings)
    assert len(out.speculation.choices) > 2 and torch.equal(out.sequences, without)


@pytest.mark.parametrize("mode", [None, "pipeline", "auto"])
def test_a_generate_nested_in_a_call_of_the_same_model_decodes_as_it_would_alone(mode):
    """A criterion and a streamer's `end` of an `exit_at_step=1` call run their own `generate` on the same model, once
    with no exit and once with a passed config choosing exit 3: each decodes as that call made on its own (first
    versions of the call's merged exits handed every nested call, then every call nested in an auto call outside
    its segments, the outer call's exit, as only auto's segments need)."""
    model = tiny_spec_model(91, 4, vocab=VOCAB, damp=0.15)
    ids, mask = left_pad(random_prompts(91, [6], VOCAB))
    probe = ids[:, :4]
    nested_calls = {"no exit": {}, "config exit 3": {"generation_config": GenerationConfig(
        exit_at_step=3, max_new_tokens=8, do_sample=False, pad_token_id=PAD)}}

    def nested(settings):
        return model.generate(probe, attention_mask=torch.ones_like(probe), **{
            "max_new_tokens": 8, "do_sample": False, "pad_token_id": PAD, "speculative_mode": None} | settings)

    alone = {name: nested(settings) for name, settings in nested_calls.items()}
    assert not torch.equal(alone["no exit"], nested({"exit_at_step": 1}))  # (the outer call's exit would show)
    seen = {}

    def criterion(input_ids, scores, **kwargs):
        seen.update({name: nested(settings) for name, settings in nested_calls.items() if name not in seen})
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    class EndsWithAGenerate(BaseStreamer):  # (auto ends its streamer outside its segments)
        def put(self, value):
            pass

        def end(self):
            ended.update({name: nested(settings) for name, settings in nested_calls.items()})

    ended = {}
    model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=PAD, exit_at_step=1,
                   speculative_mode=mode, stopping_criteria=[criterion], streamer=EndsWithAGenerate())
    for got in (seen, ended):
        assert {name: out.tolist() for name, out in got.items()} == {name: out.tolist() for name, out in alone.items()}
