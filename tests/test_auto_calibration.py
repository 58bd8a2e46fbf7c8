"""Auto's cost table: measured cheaply (`auto_calibration.measure_costs`), kept in the process and stored on disk
across processes (`auto_cache`), keyed by what changes costs.

A fresh process is imitated by dropping the in-process table (`set_costs(model, None)`); what is timed is counted by
wrapping the measuring functions. Every test stores its tables under its own `tmp_path` (`HF_LOOPSPEC_CACHE`).
"""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
from speculative_utils import tiny_spec_model

from hf_loopspec.generation import auto_cache, auto_calibration
from hf_loopspec.generation.auto import candidates
from hf_loopspec.generation.auto_calibration import ROUNDS, costs_for, decode, encode
from hf_loopspec.generation.auto_costs import Candidate, CostTable, set_costs

PIPE1, PIPE2, BLOCK1, BLOCK3 = (Candidate("pipeline", 1), Candidate("pipeline", 2), Candidate("block", 1, 4),
                                Candidate("block", 3, 4))


@pytest.fixture(scope="module")
def model():
    return tiny_spec_model(2)


@pytest.fixture
def counted(model, tmp_path, monkeypatch):
    """The cache under `tmp_path`, no table in the process; returns the lists of the measuring calls made: whole
    measurements (`measure_costs`, by batch size), timed plain runs (`_plain_run`) and timed engine runs
    (`_cycle_seconds`, by candidate)."""
    monkeypatch.setenv(auto_cache.CACHE_ENV, str(tmp_path))
    set_costs(model, None)
    calls = {"measure": [], "plain": [], "cycle": []}
    measure, plain, cycle = (auto_calibration.measure_costs, auto_calibration._plain_run,
                             auto_calibration._cycle_seconds)

    def counted_measure(*args):
        calls["measure"].append(args[1])
        return measure(*args)

    def counted_plain(model, ids):
        calls["plain"].append(len(ids))
        return plain(model, ids)

    def counted_cycle(model, ids, candidate, reference):
        calls["cycle"].append(candidate)
        return cycle(model, ids, candidate, reference)

    monkeypatch.setattr(auto_calibration, "measure_costs", counted_measure)
    monkeypatch.setattr(auto_calibration, "_plain_run", counted_plain)
    monkeypatch.setattr(auto_calibration, "_cycle_seconds", counted_cycle)
    yield calls
    set_costs(model, None)


def stored_files(tmp_path):
    return sorted((tmp_path / "costs").glob("*.json"))


