"""Continuous batching managers shared by threads: `continuous_batching_context_manager` blocks (and so
`generate_batch` calls) of several threads on one kept manager, and `start` / `stop` called from several threads.

Before, each block started and stopped the one kept manager on its own: a block that ended stopped the loop under
another thread's requests (dropped, or a call waiting forever), two blocks entering at once started two loops on the
same slots (requests FINISHED with wrong tokens and no error), and two `stop`s at once crashed. The reference of
every request is plain greedy `generate` of it alone (fp32).
"""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch
from continuous_utils import VOCAB, WAIT_S, alone, batching, collect, generation_config, prompts
from speculative_utils import named_modes, tiny_spec_model

PIPELINE = named_modes()["pipeline-d1"]


@pytest.fixture
def model():
    model = tiny_spec_model(0, vocab=VOCAB, damp=0.5)
    yield model
    model.destroy_cached_continuous_batching_manager()


def _kept(model) -> dict:
    return dict(generation_config=generation_config(PIPELINE), continuous_batching_config=batching(),
                persistent_manager=True)


def _in_threads(calls) -> tuple[list, list[str], int]:
    """Run each of `calls` in a thread of its own, all at once: (their results, the exceptions they raised, how many
    threads were still running after `WAIT_S` seconds)."""
    results, errors = [None] * len(calls), []

    def run(i):
        try:
            results[i] = calls[i]()
        except Exception as error:  # (an exception in a thread would otherwise pass unseen)
            errors.append(repr(error))

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT_S)
    return results, errors, sum(thread.is_alive() for thread in threads)


def test_a_block_that_ends_leaves_the_loop_of_another_block_running(model):
    """Two blocks on one kept manager: when the first ends, the second's requests still decode."""
    inputs = prompts(2, [4, 6])
    model.generate_batch(inputs, **_kept(model))  # builds the manager and keeps it
    other = model.continuous_batching_context_manager(**_kept(model))
    with model.continuous_batching_context_manager(**_kept(model)) as first:
        second = other.__enter__()
        assert second is first
    try:
        ids = second.add_requests(inputs, max_new_tokens=8)
        results = collect(second, ids)
        assert [results[i].generated_tokens for i in ids] == [alone(model, p, 8) for p in inputs]
    finally:
        other.__exit__(None, None, None)
    assert not second.is_running()  # the last block out stops the loop


def test_threads_sharing_a_kept_manager_get_their_own_tokens(model):
    """`generate_batch(persistent_manager=True)` from two threads at once, three times over."""
    inputs = [prompts(3, [5, 7, 9]), prompts(4, [6, 3])]
    expected = [[alone(model, p, 8) for p in group] for group in inputs]
    model.generate_batch(inputs[0], **_kept(model))
    for _ in range(3):
        got, errors, hung = _in_threads([lambda group=group: [
            r.generated_tokens for r in model.generate_batch(group, **_kept(model)).values()] for group in inputs])
        assert (errors, hung, got) == ([], 0, expected)


def test_stops_from_two_threads_at_once(model):
    """The second `stop` waits for, or finds, the first one's end; neither raises."""
    manager = model.init_continuous_batching(generation_config(PIPELINE), batching())
    for _ in range(10):
        manager.start()
        _, errors, hung = _in_threads([lambda: manager.stop(block=True)] * 2)
        assert (errors, hung, manager.is_running()) == ([], 0, False)


def test_a_start_after_a_stop_that_did_not_wait_runs_a_new_loop(model):
    """`stop(block=False)` then `start()`: the old loop was still ending, so `start` only warned, and every later
    request failed ("stopping"). `start` now waits for the old loop's end and starts a new one."""
    manager = model.init_continuous_batching(generation_config(PIPELINE), batching())
    inputs = prompts(5, [4, 6])
    manager.start()
    try:
        first = manager.add_request(inputs[0], max_new_tokens=8)
        manager.stop(block=False)
        manager.start()
        second = manager.add_request(inputs[1], max_new_tokens=8)
        results = collect(manager, [first, second])
        assert [results[i].generated_tokens for i in (first, second)] == [alone(model, p, 8) for p in inputs]
    finally:
        manager.stop(block=True)


def test_a_pause_holders_stop_gets_through_while_another_thread_waits_for_the_loop(model):
    """Thread B waits in `stop(block=True)` for a loop that thread A holds paused; A's `stop(block=False)` inside its
    pause (what the pause's own error advises) must return, so that A leaves its pause and B's stop ends."""
    manager = model.init_continuous_batching(generation_config(PIPELINE), batching())
    manager.start()
    paused, b_waits = threading.Event(), threading.Event()

    def a():
        with manager.pause():
            paused.set()
            b_waits.wait(WAIT_S)
            manager.stop(block=False)

    def b():
        paused.wait(WAIT_S)
        b_waits.set()
        manager.stop(block=True)

    _, errors, hung = _in_threads([a, b])
    assert (errors, hung, manager.is_running()) == ([], 0, False)


def test_a_start_inside_a_pause_of_an_ending_loop_raises(model):
    """The paused loop cannot end, so a `start` that waits for it would wait forever."""
    manager = model.init_continuous_batching(generation_config(PIPELINE), batching())
    manager.start()
    try:
        with manager.pause():
            manager.stop(block=False)
            with pytest.raises(RuntimeError, match="start inside the manager's pause"):
                manager.start()
    finally:
        manager.stop(block=True)


