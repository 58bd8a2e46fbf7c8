"""Write a folder beside its destination and move it into place only when it is complete.

`staged_folder(out)` yields a new, empty folder `.OUT.<random>.partial` next to `out` (same file system). When the
`with` block ends normally, the staged folder takes `out`'s place by renames: a reader of `out` sees the previous
folder, then for an instant no folder, then the new complete one; never a mix. Entries of the previous `out` whose
names start with "." (`.git`, `.gitattributes`, `.cache`) are moved into the new folder, and every other entry of
the previous `out` is deleted with it: nothing of a previous write survives, so a stale weights file or index cannot
sit beside new ones. Symlinks inside the previous `out` are removed (or moved, when hidden) as links, never followed,
so nothing outside `out` is written or deleted.

When the block raises (or the rename fails), the staged folder is removed, any parent folders created for it are
removed again, and `out` is exactly as it was. A process killed mid-write leaves only the hidden `.partial` folder.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def staged_folder(out: str | Path) -> Iterator[Path]:
    """Yield an empty folder to write into; it replaces `out` on success (see the module docstring)."""
    out = check_destination(out, overwrite=True)
    created = _make_parents(out.parent)
    stage = _unique(out, "partial")
    stage.mkdir(mode=0o777)  # the umask applies, as for any folder the user creates
    try:
        yield stage
        _replace(stage, out)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        for folder in reversed(created):
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise


def check_destination(out: str | Path, *, overwrite: bool) -> Path:
    """`out` as an absolute path, or an error when it cannot be replaced safely: `ValueError` for a symlink (its
    target lies outside the path given), `FileExistsError` for a file, or for a non-empty folder unless
    `overwrite`."""
    out = Path(os.path.abspath(out))
    if out.is_symlink():
        raise ValueError(f"{out} is a symlink; pass the folder it points to ({os.path.realpath(out)}) or a new path.")
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} exists and is not a folder; pass a new or empty folder.")
    if not overwrite and out.is_dir() and any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty; pass --overwrite (overwrite=True) to replace its contents, or a "
                              "new folder.")
    return out


def _unique(out: Path, suffix: str) -> Path:
    return out.parent / f".{out.name}.{secrets.token_hex(4)}.{suffix}"


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
    """Move `stage` to `out`; the previous `out` (if any) gives its hidden entries to `stage` and is deleted."""
    if not os.path.lexists(out):
        os.rename(stage, out)
        return
    old = _unique(out, "old")
    os.rename(out, old)
    moved = []
    try:
        for entry in sorted(old.iterdir()):
            if entry.name.startswith(".") and not os.path.lexists(stage / entry.name):
                os.rename(entry, stage / entry.name)
                moved.append(entry.name)
        os.rename(stage, out)
    except BaseException:  # put the previous folder back as it was
        for name in moved:
            os.rename(stage / name, old / name)
        os.rename(old, out)
        raise
    shutil.rmtree(old)


__all__ = ["check_destination", "staged_folder"]