def test_an_engine_cycle_costs_its_periodic_long_intervals_too(model, monkeypatch):
    """The engine's host work comes in periods (a read-back every few cycles): a clock whose every fourth interval
    is 9 ms and the others 1 ms costs a cycle 3 ms over whole periods, and at least 1 + 8 floor(n / 4) / n ms over
    any n >= 4 consecutive intervals (2.1 ms at worst, n = 7). Leaving out the long ones as another process's
    spikes gave 1 ms: speculation looked three times cheaper than it ran."""
    ticks = iter(range(10**6))

    def clock(device):
        n = next(ticks)
        return (n + 8 * (n // 4)) * 1e-3  # interval k (from tick k to k + 1): 9 ms when k % 4 == 3, else 1 ms

    monkeypatch.setattr(auto_calibration, "_now", clock)
    ids = torch.randint(1, model.config.vocab_size, (1, auto_calibration.PROBE_PROMPT), generator=torch.Generator()
                        .manual_seed(0))
    reference = model.generate(ids, max_new_tokens=auto_calibration.PROBE_TOKENS, do_sample=False,
                               eos_token_id=None, speculative_mode=None)
    seconds = auto_calibration._cycle_seconds(model, ids, PIPE1, reference)
    assert 2.1e-3 <= seconds <= 9e-3


def test_the_plain_probe_runs_past_the_models_eos_and_stop_strings(model, monkeypatch):
    """The probe decodes `PROBE_TOKENS` tokens whatever the model's generation config says: its stop strings (which
    need a tokenizer the probe has none of: every auto call of such a model failed) and its EOS were filled into
    the probe's config by transformers."""
    ids = torch.randint(1, model.config.vocab_size, (1, auto_calibration.PROBE_PROMPT), generator=torch.Generator()
                        .manual_seed(3))
    first = model.generate(ids, max_new_tokens=1, do_sample=False, eos_token_id=None)[0, -1].item()
    monkeypatch.setattr(model.generation_config, "eos_token_id", first)  # would stop the probe at once
    monkeypatch.setattr(model.generation_config, "stop_strings", ["x"])
    out, step = auto_calibration._plain_run(model, ids)
    assert out.shape == (1, ids.shape[1] + auto_calibration.PROBE_TOKENS) and step > 0


def test_a_lone_spike_in_the_engine_cycles_is_left_out():
    """One interval far over the others is another process's time slice, left out; periodic long intervals (two or
    more in a run) are the engine's own and stay (the run above)."""
    assert auto_calibration.cycle_mean([1.0] * 9 + [40.0]) == 1.0
    assert auto_calibration.cycle_mean([1.0, 1.0, 1.0, 9.0] * 3) == 3.0
    assert auto_calibration.cycle_mean([2.0, 5.0]) == 3.5  # too few to tell: every interval


def test_a_fresh_process_reads_the_stored_table(model, counted, tmp_path):
    """The first call measures and stores one file; with the process's table dropped, the next reads it and times
    nothing; the table survives the round trip exactly."""
    options = candidates(model.num_loops, None, None)
    first = costs_for(model, 1, options)
    assert counted["measure"] == [1] and len(stored_files(tmp_path)) == 1
    set_costs(model, None)
    second = costs_for(model, 1, options)
    assert counted["measure"] == [1] and counted["plain"] == [1] * ROUNDS and len(counted["cycle"]) == ROUNDS
    assert second == first and second.adapt
    assert decode(encode(first)) == first


def test_each_cost_is_its_fastest_rounds_and_the_rounds_interleave(model, monkeypatch):
    """Plain and each timed candidate run in turn, `ROUNDS` times, and each cost is its fastest round's: a round
    slowed by another process (the first plain run here, 3x) was stored for every later process, and the choice
    followed it."""
    assert ROUNDS >= 2
    runs, plain_seconds, cycle_seconds = [], iter([0.03, 0.01, 0.02] * ROUNDS), iter([0.005, 0.004, 0.009] * ROUNDS)
    reference = torch.zeros(1, 1, dtype=torch.long)

    def plain(model, ids):
        runs.append("plain")
        return reference, next(plain_seconds)

    def cycle(model, ids, candidate, given):
        assert given is reference  # (each engine run's drafts come from plain decoding's tokens)
        runs.append(candidate.name)
        return next(cycle_seconds)

    monkeypatch.setattr(auto_calibration, "_plain_run", plain)
    monkeypatch.setattr(auto_calibration, "_cycle_seconds", cycle)
    table = auto_calibration.measure_costs(model, 1, [Candidate(None), PIPE1, PIPE2, BLOCK3])
    assert runs == ["plain", "pipeline(d=1)"] * ROUNDS
    assert table.plain_step == min([0.03, 0.01, 0.02][:ROUNDS])
    assert table.cycle == dict.fromkeys((PIPE1, PIPE2, BLOCK3), min([0.005, 0.004, 0.009][:ROUNDS]))


def test_one_engine_run_times_every_candidate(model, counted):
    """Only the shallowest pipeline is timed: the deeper pipeline and block take its cycle cost; block alone (a depth
    no pipeline fits, U % d != 0) is timed itself."""
    table = costs_for(model, 1, [Candidate(None), PIPE1, PIPE2, BLOCK1])
    assert counted["cycle"] == [PIPE1] * ROUNDS
    assert table.plain_step > 0 and table.cycle[PIPE1] > 0
    assert table.cycle[PIPE2] == table.cycle[BLOCK1] == table.cycle[PIPE1]
    assert costs_for(model, 1, [Candidate(None), BLOCK3]).cycle[BLOCK3] == table.cycle[PIPE1]  # covered by d=1
    set_costs(model, None)
    costs_for(model, 2, [Candidate(None), BLOCK3])
    assert counted["cycle"] == [PIPE1] * ROUNDS + [BLOCK3] * ROUNDS


def test_another_key_measures_again(model, counted, tmp_path, monkeypatch):
    """Another batch size or thread count is another key (another file); a file at the right path that was stored
    under another key is ignored."""
    options = [Candidate(None), PIPE1]
    costs_for(model, 1, options)
    set_costs(model, None)
    costs_for(model, 2, options)
    assert counted["measure"] == [1, 2] and len(stored_files(tmp_path)) == 2
    set_costs(model, None)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 7)
    costs_for(model, 1, options)
    assert counted["measure"] == [1, 2, 1] and len(stored_files(tmp_path)) == 3
    key = auto_cache.cost_key(model, 1)
    path = auto_cache._path(key)
    stored = json.loads(path.read_text())
    path.write_text(json.dumps({**stored, "key": {**key, "batch": 5}}))
    assert auto_cache.load(key) is None


@pytest.mark.parametrize("content", ["{not json", json.dumps({"key": "x", "table": []}), "",
                                     pytest.param("[" * 100_000, id="nested")])  # (deeper than the parser recurses)
def test_a_corrupt_file_is_measured_over(model, counted, tmp_path, content):
    """An unreadable or malformed stored table is ignored: the call measures and stores a readable one."""
    options = [Candidate(None), PIPE1]
    path = auto_cache._path(auto_cache.cost_key(model, 1))
    path.parent.mkdir(parents=True)
    path.write_text(content)
    table = costs_for(model, 1, options)
    assert counted["measure"] == [1]
    assert decode(auto_cache.load(auto_cache.cost_key(model, 1))) == table
    assert decode({"plain_step": 1.0, "cycle": [["pipeline", "x", None, 1.0]]}) is None
    # readable JSON that no measurement makes: an Infinity depth, a 400-digit cost (OverflowError before)
    assert decode({"plain_step": 1.0, "cycle": [["pipeline", float("inf"), None, 1.0]]}) is None
    assert decode({"plain_step": 10**400, "cycle": [["pipeline", 1, None, 1.0]]}) is None


def test_a_fifo_at_a_tables_path_is_no_table(tmp_path, monkeypatch):
    """A FIFO (or a device) where a table would be blocked every auto call for ever in the read."""
    monkeypatch.setenv(auto_cache.CACHE_ENV, str(tmp_path))
    key = {"format": auto_cache.FORMAT, "test": "fifo"}
    path = auto_cache._path(key)
    path.parent.mkdir(parents=True)
    os.mkfifo(path)
    assert auto_cache.load(key) is None  # (at once: nobody writes to the FIFO)


@pytest.mark.parametrize("plain_step, cycle_seconds", [(0.0, 1.0), (1.0, 0.0), (-1.0, 1.0), (float("nan"), 1.0),
                                                       (1.0, float("inf"))])
def test_a_stored_table_with_a_cost_that_is_no_time_is_measured_over(model, counted, plain_step, cycle_seconds):
    """A readable table whose plain step or cycle costs no positive, finite time is damaged too: it is measured
    over (a stored `plain_step` of 0 was trusted, and every later auto call raised ZeroDivisionError in the
    rescaling that folds a plain segment's time into the table)."""
    key = auto_cache.cost_key(model, 1)
    auto_cache.store(key, {"plain_step": plain_step, "cycle": [["pipeline", 1, None, cycle_seconds]]})
    table = costs_for(model, 1, [Candidate(None), PIPE1])
    assert counted["measure"] == [1]
    assert table.plain_step > 0 and table.cycle[PIPE1] > 0
    assert decode(auto_cache.load(key)) == table


def test_a_kept_table_is_completed_from_disk(model, counted):
    """An injected table lacking a candidate takes that candidate's cost from the stored table, timing nothing, and
    keeps its own costs."""
    costs_for(model, 1, [Candidate(None), PIPE1])
    stored = auto_cache.load(auto_cache.cost_key(model, 1))
    injected = CostTable(3.0, {PIPE2: 1.0})
    set_costs(model, injected, batch=1)
    table = costs_for(model, 1, [PIPE1, PIPE2])
    assert counted["plain"] == [1] * ROUNDS and counted["cycle"] == [PIPE1] * ROUNDS
    assert table == CostTable(3.0, {PIPE1: decode(stored).cycle[PIPE1], PIPE2: 1.0})


def test_the_cache_folder_and_a_folder_that_cannot_be_written(model, counted, tmp_path, monkeypatch, caplog):
    """`HF_LOOPSPEC_CACHE` names the folder; without it, a per-user cache folder named for the package. A folder
    that cannot be created (a file is in the way) costs only the cache: the call measures and keeps its table, and
    a warning (once) says the tables cannot be stored there."""
    assert auto_cache.cache_dir() == tmp_path
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv(auto_cache.CACHE_ENV, str(blocked / "cache"))
    monkeypatch.setattr(auto_cache, "_UNWRITABLE", set())
    with caplog.at_level(logging.WARNING, logger=auto_cache.__name__):
        table = costs_for(model, 1, [Candidate(None), PIPE1])
    assert counted["measure"] == [1] and costs_for(model, 1, [PIPE1]) is table
    assert auto_cache.unwritable()  # (the command line then says the table is not stored)
    warned = [r.getMessage() for r in caplog.records if "cannot store" in r.getMessage()]
    assert len(warned) == 1 and str(blocked / "cache") in warned[0] and auto_cache.CACHE_ENV in warned[0]
    monkeypatch.delenv(auto_cache.CACHE_ENV)
    assert "hf_loopspec" in auto_cache.cache_dir().parts


class OpaqueWeight(torch.Tensor):
    """A weight whose values plain tensor operations cannot read, as torchao's quantized weights (their `view`
    raised NotImplementedError in auto's weights fingerprint, so that auto failed on such a model)."""

    @staticmethod
    def __new__(cls, shape):
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=torch.float32)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.detach.default:
            return args[0]
        raise NotImplementedError(f"{func} on an opaque weight")


