"""Speculative clipping: exact global-norm clipping whose host updates still overlap the backward pass.

A step that clips by the global norm (``max_grad_norm``), or skips a
non-finite step, must see every gradient before any parameter changes. The
deferred path (``Updates._apply_deferred``) therefore queues every update at
the end of the step, so they overlap only the next forward pass. Most steps of
a fine-tune do not clip, so this module bets that the step will not:

* during the backward, each sliding unit whose master and optimizer state are
  in host RAM (``HostStore.can_back_up``) is updated with scale 1, as in the
  unclipped path, piece by piece as its gradient arrives, and its master
  and state as they were go to the unit's backup (``HostStore.backup``). The
  optimizer thread takes the waiting units not oldest first but, of those whose
  gradients have come down, the one the next forward needs first: the backup
  makes each update slower than the backward's pace, and what is still waiting
  when the backward ends then overlaps the next forward instead of holding up
  its first upload (NOTES.md 31). Once the main thread knows the norm
  (``_norm_known``), a unit not yet taken needs no backup: with scale 1.0 it is
  updated plainly, otherwise it is left to the step's end. An
  optimizer that declares ``fused_backup`` (``FusedBackupOptimizer``: both
  bundled ones) writes the backup itself, in the update's own pass, given the
  backup's slices as ``backup_out``: one call per piece. For any other, right
  before each chunk of ``BACKUP_CHUNK`` parameters is updated, the optimizer
  thread copies that chunk's master and state into the backup, so the bytes
  the update then reads are hot in cache (``update_backed``). An optimizer that
  declares ``fused_update_out`` (the three bundled ones) updates *out of place*
  instead: the new master and state go into the unit's second buffers
  (``HostStore.backup``) and the old ones stay where they are, so the pass moves
  no more bytes than an update in place. The unit is then done only once the
  bet is settled: a taker that finishes after the norm is known swaps the new
  buffers in itself when the bet won (``_swap_or_hold``), one that finishes
  before leaves that to the main thread at the step's end (``StepState.held``,
  ``_release_held``), and no upload reads the unit's master until then. The
  gradient stays in the unit's own buffer (``HostStore.unit_grad``), as the
  deferred path keeps it;
* at the end of the step, when the global norm is known: with scale exactly
  1.0 and a finite norm the bet was right and the speculated units are done;
  the others (streamed state, units the bet stopped for) get their deferred
  update as today. Otherwise the step *rolls back*: per unit, in the order
  the next forward needs them, the optimizer thread restores master and state
  from the backup (out of place: they were never written, only the upload copy
  is cast again) and applies today's deferred update with the clip scale, so
  every bit equals the deferred path's. The unit's version is bumped, so no
  cache unit uploaded from a speculated master is taken as current, and the
  next forward's upload of the unit waits for that restore-and-update. A
  non-finite step restores and then skips (or raises ``NonFiniteError``,
  nothing updated);
* early stop: the squared norm only grows as units finish. Once the sum seen
  so far makes clipping certain (or is not finite), the remaining units of the
  step are not speculated, which saves their backup and restore.

Exactness does not depend on the bet: the chunked update equals the whole-unit
one bit for bit (the optimizer's state is linear, ``UnitOptimizer.linear_state``,
which the streamed and piecewise paths rely on too), and a rolled-back unit is
put back byte for byte before the exact update. The early stop only chooses
which units speculate.

The trade-off (``OptimConfig.clip_overlap``): "speculate" holds a backup of
4 B/param (master) plus the optimizer's state bytes (8 for layer_adam, 2 for
adamw_8bit) for every backed-up unit, in host RAM, and costs writing those
bytes per update, in the update's pass with ``fused_backup``, else a copy
(``benchmarks/clip_backup.py`` measures both, docs/benchmarks/NOTES.md 15 and
23); out of place (``fused_update_out``) the same memory (its master page-locked)
and no more bytes per update than an update in place (NOTES.md 36). A step that
clips pays a restore (none out of place) and the whole deferred update at its
end, more than the deferred path. "defer" is the deferred path. "auto" speculates where the
planner found host RAM for the backups and, on a GPU with known rates, where
the step-time model predicts a speculating step faster than a deferring one
(``slidekit.planning.clip_overlap.overlap_layout``); with an optimizer that updates
in place, not on the step right after a step that clipped or was not finite:
clipping tends to persist, and deferring then costs no rollback. Out of place a
lost bet restores nothing and costs what deferring costs (NOTES.md 36: 1.01x the
deferred step at 3B batch 32 when every step clipped), so "auto" speculates on
every step.

Data-parallel: each rank speculates on its own shards; the rollback decision
depends only on the global norm, so every rank takes the same one.

Test: ``pytest tests/engine/test_speculative_clip.py``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any, cast

import torch

from slidekit.capabilities import fuses_backup, updates_out_of_place
from slidekit.engine.state import slice_groups
from slidekit.engine.step_state import StepState
from slidekit.engine.updates import Updates
from slidekit.engine.window import Slot
from slidekit.interfaces import FusedBackupOptimizer, ParamGroupRange, UnitOptimizer
from slidekit.planning.layout import Layout
from slidekit.planning.placement import GRANULE

__all__ = ["BACKUP_CHUNK", "CERTAIN", "Speculation", "decide", "update_backed"]

#: Parameters backed up and then updated in one go: a multiple of GRANULE (so chunks of linear state
#: start where their state does), small enough that much of the backed-up bytes (12 MiB with layer_adam)
#: are still in cache for the update, large enough that each optimizer call's fixed cost (its threads'
#: start) stays small: on the 2-core test machine 1 M beat 64 K (benchmarks/clip_backup.py, NOTES.md 15).
BACKUP_CHUNK = 256 * GRANULE
#: The early stop declares clipping certain once the norm seen so far exceeds max_grad_norm by this
#: share: the host's sum of the units' FP32 squared norms differs from the device's by rounding only.
CERTAIN = 1e-4


def decide(policy: str, *, defer: bool, backed_up: bool, clipped_last: bool, out_of_place: bool = False) -> bool:
    """Whether a step speculates: it must defer (clipping, skipping non-finite steps); "speculate" always
    does, "defer" never, "auto" where the layout has backups and either the optimizer updates out of place
    (``out_of_place``: a lost bet restores nothing, so it costs what deferring costs; NOTES.md 36 measured
    1.01x) or the previous step did not clip (clipping tends to persist, and a rollback in place restores
    every speculated unit)."""
    if not defer or policy == "defer":
        return False
    if policy == "speculate":
        return True
    return backed_up and (out_of_place or not clipped_last)


Span = Callable[[int, int], Mapping[str, tuple[torch.dtype, int, int]]]


def _relative_span(
    span: Callable[..., Mapping[str, tuple[torch.dtype, int, int]]], unit: int, base: int, lo: int, hi: int
) -> dict[str, tuple[torch.dtype, int, int]]:
    """The state span of parameters [base + lo, base + hi) of ``unit``, relative to the state of ``base``."""
    first = span(unit, base, base + 1)
    return {
        name: (dt, at - first[name][1], n) for name, (dt, at, n) in span(unit, base + lo, base + hi).items()
    }


def update_backed(
    optimizer: UnitOptimizer,
    master: torch.Tensor,
    grad: torch.Tensor,
    state: Mapping[str, torch.Tensor],
    saved_master: torch.Tensor,
    saved_state: Mapping[str, torch.Tensor],
    *,
    lr: float,
    count: int,
    groups: Sequence[ParamGroupRange],
    span: Span | None,
    chunk: int = BACKUP_CHUNK,
    lowp_out: torch.Tensor | None = None,
    out_of_place: bool = False,
) -> None:
    """Back up and update one range of a unit with scale 1: ``saved_*`` receive its master and state as
    they were. An optimizer with ``fused_backup`` gets them as ``backup_out`` and writes them in its update's
    pass, the range in one call. Any other is called ``chunk`` parameters at a time, each chunk's master and
    state copied to ``saved_*`` right before the optimizer reads them (so it reads them from cache).
    ``out_of_place`` (an optimizer with ``fused_update_out``): ``saved_*`` receive the *updated* master and
    state instead (``update_out``), ``master`` and ``state`` stay as they were.
    ``span(lo, hi)``: name -> (dtype, first, count) of the state of parameters [lo, hi) of the range, for
    linear state; None (state that is not linear): the range in one go. ``lowp_out``: the range's upload
    copy, written with the update (not backed up: ``HostStore.restore`` casts it again from the restored
    master). Either way the same bits."""
    if out_of_place and not updates_out_of_place(optimizer):
        raise ValueError(
            f"optimizer {getattr(optimizer, 'name', type(optimizer).__name__)!r} does not declare "
            "fused_update_out: it cannot update out of place; back it up in place (out_of_place=False)"
        )
    if out_of_place or fuses_backup(optimizer):  # the optimizer writes the second buffers in its pass
        buffers = {"master": saved_master, **{k: saved_state[k][: t.numel()] for k, t in state.items()}}
        cast(FusedBackupOptimizer, optimizer).step(
            master,
            grad,
            state,
            lr=lr,
            count=count,
            groups=groups,
            lowp_out=lowp_out,
            **{"update_out" if out_of_place else "backup_out": buffers},
        )
        return
    n = master.numel()
    cuts = [(0, n)] if span is None else [(lo, min(lo + chunk, n)) for lo in range(0, n, chunk)]
    for lo, hi in cuts:
        where = (
            {name: (0, t.numel()) for name, t in state.items()}
            if span is None
            else {name: (at, m) for name, (_, at, m) in span(lo, hi).items()}
        )
        sub = {name: state[name][at : at + m] for name, (at, m) in where.items()}
        for name, (at, m) in where.items():
            saved_state[name][at : at + m].copy_(sub[name])
        saved_master[lo:hi].copy_(master[lo:hi])
        optimizer.step(
            master[lo:hi],
            grad[lo:hi],
            sub,
            lr=lr,
            count=count,
            groups=slice_groups(groups, lo, hi),
            lowp_out=None if lowp_out is None else lowp_out[lo:hi],
        )


class Speculation(Updates):
    """``Updates`` with speculative clipping (the base of ``Engine``): overrides how a deferring step
    handles a unit's gradients (``_defer_unit``), queues its end-of-step updates (``_queue_update``) and
    drops a non-finite step (``_drop_deferred``)."""

    clip_overlap: str  # this step's policy (``OptimConfig.clip_overlap``), set by ``Engine.train_step``
    layout: Layout  # the run's layout (``Engine``): ``forward_updates`` hands every unit to the takers

    def _defer_unit(
        self, unit: int, slot: Slot, done: Any, unit_sq: torch.Tensor | None, c: StepState
    ) -> None:
        if self._speculates(unit, c):
            self._speculate_unit(unit, slot, done, unit_sq, c)
        else:
            super()._defer_unit(unit, slot, done, unit_sq, c)

    def _norm_known(self, c: StepState, scale: float | None) -> None:
        """Main thread, at the step's end: tell the optimizer thread the clip factor (None: not finite).
        A unit it takes from now on needs no backup: with scale 1.0 it is updated plainly (the bet won, the
        same bits), otherwise left to the step's end, like a halted one. After this no unit can halt, so
        ``halted_units`` is final when ``_queue_update`` reads it."""
        with c.lock:
            c.known, c.known_scale = True, scale

    def _queue_update(self, unit: int, download: Future[float], c: StepState, scale: float) -> None:
        """At the step's end (finite): a unit the bet updates (or updated) is done when its taker is
        (``bet_done``), whichever order the optimizer thread takes the units in; a halted one, or every one
        of a step that rolls back, gets its exact update queued after every taker (``_settle``). A
        rolled-back unit's version moves on: no cache unit holding weights uploaded from its speculated
        master is current, and its next upload waits for the restore and the exact update."""
        if unit not in c.speculative:
            super()._queue_update(unit, download, c, scale)
            return
        self._release_held(unit, c)
        if not c.rolled_back and unit not in c.halted_units:
            self.updated[unit] = c.bet_done[unit]
            return
        if c.rolled_back:
            self.version[unit] += 1
        self.updated[unit] = self.pipeline.submit(
            "optim", self._settle, unit, download, c, self.updates_applied + 1, scale, unit=unit
        )

    def _release_held(self, unit: int, c: StepState) -> None:
        """Main thread, the norm known: a unit updated out of place before it was (``StepState.held``) gets
        its new master and state swapped in if the bet won, and its ``bet_done``. The optimizer thread is
        done with it, and no upload reads it before ``bet_done``."""
        with c.lock:
            held = unit in c.held
            c.held.discard(unit)
        if held:
            if not c.rolled_back:
                self.host.swap_backup(unit)
            c.bet_done[unit].set_result(None)

    def _drop_deferred(self, c: StepState) -> None:
        """A non-finite step: restore the speculated units, wait for the other downloads, apply nothing."""
        c.rolled_back = bool(c.speculative)
        for unit in sorted(c.speculative):
            self._release_held(unit, c)  # nothing swapped in: the old master and state stay
        for unit, download in c.take_deferred().items():
            if unit not in c.speculative:
                self.pipeline.result(download, f"the gradient download of unit {unit}")
                continue
            self.version[unit] += 1
            fut = self.updated[unit] = self.pipeline.submit(
                "optim", self._settle, unit, download, c, 0, None, unit=unit
            )
            self.pipeline.result(fut, f"restoring unit {unit} from its backup")

    def _speculates(self, unit: int, c: StepState) -> bool:
        """Whether ``unit`` is updated during the backward: the step speculates, the optimizer thread has
        not stopped it (read without a lock: a late stop only defers a unit more), and the unit can be."""
        if not c.speculate or c.halted_units or not self.host.can_back_up(unit):
            return False
        return self.host.has_backup(unit) or self.clip_overlap == "speculate"

    def _arrive(self, unit: int, slot: Slot, done: Any, unit_sq: torch.Tensor | None, c: StepState) -> None:
        """A step that does not defer: with ``Layout.forward_updates`` (``engine.update_order="forward"``)
        the unit is handed on to the takers (``_hand_on``), which update it plainly in the next forward's
        order; otherwise through the ring as it arrives."""
        if self.layout.forward_updates:
            self._hand_on(unit, slot, done, unit_sq, c)
        else:
            super()._arrive(unit, slot, done, unit_sq, c)

    def _speculate_unit(
        self, unit: int, slot: Slot, done: Any, unit_sq: torch.Tensor | None, c: StepState
    ) -> None:
        """Main thread: the unit handed on to the takers (``_hand_on``), which update it as if unclipped;
        the end of the step settles it (``_apply_deferred``)."""
        c.speculative.add(unit)
        c.deferred[unit] = self._hand_on(unit, slot, done, unit_sq, c)

    def _hand_on(
        self, unit: int, slot: Slot, done: Any, unit_sq: torch.Tensor | None, c: StepState
    ) -> Future[float]:
        """Main thread: the gradients into the unit's own buffer piece by piece, each handed on; the unit
        joins the step's waiting units and one more taker is queued on the optimizer thread
        (``_take_and_update``), which updates some waiting unit. Returns the download."""
        handoff: list[Future[tuple[int, float]]] = [
            self.pipeline.promise("d2h", unit) for _ in self.host.pieces(unit)
        ]
        download = self.pipeline.submit(
            "d2h", self._download, unit, slot, done, unit_sq, handoff, True, unit=unit
        )
        if self.collectives is not None:
            c.shard_sq[unit] = download
        self.updated[unit] = c.bet_done[unit] = self.pipeline.promise("optim", unit)
        with c.lock:
            c.waiting[unit] = handoff
        self.pipeline.submit("optim", self._take_and_update, c, self.updates_applied + 1, unit=unit)
        return download

    def _take(self, c: StepState) -> tuple[int, list[Future[tuple[int, float]]]]:
        """Optimizer thread: the waiting unit to update next. Of those whose first piece has come down, the
        one the next forward needs first (the lowest index): when the updates fall behind the backward,
        what is left at its end are the units the forward needs last, and they overlap it instead of
        holding up its first upload. When none has come down, the first handed on (it comes down first).
        Each taker takes one unit and each unit queued one taker, so one is always waiting."""
        with c.lock:
            arrived = [u for u, handoff in c.waiting.items() if handoff[0].done()]
            unit = min(arrived) if arrived else next(iter(c.waiting))
            return unit, c.waiting.pop(unit)

    def _take_and_update(self, c: StepState, count: int) -> None:
        """Optimizer thread: take a waiting unit (``_take``), update it (``_speculate``), and complete its
        ``bet_done``, also when that fails (the failure is the pipeline's, so every waiter raises it)."""
        unit, handoff = self._take(c)
        done = c.bet_done[unit]
        try:
            self._speculate(unit, handoff, c, count)
            held = self._swap_or_hold(unit, c)
        except BaseException as exc:
            done.set_exception(exc)
            raise
        if not held:
            done.set_result(None)

    def _swap_or_hold(self, unit: int, c: StepState) -> bool:
        """Optimizer thread, after ``unit``'s update: one made out of place (``HostStore.out_of_place``) is
        settled here if the norm is known (its new master and state swapped in if the bet won; if it lost,
        the old ones are where they were and the step's end redoes the update), else held for the main
        thread (``_release_held``). True when held: ``bet_done`` then waits for the main thread."""
        if not (self.host.out_of_place and unit in c.speculated):
            return False
        with c.lock:
            if not c.known:
                c.held.add(unit)
                return True
            won = c.known_scale == 1.0
        if won:
            self.host.swap_backup(unit)
        return False

    def _speculate(
        self, unit: int, handoff: list[Future[tuple[int, float]]], c: StepState, count: int
    ) -> None:
        """Optimizer thread: update ``unit`` with scale 1, piece by piece as it arrives: backed up while the
        norm is unknown, plainly once it is known and nothing clips; not at all (the step's end updates it)
        when clipping is certain, known, or the norm is not finite. In a step that does not defer (the
        updates in forward order) plainly, as the ring path does (``Updates._update``)."""
        what = f"the gradient download of unit {unit}"
        _, sq = self.pipeline.result(handoff[0], what)  # the unit's squared norm comes with its first piece
        if c.defer:
            backed = self._bet_on(unit, c, sq)
            if backed is None:
                return
        else:  # the updates in forward order: plain, and never applied from gradients that are not finite
            self._check_finite(unit, sq)
            backed = False
        self._wait_checkpoint(unit)
        if backed:
            c.speculated.add(unit)
        grad = self.host.unit_grad(unit)
        for k, (a, b) in enumerate(self.host.pieces(unit)):
            if k:
                self.pipeline.result(handoff[k], what)
            with self.timeline.host("update", unit):
                if backed:
                    self._apply_backed(unit, grad[a:b], lr=c.lr, count=count, start=a, stop=b)
                else:
                    copy = self.host.copy_slice(unit, a, b)
                    self._apply(
                        unit, grad[a:b], lr=c.lr, count=count, scale=1.0, lowp_out=copy, start=a, stop=b
                    )

    def _bet_on(self, unit: int, c: StepState, sq: float) -> bool | None:
        """Optimizer thread, as it starts ``unit``: True, update it backed up (the norm is unknown and the
        bet stands); False, plainly (the norm is known and nothing clips); None, leave it to the step's end
        (clipping or a non-finite norm known or certain). Decided under the step's lock, so that once the
        main thread has said the norm is known (``_norm_known``) no unit halts any more."""
        with c.lock:
            if c.known:
                return False if c.known_scale == 1.0 else None
            if self._still_betting(c, sq):
                return True
            c.halted_units.add(unit)
            return None

    def _still_betting(self, c: StepState, sq: float) -> bool:
        """Optimizer thread: add a unit's squared norm; False (for this unit and the rest of the step) once
        the sum makes clipping certain or is not finite. Data-parallel: the rank's shards, a lower bound."""
        if c.halted_units:
            return False
        c.seen_sq += sq
        return math.isfinite(c.seen_sq) and (
            c.clip is None or math.sqrt(c.seen_sq) + 1e-6 <= c.clip * (1 + CERTAIN)
        )

    def _apply_backed(
        self, unit: int, grad: torch.Tensor, *, lr: float, count: int, start: int, stop: int
    ) -> None:
        """``_apply`` with scale 1 over parameters [start, stop), their master and state backed up first
        (``update_backed``: by the optimizer in its pass, or chunk by chunk right before it reads them)."""
        master, groups = self.host.masters[unit], self.groups[unit]
        saved_master, saved_state = self.host.backup(unit)
        store = self.host.state
        copy = self.host.copy_slice(unit)  # the upload copy (engine.upload_copy), written with the update

        def step(a: int, b: int, state: Mapping[str, torch.Tensor]) -> None:
            update_backed(
                self.optimizer,
                master[a:b],
                grad[a - start : b - start],
                state,
                saved_master[a:b],
                {name: saved_state[name][at : at + n] for name, (_, at, n) in store.span(unit, a, b).items()},
                lr=lr,
                count=count,
                groups=slice_groups(groups, a, b),
                span=functools.partial(_relative_span, store.span, unit, a) if store.linear else None,
                lowp_out=None if copy is None else copy[a:b],
                out_of_place=self.host.out_of_place,
            )

        store.update(unit, step, start, stop)

    def _settle(
        self: Updates,
        unit: int,
        download: Future[float],
        c: StepState,
        count: int,
        scale: float | None,
    ) -> None:
        """Optimizer thread, at the step's end: a speculated unit is done unless the step rolls back; then
        (or when it was not speculated) restore it and apply the deferred update with ``scale`` exactly as
        the deferred path does; ``scale`` None (a non-finite step): restore only."""
        speculated = unit in c.speculated  # the unit's ``_speculate`` ran before this, on this thread
        if speculated and not c.rolled_back:
            return
        if speculated:
            with self.timeline.host("restore", unit):
                self.host.restore(unit)
        if scale is None:
            self.pipeline.result(download, f"the gradient download of unit {unit}")
            return
        self._update(unit, download, None, c.lr, count, scale)
