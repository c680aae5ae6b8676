"""The window: a fixed set of pre-allocated cache units on the compute device.

Each cache unit ("slot") is two flat buffers in the compute dtype, sized for
the largest unit: parameters and gradients. Loading a unit is one copy into a
free slot; templates bind their weights as views into it. Peak device memory
is therefore fixed by the window size and the largest unit, not by depth.

A slot remembers which unit (and which version of its parameters, bumped by
every optimizer update) it holds, so a unit still resident from the forward
pass is reused by the backward pass without a second upload.

Ordering on CUDA: every slot carries ``free_event``, recorded once the last
kernel or copy reading it has been queued; an upload into the slot makes the
upload stream wait on it, so a slot is never overwritten while in use.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from slidekit.engine.runtime import Pipeline
from slidekit.models.base import UnitLayout

__all__ = ["Slot", "Window"]


@dataclass(eq=False)
class Slot:
    """One cache unit on the compute device."""

    index: int
    params: torch.Tensor  # (slot_numel,) compute dtype
    grads: torch.Tensor  # (slot_numel,) compute dtype
    unit: int | None = None  # unit whose parameters it holds (valid once ``loaded``)
    version: int = -1  # that unit's parameter version
    users: int = 0  # visits holding it; free for reuse at 0
    pinned: bool = False  # kept for the whole step (tied embedding)
    resident: bool = False  # a unit's own buffers for good: never shared, never released
    last_use: int = 0
    free_event: Any = None  # CUDA event: all work reading/writing the slot is queued before it
    _bindings: dict[tuple[str, bool], dict[str, torch.Tensor]] = field(default_factory=dict)

    def weights(self, layout: UnitLayout, *, trainable: bool) -> dict[str, torch.Tensor]:
        """The unit's weights as views into this slot, keyed by short name.

        With ``trainable`` they are leaf tensors requiring grad whose ``.grad`` is
        preset to the matching view of ``grads``: autograd then accumulates
        straight into the flat gradient buffer, with no per-tensor copies.
        Bindings are cached per layout shape (all decoder layers share one).
        """
        key = (layout.kind, trainable)
        bound = self._bindings.get(key)
        if bound is None or any(bound[e.key].shape != e.shape for e in layout.entries):
            views = layout.views(self.params)
            if trainable:
                grads = layout.views(self.grads)
                for name, view in views.items():
                    leaf = view.detach().requires_grad_(True)
                    leaf.grad = grads[name]
                    views[name] = leaf
            bound = self._bindings[key] = views
        return bound


class Window:
    """The cache units and who holds them."""

    def __init__(
        self,
        count: int,
        numel: int,
        dtype: torch.dtype,
        device: torch.device,
        pipeline: Pipeline,
        *,
        deterministic: bool = False,
    ) -> None:
        """``deterministic``: a claim takes the least recently used slot (not pinned) and waits for it
        to be free, rather than take whichever is free first, so which slot holds which unit never
        depends on the threads' timing (data-parallel ranks make the same uploads, hence the same
        collectives, in the same order)."""
        self.slots = [
            Slot(
                i,
                torch.zeros(numel, dtype=dtype, device=device),
                torch.zeros(numel, dtype=dtype, device=device),
            )
            for i in range(count)
        ]
        self._pipeline = pipeline
        self._deterministic = deterministic
        self._clock = 0
        self.resident: dict[int, Slot] = {}  # unit -> its own slot, for units resident on the device

    def lookup(self, unit: int, version: int) -> Slot | None:
        """A slot already holding this version of the unit, if any (claimed for the caller)."""
        with self._pipeline.lock:
            for s in self.slots:
                if s.unit == unit and s.version == version:
                    s.users += 1
                    self._touch(s)
                    return s
        return None

    def claim(self, unit: int, version: int, *, pinned: bool = False) -> Slot:
        """A free slot, least recently used first, re-labelled for ``unit``; waits (bounded) for one."""
        with self._pipeline.lock:
            self._pipeline.wait_until(
                (lambda: self._next().users == 0)
                if self._deterministic
                else lambda: any(s.users == 0 and not s.pinned for s in self.slots),
                f"a free cache unit for unit {unit} (window of {len(self.slots)})",
            )
            slot = self.try_claim(unit, version, pinned=pinned)
            assert slot is not None
            return slot

    def try_claim(self, unit: int, version: int, *, pinned: bool = False) -> Slot | None:
        """Like ``claim``, but None at once when every slot is in use (a prefetch must not wait)."""
        with self._pipeline.lock:
            if self._deterministic:
                slot = self._next()
                if slot.users:
                    return None
            else:
                free = [s for s in self.slots if s.users == 0 and not s.pinned]
                if not free:
                    return None
                slot = min(free, key=lambda s: s.last_use)
            slot.unit, slot.version, slot.users, slot.pinned = unit, version, 1, pinned
            self._touch(slot)
            return slot

    def _next(self) -> Slot:
        """The slot a deterministic claim takes: the least recently used of those not pinned."""
        return min((s for s in self.slots if not s.pinned), key=lambda s: s.last_use)

    def invalidate(self, slot: Slot) -> None:
        """Forget what a slot holds (its upload failed or its contents were overwritten)."""
        with self._pipeline.lock:
            slot.unit, slot.version = None, -1

    def add_resident(self, unit: int, numel: int) -> Slot:
        """Exact-size device buffers a resident unit keeps for the whole run (outside the rotating window)."""
        dtype, device = self.slots[0].params.dtype, self.slots[0].params.device
        slot = Slot(
            -1 - unit,
            torch.zeros(numel, dtype=dtype, device=device),
            torch.zeros(numel, dtype=dtype, device=device),
            unit=unit,
            pinned=True,
            resident=True,
        )
        self.resident[unit] = slot
        return slot

    def release(self, slot: Slot, free_event: Any) -> None:
        """One visit is done with the slot; ``free_event`` marks its last queued use."""
        if slot.resident:
            return
        with self._pipeline.lock:
            slot.free_event = free_event
            slot.users -= 1
            assert slot.users >= 0, f"slot {slot.index} released more often than claimed"
        self._pipeline.notify()

    def pin(self, slot: Slot) -> None:
        with self._pipeline.lock:
            slot.pinned = True

    def unpin(self, slot: Slot) -> None:
        if slot.resident:
            return
        with self._pipeline.lock:
            slot.pinned = False
        self._pipeline.notify()

    def _touch(self, slot: Slot) -> None:
        self._clock += 1
        slot.last_use = self._clock

    @property
    def nbytes(self) -> int:
        slots = [*self.slots, *self.resident.values()]
        return sum(s.params.nbytes + s.grads.nbytes for s in slots)
