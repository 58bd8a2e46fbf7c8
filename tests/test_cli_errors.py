"""Every error a user can cause through `hf-loopspec` is ONE line on stderr (`hf-loopspec CMD: error: ...` naming the
problem and the fix) and exit status 2, with nothing written anywhere; `--debug` / `HF_LOOPSPEC_DEBUG=1` show the
traceback instead. Broken checkpoints (zero-byte, truncated and corrupt weights, a missing shard, pickle-only, no
config) are made by the tests from a tiny checkpoint; `generate`, `batch`, `bench` and `export` run through the real
entry point (`cli.main(argv)` in-process, and `python -m hf_loopspec.cli` in a subprocess)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from checkpoint_utils import save_checkpoint, snapshot, word_tokenizer
from cli_utils import command, one_error_line
from huginn_utils import tiny_huginn
from processes import cli_runs_in_one_process, subprocess_env

from hf_loopspec import cli
from hf_loopspec.bench import main as bench_main

POSITIONS = 16  # max_position_embeddings of the checkpoint: small, so that too-long prompts are cheap


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return save_checkpoint(tmp_path_factory.mktemp("good") / "ckpt", seed=1, max_position_embeddings=POSITIONS)


def _truncate(folder: Path) -> None:
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])


def _garbage_header(folder: Path) -> None:  # the 8-byte header length claims more bytes than the file has
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes((2**40).to_bytes(8, "little") + data[8:])


def _pickle_only(folder: Path) -> None:
    (folder / "model.safetensors").unlink()
    torch.save({"w": torch.zeros(2)}, folder / "pytorch_model.bin")


def _missing_shard(folder: Path) -> None:
    (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    index = {"metadata": {}, "weight_map": {"a": names[0], "b": names[1]}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


BREAKAGES = {  # name: (how the checkpoint is damaged, what the message must say)
    "zero-byte": (lambda f: (f / "model.safetensors").write_bytes(b""), "is empty (0 bytes)"),
    "truncated": (_truncate, "is truncated or corrupt"),
    "corrupt-header": (_garbage_header, "is truncated or corrupt"),
    "pickle-only": (_pickle_only, "has only pickle weights (pytorch_model.bin)"),
    "missing-shard": (_missing_shard, "model-00002-of-00002.safetensors is missing"),
    "bad-index": (lambda f: (f / "model.safetensors.index.json").write_text("{not json"),
                  "not a valid safetensors index"),
    "no-config": (lambda f: (f / "config.json").unlink(), "has no config.json"),
    "no-weights": (lambda f: (f / "model.safetensors").unlink(), "has no model.safetensors"),
}


def broken(good: Path, tmp_path: Path, kind: str) -> Path:
    folder = tmp_path / kind
    shutil.copytree(good, folder)
    BREAKAGES[kind][0](folder)
    return folder


# --- broken checkpoints, missing folders --------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["generate", "batch", "bench", "export"])
@pytest.mark.parametrize("kind", list(BREAKAGES))
def test_broken_checkpoints_are_one_line_errors(kind, name, good, tmp_path, capsys):
    folder = broken(good, tmp_path, kind)
    argv = command(name, str(folder), tmp_path)
    before = snapshot(tmp_path)
    assert cli.main(argv) == 2
    line = one_error_line(capsys, name)
    assert BREAKAGES[kind][1] in line and str(folder) in line
    assert snapshot(tmp_path) == before  # export: no OUT, no staging folder left beside it


@pytest.mark.parametrize("name", ["generate", "export"])
@pytest.mark.parametrize("kind", ["zero-byte", "truncated", "missing-shard"])
def test_a_broken_checkpoint_in_the_hub_cache_is_a_one_line_error(kind, name, good, tmp_path, capsys, monkeypatch):
    """A Hub id whose cached weights are empty or cut short (a download that did not finish) was loaded as it was:
    safetensors' traceback, exit 1, where the same folder named locally is one line. A shard not cached yet is the
    download's to fetch (offline here: the load's own error), not a broken checkpoint."""
    import huggingface_hub.constants

    snapshot_dir = tmp_path / "hub" / "models--someone--model" / "snapshots" / ("a" * 40)
    (tmp_path / "hub" / "models--someone--model" / "refs").mkdir(parents=True)
    (tmp_path / "hub" / "models--someone--model" / "refs" / "main").write_text("a" * 40)
    shutil.copytree(broken(good, tmp_path, kind), snapshot_dir)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert cli.main(command(name, "someone/model", tmp_path)) == 2
    line = one_error_line(capsys, name)
    if kind == "missing-shard":
        assert "is missing" not in line and "someone/model" in line, line
    else:
        assert f"{snapshot_dir}/model.safetensors {BREAKAGES[kind][1]}" in line, line


@pytest.mark.parametrize("name", ["generate", "export"])
@pytest.mark.parametrize("where", ["folder", "hub cache"])
def test_an_adapter_alone_is_named_as_an_adapter(where, name, tmp_path, capsys, monkeypatch):
    """A PEFT adapter's folder (adapter_config.json, no config.json) is no checkpoint: named as an adapter, with the
    fix, locally and as a Hub id cached offline (that one was "not in the local Hub cache", though it is)."""
    import huggingface_hub.constants

    folder = tmp_path / "hub" / "models--someone--adapter" / "snapshots" / ("a" * 40) if where == "hub cache" \
        else tmp_path / "adapter"
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "base_model_name_or_path": "x"}))
    if where == "hub cache":
        (tmp_path / "hub" / "models--someone--adapter" / "refs").mkdir()
        (tmp_path / "hub" / "models--someone--adapter" / "refs" / "main").write_text("a" * 40)
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    spec = "someone/adapter" if where == "hub cache" else str(folder)
    assert cli.main(command(name, spec, tmp_path)) == 2
    line = one_error_line(capsys, name)
    assert f"{spec} has no config.json" in line and "but a PEFT adapter (adapter_config.json)" in line, line
    assert "merge the adapter into its base model first" in line


@pytest.mark.parametrize("name", ["generate", "batch", "bench", "export"])
@pytest.mark.parametrize("spec", ["{tmp}/nowhere", "./nowhere", "some/where/else"])
def test_a_missing_local_folder_is_not_reported_as_a_hub_id(spec, name, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = spec.format(tmp=tmp_path)
    assert cli.main(command(name, spec, tmp_path)) == 2
    line = one_error_line(capsys, name)
    assert f"no such folder: {spec}" in line and "Repo id" not in line
    assert not (tmp_path / "OUT").exists()


@pytest.mark.parametrize("name", ["generate", "export"])
def test_a_hub_id_that_cannot_be_loaded_says_it_was_tried_as_one(name, tmp_path, capsys, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # no network: the id is not in the cache
    assert cli.main(command(name, "no-such-org/no-such-model", tmp_path)) == 2
    line = one_error_line(capsys, name)
    assert "no-such-org/no-such-model is not a local folder, and " in line
    # both refuse an uncached id before any Hub request (no retries), naming the offline switch
    assert "not in the local Hub cache while the Hub is off" in line
    assert not (tmp_path / "OUT").exists()


def test_a_file_is_not_a_checkpoint_folder(good, capsys):
    assert cli.main(command("generate", str(good / "config.json"), good)) == 2
    assert "config.json is a file; pass the checkpoint folder" in one_error_line(capsys, "generate")


# --- devices, numbers, positions ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["generate", "bench"])
@pytest.mark.parametrize("device, message", [("meta", "do not run on meta tensors"), ("cuda:99", "--device cuda:99"),
                                             ("quantum", "is not a torch device")])
def test_unsupported_devices_are_one_line_errors(device, message, name, good, tmp_path, capsys):
    argv = [*command(name, str(good), tmp_path), "--device", device]
    assert cli.main(argv) == 2
    assert message in one_error_line(capsys, name)


@pytest.mark.parametrize("argv", [
    ["generate", "x", "--do-sample", "--temperature", "inf"],
    ["generate", "x", "--do-sample", "--temperature", "nan"],
    ["generate", "x", "--do-sample", "--top-p", "nan"],
    ["bench", "--do-sample", "--temperature", "inf"],
    ["bench", "--calibration-seconds", "nan"],
    ["bench", "--calibration-seconds", "inf"],
    ["export", "src", "out", "--max-shard-size", "5XB"],
    ["export", "src", "out", "--max-shard-size", "0"],
    ["generate", "x", "--mode", "fast"],
    ["generate", "x", "--seed", str(2**70)],  # torch would refuse it after the model loads, naming no argument
    ["bench", "--seed", "-1"],
])
def test_bad_numbers_and_choices_are_one_line_errors(argv, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    try:
        status = cli.main(argv)
    except SystemExit as exit_:  # argparse's own exit
        status = exit_.code
    assert status == 2
    line = one_error_line(capsys, argv[0])
    assert argv[-1] in line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv, message", [
    (["bench", "--model", "ouro-tiny", "--json", "/proc/no/results.json"], "--json /proc/no/results.json"),
    (["bench", "--model", "ouro-tiny", "--plot", "/proc/no/plot.png"], "--plot /proc/no/plot.png"),
    (["bench", "--model", "ouro-tiny", "--json", "{tmp}/prompts.txt/x.json"], "({tmp}/prompts.txt is a file, not a"),
    (["export", "default", "{tmp}/prompts.txt/out"], "{tmp}/prompts.txt is a file, not a folder"),
    (["bench", "--model", "ouro-tiny", "--prompt-file", "{tmp}/none.txt"], "--prompt-file {tmp}/none.txt: no such"),
    (["bench", "--model", "ouro-tiny", "--prompt-file", "{tmp}/prompts.txt"], "has no tokenizer"),
    (["export", "default", "{tmp}/out", "--benchmarks", "{tmp}/none.json"], "{tmp}/none.json: cannot be read"),
    (["export", "default", "{tmp}/out", "--benchmarks", "none", "--benchmarks", "{tmp}/none.json"],
     "'none' says the card has no measured numbers; pass it alone"),
    (["export", "default", "{tmp}/out", "--benchmarks", "{tmp}/latin.txt"],
     "{tmp}/latin.txt is not UTF-8 text (byte 0xe9 at byte 3), so not JSON; pass a file written by"),
    (["bench", "--model", "ouro-tiny", "--prompt-file", "{tmp}/latin.txt"],
     "--prompt-file {tmp}/latin.txt is not UTF-8 text (byte 0xe9 at byte 3)"),
])
def test_paths_are_checked_before_the_run(argv, message, tmp_path, capsys, monkeypatch):
    """An output path that cannot be written, a missing input file, or a prompt file for a model without a
    tokenizer: one line naming the flag or the file, before any timed run (a bench of minutes is not lost at its
    end), and nothing written."""
    (tmp_path / "prompts.txt").write_text("def f(x):\n    return x\n")
    (tmp_path / "latin.txt").write_bytes(b"caf\xe9\n")
    monkeypatch.setattr("hf_loopspec.bench.main._measure", None)  # a run would fail on this, not on the check
    assert cli.main([arg.format(tmp=tmp_path) for arg in argv]) == 2
    assert message.format(tmp=tmp_path) in one_error_line(capsys, argv[0])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latin.txt", "prompts.txt"]


def _last_line(err: str) -> str:
    """stderr's last line, after checking that every other line is the weights-loading progress bar."""
    lines = err.strip().splitlines()
    assert all("Loading weights" in line for line in lines[:-1]), err
    return lines[-1]


