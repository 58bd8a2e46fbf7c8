"""Hub export (`hf_loopspec.hub`): the folder layout, loading through remote code only in a fresh process (with and
without a prior `import hf_loopspec`, and without the package), `custom_generate` on hf_loopspec models and on a
different class that owns Ouro weights (shared, not copied; streamer and stopping criteria included), the model
card's metadata and speed section, the rendered variant cards, and the `export` command line. CPU, fp32, tiny
random models, no network: speculative outputs must equal plain greedy decoding."""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
from importlib import resources
from pathlib import Path
from types import SimpleNamespace

import pytest
import tomllib
import torch
from checkpoint_utils import save_checkpoint, word_tokenizer
from huggingface_hub import ModelCard
from inputs import left_pad, random_prompts
from processes import ROOT, subprocess_env
from recorders import RecordingStreamer, StopAtWidth
from safetensors.torch import load_file
from speculative_utils import tiny_spec_model
from torch import nn
from transformers import AutoModelForCausalLM
from transformers.dynamic_module_utils import check_python_requirements
from transformers.generation.stopping_criteria import StoppingCriteriaList

import hf_loopspec
from hf_loopspec.bench import args as bench_args
from hf_loopspec.bench.report import command_line
from hf_loopspec.hub import card as hub_card
from hf_loopspec.hub import custom_generate, export, install, shims

NEW = 12
PAD = 0
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
CHATML_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|>{% endfor %}"


# --- fixtures ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """(model, folder): a tiny fp32 Ouro that accepts some drafts, saved with a word-level chat tokenizer."""
    model = tiny_spec_model(seed=5, damp=0.15)
    folder = tmp_path_factory.mktemp("src")
    model.save_pretrained(folder)
    word_tokenizer(model.config.vocab_size, CHAT_TEMPLATE).save_pretrained(folder)
    return model, folder


@pytest.fixture(scope="module")
def exported(source, tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "Ouro-tiny-loopspec"
    export.export_checkpoint(source[1], out, max_shard_size="40KB", base_model="ByteDance/Ouro-1.4B",
                             repo_id="someone/Ouro-tiny-loopspec", benchmarks=None)
    return out


@pytest.fixture(scope="module")
def batch():
    return left_pad(random_prompts(7, [5, 9], 96), PAD)


@pytest.fixture(scope="module")
def expected(source, batch):
    """Plain greedy continuations of `batch` (transformers' own loop)."""
    ids, mask = batch
    with torch.no_grad():
        return source[0].generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=PAD,
                                  speculative_mode=None)


def fresh_env(tmp_path: Path) -> dict:
    """Environment of a fresh interpreter: its own remote-code module cache, offline, hf_loopspec importable (from
    the checkout when it is not installed) but not imported."""
    return subprocess_env(HF_HOME=str(tmp_path / "hf_home"), drop=("HF_MODULES_CACHE",))


