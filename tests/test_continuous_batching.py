"""Continuous batching on the package's models (`generation.continuous`): transformers' entry points
(`generate_batch`, `init_continuous_batching`, the manager's API and result objects) on the wavefront engine.

The reference of every request is plain greedy `generate` of that request alone (fp32): the manager's tokens must
equal it whatever else is in flight and whenever the request arrived, in plain and speculative modes. Requests that
cannot run fail alone, with the reason in their `error`; a failure of the loop raises in `generate_batch`.
"""

from __future__ import annotations

import contextlib
import copy
import re
import threading
import time

import pytest
import torch
from continuous_utils import VOCAB, WAIT_S, alone, batching, collect, generation_config, prompts, starting
from speculative_utils import named_modes, tiny_spec_model
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.generation.continuous_batching import RequestStatus
from transformers.generation.continuous_batching.requests import GenerationOutput

from hf_loopspec.assets import default_model_path
from hf_loopspec.generation.continuous import slots as slots_module
from hf_loopspec.generation.continuous.manager import CANCELLED
from hf_loopspec.generation.continuous.router import Router

SETTINGS = named_modes()  # plain, then one pipeline and one block setting
SECOND = {**SETTINGS["pipeline-d1"], "second_draft_loops": 3}  # pipeline with second proposals (U = 4, d = 1)


@pytest.fixture(scope="module")
def model():
    """A tiny fp32 Ouro whose loops agree often enough that drafts are both accepted and rejected (asserted by
    `test_speculation_runs_inside_the_slots`)."""
    return tiny_spec_model(0, vocab=VOCAB, damp=0.5)


@pytest.fixture
def started(model):
    """A function that starts a manager (stopped at the end of the test)."""
    def configure(settings: dict, slots: int = 2, positions: int = 64, **extra):
        return generation_config(settings, **extra), batching(slots, positions)

    yield from starting(model, configure)


@pytest.mark.parametrize("name", [*SETTINGS, "pipeline-d1-second"])
def test_generate_batch_equals_each_request_alone(model, name):
    """More requests than slots, ragged prompts, one stopped early by its EOS: every request's tokens are plain
    decoding's of it alone, returned in the order of the inputs with transformers' `GenerationOutput`."""
    inputs = prompts(1, [5, 1, 9, 3, 12])
    eos = alone(model, inputs[0], 8)[2]  # request 0 stops at its third token
    config = generation_config(SETTINGS.get(name, SECOND), eos_token_id=eos)
    out = model.generate_batch(inputs, generation_config=config, continuous_batching_config=batching(),
                               record_timestamps=True)
    expected = [alone(model, p, 8, eos) for p in inputs]
    assert [len(r.timestamps) for r in out.values()] == [len(e) for e in expected]
    assert len(expected[0]) == 3 and any(len(e) == 8 for e in expected)
    assert list(out) == [f"req_{i}" for i in range(len(inputs))]
    assert [r.status for r in out.values()] == [RequestStatus.FINISHED] * len(inputs)
    assert [r.generated_tokens for r in out.values()] == expected
    assert [r.prompt_ids for r in out.values()] == inputs


@pytest.mark.parametrize("name", SETTINGS)
def test_arrivals_while_a_longer_request_streams(model, started, name):
    """A long streaming request decodes; others arrive once it has produced tokens and share the slots (more of them
    than free slots). The stream yields growing prefixes, DECODING then FINISHED; every request equals its plain
    decoding alone."""
    manager = started(SETTINGS[name])
    first, *later = prompts(2, [4, 7, 2, 10])
    long_id = manager.add_request(first, max_new_tokens=30, streaming=True)
    stream = manager.request_id_iter(long_id)
    outputs = [next(stream)]
    assert outputs[0].status == RequestStatus.DECODING and outputs[0].generated_tokens
    ids = [manager.add_request(p, max_new_tokens=n) for p, n in zip(later, (6, 9, 3))]
    outputs += list(stream)
    results = collect(manager, ids)
    final = alone(model, first, 30)
    assert [o.status for o in outputs] == [RequestStatus.DECODING] * (len(outputs) - 1) + [RequestStatus.FINISHED]
    lengths = [len(o.generated_tokens) for o in outputs]
    assert lengths == sorted(set(lengths)) and lengths[-1] == 30
    assert all(o.generated_tokens == final[: len(o.generated_tokens)] for o in outputs)
    assert [results[i].generated_tokens for i in ids] == [alone(model, p, n) for p, n in zip(later, (6, 9, 3))]


