"""The step-time model: its parts against hand arithmetic, its bounds, the planner's choice by predicted
step, the GPU profiles, and `slidekit plan` for a GPU this machine lacks.

The calibration against the measured H200 steps is ``tests/test_timing_calibration.py``.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from planning_fixtures import cuda_machine, planner, replay, tiny_spec

from slidekit.cli import main
from slidekit.config import DataConfig, EngineConfig, ModelConfig, OptimConfig, TrainConfig
from slidekit.errors import ConfigError
from slidekit.models.base import ArchSpec
from slidekit.planning import GIB, TIE, Machine, Placement, Planner, Rates, UpdateRate, plan_run
from slidekit.planning.clip_overlap import overlap_layout as room
from slidekit.planning.profiles import PROFILES, profile, profile_for_device
from slidekit.planning.rates import CLIP_PASS_BYTES, GRAD_PASS_BYTES
from slidekit.planning.simulate import Piece, UnitCost, simulate
from slidekit.planning.timing import backup_costs, predict_step, unit_costs
from slidekit.planning.what_if import what_if_machine
from slidekit.plugins import Plugins

#: Round figures, so that every expected second below is plain arithmetic.
RATES = Rates(
    name="test",
    layer_tflops=2.0,
    head_tflops=1.0,
    device_gbps=100.0,
    h2d_gbps=10.0,
    d2h_gbps=10.0,
    host_gbps=20.0,
    disk_read_gbps=1.0,
    disk_write_gbps=0.5,
    step_overhead_s=1e-4,
    updates={"adam": UpdateRate(host_params_per_s=1e9, device_bytes_per_param=28.0, source="test")},
)


def _planner(spec: ArchSpec, **kw: object) -> Planner:
    """``planner`` with the optimizer whose update rate ``RATES`` sets."""
    return planner(spec, **{"optimizer": "adam", **kw})  # type: ignore[arg-type]


def _machine(
    gpu: float = 80.0, ram: float = 64.0, disk: float | None = None, rates: Rates | None = RATES
) -> Machine:
    return cuda_machine(gpu, ram, disk, rates)


def _rates(**changes: object) -> Rates:
    return dataclasses.replace(RATES, **changes)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- the model's parts


@pytest.mark.parametrize(("recompute", "passes"), [("all", 4), ("auto", 3)])
def test_all_resident_is_compute_only_and_matches_the_arithmetic(recompute, passes):
    """Every unit resident: the step is the device's work, unit by unit, plus the per-step host time. A
    layer's forward and backward are 4 forwards when it recomputes, 3 when it keeps its activations
    ("auto" on 80 GB: every layer keeps)."""
    spec = tiny_spec("llama", num_hidden_layers=4)
    p = _planner(spec, batch=2, seq=16, accum=3, recompute=recompute)
    layout = p.layout(Placement(gpu_resident="all"), _machine())
    assert [u.keeps for u in layout.units] == [False, *[recompute == "auto"] * 4, False]
    pred = predict_step(layout, RATES, p.work)
    tokens, micro = 2 * 16, 3
    attention = 4 * spec.num_heads * spec.head_dim * 16 * tokens
    layers = sum(passes * (2 * u.numel * tokens + attention) for u in spec.units if u.kind == "layer") / 2e12
    head = 6 * spec.vocab_size * spec.hidden_size * tokens / 1e12
    embed = 3 * tokens * spec.hidden_size * 2 / 100e9
    passes = sum(u.numel for u in spec.units) * (GRAD_PASS_BYTES + 28) / 100e9
    compute = micro * (layers + head + embed) + passes
    assert pred.compute_s == pytest.approx(compute, rel=1e-9)
    assert pred.seconds == pytest.approx(compute + RATES.step_overhead_s, rel=1e-9)
    assert pred.exposed == pytest.approx({"host": RATES.step_overhead_s})
    assert set(pred.work) == {"compute", "host"} and pred.drain_s == 0 and pred.bound == "compute"
    assert pred.tokens == tokens * micro and pred.tokens_per_s == pytest.approx(pred.tokens / pred.seconds)


def test_every_unit_on_the_host_is_bound_by_its_updates():
    spec = tiny_spec("llama", num_hidden_layers=6)
    p = _planner(spec)
    slow = _rates(
        updates={"adam": UpdateRate(host_params_per_s=1e4, device_bytes_per_param=28.0, source="t")}
    )
    layout = p.layout(Placement(gpu_resident="none"), _machine())
    pred = predict_step(layout, slow, p.work)
    updates = sum(u.numel for u in spec.units) / 1e4
    assert pred.work["host update"] == pytest.approx(updates)
    assert pred.bound == "host update"
    assert updates <= pred.seconds <= updates + sum(pred.work.values())  # the optimizer lane is serial
    # The next forward needs unit 0 first, which the backward order updates last: a run's last step
    # ends once it is applied, so the drain is at least that update.
    assert pred.drain_s >= spec.units[0].numel / 1e4 * (1 - 1e-9)


def test_state_on_disk_is_bound_by_streaming_it():
    spec = tiny_spec("llama", num_hidden_layers=6)
    p = _planner(spec)
    place = Placement(gpu_resident="none", state_offload_tier="posix", state_offload_fraction=1.0)
    layout = p.layout(place, _machine(disk=10))
    assert all(u.streamed for u in layout.units)
    slow = _rates(disk_read_gbps=1e-3, disk_write_gbps=1e-3)
    pred = predict_step(layout, slow, p.work)
    state = 8 * sum(u.numel for u in spec.units)
    assert pred.work["disk"] == pytest.approx(2 * state / 1e6)  # read and written back, 1 MB/s each
    assert pred.bound == "disk" and pred.seconds >= pred.work["disk"] * (1 - 1e-9)


def test_slow_uploads_bound_the_step_and_resident_units_take_them_away():
    spec = tiny_spec("llama", num_hidden_layers=6)
    p = _planner(spec)
    slow = _rates(h2d_gbps=1e-3)
    none = predict_step(p.layout(Placement(gpu_resident="none"), _machine()), slow, p.work)
    once = sum(u.numel for u in spec.units) * 4 / 1e6  # every master up at least once a step
    assert none.bound == "upload" and none.seconds >= once
    half = predict_step(p.layout(Placement(gpu_resident="0.5"), _machine()), slow, p.work)
    assert half.work["upload"] < none.work["upload"] and half.seconds < none.seconds


def test_clipping_adds_one_pass_over_each_gradient_and_defers_the_updates():
    spec = tiny_spec("llama", num_hidden_layers=4)
    plain = _planner(spec)
    clipped = _planner(spec, keep_grads=True, clip=True)
    a = predict_step(plain.layout(Placement(gpu_resident="none"), _machine()), RATES, plain.work)
    layout = clipped.layout(Placement(gpu_resident="none"), _machine())
    assert layout.unit_grads
    b = predict_step(layout, RATES, clipped.work)
    extra = sum(u.numel for u in spec.units) * CLIP_PASS_BYTES / 20e9
    assert b.work["host update"] - a.work["host update"] == pytest.approx(extra, rel=1e-9)
    # deferred: every update waits for the end of the step, so a run's last step waits for all of them
    assert b.drain_s >= b.work["host update"] * (1 - 1e-9) > a.drain_s


def _backed_up(layout):
    """``layout`` with speculative clipping's backups (``Workload.clip_backup``, as the planner builds it)."""
    return dataclasses.replace(layout, clip_backup=True)


