"""The `hf-loopspec` CLI and the benchmark, on tiny random-weight models (CPU, fp32): the bench runs every mode,
writes the documented JSON, checks every speculative output against plain greedy, reproduces the pipeline cost
model under synthetic full acceptance, and with `--do-sample` samples in every mode (seeded, with generate's own
warpers, not compared token by token); `generate` streams the same text in every mode and samples in every mode;
bad input ends with a one-line message and exit status 2. No timing assertions."""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import subprocess
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from checkpoint_utils import word_tokenizer
from processes import ROOT
from transformers import PreTrainedTokenizerFast

from hf_loopspec import cli, loading
from hf_loopspec.bench import args as bench_args
from hf_loopspec.bench import costs, plot, prompts, report, run, shapes
from hf_loopspec.bench import main as main_module
from hf_loopspec.bench.main import run_bench

N = 8  # new tokens
FAST = ["--model", "ouro-tiny", "--device", "cpu", "--prompt-len", "8", "--new-tokens", str(N), "--repeats", "1",
        "--calibration-seconds", "0.05", "--quiet"]
ROW_KEYS = {"mode", "tokens_per_s", "ratio_vs_plain", "speedup_vs_ar", "core_calls_per_token", "acceptance_rate",
            "ideal_speedup_vs_ar", "fraction_of_ideal", "overhead_fraction", "peak_mem_bytes", "check", "check_passed"}


