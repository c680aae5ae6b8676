"""Pure placement arithmetic: which units stay on the compute device, where each unit's optimizer
state goes, and the pieces gradients come down in. No devices, no files.

``slidekit.planning.layout`` puts these together into the run's ``Layout``.
Test: ``pytest tests/test_placement.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "GRANULE",
    "MemoryPlan",
    "place_state",
    "plan_memory",
    "plan_residency",
    "ring_numel",
    "spread_host_units",
    "unit_pieces",
]

@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryPlan:
    """Buffer sizes the engine allocates, and what they cost."""

    slot_numel: int  # elements of one cache unit (parameters; gradients are the same size)
    window: int  # cache units on the compute device, the pinned tied embedding included
    grad_buffers: int  # shared host gradient buffers
    device_bytes: int  # cache units: parameters + gradients


def plan_memory(
    unit_numels: Sequence[int],
    *,
    compute_itemsize: int,
    window: int,
    grad_buffers: int,
    tied: bool,
) -> MemoryPlan:
    """Size the cache units for units of the given lengths (what the whole run needs, host
    memory included, is the run's ``slidekit.planning.Layout``).

    ``window`` counts the cache units that take turns; a tied embedding adds
    one pinned unit on top. At least two must take turns, so the next unit can
    load while the current one computes.
    """
    if window < 2:
        raise ValueError(f"window must be at least 2 cache units (one computing, one loading), got {window}")
    if grad_buffers < 1:
        raise ValueError(f"grad_buffers must be at least 1, got {grad_buffers}")
    slot = max(unit_numels)
    slots = window + (1 if tied else 0)
    return MemoryPlan(
        slot_numel=slot,
        window=slots,
        grad_buffers=grad_buffers,
        device_bytes=2 * slots * slot * compute_itemsize,
    )


#: Streamed state chunks and gradient pieces start at multiples of this many parameters.
GRANULE = 1 << 12


def ring_numel(numels: Sequence[int], kinds: Sequence[str], sliding: Sequence[bool], *, pieces: bool) -> int:
    """Elements of one shared host gradient buffer; 0 when no unit slides (the ring is not needed).

    The buffers take the gradients of every unit that slides. Where the
    optimizer can update a unit piece by piece (``pieces``: its state is
    linear in the parameters, see ``slidekit.engine.state``), they are sized
    for the largest sliding *layer* (rounded up to ``GRANULE``), and a larger
    unit (an embedding, a head) comes down and is updated in pieces of that
    size; otherwise for the largest sliding unit. Units kept on the compute
    device never come down, so they size nothing.
    """
    moving = [(n, k) for n, k, s in zip(numels, kinds, sliding, strict=True) if s]
    if not moving:
        return 0
    biggest = max(n for n, _ in moving)
    layers = [n for n, k in moving if k == "layer"]
    if not pieces or not layers:
        return biggest
    return min(biggest, -(-max(layers) // GRANULE) * GRANULE)


def unit_pieces(numel: int, piece: int) -> list[tuple[int, int]]:
    """The ranges [a, b) a unit of ``numel`` parameters comes down in, through buffers of ``piece``.

    ``piece`` comes from ``ring_numel`` for a unit that slides, so it is at
    least a layer (or the unit itself): a unit has a handful of pieces, never
    one per parameter.
    """
    if piece < 1:
        raise ValueError(f"a gradient piece needs at least one element, got {piece} (does the unit slide?)")
    return [(a, min(a + piece, numel)) for a in range(0, numel, piece)] if numel else [(0, 0)]


def place_state(num_units: int, fraction: float) -> list[bool]:
    """Which units' optimizer state goes to the offload tier: ``round(fraction * num_units)`` of them,
    spread evenly over the model so that streamed units alternate with in-memory ones."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction must lie in [0, 1], got {fraction}")
    target = round(fraction * num_units)
    return [(i + 1) * target // num_units > i * target // num_units for i in range(num_units)]


def spread_host_units(num_units: int, host: int) -> list[bool]:
    """Which of ``num_units`` units stay on the host when ``host`` of them must: spread evenly over the
    backward order, the first unit of that order (the head) first, the embedding last.

    A host unit's update runs on the CPU while the GPU computes the backward
    passes of the units after it, so host units separated by resident ones each
    get the backward time of the gap between them to hide their update in
    (and, in the forward pass, their upload). The units below the last host
    unit are resident: their backward covers its update and its upload for the
    next forward pass, which needs the lowest units first. Positions in backward
    order: ``floor(j * (num_units - 1) / host)`` for ``j < host``.
    """
    if not 0 <= host <= num_units:
        raise ValueError(f"host must lie in [0, {num_units}], got {host}")
    if host == num_units:
        return [True] * num_units
    chosen = [False] * num_units
    for j in range(host):
        chosen[num_units - 1 - j * (num_units - 1) // host] = True
    return chosen


def plan_residency(
    unit_numels: Sequence[int], *, bytes_per_param: float, budget: int, fraction: float | None = None
) -> list[bool]:
    """Which units live on the compute device for good, master and optimizer state included.

    The units that stay on the host are spread evenly over the backward order
    (``spread_host_units``), so each host update hides under the backward of
    the resident units after it instead of queueing behind the others. With
    ``fraction`` that share of the units (rounded) is resident, budget or not;
    otherwise the fewest host units whose spread leaves residents within
    ``budget`` bytes at ``bytes_per_param`` each.
    """
    units = len(unit_numels)
    if fraction is not None:
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"fraction must lie in [0, 1], got {fraction}")
        return [not h for h in spread_host_units(units, units - round(fraction * units))]
    for host in range(units + 1):
        on_host = spread_host_units(units, host)
        cost = sum(n for n, h in zip(unit_numels, on_host, strict=True) if not h) * bytes_per_param
        if cost <= budget:
            return [not h for h in on_host]
    return [False] * units
