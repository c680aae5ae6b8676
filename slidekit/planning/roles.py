"""Tiers by role, not by name: the core never names a bundled tier.

A tier declares its ``medium`` ("device", "host" or "disk",
``slidekit.interfaces.TierDescriptor``). The roles a run needs are resolved
here, and only here, as the available tier of that medium with the highest
priority that serves the device:

    device   where resident units keep their optimizer state: the compute device's memory
             (on the CPU that is host RAM, so the host role serves it)
    host     RAM, what a placement falls back to when state or activations must leave the device
    disk     files in ``engine.offload_dir``, where the planner may move optimizer state

Test: ``pytest tests/test_planner.py -k role``.
"""

from __future__ import annotations

from slidekit.errors import DriverUnavailableError
from slidekit.plugins import Plugins, Selection

__all__ = ["device_tier", "tier_for"]


def tier_for(
    plugins: Plugins, medium: str, device_type: str, *, assume_available: bool = False
) -> Selection | None:
    """The available tier of ``medium`` with the highest priority that serves ``device_type``, or None.

    ``assume_available``: take the highest-priority one whatever this machine says of it (a what-if for
    a device this machine lacks, whose own memory's tier only that device could probe)."""
    for reg in plugins.drivers("tier"):
        if reg.descriptor.medium != medium or device_type not in reg.descriptor.devices:
            continue
        if assume_available:
            return Selection(reg, f"tier {reg.name!r} for {device_type}, assumed available (what-if)", True)
        ok, _ = plugins.availability("tier", reg.name)
        if ok:
            return plugins.select("tier", reg.name, device_type)
    return None


def device_tier(plugins: Plugins, device_type: str) -> Selection:
    """The tier resident units keep their state on: the compute device's memory (RAM on the CPU)."""
    medium = "host" if device_type == "cpu" else "device"
    found = tier_for(plugins, medium, device_type)
    if found is None:
        raise DriverUnavailableError(
            f"no storage tier of medium {medium!r} is available on {device_type}, so no unit can be resident "
            "there; install or unblock one (the bundled ones come with slidekit), or set "
            "engine.gpu_resident='none'"
        )
    return found
