"""Uploads: the parameters of the next visits into free cache units, ahead of the compute.

While the device computes visit k, the upload thread loads the parameters of
the next ``prefetch_depth`` visits into free cache units. An upload of a unit
waits for that unit's latest optimizer update, so every forward pass sees fully
updated weights. FP32 masters cross the bus and are cast on the device through
the layout's staging buffer (BF16 compute), or, with upload copies
(``engine.upload_copy``, ``Layout.upload_copy``), the unit's BF16 copy that
its host update wrote crosses as it is (half the bytes, no staging, no
device cast; ``slidekit.engine.host``); units resident on the device are
never uploaded. A resident unit whose weights slide (``slidekit.planning.weights``)
takes a cache unit like a sliding one, and its weights are cast into it from
its master on the device (``_cast``): no bus crossing, no staging. Part of
``slidekit.engine.core.Engine``.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import torch

from slidekit.engine.collectives import Collectives
from slidekit.engine.host import HostStore
from slidekit.engine.runtime import Pipeline, Streams
from slidekit.engine.window import Slot, Window
from slidekit.models.base import ArchSpec
from slidekit.planning.layout import UPLOAD_CHUNK
from slidekit.planning.schedule import Visit
from slidekit.telemetry import Timeline

__all__ = ["Uploads"]


class Uploads:
    """The upload half of the engine (a mixin of ``Engine``)."""

    # The engine's state these methods share (set by ``Engine.__init__``).
    spec: ArchSpec
    host: HostStore
    window: Window
    pipeline: Pipeline
    streams: Streams
    timeline: Timeline
    dtype: torch.dtype
    visits: tuple[Visit, ...]
    version: list[int]
    updated: list[Future[None] | None]
    prefetch_depth: int
    upload_stage: torch.Tensor | None
    _loads: dict[int, tuple[Slot, Future[Any] | None]]
    _tied_slot: Slot | None
    collectives: Collectives | None  # data-parallel ranks' collectives (None: one process)
    _stale: set[int]  # resident units whose other ranks' shards are still to be gathered (data-parallel)
    weights_slide: frozenset[int]  # resident units whose weights slide: cast from the device master per visit
    _cast_after: dict[int, Any]  # unit -> event after its latest device update (compute stream)

    def _request(self, k: int, *, wait: bool = True) -> bool:
        """Make sure visit ``k``'s parameters are (being) loaded into a slot.

        ``wait=False`` (a prefetch): when every cache unit is still in use, give
        up at once and return False rather than hold up the main thread, which
        may have work that needs no cache unit (resident units) meanwhile.
        """
        if k >= len(self.visits) or k in self._loads:
            return True
        visit = self.visits[k]
        if not visit.needs_params:
            return True
        own = self.window.resident.get(visit.unit)
        if own is not None:  # always loaded, never evicted (data-parallel: gathered after its update)
            if self._is_tied_embed(visit.unit):
                self._tied_slot = own
            self._loads[k] = (own, self._resident_gather(visit.unit))
            return True
        if self._is_tied_embed(visit.unit) and self._tied_slot is not None:
            self._loads[k] = (self._tied_slot, None)
            return True
        version = self.version[visit.unit]
        tied = self._is_tied_embed(visit.unit)
        slot = self.window.lookup(visit.unit, version)  # still resident from an earlier visit?
        fut = None
        if slot is None:
            if wait:
                slot = self.window.claim(visit.unit, version, pinned=tied)
            else:
                slot = self.window.try_claim(visit.unit, version, pinned=tied)
                if slot is None:
                    return False
            fut = self.pipeline.submit(
                "h2d",
                self._upload,
                slot,
                visit.unit,
                self.updated[visit.unit],
                slot.free_event,
                unit=visit.unit,
            )
        if tied:  # the tied embedding stays for the whole pass: the head needs it too
            self.window.pin(slot)
            self._tied_slot = slot
        self._loads[k] = (slot, fut)
        return True

    def _upload(self, slot: Slot, unit: int, update: Future[None] | None, free_event: Any) -> Any:
        """Upload thread: wait for the unit's update, then copy its master into the slot."""
        if unit in self.weights_slide:
            return self._cast(slot, unit, free_event)
        if update is not None:
            self.pipeline.result(update, f"the optimizer update of unit {unit}")
        master = self.host.masters[unit]
        copy = self.host.copies[unit]  # its weights in the compute dtype, written by its update (or None)
        n = master.numel()
        at = 0 if self.collectives is None else self.collectives.shards[unit].start  # a rank's shard
        if not self.streams.cuda:
            with self.timeline.host("h2d", unit):
                slot.params[at : at + n].copy_(master if copy is None else copy)
            self._gather(unit, slot)
            return None
        s = self.streams
        with s.use(s.h2d):
            with self.timeline.device("h2d", unit, s.h2d):
                s.wait(s.h2d, free_event)  # the slot's previous contents are no longer read
                if copy is not None:  # BF16 over the bus, as its update wrote it (pinned): nothing to cast
                    slot.params[at : at + n].copy_(copy, non_blocking=True)
                elif self.dtype == torch.float32:
                    slot.params[at : at + n].copy_(master, non_blocking=True)
                else:  # FP32 over the bus, cast on the device: no host-side BF16 copy to keep
                    stage = self._staging()
                    for a in range(0, n, UPLOAD_CHUNK):
                        b = min(a + UPLOAD_CHUNK, n)
                        stage[: b - a].copy_(master[a:b], non_blocking=True)
                        slot.params[at + a : at + b].copy_(stage[: b - a])
            self._gather(unit, slot)  # queued behind the upload on the h2d stream
        return s.record(s.h2d)

    def _cast(self, slot: Slot, unit: int, free_event: Any) -> Any:
        """Upload thread: the weights of a unit whose master lives on the device, cast into ``slot`` there.

        On CUDA the cast is queued on the upload stream behind two events: the slot's previous contents
        are no longer read (``free_event``), and the unit's latest update on the compute stream has
        written the master (``_cast_after``, recorded by the main thread before it asked for this visit).
        On the CPU the main thread applied that update before it asked: the order is the program's.
        Data-parallel: the rank casts its shard, then gathers the others' (``_gather``)."""
        master = self.host.masters[unit]
        n = master.numel()
        at = 0 if self.collectives is None else self.collectives.shards[unit].start  # a rank's shard
        s = self.streams
        if not s.cuda:
            with self.timeline.host("cast", unit):
                slot.params[at : at + n].copy_(master)
            self._gather(unit, slot)
            return None
        with s.use(s.h2d):
            with self.timeline.device("cast", unit, s.h2d):
                s.wait(s.h2d, free_event)
                s.wait(s.h2d, self._cast_after.get(unit))
                slot.params[at : at + n].copy_(master)  # FP32 to the compute dtype, on the device
            self._gather(unit, slot)  # data-parallel: every rank's shard, behind the cast on the h2d stream
        return s.record(s.h2d)

    def _gather(self, unit: int, slot: Slot) -> None:
        """Data-parallel: every rank's updated shard into the slot (h2d lane, after the own upload)."""
        if self.collectives is not None:
            with self.timeline.host("gather", unit):
                self.collectives.gather_weights(unit, slot.params)

    def _resident_gather(self, unit: int) -> Future[Any] | None:
        """The gather a resident unit waits for before its next use, queued now if its shards changed
        (data-parallel; requests come in the visits' order, the same on every rank)."""
        if unit not in self._stale:
            return None
        self._stale.discard(unit)
        done = self.streams.record(self.streams.compute)  # after the update that wrote this rank's shard
        return self.pipeline.submit("h2d", self._gather_resident, unit, done, unit=unit)

    def _gather_resident(self, unit: int, computed: Any) -> Any:
        """h2d lane, data-parallel: a resident unit's updated shards gathered into its own slot (the h2d
        lane issues every weight gather, so all ranks issue them in one order)."""
        assert self.collectives is not None
        s, slot = self.streams, self.window.resident[unit]
        with self.timeline.host("gather", unit), s.use(s.h2d):
            s.wait(s.h2d, computed)  # the update on the compute stream wrote this rank's shard
            self.collectives.gather_weights(unit, slot.params)
        return s.record(s.h2d)

    def _staging(self) -> torch.Tensor:
        assert self.upload_stage is not None, "the layout plans no upload staging for a cast upload"
        return self.upload_stage

    def _acquire(self, k: int, last: int | None = None) -> Slot:
        """The slot holding visit ``k``'s parameters, ready for compute on the compute stream.

        Prefetches the next visits, up to visit ``last`` when given (forward-only passes).
        """
        unit = self.visits[k].unit
        if self.pipeline.task_hook is not None:
            self.pipeline.task_hook("main")
        with self.timeline.host("stall", unit):  # the main thread waiting: uploads or cache units behind
            self._request(k)
            slot, fut = self._loads.pop(k)
            if fut is not None:
                event = self.pipeline.result(fut, f"the upload of unit {unit}")
                self.streams.wait(self.streams.compute, event)
        stop = k + 1 + self.prefetch_depth
        for j in range(k + 1, stop if last is None else min(stop, last + 1)):
            if not self._request(j, wait=False):
                break  # no free cache unit yet: the visit itself claims one when its turn comes
        return slot

    def _is_tied_embed(self, unit: int) -> bool:
        return unit == 0 and self.spec.tie_embeddings
