"""Storage-tier bandwidth for unit-sized transfers, against the disk's raw bandwidth measured by dd.

    python3 benchmarks/tier_bandwidth.py --dir /tmp/slidekit-bench --size-gb 0.5   # the GPU machine
    python3 benchmarks/tier_bandwidth.py --dir /tmp/slidekit-bench --size-gb 0.02  # quick, anywhere

For every storage tier the plugin registry offers and finds available (or
those named with --tiers), one region of --size-gb is written from, then read
back into, page-locked host memory and (with CUDA) a GPU tensor, --repeat
times each after a warm-up; the warm-up's bytes are checked on the way. Before
every read the tier's files (if it has a ``root`` directory) are dropped from
the page cache, so buffered I/O is not timed at RAM speed. In the same run and
directory, ``dd`` writes and reads a file of the same size with
oflag=direct / iflag=direct (buffered, and labelled so, where the file system
refuses O_DIRECT): the ceiling a file tier is measured against.

Output: one JSON line per measurement on stdout (median seconds and GB/s,
1 GB = 1e9 bytes), then a table on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from statistics import median
from typing import Any

import torch

from slidekit import Plugins
from slidekit.hostmem import HostBuffers
from slidekit.interfaces import TierContext

DD_BLOCK = 16 << 20


def _median_seconds(fn: Callable[[], None], repeat: int, before: Callable[[], None] | None = None) -> float:
    times = []
    for _ in range(repeat):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return median(times)


def _drop_page_cache(root: str | None) -> None:
    """Write back and evict the page-cache pages of every file under ``root`` (no-op for O_DIRECT files)."""
    if root is None or not hasattr(os, "posix_fadvise"):
        return
    for name in os.listdir(root):
        fd = os.open(os.path.join(root, name), os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _emit(record: dict[str, Any]) -> dict[str, Any]:
    print(json.dumps(record), flush=True)
    return record


def _dd(directory: str, nbytes: int, repeat: int) -> list[dict[str, Any]]:
    """Raw sequential bandwidth of the disk under ``directory``: dd with O_DIRECT where allowed."""
    path = os.path.join(directory, "slidekit-dd.bin")
    count = -(-nbytes // DD_BLOCK)
    moved = count * DD_BLOCK
    records = []
    try:
        for op, direct in (("write", "oflag=direct"), ("read", "iflag=direct")):
            io = (
                (["if=/dev/zero", f"of={path}", "conv=fsync"])
                if op == "write"
                else [f"if={path}", "of=/dev/null"]
            )
            cmd = ["dd", *io, f"bs={DD_BLOCK}", f"count={count}", "status=none"]
            label = "O_DIRECT"
            if subprocess.run([*cmd, direct], capture_output=True).returncode != 0:
                label = "buffered (O_DIRECT refused)"
            else:
                cmd.append(direct)

            def run(cmd: list[str] = cmd) -> None:
                subprocess.run(cmd, check=True, capture_output=True)

            drop = None if label == "O_DIRECT" else (lambda: _drop_page_cache_file(path))
            seconds = _median_seconds(run, repeat, drop if op == "read" else None)
            records.append(
                _emit(
                    {
                        "what": "dd",
                        "tier": "dd",
                        "op": op,
                        "memory": "-",
                        "bytes": moved,
                        "median_s": seconds,
                        "gb_per_s": moved / seconds / 1e9,
                        "repeat": repeat,
                        "detail": f"dd bs={DD_BLOCK >> 20}M, {label}",
                    }
                )
            )
    finally:
        if os.path.exists(path):
            os.unlink(path)
    return records


def _drop_page_cache_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _bench_tier(
    plugins: Plugins,
    name: str,
    args: argparse.Namespace,
    device: torch.device,
    sources: dict[str, torch.Tensor],  # memory kind -> (nbytes,) uint8 source
    host_out: torch.Tensor,  # (nbytes,) uint8 page-locked destination for host reads
) -> list[dict[str, Any]]:
    ctx = TierContext(device=device, directory=args.dir, io_threads=args.io_threads)
    tier = plugins.get("tier", name).descriptor.factory(ctx)
    records = []
    try:
        nbytes = host_out.numel()
        tier.allocate("bench", nbytes)
        root = getattr(tier, "root", None)
        for memory, src in sources.items():
            dst = torch.empty_like(src) if src.device.type == "cuda" else host_out
            tier.write("bench", src).result()  # warm-up, and a check that the path moves the right bytes
            _drop_page_cache(root)
            dst.zero_()
            tier.read("bench", dst).result()
            if not torch.equal(dst, src):
                raise AssertionError(f"tier {name}: {memory} round trip returned other bytes")

            def write(src: torch.Tensor = src) -> None:
                _sync(device)
                tier.write("bench", src).result()

            def read(dst: torch.Tensor = dst) -> None:
                tier.read("bench", dst).result()
                _sync(device)

            for op, fn, before in (("write", write, None), ("read", read, lambda: _drop_page_cache(root))):
                seconds = _median_seconds(fn, args.repeat, before)
                records.append(
                    _emit(
                        {
                            "what": "tier",
                            "tier": name,
                            "op": op,
                            "memory": memory,
                            "bytes": nbytes,
                            "median_s": seconds,
                            "gb_per_s": nbytes / seconds / 1e9,
                            "repeat": args.repeat,
                            "detail": tier.stats().detail,
                        }
                    )
                )
    finally:
        tier.close()
    return records


def _table(records: list[dict[str, Any]]) -> str:
    dd = {r["op"]: r["gb_per_s"] for r in records if r["what"] == "dd"}
    rows = {}
    for r in records:
        rows.setdefault((r["tier"], r["memory"]), {})[r["op"]] = r["gb_per_s"]
    lines = [
        f"{'tier':<8} {'memory':<12} {'write GB/s':>10} {'read GB/s':>10} {'write/dd':>9} {'read/dd':>8}"
    ]
    for (tier, memory), ops in rows.items():
        w, r = ops.get("write", float("nan")), ops.get("read", float("nan"))
        lines.append(
            f"{tier:<8} {memory:<12} {w:>10.2f} {r:>10.2f} "
            f"{w / dd.get('write', float('nan')):>9.2f} {r / dd.get('read', float('nan')):>8.2f}"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", required=True, help="directory for file tiers and dd (created if missing)")
    p.add_argument("--size-gb", type=float, default=0.5, help="bytes per transfer, in GB (1e9)")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--io-threads", type=int, default=2, help="TierContext.io_threads")
    p.add_argument("--tiers", default=None, help="comma-separated tier names (default: every available one)")
    args = p.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    nbytes = int(args.size_gb * 1e9)
    free = shutil.disk_usage(args.dir).free
    if 2 * nbytes > free:
        sys.exit(f"--dir {args.dir} has {free / 1e9:.1f} GB free; this run needs {2 * nbytes / 1e9:.1f} GB")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    plugins = Plugins()
    names = args.tiers.split(",") if args.tiers else [r.name for r in plugins.drivers("tier")]
    host = HostBuffers(pin=device.type == "cuda")
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    sources = {"pinned_host" if host.pin else "host": host.empty(nbytes, torch.uint8).copy_(data)}
    host_out = host.empty(nbytes, torch.uint8)
    if device.type == "cuda":
        sources["gpu"] = data.to(device)
    del data
    records = _dd(args.dir, nbytes, args.repeat)
    for name in names:
        ok, reason = plugins.availability("tier", name)
        if not ok:
            print(f"# skipping tier {name}: {reason}", file=sys.stderr)
            continue
        records += _bench_tier(plugins, name, args, device, sources, host_out)
    print(_table(records), file=sys.stderr)
    host.close()


if __name__ == "__main__":
    main()
