"""The engine builder: allocates exactly what a ``slidekit.planning.Layout`` says and returns the engine.

    layout = planner.layout(placement, machine)          # decided once (slidekit.planning)
    engine = build_engine(layout, parts)                 # allocated once, here

Per unit: its FP32 master (on the compute device when resident, else in host
RAM, page-locked with an accelerator), its optimizer state on the tier the
layout names, and, when resident, its own cache unit (none when its weights
slide: then, when the step defers its updates, a device gradient buffer of its
own). For the run: the
window's cache units, the gradient ring, the per-unit gradient buffers of a
step that keeps every gradient, the host units' upload copies, the upload staging buffer, the state staging
sets, and the activation store. Before anything is allocated, the tiers'
capacity is checked against what the layout puts on them.

``footprint(engine)`` measures what a built engine holds, per medium, from
the tensors and the tiers' own counters: ``tests/engine/test_build.py`` checks
it against ``Layout.allocations`` for random configurations.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from slidekit.config import upload_copy_dtype_error
from slidekit.distributed.group import DataParallel
from slidekit.engine.activations import DeviceActivations, TierActivations
from slidekit.engine.collectives import Collectives
from slidekit.engine.core import Engine
from slidekit.engine.host import HostStore
from slidekit.engine.runtime import Pipeline, Streams
from slidekit.engine.state import slice_groups
from slidekit.engine.window import Window
from slidekit.errors import ConfigError
from slidekit.interfaces import KernelSet, ParamGroupRange, StorageTier, UnitOptimizer
from slidekit.models.base import ArchSpec
from slidekit.planning.layout import Layout

__all__ = ["EngineParts", "build_engine", "footprint"]

GIB = float(1 << 30)


@dataclass(frozen=True, kw_only=True)
class EngineParts:
    """The runtime pieces a layout is built with: drivers, device, dtype and the pipeline's settings.

    ``tier(name)`` returns the (shared) instance of a storage tier; ``task_hook(lane)`` is the
    pipeline's fault-injection seam (``Trainer``'s ``fault_hook``).
    """

    spec: ArchSpec
    kernels: KernelSet
    optimizer: UnitOptimizer
    tier: Callable[[str], StorageTier]
    device: torch.device
    compute_dtype: torch.dtype
    groups: Sequence[Sequence[ParamGroupRange]]
    loss_chunk: int | None
    timeout_s: float
    task_hook: Callable[[str], None] | None = None
    offload_dir: str | None = None  # named in capacity errors
    parallel: DataParallel | None = None  # this process's rank of a data-parallel run (None: one process)


def _check_layout(layout: Layout) -> None:
    for u in layout.units:
        if u.slides and u.state_medium == "device":
            raise ConfigError(
                f"optimizer state of unit {u.index} is in device memory (tier {u.state_tier!r}), but the unit is "
                "updated on the CPU; use a host tier (ram, posix, gds) for engine.state_tier / "
                "state_offload_tier, and engine.gpu_resident to keep whole units on the device"
            )


def _check_capacity(layout: Layout, parts: EngineParts) -> None:
    """Refuse, before anything is written, a layout whose tiers lack the space for it."""
    need: dict[str, list[int]] = {}  # tier name -> [state bytes, activation bytes]
    for u in layout.units:
        need.setdefault(u.state_tier, [0, 0])[0] += u.state_bytes
    if layout.activation_tier != "device":
        need.setdefault(layout.activation_tier, [0, 0])[1] += layout.activation_bytes
    for name, (state, acts) in need.items():
        capacity = parts.tier(name).stats().capacity
        if capacity is not None and state + acts > capacity:
            where = f" in {parts.offload_dir}" if parts.offload_dir else ""
            raise ConfigError(
                f"storage tier {name!r}{where} needs {(state + acts) / GIB:.2f} GiB "
                f"(optimizer state {state / GIB:.2f} GiB, activations {acts / GIB:.2f} GiB) but has "
                f"{capacity / GIB:.2f} GiB free; free space, use another offload_dir, lower "
                "state_offload_fraction, or keep activations elsewhere"
            )


def _check_rank(layout: Layout, dp: DataParallel | None) -> None:
    """Refuse a layout planned for another data-parallel rank (its shards would not be this rank's)."""
    world, rank = (dp.world, dp.rank) if dp else (1, 0)
    if (layout.world, layout.rank) != (world, rank):
        raise ConfigError(
            f"the layout was planned for data-parallel rank {layout.rank} of {layout.world}, but this process is "
            f"rank {rank} of {world}; plan with Planner(..., world={world}, rank={rank}) "
            "(Planner.for_run does, given the run's DataParallel)"
        )


def build_engine(layout: Layout, parts: EngineParts) -> Engine:
    """Allocate ``layout`` and return the engine that runs it (closed again if building fails)."""
    if layout.upload_copy and parts.compute_dtype != torch.bfloat16:  # the optimizers write BF16 copies only
        raise ConfigError(upload_copy_dtype_error(str(parts.compute_dtype).removeprefix("torch.")))
    _check_rank(layout, parts.parallel)
    _check_layout(layout)
    _check_capacity(layout, parts)
    spec, device, dtype = parts.spec, parts.device, parts.compute_dtype
    dp = parts.parallel
    pipeline = Pipeline(parts.timeout_s, task_hook=parts.task_hook, on_fail=dp.report if dp else None)
    shards = layout.shards
    host = acts = None
    try:
        host = HostStore(
            layout,
            spec.units,
            optimizer=parts.optimizer,
            state_tiers=[parts.tier(u.state_tier) for u in layout.units],
            pin=device.type == "cuda",
            grad_dtype=dtype,
            pipeline=pipeline,
            device=device,
        )
        w = layout.window
        # Data-parallel: a unit's buffers hold ``world`` equal pieces (a few GRANULEs more than the unit).
        window = Window(w.window, w.slot_numel, dtype, device, pipeline, deterministic=dp is not None)
        device_grads: dict[int, torch.Tensor] = {}
        for u in layout.units:
            if u.resident and not u.weights_slide:  # its own cache unit for good, outside the rotating window
                window.add_resident(u.index, u.padded)
            elif u.weights_slide and layout.device_grads:  # its gradients, kept until the step's end
                device_grads[u.index] = torch.empty(u.own, dtype=dtype, device=device)
        acts = (
            DeviceActivations()
            if layout.activation_tier == "device"
            else TierActivations(parts.tier(layout.activation_tier), device, pipeline)
        )
        stage = (
            torch.empty(layout.upload_staging, dtype=torch.float32, device=device)
            if layout.upload_staging
            else None
        )
        streams = Streams(device)
        groups = parts.groups
        if dp is not None:  # each rank updates its shard: the parameter groups in shard coordinates
            groups = [slice_groups(g, s.start, s.stop) for g, s in zip(groups, shards, strict=True)]
        return Engine(
            spec,
            layout=layout,
            kernels=parts.kernels,
            optimizer=parts.optimizer,
            host=host,
            window=window,
            activations=acts,
            pipeline=pipeline,
            streams=streams,
            upload_staging=stage,
            groups=groups,
            device=device,
            compute_dtype=dtype,
            loss_chunk=parts.loss_chunk,
            collectives=None if dp is None else Collectives(dp, pipeline, streams, shards),
            device_grads=device_grads,
        )
    except BaseException:
        pipeline.close()
        if acts is not None:
            acts.close()
        if host is not None:
            host.close()
        raise


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def footprint(engine: Engine, tiers: Mapping[str, StorageTier]) -> dict[str, dict[str, int]]:
    """What a built engine holds, measured from its tensors, and per tier from the tier's own counter.

    "device" and "host" follow ``Layout.allocations``' names (state as the mapped tensors: resident
    units' under "resident"; the device gradient buffers of units whose weights slide under "gradients"); "tiers" maps each of ``tiers`` to its ``bytes_allocated``, which holds
    streamed state too, and activations once a step has saved them.
    """
    host, layout, window = engine.host, engine.layout, engine.window

    def mapped(unit: int) -> int:
        return sum(_nbytes(t) for t in (host.state.mapped(unit) or {}).values())

    resident = [u.index for u in layout.units if u.resident]
    sliding = [u for u in layout.units if u.slides]

    def own(unit: int) -> int:  # a resident unit's weights and gradients (none when its weights slide)
        slot = window.resident.get(unit)
        return 0 if slot is None else _nbytes(slot.params) + _nbytes(slot.grads)

    device = {
        "window": sum(_nbytes(s.params) + _nbytes(s.grads) for s in window.slots),
        "resident": sum(own(u) + _nbytes(host.masters[u]) + mapped(u) for u in resident),
        "staging": 0 if engine.upload_stage is None else _nbytes(engine.upload_stage),
    }
    if engine.device_grads:
        device["gradients"] = sum(_nbytes(g) for g in engine.device_grads.values())
    on_device = sum(mapped(u.index) for u in sliding if u.state_medium == "device")
    if on_device:
        device["state"] = on_device
    out_host = {
        "masters": sum(_nbytes(host.masters[u.index]) for u in sliding),
        "state": sum(mapped(u.index) for u in sliding if u.state_medium == "host"),
        "state staging": host.state.staging_bytes(),
        "gradients": sum(_nbytes(b) for b in host.ring.buffers) + host.unit_grad_bytes(),
    }
    if layout.clip_backup:
        out_host["clip backup"] = host.backup_bytes()
    if layout.upload_copy:
        out_host["upload copies"] = host.copy_bytes()
    return {
        "device": device,
        "host": out_host,
        "tiers": {name: tier.stats().bytes_allocated for name, tier in tiers.items()},
    }
