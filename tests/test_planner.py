"""The memory planner: its numbers track what the engine allocates; it refuses what cannot fit, and recommends.

The GPU totals are checked against measured peaks in ``tests/gpu/test_planner_gpu.py``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from planning_fixtures import cuda_machine, planner, tiny_spec

from slidekit import EngineConfig, ModelConfig, OptimConfig, TrainConfig, Trainer
from slidekit.cli import main
from slidekit.config import DataConfig
from slidekit.errors import ConfigError
from slidekit.hostmem import registered_bytes
from slidekit.planning import GIB, GRANULE, Machine, Placement, plan_run, spread_host_units
from slidekit.planning.profiles import PROFILES
from slidekit.plugins import Plugins
from slidekit.testing.models import save_tiny_model

H200 = PROFILES["h200"].rates


def test_components_follow_the_formulas():
    spec = tiny_spec("qwen2")  # tied embeddings: one more cache unit
    p = planner(spec, batch=2, seq=16, accum=3, recompute="all")  # every layer saves its boundary
    numels = [u.numel for u in spec.units]
    est = p.estimate(Placement(gpu_resident="none"), cuda_machine(80))
    assert est.device["window"] == 2 * (3 + 1) * max(numels) * 2
    assert est.device["activations"] == spec.num_layers * 3 * 2 * 16 * spec.hidden_size * 2
    assert est.device["hidden"] == 3 * 2 * 16 * spec.hidden_size * 2
    assert est.host["masters"] == 4 * sum(numels)
    assert est.host["state"] == 8 * sum(numels)
    assert est.host["gradients"] == 2 * max(numels) * 2
    assert est.disk == {}
    # activations on ram move to the host; the device keeps the two in flight
    est2 = p.estimate(Placement(gpu_resident="none", activation_tier="ram"), cuda_machine(80))
    assert est2.host["activations"] == est.device["activations"]
    assert est2.device["activations"] == 2 * 2 * 16 * spec.hidden_size * 2


def test_resident_units_move_master_and_state_to_the_device_and_shrink_the_window():
    spec = tiny_spec("llama", vocab_size=4096)  # embedding and head far larger than a layer
    p = planner(spec)
    numels = [u.numel for u in spec.units]
    all_res = p.estimate(Placement(gpu_resident="all"), cuda_machine(80))
    assert all(all_res.resident)
    assert all_res.device["resident"] == sum(n * (4 + 2 * 2 + 8) for n in numels)
    assert all_res.host["masters"] == 0 and all_res.host["state"] == 0
    # half resident, the host half spread over the backward order from the head down: the window is
    # sized for the largest unit still sliding (the head)
    half = p.estimate(Placement(gpu_resident="0.5"), cuda_machine(80))
    host = len(numels) - round(0.5 * len(numels))
    assert half.resident == tuple(not h for h in spread_host_units(len(numels), host))
    assert sum(half.resident) == round(0.5 * len(numels)) and half.resident[0] and not half.resident[-1]
    on_host = ", ".join(str(u) for u, r in enumerate(half.resident) if not r)
    assert f"units on the host (spread over the backward order): {on_host}\n" in half.table() + "\n"
    assert "units on the host" not in all_res.table()
    assert half.device["window"] == 2 * 3 * numels[-1] * 2
    layers_only = p.estimate(
        Placement(), cuda_machine(80), resident=[True] + [False] * (len(numels) - 2) + [True]
    )
    assert layers_only.device["window"] == 2 * 3 * numels[1] * 2


def test_auto_residency_keeps_the_fewest_host_units_the_spare_memory_allows_spread_out():
    spec = tiny_spec("llama", num_hidden_layers=8, vocab_size=512)
    p = planner(spec, recompute="all")  # the spare memory goes to residency alone
    none = p.estimate(Placement(gpu_resident="none"), cuda_machine(80))
    units = len(spec.units)
    per_unit = [p.resident_cost(u) for u in range(units)]
    reserve = 4 * GIB
    layouts = [spread_host_units(units, h) for h in range(units + 1)]

    def kept(on_host: list[bool]) -> int:  # device bytes of the units that are not on the host
        return sum(c for c, h in zip(per_unit, on_host, strict=True) if not h)

    for spare in sorted({0, per_unit[1] // 2, *(kept(layout) + 1 for layout in layouts)}):
        machine = dataclasses.replace(
            cuda_machine(80), device_free=none.device_bytes + reserve + spare, device_total=1
        )
        res = p.residency(Placement(resident_weights="keep"), machine)
        host = units - sum(res)
        assert res == [not h for h in layouts[host]], spare  # one of the spread layouts
        assert kept(layouts[host]) <= spare  # that fits
        assert all(kept(layouts[h]) > spare for h in range(host))  # with the fewest host units
    assert host == 0  # the largest spare memory holds every unit


def test_optimizer_without_device_updates_keeps_everything_on_the_host():
    p = planner(tiny_spec(), device_updates=False)
    assert not any(p.estimate(Placement(gpu_resident="auto"), cuda_machine(80)).resident)


def test_state_fraction_goes_to_disk_and_is_streamed():
    spec = tiny_spec("llama", num_hidden_layers=6)
    p = planner(spec, state_chunk=1024)
    place = Placement(gpu_resident="none", state_offload_tier="posix", state_offload_fraction=0.5)
    est = p.estimate(place, cuda_machine(80, disk=10))
    numels = [u.numel for u in spec.units]
    assert est.disk["state"] + est.host["state"] == 8 * sum(numels)
    assert est.disk["state"] > 0 and est.host["state"] > 0
    # Chunks start at multiples of GRANULE: the engine rounds a smaller chunk up to one (the old planner
    # counted the 1,024 asked for, a quarter of what the engine allocated).
    assert est.host["state staging"] == 3 * GRANULE * 8
    assert planner(spec).estimate(place, cuda_machine(80)).host["state staging"] == 3 * 8 * max(numels)
    # no offload directory: the disk need is a shortfall that says how to fix it
    problems = est.shortfalls(cuda_machine(80, disk=None))
    assert len(problems) == 1 and "offload_dir" in problems[0]
    tiny_disk = est.shortfalls(cuda_machine(80, disk=1e-6))
    assert len(tiny_disk) == 1 and tiny_disk[0].startswith("disk: needs")


def test_shortfalls_name_each_medium_with_numbers():
    p = planner(tiny_spec(), batch=64, seq=64)
    est = p.estimate(Placement(gpu_resident="none"), cuda_machine(1e-3, ram=1e-3))
    problems = est.shortfalls(cuda_machine(1e-3, ram=1e-3))
    assert [x.split(":")[0] for x in problems] == ["GPU memory", "host RAM"]
    assert "window" in problems[0] and "GiB free" in problems[0]
    assert "masters" in problems[1] and "available" in problems[1]
    assert est.fits(cuda_machine(80))


def test_recommendation_is_the_fastest_placement_that_fits():
    spec = tiny_spec("llama", num_hidden_layers=8, vocab_size=512)
    p = planner(spec, batch=8, seq=64)
    base = Placement(gpu_resident="none")
    roomy = p.recommend(base, cuda_machine(80))
    assert roomy is not None and roomy.placement.gpu_resident == "all"
    # A device too small for the activations (and an optimizer that cannot update there): activations to RAM
    # (every layer recomputing: kept graphs would need more of the device, not less).
    p = planner(spec, batch=8, seq=64, device_updates=False, recompute="all")
    sliding = p.estimate(Placement(gpu_resident="none"), cuda_machine(80))
    acts = sliding.device["activations"]
    tight = sliding.device_bytes * 1.05 + (512 << 20) - acts / 2
    rec = p.recommend(
        base, dataclasses.replace(cuda_machine(80), device_free=int(tight), device_total=int(tight))
    )
    assert rec is not None and rec.placement.activation_tier == "ram" and not any(rec.resident)
    # Host RAM too small for all the state: part of it goes to disk, the smallest share that fits.
    host = sliding.host_bytes - 0.4 * sliding.host["state"]
    machine = dataclasses.replace(cuda_machine(1e-3, ram=0, disk=100), host_available=int(host))
    machine = dataclasses.replace(machine, device_free=int(tight * 2), device_total=int(tight * 2))
    rec = p.recommend(base, machine, "posix")
    assert rec is not None and rec.placement.state_offload_tier == "posix"
    assert 0 < rec.placement.state_offload_fraction < 1 and rec.fits(machine)
    # every faster candidate does not fit
    order = p.candidates(base, "posix")
    assert all(not p.estimate(c, machine).fits(machine) for c in order[: order.index(rec.placement)])
    # Without a disk tier nothing fits.
    assert p.recommend(base, dataclasses.replace(machine, disk_free=None), "posix") is None


def test_candidates_run_from_fastest_to_slowest():
    p = planner(tiny_spec())
    keep = Placement(resident_weights="keep")
    order = p.candidates(keep, "posix")
    assert order[:4] == [
        Placement(gpu_resident="all", activation_tier="device", resident_weights="keep"),
        Placement(gpu_resident="all", activation_tier="device", resident_weights="auto"),  # more on the GPU
        Placement(gpu_resident="auto", activation_tier="device", resident_weights="keep"),
        Placement(gpu_resident="auto", activation_tier="device", resident_weights="auto"),
    ]
    # The defaults ("auto" activations and weights): each candidate names its activation tier.
    assert [c.gpu_resident for c in p.candidates(Placement(), "posix")[:2]] == ["all", "auto"]
    assert all(c.activation_tier != "auto" for c in p.candidates(Placement(), "posix"))
    # A choice of the user's other than "keep" is kept; nothing slides on the CPU or without device updates.
    assert {c.resident_weights for c in p.candidates(Placement(resident_weights="slide"), "posix")} == {"slide"}
    for other in (planner(tiny_spec(), device_updates=False), planner(tiny_spec(), device_type="cpu")):
        assert {c.resident_weights for c in other.candidates(keep, "posix")} == {"keep"}
    fractions = [c.state_offload_fraction for c in order]
    assert fractions == sorted(fractions) and fractions[-1] == 1.0
    assert order[-1].activation_tier == "posix"
    assert len(order) == len(set(order))
    assert all(c.state_offload_fraction == 0 for c in p.candidates(Placement(), None))


def test_recommendation_slides_resident_weights_where_keeping_them_does_not_fit():
    """A model whose masters and state fit on the GPU only without the resident units' BF16 copies, and a
    host too small for the units that would leave the GPU: the fix is --resident-weights auto, not disk."""
    spec = tiny_spec(
        "llama",
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=32,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=128,
        vocab_size=32000,
    )
    p = planner(spec, batch=2, seq=256)
    big = cuda_machine(400, ram=400)
    keep = p.estimate(Placement(gpu_resident="all"), big)
    slide = p.estimate(Placement(gpu_resident="all", resident_weights="slide"), big)
    assert keep.device_bytes - slide.device_bytes > 6 * GIB  # 4 B/param: the weights and gradients
    # Room for every master and state with sliding weights plus the reserve, not for the copies.
    gpu = (slide.device_bytes * 1.05 + (512 << 20) + 5 * GIB) / GIB
    ram = (slide.host_bytes + GIB) / GIB
    machine = cuda_machine(gpu, ram=ram, disk=100)
    assert not keep.fits(machine)
    for rates in (None, H200):
        m = dataclasses.replace(machine, rates=rates)
        rec = p.recommend(Placement(), m, "posix")
        assert rec is not None and rec.fits(m) and rec.placement.resident_weights == "auto", rates
        assert rec.placement.state_offload_fraction == 0  # no disk: the GPU holds what RAM cannot
        slid = [u.weights_slide for u in rec.layout.units]
        assert all(rec.resident) and any(slid) and not all(slid)  # every copy that fits is kept
        # Without the choice nothing fits, not even with state on disk: the masters of the units that would
        # leave the GPU need host RAM (the recommendation used to be "no placement fits").
        keep = Placement(resident_weights="keep")
        keeping = [c for c in p.split_candidates(keep, "posix", m) if c.resident_weights == "keep"]
        assert keeping and not any(p.estimate(c, m).fits(m) for c in keeping)
    # Where keeping fits, it is kept (a tie or faster: the same layout).
    roomy = p.recommend(Placement(), dataclasses.replace(big, rates=H200), "posix")
    assert roomy is not None and roomy.placement == Placement(gpu_resident="all", activation_tier="device")
    assert not any(u.weights_slide for u in roomy.layout.units)


def test_planner_matches_what_the_engine_allocates(tmp_path):
    """Window, masters, state and gradient ring as the CPU engine allocates them, byte for byte."""
    model = save_tiny_model("qwen2", tmp_path / "m")
    config = TrainConfig(
        model=ModelConfig(source=str(model)),
        data=DataConfig(batch_size=2, seq_len=16),
        engine=EngineConfig(device="cpu", gpu_resident="none"),
    )
    with Trainer(config) as t:
        est = t.estimate
        assert est is not None
        engine = t.engine
        window = sum(s.params.nbytes + s.grads.nbytes for s in engine.window.slots)
        assert est.device["window"] == window
        assert est.host["masters"] == sum(m.nbytes for m in engine.host.masters)
        assert est.host["state"] == sum(engine.host.state.nbytes(u) for u in range(len(t.spec.units)))
        assert est.host["gradients"] == sum(b.nbytes for b in engine.host.ring.buffers)


def test_trainer_refuses_what_does_not_fit_before_allocating(tmp_path):
    model = save_tiny_model("llama", tmp_path / "m")
    config = TrainConfig(
        model=ModelConfig(source=str(model)),
        engine=EngineConfig(device="cpu", state_tier="posix", offload_dir=str(tmp_path / "off")),
    )
    small = Machine(device_type="cpu", host_available=8 * GIB, host_total=8 * GIB, disk_free=100)
    before = registered_bytes()
    with pytest.raises(ConfigError) as err:
        Trainer(config, machine=small)
    text = str(err.value)
    assert "does not fit" in text and "disk: needs" in text and "GiB free" in text
    assert "--state-tier ram" in text  # the fix: state in RAM fits
    assert registered_bytes() == before
    assert not any((tmp_path / "off").glob("*")) if (tmp_path / "off").exists() else True
    # nothing fits at all: the message says what to change
    tiny = dataclasses.replace(small, host_available=1 << 20)
    with pytest.raises(ConfigError, match=r"no placement fits this batch: lower data\.batch_size"):
        Trainer(config, machine=tiny)


def test_plan_run_and_cli(tmp_path, capsys):
    config = TrainConfig(engine=EngineConfig(device="cpu"))
    report = plan_run(config)
    assert report.fits and "verdict: fits" in report.render()
    assert main(["plan", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "host RAM" in out and "verdict: fits" in out
    assert main(["plan", "--device", "cpu", "--ram-gib", "0.5"]) == 1
    out = capsys.readouterr().out
    assert "does NOT fit" in out and "host RAM: needs" in out
    # with a disk tier allowed, the plan recommends moving state there
    off = tmp_path / "off"
    config = TrainConfig(engine=EngineConfig(device="cpu", offload_dir=str(off)))
    need = plan_run(config).requested
    host = need.host_bytes + need.device_bytes - need.host["state"] // 2
    report = plan_run(
        config, machine=Machine(device_type="cpu", host_available=host, host_total=host, disk_free=GIB)
    )
    out = report.render()
    assert not report.fits and "fastest placement that fits" in out and "--state-offload-tier posix" in out
    assert report.recommended is not None and report.recommended.placement.state_offload_fraction > 0


def test_the_2_gpu_machine_holds_a_70b_shape_without_disk(capsys):
    """Issue 19's target: Llama-3.1-70B with FP32 masters on two H200 ranks sharing 250 GiB of RAM. The
    default placement ("auto" resident weights) fits without disk: about 35 units' master and state on each
    GPU with sliding weights. Keeping every resident unit's weights ("keep") does not fit host RAM, and its
    recommendation is the sliding one (it was state on disk, disk-bound, before sliding was a candidate)."""
    argv = ["plan", "--preset", "llama-3.1-70b", "--gpu", "h200", "--ram-gib", "250", "--disk-gib", "120"]
    argv += ["--nproc-per-node", "2", "--seq-len", "1024", "--batch-size", "4", "--optimizer", "adamw_8bit"]
    argv += ["--offload-dir", "/nonexistent/off"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "verdict: fits" in out and "planned for rank 0" in out
    requested = out.split("requested placement: ")[1]
    assert requested.startswith("--gpu-resident auto --state-tier ram --activation-tier device --resident-weights auto")
    assert "weights slide" in requested and "0 with master in RAM and state on disk" in requested
    assert "engine.resident_weights='auto'" in out and "('keep')" in out  # the note says what it traded
    assert main([*argv, "--resident-weights", "keep"]) == 1
    out = capsys.readouterr().out
    assert "does NOT fit" in out
    best = out.split("fastest placement that fits with the shortest predicted step: ")[1].splitlines()[0]
    assert "--resident-weights auto" in best and "--state-offload" not in best
    assert "0 with master in RAM and state on disk" in out.split(best)[1]


def test_plan_reports_rows_beyond_the_models_positions_as_such(capsys):
    """A seq_len past max_position_embeddings is a model limit, never reported as a memory shortfall."""
    assert main(["plan", "--device", "cpu", "--seq-len", "1024", "--batch-size", "1"]) == 1
    out = capsys.readouterr().out
    assert "does NOT fit" in out and "data.seq_len 1024 exceeds the model's max_position_embeddings" in out
    config = TrainConfig(engine=EngineConfig(device="cpu"), data=DataConfig(seq_len=1024, batch_size=1))
    report = plan_run(config)
    assert not report.fits and report.refusals and report.requested.fits(report.machine)  # memory is fine


def test_placement_flags_round_trip_through_the_cli_parser():
    from slidekit.cli import build_parser, config_from_args

    place = Placement(
        gpu_resident="0.25",
        state_tier="ram",
        state_offload_tier="posix",
        state_offload_fraction=0.75,
        activation_tier="ram",
    )
    args = build_parser().parse_args(["finetune", *place.flags().split(), "--offload-dir", "/tmp/x"])
    assert Placement.of(config_from_args(args).engine) == place


def test_machine_probe_reads_this_machine(tmp_path):
    m = Machine.probe(torch.device("cpu"), str(tmp_path / "not" / "yet"))
    assert m.device_free is None and 0 < m.host_available <= m.host_total
    assert m.disk_free is not None and m.disk_free > 0


def test_optimizer_state_bytes_come_from_the_optimizer(tmp_path):
    config = TrainConfig(engine=EngineConfig(device="cpu"), optim=OptimConfig(name="adamw_8bit"))
    report = plan_run(config)
    assert "adamw_8bit (2.0" in report.summary


def test_tier_roles_are_found_by_medium_and_priority():
    """``slidekit.planning.roles``: the core names no bundled tier; a role is the available tier of its
    medium with the highest priority that serves the device."""
    from slidekit.hookspecs import hookimpl
    from slidekit.interfaces import TierDescriptor
    from slidekit.planning.roles import tier_for
    from slidekit_tiers.ram import RamTier

    bundled = Plugins(entry_points=["ram", "posix", "gpu", "gds"])
    host, disk = tier_for(bundled, "host", "cpu"), tier_for(bundled, "disk", "cpu")
    assert host is not None and host.name == "ram"
    assert (
        disk is not None and disk.name == "posix"
    )  # gds, unavailable without the CUDA driver, is passed over
    assert tier_for(bundled, "device", "cpu") is None  # the gpu tier serves accelerators only

    class Fast:
        @hookimpl
        def slidekit_storage_tiers(self):
            yield TierDescriptor(
                name="fast_ram", factory=RamTier, priority=150, medium="host"
            )  # above ram (100)
            yield TierDescriptor(name="broken", factory=RamTier, priority=200, medium="host",
                                 available=lambda: (False, "not here"))  # fmt: skip

    ranked = Plugins(entry_points=["ram"], extra=[("fast", Fast())])
    found = tier_for(ranked, "host", "cpu")
    assert found is not None and found.name == "fast_ram"


def test_plan_prints_the_layout_unit_by_unit(tmp_path):
    """``slidekit plan`` shows the Layout it estimates: where each unit lives and its state's tier, runs of
    alike units grouped, and the run's window, ring and staging, as the engine will build them."""
    off = tmp_path / "off"
    off.mkdir()
    config = TrainConfig(
        engine=EngineConfig(
            device="cpu",
            gpu_resident="0.5",
            state_offload_tier="posix",
            state_offload_fraction=0.5,
            offload_dir=str(off),
            activation_tier="ram",
        ),
        optim=OptimConfig(max_grad_norm=1.0),
    )
    report = plan_run(config)
    layout = report.requested.layout
    assert layout is not None
    text = report.render()
    assert layout.describe() in text
    rows = [line for line in layout.describe().splitlines() if line.strip()[:1].isdigit()]
    # every unit appears in exactly one row, the rows in order
    covered = []
    for row in rows:
        span = row.split()[0]
        first, _, last = span.partition("-")
        covered += list(range(int(first), int(last or first) + 1))
    assert covered == list(range(len(layout.units)))
    spans = []
    for row in rows:
        first, _, last = row.split()[0].partition("-")
        spans.append((int(first), int(last or first), row))
    for u in layout.units:  # the row of each unit says what the layout says of it
        row = next(r for a, b, r in spans if a <= u.index <= b)
        assert ("resident" if u.resident else "slides") in row and f"{u.state_tier} ({u.state_medium}" in row
    assert {u.resident for u in layout.units} == {True, False}
    assert any(u.state_medium == "disk" and u.slides for u in layout.units)
    summary = text[text.index("  window:") :]
    assert f"{layout.window.window} cache units of {layout.window.slot_numel:,}" in summary
    assert "keeps its gradients until the step ends" in summary  # clipping: per-unit gradient buffers
    assert "state staging 3 x" in summary and "boundary activations on ram (host)" in summary