def test_prompts_too_long_for_the_model_are_errors(good, tmp_path, capsys):
    long_prompt = " ".join(["w5"] * (POSITIONS + 2))
    assert cli.main(["generate", long_prompt, "--model", str(good), "--device", "cpu"]) == 2  # (128 new: past them)
    assert f"shorten PROMPT to at most {POSITIONS - 1} tokens with --max-new-tokens 1." in \
        _last_line(capsys.readouterr().err)
    assert cli.main(["generate", long_prompt, "--model", str(good), "--device", "cpu", "--max-new-tokens", "3"]) == 2
    # a fix for the call as given: it said "at most POSITIONS - 1 tokens" whatever --max-new-tokens asked for
    assert (f"the prompt is {POSITIONS + 2} tokens and the model has {POSITIONS} positions, which the prompt and the "
            f"new tokens share; shorten PROMPT to at most {POSITIONS - 3} tokens for --max-new-tokens 3, or to "
            f"{POSITIONS - 1} with --max-new-tokens 1.") in _last_line(capsys.readouterr().err)
    four = "w5 w6 w7 w8"
    base = ["generate", four, "--model", str(good), "--device", "cpu", "--mode", "plain"]
    assert cli.main([*base, "--max-new-tokens", str(POSITIONS - 3)]) == 2
    assert f"lower --max-new-tokens to {POSITIONS - 4}" in _last_line(capsys.readouterr().err)
    assert cli.main([*base, "--max-new-tokens", str(POSITIONS - 4)]) == 0  # exactly the model's positions: fine
    capsys.readouterr()
    bench_argv = [*command("bench", str(good), tmp_path), "--prompt-len", "12", "--new-tokens", "8"]
    assert cli.main(bench_argv) == 2
    assert "lower --new-tokens to 4 or shorten --prompt-len" in _last_line(capsys.readouterr().err)
    # one position left: the speculative modes need two new tokens, so the fix is a shorter prompt (it said "lower
    # --new-tokens to 1", which the next run refused)
    bench_argv = [*command("bench", str(good), tmp_path), "--prompt-len", str(POSITIONS - 1), "--new-tokens", "2",
                  "--modes", "plain,pipeline"]
    assert cli.main(bench_argv) == 2
    assert f"shorten --prompt-len to at most {POSITIONS - 2} tokens" in _last_line(capsys.readouterr().err)
    assert cli.main([*bench_argv, "--new-tokens", "1"]) == 2
    assert "--new-tokens 1: the speculative modes (" in capsys.readouterr().err


