"""Where an offloading step's time goes along the GPU's cycle, read from its trace; two traces side by side.

A cycle runs from the start of one step's first forward visit (the lowest unit's ``fwd``) to the start
of the next step's, and is cut into five segments that add up to it exactly:

    fwd    the forward window: its first visit's start to its last visit's end (uploads waited for included)
    head   then to the head's end
    bwd    then to the end of the backward's last visit (the embedding's)
    tail   then to the end of the first unit's host update (the update lane's backlog ahead of it;
           0 when that update had ended before)
    up0    then to the next forward's first visit (its upload waits for that update)

Beside them, per cycle: the step's host updates still to run when the backward ends (``backlog``: the
update spans from the end of its forward to the end of the next, the part after the backward), the
GPU's idle time between the forward's visits (``fwd_gaps``: waits for uploads, and the uploads' waits for
updates), the update lane's busy time (``update_busy``) and the main thread's wait for the first unit
(``stall0``), all in ms. It prints one JSON line per trace with the medians over the steady cycles (the
first ``--skip`` left out), and with two traces a last line of the second's medians minus the first's:
what NOTES.md section 31 read to find the speculating step's backlog.

    python benchmarks/step_cycles.py UNCLIPPED.json.gz SPECULATING.json.gz [--skip 2]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from offload_floor import lanes, load_events  # the trace reader the benchmarks share

#: The cycle's consecutive parts, in order; they add up to it.
SEGMENTS = ("fwd", "head", "bwd", "tail", "up0")


def _end(e: dict[str, Any]) -> float:
    return float(e["ts"] + e["dur"])


def _unit(e: dict[str, Any]) -> int:
    return int(e["args"]["unit"])


def _within(spans: list[dict[str, Any]], a: float, b: float) -> list[dict[str, Any]]:
    return [e for e in spans if a <= e["ts"] < b]


def cycle(
    by_lane: dict[str, list[dict[str, Any]]], first: int, t0: float, t1: float, t2: float
) -> dict[str, float]:
    """The figures of the cycle [t0, t1) in ms (the next one ends at ``t2``); ``first`` is the unit the
    forward starts with."""
    fwd = sorted(_within(by_lane.get("fwd", []), t0, t1), key=lambda e: e["ts"])
    fwd_end = max(map(_end, fwd), default=t0)
    next_fwd_end = max(map(_end, _within(by_lane.get("fwd", []), t1, t2)), default=t1)
    head_end = max(map(_end, _within(by_lane.get("head", []), t0, t1)), default=fwd_end)
    bwd_end = max(map(_end, _within(by_lane.get("bwd", []), t0, t1)), default=head_end)
    updates = [e for e in by_lane.get("update", []) if e["ts"] < t1]
    first_done = max((_end(e) for e in _within(updates, bwd_end, t1) if _unit(e) == first), default=bwd_end)
    first_done = max(first_done, bwd_end)
    seg = {
        "fwd": fwd_end - t0,
        "head": head_end - fwd_end,
        "bwd": bwd_end - head_end,
        "tail": first_done - bwd_end,
        "up0": t1 - first_done,
    }
    stalls = _within(by_lane.get("stall", []), bwd_end, t1)
    figures = {
        "cycle": t1 - t0,
        **seg,
        "backlog": sum(  # the step's updates: they start after its forward, before the next one's end
            max(0.0, _end(e) - max(e["ts"], bwd_end))
            for e in _within(by_lane.get("update", []), fwd_end, next_fwd_end)
        ),
        "fwd_gaps": sum(max(0.0, b["ts"] - _end(a)) for a, b in itertools.pairwise(fwd)),
        "update_busy": sum(max(0.0, min(_end(e), t1) - max(e["ts"], t0)) for e in updates),
        "stall0": sum(e["dur"] for e in stalls if _unit(e) == first),
    }
    return {k: v / 1e3 for k, v in figures.items()}  # the trace's microseconds -> ms


def analyse(path: Path, skip: int) -> dict[str, Any]:
    """The medians over the steady cycles of the trace at ``path``."""
    by_lane = lanes(load_events(path))
    fwd = by_lane.get("fwd", [])
    if not fwd:
        raise SystemExit(f"{path}: no forward visits in the trace")
    first = min(map(_unit, fwd))
    starts = sorted(e["ts"] for e in fwd if _unit(e) == first)
    if len(starts) <= skip + 1:
        raise SystemExit(f"{path}: {len(starts)} forward passes; need more than {skip + 1} (lower --skip)")
    ends = [*starts[skip + 2 :], float("inf")]  # where the cycle after each one ends
    rows = [
        cycle(by_lane, first, a, b, c)
        for a, b, c in zip(starts[skip:-1], starts[skip + 1 :], ends, strict=True)
    ]
    return {
        "trace": path.name,
        "cycles": len(rows),
        **{k: round(statistics.median(r[k] for r in rows), 2) for k in rows[0]},
    }


def delta(base: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """``other``'s medians minus ``base``'s, figure by figure (ms)."""
    keys = [k for k in base if k not in ("trace", "cycles")]
    return {"delta": f"{other['trace']} - {base['trace']}", **{k: round(other[k] - base[k], 2) for k in keys}}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("traces", nargs="+", type=Path, help="one trace, or a base and another to compare")
    p.add_argument("--skip", type=int, default=2, help="leading cycles left out (the warm-up steps)")
    args = p.parse_args(argv)
    if len(args.traces) > 2:
        p.error("give one trace, or two to compare")
    found = [analyse(path, args.skip) for path in args.traces]
    for row in found:
        print(json.dumps(row))
    if len(found) == 2:
        print(json.dumps(delta(*found)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
