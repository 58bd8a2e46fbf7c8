"""The checks of `export_checkpoint` and `build_model_card` arguments (`hf_loopspec.hub.card_checks`): a setting that
needs no weights is refused before the checkpoint loads (the loop count and family come from config.json), a value
that would be read as something else (`overwrite="False"`, `max_shard_size=2.5`) is refused rather than coerced, and
`build_model_card` refuses every argument it cannot use rather than writing it into the card. CPU, tiny checkpoints,
no network."""

from __future__ import annotations

import inspect
import re

import numpy as np
import pytest
from checkpoint_utils import save_checkpoint
from huginn_utils import tiny_huginn
from transformers import AutoModelForCausalLM

from hf_loopspec.hub import card as hub_card
from hf_loopspec.hub import export
from hf_loopspec.hub.card_checks import shard_size


@pytest.fixture(scope="module")
def ouro_src(tmp_path_factory):
    """A tiny 4-loop Ouro checkpoint folder."""
    return save_checkpoint(tmp_path_factory.mktemp("src") / "ouro", seed=1)


@pytest.fixture
def no_weights_load(monkeypatch):
    """Fail the test when the export loads the checkpoint's weights (`AutoModelForCausalLM.from_pretrained`)."""
    def refuse(cls, *args, **kwargs):
        raise AssertionError("the checkpoint was loaded before the setting was checked")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", classmethod(refuse))


@pytest.mark.parametrize(("bad", "error", "message"), [
    ({"overwrite": "False"}, ValueError, "overwrite='False' must be True or False"),
    ({"trust_remote_code": "no"}, ValueError, "trust_remote_code='no' must be True or False"),
    ({"max_shard_size": 2.5}, ValueError, "max shard size 2.5 is not a size"),  # (read as 2 bytes)
    ({"max_shard_size": "2.5"}, ValueError, "max shard size '2.5' is not a size"),
    ({"speculative_mode": "fast"}, ValueError, "speculative_mode='fast' is not supported"),
    ({"draft_loops": "1"}, ValueError, "draft_loops='1' must be an integer"),
    ({"draft_loops": 4}, ValueError, r"draft_loops=4 is outside \[1, 3\] for a model with 4 loops"),  # config's loops
    ({"tags": "code"}, ValueError, "tags='code' must be a list of strings"),
    ({"titel": "x"}, TypeError, "export_checkpoint.* keyword argument 'titel'; .* title, summary"),
    ({"sampling": {"temperature": -1}}, ValueError, "temperature=-1 must be a number > 0"),
    ({"language": "english"}, ValueError, "language='english' must be a language code"),
    ({"exit_options": {"exit_at_step": 9}}, ValueError, r"exit_at_step=9 must be an integer in \[0, 3\]"),
])
def test_settings_that_need_no_weights_are_refused_before_the_load(ouro_src, tmp_path, no_weights_load, bad, error,
                                                                   message):
    """They were checked only after `from_pretrained` had read the whole checkpoint (minutes for a real one), and
    `overwrite="False"` replaced a non-empty OUT; OUT is left as it was."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("keep")
    with pytest.raises(error, match=message):
        export.export_checkpoint(ouro_src, out, benchmarks=None, **{"overwrite": True, **bad})
    assert [path.name for path in tmp_path.iterdir()] == ["out"]  # (no staged folder left beside OUT)
    assert [path.name for path in out.iterdir()] == ["notes.txt"]


def test_a_source_of_another_family_is_refused_from_its_config(tmp_path, no_weights_load):
    """A Huginn checkpoint (a looped model hf_loopspec runs, but not Ouro) was loaded whole, then refused."""
    tiny_huginn()[0].save_pretrained(tmp_path / "huginn")
    with pytest.raises(ValueError, match="has model_type 'huginn_raven'; export supports hf_loopspec's Ouro models"):
        export.export_checkpoint(tmp_path / "huginn", tmp_path / "out", benchmarks=None)


def test_a_shard_size_is_a_whole_number_of_bytes():
    """`max_shard_size=2.5` was read as 2 bytes; a text with a decimal unit ("2.5GB") stays a size."""
    assert shard_size("2.5GB") == 2_500_000_000 and shard_size("40KB") == 40_000 and shard_size(np.int64(7)) == 7
    assert shard_size(" 500 mb ") == 500_000_000
    for bad in (2.5, 2.0, "2.5", "1.0005KB", True, 0, -5, "5 GiB", None):
        with pytest.raises(ValueError, match=re.escape(f"max shard size {bad!r} is not a size")):
            shard_size(bad)


@pytest.mark.parametrize(("bad", "message"), [
    ({"max_new_tokens": -5}, "max_new_tokens=-5 must be an integer >= 1"),  # (written into the example code)
    ({"max_new_tokens": True}, "max_new_tokens=True must be an integer >= 1"),
    ({"license": "Apache 2.0"}, "license='Apache 2.0' is not a Hub license id: give one such as apache-2.0"),
    ({"language": "english"}, "language='english' must be a language code"),
    ({"language": 123}, "language=123 must be a language code"),
    ({"eos_token_ids": "x"}, "eos_token_ids='x' must be a token id"),
    ({"eos_token_ids": []}, r"eos_token_ids=\[\] must be a token id"),
    ({"eos_token_ids": -1}, "eos_token_ids=-1 must be a token id"),
    ({"eos_token_ids": [2, "3"]}, "eos_token_ids=.* must be a token id"),
    ({"chat": True, "chat_tokens": {"im_start": "y"}}, r"chat_tokens=\{'im_start': 'y'\} must map the ChatML tokens"),
    ({"chat_tokens": {"<|im_end|>": "2"}}, "chat_tokens=.* must map the ChatML tokens"),
    ({"weights_dtype": "int3"}, "weights_dtype='int3' must be one of bfloat16, float16, float32"),
    ({"chat": "no"}, "chat='no' must be True or False"),
    ({"tokenizer": "no"}, "tokenizer='no' must be True or False"),
    ({"prompt": ""}, "prompt='' must be a non-empty string"),
    ({"title": 5}, "title=5 must be a non-empty string or None"),
])
def test_the_card_refuses_an_argument_it_cannot_use(bad, message):
    """These were written into the card as they came (its example code, its metadata, its prose)."""
    with pytest.raises(ValueError, match=message):
        hub_card.build_model_card(repo_id="me/x", **bad)


def test_every_card_argument_is_checked():
    """Each of `build_model_card`'s arguments, given a value of no use to it, is refused with a message that starts
    with its name and the value."""
    for name in inspect.signature(hub_card.build_model_card).parameters:
        arguments = {"repo_id": "me/x", name: object()}
        with pytest.raises(ValueError, match=f"^{name}=<object object"):
            hub_card.build_model_card(**arguments)


def test_the_usable_forms_of_the_checked_card_arguments_are_written():
    card = hub_card.build_model_card(
        repo_id="me/x", max_new_tokens=np.int64(64), license="openrail++", language=["en", "zho"], chat=True,
        eos_token_ids=[np.int64(0), 2], chat_tokens={"<|im_end|>": 2, "<|im_start|>": 1}, weights_dtype="bfloat16",
        tokenizer=False, base_model="someone/base").content
    assert "license: openrail++" in card and "- zho" in card and "max_new_tokens=64, do_sample=False" in card
    assert "eos_token_id=[0, 2]" in card and "`<|im_start|>` = 1, `<|im_end|>` = 2" in card and "in bfloat16" in card
    assert 'AutoTokenizer.from_pretrained("someone/base"' in card