def test_the_weights_fingerprint_reads_a_weight_it_cannot_view_by_its_type_and_shape():
    plain, opaque = tiny_spec_model(3), tiny_spec_model(3)
    head = opaque.lm_head.weight
    opaque.lm_head.weight = torch.nn.Parameter(OpaqueWeight(head.shape), requires_grad=False)
    key = auto_cache.weights_fingerprint(opaque)
    assert key == auto_cache.weights_fingerprint(opaque) != auto_cache.weights_fingerprint(plain)


@pytest.mark.parametrize("max_memory", ["1KB", "40KB"], ids=["all-on-disk", "part-on-disk"])
def test_the_weights_fingerprint_reads_weights_accelerate_offloaded(tmp_path, max_memory):
    """Two checkpoints of one architecture offloaded to disk (`device_map="auto"` with little memory): their offloaded
    weights are on the meta device, which the fingerprint skipped, so both got one key and one shared the other's
    stored acceptance. It reads them from accelerate's store: an offloaded model has its in-memory twin's key."""
    from transformers import AutoModelForCausalLM

    models = {}
    for sign in (1.0, -1.0):
        model = tiny_spec_model(3)
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.mul_(sign)
        model.save_pretrained(tmp_path / str(sign))
        models[sign] = model, AutoModelForCausalLM.from_pretrained(
            tmp_path / str(sign), dtype=torch.float32, device_map="auto", max_memory={"cpu": max_memory},
            offload_folder=tmp_path / f"offload{sign}")
    for in_memory, offloaded in models.values():
        assert "disk" in offloaded.hf_device_map.values()
        assert any(p.device.type == "meta" for p in offloaded.parameters())
        assert auto_cache.weights_fingerprint(offloaded) == auto_cache.weights_fingerprint(in_memory)
    assert auto_cache.weights_fingerprint(models[1.0][1]) != auto_cache.weights_fingerprint(models[-1.0][1])


