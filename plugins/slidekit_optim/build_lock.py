"""A build lock that cannot go stale, around ``torch.utils.cpp_extension`` builds of one directory.

torch guards an extension's build directory with a ``FileBaton``: a file
named ``lock`` in that directory, created with ``O_EXCL`` when a build (or a
load of a cached build) starts and removed when it ends. A process killed
meanwhile (``kill -9``, the OOM killer, a lost node) never removes it, and
every later ``cpp_extension.load`` of that directory then sleeps forever in
``FileBaton.wait()``, printing nothing.

``exclusive_build(directory)`` takes slidekit's own lock first: an exclusive
``fcntl.flock`` on the file ``<directory>.lock`` beside the build directory
(``slidekit.owned``: the lock and owner record every slidekit lock uses).
The OS drops a flock when the holder's file descriptor closes, which happens
when the process ends however it ends, so a held lock always has a live
holder (the descriptor is not inheritable: a compiler the build starts does
not keep it). While another live process holds it, the caller waits, saying
on stderr what it waits for (the lock file, the holder's pid and host as
recorded in it), and gives up after ``timeout`` seconds with
``BuildLockTimeout``, which names the lock and what to do.
``build_timeout()`` reads that bound from ``SLIDEKIT_BUILD_TIMEOUT``
(seconds; default ``DEFAULT_TIMEOUT_S``).

Every slidekit build of the directory runs under this lock, so a torch
``lock`` file that its holder finds was left by a build that died: it is
removed (and said so on stderr) before torch runs. Two exceptions, which
Linux can see in ``/proc`` and which are waited for within the same bound
first: a process that holds torch's lock file open is a live torch build
that does not take slidekit's lock (an older slidekit sharing the cache, or
another tool); a process running in the build directory is the ninja or
compiler of a build whose Python process alone was killed, still finishing
the file it compiles. Elsewhere (no ``/proc``) the takeover assumes that
only slidekit builds in these directories, as their names (a hash of the
kernel source, flags, torch and Python) suggest.

POSIX only (``fcntl``); elsewhere ``exclusive_build`` raises ``OSError``
saying so, and the optimizers fall back to pure torch as for any failed build.

Test: ``pytest tests/plugins/test_build_lock.py``.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from slidekit import owned

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "ENV_TIMEOUT",
    "TORCH_LOCK",
    "BuildLockTimeout",
    "HeldLock",
    "build_timeout",
    "exclusive_build",
    "lock_path",
]

#: The environment variable bounding the wait for another process's build, in seconds.
ENV_TIMEOUT: Final = "SLIDEKIT_BUILD_TIMEOUT"
#: A build takes ~30-60 s on two busy cores; five minutes leaves room for a slow machine.
DEFAULT_TIMEOUT_S: Final = 300.0
#: The name of torch's ``FileBaton`` file inside a build directory (torch.utils.cpp_extension).
TORCH_LOCK: Final = "lock"

_POLL_S = 0.25  # between attempts to take a lock another process holds
_USERS_POLL_S = 1.0  # between looks at the processes still at work on a build (a walk over /proc)


class BuildLockTimeout(TimeoutError):
    """Another live process held the build lock for longer than the timeout; the message says who and what to do."""


@dataclass(frozen=True, slots=True)
class HeldLock:
    """What ``exclusive_build`` found on its way in."""

    path: Path  # slidekit's lock file, beside the build directory
    waited_s: float  # seconds until it was held: waiting for other processes, if any, included
    stale: Path | None  # the torch lock file a dead build left behind, now removed; None if there was none


def lock_path(directory: Path) -> Path:
    """slidekit's lock file for a build directory: ``<directory>.lock``, beside it."""
    return directory.with_name(directory.name + ".lock")


def build_timeout() -> float:
    """Seconds to wait for another process's build: ``SLIDEKIT_BUILD_TIMEOUT``, else ``DEFAULT_TIMEOUT_S``."""
    raw = os.environ.get(ENV_TIMEOUT, "").strip()
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (value >= 0 and math.isfinite(value)):
        raise ValueError(
            f"{ENV_TIMEOUT}={raw!r} is not valid: give the seconds to wait for another process's kernel "
            f"build as a number >= 0 (default {DEFAULT_TIMEOUT_S:.0f}), or unset it"
        )
    return value


class _Deadline:
    """A wait's bound: ``limit`` seconds from now."""

    def __init__(self, limit: float) -> None:
        self.limit = limit
        self.start = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def passed(self) -> bool:
        return self.elapsed() >= self.limit

    def sleep(self, most: float) -> None:
        time.sleep(max(0.0, min(most, self.limit - self.elapsed())))


def _say(message: str) -> None:
    print(f"slidekit: {message}", file=sys.stderr, flush=True)


def _holder(fd: int) -> str:
    """Who holds the lock, as its holder recorded it ("pid 123 on host h"), or a sentence saying it is unknown."""
    return owned.holder(fd) or "a process that has not recorded its pid yet"


