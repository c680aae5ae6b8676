"""The cost of speculative clipping's backup: one unit's update with and without it, on this CPU.

    python benchmarks/clip_backup.py --numel 20000000                   # quick, anywhere
    python benchmarks/clip_backup.py --numel 100000000 --chunks 65536,1048576,4194304
    python benchmarks/clip_backup.py --numel 81000000 --repeat 5 --threads 16   # the H200 host

A speculative step (``slidekit.engine.speculation``) backs up each unit's FP32
master and optimizer state before updating it (``update_backed``). An
optimizer declaring ``fused_backup`` (both bundled ones) writes the backup in
its update's pass, given it as ``backup_out``; for any other the engine copies
each chunk right before the optimizer updates that chunk, so the update reads
the bytes the copy has just brought into cache. Per optimizer driver (``layer_adam`` and
``adamw_8bit``, fused C++ kernels, through the plugin registry as the engine
gets them), this times, on one unit of ``--numel`` parameters with an FP32
gradient (the CPU engine's; BF16 on the GPU) and weight decay 0.1:

* ``update``: the update alone, whole unit in one call (today's path);
* ``backed_<chunk>``: the copy path, ``update_backed`` with each chunk size of ``--chunks``, the
  optimizer's ``fused_backup`` hidden (as for an optimizer without it; the path before the fused one);
* ``fused``: ``update_backed`` with the capability: one call, the backup written in the pass;
* ``copy_then_update``: the whole unit copied first, then updated (the naive backup);
* ``out_of_place``: ``update_backed`` with ``out_of_place`` (an optimizer declaring
  ``fused_update_out``: the new master and state written into the second buffers, the sources only
  read; NOTES.md 36), one call.

``--bf16``: a BF16 gradient and a BF16 upload copy written by every contender (the GPU engine's
host update) instead of an FP32 gradient and no copy. ``ATEN_CPU_CAPABILITY=avx2`` (or ``default``)
in front builds and times the kernels' portable loops instead of their AVX-512 ones.

``--repeat`` interleaved rounds (a change of background load hits all alike),
median per contender; prints one JSON line with seconds, each contender's
extra time over ``update`` (``<driver>_<contender>_extra``, a fraction), the
fused path's time over the copy path's at the engine's chunk
(``<driver>_fused_over_copy``) and the kernels' streaming-store width
(``backup_stream_bytes``: 64 with AVX-512, 32 with AVX2, 0 where they memcpy).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from statistics import median

import torch

from slidekit import Plugins
from slidekit.engine.speculation import BACKUP_CHUNK, update_backed
from slidekit.interfaces import OptimizerHyper, ParamGroupRange, UnitOptimizer

Step = Callable[[], None]


class _CopyPath:
    """``opt`` without its ``fused_backup``: ``update_backed`` copies the backup chunk by chunk."""

    def __init__(self, opt: UnitOptimizer) -> None:
        self.opt = opt
        self.name, self.device_update, self.linear_state = opt.name, opt.device_update, opt.linear_state
        self.state_layout = opt.state_layout
        self.step = opt.step


class _InPlace:
    """``opt`` without its ``fused_update_out``: ``update_backed`` hands it the in-place backup (``backup_out``)."""

    def __init__(self, opt: UnitOptimizer) -> None:
        self.opt = opt
        self.name, self.device_update, self.linear_state = opt.name, opt.device_update, opt.linear_state
        self.state_layout, self.fused_backup = opt.state_layout, True
        self.step = opt.step


def _unit(opt, n: int):
    master = torch.randn(n, generator=torch.Generator().manual_seed(1))
    state = {k: torch.zeros(c, dtype=dt) for k, (dt, c) in opt.state_layout(n).items()}
    saved_master = torch.empty_like(master)
    saved_state = {k: torch.empty_like(t) for k, t in state.items()}
    return master, state, saved_master, saved_state


def _contenders(opt, n: int, chunks: list[int], bf16: bool = False) -> dict[str, Step]:
    grad = torch.randn(n, generator=torch.Generator().manual_seed(0))
    grad = grad.bfloat16() if bf16 else grad
    copy = torch.empty(n, dtype=torch.bfloat16) if bf16 else None
    groups = [ParamGroupRange(start=0, stop=n, weight_decay=0.1)]
    master, state, saved_master, saved_state = _unit(opt, n)
    count = [0]

    def span(lo: int, hi: int) -> dict[str, tuple[torch.dtype, int, int]]:
        before = dict(opt.state_layout(lo)) if lo else {}
        return {k: (dt, before.get(k, (dt, 0))[1], c) for k, (dt, c) in opt.state_layout(hi - lo).items()}

    def update() -> None:
        count[0] += 1
        opt.step(master, grad, state, lr=1e-6, count=count[0], groups=groups, lowp_out=copy)

    def backed(chunk: int, via: UnitOptimizer, out_of_place: bool = False) -> Step:
        def step() -> None:
            count[0] += 1
            update_backed(
                via, master, grad, state, saved_master, saved_state,
                lr=1e-6, count=count[0], groups=groups, span=span, chunk=chunk, lowp_out=copy,
                out_of_place=out_of_place,
            )  # fmt: skip

        return step

    def copy_then_update() -> None:
        saved_master.copy_(master)
        for k, t in state.items():
            saved_state[k].copy_(t)
        update()

    out = {"update": update, "copy_then_update": copy_then_update}
    out |= {f"backed_{c}": backed(c, _CopyPath(opt)) for c in chunks}
    if getattr(opt, "fused_backup", False) is True:
        out["fused"] = backed(BACKUP_CHUNK, _InPlace(opt))  # the chunk is not used: one call
    if getattr(opt, "fused_update_out", False) is True:
        out["out_of_place"] = backed(BACKUP_CHUNK, opt, out_of_place=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--numel", type=int, default=20_000_000)
    p.add_argument("--chunks", default=f"{BACKUP_CHUNK // 16},{BACKUP_CHUNK},{BACKUP_CHUNK * 16}")
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--bf16", action="store_true", help="a BF16 gradient and a BF16 upload copy (the GPU engine's)")
    p.add_argument("--optimizers", default="layer_adam,adamw_8bit", help="which drivers (comma-separated)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    chunks = [int(c) for c in args.chunks.split(",")]
    hyper = OptimizerHyper(weight_decay=0.1)
    steps: dict[str, Step] = {}
    stream_bytes = None
    for reg in Plugins().drivers("optimizer"):
        if reg.name in args.optimizers.split(","):
            opt = reg.descriptor.factory(hyper, impl="cpp")
            stream_bytes = opt._kernel.backup_stream_bytes()
            steps |= {f"{reg.name}_{k}": s for k, s in _contenders(opt, args.numel, chunks, args.bf16).items()}
    for step in steps.values():
        step()  # warm-up: first touch, kernel caches
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(args.repeat):
        for name, step in steps.items():
            t0 = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t0)
    secs = {k: median(v) for k, v in times.items()}
    out: dict[str, object] = {
        "numel": args.numel,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "default_chunk": BACKUP_CHUNK,
        "repeat": args.repeat,
        "backup_stream_bytes": stream_bytes,
        "bf16": args.bf16,
    }
    out |= {f"{k}_s": round(v, 5) for k, v in secs.items()}
    for name in secs:
        driver = name.split("_update")[0] if name.endswith("_update") and "copy" not in name else None
        if driver:
            for other, v in secs.items():
                if other.startswith(driver + "_") and other != name:
                    out[f"{other}_extra"] = round(v / secs[name] - 1, 3)
            if f"{driver}_fused" in secs:
                out[f"{driver}_fused_over_copy"] = round(
                    secs[f"{driver}_fused"] / secs[f"{driver}_backed_{BACKUP_CHUNK}"], 3
                )
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
