"""benchmarks/offload_floor.py on a synthetic trace whose figures are known: each 1 s step starts with
0.1 s of the previous step's updates, the forward (0.1-0.25 s) waits behind them, the host is idle until
the head's gradient arrives at 0.4 s, then updates to the step's end (the head, unit 5, first)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from bench_helpers import load_benchmark


def _script():
    return load_benchmark("offload_floor")


def _trace(path: Path, steps: int = 6) -> None:
    names = {0: "step", 1: "update", 2: "fwd"}
    events = [
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": t, "args": {"name": n}} for t, n in names.items()
    ]
    s = 1e6  # microseconds per second
    for k in range(steps):
        t0 = k * s
        events.append({"ph": "X", "name": f"step {k + 1}", "ts": t0, "dur": s, "pid": 1, "tid": 0})
        events.append({"ph": "X", "name": "update 0", "ts": t0, "dur": 0.1 * s, "pid": 1, "tid": 1})
        events.append({"ph": "X", "name": "fwd 0", "ts": t0 + 0.1 * s, "dur": 0.15 * s, "pid": 1, "tid": 2})
        for k, u in enumerate(reversed(range(6))):  # the step's own updates, back to back from 0.4 s
            events.append(
                {
                    "ph": "X",
                    "name": f"update {u}",
                    "ts": t0 + (0.4 + 0.1 * k) * s,
                    "dur": 0.1 * s,
                    "pid": 1,
                    "tid": 1,
                    "args": {"unit": u, "lane": "update"},
                }
            )
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)


def test_the_floor_is_the_update_plus_the_bus_bound_forward_plus_the_head(tmp_path):
    trace = tmp_path / "t.json.gz"
    _trace(trace)
    params = int(0.2 * 55e9 / 4)  # 0.2 s of FP32 uploads at 55 GB/s: more than the forward's 0.15 s
    r = _script().analyse(trace, params, 55.0, 4.0, skip=1)
    assert r["steps"] == 4  # 6 steps, the first and the last left out
    assert r["step_s"] == pytest.approx(1.0)
    assert r["update_busy_s"] == pytest.approx(0.7)
    assert r["longest_gap_s"] == pytest.approx(0.3)
    assert r["forward_device_s"] == pytest.approx(0.15)
    assert r["forward_upload_s"] == pytest.approx(0.2, abs=1e-4)
    assert r["head_latency_s"] == pytest.approx(0.15)
    assert r["floor_s"] == pytest.approx(0.7 + 0.2 + 0.15, abs=1e-4)
    assert r["over_floor"] == pytest.approx(1.0 / 1.05 - 1.0, abs=1e-4)
    slow_bus = _script().analyse(trace, params, 27.5, 4.0, skip=1)  # the forward is then bus-bound at 0.4 s
    assert slow_bus["floor_s"] == pytest.approx(0.7 + 0.4 + 0.15, abs=1e-4)


def test_too_few_steps_says_so(tmp_path):
    trace = tmp_path / "t.json.gz"
    _trace(trace, steps=2)
    with pytest.raises(SystemExit, match="2 steps in the trace; need more than 4"):
        _script().analyse(trace, 10, 55.0, 4.0, skip=3)


def test_the_forward_order_hides_the_forward_and_the_head_is_the_highest_unit(tmp_path):
    # In the forward order the previous step's updates run beside the forward: the floor drops F. The head
    # latency is read up to the head's update (unit 5 at 0.4 s), not up to a backlog update of unit 0 that
    # still runs after the forward ends (here at 0.3 s).
    trace = tmp_path / "t.json.gz"
    _trace(trace)
    with gzip.open(trace, "rt") as f:
        data = json.load(f)
    for k in range(6):
        data["traceEvents"].append(
            {"ph": "X", "name": "update 0", "ts": (k + 0.3) * 1e6, "dur": 0.05e6, "pid": 1, "tid": 1}
        )
    with gzip.open(trace, "wt") as f:
        json.dump(data, f)
    r = _script().analyse(trace, int(0.2 * 55e9 / 4), 55.0, 4.0, skip=1, order="forward")
    assert r["order"] == "forward" and r["head_latency_s"] == pytest.approx(0.15)
    assert r["update_busy_s"] == pytest.approx(0.75)
    assert r["floor_s"] == pytest.approx(0.75 + 0.15, abs=1e-4)
