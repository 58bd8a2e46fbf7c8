"""The rows of an `hf-loopspec batch` input file, before their ids and prompts are checked (`prompts.read_prompts`).

Contract of `file_rows(path)`: `(where, row)` for every row in file order, `where` being "PATH, line N" or "PATH, row
N" (N from 1) as the format says:

* JSONL (any suffix but those below): every non-blank line is one JSON value ("line N");
* `.json`: the elements of the one JSON array the file holds ("row N"), or, when it does not start with `[`, the
  JSON values it holds one after another: one a line (JSON Lines), or each over several lines as a pretty-printer
  writes them ("line N": where the value starts); an empty array, and an empty object alone, hold no rows. It is
  read with the json module, so values are as written (no column is coerced to one type);
* `.csv`: the records after the header (the first non-blank record; blank lines, and lines of spaces alone, skipped), as
  `{column: cell}` with every cell the text it holds ("row N"); a header naming a column twice, or a record with more or
  fewer fields than the header (an unquoted comma), is refused naming its line;
* `.parquet`: the rows `datasets` reads ("row N").

No JSON object may give a key twice. Text that is not UTF-8 (a UTF-8 byte-order mark first is dropped), JSON or CSV
that cannot be read, and a Parquet file `datasets` cannot read are each a `ValueError` naming the file, the line or
row where the reader gives one, and the fix; `datasets`' progress bars and log lines are silenced while it reads, so
that the error is the only line.
"""

from __future__ import annotations

import codecs
import contextlib
import csv
import functools
import io
import json
import logging
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path

SPACE = re.compile(r"[ \t\n\r]*")  # JSON's whitespace
LINE_FIX = 'each line must be one JSON object such as {"id": 1, "prompt": "..."}'
JSON_FIX = ('a .json file holds one JSON array of objects such as [{"id": 1, "prompt": "..."}], or one such object '
            "a line")
CSV_FIX = ('put a field that holds a comma, a quote or a line break in double quotes ("def f(a, b):"), its quotes '
           "doubled")
SHOWN = 40  # characters of a CSV field shown in a message
FIELD_LIMIT = 2**31 - 1  # the csv module's largest field (a C long on every platform)


class RepeatedKey(ValueError):
    """A key given twice in one JSON object of the input."""


def _unique_keys(where: str, pairs: list[tuple[str, object]]) -> dict:
    keys = [key for key, _ in pairs]
    if repeated := next((key for i, key in enumerate(keys) if key in keys[:i]), None):
        raise RepeatedKey(f"{where} has the key {repeated!r} twice (JSON readers keep one of them silently); "
                          "keep one.")
    return dict(pairs)


def _syntax_error(where: str, err: json.JSONDecodeError, fix: str) -> ValueError:
    at = f"line {err.lineno}, column {err.colno}" if "\n" in err.doc else f"column {err.colno}"
    return ValueError(f"{where} is not valid JSON ({err.msg} at {at}); {fix}.")


def _decode(where: str, text: str, start: int, fix: str) -> tuple[object, int]:
    """The JSON value at `text[start:]` (whitespace first skipped) and the index just after it. A key given twice in
    one object is a `RepeatedKey`; text JSON does not read, nesting too deep to read and an integer of more digits
    than Python reads are a `ValueError` naming `where` (the fix of bad JSON is `fix`)."""
    decoder = json.JSONDecoder(object_pairs_hook=functools.partial(_unique_keys, where))
    try:
        return decoder.raw_decode(text, SPACE.match(text, start).end())
    except json.JSONDecodeError as err:
        raise _syntax_error(where, err, fix) from None
    except RepeatedKey:
        raise
    except RecursionError:
        raise ValueError(f"{where} nests too deeply to read; {fix}.") from None
    except ValueError as err:  # Python's own limit on an integer's digits (a JSON number of over 4300 of them)
        raise ValueError(f"{where} holds an integer of more digits than Python reads ({err}); write it as a "
                         'string ("...").') from None


def _after(text: str, end: int, where: str, fix: str) -> None:
    """`ValueError` when anything but whitespace follows the JSON value that ends at `text[end]`."""
    if (extra := SPACE.match(text, end).end()) != len(text):
        raise _syntax_error(where, json.JSONDecodeError("Extra data", text, extra), fix)


def utf8_text(path: Path) -> str:
    """The text of `path`, without the byte-order mark an editor may put first (Excel's "CSV UTF-8"); `ValueError`
    naming the line and column (in bytes, the mark not counted) of the first byte that is not UTF-8."""
    data = path.read_bytes().removeprefix(codecs.BOM_UTF8)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line, line_start = data.count(b"\n", 0, err.start) + 1, data.rfind(b"\n", 0, err.start) + 1
        raise ValueError(f"{path}, line {line}, is not UTF-8 text (byte "
                         f"0x{data[err.start]:02x} at byte {err.start - line_start + 1} of the line); save the file "
                         "as UTF-8.") from None


def _lines_rows(path: Path, text: str, fix: str = LINE_FIX) -> Iterator[tuple[str, object]]:
    """(where, value) for every non-blank line of JSON Lines `text` ("line N")."""
    for number, line in enumerate(text.split("\n"), start=1):
        if line.strip():
            where = f"{path}, line {number}"
            value, end = _decode(where, line, 0, fix)
            _after(line, end, where, fix)
            yield where, value


