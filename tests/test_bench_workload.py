"""The ragged-workload benchmark (`scripts/bench_workload.py`, `hf_loopspec.bench.workload*`): its workload, its
static and continuous serving against plain `generate` of each request alone, its statistics against numpy, its
one-line argument errors, and a tiny run of the whole bench (what the script runs)."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy
import pytest
import torch

from hf_loopspec.bench import workload, workload_main
from hf_loopspec.bench.run import bench_generation_config, run_mode
from hf_loopspec.bench.shapes import random_model
from hf_loopspec.bench.workload import Served, make_workload, run_continuous, run_static
from hf_loopspec.defaults import CPUS

VOCAB = 256  # ouro-tiny's


@pytest.fixture(scope="module")
def model():
    model = random_model("ouro-tiny", seed=3)
    with bench_generation_config(model, None):  # no EOS: every request runs exactly its own length
        yield model


def alone(model, request) -> list[int]:
    """Plain greedy `generate` of one request, unpadded (the reference)."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([request.prompt]), max_new_tokens=request.new_tokens,
                             speculative_mode=None)
    return out[0, len(request.prompt):].tolist()


def test_workload_is_seeded_ragged_and_the_same_requests_under_either_arrivals():
    burst = make_workload(40, (3, 9), (2, 7), VOCAB, seed=5)
    poisson = make_workload(40, (3, 9), (2, 7), VOCAB, seed=5, rate=100.0)
    assert burst == make_workload(40, (3, 9), (2, 7), VOCAB, seed=5)
    assert [(r.prompt, r.new_tokens) for r in burst] == [(r.prompt, r.new_tokens) for r in poisson]
    assert {len(r.prompt) for r in burst} == set(range(3, 10)) and {r.new_tokens for r in burst} == set(range(2, 8))
    assert all(3 <= t < VOCAB for r in burst for t in r.prompt)
    assert all(r.arrival == 0 for r in burst)
    arrivals = [r.arrival for r in poisson]
    assert arrivals[0] == 0 and all(b > a for a, b in zip(arrivals, arrivals[1:]))


@pytest.mark.parametrize("mode", ["plain", "pipeline"])
def test_static_batches_serve_each_request_as_plain_generate_alone(model, mode):
    requests = make_workload(5, (2, 7), (2, 6), VOCAB, seed=1, rate=200.0)
    reference = {r.index: alone(model, r) for r in requests}
    served = run_static(model, requests, 2, mode, 1, reference=reference, acceptance=0.7)
    assert served.outputs == reference and served.mode == mode
    assert all(served.finished[r.index] >= r.arrival for r in requests)
    assert served.seconds == max(served.finished.values())


@pytest.mark.parametrize("mode", ["plain", "pipeline"])
def test_continuous_batching_serves_each_request_as_plain_generate_alone(model, mode):
    requests = make_workload(5, (2, 7), (2, 6), VOCAB, seed=2, rate=200.0)
    reference = {r.index: alone(model, r) for r in requests}
    config = workload_main.manager_config(model, mode, 1)
    served = run_continuous(model, requests, 2, config, reference=reference, acceptance=0.7, timeout=120)
    assert served.outputs == reference
    assert served.mode == ("ar" if mode == "plain" else "pipeline")  # the manager decodes what the row names


def test_a_static_batch_drafts_its_shorter_requests_on_to_its_longest():
    # generate runs every row of a batch to its longest; a real model keeps drafting there, so the synthetic drafts
    # of a shorter request go on (at acceptance 1: its known greedy tokens) as far as the reference goes. Positions
    # are each request's own (the engines count them from the first real token; left padding is not one)
    short = replace(make_workload(1, (2, 2), (2, 2), VOCAB, seed=1)[0], index=0)
    long = replace(make_workload(1, (4, 4), (5, 5), VOCAB, seed=2)[0], index=1)
    known = {0: [11, 12, 13, 14, 15], 1: [21, 22, 23, 24, 25]}
    hook = workload._batch_hook([short, long], known, 1.0, VOCAB, seed=0)
    assert [hook(0, p, -1) for p in range(2, 7)] == known[0] and [hook(1, p, -1) for p in range(4, 9)] == known[1]
    assert hook(0, 1, 7) == 7 and hook(0, 7, 7) == 7  # the prompt and past the reference: the model's own draft
    assert workload.request_override(short, known, 1.0, VOCAB, 0) == [-1] * 2 + known[0][:2]  # alone: its own


def test_every_synthetic_draft_of_a_padded_static_batch_is_right_at_acceptance_one(model):
    # the drafts land on the positions the engine drafts (a misaligned pattern would be rejected, silently slow)
    requests = make_workload(3, (2, 7), (3, 6), VOCAB, seed=6)
    longest = max(r.new_tokens for r in requests)
    known = {r.index: alone(model, replace(r, new_tokens=longest)) for r in requests}
    width = max(len(r.prompt) for r in requests)
    ids = torch.tensor([[0] * (width - len(r.prompt)) + r.prompt for r in requests])
    mask = torch.tensor([[0] * (width - len(r.prompt)) + [1] * len(r.prompt) for r in requests])
    with torch.inference_mode():
        result = run_mode(model, "pipeline", ids, longest, draft_loops=1, k=4, attention_mask=mask,
                          draft_hook=workload._batch_hook(requests, known, 1.0, VOCAB, seed=0))
    assert result["generated"].tolist() == [known[r.index] for r in requests]
    assert result["stats"].rejected == 0 and result["stats"].accepted > 0