def run_fresh(script: str, tmp_path: Path, *args: str) -> dict:
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(script))
    proc = subprocess.run([sys.executable, str(path), *args], check=False, capture_output=True, text=True,
                          env=fresh_env(tmp_path), cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, f"fresh process failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --- the folder -------------------------------------------------------------------------------------------------------


def test_export_writes_a_hub_ready_folder(exported, source):
    files = {str(p.relative_to(exported)) for p in exported.rglob("*") if p.is_file()}
    assert {"config.json", "generation_config.json", "configuration_ouro.py", "modeling_ouro.py", "README.md",
            "custom_generate/generate.py", "custom_generate/requirements.txt", "tokenizer.json",
            "model.safetensors.index.json"} <= files
    shards = sorted(f for f in files if f.endswith(".safetensors"))
    assert len(shards) > 1, "a small max_shard_size must shard the weights"
    weights = {}
    for shard in shards:
        weights |= load_file(str(exported / shard))
    assert set(weights) == set(source[0].state_dict())
    for key, value in source[0].state_dict().items():
        assert torch.equal(weights[key], value), key
    modes = {f: (exported / f).stat().st_mode & 0o777 for f in files}
    assert set(modes.values()) == {modes["README.md"]}, modes  # the weights as readable as the card

    config = json.loads((exported / "config.json").read_text())
    assert config["auto_map"] == export.AUTO_MAP and config["architectures"] == ["OuroForCausalLM"]
    assert config["model_type"] == "ouro"
    gen = json.loads((exported / "generation_config.json").read_text())
    assert (gen["speculative_mode"], gen["draft_loops"], gen["num_speculative_tokens"]) == ("auto", 1, 4)
    assert gen["pad_token_id"] == PAD
    requirements = (exported / "custom_generate" / "requirements.txt").read_text().splitlines()
    assert f"hf-loopspec>={hf_loopspec.__version__}" in requirements  # the form transformers checks
    assert any(line.startswith("#") and install.install_command() in line for line in requirements)
    # pyproject.toml's transformers range, a bound per line (transformers compares one bound per line), which
    # transformers' own check of a custom_generate folder passes here
    pinned = next(dep for dep in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
                  if dep.startswith("transformers"))
    assert {line for line in requirements if line.startswith("transformers")} == {
        f"transformers{bound}" for bound in pinned.removeprefix("transformers").split(",")}
    check_python_requirements(exported, "custom_generate/requirements.txt")


def test_export_of_a_chatml_model_stops_at_the_end_of_turn(source, tmp_path):
    """With a ChatML template (Ouro's Thinking models), `<|im_end|>` (2) joins the eos ids of generation_config.json."""
    src = tmp_path / "chat-src"
    source[0].save_pretrained(src)
    word_tokenizer(source[0].config.vocab_size, CHATML_TEMPLATE).save_pretrained(src)
    for eos, want in ((None, [2]), (0, [0, 2]), ([0, 2], [0, 2])):
        config = json.loads((src / "config.json").read_text())
        config["eos_token_id"] = eos
        (src / "config.json").write_text(json.dumps(config))
        (src / "generation_config.json").unlink(missing_ok=True)
        out = export.export_checkpoint(src, tmp_path / f"out-{eos}", benchmarks=None)
        assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == want
        assert f"generation stops at token {' or '.join(map(str, want))}" in (out / "README.md").read_text()


def test_a_chat_cards_token_ids_are_its_tokenizers(source, tmp_path):
    """The card names the ChatML tokens by the ids of the exported tokenizer (it gave Ouro's 1, 2 and 0 for any
    tokenizer), and a chat template that is not ChatML by no ids."""
    vocab = source[0].config.vocab_size
    src = tmp_path / "chat-src"
    source[0].save_pretrained(src)
    word_tokenizer(vocab, CHATML_TEMPLATE, specials_at=vocab - 3).save_pretrained(src)
    out = export.export_checkpoint(src, tmp_path / "out", benchmarks=None)
    card = (out / "README.md").read_text()
    assert (f"a ChatML chat template (`<|im_start|>` = {vocab - 2}, `<|im_end|>` = {vocab - 1}). A turn ends with "
            f"`<|im_end|>` and a document with `<|endoftext|>` = {vocab - 3};") in card
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"][-1] == vocab - 1
    plain = export.export_checkpoint(source[1], tmp_path / "plain", benchmarks=None)  # CHAT_TEMPLATE: not ChatML
    assert "The tokenizer carries a chat template;" in (plain / "README.md").read_text()


def test_sampling_settings_of_the_checkpoint_are_credited_to_it(source, tmp_path):
    """A source whose generation_config.json samples: the card uses all its sampling settings (min_p and
    repetition_penalty were dropped) and says they come from there (it said "recommended by the base model's card", for
    a source with no card and no base model)."""
    src = tmp_path / "sampling-src"
    source[0].save_pretrained(src)
    word_tokenizer(source[0].config.vocab_size).save_pretrained(src)
    config = json.loads((src / "generation_config.json").read_text())
    (src / "generation_config.json").write_text(json.dumps({**config, "do_sample": True, "temperature": 0.7,
                                                            "top_p": 0.9, "top_k": 20, "min_p": 0.05,
                                                            "repetition_penalty": 1.1}))
    card = (export.export_checkpoint(src, tmp_path / "out", benchmarks=None) / "README.md").read_text()
    assert ("Sampling settings recommended by the checkpoint's `generation_config.json`: temperature=0.7, top_p=0.9, "
            "top_k=20, min_p=0.05, repetition_penalty=1.1.") in card
    assert "do_sample=True, temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, repetition_penalty=1.1)" in card
    assert "base model's card" not in card


@pytest.mark.parametrize("base_model", ["./local-model", "/abs/path/model"])
def test_a_source_cards_base_model_that_is_a_path_is_left_out_with_a_warning(source, tmp_path, caplog, base_model):
    """A local fine-tune's card may name its base model by path: the export's card wrote it as the Hub's base_model
    (which the Hub rejects) and linked https://huggingface.co/./local-model. It is left out, with a warning naming
    --base-model; a Hub id there is kept."""
    src = tmp_path / "src"
    source[0].save_pretrained(src)
    for named, kept in ((base_model, False), ("someone/base", True)):
        (src / "README.md").write_text(f"---\nbase_model: {named}\nlicense: mit\n---\n# Model\n\nA fine-tune.\n")
        with caplog.at_level(logging.WARNING, logger="hf_loopspec"):
            out = export.export_checkpoint(src, tmp_path / f"out-{kept}", benchmarks=None)
        card, data = (out / "README.md").read_text(), ModelCard.load(out / "README.md").data.to_dict()
        assert data.get("base_model") == ("someone/base" if kept else None), data
        assert ("huggingface.co/someone/base" in card) == kept and "huggingface.co/." not in card
        assert ("is no Hub repo id" in caplog.text) != kept and (kept or "--base-model" in caplog.text)
        caplog.clear()


def test_an_exit_option_of_the_checkpoint_is_on_the_card_and_a_bad_one_refused(source, tmp_path):
    """A source whose generation_config.json sets an exit option: the export keeps it and its card says `generate`
    decodes from that exit (it said "from the last loop"); a setting every `generate` of the export would raise on
    (an exit past the loops, two exits, Huginn's num_steps) is refused before anything is written (it was copied,
    exit 0)."""
    src = tmp_path / "exit-src"
    source[0].save_pretrained(src)
    word_tokenizer(source[0].config.vocab_size).save_pretrained(src)
    config = json.loads((src / "generation_config.json").read_text())
    config.pop("_from_model_config", None)  # (a file marked so loses its extra keys as it loads)
    for given in ({"exit_at_step": 0}, {"exit_threshold": 0.5}):
        (src / "generation_config.json").write_text(json.dumps({**config, **given}))
        out = export.export_checkpoint(src, tmp_path / f"out-{next(iter(given))}", benchmarks=None)
        card = (out / "README.md").read_text()
        name, value = next(iter(given.items()))
        assert f"sets `{name}={value!r}`: `generate` decodes from that exit" in card
        assert "decodes from the last loop" not in card
        assert json.loads((out / "generation_config.json").read_text())[name] == value
    for bad, match in [({"exit_at_step": 7}, "exit_at_step=7 must be"), ({"exit_at_step": 1, "exit_threshold": 0.5},
                       "Pass at most one"), ({"num_steps": 8}, "num_steps=8: OuroForCausalLM has no recurrence"),
                       ({"speculative_trace": True}, "speculative_trace=True in a generation config is not read")]:
        (src / "generation_config.json").write_text(json.dumps({**config, **bad}))
        with pytest.raises(ValueError, match=f"the source's generation_config.json: .*{match}.*; correct it "):
            export.export_checkpoint(src, tmp_path / "bad", benchmarks=None)
        assert not (tmp_path / "bad").exists()


def test_the_sources_other_speculative_settings_are_left_out_with_a_warning(source, tmp_path, caplog):
    """The export writes its own speculative defaults; the source's settings it has no argument for were copied
    beside them: a saved `second_draft_loops` next to the export's auto mode made every default `generate` of the
    export raise, and a saved `compile_core` or `speculative_engine` generate refuses was exported without a word."""
    src = tmp_path / "src"
    model = source[0]
    model.save_pretrained(src)
    word_tokenizer(model.config.vocab_size).save_pretrained(src)
    config = json.loads((src / "generation_config.json").read_text())
    config.pop("_from_model_config", None)  # (a file marked so loses its extra keys as it loads)
    saved = {"speculative_mode": "pipeline", "draft_loops": 1, "second_draft_loops": model.num_loops - 1,
             "compile_core": "not-a-backend", "speculative_engine": "lanes"}
    (src / "generation_config.json").write_text(json.dumps({**config, **saved}))
    with caplog.at_level(logging.WARNING, logger="hf_loopspec"):
        out = export.export_checkpoint(src, tmp_path / "out", benchmarks=None)
    assert ("sets compile_core='not-a-backend', speculative_engine='lanes', "
            f"second_draft_loops={model.num_loops - 1}, which the export leaves out: its speculative defaults are the "
            "export's own (speculative_mode='auto', draft_loops=1, num_speculative_tokens=4)") in caplog.text
    written = json.loads((out / "generation_config.json").read_text())
    assert written["speculative_mode"] == "auto"
    assert not {"second_draft_loops", "compile_core", "speculative_engine"} & set(written), written
    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.tensor([[5, 17, 42, 9]])
    with torch.inference_mode():  # the export's default call runs, as plain decoding (greedy, fp32)
        assert exported.generate(ids, max_new_tokens=6).tolist() == \
            model.generate(ids, max_new_tokens=6, speculative_mode=None).tolist()


def test_a_reexport_keeps_the_models_name_and_language(tmp_path):
    """Exporting an exported folder again keeps the model's name (it travels in the card's `model_name`: the second
    card was titled and coded after the first export's folder) and its `language`."""
    first = export.export_checkpoint("default", tmp_path / "rx1", benchmarks=None)
    second = export.export_checkpoint(first, tmp_path / "rx2", benchmarks=None)
    cards = [ModelCard.load(folder / "README.md") for folder in (first, second)]
    assert cards[0].data.model_name == "hf-loopspec-default" and cards[0].data.language == ["code"]
    assert cards[1].data.to_dict() == cards[0].data.to_dict()
    for card in cards:
        assert card.text.lstrip().startswith("# hf-loopspec-default")
        assert "your-username/hf-loopspec-default" in card.text
        assert "rx1" not in card.text

    # a card with benchmark results keeps its name only as model-index's (the re-export was titled "rx3")
    results = [ROOT / "bench_results" / "cpu_default_b1.json"]
    measured = export.export_checkpoint("default", tmp_path / "rx3", benchmarks=results)
    again = ModelCard.load(export.export_checkpoint(measured, tmp_path / "rx4", benchmarks=None) / "README.md")
    assert again.data.model_name == "hf-loopspec-default" and again.text.lstrip().startswith("# hf-loopspec-default")


def test_each_benchmark_keeps_its_own_model_index_entry(tmp_path):
    """Five bench results (an Intel machine with two threads, greedy and sampled; an AMD one with one thread; the
    first one's command repeated on another machine and with a prompt file): every metric of the card's model-index
    sits under its own workload, read back by huggingface_hub, which groups entries by dataset type, config and split
    (with the workload as the name alone, every metric went under the first one's; with the flags alone as config,
    one command's runs on two machines or prompt files did)."""
    names = ("cpu_default_b1.json", "cpu_default_b1_sampling.json", "cpu_default_threads1.json")
    results = [json.loads((ROOT / "bench_results" / name).read_text()) for name in names]
    first = results[0]
    scaled = [{**row, "tokens_per_s": row["tokens_per_s"] / 3} for row in first["rows"]]
    results += [{**first, "machine": {**first["machine"], "device_name": "Another CPU"}, "rows": scaled},
                {**first, "args": {**first["args"], "prompt_file": "/data/my_prompts.txt"}, "rows": scaled[::-1]}]
    card = ModelCard.load(export.export_checkpoint("default", tmp_path / "out", benchmarks=results) / "README.md")
    expected = {}
    for result in results:
        workload = (result["machine"]["device_name"], result["args"]["threads"], result.get("sampling") is not None,
                    result["args"]["prompt_file"] is not None)
        for row in result["rows"]:
            expected[(*workload, f"{row['mode']} tokens/s")] = round(row["tokens_per_s"], 4)
    got, groups = {}, {(entry.dataset_name, entry.dataset_config) for entry in card.data.eval_results}
    for entry in card.data.eval_results:
        machine = next(name for name, *_ in expected if name in entry.dataset_name)
        assert entry.dataset_config.endswith(f" on {machine}")
        threads = int(entry.dataset_name.split(" thread")[0].rsplit(", ", 1)[1])
        prompts = "--prompt-file my_prompts.txt " in entry.dataset_config
        if entry.metric_name.endswith("tokens/s"):
            key = (machine, threads, entry.dataset_name.endswith(", sampling"), prompts, entry.metric_name)
            assert key not in got
            got[key] = entry.metric_value
    assert got == expected and len(groups) == 5


def test_a_source_cards_metadata_is_checked_as_the_flags_are(source, tmp_path, caplog):
    """The source card's license is used only when it is a Hub license id, like --license's (it was written into the
    card as it came), and a language that is no language code is left out with a warning."""
    src = tmp_path / "src"
    shutil.copytree(source[1], src)
    (src / "README.md").write_text("---\nlicense: Apache License 2.0\nlanguage: 5\n---\n# a card\n")
    with pytest.raises(ValueError, match="license: 'Apache License 2.0', which is not a Hub license id; pass --"):
        export.export_checkpoint(src, tmp_path / "out", benchmarks=None)
    assert not (tmp_path / "out").exists()
    out = export.export_checkpoint(src, tmp_path / "out", benchmarks=None, license="mit")
    data = ModelCard.load(out / "README.md").data.to_dict()
    assert data["license"] == "mit" and "language" not in data
    assert "the source card's language 5 is no language code" in caplog.text
    for language, kept in (("English", False), ("[en, English]", False), ("''", False), ("[en, zh-Hans]", False),
                           ("code", True), ("[en, multilingual]", True), ("[en, zho]", True)):
        (src / "README.md").write_text(f"---\nlicense: openrail++\nlanguage: {language}\n---\n# a card\n")
        out = export.export_checkpoint(src, tmp_path / "out", benchmarks=None, overwrite=True)
        data = ModelCard.load(out / "README.md").data.to_dict()
        assert data["license"] == "openrail++" and ("language" in data) == kept, (language, data)


def test_shims_import_hf_loopspec_only_inside_try():
    """transformers' `check_imports` must not list hf_loopspec as a hard requirement of the remote code."""
    from transformers.dynamic_module_utils import get_imports

    for name in ("configuration_ouro.py", "modeling_ouro.py", "custom_generate/generate.py"):
        assert "hf_loopspec" not in get_imports(shims.TEMPLATES / name), name


def test_the_sources_speculative_settings_set_to_null_are_left_out_without_a_word(source, tmp_path, caplog):
    """A null changes nothing, but docs/export.md says the keys export has no option for are left out: they were
    written back as nulls."""
    src = tmp_path / "src"
    source[0].save_pretrained(src)
    word_tokenizer(source[0].config.vocab_size).save_pretrained(src)
    config = json.loads((src / "generation_config.json").read_text())
    config.pop("_from_model_config", None)  # (a file marked so loses its extra keys as it loads)
    nulls = {"second_draft_loops": None, "compile_core": None, "speculative_engine": None}
    (src / "generation_config.json").write_text(json.dumps({**config, **nulls}))
    with caplog.at_level(logging.WARNING, logger="hf_loopspec"):
        out = export.export_checkpoint(src, tmp_path / "out", speculative_mode=None, benchmarks=None)
    assert "leaves out" not in caplog.text
    assert not set(nulls) & set(json.loads((out / "generation_config.json").read_text()))


def test_export_refuses_a_non_empty_folder_and_bad_settings(source, tmp_path):
    (tmp_path / "x.txt").write_text("keep")
    with pytest.raises(FileExistsError, match="overwrite"):
        export.export_checkpoint(source[1], tmp_path, benchmarks=None)
    with pytest.raises(ValueError, match="draft_loops"):
        export.export_checkpoint(source[1], tmp_path / "new", speculative_mode="pipeline", draft_loops=3,
                                 benchmarks=None)
    # plain decoding by default still writes the depths a later speculative call reads: checked alike
    for bad, match in [({"draft_loops": 7}, "draft_loops=7"),
                       ({"num_speculative_tokens": 0}, "num_speculative_tokens")]:
        with pytest.raises(ValueError, match=match):
            export.export_checkpoint(source[1], tmp_path / "new", speculative_mode=None, benchmarks=None, **bad)
    for falsy in ("", False, 0):  # (checked as the default "auto": written as given, refused by every generate)
        with pytest.raises(ValueError, match=f"speculative_mode={falsy!r} is not supported"):
            export.export_checkpoint(source[1], tmp_path / "new", speculative_mode=falsy, benchmarks=None)
    one_loop = save_checkpoint(tmp_path / "one-loop", total_ut_steps=1)  # cannot speculate: no depths to check
    with pytest.raises(ValueError, match=r"a model of 1 loop has no shallower loop .* --speculative-mode none"):
        export.export_checkpoint(one_loop, tmp_path / "one", benchmarks=None)  # (the default: auto)
    out = export.export_checkpoint(one_loop, tmp_path / "one", speculative_mode=None, benchmarks=None)
    saved = json.loads((out / "generation_config.json").read_text())
    # plain decoding, and no draft settings that no call could use (it wrote the default draft_loops and K)
    assert saved["speculative_mode"] is None and not {"draft_loops", "num_speculative_tokens"} & set(saved)
    card = (out / "README.md").read_text()  # offers no speculative mode (generate refuses them all on it)
    assert "`custom_generate/`: the same decoding for" in card and "strategies" not in card
    assert "**No self-speculation.**" in card and 'speculative_mode="' not in card and "to speculate" not in card
    # nor does its lead or its tags (they said "decoded with lossless pipelined or block self-speculation")
    assert "self-speculation." not in card.split("**No self-speculation.**")[0]
    assert "speculative-decoding" not in ModelCard.load(out / "README.md").data.tags
    # nor its code, speed section or limitations (they spoke of speculative output, drafting and its speed-up)
    for speculative in ("speculative equals plain", "drafting", "Speculation pays off", "speculative output"):
        assert speculative not in card, speculative
    assert "--modes plain" in card and "## Limitations" in card
    assert (tmp_path / "x.txt").read_text() == "keep"
    for bad, match in [({"repo_id": "a/b/c"}, "--repo-id 'a/b/c'"), ({"repo_id": "../evil"}, "--repo-id '../evil'"),
                       ({"repo_id": "name-only"}, "namespace/name"), ({"base_model": "x y"}, "--base-model 'x y'"),
                       ({"license": "not a license!"}, "--license 'not a license!'")]:
        with pytest.raises(ValueError, match=re.escape(match)):  # refused before anything loads or is written
            export.export_checkpoint(source[1], tmp_path / "new", benchmarks=None, **bad)
    assert not (tmp_path / "new").exists()


def test_the_card_sizes_the_kv_of_this_model():
    """The Limitations quote the exported model's own KV bytes per context token (bf16, every loop), and the
    pipeline prose its own loop count: an export of a 3-loop model said "loop 1 of 4" and quoted Ouro-1.4B's KV."""
    model = tiny_spec_model(0, 3, vocab=64)
    layout = model.kv_layout
    per_token = 2 * layout.num_layers * layout.num_kv_heads * layout.head_dim * 2 * 3
    assert export.kv_bytes_per_token(model) == per_token
    text = hub_card.build_model_card(repo_id="x/y", num_loops=3, kv_bytes_per_token=per_token).text
    assert per_token < 1000 and f"about {per_token} bytes per context token for this model in bf16 across its 3 " \
        "loops" in text
    for count, written in ((786_432, "786 KB"), (1_572_864, "1.6 MB")):  # Ouro-1.4B's and 2.6B's (24, 48 layers)
        assert f"about {written} per context token" in hub_card.build_model_card(
            repo_id="x/y", kv_bytes_per_token=count).text
    assert "loop 1 of 3" in text and "one per\n3 calls" in text and "of 4" not in text


# --- remote code in a fresh process -----------------------------------------------------------------------------------

REMOTE_SCRIPT = """
import json, os, sys
import torch
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
from transformers.generation.streamers import BaseStreamer

folder, import_first = sys.argv[1], sys.argv[2] == "1"
if import_first:
    import hf_loopspec
assert ("hf_loopspec" in sys.modules) == import_first
data = json.loads(open(sys.argv[3]).read())
ids, mask = torch.tensor(data["ids"]), torch.tensor(data["mask"])

class Recorder(BaseStreamer):
    def __init__(self):
        self.chunks, self.ended = [], False
    def put(self, value):
        self.chunks.append(value.reshape(-1).tolist())
    def end(self):
        self.ended = True

model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
import hf_loopspec  # noqa: E402  (now only to check what the remote code returned)
report = {"class_module": type(model).__module__, "is_loopspec": isinstance(model, hf_loopspec.OuroForCausalLM),
          "config_module": type(model.config).__module__, "defaults": model.generation_config.speculative_mode}
kw = dict(attention_mask=mask, max_new_tokens=data["new"], do_sample=False, pad_token_id=0)
report["plain"] = model.generate(ids, speculative_mode=None, **kw).tolist()
for mode in ("pipeline", "block"):
    report[mode] = model.generate(ids, speculative_mode=mode, draft_loops=1, **kw).tolist()
report["default"] = model.generate(ids, **kw).tolist()  # generation_config.json: auto
single = ids[1:]
recorder = Recorder()
out = model.generate(single, max_new_tokens=data["new"], do_sample=False, pad_token_id=0, streamer=recorder,
                     speculative_mode="pipeline", return_dict_in_generate=True)
report["streamed"] = recorder.chunks
report["stream_ended"] = recorder.ended
report["streamed_sequence"] = out.sequences.tolist()
report["calls"] = out.speculation.core_calls
again = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
report["again_is_loopspec"] = isinstance(again, hf_loopspec.OuroForCausalLM)
report["again_pipeline"] = again.generate(ids, speculative_mode="pipeline", **kw).tolist()
model.save_pretrained(sys.argv[4])  # a remote-code model saves its shims again
report["resaved"] = sorted(name for name in os.listdir(sys.argv[4]) if name.endswith(".py"))
base = AutoModel.from_pretrained(folder, trust_remote_code=True)
report["base_class"] = type(base).__name__
report["config_class"] = type(AutoConfig.from_pretrained(folder, trust_remote_code=True)).__name__
print(json.dumps(report))
"""


@pytest.mark.parametrize("import_first", [False, True], ids=["remote-code-only", "hf_loopspec-imported-first"])
def test_remote_code_loads_in_a_fresh_process(exported, batch, expected, tmp_path, import_first):
    ids, mask = batch
    data = tmp_path / "batch.json"
    data.write_text(json.dumps({"ids": ids.tolist(), "mask": mask.tolist(), "new": NEW}))
    report = run_fresh(REMOTE_SCRIPT, tmp_path, str(exported), "1" if import_first else "0", str(data),
                       str(tmp_path / "resaved"))
    if import_first:  # the package's registration wins: remote code is not even executed
        assert report["class_module"] == "hf_loopspec.models.ouro.modeling_ouro"
    else:  # the folder's shim, a subclass of the package's class
        assert report["class_module"].startswith("transformers_modules.")
        assert report["class_module"].endswith(".modeling_ouro")
        assert report["config_module"].startswith("transformers_modules.")
        assert report["resaved"] == ["configuration_ouro.py", "modeling_ouro.py"]
    assert report["is_loopspec"] and report["again_is_loopspec"]
    assert report["defaults"] == "auto"
    want = expected.tolist()
    for key in ("plain", "pipeline", "block", "default", "again_pipeline"):
        assert report[key] == want, key
    assert report["base_class"] == "OuroModel" and report["config_class"] == "OuroConfig"
    # the streamer sees the prompt, then every new token once, in order, then end()
    sequence = report["streamed_sequence"][0]
    prompt = ids[1].tolist()
    assert report["streamed"][0] == prompt
    assert [t for chunk in report["streamed"][1:] for t in chunk] == sequence[len(prompt):]
    assert report["stream_ended"]


def test_remote_code_without_the_package_names_pip_install(exported, tmp_path):
    script = """
    import sys
    sys.modules["hf_loopspec"] = None  # as if hf-loopspec were not installed
    from transformers import AutoModelForCausalLM
    try:
        AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True)
    except ImportError as err:
        import json
        print(json.dumps({"error": str(err)}))
    """
    report = run_fresh(script, tmp_path, str(exported))
    assert install.install_command() in report["error"]


def test_saving_a_natively_loaded_export_writes_the_shims_its_auto_map_names(exported, tmp_path, caplog):
    """After `import hf_loopspec` an exported repo loads as the package's own class (remote code or not), for which
    transformers writes no code files: config.json named the shims anyway, and the saved folder (or a repo pushed
    from it) failed to load for anyone following the card (OSError: no configuration_ouro.py). The save writes the
    shims; a pointer to code the package does not write is left out, with a warning."""
    model = AutoModelForCausalLM.from_pretrained(exported, trust_remote_code=True)
    assert type(model) is hf_loopspec.OuroForCausalLM and model.config.auto_map == export.AUTO_MAP
    extra = {"AutoModelForSequenceClassification": "modeling_ouro.OuroForSequenceClassification"}
    model.config.auto_map = {**export.AUTO_MAP, **extra}
    with caplog.at_level(logging.WARNING, logger="hf_loopspec"):
        model.save_pretrained(tmp_path / "resaved")
    assert json.loads((tmp_path / "resaved" / "config.json").read_text())["auto_map"] == export.AUTO_MAP
    assert [r.getMessage() for r in caplog.records if "OuroForSequenceClassification" in r.getMessage()]
    assert model.config.auto_map == {**export.AUTO_MAP, **extra}  # the model's own config is as it was
    for name in export.SHIM_FILES:
        assert (tmp_path / "resaved" / name).read_text() == (exported / name).read_text()
    script = """
    import json, sys
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True)
    print(json.dumps({"module": type(model).__module__, "imported": "hf_loopspec" in sys.modules}))
    """
    report = run_fresh(script, tmp_path, str(tmp_path / "resaved"))  # as the card says, with no import first
    assert report["imported"] and report["module"].startswith("transformers_modules.")  # the shim

    # a folder with a modeling_ouro.py of the user's (any encoding): kept, and named as it was; a shim of an
    # earlier release (another install line) is the package's: written anew
    own = tmp_path / "own"
    own.mkdir()
    (own / "modeling_ouro.py").write_bytes("# my own modeling code, café\n".encode("latin-1"))
    shim = (exported / "configuration_ouro.py").read_text()
    earlier = shim.replace("hf_loopspec.OuroConfig", "hf_loopspec.OuroConfig (0.1)")  # wording of another release
    assert earlier != shim
    (own / "configuration_ouro.py").write_text(earlier)
    model.config.auto_map = dict(export.AUTO_MAP)
    model.save_pretrained(own)
    assert (own / "modeling_ouro.py").read_bytes() == "# my own modeling code, café\n".encode("latin-1")
    assert (own / "configuration_ouro.py").read_text() == shim
    assert json.loads((own / "config.json").read_text())["auto_map"] == export.AUTO_MAP


def test_pushing_a_natively_loaded_export_uploads_the_shims(exported, tmp_path, monkeypatch):
    """`push_to_hub` (through a temporary folder) and `save_pretrained(push_to_hub=True)` upload the shims with the
    config.json that names them (the Hub stands in: a repo id for any name, an upload that records what
    transformers would send: the files new or changed since its save began)."""
    import transformers.modeling_utils
    import transformers.utils.hub

    hub_api = SimpleNamespace(create_repo=lambda repo_id, **kwargs: SimpleNamespace(repo_id=repo_id))
    card = SimpleNamespace(save=lambda path: None)
    for module in (transformers.utils.hub, transformers.modeling_utils):
        monkeypatch.setattr(module, "hf_api", lambda: hub_api)
        monkeypatch.setattr(module, "create_and_tag_model_card", lambda *args, **kwargs: card)
    uploads = []

    def upload(self, working_dir, repo_id, files_timestamps, **kwargs):
        names = {name for name in os.listdir(working_dir) if name not in files_timestamps
                 or os.path.getmtime(os.path.join(working_dir, name)) > files_timestamps[name]}
        config = json.loads(Path(working_dir, "config.json").read_text())
        uploads.append((names, config.get("auto_map")))

    monkeypatch.setattr(transformers.utils.hub.PushToHubMixin, "_upload_modified_files", upload)
    model = AutoModelForCausalLM.from_pretrained(exported)
    model.push_to_hub("me/ouro-loopspec")
    for _ in range(2):  # into a fresh folder, then again into the folder that now holds the shims
        model.save_pretrained(tmp_path / "ouro-loopspec", push_to_hub=True)
    assert len(uploads) == 3
    for names, auto_map in uploads:
        assert {"config.json", *export.SHIM_FILES} <= names and auto_map == export.AUTO_MAP


# --- custom_generate --------------------------------------------------------------------------------------------------


FOREIGN_SOURCE = '''"""ForeignOuro: another class with Ouro's parameter names (think: upstream code), no hf_loopspec."""
import json
import os

import torch
from safetensors.torch import load_file
from torch import nn
from transformers import GenerationMixin, PreTrainedConfig, PreTrainedModel


class Norm(nn.Module):
    def __init__(self, size):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))


class ForeignOuroConfig(PreTrainedConfig):
    model_type = "ouro"


class ForeignOuro(PreTrainedModel, GenerationMixin):
    config_class = ForeignOuroConfig

    def __init__(self, config):
        super().__init__(config)
        c = config
        hid, heads, kv, dim = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(c.vocab_size, hid)
        self.model.layers = nn.ModuleList()
        for _ in range(c.num_hidden_layers):
            layer = nn.Module()
            layer.self_attn = nn.Module()
            layer.self_attn.q_proj = nn.Linear(hid, heads * dim, bias=False)
            layer.self_attn.k_proj = nn.Linear(hid, kv * dim, bias=False)
            layer.self_attn.v_proj = nn.Linear(hid, kv * dim, bias=False)
            layer.self_attn.o_proj = nn.Linear(heads * dim, hid, bias=False)
            layer.mlp = nn.Module()
            layer.mlp.gate_proj = nn.Linear(hid, c.intermediate_size, bias=False)
            layer.mlp.up_proj = nn.Linear(hid, c.intermediate_size, bias=False)
            layer.mlp.down_proj = nn.Linear(c.intermediate_size, hid, bias=False)
            for name in ("input_layernorm", "input_layernorm_2", "post_attention_layernorm",
                         "post_attention_layernorm_2"):
                setattr(layer, name, Norm(hid))
            self.model.layers.append(layer)
        self.model.norm = Norm(hid)
        self.model.early_exit_gate = nn.Linear(hid, 1)
        self.lm_head = nn.Linear(hid, c.vocab_size, bias=False)
        self.post_init()

    def forward(self, *args, **kwargs):
        raise AssertionError("the foreign model's forward must not run: custom_generate decodes with hf_loopspec")


def load_folder(folder):
    """A ForeignOuro with the config and (possibly sharded) safetensors of an exported folder."""
    with open(os.path.join(folder, "config.json")) as f:
        values = json.load(f)
    for key in ("auto_map", "model_type", "architectures"):
        values.pop(key, None)
    model = ForeignOuro(ForeignOuroConfig(**values)).eval()
    weights = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            weights.update(load_file(os.path.join(folder, name)))
    model.load_state_dict(weights, strict=True)
    model.generation_config.pad_token_id = 0
    return model
'''


@pytest.fixture(scope="module")
def foreign_module(tmp_path_factory):
    """`FOREIGN_SOURCE` as an importable module `foreign_ouro` (the fresh processes import it too)."""
    folder = tmp_path_factory.mktemp("foreign")
    (folder / "foreign_ouro.py").write_text(FOREIGN_SOURCE)
    spec = importlib.util.spec_from_file_location("foreign_ouro", folder / "foreign_ouro.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["foreign_ouro"] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("foreign_ouro", None)


@pytest.fixture(scope="module")
def foreign(foreign_module, exported):
    return foreign_module.load_folder(exported)


def test_custom_generate_shares_the_weights_of_a_different_class(foreign, exported, batch, expected):
    ids, mask = batch
    outs = {}
    for mode in ("pipeline", "block"):
        outs[mode] = foreign.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                                      custom_generate=str(exported), trust_remote_code=True, speculative_mode=mode)
        assert torch.equal(outs[mode], expected), mode
    looped = custom_generate.borrow(foreign)
    assert isinstance(looped, hf_loopspec.OuroForCausalLM)
    foreign_params = dict(foreign.named_parameters())
    for name, param in looped.named_parameters():
        assert param is foreign_params[name], f"{name} was copied"
    assert not any(p.is_meta for p in looped.parameters())
    assert custom_generate.borrow(foreign) is looped  # cached while the weights are the same objects


def test_custom_generate_keeps_streamer_and_stopping_criteria(foreign, exported, batch, expected):
    ids = batch[0][1:]
    stop_at = ids.shape[-1] + 5
    recorder, stop = RecordingStreamer(), StopAtWidth(stop_at)
    out = foreign.generate(ids, max_new_tokens=NEW, do_sample=False, custom_generate=str(exported),
                           trust_remote_code=True, speculative_mode="pipeline", streamer=recorder,
                           stopping_criteria=StoppingCriteriaList([stop]), return_dict_in_generate=True)
    assert out.sequences.shape[-1] == stop_at and stop.calls > 0
    assert out.sequences[0].tolist() == expected[1, batch[1].shape[-1] - ids.shape[-1]:][:stop_at].tolist()
    assert recorder.puts[0] == ids.tolist() and recorder.ends == 1
    assert [t for put in recorder.puts[1:] for t in put] == out.sequences[0, ids.shape[-1]:].tolist()
    assert out.speculation.committed_tokens == 5


def test_custom_generate_on_an_hf_loopspec_model_runs_its_own_generate(source, exported, batch, expected):
    ids, mask = batch
    out = source[0].generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=PAD,
                             custom_generate=str(exported), trust_remote_code=True, speculative_mode="block",
                             num_speculative_tokens=2)
    assert torch.equal(out, expected)
    assert source[0] not in custom_generate._BORROWED


