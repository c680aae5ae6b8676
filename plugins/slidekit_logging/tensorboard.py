"""The ``tensorboard`` logger: a run's scalars as TensorBoard event files in RUN_DIR/tensorboard.

Enabled by ``run.report_to`` (CLI: ``--report-to tensorboard``, or ``all``); needs the
``tensorboard`` package (``pip install 'slidekit[tensorboard]'``) and writes through
``torch.utils.tensorboard.SummaryWriter``. Per step it writes the scalars of
``slidekit.reporting.SCALARS`` (train/loss, train/lr, train/grad_norm, train/tokens_per_s,
eval/loss, memory/..., at the step's number), the run's configuration as text when it
starts, and a text line for each checkpoint saved. A resumed run starts its writer with
``purge_step`` = its first step, so TensorBoard drops what a killed run had logged after
the checkpoint it resumed from: every step is shown once, as the resumed run computed it.

    slidekit finetune --run-dir runs/a --report-to tensorboard
    tensorboard --logdir runs/a/tensorboard

Test: ``pytest tests/test_logging_plugins.py``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from slidekit.hookspecs import hookimpl
from slidekit.reporting import import_library, log_dir, requested, scalars
from slidekit_logging._active import PerThread

NAME = "tensorboard"

_writers: PerThread[Any] = PerThread()  # SummaryWriter of the fit on each thread


@hookimpl
def slidekit_fit_start(config: Any, steps_done: int) -> None:
    if requested(config, NAME) is None:
        return
    module = import_library(
        config,
        NAME,
        "torch.utils.tensorboard",
        extra="tensorboard",
        what="TensorBoard (torch.utils.tensorboard)",
    )
    if module is None:
        return
    # purge_step: events of this step and later, from an earlier run in this directory, are dropped
    writer = module.SummaryWriter(log_dir=str(log_dir(config, NAME)), purge_step=steps_done + 1)
    stale = _writers.put(writer)
    if stale is not None:
        stale.close()
    text = json.dumps(config.to_dict(), indent=1)
    writer.add_text("config", "".join(f"    {line}\n" for line in text.splitlines()), steps_done)


@hookimpl
def slidekit_step_end(step: int, metrics: Mapping[str, float]) -> None:
    writer = _writers.get()
    if writer is not None:
        for tag, value in scalars(metrics).items():
            writer.add_scalar(tag, value, step)


@hookimpl
def slidekit_checkpoint_saved(step: int, path: Path) -> None:
    writer = _writers.get()
    if writer is not None:
        writer.add_text("checkpoints", f"saved checkpoint step {step} -> {path}", step)


@hookimpl
def slidekit_fit_end() -> None:
    writer = _writers.pop()
    if writer is not None:
        writer.close()
