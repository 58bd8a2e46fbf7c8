"""Ouro forward pass against the independent reference (tests/ouro_reference.py): per-loop logits and exit gates,
the exit options, cached decoding, left padding, and input / config validation. CPU, fp32, tiny random models."""

from __future__ import annotations

import json
import logging
import re
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import VOCAB, reference, tiny_config, tiny_model
from inputs import left_pad, random_ids
from ouro_reference import exit_distribution
from tolerances import assert_fp32_close, ouro_depth
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.cache_utils import DynamicCache

from hf_loopspec.generation.mixin import looped_static_cache
from hf_loopspec.models.layers import project
from hf_loopspec.models.loops import check_mask
from hf_loopspec.models.ouro.configuration_ouro import OuroConfig

# MHA and GQA (incl. a single KV head), U in {1, 3, 4}, explicit head_dim != hidden / heads (= 16).
ARCHS = {
    "mha-U4": {},
    "gqa-U3": {"num_key_value_heads": 2, "total_ut_steps": 3},
    "mqa-U1-head_dim24": {"num_key_value_heads": 1, "head_dim": 24, "total_ut_steps": 1},
    "gqa-U4-head_dim8": {"num_key_value_heads": 2, "head_dim": 8},
    "mha-U3-head_dim32": {"head_dim": 32, "total_ut_steps": 3},
}


def assert_close(actual, expected, config):
    """The package's output against the fp32 reference's: rounding of a full forward of `config` apart."""
    assert_fp32_close(actual, expected.to(actual.dtype), **ouro_depth(config))


# --- parity with the reference ------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", list(ARCHS), ids=list(ARCHS))
def test_loop_logits_and_gates_match_reference(arch):
    model, sd = tiny_model(seed=1, **ARCHS[arch])
    loops = model.config.total_ut_steps
    ids = random_ids((3, 11), VOCAB, seed=2)
    ref = reference(sd, ids, model.config)
    with torch.no_grad():
        out = model(ids, output_loop_logits=True, use_cache=False)
    assert len(out.loop_logits) == loops
    for u in range(loops):
        assert_close(out.loop_logits[u], ref["loop_logits"][u], model.config)
    assert out.exit_gate_logits.shape == (3, 11, loops)
    assert_close(out.exit_gate_logits, ref["gate_logits"], model.config)
    assert_close(out.logits, ref["loop_logits"][-1], model.config)  # no exit option: the last loop


def test_single_sequence_and_default_logits_match_reference():
    model, sd = tiny_model(seed=3)
    ids = random_ids(13, VOCAB, seed=4)  # one sequence [T]
    ref = reference(sd, ids, model.config)
    with torch.no_grad():
        out = model(ids[None])
    assert out.loop_logits is None and out.exit_gate_logits is None
    assert_close(out.logits[0], ref["loop_logits"][-1, 0], model.config)


def test_hidden_states_are_embeddings_then_every_loop():
    model, sd = tiny_model(seed=5, total_ut_steps=3)
    ids = random_ids((2, 8), VOCAB, seed=6)
    ref = reference(sd, ids, model.config)
    with torch.no_grad():
        out = model(ids, output_hidden_states=True, use_cache=False)
    assert len(out.hidden_states) == 4
    assert_close(out.hidden_states[0], sd["model.embed_tokens.weight"][ids], model.config)
    for u in range(3):
        assert_close(out.hidden_states[u + 1], ref["loop_hidden"][u], model.config)
    assert_close(out.exit_gate_logits, ref["gate_logits"], model.config)
    with torch.no_grad():
        base = model.model(ids, use_cache=False)
    assert_close(base.last_hidden_state, ref["loop_hidden"][-1], model.config)
    model.config.output_hidden_states = True  # the default of a call that passes none (it was ignored)
    with torch.no_grad():
        by_config, base, off = model(ids, use_cache=False), model.model(ids, use_cache=False), \
            model(ids, use_cache=False, output_hidden_states=False)
    assert torch.equal(torch.stack(by_config.hidden_states), torch.stack(out.hidden_states))
    assert len(base.hidden_states) == 4 and off.hidden_states is None


def test_logits_to_keep_and_loss():
    model, sd = tiny_model(seed=7)
    ids = random_ids((2, 10), VOCAB, seed=8)
    ref = reference(sd, ids, model.config)["loop_logits"][-1]
    with torch.no_grad():
        last = model(ids, logits_to_keep=1).logits
        loss = model(ids, labels=ids).loss
    assert last.shape == (2, 1, 101)
    assert_close(last, ref[:, -1:], model.config)
    expected = F.cross_entropy(ref[:, :-1].reshape(-1, 101), ids[:, 1:].reshape(-1))
    assert_close(loss, expected, model.config)


@pytest.mark.parametrize("family", ["ouro", "huginn"])
def test_labels_are_checked_and_ignore_index_is_honoured(family):
    """Labels of another dtype or shape, or with ids outside the vocabulary that are not the ignore index, raise a
    ValueError naming labels (torch's loss raised an IndexError about a 'target', a dtype RuntimeError or a flattened
    batch-size mismatch); one row's labels may come as [T], as transformers takes them. The ignore index (-100, or the
    one passed) marks positions without a label: the loss equals cross-entropy over the other positions of the returned
    logits."""
    from huginn_utils import tiny_huginn

    model = tiny_model(seed=7)[0] if family == "ouro" else tiny_huginn(seed=7)[0]
    vocab, settings = model.config.vocab_size, {} if family == "ouro" else {"num_steps": 2, "init_scale": 0.0}
    ids = random_ids((2, 8), vocab, seed=8)
    bad = {"a float tensor": (ids.float(), {}), "an int32 tensor": (ids.int(), {}), "a list": (ids.tolist(), {}),
           "one label short": (ids[:, 1:], {}), "logits_to_keep": (ids, {"logits_to_keep": 1}),
           "above the vocabulary": (ids + vocab, {}), "negative": (ids - 200, {}),
           "another ignore index": (torch.full_like(ids, -100), {"ignore_index": -1})}
    with torch.no_grad():
        for labels, extra in bad.values():
            with pytest.raises(ValueError, match="^labels "):
                model(ids, labels=labels, **settings, **extra)
        for ignore in (-100, -1):
            labels = ids.clone()
            labels[:, :3] = ignore
            out = model(ids, labels=labels, **settings, **({} if ignore == -100 else {"ignore_index": ignore}))
            logits = out.logits[:, :-1].reshape(-1, vocab).float()
            expected = F.cross_entropy(logits, labels[:, 1:].reshape(-1), ignore_index=ignore)
            # the same logits on both sides: only the mean over the 10 labelled positions may be summed in another
            # order, a relative error of about 10 fp32 epsilons (1.2e-6); 1e-5 leaves room
            torch.testing.assert_close(out.loss, expected, rtol=1e-5, atol=0)
        one_row = model(ids[:1], labels=ids[0], **settings)  # [T] labels for one row: the loss of [1, T] ones
        torch.testing.assert_close(one_row.loss, model(ids[:1], labels=ids[:1], **settings).loss, rtol=0, atol=0)


