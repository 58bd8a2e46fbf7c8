"""The files of `hf-loopspec batch`: a second run on the same OUT is refused while the first holds the lock (and goes
ahead once the holder died); nothing is written through a pre-placed link; links in OUT's paths, a corrupt settings
file and a resume against other weights at the same `--model` are one-line refusals naming the file and the fix;
corrupt or non-UTF-8 inputs are one line naming the file and line, with nothing else on stderr (a real process, so
that third-party log handlers and progress bars are seen); the progress bar counts every process's rows."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
from checkpoint_utils import save_checkpoint, snapshot
from processes import accelerate_launch, cli_runs_in_one_process, subprocess_env

import hf_loopspec
from hf_loopspec import cli, loading
from hf_loopspec.assets import default_model_path
from hf_loopspec.batch import fingerprint
from hf_loopspec.batch import run as batch_run
from hf_loopspec.batch.parts import PartStore
from hf_loopspec.batch.progress import RunProgress

PROMPTS = [{"id": 0, "prompt": "import os\n"}, {"id": "b", "prompt": "def f(a, b):\n"}]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def argv(prompts: Path, output: Path, *extra: str) -> list[str]:
    return ["batch", str(prompts), "--output", str(output), "--mode", "plain", "--max-new-tokens", "3", "--device",
            "cpu", *extra]


def one_error_line(capsys) -> str:
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert out == "" and len(lines) == 1 and lines[0].startswith("hf-loopspec batch: error: "), err
    return lines[0]


@pytest.fixture
def no_model(monkeypatch):
    """Loading a model fails the test: the refusals come before it."""
    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))


@pytest.fixture
def prompts(tmp_path) -> Path:
    return write_jsonl(tmp_path / "prompts.jsonl", PROMPTS)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> bytes:
    """OUT of a run in a folder with nothing else in it."""
    folder = tmp_path_factory.mktemp("reference")
    output = folder / "out.jsonl"
    assert cli.main(argv(write_jsonl(folder / "prompts.jsonl", PROMPTS), output)) == 0
    return output.read_bytes()


# --- the lock -------------------------------------------------------------------------------------------------------

HOLDER = """
import sys
from pathlib import Path
from hf_loopspec.batch.parts import PartStore

with PartStore(Path(sys.argv[1]), {}, 0).lock():
    print("locked", flush=True)
    sys.stdin.read()  # until the test closes stdin or kills this process
"""


def fail_at_the_load(*args, **kwargs):
    raise ValueError("loaded")


def test_a_second_run_on_the_same_output_is_refused_naming_the_first(prompts, tmp_path, capsys, monkeypatch):
    output = tmp_path / "out.jsonl"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(output)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=subprocess_env())
    try:
        assert holder.stdout.readline() == "locked\n"
        monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
        assert cli.main(argv(prompts, output)) == 2
        line = one_error_line(capsys)
        assert f"--output {output} is being written by another hf-loopspec batch run (pid {holder.pid} on " in line
        assert "wait for it to finish" in line
        assert (output.parent / "out.jsonl.parts" / "lock").is_file()  # the holder's, left alone
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=60)
    # the kernel released the dead holder's lock: the next run takes it (and fails at the load, on purpose)
    monkeypatch.setattr(loading, "load_model", fail_at_the_load)
    assert cli.main(argv(prompts, output)) == 2
    assert one_error_line(capsys).endswith("error: loaded")
    assert not output.with_name("out.jsonl.parts").exists()  # it held nothing but the lock: removed


@pytest.mark.slow
def test_every_process_of_a_launch_is_refused_not_only_the_main_one(prompts, tmp_path):
    """Only the main process takes the lock; the others get its refusal instead of waiting for it at a barrier."""
    output = tmp_path / "out.jsonl"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(output)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=subprocess_env())
    try:
        assert holder.stdout.readline() == "locked\n"
        launch = [*accelerate_launch(2), "batch", str(prompts), "--output", str(output)]
        proc = subprocess.run(launch, capture_output=True, text=True, env=subprocess_env(), cwd=tmp_path, timeout=600)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=60)
    assert proc.returncode != 0
    refusal = f"hf-loopspec batch: error: --output {output} is being written by another hf-loopspec batch run (pid " \
              f"{holder.pid} on "
    assert proc.stderr.count(refusal) == 2, proc.stderr[-4000:]


# --- links and temporary files --------------------------------------------------------------------------------------


def test_a_preplaced_temporary_link_is_not_written_through(reference, tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("unrelated\n")
    (folder / "out.jsonl.tmp").symlink_to(victim)  # the temporary name the merge used to write
    output = folder / "out.jsonl"
    assert cli.main(argv(write_jsonl(folder / "prompts.jsonl", PROMPTS), output)) == 0
    assert victim.read_text() == "unrelated\n"
    assert output.read_bytes() == reference
    assert sorted(p.name for p in folder.iterdir()) == ["out.jsonl", "out.jsonl.tmp", "prompts.jsonl"]  # no debris
    assert os.stat(output).st_mode & 0o777 == 0o666 & ~current_umask()  # a plain file's mode, not mkstemp's 0600


KILLED_AT_THE_RENAME = """
import os, signal, sys
from hf_loopspec import cli

