"""The step-time model: a ``Layout``'s predicted step on a machine's ``Rates``, and its parts.

``predict_step(layout, rates, work)`` prices every unit's work from the
rates (``unit_costs``) and replays the engine's schedule with those costs
(``slidekit.planning.simulate``), several steps until it repeats, so that
what overlaps what is the engine's own order: uploads ahead of the compute
into free cache units, a unit's gradients down and its host update under
the backward of the units after it (two ring buffers between them), the
next forward's uploads waiting for each unit's update, deferred updates
(clipping, skipping) under the next forward, resident units updated on the
device after the backward; with ``Layout.forward_updates`` (``engine.update_order``) the host updates of
a step that does not clip are taken in the next forward's order from each unit's own gradient buffer. A
layout with speculative clipping's backups
(``Layout.clip_backup``) is priced twice (``backup_costs``): a step that does
not clip updates its host units as they come down, the one the next forward
needs first, each paying its backup until the norm is known and updated
plainly after; a step that clips also pays the rollback, each backed-up unit
restored and updated at the step's end as deferred steps are, the units
taken after the norm is known updated there without a restore
(``StepPrediction.clipped_s``). The result, a ``StepPrediction``, is the steady
step (start to start), the drain a run's last step adds, the work of each
lane and how much of each the compute stream waited for (``exposed``; the
rest is hidden under compute).

Costs per unit and step (``StepWork``: the model's shape and the run's tokens):

    forward     2 x parameters x tokens + 4 x heads x head_dim x seq x tokens FLOPs at layer_tflops
    backward    3 x the forward (recompute from the boundary, then backward); 2 x for a layer that
                keeps its activations (no recompute)
    head        6 x vocab x hidden x tokens at head_tflops (loss and gradients in one visit)
    gradients   zeroed and their norm taken: 4 B/param at device_gbps, once a step
    upload      the FP32 master, 4 B/param at h2d_gbps; with upload copies (``Layout.upload_copy``,
                ``engine.upload_copy``) its BF16 copy, 2 B/param
    cast        a resident unit whose weights slide (``slidekit.planning.weights``): its weights cast
                from its device master into a cache unit for each visit that finds none holding them (a
                layer's forward and backward, the embedding's forward, the head's one visit), 4 B read +
                2 B written per param at device_gbps, on the host -> device lane in turn with the
                uploads, as the engine casts them (on the upload stream, into a cache unit of the
                window: NOTES.md 57 measured what pricing them beside the window missed); no upload,
                no download, the update on the device
    down        the gradients, compute dtype, at d2h_gbps, one ring piece at a time
    update      host: parameters / the optimizer's params/s; device (resident units): its bytes per
                parameter at device_gbps; clipping adds a 4 B/param pass (host_gbps / device_gbps);
                upload copies add the BF16 write, 2 B/param at host_gbps, to the host update
    backup      speculative clipping, per backed-up unit: its master (4 B/param) and state bytes read
                and written at the effective backup_gbps (an optimizer that writes the backup in its
                update's pass, fused_backup) or backup_copy_gbps (one whose backups are copied),
                host_gbps where the rates have neither, with each update taken before the norm is
                known (NOTES.md 31: 24 B/param for layer_adam at an effective 257 GB/s fused on the
                H200 host, 35 GB/s copied); the same bytes at host_gbps to restore a step that clips.
                None of it for an optimizer that updates out of place (fused_update_out: NOTES.md 36)
    streamed    state on a disk tier: read and written back at disk_read/write_gbps, the update
                taking the longer of that and its CPU time
    activations on a tier: each recomputing layer's input written in the forward, read in the backward,
                over the bus (a host tier) or the disk

What it ignores: contention for host memory between the optimizer and the
bus copies; the bus shared by uploads and activation reads beyond taking
turns; a cast's share of the device's memory bandwidth while compute runs
beside it, and the device sync that a unit whose weights slide takes to read
its gradient norm before its update (a step that does not defer: engine
``Updates._finish_lean``); kernel-launch gaps inside a visit (they are in the calibrated
rates); the compute rate's dependence on the batch and the GPU's clocks
(one rate per kind of matmul, calibrated on all-resident steps);
checkpoints and evaluation; and, for a data-parallel rank's layout, the
collectives (the gradient reduction, the weight all-gather: not yet measured
on any machine, issue 19): a rank is priced for its own shard's uploads,
downloads and updates and the whole unit's compute on its micro-batches.
``docs/planning.md`` has the calibration
against the measured steps. Test: ``pytest tests/test_timing.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from slidekit.models.base import ArchSpec
from slidekit.planning.layout import Layout, Workload
from slidekit.planning.rates import CLIP_PASS_BYTES, COPY_WRITE_BYTES, GRAD_PASS_BYTES, Rates
from slidekit.planning.simulate import Piece, SimResult, UnitCost, simulate

__all__ = ["LABELS", "StepPrediction", "StepWork", "backup_costs", "predict_step", "replay_step", "unit_costs"]

#: What each lane's work is called in a prediction's parts.
LABELS = {
    "compute": "device compute",
    "upload": "uploads",
    "cast": "weight casts",
    "grad copy": "gradient copies",
    "host update": "host updates",
    "disk": "disk streaming",
    "activations": "activation transfers",
    "host": "host overhead",
}


@dataclass(frozen=True, kw_only=True, slots=True)
class StepWork:
    """What a step computes, as the step-time model needs it: the model's shape and the run's tokens."""

    tokens: int  # per micro-batch
    micro: int  # micro-batches per step
    seq_len: int
    hidden_size: int
    attention_width: int  # heads x head_dim
    head_params: int  # vocab x hidden: the LM head's matrix (the tied embedding's)
    tied: bool  # the LM head is the embedding (one more, pinned, cache unit)
    optimizer: str  # the optimizer's name (its rate in ``Rates.updates``)
    state_bytes_per_param: float  # for an optimizer without a rate
    clip: bool  # clipping by the global norm: one more pass over each gradient before its update
    fused_backup: bool = True  # the optimizer writes speculative clipping's backups in its update's pass
    out_of_place: bool = False  # ... or updates out of place (``fused_update_out``): no backup bytes at all

    @classmethod
    def of(
        cls,
        spec: ArchSpec,
        workload: Workload,
        *,
        optimizer: str,
        state_bytes_per_param: float,
        clip: bool,
        fused_backup: bool = True,
        out_of_place: bool = False,
    ) -> StepWork:
        return cls(
            tokens=workload.tokens,
            micro=workload.grad_accum,
            seq_len=workload.seq_len,
            hidden_size=spec.hidden_size,
            attention_width=spec.num_heads * spec.head_dim,
            head_params=spec.vocab_size * spec.hidden_size,
            tied=spec.tie_embeddings,
            optimizer=optimizer,
            state_bytes_per_param=state_bytes_per_param,
            clip=clip,
            fused_backup=fused_backup,
            out_of_place=out_of_place,
        )

    def layer_flops(self, numel: int) -> float:
        """FLOPs of one decoder layer's forward over one micro-batch (the model-FLOPs convention)."""
        return 2.0 * numel * self.tokens + 4.0 * self.attention_width * self.seq_len * self.tokens


