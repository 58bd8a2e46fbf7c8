"""transformers' load report held back while a strict `from_pretrained` decides whether to keep the model.

transformers logs a table of the missing, unexpected and mis-shaped keys (a warning of `transformers.modeling_utils`
headed "LOAD REPORT") and notes that such weights were "newly initialized". When `StrictLoadingMixin.from_pretrained`
then refuses the checkpoint with a `ValueError` that names the same keys, that note contradicts it, and a CLI error
is no longer one line. Inside `held_load_report()` this thread's reports are held; they are logged when the block
ends, unless `drop()` was called (the load was refused for what they say). Other threads' records pass as usual.
"""

from __future__ import annotations

import logging
import threading
from contextlib import contextmanager

LOGGER = "transformers.modeling_utils"
HEADING = "LOAD REPORT"


class HeldReports(logging.Filter):
    """A filter on `LOGGER` that keeps this thread's load reports instead of passing them on."""

    def __init__(self):
        super().__init__()
        self.thread, self.records, self.dropped = threading.get_ident(), [], False

    def filter(self, record: logging.LogRecord) -> bool:  # (runs in the logging thread; `record.thread` may be None)
        if threading.get_ident() == self.thread and HEADING in str(record.msg):
            self.records.append(record)
            return False
        return True

    def drop(self) -> None:
        """Log none of the held reports (the caller raises an error that says what they say)."""
        self.dropped = True


@contextmanager
def held_load_report():
    """Hold this thread's load reports for the block (yields the `HeldReports`), then log them unless dropped."""
    logger, held = logging.getLogger(LOGGER), HeldReports()
    logger.addFilter(held)
    try:
        yield held
    finally:
        logger.removeFilter(held)
        if not held.dropped:
            for record in held.records:
                logger.handle(record)