def test_a_backup_costs_its_master_and_state_read_and_written_at_its_rate_and_restores_at_the_hosts():
    """Backed up at the fused rate (``fused_backup``) or the copy rate, each falling back to host
    bandwidth; restored at host bandwidth: master (4 B/param) and state (8 B/param here), both ways."""
    spec = tiny_spec("llama", num_hidden_layers=4)
    p = _planner(spec, keep_grads=True, clip=True)
    place = Placement(gpu_resident="0.5", state_offload_tier="posix", state_offload_fraction=0.5)
    layout = _backed_up(p.layout(place, _machine(disk=10)))
    costs = unit_costs(layout, RATES, p.work)
    backed = {u.index for u in layout.backed_up()}
    assert backed and any(u.streamed for u in layout.units if u.slides)  # some on disk: not backed up
    with_rates = _rates(backup_gbps=80.0, backup_copy_gbps=5.0)
    for rates, fused, backup_gbps in (
        (RATES, True, 20.0),
        (RATES, False, 20.0),
        (with_rates, True, 80.0),
        (with_rates, False, 5.0),
    ):
        for u, c in zip(layout.units, backup_costs(costs, layout, rates, fused=fused), strict=True):
            moved = u.numel * 2 * (4 + 8) if u.index in backed else 0.0
            assert sum(x.backup_s for x in c.pieces) == pytest.approx(moved / (backup_gbps * 1e9), rel=1e-12)
            assert sum(x.restore_s for x in c.pieces) == pytest.approx(moved / 20e9, rel=1e-12)
    plain = p.layout(place, _machine(disk=10))
    assert backup_costs(costs, plain, RATES) == costs  # no backups: the costs as they are
    # Out of place (fused_update_out) the update writes its new values elsewhere and restores nothing.
    for u, c in zip(layout.units, backup_costs(costs, layout, with_rates, out_of_place=True), strict=True):
        assert all(x.speculates is (u.index in backed) and x.backup_s == x.restore_s == 0 for x in c.pieces)


def test_a_layout_without_backups_is_priced_exactly_as_before():
    """What ``predict_step`` did before speculative clipping was priced: one replay of ``unit_costs``."""
    spec = tiny_spec("llama", num_hidden_layers=4)
    for clip in (False, True):
        p = _planner(spec, keep_grads=clip, clip=clip)
        for resident in ("none", "0.5"):
            layout = p.layout(Placement(gpu_resident=resident), _machine())
            assert not layout.clip_backup
            old = simulate(
                unit_costs(layout, RATES, p.work),
                window=layout.window.window,
                prefetch=layout.prefetch,
                ring=layout.ring_buffers,
                tied=p.work.tied,
                defer=layout.unit_grads,
                micro=p.work.micro,
                step_overhead_s=RATES.step_overhead_s,
            )
            pred = predict_step(layout, RATES, p.work)
            assert (pred.seconds, pred.drain_s, pred.work, pred.exposed) == (
                old.seconds,
                old.drain_s,
                old.busy,
                old.exposed,
            )
            assert pred.clipped_s is None and "on a step that clips" not in pred.describe()


