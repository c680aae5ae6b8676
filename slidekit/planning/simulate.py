"""The engine's schedule replayed in virtual time: what the step-time model (``slidekit.planning.timing``)
runs its per-unit costs through.

It follows ``slidekit.engine`` decision by decision, with seconds where the
engine has work:

* the main thread takes the visits in order (``slidekit.planning.schedule``); before a visit it
  claims a cache unit (waiting while all are held) and waits for the upload thread to have issued
  the unit's upload, which waits for the unit's last update; then it prefetches the next
  ``prefetch`` visits into free cache units, giving up at the first that finds none;
* uploads run one at a time on the host -> device lane, each after the compute that last read its
  cache unit; a unit still in a cache unit from the forward pass is not uploaded again;
* the compute stream runs the visits one after another, each after its upload (and, for activations
  on a tier, after their read);
* after a unit's backward its gradients come down piece by piece on the device -> host lane, each
  piece into a ring buffer the optimizer has released; the optimizer thread updates the pieces in
  order and releases the buffers; the cache unit is free again when the last piece is down;
* clipping or skipping (``defer``): the gradients come down whole into the unit's own buffer, and
  every update is queued at the end of the step in forward order, under the next forward pass;
* speculative clipping (a deferring step, a unit whose pieces speculate: ``Piece.speculates``): the
  unit's gradients come down piece by piece into its own buffer (no ring buffer to wait for) and one
  taker per unit is queued on the optimizer thread; each taker, when the thread gets to it, takes of
  the units handed on whose first piece is down the one the next forward needs first (the lowest
  index), else the first handed on, and updates it piece by piece as it comes down: backed up while
  the norm is unknown (until the main thread has waited for the backward's end), plainly after. A
  step that clips (``rollback``) leaves a unit taken after the norm is known to the step's end, and
  restores (``Piece.restore_s``: zero out of place) and updates again every unit it backed up, both in
  forward order with
  the deferred updates (``slidekit.engine.speculation``; the early stop, which depends on the
  gradients' norms, is not replayed: every unit taken before the norm is known is backed up);
* the updates in forward order (``takes``, a step that does not defer: ``engine.update_order``): as a
  speculating step's, without backups;
* resident units never move: the device updates them at the end of the step, after the backward;
* a resident unit whose weights slide (``UnitCost.weights_slide``) takes a cache unit for each visit as
  a host unit does, and its weights are cast into it from its device master on the host -> device
  lane, in turn with the uploads (the engine casts on the upload stream: ``Uploads._cast``); it lets
  the cache unit go after its backward and is updated on the device with the resident units;
* the step ends when the device is done; the next starts ``step_overhead_s`` later.

Every interval remembers what it waited for (``Ev.cause``), so a gap on the compute stream is
split among the lanes on its critical path (``exposed``). What it ignores is listed in
``slidekit.planning.timing``. Pure: no devices, no threads. Test: ``pytest tests/test_timing.py``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from slidekit.planning.schedule import FWD, HEAD, Visit, schedule

__all__ = ["Piece", "SimResult", "UnitCost", "simulate"]

#: Activation writes in flight before the forward pass waits for the oldest (``TierActivations``).
ACT_PENDING = 2
#: Steps the replay runs at most, and how close two steps in a row must be to count as steady.
MAX_STEPS = 12
STEADY = 1e-6


@dataclass(frozen=True, slots=True)
class Piece:
    """One range of a unit's gradients on its way down and through the optimizer."""

    down_s: float  # its copy to the host
    update_s: float  # the optimizer's time on it (CPU)
    disk_s: float = 0.0  # its optimizer state read and written back (streamed state)
    backup_s: float = 0.0  # its update takes this longer writing its backup (speculative clipping)
    restore_s: float = 0.0  # its master and state copied back from the backup (a step that clips)
    speculates: bool = False  # its unit speculates in a deferring step (backup_s is 0 out of place)


