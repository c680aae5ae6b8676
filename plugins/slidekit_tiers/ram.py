"""The ``ram`` storage tier: regions in host memory, pinned when an accelerator exists.

Pinned (page-locked) memory lets copies to and from the GPU run
asynchronously at full bus speed; without an accelerator pinning buys
nothing, so regions are ordinary pageable memory, and the tier says which.
Regions can be mapped, so the engine updates optimizer state in place.

Copies run on the tier's own worker threads; copies to or from the GPU run on
a side stream that first waits for the caller's current stream, so a source
produced by queued kernels is complete and a destination is no longer in use.

Test: ``pytest tests/plugins/test_ram_tier.py``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from slidekit.hookspecs import hookimpl
from slidekit.hostmem import HostBuffers
from slidekit.interfaces import Availability, TierContext, TierDescriptor, TierStats

__all__ = ["RamTier"]


def _pin_default() -> bool:
    return torch.cuda.is_available()


def _available() -> Availability:
    if _pin_default():
        return True, "pinned host memory"
    return True, "pageable host memory (no accelerator to pin for)"


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError("storage tiers move contiguous tensors only; call .contiguous() first")
    return t.reshape(-1).view(torch.uint8)


class RamTier:
    """Named byte regions in host memory."""

    name = "ram"

    def __init__(self, ctx: TierContext, *, pin: bool | None = None) -> None:
        self.pin = _pin_default() if pin is None else pin
        self._memory = HostBuffers(pin=self.pin)  # exact-size page-locked buffers
        self._regions: dict[str, torch.Tensor] = {}
        self._pool = ThreadPoolExecutor(max(1, ctx.io_threads), thread_name_prefix="slidekit-ram")
        self._lock = threading.Lock()
        self._written = 0
        self._read = 0
        self._local = threading.local()

    # ---------------------------------------------------------------- regions

    def allocate(self, key: str, nbytes: int) -> None:
        if nbytes < 0:
            raise ValueError(f"region {key!r}: size must be >= 0 bytes, got {nbytes}")
        if key in self._regions:
            raise KeyError(f"region {key!r} already exists; free it first")
        self._regions[key] = self._memory.empty(nbytes, torch.uint8)

    def map(self, key: str) -> torch.Tensor | None:
        return self._region(key)

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
        data = _as_bytes(t)
        if offset < 0 or offset + data.numel() > region.numel():
            raise ValueError(
                f"region {key!r} holds {region.numel()} bytes; cannot move {data.numel()} bytes at offset {offset}"
            )
        return region[offset : offset + data.numel()], data

    # ---------------------------------------------------------------- I/O

    def write(self, key: str, src: torch.Tensor, offset: int = 0) -> Future[None]:
        dst, data = self._span(key, src, offset)
        return self._copy(dst, data, lambda n: self._count(written=n))

    def read(self, key: str, dst: torch.Tensor, offset: int = 0) -> Future[None]:
        src, data = self._span(key, dst, offset)
        return self._copy(data, src, lambda n: self._count(read=n))

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, done: Callable[[int], None]) -> Future[None]:
        device = dst.device if dst.is_cuda else src.device
        if device.type != "cuda":

            def run_host() -> None:
                dst.copy_(src)
                done(src.numel())

            return self._pool.submit(run_host)
        # Order the copy after everything already queued on the caller's stream.
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(device))

        def run_device() -> None:
            stream = self._stream(device)
            with torch.cuda.stream(stream):
                stream.wait_event(ready)
                dst.copy_(src, non_blocking=self.pin)
            stream.synchronize()
            done(src.numel())

        return self._pool.submit(run_device)

    def _stream(self, device: torch.device) -> Any:
        stream = getattr(self._local, "stream", None)
        if stream is None:
            stream = self._local.stream = torch.cuda.Stream(device)
        return stream

    def _count(self, *, written: int = 0, read: int = 0) -> None:
        with self._lock:
            self._written += written
            self._read += read

    # ---------------------------------------------------------------- reporting

    def stats(self) -> TierStats:
        return TierStats(
            bytes_written=self._written,
            bytes_read=self._read,
            bytes_allocated=sum(r.numel() for r in self._regions.values()),
            capacity=None,
            detail="pinned host memory" if self.pin else "pageable host memory",
        )

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._regions.clear()
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