def test_speculative_clipping_arithmetic_when_the_host_updates_bound_the_step():
    """Every unit on the host, updates far slower than the rest: the step is the optimizer lane's work.
    The head's gradients come down first and the lane takes it at once, before the backward (fast here)
    has ended: it is backed up. By the time the lane is free the norm is known: every other unit is
    updated plainly, in the next forward's order. A step that does not clip: every update (with its
    clipping pass) and the head's backup; a step that clips: the head's update and backup, then at the
    step's end the head restored (the backup's bytes again) and every unit's deferred update."""
    spec = tiny_spec("llama", num_hidden_layers=4)
    slow = _rates(
        host_gbps=2.4e-4,  # 24 B/param of backup (12 read, 12 written) take 1e-4 s/param, as the update
        updates={"adam": UpdateRate(host_params_per_s=1e4, device_bytes_per_param=28.0, source="t")},
    )
    p = _planner(spec, keep_grads=True, clip=True)
    deferred = p.layout(Placement(gpu_resident="none"), _machine())
    n, head = sum(u.numel for u in spec.units), spec.units[-1].numel
    update, clip, backup = n / 1e4, n * CLIP_PASS_BYTES / 2.4e5, head * 24 / 2.4e5
    head_update = head / 1e4 + head * CLIP_PASS_BYTES / 2.4e5
    before = predict_step(deferred, slow, p.work)
    assert before.work["host update"] == pytest.approx(update + clip, rel=1e-9)
    layout = _backed_up(deferred)
    pred = predict_step(layout, slow, p.work)
    assert pred.work["host update"] == pytest.approx(update + clip + backup, rel=1e-9)
    assert pred.seconds == pytest.approx(update + clip + backup, rel=2e-3)
    assert pred.clipped_s == pytest.approx(update + clip + head_update + 2 * backup, rel=2e-3)
    assert pred.seconds < pred.clipped_s < before.seconds + head_update + 2 * backup + 1e-9
    text = pred.describe()
    assert f"; {pred.clipped_s:.1f} s on a step that clips), bound by host updates" in text
    last = len(spec.units) - 1
    for rollback in (False, True):
        takes = replay(layout, slow, p, rollback=rollback).takes
        assert takes == ((last, True), *((u, False) for u in range(last))), rollback


def test_speculative_clipping_hides_the_updates_under_the_backward_where_a_deferred_step_cannot():
    """Slow compute, the host updates ~0.4 of it: longer than a forward pass (which is all a deferred
    update can hide under), shorter than the backward. A step that does not clip costs about what an
    unclipped one does, less than the deferred step; a step that clips costs at least the deferred one."""
    spec = tiny_spec("llama", num_hidden_layers=6)
    rates = _rates(
        layer_tflops=1e-4,
        head_tflops=1e-4,
        updates={"adam": UpdateRate(host_params_per_s=2.5e5, device_bytes_per_param=28.0, source="t")},
    )
    unclipped = _planner(spec)
    plain = predict_step(unclipped.layout(Placement(gpu_resident="none"), _machine()), rates, unclipped.work)
    p = _planner(spec, keep_grads=True, clip=True)
    deferred = p.layout(Placement(gpu_resident="none"), _machine())
    before = predict_step(deferred, rates, p.work)
    pred = predict_step(_backed_up(deferred), rates, p.work)
    assert pred.clipped_s is not None
    assert plain.seconds <= pred.seconds < before.seconds <= pred.clipped_s
    # What the speculative step adds to the unclipped one: at most the embedding's own update and backup
    # (the last backward, nothing after it to hide under) and its clipping pass.
    embed = spec.units[0].numel
    assert pred.seconds - plain.seconds <= embed * (1 / 2.5e5 + (CLIP_PASS_BYTES + 24) / 20e9) * (1 + 1e-6)
    assert before.seconds - pred.seconds > 0.1 * plain.work["host update"]  # the deferred path's exposure


def test_activations_on_a_tier_cross_the_bus_each_way():
    spec = tiny_spec("llama", num_hidden_layers=4)
    p = _planner(spec, batch=8, seq=64, accum=2, recompute="all")
    layout = p.layout(Placement(gpu_resident="all", activation_tier="ram"), _machine())
    pred = predict_step(layout, RATES, p.work)
    assert pred.work["activations"] == pytest.approx(2 * layout.activation_bytes / 10e9)
    on_disk = p.layout(Placement(gpu_resident="all", activation_tier="posix"), _machine(disk=1))
    disk = predict_step(on_disk, RATES, p.work)
    assert disk.work["activations"] == pytest.approx(on_disk.activation_bytes * (1 / 1e9 + 1 / 0.5e9))


def test_layers_that_keep_their_activations_send_none_to_the_tier():
    """Keeping layers save no boundary activation: only the recomputing ones' inputs cross the bus."""
    spec = tiny_spec("llama", num_hidden_layers=4)
    every = _planner(spec, batch=8, seq=64, accum=2, recompute="all")
    auto = _planner(spec, batch=8, seq=64, accum=2)
    placement = Placement(gpu_resident="all", activation_tier="ram")
    base = every.layout(placement, _machine())
    kept = auto.layout(placement, _machine())
    assert sum(u.keeps for u in kept.units) == 4 and kept.activation_bytes == 0
    assert "activations" not in predict_step(kept, RATES, auto.work).work
    # The last two keeping: half the traffic; their backward is 2 forwards instead of 3.
    half = auto._layout(placement, [True] * 6, (False, False, False, True, True, False))
    assert half.activation_bytes == base.activation_bytes // 2
    pred, full = predict_step(half, RATES, auto.work), predict_step(base, RATES, every.work)
    assert pred.work["activations"] == pytest.approx(full.work["activations"] / 2)
    forward = sum(auto.work.layer_flops(u.numel) for u in spec.units[3:5]) / 2e12
    assert full.compute_s - pred.compute_s == pytest.approx(2 * forward, rel=1e-9)  # 2 micro-batches