def test_a_block_joining_a_running_loop_does_not_warm_up_its_slots(model, monkeypatch):
    """A compiled manager's warmup runs the step on the slots: on a loop that serves another block's requests it
    dropped a prefilling request's prompt rows (FINISHED with wrong tokens). A block joining a running loop skips
    it (the step is built on first use)."""
    kept = {**_kept(model), "warmup": False}
    model.generate_batch(prompts(2, [4]), **kept)
    manager = model._cached_continuous_batching_manager
    warmups = []
    monkeypatch.setattr(manager, "warmup", lambda: warmups.append(manager.is_running()))
    with model.continuous_batching_context_manager(**kept), \
            model.continuous_batching_context_manager(**{**kept, "warmup": True}):
        pass
    with model.continuous_batching_context_manager(**{**kept, "warmup": True}):
        pass
    assert warmups == [False]  # the second block joined a running loop; the third started one


@pytest.mark.parametrize("stopping", [False, True])
def test_a_block_ended_inside_its_own_threads_pause_does_not_wait_forever(model, stopping):
    """A block that ends (or starts on a loop that is ending) inside its thread's pause: the loop it would wait for
    cannot end while the pause holds it. The block ends without waiting; the loop ends once the pause is left."""
    kept = _kept(model)
    model.generate_batch(prompts(2, [4]), **kept)
    manager = model._cached_continuous_batching_manager
    manager.start()

    def block_in_pause():
        with manager.pause():
            if stopping:
                manager.stop(block=False, keep_for_next_session=True)
            with contextlib.suppress(RuntimeError), model.continuous_batching_context_manager(**kept):
                pass
            return manager._sessions

    sessions, errors, hung = _in_threads([block_in_pause])
    assert (errors, hung, sessions) == ([], 0, [0])
    manager.join(timeout=WAIT_S)
    assert not manager.is_running()


@pytest.mark.parametrize("loop", ["running", "ended before"])
def test_a_manager_destroyed_inside_a_kept_block_is_not_kept_again(model, loop):
    """`destroy_cached_continuous_batching_manager()` inside a `persistent_manager=True` block (its loop running, or
    already ended by a `stop(block=False)`): the block's end kept the destroyed manager again, and a later call with
    other settings was refused."""
    model.generate_batch(prompts(2, [4]), **_kept(model))
    with model.continuous_batching_context_manager(**_kept(model)) as manager:
        if loop == "ended before":
            manager.stop(block=False)
            manager._generation_thread.join(WAIT_S)
        model.destroy_cached_continuous_batching_manager()
    assert getattr(model, "_cached_continuous_batching_manager", None) is None
    other = dict(generation_config=generation_config({}), continuous_batching_config=batching())
    out = model.generate_batch(prompts(3, [5]), **other)
    assert [r.generated_tokens for r in out.values()] == [alone(model, prompts(3, [5])[0], 8)]


def test_the_loop_thread_decodes_under_the_callers_autocast(model):
    """autocast is per thread, and the manager decodes on a thread of its own: `generate_batch` under
    `torch.autocast` ran its layers in fp32 without a word, where `generate` runs them in bf16. The loop now runs
    under its creator's autocast (seen by a hook on a layer: the dtype of what it returns, and the thread's
    autocast), and a kept manager asked for under another autocast is refused."""
    seen = []
    layer = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))
    handle = layer.register_forward_hook(lambda m, i, out: seen.append((torch.is_autocast_enabled("cpu"), out.dtype)))
    try:
        inputs = prompts(5, [4, 6])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model.generate_batch(inputs, max_new_tokens=3, **_kept(model))
        assert seen and set(seen) == {(True, torch.bfloat16)}
        with pytest.raises(ValueError, match="under another torch.autocast"):
            model.generate_batch(inputs, max_new_tokens=3, **_kept(model))
        model.destroy_cached_continuous_batching_manager()
        seen.clear()
        model.generate_batch(inputs, max_new_tokens=3, **_kept(model))
        assert seen and set(seen) == {(False, torch.float32)}
        with torch.autocast("cpu", dtype=torch.float16, enabled=False):  # off: its dtype does not count (refused)
            model.generate_batch(inputs, max_new_tokens=3, **_kept(model))
    finally:
        handle.remove()


def test_a_destroyed_manager_is_not_started_again(model):
    """`destroy()` says the manager cannot be restarted: `start` on it rebuilt its slots and ran a new loop, and a
    kept manager destroyed by its own `destroy()` stayed on the model, so the next block took the destroyed one."""
    model.generate_batch(prompts(2, [4]), **_kept(model))
    manager = model.init_continuous_batching(generation_config(PIPELINE), batching())
    manager.destroy()
    for call in (manager.start, manager.warmup, lambda: manager.session(True, True, None, False).__enter__()):
        with pytest.raises(RuntimeError, match="destroyed"):
            call()
    assert not manager.is_running() and manager.batch_processor is None  # (no slots built again)
    assert getattr(model, "_cached_continuous_batching_manager", None) is None
    model._cached_continuous_batching_manager = manager  # kept by a `stop` racing the `destroy`: not handed out
    assert model.init_continuous_batching(generation_config(PIPELINE), batching()) is not manager
    out = model.generate_batch(prompts(3, [5]), **_kept(model))  # a new manager, built and kept
    assert [r.generated_tokens for r in out.values()] == [alone(model, prompts(3, [5])[0], 8)]
