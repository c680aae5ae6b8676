"""The step-time model against every measured slidekit step on the H200 (issue 17: within 15%).

Reads the committed suite records (``benchmarks/calibrate_rates.py``: ``RECORDS``), rebuilds each
run's Layout from its model preset, batch, sequence length and residency mode, predicts its step
with the H200 profile, and compares it with the measured one (tokens per step over tokens/s).
The table is in docs/planning.md. CPU only.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from bench_helpers import load_benchmark

from slidekit.planning.profiles import H200_RATES

ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = 0.15


def _calibration():
    return load_benchmark("calibrate_rates")


calibration = _calibration()


@pytest.fixture(scope="module")
def cells():
    return calibration.cells()


def test_every_measured_cell_is_read(cells):
    """Every slidekit run that finished in the three suites is a cell: 12 at 3B, 7 at 7B, 2 at 14B."""
    per_model: dict[str, int] = {}
    for c in cells:
        per_model[c.record["model"]] = per_model.get(c.record["model"], 0) + 1
    assert per_model == {"qwen2.5-3b": 12, "qwen2.5-7b": 7, "qwen2.5-14b": 2}


def test_the_rebuilt_layouts_are_the_measured_ones(cells):
    """Each rebuilt layout keeps as many units resident as the run did: "auto" on the H200 profile's
    memory gives the 26 and 22 of 50 units the 14B runs kept."""
    for c in cells:
        assert c.resident == c.record["resident_units"], c.label
        assert c.layout.unit_grads == (c.record["max_grad_norm"] is not None and not all(c.layout.resident))


def test_every_cell_is_predicted_within_15_percent(cells):
    outside = [f"{c.label}: predicted {c.predicted_s:.3f} s, measured {c.measured_s:.3f} s ({c.error:+.1%})"
               for c in cells if abs(c.error) > TOLERANCE]  # fmt: skip
    assert not outside, "\n".join(outside)


def test_the_profile_states_what_the_records_give():
    """The H200 profile's compute figures are the ones ``derive`` reads from the all-resident lanes."""
    derived = calibration.derive()
    assert H200_RATES.layer_tflops == pytest.approx(derived["layer_tflops"], abs=0.05)
    assert H200_RATES.head_tflops == pytest.approx(derived["head_tflops"], abs=0.05)
    assert H200_RATES.device_gbps == pytest.approx(derived["device_gbps"], abs=0.5)
    assert H200_RATES.step_overhead_s == pytest.approx(derived["step_overhead_s"], abs=5e-5)


def test_the_table_has_a_row_per_cell(cells):
    table = calibration.markdown(cells).splitlines()
    assert len(table) == 2 + len(cells) and all(row.count("|") == 8 for row in table)


def test_the_documented_table_is_the_one_the_model_gives(cells):
    """docs/planning.md shows this very table (regenerate: python benchmarks/calibrate_rates.py --markdown)."""
    assert calibration.markdown(cells) in (ROOT / "docs" / "planning.md").read_text(encoding="utf-8")
