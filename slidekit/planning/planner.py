"""The planner: the run's ``Layout`` for a placement, its ``Estimate`` on a machine, and the fastest
placement that fits.

``Planner.for_run`` takes a configured run (model spec, workload, engine
settings, what the drivers declare); ``layout(placement, machine)`` decides
which units are resident (``residency``) and where each unit's state goes;
``estimate`` adds up the layout's bytes and a step's transient work on each
medium; ``predict`` prices a layout's step on a machine's rates
(``slidekit.planning.timing``); ``recommend`` returns the placement that fits
with the shortest predicted step: it fills the fastest tier first, per unit
(as many units resident on the GPU as fit, then their state in RAM, then on
disk the smallest share of units that makes RAM suffice, spread over the
model), with activations on the device or on a host tier, and lets the
predicted step choose among those; where predictions tie (within
``TIE``), or the machine has no rates, the fixed order decides: more units
resident first, activations on the device before a host tier, state in RAM
before a growing share on disk. The trainer refuses a configuration that
does not fit before it allocates anything, with the numbers and that
recommendation; a run directory that lacks room for its checkpoints is
refused up front too.

    slidekit plan --model DIR --batch-size 8 --seq-len 1024      # what a run needs, and what fits

The recommendations are ``slidekit.planning.recommend`` (a mixin of ``Planner``).

Test: ``pytest tests/test_planner.py``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from slidekit.capabilities import fuses_backup, updates_out_of_place
from slidekit.config import resident_fraction, upload_copy_dtype_error
from slidekit.errors import ConfigError
from slidekit.models.base import ArchSpec
from slidekit.models.loading import load_staging_bytes
from slidekit.planning.activations import AUTO, activation_candidates, activation_note
from slidekit.planning.clip_overlap import overlap_layout
from slidekit.planning.estimate import (
    DEVICE_HEADROOM,
    DEVICE_SLACK,
    RUNTIME_HOST,
    Estimate,
    head_work,
    kept_bytes,
    layer_work,
    step_work,
)
from slidekit.planning.keeping import kept_runs, plan_keeps
from slidekit.planning.layout import (
    UPLOAD_CHUNK,
    Drivers,
    EngineSettings,
    Layout,
    Placement,
    StateLayout,
    Workload,
    build_layout,
)
from slidekit.planning.machine import Machine
from slidekit.planning.placement import place_state, plan_residency, spread_host_units
from slidekit.planning.recommend import TIE, Recommendations
from slidekit.planning.run_space import checkpoint_bytes, checkpoint_writes, run_dir_need
from slidekit.planning.shards import unit_shards
from slidekit.planning.timing import StepPrediction, StepWork, predict_step
from slidekit.planning.update_order import order_layout
from slidekit.planning.weights import device_unit_bytes, plan_weights

if TYPE_CHECKING:
    from slidekit.config import TrainConfig
    from slidekit.interfaces import UnitOptimizer
    from slidekit.plugins import Plugins
    from slidekit.resolve import RunSetup

__all__ = ["RESIDENCY_CANDIDATES", "RESIDENCY_GAIN", "RESIDENT_RESERVE", "TIE", "Choice", "Planner"]

#: "auto" residency leaves max(RESIDENT_RESERVE, 5% of the device) free beyond the plan.
RESIDENT_RESERVE = 4 << 30
#: "auto" residency with rates (``Planner.fastest_residency``) keeps fewer units resident than fit only
#: where the step-time model predicts a step this much shorter, trying this many host counts between.
#: The model ordered three 3B placements on an H100 as measured (NOTES.md 37), but predicts offloaded
#: layouts 1-15% faster against all-resident than the H200 measured (NOTES.md 38): a margin, not a tie.
RESIDENCY_GAIN = 0.05
RESIDENCY_CANDIDATES = 12


@dataclass(frozen=True, slots=True)
class Choice:
    """A layout with the placement's "auto" settings decided, and notes on what they traded (the run and
    ``slidekit plan`` print them)."""

    layout: Layout
    notes: tuple[str, ...] = ()


class Planner(Recommendations):
    """Layouts, memory estimates and placement recommendations for one model and workload.

    ``state_bytes(numel)`` (or ``state_layout(numel)``) is the optimizer state of a unit of ``numel``
    parameters; ``media`` maps tier names to "device", "host" or "disk". ``device_updates``: the
    optimizer can update units on the device (only then can units be resident). ``keep_grads``: every
    unit's gradients stay on the host until the step ends (global-norm clipping, skipping non-finite
    steps). ``device_tier``: the tier resident units keep their state on. ``optimizer`` (its name, for
    its update rate), ``clip`` (clipping by the global norm), ``fused_backup`` (the optimizer writes
    speculative clipping's backups in its update's pass) and ``out_of_place`` (it updates out of place
    instead, ``fused_update_out``) are what the step-time model needs.
    ``recompute`` (``engine.recompute``) and ``fused_kernels`` (the kernel set keeps only its inputs,
    ``estimate.kept_bytes``): which layers keep their activations (``keeps``). ``clip_overlap`` and
    ``update_order`` (``optim.clip_overlap``, ``engine.update_order``): the policies a layout runs with
    (``as_run``), which the "auto" choices weigh.
    """

    def __init__(
        self,
        spec: ArchSpec,
        workload: Workload,
        *,
        compute_itemsize: int,
        media: Mapping[str, str],
        device_type: str,
        state_bytes: Callable[[int], int] | None = None,
        state_layout: Callable[[int], StateLayout] | None = None,
        window: int = 3,
        grad_buffers: int = 2,
        state_chunk: int = 1 << 22,
        loss_workspace: int = 768 << 20,
        device_updates: bool = True,
        keep_grads: bool = False,
        linear_state: bool = True,
        device_tier: str | None = None,
        host_tier: str | None = None,
        disk_tier: str | None = None,
        checkpoint_keep: int | None = None,
        checkpoint_writes: int = 0,
        optimizer: str = "",
        clip: bool = False,
        fused_backup: bool = True,
        out_of_place: bool = False,
        world: int = 1,
        rank: int = 0,
        recompute: str = "auto",
        fused_kernels: bool = True,
        clip_overlap: str = "auto",
        update_order: str = "auto",
    ) -> None:
        if state_layout is None:
            if state_bytes is None:
                raise TypeError("a Planner needs state_layout or state_bytes")
            import torch

            sized = state_bytes

            def state_layout(numel: int) -> StateLayout:  # a byte count stands for one byte buffer
                return {"state": (torch.uint8, sized(numel))}

        self.spec = spec
        self.workload = dataclasses.replace(workload, keep_grads=workload.keep_grads or keep_grads)
        self.itemsize = compute_itemsize
        self.device_type = device_type

        def first(medium: str) -> str | None:  # without roles resolved: the first tier of the medium
            return next((t for t, m in media.items() if m == medium), None)

        if host_tier is None:
            host_tier = first("host") or ""
        if device_tier is None:  # the tier of the compute device's memory (on the CPU: RAM)
            device_tier = host_tier if device_type == "cpu" else first("device") or ""
        self.drivers = Drivers(
            state_layout=state_layout,
            device_update=device_updates,
            linear_state=linear_state,
            media=dict(media),
            device_tier=device_tier,
            host_tier=host_tier,
            disk_tier=first("disk") if disk_tier is None else disk_tier,
            loss_workspace=loss_workspace,
        )
        self.settings = EngineSettings(window=window, grad_buffers=grad_buffers, state_chunk=state_chunk)
        self.numels = [u.numel for u in spec.units]
        # A data-parallel rank plans its own shards (slidekit.planning.shards): masters and state are 1/world.
        self.world, self.rank = world, rank
        self.shards = unit_shards(self.numels, world, rank)
        self.state = [self.drivers.state_bytes(sh.size) for sh in self.shards]
        self.state_per_param = sum(self.drivers.state_bytes(n) for n in self.numels) / sum(self.numels)
        self.checkpoint_keep = checkpoint_keep  # run.keep (None: every checkpoint is kept)
        self.checkpoint_writes = checkpoint_writes  # checkpoints the run writes at most (0: no run.dir)
        self.optimizer = optimizer
        self.clip = clip
        self.fused_backup = fused_backup
        self.out_of_place = out_of_place
        self.recompute = recompute
        self.fused_kernels = fused_kernels
        self.clip_overlap, self.update_order = clip_overlap, update_order  # the policies ``as_run`` applies

    @classmethod
    def for_run(
        cls,
        config: TrainConfig,
        setup: RunSetup,
        *,
        optimizer: UnitOptimizer,
        plugins: Plugins,
        what_if: bool = False,
        world: int = 1,
        rank: int = 0,
    ) -> Planner:
        """The planner of a configured run: its model, workload, engine settings and drivers.

        ``what_if``: planning for a device this machine lacks (``slidekit plan --gpu``): tiers of the
        device's own memory count as available, since only that device could say otherwise. ``world``,
        ``rank``: a data-parallel rank's planner plans that rank's shards (its machine is its share of the
        host's, ``Machine.share``)."""
        from slidekit.planning.roles import tier_for

        ec, dc, oc = config.engine, config.data, config.optim
        roles = {
            m: tier_for(plugins, m, setup.family, assume_available=what_if and m == "device")
            for m in ("device", "host", "disk")
        }
        host = roles["host"].name if roles["host"] else ""
        device = host if setup.family == "cpu" else roles["device"].name if roles["device"] else ""
        return cls(
            setup.spec,
            Workload(
                batch_size=dc.batch_size,
                seq_len=dc.seq_len,
                grad_accum=config.grad_accum,
                clip_backup=oc.clip_overlap != "defer",  # speculative clipping's backups (host RAM)
                upload_copy=_upload_copy(ec.upload_copy, setup),
            ),
            compute_itemsize=setup.itemsize,
            state_layout=optimizer.state_layout,
            media={r.name: r.descriptor.medium for r in plugins.drivers("tier")},
            device_type=setup.family,
            window=ec.window,
            grad_buffers=ec.grad_buffers,
            state_chunk=ec.state_chunk,
            loss_workspace=setup.selections["kernels"].descriptor.loss_workspace_bytes,
            device_updates=optimizer.device_update,
            keep_grads=oc.max_grad_norm is not None or oc.on_nonfinite == "skip",
            linear_state=optimizer.linear_state,
            device_tier=device,
            host_tier=host,
            disk_tier=roles["disk"].name if roles["disk"] else "",
            checkpoint_keep=config.run.keep,
            checkpoint_writes=checkpoint_writes(config),
            optimizer=optimizer.name,
            clip=oc.max_grad_norm is not None,
            fused_backup=fuses_backup(optimizer),
            out_of_place=updates_out_of_place(optimizer),
            world=world,
            rank=rank,
            recompute=ec.recompute,
            fused_kernels=setup.selections["kernels"].descriptor.name != "torch_ref",
            clip_overlap=oc.clip_overlap,
            update_order=ec.update_order,
        )

    # ------------------------------------------------------------------ pieces

    @property
    def device_updates(self) -> bool:
        return self.drivers.device_update

    def medium(self, tier: str) -> str:
        return self.drivers.medium(tier)

    def resident_cost(self, unit: int, *, slide: bool = False) -> int:
        """Device bytes of one resident unit: FP32 master and optimizer state (of the rank's shard), weights
        and gradients (the whole unit, padded for the collectives); ``slide``: its weights slide instead, a
        gradient buffer of its own when the step defers (``slidekit.planning.weights``)."""
        sh = self.shards[unit]
        return device_unit_bytes(
            own=sh.size,
            padded=sh.padded,
            state=self.state[unit],
            itemsize=self.itemsize,
            slide=slide,
            deferred=self.workload.keep_grads or self.world > 1,  # a rank's reduced shard waits for the step's end
        )

    def layer_work(self) -> int:
        return layer_work(self.spec, self.workload, self.itemsize)

    def head_work(self) -> int:
        return head_work(self.spec, self.workload, self.itemsize, self.drivers.loss_workspace)

    def flow_bytes(self, activation_tier: str, keeps: Sequence[bool] = ()) -> dict[str, int]:
        """Activations, the flowing hidden states and the working peak of a step, on the device
        (``keeps``: per unit, whether it keeps its activations)."""
        on_device = activation_tier == "device" or self.medium(activation_tier) == "device"
        return step_work(
            self.spec,
            self.workload,
            itemsize=self.itemsize,
            activations_on_device=on_device,
            loss_workspace=self.drivers.loss_workspace,
            keeps=sum(keeps),
            kept_runs=kept_runs(keeps),
            fused_kernels=self.fused_kernels,
        )

    def checkpoint_bytes(self) -> int:
        """Disk space of one checkpoint (a data-parallel rank's part): every unit's FP32 master and optimizer
        state (of the rank's shards), and its files."""
        return checkpoint_bytes([sh.size for sh in self.shards], self.state)

    # ------------------------------------------------------------------ layouts and estimates

    def residency(self, placement: Placement, machine: Machine) -> list[bool]:
        """Units kept on the device: the configured share, or for "auto" what the device's spare memory holds
        (``most_resident``), fewer where the step-time model predicts that faster (``fastest_residency``).
        ``resident_weights`` applies as a rule ("auto": at the sliding cost first, as ``placed`` does)."""
        placement = self.decided_tier(placement, machine)
        most = self.most_resident(placement, machine)
        if resident_fraction(placement.gpu_resident) is not None:
            return most
        return self.fastest_residency(placement, machine, most)

    def most_resident(self, placement: Placement, machine: Machine) -> list[bool]:
        """The configured share of the units, or for "auto" as many as the device's spare memory holds."""
        placement = self.decided_tier(placement, machine)
        fraction = resident_fraction(placement.gpu_resident)
        units = len(self.numels)
        free = machine.device_free
        on_cpu = free is None
        if not on_cpu and not self.device_updates:
            return [False] * units  # an optimizer that updates on the CPU only: nothing can stay on the GPU
        if fraction is not None:  # as configured (on the CPU "resident" units are updated in place in RAM)
            return plan_residency(self.numels, bytes_per_param=0, budget=0, fraction=fraction)
        budget = self.device_budget(placement, machine)
        if budget is None:
            return [False] * units  # "auto" on the CPU: nothing to gain
        # Whole weights and gradients, the shard's master and state (a data-parallel rank keeps 1/world); with
        # sliding weights ("slide", and "auto" first) the master and state, and a gradient buffer when deferring.
        per_param = 2 * self.itemsize + (4 + self.state_per_param) / self.world
        if placement.resident_weights != "keep":
            deferred = self.workload.keep_grads or self.world > 1
            per_param = (4 + self.state_per_param + (self.itemsize if deferred else 0)) / self.world
        return plan_residency(self.numels, bytes_per_param=per_param, budget=max(budget, 0))

    def fastest_residency(self, placement: Placement, machine: Machine, most: Sequence[bool]) -> list[bool]:
        """"auto" residency where the step-time model can choose: ``most`` (as many units resident as the
        device holds) or, where the model predicts a step more than ``RESIDENCY_GAIN`` shorter, fewer
        resident units (``RESIDENCY_CANDIDATES`` host counts up to all of them, spread as ``plan_residency``
        spreads them) whose freed device memory keeps more layers' activations (``keeps``, recompute
        "auto"), of those whose layout fits the machine. Without rates, on the CPU, with a recompute
        that memory does not change, or where every layer keeps its activations already: ``most``."""
        most = list(most)
        units, host_most = len(most), most.count(False)
        if machine.rates is None or self.device_type == "cpu" or self.recompute != "auto" or host_most == units:
            return most
        full = self.placed(placement, machine, resident=most)
        if all(u.keeps for u in full.units if u.kind == "layer"):
            return most  # every layer keeps its activations already: memory has nothing to buy
        base = self.predict(full, machine)
        if base is None:
            return most
        best, best_s = most, base.seconds * (1 - RESIDENCY_GAIN)
        span, n = units - host_most, RESIDENCY_CANDIDATES
        for host in sorted({host_most + -(-span * k // n) for k in range(1, n + 1)}):  # up to every unit
            resident = [not h for h in spread_host_units(units, host)]
            layout = self.placed(placement, machine, resident=resident)
            pred = self.predict(layout, machine)
            if pred is not None and pred.seconds < best_s and self.estimate_layout(layout, machine).fits(machine):
                best, best_s = resident, pred.seconds
        return best

    def residency_note(self, layout: Layout, machine: Machine) -> str | None:
        """What "auto" residency traded, where ``layout`` keeps fewer units resident than fit
        (``fastest_residency``): the two predicted steps and the layers that keep their activations."""
        placement = layout.placement
        if resident_fraction(placement.gpu_resident) is not None:
            return None
        most = self.most_resident(placement, machine)
        chosen = sum(u.resident for u in layout.units)
        if chosen >= sum(most):
            return None
        full = self.placed(placement, machine, resident=most)
        ahead, behind = self.predict(layout, machine), self.predict(full, machine)
        if ahead is None or behind is None:
            return None
        return (
            f"engine.gpu_resident='auto': {chosen} of {len(layout.units)} units resident, not the {sum(most)} that "
            f"fit: the step-time model predicts {ahead.seconds:.3f} s a step against {behind.seconds:.3f} s, the "
            f"freed GPU memory keeping {sum(u.keeps for u in layout.units)} layers' activations instead of "
            f"{sum(u.keeps for u in full.units)} (--gpu-resident all keeps every unit resident)"
        )

    def device_budget(self, placement: Placement, machine: Machine) -> int | None:
        """Device bytes left for resident units beyond the window, the staging, a step's work and the
        reserve (None on the CPU's own planning)."""
        placement = self.decided_tier(placement, machine)
        if machine.device_free is None:
            return None
        nothing = self._layout(placement, [False] * len(self.numels), None).allocations()["device"]
        fixed = nothing["window"] + 4 * UPLOAD_CHUNK + sum(self.flow_bytes(placement.activation_tier).values())
        reserve = max(RESIDENT_RESERVE, (machine.device_total or 0) // 20 // machine.device_ranks)
        # Never more than the fit check accepts: it adds DEVICE_HEADROOM of the whole need and DEVICE_SLACK,
        # which on 80-200 GiB devices can exceed the reserve (a full "auto" plan was refused by ~0.1 GiB).
        fits = int((machine.device_free - DEVICE_SLACK) / (1 + DEVICE_HEADROOM)) - fixed
        return min(machine.device_free - fixed - reserve, fits)

    def weights_slide(self, placement: Placement, machine: Machine, resident: Sequence[bool]) -> list[bool]:
        """The resident units whose weights slide through the window (``slidekit.planning.weights``)."""
        placement = self.decided_tier(placement, machine)
        mode = placement.resident_weights
        units = range(len(self.numels))
        return plan_weights(
            mode,
            resident,
            keep_cost=[self.resident_cost(u) for u in units],
            slide_cost=[self.resident_cost(u, slide=True) for u in units],
            budget=self.device_budget(placement, machine) if mode == "auto" else None,
        )

    def keeps(
        self, placement: Placement, machine: Machine, resident: Sequence[bool], slide: Sequence[bool] = ()
    ) -> list[bool]:
        """Layers that keep their activations (``slidekit.planning.keeping``): for "auto", as many layers,
        resident or sliding, as the device memory left beyond the layout without any (and the reserve)
        holds."""
        placement = self.decided_tier(placement, machine)
        kinds = [str(u.kind) for u in self.spec.units]
        budget = None
        w, s = self.workload, self.itemsize
        boundary = w.grad_accum * w.tokens * self.spec.hidden_size * s  # a layer's, every micro-batch
        if self.recompute == "auto" and machine.device_free is not None:
            need = self.estimate_layout(self._layout(placement, resident, None, slide), machine).device_bytes
            reserve = max(RESIDENT_RESERVE, (machine.device_total or 0) // 20 // machine.device_ranks)
            usable = (machine.device_free - reserve - DEVICE_SLACK) / (1 + DEVICE_HEADROOM)
            budget = max(int(usable) - need, 0)
        tier = placement.activation_tier
        on_device = tier == "device" or self.medium(tier) == "device"
        graphs = w.grad_accum * kept_bytes(self.spec, w.tokens, s, fused_kernels=self.fused_kernels)
        return plan_keeps(
            kinds,
            recompute=self.recompute,
            per_layer=graphs - (boundary if on_device else 0),  # it saves no boundary activation
            fixed=boundary,
            budget=budget,
        )

    def layout(
        self,
        placement: Placement,
        machine: Machine,
        resident: Sequence[bool] | None = None,
        slide: Sequence[bool] | None = None,
    ) -> Layout:
        """Where every buffer of ``placement`` lives, its "auto" activation tier and resident weights decided
        (``choose``). ``resident`` overrides the residency plan, ``slide`` which resident units' weights
        slide: then only the activation tier is chosen, and the weights' rule applies as ``placed`` does."""
        if resident is None and slide is None:
            return self.choose(placement, machine).layout
        return self.placed(placement, machine, resident, slide)

    def choose(self, placement: Placement, machine: Machine) -> Choice:
        """``placement``'s layout with "auto" decided, and notes on what was traded: the activation tier
        (``slidekit.planning.activations``: the first of the device, the host tier, the disk tier with
        which the placement fits), and for each the resident weights (``weights_layout``)."""
        refused: list[tuple[str, list[str]]] = []
        tiers = activation_candidates(placement, self.drivers, machine)
        first: Choice | None = None
        for tier in tiers:
            chosen = self.weights_layout(dataclasses.replace(placement, activation_tier=tier), machine)
            first = first or chosen
            if len(tiers) == 1:
                return chosen
            short = self.estimate_layout(self.as_run(chosen.layout, machine), machine).placement_shortfalls(machine)
            if not short:
                note = activation_note(chosen.layout, refused)
                return Choice(chosen.layout, chosen.notes + ((note,) if note else ()))
            refused.append((tier, short))
        assert first is not None
        return first  # nothing fits: the device's layout is refused, with the placement that would fit

    def as_run(self, layout: Layout, machine: Machine) -> Layout:
        """``layout`` as the engine runs it: ``optim.clip_overlap`` and ``engine.update_order`` decided
        (``overlap_layout``, ``order_layout``; the engine's builder and ``slidekit plan`` apply them too)."""
        layout = overlap_layout(self, layout, machine, self.clip_overlap)[0]
        return order_layout(self, layout, machine, self.update_order)[0]

    def decided_tier(self, placement: Placement, machine: Machine) -> Placement:
        """``placement`` with an "auto" activation tier replaced by the one ``choose`` takes."""
        if placement.activation_tier != AUTO:
            return placement
        return dataclasses.replace(
            placement, activation_tier=self.choose(placement, machine).layout.activation_tier
        )

    def weights_layout(self, placement: Placement, machine: Machine) -> Choice:
        """``placement``'s layout with ``resident_weights`` "auto" decided: the layout of "keep" (every unit on
        the device keeps its weights) where it fits and the step-time model does not predict the sliding-first
        rule's layout (``placed``: as many units on the device as fit at the sliding cost, then as many copies
        as the memory left holds) more than ``TIE`` faster; else the sliding-first layout. "Fits" includes
        leaving the reserve free (``device_budget``), as "auto" residency does, also where a configured share
        ("all") fixes which units are resident. Without a device
        budget (the CPU's own planning) or an optimizer that updates on the device: "keep"'s layout. The layout's
        placement says "keep" only where that was chosen over a different layout; else it stays "auto"."""
        if placement.resident_weights != "auto":
            return Choice(self.placed(placement, machine))
        keep = self.placed(dataclasses.replace(placement, resident_weights="keep"), machine)
        if machine.device_free is None or not self.device_updates:
            return Choice(dataclasses.replace(keep, placement=placement))  # nothing to choose: "auto" stays
        fill = self.placed(placement, machine)
        if [(u.resident, u.weights_slide) for u in fill.units] == [(u.resident, u.weights_slide) for u in keep.units]:
            return Choice(fill)  # the same layout: "auto" stays
        keep_run, fill_run = self.as_run(keep, machine), self.as_run(fill, machine)  # as the engine runs them
        keep_short = self.estimate_layout(keep_run, machine).placement_shortfalls(machine)
        budget = self.device_budget(placement, machine)
        kept_bytes = sum(self.resident_cost(u.index) for u in keep.units if u.resident)
        if not keep_short and budget is not None and kept_bytes > budget:  # a configured share ("all")
            keep_short = [f"its resident units need {kept_bytes / 2**30:.2f} GiB of the GPU, more than the "
                          f"{max(budget, 0) / 2**30:.2f} GiB that leave the reserve free"]  # fmt: skip
        fill_fits = self.estimate_layout(fill_run, machine).placement_fits(machine)
        why = ""
        if keep_short:
            if not fill_fits:
                return Choice(fill)  # neither fits: the one with more on the device is refused
            why = "it does not fit: " + ", ".join(keep_short)
        elif fill_fits:
            a, b = self.predict(keep_run, machine), self.predict(fill_run, machine)
            if a is None or b is None or a.seconds <= b.seconds * (1 + TIE):
                return Choice(keep)
            why = f"the step-time model predicts {a.seconds:.3f} s a step against {b.seconds:.3f} s"
        else:
            return Choice(keep)
        on_device = sum(u.resident for u in fill.units)
        slides = sum(u.weights_slide for u in fill.units)
        note = (
            f"engine.resident_weights='auto': {on_device} of {len(fill.units)} units keep their master and "
            f"state on the GPU, {slides} of them sliding their weights through the window; with every one "
            f"keeping its weights ('keep'), {sum(u.resident for u in keep.units)} units would, but {why} "
            "(--resident-weights keep asks for that)"
        )
        return Choice(fill, (note,))

    def placed(
        self,
        placement: Placement,
        machine: Machine,
        resident: Sequence[bool] | None = None,
        slide: Sequence[bool] | None = None,
    ) -> Layout:
        """Where every buffer of ``placement`` lives, its activation tier as given and ``resident_weights``
        applied as a rule ("auto": sliding first, ``slidekit.planning.weights``); ``resident`` overrides the
        residency plan, ``slide`` which resident units' weights slide."""
        placement = self.decided_tier(placement, machine)
        res = tuple(self.residency(placement, machine) if resident is None else resident)
        lean = tuple(self.weights_slide(placement, machine, res) if slide is None else slide)
        return self._layout(placement, res, tuple(self.keeps(placement, machine, res, lean)), lean)

    def _layout(
        self,
        placement: Placement,
        res: Sequence[bool],
        keeps: tuple[bool, ...] | None,
        slide: Sequence[bool] = (),
    ) -> Layout:
        sp = self.spec
        return build_layout(
            tuple((u.index, str(u.kind), u.numel) for u in sp.units),
            tied=sp.tie_embeddings,
            workload=self.workload,
            hidden_size=sp.hidden_size,
            num_layers=sp.num_layers,
            itemsize=self.itemsize,
            drivers=self.drivers,
            settings=self.settings,
            placement=placement,
            resident=tuple(res),
            offload=tuple(place_state(len(self.numels), placement.state_offload_fraction)),
            accelerator=self.device_type != "cpu",
            world=self.world,
            rank=self.rank,
            keeps=keeps,
            weights_slide=tuple(slide) or None,
        )

    def estimate(
        self, placement: Placement, machine: Machine, resident: Sequence[bool] | None = None
    ) -> Estimate:
        """Bytes ``placement`` needs on each medium (``resident`` overrides the residency plan)."""
        return self.estimate_layout(self.layout(placement, machine, resident), machine)

    def estimate_layout(self, layout: Layout, machine: Machine) -> Estimate:
        """``layout``'s bytes plus a step's transient work and the run directory's checkpoints."""
        alloc = layout.allocations()
        device = {k: alloc["device"][k] for k in ("window", "resident", "staging")}
        for k in ("gradients", "state"):
            if k in alloc["device"]:
                device[k] = alloc["device"][k]
        device.update(self.flow_bytes(layout.placement.activation_tier, [u.keeps for u in layout.units]))
        host = dict(alloc["host"])
        # setup's FP32 host copies of the masters that live on the device (slidekit.models.loading)
        on_device = [u.numel for u in layout.units if u.resident] if self.device_type != "cpu" else []
        whole = [u.numel for u in layout.units] if layout.world > 1 else []
        staging = load_staging_bytes(on_device, whole)
        if staging:
            host["load staging"] = staging
        host["runtime"] = RUNTIME_HOST.get(self.device_type, RUNTIME_HOST["cuda"])
        run_dir, fix = run_dir_need(
            self.checkpoint_bytes(), self.checkpoint_keep, self.checkpoint_writes, machine.run_dir_checkpoints
        )
        return Estimate(
            placement=layout.placement,
            resident=layout.resident,
            layout=layout,
            device=device,
            host=host,
            disk=alloc["disk"],
            run_dir=run_dir,
            run_dir_fix=fix,
        )

    # ------------------------------------------------------------------ step time

    @property
    def work(self) -> StepWork:
        """What a step computes, as the step-time model needs it."""
        return StepWork.of(
            self.spec,
            self.workload,
            optimizer=self.optimizer,
            state_bytes_per_param=self.state_per_param,
            clip=self.clip,
            fused_backup=self.fused_backup,
            out_of_place=self.out_of_place,
        )

    def predict(self, layout: Layout, machine: Machine) -> StepPrediction | None:
        """``layout``'s predicted step on ``machine``'s rates; None on the CPU or without rates."""
        if machine.rates is None or self.device_type == "cpu":
            return None
        return predict_step(layout, machine.rates, self.work)


def _upload_copy(setting: str, setup: RunSetup) -> bool:
    """``engine.upload_copy`` of a run: "on" needs BF16 compute (a ConfigError naming the fix otherwise,
    also where compute_dtype "auto" resolved to FP32 on the CPU)."""
    import torch

    if setting != "on":
        return False
    if setup.compute_dtype != torch.bfloat16:
        raise ConfigError(upload_copy_dtype_error(str(setup.compute_dtype).removeprefix("torch.")))
    return True
