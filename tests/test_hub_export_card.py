"""What an export's model card says of its source and of its own defaults (`hf_loopspec.hub.card`,
`hf_loopspec.hub.source`, `hf_loopspec.hub.card_speed`): the source's license stays named and its license files
travel, the generation defaults are described as they can run, and a bench result measured on a local folder is
quoted as a command a Hub reader can run. CPU, tiny checkpoints, no network."""

from __future__ import annotations

import json
import logging
import re
import shlex
from pathlib import Path

import pytest
from checkpoint_utils import TINY, save_checkpoint
from huggingface_hub import ModelCard
from processes import ROOT
from transformers import AutoTokenizer, GenerationConfig

from hf_loopspec.bench import args as bench_args
from hf_loopspec.hub import card as hub_card
from hf_loopspec.hub import export
from hf_loopspec.hub.source import Source, card_metadata

OTHER_LICENSE_CARD = """---
license: other
license_name: tiny-research-license
license_link: LICENSE
datasets:
- my-org/my-data
---

# Tiny research Ouro

A tiny Ouro checkpoint under a custom license.
"""


@pytest.fixture(scope="module")
def licensed_src(tmp_path_factory):
    """A tiny Ouro checkpoint folder whose card names an `other` license, with license files beside it."""
    src = save_checkpoint(tmp_path_factory.mktemp("src") / "ouro", seed=1)
    (src / "README.md").write_text(OTHER_LICENSE_CARD)
    (src / "LICENSE").write_text("custom license text\n")
    (src / "NOTICE.txt").write_text("notice text\n")
    (src / "docs").mkdir()
    (src / "docs" / "LICENSE.md").write_text("nested: not copied\n")
    return src


def test_an_other_license_keeps_its_name_link_and_files(licensed_src, tmp_path):
    """The card kept `license: other` but dropped its name and link, and LICENSE was not copied: the exported repo no
    longer said which license applies. The source's datasets were dropped too."""
    out = export.export_checkpoint(licensed_src, tmp_path / "out", benchmarks=None)
    data = ModelCard.load(out / "README.md").data.to_dict()
    assert data["license"] == "other" and data["license_name"] == "tiny-research-license"
    assert data["license_link"] == "LICENSE" and data["datasets"] == ["my-org/my-data"]
    assert (out / "LICENSE").read_text() == "custom license text\n"
    assert (out / "NOTICE.txt").read_text() == "notice text\n" and not (out / "docs").exists()
    # --license replaces the source's: its name and link are not carried (the files still are: they are the source's)
    out = export.export_checkpoint(licensed_src, tmp_path / "mit", benchmarks=None, license="mit")
    data = ModelCard.load(out / "README.md").data.to_dict()
    assert data["license"] == "mit" and "license_name" not in data and "license_link" not in data
    assert (out / "LICENSE").is_file()


def test_a_license_link_leads_to_the_license_from_the_exported_repo(licensed_src, caplog):
    """A relative link of a Hub source's card leads to the file in the source's repo; one of a local folder that names
    no license file the export copies is left out with a warning; datasets not in the Hub's form too."""
    data = {"license": "other", "license_name": "x", "license_link": "./LICENSE.md"}
    hub = Source("org/model", "org/model", "model", None, True, True, data)
    assert card_metadata(hub, None)["license_link"] == "https://huggingface.co/org/model/blob/main/LICENSE.md"
    url = {**data, "license_link": "https://example.org/license"}
    assert card_metadata(Source("org/model", "org/model", "model", None, True, True, url), None) == url
    local = Source(str(licensed_src), str(licensed_src), "ouro", None, False, False,
                   {**data, "license_link": "legal/LICENSE.md", "datasets": "my-org/my-data"})
    with caplog.at_level(logging.WARNING):
        assert card_metadata(local, None) == {"license": "other", "license_name": "x"}
    assert "license_link 'legal/LICENSE.md' names no license file at the top of" in caplog.text
    assert "the source card's datasets 'my-org/my-data' is no list of dataset ids" in caplog.text