def test_an_optimizer_without_a_rate_is_priced_by_the_bytes_it_moves():
    rate = RATES.update("mystery", 2.0)
    assert rate.host_params_per_s == pytest.approx(20e9 / (2 + 8 + 4)) and "estimated" in rate.source
    assert RATES.update("adam", 8.0) is RATES.updates["adam"]


def test_rates_refuse_figures_that_are_not_positive():
    with pytest.raises(ConfigError, match=r"h2d_gbps must be positive, got 0\.0"):
        _rates(h2d_gbps=0.0)
    with pytest.raises(ConfigError, match="step_overhead_s must be >= 0"):
        _rates(step_overhead_s=-1.0)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    layers=st.integers(1, 6),
    tied=st.booleans(),
    window=st.integers(2, 4),
    buffers=st.integers(1, 3),
    accum=st.integers(1, 3),
    resident=st.sampled_from(["none", "0.25", "0.5", "all"]),
    clip=st.booleans(),
    acts=st.sampled_from(["device", "ram", "posix"]),
    fraction=st.sampled_from([0.0, 0.5, 1.0]),
    scale=st.floats(1e-3, 1e3),
    backup=st.booleans(),
)
def test_the_replay_accounts_for_every_second(
    layers, tied, window, buffers, accum, resident, clip, acts, fraction, scale, backup
):
    """Whatever the layout: the step is its compute plus what the compute waited for, lane by lane, and
    no serial lane works longer than a step (the replay is steady); with backups (speculative clipping)
    a step that clips costs at least the one that does not."""
    spec = tiny_spec("qwen2" if tied else "llama", num_hidden_layers=layers)
    p = _planner(spec, accum=accum, window=window, grad_buffers=buffers, keep_grads=clip, clip=clip)
    place = Placement(
        gpu_resident=resident,
        activation_tier=acts,
        state_offload_tier="posix" if fraction else None,
        state_offload_fraction=fraction,
    )
    layout = p.layout(place, _machine(disk=10))
    if clip and backup:
        layout = _backed_up(layout)
    rates = _rates(h2d_gbps=10.0 * scale, disk_read_gbps=scale, disk_write_gbps=scale / 2)
    pred = predict_step(layout, rates, p.work)
    assert (pred.clipped_s is not None) == bool(layout.backed_up())
    assert pred.clipped_s is None or pred.clipped_s >= pred.seconds * (1 - 1e-9)
    assert pred.seconds > 0 and pred.drain_s >= 0 and min(pred.exposed.values(), default=0) >= 0
    assert pred.compute_s + sum(pred.exposed.values()) == pytest.approx(pred.seconds, rel=1e-9)
    bus = pred.work.get("upload", 0.0) + pred.work.get("cast", 0.0)  # one host -> device lane
    assert bus <= pred.seconds * (1 + 1e-9)
    for lane in ("compute", "grad copy", "host update", "disk"):
        assert pred.work.get(lane, 0.0) <= pred.seconds * (1 + 1e-9), lane


def test_simulate_refuses_too_few_steps():
    unit = UnitCost(kind="layer", resident=False, pieces=(Piece(0.1, 0.1),))
    with pytest.raises(ValueError, match="at least 3 simulated steps"):
        simulate([unit] * 3, window=2, prefetch=1, ring=1, tied=False, defer=False, micro=1,
                 step_overhead_s=0, max_steps=2)  # fmt: skip


@pytest.mark.parametrize(("window", "casts"), [(1, 5), (2, 4)])
def test_a_unit_whose_weights_slide_takes_a_cache_unit_and_casts_on_the_upload_lane(window, casts):
    """Resident units whose weights slide (three layers) claim cache units as host units do, and each
    visit that finds none holding its weights casts them on the host -> device lane (``Uploads._cast``).
    One cache unit: the forward casts the three, the backward finds layer 3 still there and casts 2 and 1
    again (5). Two: layer 2 is still there too (4). The embedding and head keep their own weights: none."""
    own = [UnitCost(kind=k, resident=True, fwd_s=0.01, bwd_s=0.01) for k in ("embed", "head")]
    layer = UnitCost(kind="layer", resident=True, fwd_s=0.01, bwd_s=0.01, weights_slide=True, cast_s=1.0)
    units = [own[0], layer, layer, layer, own[1]]
    sim = simulate(units, window=window, prefetch=window - 1, ring=1, tied=False, defer=False, micro=1,
                   step_overhead_s=0)  # fmt: skip
    assert sim.busy["cast"] == pytest.approx(casts) and "upload" not in sim.busy
    assert sim.seconds >= casts and sim.exposed.get("cast", 0.0) > 0.9 * casts
    kept = [dataclasses.replace(u, weights_slide=False, cast_s=0.0) for u in units]
    alone = simulate(kept, window=window, prefetch=window - 1, ring=1, tied=False, defer=False, micro=1,
                     step_overhead_s=0)  # fmt: skip
    assert "cast" not in alone.busy and alone.seconds == pytest.approx(0.09)  # nine visits of 0.01 s


