"""The input and output paths of `hf-loopspec batch`: a `.json` file's values are kept as written (ids were coerced to
one type by `datasets`); a key given twice in a `.json` object or a CSV header, a CSV record with more or fewer fields
than its header (it was read shifted), and a file without rows are one-line refusals naming the line or row before a
model loads; a failed run removes the output folders it created; an output folder the run cannot write names
--output; a merge killed while it removed the parts leaves a finished OUT that the rerun recognises."""

from __future__ import annotations

import csv
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from checkpoint_utils import TINY, save_checkpoint, snapshot
from processes import subprocess_env
from test_batch_files import argv, one_error_line

from hf_loopspec import cli, loading
from hf_loopspec.batch.prompts import read_prompts


@pytest.fixture
def no_model(monkeypatch):
    """Loading a model fails the test: the refusals come before it."""
    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))


# --- .json values as written ----------------------------------------------------------------------------------------

MIXED = [{"id": 1, "prompt": "def a():"}, {"id": "2", "prompt": "def b():"}, {"id": "x", "prompt": "def c():"},
         {"id": "0042", "prompt": "def d():"}, {"id": 7, "prompt": "def e():"}, {"id": "007", "prompt": "def f():"}]


def test_json_ids_are_kept_as_written(tmp_path):
    """Integer and string ids in one `.json` array stay what they are (they were [1, 2, "x", 42], and 7 and "007" were
    refused as one id), in the rows read and in OUT, as from the same rows written as JSONL."""
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps(MIXED), encoding="utf-8")
    rows = read_prompts(prompts)
    assert [(row.where, row.id, row.prompt) for row in rows] == [
        (f"{prompts}, row {number}", row["id"], row["prompt"]) for number, row in enumerate(MIXED, start=1)]
    output = tmp_path / "out.jsonl"
    assert cli.main(argv(prompts, output)) == 0
    assert [json.loads(line)["id"] for line in output.read_text().splitlines()] == [row["id"] for row in MIXED]


# --- refusals before the model loads --------------------------------------------------------------------------------

BAD = {  # name: (content, what the error line says after "FILE")
    "repeated-key.json": ('[{"id": 1, "prompt": "a"},\n {"id": 2, "prompt": "b", "prompt": "c"}]',
                          ", row 2 has the key 'prompt' twice (JSON readers keep one of them silently); keep one."),
    "repeated-nested-key.json": ('[{"id": 1, "prompt": "a", "meta": {"k": 1, "k": 2}}]',
                                 ", row 1 has the key 'k' twice"),
    "repeated-key-lines.json": ('{"id": 1, "prompt": "a"}\n{"id": 2, "id": 3, "prompt": "b"}\n',
                                ", line 2 has the key 'id' twice"),
    "repeated-column.csv": ("id,prompt,prompt\n1,def a():,def b():\n",
                            ", line 1: the header names the column 'prompt' twice (a reader keeps one of them "
                            "silently); rename or remove one."),
    "unquoted-comma.csv": ("id,prompt\n1,def f(a, b):\n",
                           ", line 2 (row 1), has 3 fields ('1', 'def f(a', ' b):') where the header has 2 ('id', "
                           "'prompt'); put a field that holds a comma, a quote or a line break in double quotes "
                           '("def f(a, b):"), its quotes doubled.'),
    "missing-field.csv": ('id,prompt\n1,"def f(a,\n  b):"\n\n2\n', ", line 5 (row 2), has 1 field ('2') where the "
                                                                   "header has 2"),
    "float-id.json": ('[{"id": 1, "prompt": "a"}, {"id": 2.5, "prompt": "b"}]',
                      ", row 2: the id is a number (2.5); use a string or an integer."),
    "trailing-comma.json": ('[{"id": 1, "prompt": "a"},]', ", row 2 is not valid JSON (Expecting value at column "
                                                           "27); a .json file holds one JSON array of objects"),
    "after-the-array.json": ('[{"id": 1, "prompt": "a"}]\n[]', ", after the array, is not valid JSON (Extra data at "
                                                               "line 2, column 1)"),
    "empty-array.json": ("[]", " holds no rows; give it at least one row such as {\"id\": 1, \"prompt\": \"...\"}."),
    "empty-object.json": ("{ }\n", " holds no rows"),
    "header-only.csv": ("id,prompt\n\n", " holds no rows"),
}


@pytest.mark.parametrize("name", BAD)
def test_bad_json_and_csv_input_is_one_line_before_the_model(name, tmp_path, capsys, no_model):
    content, message = BAD[name]
    prompts = tmp_path / name
    prompts.write_text(content, encoding="utf-8")
    before = snapshot(tmp_path)
    assert cli.main(argv(prompts, tmp_path / "out.jsonl")) == 2
    line = one_error_line(capsys)
    assert f"{prompts}{message}" in line, line
    assert snapshot(tmp_path) == before


