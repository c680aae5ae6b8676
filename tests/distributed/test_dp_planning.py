"""Per-rank planning: a data-parallel rank's layout is its shards, on its share of the machine, and the
ranks decide alike (``slidekit.distributed.planning``, ``Planner(world=, rank=)``, ``Machine.share``).

The pure part plans by hand-built machines; the gloo part builds every rank's engine and checks that
what each rank allocates is exactly its layout, as tests/engine/test_build.py does for one process.
"""

from __future__ import annotations

import types

import pytest
from dp_plan_jobs import GIB, Build, agreed_machine, agreed_probed_machine, footprint_against_layout
from dp_ranks import run_ranks
from planning_fixtures import cuda_machine, planner, tiny_spec

from slidekit.cli import main
from slidekit.engine.build import build_engine
from slidekit.errors import ConfigError
from slidekit.planning import (
    GRANULE,
    RESIDENT_RESERVE,
    UPLOAD_CHUNK,
    Machine,
    Placement,
    Planner,
    unit_shards,
)


def _spec(family: str = "llama", **overrides: object):
    return tiny_spec(family, **overrides)


def _planner(spec, world: int = 1, rank: int = 0, **kw: object) -> Planner:
    """The shared planner (BF16, 8 B/param of state, CUDA), micro-batches of 2 x 16, as rank ``rank``."""
    return planner(spec, batch=2, seq=16, world=world, rank=rank, **kw)


def _gpu(gib: float, ram: float = 64.0) -> Machine:
    return cuda_machine(gib, ram)


# ---------------------------------------------------------------------- the layout of a rank