@pytest.mark.parametrize("name", ["pipeline-d1"])
def test_cancellation_frees_the_slot(model, started, name):
    """A request cancelled while decoding and one cancelled while waiting are delivered FAILED ("cancelled"), the
    first with a prefix of its tokens; the others, one admitted into the freed slot, equal plain decoding."""
    manager = started(SETTINGS[name])
    a, b, c, d = prompts(3, [3, 5, 4, 6])
    cancelled = manager.add_request(a, max_new_tokens=40, streaming=True)
    kept = manager.add_request(b, max_new_tokens=40)
    waiting = manager.add_request(c, max_new_tokens=5)
    first = next(manager.request_id_iter(cancelled))
    manager.cancel_request(cancelled)
    manager.cancel_request(waiting)
    late = manager.add_request(d, max_new_tokens=7)
    results = collect(manager, [cancelled, kept, waiting, late])
    for request_id in (cancelled, waiting):
        assert results[request_id].status == RequestStatus.FAILED and results[request_id].error == CANCELLED
    partial = results[cancelled].generated_tokens
    assert len(first.generated_tokens) <= len(partial) < 40
    assert partial == alone(model, a, 40)[: len(partial)]
    assert results[kept].generated_tokens == alone(model, b, 40)
    assert results[late].generated_tokens == alone(model, d, 7)


def test_a_cancellation_after_delivery_leaves_a_reused_id_alone(model, started):
    """`cancel_request` of a delivered request does nothing, also to a later request that reuses its id (it was
    applied to that one: FAILED "cancelled"); an unknown id is ignored too."""
    manager = started(SETTINGS["pipeline-d1"])
    first, second = prompts(5, [3, 4])
    manager.add_request(first, request_id="a", max_new_tokens=6)
    assert manager.get_result("a", timeout=60).status == RequestStatus.FINISHED
    manager.cancel_request("a")
    manager.cancel_request("never-added")
    manager.add_request(second, request_id="a", max_new_tokens=6)
    result = manager.get_result("a", timeout=60)
    assert result.status == RequestStatus.FINISHED and result.error is None
    assert result.generated_tokens == alone(model, second, 6)


def test_requests_that_cannot_run_fail_alone(model, started):
    """Each request that cannot run is delivered FAILED with a message naming the value; the manager keeps
    serving."""
    manager = started(SETTINGS["pipeline-d1"], positions=32)
    good = prompts(4, [6])[0]
    bad = {
        "positions": manager.add_request(list(range(3, 30)), max_new_tokens=8),
        "ids": manager.add_request([3, VOCAB + 5]),
        "empty": manager.add_request([]),
        "max_new_tokens": manager.add_request(good, max_new_tokens=0),
        "settings": manager.add_request(good, temperature=0.5),
        "seed": manager.add_request(good, seed=3),
        "init_seed": manager.add_request(good, init_seed=3),
    }
    ok = manager.add_request(good, max_new_tokens=8)
    results = collect(manager, [*bad.values(), ok])
    messages = {
        "positions": r"needs 35 positions, and a slot of this manager holds 32",
        "ids": rf"token ids must be integers in \[0, {VOCAB}\)",
        "empty": r"input_ids=\[\]",
        "max_new_tokens": r"max_new_tokens=0",
        "settings": r"per-request settings \['temperature'\] are not supported",
        "seed": r"seed=3 on a greedy manager",
        "init_seed": r"per-request settings \['init_seed'\] are not supported: .* only seed\.",
    }
    for key, request_id in bad.items():
        assert results[request_id].status == RequestStatus.FAILED
        assert re.search(messages[key], results[request_id].error or ""), key
    assert results[ok].status == RequestStatus.FINISHED
    assert results[ok].generated_tokens == alone(model, good, 8)


