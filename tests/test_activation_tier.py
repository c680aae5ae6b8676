"""``engine.activation_tier = "auto"`` (the default; ``slidekit.planning.activations``).

- The planner takes the first of the device, the host tier and the disk tier (where the machine has an
  offload directory) with which the placement fits, the layout being exactly that of naming the tier;
  where none fits, the device's (the one refused); over machines of every size (hypothesis).
- A run whose device cannot hold the boundary activations puts them on the host tier: the engine
  allocates that tier's activations, names the tier among its drivers, says why in a note, and trains
  bitwise as the run that names the tier.
- The CLI's plan prints the chosen tier, never "auto".

Run: ``pytest tests/test_activation_tier.py``.
"""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st
from planning_fixtures import cuda_machine, planner, tiny_spec

from slidekit import EngineConfig, ModelConfig, OptimConfig, TrainConfig, Trainer
from slidekit.planning import GIB, Machine, Placement
from slidekit.planning.activations import activation_candidates
from slidekit.planning.estimate import DEVICE_HEADROOM, DEVICE_SLACK
from slidekit.testing.asserts import assert_states_equal, trained_state
from slidekit.testing.models import random_batches

SPEC = tiny_spec("llama", num_hidden_layers=6, hidden_size=256, intermediate_size=512, vocab_size=1024)


def _fits(p, placement, machine) -> bool:
    """Whether ``placement``'s layout, as the engine runs it (``Planner.as_run``), fits ``machine``."""
    return p.estimate_layout(p.as_run(p.layout(placement, machine), machine), machine).placement_fits(machine)


@settings(max_examples=80, deadline=None)
@given(  # around the needs: ~1.5-1.7 GiB of GPU (activations on it or not), ~3.0-3.2 GiB of RAM
    gpu=st.floats(1.3, 1.9),
    ram=st.floats(2.9, 3.4),
    disk=st.one_of(st.none(), st.floats(0.0, 0.5)),
    resident=st.sampled_from(["auto", "none", "all"]),
    recompute=st.sampled_from(["auto", "all"]),
)
def test_auto_takes_the_first_tier_that_fits(gpu, ram, disk, resident, recompute):
    p = planner(SPEC, batch=32, seq=2048, recompute=recompute)
    machine = cuda_machine(gpu, ram=ram, disk=disk)
    auto = Placement(gpu_resident=resident)
    tiers = activation_candidates(auto, p.drivers, machine)
    assert tiers == ["device", "ram"] + (["posix"] if disk is not None else [])
    named = [dataclasses.replace(auto, activation_tier=t) for t in tiers]
    fitting = [pl for pl in named if _fits(p, pl, machine)]
    expected = fitting[0] if fitting else named[0]
    layout = p.layout(auto, machine)
    assert layout == p.layout(expected, machine)  # exactly the named tier's layout
    assert layout.activation_tier == expected.activation_tier and layout.placement.activation_tier != "auto"
    assert p.residency(auto, machine) == list(layout.resident)  # the public helpers decide alike


def test_a_small_device_moves_them_to_ram_and_a_small_host_to_disk():
    p = planner(SPEC, batch=16, seq=512, recompute="all")  # memory buys no kept activations
    roomy = cuda_machine(80, ram=64, disk=100)
    assert p.layout(Placement(), roomy).activation_tier == "device"
    on_device = p.estimate(Placement(gpu_resident="none", activation_tier="device"), roomy)
    acts = on_device.device["activations"]
    small_gpu = (on_device.device_bytes - acts // 2) * (1 + DEVICE_HEADROOM) + DEVICE_SLACK
    machine = dataclasses.replace(roomy, device_free=int(small_gpu), device_total=int(small_gpu))
    chosen = p.choose(Placement(gpu_resident="none"), machine)
    assert chosen.layout.activation_tier == "ram" and chosen.layout.activation_medium == "host"
    assert any("engine.activation_tier='auto'" in n and "GPU memory: needs" in n for n in chosen.notes)
    in_ram = p.estimate(Placement(gpu_resident="none", activation_tier="ram"), machine)
    host = in_ram.host_bytes - in_ram.host["activations"] // 2
    tight = dataclasses.replace(machine, host_available=int(host), host_total=int(host))
    chosen = p.choose(Placement(gpu_resident="none"), tight)
    assert chosen.layout.activation_tier == "posix" and chosen.layout.activation_medium == "disk"
    assert any("on ram: host RAM: needs" in n for n in chosen.notes)
    # Without an offload directory nothing fits: the device's layout is the one refused.
    none = p.choose(Placement(gpu_resident="none"), dataclasses.replace(tight, disk_free=None))
    assert none.layout.activation_tier == "device" and not none.notes
    assert not _fits(p, none.layout.placement, dataclasses.replace(tight, disk_free=None))


def _config(model_dir, tier: str) -> TrainConfig:
    return TrainConfig(
        model=ModelConfig(source=str(model_dir)),
        optim=OptimConfig(lr=1e-3),
        engine=EngineConfig(device="cpu", gpu_resident="none", activation_tier=tier, window=2),
        grad_accum=2,
        steps=3,
    )


def test_a_run_whose_device_lacks_room_puts_them_in_ram_and_trains_as_naming_ram(tiny_model):
    model_dir = tiny_model("llama")
    batches = random_batches(128, steps=6, seed=3)
    with Trainer(_config(model_dir, "device")) as t:
        est = t.estimate
        assert est is not None and t.engine.layout.activation_tier == "device"
    acts = est.device["activations"]
    free = int((est.device_bytes - acts // 2) * (1 + DEVICE_HEADROOM) + DEVICE_SLACK)
    # The CPU engine with a device budget of its own: the planner treats it as the GPU's.
    machine = Machine(device_type="cpu", device_free=free, device_total=free, host_available=64 * GIB,
                      host_total=64 * GIB)  # fmt: skip
    runs = {}
    for tier in ("auto", "ram"):
        with Trainer(_config(model_dir, tier), machine=machine) as t:
            assert t.engine.layout.activation_tier == "ram"
            assert t.selections["activation_tier"].name == "ram"  # the drivers name the tier chosen
            assert t.estimate is not None and "activations" in t.estimate.host
            runs[tier] = (t.fit(batches).losses, trained_state(t), t.notes)
    (auto_losses, auto_state, notes), (ram_losses, ram_state, _) = runs["auto"], runs["ram"]
    assert auto_losses == ram_losses
    assert_states_equal(auto_state, ram_state)
    assert any("engine.activation_tier='auto': boundary activations on ram" in n for n in notes)


def test_the_plan_prints_the_chosen_tier(capsys):
    from slidekit.cli import main

    assert main(["plan", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    requested = out.split("requested placement: ")[1].splitlines()[0]
    assert "--activation-tier device" in requested and "--activation-tier auto" not in out
