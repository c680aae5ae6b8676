"""Per-rank planning: each rank of a data-parallel run plans its own shards on its share of the machine.

Every rank plans its layout itself (``Planner(..., world, rank)``: its shards'
masters, state and gradient buffers), and every rank must take the same
decisions: which units are resident, where each unit's state goes, the
window. The collectives follow those decisions (a resident unit is gathered
by a different lane than a sliding one), so ranks that planned differently
would wait for each other forever. Two things make them agree:

* ``rank_machine``: the machine each rank plans on is the same for all. Every
  rank probes, then one collective takes the least free memory and disk any
  rank saw (which is also a barrier: no rank allocates before every rank has
  probed, so no probe sees another rank's buffers), and each rank takes its
  share of it: the ranks of one host split its RAM and disks, the ranks of
  one GPU its memory (``Machine.share``). Where the rates were probed (a GPU
  no profile knows, ``slidekit.planning.probe``), a second collective takes
  the slowest rank's measurements, so every rank prices layouts alike.
* ``check_same_decisions``: before anything is allocated, the ranks compare a
  digest of their decisions, and refuse to start when they differ.

Test: ``pytest tests/distributed/test_dp_planning.py``.
"""

from __future__ import annotations

import dataclasses
import math
import zlib

from slidekit.distributed.group import DataParallel
from slidekit.errors import ConfigError
from slidekit.planning.layout import Layout
from slidekit.planning.machine import Machine

__all__ = ["check_same_decisions", "decisions", "rank_machine"]

#: The free figures of a ``Machine`` every rank must plan with alike (the least any rank saw).
_FREE = ("device_free", "host_available", "disk_free", "run_dir_free")


def rank_machine(machine: Machine, parallel: DataParallel, device: object = None) -> Machine:
    """This rank's share of ``machine``, planned on the least free memory and disk any rank measured, and
    on rates every rank shares: where ``machine`` has none for a GPU no profile knows, each rank probes
    its ``device`` once every rank has read its free memory, and all take the slowest measurements.

    Collectives on the ``control`` group: every rank calls it once, at the same point of its set-up.
    """
    seen = [getattr(machine, name) for name in _FREE]
    least = parallel.all_reduce([math.inf if v is None else float(v) for v in seen], op="min")
    device_free, host_available, disk_free, run_dir_free = (None if math.isinf(v) else int(v) for v in least)
    agreed = dataclasses.replace(
        machine,
        device_free=device_free,
        host_available=machine.host_available if host_available is None else host_available,
        disk_free=disk_free,
        run_dir_free=run_dir_free,
    )
    agreed = _agreed_rates(agreed, parallel, device)
    host, device = parallel.sharing()
    return agreed.share(host, device)


def _agreed_rates(machine: Machine, parallel: DataParallel, device: object) -> Machine:
    """The rates every rank plans with where they are probed (a GPU no profile knows; probed here, after
    the free-memory collective, when ``machine`` has none and ``device`` is given): made of the slowest
    rank's measurements, each figure the least any rank measured, so the ranks decide alike
    (``check_same_decisions``). One collective on ``control``, whether or not this rank probed."""
    import torch

    from slidekit.planning.probe import Probed, measure_once, rates_from

    probed = machine.probed
    if probed is None and machine.rates is None and device is not None:
        dev = torch.device(str(device))
        if dev.type == "cuda":
            probed = measure_once(dev)  # None (a warning) where it cannot: the other ranks' figures
    width = len(Probed.__dataclass_fields__)
    mine = [math.inf] * width if probed is None else probed.values()
    least = parallel.all_reduce([float(v) for v in mine], op="min")
    if any(math.isinf(v) for v in least):
        return machine  # no rank probed: every rank has its profile's rates (or none)
    probed = Probed.of(least)
    return dataclasses.replace(machine, probed=probed, rates=rates_from(probed, machine.gpu))


def decisions(layout: Layout) -> str:
    """What every rank's layout must have alike: placement, per unit where it lives, its state tier and
    whether it keeps its activations, the window, whether steps keep every gradient for the norm and the
    activation tier (not the shard sizes, which differ by rank, nor the order of a rank's host updates,
    ``Layout.forward_updates``: it is the rank's own, and the bits are the same either way)."""
    units = [(u.index, u.resident, u.state_tier, u.keeps) for u in layout.units]
    w = layout.window
    return repr(
        (
            layout.placement,
            units,
            (w.window, w.slot_numel),
            layout.prefetch,
            layout.unit_grads and not layout.forward_updates,
            layout.activation_tier,
        )
    )


def check_same_decisions(layout: Layout, parallel: DataParallel) -> None:
    """Refuse to start when the ranks' layouts decided differently (one collective on ``control``)."""
    if parallel.same(zlib.crc32(decisions(layout).encode())):
        return
    kept = sum(u.resident for u in layout.units)
    raise ConfigError(
        f"rank {parallel.rank}: the data-parallel ranks planned different layouts (this rank keeps {kept} of "
        f"{len(layout.units)} units resident, placement {layout.placement.flags()}); every rank must place "
        "its units alike. Give every rank the same configuration, or fix the placement (e.g. "
        "--gpu-resident none or all, --state-offload-fraction) instead of 'auto'"
    )