def test_a_huginn_models_costs_are_measured_per_recurrence_steps(tmp_path, monkeypatch):
    """A call's cost grows with Huginn's `num_steps`: a table measured at 2 steps was used at 6, in the process and
    from disk (the keys named no loop count), so auto underpriced plain decoding at the deeper setting."""
    from huginn_utils import tiny_huginn

    monkeypatch.setenv(auto_cache.CACHE_ENV, str(tmp_path))
    huginn = tiny_huginn(seed=1)[0]
    measured = []
    measure = auto_calibration.measure_costs
    monkeypatch.setattr(auto_calibration, "measure_costs",
                        lambda *args: measured.append(huginn.num_loops) or measure(*args))
    for steps in (2, 6, 2, 6):
        with huginn.recurrence(num_steps=steps, init_scale=0.0):
            costs_for(huginn, 1, [Candidate("pipeline", 1)])
    assert measured == [2, 6]  # once per loop count, then kept in the process
    set_costs(huginn, None)
    with huginn.recurrence(num_steps=6, init_scale=0.0):
        costs_for(huginn, 1, [Candidate("pipeline", 1)])
    assert measured == [2, 6]  # read back from disk, under the key of its loop count


def test_an_injected_table_holds_at_every_loop_count_and_a_new_one_replaces_it(tmp_path, monkeypatch):
    """Injected tables are fixed choices (tests, benchmarks): one for a batch size held only at the Huginn loop
    count it was set at (auto measured at the others), forgetting a batch size left the tables of other loop counts,
    and a table for every batch size did not replace the copy auto had completed from the previous one."""
    from huginn_utils import tiny_huginn

    from hf_loopspec.generation.auto_costs import kept_table

    monkeypatch.setenv(auto_cache.CACHE_ENV, str(tmp_path))
    huginn = tiny_huginn(seed=1)[0]
    injected = CostTable(1.0, {PIPE1: 0.5})
    set_costs(huginn, injected, batch=1)
    for steps in (2, 6):
        with huginn.recurrence(num_steps=steps, init_scale=0.0):
            assert kept_table(huginn, 1) is injected
            costs_for(huginn, 1, [PIPE1])  # nothing to measure
            assert kept_table(huginn, 1) is injected
    with huginn.recurrence(num_steps=2, init_scale=0.0):
        costs_for(huginn, 2, [PIPE1])  # measured for batch 2 at 2 steps
    with huginn.recurrence(num_steps=6, init_scale=0.0):  # measured at 6 steps, then replaced by an injected table
        costs_for(huginn, 2, [PIPE1])
        set_costs(huginn, injected, batch=2)
    with huginn.recurrence(num_steps=2, init_scale=0.0):
        assert kept_table(huginn, 2) is injected
    set_costs(huginn, None, batch=2)
    with huginn.recurrence(num_steps=6, init_scale=0.0):
        set_costs(huginn, None, batch=1)
    with huginn.recurrence(num_steps=2, init_scale=0.0):
        assert kept_table(huginn, 1) is None and kept_table(huginn, 2) is None
    first, second = CostTable(1.0, {PIPE1: 0.5}), CostTable(1.0, {PIPE1: 0.25, PIPE2: 0.25})
    set_costs(huginn, first)
    with huginn.recurrence(num_steps=4, init_scale=0.0):
        completed = costs_for(huginn, 1, [PIPE1, PIPE2])  # the injected table completed for batch 1
        assert completed.cycle[PIPE1] == 0.5 and not completed.adapt
        set_costs(huginn, second)
        assert kept_table(huginn, 1) is second
    set_costs(huginn, None)
