"""Machine profiles: the device memory and ``Rates`` of the GPUs the planner knows, for what-ifs.

    slidekit plan --model DIR --gpu h200 --ram-gib 512       # plan for an H200 box from any machine
    slidekit plan --model DIR --gpu rtx4090 --ram-gib 256

``h200`` is the machine the benchmarks ran on, every figure measured there
(sources name the page or record; ``benchmarks/calibrate_rates.py`` derives
the compute figures from the raw suite records). ``rtx4090`` is not measured:
its memory, tensor rate, memory bandwidth and bus are NVIDIA's published
figures scaled by the share of the H200's published figures that the H200
achieved here, and its host (CPU, RAM bandwidth, disk) is an assumed 256 GB
workstation; each source says which. ``Machine.probe`` takes a profile's
rates when the GPU it finds has the profile's name in its own, and probes them for
any other GPU (``slidekit.planning.probe``: five micro-benchmarks scaling these figures).

Test: ``pytest tests/test_timing.py -k profile``.
"""

from __future__ import annotations

from dataclasses import dataclass

from slidekit.errors import ConfigError
from slidekit.planning.machine import GIB
from slidekit.planning.rates import Rates, UpdateRate

__all__ = ["PROFILES", "GpuProfile", "profile", "profile_for_device"]


@dataclass(frozen=True, kw_only=True, slots=True)
class GpuProfile:
    """A GPU and the machine around it, as the planner sees them."""

    name: str
    description: str
    device_total: int  # bytes of device memory
    device_free: int  # bytes free to a fresh process (the CUDA context takes the rest)
    memory_source: str
    rates: Rates
    matches: tuple[str, ...]  # substrings of torch.cuda.get_device_name() that mean this GPU


_H200_PAGE = "docs/benchmarks"
#: NVIDIA H200 SXM data sheet: BF16 tensor 1,979 TFLOPS with sparsity (989.5 dense), HBM3e 4.8 TB/s,
#: PCIe Gen5 x16 (63 GB/s each way).
_H200_PUBLISHED = {"bf16_tflops": 989.5, "memory_gbps": 4800.0, "bus_gbps": 63.0}
_SUITES = "raw/2026-12-01-s6/suite-qwen2.5-3b.jsonl and raw/2026-12-01-s7/suite-qwen2.5-7b.jsonl"
#: Speculative clipping's backups on the H200 host, effective, written in the update's pass (fused_backup):
#: in the 3B forced-offload batch-32 traces of raw/2026-12-02-s15/ratio-clip-3b (NOTES.md 30 and 31) a
#: layer's update (77.08 M parameters) took 24.06 ms backing up against 16.86 ms unclipped; 24 B/param
#: (master and moments, read and written) over the 7.20 ms more is 257 GB/s.
_H200_BACKUP_GBPS = 257.0
_BACKUP_TRACES = "raw/2026-12-02-s15/ratio-clip-3b/traces-clip.tar"
#: ... and copied beside each chunk's update (before the fusion): the 3B forced-offload batch-32 step's host
#: update lane took 2.813 s speculating (a clip that never fires) and 0.723 s unclipped; the 2.090 s
#: more over 3.086 G parameters at 24 B/param is 35.4 GB/s.
_H200_BACKUP_COPY_GBPS = 35.4
_LEVERS = "raw/2026-12-02-s10/levers-3b/suite-levers-qwen2.5-3b.jsonl"
#: adamw_fp8 on the H200 host: the fused kernel, 233M unit, 16 threads, median of 5 (NOTES section 21).
_FP8_HOST = 5.687e9
#: adamw_8bit's host kernel on the H200 host, measured in the same rounds (raw/2026-12-02-s10/fp8_rate.json).
_8BIT_HOST = 3.663e9
#: adamw_fp8 updates on the host only, so the planner never prices a device update for it (no unit is
#: resident with it); UpdateRate needs a figure: 16 B/param, the bytes its fused pass moves per parameter
#: (gradient 2, master 8, codes 4, BF16 copy 2), what a device pass of the same arithmetic would move.
_FP8_DEVICE_BYTES = 16.0
_FP8_NO_DEVICE = (
    "not applicable, host only (device_update = False: no unit is resident with it); 16 B/param is the "
    "bytes its fused pass moves (gradient 2, master 8, codes 4, BF16 copy 2), never used"
)

