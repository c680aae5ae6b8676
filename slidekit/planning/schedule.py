"""The visit schedule of a training step: which unit the compute device works on, in what order.

A step visits units in this order (L decoder layers; unit 0 is the
embedding, L+1 the head)::

    fwd 0, fwd 1, ..., fwd L, head L+1, bwd L, ..., bwd 1, bwd 0

``head`` computes the loss and its gradients at once (the fused linear +
cross-entropy never keeps the logits), so the head's backward needs no second
visit. ``bwd 0`` needs only a gradient buffer, not the embedding's weights,
unless the LM head is tied to it: then the embedding stays in a pinned cache
unit for the whole step, because the head needs its weights and both ends add
to its gradient. Pure: no devices, no files. Test: ``pytest tests/test_placement.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BWD", "FWD", "HEAD", "Visit", "schedule"]

FWD, HEAD, BWD = "fwd", "head", "bwd"


@dataclass(frozen=True, slots=True)
class Visit:
    """One unit's turn on the compute device."""

    unit: int
    phase: str  # "fwd", "head" or "bwd"
    needs_params: bool  # must the unit's weights be in a cache unit?


def schedule(num_layers: int, tied: bool) -> tuple[Visit, ...]:
    """The visits of one training step, in order."""
    if num_layers < 1:
        raise ValueError(f"a model needs at least one decoder layer, got {num_layers}")
    head = num_layers + 1
    visits = [Visit(0, FWD, True)]
    visits += [Visit(i, FWD, True) for i in range(1, head)]
    visits.append(Visit(head, HEAD, True))
    visits += [Visit(i, BWD, True) for i in range(num_layers, 0, -1)]
    visits.append(Visit(0, BWD, tied))
    return tuple(visits)
