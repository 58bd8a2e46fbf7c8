"""Result routing of the continuous batching manager (`manager.LoopBatchingManager`): transformers' `OutputRouter`
with results taken by request id, and the requests that are open (added and not yet delivered finished or failed),
each with a serial, so that a cancellation reaches only the request that was open when it was made."""

from __future__ import annotations

import threading
import time

from transformers.generation.continuous_batching.continuous_api import OutputRouter
from transformers.generation.continuous_batching.requests import GenerationOutput, RequestStatus


class Router(OutputRouter):
    """transformers' `OutputRouter`, whose deliveries without a handler are queued under its lock (so a handler
    registered meanwhile finds them: `take_queued`), and taken from the queue by request id without disturbing the
    others (`take`): a reader waiting for one request never requeues another's results, so each request's results
    stay in delivery order and no reader spins. Results of an abandoned request are dropped (`abandon`)."""

    def __init__(self):
        super().__init__()
        self.open_ids: dict[str, int] = {}  # the requests added and not yet delivered finished or failed: serials
        self._opened = 0  # serials of opens: a reused id gets a new one
        self.abandoned: set[str] = set()  # open requests whose results nobody will read: dropped on delivery
        self._arrived = threading.Condition()  # notified after every delivery to the queue

    def open(self, request_id: str) -> None:
        """Note `request_id` as added; `ValueError` when a request of that id is still open."""
        with self._lock:
            if request_id in self.open_ids:
                raise ValueError(f"request_id={request_id!r} is already waiting or in flight on this manager: give "
                                 "each request its own id (or none: the manager numbers them).")
            self._opened += 1
            self.open_ids[request_id] = self._opened

    def close(self, request_id: str) -> None:
        """Note `request_id` as no longer open without a delivery (its request was never queued)."""
        with self._lock:
            self.open_ids.pop(request_id, None)

    def register_handler(self, request_id: str, callback, loop) -> None:
        """Deliver `request_id`'s results to `callback` on the asyncio `loop`, those delivered before included (a
        request refused by `add_request`); the handler is removed after the final result."""
        def handle(result):
            callback(result)
            if result.is_finished() or result.status == RequestStatus.FAILED:
                with self._lock:
                    self.result_handlers.pop(request_id, None)

        with self._lock:
            self.result_handlers[request_id] = (handle, loop)
            early = self.take_queued(request_id)
        for result in early:
            loop.call_soon(handle, result)

    def serial(self, request_id: str) -> int | None:
        """The serial of the open request of id `request_id`, or None when none is open."""
        with self._lock:
            return self.open_ids.get(request_id)

    def deliver(self, output: GenerationOutput) -> None:
        self.deliver_batch([output])

    def deliver_batch(self, outputs: list[GenerationOutput]) -> None:
        callbacks = []  # (transformers' routing, with the drop of abandoned results in the same hold of the lock)
        with self._lock:
            for output in outputs:
                final = output.is_finished() or output.status == RequestStatus.FAILED
                if final:
                    self.open_ids.pop(output.request_id, None)
                if output.request_id in self.abandoned:
                    if final:
                        self.abandoned.discard(output.request_id)
                elif (entry := self.result_handlers.get(output.request_id)) is not None:
                    callbacks.append((entry, output))
                else:
                    self.output_queue.put(output)
        for (callback, loop), output in callbacks:
            loop.call_soon_threadsafe(callback, output)
        with self._arrived:  # after the puts: a reader that found nothing is waiting by now, or finds them
            self._arrived.notify_all()

    def abandon(self, request_id: str) -> bool:
        """Drop `request_id`'s queued results and those still to come (its reader stopped waiting, e.g. on Ctrl-C);
        True when the request is still open, so that the caller cancels it (its final result ends the drops)."""
        with self._lock:  # (deliveries hold it too: a result is queued before this, or dropped after it)
            still_open = request_id in self.open_ids
            if still_open:
                self.abandoned.add(request_id)
            self.take_queued(request_id)
        return still_open

    def take(self, request_id: str | None, timeout: float | None) -> GenerationOutput | None:
        """The oldest queued result (of `request_id` when given), waiting up to `timeout` seconds (None: without
        limit) for one to be delivered; None when none came."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._arrived:
            while (result := self._pop(request_id)) is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._arrived.wait(left)
        return result

    def take_queued(self, request_id: str) -> list[GenerationOutput]:
        """Take `request_id`'s queued results out of the output queue, in order, leaving the others'."""
        taken = []
        while (result := self._pop(request_id)) is not None:
            taken.append(result)
        return taken

    def holds(self, request_id: str) -> bool:
        """Whether a result of `request_id` is queued."""
        with self.output_queue.mutex:
            return any(result.request_id == request_id for result in self.output_queue.queue)

    def _pop(self, request_id: str | None) -> GenerationOutput | None:
        """Remove and return the oldest queued result (of `request_id` when given), or None."""
        waiting = self.output_queue
        with waiting.mutex:
            for i, result in enumerate(waiting.queue):
                if request_id is None or result.request_id == request_id:
                    del waiting.queue[i]
                    return result
        return None
