"""Building a run's engine: the storage tiers, the layout planned once on this machine (a data-parallel
rank's share of it), the refusal of what does not fit, and the engine that allocates exactly that.

Part of ``slidekit.trainer.Trainer`` (a mixin: the Trainer's constructor calls ``_build_engine`` once,
after the run directory is claimed and before any weight is loaded).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from slidekit import owned
from slidekit.config import TrainConfig
from slidekit.devices import device_family
from slidekit.distributed import DataParallel
from slidekit.distributed.planning import check_same_decisions, rank_machine
from slidekit.engine import Engine
from slidekit.engine.build import EngineParts, build_engine
from slidekit.errors import ConfigError
from slidekit.interfaces import StorageTier, TierContext
from slidekit.owned import Leftover
from slidekit.param_groups import param_groups
from slidekit.planning import Estimate, Layout, Machine, Placement, Planner
from slidekit.planning.clip_overlap import overlap_layout
from slidekit.planning.fit import check_fit
from slidekit.planning.update_order import order_layout
from slidekit.plugins import Plugins, Selection, build_kernel_set, driver_options
from slidekit.resolve import build_optimizer

if TYPE_CHECKING:
    import torch

    from slidekit.models.base import ArchSpec
    from slidekit.resolve import RunSetup

__all__ = ["EngineBuilding"]


class EngineBuilding:
    """The engine-building half of ``Trainer``."""

    # The Trainer's state these methods share (set by ``Trainer.__init__``).
    config: TrainConfig
    plugins: Plugins
    setup: RunSetup
    device: torch.device
    compute_dtype: torch.dtype
    spec: ArchSpec
    selections: dict[str, Selection]
    parallel: DataParallel | None
    planner: Planner | None
    estimate: Estimate | None
    notes: list[str]
    _tiers: dict[str, StorageTier]
    _fault_hook: Callable[[str], None] | None
    _machine: Machine | None
    _machine_shared: bool
    _kept_leftovers: list[Leftover]

    def _check_seq_len(self) -> None:
        raise NotImplementedError  # the Trainer's

    def _tier(self, name: str) -> StorageTier:
        """The run's one instance of the storage tier ``name`` (built on first use)."""
        if name not in self._tiers:
            sel = self.plugins.select("tier", name, device_family(self.device))
            ec = self.config.engine
            ctx = TierContext(
                device=self.device,
                directory=ec.offload_dir,
                close_timeout_s=ec.timeout_s,
                options=driver_options(sel, self.config.plugins.options),
            )
            self._tiers[name] = sel.descriptor.factory(ctx)
        return self._tiers[name]

    def _build_engine(self) -> Engine:
        """Plan the run's layout once (``slidekit.planning``), refuse it if it does not fit, build it."""
        ec, oc = self.config.engine, self.config.optim
        optimizer = build_optimizer(self.config, self.setup)
        dp = self.parallel
        self.planner = planner = Planner.for_run(
            self.config, self.setup, optimizer=optimizer, plugins=self.plugins,
            world=dp.world if dp else 1, rank=dp.rank if dp else 0,
        )  # fmt: skip
        layout = self._plan(planner, optimizer)
        if dp is not None:  # every rank must have decided alike before anything is allocated
            check_same_decisions(layout, dp)
        parts = EngineParts(
            spec=self.spec,
            kernels=build_kernel_set(self.selections["kernels"], self.config.plugins.options),
            optimizer=optimizer,
            tier=self._tier,
            device=self.device,
            compute_dtype=self.compute_dtype,
            groups=[param_groups(u, oc.weight_decay, oc.no_decay) for u in self.spec.units],
            loss_chunk=ec.loss_chunk,
            timeout_s=ec.timeout_s,
            task_hook=self._fault_hook,
            offload_dir=ec.offload_dir,
            parallel=self.parallel,
        )
        return build_engine(layout, parts)

    def machine(self) -> Machine:
        """What this machine has for the run (measured once, unless given to the constructor); a
        data-parallel rank's share of it, agreed with the other ranks (``slidekit.distributed.planning``)."""
        if self._machine is None or (self.parallel is not None and not self._machine_shared):
            here = self._machine or Machine.probe(
                self.device, self.config.engine.offload_dir, self.config.run.dir, rates=self.parallel is None
            )
            if self.parallel is not None:  # a GPU's rates probed after every rank read its free memory
                here = rank_machine(here, self.parallel, None if self._machine else self.device)
                self._machine_shared = True
            self._machine = here
        return self._machine

    def _plan(self, planner: Planner, optimizer: Any) -> Layout:
        """The layout of the configured placement on this machine (with a note on what stays resident)."""
        ec = self.config.engine
        if self.device.type == "cuda" and ec.resident_fraction() and not planner.device_updates:
            raise ConfigError(
                f"optimizer {optimizer.name!r} updates on the CPU only (device_update = False), so no unit "
                f"can be resident on the GPU (engine.gpu_resident={ec.gpu_resident!r}); set "
                "engine.gpu_resident='none' (CLI: --gpu-resident none), or use an optimizer that updates "
                "on the GPU too (layer_adam, adamw_8bit)"
            )
        chosen = planner.choose(Placement.of(ec), self.machine())
        layout = chosen.layout
        self.notes.extend(chosen.notes)
        traded = planner.residency_note(layout, self.machine())
        if traded:
            self.notes.append(traded)
        if layout.activation_tier != "device" and "activation_tier" not in self.selections:  # "auto" chose it
            self.selections["activation_tier"] = self.plugins.select(
                "tier", layout.activation_tier, device_family(self.device)
            )
        for decide, policy in (
            (overlap_layout, self.config.optim.clip_overlap),
            (order_layout, ec.update_order),
        ):
            layout, note = decide(planner, layout, self.machine(), policy)
            if note:
                self.notes.append(note)
        self._check_fit(planner, layout)
        kept = [u for u in layout.units if u.resident]
        if kept:
            gib = sum(planner.resident_cost(u.index, slide=u.weights_slide) for u in kept) / 2**30
            sliding = sum(u.weights_slide for u in kept)
            what = "master, optimizer state, weights, gradients"
            if sliding:  # their BF16 weights are cast into the window from the device master at each visit
                what = f"master, optimizer state, and weights and gradients for {len(kept) - sliding} of them"
            self.notes.append(
                f"{len(kept)} of {len(layout.units)} units resident on {self.device} ({gib:.1f} GiB: {what}; "
                f"updated there){f'; {sliding} of them slide their weights into the window' if sliding else ''}"
            )
        return layout

    def _check_fit(self, planner: Planner, layout: Layout) -> None:
        """Refuse, before anything is allocated, a configuration this machine cannot hold, with the numbers
        and the fastest placement that would fit (``slidekit.planning.fit``)."""
        extra = []
        if self._kept_leftovers:
            extra.append(
                "the offload directory also holds other slidekit processes' files, left alone (their "
                f"owners live, or cannot be told): {owned.describe(self._kept_leftovers)}"
            )
        self.estimate = check_fit(
            planner, layout, self.machine(), seq_len_refusal=self._check_seq_len, disk_notes=extra
        )

