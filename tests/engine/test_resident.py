"""Units kept on the compute device (``engine.gpu_resident``), on the CPU: the same code path as on the GPU.

A resident unit keeps its FP32 master and optimizer state on the compute
device and is updated there by ``Engine._update_resident``; only the units
that slide come down through the shared host gradient ring. On the CPU the
compute device is the host, but the engine takes exactly the path it takes
on a GPU, so CI covers it:

- the gradient ring and the gradient pieces are sized from the units that
  slide (a64cc2a sized them for every unit with the ring at one element when
  none slid, and building the pieces of a large embedding then never ended);
- "none", a fraction and "all" give the bits of the all-host run, with
  gradient accumulation and exact global-norm clipping on;
- building an all-resident run costs about what building an all-host one does.
"""

from __future__ import annotations

import time

import pytest
import torch

from slidekit import EngineConfig, ModelConfig, OptimConfig, TrainConfig, Trainer
from slidekit.engine.host import HostStore
from slidekit.engine.runtime import Pipeline
from slidekit.interfaces import TierContext
from slidekit.models.base import UnitKind
from slidekit.planning import GRANULE, Placement
from slidekit.plugins import Plugins
from slidekit.testing.asserts import assert_states_equal
from slidekit.testing.models import random_batches

LR, WD = 1e-4, 0.1


def _config(model: ModelConfig, resident: str, **optim: object) -> TrainConfig:
    return TrainConfig(
        model=model,
        optim=OptimConfig(lr=LR, weight_decay=WD, **optim),  # type: ignore[arg-type]
        engine=EngineConfig(device="cpu", compute_dtype="float32", gpu_resident=resident),
        grad_accum=2,
        steps=4,
    )


def _host_store(trainer: Trainer, on_device: list[bool]) -> HostStore:
    """A HostStore for ``trainer``'s model, laid out with the given units kept on the compute device."""
    assert trainer.planner is not None
    layout = trainer.planner.layout(Placement.of(trainer.config.engine), trainer.machine(), on_device)
    tier = trainer.selections["state_tier"].descriptor.factory(TierContext(device=torch.device("cpu")))
    return HostStore(
        layout,
        trainer.spec.units,
        optimizer=trainer.engine.optimizer,
        state_tiers=[tier] * len(trainer.spec.units),
        pin=False,
        grad_dtype=torch.float32,
        pipeline=Pipeline(30.0),
        device=torch.device("cpu"),
    )


def test_only_units_that_slide_size_the_gradient_ring(tiny_model):
    """Fails on a64cc2a: with every unit kept on the device the ring held one element, and every unit was cut
    into one-element pieces (hundreds of millions of tuples for a real embedding)."""
    model = ModelConfig(source=str(tiny_model("llama", vocab_size=5000)))
    with Trainer(_config(model, "none")) as trainer:
        units = trainer.spec.units
        layer = max(u.numel for u in units if u.kind == UnitKind.LAYER)

        every = _host_store(trainer, [True] * len(units))
        try:
            assert every.piece == 0 and every.ring.buffers == []
            assert all(every.pieces(u) == [] for u in range(len(units)))
            assert all(m.device.type == "cpu" for m in every.masters)
        finally:
            every.close()

        # The embedding and head (320,000 parameters each) slide, the layers stay: pieces of a layer's size.
        ends = [u.kind != UnitKind.LAYER for u in units]
        some = _host_store(trainer, [not e for e in ends])
        try:
            assert some.piece == max(
                u.numel for u, e in zip(units, ends, strict=True) if e
            )  # no layer slides
            for u, slides in enumerate(ends):
                pieces = some.pieces(u)
                if not slides:
                    assert pieces == []
                    continue
                assert pieces[0][0] == 0 and pieces[-1][1] == units[u].numel
                assert len(pieces) == -(-units[u].numel // some.piece)
        finally:
            some.close()

        # All slide (the run itself): layer-sized pieces, a handful per embedding.
        host = trainer.engine.host
        assert host.piece == -(-layer // GRANULE) * GRANULE
        assert len(host.pieces(0)) == -(-units[0].numel // host.piece) < 100


@pytest.mark.parametrize("resident", ["none", "0.5", "all"])
@pytest.mark.parametrize("family", ["qwen2", "llama"])  # tied and untied embeddings
def test_resident_units_give_the_bits_of_the_all_host_run_with_clipping_and_accumulation(
    family, resident, tiny_model
):
    model = ModelConfig(source=str(tiny_model(family)))
    batches = random_batches(128, steps=8)  # 4 steps of 2 micro-batches

    def run(placement: str) -> tuple[list[float], dict[str, torch.Tensor], int, int]:
        with Trainer(_config(model, placement, max_grad_norm=0.05)) as t:
            kept, units = len(t.engine.window.resident), len(t.spec.units)
            return t.fit(batches).losses, t.state_dict(), kept, units

    base_losses, base_state, _, _ = run("none")
    losses, state, kept, units = run(resident)
    assert kept == {"none": 0, "0.5": round(0.5 * units), "all": units}[resident]
    assert losses == base_losses
    assert_states_equal(state, base_state)


def test_resident_units_are_updated_on_the_compute_device_and_clipping_bites(tiny_model):
    """The resident path really runs: masters live outside the host buffers, updates are timed on the
    device lane, and the clip factor (< 1 here) is applied, so the comparison above is not vacuous."""
    model = ModelConfig(source=str(tiny_model("llama")))
    batches = random_batches(128, steps=4)
    with Trainer(_config(model, "all", max_grad_norm=0.05)) as t:
        host = t.engine.host
        assert not any(u.slides for u in t.engine.layout.units) and host.ring.buffers == []
        result = t.fit(batches)
        assert all(n > 0.05 for n in result.grad_norms)  # every step clips
        lanes = result.timings[-1]
        assert lanes.get("update_gpu", 0.0) > 0.0 and lanes.get("update", 0.0) == 0.0
        assert lanes.get("d2h", 0.0) == 0.0  # nothing comes down


def _setup_seconds(model: ModelConfig, resident: str, plugins: Plugins) -> float:
    """CPU seconds this process spends building (and closing) the run: unlike wall time, not stretched by
    other processes on a loaded machine, nor by a kernel build, which runs in a compiler child process."""
    t0 = time.process_time()
    with Trainer(_config(model, resident), plugins=plugins):
        pass
    return time.process_time() - t0


def test_building_an_all_resident_run_costs_about_what_an_all_host_one_does():
    """A model with a large embedding (8M parameters): on a64cc2a building it all-resident cut every unit into
    one-element pieces and took minutes; now it costs about what building it with every unit on the host does.
    CPU time, best of three builds each, interleaved. The bound is 4x, not 1x: inside the whole suite on CI's
    machine the resident build measured 2.03x (0.526 against 0.258 s; why there and not alone is not established:
    alone here the two are equal), and the regression this guards against was more than 100x."""
    model = ModelConfig(
        source="demo",
        random_init=True,
        overrides={
            "vocab_size": 64_000,
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
        },
    )
    plugins = Plugins()
    host, resident = [], []
    for _ in range(3):
        host.append(_setup_seconds(model, "none", plugins))
        resident.append(_setup_seconds(model, "all", plugins))
    print(f"setup CPU seconds: all-host {host}, all-resident {resident}")
    assert min(resident) <= 4 * min(host), (resident, host)
