"""`hf-loopspec batch` on the embedded model (CPU, fp32): every row equals plain greedy decoding of the batch it
was decoded in; a real two-process `accelerate launch` gives the one-process output by id; a run SIGKILLed in the
middle of writing a batch resumes to the same output, decoding only the batches it had not finished; bad input is a
one-line error naming the line before any model is loaded; a restart with other settings is refused."""

from __future__ import annotations

import argparse
import codecs
import csv as csv_module
import json
import signal
import subprocess
import sys
import textwrap
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from processes import accelerate_launch, subprocess_env
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_loopspec import cli, loading
from hf_loopspec.assets import default_model_path
from hf_loopspec.batch import run as batch_run
from hf_loopspec.batch.parts import PartStore
from hf_loopspec.batch.prompts import plan_batches, read_prompts

NEW = 10  # new tokens per row
BATCH = 4
GROUPS = 6  # prompt lengths; BATCH prompts of each, so every planned batch is one length and has no padding
STEMS = ("def f{}(a, b):", "import mod{}", "class C{}:", "x = [{}, 2]", "for i in range({}):", "print({})",
         "return {}")


def batch_args(prompts: Path, output: Path, *extra: str) -> list[str]:
    return ["batch", str(prompts), "--output", str(output), "--batch-size", str(BATCH), "--max-new-tokens", str(NEW),
            "--mode", "pipeline", *extra]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def model():
    return AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(default_model_path())