@pytest.mark.parametrize("world", [2, 3, 4])
def test_the_ranks_layouts_hold_the_shards_and_together_one_process(world):
    spec = _spec("llama", hidden_size=96, intermediate_size=200)
    one = _planner(spec).layout(Placement(gpu_resident="none"), _gpu(80))
    ranks = [_planner(spec, world, r).layout(Placement(gpu_resident="none"), _gpu(80)) for r in range(world)]
    numels = [u.numel for u in spec.units]
    for r, layout in enumerate(ranks):
        assert (layout.world, layout.rank) == (world, r)
        assert layout.shards == unit_shards(numels, world, r)
        for u in layout.units:
            assert u.state_bytes == 8 * u.own
            # the gradient pieces cover exactly the rank's shard
            assert sum(b - a for a, b in u.pieces) == u.own and u.pieces[0][0] == 0
        # cache units hold whole units, padded to world equal pieces
        assert layout.window.slot_numel == max(u.padded for u in layout.units)
        assert layout.ring_numel <= -(-max(u.own for u in layout.units) // GRANULE) * GRANULE
    host = [layout.allocations()["host"] for layout in ranks]
    single = one.allocations()["host"]
    for part in ("masters", "state"):
        assert sum(h[part] for h in host) == single[part]
        assert max(h[part] for h in host) < single[part]
    # the ring is sized for a layer's shard: smaller than one process's, never larger
    assert max(h["gradients"] for h in host) < single["gradients"]


def test_a_resident_unit_costs_its_whole_weights_and_its_shard_of_master_and_state():
    spec = _spec("llama")
    p = _planner(spec, world=2, rank=0)
    layout = p.layout(Placement(gpu_resident="all"), _gpu(80))
    expect = sum(u.padded * 2 * 2 + u.own * 4 + 8 * u.own for u in layout.units)
    assert layout.allocations()["device"]["resident"] == expect
    assert sum(p.resident_cost(u.index) for u in layout.units) == expect
    whole = _planner(spec).layout(Placement(gpu_resident="all"), _gpu(80)).allocations()["device"]["resident"]
    assert expect < whole  # 12 of 16 B/param are halved


def test_auto_residency_keeps_more_units_on_a_rank_than_one_process_could():
    spec = _spec("llama", num_hidden_layers=8, hidden_size=256, intermediate_size=512)
    one = _planner(spec)
    # a device with the fixed work, the reserve, and room for half the model at one process's 16 B/param
    nothing = one.layout(Placement(), _gpu(80), [False] * len(one.numels)).allocations()["device"]
    fixed = nothing["window"] + 4 * UPLOAD_CHUNK + sum(one.flow_bytes("device").values())
    machine = _gpu((fixed + RESIDENT_RESERVE + 8 * sum(one.numels)) / GIB)
    kept_one = sum(one.residency(Placement(), machine))
    kept_two = sum(_planner(spec, 2, 0).residency(Placement(), machine))
    assert 0 < kept_one < kept_two


def test_build_refuses_a_layout_planned_for_another_rank():
    layout = _planner(_spec(), world=2, rank=1).layout(Placement(gpu_resident="none"), _gpu(80))
    with pytest.raises(ConfigError, match="planned for data-parallel rank 1 of 2, but this process is rank 0 of 1"):
        build_engine(layout, types.SimpleNamespace(parallel=None))  # type: ignore[arg-type]


def test_a_describe_names_the_rank_and_its_shard():
    text = _planner(_spec(), world=2, rank=0).layout(Placement(gpu_resident="none"), _gpu(80)).describe()
    assert "data-parallel rank 0 of 2" in text and "1/2 shard" in text


# ---------------------------------------------------------------------- the machine a rank plans on


def test_a_share_divides_what_the_ranks_split_and_keeps_totals():
    m = Machine(
        device_type="cuda", device_free=80 * GIB, device_total=80 * GIB, host_available=100 * GIB,
        host_total=128 * GIB, disk_free=60 * GIB, run_dir_free=30 * GIB,
    )  # fmt: skip
    s = m.share(4, 2)
    assert (s.device_free, s.host_available, s.disk_free, s.run_dir_free) == (40 * GIB, 25 * GIB, 15 * GIB, 7.5 * GIB)
    assert (s.device_total, s.host_total, s.host_ranks, s.device_ranks) == (80 * GIB, 128 * GIB, 4, 2)
    assert m.share(1, 1) is m
    assert "split among 4 ranks" in s.describe() and "GPU's memory among 2" in s.describe()
    for bad in ((0, 1), (2, 3)):
        with pytest.raises(ValueError, match="at least one rank"):
            m.share(*bad)


def test_ranks_plan_on_the_least_any_of_them_measured_and_split_the_host():
    machines = [o.ok() for o in run_ranks(agreed_machine, 2)]
    for m in machines:
        assert m.host_available == 10 * GIB // 2  # rank 0 saw the least RAM; two ranks on this host
        assert m.disk_free == 99 * GIB // 2  # rank 1 saw the least disk
        assert m.run_dir_free is None and m.host_ranks == 2


def test_ranks_that_probed_their_gpu_plan_with_the_slowest_measurements():
    """A GPU no profile knows has its rates probed on every rank (``slidekit.planning.probe``); rates that
    differ would make the ranks decide differently, so they agree on the least each figure measured."""
    from slidekit.planning.probe import H200_PROBE

    machines = [o.ok() for o in run_ranks(agreed_probed_machine, 2)]
    for m in machines:
        assert m.probed.matmul_tflops == 700.0 and m.probed.host_gbps == 80.0  # rank 0's and rank 1's
        assert m.probed.device_gbps == H200_PROBE.device_gbps
        assert m.rates == machines[0].rates and m.rates.name == "Some GPU (probed)"


# ---------------------------------------------------------------------- every rank allocates its layout

BUILDS = {
    "2 ranks, half resident, clipping": (2, {"resident": "0.5", "clip": True}),
    "4 ranks, adamw_8bit, state half on disk, activations in RAM": (
        4,
        {"optimizer": "adamw_8bit", "engine": {"state_offload_fraction": 0.5, "activation_tier": "ram", "state_chunk": 4096}},
    ),
    "2 ranks, tied, all resident, accumulation": (2, {"resident": "all", "accum": 2, "family": "qwen2"}),
}


def _compare(out: dict) -> None:
    for medium in ("device", "host"):
        for name, nbytes in out["measured"][medium].items():
            want = out["host_state"] if (medium, name) == ("host", "state") else out["expected"][medium].get(name, 0)
            assert nbytes == want, f"rank {out['rank']}: {medium} {name}: engine {nbytes} B, layout {want} B"


@pytest.mark.parametrize("case", list(BUILDS), ids=list(BUILDS))
def test_every_rank_allocates_exactly_its_layout(case, tiny_model, tmp_path):
    world, settings = BUILDS[case]
    settings = dict(settings)
    family = settings.pop("family", "llama")
    engine = dict(settings.pop("engine", {}))
    if engine.get("state_offload_fraction"):
        engine.update(state_offload_tier="posix", offload_dir=str(tmp_path))
    job = Build(model_dir=str(tiny_model(family)), engine=engine, **settings)
    outs = [o.ok() for o in run_ranks(footprint_against_layout, world, job)]
    for r, out in enumerate(outs):
        assert (out["world"], out["rank"]) == (world, r)
        assert out["machine"].host_ranks == world  # every rank runs on this host
        _compare(out)
    # together the ranks hold each unit's parameters once
    assert [sum(o["own"][u] for o in outs) for u in range(len(outs[0]["numel"]))] == outs[0]["numel"]


def test_ranks_that_decide_differently_refuse_before_allocating(tiny_model):
    job = Build(model_dir=str(tiny_model("llama")), resident=["none", "0.5"])
    outcomes = run_ranks(footprint_against_layout, 2, job)
    for o in outcomes:
        assert o.error == "ConfigError", (o.error, o.message)
        assert "planned different layouts" in o.message


# ---------------------------------------------------------------------- slidekit plan


def test_plan_shows_rank_zeros_share(capsys):
    args = ["plan", "--preset", "qwen2.5-7b", "--gpu", "h200", "--batch-size", "8", "--seq-len", "1024"]
    main([*args, "--gpu-resident", "none"])
    one = capsys.readouterr().out
    main([*args, "--gpu-resident", "none", "--nproc-per-node", "2", "--ram-gib", "400"])
    two = capsys.readouterr().out
    assert "data-parallel: 2 ranks, 2 per host" in two and "rank 0 of 2" in two
    assert "one rank's share" in two and "200.00 GiB available" in two

    def masters(text: str) -> float:
        line = next(ln for ln in text.splitlines() if ln.strip().startswith("masters"))
        return float(line.split()[1])

    assert masters(two) == pytest.approx(masters(one) / 2, rel=0.01)
    assert main([*args, "--nproc-per-node", "0"]) != 0
    assert "--nproc-per-node must be at least 1, got 0" in capsys.readouterr().err
