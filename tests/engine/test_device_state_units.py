"""Units whose master and state live on the device while their weights slide (``engine.resident_weights``).

- "slide" (and "auto" on a Machine built by hand so that some units keep their weights and others
  slide them) gives the bits of "keep": losses, gradient norms, every master and every optimizer
  state buffer, for layer_adam and adamw_8bit, BF16 and FP32 compute, gradient accumulation, tied
  and untied embeddings, a window of two, clipping deferred and speculative (host units beside them);
- it matches transformers + torch.optim.AdamW (+ clip_grad_norm_) at a tolerance;
- the planner counts exactly the bytes the placement needs: how many units fit in a given device
  budget at each setting, "auto" keeping the weights of the cheapest upgrades the room left holds;
- a unit whose weights slide never keeps its activations; a data-parallel run refuses "slide";
- a checkpoint of such a run resumes bitwise, and so does one written by a "keep" run.

The engine's footprint against ``Layout.allocations`` is ``tests/engine/test_build.py``'s.
Run: ``pytest tests/engine/test_device_state_units.py``.
"""

from __future__ import annotations

import dataclasses

import pytest

from slidekit import EngineConfig, ModelConfig, OptimConfig, RunConfig, TrainConfig, Trainer
from slidekit.errors import ConfigError
from slidekit.planning import GIB, Machine, Placement, Planner, Workload
from slidekit.planning.keeping import check_keeps
from slidekit.planning.placement import spread_host_units
from slidekit.plugins import Plugins
from slidekit.testing.asserts import (
    assert_losses_close,
    assert_states_close,
    assert_states_equal,
    trained_state,
)
from slidekit.testing.models import random_batches, tiny_config
from slidekit.testing.reference import reference_run

LR, WD = 1e-3, 0.1


def _config(model_dir, weights: str, *, optimizer="layer_adam", dtype="bfloat16", clip=None, policy="auto",
            resident="all", steps=3, run=None, **engine) -> TrainConfig:  # fmt: skip
    return TrainConfig(
        model=ModelConfig(source=str(model_dir)),
        optim=OptimConfig(name=optimizer, lr=LR, weight_decay=WD, max_grad_norm=clip, clip_overlap=policy),
        engine=EngineConfig(
            device="cpu", compute_dtype=dtype, gpu_resident=resident, resident_weights=weights, window=2, **engine
        ),
        run=run or RunConfig(),
        grad_accum=2,
        steps=steps,
    )


_state = trained_state  # masters and optimizer state, compared bit for bit


def _run(model_dir, weights: str, batches, machine: Machine | None = None, **kw):
    with Trainer(_config(model_dir, weights, **kw), machine=machine) as t:
        lean = [u.index for u in t.engine.layout.units if u.weights_slide]
        result = t.fit(batches)
        return lean, result, _state(t)


def _same(a, b) -> None:
    (_, ra, sa), (_, rb, sb) = a, b
    assert ra.losses == rb.losses
    assert ra.grad_norms == rb.grad_norms
    assert_states_equal(sa, sb)


# ---------------------------------------------------------------------------- bitwise "keep"

CASES = [  # family (qwen2: tied embeddings), clip, clip_overlap, gpu_resident, compute dtype
    ("qwen2", None, "auto", "all", "bfloat16"),
    ("llama", None, "auto", "all", "float32"),
    ("llama", 0.05, "defer", "all", "bfloat16"),
    ("qwen2", 0.05, "speculate", "0.5", "bfloat16"),  # host units speculate beside the device ones
    ("llama", 0.05, "speculate", "0.5", "float32"),
]


@pytest.mark.parametrize("optimizer", ["layer_adam", "adamw_8bit"])
@pytest.mark.parametrize(("family", "clip", "policy", "resident", "dtype"), CASES)
def test_sliding_weights_give_the_bits_of_kept_weights(tiny_model, optimizer, family, clip, policy, resident,
                                                       dtype):  # fmt: skip
    model_dir = tiny_model(family)
    batches = random_batches(128, steps=6, seed=3)
    kw = dict(optimizer=optimizer, clip=clip, policy=policy, resident=resident, dtype=dtype)
    keep = _run(model_dir, "keep", batches, **kw)
    slide = _run(model_dir, "slide", batches, **kw)
    assert keep[0] == []
    with Trainer(_config(model_dir, "keep", resident=resident)) as t:
        on_device = [u.index for u in t.engine.layout.units if u.resident]
    assert slide[0] == on_device and on_device  # every unit on the device slides its weights
    if clip is not None:  # the clip bites, so the scaled device updates are compared
        assert all(n > clip for n in slide[1].grad_norms)
    if policy == "speculate":
        assert slide[1].speculated > 0
    _same(slide, keep)