def test_advice_to_decode_plainly_names_the_option(tmp_path, capsys):
    """The library's "speculative_mode=None" reads "--mode plain" on the command line: a one-loop checkpoint has no
    shallower loop to draft from, and generate and batch say which option decodes it (they named the argument)."""
    one_loop = save_checkpoint(tmp_path / "one-loop", total_ut_steps=1)
    capsys.readouterr()  # (the save's progress bar)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": 1, "prompt": "w5 w6"}\n')
    for argv in (["generate", "w5 w6"], ["batch", str(prompts), "--output", str(tmp_path / "out.jsonl")]):
        assert cli.main([*argv, "--model", str(one_loop), "--device", "cpu", "--mode", "pipeline"]) == 2
        line = _last_line(capsys.readouterr().err)
        assert "this call runs 1 loop" in line and "decode plainly (--mode plain)" in line, line
        assert "speculative_mode" not in line
    # a path or a field that holds an argument's name is printed as given (it was rewritten as an option)
    missing = tmp_path / "sweeps" / "top_p" / "max_new_tokens"
    assert cli.main(["generate", "w5", "--model", str(missing), "--device", "cpu"]) == 2
    assert f"no such folder: {missing}" in _last_line(capsys.readouterr().err)
    assert cli.main(["batch", str(prompts), "--output", str(tmp_path / "o.jsonl"), "--field", "max_new_tokens"]) == 2
    assert "has no 'max_new_tokens' field" in _last_line(capsys.readouterr().err)


