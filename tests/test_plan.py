"""The pure planner: visit schedule and memory sizes."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from slidekit.plan import BWD, FWD, HEAD, plan_memory, schedule


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
