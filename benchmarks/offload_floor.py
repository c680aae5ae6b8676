"""Where a host-bound offload step goes, read from its trace, against the floor the physics allows.

With every unit's master on the host and the host update slower than the GPU (forced offload at
small batch), a step whose host updates run in the backward's arrival order cannot be shorter than

    floor = U + F + H

U: the host update's busy time in the step (the update lane of the trace). The CPU has nothing to
   update while the next forward runs: unit 0 is updated last (its gradients come last), and the
   forward needs it first.
F: the forward pass with every unit's weights crossing the bus once: max(its device time, the bytes
   uploaded / the bus rate). ``--bytes-per-param`` is 4 for FP32 masters (2 with ``upload_copy``).
H: the latency from the end of the forward to the first gradient the host can update (the head's
   backward and its gradients' download), read from the trace: the first update, after the forward,
   of the unit the backward starts with (the highest index).

In the next forward's order (``engine.update_order="forward"``, the record's ``forward_updates``;
``--order forward``) the forward runs beside the previous step's updates, so F leaves the floor:

    floor = U + H

It prints one JSON line per trace: the per-step medians of the steady steps (the first
``--skip`` and the last are left out), the update lane's idle gaps, the floor, and the measured step
against it (``over_floor``: 0.03 is 3% above). Issue 16 item 3 asks for batch 8 within 10%.

    python benchmarks/offload_floor.py TRACE.json[.gz] --params 3085938688 [--bus-gbs 55] [--order forward]
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

GAP_US = 200.0  # update-lane idle shorter than this is scheduling noise, not a gap


def load_events(path: Path) -> list[dict[str, Any]]:
    """The trace's events (Chrome trace JSON, gzipped or not)."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def lanes(events: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Complete events ('X') by lane name (the trace's thread names), sorted by start."""
    names = {
        (e["pid"], e["tid"]): e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e["name"] == "thread_name"
    }
    out: dict[str, list[dict[str, Any]]] = {}
    for e in events:
        if e.get("ph") == "X":
            out.setdefault(names.get((e["pid"], e["tid"]), "?"), []).append(e)
    for spans in out.values():
        spans.sort(key=lambda e: e["ts"])
    return out


def _unit(event: dict[str, Any]) -> int:
    """The unit an update span is of (its ``args``, else the number ending its name: "update 12")."""
    unit = event.get("args", {}).get("unit")
    return int(unit) if unit is not None else int(event["name"].rsplit(" ", 1)[-1])


def step_breakdown(by_lane: dict[str, list[dict[str, Any]]], step: dict[str, Any]) -> dict[str, float]:
    """One step's figures in seconds: its period, the forward's device time, the update lane's busy time
    and idle gaps, and the latency from the forward's end to the first update after it (the head's)."""
    a, b = step["ts"], step["ts"] + step["dur"]
    busy, gaps, cur = 0.0, [], a
    for e in by_lane.get("update", []):
        s, end = max(e["ts"], a), min(e["ts"] + e["dur"], b)
        if end <= s:
            continue
        if s > cur + GAP_US:
            gaps.append((cur, s))
        busy += max(0.0, end - max(s, cur))  # the part no earlier span of the lane covered
        cur = max(cur, end)
    if b > cur + GAP_US:
        gaps.append((cur, b))
    fwd = [e for e in by_lane.get("fwd", []) if a <= e["ts"] < b]
    fwd_end = max((e["ts"] + e["dur"] for e in fwd), default=a)
    after = [e for e in by_lane.get("update", []) if fwd_end <= e["ts"] < b]
    head = max((_unit(e) for e in after), default=None)  # the backward's first unit
    first_update = min((e["ts"] for e in after if _unit(e) == head), default=b)
    longest = max(gaps, key=lambda g: g[1] - g[0], default=(a, a))
    return {
        "step_s": (b - a) / 1e6,
        "forward_device_s": sum(e["dur"] for e in fwd) / 1e6,
        "update_busy_s": busy / 1e6,
        "update_idle_s": sum(g1 - g0 for g0, g1 in gaps) / 1e6,
        "longest_gap_s": (longest[1] - longest[0]) / 1e6,
        "forward_in_gap_s": max(0.0, fwd_end - longest[0]) / 1e6,  # the forward after the last update
        "head_latency_s": max(0.0, first_update - fwd_end) / 1e6,
    }


def analyse(
    path: Path, params: int, bus_gbs: float, bytes_per_param: float, skip: int, order: str = "arrival"
) -> dict[str, Any]:
    by_lane = lanes(load_events(path))
    steps = by_lane.get("step", [])
    steady = steps[skip:-1]
    if not steady:
        raise SystemExit(f"{path}: {len(steps)} steps in the trace; need more than {skip + 1} (lower --skip)")
    rows = [step_breakdown(by_lane, s) for s in steady]
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    upload_s = params * bytes_per_param / (bus_gbs * 1e9)
    forward = max(med["forward_device_s"], upload_s) if order == "arrival" else 0.0  # hidden in "forward"
    floor = med["update_busy_s"] + forward + med["head_latency_s"]
    return {
        "trace": path.name,
        "order": order,
        "steps": len(rows),
        **{k: round(v, 4) for k, v in med.items()},
        "forward_upload_s": round(upload_s, 4),
        "floor_s": round(floor, 4),
        "over_floor": round(med["step_s"] / floor - 1.0, 4),
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("traces", nargs="+", type=Path)
    p.add_argument("--params", type=int, required=True, help="the model's parameters (the record's 'params')")
    p.add_argument(
        "--bus-gbs", type=float, default=55.0, help="host-to-device GB/s (the H200's pinned rate: 55)"
    )
    p.add_argument(
        "--bytes-per-param", type=float, default=4.0, help="uploaded per parameter (4: FP32 masters)"
    )
    p.add_argument("--skip", type=int, default=3, help="leading steps left out (warm-up and the first timed)")
    p.add_argument(
        "--order",
        choices=("arrival", "forward"),
        default="arrival",
        help="the run's host update order (its record's forward_updates: true is 'forward')",
    )
    args = p.parse_args(argv)
    for path in args.traces:
        print(
            json.dumps(analyse(path, args.params, args.bus_gbs, args.bytes_per_param, args.skip, args.order))
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