# --- exit options ---------------------------------------------------------------------------------------------


def test_exit_at_step_selects_that_loop():
    model, sd = tiny_model(seed=9)
    ids = random_ids((2, 9), VOCAB, seed=10)
    ref = reference(sd, ids, model.config)
    for k in range(4):
        with torch.no_grad():
            out = model(ids, exit_at_step=k)
        assert_close(out.logits, ref["loop_logits"][k], model.config)
    # loops differ, so the above really distinguishes them
    assert (ref["loop_logits"][0] - ref["loop_logits"][-1]).abs().max() > 0.1


def test_weighted_exit_is_expectation_under_exit_distribution():
    model, sd = tiny_model(seed=11, gate_scale=3.0)
    ids = random_ids((2, 9), VOCAB, seed=12)
    ref = reference(sd, ids, model.config)
    probs = exit_distribution(ref["gate_logits"])  # [B, T, U], float64
    assert torch.allclose(probs.sum(-1), torch.ones_like(probs[..., 0]))
    expected = (probs.permute(2, 0, 1)[..., None] * ref["loop_logits"].double()).sum(0)
    with torch.no_grad():
        out = model(ids, use_weighted_exit=True)
    assert_close(out.logits, expected, model.config)


def _threshold_choice(gate_logits, q):
    """First loop whose cumulative exit probability reaches q, else the last (ouro.md)."""
    cum = exit_distribution(gate_logits).cumsum(-1)
    loops = cum.shape[-1]
    choice = torch.full(cum.shape[:-1], loops - 1)
    for t in reversed(range(loops - 1)):
        choice = torch.where(cum[..., t] >= q, t, choice)
    return choice, cum


@pytest.mark.parametrize("q", [0.3, 0.5, 0.7])
def test_exit_threshold_picks_first_loop_reaching_threshold_per_token(q):
    model, sd = tiny_model(seed=13)
    # A strongly varying gate (large weight, bias around 0) spreads the exits over the loops.
    gen = torch.Generator().manual_seed(14)
    sd["model.early_exit_gate.weight"] = 1.5 * torch.randn(1, 64, generator=gen)
    sd["model.early_exit_gate.bias"] = torch.tensor([-0.5])
    model.load_state_dict(sd, strict=True)
    ids = random_ids((3, 16), VOCAB, seed=15)
    ref = reference(sd, ids, model.config)
    choice, cum = _threshold_choice(ref["gate_logits"], q)
    assert len(choice.unique()) >= 3, f"threshold {q} does not spread the tokens over the loops: {choice}"
    assert (cum - q).abs().min() > 1e-4  # no token sits on the boundary (fp32 vs fp64)
    expected = torch.stack([ref["loop_logits"][choice[b, t], b, t] for b in range(3) for t in range(16)])
    with torch.no_grad():
        out = model(ids, exit_threshold=q)
    assert_close(out.logits.reshape(-1, 101), expected, model.config)


def test_exit_threshold_extremes():
    model, sd = tiny_model(seed=16, gate_scale=2.0)
    ids = random_ids((2, 7), VOCAB, seed=17)
    ref = reference(sd, ids, model.config)
    with torch.no_grad():
        first = model(ids, exit_threshold=0.0).logits  # p_0 >= 0: every token exits after loop 0
        last = model(ids, exit_threshold=1.0).logits  # the cumulative mass reaches 1 only at the last loop
    assert_close(first, ref["loop_logits"][0], model.config)
    assert_close(last, ref["loop_logits"][-1], model.config)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"exit_at_step": 4},
        {"exit_at_step": -1},
        {"exit_threshold": 1.5},
        {"exit_threshold": -0.1},
        {"exit_at_step": 1, "use_weighted_exit": True},
        {"exit_at_step": 1, "exit_threshold": 0.5},
        {"exit_threshold": 0.5, "use_weighted_exit": True},
    ],
)
def test_invalid_exit_arguments_raise(kwargs):
    model, _ = tiny_model(seed=0)
    with pytest.raises(ValueError):
        model(random_ids((1, 4), VOCAB), **kwargs)


# --- cached decoding ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunks", [[1] * 10, [3, 1, 4, 2], [6, 4]], ids=["token-by-token", "3-1-4-2", "6-4"])
@pytest.mark.parametrize("arch", ["mha-U4", "gqa-U3"])
def test_incremental_decoding_with_dynamic_cache_matches_full_forward(chunks, arch):
    model, sd = tiny_model(seed=18, **ARCHS[arch])
    loops, layers = model.config.total_ut_steps, model.config.num_hidden_layers
    ids = random_ids((2, sum(chunks)), VOCAB, seed=19)
    ref = reference(sd, ids, model.config)
    cache = DynamicCache()
    start = 0
    for n in chunks:
        with torch.no_grad():
            out = model(ids[:, start:start + n], cache=cache, output_loop_logits=True)
        assert out.cache is cache
        for u in range(loops):
            assert_close(out.loop_logits[u], ref["loop_logits"][u][:, start:start + n], model.config)
        start += n
        assert cache.get_seq_length() == start
    assert len(cache.layers) == loops * layers  # one KV per (loop, layer)


def test_past_key_values_alias():
    model, sd = tiny_model(seed=20)
    ids = random_ids((1, 6), VOCAB, seed=21)
    ref = reference(sd, ids, model.config)["loop_logits"][-1]
    cache = DynamicCache()
    with torch.no_grad():
        model(ids[:, :4], past_key_values=cache)
        out = model(ids[:, 4:], past_key_values=cache)
    assert_close(out.logits, ref[:, 4:], model.config)
    with pytest.raises(ValueError):
        model(ids[:, 4:], cache=DynamicCache(), past_key_values=DynamicCache())


# --- left padding ---------------------------------------------------------------------------------------------


def test_left_padded_batch_matches_each_row_alone():
    model, sd = tiny_model(seed=22, num_key_value_heads=2)
    rows = [random_ids(n, VOCAB, seed=30 + n) for n in (7, 3, 10, 1)]
    ids, mask = left_pad(rows, pad_id=5)
    with torch.no_grad():
        out = model(ids, attention_mask=mask, output_loop_logits=True, use_cache=False)
    for i, row in enumerate(rows):
        ref = reference(sd, row, model.config)
        n = len(row)
        for u in range(4):
            assert_close(out.loop_logits[u][i, -n:], ref["loop_logits"][u][0], model.config)
        assert_close(out.exit_gate_logits[i, -n:], ref["gate_logits"][0], model.config)


