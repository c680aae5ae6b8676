"""The sliding engine: executes the visit schedule of ``slidekit.planning.schedule`` for one step at a time.

One step, for a model of L layers (units 0..L+1)::

    forward   embed, layer 1..L   (no autograd; each layer's input saved)
    head      final norm + fused linear/cross-entropy: loss AND its gradients
    backward  layer L..1          (recompute from the saved input, backprop)
              embed               (scatter-add of the input gradient)

A layer that keeps its activations (``UnitPlace.keeps``, chosen by the
planner: ``slidekit.planning.keeping``) runs its forward with autograd on
instead and saves no input; its backward back-propagates through the kept
graph: the same operations in the same order as a recompute, one forward
fewer. A sliding one's graph holds references to its weights, not the cache
unit's tensors (``KeptGraphs``), read at the backward from the cache unit it
is loaded into then.

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
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from slidekit.engine.activations import ActivationStore, KeptGraphs
from slidekit.engine.collectives import Collectives
from slidekit.engine.host import HostStore
from slidekit.engine.runtime import Pipeline, Streams
from slidekit.engine.speculation import Speculation, decide
from slidekit.engine.step_state import StepState
from slidekit.engine.updates import settle_scale
from slidekit.engine.uploads import Uploads
from slidekit.engine.window import Slot, Window
from slidekit.errors import NonFiniteError
from slidekit.inputs import check_step
from slidekit.interfaces import KernelSet, ParamGroupRange, UnitOptimizer
from slidekit.models.base import ArchSpec, UnitKind
from slidekit.models.decoder import RopeTables, embed_backward, embed_forward, head_loss, layer_forward
from slidekit.planning.keeping import check_keeps
from slidekit.planning.layout import Layout
from slidekit.planning.schedule import BWD, FWD, HEAD, Visit, schedule
from slidekit.telemetry import Timeline

__all__ = ["Engine", "StepResult"]

@dataclass(frozen=True, slots=True)
class StepResult:
    loss: float  # mean cross-entropy over the labelled tokens
    skipped: bool  # True when the update was skipped (non-finite loss or gradients)
    tokens: int  # tokens processed (labelled or not)
    labelled: int  # tokens that carried a label
    seconds: float  # train_step's own wall time, the device work of the step included (its resident update too)
    grad_norm: float  # global L2 norm of the step's gradients (before clipping)
    timings: dict[str, float]  # seconds per pipeline lane (see Engine.train_step)
    speculated: bool = False  # host units were updated during the backward as if unclipped (clip_overlap)
    rolled_back: bool = False  # ... and the step clipped (or was not finite): they were restored and redone


class Engine(Uploads, Speculation):
    """Runs training steps over a model whose units live on the host and slide through a window."""

    def __init__(
        self,
        spec: ArchSpec,
        *,
        layout: Layout,
        kernels: KernelSet,
        optimizer: UnitOptimizer,
        host: HostStore,
        window: Window,
        activations: ActivationStore,
        pipeline: Pipeline,
        streams: Streams,
        upload_staging: torch.Tensor | None,
        groups: Sequence[Sequence[ParamGroupRange]],
        device: torch.device,
        compute_dtype: torch.dtype,
        loss_chunk: int | None,
        collectives: Collectives | None = None,
        device_grads: Mapping[int, torch.Tensor] | None = None,
    ) -> None:
        """The parts come from ``slidekit.engine.build.build_engine``, which allocates ``layout``.

        ``collectives``: this rank's part in a data-parallel run (``slidekit.engine.collectives``);
        None for one process, which then runs exactly the single-process engine. ``device_grads``: the
        device gradient buffers of the units whose weights slide, for steps that defer their updates."""
        self.spec = spec
        self.kernels = kernels
        self.optimizer = optimizer
        self.host = host
        self.window = window
        self.acts = activations
        self.pipeline = pipeline
        self.streams = streams
        self.layout = layout
        self.groups = groups
        self.device = device
        self.dtype = compute_dtype
        self.loss_chunk = loss_chunk
        self.prefetch_depth = layout.prefetch
        self.visits = schedule(spec.num_layers, spec.tie_embeddings)
        self.rope = RopeTables(spec)
        n = len(spec.units)
        self.version = [0] * n  # bumped when an optimizer update of the unit is queued
        self.updated: list[Future[None] | None] = [None] * n  # the latest update of each unit
        self.steps_done = 0  # steps taken, skipped ones included
        self.updates_applied = 0  # steps whose update was applied: Adam's bias-correction count
        self._loads: dict[int, tuple[Slot, Future[Any] | None]] = {}  # visit index -> slot, upload
        self._tied_slot: Slot | None = None
        self.upload_stage = upload_staging  # FP32 staging on the device for casting uploads
        self.timeline = Timeline(streams.cuda)
        self._checkpoint: tuple[Any, dict[int, list[str]]] | None = None  # (SaveHandle, names per unit)
        self.collectives = collectives
        self._stale: set[int] = set()  # resident units whose other ranks' shards are still to be gathered
        # Resident units whose weights slide (slidekit.planning.weights): cast into a cache unit per visit.
        self.weights_slide = frozenset(u.index for u in layout.units if u.weights_slide)
        self.device_grads = dict(device_grads or {})
        self._cast_after: dict[int, Any] = {}  # unit -> event after its latest device update (CUDA)
        self._reduced: dict[int, Any] = {}  # data-parallel: unit -> event after its reduced shard's copy
        self.clip_overlap = "auto"
        self._clipped_last = False  # the last step clipped or was not finite ("auto" in place then defers the next)
        check_keeps(layout.units)  # decoder layers only
        self.keeps = tuple(u.keeps for u in layout.units)
        self.kept = KeptGraphs()  # the graphs of the layers that keep their activations, this step
        self.sync_resident()

    # ================================================================== the step

    def train_step(
        self,
        micro: Sequence[tuple[torch.Tensor, torch.Tensor]],
        lr: float,
        *,
        max_grad_norm: float | None = None,
        skip_nonfinite: bool = False,
        clip_overlap: str = "auto",
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
        per parameter in BF16). ``clip_overlap`` (``OptimConfig.clip_overlap``) says whether their host
        updates still overlap the backward, speculatively and exactly (``slidekit.engine.speculation``),
        or wait for the next forward pass ("defer").
        """
        if clip_overlap not in ("auto", "speculate", "defer"):
            raise ValueError(f"clip_overlap must be 'auto', 'speculate' or 'defer', got {clip_overlap!r}")
        self.clip_overlap = clip_overlap
        if self.collectives is None:
            return self._train_step(micro, lr, max_grad_norm, skip_nonfinite)
        try:
            return self._train_step(micro, lr, max_grad_norm, skip_nonfinite)
        except BaseException as exc:  # the other ranks must not wait for this one: tell them
            self.collectives.parallel.report(exc)
            raise

    def _train_step(
        self,
        micro: Sequence[tuple[torch.Tensor, torch.Tensor]],
        lr: float,
        max_grad_norm: float | None,
        skip_nonfinite: bool,
    ) -> StepResult:
        t0 = time.perf_counter()
        self.pipeline.check()
        # Every micro-batch checked before anything moves: bad input fails here, naming its cause.
        labelled = check_step(micro, vocab_size=self.spec.vocab_size, max_positions=self.spec.max_positions)
        tokens = sum(i.numel() for i, _ in micro)
        if self.collectives is not None:  # the loss is the mean over every rank's labelled tokens
            total = self.collectives.parallel.all_reduce([float(labelled), float(tokens)])
            labelled, tokens = int(total[0]), int(total[1])
        ids = [i.to(self.device, torch.int64, non_blocking=True) for i, _ in micro]
        tgt = [t.to(self.device, torch.int64, non_blocking=True) for _, t in micro]
        # Micro-batches may differ in length: each gets the first T rows of one shared table.
        rope = [self.rope.get(i.shape[1], self.device, self.dtype) for i in ids]
        defer = max_grad_norm is not None or skip_nonfinite
        c = StepState(
            ids=ids,
            labels=tgt,
            rope=rope,
            lr=lr,
            labelled=labelled,
            clip=max_grad_norm,
            defer=defer,
            sq_norm=torch.zeros((), dtype=torch.float32, device=self.device),
            speculate=decide(
                self.clip_overlap,
                defer=defer,
                backed_up=self.layout.clip_backup,
                clipped_last=self._clipped_last,
                out_of_place=self.host.out_of_place,
            ),
        )
        run: dict[str, Callable[..., Any]] = {FWD: self._forward, HEAD: self._head, BWD: self._backward}
        self._request(0)
        for k, visit in enumerate(self.visits):
            run[visit.phase](k, visit, c)
        assert c.loss_sum is not None, "the step has no head visit"
        loss_sum = float(c.loss_sum)  # waits for the device, not for the optimizer
        if self.collectives is None:
            grad_norm = float(c.sq_norm.sqrt())
        else:
            loss_sum, grad_norm = self._global_sums(c, loss_sum)
        skipped = self._conclude(c, loss_sum / labelled, grad_norm, skip_nonfinite)
        self.steps_done += 1
        self.updates_applied += not skipped
        timings = self.timeline.finish()  # waits for the step's device work: the resident update too
        return StepResult(
            loss=loss_sum / labelled,
            skipped=skipped,
            tokens=tokens,
            labelled=labelled,
            seconds=time.perf_counter() - t0,
            grad_norm=grad_norm,
            timings=timings,
            speculated=bool(c.speculative),
            rolled_back=c.rolled_back,
        )

    def _global_sums(self, c: StepState, loss_sum: float) -> tuple[float, float]:
        """Data-parallel: the step's loss sum and gradient norm over every rank (each rank's squared shard
        norms, as the reductions finish on the d2h lane, summed here)."""
        assert self.collectives is not None
        sq = torch.zeros((), dtype=torch.float32)
        for unit, fut in c.shard_sq.items():
            sq += self.pipeline.result(fut, f"the gradient reduction of unit {unit}")
        # In FP32, as one process sums them: with two ranks of one micro-batch each, the loss is its bits.
        total = self.collectives.parallel.all_reduce([loss_sum, float(sq)], dtype=torch.float32)
        return total[0], math.sqrt(total[1]) if total[1] >= 0 else math.nan

    def _conclude(self, c: StepState, loss: float, grad_norm: float, skip_nonfinite: bool) -> bool:
        """Apply deferred updates, or skip / refuse a non-finite step. True when skipped."""
        finite = math.isfinite(loss) and math.isfinite(grad_norm)
        scale = settle_scale(c.clip, grad_norm) if finite else None
        self._clipped_last = scale is None or scale < 1.0
        self._norm_known(c, scale)
        if scale is not None:
            self._update_resident(c, scale)
            if c.defer:
                self._apply_deferred(c, scale)
            return False
        what = f"step {self.steps_done + 1}: loss {loss} / gradient norm {grad_norm} is not finite"
        if c.defer:
            self._drop_deferred(c)
            if skip_nonfinite:
                return True
            raise NonFiniteError(
                f"{what}; nothing was updated. Set optim.on_nonfinite='skip' to skip such steps"
            )
        raise NonFiniteError(
            f"{what}. Lower the learning rate, clip gradients (optim.max_grad_norm) or set optim.on_nonfinite='skip'"
        )

    def _forward(self, k: int, visit: Visit, c: StepState) -> None:
        slot = self._acquire(k)
        unit = self.spec.units[visit.unit]
        keeps = self.keeps[visit.unit]
        # A keeping layer binds the weights its backward accumulates into: the leaves whose .grad is the
        # cache unit's gradient buffer (Slot.weights), as a recompute would bind them.
        w = slot.weights(unit, trainable=keeps)
        # A sliding keeper's cache unit goes to another unit before its backward: its graph keeps
        # references to the weights, read at the backward from the cache unit it is loaded into then.
        sliding = keeps and not slot.resident
        saving = self.kept.saving_weights(visit.unit, slot.params, w) if sliding else nullcontext()
        with (
            torch.set_grad_enabled(keeps),
            saving,
            self.timeline.device("fwd", visit.unit, self.streams.compute),
        ):
            if unit.kind == UnitKind.EMBED:
                self.kept.clear()  # the step's first visit: nothing a failed step left is used again
                c.x = [embed_forward(w, ids).to(self.dtype) for ids in c.ids]
            else:
                for mb, x in enumerate(c.x):
                    cos, sin = c.rope[mb]
                    if keeps:  # the graph from a leaf input, exactly the recompute's
                        x = x.detach().requires_grad_(True)
                        y = layer_forward(self.spec, w, x, cos, sin, self.kernels)
                        self.kept.keep((visit.unit, mb), x, y)
                        c.x[mb] = y.detach()
                    else:
                        self.acts.save((visit.unit, mb), x)
                        c.x[mb] = layer_forward(self.spec, w, x, cos, sin, self.kernels)
        if not slot.pinned:
            self.window.release(slot, self.streams.record(self.streams.compute))

    def _head(self, k: int, visit: Visit, c: StepState) -> None:
        slot = self._acquire(k)
        unit = self.spec.units[visit.unit]
        slot.grads[: unit.numel].zero_()
        w = slot.weights(unit, trainable=True)
        if self.spec.tie_embeddings:  # the head's gradient is the first to reach the tied embedding
            assert self._tied_slot is not None
            self._tied_slot.grads[: self.spec.embed.numel].zero_()
        lm_weight = self._lm_weight(w, trainable=True)
        c.dx, total = [], torch.zeros((), dtype=torch.float32, device=self.device)
        with torch.enable_grad(), self.timeline.device("head", visit.unit, self.streams.compute):
            for hidden, labels in zip(c.take_x(), c.labels, strict=True):
                x = hidden.detach().requires_grad_(True)
                loss_sum = head_loss(self.spec, w, lm_weight, x, labels, self.kernels, self.loss_chunk)
                (loss_sum / c.labelled).backward()
                total += loss_sum.detach()
                assert x.grad is not None
                c.dx.append(x.grad)
        c.loss_sum = total
        self._finish_unit(visit.unit, slot, c)

    def _backward(self, k: int, visit: Visit, c: StepState) -> None:
        unit = self.spec.units[visit.unit]
        if unit.kind == UnitKind.EMBED:
            self._embed_backward(k, visit, c)
            return
        slot = self._acquire(k)
        slot.grads[: unit.numel].zero_()
        if self.keeps[visit.unit]:
            self._kept_backward(visit, slot, c)
            return
        w = slot.weights(unit, trainable=True)
        micro = len(c.dx)
        for mb in range(micro):
            # Read the next boundary activation back while this one recomputes.
            if mb + 1 < micro:
                self.acts.prefetch((visit.unit, mb + 1))
            elif visit.unit > 1:
                self.acts.prefetch((visit.unit - 1, 0))
            with self.timeline.host("act_load", visit.unit):  # the main thread waiting for the tier's read
                x = self.acts.load((visit.unit, mb)).detach().requires_grad_(True)
            with torch.enable_grad(), self.timeline.device("bwd", visit.unit, self.streams.compute):
                cos, sin = c.rope[mb]
                y = layer_forward(self.spec, w, x, cos, sin, self.kernels)
                torch.autograd.backward(y, c.dx[mb])
            assert x.grad is not None
            c.dx[mb] = x.grad
        self._finish_unit(visit.unit, slot, c)

    def _kept_backward(self, visit: Visit, slot: Slot, c: StepState) -> None:
        """Back-propagate through a keeping layer's graphs, micro-batch by micro-batch, as ``_backward``
        does through its recomputed ones: the weight gradients add up in the cache unit's buffer."""
        micro = len(c.dx)
        leaves = slot.weights(self.spec.units[visit.unit], trainable=True)  # .grad: this slot's buffer
        with self.kept.bound(visit.unit, slot.params, leaves):
            for mb in range(micro):
                if mb + 1 == micro and visit.unit > 1:  # the layer below may recompute: its input, on its way
                    self.acts.prefetch((visit.unit - 1, 0))
                x, y = self.kept.take((visit.unit, mb))
                with torch.enable_grad(), self.timeline.device("bwd", visit.unit, self.streams.compute):
                    torch.autograd.backward(y, c.dx[mb])
                assert x.grad is not None
                c.dx[mb] = x.grad
        self._finish_unit(visit.unit, slot, c)

    def _embed_backward(self, k: int, visit: Visit, c: StepState) -> None:
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
            for ids, dx in zip(c.ids, c.take_dx(), strict=True):
                embed_backward(grad, ids, dx, padding_idx=self.spec.pad_token_id)
        self._finish_unit(0, slot, c)

    # ================================================================== forward only

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """A forward pass with the current weights, no gradients and no update.

        With ``labels`` (B, T): the summed cross-entropy over labelled tokens (a
        scalar, through the fused head: no logits kept). Without: the logits
        (B, T, V) in FP32; meant for checks on small inputs. Data-parallel: every
        rank must make the same forward passes (they gather the weights together).
        """
        if self.collectives is None:
            return self._forward_only(input_ids, labels)
        try:
            return self._forward_only(input_ids, labels)
        except BaseException as exc:
            self.collectives.parallel.report(exc)
            raise

    @torch.no_grad()
    def _forward_only(self, input_ids: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
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

    # ================================================================== state

    def invalidate_device_copies(self) -> None:
        """Masters were replaced (a checkpoint was loaded): no cache unit holds current weights any more."""
        self.wait_updates()
        self.version = [v + 1 for v in self.version]
        self.updated = [None] * len(self.updated)
        self.sync_resident()

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
        """Hugging Face name -> FP32 master view (after all updates). Tied heads appear under both names.

        Data-parallel: the whole masters gathered from every rank's shards (new tensors), on every rank;
        every rank must call it."""
        self.wait_updates()
        out: dict[str, torch.Tensor] = {}
        for unit, master in zip(self.spec.units, self.host.masters, strict=True):
            if self.collectives is not None:  # every rank's shard: a collective, on every rank
                master = self.collectives.gather_master(unit.index, master.cpu())
            master = master.cpu()  # a copy for units resident on the device, the master itself otherwise
            for e in unit.entries:
                out[e.name] = master[e.offset : e.stop].view(e.shape)
        if self.spec.tie_embeddings:
            out["lm_head.weight"] = out["model.embed_tokens.weight"]
        return out

    def close(self) -> None:
        self.kept.clear()
        self.pipeline.close()
        self.acts.close()
        self.host.close()
