"""The host side of the model: FP32 masters, optimizer state on its tier, the shared gradient ring.

Per unit: one flat FP32 master (pinned when an accelerator exists) and the
optimizer's state buffers, each a region on the state tier. Tiers that can
map a region (RAM) are updated in place; others are staged through one
host buffer per state name: read, update, write back.

Shared by all units: ``grad_buffers`` flat buffers in the compute dtype that
gradients land in from the device and that the optimizer reads. Host memory
is therefore about 4 (master) + the optimizer's state bytes per parameter,
plus a few unit-sized buffers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future

import torch

from slidekit.engine.runtime import Pipeline
from slidekit.hostmem import HostBuffers
from slidekit.interfaces import StorageTier, UnitOptimizer
from slidekit.models.base import UnitLayout

__all__ = ["GradRing", "HostStore"]


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class GradRing:
    """A few shared host buffers that gradients are copied into, handed out in turn."""

    def __init__(
        self, count: int, numel: int, dtype: torch.dtype, memory: HostBuffers, pipeline: Pipeline
    ) -> None:
        self.buffers = [memory.empty(numel, dtype) for _ in range(count)]
        self._free = list(range(count))
        self._pipeline = pipeline

    def acquire(self) -> int:
        """Index of a free buffer; waits (bounded) for the optimizer to release one."""
        with self._pipeline.lock:
            self._pipeline.wait_until(lambda: bool(self._free), "a free host gradient buffer")
            return self._free.pop(0)

    def release(self, index: int) -> None:
        with self._pipeline.lock:
            self._free.append(index)
        self._pipeline.notify()


class HostStore:
    """Masters, optimizer state and the gradient ring for every unit."""

    def __init__(
        self,
        units: Sequence[UnitLayout],
        *,
        optimizer: UnitOptimizer,
        state_tier: StorageTier,
        pin: bool,
        grad_dtype: torch.dtype,
        grad_buffers: int,
        pipeline: Pipeline,
    ) -> None:
        self.units = units
        self.memory = HostBuffers(pin=pin)  # page-locked at exact sizes when an accelerator is used
        self.tier = state_tier
        self._pipeline = pipeline
        self.masters = [self.memory.empty(u.numel, torch.float32) for u in units]
        self.ring = GradRing(grad_buffers, max(u.numel for u in units), grad_dtype, self.memory, pipeline)
        self._layouts = [dict(optimizer.state_layout(u.numel)) for u in units]
        self._mapped: list[dict[str, torch.Tensor] | None] = []
        for u, layout in zip(units, self._layouts, strict=True):
            self._mapped.append(self._allocate_state(u.index, layout))
        self._staging: dict[str, torch.Tensor] = {}

    # ------------------------------------------------------------------ state

    @staticmethod
    def _key(unit: int, name: str) -> str:
        return f"state/{unit}/{name}"

    def _allocate_state(
        self, unit: int, layout: Mapping[str, tuple[torch.dtype, int]]
    ) -> dict[str, torch.Tensor] | None:
        """Allocate a unit's state regions, zeroed; return them mapped, or None if the tier cannot map."""
        nbytes = {name: numel * _itemsize(dtype) for name, (dtype, numel) in layout.items()}
        for name, n in nbytes.items():
            self.tier.allocate(self._key(unit, name), n)
        regions = {name: self.tier.map(self._key(unit, name)) for name in layout}
        if all(r is not None for r in regions.values()):
            mapped = {}
            for name, (dtype, _) in layout.items():
                region = regions[name]
                assert region is not None
                mapped[name] = region[: nbytes[name]].view(dtype)
                mapped[name].zero_()
            return mapped
        for name, (dtype, numel) in layout.items():
            write = self.tier.write(self._key(unit, name), torch.zeros(numel, dtype=dtype))
            self._pipeline.result(write, f"zeroing optimizer state of unit {unit}")
        return None

    def with_state(self, unit: int, fn: Callable[[Mapping[str, torch.Tensor]], None]) -> None:
        """Run ``fn(state)`` on a unit's optimizer state: in place if mapped, else staged through buffers.

        Called on the optimizer thread only, so the staging buffers are never shared.
        """
        mapped = self._mapped[unit]
        if mapped is not None:
            fn(mapped)
            return
        staged: dict[str, torch.Tensor] = {}
        reads: list[Future[None]] = []
        for name, (dtype, numel) in self._layouts[unit].items():
            buf = self._staging_buffer(name, dtype, numel)
            staged[name] = buf
            reads.append(self.tier.read(self._key(unit, name), buf))
        for f in reads:
            self._pipeline.result(f, f"reading optimizer state of unit {unit}")
        fn(staged)
        writes = [self.tier.write(self._key(unit, name), buf) for name, buf in staged.items()]
        for f in writes:  # the staging buffers are reused by the next unit: wait for the writes
            self._pipeline.result(f, f"writing optimizer state of unit {unit}")

    def _staging_buffer(self, name: str, dtype: torch.dtype, numel: int) -> torch.Tensor:
        buf = self._staging.get(name)
        if buf is None or buf.dtype != dtype or buf.numel() < numel:
            biggest = max(layout[name][1] for layout in self._layouts if name in layout)
            buf = self.memory.empty(biggest, dtype)
            self._staging[name] = buf
        return buf[:numel]

    def state_nbytes(self) -> int:
        """Bytes of optimizer state over all units."""
        return sum(numel * _itemsize(dtype) for layout in self._layouts for dtype, numel in layout.values())

    def close(self) -> None:
        for unit, layout in enumerate(self._layouts):
            for name in layout:
                self.tier.free(self._key(unit, name))
        self.memory.close()
