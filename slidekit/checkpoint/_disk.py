"""Checkpoint directories on disk: fsync helpers, writer locks, temporary directories, retention.

See ``slidekit.checkpoint`` for the commit protocol these implement.
"""

from __future__ import annotations

import fcntl
import os
import secrets
import shutil
import time
from pathlib import Path

from slidekit.checkpoint._format import _LOCK, _STEP_DIR, _step_name

_STALE_UNLOCKED_S = 60.0  # a .tmp-* dir without a lock file is a writer's only before its first instant

# --------------------------------------------------------------------------- small file-system helpers


def _fsync_path(path: Path, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dirs(root: Path) -> None:
    """fsync every directory under ``root`` (files are synced by their writers: tensorstore's
    ``file_io_sync`` for zarr files, ``_write_synced`` for ours), deepest first, so entries are durable."""
    for dirpath, _dirs, _files in os.walk(root, topdown=False):
        _fsync_path(Path(dirpath), directory=True)


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _lock_held(tmp: Path) -> bool | None:
    """Whether a live writer holds ``tmp``'s lock (None: there is no lock file)."""
    try:
        fd = os.open(tmp / _LOCK, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing our own descriptor drops only our flock, never the writer's
    return False


def _cleanup_tmp(directory: Path) -> None:
    """Remove ``.tmp-*`` directories that no live writer owns (left by crashes or failed saves)."""
    for entry in directory.glob(".tmp-*"):
        if not entry.is_dir():
            continue
        held = _lock_held(entry)
        if held or (held is None and time.time() - entry.stat().st_mtime < _STALE_UNLOCKED_S):
            continue
        shutil.rmtree(entry, ignore_errors=True)


def _remove_checkpoint(path: Path) -> None:
    aside = path.with_name(f".tmp-delete-{path.name}-{secrets.token_hex(4)}")
    os.rename(path, aside)  # a crash from here on leaves a .tmp-* dir, never a half-deleted step-*
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
    fcntl.flock(fd, fcntl.LOCK_EX)  # tells _cleanup_tmp (any process) that this directory is alive
    return tmp, fd