def test_custom_generate_in_a_fresh_process_without_hf_loopspec_imported(foreign_module, exported, batch, expected,
                                                                          tmp_path):
    """The string route from a process that never imported hf_loopspec, on the foreign class."""
    ids, mask = batch
    data = tmp_path / "batch.json"
    data.write_text(json.dumps({"ids": ids.tolist(), "mask": mask.tolist(), "new": NEW}))
    script = """
    import json, sys
    import torch
    sys.path.insert(0, sys.argv[3])
    from foreign_ouro import load_folder
    folder, data = sys.argv[1], json.loads(open(sys.argv[2]).read())
    model = load_folder(folder)
    assert "hf_loopspec" not in sys.modules
    out = model.generate(torch.tensor(data["ids"]), attention_mask=torch.tensor(data["mask"]),
                         max_new_tokens=data["new"], do_sample=False, custom_generate=folder,
                         trust_remote_code=True, speculative_mode="pipeline")
    print(json.dumps({"out": out.tolist(), "class": type(model).__module__}))
    """
    report = run_fresh(script, tmp_path, str(exported), str(data), str(Path(foreign_module.__file__).parent))
    assert report["out"] == expected.tolist() and report["class"] == "foreign_ouro"


def test_custom_generate_rejects_a_model_that_is_not_ouro():
    other = nn.Linear(2, 2)
    other.config = SimpleNamespace(to_dict=lambda: {"model_type": "llama"})
    with pytest.raises(ValueError, match="model_type='llama'"):
        custom_generate.borrow(other)