@dataclass(frozen=True, kw_only=True, slots=True)
class StepPrediction:
    """A layout's predicted step: the steady period and what it is made of (see the module doc)."""

    seconds: float  # one step, start to start, once the run is steady
    drain_s: float  # after the last step returns, until every update is applied
    tokens: int  # tokens per step
    work: dict[str, float]  # seconds of work per lane in one step (keys: ``LABELS``)
    exposed: dict[str, float]  # seconds of the step the compute stream waited for each lane
    rates: str  # the name of the rates it was priced with
    #: A step that clips, where the layout backs up for speculative clipping (it rolls back: restore and
    #: deferred update at its end); None where every step is priced alike (``seconds``).
    clipped_s: float | None = None

    @property
    def compute_s(self) -> float:
        return self.work.get("compute", 0.0)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def bound(self) -> str:
        """What sets the step: the device's compute, or the lane the compute waits for most."""
        waits = {k: v for k, v in self.exposed.items() if k != "host"}
        if not waits or max(waits.values()) < 0.05 * self.seconds:
            return "compute"
        return max(waits, key=lambda k: waits[k])

    def mean_over(self, steps: int) -> float:
        """The mean step of ``steps`` timed steps whose last ends once every update is applied (what
        ``slidekit bench`` reports): the steady step plus the drain spread over them."""
        if steps < 1:
            raise ValueError(f"steps must be at least 1, got {steps}")
        return self.seconds + self.drain_s / steps

    def describe(self) -> str:
        """Two lines: the step, its tokens/s and what bounds it; each lane's work and how much of it the
        compute stream waited for."""
        clips = "" if self.clipped_s is None else f"; {_sec(self.clipped_s)} on a step that clips"
        head = (
            f"predicted step {_sec(self.seconds)} ({self.tokens_per_s:,.0f} tokens/s{clips}), bound by "
            f"{LABELS[self.bound]} (rates: {self.rates})"
        )
        parts = []
        for kind, label in LABELS.items():
            busy, waited = self.work.get(kind, 0.0), self.exposed.get(kind, 0.0)
            if kind == "compute":
                parts.append(f"{label} {_sec(busy)}")
            elif busy > 0 or waited > 0:
                shown = f"{_sec(waited)} exposed" if waited >= 0.0005 else "hidden"
                parts.append(f"{label} {_sec(busy)} ({shown})")
        tail = f"; a run's last step adds {_sec(self.drain_s)} of updates" if self.drain_s >= 0.0005 else ""
        return f"  {head}\n    " + "; ".join(parts) + tail