@pytest.fixture(scope="module")
def groups(tokenizer) -> list[list[str]]:
    """GROUPS lists of BATCH prompts; equal token lengths within a list, different lengths across lists."""
    by_length = defaultdict(list)
    for i in range(40):
        for stem in STEMS:
            text = stem.format(i) + "\n"
            by_length[len(tokenizer(text).input_ids)].append(text)
    lengths = [n for n in sorted(by_length) if len(by_length[n]) >= BATCH][:GROUPS]
    assert len(lengths) == GROUPS
    return [by_length[n][:BATCH] for n in lengths]


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory, groups) -> Path:
    """The groups' prompts interleaved (file order is not length order); ids alternate strings and integers."""
    path = tmp_path_factory.mktemp("batch") / "prompts.jsonl"
    texts = [group[k] for k in range(BATCH) for group in groups]
    rows = [{"id": n if n % 2 else f"q{n}", "prompt": text, "meta": n} for n, text in enumerate(texts)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def reference(prompts_file) -> list[dict]:
    """The one-process output (in this process)."""
    output = prompts_file.with_name("one.jsonl")
    assert cli.main(batch_args(prompts_file, output, "--device", "cpu")) == 0
    return read_jsonl(output)


def test_rows_equal_plain_decoding_of_their_batch(reference, prompts_file, groups, model, tokenizer):
    rows = {json.dumps(row["id"]): row for row in reference}
    assert [row["id"] for row in reference] == [row["id"] for row in read_jsonl(prompts_file)]  # input order
    ids_of = {row["prompt"]: json.dumps(row["id"]) for row in read_jsonl(prompts_file)}
    for group in groups:  # the plan decodes each group as one unpadded batch, in file order
        ids = torch.tensor([tokenizer(text).input_ids for text in group])  # [BATCH, length]
        with torch.no_grad():
            plain = model.generate(ids, max_new_tokens=NEW, do_sample=False, speculative_mode=None)
        for text, tokens in zip(group, plain[:, ids.shape[1]:].tolist()):
            kept = tokens[: tokens.index(0) + 1] if 0 in tokens else tokens  # through the first EOS (id 0)
            row = rows[ids_of[text]]
            assert row["completion"] == tokenizer.decode(kept, skip_special_tokens=True)
            assert row["new_tokens"] == len(kept) == row["speculation"]["committed"]
            assert row["stop"] == ("eos" if 0 in tokens else "length")
            spec = row["speculation"]
            assert spec["accepted"] + spec["rejected"] == spec["verified"]
    assert sum(row["speculation"]["verified"] for row in reference) > 0


def test_plan_groups_rows_by_length():
    lengths = [7, 3, 9, 3, 5, 7, 1, 9, 3, 2, 8]
    plan = plan_batches(lengths, 3)
    assert sorted(i for rows in plan for i in rows) == list(range(len(lengths)))
    assert all(len(rows) <= 3 for rows in plan)
    spans = sorted((min(lengths[i] for i in rows), max(lengths[i] for i in rows)) for rows in plan)
    assert all(hi <= next_lo for (_, hi), (next_lo, _) in zip(spans, spans[1:]))  # batches do not overlap
    assert plan == plan_batches(lengths, 3)


@pytest.mark.slow
def test_two_processes_under_accelerate_equal_one_process(reference, prompts_file, tmp_path):
    output = tmp_path / "two.jsonl"
    launch = accelerate_launch(2)
    proc = subprocess.run([*launch, *batch_args(prompts_file, output)], capture_output=True, text=True,
                          env=subprocess_env(), cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "(2 processes)" in proc.stderr
    assert f"{GROUPS * BATCH}/{GROUPS * BATCH}" in proc.stderr  # the bar counts both processes' rows
    assert read_jsonl(output) == reference
    assert not output.with_name("two.jsonl.parts").exists()


KILLER = """
import os, signal, sys
from hf_loopspec import cli
from hf_loopspec.batch.parts import PartStore

appended = []
original = PartStore.append

def append_then_die(handle, rows):
    rows = list(rows)
    if len(appended) == 2:  # the third batch: half of its first line reaches the file, then SIGKILL
        handle.write(__import__("json").dumps(rows[0])[:20])
        handle.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    appended.append(rows)
    original(handle, rows)

PartStore.append = staticmethod(append_then_die)
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_killed_run_resumes_to_the_same_output(reference, prompts_file, tmp_path, monkeypatch, capsys):
    output = tmp_path / "resumed.jsonl"
    args = batch_args(prompts_file, output, "--device", "cpu")
    script = tmp_path / "killer.py"
    script.write_text(textwrap.dedent(KILLER))
    proc = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True,
                          env=subprocess_env(), cwd=tmp_path, timeout=600)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-4000:]
    part = output.with_name("resumed.jsonl.parts") / "process-0.jsonl"
    data = part.read_bytes()
    assert data.count(b"\n") == 2 * BATCH and not data.endswith(b"\n")  # two batches and a torn line
    assert not output.exists()

    decoded = []
    original = batch_run.decode_batch
    monkeypatch.setattr(batch_run, "decode_batch", lambda m, t, p, k: decoded.append(len(p)) or original(m, t, p, k))
    assert cli.main(args) == 0
    assert f"resuming: {2 * BATCH} of {GROUPS * BATCH} rows were already done" in capsys.readouterr().err
    assert decoded == [BATCH] * (GROUPS - 2)  # only the unfinished batches
    assert read_jsonl(output) == reference  # each id once, in input order, same completions
    assert not part.parent.exists()


BAD_INPUTS = {
    "not-json": (['{"id": 1, "prompt": "a"}', "{'id': 2}"], [], 2, "is not valid JSON"),
    "not-an-object": (['{"id": 1, "prompt": "a"}', "[1, 2]"], [], 2, "is an array, not an object"),
    "missing-id": (['{"id": 1, "prompt": "a"}', '{"prompt": "b"}'], [], 2, "has no 'id'"),
    "bool-id": (['{"id": true, "prompt": "a"}'], [], 1, "the id is a boolean (true)"),
    "number-prompt": (['{"id": 1, "prompt": 42}'], [], 1, "'prompt' is a number (42), not a string"),
    "repeated-key": (['{"id": 1, "prompt": "a"}', '{"id": 2, "prompt": "b", "prompt": "c"}'], [], 2,
                     "has the key 'prompt' twice"),
    "duplicate-id": (['{"id": "a", "prompt": "x"}', "", '{"id": "b", "prompt": "y"}', '{"id": "a", "prompt": "z"}'],
                     [], 4, "id 'a' was already used on " + "{prompts}, line 1"),
    "empty-prompt": (['{"id": 1, "prompt": "a"}', '{"id": 2, "prompt": "  "}'], [], 2, "is empty or only whitespace"),
    "missing-field": (['{"id": 1, "prompt": "a"}'], ["--field", "text"], 1, "has no 'text' field"),
    "surrogate-id": (['{"id": 1, "prompt": "a"}', '{"id": "b\\ud800", "prompt": "b"}'], [], 2,
                     "holds the escape \\ud800 at character 1, half of a surrogate pair"),  # (failed as it was written)
    "surrogate-prompt": (['{"id": 1, "prompt": "a\\udcff"}'], [], 1, "holds the escape \\udcff"),  # (not "byte 0xff")
    "deep": (['{"id": 1, "prompt": "a", "x": ' + "[" * 100000], [], 1, "nests too deeply to read"),  # (a traceback)
    "huge-int-id": (['{"id": 1, "prompt": "a"}', '{"id": 1' + "0" * 5000 + ', "prompt": "b"}'], [], 2,
                    "holds an integer of more digits than Python reads"),
}


def test_an_existing_output_is_never_overwritten(prompts_file, tmp_path, monkeypatch, capsys):
    """An OUT that exists without an unfinished run's parts (a finished run's output, or any other file) is refused
    in one line before a model loads, and kept byte for byte (it was replaced silently)."""
    output = tmp_path / "out.jsonl"
    output.write_text("precious\n")
    monkeypatch.setattr(loading, "load_model", lambda *args, **kwargs: pytest.fail("a model was loaded"))
    assert cli.main(batch_args(prompts_file, output, "--device", "cpu")) == 2
    assert f"--output {output} exists" in capsys.readouterr().err and output.read_text() == "precious\n"
    assert not output.with_name("out.jsonl.parts").exists()
    assert cli.main(batch_args(prompts_file, output / "out.jsonl", "--device", "cpu")) == 2  # below a file
    assert f"{output} is a file, not a folder" in capsys.readouterr().err


def test_a_repeated_key_is_named_whatever_it_is_called(tmp_path):
    """A key given twice is reported as such, also when its name (or the file's path) says "digits" (it was taken for
    Python's limit on an integer's digits)."""
    prompts = tmp_path / "digits.jsonl"
    prompts.write_text('{"id": 1, "digits": 1, "digits": 2, "prompt": "a"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"line 1 has the key 'digits' twice \(JSON readers keep one of them "
                                         r"silently\); keep one\.$"):
        read_prompts(prompts)


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_names_the_line_before_loading_a_model(case, tmp_path, monkeypatch, capsys):
    lines, extra, line, message = BAD_INPUTS[case]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(lines) + "\n", encoding="utf-8")
    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    output = tmp_path / "out.jsonl"
    assert cli.main(["batch", str(prompts), "--output", str(output), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("hf-loopspec batch: error: ")
    assert f"{prompts}, line {line}" in err and message.format(prompts=prompts) in err
    assert not output.exists() and not output.with_name("out.jsonl.parts").exists()


@pytest.mark.parametrize("target", ["folder", "input"])
def test_output_that_is_a_folder_or_the_input_is_refused(target, prompts_file, tmp_path, monkeypatch, capsys):
    output = tmp_path if target == "folder" else prompts_file
    before = prompts_file.read_bytes()
    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    assert cli.main(batch_args(prompts_file, output)) == 2
    assert f"--output {output} is {'a folder' if target == 'folder' else 'the input file'}" in capsys.readouterr().err
    assert prompts_file.read_bytes() == before


def test_restart_with_other_settings_is_refused(prompts_file, tmp_path, monkeypatch, capsys):
    output = tmp_path / "out.jsonl"
    first = cli.build_parser().parse_args(batch_args(prompts_file, output))
    PartStore(output, batch_run.run_settings(first), 0).create()  # what a killed first run leaves
    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    assert cli.main([*batch_args(prompts_file, output), "--batch-size", "2"]) == 2
    err = capsys.readouterr().err
    assert "other settings (--batch-size: 4 then, 2 now)" in err and "delete" in err  # (the option, by name)


def test_a_depth_the_model_refuses_leaves_nothing_behind(prompts_file, tmp_path, capsys):
    """A draft depth the model's 4 loops refuse for pipeline mode fails before OUT.parts is made (it was made, the
    first batch failed, and the corrected command was refused as "an unfinished run with other settings")."""
    output = tmp_path / "out.jsonl"
    assert cli.main([*batch_args(prompts_file, output), "--draft-loops", "3", "--device", "cpu"]) == 2
    assert "--draft-loops=3" in capsys.readouterr().err
    assert not output.exists() and not Path(f"{output}.parts").exists()


def test_plain_mode_decodes_plain_on_a_speculative_default(prompts_file, tmp_path, capsys):
    """The embedded model's generation_config.json defaults to pipeline; `--mode plain` must still decode plain."""
    prompts = tmp_path / "two.jsonl"
    prompts.write_text("".join(prompts_file.read_text(encoding="utf-8").splitlines(keepends=True)[:2]))
    output = tmp_path / "plain.jsonl"
    assert cli.main([*batch_args(prompts, output), "--mode", "plain", "--device", "cpu"]) == 0
    assert all("speculation" not in row for row in read_jsonl(output))
    assert cli.main(["generate", "import os\n", "--mode", "plain", "--max-new-tokens", "4", "--device", "cpu"]) == 0
    assert "core calls" not in capsys.readouterr().err  # the counters of a speculative run


