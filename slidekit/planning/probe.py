"""Rates for a GPU no profile knows: measured in about a second, scaled from the H200 profile.

The step-time model needs ``Rates`` to decide what "auto" settings take (the update order, speculative
clipping, the recommendation). ``slidekit.planning.profiles`` has them for GPUs measured with whole
benchmark suites (the H200); on any other GPU (an H100, an A100, an AMD card under ROCm) the planner
had none, so every "auto" fell back to its fixed choice: on an H100 host the forward update order,
15.9% faster at 3B batch 8 (docs/benchmarks/NOTES.md 34), was never taken.

``measure`` times five micro-benchmarks on the device and its host, each the median of a few repeats
after a warm-up: a bf16 matrix product (``matmul_tflops``), a device-to-device copy (``device_gbps``,
bytes read and written), page-locked copies each way (``h2d_gbps``, ``d2h_gbps``) and a host triad
``a = b + 2c`` over arrays larger than the caches (``host_gbps``, three arrays' bytes). ``rates_from``
scales each H200 figure by the ratio of the same measurement here to the H200's (``H200_PROBE``,
measured on the H200 machine this project benchmarks on): the layers' and head's achieved TFLOPS with
the matrix product, the device passes with the copy, the bus with the copies, the host optimizers'
rates and backups with the triad (they are bound by host memory). The per-step host overhead and the
disk are the H200 host's, said so in their sources (the disk tier's own bandwidth test measures it).

Machine.probe calls ``measure_once`` (once per device and process) where no profile matches a CUDA
device; a data-parallel run agrees on the slowest rank's measurements
(``slidekit.distributed.planning.rank_machine``), so every rank plans with the same rates. Memory: ~1.4 GiB on the device and 1 GiB of host RAM (a quarter of it
page-locked), all given back before it returns. Time: ~0.3 s on an H200 plus the page-locking.

Test: ``pytest tests/test_probe.py`` (the CPU runs ``measure`` at small sizes; the GPU gate on the GPU).
"""

from __future__ import annotations

import dataclasses
import statistics
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from slidekit.planning.rates import Rates, UpdateRate

