"""Gradients and updates: after a unit's backward, its gradients come down and its master is updated.

After a unit's backward the download thread copies its gradients into a
shared host buffer (piece by piece, ``HostStore.pieces``) and the optimizer
thread updates the unit's FP32 master from it while the device moves on.
With clipping or skipping the step must see every gradient first: the
gradients wait in the unit's own host buffer and the updates are queued at
the end of the step. Resident units are updated on the device; so are those
whose weights slide (``slidekit.planning.weights``): from the cache unit right
after their backward, or, deferring, from a device gradient buffer of their own
at the step's end (``_finish_lean``). A checkpoint
being written holds back each unit's next update until it has the unit's
tensors. Part of ``slidekit.engine.core.Engine``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from slidekit.engine.collectives import Collectives
from slidekit.engine.host import HostStore
from slidekit.engine.runtime import Pipeline, Streams
from slidekit.engine.state import slice_groups
from slidekit.engine.step_state import StepState
from slidekit.engine.window import Slot, Window
from slidekit.errors import NonFiniteError
from slidekit.interfaces import ParamGroupRange, UnitOptimizer
from slidekit.models.base import ArchSpec
from slidekit.planning.schedule import Visit
from slidekit.telemetry import Timeline

__all__ = ["Updates", "settle_scale"]


def settle_scale(clip: float | None, grad_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_'s factor: min(1, max_norm / (norm + 1e-6)); 1.0 without clipping."""
    return 1.0 if clip is None else min(1.0, clip / (grad_norm + 1e-6))