@pytest.mark.parametrize("mode", [None, "auto"])
def test_the_card_names_only_modes_its_defaults_can_run(mode):
    """With `draft_loops` that does not divide the loop count, the card promised `speculative_mode="pipeline"` (which
    raises at that depth) or said auto weighs pipeline (it weighs plain and block only)."""
    text = hub_card.build_model_card(repo_id="me/x", num_loops=4, speculative_mode=mode, draft_loops=3).text
    line = next(line for line in text.splitlines() if line.startswith("* `generation_config.json`"))
    assert "pipeline mode from" not in line and 'pass `speculative_mode="pipeline"`' not in line
    assert "needs a `draft_loops` that divides 4: 1, 2" in line
    assert ('pass `speculative_mode="block"` to speculate from loop 3' if mode is None else
            "decodes plainly or in block mode from loop 3") in line
    at_divisor = hub_card.build_model_card(repo_id="me/x", num_loops=4, speculative_mode=mode, draft_loops=2).text
    speculates = ('speculative_mode="pipeline"` or `"block"` to speculate' if mode is None else
                  "in block or in pipeline mode from loop 2")
    assert speculates in at_divisor and "that divides" not in at_divisor


def test_a_bench_of_a_local_folder_is_quoted_on_the_cards_repo(tmp_path):
    """The quoted command (and its heading) named this machine's checkpoint path, which a Hub reader cannot run; a Hub
    id, 'default' and a random-weight shape are quoted as measured."""
    result = json.loads((ROOT / "bench_results" / "cpu_ouro100m_b1.json").read_text())
    for local in (str(tmp_path), "/no/such/folder/ouro"):
        bench = {**result, "args": {**result["args"], "model": local}, "model": {**result["model"], "name": local}}
        text = hub_card.build_model_card(repo_id="me/x", benchmarks=[bench]).text
        assert local not in text and "hf-loopspec bench --model me/x " in text and "### me/x, " in text
    for kept in ("someone/Ouro-tiny", "ouro-100m"):
        bench = {**result, "args": {**result["args"], "model": kept}}
        text = hub_card.build_model_card(repo_id="me/x", benchmarks=[bench]).text
        assert f"hf-loopspec bench --model {kept} " in text
    # a prompt file by its name alone (its path named the measuring machine's folders, a Windows path whole), quoted
    # for a shell when it has a space (pasted, it gave "unrecognized arguments")
    for path, quoted in (("/home/alice/private/prompts.txt", " prompts.txt"),
                         ("C:\\Users\\alice\\bench\\prompts.txt", " prompts.txt"),
                         ("/home/alice/code sample.py", " 'code sample.py'"), ("./-prompts.txt", "=-prompts.txt"),
                         ("/home/alice/-prompts(1).txt", "='-prompts(1).txt'")):  # (a leading dash: an option)
        bench = {**result, "args": {**result["args"], "prompt_file": path}}
        text = hub_card.build_model_card(repo_id="me/x", benchmarks=[bench]).text
        assert "alice" not in text and f"--prompt-file{quoted} " in text, path
        line = next(line for line in text.splitlines() if line.startswith("hf-loopspec bench"))
        assert bench_args.parse_args(shlex.split(line)[2:]).prompt_file == shlex.split(quoted[1:])[0]


def test_the_cards_tokenizer_load_trusts_the_repo_as_its_model_load_does():
    """Without `trust_remote_code=True`, transformers asks on a terminal whether to run the repo's shims (named by its
    config.json) when the tokenizer is loaded first in a process that has not imported hf_loopspec."""
    text = hub_card.build_model_card(repo_id="me/x").text
    assert 'AutoModelForCausalLM.from_pretrained(repo, trust_remote_code=True' in text
    assert 'tok = AutoTokenizer.from_pretrained(repo, trust_remote_code=True, padding_side="left")' in text


def card_blocks(card: str, repo: Path) -> list[str]:
    """The card's Python blocks, run against the local folder `repo` as written (on a machine without CUDA they load
    the model on the CPU in fp32: before, they asked for CUDA and failed there)."""
    blocks = re.findall(r"```python\n(.*?)```", card, flags=re.DOTALL)
    return [re.sub(r'"your-username/[^"]+"', repr(str(repo)), block) for block in blocks]


