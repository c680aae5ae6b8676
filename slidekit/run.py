"""A run's directory: the effective configuration, the metrics, the checkpoints.

    RUN_DIR/
      config.json      the effective TrainConfig (written atomically when the run starts)
      metrics.jsonl    one JSON object per step: step, loss, tokens/s, grad norm, lane timings, ...
      checkpoints/     step-NNNNNNNN/ directories (slidekit.checkpoint), the newest ``keep`` of them;
                       damaged-step-* / superseded-step-*: ones a resume moved aside (slidekit.resume)

A checkpoint holds the engine's masters and optimizer state (see
``slidekit.engine.snapshot``) and, in ``meta.json``, the step counters, the
number of batches consumed from the configured data, and the configuration;
resuming from it continues bitwise as if the run had never stopped.

Test: ``pytest tests/test_resume.py``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slidekit import checkpoint as ck
from slidekit.atomic import write_text_atomically
from slidekit.engine import snapshot
from slidekit.errors import ConfigError
from slidekit.resume import restore

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
        write_text_atomically(self.path / "config.json", json.dumps(config.to_dict(), indent=1) + "\n")
        self.writer = ck.CheckpointWriter(self.checkpoints, keep=rc.keep, progress=progress)
        self._metrics = (self.path / "metrics.jsonl").open("a", encoding="utf-8")
        self.last_saved: int | None = None
        self.resumed_from: Path | None = None  # the checkpoint ``resume`` restored
        self._handles: list[ck.SaveHandle] = []

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
        """Wait for every checkpoint requested so far; raise the first one's error if any failed."""
        handles, self._handles = self._handles, []
        for h in handles:
            h.result()

    def resume(
        self, engine: Engine, target: int | str = "latest", identity: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        """Load checkpoint ``target`` into the engine and return its metadata (``slidekit.resume``):
        "latest" is the newest that restores cleanly (damaged ones are moved aside), a step or a path
        that checkpoint. ``identity`` (``slidekit.identity``) is what the checkpoint must match; by
        default the engine's architecture."""
        if identity is None:
            identity = {f"model.{k}": v for k, v in self.model_identity(engine).items()}
        path, meta = restore(engine, self.checkpoints, target, identity)
        engine.steps_done = int(meta["step"])
        engine.updates_applied = int(meta["updates_applied"])
        self.last_saved = engine.steps_done
        self._drop_metrics_after(engine.steps_done)
        self.resumed_from = path
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
        """Finish pending checkpoints, close the metrics file."""
        try:
            self.writer.close()
        finally:
            self._metrics.close()