H200_RATES = Rates(
    name="h200 (measured)",
    layer_tflops=604.3,
    head_tflops=505.5,
    device_gbps=4138.0,
    h2d_gbps=51.5,
    d2h_gbps=51.5,
    host_gbps=95.0,
    disk_read_gbps=2.09,
    disk_write_gbps=2.79,
    step_overhead_s=0.0073,
    backup_gbps=_H200_BACKUP_GBPS,
    backup_copy_gbps=_H200_BACKUP_COPY_GBPS,
    updates={
        "layer_adam": UpdateRate(
            host_params_per_s=4.32e9,
            device_bytes_per_param=28.0,
            source=(
                "measured: host 4.32 G params/s (benchmarks/optimizer_rate.py, 16 threads, "
                f"{_H200_PAGE}/2026-11-29-session2.md); device 28 B/param, its fused pass (read BF16 "
                "gradient, FP32 master and moments; write them and the BF16 weights)"
            ),
        ),
        "adamw_8bit": UpdateRate(
            host_params_per_s=_8BIT_HOST,
            device_bytes_per_param=16.0,
            source=(
                "measured: host 3.663 G params/s (benchmarks/fp8_codec.py rate, 16 threads, 233M unit, "
                f"beside adamw_fp8: {_H200_PAGE}/raw/2026-12-02-s10/fp8_rate.json; it replaces session 2's 2.352, "
                "an older measurement below it); device: "
                "derived, not measured: 16 B/param its fused Triton pass moves (gradient 2, master 8, "
                "codes 4, BF16 weights 2) at the measured device bandwidth"
            ),
        ),
        "adamw_fp8": UpdateRate(
            host_params_per_s=_FP8_HOST,
            device_bytes_per_param=_FP8_DEVICE_BYTES,
            source=(
                "measured: host 5.687 G params/s (benchmarks/fp8_codec.py rate, 16 threads, "
                f"{_H200_PAGE}/raw/2026-12-02-s10/fp8_rate.json); device: {_FP8_NO_DEVICE}"
            ),
        ),
    },
    sources={
        "layer_tflops": (
            "measured: model FLOPs of the decoder layers (forward + recompute + backward = 4 x forward) "
            f"over their fwd + bwd lanes, the all-resident cells of {_SUITES} pooled "
            "(benchmarks/calibrate_rates.py)"
        ),
        "head_tflops": "measured: 6 x vocab x hidden x tokens over the head lane, the same cells",
        "device_gbps": (
            "measured: the update_gpu lane of the same cells at layer_adam's 28 B/param (148 G params/s)"
        ),
        "h2d_gbps": (
            f"measured: pinned host -> device, the ram tier to GPU memory ({_H200_PAGE}/"
            "2026-11-29-h200-session.md, Storage tiers)"
        ),
        "d2h_gbps": (
            "measured: device -> pinned host, the same table; the suites' d2h_copy lanes give 51-53 GB/s"
        ),
        "host_gbps": f"measured: STREAM triad, 16 threads ({_H200_PAGE}/2026-11-29-session3.md)",
        "backup_gbps": (
            "measured: a layer's host update backing up (fused) and unclipped in the 3B forced-offload "
            f"batch-32 traces ({_H200_PAGE}/{_BACKUP_TRACES}), the difference over 24 B/param"
        ),
        "backup_copy_gbps": (
            "measured: the host update lanes of the 3B forced-offload batch-32 runs speculating (backups "
            f"copied, before the fusion) and unclipped ({_H200_PAGE}/{_LEVERS}), the difference over 24 B/param"
        ),
        "disk_read_gbps": (
            f"measured: the posix tier, O_DIRECT, 16 MiB chunks, 2 I/O threads ({_H200_PAGE}/"
            "2026-11-29-h200-session.md, Storage tiers)"
        ),
        "disk_write_gbps": "measured: the same table",
        "step_overhead_s": (
            "measured: each all-resident cell's step minus its device lanes and modelled gradient passes, "
            "averaged (benchmarks/calibrate_rates.py)"
        ),
    },
)