@pytest.fixture(scope="module")
def all_modes(tmp_path_factory):
    """(result, JSON path) of one bench run over all four modes, batch 2."""
    path = tmp_path_factory.mktemp("bench") / "out" / "bench.json"
    return run_bench(bench_args.parse_args([*FAST, "--batch-size", "2", "--json", str(path)])), path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny random Ouro checkpoint folder with a word-level tokenizer covering its whole vocabulary."""
    folder = tmp_path_factory.mktemp("tiny-ouro")
    model = shapes.random_model("ouro-tiny", torch.float32, torch.device("cpu"), seed=3)
    model.save_pretrained(folder)
    word_tokenizer(model.config.vocab_size).save_pretrained(folder)
    return folder


# --- bench ----------------------------------------------------------------------------------------------------------


def test_bench_runs_every_mode_and_writes_the_documented_json(all_modes):
    result, path = all_modes
    assert [r["mode"] for r in result["rows"]] == list(bench_args.MODES)
    for row in result["rows"]:
        assert ROW_KEYS <= set(row)
        assert row["tokens_per_s"] > 0 and row["peak_mem_bytes"] > 0
    assert {"cpu", "torch_threads", "torch", "device", "device_name"} <= set(result["machine"])
    assert result["args"]["new_tokens"] == N and result["synthetic_acceptance"] is None
    assert result["notes"]["peak_mem_kind"].startswith("params_plus_kv_cache")
    on_disk = json.loads(path.read_text())
    assert {"rows", "machine", "args", "call_costs"} <= set(on_disk)
    assert [r["mode"] for r in on_disk["rows"]] == list(bench_args.MODES)
    ar = next(r for r in result["rows"] if r["mode"] == "ar")
    assert ar["core_calls_per_token"] == 4.0 and ar["ideal_speedup_vs_ar"] == pytest.approx(1.0)


def test_bench_speculative_outputs_equal_plain_greedy(all_modes):
    result, _ = all_modes
    for row in result["rows"][1:]:
        assert row["check_passed"] is True, row["check"]
        assert row["check"]["exact"] and row["check"]["agreement_rate"] == 1.0
    assert result["all_checks_passed"]


def test_bench_loads_a_checkpoint_and_cuts_prompts_from_a_file(checkpoint, tmp_path):
    text = tmp_path / "prompt.txt"
    text.write_text(" ".join(f"w{3 + i % 50}" for i in range(40)))
    args = bench_args.parse_args([*FAST, "--model", str(checkpoint), "--modes", "plain,pipeline", "--prompt-file",
                                  str(text), "--batch-size", "2"])
    result = run_bench(args)
    assert result["model"]["name"] == str(checkpoint)
    assert result["rows"][1]["check_passed"] is True


def test_compare_reports_the_first_divergence():
    ref = torch.tensor([[5, 6, 7, 8], [1, 2, 3, 4]])
    out = torch.tensor([[5, 6, 7, 8], [1, 2, 9, 9]])
    check = run.compare(out, ref)
    assert not check["exact"] and check["agreement_rate"] == pytest.approx((4 + 2) / 8)
    assert check["first_divergence"] == {"seq": 1, "token_index": 2, "reference_token": 3, "token": 9}


@pytest.mark.parametrize("draft_loops", [1, 2])
def test_synthetic_full_acceptance_reproduces_the_pipeline_cost_model(draft_loops, tmp_path):
    args = bench_args.parse_args([*FAST, "--modes", "plain,block,pipeline", "--synthetic-acceptance", "1.0",
                                  "--draft-loops", str(draft_loops), "--json", str(tmp_path / "b.json")])
    result = run_bench(args)
    rows = {r["mode"]: r for r in result["rows"]}
    assert result["synthetic_acceptance"] == 1.0
    assert json.loads((tmp_path / "b.json").read_text())["synthetic_acceptance"] == 1.0
    for mode in ("block", "pipeline"):
        assert rows[mode]["acceptance_rate"] == 1.0 and rows[mode]["check_passed"] is True
    assert rows["pipeline"]["core_calls_per_token"] == pytest.approx(((N - 1) * draft_loops + 4) / N)
    assert rows["block"]["core_calls_per_token"] < 4
    assert "SYNTHETIC ACCEPTANCE 1.0" in report.format_table(result)


def test_bench_engines_runs_each_lane_mode_on_the_engine_and_the_reference(tmp_path):
    """`--engines wavefront,reference`: every lane mode on the engine and on the reference (a measured baseline) in
    one process, rows named by engine and carrying it; full synthetic acceptance gives both the pipeline cost model
    and plain's tokens; with `--second-draft-loops` pipeline runs once more on each with second proposals, with the
    same counters."""
    args = bench_args.parse_args([*FAST, "--modes", "plain,ar,pipeline", "--engines", "wavefront,reference",
                                  "--synthetic-acceptance", "1.0", "--batch-size", "2", "--second-draft-loops", "3",
                                  "--json", str(tmp_path / "b.json")])
    result = run_bench(args)
    rows = {r["mode"]: r for r in result["rows"]}
    assert list(rows) == ["plain", "ar", "ar/reference", "pipeline", "pipeline/reference", "pipeline+second",
                          "pipeline+second/reference"]
    assert [r["engine"] for r in result["rows"]] == [None, "wavefront", "reference", "wavefront", "reference",
                                                      "wavefront", "reference"]
    assert result["all_checks_passed"]
    oracle, wavefront = rows["pipeline+second/reference"], rows["pipeline+second"]
    assert [oracle[k] for k in ("second_drafts", "second_accepted", "core_calls_per_token")] == \
        [wavefront[k] for k in ("second_drafts", "second_accepted", "core_calls_per_token")]
    for name in ("ar", "pipeline"):
        oracle, wavefront = rows[f"{name}/reference"], rows[name]
        assert wavefront["check_passed"] is True
        assert wavefront["core_calls_per_token"] == oracle["core_calls_per_token"]
        assert wavefront["ideal_speedup_vs_ar"] is not None  # its call rows feed the cost model
    assert rows["pipeline"]["core_calls_per_token"] == pytest.approx((N - 1 + 4) / N)
    assert "pipeline/reference" in report.format_table(result)
    sampled = run_bench(bench_args.parse_args([*FAST, "--modes", "pipeline", "--engines", "wavefront",
                                               *SAMPLING]))  # the wavefront engine samples too
    assert [(r["mode"], r["engine"], r["check"]["exact"]) for r in sampled["rows"]] == \
        [("pipeline", "wavefront", None)]
    assert sampled["rows"][0]["drafted"] > 0


def test_the_progress_log_holds_each_timed_run_as_it_ends(capsys):
    """Without --quiet, stderr names each warm-up and timed run with its seconds as it ends: what a run stopped at a
    time limit (scripts/gpu_check.sh) still reports. The logged seconds are the ones the rows hold."""
    argv = [a for a in FAST if a != "--quiet"]
    result = run_bench(bench_args.parse_args([*argv, "--modes", "plain,pipeline", "--repeats", "2"]))
    err = capsys.readouterr().err
    for row in result["rows"]:
        for r, seconds in enumerate(row["seconds_all"], start=1):
            assert f"[bench] round {r} {row['mode']}: {seconds:.2f}s\n" in err
    assert re.search(r"\[bench\] warm-up pipeline: \d+\.\d\ds\n", err)


def test_bench_runs_a_huginn_shape_with_calls_per_token_of_its_recurrence(tmp_path):
    """huginn-tiny (8 recurrence steps): plain and ar take 8 core calls per token, pipeline at synthetic full
    acceptance (N-1)d + U calls, outputs equal plain greedy; its call costs (prelude and coda timed on their own
    KV planes) give the ideal columns, and ar's ideal speed-up over itself is 1."""
    args = bench_args.parse_args([*FAST, "--model", "huginn-tiny", "--synthetic-acceptance", "1.0", "--draft-loops",
                                  "2", "--json", str(tmp_path / "h.json")])
    result = run_bench(args)
    rows = {r["mode"]: r for r in result["rows"]}
    assert result["model"]["num_loops"] == 8 and result["model"]["config"]["model_type"] == "huginn_raven"
    assert rows["plain"]["core_calls_per_token"] == rows["ar"]["core_calls_per_token"] == 8
    assert rows["pipeline"]["core_calls_per_token"] == pytest.approx(((N - 1) * 2 + 8) / N)
    assert all(r["check_passed"] for r in result["rows"][1:])
    costs_json = result["call_costs"]
    for stage in ("embed", "core", "head"):
        assert costs_json[f"{stage}_prefill_seconds"] > 0
        assert all(s > 0 for s in costs_json[f"{stage}_seconds_by_rows"].values())
    assert rows["ar"]["ideal_speedup_vs_ar"] == pytest.approx(1.0)
    assert rows["ar"]["predicted_seconds"] == pytest.approx(costs_json["ar_predicted_seconds"])
    for mode in ("block", "pipeline"):
        assert rows[mode]["ideal_speedup_vs_ar"] > 0 and rows[mode]["fraction_of_ideal"] > 0
    assert "head h(1)=" in report.format_table(result) and "embed e(1)=" in report.format_table(result)