def test_the_sliding_path_really_runs(tiny_model):
    """No unit holds weights of its own on the device; each visit casts into a window cache unit; updates
    run on the device lane and nothing comes down to the host."""
    model_dir = tiny_model("llama")
    with Trainer(_config(model_dir, "slide")) as t:
        assert t.engine.window.resident == {} and t.engine.host.ring.buffers == []
        assert t.engine.device_grads == {}  # no step defers: updates read the cache unit
        result = t.fit(random_batches(128, steps=4))
    lanes = result.timings[-1]
    assert lanes.get("cast", 0.0) > 0.0 and lanes.get("update_gpu", 0.0) > 0.0
    assert lanes.get("h2d", 0.0) == 0.0 and lanes.get("d2h", 0.0) == 0.0 and lanes.get("update", 0.0) == 0.0


def test_forward_only_passes_between_steps_match_kept_weights(tiny_model):
    """Logits and the fused loss of forward-only passes (they cast too), and the steps after them."""
    model_dir = tiny_model("qwen2")
    batches = random_batches(128, steps=8, seed=4)

    def run(weights: str):
        with Trainer(_config(model_dir, weights, steps=4)) as t:
            first = t.fit(batches[:4])
            logits = t.engine.forward(batches[0].input_ids)
            loss = t.engine.forward(batches[1].input_ids, batches[1].labels)
            second = t.fit(batches[4:])
            return first.losses + second.losses, logits, loss, _state(t)

    keep, slide = run("keep"), run("slide")
    assert slide[0] == keep[0]
    assert slide[1].equal(keep[1]) and slide[2].equal(keep[2])
    assert_states_equal(slide[3], keep[3])


# ---------------------------------------------------------------------------- "auto" on a hand-built Machine


def _cpu(device_free: int) -> Machine:
    """This CPU, with ``device_free`` standing for a GPU's free memory."""
    return Machine(device_type="cpu", device_free=device_free, device_total=device_free, host_available=64 * GIB,
                   host_total=64 * GIB)  # fmt: skip


def _free_for_upgrades(planner: Planner, placement: Placement, upgrades: int) -> int:
    """Device memory that lets "auto" keep the weights of exactly ``upgrades`` units of an all-resident run
    (half the next upgrade to spare): every unit at the sliding cost, plus the cheapest upgrades."""
    units = range(len(planner.numels))
    base = 8 * GIB
    fixed = base - planner.device_budget(placement, _cpu(base))  # window, staging, a step's work, reserve
    slide = [planner.resident_cost(u, slide=True) for u in units]
    extra = sorted(planner.resident_cost(u) - slide[u] for u in units)
    return fixed + sum(slide) + sum(extra[:upgrades]) + extra[upgrades] // 2


@pytest.mark.parametrize("optimizer", ["layer_adam", "adamw_8bit"])
def test_auto_mixes_and_gives_the_bits_of_keep(tiny_model, optimizer):
    model_dir = tiny_model("qwen2")
    batches = random_batches(128, steps=6, seed=5)
    with Trainer(_config(model_dir, "auto", optimizer=optimizer, clip=0.05)) as t:
        planner = t.planner
        assert planner is not None
        free = _free_for_upgrades(planner, Placement.of(t.config.engine), 2)
    machine = _cpu(free)
    auto = _run(model_dir, "auto", batches, machine, optimizer=optimizer, clip=0.05)
    assert len(auto[0]) == len(planner.numels) - 2  # two units keep their weights, the rest slide
    _same(auto, _run(model_dir, "keep", batches, optimizer=optimizer, clip=0.05))


# ---------------------------------------------------------------------------- the reference loop


def test_matches_the_reference_loop(tiny_model):
    """transformers + torch.optim.AdamW + clip_grad_norm_, FP32, at a tolerance."""
    model_dir = tiny_model("qwen2")
    batches = random_batches(128, steps=8, seed=7)  # 4 steps of 2 micro-batches
    cfg = _config(model_dir, "slide", dtype="float32", clip=0.05, steps=4)
    with Trainer(cfg) as t:
        init = t.state_dict()
        res = t.fit(batches)
        state = t.state_dict()
        hf = t.hf_config
    micro = [batches[i : i + 2] for i in range(0, len(batches), 2)]
    ref = reference_run(hf, init, micro, lr=LR, weight_decay=WD, max_grad_norm=0.05)
    assert_losses_close(res.losses, ref.losses, rtol=1e-5)
    assert_states_close(state, ref.state, rtol=1e-5)