def _acquire(fd: int, path: Path, what: str, deadline: _Deadline, say: Callable[[str], None]) -> None:
    """Take the flock on ``fd``, waiting for its holder until ``deadline``."""
    if owned.try_lock(fd):
        return
    say(
        f"waiting for {_holder(fd)} to finish building {what} (lock {path}); "
        f"giving up after {deadline.limit:g} s ({ENV_TIMEOUT})"
    )
    while not owned.try_lock(fd):
        if deadline.passed():
            raise BuildLockTimeout(
                f"gave up after {deadline.elapsed():.1f} s waiting for the build lock {path} of {what}, "
                f"held by {_holder(fd)}, which is still running. Let it finish and run again, stop that "
                f"process if it hangs, or wait longer with {ENV_TIMEOUT}=SECONDS (now {deadline.limit:g}); "
                "`slidekit build` compiles the kernels ahead of time"
            )
        deadline.sleep(_POLL_S)


# --------------------------------------------------------------------------- torch's lock file


def _users(directory: Path, torch_lock: Path) -> list[str]:
    """Other live processes still at work on a build, one sentence each; [] where there is no ``/proc``.

    A process is at work when it holds torch's lock file open (a torch build
    that does not take slidekit's lock: an older slidekit, another tool) or runs
    in the build directory (ninja or the compiler of a build whose Python
    process alone was killed: they finish the file they compile).
    """
    lock, inside = os.path.realpath(torch_lock), os.path.realpath(directory)
    me, found = os.getpid(), []
    try:
        entries = [e.name for e in os.scandir("/proc") if e.name.isdigit() and int(e.name) != me]
    except OSError:
        return []
    for pid in entries:
        base = f"/proc/{pid}"
        cwd = _readlink(f"{base}/cwd")
        if not cwd:  # gone, or another user's: not ours to wait for
            continue
        why = "runs in the build directory" if cwd == inside or cwd.startswith(inside + os.sep) else ""
        if not why:
            with suppress(OSError):
                if any(_readlink(f"{base}/fd/{fd}") == lock for fd in os.listdir(f"{base}/fd")):
                    why = f"holds {torch_lock.name!r} open without slidekit's lock (an older slidekit?)"
        if why:
            comm = _read_text(f"{base}/comm") or "?"
            found.append(f"pid {pid} ({comm}) {why}")
    return found


def _readlink(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return ""


def _clear_torch_lock(
    directory: Path, what: str, deadline: _Deadline, say: Callable[[str], None]
) -> Path | None:
    """Make sure no stale torch lock file is left in ``directory``; the one removed, if any.

    Called holding slidekit's lock, so no slidekit build is at work there. A
    torch lock file left there is stale unless a process still holds it open or
    works in the directory (Linux can tell): those are waited for until the
    deadline; then what is left is removed.
    """
    torch_lock = directory / TORCH_LOCK
    announced = False
    while torch_lock.exists() and (users := _users(directory, torch_lock)):
        if not announced:
            say(
                f"waiting for {'; '.join(users)}: the build of {what} there is not finished "
                f"(torch's lock {torch_lock}); giving up after {deadline.limit:g} s ({ENV_TIMEOUT})"
            )
            announced = True
        if deadline.passed():
            raise BuildLockTimeout(
                f"gave up after {deadline.elapsed():.1f} s waiting for torch's build lock {torch_lock} of "
                f"{what}: {'; '.join(users)}. Let it finish and run again, stop it if it hangs, or wait "
                f"longer with {ENV_TIMEOUT}=SECONDS (now {deadline.limit:g})"
            )
        deadline.sleep(_USERS_POLL_S)
    try:
        torch_lock.unlink()
    except FileNotFoundError:
        return None
    say(
        f"removed the stale build lock {torch_lock} of {what}, left by a build that was killed; building again"
    )
    return torch_lock


@contextmanager
def exclusive_build(
    directory: Path | str,
    *,
    what: str,
    timeout: float | None = None,
    say: Callable[[str], None] = _say,
) -> Iterator[HeldLock]:
    """Hold the build lock of ``directory`` for the block: the only slidekit build there, with no stale lock.

    ``what`` names the thing built, for messages. ``timeout`` bounds the whole
    wait, for a live holder of the lock and for processes still at work on a
    killed build (None: ``build_timeout()``); past it ``BuildLockTimeout``.
    ``say`` receives the messages (default: stderr, prefixed "slidekit: ").
    ``OSError`` when the lock file cannot be made or locked (or there is no
    ``fcntl`` here).
    """
    owned.require_flock()
    directory = Path(directory)
    limit = build_timeout() if timeout is None else timeout
    if not limit >= 0:
        raise ValueError(f"timeout must be >= 0 seconds or None ({ENV_TIMEOUT}), got {timeout}")
    deadline = _Deadline(limit)
    path = lock_path(directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # not inheritable (PEP 446): children never hold it
    try:
        _acquire(fd, path, what, deadline, say)
        owned.record(fd)
        directory.mkdir(parents=True, exist_ok=True)
        stale = _clear_torch_lock(directory, what, deadline, say)
        held = HeldLock(path=path, waited_s=deadline.elapsed(), stale=stale)
        try:
            yield held
        finally:
            os.ftruncate(fd, 0)  # the next holder records itself; until then, nobody claims it
    finally:
        os.close(fd)  # releases the flock
