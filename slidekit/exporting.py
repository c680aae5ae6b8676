"""A run's export: the current weights as a Hugging Face model directory, with the run's tokenizer and a
model card, refused before anything is written where it would replace what slidekit did not write.

Part of ``slidekit.trainer.Trainer`` (a mixin); the writing itself is ``slidekit.export``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slidekit import leftovers
from slidekit.config import TrainConfig
from slidekit.data import StepCount
from slidekit.data.configured import model_tokenizer
from slidekit.distributed import DataParallel
from slidekit.errors import ConfigError
from slidekit.export import ExportError, check_dtype, check_target, export_guards, export_model
from slidekit.modelcard import last_logged, model_card
from slidekit.plugins import Selection
from slidekit.run import RunDirectory

if TYPE_CHECKING:
    import torch

    from slidekit.engine import Engine
    from slidekit.models.base import ArchSpec
    from slidekit.telemetry import Progress

__all__ = ["Exporting"]


class Exporting:
    """The export half of ``Trainer``."""

    # The Trainer's state these methods share (set by ``Trainer.__init__``).
    config: TrainConfig
    model_dir: Path
    hf_config: Any
    spec: ArchSpec
    selections: dict[str, Selection]
    compute_dtype: torch.dtype
    lr: float
    notes: list[str]
    parallel: DataParallel | None
    run: RunDirectory | None
    step_count: StepCount
    _guards: list[Any] | None
    _tokenizer: Any
    _logged: dict[str, tuple[int, float]]
    _fault_hook: Callable[[str], None] | None

    if TYPE_CHECKING:

        @property
        def engine(self) -> Engine: ...

    def checkpoint(self) -> Any:
        raise NotImplementedError  # the Trainer's

    def _report_saved(self, bar: Progress | None) -> None:
        raise NotImplementedError  # the Trainer's

    def _export_guards(self) -> list[Any]:
        if self._guards is None:
            self._guards = export_guards(self.config, self.model_dir)
        return self._guards

    def tokenizer(self) -> Any:
        """The run's tokenizer: ``model.tokenizer``, else the model directory's (the demo's for the demo
        model), loaded once. A directory without one is a ConfigError naming it and the fix (``--tokenizer``):
        training on ``config.data`` and exporting need it; ``fit()`` on batches of token ids does not."""
        if self._tokenizer is None:
            self._tokenizer = model_tokenizer(self.config, self.model_dir)
        return self._tokenizer

    def export(self, out: str, *, dtype: str = "bfloat16", overwrite: bool = False) -> Path:
        """Write the current weights as a Hugging Face model directory (see ``slidekit.export``).

        ``out`` must be new, empty, or a previous slidekit export, which is replaced only with
        ``overwrite`` and then only the files its manifest lists; it may not be or contain the current
        directory, the run directory, the source model or the data (ConfigError, before anything is
        written there). With a run directory the current state is in a checkpoint before the export
        starts, so an export that is refused or fails (ExportError) loses nothing: the error names the
        checkpoint to resume from.
        """
        engine = self.engine
        check_dtype(dtype)
        self.notes += leftovers.reclaim_export(out)
        saved: Path | None = None
        if self.run is not None:
            if self.run.last_saved != engine.steps_done:
                self.checkpoint()
            self.run.wait()
            self._report_saved(None)
            saved = self.run.last_path
        if saved is not None and self.run is not None:
            where = (
                f"the trained weights are safe in the checkpoint {saved} (step {engine.steps_done}): fix the "
                f"problem, then resume the run directory {self.run.path} to export them (CLI: --run-dir "
                f"{self.run.path} --resume --export {out}; no step is trained again)"
            )
        else:
            where = "the trained weights are still in this Trainer: fix the problem and call export() again"
        state = None
        if self.parallel is not None:  # every rank lends its shards (a collective); rank 0 writes the export
            state = engine.master_state()
            if self.parallel.rank != 0:
                return Path(out)
        hook = self._fault_hook
        on_stage = (lambda stage, _detail: hook(f"export:{stage}")) if hook else None
        try:
            tokenizer = self.tokenizer()  # an export is a whole model directory: no tokenizer, no export
            target = check_target(out, overwrite=overwrite, guards=self._export_guards(), dtype=dtype)
        except ConfigError as exc:
            raise ConfigError(f"{exc}; {where}" if saved is not None else str(exc)) from None
        try:
            return export_model(
                target,
                hf_config=copy.deepcopy(self.hf_config),
                state=engine.master_state() if state is None else state,
                tokenizer=tokenizer,
                info={
                    "step": engine.steps_done,
                    "steps": self.step_count.total,
                    "model": self.config.model.source,
                },
                source_dir=self.model_dir,
                model_card=self._model_card(target.path, dtype),
                progress=on_stage,
            )
        except Exception as exc:
            raise ExportError(f"the export to {out} failed: {exc}; {where}") from exc

    def _model_card(self, out: Path, dtype: str) -> str:
        """The export's README.md (``slidekit.modelcard``) with the losses logged last: in this process or,
        before a resume, in the run directory's metrics.jsonl."""
        from slidekit import __version__

        steps = self.engine.steps_done
        logged = dict(self._logged)
        if self.run is not None:
            logged = {**last_logged(self.run.path / "metrics.jsonl", upto=steps), **logged}
        return model_card(
            self.config,
            title=out.name,
            family=self.spec.family,
            source_dir=self.model_dir,
            step=steps,
            lr=self.lr,
            drivers={k: s.name for k, s in self.selections.items()},
            dtype=dtype,
            compute_dtype=str(self.compute_dtype).removeprefix("torch."),
            logged=logged,
            version=__version__,
        )