def test_generate_batch_raises_when_the_loop_fails(model, monkeypatch):
    """An error of the loop reaches the caller of `generate_batch` (not empty outputs)."""

    def broken(self, cycles):
        raise RuntimeError("device lost")

    monkeypatch.setattr(slots_module.SlotBatch, "run", broken)
    with pytest.raises(RuntimeError, match="continuous batching loop failed: device lost"):
        model.generate_batch(prompts(5, [3, 4]), generation_config=generation_config(SETTINGS["plain"]))


def test_speculation_runs_inside_the_slots(model, started):
    """The speculative manager drafts, accepts and rejects inside its slots (the counters of the slot that served
    the request), so the equality tests above exercise speculation, not only its fallback."""
    manager = started(SETTINGS["pipeline-d1"], slots=1)
    request_id = manager.add_request(prompts(6, [5])[0], max_new_tokens=24)
    collect(manager, [request_id])
    counters = dict(zip(("committed", "drafted", "verified", "accepted", "rejected"),
                        manager.batch_processor.state.counters[0, :5].tolist()))
    assert counters["committed"] == 24 and counters["accepted"] > 0 and counters["rejected"] > 0, counters


@pytest.mark.parametrize("name", ["plain", "pipeline-d1"])
def test_a_seeded_sampled_request_is_the_same_alone_and_in_a_busy_batch(model, started, name):
    """Sampling draws each slot's uniforms from the request's own seed: the same seed gives the same tokens alone and
    among other requests (arriving before and after it); another seed gives other tokens."""
    sampled = {**SETTINGS[name], "do_sample": True, "temperature": 2.0, "top_k": 0}
    prompt, *others = prompts(7, [4, 6, 3, 8])
    quiet = started(sampled, slots=3)
    ids = [quiet.add_request(prompt, max_new_tokens=16, seed=s) for s in (11, 12)]
    quiet_results = collect(quiet, ids)
    by_seed = [quiet_results[i].generated_tokens for i in ids]
    busy = started(sampled, slots=3)
    before = [busy.add_request(p, max_new_tokens=12, seed=1) for p in others[:2]]
    seeded = busy.add_request(prompt, max_new_tokens=16, seed=11)
    after = [busy.add_request(others[2], max_new_tokens=12, seed=2)]
    results = collect(busy, [*before, seeded, *after])
    assert results[seeded].generated_tokens == by_seed[0]
    assert by_seed[0] != by_seed[1]


def test_a_sampled_manager_whose_requests_carry_seeds_leaves_torch_s_generator_alone(model, started):
    """Building the manager's engine drew a number from torch's global generator that no slot used (each samples
    from its request's seed): a script's own draws after it shifted."""
    before = torch.get_rng_state()
    manager = started({**SETTINGS["pipeline-d1"], "do_sample": True, "temperature": 2.0}, slots=2)
    collect(manager, [manager.add_request(p, max_new_tokens=6, seed=5) for p in prompts(3, [4, 5])])
    assert torch.equal(torch.get_rng_state(), before)


def test_the_default_model_through_generate_batch():
    """The embedded model with its own generation config (auto, which a manager runs as pipeline): `generate_batch`
    on tokenized prompts equals plain `generate` of each."""
    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    inputs = [tokenizer(text)["input_ids"] for text in ("def add(a, b):", "import os\n", "class Path:")]
    config = copy.deepcopy(model.generation_config)
    config.max_new_tokens = 10
    assert config.speculative_mode == "auto"
    out = model.generate_batch(inputs, generation_config=config, continuous_batching_config=batching(2, 32))
    expected = [alone(model, ids, 10, tokenizer.eos_token_id) for ids in inputs]
    assert [r.generated_tokens for r in out.values()] == expected


@pytest.mark.parametrize("settings, fixed", [({"speculative_mode": "auto"}, ("pipeline", 1)),
                                             ({"speculative_mode": "auto", "draft_loops": 3}, ("block", 3))])
