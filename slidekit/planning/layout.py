"""The run's memory layout: where every buffer of the engine lives, decided once.

A ``Layout`` is a pure value, computed from the model spec, the workload, what
the drivers declare (``Drivers``), the engine settings, the placement and the
machine (``Planner.layout``). Per unit it says whether the unit is resident
(FP32 master, optimizer state, weights and gradients on the compute device
for good, updated there), resident with sliding weights (master and state on
the device, updated there, its weights cast into a cache unit of the window
for each visit: ``slidekit.planning.weights``, which gives each placement's
bytes per parameter) or slides (master in host RAM, weights uploaded into
the window, gradients down through the ring), which tier holds its optimizer
state and on what medium, and the pieces its gradients come down in. For the
run: the window's cache units and their size, the host gradient ring, the
per-unit gradient buffers of a step that must see every gradient first
(clipping, skipping), the device staging buffer uploads are cast through, the
optimizer-state chunking and staging, and where boundary activations go.

A data-parallel rank's layout (``world`` > 1) is that rank's: each unit's
``shard`` says which part of it the rank owns (``slidekit.planning.shards``),
and every per-rank size follows it: the host master, the optimizer state, the
gradient pieces and buffers, a resident unit's master and state are the
shard's; the window's cache units and a resident unit's weights and gradients
hold the whole unit, padded to ``world`` equal pieces for the collectives.

``slidekit.engine.build`` allocates exactly this; ``Layout.allocations`` is
its bytes per medium (the estimate adds the transient work of a step, see
``slidekit.planning.estimate``); ``slidekit plan`` prints it
(``Layout.describe``). Nothing else computes any part of it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from slidekit.config import upload_copy_dtype_error
from slidekit.errors import ConfigError
from slidekit.planning.placement import GRANULE, MemoryPlan, ring_numel, unit_pieces
from slidekit.planning.shards import Shard, unit_shards
from slidekit.planning.weights import device_unit_bytes

__all__ = [
    "UPLOAD_CHUNK",
    "Drivers",
    "EngineSettings",
    "Layout",
    "Placement",
    "UnitPlace",
    "Workload",
]

#: Elements of the FP32 device buffer that uploads of FP32 masters are cast through (BF16 compute).
UPLOAD_CHUNK = 1 << 24
#: The state staging sets a streamed unit rotates through (read ahead, update, write back).
STAGING_SETS = 3

StateLayout = Mapping[str, tuple[torch.dtype, int]]


@dataclass(frozen=True, kw_only=True, slots=True)
class Workload:
    """Tokens per step: micro-batches of ``batch_size`` rows of ``seq_len`` tokens, ``grad_accum`` of them.

    ``keep_grads``: the step must see every gradient before any update (global-norm clipping,
    skipping non-finite steps), so every sliding unit keeps its gradients on the host until the end.
    """

    batch_size: int
    seq_len: int
    grad_accum: int = 1
    keep_grads: bool = False
    #: With ``keep_grads``: every sliding unit whose state is mapped in host RAM keeps a backup of its
    #: master and state, for speculative clipping (``optim.clip_overlap``, ``slidekit.engine.speculation``).
    clip_backup: bool = False
    #: Every sliding unit keeps a BF16 copy of its weights in host RAM, written by its host update, and
    #: uploads it instead of its FP32 master (``engine.upload_copy``, ``slidekit.engine.host``).
    upload_copy: bool = False

    @property
    def tokens(self) -> int:
        """Tokens of one micro-batch."""
        return self.batch_size * self.seq_len


@dataclass(frozen=True, kw_only=True, slots=True)
class Placement:
    """Where state, activations and whole units live: the fields of ``EngineConfig`` the planner chooses."""

    state_tier: str = "ram"
    state_offload_tier: str | None = None
    state_offload_fraction: float = 0.0
    activation_tier: str = "auto"  # "device", a tier, or "auto" (slidekit.planning.activations)
    gpu_resident: str = "auto"
    resident_weights: str = "auto"  # units on the device keep or slide their weights (slidekit.planning.weights)

    @classmethod
    def of(cls, engine: object) -> Placement:
        """The placement an ``EngineConfig`` asks for."""
        return cls(**{f.name: getattr(engine, f.name) for f in dataclasses.fields(cls)})

    def flags(self) -> str:
        """The ``slidekit finetune`` options that select this placement."""
        out = [f"--gpu-resident {self.gpu_resident}", f"--state-tier {self.state_tier}"]
        if self.state_offload_fraction and self.state_offload_tier:
            out += [
                f"--state-offload-tier {self.state_offload_tier}",
                f"--state-offload-fraction {self.state_offload_fraction:g}",
            ]
        out.append(f"--activation-tier {self.activation_tier}")
        out.append(f"--resident-weights {self.resident_weights}")
        return " ".join(out)


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineSettings:
    """The engine's fixed sizes (``EngineConfig``): cache units that take turns, host gradient buffers,
    parameters per streamed state chunk."""

    window: int = 3
    grad_buffers: int = 2
    state_chunk: int = 1 << 22


@dataclass(frozen=True, kw_only=True)
class Drivers:
    """What the selected drivers declare, as far as memory goes.

    ``state_layout``: the optimizer's state buffers for a unit of n parameters; ``device_update`` and
    ``linear_state``: its declared capabilities (``slidekit.interfaces.UnitOptimizer``); ``media``: tier
    name -> "device", "host" or "disk"; ``device_tier``, ``host_tier``, ``disk_tier``: the tiers of those
    roles (``slidekit.planning.roles``: resident units' state, RAM, files); ``loss_workspace``: the kernel set's fused-loss workspace.
    """

    state_layout: Callable[[int], StateLayout]
    device_update: bool = True
    linear_state: bool = True
    media: Mapping[str, str] = dataclasses.field(default_factory=dict)
    device_tier: str = ""
    host_tier: str = ""  # the host tier a placement falls back to (RAM)
    disk_tier: str | None = None  # the disk tier the planner may move state to
    loss_workspace: int = 768 << 20

    def state_bytes(self, numel: int) -> int:
        return sum(n * dt.itemsize for dt, n in self.state_layout(numel).values())

    def medium(self, tier: str) -> str:
        try:
            return self.media[tier]
        except KeyError:
            raise ConfigError(f"unknown storage tier {tier!r}; known tiers: {sorted(self.media)}") from None


@dataclass(frozen=True, slots=True)
class UnitPlace:
    """Where one unit lives."""

    index: int
    kind: str  # "embed", "layer" or "head"
    numel: int
    resident: bool  # master, state, weights and gradients on the compute device for good, updated there
    state_tier: str  # the tier holding its optimizer state
    state_medium: str  # that tier's medium: "device", "host" or "disk"
    state_bytes: int  # of the optimizer state of its shard (the whole unit in one process)
    pieces: tuple[tuple[int, int], ...]  # ranges [a, b) of its shard its gradients come down in (none when resident)
    shard: Shard  # the part this rank owns, updates and keeps the master and state of (one process: all of it)

    @property
    def own(self) -> int:
        """Parameters of the unit this rank keeps a master and state for: its shard."""
        return self.shard.size

    @property
    def padded(self) -> int:
        """Elements of the unit's buffers on the compute device: ``world`` equal pieces (one process: the unit)."""
        return self.shard.padded
    keeps: bool = False  # a layer that keeps its activations: no recompute (slidekit.planning.keeping)
    # A resident unit without weights of its own on the device: they are cast into a window cache unit from
    # its device master for each visit, and it is updated from that cache unit (slidekit.planning.weights).
    weights_slide: bool = False

    @property
    def slides(self) -> bool:
        """Uploaded into the window for its visits; its master stays in host RAM."""
        return not self.resident

    @property
    def visits_window(self) -> bool:
        """Takes a window cache unit for its visits: it slides, or its weights do."""
        return not self.resident or self.weights_slide

    @property
    def streamed(self) -> bool:
        """Its state is staged chunk by chunk through host buffers (a disk tier) instead of mapped."""
        return self.state_medium == "disk"


@dataclass(frozen=True, kw_only=True, slots=True)
class Layout:
    """Every buffer the engine allocates, per unit and for the run (see the module doc)."""

    placement: Placement
    units: tuple[UnitPlace, ...]
    itemsize: int  # bytes per element in the compute dtype
    window: MemoryPlan  # cache units (the tied embedding's pinned one included) and their size
    prefetch: int  # visits loaded ahead of the one computing
    ring_buffers: int  # shared host gradient buffers (0: nothing slides)
    ring_numel: int  # elements of each
    unit_grads: bool  # every sliding unit has a host gradient buffer of its own (``Workload.keep_grads``,
    # or ``forward_updates``)
    # A step that does not clip takes the sliding units' updates in the next forward's order, from their own
    # gradient buffers (``engine.update_order``: ``slidekit.planning.update_order`` sets it on a layout
    # without ``keep_grads``, whose steps defer)
    forward_updates: bool = False
    clip_backup: bool = False  # sliding units with state in host RAM keep a backup (``Workload.clip_backup``)
    # Every sliding unit keeps a host copy of its weights in the compute dtype (BF16), written by its update,
    # and its uploads copy those bytes (``Workload.upload_copy``): no FP32 over the bus, no staging.
    upload_copy: bool = False
    upload_staging: int  # FP32 elements on the device uploads are cast through (0: none needed)
    device_grads: bool = False  # units whose weights slide keep a device gradient buffer of their shard
    # (``Workload.keep_grads``, or data-parallel: the reduced gradient of the rank's shard, updated at the step's end)
    state_chunk: int  # parameters per streamed state chunk
    state_staging: int  # parameters one state staging set holds
    state_staging_bytes: int  # bytes of the STAGING_SETS sets, allocated when a unit's state streams (else 0)
    activation_tier: str  # "device", or the tier boundary activations go to
    activation_medium: str
    activation_bytes: int  # the boundary activations of one step: every recomputing layer, every micro-batch
    world: int = 1  # data-parallel ranks the units are sharded over (1: one process)
    rank: int = 0  # the rank whose layout this is

    @property
    def resident(self) -> tuple[bool, ...]:
        return tuple(u.resident for u in self.units)

    @property
    def shards(self) -> tuple[Shard, ...]:
        return tuple(u.shard for u in self.units)

    def allocations(self) -> dict[str, dict[str, int]]:
        """Bytes the engine builder allocates, per medium ("device", "host", "disk") and component.

        Device: the window's cache units, the resident units (master, state, weights, gradients; a unit
        whose weights slide: master and state), the gradient buffers of units whose weights slide
        (``device_grads``), the upload staging buffer, state a non-resident unit keeps on a device tier. Host: the
        sliding units' masters, their state on host tiers, the state staging sets, the gradient
        ring and per-unit gradient buffers, the upload copies (``upload_copy``), activations on a host tier. Disk: state and activations
        on disk tiers.
        """
        s = self.itemsize
        sliding = [u for u in self.units if u.slides]
        device = {
            "window": self.window.device_bytes,
            "resident": sum(
                device_unit_bytes(
                    own=u.own, padded=u.padded, state=u.state_bytes, itemsize=s, slide=u.weights_slide, deferred=False
                )
                for u in self.units
                if u.resident
            ),
            "staging": 4 * self.upload_staging,
        }
        if self.device_grads:
            device["gradients"] = s * sum(u.own for u in self.units if u.weights_slide)
        state = {"device": 0, "host": 0, "disk": 0}
        for u in sliding:
            state[u.state_medium] += u.state_bytes
        if state["device"]:
            device["state"] = state["device"]
        host = {
            "masters": 4 * sum(u.own for u in sliding),
            "state": state["host"],
            "state staging": self.state_staging_bytes,
            "gradients": self.ring_buffers * self.ring_numel * s
            + (s * sum(u.own for u in sliding) if self.unit_grads else 0),
        }
        if self.clip_backup:  # the speculated units' pre-update master and state
            host["clip backup"] = sum(4 * u.own + u.state_bytes for u in self.backed_up())
        if self.upload_copy:  # the sliding units' weights in the compute dtype, uploaded as they are
            host["upload copies"] = s * sum(u.own for u in sliding)
        disk: dict[str, int] = {}
        if self.activation_medium == "host":
            host["activations"] = self.activation_bytes
        elif self.activation_medium == "disk":
            disk["activations"] = self.activation_bytes
        if state["disk"]:
            disk["state"] = state["disk"]
        return {"device": device, "host": host, "disk": disk}

    def backed_up(self) -> list[UnitPlace]:
        """The units a speculative step updates during the backward (``clip_backup``): sliding, state in RAM."""
        return [u for u in self.units if u.slides and u.state_medium == "host"] if self.clip_backup else []

    def describe(self) -> str:
        """The layout, unit by unit and for the run (``slidekit plan`` prints it)."""
        lines = []
        if self.world > 1:
            lines.append(
                f"  data-parallel rank {self.rank} of {self.world}: this rank keeps the master and optimizer "
                f"state of its 1/{self.world} shard of every unit ({sum(u.own for u in self.units):,} of "
                f"{sum(u.numel for u in self.units):,} parameters); the window holds whole units"
            )
        wide = 14 if any(u.weights_slide for u in self.units) else 9  # room for "weights slide"
        lines.append("  units     kind   parameters each  " + "where".ljust(wide) + " optimizer state")
        groups: list[tuple[int, int, tuple[object, ...]]] = []  # consecutive units placed alike
        for u in self.units:
            key = (u.kind, u.numel, u.resident, u.state_tier, u.state_medium, len(u.pieces), u.keeps, u.weights_slide)
            if groups and groups[-1][2] == key and groups[-1][1] == u.index - 1:
                groups[-1] = (groups[-1][0], u.index, key)
            else:
                groups.append((u.index, u.index, key))
        for first, last, (kind, numel, resident, tier, medium, pieces, keeps, lean) in groups:
            span = f"{first}" if first == last else f"{first}-{last}"
            where = ("weights slide" if lean else "resident") if resident else "slides"
            streamed = ", streamed" if medium == "disk" and not resident else ""
            cut = f", {pieces} gradient pieces" if isinstance(pieces, int) and pieces > 1 else ""
            kept = "; keeps its activations" if keeps else ""
            lines.append(f"  {span:<9} {kind:<6} {numel:>15,}  {where:<{wide}} {tier} ({medium}{streamed}){cut}{kept}")
        w = self.window
        lines.append(
            f"  window: {w.window} cache units of {w.slot_numel:,} parameters (+ gradients), {self.prefetch} "
            f"loaded ahead; gradient ring: {self.ring_buffers} x {self.ring_numel:,}"
            + (
                "; every sliding unit keeps its gradients, updated in the next forward's order"
                if self.forward_updates
                else "; every sliding unit keeps its gradients until the step ends"
                if self.unit_grads
                else ""
            )
            + (f"; {len(self.backed_up())} units back up their master and state" if self.clip_backup else "")
        )
        if self.upload_copy:
            lines.append(
                "  upload copies: every sliding unit keeps its weights in BF16 in host RAM (written by its update) "
                "and uploads them as they are, 2 B/param over the bus instead of the FP32 master's 4"
            )
        extra = []
        if self.upload_staging:
            extra.append(f"upload staging {self.upload_staging:,} FP32")
        if self.state_staging_bytes:
            extra.append(f"state staging {STAGING_SETS} x {self.state_staging:,} parameters")
        acts = self.activation_tier if self.activation_tier == "device" else f"{self.activation_tier} ({self.activation_medium})"
        extra.append(f"boundary activations on {acts}")
        keeping = sum(u.keeps for u in self.units)
        layers = sum(u.kind == "layer" for u in self.units)
        extra.append(f"{keeping} of {layers} layers keep their activations (the rest recompute)")
        lines.append("  " + "; ".join(extra))
        lean = [u for u in self.units if u.weights_slide]
        if lean:
            whole = sum(u.resident for u in self.units) - len(lean)
            lines.append(
                f"  {len(lean)} units on the GPU with sliding weights (master and state there, weights cast into "
                f"the window for each visit), {whole} keep their weights there"
                + ("; their gradients wait in a device buffer until the step ends" if self.device_grads else "")
            )
        return "\n".join(lines)


def build_layout(
    units: tuple[tuple[int, str, int], ...],  # (index, kind, numel) per unit
    *,
    tied: bool,
    workload: Workload,
    hidden_size: int,
    num_layers: int,
    itemsize: int,
    drivers: Drivers,
    settings: EngineSettings,
    placement: Placement,
    resident: tuple[bool, ...],
    offload: tuple[bool, ...],
    accelerator: bool,
    world: int = 1,
    rank: int = 0,
    keeps: tuple[bool, ...] | None = None,
    weights_slide: tuple[bool, ...] | None = None,
) -> Layout:
    """The layout of ``placement`` with ``resident`` units kept on the device and ``offload`` units' state
    on the offload tier (``Planner.layout`` chooses both). ``accelerator``: the compute device is not the
    CPU (uploads then cross a bus, through the staging buffer when they are cast). ``world``, ``rank``:
    the data-parallel rank whose layout this is (its shards, ``slidekit.planning.shards``). ``keeps``: the
    layers that keep their activations (``slidekit.planning.keeping``; None: none). ``weights_slide``:
    the resident units whose weights slide through the window (``slidekit.planning.weights``; None: none)."""
    from slidekit.planning.keeping import check_keeps
    from slidekit.planning.placement import plan_memory

    keeps = keeps or (False,) * len(units)
    weights_slide = weights_slide or (False,) * len(units)
    lean = [r and w for r, w in zip(resident, weights_slide, strict=True)]

    numels = [n for _, _, n in units]
    shards = unit_shards(numels, world, rank)
    owns = [sh.size for sh in shards]
    sliding = [not r for r in resident]
    copies = workload.upload_copy and any(sliding)
    if copies and itemsize != 2:
        raise ConfigError(upload_copy_dtype_error(f"{8 * itemsize}-bit"))
    piece = ring_numel(owns, [k for _, k, _ in units], sliding, pieces=drivers.linear_state)
    if any(sliding):
        piece = max(piece, 1)  # a rank may own none of any sliding unit (tiny units, many ranks)
    places = []
    for (index, kind, numel), shard, on_device, off in zip(units, shards, resident, offload, strict=True):
        if on_device:
            tier = drivers.device_tier
            if not tier:
                raise ConfigError(
                    f"unit {index} is to be resident, but no storage tier of the compute device's memory is "
                    "available for its optimizer state (slidekit.planning.roles); set engine.gpu_resident="
                    "'none', or install / unblock such a tier (the bundled 'gpu' tier ships with slidekit)"
                )
        elif off and placement.state_offload_tier:
            tier = placement.state_offload_tier
        else:
            tier = placement.state_tier
        places.append(
            UnitPlace(
                index=index,
                kind=kind,
                numel=numel,
                resident=on_device,
                state_tier=tier,
                state_medium=drivers.medium(tier),
                state_bytes=drivers.state_bytes(shard.size),
                pieces=() if on_device else tuple(unit_pieces(shard.size, piece)),
                shard=shard,
                keeps=keeps[index],
                weights_slide=lean[index],
            )
        )
    check_keeps(places)
    window = plan_memory(  # the units that visit the window: those that slide, and those whose weights do
        [sh.padded for sh, s, w in zip(shards, sliding, lean, strict=True) if s or w] or [1],
        compute_itemsize=itemsize,
        window=settings.window,
        grad_buffers=settings.grad_buffers,
        tied=tied,
    )
    linear = drivers.linear_state
    chunk = max(GRANULE, settings.state_chunk // GRANULE * GRANULE) if linear else max(1, *owns)
    streams = any(p.streamed and p.slides for p in places)
    staged = max(min(chunk, n) for n in owns)
    acts = placement.activation_tier
    acts_medium = "device" if acts == "device" else drivers.medium(acts)
    return Layout(
        placement=placement,
        units=tuple(places),
        itemsize=itemsize,
        window=window,
        prefetch=settings.window - 1,
        ring_buffers=settings.grad_buffers if piece else 0,
        ring_numel=piece,
        unit_grads=workload.keep_grads and any(sliding),
        clip_backup=workload.keep_grads
        and workload.clip_backup
        and any(p.slides and p.state_medium == "host" for p in places),
        upload_copy=copies,
        upload_staging=UPLOAD_CHUNK if accelerator and itemsize < 4 and any(sliding) and not copies else 0,
        device_grads=(workload.keep_grads or world > 1) and any(lean),  # a rank reduces them into its shard's
        state_chunk=chunk,
        state_staging=staged,
        state_staging_bytes=STAGING_SETS * drivers.state_bytes(staged) if streams else 0,
        activation_tier=acts,
        activation_medium=acts_medium,
        activation_bytes=(num_layers - sum(keeps)) * workload.grad_accum * workload.tokens * hidden_size * itemsize,
        world=world,
        rank=rank,
    )
