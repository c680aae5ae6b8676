"""Planning for a GPU this machine may lack: ``slidekit plan --gpu NAME`` (a profile, ``slidekit.planning.profiles``).

``what_if_setup`` resolves a configuration for that GPU's device family
without touching a device: the model's spec as ``slidekit.resolve`` reads it,
the compute dtype a CUDA device gets, and the drivers that device would get;
drivers that only the device itself could probe (kernel sets, tiers of the
device's memory) count as available, everything else is selected as usual.
``what_if_machine`` puts the profile's device memory and rates together with
what was given (``--gpu-gib``, ``--ram-gib``, ``--disk-gib``) and, for the rest,
this machine's RAM and disks; every given figure is marked as a what-if.

Test: ``pytest tests/test_timing.py -k what_if``.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from slidekit.errors import ConfigError, DriverUnavailableError
from slidekit.planning.machine import GIB, Machine
from slidekit.planning.profiles import GpuProfile, profile

if TYPE_CHECKING:
    from slidekit.config import TrainConfig
    from slidekit.plugins import Plugins, Selection
    from slidekit.resolve import RunSetup

__all__ = ["plan_machine", "what_if_machine", "what_if_setup"]

FAMILY = "cuda"  # every profile is an NVIDIA GPU


def plan_machine(
    config: TrainConfig,
    *,
    gpu: str | None = None,
    gpu_gib: float | None = None,
    ram_gib: float | None = None,
    disk_gib: float | None = None,
) -> tuple[Machine, GpuProfile | None]:
    """The machine ``slidekit plan`` plans for: with ``gpu`` (a profile's name) that GPU, this machine's
    RAM and disks otherwise; without, this machine; either way with the given figures instead of the
    probed ones, each marked as a what-if. Returns it and the profile (None without ``gpu``)."""
    ec = config.engine
    if gpu is not None:
        chosen = profile(gpu)
        here = Machine.probe("cpu", ec.offload_dir, config.run.dir)
        return what_if_machine(chosen, here, gpu_gib=gpu_gib, ram_gib=ram_gib, disk_gib=disk_gib), chosen
    from slidekit.resolve import resolve_device

    machine = Machine.probe(resolve_device(ec.device), ec.offload_dir, config.run.dir)
    changes: dict[str, Any] = {}
    given = set()
    if gpu_gib is not None:
        if machine.device_free is None:
            raise ConfigError(
                "--gpu-gib plans for a GPU, but this run computes on the CPU; add --gpu NAME (a profile: "
                "h200, rtx4090) or --device cuda on a machine with one"
            )
        changes["device_free"] = changes["device_total"] = int(gpu_gib * GIB)
        given.add("gpu")
    if ram_gib is not None:
        changes["host_available"] = changes["host_total"] = int(ram_gib * GIB)
        given.add("ram")
    if disk_gib is not None:
        changes["disk_free"] = int(disk_gib * GIB)
        given.add("disk")
    return dataclasses.replace(machine, what_if=frozenset(given), **changes), None


def what_if_machine(
    gpu: GpuProfile,
    here: Machine,
    *,
    gpu_gib: float | None = None,
    ram_gib: float | None = None,
    disk_gib: float | None = None,
) -> Machine:
    """``gpu``'s memory (or ``gpu_gib`` free) and rates; RAM and disk from ``here`` unless given."""
    given = {"gpu"}
    free, total = gpu.device_free, gpu.device_total
    if gpu_gib is not None:
        free = total = int(gpu_gib * GIB)
    changes: dict[str, object] = {}
    if ram_gib is not None:
        given.add("ram")
        changes["host_available"] = changes["host_total"] = int(ram_gib * GIB)
    if disk_gib is not None:
        given.add("disk")
        changes["disk_free"] = int(disk_gib * GIB)
    return dataclasses.replace(
        here,
        device_type=FAMILY,
        device_free=free,
        device_total=total,
        rates=gpu.rates,
        gpu=gpu.name,
        what_if=frozenset(given) | here.what_if,
        **changes,  # type: ignore[arg-type]
    )


def what_if_setup(config: TrainConfig, plugins: Plugins) -> RunSetup:
    """``slidekit.resolve.resolve`` for a CUDA device, whether or not this machine has one."""
    import torch

    from slidekit.resolve import RunSetup, compute_dtype, resolve_spec

    ec = config.engine
    if ec.device not in ("auto", "cuda") and not ec.device.startswith("cuda:"):
        raise ConfigError(
            f"--gpu plans for a CUDA device, but engine.device is {ec.device!r}; leave --device out or "
            "give --device cuda"
        )
    device = torch.device("cuda")
    spec, hf_config, model_dir = resolve_spec(config, plugins)
    selections = {
        "kernels": _device_driver(plugins, "kernels", ec.kernels),
        "optimizer": plugins.select("optimizer", config.optim.name, FAMILY),
        "state_tier": _tier(plugins, ec.state_tier),
    }
    if ec.activation_tier not in ("device", "auto"):
        selections["activation_tier"] = _tier(plugins, ec.activation_tier)
    if ec.state_offload_fraction > 0 and ec.state_offload_tier:
        selections["state_offload_tier"] = _tier(plugins, ec.state_offload_tier)
    return RunSetup(
        device=device,
        family=FAMILY,
        compute_dtype=compute_dtype(ec.compute_dtype, device),
        hf_config=hf_config,
        model_dir=model_dir,
        spec=spec,
        selections=selections,
    )


def _device_driver(plugins: Plugins, family: str, name: str) -> Selection:
    """A driver only the device could probe: the named one if it serves CUDA, or for "auto" the one of
    the highest priority that does, taken as available."""
    from slidekit.plugins import FAMILIES, Selection

    noun = FAMILIES[family].noun
    serving = [r for r in plugins.drivers(family) if FAMILY in r.descriptor.devices]
    if name not in ("auto", None):
        reg = plugins.get(family, name)
        if FAMILY not in reg.descriptor.devices:
            raise DriverUnavailableError(
                f"{noun} {name!r} does not run on {FAMILY}; choose one of: {', '.join(r.name for r in serving)}"
            )
        return Selection(
            reg, f"{noun} {name!r} as configured, assumed available on the {FAMILY} device", False
        )
    if not serving:
        raise DriverUnavailableError(f"no {noun} serves {FAMILY}; install one (slidekit ships triton_cuda)")
    best = max(serving, key=lambda r: r.descriptor.priority)
    return Selection(best, f"{noun} {best.name!r}, the one a {FAMILY} device would select (what-if)", True)


def _tier(plugins: Plugins, name: str) -> Selection:
    """A tier for the what-if device: one of the device's memory is taken as available; others as usual."""
    reg = plugins.get("tier", name)
    if reg.descriptor.medium == "device":
        return _device_driver(plugins, "tier", name)
    return plugins.select("tier", name, FAMILY)
