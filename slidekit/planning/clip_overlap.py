"""What ``optim.clip_overlap`` makes of a layout: whether clipped steps speculate (and hold backups).

Speculative clipping (``slidekit.engine.speculation``) updates host units during
the backward as if the step did not clip, each chunk's master and state copied
to a backup first; "defer" queues every update at the step's end. The choice is
the planner's, so that ``slidekit plan`` predicts the step the engine then
runs: the engine's builder (``slidekit.building``) and ``slidekit plan``
(``slidekit.planning.report``) both take the layout from ``overlap_layout``.

Test: ``pytest tests/test_timing.py -k clip_overlap``.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from slidekit.planning.estimate import Machine
    from slidekit.planning.layout import Layout
    from slidekit.planning.planner import Planner

__all__ = ["overlap_layout"]


def overlap_layout(
    planner: Planner, layout: Layout, machine: Machine, policy: str
) -> tuple[Layout, str | None]:
    """``layout`` for ``policy`` (``optim.clip_overlap``): "auto" drops the backups when host RAM cannot
    hold them, or when the step-time model (``Planner.predict``, where the machine has rates) predicts
    a step that speculates no faster than one that defers, with a note saying which; "speculate" keeps
    them (the fit check refuses what does not fit); "defer" has none (the planner builds it so)."""
    if policy != "auto" or not layout.clip_backup:
        return layout, None
    deferred = dataclasses.replace(layout, clip_backup=False)
    if not planner.estimate_layout(layout, machine).host_fits(machine):
        backup = layout.allocations()["host"]["clip backup"]
        return deferred, (
            f"optim.clip_overlap='auto': host RAM lacks the {backup / 2**30:.1f} GiB the speculative-clipping "
            "backups need, so clipped steps defer their updates to the step's end (slower; free host RAM or "
            "set optim.clip_overlap='defer' to silence this)"
        )
    ahead, behind = planner.predict(layout, machine), planner.predict(deferred, machine)
    if ahead is None or behind is None or ahead.seconds < behind.seconds:
        return layout, None  # no prediction (the CPU, a GPU without rates), or speculating is faster
    return deferred, (
        f"optim.clip_overlap='auto': the step-time model predicts {behind.seconds:.3f} s a step deferring the "
        f"host updates and {ahead.seconds:.3f} s speculating (the backups' copies cost more than the overlap "
        "gains here), so clipped steps defer (optim.clip_overlap='speculate' speculates anyway)"
    )