@pytest.mark.parametrize("shape", ["ouro-tiny", "huginn-tiny"])
def test_ar_call_rows_are_the_rows_an_ar_run_records(shape):
    """The cost model's `ar` call shapes (used when `ar` is not among the modes) are what the reference counts (the
    engine counts the fixed shapes it runs, masked rows included)."""
    model = shapes.random_model(shape)
    ids = prompts.make_prompts(None, model.config.vocab_size, 2, 8, seed=0)
    recurrence = model.recurrence(init_scale=0.0) if shape.startswith("huginn") else contextlib.nullcontext()
    with torch.inference_mode(), recurrence, run.bench_generation_config(model, None):
        recorded = run.run_mode(model, "ar", ids, 5, draft_loops=1, k=4, engine="reference")["call_rows"]
    head_has_kv = model.kv_layout.first_exit_plane is not None
    assert recorded == costs.ar_call_rows(model.num_loops, 2, 8, 5, head_has_kv)


@pytest.mark.slow
def test_bench_compile_reports_compile_time_and_keeps_outputs(tmp_path):
    """`--compile BACKEND` compiles the speculative modes (not plain), reports their compile time and backend, and
    keeps their outputs plain's; the `eager` backend: dynamo's tracing, whatever the backend (the engine's inductor
    code is tested in `test_wavefront.py`)."""
    args = bench_args.parse_args([*FAST, "--modes", "plain,ar,pipeline,auto", "--compile", "eager"])
    result = run_bench(args)
    rows = {r["mode"]: r for r in result["rows"]}
    assert rows["plain"]["compile_seconds"] is None
    assert rows["ar"]["compile_seconds"] is not None and rows["pipeline"]["compile_seconds"] is not None
    assert rows["pipeline"]["overhead_fraction"] is None  # eager call costs cannot split a compiled run's time
    assert rows["auto"]["compile_seconds"] is not None and rows["auto"]["overhead_fraction"] is None
    assert all(r["check_passed"] for r in result["rows"][1:])
    assert "backend eager" in report.format_table(result)


def test_bench_static_mode_is_transformers_loop_on_a_static_cache():
    result = run_bench(bench_args.parse_args([*FAST, "--modes", "plain,static,pipeline"]))
    rows = {r["mode"]: r for r in result["rows"]}
    assert rows["static"]["check_passed"] is True and rows["static"]["core_calls_per_token"] == 4
    assert rows["static"]["kv_cache_bytes"] > 0  # (no compile time on a CPU, where transformers compiles nothing)


def test_synthetic_hook_is_seeded_and_wrong_tokens_differ():
    ref = torch.tensor([[7] * 50])
    picks = [run.synthetic_hook(ref, 10, 0.5, 20, seed=1) for _ in range(2)]
    a = [picks[0](0, 10 + i, 0) for i in range(50)]
    assert a == [picks[1](0, 10 + i, 0) for i in range(50)]
    assert 0 < a.count(7) < 50 and all(0 <= x < 20 for x in a)


def test_synthetic_drafts_do_not_depend_on_the_order_they_are_asked_in():
    # The reference decoder asks position by position as it drafts (again after a rejection); the engine fills its
    # device-side override for every position up front: both must see the same draft at each (sequence, position).
    ref = torch.arange(60).reshape(2, 30) % 17
    forward, backward = (run.synthetic_hook(ref, 5, 0.6, 17, seed=3) for _ in range(2))
    cells = [(seq, 5 + i) for seq in range(2) for i in range(30)]
    first = {cell: forward(*cell, -1) for cell in cells}
    assert first == {cell: backward(*cell, -1) for cell in reversed(cells)}
    assert all(forward(*cell, -1) == first[cell] for cell in cells)  # a redraft proposes the same token
    assert forward(0, 4, 9) == 9 and forward(1, 35, 9) == 9  # outside the new tokens: the model's own draft