class Updates:
    """The gradient and update half of the engine (a mixin of ``Engine``)."""

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
    optimizer: UnitOptimizer
    groups: Sequence[Sequence[ParamGroupRange]]
    steps_done: int
    updates_applied: int
    _checkpoint: tuple[Any, dict[int, list[str]]] | None
    collectives: Collectives | None  # data-parallel ranks' collectives (None: one process)
    _stale: set[int]  # resident units whose other shards are still to be gathered (data-parallel)
    weights_slide: frozenset[int]  # resident units whose weights slide through the window
    device_grads: dict[int, torch.Tensor]  # their gradients, kept on the device until the step's end
    _cast_after: dict[int, Any]  # unit -> event after its latest device update (the next cast waits for it)
    _reduced: dict[int, Any]  # data-parallel: unit -> event after its reduced shard reached its device buffer

    def _finish_unit(self, unit: int, slot: Slot, c: StepState) -> None:
        """After a unit's backward: add its gradient norm, copy the gradients down, update it.

        Without clipping the update is queued at once and overlaps the rest of
        the backward pass. With clipping it must wait for the global norm: the
        gradients go to the unit's own host buffer and the update is queued at
        the end of the step (``_clip_and_update``).
        """
        unit_sq: torch.Tensor | None = None
        if self.collectives is None:
            n = self.spec.units[unit].numel
            unit_sq = torch.linalg.vector_norm(slot.grads[:n], dtype=torch.float32).square()
            c.sq_norm += unit_sq
        if unit in self.weights_slide:
            self._finish_lean(unit, slot, unit_sq, c)
            return
        # Data-parallel: the d2h lane reduces the gradient over the ranks first; the norm is the shard's.
        if slot.resident:  # updated on the device once the step's loss and norm are known
            c.resident_due.append(unit)
            if self.collectives is not None:
                done = self.streams.record(self.streams.compute)
                c.shard_sq[unit] = self.pipeline.submit(
                    "d2h", self._reduce_on_device, unit, slot, done, unit=unit
                )
            return
        done = self.streams.record(self.streams.compute)
        # Bump the version now, on this thread: from here on no slot holding the old
        # parameters can be mistaken for current, and every upload waits for the update.
        self.version[unit] += 1
        if c.defer:
            self._defer_unit(unit, slot, done, unit_sq, c)
        else:
            self._arrive(unit, slot, done, unit_sq, c)

    def _arrive(self, unit: int, slot: Slot, done: Any, unit_sq: torch.Tensor | None, c: StepState) -> None:
        """A step that does not defer: the gradients down through the ring, piece by piece, each updated as
        it arrives (``engine.update_order="arrival"``)."""
        # Futures the download completes piece by piece: stall reports follow them to the d2h lane.
        handoff: list[Future[tuple[int, float]]] = [
            self.pipeline.promise("d2h", unit) for _ in self.host.pieces(unit)
        ]
        download = self.pipeline.submit("d2h", self._download, unit, slot, done, unit_sq, handoff, unit=unit)
        if self.collectives is not None:
            c.shard_sq[unit] = download
        self.updated[unit] = self.pipeline.submit(
            "optim", self._update, unit, download, handoff, c.lr, self.updates_applied + 1, 1.0, unit=unit
        )

    def _finish_lean(self, unit: int, slot: Slot, unit_sq: torch.Tensor | None, c: StepState) -> None:
        """Main thread, after the backward of a resident unit whose weights slide: its gradients are in the
        cache unit. Deferring, they are copied into the unit's device buffer and it is updated at the step's
        end with the resident units (``_update_resident``); otherwise it is updated on the device now, with
        the resident units' fused update (and its arithmetic). Then the cache unit is let go.

        Not deferring, the unit's gradient norm is read first (a device sync, once per such unit): a unit
        whose gradients are not finite is never applied, as on the host path (``_update``).

        Data-parallel: the d2h lane reduces the gradient over the ranks and copies this rank's shard into
        the unit's device buffer (``_reduce_on_device``); the unit is updated at the step's end, as resident
        units are, and its next cast gathers every rank's shard."""
        # Its weights in any cache unit are stale once the update is queued: the next visit casts afresh.
        self.version[unit] += 1
        compute = self.streams.compute
        if self.collectives is not None:
            done = self.streams.record(compute)
            c.resident_due.append(unit)
            c.shard_sq[unit] = self.pipeline.submit("d2h", self._reduce_on_device, unit, slot, done, unit=unit)
            return
        assert unit_sq is not None
        n = self.host.masters[unit].numel()
        try:
            if c.defer:
                self.device_grads[unit].copy_(slot.grads[:n])  # on the compute stream, after the backward
                c.resident_due.append(unit)
                return
            self._check_finite(unit, float(unit_sq))
            self._wait_checkpoint(unit)
            with self.timeline.device("update_gpu", unit, compute):
                self._apply(unit, slot.grads[:n], lr=c.lr, count=self.updates_applied + 1, scale=1.0, lowp_out=None)
            self._cast_after[unit] = self.streams.record(compute)  # the next cast reads the new master
        finally:  # after the copy or the update that read its gradients, queued on the compute stream
            self.window.release(slot, self.streams.record(compute))

    def _defer_unit(
        self, unit: int, slot: Slot, done: Any, unit_sq: torch.Tensor | None, c: StepState
    ) -> None:
        """The gradients into the unit's own buffer, updated once the step's norm is known."""
        c.deferred[unit] = self.pipeline.submit(
            "d2h", self._download, unit, slot, done, unit_sq, None, unit=unit
        )
        if self.collectives is not None:
            c.shard_sq[unit] = c.deferred[unit]

    def _download(
        self,
        unit: int,
        slot: Slot,
        computed: Any,
        unit_sq: torch.Tensor | None,
        handoff: list[Future[tuple[int, float]]] | None,
        keep: bool = False,
    ) -> float:
        """Download thread: the unit's gradients to the host; returns their squared norm.

        With ``handoff`` (one future per range of ``host.pieces(unit)``) each
        piece lands in a ring buffer whose index (with the norm) is handed to the
        optimizer thread as soon as it has arrived, so a unit larger than a
        buffer is updated while its later pieces come down. Without, the whole
        unit goes into its own buffer, kept until the step ends. With both (``keep``, speculative
        clipping) the pieces land in the unit's own buffer and are handed on as they arrive.

        Data-parallel (``unit_sq`` None): first the gradient is reduced over the ranks; then only
        this rank's shard comes down, and the norm returned is the shard's.
        """
        n = self.host.masters[unit].numel()
        sq = torch.empty((), dtype=torch.float32, pin_memory=self.streams.cuda)
        s = self.streams
        copied = None
        at = 0  # where the rank's shard begins in the unit
        try:
            if unit_sq is None:
                unit_sq = self._reduce(unit, slot, computed)
                at = self._shard_start(unit)
            for k, (a, b) in enumerate(self.host.pieces(unit) if handoff is not None else [(0, n)]):
                if handoff is None:
                    index, dst = -1, self.host.unit_grad(unit)
                elif keep:
                    index, dst = -1, self.host.unit_grad(unit)[a:b]
                else:
                    with self.timeline.host("d2h_wait", unit):  # waiting for the optimizer to free a buffer
                        index = self.host.ring.acquire()
                    dst = self.host.ring.buffers[index][: b - a]
                with self.timeline.host("d2h", unit):
                    if s.cuda:
                        with s.use(s.d2h):
                            if k == 0:
                                s.wait(s.d2h, computed)
                            with self.timeline.device("d2h_copy", unit, s.d2h):  # the transfer alone
                                dst.copy_(slot.grads[at + a : at + b], non_blocking=True)
                                if k == 0:
                                    sq.copy_(unit_sq, non_blocking=True)
                            copied = s.record(s.d2h)
                        s.synchronize(copied)
                    else:
                        with self.timeline.device("d2h_copy", unit, None):
                            dst.copy_(slot.grads[at + a : at + b])
                            if k == 0:
                                sq.copy_(unit_sq)
                if handoff is not None:
                    handoff[k].set_result((index, float(sq)))
        except BaseException as exc:
            for fut in handoff or []:
                if not fut.done():
                    fut.set_exception(exc)
            raise
        self.window.release(slot, copied)
        return float(sq)

    def _shard_start(self, unit: int) -> int:
        return 0 if self.collectives is None else self.collectives.shards[unit].start

    def _reduce(self, unit: int, slot: Slot, computed: Any) -> torch.Tensor:
        """d2h lane, data-parallel: sum the unit's gradient over the ranks (in this rank's shard, which
        the caller then copies down) and return the squared norm of that shard (a device scalar)."""
        assert self.collectives is not None
        shard = self.collectives.shards[unit]
        s = self.streams
        with self.timeline.host("reduce", unit), s.use(s.d2h):
            s.wait(s.d2h, computed)  # the backward wrote the gradient
            self.collectives.reduce_grads(unit, slot.grads)
            own = slot.grads[shard.start : shard.stop]
            return torch.linalg.vector_norm(own, dtype=torch.float32).square()

    def _reduce_on_device(self, unit: int, slot: Slot, computed: Any) -> float:
        """d2h lane, data-parallel: reduce the gradient of a unit updated on the device at the step's end
        (resident, or resident with sliding weights) and return the squared norm of this rank's shard,
        once the d2h stream has written it.

        A unit whose weights slide has its shard copied into its device buffer first and lets the cache
        unit go. The host waits for an event on the d2h stream before reading the norm (a plain read would
        run on this thread's current stream, the compute stream, unordered with d2h), and the update on
        the compute stream waits for the same event (``_reduced``)."""
        sq = self._reduce(unit, slot, computed)
        s = self.streams
        lean = unit in self.weights_slide
        if lean:
            a = self._shard_start(unit)
            with s.use(s.d2h):
                self.device_grads[unit].copy_(slot.grads[a : a + self.host.masters[unit].numel()])
        done = s.record(s.d2h)
        self._reduced[unit] = done
        if lean:
            self.window.release(slot, done)
        s.synchronize(done)
        return float(sq)

    def _update(
        self,
        unit: int,
        download: Future[float],
        handoff: list[Future[tuple[int, float]]] | None,
        lr: float,
        count: int,
        scale: float,
    ) -> None:
        """Optimizer thread: update ``unit``'s master from its gradients, in submission order.

        Piece by piece as they arrive (``handoff``), or from the unit's own
        buffer once ``download`` is done. A unit whose gradients are not finite
        is never applied: the step stops here.
        """
        what = f"the gradient download of unit {unit}"
        if handoff is None:
            self._check_finite(unit, self.pipeline.result(download, what))
            self._wait_checkpoint(unit)
            with self.timeline.host("update", unit):
                copy = self.host.copy_slice(unit)  # the upload copy, written in the same pass (engine.upload_copy)
                self._apply(unit, self.host.unit_grad(unit), lr=lr, count=count, scale=scale, lowp_out=copy)
            return
        for k, (a, b) in enumerate(self.host.pieces(unit)):
            index, sq = self.pipeline.result(handoff[k], what)
            try:
                if k == 0:
                    self._check_finite(unit, sq)
                    self._wait_checkpoint(unit)
                grad = self.host.ring.buffers[index][: b - a]
                with self.timeline.host("update", unit):
                    copy = self.host.copy_slice(unit, a, b)
                    self._apply(unit, grad, lr=lr, count=count, scale=scale, lowp_out=copy, start=a, stop=b)
            finally:
                self.host.ring.release(index)

    def _check_finite(self, unit: int, sq: float) -> None:
        if not math.isfinite(sq):
            raise NonFiniteError(
                f"step {self.steps_done + 1}: the gradients of unit {unit} ({self.spec.units[unit].kind}) "
                "are not finite; no update was applied to it. Lower the learning rate, clip gradients "
                "(optim.max_grad_norm), or set optim.on_nonfinite='skip' to skip such steps"
            )

    def _norm_known(self, c: StepState, scale: float | None) -> None:
        """Main thread, at the step's end, before any update is queued: the step's clip factor (None: the
        norm or loss is not finite). Nothing to do here; speculative clipping tells its optimizer thread."""

    def _apply_deferred(self, c: StepState, scale: float) -> None:
        """Queue every unit's update, in the order the next forward pass needs them, with the clip factor
        (``settle_scale``)."""
        c.rolled_back = bool(c.speculative) and scale != 1.0  # speculated with scale 1: redo them
        for unit in sorted(c.deferred):  # resident units are updated on the device instead
            self._queue_update(unit, c.deferred.pop(unit), c, scale)

    def _queue_update(self, unit: int, download: Future[float], c: StepState, scale: float) -> None:
        self.updated[unit] = self.pipeline.submit(
            "optim", self._update, unit, download, None, c.lr, self.updates_applied + 1, scale, unit=unit
        )

    def _update_resident(self, c: StepState, scale: float) -> None:
        """Update the device-resident units on the device, in the order the next forward pass needs them.

        Their BF16 weights are rewritten in place from the new masters, so they
        never cross the bus. The update is queued on the compute stream, after
        the backward pass that produced the gradients. ``scale``: the clip factor (``settle_scale``).
        """
        for unit in sorted(c.resident_due):
            self._wait_checkpoint(unit)
            with self.timeline.device("update_gpu", unit, self.streams.compute):
                self._update_on_device(unit, c.lr, self.updates_applied + 1, scale)

    def _update_on_device(self, unit: int, lr: float, count: int, scale: float) -> None:
        # Streaming uses staging buffers that belong to the optimizer thread: resident state must map.
        assert not self.host.state.streamed(unit), f"resident unit {unit} has streamed state"
        self.streams.wait(self.streams.compute, self._reduced.pop(unit, None))  # data-parallel: the reduction
        if unit in self.weights_slide:  # its gradients wait in its device buffer; no weights of its own
            self._apply(unit, self.device_grads[unit], lr=lr, count=count, scale=scale, lowp_out=None)
            self._cast_after[unit] = self.streams.record(self.streams.compute)
            return
        slot = self.window.resident[unit]
        a = self._shard_start(unit)  # data-parallel: this rank's shard, gathered into the slot afterwards
        b = a + self.host.masters[unit].numel()
        params = slot.params[a:b]
        lowp = params.dtype == torch.bfloat16  # the optimizer writes the BF16 weights in the same pass
        self._apply(unit, slot.grads[a:b], lr=lr, count=count, scale=scale, lowp_out=params if lowp else None)
        if not lowp:
            params.copy_(self.host.masters[unit])
        if self.collectives is not None:  # the other ranks' shards come at the unit's next request
            self._stale.add(unit)

    def _apply(
        self,
        unit: int,
        grad: torch.Tensor,
        *,
        lr: float,
        count: int,
        scale: float,
        lowp_out: torch.Tensor | None,
        start: int = 0,
        stop: int | None = None,
    ) -> None:
        """Scale ``grad`` (clipping) and run the optimizer over the unit's master and state, chunk by chunk.

        ``grad`` (and ``lowp_out``) hold parameters [start, stop) of the unit: all of it by default.
        """
        if grad.numel() == 0:
            return  # data-parallel: this rank owns none of the unit
        if scale != 1.0:
            grad.mul_(scale)
        master, groups = self.host.masters[unit], self.groups[unit]

        def step(a: int, b: int, state: Mapping[str, torch.Tensor]) -> None:
            self.optimizer.step(
                master[a:b],
                grad[a - start : b - start],
                state,
                lr=lr,
                count=count,
                groups=slice_groups(groups, a, b),
                lowp_out=None if lowp_out is None else lowp_out[a - start : b - start],
            )

        self.host.state.update(unit, step, start, stop)

    def sync_resident(self) -> None:
        """Refresh resident units' compute-dtype weights from their masters (after loading or restoring),
        and the host units' upload copies.

        Data-parallel: this rank's shard now; the other ranks' at the unit's next request
        (``_resident_gather``), so that loading and restoring need no collective. Units whose weights
        slide have none on the device: their next casts wait for what the compute stream wrote so far.
        Host units' upload copies (``engine.upload_copy``) are cast again from their masters."""
        self.host.refresh_copies()
        for unit in self.weights_slide:
            self._cast_after[unit] = self.streams.record(self.streams.compute)
        for unit, slot in self.window.resident.items():
            a = self._shard_start(unit)
            master = self.host.masters[unit]
            slot.params[a : a + master.numel()].copy_(master)
            if self.collectives is not None:
                self._stale.add(unit)

    def _drop_deferred(self, c: StepState) -> None:
        """Skip the step: wait for the downloads, apply nothing. Masters and state stay as they were."""
        for unit, download in c.take_deferred().items():
            self.pipeline.result(download, f"the gradient download of unit {unit}")

    def guard_checkpoint(self, handle: Any, names: dict[int, list[str]]) -> None:
        """Hold back each unit's next update until ``handle`` (a checkpoint being written) has its tensors."""
        self._checkpoint = (handle, names)

    def _wait_checkpoint(self, unit: int) -> None:
        guard = self._checkpoint
        if guard is None:
            return
        handle, names = guard
        if handle.done():
            self._checkpoint = None
        with self.timeline.host("checkpoint_wait", unit):
            handle.wait_for(*names[unit], timeout=self.pipeline.timeout_s)