@pytest.mark.parametrize("state_per_param", [8, 2])
@pytest.mark.parametrize("gpu", [24, 80, 100, 139.29, 192])
def test_an_auto_residency_plan_passes_the_fit_check(state_per_param, gpu):
    """"auto" fills the device's spare memory, and the fit check adds its headroom (5% of the need and
    512 MiB): the plan must still fit. It did not on 80-200 GiB devices, whose reserve (5% of the total)
    was less than that headroom once the need came near the total (Qwen2.5-14B on the H200: 0.12 GiB)."""
    from slidekit.tools.presets import arch_spec

    for preset in ("qwen2.5-7b", "qwen2.5-14b"):
        p = planner(arch_spec(preset, 1024), batch=8, seq=1024, state_bytes=lambda n: state_per_param * n)
        machine = cuda_machine(gpu, ram=4096)
        est = p.estimate(Placement(gpu_resident="auto"), machine)
        assert est.placement_fits(machine), (preset, gpu, est.shortfalls(machine))
        if gpu >= 139:  # the budget is used, not merely respected: most of the units stay resident
            assert sum(est.resident) > len(est.resident) // 3, (preset, gpu, sum(est.resident))


def test_the_plan_counts_setups_host_copies_of_the_masters_on_the_gpu():
    """Setup fills the masters of resident units through FP32 host copies, two at a time
    (``slidekit.models.loading.LOAD_STAGING_UNITS``): host RAM the peak RSS shows (NOTES 25), so the
    plan counts it; nothing for a plan with no unit on the GPU, or on the CPU (masters fill in place)."""
    from planning_fixtures import cuda_machine, planner, tiny_spec

    from slidekit.models.loading import LOAD_STAGING_UNITS
    from slidekit.planning import Placement

    spec = tiny_spec("llama", num_hidden_layers=6)
    p = planner(spec)
    resident = p.estimate(Placement(gpu_resident="all"), cuda_machine())
    sizes = sorted((u.numel for u in spec.units), reverse=True)
    assert resident.host["load staging"] == 4 * sum(sizes[:LOAD_STAGING_UNITS])
    half = p.estimate(Placement(gpu_resident="0.5"), cuda_machine())
    on_gpu = sorted((u.numel for u, r in zip(spec.units, half.resident, strict=True) if r), reverse=True)
    assert half.host["load staging"] == 4 * sum(on_gpu[:LOAD_STAGING_UNITS])
    assert "load staging" not in p.estimate(Placement(gpu_resident="none"), cuda_machine()).host
    cpu = planner(spec, device_type="cpu")
    assert "load staging" not in cpu.estimate(Placement(gpu_resident="all"), cuda_machine()).host
    ranks = planner(spec, world=2, rank=0)
    assert ranks.estimate(Placement(gpu_resident="none"), cuda_machine()).host["load staging"] == 4 * sizes[0]
