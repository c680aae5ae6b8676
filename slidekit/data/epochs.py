"""How many optimizer steps a run takes: ``steps``, or ``epochs`` passes over the training rows.

One step takes ``data.batch_size * grad_accum`` rows, so an epoch is
``steps_per_epoch = rows // (batch_size * grad_accum)`` steps (rounded down: the rows left over start
the next epoch's permutation, as the batches are endless). A run with ``epochs`` takes
``ceil(epochs * steps_per_epoch)`` steps (rounded up, as transformers' Trainer rounds
``num_train_epochs``, so the run covers at least the epochs asked for; the product is first rounded
to 9 decimals, so that 0.1 epoch of 30 steps is 3 steps, not 4). A run that sets ``steps`` takes that
many, with or without ``epochs``: ``steps`` wins, as ``max_steps`` wins over ``num_train_epochs``
in transformers. A run that sets neither takes ``DEFAULT_STEPS``. Training data with fewer rows than
one step is an error that names the numbers.

``count_steps`` is the one place this is decided; the Trainer fixes the count when it is built (so a
resumed run, whose data cannot change, gets the same count) and ``slidekit plan`` prints the same.

Test: ``python -m pytest -q tests/test_epochs.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from slidekit.config import DEFAULT_STEPS
from slidekit.errors import ConfigError

__all__ = ["StepCount", "count_steps", "needs_rows", "steps_per_epoch"]


def steps_per_epoch(rows: int, batch_size: int, grad_accum: int) -> int:
    """Optimizer steps in one pass over ``rows`` training rows: ``rows // (batch_size * grad_accum)``."""
    per_step = batch_size * grad_accum
    if rows < per_step:
        raise ConfigError(
            f"the training data holds {rows} rows, fewer than one step takes: {batch_size} rows per "
            f"micro-batch x {grad_accum} micro-batches = {per_step}; add data, or lower data.batch_size "
            "(CLI: --batch-size) or grad_accum (--grad-accum), or data.seq_len (--seq-len) for more rows"
        )
    return rows // per_step


def _epochs(value: float | None) -> str:
    return f"{value:.4g} epoch{'' if value == 1 else 's'}"


@dataclass(frozen=True, slots=True)
class StepCount:
    """The run's optimizer steps and where the number comes from."""

    total: int  # optimizer steps of the whole run
    per_epoch: int | None  # steps in one pass over the training rows; None when the rows are not known
    epochs: float | None  # the epochs asked for (None: none were)
    source: str  # "steps" (set), "epochs" (computed from them) or "default" (DEFAULT_STEPS)

    def describe(self) -> str:
        """One line for the log, e.g. "300 steps = 2 epochs of 150 steps"."""
        if self.source == "epochs":
            return f"{self.total} steps = {_epochs(self.epochs)} of {self.per_epoch} steps"
        what = "steps" if self.source == "steps" else "the default: neither steps nor epochs set"
        line = f"{self.total} steps ({what}"
        if self.epochs is not None:
            line += f"; steps wins over epochs = {self.epochs:g}, as max_steps does in transformers"
        if self.per_epoch:
            line += f"; {_epochs(self.total / self.per_epoch)} of {self.per_epoch} steps"
        return line + ")"


def needs_rows(steps: int | None, epochs: float | None) -> bool:
    """Whether the step count depends on the training data: ``epochs`` set and ``steps`` not."""
    return steps is None and epochs is not None


def count_steps(
    steps: int | None,
    epochs: float | None,
    *,
    rows: int | None = None,
    batch_size: int,
    grad_accum: int,
) -> StepCount:
    """The run's step count (see the module docstring); ``rows`` (the training rows) is needed only
    when ``needs_rows``, and gives ``per_epoch`` whenever it is known."""
    per_epoch = steps_per_epoch(rows, batch_size, grad_accum) if rows is not None else None
    if steps is not None:
        return StepCount(steps, per_epoch, epochs, "steps")
    if epochs is None:
        return StepCount(DEFAULT_STEPS, per_epoch, None, "default")
    if per_epoch is None:
        raise ValueError("count_steps needs the training rows to count epochs (needs_rows)")
    return StepCount(max(1, math.ceil(round(epochs * per_epoch, 9))), per_epoch, epochs, "epochs")
