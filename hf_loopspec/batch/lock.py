"""The advisory lock that makes one `hf-loopspec batch` run at a time own an output's parts folder.

The lock is `fcntl.flock` on the file `lock` inside `OUT.parts/`, taken without waiting by the run's main process
before anything is loaded, and held until OUT is written (or the run fails). The kernel releases it when the holder
exits in any way, SIGKILL included, so a killed run never leaves a stale lock: the rerun that resumes it simply takes
the lock again. While held, the file records who holds it (pid, host, start time, command line), and a second run on
the same OUT is refused naming that run. The holder removes the folder on release when it holds nothing but the lock,
and then the folders above it that it created (OUT's missing folders) as far as they are empty, so a run that failed
before it recorded its settings leaves nothing behind; a run that locked a file that was removed meanwhile (the
previous holder's cleanup or merge) notices by the inode and locks the new file instead. A folder or lock file that
cannot be made (a folder the user cannot write) is a `ValueError` naming --output and the path.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
from itertools import takewhile
from pathlib import Path

LOCK_NAME = "lock"
NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def _holder() -> bytes:
    """What the lock file records about this run."""
    return json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                       "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                       "command": " ".join(sys.argv)}).encode() + b"\n"


def _describe_holder(fd: int) -> str:
    """The running holder as recorded in its lock file, as text for a message."""
    try:
        holder = json.loads(os.pread(fd, 1 << 16, 0) or b"null")
        return (f"pid {holder['pid']} on {holder['host']}, started {holder['started']}: "
                f"{holder['command']}")
    except (ValueError, TypeError, KeyError, OSError):
        return "it has not recorded its pid yet"


class RunLock:
    """The lock of the parts folder `folder` (see the module docstring); `output` names the run in messages."""

    def __init__(self, folder: Path, output: Path):
        self.folder = folder
        self.output = output
        self.path = folder / LOCK_NAME
        self._fd: int | None = None
        self._created: list[Path] = []  # the folders `acquire` made, the innermost (the parts folder) first

    def acquire(self) -> None:
        """Take the lock, creating the folder (and its missing parents) if needed; `ValueError` naming the holder when
        another run holds it."""
        try:
            import fcntl
        except ImportError:
            raise ValueError("hf-loopspec batch locks its parts folder with POSIX file locks (fcntl), which this "
                             "platform lacks; run it on Linux or macOS.") from None
        self._created = list(takewhile(lambda folder: not folder.exists(), [self.folder, *self.folder.parents]))
        while self._fd is None:
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _describe_holder(fd)
                os.close(fd)
                raise ValueError(f"--output {self.output} is being written by another hf-loopspec batch run "
                                 f"({holder}); wait for it to finish, or stop it and rerun this command to resume "
                                 "its work.") from None
            if self._is_current(fd):
                self._fd = fd
            else:
                os.close(fd)  # removed by the run that held it last: lock the file that is there now
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, _holder(), 0)
        os.fsync(self._fd)

    def _open(self) -> int:
        """The lock file opened (never through a link), made with its missing folders if needed; `ValueError` naming
        --output and the path that could not be made."""
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            return os.open(self.path, os.O_RDWR | os.O_CREAT | NOFOLLOW, 0o644)
        except OSError as err:
            made = os.fsdecode(err.filename or self.folder)
            raise ValueError(f"--output {self.output}: cannot create {made} ({err.strerror}); pass an --output in a "
                             f"folder you can write (the run keeps its parts in {self.folder.name}/ beside it)."
                             ) from None

    def _is_current(self, fd: int) -> bool:
        try:
            return os.stat(self.path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            return False

    def release(self) -> None:
        """Give the lock up; the folder goes too when nothing but the lock is in it (or it is gone already), and so do
        the empty folders above it that `acquire` created."""
        if self._fd is None:
            return
        try:
            if self._is_current(self._fd) and [p.name for p in self.folder.iterdir()] == [LOCK_NAME]:
                self.path.unlink()
                with contextlib.suppress(OSError):  # another run created its lock file (or a file) meanwhile: kept
                    for folder in self._created or [self.folder]:
                        folder.rmdir()
        finally:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
