"""Weight-decay groups of a unit's flat parameter vector."""

from __future__ import annotations

from collections.abc import Sequence

from slidekit.interfaces import ParamGroupRange
from slidekit.models.base import UnitLayout

__all__ = ["param_groups"]


def param_groups(unit: UnitLayout, weight_decay: float, no_decay: Sequence[str]) -> list[ParamGroupRange]:
    """Weight-decay ranges of a unit's flat vector: decay unless the name ends with a ``no_decay`` suffix."""
    groups: list[ParamGroupRange] = []
    for e in unit.entries:
        wd = 0.0 if any(e.name.endswith(s) for s in no_decay) else weight_decay
        if groups and groups[-1].weight_decay == wd:
            groups[-1] = ParamGroupRange(start=groups[-1].start, stop=e.stop, weight_decay=wd)
        else:
            groups.append(ParamGroupRange(start=e.offset, stop=e.stop, weight_decay=wd))
    return groups