def test_an_auto_generation_config_runs_a_fixed_mode(model, started, settings, fixed):
    """A manager's mode is fixed for its life: auto runs pipeline at the config's depth (block where the loop count
    is no multiple of it); its slots speculate and every request's tokens are plain decoding's of it alone."""
    manager = started(settings, slots=2)
    assert (manager.settings.mode, manager.settings.draft_loops) == fixed
    inputs = prompts(9, [5, 2, 7])
    ids = [manager.add_request(p, max_new_tokens=12) for p in inputs]
    results = collect(manager, ids)
    assert [results[i].generated_tokens for i in ids] == [alone(model, p, 12) for p in inputs]
    assert manager.batch_processor.state.counters[:, 2].sum() > 0  # drafts were verified in the slots


def test_pause_holds_the_loop_and_keeps_requests(model, started):
    """Inside `pause` the loop is parked (a request added then gets no result); on leaving it, the request decodes
    to plain decoding's tokens."""
    manager = started(SETTINGS["pipeline-d1"])
    prompt = prompts(9, [5])[0]
    with manager.pause():
        request_id = manager.add_request(prompt, max_new_tokens=6)
        assert manager.get_result(timeout=0.5) is None
    assert collect(manager, [request_id])[request_id].generated_tokens == alone(model, prompt, 6)


@pytest.mark.parametrize("stop", ["stop", "hard stop", "destroy"])
def test_stopping_inside_a_pause_raises_instead_of_waiting_forever(model, started, stop):
    """`stop` (or `destroy`) inside the calling thread's own pause waited for a loop that the pause holds: it hung.
    It raises a `RuntimeError` saying to leave the pause; the request in flight then finishes with plain decoding's
    tokens, and the manager stops."""
    manager = started(SETTINGS["pipeline-d1"])
    prompt = prompts(9, [5])[0]
    request_id = manager.add_request(prompt, max_new_tokens=6)
    with manager.pause():
        with pytest.raises(RuntimeError, match="pause"):
            {"stop": manager.stop, "hard stop": lambda: manager.stop(hard_stop=True),
             "destroy": manager.destroy}[stop]()
    assert collect(manager, [request_id])[request_id].generated_tokens == alone(model, prompt, 6)
    manager.stop(block=True, timeout=60)
    assert not manager.is_running()


def test_a_stop_that_does_not_wait_forever_is_allowed_inside_a_pause(model, started):
    """`stop(block=False)` and `stop(timeout=...)` inside a pause return (the loop ends once the pause is left), as
    before the guard against the stop that would wait forever; the request in flight finishes first."""
    manager = started(SETTINGS["pipeline-d1"])
    prompt = prompts(9, [5])[0]
    request_id = manager.add_request(prompt, max_new_tokens=6)
    with manager.pause():
        manager.stop(block=True, timeout=0.05)
        manager.stop(block=False)
    assert collect(manager, [request_id])[request_id].generated_tokens == alone(model, prompt, 6)
    manager.join(timeout=60)
    assert not manager.is_running()


def test_a_pause_left_in_another_thread_releases_the_loop(model, started):
    """A pause entered in one thread and left in another (an ExitStack handed to a worker) releases the loop: the
    request decodes and a blocking stop from the entering thread is not taken for a stop inside its pause."""
    manager = started(SETTINGS["pipeline-d1"])
    prompt = prompts(9, [5])[0]
    stack = contextlib.ExitStack()
    stack.enter_context(manager.pause())
    request_id = manager.add_request(prompt, max_new_tokens=6)
    worker = threading.Thread(target=stack.close)
    worker.start()
    worker.join()
    assert collect(manager, [request_id])[request_id].generated_tokens == alone(model, prompt, 6)
    manager.stop(block=True, timeout=60)
    assert not manager.is_running()


