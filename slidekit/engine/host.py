"""The host side of the model: FP32 masters, optimizer state on its tiers, the shared gradient ring.

Per unit: one flat FP32 master (page-locked when an accelerator exists) and
the optimizer's state, on the tier the plan chose for the unit
(``slidekit.engine.state``).

Shared by the units that slide: ``grad_buffers`` flat buffers in the compute dtype that
gradients land in from the device and that the optimizer reads, each the size
of a layer (``slidekit.planning.ring_numel``): an embedding or head larger than
that comes down, and is updated, in layer-sized pieces (``pieces``). Host
memory is therefore about 4 (master) + the optimizer's state bytes per
parameter, plus a few layer-sized buffers. A unit kept on the compute device
(``device_masters[i]`` set) keeps its master there and never uses the ring;
when every unit is kept there, the ring is empty.

Upload copies (``Layout.upload_copy``, ``engine.upload_copy="on"``): each
sliding unit also keeps its weights in the compute dtype (BF16), pinned, 2
bytes per parameter (``copies[i]``; a data-parallel rank: its shard's). The
unit's host update writes them in the same pass as the master (the
optimizer's ``lowp_out``), and its uploads copy those bytes into the cache
unit as they are. A copy is derived state, never checkpointed: wherever a
master changes outside an update (loading, restoring a checkpoint,
re-sharding: ``refresh_copies``; a speculative-clipping rollback:
``restore``) it is cast again from the master, round to nearest even as the
device's cast of an uploaded FP32 master rounds, so training is bitwise the
same either way.

Speculative clipping (``slidekit.engine.speculation``): each sliding unit whose
state is mapped in host RAM has a second set of buffers for its master and
state (allocated once when ``Layout.clip_backup``). With an optimizer that
updates in place, they are a backup (plain pageable memory) of the values
before a speculative update, which a step that clips restores before its
exact update. With one that updates out of place (``fused_update_out``), the
speculative update writes the new values there and leaves the master and
state as they were: a won bet swaps the two sets (``swap_backup``), a lost one
finds the old values in place and restores nothing. The second master is then
page-locked like the first, since after a swap uploads read it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from slidekit.capabilities import updates_out_of_place
from slidekit.engine.runtime import Pipeline
from slidekit.engine.state import StateStore
from slidekit.hostmem import HostBuffers
from slidekit.interfaces import StorageTier, UnitOptimizer
from slidekit.models.base import UnitLayout
from slidekit.planning.layout import Layout

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
    """Masters, optimizer state (``StateStore``) and the gradient ring for every unit, as ``layout`` says."""

    def __init__(
        self,
        layout: Layout,
        units: Sequence[UnitLayout],
        *,
        optimizer: UnitOptimizer,
        state_tiers: Sequence[StorageTier],
        pin: bool,
        grad_dtype: torch.dtype,
        pipeline: Pipeline,
        device: torch.device,
    ) -> None:
        """Every size is the layout's: a data-parallel rank keeps only its shard of each unit
        (``UnitPlace.own``, ``slidekit.planning.shards``), in one process the whole unit."""
        self.units = units
        self.numels = [place.own for place in layout.units]
        self.memory = HostBuffers(pin=pin)  # page-locked at exact sizes when an accelerator is used
        # Units resident on the compute device keep their master there, not here.
        self.masters = [
            torch.empty(n, dtype=torch.float32, device=device)
            if place.resident
            else self.memory.empty(n, torch.float32)
            for n, place in zip(self.numels, layout.units, strict=True)
        ]
        self.state = StateStore(
            units,
            optimizer=optimizer,
            tiers=state_tiers,
            memory=self.memory,
            pipeline=pipeline,
            chunk=layout.state_chunk,
            staging=layout.state_staging,
            stage_now=bool(layout.state_staging_bytes),
            numels=self.numels,
        )
        # The ring holds gradients on their way down: units kept on the compute device never come down.
        self.piece = layout.ring_numel
        self.ring = GradRing(layout.ring_buffers, self.piece, grad_dtype, self.memory, pipeline)
        # The sliding units' weights in the compute dtype, written by their updates, uploaded as they are.
        self.copies: list[torch.Tensor | None] = [
            self.memory.empty(n, grad_dtype) if layout.upload_copy and place.slides else None
            for n, place in zip(self.numels, layout.units, strict=True)
        ]
        self._pieces = [list(place.pieces) for place in layout.units]  # of the rank's shard
        self._grad_dtype = grad_dtype
        # Speculative updates write the new values into the backup buffers and swap them in (module doc).
        self.out_of_place = updates_out_of_place(optimizer)
        self._backups: dict[int, tuple[torch.Tensor, dict[str, torch.Tensor]]] = {}
        for place in layout.backed_up():  # this rank's part: as long as the master it holds
            if self.can_back_up(place.index):
                self.backup(place.index)
        self._unit_grads: dict[int, torch.Tensor] = {}
        if layout.unit_grads:  # a step that must see every gradient first keeps each sliding unit's own
            for place in layout.units:
                if place.slides:
                    self.unit_grad(place.index)

    def pieces(self, unit: int) -> list[tuple[int, int]]:
        """The ranges [a, b) of ``unit`` that come down and are updated one ring buffer at a time
        (none for a unit kept on the compute device: it is updated where it is)."""
        return self._pieces[unit]

    def unit_grad(self, unit: int) -> torch.Tensor:
        """A gradient buffer of the unit's own, for steps that must keep every gradient until the end
        (exact global-norm clipping): 2 more bytes per parameter in BF16, allocated up front when the layout
        keeps gradients (``Layout.unit_grads``), else on first use (a step asked to clip directly)."""
        buf = self._unit_grads.get(unit)
        if buf is None:
            buf = self._unit_grads[unit] = self.memory.empty(self.numels[unit], self._grad_dtype)
        return buf

    def unit_grad_bytes(self) -> int:
        """Bytes of the per-unit gradient buffers allocated so far."""
        return sum(b.numel() * b.element_size() for b in self._unit_grads.values())

    def can_back_up(self, unit: int) -> bool:
        """Whether a speculative step can update ``unit`` during the backward: its master is in host RAM and
        its optimizer state is mapped there (streamed state is updated at the step's end instead)."""
        return self.masters[unit].device.type == "cpu" and not self.state.streamed(unit)

    def has_backup(self, unit: int) -> bool:
        return unit in self._backups

    def backup(self, unit: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The unit's second master and state buffers, of the same sizes (module doc): the backup, or
        where an out-of-place update writes. Allocated up front for the layout's backed-up units
        (``Layout.clip_backup``), else on first use (a step asked to speculate directly). Out of place, the
        master's is page-locked where the first is (uploads read it once it is swapped in)."""
        got = self._backups.get(unit)
        if got is None:
            mapped = self.state.mapped(unit)
            if mapped is None or not self.can_back_up(unit):
                raise ValueError(
                    f"unit {unit} cannot be backed up: its master or state is not mapped in host RAM"
                )
            n = self.masters[unit].numel()
            master = (
                self.memory.empty(n, torch.float32)
                if self.out_of_place
                else torch.empty(n, dtype=torch.float32)
            )
            got = self._backups[unit] = (
                master,
                {name: torch.empty(t.numel(), dtype=t.dtype) for name, t in mapped.items()},
            )
        return got

    def swap_backup(self, unit: int) -> None:
        """An out-of-place update's new master and state become the unit's, and its old ones the buffers
        the next one writes (the bet won). Only while no thread updates, uploads or saves the unit."""
        master, state = self._backups[unit]
        old_state = self.state.swap(unit, state)
        self._backups[unit] = (self.masters[unit], old_state)
        self.masters[unit] = master

    def restore(self, unit: int) -> None:
        """Put the unit's master and state back as its backup holds them (optimizer thread), and its upload
        copy as the master's cast: the speculated update wrote the copy too. Out of place, the master and
        state were never written: only the copy is cast again."""
        if self.out_of_place:
            self.refresh_copy(unit)
            return
        master, state = self._backups[unit]
        self.masters[unit].copy_(master)
        self.refresh_copy(unit)
        mapped = self.state.mapped(unit)
        assert mapped is not None
        for name, saved in state.items():
            mapped[name].copy_(saved)

    def copy_slice(self, unit: int, start: int = 0, stop: int | None = None) -> torch.Tensor | None:
        """Parameters [start, stop) of the unit's upload copy, for the update to write (None: it has none)."""
        copy = self.copies[unit]
        return None if copy is None else copy[start:stop]

    def refresh_copy(self, unit: int) -> None:
        """The unit's upload copy cast again from its master (round to nearest even), if it has one."""
        copy = self.copies[unit]
        if copy is not None:
            copy.copy_(self.masters[unit])

    def refresh_copies(self) -> None:
        """Every upload copy cast again from its master: after masters changed outside an update."""
        for unit in range(len(self.copies)):
            self.refresh_copy(unit)

    def copy_bytes(self) -> int:
        """Bytes of the upload copies."""
        return sum(c.numel() * c.element_size() for c in self.copies if c is not None)

    def backup_bytes(self) -> int:
        """Bytes of the speculative-clipping backups allocated so far."""
        return sum(
            m.numel() * m.element_size() + sum(t.numel() * t.element_size() for t in st.values())
            for m, st in self._backups.values()
        )

    def close(self) -> None:
        self.state.close()
        self.memory.close()
