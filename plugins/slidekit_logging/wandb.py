"""The ``wandb`` logger: a run's scalars in Weights & Biases, with its files in RUN_DIR/wandb.

Enabled by ``run.report_to`` (CLI: ``--report-to wandb``, or ``all``); needs the ``wandb``
package (``pip install 'slidekit[wandb]'``). W&B reads its own settings from the environment:
``WANDB_MODE=offline`` keeps everything on disk (``wandb sync RUN_DIR/wandb/offline-run-*``
uploads it later), ``WANDB_PROJECT`` names the project (default "slidekit"), ``WANDB_NAME`` the
run (default: the run directory's name). The W&B run gets the configuration; per step it logs
the scalars of ``slidekit.reporting.SCALARS`` at the step's number, and its summary names the
last checkpoint saved. The W&B run id is kept in RUN_DIR/wandb/slidekit-run-id: a resumed run
continues the same W&B run (``resume="allow"``), a fresh one (also after ``--overwrite``) starts
a new one.

    WANDB_MODE=offline slidekit finetune --run-dir runs/a --report-to wandb

Test: ``pytest tests/test_logging_plugins.py``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from slidekit.errors import DriverUnavailableError
from slidekit.hookspecs import hookimpl
from slidekit.reporting import import_library, log_dir, requested, scalars
from slidekit_logging._active import PerThread

NAME = "wandb"
#: The file in RUN_DIR/wandb that holds the W&B run id, so a resumed run continues its W&B run.
RUN_ID_FILE = "slidekit-run-id"

_runs: PerThread[Any] = PerThread()  # the W&B run of the fit on each thread


@hookimpl
def slidekit_fit_start(config: Any, steps_done: int) -> None:
    if requested(config, NAME) is None:
        return
    wandb = import_library(config, NAME, "wandb", extra="wandb", what="Weights & Biases (wandb)")
    if wandb is None:
        return
    directory = log_dir(config, NAME)  # wandb.init(dir=D) writes in D/wandb
    directory.mkdir(parents=True, exist_ok=True)
    id_file = directory / RUN_ID_FILE
    run_id = _recorded_id(id_file) if steps_done > 0 else None  # None: W&B makes a new one
    try:
        run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "slidekit"),
            name=os.environ.get("WANDB_NAME", directory.parent.name),
            dir=str(directory.parent),
            id=run_id,
            resume="allow" if run_id else None,
            config=config.to_dict(),
        )
    except Exception as exc:  # no login, no network, a bad setting: before the first step, with W&B's reason
        raise DriverUnavailableError(
            f"run.report_to asks for wandb, but W&B could not start its run ({type(exc).__name__}: {exc}); log "
            "in (wandb login), or set WANDB_MODE=offline to keep the run on disk, or leave wandb out of "
            "run.report_to (CLI: --report-to)"
        ) from exc
    stale = _runs.put(run)
    if stale is not None:
        stale.finish()
    if run_id is None:
        id_file.write_text(f"{run.id}\n", encoding="utf-8")


def _recorded_id(path: Path) -> str | None:
    """The W&B run id a previous fit of this run recorded in ``path``, or None (then a new run starts)."""
    try:
        return path.read_text(encoding="utf-8").strip() or None
    except FileNotFoundError:
        return None


@hookimpl
def slidekit_step_end(step: int, metrics: Mapping[str, float]) -> None:
    run = _runs.get()
    if run is not None:
        run.log(scalars(metrics), step=step)


@hookimpl
def slidekit_checkpoint_saved(step: int, path: Path) -> None:
    run = _runs.get()
    if run is not None:
        run.summary["checkpoint/step"] = step
        run.summary["checkpoint/path"] = str(path)


@hookimpl
def slidekit_fit_end(error: BaseException | None) -> None:
    run = _runs.pop()
    if run is not None:
        run.finish(exit_code=0 if error is None else 1)
