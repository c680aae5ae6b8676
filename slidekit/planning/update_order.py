"""What ``engine.update_order`` makes of a layout: whether a step that does not clip takes its host
updates in the next forward's order.

"arrival" updates each sliding unit as its gradients come down, through the
shared ring of ``grad_buffers`` host buffers: the optimizer must free the
oldest buffer first, so it works in the backward's order, and the next
forward, which needs unit 0 first, waits for the whole backlog before its
first upload. "forward" gives every sliding unit a gradient buffer of its own
(2 B/param of host RAM in BF16, the buffers a clipped step keeps anyway) and
the optimizer takes, of the units whose gradients have come down, the one the
next forward needs first (``slidekit.engine.speculation``'s takers, without
backups), so the next forward's uploads overlap the updates still running.
The bits are the same either way: each unit's update reads only its own
gradient. "auto" is "forward" where the step-time model, on a GPU with
known rates, predicts it faster and host RAM holds the buffers; without a
prediction (the CPU) it is "arrival"; a GPU no profile knows has its rates probed
(``slidekit.planning.probe``). The planner
plans memory and placements in the arrival order; ``order_layout`` then
adds the buffers. A step that clips or skips non-finite steps defers its
updates (or speculates) in forward order anyway, so a layout that keeps
gradients for that is left as it is. The engine's builder (``slidekit.building``) and ``slidekit plan``
(``slidekit.planning.report``) both take the layout from ``order_layout``.

Test: ``pytest tests/test_update_order.py`` (the planner) and ``tests/engine/test_forward_updates.py`` (the
engine: bitwise the arrival order, the takes in order).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from slidekit.planning.estimate import Machine
    from slidekit.planning.layout import Layout
    from slidekit.planning.planner import Planner

__all__ = ["arrival_order", "forward_order", "grad_buffer_bytes", "order_layout"]


def forward_order(layout: Layout) -> Layout:
    """``layout`` with its host updates in the next forward's order: every sliding unit's own gradient
    buffer, and ``forward_updates``. A layout that keeps gradients for clipping (its steps defer, in
    forward order already) or where nothing slides is returned as it is."""
    if layout.unit_grads or not any(u.slides for u in layout.units):
        return layout
    return dataclasses.replace(layout, forward_updates=True, unit_grads=True)


def arrival_order(layout: Layout) -> Layout:
    """``layout`` with its host updates as the gradients arrive (undoes ``forward_order``)."""
    if not layout.forward_updates:
        return layout
    return dataclasses.replace(layout, forward_updates=False, unit_grads=False)


def order_layout(
    planner: Planner, layout: Layout, machine: Machine, policy: str
) -> tuple[Layout, str | None]:
    """``layout`` (as the planner builds it: arrival order) for ``policy`` (``engine.update_order``):
    "forward" takes the forward order (``forward_order``; the fit check refuses what does not fit); "auto"
    takes it where the step-time model (``Planner.predict``, where the machine has rates) predicts it
    faster and host RAM holds the buffers, else keeps the arrival order, with a note when only the RAM
    stood in the way; "arrival" keeps it."""
    forward = layout if policy == "arrival" else forward_order(layout)
    if forward is layout or policy == "forward":
        return forward, None
    ahead, behind = planner.predict(forward, machine), planner.predict(layout, machine)
    if ahead is None or behind is None or ahead.seconds >= behind.seconds:
        return layout, None
    if not planner.estimate_layout(forward, machine).host_fits(machine):
        return layout, (
            f"engine.update_order='auto': the step-time model predicts {ahead.seconds:.3f} s a step with the "
            f"host updates in the next forward's order and {behind.seconds:.3f} s as they arrive, but host RAM "
            f"lacks the {grad_buffer_bytes(forward) / 2**30:.1f} GiB of every sliding unit's own gradient buffer, so "
            "they run as they arrive (free host RAM, or set engine.update_order='arrival' to silence this)"
        )
    return forward, None


def grad_buffer_bytes(layout: Layout) -> int:
    """Bytes of every sliding unit's own gradient buffer (the forward order's, or a clipped step's)."""
    return layout.itemsize * sum(u.own for u in layout.units if u.slides)
