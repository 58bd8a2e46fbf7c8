"""Write a folder beside its destination and move it into place only when it is complete.

`staged_folder(out)` yields a new, empty folder `.OUT.<random>.partial` next to `out` (same file system). When the
`with` block ends normally, the staged entries move into `out` by renames. A new `out` is the staged folder renamed;
an existing `out` stays the same folder (its permissions, a shell or process whose working folder it is): its entries
are first moved aside into `.OUT.<random>.old`, then the staged ones moved in, so a reader of `out` never sees a
previous file beside a new one (for an instant it sees part of one set). Entries whose names start with "." (`.git`,
`.gitattributes`, `.cache`) stay, unless the staged folder holds one of the same name; every other previous entry is
deleted: nothing of a previous write survives, so a stale weights file or index cannot sit beside new ones. Symlinks
inside the previous `out` are moved and removed as links, never followed, so nothing outside `out` is written or
deleted.

When the block raises (or a rename fails), the staged folder is removed, any parent folders created for it are
removed again, and `out` is exactly as it was. A process killed mid-write leaves only the hidden `.partial` folder
(killed while moving entries, `out` partly replaced and a `.old` folder of its previous entries), and the next
`staged_folder` for the same `out` removes them: a writer holds an exclusive `flock` on its staged folder while it
writes, and on `out` while it moves entries, so a `.partial` folder whose lock can be taken, or a `.old` folder
while `out`'s can, has no live writer (one still being written, by a concurrent export, is left alone). Where
`fcntl` is missing (Windows) stale folders are left in place. (`OUT` in these names is `out`'s name, or for a name
of over 200 bytes its start and a digest of it: the names stay within a file system's 255, `_prefix`.)
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from ..input_checks import file_in_the_way

try:
    import fcntl
except ImportError:  # no flock (Windows): stale staged folders are not detected
    fcntl = None


@contextlib.contextmanager
def staged_folder(out: str | Path) -> Iterator[Path]:
    """Yield an empty folder to write into; it replaces `out` on success (see the module docstring)."""
    out = check_destination(out, overwrite=True)
    created = _make_parents(out.parent)
    remove_stale_stages(out)
    stage = _unique(out, "partial")
    stage.mkdir(mode=0o777)  # the umask applies, as for any folder the user creates
    with _locked(stage):
        try:
            yield stage
            _replace(stage, out)
        except BaseException:
            shutil.rmtree(stage, ignore_errors=True)
            for folder in reversed(created):
                with contextlib.suppress(OSError):
                    folder.rmdir()
            raise


def remove_stale_stages(out: Path) -> list[Path]:
    """Remove the `.OUT.*.partial` and `.OUT.*.old` folders beside `out` that no live writer holds (module
    docstring); returns them."""
    if fcntl is None or not out.parent.is_dir():
        return []
    removed = []
    for suffix, holder in (("partial", None), ("old", out)):
        ours = re.compile(re.escape(_prefix(out)) + r"[0-9a-f]{8}\." + suffix)  # (never another OUT's)
        for stage in sorted(path for path in out.parent.iterdir() if ours.fullmatch(path.name)):
            locked = holder or stage  # a `.old` folder's writer locks `out`
            if stage.is_symlink() or not stage.is_dir() or locked.is_symlink() or not locked.is_dir():
                continue
            fd = os.open(locked, os.O_RDONLY)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # a live writer holds it
                continue
            else:
                shutil.rmtree(stage, ignore_errors=True)
                removed.append(stage)
            finally:
                os.close(fd)
    return removed


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """Hold an exclusive flock on `folder` (a no-op without fcntl)."""
    if fcntl is None:
        yield
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def check_destination(out: str | Path, *, overwrite: bool) -> Path:
    """`out` as an absolute path, or an error when it cannot be replaced safely: `ValueError` for a path below a file
    or a symlink (its target lies outside the path given), `FileExistsError` for a file, or for a non-empty folder
    unless `overwrite`; `ValueError` for an `out` that is no path; those of `check_writable`."""
    if not isinstance(out, (str, os.PathLike)) or not str(out):
        raise ValueError(f"out={out!r}: give the path of the folder to write (a new or empty folder).")
    out = Path(os.path.abspath(out))
    if (blocking := file_in_the_way(out)) is not None:
        raise ValueError(f"{out}: {blocking} is a file, not a folder; pass a path in a folder.")
    if out.is_symlink():
        raise ValueError(f"{out} is a symlink; pass the folder it points to ({os.path.realpath(out)}) or a new path.")
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} exists and is not a folder; pass a new or empty folder.")
    if not overwrite and out.is_dir() and any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty; pass --overwrite (overwrite=True) to replace its contents, or a "
                              "new folder.")
    check_writable(out)
    return out


def check_writable(out: Path) -> None:
    """An error naming `out` when the export could not write it, found by doing what it will do with an empty
    folder (permissions alone do not tell, e.g. for root on /proc): make one beside `out` (in the nearest folder that
    exists), and when `out` is a folder move it in and remove it. `OSError` when either fails, `ValueError` when the
    move crosses file systems (`out` is a mount point, e.g. a container's volume)."""
    folder = out.parent
    while not folder.exists():
        folder = folder.parent
    place = folder
    try:
        probe = Path(tempfile.mkdtemp(prefix=_prefix(out), suffix=".probe", dir=folder))
        try:
            if out.is_dir():
                place = out
                os.rename(probe, out / probe.name)
                probe = out / probe.name
        finally:
            probe.rmdir()
    except OSError as error:
        if error.errno == errno.EXDEV:
            raise ValueError(f"{out} is a mount point: export writes beside OUT and moves the files in, which cannot "
                             f"cross file systems; pass a folder inside it, e.g. {out / 'model'}.") from None
        raise OSError(f"{out}: cannot write in {place} ({error.strerror or error}); pass an OUT in a folder you can "
                      "write to.") from None


def _prefix(out: Path) -> str:
    """The start of the names of `out`'s staged and previous-entry folders (module docstring): `.OUT.`, a name of
    over 200 bytes (file systems count bytes) cut to at most 180 and a digest of the whole (names that share their
    start stay apart)."""
    name = os.fsencode(out.name)
    if len(name) > 200:
        name = name[:180].decode("utf-8", "ignore").encode() + b"~" + hashlib.sha1(name).hexdigest()[:16].encode()
    return f".{os.fsdecode(name)}."


def _unique(out: Path, suffix: str) -> Path:
    return out.parent / f"{_prefix(out)}{secrets.token_hex(4)}.{suffix}"


def _make_parents(folder: Path) -> list[Path]:
    """Create `folder` and its missing parents; returns the folders created, outermost first."""
    missing = []
    while not folder.exists():
        missing.append(folder)
        folder = folder.parent
    for path in reversed(missing):
        path.mkdir()
    return list(reversed(missing))


def _replace(stage: Path, out: Path) -> None:
    """Move `stage`'s entries into `out` and delete `out`'s previous ones but the hidden entries `stage` lacks (the
    module docstring); a new `out` is `stage` renamed. On failure `out` is put back as it was."""
    if not os.path.lexists(out):
        os.rename(stage, out)
        return
    with _locked(out):  # two exports to one existing `out` take turns: never a mix of both
        old = _unique(out, "old")
        old.mkdir()
        aside, placed = [], []
        try:
            for entry in sorted(out.iterdir()):
                if not entry.name.startswith(".") or os.path.lexists(stage / entry.name):
                    os.rename(entry, old / entry.name)
                    aside.append(entry.name)
            for entry in sorted(stage.iterdir()):
                os.rename(entry, out / entry.name)
                placed.append(entry.name)
        except BaseException:  # put the previous entries back
            for name in placed:
                os.rename(out / name, stage / name)
            for name in aside:
                os.rename(old / name, out / name)
            old.rmdir()
            raise
        shutil.rmtree(old)
        stage.rmdir()


__all__ = ["check_destination", "remove_stale_stages", "staged_folder"]
