"""What killed runs leave where a run writes, found and removed when the next run starts.

A ``kill -9`` (or a power cut) skips every cleanup, and leaves:

* offload directories of file-backed tiers in ``engine.offload_dir`` (``slidekit-<tier>-<pid>-*``),
  often the size of the optimizer state: removed when their owner is dead (``slidekit.owned``),
  never when it lives; the ones left alone are named, so a refusal for lack of disk space says
  whose files take it;
* ``.tmp-*`` directories in ``run.dir/checkpoints``: a checkpoint being written, or one being
  deleted by retention (``checkpoint.remove_leftovers``);
* the directory an export was being assembled in, beside ``run.export_dir``.

``reclaim(config)`` runs before the run is planned, so the space they held counts as free.

Test: ``pytest tests/test_leftovers.py``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from slidekit import checkpoint as ck
from slidekit import owned
from slidekit.export import remove_leftovers

if TYPE_CHECKING:
    from slidekit.config import TrainConfig

__all__ = ["Reclaimed", "reclaim", "reclaim_export"]


@dataclass(slots=True)
class Reclaimed:
    """What ``reclaim`` removed (one line per place) and the offload directories it left alone."""

    removed: list[str] = field(default_factory=list)
    kept: list[owned.Leftover] = field(default_factory=list)

    def notes(self, offload_dir: str | None) -> list[str]:
        out = []
        if self.removed:
            out.append("removed what killed runs left: " + "; ".join(self.removed))
        if self.kept:
            out.append(
                f"{offload_dir} also holds other slidekit processes' files, left alone: "
                + owned.describe(self.kept)
            )
        return out


def reclaim_export(out: str | os.PathLike[str]) -> list[str]:
    """Remove the staging directories dead exports to ``out`` left beside it (``export.remove_leftovers``:
    beside the real target, symlinks resolved; only those no live export holds); say what went."""
    gone = remove_leftovers(out)
    return [f"a half-written export beside {out} ({', '.join(p.name for p in gone)})"] if gone else []


def reclaim(config: TrainConfig) -> Reclaimed:
    """Remove what killed runs left in ``config``'s offload directory, run directory and beside its export."""
    ec, rc = config.engine, config.run
    result = Reclaimed()
    if ec.offload_dir and os.path.isdir(ec.offload_dir):
        gone, result.kept = owned.reclaim(ec.offload_dir, "slidekit-")
        if gone:
            result.removed.append(f"offload files in {ec.offload_dir} ({owned.describe(gone)})")
    if rc.dir:
        tmp = ck.remove_leftovers(Path(rc.dir).expanduser() / "checkpoints")
        if tmp:
            result.removed.append(f"interrupted checkpoint files ({', '.join(p.name for p in tmp)})")
    if rc.export_dir:
        result.removed += reclaim_export(rc.export_dir)
    return result
