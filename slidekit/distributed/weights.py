"""Filling a rank's master shards with the model's weights (or the seeded random initialisation).

Each rank reads (or draws) every unit whole into a temporary host buffer and
keeps its shard: the same values as a single process, whatever the world
size. One unit at a time, so a rank's transient host memory is one unit's
FP32 copy beyond its shards.

Test: ``pytest tests/distributed/test_equivalence.py``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from slidekit.distributed.shards import Shard
from slidekit.models.base import ArchSpec
from slidekit.models.loading import fill_masters, init_unit, load_unit_weights

__all__ = ["fill_shards"]


def fill_shards(
    spec: ArchSpec,
    masters: Sequence[torch.Tensor],
    shards: Sequence[Shard] | None,
    files: Mapping[str, Any],
    seed: int,
) -> None:
    """``fill_masters`` for masters that hold ``shards`` of the units (None: whole units)."""
    if shards is None:
        fill_masters(spec, masters, files, seed)
        return
    for unit, master, shard in zip(spec.units, masters, shards, strict=True):
        whole = torch.empty(unit.numel, dtype=torch.float32)
        if files:
            load_unit_weights(unit, files, whole)
        else:
            init_unit(spec, unit, whole, seed)
        master.copy_(whole[shard.start : shard.stop])
