"""Durable file-system steps: fsync, files wholly written or not there, trees renamed aside to go.

A reader (or a crash) never sees half a file: ``write_text_atomically``
writes a temporary file in the target's directory, flushes it to disk and
renames it over the target in one step. Used for a run's ``config.json`` and
``metrics.jsonl`` rewrites and for Chrome traces; checkpoints and exports have
their own directory-level protocols (``slidekit.checkpoint``,
``slidekit.export``), built from the helpers here:

``fsync_path`` / ``fsync_tree``
    flush a file or directory, or everything under a directory (deepest first,
    so every entry is durable before the directory naming it), to the disk;
``write_synced``
    write a new file and flush it;
``rename_aside``
    rename a directory to ``<prefix><name>-<random>`` beside it before removing
    it, so a crash mid-way leaves a leftover recognisable by its prefix, never
    a half-deleted original that a later reader would take for whole.

Test: ``pytest tests/test_atomic.py``.
"""

from __future__ import annotations

import os
import secrets
import tempfile
from pathlib import Path

__all__ = ["fsync_path", "fsync_tree", "rename_aside", "write_synced", "write_text_atomically"]


def fsync_path(path: str | os.PathLike[str], *, directory: bool = False) -> None:
    """Flush one file, or (``directory``) one directory's entries, to the disk."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str | os.PathLike[str], *, files: bool = True) -> None:
    """fsync every directory under ``root`` and, with ``files``, every file, deepest first, ``root`` last
    (``files=False`` where the writers synced their files themselves)."""
    for dirpath, _dirs, names in os.walk(root, topdown=False):
        if files:
            for name in names:
                fsync_path(os.path.join(dirpath, name))
        fsync_path(dirpath, directory=True)


def write_synced(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` and flush it to the disk before returning."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def rename_aside(path: Path, prefix: str) -> Path:
    """Rename ``path`` to ``<prefix><name>-<random>`` in its directory (to be removed); the new path."""
    aside = path.with_name(f"{prefix}{path.name}-{secrets.token_hex(4)}")
    os.rename(path, aside)
    return aside


def write_text_atomically(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` (UTF-8) atomically; the file is private to the user (mode 0600)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
