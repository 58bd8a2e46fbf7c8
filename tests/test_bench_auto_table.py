"""The auto-mode table's cell bench (`scripts/bench_auto_table.py`, `hf_loopspec.bench.auto_table`): its
interleaving, a tiny cell end to end (outputs checked against plain decoding inside), its one-line errors."""

from __future__ import annotations

import json

import pytest

from hf_loopspec.bench import auto_table


def test_rounds_interleave_after_one_untimed_warm_up():
    calls, seen = [], []

    def generate(**options):
        calls.append(options["tag"])
        return len(calls)

    runs = {tag: {"tag": tag} for tag in "abc"}
    times, median = auto_table.interleaved(generate, runs, 3, lambda name, out: seen.append((name, out)))
    # the warm-up in the given order, then three rounds, each run once per round, the order rotated by the round
    assert calls == list("abc" "bca" "cab" "abc")
    assert [len(t) for t in times.values()] == [3, 3, 3] and set(median) == set("abc")
    assert seen == [(n, i + 1) for i, n in enumerate(calls)]  # every output is checked, the warm-up's too


@pytest.mark.parametrize("rounds", [3, 4])
def test_each_run_reports_the_output_of_its_median_time_round(monkeypatch, rounds):
    """A row's counters and auto's choices come from the round its median time comes from (they came from the last
    round: with nine rounds, auto's ninth call re-probed, and the table showed that call's choices beside the time of
    plain-decoding rounds). Each call takes the seconds a script gives it on a fake clock; for an even count the
    faster of the two middle rounds, as `report.median_run`."""
    clock, calls = [0.0], []
    seconds = {"a": [9, 3, 1, 7, 5], "b": [9, 8, 4, 2, 6]}  # the warm-up's first, then the timed rounds'

    def generate(**options):
        tag = options["tag"]
        calls.append(tag)
        clock[0] += seconds[tag][sum(c == tag for c in calls) - 1]
        return (tag, sum(c == tag for c in calls) - 1)  # (run, its round: 0 the warm-up)

    monkeypatch.setattr(auto_table.time, "perf_counter", lambda: clock[0])
    times, median = auto_table.interleaved(generate, {"a": {"tag": "a"}, "b": {"tag": "b"}}, rounds, lambda *_: None)
    assert times == {tag: seconds[tag][1:rounds + 1] for tag in "ab"}
    for tag in "ab":
        timed = seconds[tag][1:rounds + 1]
        middle = sorted(timed)[(rounds - 1) // 2]
        assert median[tag] == (tag, timed.index(middle) + 1)
        assert timed[median[tag][1] - 1] == middle and median[tag][1] != rounds  # (not the last round here)


def test_a_tiny_cell_runs_every_setting_and_reports_auto_against_the_best(tmp_path, capsys):
    path = tmp_path / "cell.json"
    assert auto_table.main(["--model", "ouro-tiny", "--synthetic-acceptance", "0.8", "--new-tokens", "6",
                            "--rounds", "1", "--modes", "plain,pipeline,auto", "--json", str(path)]) == 0
    result = json.loads(path.read_text())
    assert list(result["rows"]) == ["plain", "pipeline", "auto"] and result["rows"]["plain"]["x_plain"] == 1.0
    assert sum(int(c.rsplit("x", 1)[1]) for c in result["rows"]["auto"]["choices"]) == 6  # every token chosen for
    best = max(("plain", "pipeline"), key=lambda r: result["rows"][r]["x_plain"])
    assert result["best_fixed"] == best
    assert result["auto_x_best"] == pytest.approx(result["rows"]["auto"]["x_plain"] / result["rows"][best]["x_plain"])
    auto = result["rows"]["auto"]
    (inside,), (total,) = auto["segments_s"], auto["rounds_s"]  # one timed round: its segments lie inside the call
    assert 0 < inside <= total and auto["own_median_s"] == pytest.approx(total - inside)
    assert "auto:" in capsys.readouterr().out


@pytest.mark.parametrize(("argv", "message"), [
    (["--modes", "plain,fast"], "--modes: fast: choose among"),
    (["--model", "ouro-tiny"], "--model ouro-tiny: give --synthetic-acceptance with a random-weight shape"),
    (["--model", "default", "--synthetic-acceptance", "0.5"], "--model default: give --synthetic-acceptance"),
    (["--model", "ouro-tiny", "--synthetic-acceptance", "0.5", "--json", ""], "--json is empty"),  # (wrote nothing)
    (["--model", "/nonexistent/x"], "no such folder: /nonexistent/x"),  # (was a FileNotFoundError traceback)
])
def test_bad_arguments_are_one_line_exit_2(capsys, argv, message):
    with pytest.raises(SystemExit) as done:
        auto_table.main(argv)
    out, err = capsys.readouterr()
    assert done.value.code == 2 and out == "" and len(err.splitlines()) == 1, err
    assert message in err, err


def test_a_json_path_that_cannot_be_written_is_refused_before_the_run(tmp_path, capsys):
    """Checked up front as `hf-loopspec bench --json` is: it was opened after every round, a traceback losing them."""
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(SystemExit) as done:
        auto_table.main(["--model", "ouro-tiny", "--synthetic-acceptance", "0.8", "--json", str(blocker / "x.json")])
    out, err = capsys.readouterr()
    assert done.value.code == 2 and out == "" and len(err.splitlines()) == 1, err
    assert "--json" in err, err


def test_a_synthetic_acceptance_of_zero_is_named_in_the_header(capsys):
    """`--synthetic-acceptance 0` drafts synthetic tokens that are all wrong: the header said "acceptance real"."""
    assert auto_table.main(["--model", "ouro-tiny", "--synthetic-acceptance", "0", "--new-tokens", "2", "--rounds",
                            "1", "--modes", "plain"]) == 0
    assert "| acceptance 0.0 |" in capsys.readouterr().out.splitlines()[0]
