"""The sliding engine: executes the visit schedule of ``slidekit.plan`` for one step at a time.

One step, for a model of L layers (units 0..L+1)::

    forward   embed, layer 1..L   (no autograd; each layer's input saved)
    head      final norm + fused linear/cross-entropy: loss AND its gradients
    backward  layer L..1          (recompute from the saved input, backprop)
              embed               (scatter-add of the input gradient)

While the device computes visit k, the upload thread loads the parameters
of the next visits into free cache units. After a unit's backward, the
download thread copies its gradients into a shared host buffer and the
optimizer thread updates the unit's FP32 master from it, while the device
moves on to the next unit. The next step's upload of a unit waits for that
unit's update, so every forward sees fully updated weights (ordinary AdamW
semantics, no staleness).

On CUDA the three activities run on three streams ordered by events; on the
CPU the same threads run the same schedule with synchronous copies.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from slidekit.engine.activations import ActivationStore
from slidekit.engine.host import HostStore
from slidekit.engine.runtime import Pipeline, Streams
from slidekit.engine.state import slice_groups
from slidekit.engine.window import Slot, Window
from slidekit.errors import NonFiniteError
from slidekit.inputs import check_step
from slidekit.interfaces import KernelSet, ParamGroupRange, UnitOptimizer
from slidekit.models.base import ArchSpec, UnitKind
from slidekit.models.decoder import RopeTables, embed_backward, embed_forward, head_loss, layer_forward
from slidekit.plan import BWD, FWD, HEAD, MemoryPlan, Visit, schedule
from slidekit.telemetry import Timeline, hiding_factor

__all__ = ["Engine", "StepResult"]

#: Elements per chunk when FP32 masters are uploaded and cast on the device.
UPLOAD_CHUNK = 1 << 24


@dataclass(frozen=True, slots=True)
class StepResult:
    loss: float  # mean cross-entropy over the labelled tokens
    skipped: bool  # True when the update was skipped (non-finite loss or gradients)
    tokens: int  # tokens processed (labelled or not)
    labelled: int  # tokens that carried a label
    seconds: float  # train_step's own wall time, the device work of the step included (its resident update too)
    grad_norm: float  # global L2 norm of the step's gradients (before clipping)
    timings: dict[str, float]  # seconds per pipeline lane (see Engine.train_step)

    @property
    def eta(self) -> float:
        """Hiding factor T_bwd / (T_d2h + T_update): >= 1 means the CPU side keeps up with backward."""
        eta = hiding_factor(self.timings)
        return float("inf") if eta is None else eta


class Engine:
    """Runs training steps over a model whose units live on the host and slide through a window."""

    def __init__(
        self,
        spec: ArchSpec,
        *,
        kernels: KernelSet,
        optimizer: UnitOptimizer,
        host: HostStore,
        window: Window,
        activations: ActivationStore,
        pipeline: Pipeline,
        streams: Streams,
        plan: MemoryPlan,
        groups: Sequence[Sequence[ParamGroupRange]],
        device: torch.device,
        compute_dtype: torch.dtype,
        loss_chunk: int | None,
        prefetch: int,
        resident: Sequence[bool] = (),
    ) -> None:
        self.spec = spec
        self.kernels = kernels
        self.optimizer = optimizer
        self.host = host
        self.window = window
        self.acts = activations
        self.pipeline = pipeline
        self.streams = streams
        self.plan = plan
        self.groups = groups
        self.device = device
        self.dtype = compute_dtype
        self.loss_chunk = loss_chunk
        self.prefetch_depth = prefetch
        self.visits = schedule(spec.num_layers, spec.tie_embeddings)
        self.rope = RopeTables(spec)
        n = len(spec.units)
        self.version = [0] * n  # bumped when an optimizer update of the unit is queued
        self.updated: list[Future[None] | None] = [None] * n  # the latest update of each unit
        self.steps_done = 0  # steps taken, skipped ones included
        self.updates_applied = 0  # steps whose update was applied: Adam's bias-correction count
        self._loads: dict[int, tuple[Slot, Future[Any] | None]] = {}  # visit index -> slot, upload
        self._tied_slot: Slot | None = None
        self._stage: torch.Tensor | None = None  # FP32 staging on the device for casting uploads
        self.timeline = Timeline(streams.cuda)
        self._checkpoint: tuple[Any, dict[int, list[str]]] | None = None  # (SaveHandle, names per unit)
        # Units resident on the device: their own cache unit, master and state there, updated there.
        for unit, on_device in enumerate(resident):
            if on_device:
                self.window.add_resident(unit, spec.units[unit].numel)
        self.sync_resident()

    # ================================================================== uploads

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
        if own is not None:  # always loaded, never evicted
            if self._is_tied_embed(visit.unit):
                self._tied_slot = own
            self._loads[k] = (own, None)
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
        if update is not None:
            self.pipeline.result(update, f"the optimizer update of unit {unit}")
        master = self.host.masters[unit]
        n = master.numel()
        if not self.streams.cuda:
            with self.timeline.host("h2d", unit):
                slot.params[:n].copy_(master)
            return None
        s = self.streams
        with s.use(s.h2d), self.timeline.device("h2d", unit, s.h2d):
            s.wait(s.h2d, free_event)  # the slot's previous contents are no longer read
            if self.dtype == torch.float32:
                slot.params[:n].copy_(master, non_blocking=True)
            else:  # FP32 over the bus, cast on the device: no host-side BF16 copy to keep
                stage = self._staging()
                for a in range(0, n, UPLOAD_CHUNK):
                    b = min(a + UPLOAD_CHUNK, n)
                    stage[: b - a].copy_(master[a:b], non_blocking=True)
                    slot.params[a:b].copy_(stage[: b - a])
        return s.record(s.h2d)

    def _staging(self) -> torch.Tensor:
        if self._stage is None:
            self._stage = torch.empty(UPLOAD_CHUNK, dtype=torch.float32, device=self.device)
        return self._stage

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

    # ================================================================== gradients and updates

    def _finish_unit(self, unit: int, slot: Slot, c: dict[str, Any]) -> None:
        """After a unit's backward: add its gradient norm, copy the gradients down, update it.

        Without clipping the update is queued at once and overlaps the rest of
        the backward pass. With clipping it must wait for the global norm: the
        gradients go to the unit's own host buffer and the update is queued at
        the end of the step (``_clip_and_update``).
        """
        n = self.spec.units[unit].numel
        unit_sq = torch.linalg.vector_norm(slot.grads[:n], dtype=torch.float32).square()
        c["sq_norm"] += unit_sq
        if slot.resident:  # updated on the device once the step's loss and norm are known
            c["resident_due"].append(unit)
            return
        done = self.streams.record(self.streams.compute)
        # Bump the version now, on this thread: from here on no slot holding the old
        # parameters can be mistaken for current, and every upload waits for the update.
        self.version[unit] += 1
        if c["defer"]:  # into the unit's own buffer, updated once the step's norm is known
            c["deferred"][unit] = self.pipeline.submit(
                "d2h", self._download, unit, slot, done, unit_sq, None, unit=unit
            )
            return
        # Futures the download completes piece by piece: stall reports follow them to the d2h lane.
        handoff: list[Future[tuple[int, float]]] = [
            self.pipeline.promise("d2h", unit) for _ in self.host.pieces(unit)
        ]
        download = self.pipeline.submit("d2h", self._download, unit, slot, done, unit_sq, handoff, unit=unit)
        self.updated[unit] = self.pipeline.submit(
            "optim", self._update, unit, download, handoff, c["lr"], self.updates_applied + 1, 1.0, unit=unit
        )

    def _download(
        self,
        unit: int,
        slot: Slot,
        computed: Any,
        unit_sq: torch.Tensor,
        handoff: list[Future[tuple[int, float]]] | None,
    ) -> float:
        """Download thread: the unit's gradients to the host; returns their squared norm.

        With ``handoff`` (one future per range of ``host.pieces(unit)``) each
        piece lands in a ring buffer whose index (with the norm) is handed to the
        optimizer thread as soon as it has arrived, so a unit larger than a
        buffer is updated while its later pieces come down. Without, the whole
        unit goes into its own buffer, kept until the step ends.
        """
        n = self.host.masters[unit].numel()
        sq = torch.empty((), dtype=torch.float32, pin_memory=self.streams.cuda)
        s = self.streams
        copied = None
        try:
            for k, (a, b) in enumerate(self.host.pieces(unit) if handoff is not None else [(0, n)]):
                if handoff is None:
                    index, dst = -1, self.host.unit_grad(unit)
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
                                dst.copy_(slot.grads[a:b], non_blocking=True)
                                if k == 0:
                                    sq.copy_(unit_sq, non_blocking=True)
                            copied = s.record(s.d2h)
                        s.synchronize(copied)
                    else:
                        with self.timeline.device("d2h_copy", unit, None):
                            dst.copy_(slot.grads[a:b])
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
                self._apply(unit, self.host.unit_grad(unit), lr=lr, count=count, scale=scale, lowp_out=None)
            return
        for k, (a, b) in enumerate(self.host.pieces(unit)):
            index, sq = self.pipeline.result(handoff[k], what)
            try:
                if k == 0:
                    self._check_finite(unit, sq)
                    self._wait_checkpoint(unit)
                grad = self.host.ring.buffers[index][: b - a]
                with self.timeline.host("update", unit):
                    self._apply(unit, grad, lr=lr, count=count, scale=scale, lowp_out=None, start=a, stop=b)
            finally:
                self.host.ring.release(index)

    def _check_finite(self, unit: int, sq: float) -> None:
        if not math.isfinite(sq):
            raise NonFiniteError(
                f"step {self.steps_done + 1}: the gradients of unit {unit} ({self.spec.units[unit].kind}) "
                "are not finite; no update was applied to it. Lower the learning rate, clip gradients "
                "(optim.max_grad_norm), or set optim.on_nonfinite='skip' to skip such steps"
            )

    def _apply_deferred(self, c: dict[str, Any], grad_norm: float) -> None:
        """Queue every unit's update, in the order the next forward pass needs them, with the clip factor.

        torch.nn.utils.clip_grad_norm_ semantics: scale = min(1, max_norm / (norm + 1e-6)).
        """
        scale = 1.0 if c["clip"] is None else min(1.0, c["clip"] / (grad_norm + 1e-6))
        for unit in sorted(c["deferred"]):  # resident units are updated on the device instead
            self.updated[unit] = self.pipeline.submit(
                "optim",
                self._update,
                unit,
                c["deferred"].pop(unit),
                None,
                c["lr"],
                self.updates_applied + 1,
                scale,
                unit=unit,
            )

    def _update_resident(self, c: dict[str, Any], grad_norm: float) -> None:
        """Update the device-resident units on the device, in the order the next forward pass needs them.

        Their BF16 weights are rewritten in place from the new masters, so they
        never cross the bus. The update is queued on the compute stream, after
        the backward pass that produced the gradients.
        """
        scale = 1.0 if c["clip"] is None else min(1.0, c["clip"] / (grad_norm + 1e-6))
        for unit in sorted(c["resident_due"]):
            self._wait_checkpoint(unit)
            with self.timeline.device("update_gpu", unit, self.streams.compute):
                self._update_on_device(unit, c["lr"], self.updates_applied + 1, scale)

    def _update_on_device(self, unit: int, lr: float, count: int, scale: float) -> None:
        # Streaming uses staging buffers that belong to the optimizer thread: resident state must map.
        assert not self.host.state.streamed(unit), f"resident unit {unit} has streamed state"
        slot = self.window.resident[unit]
        n = self.spec.units[unit].numel
        params = slot.params[:n]
        lowp = params.dtype == torch.bfloat16  # the optimizer writes the BF16 weights in the same pass
        self._apply(unit, slot.grads[:n], lr=lr, count=count, scale=scale, lowp_out=params if lowp else None)
        if not lowp:
            params.copy_(self.host.masters[unit])

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
        """Refresh resident units' compute-dtype weights from their masters (after loading or restoring)."""
        for unit, slot in self.window.resident.items():
            n = self.spec.units[unit].numel
            slot.params[:n].copy_(self.host.masters[unit])

    def _drop_deferred(self, c: dict[str, Any]) -> None:
        """Skip the step: wait for the downloads, apply nothing. Masters and state stay as they were."""
        for unit, download in c.pop("deferred").items():
            self.pipeline.result(download, f"the gradient download of unit {unit}")

    # ================================================================== the step

    def train_step(
        self,
        micro: Sequence[tuple[torch.Tensor, torch.Tensor]],
        lr: float,
        *,
        max_grad_norm: float | None = None,
        skip_nonfinite: bool = False,
    ) -> StepResult:
        """One optimizer step over ``micro``-batches of (``input_ids``, ``labels``), each (B, T).

        Gradients of all micro-batches add up in each cache unit while it is
        resident (every micro-batch passes through a unit before it moves on),
        so the step equals one step on their concatenation; the loss is the
        mean over all labelled tokens (label -100 carries none). B and T may
        differ between micro-batches: the step then equals one step on all
        rows right-padded to the longest with label -100 on the padding.
        Inputs are checked first (``slidekit.inputs.check_step``).

        Updates overlap the backward pass unless the step must see every
        gradient first: clipping by the global norm (``max_grad_norm``), or
        ``skip_nonfinite``, which skips a step whose loss or gradients are not
        finite instead of raising ``NonFiniteError``. Those keep each unit's
        gradients on the host until the end of the backward pass (2 more bytes
        per parameter in BF16) and update during the next forward pass.
        """
        t0 = time.perf_counter()
        self.pipeline.check()
        # Every micro-batch checked before anything moves: bad input fails here, naming its cause.
        labelled = check_step(micro, vocab_size=self.spec.vocab_size, max_positions=self.spec.max_positions)
        ids = [i.to(self.device, torch.int64, non_blocking=True) for i, _ in micro]
        tgt = [t.to(self.device, torch.int64, non_blocking=True) for _, t in micro]
        # Micro-batches may differ in length: each gets the first T rows of one shared table.
        rope = [self.rope.get(i.shape[1], self.device, self.dtype) for i in ids]
        c: dict[str, Any] = {
            "ids": ids,
            "labels": tgt,
            "rope": rope,  # (cos, sin) per micro-batch
            "lr": lr,
            "labelled": labelled,
            "clip": max_grad_norm,
            "deferred": {},
            "defer": max_grad_norm is not None or skip_nonfinite,
            "resident_due": [],
            "sq_norm": torch.zeros((), dtype=torch.float32, device=self.device),
        }
        run: dict[str, Callable[..., Any]] = {FWD: self._forward, HEAD: self._head, BWD: self._backward}
        self._request(0)
        for k, visit in enumerate(self.visits):
            run[visit.phase](k, visit, c)
        loss_sum = float(c["loss_sum"])  # waits for the device, not for the optimizer
        grad_norm = float(c["sq_norm"].sqrt())
        skipped = self._conclude(c, loss_sum / labelled, grad_norm, skip_nonfinite)
        self.steps_done += 1
        self.updates_applied += not skipped
        timings = self.timeline.finish()  # waits for the step's device work: the resident update too
        return StepResult(
            loss=loss_sum / labelled,
            skipped=skipped,
            tokens=sum(i.numel() for i in ids),
            labelled=labelled,
            seconds=time.perf_counter() - t0,
            grad_norm=grad_norm,
            timings=timings,
        )

    def _conclude(self, c: dict[str, Any], loss: float, grad_norm: float, skip_nonfinite: bool) -> bool:
        """Apply deferred updates, or skip / refuse a non-finite step. True when skipped."""
        finite = math.isfinite(loss) and math.isfinite(grad_norm)
        if finite:
            self._update_resident(c, grad_norm)
            if c["defer"]:
                self._apply_deferred(c, grad_norm)
            return False
        what = f"step {self.steps_done + 1}: loss {loss} / gradient norm {grad_norm} is not finite"
        if c["defer"]:
            self._drop_deferred(c)
            if skip_nonfinite:
                return True
            raise NonFiniteError(
                f"{what}; nothing was updated. Set optim.on_nonfinite='skip' to skip such steps"
            )
        raise NonFiniteError(
            f"{what}. Lower the learning rate, clip gradients (optim.max_grad_norm) or set optim.on_nonfinite='skip'"
        )

    def _forward(self, k: int, visit: Visit, c: dict[str, Any]) -> None:
        slot = self._acquire(k)
        unit = self.spec.units[visit.unit]
        w = slot.weights(unit, trainable=False)
        with torch.no_grad(), self.timeline.device("fwd", visit.unit, self.streams.compute):
            if unit.kind == UnitKind.EMBED:
                c["x"] = [embed_forward(w, ids).to(self.dtype) for ids in c["ids"]]
            else:
                for mb, x in enumerate(c["x"]):
                    self.acts.save((visit.unit, mb), x)
                    cos, sin = c["rope"][mb]
                    c["x"][mb] = layer_forward(self.spec, w, x, cos, sin, self.kernels)
        if not slot.pinned:
            self.window.release(slot, self.streams.record(self.streams.compute))

    def _head(self, k: int, visit: Visit, c: dict[str, Any]) -> None:
        slot = self._acquire(k)
        unit = self.spec.units[visit.unit]
        slot.grads[: unit.numel].zero_()
        w = slot.weights(unit, trainable=True)
        if self.spec.tie_embeddings:  # the head's gradient is the first to reach the tied embedding
            assert self._tied_slot is not None
            self._tied_slot.grads[: self.spec.embed.numel].zero_()
        lm_weight = self._lm_weight(w, trainable=True)
        c["dx"], c["loss_sum"] = [], torch.zeros((), dtype=torch.float32, device=self.device)
        with torch.enable_grad(), self.timeline.device("head", visit.unit, self.streams.compute):
            for hidden, labels in zip(c.pop("x"), c["labels"], strict=True):
                x = hidden.detach().requires_grad_(True)
                loss_sum = head_loss(self.spec, w, lm_weight, x, labels, self.kernels, self.loss_chunk)
                (loss_sum / c["labelled"]).backward()
                c["loss_sum"] += loss_sum.detach()
                c["dx"].append(x.grad)
        self._finish_unit(visit.unit, slot, c)

    def _backward(self, k: int, visit: Visit, c: dict[str, Any]) -> None:
        unit = self.spec.units[visit.unit]
        if unit.kind == UnitKind.EMBED:
            self._embed_backward(k, visit, c)
            return
        slot = self._acquire(k)
        slot.grads[: unit.numel].zero_()
        w = slot.weights(unit, trainable=True)
        micro = len(c["dx"])
        for mb in range(micro):
            # Read the next boundary activation back while this one recomputes.
            if mb + 1 < micro:
                self.acts.prefetch((visit.unit, mb + 1))
            elif visit.unit > 1:
                self.acts.prefetch((visit.unit - 1, 0))
            with self.timeline.host("act_load", visit.unit):  # the main thread waiting for the tier's read
                x = self.acts.load((visit.unit, mb)).detach().requires_grad_(True)
            with torch.enable_grad(), self.timeline.device("bwd", visit.unit, self.streams.compute):
                cos, sin = c["rope"][mb]
                y = layer_forward(self.spec, w, x, cos, sin, self.kernels)
                torch.autograd.backward(y, c["dx"][mb])
            c["dx"][mb] = x.grad
        self._finish_unit(visit.unit, slot, c)

    def _embed_backward(self, k: int, visit: Visit, c: dict[str, Any]) -> None:
        embed = self.spec.embed
        if self._tied_slot is not None:
            slot = self._tied_slot
            self._loads.pop(k, None)
            self.window.unpin(slot)  # its last use this step: the next step uploads it afresh
            self._tied_slot = None
        elif 0 in self.window.resident:
            slot = self.window.resident[0]
            slot.grads[: embed.numel].zero_()
        else:
            # Only a gradient buffer is needed: claim a slot without loading any weights.
            slot = self.window.claim(-1, -1)
            self.window.invalidate(slot)
            slot.grads[: embed.numel].zero_()
        grad = embed.views(slot.grads)["embed_tokens.weight"]
        with self.timeline.device("bwd", 0, self.streams.compute):
            for ids, dx in zip(c["ids"], c.pop("dx"), strict=True):
                embed_backward(grad, ids, dx, padding_idx=self.spec.pad_token_id)
        self._finish_unit(0, slot, c)

    # ================================================================== forward only

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """A forward pass with the current weights, no gradients and no update.

        With ``labels`` (B, T): the summed cross-entropy over labelled tokens (a
        scalar, through the fused head: no logits kept). Without: the logits
        (B, T, V) in FP32; meant for checks on small inputs.
        """
        ids = input_ids.to(self.device)
        cos, sin = self.rope.get(ids.shape[1], self.device, self.dtype)
        head = self.spec.num_layers + 1  # the head's visit index in the schedule
        x: torch.Tensor | None = None
        out = torch.zeros(())
        for k in range(head + 1):
            slot = self._acquire(k, last=head)
            unit = self.spec.units[self.visits[k].unit]
            w = slot.weights(unit, trainable=False)
            if unit.kind == UnitKind.EMBED:
                x = embed_forward(w, ids).to(self.dtype)
            elif unit.kind == UnitKind.LAYER:
                assert x is not None
                x = layer_forward(self.spec, w, x, cos, sin, self.kernels)
            else:
                assert x is not None
                lm = self._lm_weight(w, trainable=False)
                if labels is None:
                    h = self.kernels.rms_norm(x, w["norm.weight"], self.spec.rms_eps)
                    out = (h @ lm.T).float()
                else:
                    out = head_loss(
                        self.spec, w, lm, x, labels.to(self.device), self.kernels, self.loss_chunk
                    )
            if not slot.pinned:
                self.window.release(slot, self.streams.record(self.streams.compute))
        if self._tied_slot is not None:  # the tied embedding stayed pinned for the head: let it go
            self.window.unpin(self._tied_slot)
            self.window.release(self._tied_slot, self.streams.record(self.streams.compute))
            self._tied_slot = None
        return out.cpu()

    def _lm_weight(self, head_weights: Mapping[str, torch.Tensor], *, trainable: bool) -> torch.Tensor:
        if not self.spec.tie_embeddings:
            return head_weights["lm_head.weight"]
        assert self._tied_slot is not None
        return self._tied_slot.weights(self.spec.embed, trainable=trainable)["embed_tokens.weight"]

    # ================================================================== checkpoints

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

    def invalidate_device_copies(self) -> None:
        """Masters were replaced (a checkpoint was loaded): no cache unit holds current weights any more."""
        self.wait_updates()
        self.version = [v + 1 for v in self.version]
        self.updated = [None] * len(self.updated)
        self.sync_resident()

    # ================================================================== state

    def wait_updates(self) -> None:
        """Block until every queued optimizer update has been applied."""
        for unit, fut in enumerate(self.updated):
            if fut is not None:
                self.pipeline.result(fut, f"the optimizer update of unit {unit}")

    def drain(self) -> None:
        """Block until every update is applied and every copy and kernel queued on the device is done."""
        self.wait_updates()
        if self.streams.cuda:
            torch.cuda.synchronize(self.device)

    def master_state(self) -> dict[str, torch.Tensor]:
        """Hugging Face name -> FP32 master view (after all updates). Tied heads appear under both names."""
        self.wait_updates()
        out: dict[str, torch.Tensor] = {}
        for unit, master in zip(self.spec.units, self.host.masters, strict=True):
            master = master.cpu()  # a copy for units resident on the device, the master itself otherwise
            for e in unit.entries:
                out[e.name] = master[e.offset : e.stop].view(e.shape)
        if self.spec.tie_embeddings:
            out["lm_head.weight"] = out["model.embed_tokens.weight"]
        return out

    def close(self) -> None:
        self.pipeline.close()
        self.acts.close()
        self.host.close()
