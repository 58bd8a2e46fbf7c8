"""The input of `hf-loopspec batch`: a JSONL file of `{"id": ..., "prompt": ...}` rows (or a CSV, Parquet or JSON
file that `datasets` reads), read and checked in full before anything is generated, and the length-grouped batches
the rows are decoded in.

Contract of `read_prompts`: every non-blank line is a JSON object with an `id` (a string or an integer, unique in the
file; a CSV's cells are all text, ids included, kept as written) and a string that is not only whitespace in the text
field (`prompt` unless `field` says otherwise), and no key twice in one object; no text may hold half a surrogate pair
(an escape such as `"\\ud800"` without its pair; in a `.json` file, checked before `datasets` reads it, which drops it)
and an integer must be readable by Python; anything else is a `ValueError` that names the file, the line (or row) number
and the fix. Blank lines are skipped. A text file (JSONL, CSV, JSON) that is not UTF-8 is refused naming the line of the
first bad byte; a file `datasets` cannot read is refused naming the file and the reader's reason (its row or line when
the reader gives one), with `datasets`' progress bars and log lines silenced while it reads, so that the error is the
only line.
"""

from __future__ import annotations

import codecs
import contextlib
import csv
import json
import logging
import random
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ..prompting import check_text

DATASETS_BUILDERS = {".csv": "csv", ".parquet": "parquet", ".json": "json"}  # other suffixes: JSONL


@dataclass(frozen=True)
class PromptRow:
    where: str  # "FILE, line N" (JSONL) or "FILE, row N" (read with datasets), N from 1
    id: str | int
    prompt: str


class RepeatedKey(ValueError):
    """A key given twice in one JSON object of the input."""


def _parse_line(where: str, text: str):
    def unique_keys(pairs: list[tuple[str, object]]) -> dict:
        keys = [key for key, _ in pairs]
        if repeated := next((key for i, key in enumerate(keys) if key in keys[:i]), None):
            raise RepeatedKey(f"{where} has the key {repeated!r} twice (JSON readers keep one of them silently); "
                              "keep one.")
        return dict(pairs)

    try:
        return json.loads(text, object_pairs_hook=unique_keys)
    except json.JSONDecodeError as err:
        raise ValueError(f"{where} is not valid JSON ({err.msg} at column {err.colno}); each line must be one JSON "
                         'object such as {"id": 1, "prompt": "..."}.') from None
    except RepeatedKey:
        raise
    except RecursionError:
        raise ValueError(f"{where} nests too deeply to read; each line must be one JSON object such as "
                         '{"id": 1, "prompt": "..."}.') from None
    except ValueError as err:  # Python's own limit on an integer's digits (a JSON number of over 4300 of them)
        raise ValueError(f"{where} holds an integer of more digits than Python reads ({err}); write it as a "
                         'string ("...").') from None