rename = os.replace

def replace(src, dst):
    if str(dst).endswith(".jsonl"):  # the merge's rename of its temporary file over OUT
        os.kill(os.getpid(), signal.SIGKILL)
    rename(src, dst)

os.replace = replace
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_merge_killed_before_its_rename_is_redone_without_debris(reference, tmp_path):
    prompts = write_jsonl(tmp_path / "prompts.jsonl", PROMPTS)
    output = tmp_path / "out.jsonl"
    proc = subprocess.run([sys.executable, "-c", KILLED_AT_THE_RENAME, *argv(prompts, output)], capture_output=True,
                          text=True, env=subprocess_env(), cwd=tmp_path, timeout=600)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-4000:]
    left = sorted(p.name for p in tmp_path.iterdir())
    assert len(left) == 3 and left[0].startswith(".out.jsonl.") and left[1:] == ["out.jsonl.parts", "prompts.jsonl"]
    assert cli.main(argv(prompts, output)) == 0
    assert output.read_bytes() == reference
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl", "prompts.jsonl"]


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


LINKS = {  # what is a link -> what the message names
    "parts-folder": ("out.jsonl.parts", "the parts folder"),
    "output": ("out.jsonl", "--output"),
    "part-file": ("out.jsonl.parts/process-0.jsonl", "the part folder's entry"),
    "settings-temporary": ("out.jsonl.parts/settings.json.tmp", "the part folder's entry"),
}


@pytest.mark.parametrize("case", LINKS)
def test_links_in_the_output_paths_are_refused(case, prompts, tmp_path, capsys, no_model):
    name, role = LINKS[case]
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "keep.txt").write_text("mine\n")
    link = tmp_path / name
    link.parent.mkdir(exist_ok=True)
    link.symlink_to(target if case == "parts-folder" else target / "keep.txt")
    before = snapshot(tmp_path)
    assert cli.main(argv(prompts, tmp_path / "out.jsonl")) == 2
    line = one_error_line(capsys)
    assert f"{role} {link} is a symbolic link (to {os.readlink(link)})" in line and "does not write through" in line
    assert snapshot(tmp_path) == before


# --- settings and weights -------------------------------------------------------------------------------------------


def interrupted_run(prompts: Path, output: Path, *extra: str) -> PartStore:
    """The parts folder a run killed before its first batch leaves (its settings, one empty part file)."""
    args = cli.build_parser().parse_args(argv(prompts, output, *extra))
    settings = {**batch_run.run_settings(args), "weights": fingerprint.weights_fingerprint(args.model, loaded=True)}
    del settings["generation_config"]  # (known once the model loads: as an hf_loopspec that did not record it left it)
    store = PartStore(output, settings, 0)
    store.create()
    store.path.touch()
    return store


