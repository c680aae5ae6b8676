"""Boundary activations: each decoder layer's input, saved in the forward pass for recompute.

Activations are keyed by ``(unit, micro_batch)``; micro-batches may differ in
shape (dynamic padding), and each comes back with its own. Two places to keep
them: on the compute device (``DeviceActivations``), or on a storage tier
(``TierActivations``): the forward pass writes each one out asynchronously,
and the backward pass reads the next one back while the current layer
recomputes. Either way a layer's activations inside the layer
are not kept: the backward pass recomputes them from the boundary.

A layer that *keeps* its activations (``UnitPlace.keeps``,
``slidekit.planning.keeping``) saves no boundary activation: its forward
runs with autograd on and ``KeptGraphs`` holds, per micro-batch, its input
(a leaf that requires grad) and its output, whose graph its backward then
back-propagates through without recomputing.

A keeping layer that slides (its weights in a cache unit that another unit
takes before its backward) must not let its graph hold the cache unit's
weights: ``KeptGraphs.saving_weights`` packs every tensor autograd saves
inside that cache unit's weight buffer as a reference (offset, shape,
stride), and ``KeptGraphs.bound`` reads them at the backward from the cache
unit the backward loaded the layer into, the same values, and points the
forward's weight leaves' gradients at that cache unit's gradient buffer.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterator, Mapping
from concurrent.futures import Future
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass

import torch

from slidekit.engine.runtime import Pipeline
from slidekit.interfaces import StorageTier

__all__ = ["ActivationStore", "DeviceActivations", "KeptGraphs", "TierActivations"]


class ActivationStore:
    """Where boundary activations wait for the backward pass."""

    def save(self, key: Hashable, x: torch.Tensor) -> None:
        raise NotImplementedError

    def prefetch(self, key: Hashable) -> None:
        """Start bringing ``key``'s activation back (no-op where it never left)."""

    def load(self, key: Hashable) -> torch.Tensor:
        raise NotImplementedError

    def close(self) -> None:
        """Release everything still held."""


class DeviceActivations(ActivationStore):
    """Keep them where they were computed."""

    def __init__(self) -> None:
        self._saved: dict[Hashable, torch.Tensor] = {}

    def save(self, key: Hashable, x: torch.Tensor) -> None:
        self._saved[key] = x

    def load(self, key: Hashable) -> torch.Tensor:
        return self._saved.pop(key)

    def close(self) -> None:
        self._saved.clear()


class TierActivations(ActivationStore):
    """Write them to a storage tier in the forward pass; read them back ahead of use.

    A tensor being written stays referenced until its write completes; at most
    ``max_pending`` writes are in flight (the oldest is waited for beyond
    that), so device memory stays bounded however deep the model is.
    """

    def __init__(
        self, tier: StorageTier, device: torch.device, pipeline: Pipeline, *, max_pending: int = 2
    ) -> None:
        self.tier = tier
        self.device = device
        self._pipeline = pipeline
        self._max_pending = max_pending
        self._regions: dict[Hashable, int] = {}  # key -> allocated bytes
        self._meta: dict[Hashable, tuple[torch.Size, torch.dtype]] = {}
        self._pending: deque[tuple[Hashable, torch.Tensor, Future[None]]] = deque()
        self._reads: dict[Hashable, tuple[torch.Tensor, Future[None]]] = {}

    @staticmethod
    def _key(key: Hashable) -> str:
        parts = key if isinstance(key, tuple) else (key,)
        return "act/" + "/".join(str(p) for p in parts)

    def save(self, key: Hashable, x: torch.Tensor) -> None:
        x = x.contiguous()
        nbytes = x.numel() * x.element_size()
        # A region only grows: micro-batches of other lengths (dynamic padding) reuse it from byte 0,
        # instead of freeing and allocating tier storage at every step.
        if self._regions.get(key, -1) < nbytes:
            if key in self._regions:
                self.tier.free(self._key(key))
            self.tier.allocate(self._key(key), nbytes)
            self._regions[key] = nbytes
        self._meta[key] = (x.shape, x.dtype)
        self._pending.append((key, x, self.tier.write(self._key(key), x)))
        while self._pending and (self._pending[0][2].done() or len(self._pending) > self._max_pending):
            self._retire()

    def _retire(self) -> None:
        """Wait for the oldest write and drop its tensor (re-raises the tier's error)."""
        key, _, fut = self._pending.popleft()
        self._pipeline.result(fut, f"writing the activation {key}")

    def prefetch(self, key: Hashable) -> None:
        if key in self._reads or key not in self._meta:
            return
        while any(k == key for k, _, _ in self._pending):
            self._retire()
        shape, dtype = self._meta[key]
        dst = torch.empty(shape, dtype=dtype, device=self.device)
        self._reads[key] = (dst, self.tier.read(self._key(key), dst))

    def load(self, key: Hashable) -> torch.Tensor:
        self.prefetch(key)
        dst, read = self._reads.pop(key)
        self._pipeline.result(read, f"reading the activation {key}")
        return dst

    def close(self) -> None:
        for _, _, fut in self._pending:
            fut.cancel()
        for _, fut in self._reads.values():
            fut.cancel()
        self._pending.clear()
        self._reads.clear()
        for key in self._regions:
            self.tier.free(self._key(key))
        self._regions.clear()


