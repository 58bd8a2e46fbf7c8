"""The maintainer scripts of `scripts/` refuse bad arguments with argparse's one-line error (exit 2) before any work:
each failed deep inside (a ZeroDivisionError, a KeyError, a traceback), accepted a value that made a broken output,
or (the training script) failed only once training had ended, writing nothing."""

from __future__ import annotations

import importlib.util
import json

import pytest
from processes import ROOT


def script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name, entry, argv, message", [
    ("measure_default_model", "parse_args", ["--num-prompts", "0"], "--num-prompts: 0 must be >= 1"),
    ("measure_default_model", "parse_args", ["--prompt-tokens", "0"], "--prompt-tokens: 0 must be >= 1"),
    ("measure_default_model", "parse_args", ["--threads", "0"], "--threads: 0 is outside [1,"),
    ("measure_default_model", "parse_args", ["--model", "/nonexistent/x"], "--model /nonexistent/x: not a folder"),
    ("render_model_cards", "main", ["--namespace", "bad ns"], "--namespace 'bad ns' is not a Hub namespace"),
    ("render_model_cards", "main", ["--namespace", ""], "--namespace '' is not a Hub namespace"),
    ("render_model_cards", "main", ["--namespace", "a/b"], "--namespace 'a/b' is not a Hub namespace"),
    ("train_default_model", "parse_args", ["--out", "{tmp}", "--steps", "1", "--val-percent", "0"],
     "--val-percent must be in (0, 100), got 0.0"),
    ("differential_soak", "main", ["--cases", "-3"], "--cases: -3 must be >= 1"),
    ("differential_soak", "main", ["--start", "-1"], "--start: -1 must be >= 0"),
])
def test_bad_arguments_end_in_one_line(capsys, tmp_path, name, entry, argv, message):
    argv = [arg.replace("{tmp}", str(tmp_path)) for arg in argv]
    if name == "render_model_cards":  # (were it accepted, the cards are written here, not over model_cards/)
        argv += ["--out", str(tmp_path)]
    with pytest.raises(SystemExit) as done:
        getattr(script(name), entry)(argv)
    err = capsys.readouterr().err
    assert done.value.code == 2 and message in err.splitlines()[-1], err


def test_the_card_script_refuses_a_results_file_that_is_no_bench_result(tmp_path, capsys):
    """A workload or auto-table result given as `--bench` failed with a KeyError once the card was being written."""
    workload = tmp_path / "workload.json"
    workload.write_text(json.dumps({"rows": {"plain": {}}, "machine": {}}))
    bench = json.loads((ROOT / "bench_results" / "cpu_default_b1.json").read_text())
    only_plain = tmp_path / "plain.json"
    only_plain.write_text(json.dumps({**bench, "rows": [r for r in bench["rows"] if r["mode"] == "plain"]}))
    for path, message in ((workload, "is not an `hf-loopspec bench --json` result"),
                          (only_plain, "has no pipeline row"), (tmp_path / "none.json", "No such file")):
        with pytest.raises(SystemExit) as done:
            script("write_default_model_card").parse_args(["--bench", str(path)])
        assert done.value.code == 2 and message in capsys.readouterr().err, path


def test_the_soak_scripts_help_shows_its_whole_description(capsys):
    with pytest.raises(SystemExit):
        script("differential_soak").main(["--help"])
    assert "for developers." in " ".join(capsys.readouterr().out.split())  # (it was cut after its first line)
