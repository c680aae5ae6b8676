"""GPU-only: device spans of the Chrome trace sit on the host clock, and the metrics report GPU memory.

Run on a CUDA machine: ``pytest tests/gpu/test_trace_gpu.py``.
"""

from __future__ import annotations

import itertools
import json
from collections import defaultdict

import pytest
import torch

from slidekit import DataConfig, EngineConfig, OptimConfig, RunConfig, TrainConfig, Trainer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

#: Slack for the host/device alignment: the latency of noticing that an event completed, each way.
ALIGN_US = 200.0


@pytest.mark.parametrize("resident", ["none", "all"])
def test_device_spans_are_aligned_and_add_up(tmp_path, resident):
    cfg = TrainConfig(
        data=DataConfig(seq_len=128, batch_size=4),
        optim=OptimConfig(lr=1e-4),
        engine=EngineConfig(device="cuda", activation_tier="ram", gpu_resident=resident),
        run=RunConfig(dir=str(tmp_path / "run"), trace=str(tmp_path / "trace.json")),
        steps=4,
    )
    with Trainer(cfg) as t:
        result = t.fit()
    doc = json.loads((tmp_path / "trace.json").read_text())
    events = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    marks = [e for e in events if e["cat"] == "step"]
    spans = [e for e in events if e["cat"] != "step"]
    device = [e for e in spans if e["pid"] == 2]
    assert {"fwd", "head", "bwd"} <= {e["cat"] for e in device}
    if resident == "none":
        assert "h2d" in {e["cat"] for e in device}
    else:
        assert "update_gpu" in {e["cat"] for e in device}

    # Compute of a step runs between the step's start and the moment its loss and norm are read back.
    for e in device:
        if e["cat"] in ("fwd", "head", "bwd"):
            assert any(
                m["ts"] - ALIGN_US <= e["ts"] and e["ts"] + e["dur"] <= m["ts"] + m["dur"] + ALIGN_US
                for m in marks
            ), e

    # Device spans on one stream never overlap; their sum is what the step totals reported.
    rows = defaultdict(list)
    for e in device:
        rows[e["tid"]].append(e)
    for row in rows.values():
        row.sort(key=lambda e: e["ts"])
        for a, b in itertools.pairwise(row):
            assert a["ts"] + a["dur"] <= b["ts"] + 2.0, (a, b)
    for lane in ("fwd", "head", "bwd"):
        traced = sum(e["dur"] for e in device if e["cat"] == lane) / 1e6
        reported = sum(tm.get(lane, 0.0) for tm in result.timings)
        assert traced == pytest.approx(reported, rel=1e-3, abs=2e-6 * len(device)), lane

    rows_m = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(0 < m["gpu_mem_gib"] < 200 and m["tflops"] > 0 for m in rows_m)