def test_ideal_model_interpolates_call_costs():
    table = {1: 1.0, 2: 1.5, 4: 2.5}
    assert costs.interpolate(table, 3) == pytest.approx(2.0)
    assert costs.interpolate(table, 8) == pytest.approx(4.5)  # extrapolated with the last slope
    measured = {"prefill_rows": 8, "prefill": {"embed": 0.25, "core": 3.0, "head": 2.0},
                "by_rows": {"embed": {1: 0.1}, "core": {1: 1.0, 4: 1.0}, "head": {1: 0.5}}}
    rows = costs.ar_call_rows(loops=4, batch=1, prompt_len=8, new_tokens=3, head_has_kv=False)
    assert rows == {"embed": [8, 1, 1], "core": [8] * 4 + [1] * 8, "head": [1] * 3}
    expected = (0.25 + 2 * 0.1) + (4 * 3.0 + 8 * 1.0) + 3 * 0.5
    assert costs.predicted_seconds(measured, rows) == pytest.approx(expected)


def _timed_run(seconds: float, core_calls: int, accepted: int) -> dict:
    """A `run.run_mode` result of a lane mode whose run made `core_calls` core calls of one row (8 tokens)."""
    stats = types.SimpleNamespace(core_calls=core_calls, core_calls_per_token=core_calls / 8, drafted=8,
                                  acceptance_rate=accepted / 8, verified=8, accepted=accepted, rejected=8 - accepted,
                                  discarded=0, second_drafts=0, second_accepted=0)
    rows = {"embed": [1] * 8, "core": [1] * core_calls, "head": [1] * 8}
    return {"seconds": seconds, "stats": stats, "call_rows": rows, "peak_mem_bytes": 1, "kv_bytes": 1}


@pytest.mark.parametrize("compiled", [False, True])
def test_a_row_reports_counters_ideal_and_overhead_of_one_run_the_median_one(compiled):
    """Rounds that differ (auto's choices, sampling): the row's counters, ideal speed-up and overhead all come
    from the median-time run, never one round's calls over another round's time; a compiled row reports no
    overhead (the call costs are eager calls, which cannot split a compiled run's time)."""
    measured = {"prefill_rows": 8, "prefill": {"embed": 0.0, "core": 0.0, "head": 0.0},
                "by_rows": {"embed": {1: 0.0}, "core": {1: 0.1}, "head": {1: 0.0}}}
    runs = [_timed_run(1.0, 32, 0), _timed_run(5.0, 8, 8), _timed_run(2.0, 16, 4)]  # the median: 2.0 s, 16 calls
    seconds = {"ar": 4.0, "auto": 2.0}
    row = report.mode_row("auto", runs, seconds, batch=1, new_tokens=8, loops=4, check={}, exact=True,
                          costs=measured, ar_predicted=3.2, warmup_seconds=3.0, compiled=compiled)
    assert row["core_calls"] == 16 and row["accepted"] == 4 and row["acceptance_rate"] == 0.5
    assert row["predicted_seconds"] == pytest.approx(1.6) and row["ideal_speedup_vs_ar"] == pytest.approx(2.0)
    assert row["overhead_fraction"] == (None if compiled else pytest.approx(0.2))  # 1 - 1.6 / 2.0
    assert row["acceptance_rate_all"] == [0.0, 1.0, 0.5]
    assert report.median_run(runs[:2])["seconds"] == 1.0  # an even count: the faster middle run


def test_bench_plot_writes_a_png(all_modes, tmp_path):
    pytest.importorskip("matplotlib")
    plot.plot(all_modes[0], str(tmp_path / "bench.png"))
    assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"


# --- bench --do-sample ----------------------------------------------------------------------------------------------

SAMPLING = ["--do-sample", "--temperature", "0.8", "--top-p", "0.9", "--top-k", "20"]


def test_bench_do_sample_runs_every_mode_and_reports_not_comparable(tmp_path, capsys):
    path = tmp_path / "sample.json"
    assert cli.main(["bench", *FAST, *SAMPLING, "--json", str(path)]) == 0  # not a mismatch: exit status 0
    table = capsys.readouterr().out
    assert "SAMPLING (temperature 0.8, top_p 0.9, top_k 20)" in table and "MISMATCH" not in table
    result = json.loads(path.read_text())
    assert result["args"]["do_sample"] is True
    assert {k: result["args"][k] for k in ("temperature", "top_p", "top_k")} == {"temperature": 0.8, "top_p": 0.9,
                                                                               "top_k": 20}
    assert result["sampling"]["warpers"] == ["TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper"]
    assert result["sampling"]["temperature"] == 0.8 and result["all_checks_passed"] is True
    rows = {r["mode"]: r for r in result["rows"]}
    assert list(rows) == list(bench_args.MODES)
    for mode, row in rows.items():
        assert ROW_KEYS <= set(row) and row["tokens_per_s"] > 0
        assert row["check"]["exact"] is None and row["check"]["note"].startswith("sampling: not comparable")
        assert row["check_passed"] is None
        assert f"{mode:<9}" in table
    assert table.count("sampling: not comparable") == len(bench_args.MODES)
    assert rows["ar"]["drafted"] == 0 and rows["ar"]["ideal_speedup_vs_ar"] == pytest.approx(1.0)
    for mode in ("block", "pipeline"):
        row = rows[mode]
        assert row["drafted"] > 0
        assert row["accepted"] + row["rejected"] == row["verified"]
        assert row["drafted"] == row["verified"] + row["discarded"]
        assert row["acceptance_rate"] == pytest.approx(row["accepted"] / row["verified"])
        assert row["acceptance_rate_all"] == [row["acceptance_rate"]]
        assert row["ideal_speedup_vs_ar"] > 0 and row["core_calls"] > 0