__all__ = ["H200_PROBE", "Probed", "measure", "measure_once", "measure_or_none", "rates_from"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Probed:
    """What ``measure`` found: the five figures, each positive."""

    matmul_tflops: float  # bf16 matrix product, n x n x n
    device_gbps: float  # device-to-device copy, bytes read and written
    h2d_gbps: float  # page-locked host -> device copy
    d2h_gbps: float  # device -> page-locked host copy
    host_gbps: float  # host triad, three arrays' bytes

    def values(self) -> list[float]:
        return [getattr(self, f.name) for f in dataclasses.fields(self)]

    @classmethod
    def of(cls, values: Sequence[float]) -> Probed:
        names = [f.name for f in dataclasses.fields(cls)]
        if len(values) != len(names):
            raise ValueError(f"Probed.of: {len(names)} values needed ({', '.join(names)}), got {len(values)}")
        return cls(**dict(zip(names, (float(v) for v in values), strict=True)))


#: The same measurements on the H200 machine of the benchmarks (its device notes, 2026-10-28: an
#: 8192^3 bf16 product 788 TFLOPS, a device copy 4.3 TB/s read and written; the project's brief: pinned
#: copies 55 GB/s each way, host triad 95 GB/s), against which ``rates_from`` scales the H200 profile.
H200_PROBE = Probed(matmul_tflops=788.0, device_gbps=4300.0, h2d_gbps=55.0, d2h_gbps=55.0, host_gbps=95.0)


def _median_seconds(run: Callable[[], None], sync: Callable[[], None], repeats: int) -> float:
    run()  # warm-up: kernels chosen, pages touched
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(
    device: torch.device,
    *,
    matmul_n: int = 8192,
    copy_bytes: int = 512 << 20,
    bus_bytes: int = 256 << 20,
    host_bytes: int = 256 << 20,
    repeats: int = 5,
) -> Probed:
    """Time the five micro-benchmarks on ``device`` and its host (module docstring); the defaults are the
    sizes of the H200's measurements (the product) or large enough that launches and caches stay a small
    part; a test on the CPU gives small ones. A page-locking pool gives its buffers back."""
    cuda = device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    measured = Probed(
        matmul_tflops=_matmul_tflops(device, matmul_n, sync, repeats),
        device_gbps=_device_gbps(device, copy_bytes, sync, repeats),
        **_bus_gbps(device, bus_bytes, sync, repeats),
        host_gbps=_host_gbps(host_bytes, repeats),
    )
    if cuda:
        torch.cuda.empty_cache()  # the planner reads free memory again: give the cached blocks back
    return measured


def _matmul_tflops(device: torch.device, n: int, sync: Callable[[], None], repeats: int) -> float:
    # The BLAS library keeps the workspace of its first product for the process's life; made here, before the
    # large blocks, it takes a block of its own, and ``measure`` can give every block it used back (a workspace
    # cut from one of them would keep the whole block reserved).
    small = torch.ones(64, 64, device=device, dtype=torch.bfloat16)
    torch.mm(small, small)
    sync()
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    products = 4  # several products per timing, so launch latency stays a small part

    def multiply() -> None:
        for _ in range(products):
            torch.mm(a, b)

    return products * 2 * n**3 / _median_seconds(multiply, sync, repeats) / 1e12


def _device_gbps(device: torch.device, nbytes: int, sync: Callable[[], None], repeats: int) -> float:
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / _median_seconds(lambda: _copy(dst, src, False), sync, repeats) / 1e9


def _bus_gbps(device: torch.device, nbytes: int, sync: Callable[[], None], repeats: int) -> dict[str, float]:
    from slidekit.hostmem import HostBuffers

    cuda = device.type == "cuda"
    pool = HostBuffers(pin=cuda)
    try:
        host = pool.empty(nbytes // 4, torch.float32)
        host.fill_(1.0)
        dev = torch.empty(nbytes // 4, device=device)
        up = _median_seconds(lambda: _copy(dev, host, cuda), sync, repeats)
        down = _median_seconds(lambda: _copy(host, dev, cuda), sync, repeats)
    finally:
        pool.close()
    return {"h2d_gbps": nbytes / up / 1e9, "d2h_gbps": nbytes / down / 1e9}


def _host_gbps(nbytes: int, repeats: int) -> float:
    n = nbytes // 4
    x, y, z = torch.ones(n), torch.ones(n), torch.empty(n)

    def triad() -> None:
        torch.add(x, y, alpha=2.0, out=z)

    return 3 * nbytes / _median_seconds(triad, lambda: None, repeats) / 1e9


def _copy(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool) -> None:
    dst.copy_(src, non_blocking=non_blocking)


def rates_from(probed: Probed, gpu: str, *, base: Rates | None = None, base_probe: Probed = H200_PROBE) -> Rates:
    """``base`` (default: the H200 profile's rates) with each figure scaled by the ratio of ``probed`` to
    ``base_probe`` for the measurement that bounds it (module docstring); every source says how."""
    if base is None:
        from slidekit.planning.profiles import H200_RATES

        base = H200_RATES
    ratio = {name: mine / theirs for name, mine, theirs in _pairs(probed, base_probe)}
    for name, r in ratio.items():
        if not r > 0:
            raise ValueError(f"rates_from: {name} must be positive, measured {getattr(probed, name)}")
    here = f"probed on {gpu or 'this device'}"

    def scaled(field: str, by: str, what: str) -> tuple[float, str]:
        mine, theirs = getattr(probed, by), getattr(base_probe, by)
        value = getattr(base, field) * ratio[by]
        return value, (
            f"probed: {what}, the {base.name} figure x {mine:.4g} / {theirs:.4g} ({by}: {here} / on the H200; "
            "slidekit.planning.probe)"
        )

    fields = {
        "layer_tflops": scaled("layer_tflops", "matmul_tflops", "decoder layers"),
        "head_tflops": scaled("head_tflops", "matmul_tflops", "LM head"),
        "device_gbps": scaled("device_gbps", "device_gbps", "device passes"),
        "h2d_gbps": scaled("h2d_gbps", "h2d_gbps", "host -> device"),
        "d2h_gbps": scaled("d2h_gbps", "d2h_gbps", "device -> host"),
        "host_gbps": scaled("host_gbps", "host_gbps", "host memory"),
    }
    host = ratio["host_gbps"]
    sources = {name: source for name, (_, source) in fields.items()}
    for name in ("disk_read_gbps", "disk_write_gbps", "step_overhead_s"):
        sources[name] = f"assumed: the {base.name} host's figure, not probed ({base.sources.get(name, 'no source')})"
    backups = {}
    for name in ("backup_gbps", "backup_copy_gbps"):
        value = getattr(base, name)
        if value is not None:
            backups[name] = value * host
            sources[name] = f"probed: the {base.name} figure x the host triad's ratio {host:.3g} ({here})"
    updates = {
        name: UpdateRate(
            host_params_per_s=rate.host_params_per_s * host,
            device_bytes_per_param=rate.device_bytes_per_param,
            source=f"probed: the {base.name} host rate x the host triad's ratio {host:.3g} ({here}); {rate.source}",
        )
        for name, rate in base.updates.items()
    }
    return dataclasses.replace(
        base,
        name=f"{gpu or 'device'} (probed)",
        **{name: value for name, (value, _) in fields.items()},
        **backups,
        updates=updates,
        sources=sources,
    )


def _pairs(a: Probed, b: Probed) -> list[tuple[str, float, float]]:
    return [(f.name, getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(Probed)]


def measure_or_none(device: torch.device) -> Probed | None:
    """``measure``, or None with a warning when it cannot run (the device's memory is taken, a copy
    fails): the plan then has no rates and every "auto" keeps its fixed choice, as before probing."""
    try:
        return measure(device)
    except (RuntimeError, OSError) as exc:  # torch.cuda.OutOfMemoryError is a RuntimeError
        warnings.warn(
            f"could not measure the rates of {device} ({exc}); planning without rates: the \"auto\" settings "
            "keep their fixed choices (engine.update_order, optim.clip_overlap)",
            RuntimeWarning,
            stacklevel=2,
        )
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return None


#: What ``measure_once`` found per device in this process ("cuda:0" -> figures, or None when it could not).
_MEASURED: dict[str, Probed | None] = {}
_MEASURED_LOCK = threading.Lock()


def measure_once(device: torch.device) -> Probed | None:
    """``measure_or_none`` the first time a process asks about ``device``, the same figures after: a
    process that builds several trainers (a benchmark's batches, a test suite) probes each GPU once, and
    its plans agree with each other."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = str(device)
    with _MEASURED_LOCK:
        if key not in _MEASURED:
            _MEASURED[key] = measure_or_none(device)
        return _MEASURED[key]
