"""Saving and loading Ouro: save_pretrained round trip, dtype and device_map, a folder laid out like the Hub repo
(loaded through the Auto classes, with and without trust_remote_code), and strict errors for checkpoints that do
not match the config. Logits are checked against the independent reference."""

from __future__ import annotations

import contextlib
import json
import logging
import re
import shutil

import pytest
import torch
from helpers import (
    HUB_AUTO_MAP,
    VOCAB,
    config_values,
    hub_key_shapes,
    reference,
    tiny_config,
    tiny_model,
    write_hub_folder,
)
from inputs import random_ids
from safetensors import safe_open
from safetensors.torch import save_file
from tolerances import assert_fp32_close, ouro_depth
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

import hf_loopspec
from hf_loopspec import OuroConfig, OuroForCausalLM, OuroModel

ARCH = {"num_key_value_heads": 2, "head_dim": 24, "total_ut_steps": 3}  # GQA, explicit head_dim, U = 3
DEPTH = ouro_depth(tiny_config(**ARCH))  # of every fp32 comparison with the fp32 reference below


@pytest.fixture(scope="module")
def source():
    """(model, state_dict, input_ids, reference logits of the last loop) for a tiny fp32 model."""
    model, sd = tiny_model(seed=101, **ARCH)
    ids = random_ids((2, 9), VOCAB, seed=102)
    return model, sd, ids, reference(sd, ids, model.config)["loop_logits"][-1]


@pytest.fixture(scope="module")
def saved(source, tmp_path_factory):
    folder = tmp_path_factory.mktemp("saved")
    source[0].save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def hub_folder(source, tmp_path_factory):
    """A folder like the Hub repo: bf16 safetensors under the Hub key names, no Python files."""
    model, sd = source[:2]
    return write_hub_folder(tmp_path_factory.mktemp("hub"), model.config, sd, dtype=torch.bfloat16)


def bf16_reference(source):
    model, sd, ids, _ = source
    rounded = {k: v.to(torch.bfloat16) for k, v in sd.items()}  # what the bf16 file holds
    return reference(rounded, ids, model.config)


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


# --- save_pretrained / from_pretrained ------------------------------------------------------------------------


def test_save_pretrained_writes_hub_keys_and_round_trips(source, saved):
    model, sd, ids, ref = source
    with safe_open(str(saved / "model.safetensors"), "pt") as f:
        stored = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
    assert stored == hub_key_shapes(config_values(model.config))  # Hub names; lm_head is not tied away
    loaded = OuroForCausalLM.from_pretrained(saved)
    assert type(loaded) is OuroForCausalLM
    assert loaded.dtype == torch.float32 and not loaded.training
    for key, value in loaded.state_dict().items():
        torch.testing.assert_close(value, sd[key], atol=0, rtol=0)
    assert_fp32_close(logits(loaded, ids), ref, **DEPTH)
    assert loaded.config.total_ut_steps == 3 and loaded.config.head_dim == 24


def test_load_in_bfloat16(source, saved):
    loaded = OuroForCausalLM.from_pretrained(saved, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in loaded.parameters())
    out = logits(loaded, source[2])
    assert out.dtype == torch.bfloat16
    ref = bf16_reference(source)["loop_logits"][-1]
    assert (out.float() - ref).abs().max() < 0.3  # bf16 rounding through 3 loops x 2 layers


def test_load_with_device_map_cpu(source, saved):
    loaded = OuroForCausalLM.from_pretrained(saved, device_map="cpu")
    assert all(p.device.type == "cpu" for p in loaded.parameters())
    assert_fp32_close(logits(loaded, source[2]), source[3], **DEPTH)


# --- a folder laid out like the Hub repo ----------------------------------------------------------------------


def test_hub_folder_layout(hub_folder):
    assert sorted(p.name for p in hub_folder.iterdir()) == ["config.json", "generation_config.json",
                                                            "model.safetensors"]
    config = json.loads((hub_folder / "config.json").read_text())
    assert config["architectures"] == ["OuroForCausalLM"]
    assert config["auto_map"] == HUB_AUTO_MAP
    assert config["torch_dtype"] == "bfloat16"
    assert isinstance(AutoConfig.from_pretrained(hub_folder), OuroConfig)


