"""An example slidekit plugin: the ``crc32_ram`` storage tier and the ``momentum_sgd`` optimizer.

A plugin is a module with ``@hookimpl`` functions named after slidekit's hook
specs, registered through an entry point in group ``slidekit``. This one
implements ``slidekit_storage_tiers`` and yields one ``TierDescriptor``, and
``slidekit_optimizers``, yielding one ``OptimizerDescriptor`` (the optimizer
is in ``sgd.py``). The tier is built on ``slidekit.tierkit``, the helpers the
bundled tiers share: ``byte_view`` (a tensor's bytes, with the checks),
``Counters`` (behind ``stats()``), ``caller_ready`` and ``StreamCopier``
(copies of GPU tensors ordered after the caller's stream) and ``IoPool``
(worker threads whose ``close`` never hangs on a stuck one).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from concurrent.futures import Future

import torch

from slidekit.hookspecs import hookimpl
from slidekit.interfaces import OptimizerDescriptor, TierContext, TierDescriptor, TierStats
from slidekit.tierkit import Counters, IoPool, StreamCopier, byte_view, caller_ready
from slidekit_example_tier.sgd import MomentumSGD

__all__ = ["CorruptRegionError", "Crc32RamTier", "MomentumSGD"]


class CorruptRegionError(RuntimeError):
    """A region's bytes no longer match the CRC-32 recorded when they were written."""


class Crc32RamTier:
    """Host-memory regions, each guarded by a CRC-32 over its bytes."""

    name = "crc32_ram"

    def __init__(self, ctx: TierContext) -> None:
        self._regions: dict[str, torch.Tensor] = {}
        self._crc: dict[str, int] = {}
        # One worker: reads and writes of a region, and its CRC, never interleave.
        self._pool = IoPool(1, tier=self.name, timeout_s=ctx.close_timeout_s)
        self._copier = StreamCopier()
        self._counters = Counters()

    def allocate(self, key: str, nbytes: int) -> None:
        if key in self._regions:
            raise KeyError(f"region {key!r} already exists")
        region = torch.zeros(nbytes, dtype=torch.uint8)
        self._regions[key] = region
        self._crc[key] = zlib.crc32(region.numpy())

    def map(self, key: str) -> torch.Tensor | None:
        return None  # every access goes through write/read, so every read is checked

    def free(self, key: str) -> None:
        self._regions.pop(key, None)
        self._crc.pop(key, None)

    def _span(self, key: str, t: torch.Tensor, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
        region = self._regions[key]  # KeyError names an unknown region
        data = byte_view(t)  # (n,) uint8; refuses non-contiguous tensors, naming the fix
        if offset < 0 or offset + data.numel() > region.numel():
            raise ValueError(
                f"region {key!r} holds {region.numel()} bytes; cannot move {data.numel()} at {offset}"
            )
        return region, data

    def write(self, key: str, src: torch.Tensor, offset: int = 0) -> Future[None]:
        region, data = self._span(key, src, offset)
        ready = caller_ready(data)  # now: a GPU source is complete once what is queued before it is

        def run() -> None:
            # After ``ready``, synchronised before it returns; pageable memory: no non-blocking copy.
            self._copier.copy(region[offset : offset + data.numel()], data, ready, non_blocking=False)
            self._crc[key] = zlib.crc32(region.numpy())
            self._counters.add(written=data.numel())

        return self._pool.submit(run)

    def read(self, key: str, dst: torch.Tensor, offset: int = 0) -> Future[None]:
        region, out = self._span(key, dst, offset)
        ready = caller_ready(out)  # now: a GPU destination is free once what is queued before it is

        def run() -> None:
            if zlib.crc32(region.numpy()) != self._crc[key]:
                raise CorruptRegionError(f"region {key!r} failed its CRC-32 check")
            self._copier.copy(out, region[offset : offset + out.numel()], ready, non_blocking=False)
            self._counters.add(read=out.numel())

        return self._pool.submit(run)

    def stats(self) -> TierStats:
        return self._counters.stats(
            allocated=sum(r.numel() for r in self._regions.values()),
            capacity=None,
            detail="host memory, CRC-32 checked",
        )

    def close(self) -> None:
        self._pool.close()  # waits at most ctx.close_timeout_s for a copy in flight, then warns
        self._regions.clear()


@hookimpl
def slidekit_storage_tiers() -> Iterator[TierDescriptor]:
    yield TierDescriptor(
        name="crc32_ram",
        factory=Crc32RamTier,
        priority=10,
        description="host memory with a CRC-32 check on every read (example plugin)",
    )


@hookimpl
def slidekit_optimizers() -> Iterator[OptimizerDescriptor]:
    yield OptimizerDescriptor(
        name="momentum_sgd",
        factory=MomentumSGD,
        priority=1,  # below the bundled optimizers: "auto" never picks it
        description="SGD with momentum, per unit, on any device (example plugin)",
    )
