"""What every benchmark record is made of: the tokens, the timing figures, the memory peaks, the causes.

Shared by slidekit's own runs (``slidekit_run``) and the alternatives (``slidekit.tools.baselines``),
so every row of a suite is computed the same way:

- ``synthetic_tokens``: the rows every system trains on (seeded, uniform random).
- ``throughput``: from the whole-step times of N consecutive timed steps (start of step i to start of
  step i+1, the last ending with every update applied and the device idle): the period is their sum,
  tokens/s = N x world x batch x seq / period (``batch`` per GPU, every rank's tokens), model TFLOPS
  = N x world x ``model_flops`` / period. The record keeps
  every step's seconds to the microsecond and its figures are computed from those rounded values, so
  ``throughput`` of a record's own ``step_seconds`` gives its figures back exactly.
- ``lane_metrics``: slidekit's per-lane times, eta and the GPU busy fractions.
- ``does_not_fit``: a measured out-of-memory message made short, with its cause where the size of the
  failed allocation names it (the FP32 logits of a full-vocabulary loss, say); ``did_not_fit``: whether
  a row is such a result (out of GPU memory, host RAM exhausted, or slidekit's planner refusing a
  placement that does not fit).
- ``versions``: the packages a record was measured with, read from their metadata (nothing imported).
- ``machine``: what a suite ran on (GPU, its memory, CPU model and count, host RAM): a suite measured
  over several calls must have run every call on one kind of machine (``continuing``).

Test: ``pytest tests/test_bench.py``.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from statistics import median
from typing import TYPE_CHECKING, Any

from slidekit.telemetry import FLOPS_FORMULA, d2h_seconds, hiding_factor

if TYPE_CHECKING:
    import argparse

    import torch

    from slidekit.models.base import ArchSpec

__all__ = [
    "COMPUTE_LANES",
    "FLOPS_FORMULA",
    "PACKAGES",
    "did_not_fit",
    "does_not_fit",
    "lane_metrics",
    "machine",
    "no_room",
    "peak_gpu_gib",
    "peak_rss_gib",
    "run_header",
    "synthetic_tokens",
    "throughput",
    "versions",
]

#: Lanes that keep the GPU computing (device time from CUDA events; host time on the CPU).
COMPUTE_LANES = ("fwd", "head", "bwd", "update_gpu")

#: Distributions whose versions every suite records (absent ones are recorded as None).
PACKAGES = ("slidekit", "torch", "triton", "transformers", "liger-kernel", "deepspeed", "torchao")

_GIB = float(2**30)


def synthetic_tokens(
    vocab: int, batch: int, seq: int, seed: int = 0, *, repeat: bool = False
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless uniform-random (inputs, labels), each (batch, seq), labels = inputs shifted by one token.

    ``repeat``: the first batch every step, so the loss falls as the model memorizes it (on fresh
    uniform tokens it cannot fall below ln(vocab)); the largest-model runs show training that way.
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    while True:
        ids = torch.randint(0, vocab, (batch, seq + 1), generator=gen)  # (B, T + 1)
        pair = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
        yield pair
        while repeat:
            yield pair[0].clone(), pair[1].clone()  # a step may keep or overwrite what it was given


def peak_rss_gib() -> float:
    """Peak resident set size of this process, GiB (``slidekit.telemetry.peak_rss_bytes``)."""
    from slidekit.telemetry import peak_rss_bytes

    return round(peak_rss_bytes() / _GIB, 3)


def peak_gpu_gib(device: torch.device) -> float | None:
    """Peak memory allocated through torch on ``device`` (None off CUDA), GiB."""
    if device.type != "cuda":
        return None
    from slidekit.telemetry import memory_metrics

    return round(memory_metrics(device)["gpu_mem_gib"], 3)


def _gpu_name(device: Any) -> str | None:
    if device.type != "cuda":
        return None
    import torch

    return str(torch.cuda.get_device_name(device))


def run_header(system: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """The fields every benchmark record starts with: what ran, on what, for how many steps."""
    return {
        "system": system,
        "status": "ok",
        "model": args.model,
        "batch": args.batch,
        "seq": args.seq,
        "steps": args.steps,
        "warmup": args.warmup,
        "max_grad_norm": getattr(args, "clip", None),
        "device": str(device),
        "gpu": _gpu_name(device),
    }


def throughput(
    spec: ArchSpec, batch: int, seq: int, step_seconds: Sequence[float], *, world: int | None = None
) -> dict[str, Any]:
    """The figures of N consecutive timed steps of ``batch`` rows of ``seq`` tokens, from their whole-step times.

    ``period_s`` is the sum of the steps (start of the first to the end of the last), ``tokens_per_s``
    = N x world x batch x seq / period and ``model_tflops`` = N x world x model FLOPs / period (every
    rank's rows: ``batch`` is per GPU), ``tokens_per_s_per_gpu`` = tokens_per_s / world; ``mean_step_s``
    = period / N, ``median_step_s`` is for spotting an odd step. Every figure is computed from the
    seconds as recorded (to the microsecond), so a record's own ``step_seconds`` give its figures back
    exactly. ``world``: the ranks that each trained ``batch`` rows a step (default: the size of
    torch.distributed's default group where one is initialised, else 1).
    """
    from slidekit.telemetry import model_flops

    if not step_seconds:
        raise ValueError("throughput needs at least one timed step")
    if world is None:
        world = _default_world()
    if world < 1:
        raise ValueError(f"throughput needs world >= 1 (the ranks of the run), got {world}")
    seconds = [round(s, 6) for s in step_seconds]
    period = sum(seconds)
    steps = len(seconds)
    tokens_per_s = round(steps * world * batch * seq / period, 1)
    return {
        "params": spec.num_params,
        "world": world,
        "step_seconds": seconds,
        "period_s": round(period, 6),
        "mean_step_s": round(period / steps, 4),
        "median_step_s": round(median(seconds), 4),
        "tokens_per_s": tokens_per_s,
        "tokens_per_s_per_gpu": round(tokens_per_s / world, 1),
        "model_tflops": float(f"{steps * world * model_flops(spec, batch * seq, seq) / period / 1e12:.4g}"),
    }


def _default_world() -> int:
    """The ranks of torch.distributed's default group (a baseline under torchrun), or 1."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def lane_metrics(
    timings: Sequence[dict[str, float]], step_seconds: Sequence[float], num_layers: int
) -> dict[str, Any]:
    """Median seconds per lane, per-unit T_fwd/T_bwd/T_d2h/T_update, eta and the GPU busy fraction."""
    lanes = {
        lane: median(t.get(lane, 0.0) for t in timings) for lane in sorted({k for t in timings for k in t})
    }
    out: dict[str, Any] = {"lanes_s": {k: round(v, 4) for k, v in lanes.items()}}
    seconds = {"fwd": lanes.get("fwd", 0.0), "bwd": lanes.get("bwd", 0.0), "d2h": d2h_seconds(lanes)}
    seconds["update"] = lanes.get("update", 0.0)
    for lane, s in seconds.items():
        out[f"t_{lane}_s"] = round(s / num_layers, 6)
    eta = hiding_factor(lanes)
    out["eta"] = None if eta is None else round(eta, 3)
    busy = [sum(t.get(k, 0.0) for k in COMPUTE_LANES) / s for t, s in zip(timings, step_seconds, strict=True)]
    out["gpu_busy"] = round(median(busy), 3)
    in_bwd = [t["bwd_busy"] / t["bwd_window"] for t in timings if t.get("bwd_window")]
    out["gpu_busy_bwd"] = round(median(in_bwd), 3) if in_bwd else None
    return out


def _cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo's first "model name"; ``platform.processor()`` elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _nvidia_gpu() -> tuple[str | None, float | None]:
    """The first NVIDIA GPU's name and memory in GiB, from ``nvidia-smi`` (the suite's own process stays out
    of CUDA: its runs need the whole device); (None, None) where there is none or it does not answer."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits", "-i", "0"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
        name, mib = (part.strip() for part in out.strip().splitlines()[0].rsplit(",", 1))
        return name, round(float(mib) / 1024, 1)
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None, None


def boot_id() -> str | None:
    """This host's boot: Linux's random id of the running kernel (/proc/sys/kernel/random/boot_id), new on
    every boot and on every host, so two records with one boot id come from one host; None elsewhere."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


def machine() -> dict[str, Any]:
    """What this process runs on: the first GPU's name and memory (None where ``nvidia-smi`` finds none),
    the CPU model and count, the host RAM, in GiB to 0.1, and the host's boot (``boot_id``)."""
    gpu, mem = _nvidia_gpu()
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {
        "gpu": gpu,
        "gpu_mem_gib": mem,
        "cpu_model": _cpu_model(),
        "cpus": os.cpu_count(),
        "host_ram_gib": round(ram / 2**30, 1),
        "boot_id": boot_id(),
    }


def versions() -> dict[str, str | None]:
    """Python and the version of every package in ``PACKAGES`` (None where it is not installed)."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    if (
        out.get("torch") is not None
    ):  # the build, not the wheel's name: "2.11.0+cu130" where pip says "2.11.0"
        import torch

        out["torch"] = torch.__version__
        out["cuda"] = torch.version.cuda
    return out


# ---------------------------------------------------------------------------- why a run did not fit

#: How a row's reason starts, or for the planner's refusal what it contains, when the run measured that it
#: does not fit this machine (``does_not_fit``; ``children``' memory watchdog; ``slidekit.planning.fit``).
_NO_ROOM_GPU = "does not fit in GPU memory"
_NO_ROOM_HOST = "host RAM exhausted"
_NO_ROOM_PLANNER = "this configuration does not fit on this machine"


def no_room(row: Mapping[str, Any]) -> str | None:
    """Where ``row`` measured that its run does not fit this machine: "gpu" (out of GPU memory), "host"
    (host RAM exhausted) or "planner" (slidekit's planner refused the placement before allocating it).
    None for any other outcome: it ran, failed another way, timed out, or did not start."""
    if row.get("status") != "unavailable":
        return None
    reason = str(row.get("reason") or "")
    if reason.startswith(_NO_ROOM_GPU):
        return "gpu"
    if reason.startswith(_NO_ROOM_HOST):
        return "host"
    return "planner" if _NO_ROOM_PLANNER in reason else None


def did_not_fit(row: Mapping[str, Any]) -> bool:
    """Whether ``row`` measured that its run does not fit this machine (``no_room``): out of GPU memory,
    host RAM exhausted, or slidekit's planner refusing the placement. Not a failure of another kind, a
    timeout or a run that did not start."""
    return no_room(row) is not None


_ALLOC = re.compile(r"Tried to allocate ([\d.]+) ([KMG]i?B)")
_FREE = re.compile(r"total capacity of ([\d.]+) GiB of which ([\d.]+) ([KMG]i?B) is free")
_UNIT = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "KB": 2**10, "MB": 2**20, "GB": 2**30}


def does_not_fit(message: str, *, batch: int, seq: int, vocab: int) -> str:
    """A measured GPU out-of-memory ``message`` made short: "does not fit in GPU memory: tried to allocate
    X GiB with Y free of Z GiB", with its cause where the failed allocation is exactly the logits of every
    token over the whole vocabulary (``batch`` x ``seq`` x ``vocab`` x 4 bytes in FP32, x 2 in BF16).
    A message that is not torch's gives its first line."""
    alloc = _ALLOC.search(message)
    if alloc is None:
        first = message.strip().splitlines()[0] if message.strip() else "CUDA out of memory"
        return f"does not fit in GPU memory ({first[:200]})"
    size = float(alloc.group(1)) * _UNIT[alloc.group(2)]
    text = f"does not fit in GPU memory: tried to allocate {alloc.group(1)} {alloc.group(2)}"
    free = _FREE.search(message)
    if free is not None:
        text += f" with {free.group(2)} {free.group(3)} free of {free.group(1)} GiB"
    logits = batch * seq * vocab
    for width, dtype in ((4, "FP32"), (2, "BF16")):
        if abs(size - logits * width) <= 0.005 * logits * width + 0.01 * 2**30:  # torch prints 2 decimals
            text += f" (the {dtype} logits: {batch} x {seq} tokens x {vocab} vocab x {width} B)"
            break
    return text