@pytest.mark.parametrize("trust_remote_code", [False, True])
def test_hub_folder_loads_registered_causal_lm(source, hub_folder, trust_remote_code):
    # The folder holds no Python files, so only the class registered by `import hf_loopspec` can serve it.
    model = AutoModelForCausalLM.from_pretrained(hub_folder, trust_remote_code=trust_remote_code,
                                                 dtype=torch.float32)
    assert type(model) is hf_loopspec.OuroForCausalLM
    assert model.config.total_ut_steps == 3 and model.config.num_key_value_heads == 2
    ref = bf16_reference(source)
    with torch.no_grad():
        out = model(source[2], output_loop_logits=True)
    for u in range(3):
        assert_fp32_close(out.loop_logits[u], ref["loop_logits"][u], **DEPTH)
    assert_fp32_close(out.exit_gate_logits, ref["gate_logits"], **DEPTH)
    assert model.generation_config.eos_token_id == 0 and model.generation_config.pad_token_id == 0


def test_hub_folder_default_dtype_follows_torch_dtype(source, hub_folder):
    model = AutoModelForCausalLM.from_pretrained(hub_folder)
    assert type(model) is hf_loopspec.OuroForCausalLM
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    ref = bf16_reference(source)["loop_logits"][-1]
    assert (logits(model, source[2]).float() - ref).abs().max() < 0.3


def test_hub_folder_loads_base_model(source, hub_folder):
    model = AutoModel.from_pretrained(hub_folder, dtype=torch.float32)  # lm_head.weight is skipped
    assert type(model) is OuroModel
    ref = bf16_reference(source)
    with torch.no_grad():
        out = model(source[2], output_hidden_states=True)
    assert_fp32_close(out.last_hidden_state, ref["loop_hidden"][-1], **DEPTH)
    for u in range(3):
        assert_fp32_close(out.hidden_states[u + 1], ref["loop_hidden"][u], **DEPTH)


# --- checkpoints that do not match the config -----------------------------------------------------------------


def broken_folder(tmp_path, source, edit):
    model, sd = source[:2]
    folder = write_hub_folder(tmp_path / "broken", model.config, sd, dtype=torch.float32)
    tensors = {k: v.clone() for k, v in sd.items()}
    edit(tensors)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


BROKEN = {
    "missing": (lambda sd: sd.pop("model.layers.1.mlp.up_proj.weight"), "model.layers.1.mlp.up_proj.weight"),
    "unexpected": (lambda sd: sd.update({"model.layers.0.self_attn.q_proj.bias": torch.zeros(96)}),
                   "model.layers.0.self_attn.q_proj.bias"),
    "mismatched": (lambda sd: sd.update({"model.layers.0.self_attn.k_proj.weight": torch.zeros(96, 64)}),
                   "model.layers.0.self_attn.k_proj.weight"),
}


@contextlib.contextmanager
def load_reports():
    """The "LOAD REPORT" warnings transformers logs inside the block (its loggers do not propagate to caplog's)."""
    logger, records = logging.getLogger("transformers.modeling_utils"), []
    handler = logging.Handler()
    handler.emit = records.append
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        records[:] = [record for record in records if "LOAD REPORT" in record.getMessage()]


@pytest.mark.parametrize("loader", [OuroForCausalLM.from_pretrained, AutoModelForCausalLM.from_pretrained],
                         ids=["OuroForCausalLM", "AutoModelForCausalLM"])
@pytest.mark.parametrize("kind", list(BROKEN))
def test_mismatching_checkpoint_raises_value_error_naming_the_key(tmp_path, source, kind, loader):
    """The ValueError names the key; transformers' load report, which calls such weights "newly initialized" (and
    made a CLI error many lines), is not logged."""
    edit, key = BROKEN[kind]
    folder = broken_folder(tmp_path, source, edit)
    with load_reports() as reports, pytest.raises(ValueError, match=kind) as info:
        loader(folder)
    assert key in str(info.value)
    assert "(ouro: vocab_size=" in str(info.value) and len(str(info.value)) < 500  # (the sizes, not the whole config)
    assert reports == []


