"""What the machine has for a run: free device memory, available RAM, free disk where the run writes,
and (``rates``) what it sustains, for the step-time model.

``Machine.probe`` measures it (and takes the rates of a known GPU's profile,
``slidekit.planning.profiles``, or, for a GPU no profile knows, measures them
in about a second, ``slidekit.planning.probe``); tests and what-if planning
build one by hand
(``what_if`` names the figures given rather than probed). A data-parallel
rank plans on its share (``Machine.share``): the ranks of one host split its
RAM and disks, the ranks of one GPU its memory.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from slidekit.telemetry import proc_sizes

if TYPE_CHECKING:
    from slidekit.planning.probe import Probed
    from slidekit.planning.rates import Rates

__all__ = ["GIB", "Machine", "fmt_gib"]

GIB = 1 << 30


def fmt_gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f} GiB"


@dataclass(frozen=True, kw_only=True, slots=True)
class Machine:
    """What the machine has: free device memory, available RAM, free disk in the offload directory."""

    device_type: str  # "cpu", "cuda" or "rocm"
    device_free: int | None = None  # None on the CPU: the compute device's memory is host RAM
    device_total: int | None = None
    host_available: int
    host_total: int
    disk_free: int | None = None  # None: no offload directory given
    run_dir_free: int | None = None  # free space where run.dir lives; None: no run directory
    run_dir_checkpoints: int = 0  # step-* checkpoints already in the run directory
    run_dir_shares_disk: bool = False  # the run directory is on the offload directory's file system
    rates: Rates | None = None  # what it sustains (None: unknown, the planner then ranks by a fixed rule)
    probed: Probed | None = None  # the measurements ``rates`` were made of, for a GPU no profile knows
    gpu: str = ""  # the GPU's name (a profile's name in a what-if)
    what_if: frozenset[str] = frozenset()  # the figures given, not probed: "gpu", "ram", "disk"
    host_ranks: int = 1  # data-parallel ranks sharing this host's RAM and disks (this is one rank's share)
    device_ranks: int = 1  # data-parallel ranks sharing the compute device's memory

    def share(self, host_ranks: int, device_ranks: int = 1) -> Machine:
        """One rank's share of this machine, when ``host_ranks`` data-parallel ranks run on the host and
        ``device_ranks`` of them on the same device: free memory and disk divided evenly (every rank of a
        run holds the same shards' sizes, give or take a GRANULE), totals and rates kept."""
        if host_ranks < 1 or device_ranks < 1 or device_ranks > host_ranks:
            raise ValueError(
                f"a machine is shared by at least one rank per host and per device, and a device's ranks are "
                f"on its host: got host_ranks={host_ranks}, device_ranks={device_ranks}"
            )
        if (host_ranks, device_ranks) == (1, 1):
            return self

        def part(value: int | None, n: int) -> int | None:
            return None if value is None else value // n

        return dataclasses.replace(
            self,
            device_free=part(self.device_free, device_ranks),
            host_available=self.host_available // host_ranks,
            disk_free=part(self.disk_free, host_ranks),
            run_dir_free=part(self.run_dir_free, host_ranks),
            host_ranks=host_ranks,
            device_ranks=device_ranks,
        )

    @classmethod
    def probe(
        cls, device: object, offload_dir: str | None, run_dir: str | None = None, *, rates: bool = True
    ) -> Machine:
        """Measure this machine, for ``device`` (a torch.device), ``offload_dir`` and ``run_dir``; with
        ``rates=False`` a GPU no profile knows is left without rates (a data-parallel rank measures them
        once every rank has read its free memory: ``slidekit.distributed.planning.rank_machine``)."""
        import torch

        dev = torch.device(str(device))
        free = total = None
        kind = "cpu"
        gpu, found, probed = "", None, None
        if dev.type == "cuda":
            from slidekit.planning.profiles import profile_for_device

            free, total = torch.cuda.mem_get_info(dev)
            kind = "rocm" if torch.version.hip else "cuda"
            gpu = torch.cuda.get_device_name(dev)
            known = profile_for_device(gpu)
            if known is not None:
                found = known.rates
            elif rates:  # measured after the free memory was read: the probe's own blocks never count
                from slidekit.planning.probe import measure_once, rates_from

                probed = measure_once(dev)
                found = None if probed is None else rates_from(probed, gpu)
        info = proc_sizes("/proc/meminfo")
        host_total = info.get("MemTotal") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        host_available = info.get("MemAvailable", host_total)
        disk = run_free = None
        existing, shared = 0, False
        if offload_dir:
            disk = shutil.disk_usage(_existing(offload_dir)).free
        if run_dir:
            from slidekit.checkpoint import step_dirs

            run_free = shutil.disk_usage(_existing(run_dir)).free
            existing = len(step_dirs(Path(run_dir).expanduser() / "checkpoints"))
            if offload_dir:
                shared = os.stat(_existing(run_dir)).st_dev == os.stat(_existing(offload_dir)).st_dev
        return cls(
            device_type=kind,
            device_free=free,
            device_total=total,
            host_available=host_available,
            host_total=host_total,
            disk_free=disk,
            run_dir_free=run_free,
            run_dir_checkpoints=existing,
            run_dir_shares_disk=shared,
            rates=found,
            probed=probed,
            gpu=gpu,
        )

    def describe(self) -> str:
        """The machine in one line; a figure given for a what-if says so, and is compared with nothing."""
        parts = []
        if self.device_free is not None:
            name = f"{self.gpu} " if self.gpu else ""
            if "gpu" in self.what_if:
                parts.append(f"GPU {name}{fmt_gib(self.device_free)} free (what-if)")
            else:
                parts.append(f"GPU {name}{fmt_gib(self.device_free)} free of {fmt_gib(self.device_total or 0)}")
        if "ram" in self.what_if:
            parts.append(f"RAM {fmt_gib(self.host_available)} available (what-if)")
        else:
            parts.append(f"RAM {fmt_gib(self.host_available)} available of {fmt_gib(self.host_total)}")
        if self.disk_free is not None:
            parts.append(f"disk {fmt_gib(self.disk_free)} free" + (" (what-if)" if "disk" in self.what_if else ""))
        if self.run_dir_free is not None:
            parts.append(f"run directory {fmt_gib(self.run_dir_free)} free")
        out = ", ".join(parts)
        if self.host_ranks > 1:
            gpu = f", the GPU's memory among {self.device_ranks}" if self.device_ranks > 1 else ""
            out += f" (one rank's share: RAM and disks split among {self.host_ranks} ranks of this host{gpu})"
        return out


def _existing(directory: str) -> Path:
    """``directory``, or its nearest existing ancestor (it may not exist yet: ask its file system)."""
    path = Path(directory).expanduser()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path