def test_a_checkpoints_refused_setting_is_named_as_the_checkpoints(tmp_path, capsys):
    """A `draft_loops` the checkpoint's generation_config.json saves, which its loops refuse, was blamed on
    `--draft-loops` (never passed; its default is 1), and `batch` found it only in its first batch, after making
    OUT.parts: both name the checkpoint's setting and the option that overrides it before anything runs."""
    folder = save_checkpoint(tmp_path / "saved-depth", total_ut_steps=2)
    config = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**config, "draft_loops": 3}))
    capsys.readouterr()
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": 1, "prompt": "w5 w6"}\n')
    out = tmp_path / "out.jsonl"
    for argv in (["generate", "w5 w6"], ["batch", str(prompts), "--output", str(out)]):
        assert cli.main([*argv, "--model", str(folder), "--device", "cpu", "--max-new-tokens", "2"]) == 2
        line = _last_line(capsys.readouterr().err)
        assert line.endswith("error: the checkpoint's generation_config.json sets draft_loops=3, which this call "
                             "refuses (draft_loops=3 is outside [1, 1] for a model with 2 loops: drafts come from a "
                             "shallower loop than the last one. Pass an integer between 1 and 1): pass "
                             "--draft-loops or --mode plain, or correct the checkpoint's generation_config.json."), line
    assert not Path(f"{out}.parts").exists()
    assert cli.main(["generate", "w5 w6", "--model", str(folder), "--device", "cpu", "--max-new-tokens", "2",
                     "--draft-loops", "1"]) == 0  # the option overrides it
    # a speculative-only option given: --mode plain (which refuses it) is offered without it
    argv = ["generate", "w5 w6", "--model", str(folder), "--device", "cpu", "--max-new-tokens", "2"]
    capsys.readouterr()  # (the run's report)
    assert cli.main([*argv, "--num-speculative-tokens", "3"]) == 2
    assert "pass --draft-loops or --mode plain without --num-speculative-tokens, or correct" in \
        _last_line(capsys.readouterr().err)
    assert cli.main([*argv, "--mode", "plain"]) == 0
    # a key no option sets: named alone (`draft_loops=` inside `second_draft_loops=` named it too), and plain
    # decoding, which reads none of them, still runs (the check refused it)
    folder = save_checkpoint(tmp_path / "saved-second", total_ut_steps=4)
    config = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**config, "speculative_mode": "pipeline",
                                                               "draft_loops": 1, "second_draft_loops": 3}))
    capsys.readouterr()
    argv = ["generate", "w5 w6", "--model", str(folder), "--device", "cpu", "--max-new-tokens", "2"]
    assert cli.main(argv) == 2
    line = _last_line(capsys.readouterr().err)
    assert "generation_config.json sets second_draft_loops=3, which this call refuses (" in line, line
    assert "or pass --mode pipeline): pass --mode plain, or correct the checkpoint's" in line, line
    assert "in the call" not in line, line  # (how a `generate` call clears it: no option does)
    for mode in ("plain", "pipeline"):
        assert cli.main([*argv, "--mode", mode]) == 0
    # an option the user gave, quoted in the same message, keeps its option spelling
    (folder / "generation_config.json").write_text(json.dumps({**config, "second_draft_loops": 1}))
    capsys.readouterr()  # (the runs' reports)
    assert cli.main([*argv, "--mode", "pipeline", "--draft-loops", "2"]) == 2
    line = _last_line(capsys.readouterr().err)
    assert "sets second_draft_loops=1, which this call refuses (second_draft_loops=1 must lie strictly between " \
           "--draft-loops=2 and the loop count 4" in line, line
    # nor how a call clears it (None) or runs it on the reference (model.decode_with_lanes): no option does either
    assert "pass one of [3]): pass --mode plain without --draft-loops, or correct" in line, line
    (folder / "generation_config.json").write_text(json.dumps({**config, "second_draft_loops": 2}))
    assert cli.main([*argv, "--mode", "pipeline"]) == 2
    line = _last_line(capsys.readouterr().err)
    assert "it needs second_draft_loops >= 3); pass second_draft_loops in [3]): pass --mode plain" in line, line


