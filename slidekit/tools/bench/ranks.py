"""Every rank's figures of a data-parallel benchmark run, gathered to rank 0 (which alone prints the record).

    torchrun --standalone --nproc-per-node 2 -m slidekit.tools.bench --model qwen2.5-7b --batch 8 --resident none

Under torchrun each rank trains its own per-GPU batch; the ranks agree before every step, so a step
ends on every rank at about the same time, and the record's step is the slowest rank's
(``slowest_steps``: per step, the largest of the ranks' whole-step seconds). What differs per rank
goes into the record's ``per_rank`` list (``rank_figures``, ``gather_ranks``): its setup, peak host
RSS, peak GPU memory, and per step (median over the timed steps) the seconds of the host update
(the ``update`` lane), of the gradient reduction (``reduce``: ``t_reduce``), of the weight gather
(``gather``: ``t_gather``) and of the gradient copy (``d2h``); the threads of its host update
(``torch.get_num_threads()``: torchrun sets ``OMP_NUM_THREADS`` per rank). ``host_update_s`` is the
host's update seconds per step over all ranks (their sum: the ranks of one host share its memory
bandwidth; compare it with one process's).

The gathering is one all-reduce on the run's ``control`` group (gloo, host scalars): rank r fills
its slots of a world x K vector, the others leave zeros there, so the sum is every rank's vector in
rank order (None travels as NaN). Every rank must give the same K; a first all-reduce checks that
and names the ranks that differ rather than leaving a collective of unequal sizes to hang. Without
a ``DataParallel`` (one process) the functions return the process's own figures, so one code path
writes every record.

Test: ``pytest tests/test_bench_dp.py``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from statistics import median
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from slidekit.distributed import DataParallel

__all__ = ["LANES", "gather", "gather_ranks", "host_update_s", "rank_figures", "slowest_steps"]

#: Record field -> engine lane (``StepResult.timings``; the engine's ``Timeline`` names them).
LANES = {"update_s": "update", "reduce_s": "reduce", "gather_s": "gather", "d2h_s": "d2h"}


def gather(parallel: DataParallel | None, values: Sequence[float | None]) -> list[list[float | None]]:
    """Every rank's ``values`` (the same number on every rank), in rank order; ``[values]`` alone
    without ``parallel``."""
    if parallel is None or parallel.world == 1:
        return [list(values)]
    world, rank, k = parallel.world, parallel.rank, len(values)
    sizes = parallel.all_reduce([float(k) if r == rank else 0.0 for r in range(world)])
    if len(set(sizes)) != 1:
        differ = ", ".join(f"rank {r}: {int(n)}" for r, n in enumerate(sizes))
        raise RuntimeError(
            f"the ranks gather different numbers of figures ({differ}); every rank must give the same"
        )
    slots = [0.0] * (world * k)
    for i, v in enumerate(values):
        slots[rank * k + i] = math.nan if v is None else float(v)
    total = parallel.all_reduce(slots)
    return [[None if math.isnan(x) else x for x in total[r * k : (r + 1) * k]] for r in range(world)]


def slowest_steps(parallel: DataParallel | None, step_seconds: Sequence[float]) -> list[float]:
    """Per step, the largest of every rank's whole-step seconds (the step of a run whose ranks wait
    for each other); ``step_seconds`` itself without ``parallel``."""
    per_rank = gather(parallel, step_seconds)
    return [max(float(s) for s in column if s is not None) for column in zip(*per_rank, strict=True)]


def _per_step(timings: Sequence[Mapping[str, float]], lane: str) -> float:
    """Median over the timed steps of ``lane``'s seconds (0 where the lane never ran)."""
    return median(t.get(lane, 0.0) for t in timings) if timings else 0.0


def rank_figures(
    *,
    setup_s: float,
    timings: Sequence[Mapping[str, float]],
    step_seconds: Sequence[float],
    device: torch.device,
) -> dict[str, float | None]:
    """This rank's figures (module docstring): its setup, peaks, lane seconds per step and threads."""
    import torch

    from slidekit.telemetry import d2h_seconds
    from slidekit.tools.bench.records import peak_gpu_gib, peak_rss_gib

    out: dict[str, float | None] = {"setup_s": round(setup_s, 2), "peak_host_rss_gib": peak_rss_gib()}
    out["peak_gpu_gib"] = peak_gpu_gib(device)
    for field, lane in LANES.items():
        if lane == "d2h":
            seconds = median(d2h_seconds(t) for t in timings) if timings else 0.0
        else:
            seconds = _per_step(timings, lane)
        out[field] = round(seconds, 4)
    out["period_s"] = round(sum(step_seconds), 6)
    out["threads"] = float(torch.get_num_threads())
    return out


def gather_ranks(parallel: DataParallel | None, figures: Mapping[str, float | None]) -> list[dict[str, Any]]:
    """Every rank's ``figures`` (the same keys on every rank, in the same order) as a list in rank order,
    each with its ``rank``."""
    keys = list(figures)
    rows = gather(parallel, [figures[k] for k in keys])
    out: list[dict[str, Any]] = []
    for r, values in enumerate(rows):
        row: dict[str, Any] = {"rank": r, **dict(zip(keys, values, strict=True))}
        if row.get("threads") is not None:
            row["threads"] = int(row["threads"])
        out.append(row)
    return out


def host_update_s(ranks: Sequence[Mapping[str, Any]]) -> float:
    """The host's update seconds per step over every rank (their sum; see the module docstring)."""
    return round(sum(float(r.get("update_s") or 0.0) for r in ranks), 4)