def test_throughput_and_latency_percentiles_match_numpy():
    requests = make_workload(7, (2, 3), (2, 9), VOCAB, seed=4, rate=10.0)
    finished = {r.index: r.arrival + 0.1 * (r.index % 3 + 1) for r in requests}
    served = Served({}, finished, max(finished.values()))
    measured = workload_main.measure(served, requests)
    latency = [finished[r.index] - r.arrival for r in requests]
    assert measured["p50_latency_s"] == pytest.approx(numpy.percentile(latency, 50))
    assert measured["p95_latency_s"] == pytest.approx(numpy.percentile(latency, 95))
    assert measured["tokens_per_s"] == pytest.approx(sum(r.new_tokens for r in requests) / served.seconds)


@pytest.mark.parametrize(("argv", "message"), [
    (["--prompt-lens", "0-5"], "--prompt-lens: '0-5' is not a range LO-HI"),
    (["--new-tokens", "9-3"], "--new-tokens: '9-3' is not a range LO-HI"),
    (["--new-tokens", "many"], "--new-tokens: 'many' is not a range LO-HI"),
    (["--engines", "plain,fast"], "--engines: 'plain,fast': choose a comma-separated subset of plain,pipeline"),
    (["--synthetic-acceptance", "1.5"], "--synthetic-acceptance: 1.5 is outside [0, 1]"),
    (["--seed", str(2**80)], "--seed: 1208925819614629174706176 is outside [0, 2**63)"),  # (was a torch overflow)
    (["--threads", str(CPUS + 1)], f"--threads: {CPUS + 1} is outside [1, {CPUS}]"),  # (as bench's: was taken)
    (["--model", "ouro-tiny", "--device", "cpu", "--engines", "plain", "--synthetic-acceptance", "0.9"],
     "--synthetic-acceptance 0.9 replaces pipeline drafts"),
    (["--model", "/no/such/folder", "--device", "cpu"], "no such folder: /no/such/folder"),
    # checked before the run (its results were lost to a traceback at its end)
    (["--model", "ouro-tiny", "--device", "cpu", "--json", "/etc/hostname/ragged.json"], "--json"),
])
def test_bad_arguments_are_one_line_exit_2(capsys, argv, message):
    with pytest.raises(SystemExit) as done:
        workload_main.main(argv)
    out, err = capsys.readouterr()
    assert done.value.code == 2 and out == "" and len(err.splitlines()) == 1, err
    assert err.startswith("bench_workload.py: error: ") and message in err, err


def test_a_huginn_shape_runs_from_zero_initial_states_and_matches(tmp_path):
    """A Huginn shape (listed by --model) failed in its pipeline warm-up (random initial states need a seed) and,
    with continuous batching, reported every row as differing (the reference itself was random): it runs from zero
    initial states, as `hf-loopspec bench` does, and every row equals the plain reference."""
    path = tmp_path / "huginn.json"
    argv = ["--model", "huginn-tiny", "--device", "cpu", "--requests", "3", "--prompt-lens", "1-5", "--new-tokens",
            "1-4", "--slots", "2", "--arrivals", "burst", "--rounds", "1", "--json", str(path), "--quiet"]
    assert workload_main.main(argv) == 0
    result = json.loads(path.read_text())
    assert result["all_checks_passed"] is True and len(result["rows"]) == 4


def test_the_bench_runs_every_row_and_checks_it(tmp_path, capsys):
    """The whole bench (both batchings, inside its inference mode), tiny; its progress log on stderr holds each timed
    run's throughput as it ends (what a run stopped at a time limit still reports)."""
    path = tmp_path / "ragged.json"
    argv = ["--model", "ouro-tiny", "--device", "cpu", "--requests", "4", "--prompt-lens", "2-6", "--new-tokens", "2-5",
            "--slots", "2", "--arrival-rate", "100", "--rounds", "2", "--synthetic-acceptance", "0.9", "--json",
            str(path)]
    assert workload_main.main(argv) == 0
    result = json.loads(path.read_text())
    rows = {(row["engine"], row["batching"], row["arrivals"]): row for row in result["rows"]}
    assert set(rows) == {(e, b, a) for e in ("plain", "pipeline") for b in ("static", "continuous")
                         for a in ("burst", "poisson")}
    assert result["all_checks_passed"] is True and all(len(row["rounds"]) == 2 for row in rows.values())
    for row in rows.values():
        assert row["tokens_per_s"] == pytest.approx(numpy.median([m["tokens_per_s"] for m in row["rounds"]]))
        assert 0 < row["p50_latency_s"] <= row["p95_latency_s"]
    out, err = capsys.readouterr()
    assert len(out.splitlines()) == 1 + len(rows)
    for (engine, batching, arrivals), row in rows.items():
        for r, measured in enumerate(row["rounds"], start=1):
            assert f"[workload] round {r} {engine} {batching} {arrivals}: {measured['tokens_per_s']:.1f} tok/s\n" in err