# ---------------------------------------------------------------------------- the planner's counts

STATE = 8  # layer_adam: two FP32 moments


def _planner(*, clip: bool = False, world: int = 1, recompute: str = "auto") -> Planner:
    hf = tiny_config("llama", num_hidden_layers=6)
    spec = Plugins().adapter_for(hf.model_type).descriptor.factory(hf)
    return Planner(
        spec,
        Workload(batch_size=4, seq_len=32, grad_accum=2),
        compute_itemsize=2,
        state_bytes=lambda n: STATE * n,
        media={"ram": "host", "gpu": "device"},
        device_type="cuda",
        keep_grads=clip,
        world=world,
        recompute=recompute,
    )


def _gpu(free: int) -> Machine:
    return Machine(device_type="cuda", device_free=free, device_total=free, host_available=64 * GIB,
                   host_total=64 * GIB)  # fmt: skip


def _bytes_per_param(weights: bool, deferred: bool) -> int:
    """The table of slidekit.planning.weights, in BF16 with layer_adam."""
    return 4 + STATE + (4 if weights else 2 if deferred else 0)


@pytest.mark.parametrize("clip", [False, True])
def test_the_planner_counts_the_bytes_of_each_placement(clip):
    """For a budget that holds some units at either cost: each setting puts on the device the most units
    (spread over the backward order) whose bytes, per the placement's table, fit; "slide" holds more."""
    p = _planner(clip=clip)
    n = len(p.numels)
    layer = p.numels[1]
    fixed = 8 * GIB - p.device_budget(Placement(), _gpu(8 * GIB))
    budget = int((5.5 if clip else 4.5) * layer * _bytes_per_param(True, False))  # some units, either way
    machine = _gpu(fixed + budget)
    counts = {}
    for weights in ("keep", "slide"):
        layout = p.layout(Placement(resident_weights=weights), machine)
        on = [u for u in layout.units if u.resident]
        per = _bytes_per_param(weights == "keep", clip)
        assert all(u.weights_slide == (weights == "slide") for u in on)
        alloc = layout.allocations()["device"]
        spent = sum(u.numel for u in on) * per
        assert alloc["resident"] + alloc.get("gradients", 0) == spent <= budget
        assert ("gradients" in alloc) == (clip and weights == "slide")
        host = n - len(on)
        assert host > 0
        one_more = spread_host_units(n, host - 1)  # the next unit resident would not fit
        assert sum(m for m, h in zip(p.numels, one_more, strict=True) if not h) * per > budget
        counts[weights] = len(on)
    assert counts["slide"] > counts["keep"]


def test_auto_keeps_the_weights_the_room_left_holds():
    """Every unit fits at the sliding cost; the room left keeps the weights (and gradients: 4 B/param in
    BF16) of as many units as it holds, the cheapest first."""
    p = _planner()
    n = len(p.numels)
    fixed = 8 * GIB - p.device_budget(Placement(), _gpu(8 * GIB))
    slide = sum(p.numels) * _bytes_per_param(False, False)
    order = sorted(range(n), key=lambda u: (p.numels[u], -u))
    extra = [4 * p.numels[u] for u in order]
    for upgrades in (0, 1, 3, n - 1):
        for room in (sum(extra[:upgrades]), sum(extra[: upgrades + 1]) - 1):
            layout = p.placed(Placement(gpu_resident="auto", resident_weights="auto"), _gpu(fixed + slide + room))
            assert all(u.resident for u in layout.units)  # all fit at the sliding cost
            kept = [u.index for u in layout.units if not u.weights_slide]
            assert sorted(kept) == sorted(order[:upgrades]), (room, kept)
    layout = p.placed(Placement(gpu_resident="all", resident_weights="auto"), _gpu(fixed + 10**12))
    assert not any(u.weights_slide for u in layout.units)  # room for every unit's weights: all keep
    assert len(layout.units) == n
    # Described as such by ``slidekit plan``.
    some = p.placed(Placement(gpu_resident="auto", resident_weights="auto"), _gpu(fixed + slide + extra[0]))
    assert f"{n - 1} units on the GPU with sliding weights" in some.describe()