def test_left_padded_batch_with_cache_matches_each_row_alone():
    model, sd = tiny_model(seed=23)
    rows = [random_ids(n, VOCAB, seed=40 + n) for n in (6, 2, 4)]
    extra = random_ids((3, 4), VOCAB, seed=41)  # continuation tokens, fed 1 then 3 at a time
    ids, mask = left_pad(rows, pad_id=7)
    cache = DynamicCache()
    with torch.no_grad():
        outs = [model(ids, attention_mask=mask, cache=cache).logits]
        for part in (extra[:, :1], extra[:, 1:]):
            mask = torch.cat([mask, torch.ones_like(part)], dim=1)
            outs.append(model(part, attention_mask=mask, cache=cache).logits)
    logits = torch.cat(outs, dim=1)
    for i, row in enumerate(rows):
        full = torch.cat([row, extra[i]])
        ref = reference(sd, full, model.config)["loop_logits"][-1, 0]
        assert_close(logits[i, -len(full):], ref, model.config)


# --- bad input ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad_id", [101, 10_000, -1])
def test_out_of_vocab_ids_raise(bad_id):
    model, _ = tiny_model(seed=0)
    ids = random_ids((2, 5), VOCAB)
    ids[1, 2] = bad_id
    with pytest.raises(ValueError, match="vocab"):
        model(ids)


@pytest.mark.parametrize(
    "overrides, named",
    [
        ({"total_ut_steps": 0}, "total_ut_steps=0"),
        ({"total_ut_steps": -2}, "total_ut_steps=-2"),
        ({"total_ut_steps": True}, "total_ut_steps=True"),  # a bool is no loop count
        ({"num_attention_heads": 4, "num_key_value_heads": 3}, "num_key_value_heads=3"),
        ({"hidden_size": 64, "num_attention_heads": 6}, "num_attention_heads=6"),  # 64 % 6 != 0 and no head_dim
        # Checked before layer_types or head_dim are derived from them (a TypeError / ZeroDivisionError before):
        ({"num_hidden_layers": 2.0}, "num_hidden_layers=2.0"),
        ({"num_hidden_layers": None}, "num_hidden_layers=None"),
        ({"hidden_size": 0}, "hidden_size=0"),
        ({"num_attention_heads": 0}, "num_attention_heads=0"),
        # accepted before: continuous batching's slots raised torch's TypeError (40.5), were 2 positions long (-5),
        # or 1024 (0, read as unset)
        ({"max_position_embeddings": 40.5}, "max_position_embeddings=40.5"),
        ({"max_position_embeddings": -5}, "max_position_embeddings=-5"),
        ({"max_position_embeddings": 0}, "max_position_embeddings=0"),
        # accepted before: theta 0 gave NaN logits (generate returned token 0), a string a TypeError in forward, and
        # attention_bias=True built no biases
        ({"rope_theta": 0}, "rope_theta=0 is invalid"),
        ({"rope_theta": -1e4}, "rope_theta=-10000.0 is invalid"),
        ({"rope_theta": "1e4"}, "rope_theta='1e4' is invalid"),
        ({"rope_theta": float("inf")}, "rope_theta=inf is invalid"),
        pytest.param({"rope_theta": 10**400}, f"rope_theta={10**400} is invalid", id="rope-theta-no-float"),
        ({"attention_bias": True}, "attention_bias=True is not supported"),
        # a string switch read as True ("attention_bias=True is not supported" misstated it; "no" tied the weights)
        ({"attention_bias": "no"}, "OuroConfig.attention_bias='no' is invalid: pass True or False"),
        ({"use_sliding_window": "no"}, "OuroConfig.use_sliding_window='no' is invalid: pass True or False"),
        ({"tie_word_embeddings": "no"}, "OuroConfig.tie_word_embeddings='no' is invalid: pass True or False"),
        # accepted before, with NaN logits
        ({"rms_norm_eps": -1.0}, "rms_norm_eps=-1.0 is invalid"),
        ({"rms_norm_eps": float("nan")}, "rms_norm_eps=nan is invalid"),
        ({"rope_theta": float("nan"), "rope_parameters": {"rope_theta": float("nan")}}, "rope_theta=nan is invalid"),
        ({"rms_norm_eps": "1e-6"}, "rms_norm_eps='1e-6' is invalid"),
        pytest.param({"rms_norm_eps": 10**400}, f"rms_norm_eps={10**400} is invalid", id="eps-no-float"),
        # an AttributeError of torch before (a traceback from the command line)
        ({"dtype": "float13"}, "OuroConfig.dtype='float13' is no torch dtype"),
        ({"torch_dtype": "bf16"}, "OuroConfig.torch_dtype='bf16' is no torch dtype"),
        ({"dtype": "float13", "torch_dtype": "float32"}, "OuroConfig.dtype='float13' is no torch dtype"),
        # a TypeError in transformers' generation config when the model was built
        ({"pad_token_id": "3"}, "OuroConfig.pad_token_id='3' is invalid: it must be None or an integer"),
        ({"bos_token_id": 1.5}, "OuroConfig.bos_token_id=1.5 is invalid"),
        ({"eos_token_id": [2, "3"]}, "OuroConfig.eos_token_id=[2, '3'] is invalid: it must be None, an integer or a "
                                     "list of integers"),
    ],
)
def test_invalid_config_raises(overrides, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        tiny_config(**overrides)


def test_numpy_token_ids_are_stored_as_python_integers(tmp_path):
    """numpy integers pass the token-id check, and `save_pretrained` then failed in transformers' JSON writer; the
    configs (Ouro's and Huginn's, which share the check) store them as Python integers, and the model saves."""
    from huginn_utils import tiny_huginn_config

    ouro = tiny_config(pad_token_id=np.int64(0), bos_token_id=np.int32(1), eos_token_id=[np.int64(2), 3])
    huginn = tiny_huginn_config(pad_token_id=np.int64(0), eos_token_id=np.int16(2))
    assert [type(i) for i in (ouro.pad_token_id, ouro.bos_token_id, *ouro.eos_token_id)] == [int] * 4
    assert [type(i) for i in (huginn.pad_token_id, huginn.eos_token_id)] == [int] * 2
    for config in (ouro, huginn):
        config.save_pretrained(tmp_path / config.model_type)
        saved = json.loads((tmp_path / config.model_type / "config.json").read_text())
        assert saved["pad_token_id"] == 0 and saved["eos_token_id"] in ([2, 3], 2)


@pytest.mark.parametrize(("key", "value", "named"), [
    ("rope_theta", 0.0, "rope_theta=0.0"), ("rope_theta", "1e4", "rope_theta='1e4'"),
    ("rms_norm_eps", float("nan"), "rms_norm_eps=nan"), ("rope_parameters", {"rope_theta": -1.0}, "rope_theta=-1.0"),
    ("tie_word_embeddings", "false", "tie_word_embeddings='false'")])
def test_a_bad_rope_theta_or_norm_eps_set_on_a_built_config_is_refused_at_once(key, value, named):
    """Checked as when the config is made: a loaded model reads them at every call, and they were taken (NaN
    logits: plain greedy decoding returned token 0, and speculative decoding other tokens; a string a TypeError)."""
    config = tiny_config()
    before = (config.rope_theta, config.rms_norm_eps)
    with pytest.raises(ValueError, match=rf"OuroConfig.{re.escape(named)} is invalid"):
        setattr(config, key, value)
    assert (config.rope_theta, config.rms_norm_eps) == before


@pytest.mark.parametrize("family", ["ouro", "huginn"])
def test_a_final_norm_replaced_by_a_module_without_eps_is_named(family):
    """The KV layout's build check reads the final norm's eps inside a property, where an AttributeError ("Identity
    has no eps") was reported as the property missing: "object has no attribute 'kv_layout'" (Ouro's plain decoding
    read the norm's weight first: "Identity has no attribute 'weight'"). It names the norm, in every mode."""
    from huginn_utils import tiny_huginn

    model = tiny_model()[0] if family == "ouro" else tiny_huginn()[0]
    name = "model.norm" if family == "ouro" else "transformer.ln_f"
    setattr(model.base_model, name.split(".")[1], torch.nn.Identity())
    for mode in (None, "pipeline"):
        with pytest.raises(ValueError, match=rf"{re.escape(name)} is a Identity, which has no eps: the model's norms "
                                             r"must be RMSNorm"):
            model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, speculative_mode=mode)


