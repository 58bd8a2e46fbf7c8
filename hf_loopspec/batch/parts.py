"""The part files of an `hf-loopspec batch` run, kept in `OUT.parts/` beside the output file `OUT`.

Layout: `settings.json` (the input's SHA-256 and every option that changes what is generated) and one
`process-<index>.jsonl` per process, each line one finished output row. Invariants that make a run resumable and
lossless after SIGTERM or SIGKILL at any point:

* a process only appends to its own part file, a batch's rows in one write followed by flush and fsync, so a
  kill can at most leave a *torn last line* (bytes after the last newline), which readers ignore and the owner
  cuts off before appending again;
* an id whose row is in any part file is finished: a restart with the same command skips it (the batch plan does
  not depend on what was finished, so the rows still to do are decoded next to the same rows as in an
  uninterrupted run);
* a restart with other settings or another input is refused, so parts made under different settings never mix;
* the merge writes `OUT` in input order to a temporary file, fsyncs it and renames it over `OUT` (atomic), and
  only then removes `OUT.parts/`; a kill during the merge leaves the parts, and a rerun merges again.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

from .prompts import PromptRow, id_key


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def _complete_lines(path: Path) -> tuple[list[dict], int]:
    """The rows of the complete lines of a part file, and the byte length they span (a torn tail is left out)."""
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    rows = []
    for number, line in enumerate(data[:end].splitlines(), start=1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            raise ValueError(f"part file {path}, line {number}, is not JSON although a later line was written after "
                             "it, so the file was changed by something else; delete it to redo its rows.") from None
    return rows, end


class PartStore:
    """The part files of one run (see the module docstring); `settings` is a JSON-able dict."""

    def __init__(self, output: str | Path, settings: dict, process_index: int):
        output = Path(output)
        self.output = output
        self.dir = output.with_name(output.name + ".parts")
        self.settings = settings
        self.path = self.dir / f"process-{process_index}.jsonl"
        self._settings_path = self.dir / "settings.json"

    def check_settings(self) -> None:
        """`ValueError` when `OUT.parts/` holds an unfinished run made with other settings."""
        if not self._settings_path.is_file():
            return
        stored = json.loads(self._settings_path.read_text(encoding="utf-8"))
        changed = [f"{key}: {stored.get(key)!r} then, {self.settings.get(key)!r} now"
                   for key in sorted(set(stored) | set(self.settings)) if stored.get(key) != self.settings.get(key)]
        if changed:
            raise ValueError(f"{self.dir} holds an unfinished run made with other settings ({'; '.join(changed)}); "
                             f"rerun that command to finish it, or delete {self.dir} to start over.")

    def create(self) -> None:
        """Make `OUT.parts/` and record the settings (main process, before any process writes a part)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        if not self._settings_path.is_file():
            _write_atomic(self._settings_path, json.dumps(self.settings, sort_keys=True) + "\n")

    def part_files(self) -> list[Path]:
        return sorted(self.dir.glob("process-*.jsonl"))

    def finished_ids(self) -> set[str]:
        """The id keys (`id_key`) of every row in any part file, torn last lines excepted."""
        return {id_key(row["id"]) for path in self.part_files() for row in _complete_lines(path)[0]}

    def open(self):
        """This process's part file opened for appending, its torn last line (if any) cut off first."""
        if self.path.is_file():
            os.truncate(self.path, _complete_lines(self.path)[1])
        return self.path.open("a", encoding="utf-8")

    @staticmethod
    def append(handle, rows: Iterable[dict]) -> None:
        """Append one batch's rows in one write, then flush and fsync (a kill tears at most the last line)."""
        handle.write("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
        handle.flush()
        os.fsync(handle.fileno())

    def merge(self, prompts: list[PromptRow]) -> int:
        """Write every prompt's row to OUT in input order (atomically), remove `OUT.parts/`; the number of rows.

        `RuntimeError` when a prompt has no row (a process did not finish): nothing is written then, and a rerun of
        the same command generates what is missing.
        """
        rows = {}
        for path in self.part_files():
            for row in _complete_lines(path)[0]:
                rows.setdefault(id_key(row["id"]), row)
        missing = [p for p in prompts if id_key(p.id) not in rows]
        if missing:
            raise RuntimeError(f"{len(missing)} of {len(prompts)} rows have no output yet (first: id {missing[0].id!r} "
                               f"on {missing[0].where}); rerun the same command to generate them.")
        _write_atomic(self.output, "".join(json.dumps(rows[id_key(p.id)], ensure_ascii=False) + "\n"
                                           for p in prompts))
        shutil.rmtree(self.dir)
        return len(prompts)