def test_the_step_time_model_prices_the_casts():
    from slidekit.planning.profiles import profile

    p = _planner(recompute="all")  # the same backward either way: only the casts differ
    rates = profile("h200").rates
    machine = dataclasses.replace(_gpu(80 * GIB), rates=rates)
    keep = p.layout(Placement(gpu_resident="all"), machine)
    slide = p.layout(Placement(gpu_resident="all", resident_weights="slide"), machine)
    a, b = p.predict(keep, machine), p.predict(slide, machine)
    assert a is not None and b is not None
    # Each visit with weights casts them on the upload lane (as ``Uploads._cast`` does), except a layer's
    # backward that finds its forward's cache unit still holding them: between one cast per unit and two
    # per layer. The compute is the same; neither uploads anything.
    per_param = 6 / (rates.device_gbps * 1e9)
    every_visit = (2 * sum(p.numels[1:-1]) + p.numels[0] + p.numels[-1]) * per_param
    assert "cast" not in a.work and sum(p.numels) * per_param * (1 - 1e-9) <= b.work["cast"] <= every_visit * (1 + 1e-9)
    assert b.work["cast"] < every_visit  # the last layer's backward finds its cache unit
    assert b.compute_s == pytest.approx(a.compute_s, rel=1e-9)
    assert b.work.get("upload", 0.0) == a.work.get("upload", 0.0) == 0.0


# ---------------------------------------------------------------------------- refusals


def test_a_unit_whose_weights_slide_keeps_its_activations_like_any_layer():
    """Its cache unit is reused before its backward, so its graph reads the weights through references
    (``KeptGraphs``; bitwise the recompute path in tests/engine/test_keep_activations.py)."""
    p = _planner()
    layout = p.layout(Placement(gpu_resident="all", resident_weights="slide"), _gpu(80 * GIB))
    assert all(u.weights_slide for u in layout.units)
    assert [u.index for u in layout.units if u.keeps] == [u.index for u in layout.units if u.kind == "layer"]
    check_keeps(layout.units)  # allowed
    head = tuple(dataclasses.replace(u, keeps=u.kind == "head") for u in layout.units)
    with pytest.raises(ConfigError, match=r"are to keep their activations, but only decoder layers"):
        check_keeps(head)


def test_a_data_parallel_rank_counts_its_shards():
    """A rank keeps its shard's master and state and, always (its reduced gradient waits for the step's
    end), its shard's gradient buffer: (4 + S + 2) / world B/param; the window holds whole units.
    (tests/distributed/test_dp_training.py and test_dp_checkpoints.py train and resume such runs.)"""
    p = _planner(world=2)
    layout = p.layout(Placement(gpu_resident="all", resident_weights="slide"), _gpu(80 * GIB))
    assert all(u.weights_slide for u in layout.units) and layout.device_grads
    alloc = layout.allocations()["device"]
    assert alloc["resident"] == sum(u.own * (4 + STATE) for u in layout.units)
    assert alloc["gradients"] == sum(u.own * 2 for u in layout.units)
    assert sum(u.own for u in layout.units) < sum(p.numels)  # shards, not whole units
    assert layout.window.slot_numel >= max(u.padded for u in layout.units)


def test_a_bad_setting_is_refused_by_name():
    with pytest.raises(ConfigError, match=r"engine.resident_weights \(CLI: --resident-weights\) must be one of"):
        EngineConfig(resident_weights="sometimes")


# ---------------------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("first", ["slide", "keep"])
def test_a_checkpoint_resumes_bitwise(tiny_model, tmp_path, first):
    """Masters and state on the device are checkpointed and restored; a "keep" run's checkpoint resumes
    with sliding weights to the same bits."""
    model_dir = tiny_model("qwen2")
    batches = random_batches(128, steps=8, seed=11)

    def cfg(d: str, weights: str, resume: bool = False) -> TrainConfig:
        run = RunConfig(dir=str(tmp_path / d), checkpoint_every=1, resume=resume)
        return _config(model_dir, weights, optimizer="adamw_8bit", clip=0.05, steps=4, run=run)

    with Trainer(cfg("whole", "slide")) as t:
        whole = t.fit(batches)
        want = _state(t)
    with Trainer(cfg("cut", first)) as t:
        head = t.fit(batches[:4], steps=2)
    with Trainer(cfg("cut", "slide", resume=True)) as t:
        assert t.engine.steps_done == 2
        assert all(u.weights_slide for u in t.engine.layout.units)
        rest = t.fit(batches[4:])
        got = _state(t)
    assert head.losses + rest.losses == whole.losses
    assert_states_equal(got, want)