# --- the model card ---------------------------------------------------------------------------------------------------


def test_card_parses_and_has_the_metadata(exported):
    card = ModelCard.load(exported / "README.md")  # parse only: validate() would call the Hub
    data = card.data.to_dict()
    assert data["license"] == "apache-2.0"
    assert data["library_name"] == "transformers" and data["pipeline_tag"] == "text-generation"
    assert data["base_model"] == "ByteDance/Ouro-1.4B"
    assert {"looped-language-model", "speculative-decoding", "custom_generate"} <= set(data["tags"])
    text = card.text
    for heading in ("## What it is", "## Usage", "## Speed", "## Limitations", "## Citation"):
        assert heading in text
    for snippet in ('speculative_mode=None', 'speculative_mode="block"', 'speculative_mode="pipeline"',
                    'self-speculative decoding is on by default (`speculative_mode="auto"`, `draft_loops=1`: each call',
                    'custom_generate="someone/Ouro-tiny-loopspec"', "2510.25741", "bf16", "context"):
        assert snippet in text, snippet
    assert "No measured speed numbers" in text  # benchmarks=None: no numbers, said plainly
    assert "apply_chat_template" in text  # the source tokenizer has a chat template


BENCH_JSON = ROOT / "bench_results" / "cpu_ouro100m_b1.json"  # a recorded `hf-loopspec bench --json` result


