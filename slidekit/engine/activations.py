"""Boundary activations: each decoder layer's input, saved in the forward pass for recompute.

Two places to keep them: on the compute device (``DeviceActivations``), or on
a storage tier (``TierActivations``): the forward pass writes each one out
asynchronously, and the backward pass reads the next one back while the
current layer recomputes. Either way a layer's activations inside the layer
are never kept: the backward pass recomputes them from the boundary.
"""

from __future__ import annotations

from concurrent.futures import Future

import torch

from slidekit.engine.runtime import Pipeline
from slidekit.interfaces import StorageTier

__all__ = ["ActivationStore", "DeviceActivations", "TierActivations"]


class ActivationStore:
    """Where boundary activations wait for the backward pass."""

    def save(self, unit: int, x: torch.Tensor) -> None:
        raise NotImplementedError

    def prefetch(self, unit: int) -> None:
        """Start bringing ``unit``'s activation back (no-op where it never left)."""

    def load(self, unit: int) -> torch.Tensor:
        raise NotImplementedError

    def close(self) -> None:
        """Release everything still held."""


class DeviceActivations(ActivationStore):
    """Keep them where they were computed."""

    def __init__(self) -> None:
        self._saved: dict[int, torch.Tensor] = {}

    def save(self, unit: int, x: torch.Tensor) -> None:
        self._saved[unit] = x

    def load(self, unit: int) -> torch.Tensor:
        return self._saved.pop(unit)

    def close(self) -> None:
        self._saved.clear()


class TierActivations(ActivationStore):
    """Write them to a storage tier in the forward pass; read them back ahead of use."""

    def __init__(self, tier: StorageTier, device: torch.device, pipeline: Pipeline) -> None:
        self.tier = tier
        self.device = device
        self._pipeline = pipeline
        self._regions: dict[int, int] = {}  # unit -> allocated bytes
        self._meta: dict[int, tuple[torch.Size, torch.dtype]] = {}
        self._writes: dict[int, tuple[torch.Tensor, Future[None]]] = {}
        self._reads: dict[int, tuple[torch.Tensor, Future[None]]] = {}

    @staticmethod
    def _key(unit: int) -> str:
        return f"act/{unit}"

    def save(self, unit: int, x: torch.Tensor) -> None:
        x = x.contiguous()
        nbytes = x.numel() * x.element_size()
        if self._regions.get(unit) != nbytes:
            if unit in self._regions:
                self.tier.free(self._key(unit))
            self.tier.allocate(self._key(unit), nbytes)
            self._regions[unit] = nbytes
        self._meta[unit] = (x.shape, x.dtype)
        # x stays referenced until the write completes: its memory must not be reused before.
        self._writes[unit] = (x, self.tier.write(self._key(unit), x))

    def prefetch(self, unit: int) -> None:
        if unit in self._reads or unit not in self._meta:
            return
        _, write = self._writes.pop(unit)
        self._pipeline.result(write, f"writing the activation of unit {unit}")
        shape, dtype = self._meta[unit]
        dst = torch.empty(shape, dtype=dtype, device=self.device)
        self._reads[unit] = (dst, self.tier.read(self._key(unit), dst))

    def load(self, unit: int) -> torch.Tensor:
        self.prefetch(unit)
        dst, read = self._reads.pop(unit)
        self._pipeline.result(read, f"reading the activation of unit {unit}")
        return dst

    def close(self) -> None:
        for _, fut in list(self._writes.values()) + list(self._reads.values()):
            fut.cancel()
        self._writes.clear()
        self._reads.clear()
        for unit in self._regions:
            self.tier.free(self._key(unit))
        self._regions.clear()