def test_a_repetition_penalty_counts_each_requests_own_prompt(model):
    """The generation config's repetition penalty runs in every slot on that request's prompt and tokens (the slot's
    `seen` row is reset at admission): each request equals plain decoding of it alone with the same penalty."""
    inputs = prompts(10, [6, 2, 8])
    config = generation_config(SETTINGS["pipeline-d1"], repetition_penalty=1.5, max_new_tokens=10)
    out = model.generate_batch(inputs, generation_config=config, continuous_batching_config=batching(slots=2))
    expected = [alone(model, p, 10, repetition_penalty=1.5) for p in inputs]
    assert expected != [alone(model, p, 10) for p in inputs]  # the penalty changes the tokens
    assert [r.generated_tokens for r in out.values()] == expected


def test_settings_a_manager_cannot_run_are_refused_at_init(model):
    """Generation settings the manager does not run raise at `init_continuous_batching`, naming them."""
    with pytest.raises(ValueError, match="MinNewTokensLengthLogitsProcessor .* drop that setting"):
        model.init_continuous_batching(generation_config(SETTINGS["plain"], min_new_tokens=3, eos_token_id=5))
    with pytest.raises(ValueError, match=r"stop_strings=\['\\n'\] in continuous batching"):
        model.init_continuous_batching(generation_config(SETTINGS["plain"], stop_strings=["\n"]))
    with pytest.raises(ValueError, match="num_return_sequences=2"):
        model.init_continuous_batching(generation_config(SETTINGS["plain"], num_return_sequences=2, do_sample=True))


def test_a_request_that_fails_at_admission_fails_alone(model, started, monkeypatch):
    """An error while one request takes its slot fails that request (its error text delivered); the slot serves the
    next request, which equals plain decoding."""
    admit = slots_module.SlotBatch.admit

    def failing(self, b, prompt, *args):
        if prompt == [7, 7, 7]:
            raise RuntimeError("embedding failed")
        return admit(self, b, prompt, *args)

    monkeypatch.setattr(slots_module.SlotBatch, "admit", failing)
    manager = started(SETTINGS["pipeline-d1"], slots=1)
    good = prompts(11, [4])[0]
    ids = [manager.add_request([7, 7, 7]), manager.add_request(good, max_new_tokens=6)]
    results = collect(manager, ids)
    assert results[ids[0]].status == RequestStatus.FAILED and results[ids[0]].error == "embedding failed"
    assert results[ids[1]].generated_tokens == alone(model, good, 6)


def test_a_draft_override_steers_acceptance_not_tokens(model, started):
    """`add_request(draft_override=...)` (test/bench-only) replaces a slot's drafts by position of the request alone:
    all right, every verified draft is accepted; all wrong, none is; either way the tokens are plain decoding's, and
    the next owner of the slot drafts on its own again. A malformed override raises, naming what is wrong."""
    manager = started(SETTINGS["pipeline-d1"], slots=1)
    prompt = prompts(6, [5])[0]
    want = alone(model, prompt, 24)
    wrong = [(t + 1) % VOCAB for t in want]
    seen = []
    for drafts in ([-1] * 5 + want, torch.tensor([-1] * 5 + wrong), None):
        request_id = manager.add_request(prompt, max_new_tokens=24, draft_override=drafts)
        assert collect(manager, [request_id])[request_id].generated_tokens == want
        seen.append(dict(zip(("accepted", "rejected"), manager.batch_processor.state.counters[0, 3:5].tolist())))
    assert seen[0]["rejected"] == 0 < seen[0]["accepted"], seen
    assert seen[1]["accepted"] == 0 < seen[1]["rejected"], seen
    assert seen[2]["accepted"] > 0 and seen[2] != seen[0], seen
    for bad, message in [([-1] * 30, "has 30 entries, and the request reaches 29 positions"),
                         ([3, VOCAB], rf"holds \[{VOCAB}\]: give token ids in \[0, {VOCAB}\)"),
                         (torch.zeros(2, 3, dtype=torch.long), r"shape \(2, 3\); give a 1-D integer tensor")]:
        with pytest.raises(ValueError, match=message):
            manager.add_request(prompt, max_new_tokens=24, draft_override=bad)
    plain_manager = started(SETTINGS["plain"])
    with pytest.raises(ValueError, match="draft_override on a manager that decodes plain"):
        plain_manager.add_request(prompt, draft_override=[-1])