def test_speed_section_is_built_from_bench_json_files_or_documents():
    """Every mode's measured numbers, the machine and the command come from the JSON; a file and its document give
    the same card; without results the card says it has none."""
    result = json.loads(BENCH_JSON.read_text())
    text = hub_card.build_model_card(repo_id="x/y", benchmarks=[BENCH_JSON]).text
    assert text == hub_card.build_model_card(repo_id="x/y", benchmarks=[result]).text
    for row in result["rows"]:
        assert f"| {row['mode']} | {row['tokens_per_s']:.1f} | {row['ratio_vs_plain']:.2f} |" in text
    assert f"Synthetic acceptance {result['synthetic_acceptance']}" in text
    assert result["machine"]["device_name"] in text and "No measured speed numbers" not in text
    assert "No measured speed numbers" in hub_card.build_model_card(repo_id="x/y", benchmarks=[]).text


def test_the_cards_command_reproduces_the_measured_arguments():
    """The command quoted in a card parses back to the arguments the result was measured with."""
    result = json.loads(BENCH_JSON.read_text())
    command = shlex.split(command_line(result))
    assert command[:2] == ["hf-loopspec", "bench"]
    parsed, defaults = vars(bench_args.parse_args(command[2:])), vars(bench_args.parse_args([]))
    for key, value in parsed.items():
        if key not in ("json", "plot", "quiet"):  # (options added after the run was recorded: their defaults)
            assert result["args"].get(key, defaults[key]) == value, key