def test_inputs_embeds_in_the_layers_dtype_are_taken_whatever_the_final_norm():
    """The dtype check of `inputs_embeds` reads the layers' dtype: from the final norm's weight it failed for a norm
    without one (LayerNorm without affine: an AttributeError), and from the embedding's it refused the layers' own
    dtype on a model whose embedding is kept in another (bf16 here). Both dtypes are taken, a third is named."""
    model = tiny_model()[0]
    model.model.norm = torch.nn.LayerNorm(model.config.hidden_size, eps=model.config.rms_norm_eps,
                                          elementwise_affine=False)
    model.get_input_embeddings().to(torch.bfloat16)
    embeds = model.get_input_embeddings()(torch.tensor([[1, 2, 3]]))
    for dtype in (torch.float32, torch.bfloat16):
        assert model(inputs_embeds=embeds.to(dtype)).logits.shape == (1, 3, model.config.vocab_size)
    with pytest.raises(ValueError, match=r"inputs_embeds has dtype torch.float16"):
        model(inputs_embeds=embeds.half())


def test_a_legacy_torch_dtype_beside_a_dtype_is_not_read():
    """transformers reads config.json's older `torch_dtype` only without a `dtype`: beside one, even a value that
    names no dtype ("auto") is no reason to refuse the config (the dtype check refused it for a while)."""
    assert tiny_config(dtype="float32", torch_dtype="auto").dtype == torch.float32


def test_keywords_giving_the_rope_base_twice_must_agree(tmp_path):
    """`rope_theta` and a `rope_parameters` with another base, both keywords of `from_pretrained`: transformers sets
    them one after the other (the last won, silently); they are refused, equal values load, and a bad base given as a
    keyword is refused when the model is built."""
    model, _ = tiny_model(seed=0)
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"rope_theta=10\.0 and rope_parameters=\{'rope_theta': 20\.0\} disagree"):
        AutoModelForCausalLM.from_pretrained(tmp_path, rope_theta=10.0, rope_parameters={"rope_theta": 20.0})
    same = AutoModelForCausalLM.from_pretrained(tmp_path, rope_theta=10.0, rope_parameters={"rope_theta": 10.0})
    assert same.config.rope_theta == 10.0
    saved = json.loads((tmp_path / "config.json").read_text())  # a config.json with both (rope_parameters won)
    (tmp_path / "config.json").write_text(json.dumps({**saved, "rope_parameters": {"rope_theta": 20.0}}))
    with pytest.raises(ValueError, match=r"\(config.json\): rope_theta=.* and rope_parameters=.* disagree"):
        AutoConfig.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**saved, "rope_theta": [1e6]}))  # (a TypeError from the check)
    with pytest.raises(ValueError, match=r"rope_theta=\[1000000\.0\] is invalid"):
        AutoConfig.from_pretrained(tmp_path)
    # the constructor too (rope_parameters' base won without a word); a keyword overrides config.json's other name
    with pytest.raises(ValueError, match=r"OuroConfig: rope_theta=5\.0 and rope_parameters=.* disagree"):
        OuroConfig(rope_theta=5.0, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    assert OuroConfig(rope_parameters={"rope_theta": 10000.0}).rope_theta == 10000.0
    (tmp_path / "config.json").write_text(json.dumps({**saved, "rope_theta": 5.0}))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, rope_parameters={"rope_theta": 20.0})
    assert loaded.config.rope_theta == 20.0
    for none in ({"rope_scaling": None}, {"rope_parameters": None}, {"rope_parameters": {"rope_type": "default"}}):
        assert AutoModelForCausalLM.from_pretrained(tmp_path, **none).config.rope_theta == 5.0  # no base: kept
    (tmp_path / "config.json").write_text(json.dumps(saved))
    for keywords in ({"rope_theta": 0.0}, {"rope_parameters": {"rope_theta": -1.0}}, {"attention_bias": True}):
        with pytest.raises(ValueError, match="rope_theta=.* is invalid|attention_bias=True"):
            AutoModelForCausalLM.from_pretrained(tmp_path, **keywords)


def test_a_model_class_built_from_another_familys_config_names_it():
    """`OuroForCausalLM(HuginnConfig())`, a dict or None failed in an AttributeError about a field the config lacks;
    a config of the family's model type is taken, a remote-code shim's subclass included."""
    from hf_loopspec import HuginnConfig, HuginnForCausalLM, OuroForCausalLM, OuroModel

    for cls, config, given in ((OuroForCausalLM, HuginnConfig(), "HuginnConfig (model_type='huginn_raven')"),
                               (OuroModel, None, "NoneType (model_type=None)"),
                               (OuroForCausalLM, {"vocab_size": 64}, "dict (model_type=None)"),
                               (HuginnForCausalLM, OuroConfig(), "OuroConfig (model_type='ouro')")):
        family = cls.config_class.model_type
        with pytest.raises(ValueError, match=re.escape(f"config={given}: {cls.__name__} needs a config of "
                                                       f"model_type={family!r}")):
            cls(config)
    shim = type("OuroConfig", (OuroConfig,), {})  # (as an exported repo's configuration_ouro.py defines it)
    assert isinstance(OuroForCausalLM(shim(**tiny_config().to_dict())), OuroForCausalLM)


