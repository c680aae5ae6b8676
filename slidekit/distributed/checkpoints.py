"""Data-parallel checkpoints: every rank writes its own shards; rank 0's part commits the whole.

    RUN_DIR/checkpoints/step-N/          rank 0's part: its shards and the step's meta.json. It is the
                                         checkpoint: committed only once every other part is
    RUN_DIR/checkpoints/rank-R/step-N/   rank R's part (R >= 1): its shards

Rank 0 keeps the run directory as one process does (``RunDirectory``: the
lock, config.json, metrics.jsonl, retention of ``step-*``). Every other rank
writes its part with a checkpoint writer of its own (``RankPart``) and, once
the part is committed, reports it in the store; rank 0's part writes its last
array only after every report (``slidekit.engine.snapshot``), so
``checkpoints/step-N`` exists only when every part of step N does, and a
failed part leaves the previous checkpoint the newest. Retention follows rank
0's: a rank removes its part of a step once rank 0 holds a newer checkpoint
and not that step (rank 0 deletes an old step only after committing a newer
one). Every rank must see RUN_DIR (one host, or a shared file system).

Resume (``resume_run``): rank 0 chooses the checkpoint as one process does
(the newest intact one, or the one asked for; identity checked), tells the
other ranks its step, and each restores its part of that step: bitwise the
run as it was. A checkpoint of another world size (one process included) is
re-sharded (``slidekit.distributed.reshard``): every rank reads its new
shards' ranges from the old parts, and the data position is counted for the
new world; the returned meta then carries the note rank 0 prints
(``"resharded"``).

Test: ``pytest tests/distributed/test_dp_checkpoints.py``.
"""

from __future__ import annotations

import contextlib
import shutil
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from slidekit import checkpoint as ck
from slidekit.atomic import rename_aside
from slidekit.distributed import reshard
from slidekit.distributed.group import DataParallel
from slidekit.engine import snapshot
from slidekit.errors import ConfigError, PipelineStalled
from slidekit.paths import directory_path
from slidekit.run import RunDirectory

if TYPE_CHECKING:
    from slidekit.config import TrainConfig
    from slidekit.engine import Engine

__all__ = ["RankPart", "resume_run", "run_directory"]

_RETIRED = ".tmp-delete-"  # what a writer's leftover cleanup removes, should a crash interrupt a removal


def run_directory(
    config: TrainConfig, parallel: DataParallel | None, *, progress: Callable[[str, str], None] | None
) -> RunDirectory:
    """The run directory as this rank keeps it: rank 0 (or one process) the ``RunDirectory``, another
    rank its ``RankPart`` of every checkpoint (the part of ``RunDirectory`` the Trainer uses)."""
    if parallel is None or parallel.rank == 0:
        return RunDirectory(config, progress=progress)
    return cast("RunDirectory", RankPart(config, parallel, progress=progress))


def resume_run(
    run: RunDirectory,
    engine: Engine,
    target: int | str,
    identity: Mapping[str, Any],
    parallel: DataParallel | None,
) -> dict[str, Any]:
    """``run.resume`` for every rank: rank 0 picks the checkpoint, the others restore their part of it.

    A checkpoint of another world size is re-sharded; its meta's ``batches_consumed`` is then this
    rank's count in the new world, and ``meta["resharded"]`` the note that says so (rank 0 prints it)."""
    if parallel is None:
        meta = run.resume(engine, target, identity)
    elif parallel.rank == 0:
        meta = run.resume(engine, target, identity)  # a failure is reported to the others by the Trainer
        parallel.all_reduce([float(engine.steps_done)])
    else:
        step = int(parallel.all_reduce([0.0])[0])
        meta = cast("RankPart", run).resume_step(engine, step)
    assert run.resumed_from is not None
    saved, world = snapshot.saved_world(run.resumed_from), snapshot.engine_world(engine)
    if saved == world:
        return meta
    out = reshard.resharded_meta(meta, saved, world)
    out["resharded"] = reshard.world_note(meta, saved, world, identity)
    return out


