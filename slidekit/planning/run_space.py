"""How much room a run's checkpoints need in its run directory: pure arithmetic for the planner.

One checkpoint (``slidekit.checkpoint``) is every unit's FP32 master and optimizer state, plus its
files: per array a ``zarr.json``, its directories and the last chunk file's partial block, per
checkpoint the manifest and ``meta.json`` (``checkpoint_bytes``). A run adds checkpoints until
``run.keep`` are there, and commits each new one before the oldest is deleted, so at its peak the
directory holds ``keep + 1``; those already there (a resumed run) count, and a run that writes
fewer never reaches the peak (``checkpoint_copies``, ``checkpoint_writes``).

Test: ``pytest tests/test_planner_run_dir.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from slidekit.config import DEFAULT_STEPS

if TYPE_CHECKING:
    from slidekit.config import TrainConfig

__all__ = [
    "CHECKPOINT_OVERHEAD",
    "CHECKPOINT_UNIT_OVERHEAD",
    "checkpoint_bytes",
    "checkpoint_copies",
    "checkpoint_writes",
    "run_dir_need",
]

#: A checkpoint's files beyond its arrays' bytes, per unit (a master and up to a few state arrays) ...
CHECKPOINT_UNIT_OVERHEAD = 64 << 10
#: ... and per checkpoint (manifest, meta.json, directories).
CHECKPOINT_OVERHEAD = 1 << 20


def checkpoint_bytes(numels: Sequence[int], state_bytes: Sequence[int]) -> int:
    """Disk space of one checkpoint of units of ``numels`` parameters with ``state_bytes`` of state."""
    arrays = sum(4 * n + s for n, s in zip(numels, state_bytes, strict=True))
    return arrays + len(numels) * CHECKPOINT_UNIT_OVERHEAD + CHECKPOINT_OVERHEAD


def checkpoint_writes(config: TrainConfig) -> int:
    """How many checkpoints a run of ``config`` writes at most (0 without a run directory)."""
    rc = config.run
    if not rc.dir:
        return 0
    every = rc.checkpoint_every
    steps = config.steps if config.steps is not None else DEFAULT_STEPS  # None: epochs decide, once data is read
    return steps // every + (1 if steps % every else 0) if every else 1


def checkpoint_copies(keep: int | None, writes: int, existing: int) -> int:
    """New checkpoints a run directory holding ``existing`` must find room for at once.

    With ``keep=None`` nothing is deleted: the ones there count as written (a resumed run)."""
    if writes <= 0:
        return 0
    if keep is None:
        return max(1, writes - existing)
    return max(0, min(writes, max(existing, keep) + 1 - existing))


def run_dir_need(size: int, keep: int | None, writes: int, existing: int) -> tuple[dict[str, int], str]:
    """The run directory's requirement for checkpoints of ``size`` bytes, by part, and the fix when
    it lacks the room (a lower ``keep`` only where there is one)."""
    copies = checkpoint_copies(keep, writes, existing)
    if not copies:
        return {}, ""
    fix = "free space there, or put run.dir (--run-dir) on a larger disk"
    from slidekit.checkpoint import fewer_checkpoints  # the wording checkpoint saves use too

    fewer = fewer_checkpoints(keep, "run.keep")
    if fewer:
        fix += f", or {fewer}"
    return {f"checkpoints ({copies} x {size / 2**30:.2f} GiB)": copies * size}, fix