@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]\n", b"\xff\xfe"])
def test_a_corrupt_settings_file_is_named_with_the_fix(content, prompts, tmp_path, capsys, no_model):
    output = tmp_path / "out.jsonl"
    store = interrupted_run(prompts, output)
    (store.dir / "settings.json").write_bytes(content)
    assert cli.main(argv(prompts, output)) == 2
    line = one_error_line(capsys)
    assert f"{store.dir / 'settings.json'} is corrupt (" in line
    assert f"restore it, or delete {store.dir} to start over" in line
    (store.dir / "settings.json").unlink()  # part files without their settings: refused too
    assert cli.main(argv(prompts, output)) == 2
    assert f"{store.dir} holds part files but no settings.json" in one_error_line(capsys)


def test_a_resume_against_other_weights_at_the_same_path_is_refused(prompts, tmp_path, capsys, no_model):
    folder = save_checkpoint(tmp_path / "ckpt", seed=1)
    weights = folder / "model.safetensors"
    then = f"{weights.stat().st_size} bytes, sha256 {hashlib.sha256(weights.read_bytes()).hexdigest()}"
    output = tmp_path / "out.jsonl"
    interrupted_run(prompts, output, "--model", str(folder))
    save_checkpoint(folder, seed=2)  # the checkpoint at the same path is replaced by another one
    now = f"{weights.stat().st_size} bytes, sha256 {hashlib.sha256(weights.read_bytes()).hexdigest()}"
    assert then != now
    capsys.readouterr()  # the progress bars of the saves
    assert cli.main(argv(prompts, output, "--model", str(folder))) == 2
    line = one_error_line(capsys)
    assert f"other settings (weights model.safetensors: '{then}' then, '{now}' now)" in line


def test_a_resume_under_another_saved_generation_config_is_refused(prompts, tmp_path, capsys, monkeypatch):
    """A run killed after its first batch, then rerun after the checkpoint's generation_config.json changed (its
    stop strings, which end rows, and its draft_loops): refused, naming the file and its keys (the rows of both
    settings were mixed in OUT without a word); rerun under the file it was made with, it finishes to what an
    uninterrupted run writes."""
    folder = tmp_path / "model"
    shutil.copytree(default_model_path(), folder)
    saved = json.loads((folder / "generation_config.json").read_text())
    output, uninterrupted = tmp_path / "out.jsonl", tmp_path / "uninterrupted.jsonl"
    command = [*argv(prompts, output, "--model", str(folder)), "--batch-size", "1", "--max-new-tokens", "4"]

    def save(stops, **changes):
        (folder / "generation_config.json").write_text(json.dumps({**saved, "stop_strings": stops, **changes}))

    save(["xx"])
    decode, calls = batch_run.decode_batch, []

    def killed_after_one_batch(*args):
        calls.append(args)
        if len(calls) == 2:
            raise KeyboardInterrupt  # (Ctrl-C during the second batch)
        return decode(*args)

    monkeypatch.setattr(batch_run, "decode_batch", killed_after_one_batch)
    assert cli.main(command) == 130
    monkeypatch.setattr(batch_run, "decode_batch", decode)
    save(["yy"], draft_loops=2)
    capsys.readouterr()
    assert cli.main(command) == 2
    line = capsys.readouterr().err.splitlines()[-1]  # (after the weights' loading bar)
    # (the file's keys as they are: not spelled as the options of the same name, which did not change)
    assert ("other settings (the checkpoint's generation_config.json draft_loops: 1 then, 2 now; the checkpoint's "
            "generation_config.json stop_strings: ['xx'] then, ['yy'] now)") in line, line
    save(["xx"])
    assert cli.main(command) == 0
    assert cli.main([*command[:3], str(uninterrupted), *command[4:]]) == 0
    assert output.read_text() == uninterrupted.read_text()


