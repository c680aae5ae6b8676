"""Optimizer state per unit, on whichever tier the plan put it.

A unit's state (the buffers its optimizer's ``state_layout`` names) lives in
regions of one storage tier. Two ways to reach it:

* **mapped**: the tier hands out host tensors aliasing its regions (RAM);
  the optimizer updates them in place, in one call per unit. Speculative
  clipping's out-of-place updates (``slidekit.engine.speculation``) write a
  unit's new state into buffers of the engine's and then ``swap`` them in:
  from then on the unit's state is those buffers, not the tier's regions,
  so every read goes through the mapped tensors (``read_buffer`` too);
* **streamed**: otherwise (files, GPUDirect) the unit is updated in chunks
  of ``chunk`` parameters: while chunk *j* is updated, chunk *j+1* is being
  read and chunk *j-1* written back, through three rotating sets of staging
  buffers. Host memory for a streamed unit is those staging buffers only.

Streaming needs the state to be *linear* in the parameters: the state of
parameters [a, a+m) sits at ``state_layout(a)`` and has the size of
``state_layout(m)`` whenever ``a`` is a multiple of ``GRANULE`` (true of
per-element moments and of block-wise quantized ones with blocks dividing
``GRANULE``). Optimizers whose state is not are staged a whole unit at a time.

The store is used from the optimizer thread only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future

import torch

from slidekit.engine.runtime import Pipeline
from slidekit.hostmem import HostBuffers
from slidekit.interfaces import ParamGroupRange, StorageTier, UnitOptimizer
from slidekit.models.base import UnitLayout
from slidekit.planning.placement import (
    GRANULE,  # streamed chunks (and gradient pieces) start at its multiples
)

__all__ = ["GRANULE", "StateStore", "slice_groups"]

StateLayout = dict[str, tuple[torch.dtype, int]]
ChunkFn = Callable[[int, int, Mapping[str, torch.Tensor]], None]


def slice_groups(groups: Sequence[ParamGroupRange], start: int, stop: int) -> list[ParamGroupRange]:
    """The parameter groups of the slice [start, stop) of a unit, in the slice's own coordinates."""
    return [
        ParamGroupRange(
            start=max(g.start, start) - start, stop=min(g.stop, stop) - start, weight_decay=g.weight_decay
        )
        for g in groups
        if g.start < stop and g.stop > start
    ]


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class StateStore:
    """Every unit's optimizer state: allocated and zeroed up front, updated in place or streamed."""

    def __init__(
        self,
        units: Sequence[UnitLayout],
        *,
        optimizer: UnitOptimizer,
        tiers: Sequence[StorageTier],
        memory: HostBuffers,
        pipeline: Pipeline,
        chunk: int,
        staging: int,
        stage_now: bool = False,
        numels: Sequence[int] | None = None,
    ) -> None:
        """``chunk``: parameters per streamed chunk; ``staging``: parameters one staging set holds; both
        from the run's ``slidekit.planning.Layout``, which allocates the sets up front (``stage_now``)
        when a unit's tier is a disk. A host tier that does not map its regions streams too: its sets are
        then allocated on first use. ``numels``: the parameters of each unit this store updates (a
        data-parallel rank's shards, ``slidekit.distributed.shards``); default: every unit whole."""
        if len(tiers) != len(units):
            raise ValueError(f"one tier per unit: got {len(tiers)} tiers for {len(units)} units")
        self.units = units
        self.numels = [u.numel for u in units] if numels is None else list(numels)
        self.tiers = list(tiers)
        self._optimizer = optimizer
        self._memory = memory
        self._pipeline = pipeline
        self._layouts: list[StateLayout] = [dict(optimizer.state_layout(n)) for n in self.numels]
        self.linear = bool(optimizer.linear_state)  # declared (slidekit.interfaces.UnitOptimizer)
        self.chunk = chunk
        self._staging_numel = staging
        self._staging: list[dict[str, torch.Tensor]] = []  # three rotating sets
        if stage_now:
            self._staging_sets()
        self._mapped: list[dict[str, torch.Tensor] | None] = [
            self._allocate(u.index, layout) for u, layout in zip(units, self._layouts, strict=True)
        ]

    @staticmethod
    def key(unit: int, name: str) -> str:
        return f"state/{unit}/{name}"

    # ------------------------------------------------------------------ allocation

    def _allocate(self, unit: int, layout: StateLayout) -> dict[str, torch.Tensor] | None:
        """Allocate a unit's regions and zero them; return mapped views, or None to stream."""
        tier = self.tiers[unit]
        nbytes = {name: numel * _itemsize(dtype) for name, (dtype, numel) in layout.items()}
        for name, n in nbytes.items():
            tier.allocate(self.key(unit, name), n)
        regions = {name: tier.map(self.key(unit, name)) for name in layout}
        if all(r is not None for r in regions.values()):
            mapped = {}
            for name, (dtype, _) in layout.items():
                region = regions[name]
                assert region is not None
                mapped[name] = region[: nbytes[name]].view(dtype)
                mapped[name].zero_()
            return mapped
        for start, stop in self._chunks(unit):
            staged = self._stage(0, unit, start, stop)
            for buf in staged.values():
                buf.zero_()
            for fut in self._write(unit, start, staged):
                self._pipeline.result(fut, f"zeroing the optimizer state of unit {unit}")
        return None

    def _chunks(self, unit: int, start: int = 0, stop: int | None = None) -> list[tuple[int, int]]:
        stop = self.numels[unit] if stop is None else stop
        return [(a, min(a + self.chunk, stop)) for a in range(start, stop, self.chunk)]

    def _span(self, unit: int, start: int, stop: int) -> dict[str, tuple[torch.dtype, int, int]]:
        """name -> (dtype, first element, element count) of the state of parameters [start, stop)."""
        if not self.linear:
            return {name: (dt, 0, n) for name, (dt, n) in self._layouts[unit].items()}
        before = dict(self._optimizer.state_layout(start)) if start else {}
        size = dict(self._optimizer.state_layout(stop - start))
        return {name: (dt, before.get(name, (dt, 0))[1], n) for name, (dt, n) in size.items()}

    def span(self, unit: int, start: int, stop: int) -> dict[str, tuple[torch.dtype, int, int]]:
        """name -> (dtype, first element, element count) of the state of parameters [start, stop)
        (linear state: ``start`` a multiple of ``GRANULE``; else the whole buffers)."""
        return self._span(unit, start, stop)

    def _stage(self, k: int, unit: int, start: int, stop: int) -> dict[str, torch.Tensor]:
        """Views into staging set ``k`` shaped for the state of parameters [start, stop)."""
        self._staging_sets()
        return {name: self._staging[k][name][:n] for name, (_, _, n) in self._span(unit, start, stop).items()}

    def _staging_sets(self) -> None:
        if not self._staging:
            per_set = dict(self._optimizer.state_layout(self._staging_numel))
            self._staging = [
                {name: self._memory.empty(n, dt) for name, (dt, n) in per_set.items()} for _ in range(3)
            ]

    def _read(self, unit: int, start: int, staged: Mapping[str, torch.Tensor]) -> list[Future[None]]:
        tier, span = self.tiers[unit], self._span(unit, start, start + 1)
        return [
            tier.read(self.key(unit, name), buf, offset=span[name][1] * buf.element_size())
            for name, buf in staged.items()
        ]

    def _write(self, unit: int, start: int, staged: Mapping[str, torch.Tensor]) -> list[Future[None]]:
        tier, span = self.tiers[unit], self._span(unit, start, start + 1)
        return [
            tier.write(self.key(unit, name), buf, offset=span[name][1] * buf.element_size())
            for name, buf in staged.items()
        ]

    # ------------------------------------------------------------------ updates

    def update(self, unit: int, fn: ChunkFn, start: int = 0, stop: int | None = None) -> None:
        """Call ``fn(a, b, state)`` over the unit's parameters [start, stop) (default: all of them):
        once if mapped, chunk by chunk if not. A partial range needs linear state and a ``start``
        that is a multiple of ``GRANULE``."""
        n = self.numels[unit]
        stop = n if stop is None else stop
        if stop == start:
            return  # an empty shard (a data-parallel rank that owns none of a small unit)
        whole = start == 0 and stop == n
        if not whole and (not self.linear or start % GRANULE):
            raise ValueError(
                f"unit {unit}: a partial state update [{start}, {stop}) needs linear optimizer state and a "
                f"start at a multiple of {GRANULE}"
            )
        mapped = self._mapped[unit]
        if mapped is not None:
            if not whole:
                mapped = {
                    name: mapped[name][first : first + count]
                    for name, (_, first, count) in self._span(unit, start, stop).items()
                }
            fn(start, stop, mapped)
            return
        chunks = self._chunks(unit, start, stop)
        what = f"optimizer state of unit {unit}"
        staged = [self._stage(j % 3, unit, a, b) for j, (a, b) in enumerate(chunks)]
        reads: dict[int, list[Future[None]]] = {0: self._read(unit, chunks[0][0], staged[0])}
        writes: dict[int, list[Future[None]]] = {}
        for j, (a, b) in enumerate(chunks):
            if j + 1 < len(chunks):
                for fut in writes.pop(j - 2, []):  # set (j+1) % 3 was last written back as chunk j-2
                    self._pipeline.result(fut, f"writing {what}")
                reads[j + 1] = self._read(unit, chunks[j + 1][0], staged[j + 1])
            for fut in reads.pop(j):
                self._pipeline.result(fut, f"reading {what}")
            fn(a, b, staged[j])
            writes[j] = self._write(unit, a, staged[j])
        for futs in writes.values():  # the staging sets are reused by the next unit
            for fut in futs:
                self._pipeline.result(fut, f"writing {what}")

    # ------------------------------------------------------------------ whole buffers (checkpoints)

    def layout(self, unit: int) -> StateLayout:
        """name -> (dtype, numel) of the unit's state buffers."""
        return dict(self._layouts[unit])

    def mapped(self, unit: int) -> dict[str, torch.Tensor] | None:
        """The unit's state as host tensors, when its tier maps them (None when streamed)."""
        return self._mapped[unit]

    def swap(self, unit: int, buffers: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Make ``buffers`` the mapped state of ``unit`` (each of its buffer's dtype and size) and return
        the ones they replace: speculative clipping's out-of-place update wrote the new state there. Only
        while no thread updates or reads the unit's state."""
        mapped = self._mapped[unit]
        if mapped is None:
            raise ValueError(f"unit {unit}'s state is streamed through its tier: there is nothing to swap")
        if set(buffers) != set(mapped):
            raise ValueError(f"unit {unit}: swap needs the buffers {sorted(mapped)}, got {sorted(buffers)}")
        for name, t in buffers.items():
            old = mapped[name]
            if t.dtype != old.dtype or t.numel() != old.numel() or t.device != old.device:
                raise ValueError(
                    f"unit {unit}: buffer {name!r} to swap in is {t.dtype} x {t.numel()} on {t.device}, its "
                    f"state is {old.dtype} x {old.numel()} on {old.device}"
                )
        self._mapped[unit] = dict(buffers)
        return mapped

    def read_buffer(self, unit: int, name: str) -> torch.Tensor:
        """A copy of one whole state buffer in a new (pageable) host tensor."""
        dtype, numel = self._layouts[unit][name]
        out = torch.empty(numel, dtype=dtype)
        mapped = self._mapped[unit]
        if mapped is not None:  # the mapped tensors, which a swap may have moved off the tier's regions
            out.copy_(mapped[name])
            return out
        fut = self.tiers[unit].read(self.key(unit, name), out)
        self._pipeline.result(fut, f"reading {name} of unit {unit}")
        return out

    def write_buffer(self, unit: int, name: str, src: torch.Tensor) -> None:
        """Overwrite one whole state buffer (mapped: in place; streamed: through its tier)."""
        mapped = self._mapped[unit]
        if mapped is not None:
            mapped[name].copy_(src)
            return
        fut = self.tiers[unit].write(self.key(unit, name), src.contiguous())
        self._pipeline.result(fut, f"writing {name} of unit {unit}")

    # ------------------------------------------------------------------ bookkeeping

    def nbytes(self, unit: int) -> int:
        return sum(n * _itemsize(dt) for dt, n in self._layouts[unit].values())

    def staging_bytes(self) -> int:
        """Bytes of the state staging sets allocated so far."""
        return sum(t.numel() * t.element_size() for stage in self._staging for t in stage.values())

    def streamed(self, unit: int) -> bool:
        return self._mapped[unit] is None

    def close(self) -> None:
        for unit, layout in enumerate(self._layouts):
            for name in layout:
                self.tiers[unit].free(self.key(unit, name))
        self._mapped = [None] * len(self.units)
        self._staging = []