def test_settings_changed_after_the_config_was_made_are_checked_when_the_model_is_built(tmp_path):
    """`from_pretrained`'s keyword overrides are set on the config after it checked itself: the model checks them
    before building (before, `total_ut_steps=0` loaded and the forward raised a bare IndexError). A changed layer
    count is a valid change: `layer_types` follows it."""
    model, _ = tiny_model(seed=0)
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="total_ut_steps=0"):
        AutoModelForCausalLM.from_pretrained(tmp_path, total_ut_steps=0)
    # a loaded model's config, which the model reads at every call: a bad loop count is refused where it is set
    # (before: the next forward's IndexError or TypeError)
    for bad in (0, "4", 2.0):
        with pytest.raises(ValueError, match=re.escape(f"total_ut_steps={bad!r} is invalid")):
            model.config.total_ut_steps = bad
    with pytest.raises(ValueError, match=r"total_ut_steps=np.int64\(4\) is invalid: it must be a Python integer"):
        model.config.total_ut_steps = np.int64(4)  # (it said "the stack must run at least once")
    assert model.config.total_ut_steps == tiny_config().total_ut_steps
    model.config.total_ut_steps = 2  # a valid change is the model's from the next call on
    with torch.no_grad():
        ids = random_ids((1, 5), VOCAB)
        assert torch.equal(model(ids).logits, tiny_model(seed=0, total_ut_steps=2)[0](ids).logits)
    config = tiny_config()
    config.num_key_value_heads = 3
    with pytest.raises(ValueError, match="num_key_value_heads=3"):
        AutoModelForCausalLM.from_config(config)
    config = tiny_config()
    config.num_hidden_layers = config.num_hidden_layers + 1
    assert len(AutoModelForCausalLM.from_config(config).model.layers) == len(config.layer_types) == \
        config.num_hidden_layers
    smaller = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path, num_hidden_layers=1))
    assert len(smaller.model.layers) == 1 and smaller.config.layer_types == ["full_attention"]


def test_attention_dropout_is_said_not_to_apply(caplog):
    """The attention has no dropout: a config with one builds (fine-tuning recipes carry it) and says it is not
    applied; train and eval forwards are the same."""
    with caplog.at_level(logging.WARNING, logger="hf_loopspec"):
        model, _ = tiny_model(seed=0, attention_dropout=0.1)
    assert any("attention_dropout=0.1 is not applied" in r.getMessage() for r in caplog.records)
    ids = random_ids((1, 4), VOCAB)
    with torch.no_grad():
        assert torch.equal(model.train()(ids).logits, model.eval()(ids).logits)


def test_output_attentions_raises_instead_of_returning_none():
    """The attention never materializes its weights: asking for them is refused by both models (it returned None)."""
    model, _ = tiny_model(seed=0)
    ids = random_ids((1, 4), VOCAB)
    for module in (model, model.model):
        with pytest.raises(ValueError, match="output_attentions=True"):
            module(ids, output_attentions=True)
    with pytest.raises(ValueError, match="output_attentions=True"):
        model.generate(ids, max_new_tokens=2, output_attentions=True, return_dict_in_generate=True)
    assert model(ids, output_attentions=False).logits.shape == (1, 4, VOCAB)


@pytest.mark.parametrize("scaling", [{"rope_type": "default"}, {"type": "default"},
                                     {"rope_type": "default", "rope_theta": 1_000_000.0}])
def test_rope_scaling_that_says_no_scaling_is_plain_rope(scaling):
    """A rope_scaling that names the default (no scaling) builds the model of rope_scaling=None (it was refused);
    any real scaling is still refused."""
    model, _ = tiny_model(seed=0)
    scaled, _ = tiny_model(seed=0, rope_scaling=scaling)
    ids = random_ids((1, 6), VOCAB)
    with torch.no_grad():
        assert torch.equal(scaled(ids).logits, model(ids).logits)
    with pytest.raises(ValueError, match="rope_scaling"):
        tiny_config(rope_scaling={"rope_type": "linear", "factor": 2.0})


def test_transformers_5_rope_parameters_set_the_rope(tmp_path):
    """transformers 5 writes RoPE settings as `rope_parameters`: its `rope_theta` is the model's (in the constructor,
    a config.json and a keyword of `from_pretrained` / `AutoConfig.from_pretrained`), and a scaling is refused as
    under `rope_scaling`. Before, the key was stored and never read: the model rotated by the default base."""
    ids = random_ids((1, 6), VOCAB)
    plain, _ = tiny_model(seed=0)
    based, _ = tiny_model(seed=0, rope_theta=10_000.0)
    given, _ = tiny_model(seed=0, rope_parameters={"rope_type": "default", "rope_theta": 10_000.0})
    with torch.no_grad():
        assert not torch.equal(based(ids).logits, plain(ids).logits)
        assert torch.equal(given(ids).logits, based(ids).logits)
    plain.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["rope_theta"]
    (tmp_path / "config.json").write_text(json.dumps({**config, "rope_parameters": {"rope_theta": 10_000.0}}))
    assert AutoModelForCausalLM.from_pretrained(tmp_path).config.rope_theta == 10_000.0
    keyword = {"rope_parameters": {"rope_type": "default", "rope_theta": 500.0}}
    assert AutoModelForCausalLM.from_pretrained(tmp_path, **keyword).config.rope_theta == 500.0
    assert AutoConfig.from_pretrained(tmp_path, **keyword).rope_theta == 500.0
    linear = {"rope_type": "linear", "factor": 4.0, "rope_theta": 10_000.0}
    with pytest.raises(ValueError, match=r"rope_parameters=\{'rope_type': 'linear'.* uses plain RoPE"):
        tiny_config(rope_parameters=linear)
    with pytest.raises(ValueError, match="uses plain RoPE"):
        AutoModelForCausalLM.from_pretrained(tmp_path, rope_parameters=linear)
    with pytest.raises(ValueError, match=r"rope_parameters=10000.0 is not supported"):
        tiny_config(rope_parameters=10_000.0)
    with pytest.raises(ValueError, match="rope_scaling=.* is not supported"):  # (accepted, then unloadable)
        plain.config.rope_scaling = {"rope_type": "linear", "factor": 4.0}
    with pytest.raises(ValueError, match="rope_scaling=.* is not supported"):  # (a keyword: dropped before)
        AutoConfig.from_pretrained(tmp_path, rope_scaling={"rope_type": "linear", "factor": 4.0})
    # set on a loaded model's config: the base changes at once, and the save says so in the family's own field
    plain.config.rope_parameters = {"rope_type": "default", "rope_theta": 10_000.0}
    plain.save_pretrained(tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert saved["rope_theta"] == 10_000.0 and "rope_parameters" not in saved
    with torch.no_grad():
        assert torch.equal(plain(ids).logits, based(ids).logits)


def test_head_dim_makes_indivisible_hidden_size_valid():
    config = tiny_config(num_attention_heads=6, num_key_value_heads=3, head_dim=12)
    assert config.head_dim == 12


def test_cache_sized_from_config_raises_with_loop_count():
    model, _ = tiny_model(seed=0, total_ut_steps=3)
    cache = DynamicCache(config=model.config)  # num_hidden_layers (2) layers: too few for 3 loops x 2 layers
    with pytest.raises(ValueError, match=r"loop") as info:
        model(random_ids((1, 4), VOCAB), cache=cache)
    assert "3" in str(info.value) and "6" in str(info.value)


# --- the projections' few-rows product (`layers.project`) ------------------------------------------------------


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 9])
def test_project_equals_f_linear_for_any_row_count(rows, bias):
    """`layers.project` (`weight @ x.T` for 2..8 rows eager on a CPU) against `F.linear` with the same parameters, on
    flat and batched inputs: one reduction of width in_features apart (its order differs)."""
    torch.manual_seed(rows)
    linear = torch.nn.Linear(48, 40, bias=bias)
    for x in (torch.randn(rows, 48), torch.randn(1, rows, 48)):
        with torch.no_grad():
            expected = F.linear(x, linear.weight, linear.bias)
            actual = project(linear, x)
        assert actual.shape == expected.shape
        assert_fp32_close(actual, expected, layers=1, width=48)


