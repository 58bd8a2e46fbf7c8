"""The progress bar of an `hf-loopspec batch` run: the whole run's rows, from every process.

The processes share nothing but the part files, and every finished row is in one of them (appended and fsynced a
batch at a time), so the main process reads the rows that appear there: each part file from where it last stopped,
complete lines only (a line being written is read on the next poll). It polls after each of its own batches and,
with several processes, once a second in a thread until every process is done (it keeps counting while it waits for
the others). The bar counts rows out of all rows (those finished by an earlier run included), and its postfix gives
the run's new tokens per second and the acceptance rate of the speculative modes, both over every process's rows.
"""

from __future__ import annotations

import json
import sys
import threading
import time

from .parts import PartStore

POLL_SECONDS = 1.0


class RunProgress:
    """A tqdm bar over every process's part files (see the module docstring); a no-op unless `enabled`.

    `total` is the number of rows of the run and `done` the rows an earlier run finished; the part files are read
    from their sizes when the bar starts (`__enter__`), so only rows written since then are counted again.
    """

    def __init__(self, store: PartStore, total: int, done: int, *, enabled: bool, poll_thread: bool):
        self.store = store
        self.total, self.done = total, done
        self.enabled, self.poll_thread = enabled, poll_thread
        self.rows = self.tokens = self.accepted = self.verified = 0
        self._offsets: dict[str, int] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._bar = None

    def __enter__(self) -> RunProgress:
        if not self.enabled:
            return self
        from tqdm.auto import tqdm

        # past each file's last newline: a torn last line left by a killed run is cut off before its owner appends
        self._offsets = {path.name: path.read_bytes().rfind(b"\n") + 1 for path in self.store.part_files()}
        self._start = time.perf_counter()
        self._bar = tqdm(total=self.total, initial=self.done, desc="rows", unit="row", file=sys.stderr)
        if self.poll_thread:
            self._thread = threading.Thread(target=self._poll_until_stopped, name="batch-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is None:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.poll()
        self._bar.close()

    def _poll_until_stopped(self) -> None:
        while not self._stop.wait(POLL_SECONDS):
            self.poll()

    def poll(self) -> None:
        """Count the rows written to any part file since the last poll and show them."""
        if self._bar is None:
            return
        with self._lock:
            new = [row for path in self.store.part_files() for row in self._new_rows(path)]
            if not new:
                return
            self.rows += len(new)
            self.tokens += sum(row["new_tokens"] for row in new)
            self.accepted += sum(row.get("speculation", {}).get("accepted", 0) for row in new)
            self.verified += sum(row.get("speculation", {}).get("verified", 0) for row in new)
            postfix = {"tok/s": f"{self.tokens / (time.perf_counter() - self._start):.1f}"}
            if self.verified:
                postfix["accepted"] = f"{self.accepted / self.verified:.1%}"
            self._bar.set_postfix(postfix, refresh=False)
            self._bar.update(len(new))

    def _new_rows(self, path) -> list[dict]:
        """The complete lines of `path` past its offset, parsed; the offset moves past them."""
        start = self._offsets.get(path.name, 0)
        try:
            with path.open("rb") as handle:
                handle.seek(start)
                data = handle.read()
        except FileNotFoundError:  # the merge removed the parts
            return []
        end = data.rfind(b"\n") + 1
        self._offsets[path.name] = start + end
        return [json.loads(line) for line in data[:end].splitlines()]