def test_bench_sampled_runs_are_seeded_and_use_generates_warpers():
    """Same seed, same tokens and counters; and the bench's sampled pipeline run draws exactly the tokens of
    `model.generate` with the same settings and seed (the engine and the reference draw one seed's uniforms alike,
    `generation.rules`), which holds only if the bench's warpers are the ones generate builds, in its order."""
    model = shapes.random_model("ouro-tiny", seed=0)
    ids = prompts.make_prompts(None, model.config.vocab_size, 1, 8, seed=0)
    sampling = run.sampling_settings(bench_args.parse_args(SAMPLING))
    runs = {}
    with torch.inference_mode(), run.bench_generation_config(model, sampling):
        processors = run.generation_processors(model, 8, ids.device)
        assert [type(p).__name__ for p in processors] == ["TemperatureLogitsWarper", "TopKLogitsWarper",
                                                           "TopPLogitsWarper"]
        for mode in ("plain", "ar", "pipeline", "pipeline"):
            result = run.run_mode(model, mode, ids, 12, draft_loops=1, k=4, processors=processors, seed=5,
                                  engine="reference" if mode == "ar" else "wavefront")
            if mode in runs:
                assert torch.equal(result["generated"], runs[mode]["generated"])
                assert result["stats"].to_dict() == runs[mode]["stats"].to_dict()
            runs[mode] = result
    torch.manual_seed(5)
    with torch.inference_mode():
        own = model.generate(ids, max_new_tokens=12, do_sample=True, temperature=0.8, top_p=0.9, top_k=20,
                             speculative_mode="pipeline", draft_loops=1, pad_token_id=0)
    assert torch.equal(runs["pipeline"]["generated"], own[:, ids.shape[1]:])
    with run.bench_generation_config(model, {"temperature": 1.0, "top_p": 1.0, "top_k": 0}):
        assert not run.generation_processors(model, 8, ids.device)  # all off: no warpers


def test_bench_leaves_the_callers_generation_config_alone():
    """The bench runs on its own clean config (no EOS, none of a checkpoint's defaults) and puts the caller's
    object back untouched, even when a run fails."""
    model = shapes.random_model("ouro-tiny", seed=0)
    mine = model.generation_config
    mine.repetition_penalty = 1.3
    before = mine.to_dict()
    with run.bench_generation_config(model, None):
        assert model.generation_config is not mine and model.generation_config.eos_token_id is None
        assert model.generation_config.repetition_penalty is None
    assert model.generation_config is mine and mine.to_dict() == before
    with pytest.raises(RuntimeError), run.bench_generation_config(model, None):
        raise RuntimeError("a failed run")
    assert model.generation_config is mine


@pytest.mark.parametrize("given, message", [
    ({"repeats": 0}, r"repeats=0: 0 must be >= 1"),  # (an IndexError after the runs)
    ({"new_tokens": 2.5}, r"new_tokens=2\.5: '2\.5' is not an integer"),
    ({"dtype": "fp16"}, r"dtype='fp16': choose one of bfloat16, float16, float32"),  # (a KeyError)
    ({"top_p": 2.0, "do_sample": True}, r"top_p=2\.0: 2\.0 is outside \[0, 1\]"),  # (ran)
    ({"quiet": "no"}, r"quiet='no': expected True or False"),
    ({"modes": ["plain", "tree"]}, r"modes=\['plain', 'tree'\]: unknown mode"),
    ({"new_tokenz": 4}, r"new_tokenz=4 is not an option of the bench; use one of .*new_tokens"),  # (ignored)
    ({"modes": ["plain", 1]}, r"modes=\['plain', 1\]: expected what --modes takes"),  # (a bare TypeError)
    ({"repeats": ["3"]}, r"repeats=\['3'\]: expected what --repeats takes"),
    ({"modes": "plain", "draft_loops": 3}, r"--draft-loops 3: none of --modes plain reads it"),  # (ran)
])
def test_a_namespace_built_in_code_is_checked_as_the_command_line_is(given, message):
    """The notebook builds `run_bench`'s arguments as an `argparse.Namespace`: each value is checked as its option's
    text would be, and a name that is no option is refused, before the model loads."""
    with pytest.raises(ValueError, match=message):
        run_bench(argparse.Namespace(model="no-such-model", **given))
    args = bench_args.with_defaults(argparse.Namespace(modes=("plain", "block"), new_tokens=np.int64(5),
                                                       json=Path("b.json"), quiet=True, device=torch.device("cpu")))
    assert (args.modes, args.new_tokens, args.json, args.quiet) == (["plain", "block"], 5, Path("b.json"), True)
    assert args.device == torch.device("cpu")
    defaults = vars(bench_args.parse_args([]))  # None is "not given" (a None seed crashed in torch, after the load)
    none = bench_args.with_defaults(argparse.Namespace(**dict.fromkeys(("seed", "repeats", "modes", "dtype",
                                                                        "threads", "draft_loops"))))
    assert all(getattr(none, key) == defaults[key] for key in ("seed", "repeats", "modes", "dtype", "threads",
                                                               "draft_loops"))
    assert not hasattr(none, "speculative_given")


