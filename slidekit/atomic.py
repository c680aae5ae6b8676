"""Files that are either wholly written or not there: write beside, fsync, rename.

A reader (or a crash) never sees half a file: ``write_text_atomically``
writes a temporary file in the target's directory, flushes it to disk and
renames it over the target in one step. Used for a run's ``config.json`` and
``metrics.jsonl`` rewrites and for Chrome traces; checkpoints have their own
directory-level protocol (``slidekit.checkpoint``).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["write_text_atomically"]


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