def test_unit_costs_price_each_piece_of_a_large_unit():
    spec = tiny_spec("llama", num_hidden_layers=2, vocab_size=4096)  # embedding and head larger than a layer
    p = _planner(spec)
    layout = p.layout(Placement(gpu_resident="none"), _machine())
    costs = unit_costs(layout, RATES, p.work)
    for u, c in zip(layout.units, costs, strict=True):
        assert len(c.pieces) == len(u.pieces) > 0
        assert sum(x.down_s for x in c.pieces) == pytest.approx(u.numel * 2 / 10e9)
        assert sum(x.update_s for x in c.pieces) == pytest.approx(u.numel / 1e9)
        assert c.upload_s == pytest.approx(u.numel * 4 / 10e9)
    assert len(costs[-1].pieces) > 1  # the head comes down in layer-sized pieces


# ---------------------------------------------------------------------------- the planner's choice


def test_without_rates_the_fixed_order_decides():
    spec = tiny_spec("llama", num_hidden_layers=8, vocab_size=512)
    p = _planner(spec)
    est = p.recommend(Placement(), _machine(rates=None))
    assert est is not None and est.placement.gpu_resident == "all"
    assert p.predict(est.layout, _machine(rates=None)) is None  # type: ignore[arg-type]


def test_the_predicted_step_chooses_where_the_fixed_order_would_not():
    """A GPU that holds either the activations or one more resident unit: with slow host updates the
    extra resident (activations in RAM) wins on time, while the fixed order puts activations first. (The
    units on the GPU slide their weights, so that the candidates differ only in where the units and the
    activations go.)"""
    base = Placement(resident_weights="slide")
    big = {
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
    }
    spec = tiny_spec(
        "llama", num_hidden_layers=8, vocab_size=32000, head_dim=128, max_position_embeddings=512, **big
    )
    p = _planner(spec, batch=64, seq=512)
    slow = _rates(
        updates={"adam": UpdateRate(host_params_per_s=1e6, device_bytes_per_param=28.0, source="t")}
    )
    found = None
    for gib in range(20, 80):  # a GPU where activations in RAM leave room for more residents
        machine = dataclasses.replace(_machine(gpu=gib), rates=slow)
        on_device = sum(p.residency(base, machine))
        in_ram = sum(p.residency(dataclasses.replace(base, activation_tier="ram"), machine))
        if 0 < on_device < in_ram < len(spec.units):
            found = machine
            break
    assert found is not None
    fixed = p.recommend(base, dataclasses.replace(found, rates=None))
    timed = p.recommend(base, found)
    assert fixed is not None and timed is not None
    assert fixed.placement.activation_tier == "device" and timed.placement.activation_tier == "ram"
    assert sum(timed.resident) > sum(fixed.resident)
    # and it is the fastest of every placement that fits, within the tie band
    seconds = [
        p.predict_layout(e, found)
        for c in p.split_candidates(base, None, found)
        if (e := p.estimate(c, found)).placement_fits(found)
    ]
    assert p.predict_layout(timed, found) <= min(seconds) * (1 + TIE)
    assert p.predict_layout(timed, found) < p.predict_layout(fixed, found)


def test_ties_keep_the_fixed_order():
    spec = tiny_spec("llama", num_hidden_layers=4)
    p = _planner(spec)
    est = p.recommend(Placement(gpu_resident="none"), _machine())
    assert est is not None and est.placement.gpu_resident == "all"  # "auto" holds them all too: a tie


def test_the_split_puts_the_fewest_units_state_on_disk():
    """RAM short of all the state: the planner moves whole units' state to disk, the fewest that make RAM
    suffice (not the next quarter), which is also the fastest."""
    spec = tiny_spec("llama", num_hidden_layers=10)
    p = _planner(spec, device_updates=False)  # nothing can be resident: RAM holds every master
    place = Placement(gpu_resident="none")
    full = p.estimate(place, _machine())
    ram = full.host_bytes - 0.3 * full.host["state"]
    machine = dataclasses.replace(_machine(disk=10), host_available=int(ram), host_total=int(ram))
    est = p.recommend(place, machine)
    assert est is not None and est.placement.state_offload_tier == "posix"
    units = len(spec.units)
    k = round(est.placement.state_offload_fraction * units)
    assert 0 < k < units and est.host_fits(machine)
    fewer = dataclasses.replace(est.placement, state_offload_fraction=(k - 1) / units)
    assert not p.estimate(fewer, machine).host_fits(machine)
    coarse = p.recommend(place, dataclasses.replace(machine, rates=None))  # the quarter grid
    assert (
        coarse is not None and coarse.placement.state_offload_fraction >= est.placement.state_offload_fraction
    )
    assert p.predict_layout(est, machine) <= p.predict_layout(coarse, machine) * (1 + TIE)


# ---------------------------------------------------------------------------- profiles


