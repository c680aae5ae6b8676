"""The pure planner: visit schedule and memory sizes."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from slidekit.planning import BWD, FWD, HEAD, plan_memory, plan_residency, schedule, spread_host_units


@given(layers=st.integers(1, 64), tied=st.booleans())
def test_schedule_visits_every_unit_forward_then_backward(layers, tied):
    visits = schedule(layers, tied)
    head = layers + 1
    assert [v.unit for v in visits if v.phase == FWD] == list(range(head))
    assert [v.unit for v in visits if v.phase == HEAD] == [head]
    assert [v.unit for v in visits if v.phase == BWD] == list(range(layers, -1, -1))
    assert len(visits) == 2 * layers + 3
    # Only the embedding's backward may skip its weights, and only when untied.
    skip = [v for v in visits if not v.needs_params]
    assert skip == ([] if tied else [visits[-1]])


def test_schedule_needs_a_layer():
    with pytest.raises(ValueError, match="at least one decoder layer"):
        schedule(0, False)


@given(
    numels=st.lists(st.integers(1, 10**9), min_size=3, max_size=80),
    window=st.integers(2, 8),
    rings=st.integers(1, 4),
    tied=st.booleans(),
)
def test_memory_plan_is_flat_in_depth(numels, window, rings, tied):
    plan = plan_memory(numels, compute_itemsize=2, window=window, grad_buffers=rings, tied=tied)
    assert plan.slot_numel == max(numels)
    assert plan.window == window + tied
    assert plan.device_bytes == 2 * plan.window * max(numels) * 2  # params + grads, BF16
    deeper = plan_memory(
        numels + numels[1:-1],
        compute_itemsize=2,
        window=window,
        grad_buffers=rings,
        tied=tied,
    )
    assert deeper.device_bytes == plan.device_bytes  # depth never grows the device side


@pytest.mark.parametrize(("window", "rings", "match"), [(1, 2, "window"), (3, 0, "grad_buffers")])
def test_memory_plan_rejects_bad_sizes(window, rings, match):
    with pytest.raises(ValueError, match=match):
        plan_memory(
            [10, 20],
            compute_itemsize=2,
            window=window,
            grad_buffers=rings,
            tied=False,
        )


@given(units=st.integers(1, 120), data=st.data())
def test_host_units_spread_evenly_over_the_backward_order(units, data):
    host = data.draw(st.integers(0, units))
    on_host = spread_host_units(units, host)
    assert sum(on_host) == host
    if host == units:
        return
    assert not on_host[0]  # the embedding (first in the next forward pass, last in backward) stays
    if host == 0:
        return
    assert on_host[-1]  # the head (first in backward) goes first
    # gaps between consecutive host units, in backward order, differ by at most one unit...
    positions = [units - 1 - u for u in reversed(range(units)) if on_host[u]]
    gaps = [b - a for a, b in itertools.pairwise(positions)]
    if gaps:
        assert max(gaps) - min(gaps) <= 1 and min(gaps) == (units - 1) // host
    # ...and the residents after the last host unit cover at least one gap of backward passes
    assert units - 1 - positions[-1] >= (units - 1) // host


def test_plan_residency_by_fraction_and_by_budget():
    assert plan_residency([1] * 30, bytes_per_param=1, budget=0, fraction=0.65) == [
        u not in {3, 6, 9, 12, 15, 18, 21, 24, 27, 29}
        for u in range(30)  # Qwen2.5-7B, 0.65 resident
    ]
    sizes = [5, 1, 1, 1, 1, 5]  # embedding and head far larger than a layer
    assert plan_residency(sizes, bytes_per_param=2, budget=18) == [True] * 5 + [False]
    assert plan_residency(sizes, bytes_per_param=2, budget=28) == [True] * 6
    assert plan_residency(sizes, bytes_per_param=2, budget=9) == [False] * 6  # not even the embedding
    with pytest.raises(ValueError, match="fraction"):
        plan_residency(sizes, bytes_per_param=1, budget=0, fraction=1.5)