def test_a_refused_load_logs_no_report_when_logging_records_no_threads(tmp_path, source, monkeypatch):
    """`logging.logThreads = False` leaves `record.thread` None: the report of a refused load is still held."""
    monkeypatch.setattr(logging, "logThreads", False)
    folder = broken_folder(tmp_path, source, BROKEN["missing"][0])
    with load_reports() as reports, pytest.raises(ValueError, match="missing"):
        AutoModelForCausalLM.from_pretrained(folder)
    assert reports == []


def test_ignore_mismatched_sizes_keeps_its_transformers_meaning(tmp_path, source):
    """`ignore_mismatched_sizes=True` (say, loading with another `vocab_size`): the mis-shaped tensors start afresh
    at the new shape and every other tensor is the checkpoint's (transformers' load report says which); a missing
    key still raises."""
    model, sd = source[:2]
    folder = write_hub_folder(tmp_path / "hub", model.config, sd, dtype=torch.float32)
    vocab = model.config.vocab_size + 7
    with load_reports() as reports:
        loaded = AutoModelForCausalLM.from_pretrained(folder, vocab_size=vocab, ignore_mismatched_sizes=True)
    assert len(reports) == 1 and "model.embed_tokens.weight" in reports[0].getMessage()
    assert loaded.get_input_embeddings().weight.shape[0] == vocab
    state = loaded.state_dict()
    for key, tensor in sd.items():
        if key in ("model.embed_tokens.weight", "lm_head.weight"):
            assert state[key].shape[0] == vocab
        else:
            assert torch.equal(state[key], tensor.float()), key
    with pytest.raises(ValueError, match="mismatched_keys"):
        AutoModelForCausalLM.from_pretrained(folder, vocab_size=vocab)
    broken = broken_folder(tmp_path, source, BROKEN["missing"][0])
    with pytest.raises(ValueError, match="missing"):
        AutoModelForCausalLM.from_pretrained(broken, ignore_mismatched_sizes=True)


@pytest.mark.parametrize("model_type", ["gpt2", "huginn_raven"])
def test_a_checkpoint_of_another_family_is_refused_before_its_weights_load(tmp_path, saved, model_type):
    """A config.json naming another `model_type` is refused by the family's class, whose tensors fit or not
    (transformers only warned, then built the class's model from the other family's config: a GPT-2 folder made a
    default-sized Ouro); the auto class still loads the checkpoint as what it is."""
    folder = tmp_path / "relabelled"
    shutil.copytree(saved, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": model_type}))
    for loader in (OuroForCausalLM, OuroModel):
        with pytest.raises(ValueError, match=rf"model_type='{model_type}'.*cannot load .*AutoModelForCausalLM"):
            loader.from_pretrained(folder)
    with pytest.raises(ValueError, match="model_type='ouro'.*HuginnForCausalLM cannot load"):
        hf_loopspec.HuginnForCausalLM.from_pretrained(saved)
    assert type(AutoModelForCausalLM.from_pretrained(saved)) is OuroForCausalLM


def test_base_model_missing_key_raises(tmp_path, source):
    folder = broken_folder(tmp_path, source, lambda sd: sd.pop("model.norm.weight"))
    with pytest.raises(ValueError, match="model.norm.weight|norm.weight"):
        AutoModel.from_pretrained(folder)


@pytest.mark.parametrize("setting", [{"speculative_mode": "pipeline"}, {"draft_loops": 1}, {"temperature": 0.5},
                                     {"max_new_tokens": 5, "use_cache": False, "top_k": 3}])
def test_decoding_settings_given_to_from_pretrained_are_named(saved, tmp_path, setting):
    """Settings only `generate` takes raise a `ValueError` naming every one of them and where they go (the model's
    `__init__` raised a TypeError naming the first: lm-eval's own command hands `--model_args` keys to
    `from_pretrained`); a base model, which does not generate, says to load the causal LM. A generation key that the
    config holds (`use_cache`, `eos_token_id`, or one a config.json adds) still sets the config, as transformers
    does, through the family's class too."""
    named = ", ".join(f"{key}={value!r}" for key, value in setting.items() if key != "use_cache")
    with pytest.raises(ValueError, match=rf"^{re.escape(named)}: decoding settings, which generate takes .* pass "
                                         r"them to generate\(\.\.\.\), or set them on model.generation_config .*"
                                         "--gen_kwargs"):
        AutoModelForCausalLM.from_pretrained(saved, **setting)
    with pytest.raises(ValueError, match=rf"^{re.escape(named)}: .* OuroModel does not generate: load the causal LM"):
        AutoModel.from_pretrained(saved, **setting)
    assert AutoModelForCausalLM.from_pretrained(saved, eos_token_id=5).config.eos_token_id == 5
    folder = tmp_path / "own-key"
    shutil.copytree(saved, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "decoder_start_token_id": 1}))
    for loader in (OuroForCausalLM, OuroModel, AutoModelForCausalLM):
        assert loader.from_pretrained(folder, decoder_start_token_id=3).config.decoder_start_token_id == 3


