"""Checkpoint directories on disk: writer locks, temporary directories, retention, full-disk errors.

See ``slidekit.checkpoint`` for the commit protocol these implement.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
import time
from pathlib import Path

from slidekit import owned
from slidekit.atomic import fsync_path, rename_aside, write_synced
from slidekit.checkpoint._format import _LOCK, _STEP_DIR, CheckpointError, _step_name

_STALE_UNLOCKED_S = 60.0  # a .tmp-* dir without a lock file is a writer's only before its first instant
# Checkpoints renamed aside (``atomic.rename_aside``) to be deleted: by retention, and when a save replaces one.
_DELETING, _REPLACED = ".tmp-delete-", ".tmp-replaced-"
_DOOMED = (_DELETING, _REPLACED)


def _cleanup_tmp(directory: Path) -> list[Path]:
    """Remove ``.tmp-*`` directories that no live writer owns (left by crashes, kills or failed saves).

    ``.tmp-delete-*`` (retention) and ``.tmp-replaced-*`` (``overwrite``) directories are checkpoints
    renamed aside to be deleted, never work in progress: they go at once, whatever their age. A
    ``.tmp-step-*`` directory goes once its writer's lock is free, or, before the writer took the lock,
    once it is older than a minute. Returns the directories removed.
    """
    removed = []
    for entry in sorted(directory.glob(".tmp-*")):
        if not entry.is_dir():
            continue
        if not entry.name.startswith(_DOOMED):
            free = owned.lock_free(entry / _LOCK)  # None: no lock file (yet)
            if free is False or (free is None and time.time() - entry.stat().st_mtime < _STALE_UNLOCKED_S):
                continue
        shutil.rmtree(entry, ignore_errors=True)
        if not entry.exists():
            removed.append(entry)
    return removed


def _remove_checkpoint(path: Path) -> None:
    # A crash from here on leaves a .tmp-* dir, never a half-deleted step-*.
    aside = rename_aside(path, _DELETING)
    shutil.rmtree(aside, ignore_errors=True)


def _step_dirs(directory: Path) -> list[tuple[int, Path]]:
    if not directory.is_dir():
        return []
    found = []
    for entry in directory.iterdir():
        m = _STEP_DIR.match(entry.name)
        if m and entry.is_dir():
            found.append((int(m.group(1)), entry))
    return sorted(found)


def _make_tmp(directory: Path, step: int) -> tuple[Path, int]:
    while True:
        tmp = directory / f".tmp-{_step_name(step)}-{secrets.token_hex(4)}"
        try:
            tmp.mkdir()
            break
        except FileExistsError:
            continue
    fd = os.open(tmp / _LOCK, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o644)
    # Held, with our owner record, for the write: tells _cleanup_tmp (any process) this directory is alive.
    if not owned.try_lock(fd):  # a file in a directory this process just made: nobody else holds it
        os.close(fd)
        raise OSError(f"cannot lock {tmp / _LOCK}: another process holds a file it has just created")
    owned.record(fd)
    return tmp, fd


def step_dirs(directory: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """Every ``step-*`` directory in ``directory`` as ``(step, path)``, oldest first (damaged ones too)."""
    return _step_dirs(Path(directory))


def step_dir(directory: str | os.PathLike[str], step: int) -> Path:
    """Where checkpoint ``step`` lives (or would live) in ``directory``."""
    return Path(directory) / _step_name(step)


def remove_leftovers(directory: str | os.PathLike[str]) -> list[Path]:
    """Remove what crashed or killed writers left in ``directory`` (``.tmp-*`` directories no live writer
    owns: interrupted saves, and checkpoints a kill caught mid-deletion); return what was removed."""
    directory = Path(directory)
    return _cleanup_tmp(directory) if directory.is_dir() else []


def set_aside(path: str | os.PathLike[str], kind: str, reason: str) -> Path:
    """Rename checkpoint ``path`` to ``<kind>-step-N-<UTC time>`` beside it, with ``<KIND>.txt`` inside
    saying why, so that no resume takes it and the run can write step N again. Returns the new path.

    Nothing is deleted: the data stays for a person to inspect (and delete)."""
    path = Path(path)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    aside = path.with_name(f"{kind}-{path.name}-{stamp}")
    while aside.exists():
        aside = path.with_name(f"{kind}-{path.name}-{stamp}-{secrets.token_hex(2)}")
    os.rename(path, aside)
    fsync_path(path.parent, directory=True)
    with contextlib.suppress(OSError):  # the note is a courtesy: a damaged directory may refuse it
        note = f"set aside by slidekit at {stamp}: {reason}\nDelete this directory once inspected.\n"
        write_synced(aside / f"{kind.upper()}.txt", note.encode())
    return aside


def quarantine(path: str | os.PathLike[str], reason: str) -> Path:
    """Move damaged checkpoint ``path`` aside to ``damaged-step-N-<UTC time>`` (``set_aside``)."""
    return set_aside(path, "damaged", reason)


def save_error(
    step: int, where: str, nbytes: int, exc: BaseException, directory: Path, keep: int | None
) -> CheckpointError:
    """The error of a failed save of ``nbytes``, with the fix: a full disk says how much was needed."""
    text = f"{type(exc).__name__}: {exc}"
    code = getattr(exc, "errno", None)
    if code in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) or any(
        s in text for s in ("No space left", "quota", "File too large")
    ):
        hint = _space_hint(nbytes, directory, keep)
    elif code in (errno.EACCES, errno.EPERM, errno.EROFS) or any(
        s in text for s in ("Permission denied", "Read-only file system")
    ):
        hint = f"make {directory} writable by this process"
    else:
        hint = "see the chained exception"
    err = CheckpointError(
        f"checkpoint step {step} was not saved: {text} (while {where}). Fix: {hint}. The partial "
        "write was removed; earlier checkpoints are untouched"
    )
    err.__cause__ = exc
    return err


def _space_hint(nbytes: int, directory: Path, keep: int | None) -> str:
    free = None
    with contextlib.suppress(OSError):
        free = shutil.disk_usage(directory if directory.is_dir() else directory.parent).free
    have = "" if free is None else f", {free / 2**30:.2f} GiB are free there"
    hint = f"free space where {directory} lives (a checkpoint takes {nbytes / 2**30:.2f} GiB{have})"
    fewer = fewer_checkpoints(keep, "keep")
    if fewer is not None:
        return f"{hint}, or {fewer}"
    return f"{hint}, or put the run directory on a larger disk (keep=1 still needs room for 2 checkpoints)"


def fewer_checkpoints(keep: int | None, option: str) -> str | None:
    """What the retention setting ``option`` (now ``keep``) can do for a run directory short of room:
    "keep fewer checkpoints (run.keep=3 now)"; None with ``keep=1``, which cannot go lower (the newest
    is deleted only after the next one is committed)."""
    if keep is None:
        return f"bound the checkpoints kept ({option}=None keeps every one)"
    if keep > 1:
        return f"keep fewer checkpoints ({option}={keep} now)"
    return None
