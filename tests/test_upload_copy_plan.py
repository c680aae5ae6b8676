"""Upload copies (``engine.upload_copy``) in the plan: their host bytes, the staging they drop, their price.

The layout itemises the copies (2 B/param of every host unit, a rank's shard of it) and plans no
upload staging; the step-time model prices a host unit's upload at 2 B/param instead of 4 and its
host update 2 B/param more (the BF16 write); `slidekit plan --upload-copy on` counts and predicts
both. The engine's own allocations are checked against the layout in ``tests/engine/test_build.py``.
"""

from __future__ import annotations

import dataclasses

import pytest
from planning_fixtures import MEDIA, cuda_machine, tiny_spec

from slidekit.cli import main
from slidekit.errors import ConfigError
from slidekit.models.base import ArchSpec
from slidekit.planning import Placement, Planner, Rates, UpdateRate, Workload
from slidekit.planning.rates import COPY_WRITE_BYTES
from slidekit.planning.timing import predict_step

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


def _planner(spec: ArchSpec, copy: bool, *, itemsize: int = 2, world: int = 1, rank: int = 0) -> Planner:
    return Planner(
        spec,
        Workload(batch_size=4, seq_len=32, upload_copy=copy),
        compute_itemsize=itemsize,
        state_bytes=lambda n: 8 * n,
        media=MEDIA,
        device_type="cuda",
        optimizer="adam",
        world=world,
        rank=rank,
    )


@pytest.mark.parametrize("resident", ["none", "0.5"])
def test_the_layout_itemises_the_copies_and_drops_the_staging(resident):
    spec = tiny_spec("llama", num_hidden_layers=6)
    machine = cuda_machine(80.0, 64.0, None, RATES)
    off = _planner(spec, False).layout(Placement(gpu_resident=resident), machine)
    on = _planner(spec, True).layout(Placement(gpu_resident=resident), machine)
    host = [u for u in on.units if u.slides]
    assert host and on.upload_copy and not off.upload_copy
    a, b = off.allocations(), on.allocations()
    assert b["host"]["upload copies"] == 2 * sum(u.numel for u in host)
    assert "upload copies" not in a["host"]
    assert a["device"]["staging"] > 0 and b["device"]["staging"] == 0  # nothing is cast on the device
    assert {k: v for k, v in b["host"].items() if k != "upload copies"} == a["host"]
    assert "upload copies: every sliding unit" in on.describe()
    # The estimate (the fit check's) counts them as the layout does.
    est = _planner(spec, True).estimate_layout(on, machine)
    assert est.host["upload copies"] == b["host"]["upload copies"]


def test_nothing_on_the_host_needs_no_copy():
    spec = tiny_spec("llama", num_hidden_layers=2)
    layout = _planner(spec, True).layout(Placement(gpu_resident="all"), cuda_machine(80.0, 64.0, None, RATES))
    assert not layout.upload_copy and "upload copies" not in layout.allocations()["host"]


def test_a_rank_keeps_the_copy_of_its_shard():
    spec = tiny_spec("llama", num_hidden_layers=4)
    machine = cuda_machine(80.0, 64.0, None, RATES)
    parts = [
        _planner(spec, True, world=2, rank=r).layout(Placement(gpu_resident="none"), machine).allocations()
        for r in range(2)
    ]
    assert sum(p["host"]["upload copies"] for p in parts) == 2 * sum(u.numel for u in spec.units)


def test_fp32_compute_is_refused():
    spec = tiny_spec("llama", num_hidden_layers=2)
    with pytest.raises(ConfigError, match=r"engine.upload_copy='on'.*engine.compute_dtype='bfloat16'"):
        _planner(spec, True, itemsize=4).layout(Placement(gpu_resident="none"), cuda_machine(80.0, 64.0))


def _predict(spec: ArchSpec, copy: bool, rates: Rates):
    p = _planner(spec, copy)
    return predict_step(
        p.layout(Placement(gpu_resident="none"), cuda_machine(80.0, 64.0, None, rates)), rates, p.work
    )


def test_uploads_move_half_the_bytes_and_updates_write_two_more():
    spec = tiny_spec("llama", num_hidden_layers=6)
    off, on = _predict(spec, False, RATES), _predict(spec, True, RATES)
    assert on.work["upload"] == pytest.approx(off.work["upload"] / 2, rel=1e-12)
    extra = sum(u.numel for u in spec.units) * COPY_WRITE_BYTES / (RATES.host_gbps * 1e9)
    assert on.work["host update"] - off.work["host update"] == pytest.approx(extra, rel=1e-9)


def test_upload_bound_steps_get_faster_and_update_bound_ones_slower():
    spec = tiny_spec("llama", num_hidden_layers=6)
    slow_bus = dataclasses.replace(RATES, h2d_gbps=1e-3)
    off, on = _predict(spec, False, slow_bus), _predict(spec, True, slow_bus)
    assert off.bound == on.bound == "upload" and on.seconds < 0.6 * off.seconds
    slow_host = dataclasses.replace(
        RATES,
        host_gbps=1e-2,  # the copy's write at 10 MB/s: the update lane grows by 2 B/param at that rate
        updates={"adam": UpdateRate(host_params_per_s=1e4, device_bytes_per_param=28.0, source="t")},
    )
    off, on = _predict(spec, False, slow_host), _predict(spec, True, slow_host)
    assert off.bound == on.bound == "host update" and on.seconds > off.seconds


def test_plan_counts_and_predicts_the_copies(capsys):
    args = ["plan", "--gpu", "h200", "--batch-size", "2", "--seq-len", "64", "--gpu-resident", "none"]
    assert main(args) == 0
    off = capsys.readouterr().out
    assert main([*args, "--upload-copy", "on"]) == 0
    on = capsys.readouterr().out
    assert "upload copies" in on and "upload copies" not in off
    assert "predicted step" in on and "predicted step" in off
    assert main(["plan", "--device", "cpu", "--upload-copy", "on"]) == 2  # auto compute dtype: FP32 there
    assert "engine.compute_dtype='bfloat16'" in capsys.readouterr().err