def test_bench_refuses_sampling_options_that_would_not_apply(capsys):
    assert "greedy decoding ignores: --temperature 0.7;" in _run_error(["bench", *FAST, "--temperature", "0.7"], capsys)
    args = bench_args.parse_args(FAST)
    args.do_sample, args.synthetic_acceptance = True, 0.9  # (argparse refuses this; run_bench does too)
    with pytest.raises(ValueError, match="cannot be combined with --do-sample"):
        run_bench(args)


# --- generate -------------------------------------------------------------------------------------------------------


def test_generate_streams_the_same_text_in_every_mode(checkpoint, capsys):
    texts = {}
    for mode in ("plain", "block", "pipeline"):
        argv = ["generate", "w5 w9 w17 w4", "--model", str(checkpoint), "--mode", mode, "--max-new-tokens", "6",
                "--device", "cpu"]
        assert cli.main(argv) == 0
        out, err = capsys.readouterr()
        texts[mode] = out
        assert f"[{mode}]" in err and "new tokens in" in err
        if mode != "plain":
            assert "core calls" in err and "accepted" in err
    assert texts["plain"].strip() and texts["plain"] == texts["block"] == texts["pipeline"]


def test_generate_repetition_penalty_is_applied_and_lossless(checkpoint, capsys):
    """`--repetition-penalty` reaches generate: plain CLI text is transformers' own plain decoding with the
    penalty (the oracle), and the speculative modes print the same text."""
    model = loading.load_model(str(checkpoint), torch.float32, torch.device("cpu"), need_tokenizer=True)[0]
    tokenizer = PreTrainedTokenizerFast.from_pretrained(checkpoint)
    prompt = "w5 w9 w5 w9"
    ids = torch.tensor([tokenizer(prompt)["input_ids"]])
    with torch.no_grad():
        oracle = model.generate(input_ids=ids, max_new_tokens=8, do_sample=False, repetition_penalty=3.0,
                                speculative_mode=None)
    expected = tokenizer.decode(oracle[0, ids.shape[1]:], skip_special_tokens=True)
    for mode in ("plain", "block", "pipeline"):
        argv = ["generate", prompt, "--model", str(checkpoint), "--mode", mode, "--max-new-tokens", "8",
                "--device", "cpu", "--repetition-penalty", "3.0"]
        assert cli.main(argv) == 0
        assert capsys.readouterr().out.strip() == expected.strip()


# --- bad input ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv, message", [
    (["generate", "x", "--mode", "fast"], "invalid choice"),
    (["generate"], "required"),
    (["generate", "x", "--draft-loops", "0"], "must be >= 1"),
    (["generate", "x", "--repetition-penalty", "0"], "must be > 0"),
    (["bench", "--modes", "plain,turbo"], "unknown mode"),
    (["bench", "--synthetic-acceptance", "1.5"], "outside [0, 1]"),
    (["bench", "--do-sample", "--synthetic-acceptance", "0.9"], "--synthetic-acceptance cannot be combined with "
                                                                 "--do-sample"),
    (["bench", "--synthetic-acceptance", "0.9", "--do-sample"], "--synthetic-acceptance cannot be combined with "
                                                                 "--do-sample"),
    (["bench", "--do-sample", "--temperature", "0"], "must be > 0"),
    (["bench", "--do-sample", "--top-k", "-1"], "must be >= 0"),
    (["bench", "--do-sample", "--top-p", "1.5"], "outside [0, 1]"),
    (["bench", "--dtype", "float64"], "invalid choice"),
    (["frobnicate"], "invalid choice"),
])
def test_bad_arguments_exit_2_with_a_message(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--modes", "plain,ar", "--synthetic-acceptance", "0.5"], "--synthetic-acceptance 0.5: none of --modes plain,ar"),
    (["--modes", "plain,pipeline", "--num-speculative-tokens", "8"], "--num-speculative-tokens 8: none of --modes"),
    (["--modes", "plain,ar", "--draft-loops", "2"], "--draft-loops 2: none of --modes plain,ar reads it"),
    (["--modes", "plain", "--engines", "reference"], "--engines reference: none of --modes plain"),
    (["--modes", "plain,static", "--compile", "eager"], "--compile eager: none of --modes plain,static"),
])
def test_bench_refuses_options_no_mode_reads(argv, message, capsys):
    """An option that none of the modes reads was printed in the header (and banners) and changed nothing."""
    assert cli.main(["bench", *FAST, *argv]) == 2
    assert message in capsys.readouterr().err
    run_bench(bench_args.parse_args([*FAST, "--modes", "plain,block", "--num-speculative-tokens", "3"]))  # read