@dataclass(frozen=True, slots=True)
class _WeightRef:
    """A saved tensor that lay in a sliding unit's cache-unit weights: where, relative to the buffer."""

    unit: int
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]


class KeptGraphs:
    """The autograd graphs of the layers that keep their activations, per (unit, micro-batch), for one step.

    ``keep`` takes the layer's input (the leaf its graph starts from) and its output; ``take`` hands
    them to the backward pass and lets go of them. ``clear`` drops whatever a failed step left. A
    sliding layer's forward runs under ``saving_weights`` and its backward under ``bound`` (module
    docstring).
    """

    def __init__(self) -> None:
        self._graphs: dict[Hashable, tuple[torch.Tensor, torch.Tensor]] = {}
        self._leaves: dict[int, Mapping[str, torch.Tensor]] = {}  # a sliding unit's forward weight leaves
        self._weights: dict[int, torch.Tensor] = {}  # a sliding unit's weights, during its backward

    def keep(self, key: Hashable, x: torch.Tensor, y: torch.Tensor) -> None:
        assert x.requires_grad and x.is_leaf and y.grad_fn is not None, f"{key}: no graph to keep"
        self._graphs[key] = (x, y)

    def take(self, key: Hashable) -> tuple[torch.Tensor, torch.Tensor]:
        return self._graphs.pop(key)

    def saving_weights(
        self, unit: int, params: torch.Tensor, leaves: Mapping[str, torch.Tensor]
    ) -> AbstractContextManager[None]:
        """For ``unit``'s forward from a cache unit whose weights are ``params`` (its weight leaves
        ``leaves``): what autograd saves inside ``params`` is kept as a reference, not the tensor."""
        self._leaves[unit] = leaves
        storage, base, device = params.untyped_storage().data_ptr(), int(params.storage_offset()), params.device

        def pack(t: torch.Tensor) -> torch.Tensor | _WeightRef:
            if t.device == device and t.untyped_storage().data_ptr() == storage:
                return _WeightRef(unit, int(t.storage_offset()) - base, tuple(t.shape), tuple(t.stride()))
            return t

        def unpack(saved: torch.Tensor | _WeightRef) -> torch.Tensor:
            if isinstance(saved, _WeightRef):
                src = self._weights[saved.unit]  # KeyError: a graph used outside its ``bound``
                return src.as_strided(saved.shape, saved.stride, src.storage_offset() + saved.offset)
            return saved

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    @contextmanager
    def bound(self, unit: int, params: torch.Tensor, leaves: Mapping[str, torch.Tensor]) -> Iterator[None]:
        """``unit``'s backward from the cache unit whose weights are ``params`` and weight leaves ``leaves``:
        its graphs read their weights there and accumulate their weight gradients into ``leaves``'
        gradient buffers. A layer that did not slide (no ``saving_weights``) is left as it is."""
        forward = self._leaves.pop(unit, None)
        if forward is None:
            yield
            return
        own = {name: leaf.grad for name, leaf in forward.items()}
        self._weights[unit] = params
        for name, leaf in forward.items():
            leaf.grad = leaves[name].grad
        try:
            yield
        finally:  # the forward cache unit's leaves go back to their own buffers (its next user's)
            for name, leaf in forward.items():
                leaf.grad = own[name]
            self._weights.pop(unit, None)

    def __len__(self) -> int:
        return len(self._graphs)

    def clear(self) -> None:
        self._graphs.clear()
        self._leaves.clear()
        self._weights.clear()