def test_profiles_say_where_every_figure_comes_from():
    fields = [f.name for f in dataclasses.fields(Rates) if f.name not in ("name", "updates", "sources")]
    for name, gpu in PROFILES.items():
        assert profile(name) is gpu and profile(name.upper()) is gpu
        assert set(gpu.rates.sources) == set(fields), name
        assert {"layer_adam", "adamw_8bit", "adamw_fp8"} <= set(gpu.rates.updates)
        assert 0 < gpu.device_free < gpu.device_total
    h200, rtx = PROFILES["h200"].rates, PROFILES["rtx4090"].rates
    assert all(s.startswith("measured") for s in h200.sources.values())
    sources = [
        *rtx.sources.values(),
        *(u.source for u in rtx.updates.values()),
        PROFILES["rtx4090"].memory_source,
    ]
    assert not any(s.startswith("measured") for s in sources)  # nothing of it was measured here
    assert all(s.startswith(("derived", "assumed", "published")) for s in sources)
    assert rtx.layer_tflops < h200.layer_tflops and rtx.h2d_gbps < h200.h2d_gbps
    with pytest.raises(ConfigError, match=r"unknown GPU profile .b300.*h200, rtx4090"):
        profile("b300")


def test_adamw_fp8s_rates_are_the_h200_hosts_measured_and_the_workstations_scaled_by_its_triad():
    h200, rtx = PROFILES["h200"].rates.updates["adamw_fp8"], PROFILES["rtx4090"].rates.updates["adamw_fp8"]
    assert h200.host_params_per_s == 5.687e9
    assert h200.source.startswith(
        "measured: host 5.687 G params/s (benchmarks/fp8_codec.py rate, 16 threads, "
        "docs/benchmarks/raw/2026-12-02-s10/fp8_rate.json)"
    )
    assert rtx.host_params_per_s == pytest.approx(5.687e9 * 65 / 95, rel=2e-3)
    assert rtx.source.startswith("assumed") and "x 65 / 95 GB/s of triad" in rtx.source
    for rate in (h200, rtx):  # host only: the device figure is documented as never used
        assert "not applicable, host only" in rate.source and rate.device_bytes_per_param == 16.0


def test_a_probed_gpu_gets_its_profiles_rates():
    assert profile_for_device("NVIDIA H200") is PROFILES["h200"]
    assert profile_for_device("NVIDIA GeForce RTX 4090") is PROFILES["rtx4090"]
    assert profile_for_device("NVIDIA A100-SXM4-80GB") is None


# ---------------------------------------------------------------------------- slidekit plan, what-ifs


def test_plan_says_what_if_and_compares_no_given_figure_with_this_machine(capsys):
    """--ram-gib beyond this machine's RAM printed "RAM 123.60 GiB available of 23.54 GiB"."""
    assert main(["plan", "--device", "cpu", "--ram-gib", "123.6", "--disk-gib", "7"]) == 0
    out = capsys.readouterr().out
    assert "RAM 123.60 GiB available (what-if)" in out and "available of" not in out
    with pytest.raises(ConfigError, match="--gpu-gib plans for a GPU"):
        from slidekit.planning.what_if import plan_machine

        plan_machine(TrainConfig(engine=EngineConfig(device="cpu")), gpu_gib=10)


def test_plan_for_a_gpu_this_machine_lacks(capsys):
    """`slidekit plan --gpu h200` plans for the H200 whether or not CUDA is here, with its rates."""
    assert main(["plan", "--gpu", "h200", "--batch-size", "2", "--seq-len", "64"]) == 0
    out = capsys.readouterr().out
    assert "GPU h200 139.29 GiB free (what-if)" in out and "on cuda (h200, what-if)" in out
    assert "kernels triton_cuda" in out and "rates: h200 (measured)" in out
    assert "predicted step" in out and "split: " in out and "verdict: fits" in out
    assert main(["plan", "--gpu", "h200", "--device", "cpu"]) == 2  # a what-if for a GPU computes there
    assert "--gpu plans for a CUDA device" in capsys.readouterr().err
    assert main(["plan", "--gpu", "b300"]) == 2
    assert main(["plan", "--preset", "tiny", "--model", "demo"]) == 2
    assert "give --model or --preset" in capsys.readouterr().err


@pytest.fixture(scope="module")
def llama70b(tmp_path_factory):
    from slidekit.tools.presets import write_config

    path = tmp_path_factory.mktemp("llama-3.1-70b")
    write_config("llama-3.1-70b", path, 1024)
    return path


def _what_if(
    model, gpu: str, ram: float, tmp_path, *, optimizer: str = "layer_adam", disk: float | None = 4000
):
    here = Machine(device_type="cpu", host_available=GIB, host_total=GIB, disk_free=None)
    machine = what_if_machine(PROFILES[gpu], here, ram_gib=ram, disk_gib=disk)
    config = TrainConfig(
        model=ModelConfig(source=str(model)),
        data=DataConfig(batch_size=8, seq_len=1024),
        engine=EngineConfig(offload_dir=str(tmp_path / "off")),
        optim=OptimConfig(name=optimizer),
    )
    return plan_run(config, machine=machine, gpu=PROFILES[gpu])


