"""Checks on the directories a run writes (run directory, export target), made before anything is trained.

``directory_path`` turns a configured path into an absolute one with symlinks
resolved, and refuses, with the path and the fix, one that can never become a
directory: an existing file, a path below a file, a parent slidekit may not
write in. ``describe`` names a few entries of a directory for an error message.

Test: ``pytest tests/test_export.py tests/test_run_dir.py``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from slidekit.errors import ConfigError

__all__ = ["describe", "directory_path", "encloses"]


def directory_path(value: str | os.PathLike[str], *, role: str, option: str) -> Path:
    """``value`` resolved, or ConfigError when it is a file, lies below a file, or cannot be written."""
    path = Path(os.path.realpath(Path(value).expanduser()))
    if path.exists() and not path.is_dir():
        raise ConfigError(
            f"the {role} {str(path)!r} ({option}) is a file, not a directory; "
            "give the path of a new or an empty directory"
        )
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(
            f"the {role} {str(path)!r} ({option}) cannot be created: {str(existing)!r} is a file, "
            "not a directory; give a path below a directory"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(
            f"the {role} {str(path)!r} ({option}) cannot be written: no permission to write in "
            f"{str(existing)!r}; choose a directory you can write to"
        )
    return path


def encloses(outer: Path, inner: Path) -> bool:
    """Whether ``inner`` is ``outer`` or lies inside it (both absolute, symlinks resolved)."""
    return inner == outer or inner.is_relative_to(outer)


def describe(names: Iterable[str], limit: int = 4) -> str:
    """``a, b, c and 3 more`` for an error message."""
    names = sorted(names)
    shown = ", ".join(names[:limit])
    return shown if len(names) <= limit else f"{shown} and {len(names) - limit} more"