def _sec(seconds: float) -> str:
    if seconds >= 100:
        return f"{seconds:.0f} s"
    return f"{seconds:.1f} s" if seconds >= 10 else f"{seconds:.3f} s"


def unit_costs(layout: Layout, rates: Rates, work: StepWork) -> list[UnitCost]:
    """Seconds of every unit's work in a step on ``rates`` (the table in the module doc)."""
    tflops_layer, tflops_head = rates.layer_tflops * 1e12, rates.head_tflops * 1e12
    dev, h2d, d2h = rates.device_gbps * 1e9, rates.h2d_gbps * 1e9, rates.d2h_gbps * 1e9
    host_bw = rates.host_gbps * 1e9
    rate = rates.update(work.optimizer, work.state_bytes_per_param)
    clip = CLIP_PASS_BYTES if work.clip else 0
    extra = clip + (COPY_WRITE_BYTES if layout.upload_copy else 0)  # host bytes per param beyond the rate's
    up = layout.itemsize if layout.upload_copy else 4  # bytes per param an upload moves
    layers = sum(u.kind == "layer" and not u.keeps for u in layout.units)  # those saving a boundary
    acts_lane, write_bw, read_bw = {
        "host": ("d2h", d2h, h2d),
        "disk": ("disk", rates.disk_write_gbps * 1e9, rates.disk_read_gbps * 1e9),
    }.get(layout.activation_medium, ("d2h", 0.0, 0.0))
    per_act = layout.activation_bytes / max(layers * work.micro, 1)
    s = layout.itemsize
    out = []
    for u in layout.units:
        fwd = bwd = 0.0
        if u.kind == "layer":
            fwd = work.layer_flops(u.numel) / tflops_layer
            bwd = (2 if u.keeps else 3) * fwd
        elif u.kind == "head":
            bwd = 6.0 * work.head_params * work.tokens / tflops_head
        else:  # the embedding's backward: a scatter-add of the input gradient
            bwd = 3.0 * work.tokens * work.hidden_size * s / dev
        pieces: tuple[Piece, ...] = ()
        if u.slides:
            per_param_state = u.state_bytes / u.own if u.own else 0.0
            disk = (
                (1 / (rates.disk_read_gbps * 1e9) + 1 / (rates.disk_write_gbps * 1e9)) if u.streamed else 0.0
            )
            pieces = tuple(
                Piece(
                    down_s=(b - a) * s / d2h,
                    update_s=(b - a) / rate.host_params_per_s + (b - a) * extra / host_bw,
                    disk_s=(b - a) * per_param_state * disk,
                )
                for a, b in u.pieces
            )
        on_tier = u.kind == "layer" and not u.keeps and write_bw > 0
        out.append(
            UnitCost(
                kind=u.kind,
                resident=u.resident,
                fwd_s=fwd,
                bwd_s=bwd,
                grad_pass_s=u.numel * GRAD_PASS_BYTES / dev,
                upload_s=0.0 if u.resident else u.own * up / h2d,  # a rank uploads its shard's master / copy
                pieces=pieces,
                device_update_s=u.own * (rate.device_bytes_per_param + clip) / dev if u.resident else 0.0,
                weights_slide=u.weights_slide,
                cast_s=u.own * CAST_BYTES / dev if u.weights_slide else 0.0,
                act_write_s=per_act / write_bw if on_tier else 0.0,
                act_read_s=per_act / read_bw if on_tier else 0.0,
                act_lane=acts_lane,
            )
        )
    return out


