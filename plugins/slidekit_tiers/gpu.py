"""The ``gpu`` storage tier: regions in the compute device's own memory.

For what should never leave the GPU when it fits there: boundary
activations of a model that fits, or the optimizer state of units the
engine keeps resident on the device (it then updates them there, with no
transfer at all). Regions map: ``map`` returns the device tensor itself.
Copies to and from it follow the ram tier's stream discipline (a side stream
that first waits for the caller's current stream).

Test: ``pytest tests/plugins/test_gpu_tier.py`` (on a CUDA machine).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from slidekit.hookspecs import hookimpl
from slidekit.interfaces import Availability, TierContext, TierDescriptor, TierStats
from slidekit_tiers.ram import RamTier

__all__ = ["GpuTier"]


def _available() -> Availability:
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    free, total = torch.cuda.mem_get_info()
    return True, f"device memory ({free / 2**30:.0f} of {total / 2**30:.0f} GiB free)"


class GpuTier(RamTier):
    """Named byte regions in device memory."""

    name = "gpu"

    def __init__(self, ctx: TierContext) -> None:
        if ctx.device.type != "cuda":
            raise RuntimeError(f"the gpu tier needs a CUDA compute device, got {ctx.device}; use ram instead")
        super().__init__(ctx, pin=False)
        self.device = ctx.device

    def allocate(self, key: str, nbytes: int) -> None:
        if nbytes < 0:
            raise ValueError(f"region {key!r}: size must be >= 0 bytes, got {nbytes}")
        if key in self._regions:
            raise KeyError(f"region {key!r} already exists; free it first")
        self._regions[key] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def free(self, key: str) -> None:
        self._regions.pop(key, None)

    def stats(self) -> TierStats:
        free, _ = torch.cuda.mem_get_info(self.device)
        base = super().stats()
        return TierStats(
            bytes_written=base.bytes_written,
            bytes_read=base.bytes_read,
            bytes_allocated=base.bytes_allocated,
            capacity=free,
            detail="device memory",
        )


@hookimpl
def slidekit_storage_tiers() -> Iterator[TierDescriptor]:
    yield TierDescriptor(
        name="gpu",
        medium="device",
        factory=GpuTier,
        available=_available,
        priority=200,
        devices=("cuda", "rocm"),
        description="the compute device's own memory",
    )