@dataclass(frozen=True, kw_only=True, slots=True)
class UnitCost:
    """Seconds of one unit's work in a step (``timing.unit_costs`` fills them from the rates)."""

    kind: str  # "embed", "layer" or "head"
    resident: bool
    fwd_s: float = 0.0  # its forward visit on the device, one micro-batch
    bwd_s: float = 0.0  # its backward (the head: its one visit), one micro-batch
    grad_pass_s: float = 0.0  # its gradients zeroed and their norm taken, once a step
    upload_s: float = 0.0  # its FP32 master up into a cache unit
    pieces: tuple[Piece, ...] = ()  # its gradients down and updated on the host
    device_update_s: float = 0.0  # a resident unit's update on the device
    weights_slide: bool = False  # resident, its weights cast into a cache unit for each visit
    cast_s: float = 0.0  # ... one such cast, on the host -> device lane
    act_write_s: float = 0.0  # one micro-batch's boundary activation to its tier (0: on the device)
    act_read_s: float = 0.0  # ... and back
    act_lane: str = "d2h"  # the lane activation traffic shares: "d2h"/"h2d" (a host tier) or "disk"


@dataclass(eq=False, slots=True)
class Ev:
    """An interval [start, end] on some lane, and the interval it waited for before starting."""

    start: float
    end: float
    kind: str
    cause: Ev | None = None


def _later(*evs: Ev | None) -> Ev:
    """The event that ends last (the first of equals): what a task starting after all of them waits for."""
    best: Ev | None = None
    for e in evs:
        if e is not None and (best is None or e.end > best.end):
            best = e
    assert best is not None
    return best


def _after(start: Ev, seconds: float, kind: str) -> Ev:
    return Ev(start.end, start.end + seconds, kind, start)


@dataclass(eq=False, slots=True)
class _Slot:
    unit: int | None = None
    version: int = -1
    users: int = 0
    pinned: bool = False
    last_use: int = 0
    busy: Ev | None = None  # released (host) at its end
    free: Ev | None = None  # its last reader done (device) at its end
    own: bool = False  # a resident unit's own buffers: never shared, never released


@dataclass(frozen=True, kw_only=True, slots=True)
class SimResult:
    """The steady step the simulation settled into."""

    seconds: float  # start to start
    drain_s: float  # from the last step's end until every update is applied
    busy: dict[str, float]  # seconds of work per lane kind in one step
    exposed: dict[str, float]  # seconds the compute stream waited, per kind on the critical path
    steps: tuple[float, ...]  # every simulated step, start to start (the last is ``seconds``)
    takes: tuple[tuple[int, bool], ...] = ()  # speculative clipping, the last step: (unit, backed up), in turn