def test_a_checkpoints_refused_exit_or_recurrence_setting_is_named_before_batch_starts(tmp_path, capsys):
    """An exit option past the loops, or Huginn's num_steps on Ouro, saved in generation_config.json: `batch` failed
    in its first batch (after making OUT's folder and OUT.parts), naming no file; both commands name it before
    anything runs. So are a Huginn checkpoint's invalid recurrence settings (they were "the model's
    generation_config", naming no file and no fix), and a num_steps too large for the memory (`batch` left
    OUT.parts)."""
    ouro = save_checkpoint(tmp_path / "saved-exit", total_ut_steps=4)
    huginn = tmp_path / "huginn"
    model = tiny_huginn(seed=1)[0]
    model.save_pretrained(huginn)
    word_tokenizer(model.config.vocab_size).save_pretrained(huginn)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": 1, "prompt": "w5 w6"}\n')
    out = tmp_path / "new" / "out.jsonl"
    for folder, saved, named in (
            (ouro, {"exit_at_step": 9}, "exit_at_step=9 must be an integer in [0, 3] for a 4-loop model"),
            (ouro, {"num_steps": 3}, "num_steps=3: OuroForCausalLM has no recurrence settings"),
            (huginn, {"num_steps": 0}, "num_steps=0 must be an integer >= 1"),
            (huginn, {"init_scale": -1.0}, "init_scale=-1.0 must be a finite number >= 0"),
            (huginn, {"init_seed": -1}, "init_seed=-1 must be an integer in [0, 2**64)"),
            (huginn, {"num_steps": 2**40}, f"num_steps={2**40}: one token's KV over its {2**41 + 1} planes takes")):
        config = json.loads((folder / "generation_config.json").read_text())
        (folder / "generation_config.json").write_text(json.dumps({**config, **saved}))
        for argv in (["generate", "w5 w6"], ["batch", str(prompts), "--output", str(out)]):
            capsys.readouterr()
            assert cli.main([*argv, "--model", str(folder), "--device", "cpu", "--max-new-tokens", "2"]) == 2
            line = _last_line(capsys.readouterr().err)
            assert f"error: the checkpoint's generation_config.json: {named}" in line, line
            assert line.endswith("; correct the checkpoint's generation_config.json."), line
        assert not out.parent.exists()
        (folder / "generation_config.json").write_text(json.dumps(config))
    # Huginn's num_steps=1 (no shallower loop to draft from) under the default --mode auto: named as the file's, with
    # the option that works (the message named generate's num_steps, which no option sets)
    config = json.loads((huginn / "generation_config.json").read_text())
    (huginn / "generation_config.json").write_text(json.dumps({**config, "num_steps": 1}))
    capsys.readouterr()
    argv = ["generate", "w5 w6", "--model", str(huginn), "--device", "cpu", "--max-new-tokens", "2"]
    assert cli.main(argv) == 2
    line = _last_line(capsys.readouterr().err)
    assert "generation_config.json sets num_steps=1, which this call refuses (speculative decoding drafts from a " \
           "shallower loop than the last, but this call runs 1 loop (a Huginn model with num_steps=1, or a 1-loop " \
           "model)): pass --mode plain, or correct the checkpoint's generation_config.json." in line, line
    assert cli.main([*argv, "--mode", "plain"]) == 0