def _scaled(h200: float, published_here: float, published_h200: float) -> float:
    """A figure of another GPU: its published figure times the share of the H200's that the H200 achieved."""
    return round(h200 * published_here / published_h200, 1)


#: NVIDIA Ada Lovelace architecture whitepaper (appendix A): GeForce RTX 4090, peak BF16 tensor TFLOPS
#: with FP32 accumulate 165.2 dense (330.4 with sparsity); 24 GB GDDR6X at 1,008 GB/s; PCIe Gen4 x16
#: (31.5 GB/s each way).
_RTX4090_PUBLISHED = {"bf16_tflops": 165.2, "memory_gbps": 1008.0, "bus_gbps": 31.5}
#: The assumed workstation around it: a 16-core desktop CPU with AVX-512 and two channels of DDR5
#: (256 GB as 4 x 64 GB), STREAM triad ~65 GB/s; a PCIe Gen4 NVMe drive.
_WORKSTATION_TRIAD = 65.0


def _rtx4090_rates() -> Rates:
    pub, h200 = _RTX4090_PUBLISHED, _H200_PUBLISHED
    scale = "derived, not measured: NVIDIA's published RTX 4090 figure"

    def share(what: str, achieved: float, key: str) -> str:
        return (
            f"{scale} ({pub[key]:g}) x the share of the H200's published {what} the H200 achieved here "
            + (f"({achieved:g} of {h200[key]:g})")
        )

    host = "assumed: a 256 GB workstation, 16-core AVX-512 desktop CPU, two DDR5 channels"
    adam_host = round(H200_RATES.updates["layer_adam"].host_params_per_s * _WORKSTATION_TRIAD / 95.0, -7)
    return Rates(
        name="rtx4090 (published and assumed, not measured)",
        layer_tflops=_scaled(H200_RATES.layer_tflops, pub["bf16_tflops"], h200["bf16_tflops"]),
        head_tflops=_scaled(H200_RATES.head_tflops, pub["bf16_tflops"], h200["bf16_tflops"]),
        device_gbps=_scaled(H200_RATES.device_gbps, pub["memory_gbps"], h200["memory_gbps"]),
        h2d_gbps=_scaled(H200_RATES.h2d_gbps, pub["bus_gbps"], h200["bus_gbps"]),
        d2h_gbps=_scaled(H200_RATES.d2h_gbps, pub["bus_gbps"], h200["bus_gbps"]),
        host_gbps=_WORKSTATION_TRIAD,
        backup_gbps=round(_H200_BACKUP_GBPS * _WORKSTATION_TRIAD / 95.0, 1),
        backup_copy_gbps=round(_H200_BACKUP_COPY_GBPS * _WORKSTATION_TRIAD / 95.0, 1),
        disk_read_gbps=5.0,
        disk_write_gbps=3.0,
        step_overhead_s=H200_RATES.step_overhead_s,
        updates={
            "layer_adam": UpdateRate(
                host_params_per_s=adam_host,
                device_bytes_per_param=28.0,
                source=(
                    f"{host}: layer_adam is bound by host memory, so the H200 host's 4.32 G params/s x "
                    f"{_WORKSTATION_TRIAD:g} / 95 GB/s of triad; device 28 B/param"
                ),
            ),
            "adamw_8bit": UpdateRate(
                host_params_per_s=_8BIT_HOST,
                device_bytes_per_param=16.0,
                source=(
                    f"{host}: adamw_8bit is bound by compute on 16 cores (3.663 G params/s on the H200 "
                    "host, 59 GB/s of memory, 62 % of its triad), assumed the same; device 16 B/param"
                ),
            ),
            "adamw_fp8": UpdateRate(
                host_params_per_s=round(_FP8_HOST * _WORKSTATION_TRIAD / 95.0, -7),
                device_bytes_per_param=_FP8_DEVICE_BYTES,
                source=(
                    f"{host}: adamw_fp8 is bound by host memory (on the H200 host its 16 B/param at "
                    "5.687 G params/s move 91 GB/s, 96 % of the triad), so the H200 host's 5.687 G params/s "
                    f"x {_WORKSTATION_TRIAD:g} / 95 GB/s of triad; device: {_FP8_NO_DEVICE}"
                ),
            ),
        },
        sources={
            "layer_tflops": share("dense BF16 tensor rate", H200_RATES.layer_tflops, "bf16_tflops"),
            "head_tflops": share("dense BF16 tensor rate", H200_RATES.head_tflops, "bf16_tflops"),
            "device_gbps": share("memory bandwidth", H200_RATES.device_gbps, "memory_gbps"),
            "h2d_gbps": share("PCIe bandwidth (Gen4 x16 here, Gen5 there)", H200_RATES.h2d_gbps, "bus_gbps"),
            "d2h_gbps": share("PCIe bandwidth", H200_RATES.d2h_gbps, "bus_gbps"),
            "host_gbps": f"{host}: STREAM triad {_WORKSTATION_TRIAD:g} GB/s",
            "backup_gbps": (
                f"{host}: the H200 host's effective {_H200_BACKUP_GBPS:g} GB/s for fused clipping backups x "
                f"{_WORKSTATION_TRIAD:g} / 95 GB/s of triad"
            ),
            "backup_copy_gbps": (
                f"{host}: the H200 host's effective {_H200_BACKUP_COPY_GBPS:g} GB/s for copied clipping "
                f"backups x {_WORKSTATION_TRIAD:g} / 95 GB/s of triad"
            ),
            "disk_read_gbps": "assumed: a PCIe Gen4 NVMe drive, sustained O_DIRECT reads",
            "disk_write_gbps": "assumed: the same drive, sustained writes past its cache",
            "step_overhead_s": "assumed: the H200 machine's measured per-step host time",
        },
    )