@pytest.mark.parametrize("argv, message", [
    (["--plot", "chart.txt"], "--plot chart.txt: matplotlib cannot write .txt files; pass a path ending in one of"),
    (["--plot", "chart.pgf"], "--plot chart.pgf: matplotlib cannot write .pgf files"),  # (only with LaTeX)
    (["--json="], "--json is empty: pass a file path, or leave --json out."),
    (["--prompt-file="], "--prompt-file is empty"),
    (["--modes", "plain", "--second-draft-loops", "2"], "--second-draft-loops 2 adds a pipeline run: include pipeline"),
    (["--modes", "pipeline", "--compile", "--engines", "wavefront,reference"], "the reference runs eagerly"),
    (["--modes", "plain", "--prompt-file", __file__], "ouro-tiny is a random-weight shape and has no tokenizer"),
])
def test_options_that_cannot_work_are_refused_before_the_model_loads(argv, message, monkeypatch, capsys):
    """Each was refused after the model was built (a minute for a large shape), or, for --plot's format, after the
    whole run, whose results the failed write lost; an empty --json wrote nothing without a word."""
    monkeypatch.setattr(main_module, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    assert cli.main(["bench", *FAST, *argv]) == 2
    assert message in capsys.readouterr().err


def test_quiet_silences_the_checkpoints_loading_bar_and_cpu_static_has_no_compile_time(checkpoint, capsys):
    """--quiet: nothing on stderr, transformers' "Loading weights" bar included; `static` compiles on CUDA only, so
    on a CPU its row has no compile time (its warm-up minus timed run was reported as one, negative at times)."""
    argv = ["--model", str(checkpoint), *FAST[2:], "--modes", "plain,static"]
    result = run_bench(bench_args.parse_args(argv))
    assert capsys.readouterr().err == ""
    assert [row["compile_seconds"] for row in result["rows"]] == [None, None]


def test_bench_checks_plains_timed_runs_and_an_auto_run_with_plain_segments_has_no_ideal(monkeypatch):
    """plain's timed runs are compared with its reference run too (a wrong one passed as "reference"); an auto run
    that decoded plain segments (transformers' loop, outside the engine's cost model) has no ideal or overhead."""
    runs, original = [], run.run_mode

    def second_plain_wrong(model, mode, *args, **kwargs):
        result = original(model, mode, *args, **kwargs)
        if mode == "plain":
            runs.append(mode)
            if len(runs) > 1:  # every plain run after the untimed reference
                result["generated"] = result["generated"].clone()
                result["generated"][0, -1] = (result["generated"][0, -1] + 1) % 64
        return result

    monkeypatch.setattr(main_module, "run_mode", second_plain_wrong)
    result = run_bench(bench_args.parse_args([*FAST, "--modes", "plain,ar"]))
    plain = result["rows"][0]
    assert plain["check_passed"] is False and not result["all_checks_passed"]
    assert plain["check"]["first_divergence"] is not None
    measured = {"prefill_rows": 8, "prefill": {"embed": 0.0, "core": 0.0, "head": 0.0},
                "by_rows": {"embed": {1: 0.0}, "core": {1: 0.1}, "head": {1: 0.0}}}
    auto = _timed_run(2.0, 16, 4)
    auto["stats"].plain_tokens = 3  # (the other rounds' counters: `test_a_row_reports_...`)
    row = report.mode_row("auto", [auto], {"ar": 4.0, "auto": 2.0}, batch=1, new_tokens=8, loops=4, check={},
                          exact=True, costs=measured, ar_predicted=3.2, warmup_seconds=3.0, compiled=False)
    assert row["core_calls"] == 16 and row["ideal_speedup_vs_ar"] is row["overhead_fraction"] is None
    assert row["fraction_of_ideal"] is None and row["predicted_seconds"] is None


def _run_error(argv, capsys) -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]  # (after transformers' weight-loading progress bar, if any)
    assert last.startswith("hf-loopspec ") and "error:" in last and "Traceback" not in err
    return last


