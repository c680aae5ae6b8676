"""Rates for a GPU no profile knows (``slidekit.planning.probe``): measured, then scaled from the H200's.

``measure`` runs its five micro-benchmarks on the CPU at small sizes (on a GPU machine, on the GPU at
its defaults); ``rates_from`` scales every H200 figure by the ratio of the measurement that bounds it,
and says so in each source; ``Machine.probe`` takes a profile's rates where one matches and probed ones
elsewhere; a data-parallel run agrees on the slowest rank's measurements. And the point of it: with
probed rates the planner takes the forward update order where the H200's rates take it.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from slidekit.planning.machine import Machine
from slidekit.planning.probe import H200_PROBE, Probed, measure, rates_from
from slidekit.planning.profiles import H200_RATES, profile_for_device


def test_measure_times_every_figure_on_the_cpu():
    probed = measure(
        torch.device("cpu"), matmul_n=96, copy_bytes=1 << 20, bus_bytes=1 << 20, host_bytes=1 << 20, repeats=2
    )
    assert all(v > 0 and v == v for v in probed.values()), probed
    assert Probed.of(probed.values()) == probed
    with pytest.raises(ValueError, match="5 values needed"):
        Probed.of([1.0, 2.0])


def test_the_h200_measured_gives_the_h200_profile_back():
    same = rates_from(H200_PROBE, "NVIDIA H200")
    for name in ("layer_tflops", "head_tflops", "device_gbps", "h2d_gbps", "d2h_gbps", "host_gbps"):
        assert getattr(same, name) == pytest.approx(getattr(H200_RATES, name)), name
    assert same.updates["layer_adam"].host_params_per_s == pytest.approx(
        H200_RATES.updates["layer_adam"].host_params_per_s
    )


def test_each_figure_follows_the_measurement_that_bounds_it():
    probed = dataclasses.replace(H200_PROBE, matmul_tflops=394.0, device_gbps=2150.0, h2d_gbps=27.5, host_gbps=47.5)
    rates = rates_from(probed, "Some GPU")
    assert rates.layer_tflops == pytest.approx(H200_RATES.layer_tflops / 2)
    assert rates.head_tflops == pytest.approx(H200_RATES.head_tflops / 2)
    assert rates.device_gbps == pytest.approx(H200_RATES.device_gbps / 2)
    assert rates.h2d_gbps == pytest.approx(H200_RATES.h2d_gbps / 2)
    assert rates.d2h_gbps == pytest.approx(H200_RATES.d2h_gbps)  # measured the same as on the H200
    assert rates.host_gbps == pytest.approx(H200_RATES.host_gbps / 2)
    for name, rate in rates.updates.items():  # host updates are bound by host memory: the triad's ratio
        assert rate.host_params_per_s == pytest.approx(H200_RATES.updates[name].host_params_per_s / 2)
        assert "probed" in rate.source
    assert rates.backup_gbps == pytest.approx(H200_RATES.backup_gbps / 2)
    assert rates.disk_read_gbps == H200_RATES.disk_read_gbps and "assumed" in rates.sources["disk_read_gbps"]
    assert "probed on Some GPU" in rates.sources["layer_tflops"] and rates.name == "Some GPU (probed)"
    with pytest.raises(ValueError, match="matmul_tflops must be positive"):
        rates_from(dataclasses.replace(H200_PROBE, matmul_tflops=0.0), "x")


def _spec_3b(tmp_path):
    from transformers import AutoConfig

    from slidekit.plugins import Plugins
    from slidekit.tools.presets import write_config

    write_config("qwen2.5-3b", tmp_path, 1024)
    hf = AutoConfig.from_pretrained(tmp_path)
    return Plugins().adapter_for(hf.model_type).descriptor.factory(hf)


def test_with_probed_rates_the_planner_takes_the_forward_order_as_with_the_profile(tmp_path):
    """At 3B batch 8 forced offload "auto" takes the forward update order on the H200 profile (NOTES 32) and
    on an H100 host as NOTES 34 measured it (15.9% faster there, where it had no rates and kept the
    arrival order): probed rates give the planner the same decision; without rates it keeps arrival."""
    from planning_fixtures import cuda_machine, planner

    from slidekit.planning import Placement
    from slidekit.planning.update_order import order_layout

    p = planner(_spec_3b(tmp_path), batch=8, seq=1024, optimizer="layer_adam")
    h100 = dataclasses.replace(H200_PROBE, matmul_tflops=798.0, device_gbps=3000.0, host_gbps=75.0)
    for rates in (H200_RATES, rates_from(H200_PROBE, "NVIDIA H200"), rates_from(h100, "NVIDIA H100 80GB HBM3")):
        machine = cuda_machine(gpu=78.0, ram=120.0, rates=rates)
        arrival = p.layout(Placement(gpu_resident="none"), machine)
        ordered, note = order_layout(p, arrival, machine, "auto")
        assert ordered.forward_updates and note is None, rates.name
    assert order_layout(p, arrival, cuda_machine(gpu=78.0, ram=120.0), "auto") == (arrival, None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="probes a GPU")
def test_machine_probe_on_a_gpu_has_rates_either_way():
    machine = Machine.probe("cuda", None)
    assert machine.rates is not None
    if profile_for_device(machine.gpu) is None:
        assert machine.probed is not None and "(probed)" in machine.rates.name
        assert all(v > 0 for v in machine.probed.values())
    else:
        assert machine.probed is None and machine.rates is profile_for_device(machine.gpu).rates


@pytest.mark.skipif(not torch.cuda.is_available(), reason="probes a GPU")
def test_a_probe_gives_its_device_memory_back():
    # This process's blocks only (other processes share the device under a parallel test run): after the
    # probe, no more reserved than before it, give or take the BLAS workspaces of a first product.
    from slidekit.planning import probe

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    probe.measure(torch.device("cuda"))
    assert torch.cuda.memory_allocated() <= allocated + (96 << 20)
    assert torch.cuda.memory_reserved() <= reserved + (96 << 20)


def test_a_probe_that_cannot_run_warns_and_plans_without_rates(monkeypatch):
    from slidekit.planning import probe

    def out_of_memory(*a, **k):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory (stand-in)")

    monkeypatch.setattr(probe, "_matmul_tflops", out_of_memory)
    with pytest.warns(RuntimeWarning, match="could not measure the rates of cpu .*planning without rates"):
        assert probe.measure_or_none(torch.device("cpu")) is None


def test_a_process_measures_each_device_once(monkeypatch):
    from slidekit.planning import probe

    calls = []

    def fake(device):
        calls.append(str(device))
        return H200_PROBE

    monkeypatch.setattr(probe, "measure_or_none", fake)
    monkeypatch.setattr(probe, "_MEASURED", {})
    cpu = torch.device("cpu")
    assert probe.measure_once(cpu) is H200_PROBE and probe.measure_once(cpu) is H200_PROBE
    assert calls == ["cpu"]