def test_a_refusal_forwarded_to_the_other_processes_keeps_the_keys_the_cli_leaves_as_they_are(monkeypatch):
    """Under `accelerate launch` the main process's refusal is sent to the others as text; the keys of a generation
    config that it names went with it (they were lost, so the other processes spelled `draft_loops` as the option
    `--draft-loops`, which had not changed, and each process printed another line)."""
    import accelerate.utils

    message = ("OUT.parts holds an unfinished run made with other settings (the checkpoint's generation_config.json "
               "draft_loops: 1 then, 2 now); rerun that command to finish it, or delete OUT.parts to start over.")
    sent = []
    monkeypatch.setattr(accelerate.utils, "broadcast_object_list", lambda objects: sent.append(objects) or
                        [message, ("draft_loops",)])  # (what the main process sends: its message and keys)
    with pytest.raises(ValueError) as raised:
        batch_run.on_main_process(SimpleNamespace(is_main_process=False, num_processes=2), lambda: pytest.fail())
    assert sent == [[None, ()]]  # (this process checked nothing)
    assert cli.option_spelled(str(raised.value), raised.value.keys) == message != cli.option_spelled(message)


def test_an_adapter_beside_the_checkpoint_is_part_of_the_weights_fingerprint(tmp_path):
    """`from_pretrained` loads a PEFT adapter saved in the checkpoint's folder onto the model, but the fingerprint
    read the checkpoint's weight files only: a run resumed after an adapter was added (or swapped, or removed) mixed
    two models' completions in OUT. A folder without one keeps the fingerprint it had."""
    import torch
    from helpers import tiny_model
    from peft import LoraConfig, get_peft_model

    tiny_model()[0].save_pretrained(tmp_path)
    bare = fingerprint.weights_fingerprint(str(tmp_path))
    assert bare == {"model.safetensors": fingerprint.file_digest(tmp_path / "model.safetensors")}
    config = LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False)
    lora = get_peft_model(hf_loopspec.OuroForCausalLM.from_pretrained(tmp_path), config)
    lora.save_pretrained(tmp_path)
    with_adapter = fingerprint.weights_fingerprint(str(tmp_path))
    assert with_adapter.keys() == {"model.safetensors", "adapter_config.json", "adapter_model.safetensors"}
    assert with_adapter["model.safetensors"] == bare["model.safetensors"]
    with torch.no_grad():
        next(p for name, p in lora.named_parameters() if "lora_B" in name).add_(1.0)
    lora.save_pretrained(tmp_path)
    assert fingerprint.weights_fingerprint(str(tmp_path))["adapter_model.safetensors"] != \
        with_adapter["adapter_model.safetensors"]


def test_the_default_model_records_the_package_version(prompts, tmp_path, capsys, no_model, monkeypatch):
    output = tmp_path / "out.jsonl"
    interrupted_run(prompts, output)
    monkeypatch.setattr(fingerprint, "__version__", "99.0")  # a new package may embed other weights
    assert cli.main(argv(prompts, output)) == 2
    line = one_error_line(capsys)
    assert f"other settings (weights hf_loopspec: '{hf_loopspec.__version__}' then, '99.0' now)" in line


def test_a_hub_id_is_fingerprinted_by_the_commit_it_loaded(prompts, tmp_path, capsys, monkeypatch):
    import huggingface_hub.constants

    repo = tmp_path / "hub" / "models--org--name"  # a Hub cache holding two commits of org/name
    commits = ["a" * 40, "b" * 40]
    for seed, commit in enumerate(commits, start=1):
        save_checkpoint(repo / "snapshots" / commit, seed=seed)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commits[0])
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert fingerprint.weights_fingerprint("org/name") is None  # before the load: it may fetch a newer commit
    digests = [fingerprint.file_digest(repo / "snapshots" / commit / "model.safetensors") for commit in commits]
    assert fingerprint.weights_fingerprint("org/name", loaded=True) == {"hub": f"org/name@{commits[0]}",
                                                                       "model.safetensors": digests[0]}
    output = tmp_path / "out.jsonl"
    interrupted_run(prompts, output, "--model", "org/name")
    (repo / "refs" / "main").write_text(commits[1])  # main moved on
    capsys.readouterr()
    assert cli.main(argv(prompts, output, "--model", "org/name")) == 2
    line = capsys.readouterr().err.splitlines()[-1]  # after the weights' loading bar
    assert f"weights hub: 'org/name@{commits[0]}' then, 'org/name@{commits[1]}' now" in line
    assert f"weights model.safetensors: '{digests[0]}' then, '{digests[1]}' now" in line
    (repo / "refs" / "main").write_text(commits[0])  # back to the commit of the unfinished run: it resumes
    assert cli.main(argv(prompts, output, "--model", "org/name")) == 0
    assert [row["id"] for row in map(json.loads, output.read_text().splitlines())] == [row["id"] for row in PROMPTS]


