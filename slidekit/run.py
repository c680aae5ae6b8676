"""A run's directory: one run, its configuration, metrics and checkpoints, and nothing slidekit did not write.

    RUN_DIR/
      config.json      the effective TrainConfig (written atomically when the run starts: after the
                       engine is built and the checkpoint restored, so an attempt that fails leaves the
                       previous run's record as it was)
      metrics.jsonl    one JSON object per step: step, loss, tokens/s, grad norm, lane timings, ...
      checkpoints/     step-NNNNNNNN/ directories (slidekit.checkpoint), the newest ``keep`` of them;
                       damaged-step-* / superseded-step-*: ones a resume moved aside (slidekit.resume)
      run.lock         the owner record (pid, host, start) of the process running in it (flock-ed while it runs)

A checkpoint holds the engine's masters and optimizer state (see
``slidekit.engine.snapshot``) and, in ``meta.json``, the step counters, the
number of batches consumed from the configured data, and the configuration;
resuming from it continues bitwise as if the run had never stopped.

Ownership (docs/runs.md): a run directory is new, empty, or holds a slidekit
run (a ``config.json`` that is a slidekit configuration); anything else, a
model directory for one, is refused before anything is written. A fresh run
(``run.resume_target()`` is None) in a directory that holds a previous run's checkpoints or
metrics is refused unless ``run.overwrite``, which removes exactly those.
One process at a time: ``run.lock`` is held with an flock (``slidekit.owned``) for the
run's life, so a second run is refused with the first one's pid, and the OS
drops the lock when its holder dies (a SIGKILL never leaves it stuck).

Two stages: ``RunDirectory(config)`` claims the directory (the checks above and the
lock) and writes nothing else; ``start()``, once the Trainer has built the engine
(the fit check passed) and restored the checkpoint, removes what ``overwrite``
discards, writes ``config.json`` and opens the metrics. An attempt that fails in
between (a bad resume target, a changed optimizer, a run that does not fit)
leaves the directory byte for byte as it was (``run.lock`` aside).

Test: ``pytest tests/test_run_dir.py tests/test_resume.py``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slidekit import checkpoint as ck
from slidekit import owned
from slidekit.atomic import rename_aside, write_text_atomically
from slidekit.engine import snapshot
from slidekit.errors import ConfigError, PipelineStalled
from slidekit.paths import describe, directory_path
from slidekit.resume import restore

if TYPE_CHECKING:
    from slidekit.config import TrainConfig
    from slidekit.engine import Engine

__all__ = [
    "RUN_ENTRIES",
    "RUN_LOCK",
    "RunDirectory",
    "RunDirectoryBusy",
    "discard_run",
    "foreign_content",
    "saved_config",
]

RUN_LOCK = "run.lock"
#: Everything slidekit writes in a run directory, and all it ever removes there.
RUN_ENTRIES = ("config.json", "metrics.jsonl", "checkpoints", RUN_LOCK)
_DISCARDED = ".discarded-"  # prefix of an entry renamed aside to be removed (a crash may leave one)
_RUN_SECTIONS = {"model", "data", "optim", "engine", "run"}


class RunDirectoryBusy(ConfigError):
    """Another live process runs in this run directory; the message names its pid."""


class RunDirectory:
    """Owns RUN_DIR for one Trainer: the lock, configuration, metrics log and checkpoint writer."""

    def __init__(self, config: TrainConfig, *, progress: Callable[[str, str], None] | None = None) -> None:
        """Claim ``config.run.dir``: refused (ConfigError) when it holds anything but a slidekit run, when
        another process runs in it (RunDirectoryBusy), or, for a fresh run, when it holds a previous run
        and ``run.overwrite`` is not set. Nothing but ``run.lock`` is written until ``start``."""
        rc = config.run
        assert rc.dir is not None
        self.path = directory_path(rc.dir, role="run directory", option="run.dir, CLI: --run-dir")
        self.config = config
        self.checkpoints = self.path / "checkpoints"
        self.last_saved: int | None = None
        self.last_path: Path | None = None  # the newest checkpoint known to be complete
        self.resumed_from: Path | None = None  # the checkpoint ``resume`` restored
        self.started = False  # ``start`` wrote config.json: the directory holds this run now
        self.timeout_s = config.engine.timeout_s  # a save that writes nothing for this long is stuck
        self._progress = progress
        self._stalled = False  # a save made no progress for timeout_s: never wait for the writer again
        self._handles: list[ck.SaveHandle] = []
        self._metrics: Any = None
        self.writer: ck.CheckpointWriter | None = None
        self._refuse_foreign()
        self.created = not self.path.exists()  # made by this run: a run that never starts removes it again
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"cannot create the run directory {str(self.path)!r}: {exc}") from exc
        self._lock: int | None = _lock(self.path)
        try:
            _remove_discarded(self.path)
            if rc.resume_target() is None:  # a fresh run (``resume=0`` resumes step 0)
                self._refuse_previous(rc.overwrite)
        except BaseException:
            self.close()
            raise

    def start(self) -> None:
        """The run starts here: discard the previous run (``overwrite``), write ``config.json``, keep the
        metrics of the steps up to the checkpoint resumed from, open the checkpoint writer. Idempotent."""
        if self.started:
            return
        if self._lock is None:
            raise RuntimeError(f"the run directory {self.path} is closed")
        rc = self.config.run
        try:
            if rc.resume_target() is None and rc.overwrite:
                _remove_entries(self.path, ("checkpoints", "metrics.jsonl"))
            record = json.dumps(self.config.to_dict(), indent=1) + "\n"
            write_text_atomically(self.path / "config.json", record)
            self.started = True
            if self.resumed_from is not None and self.last_saved is not None:
                self._drop_metrics_after(self.last_saved)
            self._metrics = (self.path / "metrics.jsonl").open("a", encoding="utf-8")
        except OSError as exc:
            raise ConfigError(
                f"the run directory {str(self.path)!r} is not writable ({exc.strerror or exc}); "
                "choose a writable run.dir (CLI: --run-dir) or fix its permissions"
            ) from exc
        self.writer = ck.CheckpointWriter(self.checkpoints, keep=rc.keep, progress=self._progress)

    def abandon(self) -> None:
        """After a fresh run failed to start (and was closed): remove what it made, never a previous run.

        A directory this run created, or one that holds no run record, goes (``discard_run``); one that
        held a previous run's ``config.json`` which this attempt never replaced is left as it was."""
        if self.started or self.created or not (self.path / "config.json").exists():
            discard_run(self.path, checkpoints=False, keep_dir=not self.created)

    def _refuse_foreign(self) -> None:
        problem = foreign_content(self.path)
        if problem:
            raise ConfigError(
                f"the run directory {str(self.path)!r} {problem}; a run directory holds one slidekit run "
                "and nothing else, and slidekit would write its config.json, metrics.jsonl and checkpoints/ "
                "there: give run.dir (CLI: --run-dir) a new or an empty directory"
            )

    def _refuse_previous(self, overwrite: bool) -> None:
        """A fresh run: refuse a directory holding a previous run, unless ``overwrite`` (then ``start``
        removes that run)."""
        previous = _previous_run(self.path)
        if previous is not None and not overwrite:
            raise ConfigError(
                f"the run directory {str(self.path)!r} holds a previous run ({previous}), which a fresh run "
                f"would delete: continue it with run.resume (CLI: --run-dir {self.path} --resume), start "
                "this run in a new directory, or set run.overwrite (CLI: --overwrite) to discard the "
                "previous run's checkpoints and metrics"
            )

    # ------------------------------------------------------------------ metrics

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        if self._metrics is None:
            raise RuntimeError(f"the run in {self.path} is not started (RunDirectory.start) or is closed")
        self._metrics.write(json.dumps({"step": step, **metrics}) + "\n")
        self._metrics.flush()

    # ------------------------------------------------------------------ checkpoints

    def save(self, engine: Engine, meta: Mapping[str, Any], *, deferred_updates: bool) -> ck.SaveHandle:
        """Checkpoint the engine after its updates; its next updates wait for their own tensors only."""
        if self.writer is None:
            raise RuntimeError(f"the run in {self.path} is not started (RunDirectory.start) or is closed")
        engine.wait_updates()
        step = engine.steps_done
        handle = self.writer.save(
            step, snapshot.capture(engine, snapshot.update_order(engine, deferred_updates)), dict(meta)
        )
        engine.guard_checkpoint(handle, snapshot.names_by_unit(engine))
        self.last_saved = step
        self._handles.append(handle)
        return handle

    def wait(self) -> None:
        """Wait for every checkpoint requested so far; raise the first one's error if any failed.

        A save takes as long as it needs while it progresses; one that writes nothing for
        ``engine.timeout_s`` raises ``PipelineStalled``.
        """
        handles, self._handles = self._handles, []
        for h in handles:
            self._await(h)
            self.last_path = h.result(self.timeout_s)

    def _await(self, h: ck.SaveHandle) -> None:
        """Block until ``h`` commits or fails, tensor by tensor (they complete in order), each within the timeout."""
        if self._stalled:
            raise PipelineStalled(f"checkpoint step {h.step} is behind a stalled save", lane="checkpoint")
        for name in (*h.names, None):
            try:
                failed = (
                    h.exception(self.timeout_s) if name is None else h.future(name).exception(self.timeout_s)
                )
            except TimeoutError:
                self._stalled = True
                doing = "committing it" if name is None else f"writing {name!r}"
                raise PipelineStalled(
                    f"checkpoint step {h.step} made no progress for {self.timeout_s:g} s ({doing}): the checkpoint "
                    f"writer is stuck, on hung or very slow storage under {self.checkpoints}? If the disk is merely "
                    "slow, raise engine.timeout_s",
                    lane="checkpoint",
                ) from None
            if failed is not None:
                return

    def resume(
        self, engine: Engine, target: int | str = "latest", identity: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        """Load checkpoint ``target`` into the engine and return its metadata (``slidekit.resume``):
        "latest" is the newest that restores cleanly (damaged ones are moved aside), a step or a path
        that checkpoint. ``identity`` (``slidekit.identity``) is what the checkpoint must match; by
        default the engine's architecture. Call before ``start``, which then drops the metrics of the
        steps after it."""
        if identity is None:
            identity = {f"model.{k}": v for k, v in self.model_identity(engine).items()}
        path, meta = restore(engine, self.checkpoints, target, identity)
        engine.steps_done = int(meta["step"])
        engine.updates_applied = int(meta["updates_applied"])
        self.last_saved, self.last_path = engine.steps_done, path
        self.resumed_from = path
        return meta

    def _drop_metrics_after(self, step: int) -> None:
        """Forget the metrics of steps after ``step``: the resumed run computes them again.

        A run killed after its last checkpoint logged steps that never reached
        a checkpoint; keeping them would leave two records of those steps.
        """
        path = self.path / "metrics.jsonl"
        if not path.is_file():
            return
        kept = []
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by the kill
            if int(record.get("step", 0)) <= step:
                kept.append(line)
        write_text_atomically(path, "".join(f"{line}\n" for line in kept))

    @staticmethod
    def model_identity(engine: Engine) -> dict[str, Any]:
        spec = engine.spec
        return {"model_type": spec.model_type, "layers": spec.num_layers, "params": spec.num_params}

    def close(self) -> None:
        """Finish pending checkpoints (while they progress: see ``wait``), close the metrics file, release
        the lock. Idempotent.

        Never raises for a save: a failed one is reported by its handle, a stalled one is left to its
        (daemon) writer thread with a warning.
        """
        writer, self.writer = self.writer, None
        try:
            handles, self._handles = self._handles, []
            for h in handles:
                try:
                    self._await(h)
                except PipelineStalled as exc:
                    warnings.warn(f"{exc}; leaving it unfinished", RuntimeWarning, stacklevel=2)
                    break
            if writer is not None:  # times out only after a stall, already reported: its thread is left behind
                with contextlib.suppress(TimeoutError):
                    writer.close(0.0 if self._stalled else self.timeout_s)
        finally:
            metrics, self._metrics = self._metrics, None
            if metrics is not None:
                metrics.close()
            lock, self._lock = self._lock, None
            if lock is not None:
                os.close(lock)  # drops the flock


# ---------------------------------------------------------------------- ownership


def foreign_content(path: Path) -> str | None:
    """Why ``path`` cannot be a run directory (it holds something other than a slidekit run), or None."""
    if not path.is_dir():
        return None
    entries = [e for e in os.listdir(path) if e != RUN_LOCK]
    if not entries:
        return None
    config = path / "config.json"
    if _is_run_config(config):
        return None
    if config.exists():
        return "holds a config.json that is not a slidekit run configuration (is it a model directory?)"
    return f"is not empty ({describe(entries)}) and holds no slidekit run"


def saved_config(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The configuration a slidekit run saved in run directory ``path`` (its ``config.json``, as plain
    data), or None when ``path`` holds no slidekit run."""
    config = Path(path).expanduser() / "config.json"
    try:
        if not config.is_file() or config.stat().st_size > 1 << 20:
            return None
        doc = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if isinstance(doc, dict) and set(doc) >= _RUN_SECTIONS and isinstance(doc["run"], dict):
        return doc
    return None


def _is_run_config(path: Path) -> bool:
    return saved_config(path.parent) is not None


def _previous_run(path: Path) -> str | None:
    """What a previous run left in ``path`` (checkpoints, logged steps), or None when it left nothing."""
    found = []
    if names := _checkpoint_entries(path):
        found.append(f"checkpoints/: {describe(names, 3)}")
    metrics = path / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size:
        with metrics.open("rb") as f:
            found.append(f"{sum(1 for _ in f)} logged step(s) in metrics.jsonl")
    return "; ".join(found) or None


def _checkpoint_entries(path: Path) -> list[str]:
    checkpoints = path / "checkpoints"
    return os.listdir(checkpoints) if checkpoints.is_dir() else []


def _remove_entries(path: Path, names: tuple[str, ...]) -> None:
    """Remove the run's own entries ``names``; a directory is renamed aside first, so a crash mid-way never
    leaves a half-deleted checkpoints/ that a later run would read."""
    for name in names:
        entry = path / name
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(rename_aside(entry, _DISCARDED))
        elif entry.exists() or entry.is_symlink():
            entry.unlink()


def _remove_discarded(path: Path) -> None:
    """Finish removals a crash interrupted (only entries this module renamed aside)."""
    for entry in path.glob(f"{_DISCARDED}*"):
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)


def discard_run(path: str | os.PathLike[str], *, checkpoints: bool, keep_dir: bool = False) -> bool:
    """Remove the slidekit run in ``path``: its own entries, then the directory if nothing else is left
    (``keep_dir``: leave the directory itself, e.g. an empty one the user made).

    Returns False, and removes nothing, when ``path`` holds something other than a slidekit run or (with
    ``checkpoints=False``) when the run holds a checkpoint. RunDirectoryBusy while another
    process runs in it.
    """
    path = Path(os.path.realpath(Path(path).expanduser()))
    if not path.is_dir():
        return True
    if foreign_content(path):
        return False
    lock = _lock(path)
    try:
        if not checkpoints and _checkpoint_entries(path):
            return False
        # config.json late: a crash before it leaves a directory that is still recognisably a run
        _remove_entries(path, ("checkpoints", "metrics.jsonl", "config.json", RUN_LOCK))
        if not keep_dir:
            with contextlib.suppress(OSError):
                path.rmdir()  # left in place when something else lives there
    finally:
        os.close(lock)
    return True


def _lock(path: Path) -> int:
    """Take ``path/run.lock`` (``owned.try_lock``: never waiting) and record us in it; the descriptor."""
    lock = path / RUN_LOCK
    for _attempt in range(3):
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise ConfigError(f"cannot lock the run directory {str(path)!r}: {exc}") from exc
        try:
            taken = owned.try_lock(fd)
        except OSError as exc:
            os.close(fd)
            raise ConfigError(f"cannot lock the run directory {str(path)!r}: {exc}") from exc
        if not taken:
            holder = owned.holder(fd) or "pid unknown"
            os.close(fd)
            raise RunDirectoryBusy(
                f"the run directory {str(path)!r} is in use by another slidekit run ({holder}); two runs in "
                "one directory would mix their checkpoints: wait for that run to end (or stop it), or give "
                "this run another run.dir (CLI: --run-dir)"
            )
        try:
            current = os.stat(lock).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            current = False
        if current:
            owned.record(fd)
            return fd
        os.close(fd)  # the holder removed the directory's lock file as we took it: take the new one
    raise RunDirectoryBusy(f"the run directory {str(path)!r} is being removed by another process")
