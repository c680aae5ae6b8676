"""Which decoder layers keep their activations instead of recomputing them (``engine.recompute``).

A layer that *keeps* runs its forward with autograd on and holds the graph
(its output, per micro-batch) until its backward, which then back-propagates
through it without recomputing the forward: about 6N instead of 8N FLOPs per
token for a model of N parameters when every layer keeps. It saves no boundary
activation. Any decoder layer may keep, resident or sliding: a sliding layer's
graph holds references to its weights rather than its cache unit's tensors
(another unit takes the cache unit before the layer's backward), and its
backward reads them from the cache unit it is loaded into then
(``slidekit.engine.activations.KeptGraphs``). Forced offload leaves the
device almost empty, so its layers keep what a resident run keeps.

``engine.recompute``:

    "auto"  keep as many layers as the device memory left after the residency plan holds
            (``plan_keeps``), the last layers of the forward first (the first of the backward:
            their graphs are the first let go); on the CPU nothing is kept
    "all"   recompute every layer: no layer keeps (the engine's behaviour before keeping)
    "none"  every layer keeps

Pure: no devices. Test: ``pytest tests/engine/test_keep_activations.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from slidekit.errors import ConfigError

__all__ = ["RECOMPUTE", "check_keeps", "kept_runs", "plan_keeps"]

#: The values of ``engine.recompute``.
RECOMPUTE = ("auto", "all", "none")


class _Place(Protocol):  # what check_keeps reads of a ``UnitPlace`` (read-only: it is frozen)
    @property
    def index(self) -> int: ...
    @property
    def kind(self) -> str: ...
    @property
    def keeps(self) -> bool: ...


def plan_keeps(
    kinds: Sequence[str],
    *,
    recompute: str,
    per_layer: int,
    fixed: int,
    budget: int | None,
) -> list[bool]:
    """Per unit: whether it keeps its activations.

    ``kinds``: per unit; ``per_layer``: device bytes one keeping layer adds (its graphs over a step's
    micro-batches, less the boundary activations it no longer saves); ``fixed``: bytes each run of
    consecutive keeping layers adds (its last layer's output, held until its backward); ``budget``:
    device bytes left for it (None: the CPU, where "auto" keeps nothing).
    """
    if recompute not in RECOMPUTE:
        raise ConfigError(f"engine.recompute must be one of {list(RECOMPUTE)}, got {recompute!r}")
    layers = [i for i, k in enumerate(kinds) if k == "layer"]
    out = [False] * len(kinds)
    if recompute == "all":
        return out
    if recompute == "none":
        for i in layers:
            out[i] = True
        return out
    if budget is None:
        return out
    room = budget
    # The last layers of the forward first (the first of the backward); each run of consecutive
    # keeping layers also holds its last output until its backward (``fixed``).
    for n, i in enumerate(reversed(layers)):
        need = per_layer + (0 if n else fixed)
        if room < need:
            break
        out[i] = True
        room -= need
    return out


def kept_runs(keeps: Sequence[bool]) -> int:
    """Runs of consecutive keeping units: each holds its last layer's output until that layer's backward."""
    return sum(k and (i + 1 == len(keeps) or not keeps[i + 1]) for i, k in enumerate(keeps))


def check_keeps(units: Sequence[_Place]) -> None:
    """Refuse a layout in which a unit that is not a decoder layer keeps its activations."""
    bad = [u.index for u in units if u.keeps and u.kind != "layer"]
    if bad:
        raise ConfigError(
            f"units {_span(bad)} are to keep their activations, but only decoder layers may (the embedding's "
            "backward needs no activation, the head computes its loss and gradients in one visit); let them "
            "recompute (engine.recompute='auto' or 'all')"
        )


def _span(units: Sequence[int]) -> str:
    return ", ".join(str(u) for u in units)
