"""Continuous batching for looped models: a manager with transformers' `ContinuousBatchingManager` API on the
wavefront engine.

`LoopBatchingManager` is what `model.init_continuous_batching(...)` returns (and so what
`continuous_batching_context_manager` and `generate_batch` use). It keeps transformers' request objects and result
routing (`RequestState`, `GenerationOutput`, `RequestStatus`, `OutputRouter`, `BackgroundThreadStatus`), so code
written for transformers' manager, `transformers serve --continuous-batching` included, drives it unchanged.

The loop (a background thread, `start`) repeats: take cancellations and new requests; admit waiting requests into free
slots (first come, first served, each taking KV pages from the manager's pool for what it can use, or waiting for
them: `pool`, `slots.SlotBatch.admit`); run R cycles of the engine (`SlotBatch.run`); read back every slot's committed
count and tokens; deliver the new tokens of streaming requests (status DECODING, the tokens so far) and the result of
each finished request (FINISHED), whose slot and pages are then free. Every request decodes with the manager's
settings (`settings.ManagerSettings`: plain decoding is the engine's "ar" mode, one token per U core calls; a
speculative mode from the generation config drafts and verifies inside the same cycles) and its own prompt,
`max_new_tokens`, EOS ids and sampling seed (and, for a Huginn-family model, initial states: `huginn`), so its tokens
are those of decoding it alone.

Failures are loud and local: a request that cannot run (`settings.request_problem`) is delivered FAILED with the
reason in `GenerationOutput.error` at once, and one whose sampling met non-finite probabilities when it finishes;
the others go on. An error of the loop itself fails every request in flight or waiting with its text and is kept as
`background_thread_status.fatal_error` (`generate_batch` raises it). A cancelled request is delivered FAILED with
the error "cancelled", so iterators and handlers waiting on it end.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from collections import deque
from contextlib import contextmanager

import torch
from transformers.generation.continuous_batching.continuous_api import BackgroundThreadStatus
from transformers.generation.continuous_batching.requests import RequestState, RequestStatus

from ...logs import get_logger
from ...models.layers import is_integer
from ..rules import non_finite_error
from . import huginn
from .results import IDLE_WAIT_S, ResultReading
from .router import Router
from .settings import (
    OVERRIDE,
    check_arguments,
    eos_ids,
    manager_config,
    manager_settings,
    model_signature,
    override_tokens,
    past_positions,
    request_max_new,
    request_problem,
    token_ids,
)
from .slots import SlotBatch

logger = get_logger(__name__)

CANCELLED = "cancelled"  # the error text of a request cancelled by `cancel_request`
CHANGED_MODEL = ("the model changed since this continuous batching manager was built (its loop count, KV layout, "
                 "vocabulary, dtype or device), and a manager's slots are fixed for its life: set the change back, or "
                 "stop the manager and build a new one (model.destroy_cached_continuous_batching_manager() first for "
                 "a kept one).")


class LoopBatchingManager(ResultReading):
    """Continuous batching of one looped model (see the module docstring). Build it with
    `model.init_continuous_batching(generation_config, continuous_batching_config, workload_hints)`."""

    def __init__(self, model, generation_config=None, continuous_batching_config=None, workload_hints=None):
        self.model = model.eval()
        self.generation_config = manager_config(model, generation_config)  # the given one over the model's
        self.from_model_config = generation_config is None  # built from model.generation_config alone
        self.continuous_batching_config = continuous_batching_config
        self.settings = manager_settings(model, generation_config, continuous_batching_config, workload_hints)
        self.model_signature = model_signature(model, self.settings.recurrence)  # (a kept manager checks it)
        self.input_queue: queue.Queue[RequestState] = queue.Queue()
        self.cancel_queue: queue.Queue[tuple[str, int]] = queue.Queue()  # (request id, its serial)
        self.output_router = Router()
        self.background_thread_status = BackgroundThreadStatus()
        self._request_counter, self._request_lock = 0, threading.Lock()
        self._past_positions_warned = False  # a request longer than the model's positions: warned of once
        self._wake_up_loop = threading.Event()
        self._generation_thread: threading.Thread | None = None
        self._control = threading.RLock()  # start, stop and sessions: one thread at a time (one loop on the slots)
        self._sessions = 0  # the open `session` blocks (`continuous_batching_context_manager`), of any thread
        self._pauses: collections.Counter = collections.Counter()  # thread id -> the pauses it entered and holds
        self._seeds = torch.Generator().manual_seed(self.settings.seed) if self.settings.seed is not None else None
        self._inference_mode = torch.is_inference_mode_enabled()  # the loop thread runs in the creator's mode
        # transformers' name for the device side; built now, so that a manager that cannot run raises here
        self.batch_processor: SlotBatch | None = SlotBatch(model, self.settings)
        self.warmed_up = False
        self.destroyed = False  # by `destroy`: never kept for a next session again

    # --- control -----------------------------------------------------------------------------------------------

    def warmup(self) -> None:
        """Build the slots (pages, state) and, compiled, both shapes of the step, so that no request waits for them.
        A destroyed manager raises (`destroy`)."""
        self._check_not_destroyed("warmup")
        slots = self._slots()
        if self.settings.compile_backend is not None:
            slots.warmup()
        self.warmed_up = True

    def _slots(self) -> SlotBatch:
        if self.batch_processor is None:
            self.batch_processor = SlotBatch(self.model, self.settings)
        return self.batch_processor

    def is_running(self) -> bool:
        """Whether the background thread has been started and is alive."""
        return (thread := self._generation_thread) is not None and thread.is_alive()

    def start(self) -> None:
        """Start the background generation thread. A loop asked to stop (`stop(block=False)`) is waited for first,
        outside the lock (so that a pause holder's `stop` still gets through): one loop at a time runs on the slots.
        A destroyed manager raises (`destroy`)."""
        while True:
            with self._control:
                self._check_not_destroyed("start")
                thread = self._generation_thread
                if thread is None or not thread.is_alive():
                    self.background_thread_status.clear()
                    self._generation_thread = threading.Thread(target=self._run_generation_loop, daemon=True)
                    self._generation_thread.start()
                    return
                if self.background_thread_status.local_status == BackgroundThreadStatus.DONT_STOP:
                    logger.warning("The continuous batching manager is already running.")
                    return
                if self._pauses[threading.get_ident()]:
                    raise RuntimeError("start inside the manager's pause(), while its loop is ending: the paused "
                                       "loop cannot end, so this would wait forever; leave the pause first.")
            self._join(thread, None)

    def _check_not_destroyed(self, name: str) -> None:
        if self.destroyed:
            raise RuntimeError(f"{name}: this continuous batching manager was destroyed, and a destroyed manager "
                               "cannot be restarted; call model.init_continuous_batching() (or generate_batch) for a "
                               "new one.")

    def stop(self, block: bool = True, timeout: float | None = None, keep_for_next_session: bool = False,
             hard_stop: bool = False) -> None:
        """Stop the thread once every request is done (`hard_stop`: now, failing those in flight); `block`: wait up
        to `timeout` seconds. `keep_for_next_session`: the model keeps it for its next `init_continuous_batching`."""
        with self._control:
            thread = self._generation_thread
            if thread is None:
                logger.warning("The continuous batching manager was not started.")
                return
            if block and timeout is None and self._pauses[threading.get_ident()]:  # the paused loop cannot end
                raise RuntimeError("stop (or destroy) inside the manager's pause(): the loop is paused and cannot "
                                   "end, so this would wait forever; leave the `with manager.pause():` block first "
                                   "(or pass block=False).")
            status = BackgroundThreadStatus.HARD_STOP if hard_stop else BackgroundThreadStatus.FLUSH_AND_STOP
            self.background_thread_status.request_stop(status, 0)
            self._wake_up_loop.set()
            if keep_for_next_session and not self.destroyed:
                self.model._cached_continuous_batching_manager = self
            elif not keep_for_next_session:  # (the loop holds the slots until it ends; a later start builds them again)
                self.batch_processor = None
        if block:
            self._join(thread, timeout)

    def join(self, stop_trigger_time: float | None = None, timeout: float | None = None) -> None:
        """Wait (at most `timeout` seconds) for the thread to end."""
        if (thread := self._generation_thread) is not None:
            self._join(thread, timeout)

    def _join(self, thread: threading.Thread, timeout: float | None) -> None:
        thread.join(timeout=timeout)
        if thread.is_alive():
            logger.warning("The generation thread did not stop within %s s.", timeout)
            return
        with self._control:
            if self._generation_thread is thread:  # (not one that another thread's `start` made since)
                self._generation_thread = None

    @contextmanager
    def session(self, warmup: bool, block: bool, timeout: float | None, keep_for_next_session: bool):
        """`continuous_batching_context_manager`'s block: the loop runs from the first open session (of any thread) to
        the last closed one, which stops it (and drops the slots unless `keep_for_next_session`): a session of one
        thread never stops the loop under another's requests, nor starts a second loop on the same slots. No lock is
        held while a loop is waited for (a pause holder's `stop` gets through)."""
        with self._control:
            self._check_not_destroyed("continuous_batching_context_manager")
            if warmup and not self.warmed_up and not self.is_running():  # (a compiled warmup runs on the slots)
                self.warmup()
            self._sessions += 1
        try:
            if not self.is_running() or self.background_thread_status.local_status != BackgroundThreadStatus.DONT_STOP:
                self.start()
            yield self
        finally:
            with self._control:
                self._sessions -= 1
                last, thread = self._sessions == 0, self._generation_thread
                if thread is not None and last:  # (None: stopped or destroyed by a caller: nothing to stop or keep)
                    self.stop(block=False, keep_for_next_session=keep_for_next_session)
                elif thread is not None and keep_for_next_session and not self.destroyed:
                    self.model._cached_continuous_batching_manager = self
            if last and thread is not None and block and not self._pauses[threading.get_ident()]:
                self._join(thread, timeout)  # (a loop this thread holds paused ends once the pause is left)

    def destroy(self) -> None:
        """Stop the thread if it runs; the manager cannot be restarted after this (`start` raises), and a model that
        kept it for its next session forgets it."""
        with self._control:  # (a `stop` or a block's end keeping it checks `destroyed` under the same lock)
            self.destroyed = True
            if self.model.__dict__.get("_cached_continuous_batching_manager") is self:
                del self.model.__dict__["_cached_continuous_batching_manager"]
        if self.is_running():
            self.stop(block=True)
        self.batch_processor = None

    @contextmanager
    def pause(self):
        """Hold the loop between two turns while the caller uses the model (the requests in flight keep their
        slots); several threads may hold it at once."""
        if not self.is_running():
            raise RuntimeError("pause: the manager is not running (call start first).")
        self.background_thread_status.acquire_pause(self._wake_up_loop)
        holder = threading.get_ident()  # (the block may be left in another thread, e.g. by an ExitStack)
        self._pauses[holder] += 1
        try:
            yield
        finally:
            self._pauses[holder] -= 1
            self.background_thread_status.release_pause()

    # --- requests ----------------------------------------------------------------------------------------------

    def add_request(self, input_ids, request_id: str | None = None, max_new_tokens: int | None = None,
                    streaming: bool = False, record_timestamps: bool = False, eos_token_id=None,
                    draft_override=None, **logit_processor_kwargs) -> str | None:
        """Queue one request (see transformers' manager); returns its id. A request that cannot run is delivered
        FAILED at once, with the reason as its error. `logit_processor_kwargs`: `seed` (sampling), nothing else.

        `draft_override` (tests and benchmarks only, a speculative manager): a list or 1-D integer tensor over the
        request's own positions (prompt first, position 0), at most prompt + `max_new_tokens` long; a draft for
        position p becomes `draft_override[p]` where that is >= 0 (-1: the model's own draft). Verification stays
        real, so the tokens do not change; only which drafts are accepted. `ValueError` here when it is malformed."""
        check_arguments(request_id, streaming=streaming, record_timestamps=record_timestamps)
        denial = self.background_thread_status.can_accept_new_requests()
        if denial is not None:
            logger.warning("%s: the request is dropped.", denial)
            return None
        extra = {key: int(value) if is_integer(value) else value for key, value in logit_processor_kwargs.items()}
        ids = token_ids(input_ids)
        max_new = request_max_new(self.settings, ids, int(max_new_tokens) if is_integer(max_new_tokens)
                                  else max_new_tokens)
        problem = None
        try:
            eos = list(self.settings.eos_token_id) if eos_token_id is None else eos_ids(eos_token_id)
        except ValueError as error:
            eos, problem = [], str(error)
        if problem is None and max_new_tokens is None and is_integer(max_new) and max_new < 1:
            problem = (f"max_length={self.settings.max_length} in the generation config leaves no new token after a "
                       f"prompt of {len(ids)} tokens: pass max_new_tokens=..., or raise max_length."
                       if self.settings.max_length is not None else
                       f"the prompt of {len(ids)} tokens fills the model's {self.settings.default_limit} positions, "
                       "where transformers' default length stops: pass max_new_tokens=..., or a shorter prompt.")
        problem = problem or request_problem(self.settings, ids, max_new, eos, extra)
        if not problem and draft_override is not None:
            extra[OVERRIDE] = override_tokens(self.settings, draft_override, len(ids) + max_new)
        request_id = self.new_request_id() if request_id is None else request_id
        state = RequestState(request_id=request_id, initial_tokens=ids if isinstance(ids, list) else [],
                             record_timestamps=record_timestamps, max_new_tokens=max_new, eos_token_id=eos,
                             streaming=streaming, logit_processor_kwargs=extra)
        self.output_router.open(request_id)
        try:
            if problem:
                self.output_router.fail_and_deliver(state, ValueError(f"request {request_id}: {problem}"))
                return request_id
            if not self._past_positions_warned and (warning := past_positions(self.model, len(ids) + max_new)):
                self._past_positions_warned = True  # (once per manager)
                logger.warning(warning)
            self.input_queue.put(state)
        except BaseException:  # Ctrl-C before the put: the id must not stay open with no request behind it
            if all(queued is not state for queued in list(self.input_queue.queue)):
                self.output_router.close(request_id)
            raise
        self._wake_up_loop.set()
        return request_id

    def new_request_id(self) -> str:
        """An id no request of this manager was given by it before ("req_<n>")."""
        with self._request_lock:
            request_id, self._request_counter = f"req_{self._request_counter}", self._request_counter + 1
        return request_id

    def add_requests(self, inputs, max_new_tokens: int | None = None, streaming: bool = False,
                     record_timestamps: bool = False, **logit_processor_kwargs) -> list[str]:
        """`add_request` for each prompt of `inputs`, in order; returns their ids."""
        return [self.add_request(ids, max_new_tokens=max_new_tokens, streaming=streaming,
                                 record_timestamps=record_timestamps, **logit_processor_kwargs) for ids in inputs]

    def cancel_request(self, request_id: str) -> None:
        """Cancel a request, waiting or in flight: it is delivered FAILED with the error "cancelled". An id with no
        open request (unknown, or already delivered) is ignored, also when a later request reuses the id."""
        serial = self.output_router.serial(request_id)
        if serial is not None:
            self.cancel_queue.put((request_id, serial))
            self._wake_up_loop.set()

    # --- the loop ----------------------------------------------------------------------------------------------

    def _run_generation_loop(self) -> None:
        """The loop, under its creator's inference mode and autocast (per thread; the last of `model_signature`)."""
        enabled, dtype = self.model_signature[-1]
        with torch.inference_mode(self._inference_mode), torch.autocast(self.model.device.type, dtype, enabled):
            self._serve()

    def _serve(self) -> None:
        owners: list[RequestState | None] = []
        waiting: deque[RequestState] = deque()
        try:
            slots = self._slots()
            owners = [None] * slots.settings.slots
            for b in range(len(owners)):  # a slot left busy by a hard stop of an earlier session serves no one
                slots.cancel(b)
            while self._loop_body(slots, owners, waiting):
                pass
            if self.background_thread_status.local_status == BackgroundThreadStatus.HARD_STOP:
                self._fail_all(RuntimeError("the manager was stopped (hard_stop) before this request finished"),
                               owners, waiting)
        except Exception as error:  # the loop's own failure: every request still open fails with it
            logger.error("hf_loopspec continuous batching loop failed: %s", error, exc_info=True)
            self._fail_all(error, owners, waiting)
            self.background_thread_status.record_fatal_error(error)
        finally:
            self.background_thread_status.mark_as_stopped()

    def _loop_body(self, slots: SlotBatch, owners: list, waiting: deque) -> bool:
        """One turn of the loop; False once it should end."""
        status = self.background_thread_status.local_status
        if status >= BackgroundThreadStatus.HARD_STOP:
            return False
        if self.background_thread_status.is_pause_requested():
            self.background_thread_status.pause_and_wait()
        self._take_new(waiting)
        self._take_cancellations(slots, owners, waiting)
        for b, owner in enumerate(owners):  # first come, first served: the first waiting request waits for pages
            if owner is None and waiting:
                if not slots.fits(len(waiting[0].initial_tokens), waiting[0].max_new_tokens):
                    break
                self._admit(slots, owners, b, waiting.popleft())
        if not any(owners):
            if status == BackgroundThreadStatus.FLUSH_AND_STOP and self.input_queue.empty():
                return False
            self._wake_up_loop.wait(IDLE_WAIT_S)
            self._wake_up_loop.clear()
            return True
        slots.run(slots.engine.read_every)
        self._harvest(slots, owners)
        return True

    def _take_new(self, waiting: deque) -> None:
        while not self.input_queue.empty():  # (this thread alone takes from it)
            waiting.append(self.input_queue.get_nowait())

    def _take_cancellations(self, slots: SlotBatch, owners: list, waiting: deque) -> None:
        """Cancel the open requests `cancel_request` named: in a slot, or waiting. A cancellation whose request was
        delivered since is dropped (its id may be reused); one whose request is open but not yet in the input queue
        (cancelled from another thread while `add_request` ran) is kept for the next turn."""
        later = []
        while True:
            try:
                request_id, serial = self.cancel_queue.get_nowait()
            except queue.Empty:
                break
            if self.output_router.serial(request_id) != serial:
                continue
            self._take_new(waiting)  # the request, if it was queued after this turn's `_take_new`
            found = [b for b, owner in enumerate(owners) if owner is not None and owner.request_id == request_id]
            for b in found:
                owner, owners[b] = owners[b], None
                slots.cancel(b)
                self.output_router.fail_and_deliver(owner, RuntimeError(CANCELLED))
            states = [s for s in waiting if s.request_id == request_id]
            for state in states:
                waiting.remove(state)
                self.output_router.fail_and_deliver(state, RuntimeError(CANCELLED))
            if not found and not states:
                later.append((request_id, serial))
        for cancellation in later:
            self.cancel_queue.put(cancellation)

    def _admit(self, slots: SlotBatch, owners: list, b: int, state: RequestState) -> None:
        seed = state.logit_processor_kwargs.get("seed")
        if seed is None and self.settings.do_sample:  # from the manager's seed, or torch's global generator
            seed = int(torch.randint(2**62, (), generator=self._seeds))
        try:
            # a config edit since the slots were built (this thread decodes under its creator's autocast)
            if model_signature(self.model, self.settings.recurrence) != self.model_signature:
                raise ValueError(CHANGED_MODEL)
            huginn.fill_initial_states(self.model, self.settings.recurrence, slots.state, b, state, self._seeds)
            slots.admit(b, state.initial_tokens, state.max_new_tokens, sorted(state._eos_token_ids), seed,
                        state.logit_processor_kwargs.get(OVERRIDE))
        except Exception as error:  # this request's own failure (its slot stays free): the others go on
            slots.cancel(b)
            self.output_router.fail_and_deliver(state, error)
            return
        state.status = RequestStatus.PREFILLING
        owners[b] = state

    def _harvest(self, slots: SlotBatch, owners: list) -> None:
        """Deliver what the read-back shows: streaming requests' new tokens, finished requests' results."""
        counts, finished, invalid, tokens = slots.read_back()
        delivered = []
        for b, owner in enumerate(owners):
            if owner is None:
                continue
            new = tokens[b, len(owner.generated_tokens): counts[b]].tolist()
            if new and owner.status == RequestStatus.PREFILLING:
                owner.status = RequestStatus.DECODING
            if owner.record_timestamps:
                owner._timestamps.extend([time.perf_counter()] * len(new))
            owner.generated_tokens.extend(new)
            if finished[b]:
                owners[b] = None
                slots.release(b)
                if invalid[b]:
                    self.output_router.fail_and_deliver(owner, non_finite_error([owner.request_id]))
                    continue
                owner.status = RequestStatus.FINISHED
                delivered.append(owner.to_generation_output())
            elif new and owner.streaming:
                delivered.append(owner.to_generation_output())
        if delivered:
            self.output_router.deliver_batch(delivered)

    def _fail_all(self, error: Exception, owners: list, waiting: deque) -> None:
        self._take_new(waiting)
        for state in [owner for owner in owners if owner is not None] + list(waiting):
            self.output_router.fail_and_deliver(state, error)
        owners[:] = [None] * len(owners)
        waiting.clear()
