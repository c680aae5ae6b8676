"""Ownership by flock: lock files and scratch directories that name their owner and die with it.

One mechanism serves every lock slidekit takes on a file (a run directory's ``run.lock``, a kernel
build's ``<dir>.lock``, a checkpoint writer's ``.writer.lock``, the ``.owner`` of a scratch
directory): an exclusive ``fcntl.flock`` taken without waiting (``try_lock``), an owner record
written in the locked file (``record``: one line, ``<pid> <host> <started unix time>``), read back
for messages (``holder``), and a probe of whether anybody holds a file's lock (``lock_free``). The
kernel drops an flock when its process ends, however it ends (``kill -9`` included), so a held lock
always has a live holder, even where the pid has since been reused.

A process that keeps large files in a directory other runs share (a file-backed tier's region files
in ``engine.offload_dir``, an export assembled beside its target) creates them in a directory of its
own that says who owns it::

    <prefix><pid>-<random>/     made by ``OwnedDir.create(parent, prefix)``
      .owner                    the owner record; the owner holds an flock on it for its life

so a later start tells a dead owner's leftovers (the lock is free) from a live run's directory (the
lock is held). ``reclaim(parent, prefix)`` removes the dead owners' directories and reports the
others; it never removes a directory whose lock is held, one that another host created, or one it
cannot identify. A directory from before this protocol (no ``.owner``) counts as dead only when the
pid in its name is not running and it holds nothing but region files (``NNNNNN-*.bin``).

Test: ``pytest tests/test_leftovers.py tests/test_run_dir.py tests/plugins/test_build_lock.py``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

try:
    import fcntl
except ImportError:  # not POSIX: require_flock says so when a lock is needed
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "OWNER_FILE",
    "Leftover",
    "OwnedDir",
    "Owner",
    "describe",
    "holder",
    "lock_free",
    "pid_of",
    "read_owner",
    "reclaim",
    "record",
    "require_flock",
    "scan",
    "try_lock",
]

OWNER_FILE = ".owner"
#: ``<prefix><pid>-<random>``: the pid and tempfile's 8-character random part end every owned name.
_NAME_TAIL = re.compile(r"-?(\d+)-([a-z0-9_]{8})$")
_REGION_FILE = re.compile(r"^\d{6}-.*\.bin$")
_RECORD_BYTES = 512  # an owner record is one short line


# ---------------------------------------------------------------------- locks and owner records


def require_flock() -> None:
    """OSError unless this platform has POSIX file locks (``fcntl``)."""
    if fcntl is None:
        raise OSError(f"slidekit's locks need POSIX file locks (fcntl), which {sys.platform} lacks")


def try_lock(fd: int) -> bool:
    """Take an exclusive flock on ``fd`` without waiting; False while another open file holds it."""
    require_flock()
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:  # EWOULDBLOCK / EAGAIN: another open file description holds it
        return False
    return True


def record(fd: int) -> None:
    """Write this process's owner record (``<pid> <host> <started>``) into the file ``fd`` holds locked."""
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()} {socket.gethostname()} {time.time():.3f}\n".encode(), 0)


@dataclass(frozen=True, slots=True)
class Owner:
    """An owner record as read back: what its writer said of itself (fields it left out are None)."""

    pid: int | None
    host: str | None
    started: float | None = None

    def label(self) -> str:
        """``pid 123 on host h`` (``pid unknown`` without a pid)."""
        pid = f"pid {self.pid}" if self.pid is not None else "pid unknown"
        return pid + (f" on host {self.host}" if self.host else "")


def _parse(text: str) -> Owner | None:
    if text.lstrip().startswith("{"):  # the JSON .owner files written before the one-line record
        try:
            doc = json.loads(text)
        except ValueError:
            return None
        if not isinstance(doc, dict):
            return None
        pid, host, started = doc.get("pid"), doc.get("host"), doc.get("started")
        return Owner(
            pid if isinstance(pid, int) and not isinstance(pid, bool) else None,
            host if isinstance(host, str) else None,
            float(started) if isinstance(started, int | float) and not isinstance(started, bool) else None,
        )
    words = text.split()
    if not words or not words[0].isdigit():
        return None
    started = None
    if len(words) > 2:
        with contextlib.suppress(ValueError):
            started = float(words[2])
    return Owner(int(words[0]), words[1] if len(words) > 1 else None, started)


def read_owner(where: int | str | os.PathLike[str]) -> Owner | None:
    """The owner record in a lock file (an open descriptor or a path); None when it holds none."""
    try:
        if isinstance(where, int):
            raw = os.pread(where, _RECORD_BYTES, 0)
        else:
            with open(where, "rb") as f:
                raw = f.read(_RECORD_BYTES)
    except OSError:
        return None
    return _parse(raw.decode("utf-8", "replace"))


def holder(fd: int) -> str | None:
    """Who holds the lock on ``fd``, as its holder recorded it (``pid 123 on host h``); None: not recorded."""
    owner = read_owner(fd)
    return owner.label() if owner is not None else None


def lock_free(path: str | os.PathLike[str]) -> bool | None:
    """Whether nobody holds the flock of ``path`` (a file or a directory); None: it cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return try_lock(fd)
    finally:
        os.close(fd)  # our descriptor's lock goes with it; an owner's never does


# ---------------------------------------------------------------------- owned directories


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
            if not try_lock(fd):  # a file this process just made: nobody else can hold it
                raise OSError(f"cannot lock {tmp}: another process holds a file it has just created")
            record(fd)
            os.rename(tmp, os.path.join(path, OWNER_FILE))
        except BaseException:
            if fd is not None:
                os.close(fd)
            shutil.rmtree(path, ignore_errors=True)
            raise
        return cls(path, fd)

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


def _owner(path: Path, pid: int | None) -> tuple[str, int | None]:
    owner_file = path / OWNER_FILE
    if owner_file.exists():
        recorded = read_owner(owner_file)
        if recorded is not None:
            pid = recorded.pid if recorded.pid is not None else pid
            if (recorded.host or socket.gethostname()) != socket.gethostname():
                return "unknown", pid  # another machine's process: its flock says nothing here
        free = lock_free(owner_file)
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


def pid_of(name: str, prefix: str) -> int | None:
    """The pid in an owned directory's name ``<prefix>...<pid>-<random>``; None for any other name."""
    if not name.startswith(prefix):
        return None
    m = _NAME_TAIL.search(name[len(prefix) :])
    return int(m.group(1)) if m else None


def scan(parent: str | os.PathLike[str], prefix: str) -> list[Leftover]:
    """Every directory in ``parent`` named ``<prefix>...<pid>-<random>``, with its owner's state."""
    parent = Path(parent)
    if not parent.is_dir():
        return []
    found = []
    for entry in sorted(parent.iterdir()):
        pid = pid_of(entry.name, prefix)
        if pid is None or not entry.is_dir() or entry.is_symlink():
            continue
        owner, pid = _owner(entry, pid)
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