@dataclass
class _Sim:
    units: Sequence[UnitCost]
    window: int
    prefetch: int
    ring: int
    tied: bool
    defer: bool
    micro: int
    step_overhead_s: float
    rollback: bool = False  # every step clips: speculated units are restored and updated at the end
    takes: bool = False  # a step that does not defer takes the updates in the next forward's order
    visits: tuple[Visit, ...] = ()
    slots: list[_Slot] = field(default_factory=list)
    own: dict[int, _Slot] = field(default_factory=dict)  # resident units' own buffers
    version: list[int] = field(default_factory=list)
    updated: list[Ev | None] = field(default_factory=list)
    lanes: dict[str, Ev] = field(default_factory=dict)  # the last interval of each lane
    ring_free: list[Ev] = field(default_factory=list)  # per piece ever handed over: its buffer's release
    clock: int = 0
    segments: list[tuple[float, float, str]] = field(default_factory=list)  # compute and explained gaps
    busy: dict[str, float] = field(default_factory=dict)
    main: Ev = field(default_factory=lambda: Ev(0.0, 0.0, "host"))
    tied_slot: _Slot | None = None

    def __post_init__(self) -> None:
        self.visits = schedule(len(self.units) - 2, self.tied)
        self.slots = [_Slot() for _ in range(self.window)]
        self.version = [0] * len(self.units)
        self.updated = [None] * len(self.units)
        zero = Ev(0.0, 0.0, "host")
        self.lanes = {k: zero for k in ("gpu", "h2d", "h2d_host", "d2h", "optim", "disk")}
        self.own = {
            u: _Slot(unit=u, pinned=True, own=True)
            for u, c in enumerate(self.units)
            if c.resident and not c.weights_slide
        }

    # ---------------------------------------------------------------- lanes

    def _run(self, lane: str, seconds: float, kind: str, *deps: Ev | None) -> Ev:
        ev = _after(_later(self.lanes[lane], *deps), seconds, kind)
        self.lanes[lane] = ev
        self.busy[kind] = self.busy.get(kind, 0.0) + seconds
        return ev

    def _wait(self, ev: Ev | None) -> None:
        self.main = _later(self.main, ev)

    def _compute(self, seconds: float, *deps: Ev | None) -> Ev:
        start = _later(self.lanes["gpu"], self.main, *deps)
        self._explain(start, self.lanes["gpu"].end)
        ev = self._run("gpu", seconds, "compute", start)
        self.segments.append((ev.start, ev.end, "compute"))
        return ev

    def _explain(self, ev: Ev | None, floor: float) -> None:
        """Split the compute stream's idle time (floor, ev.end] along ev's chain of causes."""
        t = ev.end if ev is not None else floor
        while ev is not None and t > floor:
            a = max(ev.start, floor)
            if t > a:
                self.segments.append((a, t, "host" if ev.kind == "compute" else ev.kind))
            t, ev = a, ev.cause
        if t > floor:
            self.segments.append((floor, t, "host"))

    # ---------------------------------------------------------------- the window

    def _touch(self, slot: _Slot) -> None:
        self.clock += 1
        slot.last_use = self.clock

    def _free_now(self) -> list[_Slot]:
        now = self.main.end
        return [
            s for s in self.slots if not s.users and not s.pinned and (s.busy is None or s.busy.end <= now)
        ]

    def _claim(self, unit: int, wait: bool) -> _Slot | None:
        free = self._free_now()
        if not free and wait:
            pending = [s for s in self.slots if not s.users and not s.pinned]
            if not pending:
                raise RuntimeError("the simulated window deadlocked: every cache unit is held")
            self._wait(min(pending, key=lambda s: s.busy.end if s.busy else 0.0).busy)
            free = self._free_now()
        if not free:
            return None
        slot = min(free, key=lambda s: s.last_use)
        slot.unit, slot.version, slot.users = unit, self.version[unit] if unit >= 0 else -1, 1
        self._touch(slot)
        return slot

    def _release(self, slot: _Slot, host: Ev, device: Ev) -> None:
        if slot.own:
            return
        slot.users -= 1
        slot.busy, slot.free = host, device

    def _request(self, k: int, loads: dict[int, tuple[_Slot, Ev | None, Ev | None]], wait: bool) -> bool:
        if k >= len(self.visits) or k in loads:
            return True
        visit = self.visits[k]
        if not visit.needs_params:
            return True
        u = visit.unit
        if u in self.own:
            loads[k] = (self.own[u], None, None)
            return True
        if u == 0 and self.tied and self.tied_slot is not None:
            loads[k] = (self.tied_slot, None, None)
            return True
        slot = next((s for s in self.slots if s.unit == u and s.version == self.version[u]), None)
        host = device = None
        if slot is not None:
            slot.users += 1
            self._touch(slot)
        else:
            slot = self._claim(u, wait)
            if slot is None:
                return False
            host = _later(self.lanes["h2d_host"], self.main, self.updated[u])
            self.lanes["h2d_host"] = host
            cost = self.units[u]
            if cost.weights_slide:
                device = self._run("h2d", cost.cast_s, "cast", host, slot.free)
            else:
                device = self._run("h2d", cost.upload_s, "upload", host, slot.free)
        if u == 0 and self.tied:
            slot.pinned = True
            self.tied_slot = slot
        loads[k] = (slot, host, device)
        return True

    def _acquire(
        self, k: int, loads: dict[int, tuple[_Slot, Ev | None, Ev | None]]
    ) -> tuple[_Slot, Ev | None]:
        self._request(k, loads, wait=True)
        slot, host, device = loads.pop(k)
        self._wait(host)
        for j in range(k + 1, k + 1 + self.prefetch):
            if not self._request(j, loads, wait=False):
                break
        return slot, device

    # ---------------------------------------------------------------- gradients and updates

    def _update(self, cost: Piece, *deps: Ev | None) -> Ev:
        start = _later(self.lanes["optim"], *deps)
        if cost.disk_s:
            disk = self._run("disk", cost.disk_s, "disk", start)
            if disk.end > start.end + cost.update_s:
                self.busy["host update"] = self.busy.get("host update", 0.0) + cost.update_s
                self.lanes["optim"] = disk
                return disk
        return self._run("optim", cost.update_s, "host update", start)

    def _finish(self, u: int, slot: _Slot, computed: Ev, c: _Step) -> None:
        """After a unit's backward (``Updates._finish_unit``): its gradients down, its update queued."""
        cost = self.units[u]
        if cost.resident:
            c.resident_due.append(u)
            if cost.weights_slide:  # its gradients kept on the device; its cache unit let go, stale
                self.version[u] += 1
                self._release(slot, computed, computed)
            return
        self.version[u] += 1
        if (self.defer and any(p.speculates for p in cost.pieces)) or (self.takes and not self.defer):
            down = self._speculate(u, cost, computed, c)
        elif self.defer:  # whole into its own buffer; updated at the end of the step
            down = self._run("d2h", sum(p.down_s for p in cost.pieces), "grad copy", self.main, computed)
            c.deferred[u] = down
        else:
            for piece in cost.pieces:
                q = len(self.ring_free)
                buffer = self.ring_free[q - self.ring] if q >= self.ring else None
                down = self._run("d2h", piece.down_s, "grad copy", self.main, computed, buffer)
                update = self._update(piece, down, self.main)
                self.updated[u] = update
                self.ring_free.append(update)  # its ring buffer is free again once it is applied
        self._release(slot, down, down)

    def _speculate(self, u: int, cost: UnitCost, computed: Ev, c: _Step) -> Ev:
        """Speculative clipping, or the updates in forward order (module docstring): each piece down into
        the unit's own buffer; the unit handed on to the optimizer thread, whose takers ``_take_all``
        replays once the step's downloads are all known."""
        downs = [self._run("d2h", p.down_s, "grad copy", self.main, computed) for p in cost.pieces]
        c.waiting[u] = (self.main, downs)
        return downs[-1] if downs else computed

    def _take_all(self, c: _Step, known: Ev) -> None:
        """The optimizer thread's takers of a speculating step, one per unit handed on, in turn: each
        takes, of the units handed on by the time the thread is free whose first piece is down, the one
        with the lowest index, else the first handed on, and updates it as its pieces come down: with its
        backup if it starts before ``known`` (the main thread has the norm), plainly after; with
        ``rollback`` one taken after that is left to the step's end (``c.deferred``)."""
        while c.waiting:
            free = self.lanes["optim"]
            handed = [u for u, (sub, _) in c.waiting.items() if sub.end <= free.end]
            if not handed:
                handed = [next(iter(c.waiting))]  # the thread idles until the next is handed on
            arrived = [u for u in handed if c.waiting[u][1][0].end <= free.end]
            u = min(arrived) if arrived else handed[0]
            sub, downs = c.waiting.pop(u)
            start = _later(free, sub, downs[0])
            backed = self.defer and start.end < known.end  # the forward order (``takes``) never backs up
            if not backed and self.rollback:
                c.takes.append((u, False))
                c.deferred[u] = downs[-1]
                continue
            c.takes.append((u, backed))
            if backed:
                c.backed.add(u)
            for piece, down in zip(self.units[u].pieces, downs, strict=True):
                cost = Piece(0.0, piece.update_s + (piece.backup_s if backed else 0.0), piece.disk_s)
                self.updated[u] = self._update(cost, down, sub)
            if backed and self.rollback:
                c.deferred[u] = downs[-1]

    # ---------------------------------------------------------------- one step

    def step(self) -> tuple[Ev, Ev, _Step]:
        """One training step (``Engine.train_step``); returns its start, its end and what it kept."""
        start = _after(self.main, self.step_overhead_s, "host")
        self.busy["host"] = self.busy.get("host", 0.0) + self.step_overhead_s
        self.main = start
        c = _Step()
        self._request(0, c.loads, wait=True)
        for k, visit in enumerate(self.visits):
            if visit.phase == FWD:
                self._forward(k, visit.unit, c)
            elif visit.phase == HEAD:
                slot, device = self._acquire(k, c.loads)
                cost = self.units[visit.unit]
                done = self._compute(self.micro * cost.bwd_s + cost.grad_pass_s, device)
                self._finish(visit.unit, slot, done, c)
            elif self.units[visit.unit].kind == "embed":
                self._embed_backward(k, c)
            else:
                self._backward(k, visit.unit, c)
        self._wait(self.lanes["gpu"])  # the loss: the device's queue is done
        self._take_all(c, self.main)  # the norm is known from here (Speculation._norm_known)
        if c.resident_due:
            self._compute(sum(self.units[u].device_update_s for u in c.resident_due))
        for u in sorted(c.deferred):  # in the order the next forward pass needs them
            pieces = self.units[u].pieces
            restore = sum(p.restore_s for p in pieces) if u in c.backed else 0.0  # rolled back
            whole = Piece(0.0, sum(p.update_s for p in pieces) + restore, sum(p.disk_s for p in pieces))
            self.updated[u] = self._update(whole, c.deferred[u], self.main)
        self._wait(self.lanes["gpu"])  # Timeline.finish: the step's device work, resident updates too
        return start, self.main, c

    def _forward(self, k: int, u: int, c: _Step) -> None:
        slot, device = self._acquire(k, c.loads)
        cost = self.units[u]
        done = device
        for mb in range(self.micro):
            if cost.kind == "layer" and cost.act_write_s:  # its input, to the tier (TierActivations.save)
                lane = "disk" if cost.act_lane == "disk" else "d2h"
                write = self._run(lane, cost.act_write_s, "activations", self.main, self.lanes["gpu"])
                c.writes[(u, mb)] = write
                c.pending.append(write)
                while c.pending and (c.pending[0].end <= self.main.end or len(c.pending) > ACT_PENDING):
                    self._wait(c.pending.popleft())
            done = self._compute(cost.fwd_s, device)
        assert done is not None
        if not slot.pinned:
            self._release(slot, self.main, done)

    def _backward(self, k: int, u: int, c: _Step) -> None:
        slot, device = self._acquire(k, c.loads)
        cost = self.units[u]
        done = device
        for mb in range(self.micro):
            if cost.act_read_s:  # the next one is asked for first, then this one if not yet
                for key in ((u, mb + 1) if mb + 1 < self.micro else (u - 1, 0), (u, mb)):
                    if key not in c.reads and key in c.writes:
                        lane = "disk" if cost.act_lane == "disk" else "h2d"
                        c.reads[key] = self._run(
                            lane, cost.act_read_s, "activations", self.main, c.writes[key]
                        )
                self._wait(c.reads[(u, mb)])
            done = self._compute(cost.bwd_s + (cost.grad_pass_s if mb == 0 else 0.0), device)
        assert done is not None
        self._finish(u, slot, done, c)

    def _embed_backward(self, k: int, c: _Step) -> None:
        if self.tied and self.tied_slot is not None:  # pinned since the forward; let go now
            slot = self.tied_slot
            c.loads.pop(k, None)
            slot.pinned, self.tied_slot = False, None
        elif 0 in self.own:
            slot = self.own[0]
        else:  # only a gradient buffer is needed: a cache unit, no upload
            claimed = self._claim(-1, wait=True)
            assert claimed is not None
            slot, slot.unit = claimed, None
        cost = self.units[0]
        done = self._compute(self.micro * cost.bwd_s + cost.grad_pass_s)
        self._finish(0, slot, done, c)


