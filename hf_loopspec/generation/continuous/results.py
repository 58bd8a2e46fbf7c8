"""Reading the results of the continuous batching manager (`manager.LoopBatchingManager`): transformers' manager
API for taking delivered results (`get_result`, iteration, per-request iteration, asyncio handlers), over the
manager's `Router`. Every wait is cut into waits of at most `IDLE_WAIT_S`, so that a loop that ends meanwhile ends the
wait (it delivers nothing more)."""

from __future__ import annotations

import time

from transformers.generation.continuous_batching.requests import GenerationOutput

IDLE_WAIT_S = 0.1  # the longest single wait: of readers for a result, and of the loop for work when no slot is busy


class ResultReading:
    """The reading half of the manager's API; the manager provides `output_router`, `background_thread_status` and
    `is_running`."""

    def get_result(self, request_id: str | None = None, timeout: float | None = None) -> GenerationOutput | None:
        """The oldest delivered result (of `request_id` when given; the others stay queued, in order), waiting up to
        `timeout` seconds (None: without limit) while the thread runs; None when none came, at once when the thread
        is not running (it delivers nothing more)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:  # in waits of at most IDLE_WAIT_S, so that a thread that ends meanwhile ends the wait
            ended = not self.is_running() or self.background_thread_status.fatal_error is not None
            left = IDLE_WAIT_S if deadline is None else min(IDLE_WAIT_S, deadline - time.monotonic())
            result = self.output_router.take(request_id, 0 if ended else max(left, 0))
            if result is not None or ended or (deadline is not None and time.monotonic() >= deadline):
                return result

    def __iter__(self):
        while self.is_running() or not self.output_router.output_queue.empty():
            result = self.get_result(timeout=IDLE_WAIT_S)
            if result is not None:
                yield result

    def request_id_iter(self, request_id: str):
        """The results of `request_id` as they come (streaming: one per read-back with new tokens), up to the final
        one."""
        while self.is_running() or self.output_router.holds(request_id):
            result = self.get_result(request_id=request_id, timeout=IDLE_WAIT_S)
            if result is not None:
                yield result
                if result.is_finished():
                    return

    def register_result_handler(self, request_id: str, callback) -> None:
        """Deliver `request_id`'s results to `callback` on the running asyncio loop (removed after the final one)."""
        import asyncio

        self.output_router.register_handler(request_id, callback, asyncio.get_running_loop())
