"""The input of `hf-loopspec batch`: a JSONL file of `{"id": ..., "prompt": ...}` rows (or a CSV, Parquet or JSON
file that `datasets` reads), read and checked in full before anything is generated, and the length-grouped batches
the rows are decoded in.

Contract of `read_prompts`: every non-blank line is a JSON object with an `id` (a string or an integer, unique in
the file) and a non-empty string in the text field (`prompt` unless `field` says otherwise); anything else is a
`ValueError` that names the file, the line (or row) number and the fix. Blank lines are skipped.
"""

from __future__ import annotations

import json
import random
import tempfile
from dataclasses import dataclass
from pathlib import Path

DATASETS_BUILDERS = {".csv": "csv", ".parquet": "parquet", ".json": "json"}  # other suffixes: JSONL


@dataclass(frozen=True)
class PromptRow:
    where: str  # "FILE, line N" (JSONL) or "FILE, row N" (read with datasets), N from 1
    id: str | int
    prompt: str


def _parse_line(where: str, text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{where} is not valid JSON ({err.msg} at column {err.colno}); each line must be one JSON "
                         'object such as {"id": 1, "prompt": "..."}.') from None


def _check_row(where: str, row, field: str) -> PromptRow:
    if not isinstance(row, dict):
        raise ValueError(f"{where} is a JSON {type(row).__name__}, not an object with an id and a {field!r} field.")
    if "id" not in row:
        raise ValueError(f"{where} has no 'id'; give every row a unique string or integer id.")
    row_id = row["id"]
    if isinstance(row_id, bool) or not isinstance(row_id, (str, int)):
        raise ValueError(f"{where}: id {row_id!r} is a {type(row_id).__name__}; use a string or an integer.")
    if field not in row:
        raise ValueError(f"{where} has no {field!r} field (it has {', '.join(map(repr, row))}); pass --field NAME to "
                         "read the text from another field.")
    prompt = row[field]
    if not isinstance(prompt, str):
        raise ValueError(f"{where}: {field!r} is a {type(prompt).__name__}, not a string.")
    if not prompt.strip():
        raise ValueError(f"{where}: the prompt ({field!r}) is empty; remove the row or give it some text.")
    return PromptRow(where, row_id, prompt)


def _jsonl_rows(path: Path):
    """(where, row) for every non-blank line of a JSONL file."""
    with path.open(encoding="utf-8") as lines:
        for number, text in enumerate(lines, start=1):
            if text.strip():
                where = f"{path}, line {number}"
                yield where, _parse_line(where, text)


def _dataset_rows(path: Path, builder: str):
    """(where, row) for every row of a file that `datasets` reads with `builder` (csv, parquet, json)."""
    try:
        import datasets
    except ImportError:
        raise ValueError(f"reading {path} needs the `datasets` package (pip install datasets); or write the prompts "
                         "as JSONL, one object a line.") from None
    with tempfile.TemporaryDirectory() as cache:  # the Arrow copy is not kept in the user's datasets cache
        rows = list(datasets.load_dataset(builder, data_files=str(path), split="train", cache_dir=cache))
    for number, row in enumerate(rows, start=1):
        yield f"{path}, row {number}", row


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