def test_the_fingerprint_samples_the_data_of_large_files_and_ignores_timestamps(tmp_path):
    import torch
    from safetensors.torch import save_file

    path = tmp_path / "model.safetensors"
    count = 2 * fingerprint.SAMPLES * fingerprint.BLOCK // 4  # float32: twice the bytes the samples read
    save_file({"w": torch.zeros(count)}, str(path))
    data = path.read_bytes()
    header_end = 8 + int.from_bytes(data[:8], "little")
    digest = fingerprint.file_digest(path)
    copy = tmp_path / "copy" / "model.safetensors"
    copy.parent.mkdir()
    shutil.copyfile(path, copy)  # another mtime, same bytes
    assert fingerprint.file_digest(copy) == digest
    size = len(data) - header_end
    middle = header_end + fingerprint.SAMPLES // 2 * (size - fingerprint.BLOCK) // (fingerprint.SAMPLES - 1)
    for offset in (header_end, len(data) - 1, middle + fingerprint.BLOCK // 2):  # in the first, last, a middle block
        changed = bytearray(data)
        changed[offset] ^= 1
        copy.write_bytes(changed)
        assert fingerprint.file_digest(copy) != digest, offset
    save_file({"w": torch.zeros(count, dtype=torch.int32)}, str(copy))  # same size, another header
    assert fingerprint.file_digest(copy) != digest


# --- reader errors, in a real process ---------------------------------------------------------------------------------

BAD_FILES = {  # name: (bytes, what the line names after the file)
    "bad.csv": (b'id,prompt\n1,"import os\n', ", line 2, cannot be read as CSV (unexpected end of data); put a "
                                              "field that holds a comma"),
    "ragged.csv": (b"id,prompt\n1,a\n2,b,c,d\n", ", line 3 (row 2), has 4 fields ('2', 'b', 'c', 'd') where the "
                                                "header has 2 ('id', 'prompt'); put a field that holds a comma"),
    "bad.json": (b'{"id": 1, "prompt": ', ", line 1 is not valid JSON (Expecting value at column 21); a .json file "
                                          "holds one JSON array of objects"),
    "bad-array.json": (b'[{"id": 1, "prompt": "a"},\n {"id": 2 "prompt": "b"}]', ", row 2 is not valid JSON "
                                                                                 "(Expecting ',' delimiter at line 2, "
                                                                                 "column 11)"),
    # files without rows ("Instruction "train" corresponds to no data!", from datasets)
    "empty-array.json": (b"[ ]\n", " holds no rows; give it at least one row such as "),
    "empty-object.json": (b"{}", " holds no rows; give it at least one row such as "),
    "header-only.csv": (b"id,prompt\n", " holds no rows; give it at least one row such as "),
    "bad.parquet": (b"PAR1 not really parquet", "cannot be read as PARQUET (ArrowInvalid: "),
    "latin.jsonl": (b'{"id": 0, "prompt": "a"}\n{"id": 1, "prompt": "caf\xe9"}\n', ", line 2, is not UTF-8 text "
                                                                                    "(byte 0xe9 at byte 25"),
    "latin.csv": (b"id,prompt\n1,caf\xe9\n", ", line 2, is not UTF-8 text (byte 0xe9 at byte 6"),
    "empty.json": (b"", " is empty (0 bytes)"),
    # half a surrogate pair, which datasets' reader dropped without a word (the id "x\ud800" was read as "x")
    "lone.json": (b'[{"id": 1, "prompt": "a"}, {"id": "x\\ud800", "prompt": "b"}]', ", row 2 holds the escape "
                                                                                       "\\ud800 at character 1"),
    "lone-lines.json": (b'{"id": 1, "prompt": "a"}\n{"id": 2, "prompt": "a\\udc80b"}\n', ", line 2 holds the "
                                                                                         "escape \\udc80"),
}


@pytest.fixture(scope="module")
def reader_runs(tmp_path_factory) -> dict[str, tuple[Path, subprocess.CompletedProcess]]:
    """(folder, result) by case: each of `BAD_FILES` (key: its name) and a too-long prompt ("too-long") run in a
    folder of its own, all in one fresh process (`processes.cli_runs_in_one_process`: what each prints is its own)."""
    runs = {}
    for name, (content, _) in BAD_FILES.items():
        folder = tmp_path_factory.mktemp("reader")
        (folder / name).write_bytes(content)
        runs[name] = folder, ["batch", name, "--output", "out.jsonl"]
    folder = tmp_path_factory.mktemp("too-long")
    write_jsonl(folder / "p.jsonl", [{"id": 1, "prompt": "x = 1\n" * 1500}])  # past the 2048 positions
    runs["too-long"] = folder, ["batch", "p.jsonl", "--output", "out.jsonl", "--device", "cpu"]
    results = cli_runs_in_one_process(list(runs.values()))
    return {case: (folder, result) for (case, (folder, _)), result in zip(runs.items(), results)}


@pytest.mark.parametrize("name", BAD_FILES)
def test_unreadable_inputs_are_the_only_line_on_stderr(name, reader_runs):
    _, message = BAD_FILES[name]
    folder, proc = reader_runs[name]
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("hf-loopspec batch: error: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert name in proc.stderr and message in proc.stderr, proc.stderr
    assert sorted(p.name for p in folder.iterdir()) == [name]


def test_a_too_long_prompt_prints_no_tokenizer_warning(reader_runs):
    folder, proc = reader_runs["too-long"]
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert all("Loading weights" in line for line in lines[:-1]), proc.stderr  # the weights' bar, nothing else
    assert "p.jsonl, line 1" in lines[-1] and "positions" in lines[-1]
    assert sorted(p.name for p in folder.iterdir()) == ["p.jsonl"]


# --- progress -------------------------------------------------------------------------------------------------------


def test_the_bar_counts_every_processes_rows(tmp_path, capsys):
    """Two writer threads stand for two processes; process 1's part file starts with a torn line of a killed run."""
    output = tmp_path / "out.jsonl"
    stores = [PartStore(output, {}, index) for index in range(2)]
    stores[0].create()
    stores[1].path.write_text(json.dumps({"id": "old", "new_tokens": 1}) + "\n" + '{"id": "torn", "new')
    batches = {index: [[{"id": f"{index}-{b}-{r}", "new_tokens": 3 + index,
                         "speculation": {"accepted": index + 1, "verified": 2}} for r in range(3)] for b in range(4)]
               for index in range(2)}

    def write(index: int, progress: RunProgress) -> None:
        with stores[index].open() as part:
            for rows in batches[index]:
                PartStore.append(part, rows)
                if index == 0:  # the main process polls after its own batches, the thread polls the rest
                    progress.poll()

    total = 1 + 2 * 4 * 3
    with RunProgress(stores[0], total, 1, enabled=True, poll_thread=True) as progress:
        writers = [threading.Thread(target=write, args=(index, progress)) for index in range(2)]
        for writer in writers:
            writer.start()
        for writer in writers:
            writer.join()
    assert progress.rows == 2 * 4 * 3
    assert progress.tokens == 4 * 3 * (3 + 4)
    assert (progress.accepted, progress.verified) == (4 * 3 * (1 + 2), 2 * 4 * 3 * 2)
    err = capsys.readouterr().err
    assert f"{total}/{total}" in err and "accepted=75.0%" in err
