"""The package's loggers, obtained through transformers (`transformers.utils.logging.get_logger`), so that
transformers' verbosity governs hf_loopspec's messages as well as its own.

`get_logger(__name__)` returns the standard logger of that name (all of them under "hf_loopspec", so
`logging.getLogger("hf_loopspec")` configures the package's output in one place) with a filter that drops records
below transformers' verbosity: `transformers.logging.set_verbosity_error()` or `TRANSFORMERS_VERBOSITY=error`
silences hf_loopspec's warnings exactly as it silences transformers'. A message meant to appear once per process
goes through `logger.warning_once` (transformers' method, on every logger once transformers is imported).
"""

from __future__ import annotations

import logging

from transformers.utils import logging as transformers_logging


def at_transformers_verbosity(record: logging.LogRecord) -> bool:
    """Keep `record` when its level is at least transformers' current verbosity."""
    return record.levelno >= transformers_logging.get_verbosity()


def get_logger(name: str) -> logging.Logger:
    """The logger `name`, filtered by transformers' verbosity (see the module docstring)."""
    logger = transformers_logging.get_logger(name)
    if at_transformers_verbosity not in logger.filters:
        logger.addFilter(at_transformers_verbosity)
    return logger


__all__ = ["at_transformers_verbosity", "get_logger"]
