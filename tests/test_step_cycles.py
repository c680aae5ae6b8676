"""benchmarks/step_cycles.py on synthetic traces whose figures are known: each 1 s cycle has a forward
(unit 0, a 20 ms gap, unit 1), the head, the backward (unit 1, then unit 0), unit 1's update running 100
ms past the backward, then unit 0's, and the main thread waiting for unit 0 until the next forward."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest
from bench_helpers import load_benchmark

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "step_cycles.py"


def _script():
    sys.path.insert(0, str(SCRIPT.parent))
    return load_benchmark("step_cycles")


def _trace(path: Path, *, unit0_update_ms: float = 100.0, cycles: int = 5) -> Path:
    lanes = ["fwd", "head", "bwd", "update", "stall"]
    events: list[dict] = [
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": t, "args": {"name": n}} for t, n in enumerate(lanes)
    ]

    def span(lane: str, unit: int, start_ms: float, stop_ms: float) -> None:
        events.append(
            {
                "ph": "X",
                "name": f"{lane} {unit}",
                "ts": start_ms * 1e3,
                "dur": (stop_ms - start_ms) * 1e3,
                "pid": 1,
                "tid": lanes.index(lane),
                "args": {"unit": unit, "lane": lane},
            }
        )

    for k in range(cycles):
        t = 1000.0 * k
        span("fwd", 0, t, t + 100)
        span("fwd", 1, t + 120, t + 200)
        span("head", 2, t + 200, t + 300)
        span("bwd", 1, t + 300, t + 500)
        span("bwd", 0, t + 500, t + 600)
        span("update", 1, t + 550, t + 700)
        span("update", 0, t + 700, t + 700 + unit0_update_ms)
        span("stall", 0, t + 700 + unit0_update_ms, t + 990)
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    return path


def test_the_segments_add_up_to_the_cycle(tmp_path):
    script = _script()
    row = script.analyse(_trace(tmp_path / "a.json.gz"), skip=1)
    assert row["cycles"] == 3  # 5 forwards: 4 whole cycles, the first left out
    assert {k: row[k] for k in ("fwd", "head", "bwd", "tail", "up0")} == {
        "fwd": 200.0, "head": 100.0, "bwd": 300.0, "tail": 200.0, "up0": 200.0,
    }  # fmt: skip
    assert sum(row[k] for k in script.SEGMENTS) == row["cycle"] == 1000.0
    assert row["backlog"] == 200.0  # 100 ms of unit 1's update and all of unit 0's
    assert row["fwd_gaps"] == 20.0 and row["update_busy"] == 250.0 and row["stall0"] == 190.0


def test_two_traces_print_the_difference(tmp_path, capsys):
    base, slow = _trace(tmp_path / "base.json.gz"), _trace(tmp_path / "slow.json.gz", unit0_update_ms=150.0)
    assert _script().main([str(base), str(slow)]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(rows) == 3 and rows[2]["delta"] == "slow.json.gz - base.json.gz"
    assert (rows[2]["tail"], rows[2]["up0"], rows[2]["cycle"], rows[2]["backlog"]) == (50.0, -50.0, 0.0, 50.0)


def test_too_few_cycles_are_refused(tmp_path):
    with pytest.raises(SystemExit, match="need more than 4"):
        _script().analyse(_trace(tmp_path / "a.json.gz", cycles=3), skip=3)