# --- output folders -------------------------------------------------------------------------------------------------


def fail_at_the_load(*args, **kwargs):
    raise ValueError("loaded")


def test_pretty_printed_json_objects_and_a_csv_line_of_spaces_read_as_before(tmp_path):
    """Forms the earlier reader (datasets) took, which the first json/csv reader refused: a `.json` file of one
    pretty-printed object, or several one after another ("line N": where each starts), and a CSV line of spaces
    alone (an editor's), skipped as blank; a CSV field longer than the csv module's default limit (131,072
    characters: refused, with advice to quote it)."""
    rows = [{"id": 1, "prompt": "def a():"}, {"id": "b", "prompt": "def b():"}, {"id": 3, "prompt": "x"}]
    one, many = tmp_path / "one.json", tmp_path / "many.json"
    one.write_text(json.dumps(rows[0], indent=2), encoding="utf-8")
    many.write_text("\n".join(json.dumps(row, indent=2) for row in rows), encoding="utf-8")
    assert [(row.where, row.id) for row in read_prompts(one)] == [(f"{one}, line 1", 1)]
    assert [(row.where, row.id) for row in read_prompts(many)] == [
        (f"{many}, line 1", 1), (f"{many}, line 5", "b"), (f"{many}, line 9", 3)]
    table, long = tmp_path / "p.csv", "x" * 200_000
    table.write_text(f"id,prompt\n1,def a():\n  \n2,def b():\n   \n3,\"{long}\"\n", encoding="utf-8")
    assert [(row.id, row.prompt) for row in read_prompts(table)] == [("1", "def a():"), ("2", "def b():"),
                                                                      ("3", long)]
    assert csv.field_size_limit() == 131_072  # (the process-wide limit is restored)


def test_a_failed_run_removes_the_folders_it_created(tmp_path, capsys, monkeypatch):
    """A run that fails after taking its lock removes OUT's folders that it created, and only those (it left them)."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": 1, "prompt": "import os\\n"}\n', encoding="utf-8")
    (tmp_path / "kept").mkdir()  # empty, but there before the run
    monkeypatch.setattr(loading, "load_model", fail_at_the_load)
    before = snapshot(tmp_path)
    assert cli.main(argv(prompts, tmp_path / "kept" / "new" / "deeper" / "out.jsonl")) == 2
    assert one_error_line(capsys).endswith("error: loaded")
    assert snapshot(tmp_path) == before


def without_file_permissions() -> list[str]:
    """A command prefix under which root obeys file permissions (none needed for another user)."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("root ignores file permissions, and setpriv (to drop that capability) is not installed")
    return ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", "--"]


@pytest.mark.parametrize("below", ["", "sub"])
def test_an_output_folder_that_cannot_be_written_names_output(below, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": 1, "prompt": "import os\\n"}\n', encoding="utf-8")
    folder = tmp_path / "read-only"
    folder.mkdir(mode=0o555)
    output = folder / below / "out.jsonl"
    made = output.with_name("out.jsonl.parts") if not below else folder / below
    command = [*without_file_permissions(), sys.executable, "-m", "hf_loopspec.cli", *argv(prompts, output)]
    proc = subprocess.run(command, capture_output=True, text=True, env=subprocess_env(), timeout=600)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == (f"hf-loopspec batch: error: --output {output}: cannot create {made} (Permission denied); "
                           "pass an --output in a folder you can write (the run keeps its parts in out.jsonl.parts/ "
                           "beside it).\n")
    assert list(folder.iterdir()) == []


KILLED_WHILE_REMOVING_THE_PARTS = """
import os, shutil, signal, sys
from hf_loopspec import cli

def rmtree(path, *args, **kwargs):  # the merge's removal of the parts: killed once settings.json is gone
    os.unlink(os.path.join(path, "settings.json"))
    os.kill(os.getpid(), signal.SIGKILL)

shutil.rmtree = rmtree
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_merge_killed_while_removing_the_parts_leaves_a_finished_output(tmp_path, capsys, monkeypatch):
    """OUT was complete, but the rerun said the parts had lost their settings.json ("restore it")."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(row) + "\n" for row in MIXED[:2]), encoding="utf-8")
    output = tmp_path / "out.jsonl"
    proc = subprocess.run([sys.executable, "-c", KILLED_WHILE_REMOVING_THE_PARTS, *argv(prompts, output)],
                          capture_output=True, text=True, env=subprocess_env(), cwd=tmp_path, timeout=600)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-4000:]
    finished = output.read_bytes()
    assert [json.loads(line)["id"] for line in finished.splitlines()] == [1, "2"]
    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    assert cli.main(argv(prompts, output)) == 2
    assert f"--output {output} exists (a finished run's output" in one_error_line(capsys)
    assert not output.with_name("out.jsonl.parts").exists()
    assert output.read_bytes() == finished
    output.unlink()  # the next run to this OUT removes what the killed removal left
    debris = [path.name for path in tmp_path.iterdir() if path.name.startswith(".out.jsonl.parts.")]
    assert len(debris) == 1
    monkeypatch.undo()
    assert cli.main(argv(prompts, output)) == 0
    assert output.read_bytes() == finished
    assert sorted(path.name for path in tmp_path.iterdir()) == ["out.jsonl", "p.jsonl"]