#: The CUDA context's share of the device on the H200 (139.80 GiB total, 139.29 free to a fresh process).
_CONTEXT = int(139.80 * GIB) - int(139.29 * GIB)

PROFILES: dict[str, GpuProfile] = {
    "h200": GpuProfile(
        name="h200",
        description="NVIDIA H200 (141 GB HBM3e), the benchmark machine: 16-core host, ~2 GB/s disk",
        device_total=int(139.80 * GIB),
        device_free=int(139.29 * GIB),
        memory_source=(
            "measured: torch.cuda.mem_get_info on the benchmark machine (`slidekit plan`'s machine line in "
            "docs/benchmarks/raw/2026-12-01-s7/logs)"
        ),
        rates=H200_RATES,
        matches=("H200",),
    ),
    "rtx4090": GpuProfile(
        name="rtx4090",
        description="NVIDIA GeForce RTX 4090 (24 GB GDDR6X, PCIe Gen4) in an assumed 256 GB workstation",
        device_total=24564 << 20,
        device_free=(24564 << 20) - _CONTEXT,
        memory_source=(
            "published: 24 GB (24,564 MiB as the driver reports it); free: assumed, less the CUDA "
            "context's share measured on the H200"
        ),
        rates=_rtx4090_rates(),
        matches=("RTX 4090",),
    ),
}


def profile(name: str) -> GpuProfile:
    """The profile called ``name``, or an error listing the ones there are."""
    try:
        return PROFILES[name.lower()]
    except KeyError:
        raise ConfigError(
            f"unknown GPU profile {name!r} (--gpu); choose one of: {', '.join(PROFILES)}"
        ) from None


def profile_for_device(device_name: str) -> GpuProfile | None:
    """The profile of a GPU that ``torch.cuda.get_device_name`` calls ``device_name``, if there is one."""
    for p in PROFILES.values():
        if any(m.lower() in device_name.lower() for m in p.matches):
            return p
    return None