def test_prompt_past_the_models_positions_names_the_line(tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    rows = [{"id": 1, "prompt": "import os\n"}, {"id": 2, "prompt": "x = 1\n" * 1500}]  # > 2048 positions
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    output = tmp_path / "out.jsonl"
    assert cli.main(["batch", str(prompts), "--output", str(output), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert f"{prompts}, line 2" in err and "positions" in err
    assert not output.exists() and not output.with_name("out.jsonl.parts").exists()


def test_csv_read_with_datasets_gives_the_jsonl_output(prompts_file, tmp_path, capsys):
    rows = read_jsonl(prompts_file)[:3]
    jsonl, csv = tmp_path / "p.jsonl", tmp_path / "p.csv"
    jsonl.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    with csv.open("w", newline="", encoding="utf-8") as handle:
        writer = csv_module.writer(handle)
        writer.writerows([("id", "text"), *((row["id"], row["prompt"]) for row in rows)])
    for source, field in ((jsonl, "prompt"), (csv, "text")):
        output = tmp_path / f"from-{source.suffix[1:]}.jsonl"
        assert cli.main([*batch_args(source, output, "--mode", "plain", "--device", "cpu"), "--field", field]) == 0
    from_jsonl = [{**row, "id": str(row["id"])} for row in read_jsonl(tmp_path / "from-jsonl.jsonl")]
    assert read_jsonl(tmp_path / "from-csv.jsonl") == from_jsonl  # a CSV column of mixed ids is read as text
    csv.write_text('id,text\n1,"import os"\n2,\n')  # an empty cell
    assert cli.main(["batch", str(csv), "--output", str(tmp_path / "bad.jsonl"), "--field", "text"]) == 2
    assert f"{csv}, row 2: the prompt ('text') is empty" in capsys.readouterr().err
    csv.write_text("id,text\n007,0042\n7,1.50\n")  # cells are text as written: no guessed numbers
    assert [(row.id, row.prompt) for row in read_prompts(csv, "text")] == [("007", "0042"), ("7", "1.50")]
    # a byte-order mark first (Excel's "CSV UTF-8", Notepad) is no part of the text (it was: no column "id")
    marked = {"csv": "id,text\n007,0042\n7,1.50\n", "jsonl": '{"id": "007", "text": "0042"}\n{"id": "7", "text": '
              '"1.50"}\n', "json": '[{"id": "007", "text": "0042"}, {"id": "7", "text": "1.50"}]'}
    for suffix, text in marked.items():
        (tmp_path / f"marked.{suffix}").write_bytes(codecs.BOM_UTF8 + text.encode())
        rows = read_prompts(tmp_path / f"marked.{suffix}", "text")
        assert [(row.id, row.prompt) for row in rows] == [("007", "0042"), ("7", "1.50")], suffix


def test_a_call_that_decodes_plainly_gives_its_reason_not_a_crash(model, tokenizer):
    """A pipeline call that falls back to plain decoding (here `prefill_chunk_size`, as a checkpoint's generation
    config may set) has no per-row counters: `batch` crashed with an IndexError, and `generate`'s statistics line
    said "0 core calls" for a call that made 4 per token."""
    prompts = [tokenizer("def f(x):")["input_ids"], tokenizer("import os")["input_ids"]]
    kwargs = {"speculative_mode": "pipeline", "draft_loops": 1, "max_new_tokens": 4, "do_sample": False,
              "prefill_chunk_size": 4}
    rows = batch_run.decode_batch(model, tokenizer, prompts, kwargs)
    assert [row["speculation"] for row in rows] == [{"fallback": rows[0]["speculation"]["fallback"]}] * 2
    assert "prefill_chunk_size" in rows[0]["speculation"]["fallback"]
    plain = batch_run.decode_batch(model, tokenizer, prompts, {"max_new_tokens": 4, "do_sample": False})
    assert [row["completion"] for row in rows] == [row["completion"] for row in plain]
    enc = tokenizer("def f(x):", return_tensors="pt")
    out = model.generate(**enc, **kwargs, return_dict_in_generate=True)
    line = cli._speculation_summary(argparse.Namespace(mode="pipeline", do_sample=False), model, out)
    assert line == f"; decoded plainly ({out.speculation.fallback})" and "core calls" not in line


def test_sampling_options_at_their_off_values_do_not_block_a_resume(tmp_path):
    """A greedy run with `--top-k 0 --temperature 1.0` (off: not passed on) and its resume without them generate the
    same: their settings compare equal (the resume was refused as made with other settings)."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": 1, "prompt": "x"}\n')
    parse = cli.build_parser().parse_args
    out = tmp_path / "o.jsonl"
    with_off = parse(batch_args(prompts, out, "--mode", "plain", "--top-k", "0", "--temperature", "1.0"))
    without = parse(batch_args(prompts, out, "--mode", "plain"))
    assert batch_run.run_settings(with_off) == batch_run.run_settings(without)
    sampled = parse(batch_args(prompts, out, "--mode", "plain", "--do-sample", "--top-k", "0"))
    assert batch_run.run_settings(sampled)["top_k"] == 0