@dataclass
class _Step:
    """What one step keeps track of beside the run's state."""

    loads: dict[int, tuple[_Slot, Ev | None, Ev | None]] = field(default_factory=dict)
    resident_due: list[int] = field(default_factory=list)  # resident units, updated at the end
    deferred: dict[int, Ev] = field(default_factory=dict)  # unit -> its gradients' download (clipping)
    # speculative clipping: unit -> (when it was handed on, its pieces' downloads), until a taker takes it
    waiting: dict[int, tuple[Ev, list[Ev]]] = field(default_factory=dict)
    backed: set[int] = field(default_factory=set)  # the units taken before the norm was known
    takes: list[tuple[int, bool]] = field(default_factory=list)  # (unit, backed up), in the takers' order
    writes: dict[tuple[int, int], Ev] = field(default_factory=dict)  # (unit, micro-batch) -> activation out
    reads: dict[tuple[int, int], Ev] = field(default_factory=dict)  # ... and back in
    pending: deque[Ev] = field(default_factory=deque)  # activation writes not yet retired


def simulate(
    units: Sequence[UnitCost],
    *,
    window: int,
    prefetch: int,
    ring: int,
    tied: bool,
    defer: bool,
    micro: int,
    step_overhead_s: float,
    max_steps: int = MAX_STEPS,
    rollback: bool = False,
    takes: bool = False,
) -> SimResult:
    """Replay steps until two in a row take the same time (at most ``max_steps``) and report the last:
    its period, the drain after it, and its parts. ``rollback``: every step clips, so the units that
    speculated (pieces that ``speculates``) are restored and updated again at its end (module docstring).
    ``takes``: a step that does not defer keeps each unit's gradients in its own buffer and takes the
    updates in the next forward's order, as a speculating step does (``engine.update_order="forward"``)."""
    if max_steps < 3:
        raise ValueError(f"the steady step needs at least 3 simulated steps, got {max_steps}")
    sim = _Sim(units, window, prefetch, max(ring, 1), tied, defer, micro, step_overhead_s, rollback, takes)
    periods: list[float] = []
    busy: dict[str, float] = {}
    while True:
        sim.busy = {}
        segments = len(sim.segments)
        start, end, last = sim.step()
        busy = sim.busy
        periods.append(end.end + step_overhead_s - start.end)  # the next step starts then
        if len(periods) >= max_steps or (
            len(periods) >= 3 and abs(periods[-1] - periods[-2]) <= STEADY * periods[-1]
        ):
            break
    window_ = (start.end, end.end + step_overhead_s)
    # The gaps of the last step: the first visit's wait and the tail after its last compute included.
    sim._explain(_after(end, step_overhead_s, "host"), sim.lanes["gpu"].end)
    exposed: dict[str, float] = {}
    for a, b, kind in sim.segments[segments:]:
        lo, hi = max(a, window_[0]), min(b, window_[1])
        if hi > lo and kind != "compute":
            exposed[kind] = exposed.get(kind, 0.0) + hi - lo
    done = max([e.end for e in sim.updated if e is not None] + [sim.lanes["optim"].end])
    return SimResult(
        seconds=periods[-1],
        drain_s=max(0.0, done - end.end),
        busy=busy,
        exposed=exposed,
        steps=tuple(periods),
        takes=tuple(last.takes),
    )