def test_results_taken_by_id_leave_the_others_queued_in_order():
    """A reader waiting for one request takes only its results: another request's stay queued in delivery order
    (before, a reader put them back at the end, reordering a stream, and spun without waiting)."""
    router = Router()
    delivered = [GenerationOutput(request_id=rid, generated_tokens=list(range(n)), status=status)
                 for rid, n, status in [("a", 1, RequestStatus.DECODING), ("a", 2, RequestStatus.DECODING),
                                        ("b", 3, RequestStatus.FINISHED), ("a", 3, RequestStatus.FINISHED)]]
    router.deliver_batch(delivered)
    assert router.take("b", timeout=0) is delivered[2]
    assert router.take("c", timeout=0) is None  # nothing of c's: the others stay
    assert [router.take("a", timeout=0) for _ in range(3)] == [delivered[0], delivered[1], delivered[3]]
    assert router.output_queue.empty()


def test_a_reader_waits_for_its_result_and_wakes_when_it_is_delivered():
    """`take` with a timeout blocks (no result of another request wakes it for good) until its request's result is
    delivered from another thread, and returns None once the timeout passes without one."""
    router = Router()
    mine = GenerationOutput(request_id="mine", status=RequestStatus.FINISHED)
    other = GenerationOutput(request_id="other", status=RequestStatus.FINISHED)

    def deliver_later():
        time.sleep(0.05)
        router.deliver(other)
        time.sleep(0.05)
        router.deliver(mine)

    thread = threading.Thread(target=deliver_later)
    thread.start()
    assert router.take("mine", timeout=WAIT_S) is mine
    thread.join()
    assert router.take("mine", timeout=0.01) is None
    assert router.take(None, timeout=0) is other


def test_a_finished_requests_iterator_ends_on_a_stopped_manager_with_other_results_queued(model, started):
    """`request_id_iter` of a request already read, after `stop`, ends although another request's result is still
    queued (it looped forever on the non-empty queue); that result stays for `get_result`."""
    manager = started(SETTINGS["plain"])
    first, second = (manager.add_request(p, max_new_tokens=3) for p in prompts(5, [4, 6]))
    assert list(manager.request_id_iter(first))[-1].is_finished()
    manager.stop(block=True, timeout=WAIT_S)
    again = []
    reader = threading.Thread(target=lambda: again.extend(manager.request_id_iter(first)), daemon=True)
    reader.start()
    reader.join(WAIT_S)
    assert not reader.is_alive() and again == []
    assert manager.get_result(second, timeout=0).request_id == second


def test_waiting_without_limit_for_a_result_that_cannot_come_returns_on_a_stopped_manager(model, started):
    """`get_result(request_id, timeout=None)` on a stopped manager, with only another request's result queued,
    returns None at once (nothing more will be delivered) instead of waiting forever."""
    manager = started(SETTINGS["plain"])
    manager.add_request(prompts(6, [4])[0], max_new_tokens=2)
    manager.stop(block=True, timeout=WAIT_S)
    answers = []
    reader = threading.Thread(target=lambda: answers.append(manager.get_result("never-added", timeout=None)),
                              daemon=True)
    reader.start()
    reader.join(WAIT_S)
    assert not reader.is_alive() and answers == [None]
    assert manager.get_result(timeout=None).is_finished()  # the other result is still there


def test_a_reader_waiting_without_limit_returns_when_the_manager_stops(model, started):
    """A wait without limit that began while the manager ran ends when it stops (nothing more will come)."""
    manager = started(SETTINGS["plain"])
    answers = []
    reader = threading.Thread(target=lambda: answers.append(manager.get_result("never-added", timeout=None)),
                              daemon=True)
    reader.start()
    time.sleep(0.3)
    manager.stop(block=True, timeout=WAIT_S)
    reader.join(WAIT_S)
    assert not reader.is_alive() and answers == [None]