@pytest.mark.parametrize("family", ["ouro", "huginn"])
def test_a_tied_checkpoint_loaded_untied_is_told_to_load_tied(tmp_path, family):
    """A checkpoint saved with a tied head has no `lm_head.weight`; loading it with `tie_word_embeddings=False` (Huginn:
    or `tie_embeddings=False`) was refused as a checkpoint of another family or shape. The refusal names the keyword
    given and how to untie after loading; loaded tied, it decodes as the saved model. An untied checkpoint without its
    head (broken: loading it tied would make a head of the embedding), or one missing another tensor, keeps the
    general advice."""
    from huginn_utils import tiny_huginn

    model = tiny_model(seed=3, tie_word_embeddings=True)[0] if family == "ouro" else tiny_huginn(seed=6)[0]
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    model.save_pretrained(tmp_path / "tied")
    for key in ("tie_word_embeddings", "tie_embeddings") if family == "huginn" else ("tie_word_embeddings",):
        advice = r"\['lm_head.weight'\]\. The checkpoint was saved with its LM head tied .*, and tie_word_embeddings="
        with pytest.raises(ValueError, match=advice + r"False.*load it without that, then untie .*model\.lm_head"):
            AutoModelForCausalLM.from_pretrained(tmp_path / "tied", **{key: False})
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "tied")
    ids = random_ids((1, 6), model.config.vocab_size, seed=2)
    settings = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0, "eos_token_id": None}
    settings |= {} if family == "ouro" else {"init_scale": 0.0}
    assert torch.equal(loaded.generate(ids, **settings), model.generate(ids, **settings))

    config = json.loads((tmp_path / "tied" / "config.json").read_text())
    untied = {**config, "tie_word_embeddings": False} | ({"tie_embeddings": False} if family == "huginn" else {})
    (tmp_path / "tied" / "config.json").write_text(json.dumps(untied))  # (an untied checkpoint that lost its head)
    for given in ({}, {"tie_word_embeddings": False}):
        with pytest.raises(ValueError, match="Check that the checkpoint belongs to this model family"):
            AutoModelForCausalLM.from_pretrained(tmp_path / "tied", **given)
    if family == "ouro":  # no checkpoint to read: the state dict of a tied model into an untied config
        with pytest.raises(ValueError, match="Check that the checkpoint belongs to this model family"):
            weights = {key: value for key, value in model.state_dict().items() if key != "lm_head.weight"}
            OuroForCausalLM.from_pretrained(None, config=tiny_config(), state_dict=weights)
    (tmp_path / "tied" / "config.json").write_text(json.dumps(config))
    weights = tmp_path / "tied" / "model.safetensors"
    with safe_open(weights, "pt") as f:  # the checkpoint less another tensor than the head's
        kept = {key: f.get_tensor(key) for key in sorted(f.keys())[:-1]}
    save_file(kept, weights, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="Check that the checkpoint belongs to this model family"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "tied", tie_word_embeddings=False)
