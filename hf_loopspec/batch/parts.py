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
* a restart with other settings, another input or other weights is refused, so parts made under different settings
  never mix; a `settings.json` that does not parse is refused naming the file;
* one run at a time owns `OUT.parts/` (`lock.RunLock`): a second run on the same OUT is refused up front;
* the merge writes `OUT` in input order to a temporary file, fsyncs it and renames it over `OUT` (atomic), and
  only then removes `OUT.parts/`: renamed first to a temporary folder beside it, then deleted, so that a kill leaves
  either the whole parts folder (a rerun merges again, removing the temporary file the killed merge left beside OUT)
  or none (OUT is finished, and a rerun is refused as for any existing OUT; the next merge to OUT removes the
  temporary folder);
* no file is written through a symbolic link: OUT, `OUT.parts/` or anything in it being a link is refused up front,
  part and lock files are opened with `O_NOFOLLOW`, and every temporary file is made by `tempfile.mkstemp` in the
  target's folder (exclusive creation under an unpredictable name) and renamed over the target.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

from ..input_checks import file_in_the_way
from .lock import NOFOLLOW, RunLock
from .prompts import PromptRow, id_key

SETTINGS_NAME = "settings.json"
TEMPORARY_SUFFIX = ".tmp"


def _write_atomic(path: Path, text: str) -> None:
    """`text` as the new content of `path`, by rename: a new temporary file beside it (see the module docstring),
    fsynced, renamed over `path`, and removed again when anything fails before the rename."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=TEMPORARY_SUFFIX)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # the mode a plain open() would give, not mkstemp's private 0600
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def temporaries(path: Path, folders: bool = False) -> list[Path]:
    """The temporary files that `_write_atomic(path, ...)` makes or, with `folders`, the temporary folders that the
    removal of the parts folder `path` makes (`PartStore.merge`), left behind by a kill (links among them too)."""
    pattern = f".{glob.escape(path.name)}.*{TEMPORARY_SUFFIX}"
    return [entry for entry in path.parent.glob(pattern) if entry.is_symlink() or entry.is_dir() == folders]


def refuse_link(path: Path, role: str, fix: str) -> None:
    """`ValueError` naming `path` (the `role` it plays) and `fix` when `path` is a symbolic link."""
    if path.is_symlink():
        raise ValueError(f"{role} {path} is a symbolic link (to {os.readlink(path)}); hf-loopspec batch does not "
                         f"write through links: {fix}.")


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


def _difference(key: str, then, now) -> str:
    """How a setting changed, for a message; of a dict (the weights' fingerprint) only the entries that changed."""
    if isinstance(then, dict) and isinstance(now, dict):
        return "; ".join(f"{key} {name}: {then.get(name)!r} then, {now.get(name)!r} now"
                         for name in sorted(set(then) | set(now)) if then.get(name) != now.get(name))
    return f"{key}: {then!r} then, {now!r} now"


class OtherSettingsError(ValueError):
    """An unfinished run made with other settings; `keys`: the entries of its dict settings it names (a checkpoint's
    generation config keys, which the CLI leaves as they are, not spelled as its options)."""

    def __init__(self, message: str, keys=()):
        super().__init__(message)
        self.keys = tuple(keys)


class PartStore:
    """The part files of one run (see the module docstring); `settings` is a JSON-able dict, and `names` says how a
    message names its keys (the command's options; a key it lacks: as it is)."""

    def __init__(self, output: str | Path, settings: dict, process_index: int, names: dict[str, str] | None = None):
        output = Path(output)
        self.output = output
        self.dir = output.with_name(output.name + ".parts")
        self.settings, self.names = settings, names or {}
        self.path = self.dir / f"process-{process_index}.jsonl"
        self._settings_path = self.dir / SETTINGS_NAME

    def lock(self) -> RunLock:
        """The run's lock on `OUT.parts/` (a context manager; the main process holds it for the whole run)."""
        return RunLock(self.dir, self.output)

    def check_paths(self) -> None:
        """`ValueError` when OUT, `OUT.parts/` or anything in it is a symbolic link, `OUT.parts` is a file, or OUT
        exists without an unfinished run's `OUT.parts/` (a finished run's output, or any other file: never
        overwritten)."""
        refuse_link(self.output, "--output", "pass the path the link points to, or remove the link")
        if (blocking := file_in_the_way(self.output)) is not None:
            raise ValueError(f"--output {self.output}: {blocking} is a file, not a folder; pass a path in a folder.")
        if self.output.exists() and not self.dir.exists():
            raise ValueError(f"--output {self.output} exists (a finished run's output, or another file), and "
                             "hf-loopspec batch does not overwrite it: delete it, or pass another --output.")
        refuse_link(self.dir, "the parts folder", f"remove the link (the parts of a run must be a real folder beside "
                                                  f"{self.output.name}), or pass another --output")
        if self.dir.exists() and not self.dir.is_dir():
            raise ValueError(f"{self.dir} is a file, where hf-loopspec batch keeps the parts of an unfinished run; "
                             "move it away, or pass another --output.")
        for entry in sorted(self.dir.iterdir()) if self.dir.is_dir() else ():
            refuse_link(entry, "the part folder's entry", f"remove it, or delete {self.dir} to start over")

    def check_settings(self, unknown: tuple[str, ...] = ()) -> None:
        """`ValueError` when `OUT.parts/` holds an unfinished run made with other settings, or settings that cannot
        be read; keys in `unknown` (not known yet in this process) are not compared, nor keys of this run that the
        unfinished one did not record (an older hf_loopspec's run)."""
        stored = self._stored_settings()
        if stored is None:
            return
        keys = [key for key in sorted(set(stored) | set(self.settings))
                if key not in unknown and key in stored and stored[key] != self.settings.get(key)]
        if keys:
            changed = "; ".join(_difference(self.names.get(key, key), stored[key], self.settings.get(key))
                                for key in keys)
            entries = {name for key in keys for value in (stored[key], self.settings.get(key))
                       if isinstance(value, dict) for name in value}
            raise OtherSettingsError(f"{self.dir} holds an unfinished run made with other settings ({changed}); "
                                     f"rerun that command to finish it, or delete {self.dir} to start over.", entries)

    def _stored_settings(self) -> dict | None:
        """The settings recorded in `OUT.parts/`, None when there is no unfinished run; `ValueError` naming the file
        and the fix when they cannot be read, or when part files have no settings beside them."""
        if not self._settings_path.is_file():
            if self.dir.is_dir() and self.part_files():
                raise ValueError(f"{self.dir} holds part files but no {SETTINGS_NAME} (the settings they were made "
                                 f"with); restore it, or delete {self.dir} to start over.")
            return None
        try:
            stored = json.loads(self._settings_path.read_bytes())
            problem = None if isinstance(stored, dict) else f"a JSON {type(stored).__name__}, not an object"
        except ValueError as err:  # JSON syntax or UTF-8
            problem = f"{type(err).__name__}: {' '.join(str(err).split())}"
        if problem is not None:
            raise ValueError(f"{self._settings_path} is corrupt ({problem}); it records the settings of the unfinished "
                             f"run in {self.dir}: restore it, or delete {self.dir} to start over.")
        return stored

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
        """This process's part file opened for appending (never through a link), its torn last line cut off first."""
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | NOFOLLOW, 0o666)
        os.ftruncate(fd, _complete_lines(self.path)[1])
        return os.fdopen(fd, "a", encoding="utf-8")

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
        for stale in temporaries(self.output):  # of a merge killed before its rename; the lock keeps others out
            stale.unlink()
        for stale in temporaries(self.dir, folders=True):  # of a merge killed while it removed the parts
            if stale.is_symlink():
                stale.unlink()
            else:
                shutil.rmtree(stale)
        _write_atomic(self.output, "".join(json.dumps(rows[id_key(p.id)], ensure_ascii=False) + "\n"
                                           for p in prompts))
        removed = tempfile.mkdtemp(dir=self.dir.parent, prefix=f".{self.dir.name}.", suffix=TEMPORARY_SUFFIX)
        os.replace(self.dir, removed)  # one step from "OUT and its parts" to "OUT alone" (see the module docstring)
        shutil.rmtree(removed)
        return len(prompts)
