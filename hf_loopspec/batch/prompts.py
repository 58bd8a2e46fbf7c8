"""The input of `hf-loopspec batch`: a JSONL file of `{"id": ..., "prompt": ...}` rows (or a CSV, JSON or Parquet
file of such rows), read and checked in full before anything is generated, and the length-grouped batches the rows
are decoded in.

Contract of `read_prompts`: every row is a JSON object with an `id` (a string or an integer, unique in the file; a CSV's
cells are all text, ids included, kept as written) and a string that is not only whitespace in the text field (`prompt`
unless `field` says otherwise), and no key twice in one object; no id or prompt may hold half a surrogate pair (an
escape such as `"\\ud800"` without its pair) and an integer must be readable by Python; anything else is a `ValueError`
that names the file, the line (or row) number and the fix. The rows of a file (`readers.file_rows`): the non-blank lines
of JSONL ("line N"); the elements of a `.json` file's one JSON array ("row N", from 1), or the objects it holds one
after another (JSON Lines, or pretty-printed: "line N"); a `.csv` file's records after its header, read with Python's
csv module ("row N"; a header naming a column twice, or a record with more or fewer fields than the header, is refused
naming its line); a `.parquet` file's rows, read with `datasets` ("row N"). A text file that is not UTF-8 is refused
naming the line of the first bad byte; a file without rows is refused.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from ..prompting import check_text
from .readers import file_rows


@dataclass(frozen=True)
class PromptRow:
    where: str  # "FILE, line N" (JSONL) or "FILE, row N" (a JSON array's element, a CSV record), N from 1
    id: str | int
    prompt: str


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


def read_prompts(path: str | Path, field: str = "prompt") -> list[PromptRow]:
    """Every row of `path` in file order, read as its suffix says and checked (see the module docstring)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"PROMPTS {path} is not a file; pass a JSONL file with one {{\"id\", {field!r}}} row a line.")
    rows: list[PromptRow] = []
    first: dict[str, PromptRow] = {}  # id key -> its first row
    for where, row in file_rows(path):
        prompt = _check_row(where, row, field)
        key = id_key(prompt.id)
        if key in first:
            raise ValueError(f"{where}: id {prompt.id!r} was already used on {first[key].where}; ids must be unique.")
        first[key] = prompt
        rows.append(prompt)
    if not rows:
        empty = "is empty (0 bytes)" if path.stat().st_size == 0 else "holds no rows"
        raise ValueError(f"PROMPTS {path} {empty}; give it at least one row such as "
                         f'{{"id": 1, {json.dumps(field)}: "..."}}.')
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
