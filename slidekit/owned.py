"""Scratch directories that name their owner, and the leftovers of owners that died.

A process that keeps large files in a directory other runs share (a file-backed tier's region files
in ``engine.offload_dir``, an export assembled beside its target) creates them in a directory of its
own that says who owns it::

    <prefix><pid>-<random>/     made by ``OwnedDir.create(parent, prefix)``
      .owner                    {"pid", "host", "started"}; the owner holds an flock on it for its life

The kernel drops an flock when its process ends, however it ends (``kill -9`` included), so a later
start tells a dead owner's leftovers (the lock is free) from a live run's directory (the lock is
held), even where the pid has since been reused. ``reclaim(parent, prefix)`` removes the dead
owners' directories and reports the others; it never removes a directory whose lock is held, one
that another host created, or one it cannot identify. A directory from before this protocol (no
``.owner``) counts as dead only when the pid in its name is not running and it holds nothing but
region files (``NNNNNN-*.bin``).

Test: ``pytest tests/test_leftovers.py``.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Leftover", "OwnedDir", "describe", "reclaim", "scan"]

OWNER_FILE = ".owner"
#: ``<prefix><pid>-<random>``: the pid and tempfile's 8-character random part end every owned name.
_NAME_TAIL = re.compile(r"-?(\d+)-([a-z0-9_]{8})$")
_REGION_FILE = re.compile(r"^\d{6}-.*\.bin$")


class OwnedDir:
    """A directory this process owns (see the module docstring); ``release`` ends the ownership.

    Remove (or rename) the directory before calling ``release``, so no scan ever finds it
    unlocked while it still holds this process's files.
    """

    def __init__(self, path: str, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    @classmethod
    def create(cls, parent: str | os.PathLike[str], prefix: str) -> OwnedDir:
        """Make ``<parent>/<prefix><pid>-<random>/`` and its locked ``.owner`` file."""
        path = tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=parent)
        fd = None
        try:
            # Locked and filled under another name, then renamed: a scan that finds .owner finds it locked.
            tmp = os.path.join(path, f"{OWNER_FILE}.tmp")
            fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            doc = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
            os.write(fd, json.dumps(doc).encode())
            os.rename(tmp, os.path.join(path, OWNER_FILE))
        except BaseException:
            if fd is not None:
                os.close(fd)
            shutil.rmtree(path, ignore_errors=True)
            raise
        return cls(path, fd)

    def disown(self) -> None:
        """Delete the ``.owner`` file (the lock stays held until ``release``): for a directory about to
        be renamed into a place where it must not carry it, such as a finished export."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(self.path, OWNER_FILE))

    def release(self) -> None:
        """Drop the lock (idempotent)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


@dataclass(frozen=True, slots=True)
class Leftover:
    """A directory of the owned kind found by ``scan``, and whether its owner lives."""

    path: Path
    pid: int | None
    owner: str  # "dead", "alive" or "unknown" (another host, unreadable, not recognisably ours)
    nbytes: int  # disk space its files take

    def label(self) -> str:
        pid = f"pid {self.pid}" if self.pid is not None else "pid unknown"
        return f"{self.path.name} ({pid}, {self.owner}, {self.nbytes / 2**30:.2f} GiB)"


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def _lock_free(owner_file: Path) -> bool | None:
    """Whether nobody holds ``owner_file``'s flock (None: the file cannot be opened)."""
    try:
        fd = os.open(owner_file, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)  # our descriptor's lock goes with it; an owner's never does
    return True


def _owner(path: Path, pid: int | None) -> tuple[str, int | None]:
    owner_file = path / OWNER_FILE
    if owner_file.exists():
        try:
            doc = json.loads(owner_file.read_text() or "{}")
        except (OSError, ValueError):
            doc = {}
        pid = doc.get("pid", pid)
        if doc.get("host", socket.gethostname()) != socket.gethostname():
            return "unknown", pid  # another machine's process: its flock says nothing here
        free = _lock_free(owner_file)
        return {True: "dead", False: "alive", None: "unknown"}[free], pid
    # No .owner: the owner's first instant, a directory being renamed away, or one from before .owner.
    if pid is None or _alive(pid):
        return ("alive" if pid is not None else "unknown"), pid
    try:
        names = os.listdir(path)
    except OSError:
        return "unknown", pid
    ours = all(_REGION_FILE.match(n) or n == f"{OWNER_FILE}.tmp" for n in names)
    return ("dead" if ours else "unknown"), pid


def _disk_bytes(path: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
    return total


def scan(parent: str | os.PathLike[str], prefix: str) -> list[Leftover]:
    """Every directory in ``parent`` named ``<prefix>...<pid>-<random>``, with its owner's state."""
    parent = Path(parent)
    if not parent.is_dir():
        return []
    found = []
    for entry in sorted(parent.iterdir()):
        if not entry.name.startswith(prefix) or not entry.is_dir() or entry.is_symlink():
            continue
        m = _NAME_TAIL.search(entry.name[len(prefix) :])
        if m is None:
            continue
        owner, pid = _owner(entry, int(m.group(1)))
        found.append(Leftover(path=entry, pid=pid, owner=owner, nbytes=_disk_bytes(entry)))
    return found


def reclaim(parent: str | os.PathLike[str], prefix: str) -> tuple[list[Leftover], list[Leftover]]:
    """Remove the directories of dead owners in ``parent`` (see ``scan``); return (removed, kept)."""
    removed, kept = [], []
    for item in scan(parent, prefix):
        if item.owner == "dead":
            shutil.rmtree(item.path, ignore_errors=True)
            if not item.path.exists():
                removed.append(item)
                continue
            item = Leftover(path=item.path, pid=item.pid, owner="dead, not removable", nbytes=item.nbytes)
        kept.append(item)
    return removed, kept


def describe(items: list[Leftover]) -> str:
    """``3.20 GiB: a (pid 1, dead, ...), b (...)`` for notes and error messages."""
    total = sum(i.nbytes for i in items)
    return f"{total / 2**30:.2f} GiB: " + ", ".join(i.label() for i in items)