def test_speed_section_refuses_files_that_are_not_bench_results(tmp_path):
    (tmp_path / "other.json").write_text(json.dumps({"rows": []}))
    (tmp_path / "text.json").write_text("mode tok/s\nplain 9.0")
    for name in ("cpu_workload_ouro100m.json", "auto_table/default_b1_t1.json"):  # other scripts' results
        (tmp_path / Path(name).name).write_text((ROOT / "bench_results" / name).read_text())
    for name in ("other.json", "text.json", "cpu_workload_ouro100m.json", "default_b1_t1.json"):
        with pytest.raises(ValueError, match=name):
            hub_card.build_model_card(repo_id="x/y", benchmarks=[tmp_path / name])


def test_a_result_whose_check_failed_is_not_quoted(tmp_path):
    """A bench result in which a speculative output differed from plain decoding (the bench exited 1) is refused by
    name: its speed-up went into the card's table and model-index without a mark."""
    result = json.loads((ROOT / "bench_results" / "cpu_default_b1.json").read_text())
    assert all(row["check_passed"] is not False for row in result["rows"])
    hub_card.build_model_card(repo_id="x/y", benchmarks=[result])  # as recorded: quoted
    pipeline = next(row for row in result["rows"] if row["mode"] == "pipeline")
    pipeline["check_passed"], result["all_checks_passed"] = False, False
    (tmp_path / "failed.json").write_text(json.dumps(result))
    for given, name in ((result, r"benchmarks\[0\]"), (tmp_path / "failed.json", "failed.json")):
        with pytest.raises(ValueError, match=f"{name}: the bench's check failed for pipeline"):
            hub_card.build_model_card(repo_id="x/y", benchmarks=[given])