def test_project_calls_hooked_replaced_and_subclassed_linears():
    """What would change a module call is honoured, on the few-row path too: hooks on the module or global ones, a
    replaced `forward` (accelerate's hooks), an `nn.Linear` subclass, a weight of a tensor subclass."""
    linear, x = torch.nn.Linear(6, 5, bias=False), torch.randn(3, 6)
    calls = []
    handle = linear.register_forward_hook(lambda m, args, out: calls.append("own"))
    project(linear, x)
    handle.remove()
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, args, out: calls.append("global"))
    project(linear, x)
    handle.remove()
    assert calls == ["own", "global"]
    linear.forward = lambda x: torch.zeros(len(x), 5)
    assert torch.equal(project(linear, x), torch.zeros(3, 5))
    del linear.forward

    class Shifted(torch.nn.Linear):
        def forward(self, x):
            return super().forward(x) + 1.0

    shifted = Shifted(6, 5, bias=False)
    with torch.no_grad():
        assert torch.equal(project(shifted, x), F.linear(x, shifted.weight) + 1.0)

    class Tagged(torch.Tensor):  # a tensor subclass keeps F.linear, which its own dispatch may implement
        functions = []

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            cls.functions.append(getattr(func, "__name__", str(func)))
            return super().__torch_function__(func, types, args, kwargs or {})

    linear.weight = torch.nn.Parameter(linear.weight.detach().as_subclass(Tagged))
    assert type(linear.weight) is not torch.nn.Parameter
    Tagged.functions.clear()
    with torch.no_grad():
        project(linear, x)
    assert "linear" in Tagged.functions and "matmul" not in Tagged.functions


def test_forward_hooks_on_a_projection_run_in_the_engine_core_calls():
    """A forward hook on a projection (what interpretability code registers) runs for every core call of a
    speculative run, the few-row ones included. Eager on a CPU the engine stops at the cycle where the last sequence
    finishes (no empty calls up to the next read-back), so the layer runs once per counted core call."""
    model, _ = tiny_model(seed=3)
    ids = random_ids((1, 5), VOCAB, seed=4)
    seen = []
    handle = model.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, args, out: seen.append(len(out)))
    try:
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=6, do_sample=False, speculative_mode="pipeline",
                                 draft_loops=1, return_dict_in_generate=True)
    finally:
        handle.remove()
    assert len(seen) == out.speculation.core_calls  # one call of the layer per core call (prefill included)
    assert any(1 < rows <= 8 for rows in seen)  # the few-row calls ran under the hook


def test_head_calls_a_replaced_lm_head_module():
    """A head module that is not an `nn.Linear` (an adapter's wrapper) is called as it is."""
    model, _ = tiny_model(seed=3)
    linear = model.lm_head

    class Shifted(torch.nn.Module):
        def forward(self, x):
            return linear(x) + 1.0

    model.lm_head = Shifted()
    hidden = torch.randn(1, 2, model.config.hidden_size)
    with torch.no_grad():
        assert torch.equal(model.head(hidden), linear(hidden) + 1.0)


# --- forward's argument contract ---------------------------------------------------------------------------------


def test_return_dict_false_returns_a_tuple_as_transformers_models_do():
    """`return_dict=False` (or `config.return_dict = False`) gives a tuple: unpacking the output object gave its key
    names ("loss", "logits")."""
    model, _ = tiny_model(seed=9)
    ids = random_ids((2, 7), VOCAB, seed=11)
    with torch.no_grad():
        full = model(ids, labels=ids, use_cache=False)
        loss, logits = model(ids, labels=ids, use_cache=False, return_dict=False)
        model.config.return_dict = False
        try:
            as_config = model(ids, use_cache=False)
        finally:
            model.config.return_dict = True
    assert torch.equal(loss, full.loss) and torch.equal(logits, full.logits)
    assert isinstance(as_config, tuple) and torch.equal(as_config[0], full.logits)


def test_logits_to_keep_takes_a_count_or_the_positions_to_keep():
    """transformers' `int | Tensor` convention: a 1-D tensor lists the positions (it raised torch's 'Boolean value
    of Tensor ... is ambiguous'); a negative or fractional count is refused."""
    model, _ = tiny_model(seed=9)
    ids = random_ids((2, 7), VOCAB, seed=12)
    with torch.no_grad():
        every = model(ids, use_cache=False).logits  # (the head's product over fewer rows may round otherwise)
        assert_close(model(ids, use_cache=False, logits_to_keep=torch.tensor([1, 4])).logits, every[:, [1, 4]],
                     model.config)
        assert_close(model(ids, use_cache=False, logits_to_keep=2).logits, every[:, -2:], model.config)
    for bad in (-1, 1.5, torch.tensor([0.5])):
        with pytest.raises(ValueError, match="logits_to_keep="):
            model(ids, logits_to_keep=bad)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"exit_at_step": True}, "exit_at_step=True must be an integer in"),
    ({"exit_at_step": 4}, r"exit_at_step=4 must be an integer in \[0, 3\]"),
    ({"exit_threshold": "0.5"}, "exit_threshold='0.5' must be a number in"),
    ({"use_weighted_exit": "no"}, "use_weighted_exit='no' must be True or False"),
    ({"attention_mask": torch.full((2, 7), 2)}, r"must hold only 0 \(padding\) and 1 \(real token\), got values \[2\]"),
    ({"attention_mask": torch.ones(2, 6, dtype=torch.long)}, r"shape \(2, 6\), expected a 2-D \[batch, 7\]"),
    ({"attention_mask": torch.ones(2, 1, 7, 7, dtype=torch.long)}, r"shape \(2, 1, 7, 7\)"),
    # these failed in torch (the embedding, the rotary positions, the first layer), naming no argument
    ({"position_ids": torch.arange(3)[None]}, r"position_ids has shape \(1, 3\), but the input is \[2, 7\]"),
    ({"position_ids": torch.arange(7)[None].expand(3, 7)}, r"position_ids has shape \(3, 7\)"),
    # an AttributeError ('list' object has no attribute 'shape'), and Tensor.item()'s RuntimeError on the meta device
    ({"position_ids": list(range(7))}, r"position_ids must be a torch tensor, got a list"),
    ({"position_ids": torch.arange(7.0)}, r"position_ids has dtype torch.float32; .* integer tensor"),
    ({"attention_mask": np.ones((2, 7), dtype=np.int64)}, r"attention_mask must be a torch tensor .* got a ndarray"),
    ({"attention_mask": torch.ones(2, 7, dtype=torch.long, device="meta")}, "attention_mask is on the meta device"),
])
def test_bad_forward_arguments_raise_value_errors_naming_them(kwargs, message):
    """They were taken as another value (True as loop 1, "no" as True), or raised deep torch errors, or changed the
    logits silently (a mask of 2s shifted every position)."""
    model, _ = tiny_model(seed=9)
    ids = random_ids((2, 7), VOCAB, seed=13)
    with pytest.raises(ValueError, match=message):
        model(ids, use_cache=False, **kwargs)


