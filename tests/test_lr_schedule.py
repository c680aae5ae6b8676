"""Learning-rate schedules: warm-up, end points, shapes."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from slidekit.lr_schedule import SCHEDULES, lr_factor


def test_warmup_is_linear_from_zero():
    assert [lr_factor(s, schedule="constant", total=100, warmup=4) for s in (1, 2, 3, 4, 5, 99)] == [
        0.25,
        0.5,
        0.75,
        1.0,
        1.0,
        1.0,
    ]


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_decays_end_at_the_floor(schedule):
    f = [lr_factor(s, schedule=schedule, total=50, warmup=10, min_ratio=0.1) for s in range(1, 51)]
    assert f[9] == 1.0  # end of warm-up
    assert f[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in itertools.pairwise(f[9:]))  # non-increasing after warm-up


def test_cosine_midpoint():
    assert lr_factor(51, schedule="cosine", total=101, warmup=1) == pytest.approx(0.5)
    assert lr_factor(6, schedule="linear", total=11, warmup=1) == pytest.approx(0.5)


@given(
    step=st.integers(1, 10_000),
    total=st.integers(1, 10_000),
    warmup=st.integers(0, 500),
    schedule=st.sampled_from(SCHEDULES),
    floor=st.floats(0, 1),
)
def test_factor_stays_in_range(step, total, warmup, schedule, floor):
    f = lr_factor(step, schedule=schedule, total=total, warmup=warmup, min_ratio=floor)
    assert 0.0 < f <= 1.0 or (f == 0.0 and floor == 0.0)
    assert math.isfinite(f)


def test_bad_arguments():
    with pytest.raises(ValueError, match="choose one of: constant, linear, cosine"):
        lr_factor(1, schedule="step", total=10)
    with pytest.raises(ValueError, match="1-based"):
        lr_factor(0, schedule="constant", total=10)
