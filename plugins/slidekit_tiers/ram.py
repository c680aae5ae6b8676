"""The ``ram`` storage tier: regions in host memory, pinned when an accelerator exists.

Pinned (page-locked) memory lets copies to and from the GPU run
asynchronously at full bus speed; without an accelerator pinning buys
nothing, so regions are ordinary pageable memory, and the tier says which.
Regions can be mapped, so the engine updates optimizer state in place.
A region is page-locked on its first copy to or from a device, not when it
is allocated (``HostBuffers.lock``): the boundary activations cross the bus
every step and are locked in the first, while optimizer state that only the
CPU updates in place is never locked (7.1 s of a 3B model's setup and 8 B
per parameter of locked RAM, NOTES.md 34).

Copies run on the tier's own worker threads; copies to or from the GPU run on
a side stream that first waits for the caller's current stream, so a source
produced by queued kernels is complete and a destination is no longer in use
(``slidekit.tierkit``: byte views, counters, ordered copies and the worker
pool, whose ``close`` gives up on a stuck copy after
``TierContext.close_timeout_s`` with a warning).

Test: ``pytest tests/plugins/test_ram_tier.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Future

import torch

from slidekit.hookspecs import hookimpl
from slidekit.hostmem import HostBuffers, PageLocker
from slidekit.interfaces import Availability, TierContext, TierDescriptor, TierStats
from slidekit.tierkit import Counters, IoPool, StreamCopier, byte_view, caller_ready

__all__ = ["RamTier"]


def _pin_default() -> bool:
    return torch.cuda.is_available()


def _available() -> Availability:
    if _pin_default():
        return True, "pinned host memory"
    return True, "pageable host memory (no accelerator to pin for)"


class RamTier:
    """Named byte regions in host memory."""

    name = "ram"

    def __init__(self, ctx: TierContext, *, pin: bool | None = None, pages: PageLocker | None = None) -> None:
        """``pin``: page-lock regions for device copies (default: when CUDA is available); ``pages``: what
        locks them (default ``cudaHostRegister``; tests pass a stand-in)."""
        self.pin = _pin_default() if pin is None else pin
        self._memory = HostBuffers(pin=self.pin, pages=pages)  # exact-size, page-locked on first device copy
        self._regions: dict[str, torch.Tensor] = {}
        self._pool = IoPool(ctx.io_threads, tier=self.name, timeout_s=ctx.close_timeout_s)
        self._copier = StreamCopier()
        self._counters = Counters()

    # ---------------------------------------------------------------- regions

    def allocate(self, key: str, nbytes: int) -> None:
        if nbytes < 0:
            raise ValueError(f"region {key!r}: size must be >= 0 bytes, got {nbytes}")
        if key in self._regions:
            raise KeyError(f"region {key!r} already exists; free it first")
        self._regions[key] = self._memory.empty(nbytes, torch.uint8, lock_now=False)

    def map(self, key: str) -> torch.Tensor | None:
        return self._region(key)

    def locked(self, key: str) -> bool:
        """Whether region ``key`` is page-locked now (it is from its first copy to or from a device)."""
        return self._memory.locked(self._region(key))

    def free(self, key: str) -> None:
        region = self._regions.pop(key, None)
        if region is not None:
            self._memory.release(region)

    def _region(self, key: str) -> torch.Tensor:
        try:
            return self._regions[key]
        except KeyError:
            raise KeyError(f"no region {key!r} in the ram tier; allocate it first") from None

    def _span(self, key: str, t: torch.Tensor, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
        region = self._region(key)
        data = byte_view(t)
        if offset < 0 or offset + data.numel() > region.numel():
            raise ValueError(
                f"region {key!r} holds {region.numel()} bytes; cannot move {data.numel()} bytes at offset {offset}"
            )
        return region[offset : offset + data.numel()], data

    # ---------------------------------------------------------------- I/O

    def write(self, key: str, src: torch.Tensor, offset: int = 0) -> Future[None]:
        dst, data = self._span(key, src, offset)
        return self._copy(key, dst, data, lambda n: self._counters.add(written=n))

    def read(self, key: str, dst: torch.Tensor, offset: int = 0) -> Future[None]:
        src, data = self._span(key, dst, offset)
        return self._copy(key, data, src, lambda n: self._counters.add(read=n))

    def _copy(self, key: str, dst: torch.Tensor, src: torch.Tensor, done: Callable[[int], None]) -> Future[None]:
        ready = caller_ready(dst, src)  # now: after everything already queued on the caller's stream
        # A copy to or from a device locks the region first (once; the tier's workers, not the caller).
        region = self._region(key) if self.pin and (dst.device.type, src.device.type) != ("cpu", "cpu") else None

        def run() -> None:
            if region is not None:
                self._memory.lock(region)
            self._copier.copy(dst, src, ready, non_blocking=self.pin)
            done(src.numel())

        return self._pool.submit(run)

    # ---------------------------------------------------------------- reporting

    def stats(self) -> TierStats:
        return self._counters.stats(
            allocated=sum(r.numel() for r in self._regions.values()),
            capacity=None,
            detail="pinned host memory (each region on its first device copy)" if self.pin else "pageable host memory",
        )

    def close(self) -> None:
        finished = self._pool.close()
        self._regions.clear()
        if finished:  # else a stuck copy may still use the buffers: they stay until exit
            self._memory.close()


@hookimpl
def slidekit_storage_tiers() -> Iterator[TierDescriptor]:
    yield TierDescriptor(
        name="ram",
        factory=RamTier,
        available=_available,
        priority=100,
        description="host memory (pinned when an accelerator exists)",
    )