def test_a_layer_count_assigned_after_building_is_refused_naming_it():
    """The KV layout read `num_hidden_layers` at every call: assigned on a built model's config, it laid the KV out
    for layers the model does not have (an IndexError in the engine; plain decoding named a cache never passed)."""
    model, _ = tiny_model(seed=9)
    ids = random_ids((1, 4), VOCAB, seed=2)
    built = model.config.num_hidden_layers
    model.config.num_hidden_layers = built - 1
    message = rf"config.num_hidden_layers={built - 1}, but the model was built with {built}: .* set it back"
    with pytest.raises(ValueError, match=message):
        model(ids)
    for mode in (None, "pipeline", "block"):
        with pytest.raises(ValueError, match=message):
            model.generate(ids, max_new_tokens=2, do_sample=False, speculative_mode=mode)
    model.config.num_hidden_layers = built
    assert model.generate(ids, max_new_tokens=2, do_sample=False).shape == (1, 6)
    for name in ("num_key_value_heads", "head_dim"):  # (the KV sizes too: an index_copy_ or size RuntimeError)
        value = getattr(model.config, name)
        setattr(model.config, name, value // 2)
        with pytest.raises(ValueError, match=rf"config.{name}={value // 2}, but the model was built with {value}"):
            model.generate(ids, max_new_tokens=2, do_sample=False, speculative_mode="pipeline")
        setattr(model.config, name, value)


@pytest.mark.parametrize("name", ["hidden_size", "vocab_size", "num_hidden_layers", "num_attention_heads",
                                  "intermediate_size", "rms_norm_eps"])
def test_a_size_assigned_after_building_is_refused_by_calls_and_by_save(name, tmp_path):
    """`hidden_size` and `vocab_size` too: the engine sized its lanes from `hidden_size` (a RuntimeError where plain
    decoding ran), and auto's calibration prompt was checked against the assigned `vocab_size` (an error naming its
    own ids); and save_pretrained wrote checkpoints whose from_pretrained refused them (for a layer count, it raised
    huggingface_hub's error blaming layer_types). The heads, MLP width and norm epsilon were ignored by the model and
    then saved (a checkpoint that did not load, or loaded with another epsilon). Set back, the model decodes and
    saves."""
    model, _ = tiny_model(seed=9)
    ids = random_ids((1, 4), VOCAB, seed=2)
    built = getattr(model.config, name)
    setattr(model.config, name, built + 16)
    message = rf"config.{name}={built + 16}, but the model was built with {built}: .* set it back"
    for mode in (None, "pipeline", "auto"):
        with pytest.raises(ValueError, match=message):
            model.generate(ids, max_new_tokens=2, do_sample=False, speculative_mode=mode)
    with pytest.raises(ValueError, match=message):  # (forward with an id the assigned vocabulary admits: an IndexError)
        model(torch.full((1, 3), built + 8) if name == "vocab_size" else ids)
    with pytest.raises(ValueError, match=message):
        model.save_pretrained(tmp_path / "edited")
    assert not (tmp_path / "edited").exists()
    setattr(model.config, name, built)
    model.save_pretrained(tmp_path / "restored")
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "restored").config.num_hidden_layers == 2


def test_a_tied_model_set_untied_is_refused_by_save_until_its_head_is_untied(tmp_path):
    """The head shares the embedding's tensor, which transformers saves once: with tie_word_embeddings set to False,
    save_pretrained wrote a checkpoint without lm_head.weight that from_pretrained refused. Untied first, the save
    reloads as the model was."""
    model, _ = tiny_model(seed=9, tie_word_embeddings=True)
    ids = random_ids((1, 4), VOCAB, seed=2)
    model.config.tie_word_embeddings = False
    with pytest.raises(ValueError, match=r"config.tie_word_embeddings=False, but this model's LM head shares"):
        model.save_pretrained(tmp_path / "edited")
    assert not (tmp_path / "edited").exists()
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.clone())  # (the fix the message names)
    model.save_pretrained(tmp_path / "untied")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "untied")
    assert loaded.lm_head.weight is not loaded.model.embed_tokens.weight
    with torch.no_grad():
        assert torch.equal(loaded.generate(ids, max_new_tokens=4, do_sample=False),
                           model.generate(ids, max_new_tokens=4, do_sample=False))


def test_numpy_exit_steps_and_one_dimensional_ids():
    """A numpy integer is an exit step (it was refused as out of range); 1-D ids name the shape to pass."""
    model, _ = tiny_model(seed=9)
    ids = random_ids((2, 7), VOCAB, seed=14)
    with torch.no_grad():
        assert torch.equal(model(ids, exit_at_step=np.int64(1)).logits, model(ids, exit_at_step=1).logits)
    with pytest.raises(ValueError, match=r"input_ids has shape \(7,\); pass a 2-D \[batch, length\] tensor"):
        model(ids[0])
    # narrower integers (a RuntimeError of the embedding; an int8 batch named in-vocabulary ids as outside it) and
    # a list or array (an AttributeError)
    for bad, message in ((ids.float(), "dtype torch.float32"), (ids.short(), "dtype torch.int16"),
                         (ids.to(torch.int8), "dtype torch.int8"), (ids.tolist(), "must be a torch tensor, got a list"),
                         (ids.numpy(), "must be a torch tensor, got a ndarray"),
                         (ids.to("meta"), "is on the meta device")):
        with pytest.raises(ValueError, match=f"input_ids (has )?{message}"):
            model(bad)
    assert torch.equal(model(ids.int()).logits, model(ids).logits)  # (int32 ids are taken)
    with torch.no_grad(), pytest.raises(ValueError, match="attention_mask is on the meta device"):  # (a later step's
        cache = model(ids, use_cache=True).past_key_values  # mask: "Cannot copy out of meta tensor")
        model(ids[:, :1], past_key_values=cache, attention_mask=torch.ones(2, 8, dtype=torch.long, device="meta"))
    with pytest.raises(ValueError, match=r"inputs_embeds has shape \(2, 7, 5\), but the model's hidden size is"):
        model(inputs_embeds=torch.randn(2, 7, 5))
    embeds = model.get_input_embeddings()(ids).detach()  # (another dtype: a matmul's RuntimeError naming no argument)
    for bad in (embeds.double(), embeds.long()):
        with pytest.raises(ValueError, match=f"inputs_embeds has dtype {bad.dtype}, but the model computes in "
                                             r"torch.float32: pass inputs_embeds.to\(torch.float32\)"):
            model(inputs_embeds=bad)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):  # (autocast: a float64 matmul error, or a
        assert torch.isfinite(model(ids).logits).all()  # residual stream and KV of another dtype than the model's)
        for bad in (embeds.double(), embeds.bfloat16()):
            with pytest.raises(ValueError, match=f"inputs_embeds has dtype {bad.dtype}"):
                model(inputs_embeds=bad)
    mixed, _ = tiny_model(seed=9)  # (an embedding kept in bf16: the layers' fp32 is taken too)
    mixed.get_input_embeddings().to(torch.bfloat16)
    with torch.no_grad():
        for given in (embeds.bfloat16(), embeds):
            assert torch.isfinite(mixed(inputs_embeds=given).logits).all()
    with pytest.raises(ValueError, match=r"computes in torch.float32 and torch.bfloat16: pass inputs_embeds.to\("
                                         r"torch.float32\)"):  # (the layers': the embedding's may not run in them)
        mixed(inputs_embeds=embeds.double())
    with torch.no_grad():  # (positions given as [T] or [1, T] are the default ones)
        for positions in (torch.arange(7), torch.arange(7)[None]):
            assert torch.equal(model(ids, position_ids=positions).logits, model(ids).logits)