@pytest.mark.parametrize("optimizer", ["layer_adam", "adamw_8bit"])
def test_llama_70b_what_ifs(llama70b, tmp_path, optimizer):
    """The boxes users grow into (docs/planning.md): one H200 with 256 or 512 GiB of RAM, an RTX 4090
    with 256 GiB. Which placement each gets and its predicted step; more RAM is never slower."""
    steps = {}
    for ram in (256, 512):
        report = _what_if(llama70b, "h200", ram, tmp_path, optimizer=optimizer)
        rec, step = report.recommended, report.recommended_step
        assert rec is not None and step is not None and rec.fits(report.machine), ram
        assert 0 < sum(rec.resident) < len(rec.resident)  # the GPU holds some units, not all
        assert report.requested_step is not None
        text = report.render()
        assert "fastest placement that fits with the shortest predicted step" in text and "split:" in text
        steps[ram] = (step.seconds, rec.placement.state_offload_fraction, step.bound)
    assert steps[512][0] <= steps[256][0] * (1 + TIE)  # more RAM never slower
    assert steps[512][1] <= steps[256][1]  # ... and never more state on disk
    if optimizer == "layer_adam":  # 12 B/param of masters and state: both boxes stream state from disk
        assert steps[256][1] > steps[512][1] > 0 and steps[256][2] == "disk"
    else:  # 6 B/param: 512 GiB holds it all in RAM
        assert steps[512][1] == 0 and steps[512][2] != "disk"
    # without a disk the 256 GiB box cannot hold the state at all
    assert _what_if(llama70b, "h200", 256, tmp_path, optimizer=optimizer, disk=None).recommended is None
    # the RTX 4090 box: its 256 GiB cannot hold the FP32 masters (4 B/param), whatever goes to disk
    rtx = _what_if(llama70b, "rtx4090", 256, tmp_path, optimizer=optimizer)
    assert rtx.recommended is None and not rtx.fits
    assert rtx.floor and any(line.startswith("host RAM") and "masters" in line for line in rtx.floor[1:])
    assert "not even the most offloaded" in rtx.render()
    # with room for the masters it fits; its device computes the same step far slower than the H200
    bigger = _what_if(llama70b, "rtx4090", 512, tmp_path, optimizer=optimizer)
    h200 = _what_if(llama70b, "h200", 512, tmp_path, optimizer=optimizer).recommended_step
    assert bigger.recommended_step is not None and h200 is not None
    assert bigger.recommended_step.compute_s > 4 * h200.compute_s


def test_llama_70b_preset_through_the_command_line(tmp_path, capsys):
    off = tmp_path / "off"
    args = ["plan", "--preset", "llama-3.1-70b", "--gpu", "h200", "--ram-gib", "512", "--disk-gib", "4000"]
    code = main([*args, "--offload-dir", str(off), "--batch-size", "8", "--seq-len", "1024"])
    out = capsys.readouterr().out
    assert code == 1  # the requested placement (all state in RAM) does not fit; the recommendation does
    assert "model: preset llama-3.1-70b (llama, 80 layers, 70.55B parameters)" in out
    assert "predicted step if it fit" in out and "fastest placement that fits" in out
    predictions = [line for line in out.splitlines() if line.startswith("  predicted step")]
    assert len(predictions) == 2
    # The disk role's tier: posix here, gds where kvikio is installed (the GPU machine): not a name to pin.
    disk = re.search(r"--state-offload-tier (\w+)", out)
    assert disk, out
    assert {r.name: r.descriptor.medium for r in Plugins().drivers("tier")}[disk.group(1)] == "disk"


def test_the_cpu_gets_no_prediction():
    report = plan_run(TrainConfig(engine=EngineConfig(device="cpu")))
    assert report.requested_step is None and "not predicted on the CPU" in report.render()
    assert torch.device("cpu").type == report.machine.device_type


def test_auto_clip_overlap_speculates_only_where_the_model_predicts_it_faster():
    """``overlap_layout``: with rates, "auto" keeps the backups where a speculating step is predicted
    faster than a deferring one, and drops them (saying so) where the backups' copies cost more."""

    spec = tiny_spec("llama", num_hidden_layers=6)
    p = _planner(spec, keep_grads=True, clip=True)
    layout = _backed_up(p.layout(Placement(gpu_resident="none"), _machine()))
    hides = _rates(  # slow compute: the updates hide under the backward only when they speculate
        layer_tflops=1e-4,
        head_tflops=1e-4,
        updates={"adam": UpdateRate(host_params_per_s=2.5e5, device_bytes_per_param=28.0, source="t")},
    )
    kept, note = room(p, layout, _machine(rates=hides), "auto")
    assert kept.clip_backup and note is None
    copies = _rates(  # the host's memory so slow that the backups' copies outweigh the overlap
        host_gbps=1e-3,
        updates={"adam": UpdateRate(host_params_per_s=1e4, device_bytes_per_param=28.0, source="t")},
    )
    dropped, note = room(p, layout, _machine(rates=copies), "auto")
    assert not dropped.clip_backup and note is not None and "predicts" in note and "defer" in note
    assert room(p, layout, _machine(rates=copies), "speculate")[0].clip_backup  # asked for: kept
    assert room(p, layout, _machine(rates=None), "auto")[0].clip_backup  # no rates: nothing to predict with


#: The H200's 3B forced-offload batch-32 whole steps, median: a clip of 1.0 deferred (raw/2026-12-02-s15/
#: ratio-clip-3b, aaa9dbe), speculating with a clip that never fires (no step rolls back) and with a clip
#: of 1.0 that rolls back every step (raw/2026-12-04-s16/clip-3b, 688920f: the forward-order takes).
MEASURED_3B_B32 = {"defer": 1.642, "speculate": 1.408, "clipped": 2.233}