def test_a_command_recorded_with_the_old_engine_name_is_quoted_with_todays():
    """Results recorded before `--engines lanes` became `reference` quote a command that today's bench accepts."""
    result = json.loads((ROOT / "bench_results" / "cpu_default_b1.json").read_text())
    assert result["args"]["engines"] == ["lanes"]
    command = shlex.split(command_line(result))
    assert vars(bench_args.parse_args(command[2:]))["engines"] == ["reference"]


def test_card_text_comes_from_the_family_table_and_the_packaged_template():
    template = resources.files("hf_loopspec.hub").joinpath("templates", "model_card.md")
    assert hub_card.MODEL_CARD_TEMPLATE.template == template.read_text(encoding="utf-8")
    assert '"hub/templates/*.md"' in (ROOT / "pyproject.toml").read_text()  # shipped as package data
    card = hub_card.build_model_card(repo_id="x/y", chat=True, eos_token_ids=[0, 2],
                                     base_model="ByteDance/Ouro-1.4B-Thinking").text
    ouro = hub_card.FAMILIES["ouro"]
    assert ouro.bibtex in card and ouro.kv_example in card
    assert ("(`<|im_start|>` = 1, `<|im_end|>` = 2). A turn ends with `<|im_end|>` and a document with "
            "`<|endoftext|>` = 0") in card  # the family's own tokenizer's ids
    # weights that are not the maker's: no maker claim, no request to cite the family's paper
    other = hub_card.build_model_card(repo_id="x/y", base_model="someone/ouro-finetune").text
    assert ouro.bibtex not in other and ouro.maker not in other and ouro.arxiv not in other
    with pytest.raises(ValueError, match="family='huginn' has no card text"):
        hub_card.build_model_card(repo_id="x/y", family="huginn")