def test_plain_generate_takes_inputs_embeds_and_the_dynamic_cache_implementation():
    """Plain `generate` from `inputs_embeds` gives the new tokens of the same ids (it raised transformers' 'forwarding
    not implemented'), and `cache_implementation="dynamic"` (transformers' own name for the default) decodes as the
    default does (it raised about the cache's layer count)."""
    model, _ = tiny_model(seed=9)
    ids, mask = left_pad([random_ids(6, VOCAB, seed=15), random_ids(3, VOCAB, seed=16)])
    settings = {"attention_mask": mask, "max_new_tokens": 5, "do_sample": False, "pad_token_id": 0,
                "eos_token_id": None, "speculative_mode": None}
    expected = model.generate(ids, **settings)
    embedded = model.generate(inputs_embeds=model.get_input_embeddings()(ids), **settings)
    assert torch.equal(embedded, expected[:, ids.shape[1]:])
    assert torch.equal(model.generate(ids, cache_implementation="dynamic", **settings), expected)


@pytest.mark.parametrize("with_ids", [True, False], ids=["ids-and-embeds", "embeds-only"])
@pytest.mark.parametrize("setting", ["assistant_model", "prompt_lookup_num_tokens", "prefill_chunk_size",
                                     "config-prefill_chunk_size"])
def test_inputs_embeds_with_assisted_decoding_or_a_chunked_prefill_are_refused(setting, with_ids):
    """`inputs_embeds` with an assistant model or prompt lookup (transformers' assisted loop returned other tokens
    than plain decoding without a word; without ids it blamed an empty input_ids) or a chunked prefill, given to the
    call or set in the model's generation config (it blamed position_ids, which the caller never passed): a
    ValueError naming both. The same call from input_ids decodes; `prefill_chunk_size=None` given to the call
    overrides the config's, as transformers merges it, and decodes the embedded prompt."""
    model, _ = tiny_model(seed=9)
    ids = random_ids((1, 6), VOCAB, seed=15)
    embeds = model.get_input_embeddings()(ids)
    settings = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0, "speculative_mode": None}
    given = {"assistant_model": {"assistant_model": tiny_model(seed=3)[0]},
             "prompt_lookup_num_tokens": {"prompt_lookup_num_tokens": 2},
             "prefill_chunk_size": {"prefill_chunk_size": 2}}.get(setting, {})
    if setting.startswith("config-"):
        model.generation_config.prefill_chunk_size = 2
    named = {"assistant_model": "assistant_model", "prompt_lookup_num_tokens": "prompt_lookup_num_tokens=2"}
    named = named.get(setting, "prefill_chunk_size=2")
    inputs = {"input_ids": ids} if with_ids else {}
    with torch.no_grad():
        with pytest.raises(ValueError, match=f"inputs_embeds cannot be decoded with {named}"):
            model.generate(**inputs, inputs_embeds=embeds, **settings, **given)
        expected = model.generate(ids, **settings, **given)
        if setting.endswith("prefill_chunk_size"):
            unchunked = model.generate(**inputs, inputs_embeds=embeds, **{**settings, "prefill_chunk_size": None})
            assert torch.equal(unchunked, expected[:, ids.shape[1]:] if not with_ids else expected)
    assert expected.shape == (1, 10)


@pytest.mark.parametrize("width", [3, 40])
def test_a_static_caches_step_checks_its_mask_as_a_dynamic_caches_does(width):
    """A step on the `StaticCache` of `cache_implementation="static"` with a mask of the wrong width was taken: a short
    one read as other rotary positions, a long one cut (logits off by 1-2), and a 4-D one failed inside torch."""
    model, _ = tiny_model(seed=9)
    ids = random_ids((2, 7), VOCAB, seed=15)
    with torch.no_grad():
        full = model(ids).logits[:, -1]
        for mask, message in ((torch.ones(2, width, dtype=torch.long), rf"shape \(2, {width}\), expected a 2-D "
                               r"\[batch, 7\]"), (torch.ones(2, 1, 1, 7), r"shape \(2, 1, 1, 7\)")):
            cache = looped_static_cache(model.config, model.kv_layout, 16)
            model(ids[:, :6], cache=cache, use_cache=True)
            with pytest.raises(ValueError, match=message):
                model(ids[:, 6:], attention_mask=mask, cache=cache, use_cache=True)
        step = model(ids[:, 6:], attention_mask=torch.ones(2, 7, dtype=torch.long), cache=cache, use_cache=True)
    assert_close(step.logits[:, -1], full, model.config)
    for mask in (torch.ones(2, 1, 1, 7), torch.ones(3, 7)):  # a count that cannot be read without a sync: the form
        with pytest.raises(ValueError, match=r"expected a 2-D \[2, cached \+ new columns\]"):
            check_mask(mask, 2, None, 1)


def test_forward_traces_with_torch_jit():
    """`torch.jit.trace` of the forward (as transformers' own models allow) failed in SDPA: the grouped-query flag was
    a traced tensor, not a bool."""
    model, _ = tiny_model(seed=9)
    ids = random_ids((2, 6), VOCAB, seed=16)

    class Logits(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x, use_cache=False).logits

    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (TorchScript's deprecation and tracer warnings)
        traced = torch.jit.trace(Logits(model), (ids,), check_trace=False)
        assert torch.equal(traced(ids), model(ids, use_cache=False).logits)
