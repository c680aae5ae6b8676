""""auto" residency trades resident units for kept activations where the step-time model predicts it faster.

``Planner.most_resident`` keeps as many units resident as the device holds; ``Planner.fastest_residency``
then tries fewer (their freed memory keeps more layers' activations, recompute "auto") and takes them
only where the model predicts a step more than ``RESIDENCY_GAIN`` shorter and the layout fits
(NOTES.md 37-38: on an 80 GB GPU every unit of a 3B model resident leaves room for 5 of 36 layers'
activations at batch 32, and half resident ran 5% faster). The shapes are the published ones
(``slidekit.tools.presets``), the rates the H200 profile's.

Test: ``pytest tests/test_fastest_residency.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import pytest
from planning_fixtures import cuda_machine, planner

from slidekit.cli import main
from slidekit.planning import Placement
from slidekit.planning.placement import spread_host_units
from slidekit.planning.planner import RESIDENCY_GAIN
from slidekit.planning.profiles import H200_RATES
from slidekit.tools.presets import arch_spec

AUTO = Placement(gpu_resident="auto")


@functools.cache
def _spec(name: str):
    return arch_spec(name, 1024)


def _planner(name: str, batch: int, **kw: object):
    return planner(_spec(name), batch=batch, seq=1024, optimizer="layer_adam", **kw)


def _step(p, machine, resident) -> float:
    return p.predict(p.layout(AUTO, machine, resident=resident), machine).seconds


def _kept(layout) -> int:
    return sum(u.keeps for u in layout.units)


@pytest.mark.parametrize(("model", "batch"), [("qwen2.5-3b", 32), ("qwen2.5-1.5b", 32), ("qwen2.5-7b", 8)])
def test_auto_takes_the_residency_the_model_predicts_fastest(model, batch):
    """On 79 GiB with the H200's rates: every host count (all of them here, not only the candidates) is
    predicted; "auto" keeps ``most_resident`` where every layer keeps its activations with it or no count
    beats it by more than RESIDENCY_GAIN, and otherwise takes one within the candidates' spacing of the best, with fewer units resident, more layers
    keeping their activations, and a layout that fits."""
    machine = cuda_machine(gpu=79.2, ram=125.0, rates=H200_RATES)
    p = _planner(model, batch)
    most, chosen = p.most_resident(AUTO, machine), p.residency(AUTO, machine)
    units = len(most)
    steps = {
        host: _step(p, machine, [not h for h in spread_host_units(units, host)])
        for host in range(most.count(False), units + 1)
    }
    best = min(steps.values())
    layout, full = p.layout(AUTO, machine), p.layout(AUTO, machine, resident=most)
    assert [u.resident for u in layout.units] == chosen
    every_layer_keeps = all(u.keeps for u in full.units if u.kind == "layer")
    if every_layer_keeps or best >= _step(p, machine, most) * (1 - RESIDENCY_GAIN):
        assert chosen == most
        return
    assert sum(chosen) < sum(most)
    assert _kept(layout) > _kept(full)
    assert _step(p, machine, chosen) < _step(p, machine, most) * (1 - RESIDENCY_GAIN)
    assert _step(p, machine, chosen) <= best * 1.02
    assert p.estimate_layout(layout, machine).fits(machine)


def test_a_3b_model_at_batch_32_on_an_80_gb_gpu_trades():
    """The case measured (NOTES.md 37): every unit of Qwen2.5-3B resident keeps 5 of 36 layers'
    activations at batch 32 on an 80 GB GPU; "auto" keeps fewer units resident and more layers."""
    machine = cuda_machine(gpu=79.2, ram=125.0, rates=H200_RATES)
    p = _planner("qwen2.5-3b", 32)
    assert all(p.most_resident(AUTO, machine)) and not all(p.residency(AUTO, machine))
    assert _kept(p.layout(AUTO, machine, resident=[True] * 38)) == 5


def test_where_every_units_activations_fit_auto_keeps_them_all_resident():
    """Batch 8 on the H200's 139 GiB: every unit resident keeps every layer's activations; no trade."""
    machine = cuda_machine(gpu=139.3, ram=125.0, rates=H200_RATES)
    p = _planner("qwen2.5-3b", 8)
    chosen = p.residency(AUTO, machine)
    assert all(chosen)
    layout = p.layout(AUTO, machine)
    assert _kept(layout) == sum(u.kind == "layer" for u in layout.units)
    assert p.residency_note(layout, machine) is None


@pytest.mark.parametrize(
    "case",
    ["no rates", "recompute all", "a fixed share"],
)
def test_without_a_prediction_or_a_choice_auto_keeps_as_many_as_fit(case):
    """No rates (the CPU, a GPU not probed), recompute "all" (memory keeps no activations) or a configured
    share: the residency the memory plan gives, unchanged."""
    rates = None if case == "no rates" else H200_RATES
    machine = cuda_machine(gpu=79.2, ram=125.0, rates=rates)
    p = _planner("qwen2.5-3b", 32, recompute="all" if case == "recompute all" else "auto")
    placement = Placement(gpu_resident="0.5") if case == "a fixed share" else AUTO
    assert p.residency(placement, machine) == p.most_resident(placement, machine)
    assert p.residency_note(p.layout(placement, machine), machine) is None


def test_units_leave_the_gpu_only_as_far_as_host_ram_holds_them():
    """With too little RAM for the offloaded units' masters and state, the trade stops where RAM ends:
    the chosen layout fits; with less still, every unit stays resident."""
    p = _planner("qwen2.5-3b", 32)
    roomy = cuda_machine(gpu=79.2, ram=125.0, rates=H200_RATES)
    traded = sum(p.residency(AUTO, roomy))
    for ram in (30.0, 8.0):
        machine = dataclasses.replace(
            roomy, host_available=int(ram * 2**30), host_total=int(ram * 2**30)
        )
        chosen = p.residency(AUTO, machine)
        assert p.estimate_layout(p.layout(AUTO, machine), machine).fits(machine) or all(chosen)
        assert sum(chosen) >= traded
    assert all(p.residency(AUTO, machine))  # 8 GiB: nothing can leave


def test_the_plan_says_what_auto_traded(capsys):
    """``slidekit plan`` notes the trade with both predicted steps and kept layers; the step it reports
    is the traded layout's."""
    args = ["plan", "--preset", "qwen2.5-3b", "--gpu", "h200", "--gpu-gib", "79.2", "--ram-gib", "125"]
    main([*args, "--batch-size", "32", "--seq-len", "1024"])
    out = capsys.readouterr().out
    note = re.search(
        r"engine.gpu_resident='auto': (\d+) of 38 units resident, not the 38 that fit: the step-time model "
        r"predicts ([\d.]+) s a step against ([\d.]+) s, the freed GPU memory keeping (\d+) layers' "
        r"activations instead of (\d+)",
        out,
    )
    assert note, out
    resident, ahead, behind, kept, before = (float(g) for g in note.groups())
    assert resident < 38 and ahead < behind * (1 - RESIDENCY_GAIN) and kept > before
    requested = out.split("fastest placement")[0]
    assert f"  {int(resident)} of 38 units resident on the GPU" in requested
    assert re.search(rf"^  predicted step {ahead:.3f} s", requested, re.M)