def _array_rows(path: Path, text: str, start: int) -> Iterator[tuple[str, object]]:
    """(where, value) for every element of the JSON array that opens at `text[start]` ("row N", from 1)."""
    index, number = SPACE.match(text, start + 1).end(), 0
    if not text.startswith("]", index):
        while True:
            number += 1
            value, index = _decode(f"{path}, row {number}", text, index, JSON_FIX)
            yield f"{path}, row {number}", value
            index = SPACE.match(text, index).end()
            if not text.startswith(",", index):
                break
            index += 1
        if not text.startswith("]", index):
            raise _syntax_error(f"{path}, after row {number},", json.JSONDecodeError("Expecting ',' delimiter", text,
                                                                                     index), JSON_FIX)
    _after(text, index + 1, f"{path}, after the array,", JSON_FIX)


def _values_rows(path: Path, text: str) -> Iterator[tuple[str, object]]:
    """(where, value) for every JSON value of `text`, one after another (one a line, or each over several lines as a
    pretty-printer writes them), "line N" being the line where the value starts."""
    index, line, counted = SPACE.match(text).end(), 1, 0  # line: the line of text[counted]
    while index < len(text):
        line, counted = line + text.count("\n", counted, index), index
        where = f"{path}, line {line}"
        value, index = _decode(where, text, index, JSON_FIX)
        yield where, value
        index = SPACE.match(text, index).end()


def _json_rows(path: Path) -> Iterator[tuple[str, object]]:
    """(where, value) for every row of a `.json` file (see the module docstring)."""
    text = utf8_text(path)
    start = SPACE.match(text).end()
    if text.startswith("[", start):
        return _array_rows(path, text, start)
    return iter(()) if "".join(text.split()) == "{}" else _values_rows(path, text)


def _shown(fields: list[str]) -> str:
    """CSV fields for a message, each cut to SHOWN characters."""
    return ", ".join(repr(field if len(field) <= SHOWN else field[: SHOWN - 3] + "...") for field in fields)


def _csv_records(path: Path) -> list[tuple[int, list[str]]]:
    """(line where it starts, fields) for every record of a CSV file; a field of any length is read (the csv module
    refuses one over 131,072 characters unless its process-wide limit is raised, as it is here while it reads)."""
    reader = csv.reader(io.StringIO(utf8_text(path), newline=""), strict=True)
    records, line, limit = [], 1, csv.field_size_limit(FIELD_LIMIT)
    try:
        for record in reader:
            records.append((line, record))
            line = reader.line_num + 1
    except csv.Error as err:
        raise ValueError(f"{path}, line {reader.line_num}, cannot be read as CSV ({err}); {CSV_FIX}.") from None
    finally:
        csv.field_size_limit(limit)
    return records


def _csv_rows(path: Path) -> Iterator[tuple[str, dict[str, str]]]:
    """(where, {column: cell}) for every record of a CSV file after its header (see the module docstring)."""
    header, number = None, 0
    for line, record in _csv_records(path):
        if len(record) == 1 and not record[0].strip():  # a line of spaces alone (an editor's): a blank line
            record = []
        if record and header is None:
            if repeated := next((name for i, name in enumerate(record) if name in record[:i]), None):
                raise ValueError(f"{path}, line {line}: the header names the column {repeated!r} twice (a reader "
                                 "keeps one of them silently); rename or remove one.")
            header = record
        elif record:
            number += 1
            if len(record) != len(header):
                raise ValueError(f"{path}, line {line} (row {number}), has {len(record)} field"
                                 f"{'s' * (len(record) != 1)} ({_shown(record)}) where the header has "
                                 f"{len(header)} ({_shown(header)}); {CSV_FIX}.")
            yield f"{path}, row {number}", dict(zip(header, record))


@contextlib.contextmanager
def quiet_logger(name: str, level: int = logging.CRITICAL) -> Iterator[None]:
    """Inside the block the logger `name` (and its children) drops records below `level`."""
    logger = logging.getLogger(name)
    before = logger.level
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.setLevel(before)


@contextlib.contextmanager
def _quiet_datasets(datasets) -> Iterator[None]:
    """No progress bars and no log lines from `datasets` inside the block (its reader errors are raised again as one
    line that names the file; a log line before it would only repeat them)."""
    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        with quiet_logger("datasets"):
            yield
    finally:
        if bars:
            datasets.enable_progress_bars()


def _reader_reason(err: BaseException) -> str:
    """The reader's own error inside the ones `datasets` wraps it in (its `__cause__` chain), as one line."""
    while err.__cause__ is not None:
        err = err.__cause__
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def _parquet_rows(path: Path) -> Iterator[tuple[str, dict]]:
    """(where, row) for every row of a Parquet file, read with `datasets`."""
    try:
        import datasets
    except ImportError:
        raise ValueError(f"reading {path} needs the `datasets` package (pip install datasets); or write the prompts "
                         "as JSONL, one object a line.") from None
    with tempfile.TemporaryDirectory() as cache, _quiet_datasets(datasets):  # the Arrow copy is not kept
        try:
            rows = list(datasets.load_dataset("parquet", data_files=str(path), split="train", cache_dir=cache))
        except Exception as err:  # whatever the reader raises, it is about this file
            raise ValueError(f"PROMPTS {path} cannot be read as PARQUET ({_reader_reason(err)}); fix the file, or "
                             "write the prompts as JSONL, one object a line.") from None
    for number, row in enumerate(rows, start=1):
        yield f"{path}, row {number}", row


def file_rows(path: Path) -> Iterator[tuple[str, object]]:
    """(where, row) for every row of `path`, read as its suffix says (see the module docstring)."""
    reader = {".json": _json_rows, ".csv": _csv_rows, ".parquet": _parquet_rows}.get(path.suffix.lower())
    return reader(path) if reader is not None else _lines_rows(path, utf8_text(path))