@pytest.mark.parametrize("case", ["no-pad", "no-pad-no-eos", "pad-past-the-vocabulary", "config-pad-past-it"])
def test_the_cards_quickstart_pads_with_a_tokenizer_that_had_no_pad_token(case, tmp_path):
    """The quickstart pads two prompts (`padding=True`): it raised "Asking to pad but the tokenizer does not have a
    padding token" on an export of a tokenizer without one, although generation_config.json names a pad id, and
    "outside the vocabulary" for prompts of unequal length with a pad token added past the model's vocabulary (in
    the tokenizer, or as generation_config.json's pad_token_id). The exported tokenizer now pads with the token of
    generation_config.json's pad id, an id of the vocabulary and a special token of the tokenizer."""
    src = save_checkpoint(tmp_path / "ouro", seed=0)
    settings = json.loads((src / "tokenizer_config.json").read_text())
    settings.pop("pad_token", None)
    if case == "no-pad-no-eos":
        settings.pop("eos_token", None)
    if case in ("pad-past-the-vocabulary", "config-pad-past-it"):
        settings["pad_token"] = "[PAD]"  # (added: the id after the vocabulary's last)
    (src / "tokenizer_config.json").write_text(json.dumps(settings))
    for name in ("config.json", "generation_config.json"):
        config = json.loads((src / name).read_text())
        config.update(pad_token_id=TINY["vocab_size"] if case == "config-pad-past-it" else None,
                      **({"eos_token_id": None} if case == "no-pad-no-eos" else {}))
        (src / name).write_text(json.dumps(config))
    if case != "no-pad-no-eos":
        assert AutoTokenizer.from_pretrained(src).pad_token_id in (None, TINY["vocab_size"])  # (the source's)
    out = export.export_checkpoint(src, tmp_path / "out", benchmarks=None)
    assert json.loads((out / "generation_config.json").read_text())["pad_token_id"] == 0
    quickstart, plain = card_blocks((out / "README.md").read_text(), out)[:2]
    assert "padding=True" in quickstart and "speculative_mode=None" in plain
    scope = {}
    exec(quickstart + plain, scope)  # noqa: S102  (the card's code)
    assert scope["tok"].pad_token_id == 0 and scope["inputs"]["input_ids"].shape[0] == 2
    padded = scope["tok"](["w5", "w5 w6 w7"], padding=True, return_tensors="pt")
    out_ids = scope["model"].generate(**padded, max_new_tokens=2, do_sample=False)  # (unequal lengths: padded)
    assert out_ids.shape == (2, 5)


def test_an_export_whose_tokenizer_cannot_pad_says_so(tmp_path, caplog):
    """An ordinary word is not made the pad token (it would be dropped from the decoded text as a special token): a
    tokenizer with no special token of the pad id keeps no pad token, and the export warns that the card's
    quickstart cannot pad with it (it exported without a word, and the quickstart raised)."""
    src = save_checkpoint(tmp_path / "ouro", seed=0)
    gen = GenerationConfig(pad_token_id=5)
    tokenizer = AutoTokenizer.from_pretrained(src)
    tokenizer.pad_token = None
    with caplog.at_level(logging.WARNING, logger="hf_loopspec"):
        hub_card.settle_pad(gen, tokenizer, TINY["vocab_size"])
    assert tokenizer.pad_token is None and tokenizer.decode([5, 6], skip_special_tokens=True) == "w5 w6"
    assert "so the card's quickstart, which pads two prompts, fails on it" in caplog.text


def test_the_cards_code_stops_at_the_stop_strings_its_generation_config_saves(tmp_path):
    """An export of a checkpoint whose generation_config.json saves stop strings keeps them: the card names them among
    its defaults, and its code passes the tokenizer that `generate` matches them with (every example failed with
    transformers' "could not locate a tokenizer", and the card said generation stops at the EOS token only)."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    from hf_loopspec.assets import default_model_path

    src = tmp_path / "src"
    shutil.copytree(default_model_path(), src)
    tok, model = AutoTokenizer.from_pretrained(src), AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    prompt = tok("def is_prime(n):", return_tensors="pt")  # (the second prompt of the card's code)
    answer = tok.decode(model.generate(**prompt, max_new_tokens=6, do_sample=False, speculative_mode=None)[
        0, prompt["input_ids"].shape[1]:])
    stop = answer[len(answer) // 2:][:3]
    saved = json.loads((src / "generation_config.json").read_text())
    (src / "generation_config.json").write_text(json.dumps({**saved, "stop_strings": [stop]}))
    out = export.export_checkpoint(src, tmp_path / "out", benchmarks=None)
    card = (out / "README.md").read_text()
    assert f"or once the text holds one of the stop strings {[stop]!r} (pass `tokenizer=tok`)" in card
    quickstart, plain = card_blocks(card, out)[:2]
    scope = {}
    exec(quickstart + plain, scope)  # noqa: S102  (the card's code)
    width = scope["inputs"]["input_ids"].shape[1]
    new = scope["out"][1, width:].tolist()  # the second prompt's answer, then the pad of its finished row
    ended = next(i for i in range(len(new)) if stop in tok.decode(new[:i + 1]))
    assert ended < 6 and set(new[ended + 1:]) <= {scope["model"].generation_config.pad_token_id}
