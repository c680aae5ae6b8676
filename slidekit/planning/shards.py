"""Which part of every unit each data-parallel rank owns: pure arithmetic, no devices, no process groups.

Part of the layout: ``UnitPlace.shard`` is the rank's shard of the unit, and every
per-rank size in a ``Layout`` (host masters, state, gradient buffers) follows it.

With ``world`` ranks, a unit of ``numel`` parameters is cut into ``world``
chunks of ``chunk = ceil(numel / world)`` parameters rounded up to a
multiple of ``GRANULE``; rank ``r`` owns ``[r * chunk, (r + 1) * chunk)``
clipped to the unit, so the last ranks' shards are shorter (or empty, for a
unit smaller than ``(world - 1) * chunk``). Cutting at ``GRANULE`` multiples
keeps every shard's optimizer state a slice of the whole unit's (the
``linear_state`` contract of ``slidekit.engine.state``; block-wise quantized
moments keep their blocks), so a shard's update is, element for element, the
update a single process makes, and checkpoints can be re-cut for another
world size.

Collectives want equal pieces: the unit's flat buffers on the device are
``world * chunk`` long (``padded``), the tail beyond ``numel`` zeroed in the
gradients and never read as weights.

Test: ``pytest tests/distributed/test_dp_shards.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from slidekit.planning.placement import GRANULE

__all__ = ["Shard", "unit_shard", "unit_shards"]


@dataclass(frozen=True, slots=True)
class Shard:
    """Rank ``rank``'s part ``[start, stop)`` of a unit of ``numel`` parameters, cut in ``chunk``s."""

    rank: int
    world: int
    numel: int
    chunk: int  # parameters per rank's piece of the padded unit (a multiple of GRANULE, or the unit)

    @property
    def start(self) -> int:
        return min(self.rank * self.chunk, self.numel)

    @property
    def stop(self) -> int:
        return min((self.rank + 1) * self.chunk, self.numel)

    @property
    def size(self) -> int:
        return self.stop - self.start

    @property
    def padded(self) -> int:
        """Elements of the unit's buffers for the collectives: ``world`` equal pieces."""
        return self.world * self.chunk

    @property
    def offset(self) -> int:
        """Where this rank's piece begins in the padded buffer (its ``start`` unless the shard is empty)."""
        return self.rank * self.chunk

    def of(self, rank: int) -> Shard:
        """The same unit's shard of another rank."""
        return Shard(rank, self.world, self.numel, self.chunk)


def unit_shard(numel: int, world: int, rank: int) -> Shard:
    """Rank ``rank``'s shard of a unit of ``numel`` parameters among ``world`` ranks.

    One rank owns the whole unit, unpadded: exactly the single-process engine.
    """
    if world < 1:
        raise ValueError(f"world size must be at least 1, got {world}")
    if not 0 <= rank < world:
        raise ValueError(f"rank must lie in [0, {world}), got {rank}")
    if numel < 0:
        raise ValueError(f"a unit has at least 0 parameters, got {numel}")
    if world == 1:
        return Shard(0, 1, numel, numel)
    chunk = -(-numel // world)
    chunk = max(GRANULE, -(-chunk // GRANULE) * GRANULE)
    return Shard(rank, world, numel, chunk)


def unit_shards(numels: Sequence[int], world: int, rank: int) -> tuple[Shard, ...]:
    """Rank ``rank``'s shard of every unit."""
    return tuple(unit_shard(n, world, rank) for n in numels)