def _kind(value) -> str:
    """What `value` is, in JSON's words: "an array", "a number (3.5)", "null", ..."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"a boolean ({json.dumps(value)})"
    if isinstance(value, (int, float)):
        return f"a number ({value!r})"
    return {list: "an array", dict: "an object", str: "a string"}.get(type(value), f"a {type(value).__name__}")


def _check_row(where: str, row, field: str) -> PromptRow:
    if not isinstance(row, dict):
        raise ValueError(f"{where} is {_kind(row)}, not an object with an id and a {field!r} field.")
    if "id" not in row:
        raise ValueError(f"{where} has no 'id'; give every row a unique string or integer id.")
    row_id = row["id"]
    if isinstance(row_id, bool) or not isinstance(row_id, (str, int)):
        raise ValueError(f"{where}: the id is {_kind(row_id)}; use a string or an integer.")
    if isinstance(row_id, str):  # (written to the output file as UTF-8 after the row is decoded)
        check_text(row_id, f"the id on {where}", escaped=True)
    if field not in row:
        raise ValueError(f"{where} has no {field!r} field (it has {', '.join(map(repr, row))}); pass --field NAME to "
                         "read the text from another field.")
    prompt = row[field]
    if not isinstance(prompt, str):
        raise ValueError(f"{where}: {field!r} is {_kind(prompt)}, not a string.")
    if not prompt.strip():
        raise ValueError(f"{where}: the prompt ({field!r}) is empty or only whitespace; remove the row or give it "
                         "some text.")
    check_text(prompt, f"the prompt on {where}", escaped=True)
    return PromptRow(where, row_id, prompt)


def _utf8_text(path: Path) -> str:
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


def _jsonl_rows(path: Path):
    """(where, row) for every non-blank line of a JSONL file."""
    for number, text in enumerate(_utf8_text(path).split("\n"), start=1):
        if text.strip():
            where = f"{path}, line {number}"
            yield where, _parse_line(where, text)


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


def _dataset_rows(path: Path, builder: str):
    """(where, row) for every row of a file that `datasets` reads with `builder` (csv, parquet, json)."""
    try:
        import datasets
    except ImportError:
        raise ValueError(f"reading {path} needs the `datasets` package (pip install datasets); or write the prompts "
                         "as JSONL, one object a line.") from None
    if path.stat().st_size == 0:
        raise ValueError(f"PROMPTS {path} is empty (0 bytes).")
    if builder != "parquet":
        text = _utf8_text(path)  # names the line of a bad byte; the readers would not
        if builder == "json":
            _check_json_escapes(path, text)
    options = _csv_as_text(path, datasets) if builder == "csv" else {}
    with tempfile.TemporaryDirectory() as cache, _quiet_datasets(datasets):  # the Arrow copy is not kept
        try:
            rows = list(datasets.load_dataset(builder, data_files=str(path), split="train", cache_dir=cache,
                                              **options))
        except Exception as err:  # whatever the reader raises, it is about this file
            raise ValueError(f"PROMPTS {path} cannot be read as {builder.upper()} ({_reader_reason(err)}); fix the "
                             "file, or write the prompts as JSONL, one object a line.") from None
    for number, row in enumerate(rows, start=1):
        yield f"{path}, row {number}", row


def _check_json_escapes(path: Path, text: str) -> None:
    """`ValueError` naming the row (a JSON array) or line (JSON Lines) of a string that holds half a surrogate pair
    (an escape such as `\\ud800` without its pair), which `datasets`' reader drops without a word; a file neither
    form reads is left to the reader's error."""
    rows, unit = [], "row"
    try:
        data = json.loads(text)
        rows = list(enumerate(data, start=1)) if isinstance(data, list) else [(None, data)]
    except (ValueError, RecursionError):  # JSON Lines (a line no JSON reader reads is left to the reader's error)
        unit = "line"
        for number, line in enumerate(text.split("\n"), start=1):
            if line.strip():
                with contextlib.suppress(ValueError, RecursionError):
                    rows.append((number, json.loads(line)))
    for number, row in rows:
        with contextlib.suppress(RecursionError):  # (nested too deeply to walk: the reader's error)
            for value in _strings(row):
                check_text(value, f"a text on {path}" + (f", {unit} {number}" if number else ""), escaped=True)


def _strings(value) -> Iterator[str]:
    """Every string in a JSON value, keys included."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield key
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


def _csv_as_text(path: Path, datasets) -> dict:
    """`load_dataset` options that read every CSV cell as the text it holds: a CSV has no types, and guessed ones
    would turn the id "007" into 7 (then equal to a "7") and a prompt "0042" into a number; an empty cell is ""."""
    with path.open(newline="", encoding="utf-8-sig") as handle:  # (the reader drops a byte-order mark too)
        header = next(csv.reader(handle), [])
    return {"features": datasets.Features({name: datasets.Value("string") for name in header}),
            "keep_default_na": False, "na_filter": False}


def read_prompts(path: str | Path, field: str = "prompt") -> list[PromptRow]:
    """Every row of `path` in file order, checked as the module docstring says: a JSONL file, or a CSV, Parquet or
    JSON file read with `datasets` (its rows are numbered from 1 in the messages, as "row N")."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"PROMPTS {path} is not a file; pass a JSONL file with one {{\"id\", {field!r}}} row a line.")
    builder = DATASETS_BUILDERS.get(path.suffix.lower())
    rows: list[PromptRow] = []
    first: dict[str, PromptRow] = {}  # id key -> its first row
    for where, row in _jsonl_rows(path) if builder is None else _dataset_rows(path, builder):
        prompt = _check_row(where, row, field)
        key = id_key(prompt.id)
        if key in first:
            raise ValueError(f"{where}: id {prompt.id!r} was already used on {first[key].where}; ids must be unique.")
        first[key] = prompt
        rows.append(prompt)
    if not rows:
        raise ValueError(f"PROMPTS {path} holds no rows.")
    return rows


def id_key(row_id: str | int) -> str:
    """A hashable key that keeps the id 1 and the id "1" apart (their JSON text)."""
    return json.dumps(row_id)


def plan_batches(lengths: list[int], batch_size: int) -> list[list[int]]:
    """Row indices grouped into batches of at most `batch_size` rows of similar length (less padding).

    Rows are sorted by (length, index) and cut into consecutive batches; the batches are then put in a fixed
    pseudo-random order, so that the consecutive shards `accelerate` hands to each process get a similar mix of
    lengths. The plan depends only on `lengths` and `batch_size`, never on the number of processes or on what a
    previous run finished: a row is decoded in the same batch, next to the same rows, in every run.
    """
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    random.Random(0).shuffle(batches)
    return batches