def test_invalid_speculative_settings_are_clear_errors(checkpoint, capsys):
    base = ["generate", "w5 w6", "--model", str(checkpoint), "--device", "cpu", "--max-new-tokens", "3"]
    # (the advice names the options: it named generate's keywords)
    assert "multiple of --draft-loops=3; use --draft-loops in [1, 2] or --mode block" in \
        _run_error([*base, "--mode", "pipeline", "--draft-loops", "3"], capsys)
    assert "outside [1, 3]" in _run_error([*base, "--mode", "block", "--draft-loops", "4"], capsys)
    assert "outside [1, 3]" in _run_error(["bench", *FAST, "--draft-loops", "5"], capsys)
    # bench names its own options (--modes, --second-draft-loops, whose absence is None): it named generate's keywords
    assert ("--modes pipeline needs the loop count (4) to be a multiple of --draft-loops=3; use --draft-loops in "
            "[1, 2] or --modes block.") in _run_error(["bench", *FAST, "--modes", "pipeline", "--draft-loops", "3"],
                                                       capsys)
    assert ("--second-draft-loops=4 must lie strictly between --draft-loops=1 and the loop count 4 (a deeper draft "
            "than the first, shallower than the target); pass one of [3] or drop --second-draft-loops.") in \
        _run_error(["bench", *FAST, "--modes", "pipeline", "--second-draft-loops", "4"], capsys)
    assert ("pass --second-draft-loops in [3] or drop --second-draft-loops (--engines reference runs the others)."
            ) in _run_error(["bench", *FAST, "--modes", "pipeline", "--second-draft-loops", "2"], capsys)
    assert "error: --compile no-such-backend: pass a torch.compile backend name usable here (one of " in \
        _run_error(["bench", *FAST, "--compile", "no-such-backend"], capsys)
    with pytest.raises(argparse.ArgumentTypeError, match="'lanes' is now 'reference'"):
        bench_args.parse_engines("lanes")
    assert "the reference runs eagerly" in _run_error(["bench", *FAST, "--engines", "reference", "--compile", "eager"],
                                                      capsys)


@pytest.mark.parametrize("mode", ["plain", "block", "pipeline"])
def test_generate_samples_in_every_mode_and_prints_the_acceptance(mode, checkpoint, capsys):
    argv = ["generate", "w5 w6", "--model", str(checkpoint), "--device", "cpu", "--max-new-tokens", "6", "--mode",
            mode, "--do-sample", "--temperature", "0.7", "--top-k", "20", "--top-p", "0.9", "--seed", "0"]
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    assert out.strip() and f"[{mode}] 6 new tokens" in err and "warning: --seed" not in err
    if mode != "plain":
        assert "drafts accepted" in err and "verified (" in err and "min(1, p/q)" in err
    assert cli.main(argv) == 0 and capsys.readouterr().out == out  # --seed: the same text again


@pytest.mark.parametrize("command", ["generate", "batch"])
def test_seed_with_sampling_in_auto_mode_warns_that_it_is_not_reproducible(command, tmp_path, capsys):
    """Auto decodes plainly or speculatively as timings and stored acceptance suggest, and the two draw different
    random numbers: `--seed` cannot make its samples repeat, and the command says so before anything loads (here
    the missing model then ends the run)."""
    inputs = ["w5 w6"] if command == "generate" else [str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "o.jsonl")]
    argv = [command, *inputs, "--model", str(tmp_path / "nowhere"), "--device", "cpu", "--do-sample", "--seed", "0"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("warning: --seed does not make --mode auto's samples reproducible") and "--mode plain" in err
    assert cli.main([*argv, "--mode", "pipeline"]) == 2
    assert "warning" not in capsys.readouterr().err


def test_missing_models_are_clear_errors(tmp_path, capsys):
    assert "random-weight shape" in _run_error(["generate", "hi", "--model", "ouro-tiny", "--device", "cpu"], capsys)
    _run_error(["generate", "hi", "--model", str(tmp_path / "nowhere"), "--device", "cpu"], capsys)
    try:
        loading.default_model_path()
    except loading.ModelNotAvailable:
        err = _run_error(["generate", "hi", "--device", "cpu"], capsys)
        assert "embedded default model" in err and "--model" in err


# --- packaging ------------------------------------------------------------------------------------------------------


def test_console_script_and_gpu_script_are_wired():
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert '\n[project.scripts]\nhf-loopspec = "hf_loopspec_cli:main"\n' in pyproject
    assert 'py-modules = ["hf_loopspec_cli"]' in pyproject
    assert 'bench = ["matplotlib", "tqdm"]' in pyproject
    for script in ("bench_gpu.sh", "gpu_check.sh"):
        assert subprocess.run(["bash", "-n", str(ROOT / "scripts" / script)], check=False,
                              capture_output=True).returncode == 0
