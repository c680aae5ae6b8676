"""What the planner tests share: a tiny model's spec, a planner for it, and a CUDA machine of given sizes.

``tests/test_planner.py`` (the memory plan) and ``tests/test_timing.py`` (the step-time model) import
these; the timing tests add their round-figure rates and the optimizer whose update rate they set.
"""

from __future__ import annotations

import dataclasses

from slidekit.models.base import ArchSpec
from slidekit.planning import GIB, Machine, Planner, Rates, Workload
from slidekit.planning.layout import Layout
from slidekit.planning.simulate import SimResult
from slidekit.planning.timing import replay_step
from slidekit.plugins import Plugins
from slidekit.testing.models import tiny_config

#: Each tier's medium, as the bundled tiers declare it.
MEDIA = {"ram": "host", "posix": "disk", "gds": "disk", "gpu": "device"}


def tiny_spec(family: str = "llama", **overrides: object) -> ArchSpec:
    """The ArchSpec of the tiny ``family`` model (``slidekit.testing.models.tiny_config``)."""
    hf = tiny_config(family, **overrides)
    return Plugins().adapter_for(hf.model_type).descriptor.factory(hf)


def planner(spec: ArchSpec, *, batch: int = 4, seq: int = 32, accum: int = 1, **kw: object) -> Planner:
    """A planner of ``spec`` for a CUDA device with BF16 compute and 8 bytes of state per parameter;
    ``kw`` replaces or adds Planner arguments."""
    args: dict[str, object] = {
        "compute_itemsize": 2,
        "state_bytes": lambda n: 8 * n,
        "media": MEDIA,
        "device_type": "cuda",
    }
    args.update(kw)
    return Planner(spec, Workload(batch_size=batch, seq_len=seq, grad_accum=accum), **args)  # type: ignore[arg-type]


def cuda_machine(
    gpu: float = 80.0, ram: float = 64.0, disk: float | None = None, rates: Rates | None = None
) -> Machine:
    """A CUDA machine with ``gpu`` GiB free of ``gpu``, ``ram`` GiB of host memory, ``disk`` GiB free
    (None: no disk) and ``rates`` (None: unknown)."""
    return Machine(
        device_type="cuda",
        device_free=int(gpu * GIB),
        device_total=int(gpu * GIB),
        host_available=int(ram * GIB),
        host_total=int(ram * GIB),
        disk_free=None if disk is None else int(disk * GIB),
        rates=rates,
    )


def replay(layout: Layout, rates: Rates, p: Planner, *, rollback: bool = False, fused: bool = True) -> SimResult:
    """The step-time model's replay of ``layout``, as ``predict_step`` runs it (``replay_step``), for what its
    result keeps beyond the prediction (``SimResult.takes``)."""
    return replay_step(layout, rates, dataclasses.replace(p.work, fused_backup=fused), rollback=rollback)