class RankPart:
    """A rank's (other than 0) part of the run directory: its part of every checkpoint, nothing else."""

    def __init__(
        self,
        config: TrainConfig,
        parallel: DataParallel,
        *,
        progress: Callable[[str, str], None] | None = None,
    ) -> None:
        rc = config.run
        assert rc.dir is not None
        run = directory_path(rc.dir, role="run directory", option="run.dir, CLI: --run-dir")
        self.root = run / "checkpoints"  # rank 0's: the committed checkpoints
        self.path = self.checkpoints = self.root / f"rank-{parallel.rank}"
        self.created = False  # nothing is written before the first save (rank 0 may still clear the run)
        self.last_saved: int | None = None
        self.last_path: Path | None = None
        self.resumed_from: Path | None = None
        self.timeout_s = config.engine.timeout_s
        self._parallel = parallel
        self._progress = progress
        self._writer: ck.CheckpointWriter | None = None
        self._handles: list[ck.SaveHandle] = []

    # ------------------------------------------------------------------ what rank 0 does alone

    def start(self) -> None:
        """config.json is rank 0's."""

    def abandon(self) -> None:
        """A run that never started wrote no part."""

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """metrics.jsonl is rank 0's."""

    # ------------------------------------------------------------------ checkpoints

    def save(self, engine: Engine, meta: Mapping[str, Any], *, deferred_updates: bool) -> ck.SaveHandle:
        """Write this rank's part of the checkpoint of ``engine``'s step (as ``RunDirectory.save``)."""
        if self._writer is None:
            self._writer = ck.CheckpointWriter(self.checkpoints, keep=None, progress=self._progress)
        self._retire()
        engine.wait_updates()
        step = engine.steps_done
        order = snapshot.update_order(engine, deferred_updates)
        handle = self._writer.save(step, snapshot.capture(engine, order), dict(meta))
        engine.guard_checkpoint(handle, snapshot.names_by_unit(engine))
        # On the writer thread, once the part is committed or failed: rank 0 commits the checkpoint then.
        handle.add_done_callback(lambda h: self._parallel.report_part(h.step, h.exception(0)))
        self.last_saved = step
        self._handles.append(handle)
        return handle

    def wait(self) -> None:
        """Wait for every part requested so far; raise the first one's error (a save that writes nothing
        for ``engine.timeout_s`` raises ``PipelineStalled``)."""
        handles, self._handles = self._handles, []
        for h in handles:
            for name in h.names:
                try:
                    h.future(name).exception(self.timeout_s)
                except TimeoutError:
                    raise PipelineStalled(
                        f"rank {self._parallel.rank}: its part of checkpoint step {h.step} made no progress for "
                        f"{self.timeout_s:g} s (writing {name!r} under {self.checkpoints})",
                        lane="checkpoint",
                    ) from None
            self.last_path = h.result(self.timeout_s)

    def _retire(self) -> None:
        """Remove the parts of steps rank 0 no longer holds while it holds a newer one (its retention)."""
        ck.remove_leftovers(self.checkpoints)
        held = {s for s, _ in ck.step_dirs(self.root)}
        newest = max(held, default=-1)
        for step, path in ck.step_dirs(self.checkpoints):
            if step < newest and step not in held:
                shutil.rmtree(rename_aside(path, _RETIRED), ignore_errors=True)

    def resume_step(self, engine: Engine, step: int) -> dict[str, Any]:
        """Restore this rank's part of checkpoint ``step`` (the one rank 0 resumed) and return its meta; a
        checkpoint of another world size is re-sharded from every part of it (``snapshot.restore``)."""
        checkpoint = ck.step_dir(self.root, step)  # rank 0's part, checked by rank 0 already
        if checkpoint.is_dir() and snapshot.saved_world(checkpoint) != self._parallel.world:
            meta = ck.load_meta(checkpoint)
            snapshot.restore(engine, checkpoint)  # this rank's ranges of every old part, checksummed
            return self._resumed(engine, step, checkpoint, meta)
        path = ck.step_dir(self.checkpoints, step)
        if not path.is_dir():
            have = [s for s, _ in ck.step_dirs(self.checkpoints)]
            raise ConfigError(
                f"rank {self._parallel.rank} has no part of checkpoint step {step} ({path}; it holds steps "
                f"{have}): was the checkpoint written by fewer ranks? Resume with the world size that wrote it"
            )
        damage = ck.problems(path)
        if damage:
            raise ck.CheckpointCorrupt(
                f"rank {self._parallel.rank}'s part of checkpoint step {step} is damaged: {'; '.join(damage[:5])}; "
                "resume from an older step (--resume STEP)"
            )
        if snapshot.saved_world(path) != self._parallel.world:  # a stale part another world size left
            raise ConfigError(
                f"{path} is not rank {self._parallel.rank}'s part of checkpoint step {step}: another world size "
                "wrote it; resume from another step (--resume STEP)"
            )
        meta = ck.load_meta(path)
        snapshot.restore(engine, path)  # every array read back and checksummed
        return self._resumed(engine, step, path, meta)

    def _resumed(self, engine: Engine, step: int, path: Path, meta: dict[str, Any]) -> dict[str, Any]:
        engine.steps_done = int(meta["step"])
        engine.updates_applied = int(meta["updates_applied"])
        for s, newer in ck.step_dirs(self.checkpoints):  # the abandoned continuation's parts
            if s > step:
                shutil.rmtree(rename_aside(newer, _RETIRED), ignore_errors=True)
        self.last_saved, self.last_path, self.resumed_from = step, path, path
        return meta

    def resume(self, engine: Engine, target: int | str = "latest", identity: Any = None) -> dict[str, Any]:
        raise RuntimeError(
            "a rank other than 0 resumes the step rank 0 chose: slidekit.distributed.resume_run"
        )

    def close(self) -> None:
        """Finish the parts still being written (while they progress), then let the writer go."""
        writer, self._writer = self._writer, None
        try:
            self.wait()
        except PipelineStalled as exc:
            warnings.warn(f"{exc}; leaving it unfinished", RuntimeWarning, stacklevel=2)
        except ck.CheckpointError:
            pass  # reported by the save's handle (and to rank 0)
        if writer is not None:
            with contextlib.suppress(TimeoutError):
                writer.close(self.timeout_s)