# --- the traceback on request, interrupts, a real process -----------------------------------------------------------


def test_debug_flag_and_environment_variable_show_the_traceback(good, tmp_path, capsys, monkeypatch):
    folder = broken(good, tmp_path, "zero-byte")
    argv = command("generate", str(folder), tmp_path)
    with pytest.raises(ValueError, match=r"is empty \(0 bytes\)"):
        cli.main([*argv, "--debug"])
    monkeypatch.setenv("HF_LOOPSPEC_DEBUG", "1")
    with pytest.raises(ValueError, match=r"is empty \(0 bytes\)"):
        cli.main(argv)
    monkeypatch.setenv("HF_LOOPSPEC_DEBUG", "0")
    assert cli.main(argv) == 2
    one_error_line(capsys, "generate")


def test_the_module_entry_points_share_the_handler(tmp_path, capsys):
    """`python -m hf_loopspec.bench` and `python -m hf_loopspec.hub.export` run `hf-loopspec bench` / `export`."""
    from hf_loopspec.bench.main import main as bench_entry
    from hf_loopspec.hub.export import main_export

    assert bench_entry(["--model", str(tmp_path / "nowhere"), "--device", "cpu"]) == 2
    assert "no such folder" in one_error_line(capsys, "bench")
    assert main_export([str(tmp_path / "nowhere"), str(tmp_path / "OUT")]) == 2
    assert "no such folder" in one_error_line(capsys, "export")
    assert list(tmp_path.iterdir()) == []


def test_an_interrupt_is_one_line_and_status_130(monkeypatch, capsys):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(bench_main, "main_from_args", interrupted)
    assert cli.main(["bench"]) == 130
    assert capsys.readouterr().err == "hf-loopspec bench: interrupted\n"


def test_a_real_process_prints_one_line(good, tmp_path, tmp_path_factory):
    """`python -m hf_loopspec.cli` in a real process (`processes.cli_runs_in_one_process`: its imports cost seconds;
    --debug is tested in-process), with an empty Hub cache, offline: a truncated checkpoint, and a Hub id that is not
    in the cache (it fails at once, naming the id and HF_HUB_OFFLINE), are each one line and write nothing."""
    folder = broken(good, tmp_path, "truncated")
    before = snapshot(tmp_path)
    uncached = ["export", "someone/no-such-model", str(tmp_path / "out")]
    runs = [(tmp_path, command("export", str(folder), tmp_path)), (tmp_path, uncached)]
    hub = tmp_path_factory.mktemp("hf_home")
    truncated, uncached = cli_runs_in_one_process(runs, drop=("HF_HUB_CACHE",), HF_HUB_OFFLINE="1", HF_HOME=str(hub))
    for proc in (truncated, uncached):
        assert proc.returncode == 2 and proc.stdout == ""
        assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("hf-loopspec export: error: "), proc.stderr
    assert "is truncated or corrupt" in truncated.stderr
    assert "someone/no-such-model" in uncached.stderr and "HF_HUB_OFFLINE" in uncached.stderr
    assert snapshot(tmp_path) == before


