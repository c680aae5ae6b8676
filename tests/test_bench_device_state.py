"""The bench record says where each unit's master and state live: ``resident_units`` counts the units
that keep their weights on the device, ``device_state_units`` every unit whose master and state are
there, whether its weights stay or slide through the window (the largest runs: "0/66" said nothing of
the 38 units on the GPU)."""

from __future__ import annotations

import json

import pytest

from slidekit.tools.bench.slidekit_run import main


@pytest.mark.parametrize(
    ("resident", "weights", "kept", "state"),
    [("all", "slide", "0/6", "6/6"), ("all", "keep", "6/6", "6/6"), ("none", "auto", "0/6", "0/6")],
)
def test_the_record_counts_units_with_state_on_the_device(tmp_path, resident, weights, kept, state):
    out = tmp_path / "records.jsonl"
    argv = ["--model", "tiny", "--device", "cpu", "--batch", "2", "--seq", "32", "--steps", "1"]
    argv += ["--warmup", "0"]
    argv += ["--resident", resident, "--resident-weights", weights, "--out", str(out)]
    assert main(argv) == 0
    (record,) = (json.loads(line) for line in out.read_text().splitlines())
    assert (record["resident_units"], record["device_state_units"]) == (kept, state)
