"""A run's directory: the effective configuration, the metrics, the checkpoints.

    RUN_DIR/
      config.json      the effective TrainConfig (written atomically when the run starts)
      metrics.jsonl    one JSON object per step: step, loss, tokens/s, grad norm, lane timings, ...
      checkpoints/     step-NNNNNNNN/ directories (slidekit.checkpoint), the newest ``keep`` of them

A checkpoint holds the engine's masters and optimizer state (see
``slidekit.engine.snapshot``) and, in ``meta.json``, the step counters, the
number of batches consumed from the configured data, and the configuration;
resuming from it continues bitwise as if the run had never stopped.

Test: ``pytest tests/test_resume.py``.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slidekit import checkpoint as ck
from slidekit.atomic import write_text_atomically
from slidekit.engine import snapshot
from slidekit.errors import ConfigError, PipelineStalled

if TYPE_CHECKING:
    from slidekit.config import TrainConfig
    from slidekit.engine import Engine

__all__ = ["RunDirectory"]


class RunDirectory:
    """Owns RUN_DIR for one Trainer: configuration, metrics log and checkpoint writer."""

    def __init__(self, config: TrainConfig, *, progress: Callable[[str, str], None] | None = None) -> None:
        rc = config.run
        assert rc.dir is not None
        self.path = Path(rc.dir).expanduser()
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"cannot create the run directory {str(self.path)!r}: {exc}") from exc
        self.config = config
        self.checkpoints = self.path / "checkpoints"
        self.timeout_s = config.engine.timeout_s  # a save that writes nothing for this long is stuck
        try:
            write_text_atomically(self.path / "config.json", json.dumps(config.to_dict(), indent=1) + "\n")
            self._metrics = (self.path / "metrics.jsonl").open("a", encoding="utf-8")
        except OSError as exc:
            raise ConfigError(
                f"the run directory {str(self.path)!r} is not writable ({exc.strerror or exc}); "
                "choose a writable run.dir (CLI: --run-dir) or fix its permissions"
            ) from exc
        self.writer = ck.CheckpointWriter(self.checkpoints, keep=rc.keep, progress=progress)
        self.last_saved: int | None = None
        self._handles: list[ck.SaveHandle] = []
        self._stalled = False  # a save made no progress for timeout_s: never wait for the writer again

    # ------------------------------------------------------------------ metrics

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self._metrics.write(json.dumps({"step": step, **metrics}) + "\n")
        self._metrics.flush()

    # ------------------------------------------------------------------ checkpoints

    def save(self, engine: Engine, meta: Mapping[str, Any], *, deferred_updates: bool) -> ck.SaveHandle:
        """Checkpoint the engine after its updates; its next updates wait for their own tensors only."""
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
            h.result(self.timeout_s)

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

    def resume(self, engine: Engine) -> dict[str, Any]:
        """Load the newest complete checkpoint into the engine; return its metadata."""
        path = ck.latest(self.checkpoints)
        if path is None:
            raise ConfigError(
                f"nothing to resume: {self.checkpoints} holds no complete checkpoint; "
                "start without resume, or point run.dir at the run you want to continue"
            )
        meta = ck.load_meta(path)
        mine = self.model_identity(engine)
        theirs = meta.get("model", {})
        if theirs != mine:
            raise ck.CheckpointMismatch(
                f"checkpoint {path} was written for model {theirs}, this run has {mine}; resume with the "
                "model and configuration that wrote it, or use a fresh run directory"
            )
        snapshot.restore(engine, path)
        engine.steps_done = int(meta["step"])
        engine.updates_applied = int(meta["updates_applied"])
        self.last_saved = engine.steps_done
        self._drop_metrics_after(engine.steps_done)
        return meta

    def _drop_metrics_after(self, step: int) -> None:
        """Forget the metrics of steps after ``step``: the resumed run computes them again.

        A run killed after its last checkpoint logged steps that never reached
        a checkpoint; keeping them would leave two records of those steps.
        """
        self._metrics.close()
        path = self.path / "metrics.jsonl"
        kept = []
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by the kill
            if int(record.get("step", 0)) <= step:
                kept.append(line)
        write_text_atomically(path, "".join(f"{line}\n" for line in kept))
        self._metrics = path.open("a", encoding="utf-8")

    @staticmethod
    def model_identity(engine: Engine) -> dict[str, Any]:
        spec = engine.spec
        return {"model_type": spec.model_type, "layers": spec.num_layers, "params": spec.num_params}

    def close(self) -> None:
        """Finish pending checkpoints (while they progress: see ``wait``), close the metrics file.

        Never raises for a save: a failed one is reported by its handle, a stalled one is left to its
        (daemon) writer thread with a warning.
        """
        try:
            handles, self._handles = self._handles, []
            for h in handles:
                try:
                    self._await(h)
                except PipelineStalled as exc:
                    warnings.warn(f"{exc}; leaving it unfinished", RuntimeWarning, stacklevel=2)
                    break
            # Times out only after a stall, already reported: the writer's thread is left behind.
            with contextlib.suppress(TimeoutError):
                self.writer.close(0.0 if self._stalled else self.timeout_s)
        finally:
            self._metrics.close()