def test_an_os_error_about_a_path_names_the_path_first(tmp_path, capsys):
    """An `OSError` with a path reads "PATH: reason" (it read "[Errno 2] No such file or directory: 'PATH'"): a
    made-up error, then a batch OUT below /proc, where nothing can be created (Linux): batch names --output, the
    folder it could not create with the reason, and the fix."""
    assert cli.one_line(FileNotFoundError(2, "No such file or directory", "/x/y")) == "/x/y: No such file or directory"
    assert cli.one_line(OSError(18, "Invalid cross-device link", "a", None, "b")) == \
        "a: Invalid cross-device link (with b)"
    assert cli.one_line(OSError("no errno")) == "no errno"
    if not Path("/proc/self").is_dir():
        return
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": 1, "prompt": "def f():"}\n')
    out = "/proc/no-such-folder/out.jsonl"
    assert cli.main(["batch", str(prompts), "--output", out, "--device", "cpu", "--max-new-tokens", "2"]) == 2
    assert one_error_line(capsys, "batch").endswith(f"error: --output {out}: cannot create /proc/no-such-folder (No "
                                                    "such file or directory); pass an --output in a folder you can "
                                                    "write (the run keeps its parts in out.jsonl.parts/ beside it).")


def test_a_reader_that_leaves_early_ends_generate_quietly():
    """`hf-loopspec generate ... | head -c 1`, here as `python -m hf_loopspec`: once the reader has closed the pipe
    the command stops with status 141 (what a shell reports for a command that SIGPIPE ended) and prints no error:
    it printed "error: [Errno 32] Broken pipe" and exited with 2. Nor does it print transformers' warning about a
    missing attention mask (the one-row prompt now passes its mask)."""
    argv = [sys.executable, "-m", "hf_loopspec", "generate", "def f(x):", "--mode", "plain", "--max-new-tokens", "200"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=subprocess_env())
    first = proc.stdout.read(1)  # the first streamed byte: the run is decoding
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 141 and first, err
    assert "error" not in err and "Traceback" not in err and "attention mask" not in err, err


def test_missing_extras_are_named_with_the_repository_install_line(monkeypatch):
    """hf-loopspec is not on PyPI: the bench's plot and serve told users to `pip install 'hf-loopspec[...]'`, which
    finds nothing; they give the repository form every other install line uses (`hub.install`)."""
    from transformers.utils import import_utils

    from hf_loopspec import serving
    from hf_loopspec.bench import plot
    from hf_loopspec.hub.install import install_command

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # (an import of it raises ImportError)
    with pytest.raises(ValueError) as error:
        plot.pyplot()
    assert install_command("bench") in str(error.value) and "@ git+" in install_command("bench")
    monkeypatch.setattr(import_utils, "is_serve_available", lambda: False)
    monkeypatch.setattr(serving, "check_address", lambda host, port: None)  # (whether the port is free: not this)
    with pytest.raises(ValueError) as error:
        serving.start(["--port", "8123"])
    assert install_command("serve") in str(error.value)


def test_a_home_relative_folder_loads_as_that_folder(tmp_path, monkeypatch):
    """`--model ~/model` quoted (or `--model=~/model`, which the shell does not expand) passed every check as that
    folder, then was loaded unexpanded as a Hub repo id ("Repo id must be in the form ..."); export did the same."""
    from hf_loopspec.hub.source import resolve_source
    from hf_loopspec.loading import load_model

    monkeypatch.setenv("HOME", str(tmp_path))
    save_checkpoint(tmp_path / "model", seed=3)
    model, tokenizer, _ = load_model("~/model", "auto", torch.device("cpu"), need_tokenizer=True)
    assert tokenizer is not None and model.config.vocab_size > 0
    assert resolve_source("~/model").path == str(tmp_path / "model")


def test_a_cache_only_load_keeps_the_adapter_lookup_off_the_hub(tmp_path, monkeypatch):
    """A Hub id loaded from the local cache only (the Hub out of reach) still had transformers look for a peft
    `adapter_config.json` on the Hub, with retries, before every cached load."""
    import transformers.models.auto.auto_factory as auto_factory

    from hf_loopspec import loading

    asked = []
    lookup = auto_factory.find_adapter_config_file
    monkeypatch.setattr(auto_factory, "find_adapter_config_file",
                        lambda *args, **kwargs: asked.append(kwargs) or lookup(*args, **kwargs))
    monkeypatch.setattr(loading, "_hub_local_only", lambda spec: True)  # as for a cached Hub id, offline
    loading.load_model(str(save_checkpoint(tmp_path / "model", seed=3)), "auto", torch.device("cpu"))
    assert asked and all(kwargs.get("local_files_only") for kwargs in asked)
