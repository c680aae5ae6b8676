"""Where a step's boundary activations go (``engine.activation_tier``), and what "auto" chose.

A recomputing layer saves its input (one hidden state per token, every
micro-batch) for the backward. "device" keeps those on the compute device;
a tier name puts them there (a host tier: RAM, copied down after the layer's
forward and up before its backward; a disk tier: a file in the offload
directory). "auto" (the default) takes the first of

    the device, the host role's tier, the disk role's tier (where the machine has an offload directory)

with which the whole placement fits the machine (``Planner.choose``). Moving
them off the device frees GPU memory (long sequences on small cards), at the
cost of their copies; it does not help a placement that lacks host RAM (a
unit "auto" residency then keeps on the GPU costs more there than it frees on
the host). Where none fits, the device's layout is the one refused, with the
placement that would fit.

Pure: no devices. Test: ``pytest tests/test_activation_tier.py``.
"""

from __future__ import annotations

from collections.abc import Sequence

from slidekit.planning.layout import Drivers, Layout, Placement
from slidekit.planning.machine import Machine

__all__ = ["AUTO", "activation_candidates", "activation_note"]

#: ``engine.activation_tier``'s value that lets the planner choose.
AUTO = "auto"


def activation_candidates(placement: Placement, drivers: Drivers, machine: Machine) -> list[str]:
    """The activation tiers "auto" tries, in order (one: the configured tier, where it is not "auto")."""
    if placement.activation_tier != AUTO:
        return [placement.activation_tier]
    out = ["device", drivers.host_tier]
    if machine.disk_free is not None and drivers.disk_tier:
        out.append(drivers.disk_tier)
    return [t for t in dict.fromkeys(out) if t]


def activation_note(chosen: Layout, refused: Sequence[tuple[str, Sequence[str]]]) -> str | None:
    """What "auto" chose, where it moved the activations off the device: each tier tried before, and
    what did not fit with it (``refused``: the tier and its shortfalls)."""
    if chosen.activation_tier == "device" or not refused:
        return None
    tried = "; ".join(f"on {'the GPU' if t == 'device' else t}: " + ", ".join(why) for t, why in refused)
    return (
        f"engine.activation_tier='auto': boundary activations on {chosen.activation_tier} "
        f"({chosen.activation_medium}), {chosen.activation_bytes / 2**30:.2f} GiB a step, because the "
        f"placement does not fit with them {tried} (--activation-tier device refuses instead)"
    )