def backup_costs(
    costs: Sequence[UnitCost], layout: Layout, rates: Rates, *, fused: bool = True, out_of_place: bool = False
) -> list[UnitCost]:
    """``costs`` (``unit_costs``) with each backed-up unit's pieces (``Layout.backed_up``) priced for
    speculative clipping: master (4 B/param) and state bytes, read and written, backed up at
    ``Rates.backup_rate_gbps(fused)`` and restored at ``host_gbps``; out of place (``fused_update_out``: the
    update writes its new values elsewhere, the same bytes as in place, and a step that clips finds the old
    ones where they were) neither costs anything. Unchanged without backups."""
    backed = {u.index for u in layout.backed_up()}
    if not backed:
        return list(costs)
    backup_bw, restore_bw = rates.backup_rate_gbps(fused) * 1e9, rates.host_gbps * 1e9
    out = []
    for u, cost in zip(layout.units, costs, strict=True):
        if u.index not in backed:
            out.append(cost)
            continue
        moved = 0.0 if out_of_place else 2 * (4 + (u.state_bytes / u.own if u.own else 0.0))
        pieces = tuple(
            replace(
                p, backup_s=(b - a) * moved / backup_bw, restore_s=(b - a) * moved / restore_bw, speculates=True
            )
            for p, (a, b) in zip(cost.pieces, u.pieces, strict=True)
        )
        out.append(replace(cost, pieces=pieces))
    return out


#: Bytes a cast of a unit's weights from its FP32 device master moves per parameter: 4 read, 2 written.
CAST_BYTES = 6


def _priced(layout: Layout, rates: Rates, work: StepWork) -> list[UnitCost]:
    """Every unit's costs (``unit_costs``), speculative clipping's backups priced as the optimizer takes them."""
    return backup_costs(
        unit_costs(layout, rates, work), layout, rates, fused=work.fused_backup, out_of_place=work.out_of_place
    )


def replay_step(layout: Layout, rates: Rates, work: StepWork, *, rollback: bool = False) -> SimResult:
    """The step-time model's replay of ``layout`` (``slidekit.planning.simulate``): what ``predict_step``
    reads its prediction from, with what else the replay keeps (the takes, the busy and exposed lanes).
    ``rollback``: the step clips, and what was updated speculatively is restored."""
    costs = _priced(layout, rates, work)
    return _replay(costs, layout, rates, work, rollback=rollback)


def _replay(
    costs: list[UnitCost], layout: Layout, rates: Rates, work: StepWork, *, rollback: bool
) -> SimResult:
    return simulate(
        costs,
        window=layout.window.window,
        prefetch=layout.prefetch,
        ring=layout.ring_buffers,
        tied=work.tied,
        defer=layout.unit_grads and not layout.forward_updates,
        micro=work.micro,
        step_overhead_s=rates.step_overhead_s,
        rollback=rollback,
        takes=layout.forward_updates,
    )


def predict_step(layout: Layout, rates: Rates, work: StepWork) -> StepPrediction:
    """The steady step of ``layout`` on ``rates`` for ``work`` (see the module doc); with backups, also
    the steady step of a run whose every step clips (``clipped_s``)."""
    costs = _priced(layout, rates, work)
    result = _replay(costs, layout, rates, work, rollback=False)
    clipped = (
        _replay(costs, layout, rates, work, rollback=True)
        if layout.unit_grads and not layout.forward_updates and layout.backed_up()
        else None
    )
    return StepPrediction(
        seconds=result.seconds,
        drain_s=result.drain_s,
        tokens=work.tokens * work.micro,
        work=dict(result.busy),
        exposed=dict(result.exposed),
        rates=rates.name,
        clipped_s=None if clipped is None else clipped.seconds,
    )