@pytest.mark.parametrize("name", ["Ouro-1.4B", "Ouro-2.6B", "Ouro-1.4B-Thinking", "Ouro-2.6B-Thinking"])
def test_rendered_variant_cards(name):
    card = ModelCard.load(ROOT / "model_cards" / f"{name}-loopspec" / "README.md")
    data = card.data.to_dict()
    assert data["base_model"] == f"ByteDance/{name}" and data["license"] == "apache-2.0"
    assert data["library_name"] == "transformers" and data["pipeline_tag"] == "text-generation"
    assert {"looped-language-model", "speculative-decoding", "custom_generate"} <= set(data["tags"])
    thinking = name.endswith("Thinking")
    assert ("apply_chat_template" in card.text) == thinking
    assert ("temperature=1.0" in card.text and "top_p=0.7" in card.text) == thinking
    assert ("eos_token_id=[0, 2]" in card.text) == thinking


def test_render_script_matches_the_committed_cards(tmp_path):
    """The committed cards are what scripts/render_model_cards.py writes (rerun it after editing the card code or
    template); the speed section is left out (it quotes the bench results the script is given)."""
    spec = importlib.util.spec_from_file_location("render_model_cards", ROOT / "scripts" / "render_model_cards.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--out", str(tmp_path)]) == 0
    for path in sorted(tmp_path.rglob("*.md")):
        committed = ROOT / "model_cards" / path.relative_to(tmp_path)
        # the speed section quotes whichever bench results the script was given
        assert _without_speed(committed.read_text()) == _without_speed(path.read_text()), (
            f"{committed} is stale: run scripts/render_model_cards.py")


def _without_speed(text: str) -> str:
    return re.sub(r"^## Speed\n.*?(?=^## )", "", text, flags=re.MULTILINE | re.DOTALL)


# --- command line -----------------------------------------------------------------------------------------------------


def test_main_export(source, tmp_path, capsys):
    out = tmp_path / "cli-out"
    assert export.main_export([str(source[1]), str(out), "--speculative-mode", "block"]) == 0
    assert "exported" in capsys.readouterr().out
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["speculative_mode"] == "block"
    assert export.main_export([str(tmp_path / "missing"), str(tmp_path / "o2")]) == 2
    assert "error" in capsys.readouterr().err


def test_export_subcommand_hook(source, tmp_path):
    """What `hf-loopspec export` does once the CLI registers `add_subcommand` and dispatches to `main_from_args`."""
    parser = argparse.ArgumentParser(prog="hf-loopspec")
    commands = parser.add_subparsers(dest="command", required=True)
    export.add_subcommand(commands)
    args = parser.parse_args(["export", str(source[1]), str(tmp_path / "o"), "--draft-loops", "2",
                              "--max-shard-size", "50000"])
    assert args.command == "export" and export.main_from_args(args) == 0
    assert json.loads((tmp_path / "o" / "generation_config.json").read_text())["draft_loops"] == 2
    assert (tmp_path / "o" / "model.safetensors.index.json").is_file()  # 50000 bytes per shard


@pytest.mark.parametrize("saved, tokenizer, match", [
    (["w5"], True, r"stop_strings=\['w5'\], which its tokenizer \(\w+\) cannot match \(ValueError: substring not "
                   r"found\): drop stop_strings from the source's generation_config.json \(for a Hub id: in a local"),
    ([""], True, r"stop_strings=\[''\], which is not a non-empty string .*: correct the source's generation_config"),
    ([""], False, r"stop_strings=\[''\], which is not a non-empty string .*: correct the source's generation_config"),
])
def test_saved_stop_strings_the_tokenizer_cannot_match_are_refused(tmp_path, saved, tokenizer, match):
    """A source whose generation_config.json saves stop strings its tokenizer cannot match (a word-level tokenizer
    has no byte-level vocabulary) was exported as it was, and every `generate` of the export that passes the
    tokenizer (the card's code) failed with transformers' bare "substring not found". Refused up front, naming the
    source's file, and nothing is written; a value `generate` refuses is named so with no tokenizer shipped too (a
    review found the card's check naming it as if passed to the card)."""
    src = save_checkpoint(tmp_path / "src", tokenizer=tokenizer)
    config = json.loads((src / "generation_config.json").read_text())
    (src / "generation_config.json").write_text(json.dumps({**config, "stop_strings": saved}))
    with pytest.raises(ValueError, match=match):
        export.export_checkpoint(src, tmp_path / "out", benchmarks=None)
    assert not (tmp_path / "out").exists()
