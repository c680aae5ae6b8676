"""The host side of the model: FP32 masters, optimizer state on its tiers, the shared gradient ring.

Per unit: one flat FP32 master (page-locked when an accelerator exists) and
the optimizer's state, on the tier the plan chose for the unit
(``slidekit.engine.state``).

Shared by the units that slide: ``grad_buffers`` flat buffers in the compute dtype that
gradients land in from the device and that the optimizer reads, each the size
of a layer (``slidekit.plan.ring_numel``): an embedding or head larger than
that comes down, and is updated, in layer-sized pieces (``pieces``). Host
memory is therefore about 4 (master) + the optimizer's state bytes per
parameter, plus a few layer-sized buffers. A unit kept on the compute device
(``device_masters[i]`` set) keeps its master there and never uses the ring;
when every unit is kept there, the ring is empty.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from slidekit.engine.runtime import Pipeline
from slidekit.engine.state import StateStore
from slidekit.hostmem import HostBuffers
from slidekit.interfaces import StorageTier, UnitOptimizer
from slidekit.models.base import UnitLayout
from slidekit.plan import ring_numel, unit_pieces

__all__ = ["GradRing", "HostStore"]


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
    """Masters, optimizer state (``StateStore``) and the gradient ring for every unit."""

    def __init__(
        self,
        units: Sequence[UnitLayout],
        *,
        optimizer: UnitOptimizer,
        state_tiers: Sequence[StorageTier],
        pin: bool,
        grad_dtype: torch.dtype,
        grad_buffers: int,
        pipeline: Pipeline,
        state_chunk: int = 1 << 22,
        device_masters: Sequence[torch.device | None] | None = None,
    ) -> None:
        self.units = units
        self.memory = HostBuffers(pin=pin)  # page-locked at exact sizes when an accelerator is used
        on = device_masters or [None] * len(units)
        # Units resident on the device keep their master there (``device_masters[i]``), not here.
        self.masters = [
            self.memory.empty(u.numel, torch.float32)
            if dev is None
            else torch.empty(u.numel, dtype=torch.float32, device=dev)
            for u, dev in zip(units, on, strict=True)
        ]
        self.state = StateStore(
            units,
            optimizer=optimizer,
            tiers=state_tiers,
            memory=self.memory,
            pipeline=pipeline,
            chunk=state_chunk,
        )
        # The ring holds gradients on their way down: units kept on the compute device never come down.
        self.sliding = [dev is None for dev in on]
        self.piece = ring_numel(
            [u.numel for u in units], [u.kind for u in units], self.sliding, pieces=self.state.linear
        )
        self.ring = GradRing(grad_buffers if self.piece else 0, self.piece, grad_dtype, self.memory, pipeline)
        self._pieces = [
            unit_pieces(u.numel, self.piece) if slides else [] for u, slides in zip(units, self.sliding, strict=True)
        ]
        self._unit_grads: dict[int, torch.Tensor] = {}
        self._grad_dtype = grad_dtype

    def pieces(self, unit: int) -> list[tuple[int, int]]:
        """The ranges [a, b) of ``unit`` that come down and are updated one ring buffer at a time
        (none for a unit kept on the compute device: it is updated where it is)."""
        return self._pieces[unit]

    def unit_grad(self, unit: int) -> torch.Tensor:
        """A gradient buffer of the unit's own, for steps that must keep every gradient until the end
        (exact global-norm clipping): 2 more bytes per parameter in BF16, allocated on first use."""
        buf = self._unit_grads.get(unit)
        if buf is None:
            buf = self._unit_grads[unit] = self.memory.empty(self.units[unit].numel, self._grad_dtype)
        return buf

    def close(self) -> None:
        self.state.close()
        self.memory.close()
