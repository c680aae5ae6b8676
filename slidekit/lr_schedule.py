"""Learning-rate schedules: the multiplier applied to the peak learning rate at each step.

With ``w`` warm-up steps, ``T`` total steps, step ``s`` (1-based, the step
about to be taken) and ``r`` the floor ratio (``min_lr_ratio``):

* ``constant``: 1 after a linear warm-up (``s / w`` while ``s <= w``);
* ``linear``: warm-up, then a straight line from 1 at step ``w`` down to ``r`` at step ``T``;
* ``cosine``: warm-up, then ``r + (1 - r) * (1 + cos(pi * p)) / 2`` with
  ``p = (s - w) / (T - w)`` going from 0 to 1.

``lr_factor`` is pure; the trainer multiplies it by ``OptimConfig.lr``, and
the reference loop feeds the same function to ``torch.optim.lr_scheduler.LambdaLR``.
"""

from __future__ import annotations

import math

__all__ = ["SCHEDULES", "lr_factor"]

SCHEDULES = ("constant", "linear", "cosine")


def lr_factor(step: int, *, schedule: str, total: int, warmup: int = 0, min_ratio: float = 0.0) -> float:
    """Multiplier of the peak learning rate for 1-based ``step`` of ``total``."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose one of: {', '.join(SCHEDULES)}")
    if step < 1:
        raise ValueError(f"steps are 1-based, got {step}")
    if warmup and step <= warmup:
        return step / warmup
    if schedule == "constant" or total <= warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / (total - warmup))
    if schedule == "linear":
        return min_ratio + (1.0 - min_ratio) * (1.0 - progress)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
