"""A unit on the compute device keeps its weights, or slides them (``engine.resident_weights``).

A unit's *placement* says where its FP32 master and optimizer state live and
where its compute-dtype weights and gradients come from. Bytes per parameter
of each (one process; ``s`` the compute dtype's size, 2 in BF16; ``S`` the
optimizer's state, 8 for layer_adam, 2 for adamw_8bit; "deferring": the step
must see every gradient first, ``optim.max_grad_norm`` or
``optim.on_nonfinite='skip'``):

    placement                          device                    host
    resident (weights kept)            4 + S + 2s                0
    device state, sliding weights      4 + S (+ s deferring)     0
    host (slides)                      0                         4 + S (+ s deferring)

The window's cache units (``slidekit.planning.placement.plan_memory``) come on
top, once for the run: every unit that is not resident with its weights kept
takes one for each visit. In BF16 with adamw_8bit that is 10 B/param for a
resident unit and 6 for one whose weights slide: a device holds about 1.7
times as many parameters' masters and state.

A unit whose master and state are on the device but whose weights slide
(``UnitPlace.weights_slide``) is updated there with the same fused update as
a resident unit; for each visit it takes a cache unit like a sliding unit,
and its weights are cast into it from the master on the device (no bus
crossing: 4 B read + 2 B written per parameter, priced on the upload lane as the
engine casts it, on the upload stream: ``slidekit.planning.timing``);
its gradients stay in the cache unit, and it is updated from there right
after its backward, or, deferring, from a gradient buffer of its own on the
device at the step's end. It never keeps its activations (its cache unit is
reused: ``slidekit.planning.keeping``).

``engine.resident_weights``: "keep" keeps every device unit's weights;
"slide" slides every device unit's weights; "auto" (the default) is decided by
``Planner.weights_layout``: "keep"'s layout where it fits and is not predicted
slower, else the sliding-first rule, which puts as many units on the device as
fit at the sliding cost first (``Planner.residency``), then keeps the weights
of as many of them as the device memory left holds (``plan_weights``), the
smallest first. As a rule (``Planner.placed``, ``plan_weights``), "auto" is
that sliding-first rule.

Data-parallel (``slidekit.engine.collectives``): a rank keeps its shard's
master and state, and always a gradient buffer of its shard (the d2h lane
reduces the gradient over the ranks into it; the update waits for the step's
end, as a resident unit's does): (4 + S + s) / world B/param; each cast
writes the rank's shard into the cache unit and gathers the others'.

Pure: no devices. Test: ``pytest tests/engine/test_device_state_units.py``.
"""

from __future__ import annotations

from collections.abc import Sequence

from slidekit.config import RESIDENT_WEIGHTS
from slidekit.errors import ConfigError

__all__ = ["RESIDENT_WEIGHTS", "device_unit_bytes", "plan_weights"]


def device_unit_bytes(*, own: int, padded: int, state: int, itemsize: int, slide: bool, deferred: bool) -> int:
    """Device bytes of one unit whose master and state live on the device: the master and state of its
    ``own`` parameters (the rank's shard), and either its weights and gradients (``padded`` elements each)
    or, when its weights ``slide`` and its update waits for the step's end (``deferred``: the step defers,
    or a data-parallel rank reduces the gradient), a gradient buffer of ``own`` elements."""
    if slide:
        return 4 * own + state + (itemsize * own if deferred else 0)
    return 4 * own + state + 2 * itemsize * padded


def plan_weights(
    mode: str,
    resident: Sequence[bool],
    *,
    keep_cost: Sequence[int],
    slide_cost: Sequence[int],
    budget: int | None,
) -> list[bool]:
    """Per unit: whether its weights slide (only units on the device, ``resident``, can).

    "keep": none; "slide": every resident unit; "auto": with ``budget`` the device bytes left for resident
    units (None: no device budget, as on the CPU, where nothing is saved: every unit keeps), the resident
    units keep their weights, the cheapest upgrade (``keep_cost - slide_cost``) first, as long as the
    budget left after every resident unit's sliding cost holds them; the rest slide.
    """
    if mode not in RESIDENT_WEIGHTS:
        raise ConfigError(f"engine.resident_weights must be one of {list(RESIDENT_WEIGHTS)}, got {mode!r}")
    if mode == "keep" or (mode == "auto" and budget is None):
        return [False] * len(resident)
    if mode == "slide":
        return list(resident)
    assert budget is not None
    slide = list(resident)
    room = budget - sum(c for c, r in zip(slide_cost, resident, strict=True) if r)
    on_device = [i for i, r in enumerate(resident) if r]
    for i in sorted(on_device, key=lambda i: (keep_cost[i] - slide_cost[i], -i)):
        extra = keep_cost[i] - slide_cost[i]
        if extra > room:
            break
        slide[i] = False
        room -= extra
    return slide