# --- pad and EOS of the checkpoint's tokenizer ----------------------------------------------------------------------

TWO_LENGTHS = [{"id": 1, "prompt": "w5 w9 w11 w40 w41 w42"}, {"id": 2, "prompt": "w17 w23"}]


def edited_checkpoint(folder: Path, tokenizer_edit, **configs) -> Path:
    """A tiny checkpoint (seed 0) whose tokenizer_config.json is changed by `tokenizer_edit` and whose config.json and
    generation_config.json get `configs`."""
    save_checkpoint(folder, seed=0)
    for name, edit in (("tokenizer_config.json", tokenizer_edit), ("config.json", lambda c: c.update(configs)),
                       ("generation_config.json", lambda c: c.update(configs))):
        data = json.loads((folder / name).read_text())
        edit(data)
        (folder / name).write_text(json.dumps(data))
    return folder


def run_rows(tmp_path: Path, model: Path, rows: list[dict], *extra: str) -> list[dict]:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    output = tmp_path / "out.jsonl"
    assert cli.main(argv(prompts, output, "--model", str(model), "--batch-size", "2", *extra)) == 0
    assert not output.with_name("out.jsonl.parts").exists()
    return [json.loads(line) for line in output.read_text().splitlines()]


def one_by_one(model_path: Path, rows: list[dict], pad: int) -> list[tuple[str, int]]:
    """`(completion, new_tokens)` of each prompt decoded alone (no padding), as `generate` does, 3 tokens."""
    model, tokenizer, _ = loading.load_model(str(model_path), torch.float32, "cpu", need_tokenizer=True)
    expected = []
    for row in rows:
        ids = torch.tensor([tokenizer(row["prompt"])["input_ids"]])
        new = model.generate(ids, max_new_tokens=3, do_sample=False, speculative_mode=None, pad_token_id=pad)
        new = new[0, ids.shape[-1]:].tolist()
        expected.append((tokenizer.decode(new, skip_special_tokens=True), len(new)))
    return expected


@pytest.mark.parametrize("case", ["no-pad-no-eos", "pad-outside-the-vocabulary", "config-pad-past-the-vocabulary",
                                  "config-pad-negative"])
def test_a_tokenizer_without_a_usable_pad_decodes_as_generate_does(case, tmp_path):
    """A tokenizer with neither pad nor eos token failed mid-run with transformers' "Asking to pad but the tokenizer
    does not have a padding token" (leaving OUT.parts/), one whose pad token was added past the model's vocabulary
    with "outside the vocabulary", as did a generation_config.json whose pad_token_id is past the vocabulary or
    negative; the batch is now padded with an id of the vocabulary, and masked."""
    if case == "no-pad-no-eos":
        model = edited_checkpoint(tmp_path / "ck", lambda c: [c.pop("eos_token", None), c.pop("pad_token", None)],
                                  eos_token_id=None, pad_token_id=None)
    elif case == "pad-outside-the-vocabulary":
        model = edited_checkpoint(tmp_path / "ck", lambda c: c.update(pad_token="[PAD]"), pad_token_id=None)
    else:
        pad = TINY["vocab_size"] if case == "config-pad-past-the-vocabulary" else -1
        model = edited_checkpoint(tmp_path / "ck", lambda c: c.update(pad_token="[PAD]"), pad_token_id=pad)
    rows = run_rows(tmp_path, model, TWO_LENGTHS)
    assert [(row["completion"], row["new_tokens"]) for row in rows] == one_by_one(model, TWO_LENGTHS, pad=0)


def test_an_eos_that_is_an_ordinary_word_is_not_in_the_completion(tmp_path):
    """With generation_config.json's eos ids [0, 16, 12] (w16 and w12 ordinary words of the tokenizer), the completion
    ended with the EOS's text ('w98 w16'); it is counted in new_tokens only."""
    model = edited_checkpoint(tmp_path / "ck", lambda c: None)
    gen = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [0, 16, 12]}))
    rows = run_rows(tmp_path, model, TWO_LENGTHS[:1], "--max-new-tokens", "8")
    assert [(row["completion"], row["new_tokens"], row["stop"]) for row in rows] == [("w98", 2, "eos")]