def _plan_3b_b32(capsys, *flags: str) -> str:
    args = ["plan", "--preset", "qwen2.5-3b", "--gpu", "h200", "--ram-gib", "125", "--batch-size", "32"]
    main([*args, "--seq-len", "1024", "--gpu-resident", "none", "--max-grad-norm", "1.0", *flags])
    return capsys.readouterr().out


def _requested_step(out: str) -> float:
    return float(re.search(r"^  predicted step ([0-9.]+) s", out, re.M).group(1))


def _clipped_step(out: str) -> float:
    return float(re.search(r"^  predicted step .*; ([0-9.]+) s on a step that clips", out, re.M).group(1))


def test_plan_predicts_the_clipped_step_the_engine_runs(capsys, monkeypatch):
    """Measured with the backups written in place (before ``fused_update_out``, and priced so here). On the
    H200's rates (the backups written in the update's pass at an effective 257 GB/s, restored at the
    host's 95 GB/s; the takes in the next forward's order, plain once the norm is known) the 3B
    shape at batch 32: "auto" speculates, predicting the speculating step (the engine's builder decides
    through the same ``overlap_layout``), and the three predictions are within 15% of the measured steps
    (the speculating ones measured on a host whose layer updates ran 18% slower than the rates' figure,
    20.98 against 17.84 ms, NOTES.md 31: the model predicts them 13.5% and 7.7% short)."""
    from slidekit_optim.layer_adam import LayerAdam

    monkeypatch.setattr(LayerAdam, "fused_update_out", False)
    auto = _plan_3b_b32(capsys)
    assert "note: optim.clip_overlap" not in auto and "clip backup" in auto.split("fastest placement")[0]
    defer, spec = _plan_3b_b32(capsys, "--clip-overlap", "defer"), _plan_3b_b32(capsys, "--clip-overlap", "speculate")
    assert "clip backup" in spec and "clip backup" not in defer.split("fastest placement")[0]
    assert _requested_step(auto) == _requested_step(spec) < _requested_step(defer)
    for policy, out in (("defer", defer), ("speculate", spec)):
        assert _requested_step(out) == pytest.approx(MEASURED_3B_B32[policy], rel=0.15), policy
    assert _clipped_step(spec) == pytest.approx(MEASURED_3B_B32["clipped"], rel=0.15)


def test_the_plan_prices_backups_fused_or_copied_as_the_optimizer_declares(capsys, monkeypatch):
    """``fused_backup`` and ``fused_update_out`` reach the step-time model from the optimizer's declaration:
    layer_adam updates out of place (and could write its backups in its update's pass), adamw_fp8 updates
    out of place and writes no backups (its in-place backups would be priced as copies)."""
    seen = set()
    predict = Planner.predict

    def spy(self, layout, machine):
        seen.add((self.optimizer, self.work.fused_backup, self.work.out_of_place))
        return predict(self, layout, machine)

    monkeypatch.setattr(Planner, "predict", spy)
    for optimizer in ("layer_adam", "adamw_fp8"):
        _plan_3b_b32(capsys, "--clip-overlap", "speculate", "--optimizer", optimizer)
    assert seen == {("layer_adam", True, True), ("adamw_fp8", False, True)}


def test_out_of_place_speculation_is_predicted_at_the_unclipped_step(capsys, monkeypatch):
    """The H200's rates, 3B at batch 32, a clip that never fires: updating out of place, the speculating
    step is predicted as fast as the unclipped one (the same bytes per update; NOTES.md 36), within 3%
    (the speculating step's takes), and faster than with the backups written in place."""
    from slidekit_optim.layer_adam import LayerAdam

    out_of_place = _requested_step(_plan_3b_b32(capsys))
    args = ["plan", "--preset", "qwen2.5-3b", "--gpu", "h200", "--ram-gib", "125", "--batch-size", "32"]
    main([*args, "--seq-len", "1024", "--gpu-resident", "none"])
    unclipped = _requested_step(capsys.readouterr().out)
    monkeypatch.setattr(LayerAdam, "fused_update_out", False)
    in_place = _requested_step(_plan_3b_b32(capsys))
    assert out_of_place == pytest.approx(unclipped, rel=0.03)
    assert in_place > out_of_place


def test_backups_copy_at_host_bandwidth_without_their_own_figure():
    rates = PROFILES["h200"].rates
    assert rates.backup_rate_gbps(fused=False) == rates.backup_copy_gbps < rates.host_gbps
    assert rates.backup_rate_gbps(fused=True) == rates.backup_gbps > rates.host_gbps  # effective: writes only
    bare = dataclasses.replace(rates, backup_gbps=None, backup_copy_gbps=None)
    assert bare.backup_rate_gbps(fused=True) == bare.backup_rate_gbps(fused=False) == bare.host_gbps
    assert "clipping backups" not in bare.describe()
    assert "clipping backups 257 GB/s (fused)" in rates.describe()
    assert "clipping backups 35.4 GB/s (copied)" in rates.describe()
    for field in ("backup_gbps", "backup_copy_gbps"):
        with pytest.raises(ConfigError, match=f"{field} must be positive"):
            dataclasses.replace(rates, **{field: 0.0})
